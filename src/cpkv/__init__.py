"""cpkv: one shared, owner-lane paged KV cache for a context-parallel group.

The package is layered, arrows pointing one way: the contract
(:mod:`cpkv.contract`: layout, plans, allocator, errors), its consumers
(:mod:`cpkv.consumers`: KV pool, prefix cache, transfer), the models
(:mod:`cpkv.models`), the runtime (:mod:`cpkv.runtime`) and the tools
(:mod:`cpkv.tools`: the ``cpkv`` command, benchmarks, simulator).

Public entry points (RFC-0001's workstream label in brackets):

* :class:`SharedKVLayout` - index arithmetic of the shared cache (layout)
* :mod:`cpkv.contract.plan` - request-local owner plans and per-rank token splits [W1]
* :class:`OwnerLaneAllocator` - owner-lane allocation [W2]
* :class:`SharedKVPool` - direct write, fence and read of the shared cache [W3, W4]
* :class:`PrefixCache` - radix prefix cache with lane-aware eviction [W5]
* :func:`plan_transfer` - prefill -> decode KV transfer between CP groups of any sizes and page sizes [W7];
  :mod:`cpkv.disagg` adds the two-group driver
* :func:`cpkv.runtime.launch` - an N-process CP group
"""

from .consumers.disagg import TransferPlan, plan_transfer
from .consumers.kv_pool import SharedKVPool
from .consumers.prefix_cache import PrefixCache, PrefixCacheMisuse, PrefixHit, PrefixMatch
from .contract.allocator import Allocation, ExtendAllocation, OwnerLaneAllocator
from .contract.errors import ContractViolation, UnsupportedPagePlan
from .contract.layout import SharedKVLayout
from .contract.plan import RankSplit, split_interleave, split_page

__all__ = [
    "ContractViolation",
    "Allocation",
    "ExtendAllocation",
    "OwnerLaneAllocator",
    "PrefixCache",
    "PrefixCacheMisuse",
    "PrefixHit",
    "PrefixMatch",
    "RankSplit",
    "SharedKVLayout",
    "SharedKVPool",
    "TransferPlan",
    "UnsupportedPagePlan",
    "split_interleave",
    "split_page",
    "plan_transfer",
]
__version__ = "0.1.0"
