"""A misuse state machine: random valid calls interleaved with random invalid
ones. After an invalid call: the right error type and rule, and every
component's snapshot exactly as before. After a valid call: every invariant.

The machine drives *components*; :class:`AllocatorComponent` is the first.
Another part of the system (a prefix cache over the same allocator) joins by
subclassing :class:`Component` and overriding :meth:`MisuseMachine.components_for`.
[[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FLATTENED-ORDER]]
"""

from hypothesis import settings

from support.misuse import MisuseMachine

MisuseMachine.TestCase.settings = settings(settings(), max_examples=80, stateful_step_count=50)
TestMisuseMachine = MisuseMachine.TestCase
