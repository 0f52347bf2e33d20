"""The contract every consumer relies on: layout arithmetic, owner plans,
owner-lane allocation and the errors that refuse a plan.

Importing any part of it imports :mod:`~cpkv.contract.sglang` too: that module
puts the calls that moved to :class:`~cpkv.contract.sglang.SGLangAllocator` in
0.2 back on :class:`~cpkv.contract.allocator.OwnerLaneAllocator` for one
release, with a ``DeprecationWarning``, so they exist wherever the allocator
does (until 0.3 removes them)."""

from . import sglang as _sglang  # noqa: F401 - the deprecated calls on the allocator (one release)
