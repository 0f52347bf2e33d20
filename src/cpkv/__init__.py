"""cpkv: one shared, owner-lane paged KV cache for a context-parallel group.

Public entry points, one per workstream:

* :class:`SharedKVLayout` - index arithmetic of the shared cache (layout)
* :mod:`cpkv.plan` - request-local owner plans and per-rank token splits (W1)
* :class:`OwnerLaneAllocator` - owner-lane allocation (W2)
* :class:`SharedKVPool` - direct write, fence and read of the shared cache (W3, W4)
* :class:`PrefixCache` - radix prefix cache with lane-aware eviction (W5)
* :func:`transfer_pairs` - prefill -> decode transfer between CP groups (W7)
* :func:`cpkv.runtime.launch` - an N-process CP group end to end
"""

from .allocator import ExtendAllocation, OwnerLaneAllocator
from .disagg import TransferPairs, transfer_pairs
from .errors import ContractViolation, UnsupportedPagePlan
from .kv_pool import SharedKVPool
from .layout import SharedKVLayout
from .plan import RankSplit, split_interleave, split_page
from .prefix_cache import PrefixCache, PrefixMatch

__all__ = [
    "ContractViolation",
    "ExtendAllocation",
    "OwnerLaneAllocator",
    "PrefixCache",
    "PrefixMatch",
    "RankSplit",
    "SharedKVLayout",
    "SharedKVPool",
    "TransferPairs",
    "UnsupportedPagePlan",
    "split_interleave",
    "split_page",
    "transfer_pairs",
]
__version__ = "0.1.0"
