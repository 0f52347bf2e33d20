"""Errors raised by cpkv.

All are loud on purpose: cpkv never falls back to an owner-oblivious path
([[RFC-0001:C-FAIL-FAST]]) and never drops a write it cannot honour
([[RFC-0001:C-DIRECT-WRITE]]). A refusal changes nothing.
"""

from __future__ import annotations


class UnsupportedPagePlan(ValueError):
    """A batch the owner-lane path cannot honour.

    Raised before any state changes. ``request`` is the index of the offending
    request in the batch (``None`` for a batch-level rule) and ``rule`` a short
    stable name of the broken rule, so a scheduler can branch on it.
    """

    def __init__(self, rule: str, message: str, request: int | None = None):
        self.rule = rule
        self.request = request
        where = "batch" if request is None else f"request {request}"
        super().__init__(f"[{rule}] {where}: {message}")


class InvalidFree(ValueError):
    """A free the allocator refuses: a slot or page outside the usable pages
    (``rule == "free-out-of-range"``), a page that is not allocated
    (``"double-free"``; a page freed earlier in an open free group is still
    allocated, and the group frees it once), or a segment that does not sit
    on its pages (``"unaligned-segment"``, ``"overlapping-segments"``).
    Nothing is freed."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"[{rule}] free: {message}")


class ContractViolation(RuntimeError):
    """A consumer was asked to do something the downstream contract forbids,
    such as writing a slot its rank does not own."""
