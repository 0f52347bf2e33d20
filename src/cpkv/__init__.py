"""cpkv: one shared, owner-lane paged KV cache for a context-parallel group.

The package is layered, arrows pointing one way: the contract
(:mod:`cpkv.contract`: layout, plans, allocator, errors), its consumers
(:mod:`cpkv.consumers`: KV pool, prefix cache, host tier, transfer), the data
plane (:mod:`cpkv.kernels`: the backend interface, the torch reference and the
Triton kernels), the models (:mod:`cpkv.models`), the runtime (:mod:`cpkv.runtime`), the engine
(:mod:`cpkv.engine`) and the tools (:mod:`cpkv.tools`: the ``cpkv`` command,
benchmarks, simulator).

Public entry points:

* :class:`SharedKVLayout` - index arithmetic of the shared cache
* :mod:`cpkv.contract.plan` - request-local owner plans (the lane-base rule)
* :class:`OwnerLaneAllocator` - owner-lane allocation; :class:`SGLangAllocator` - SGLang's allocator calls over it
* :class:`SharedKVPool` - direct write, fence and read of the shared cache
* :class:`PrefixCache` - radix prefix cache with lane-aware eviction
* :func:`plan_transfer` - prefill -> decode KV transfer between CP groups of any sizes and page sizes;
  :mod:`cpkv.engine.disagg` runs the two groups (:func:`run_disagg`, :class:`DisaggConfig`)
* :func:`run_engine` - a serving trace on a CP group (:class:`EngineConfig`)
* :func:`cpkv.runtime.launch` - an N-process CP group

Every public error class is importable from here: the contract's refusals
(:class:`UnsupportedPagePlan`, :class:`InvalidFree`, :class:`ContractViolation`),
the prefix cache's (:class:`PrefixCacheMisuse`), a trace file's
(:class:`TraceError`), a group this machine cannot hold
(:class:`GroupTooLarge`), a failed rank (:class:`RankFailure`) and a failed
disaggregated run (:class:`DisaggFailure`, :class:`TransferAborted`).

On a machine without CUDA, importing cpkv sets ``TRITON_INTERPRET=1`` (unless
set) before anything else can import triton (``transformers`` does), so the
Triton kernels of :mod:`cpkv.kernels` run in Triton's interpreter.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():  # before transformers or anything else imports triton
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .consumers.kv_pool import SharedKVPool
from .consumers.prefix_cache import PrefixCache, PrefixCacheMisuse, PrefixHit, PrefixMatch
from .consumers.transfer import TransferPlan, plan_transfer
from .contract.allocation import Allocation
from .contract.allocator import OwnerLaneAllocator
from .contract import deprecated as _deprecated
from .contract.errors import ContractViolation, InvalidFree, UnsupportedPagePlan
from .contract.layout import SharedKVLayout
from .contract.sglang import SGLangAllocator
from .engine.config import DisaggConfig, EngineConfig, RunConfig
from .engine.disagg import DisaggFailure, TransferAborted, format_disagg, run_disagg
from .engine.engine import run_engine
from .engine.trace import TraceError
from .runtime.group import RankFailure
from .runtime.sizing import GroupTooLarge

__all__ = [
    "ContractViolation",
    "Allocation",
    "DisaggConfig",
    "DisaggFailure",
    "EngineConfig",
    "GroupTooLarge",
    "InvalidFree",
    "OwnerLaneAllocator",
    "PrefixCache",
    "PrefixCacheMisuse",
    "PrefixHit",
    "PrefixMatch",
    "RankFailure",
    "RunConfig",
    "SGLangAllocator",
    "SharedKVLayout",
    "SharedKVPool",
    "TraceError",
    "TransferAborted",
    "TransferPlan",
    "UnsupportedPagePlan",
    "format_disagg",
    "plan_transfer",
    "run_disagg",
    "run_engine",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Names that went in 0.2, one release with a ``DeprecationWarning`` (:mod:`cpkv.contract.deprecated`)."""
    if name == "ExtendAllocation":
        _deprecated.warn_deprecated("cpkv.ExtendAllocation", "cpkv.Allocation")
        return Allocation
    if name in _deprecated.PUBLIC:
        obj, instead = _deprecated.PUBLIC[name]
        _deprecated.warn_deprecated(f"cpkv.{name}", instead)
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
