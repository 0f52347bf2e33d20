"""cpkv: one shared, owner-lane paged KV cache for a context-parallel group.

Public entry points, one per workstream:

* :class:`SharedKVLayout` - index arithmetic of the shared cache (layout)
* :mod:`cpkv.plan` - request-local owner plans and per-rank token splits (W1)
* :class:`OwnerLaneAllocator` - owner-lane allocation (W2)
"""

from .allocator import ExtendAllocation, OwnerLaneAllocator
from .errors import ContractViolation, UnsupportedPagePlan
from .layout import SharedKVLayout
from .plan import RankSplit, split_interleave, split_page

__all__ = [
    "ContractViolation",
    "ExtendAllocation",
    "OwnerLaneAllocator",
    "RankSplit",
    "SharedKVLayout",
    "UnsupportedPagePlan",
    "split_interleave",
    "split_page",
]
__version__ = "0.1.0"
