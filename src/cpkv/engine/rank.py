"""One rank's parts, built the same way by the engine and by the disaggregation driver.

* :func:`build_cache` - the prefix cache over a fresh owner-lane allocator of one group;
* :func:`build_rank` - a rank's shared KV pool, host pool and runner (the
  runtime's :func:`~cpkv.runtime.parts.build_parts`, and the host tier);
* :func:`thread_buffers` - the ``shared(tag, shape, dtype)`` of ranks that are threads
  of one process (tests): one zeroed tensor per tag, made once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..consumers.hicache import HostPool
from ..consumers.kv_pool import SharedKVPool
from ..consumers.prefix_cache import PrefixCache
from ..consumers.replicated import ReplicatedHostPool
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import SharedKVLayout
from ..runtime.comm import Comm
from ..runtime.parts import SharedBuffers, build_parts
from ..runtime.runner import CPRunner
from .config import RunConfig


def build_cache(cp_size: int, page_size: int, pages_per_rank: int, eviction: str = "lru") -> PrefixCache:
    """The prefix cache over a fresh :class:`OwnerLaneAllocator` of a group of
    ``cp_size`` ranks with ``pages_per_rank`` pages of ``page_size`` tokens each
    (page 0 reserved), evicting by the policy named ``eviction``; every rank
    of the group builds the same one."""
    layout = SharedKVLayout(cp_size, page_size, pages_per_rank)
    return PrefixCache(OwnerLaneAllocator.for_layout(layout), eviction=eviction)


def cache_lane_pages(cp_size: int, pages_per_rank: int) -> list[int]:
    """The pages per lane of :func:`build_cache`'s cache, without building it:
    ``pages_per_rank`` on every lane but lane 0, which holds one fewer (page 0
    is reserved). A command refuses a trace with it before any allocation."""
    return [pages_per_rank - 1] + [pages_per_rank] * (cp_size - 1)


@dataclass
class RankParts:
    """A rank's KV pool (its segment of the group's shared cache), its host pool
    (``None`` without a host tier) and its runner."""

    pool: SharedKVPool
    host: HostPool | None
    runner: CPRunner


def build_rank(cfg: RunConfig, adapter, layout: SharedKVLayout, group: Comm, shared: SharedBuffers,
               host_pages: int, *, host_shared: SharedBuffers | None = None,
               device: torch.device | None = None) -> RankParts:
    """Build rank ``group.rank``'s parts over ``layout``: the pool over the
    group's shared buffers (fenced by ``group.barrier``), a host pool of
    ``host_pages`` pages (none for 0) and a runner with ``cfg``'s splits
    (its forwards read the scheduler's page table).
    With ``cfg.replicated`` the pool is the rank's private full copy over
    ``layout`` (one rank: :mod:`cpkv.consumers.replicated`) and the splits are
    ``cfg.splits()``'s token splits. The caches are
    ``adapter.kv_families(cfg.kv_dtype)``: pools and host pool store their
    rows [[RFC-0001:C-KV-FORMAT]]. ``host_shared`` allocates the host tier
    (default ``shared``; on a GPU the KV buffers are device memory and the
    host tier pinned host memory)."""
    fams = adapter.kv_families(cfg.kv_dtype)
    prefill_split, decode_split = cfg.splits()
    parts = build_parts(adapter, layout, group, shared=None if cfg.replicated else shared, families=fams,
                        replicated=cfg.replicated, prefill_split=prefill_split, decode_split=decode_split,
                        check_plans=cfg.check_plans, kernels=cfg.kernels, device=device,
                        record_selection=cfg.check, choose_split=decode_chooser(cfg, group.size))
    pool, runner = parts.pool, parts.runner
    host_cls = ReplicatedHostPool if cfg.replicated else HostPool
    host = (host_cls(fams, HostPool.allocate(fams, host_pages, layout.slots_per_page, host_shared or shared))
            if host_pages else None)
    return RankParts(pool, host, runner)


def decode_chooser(cfg: RunConfig, size: int):
    """Under ``decode_split="auto"``, the function each decode forward asks for
    its split: ``cfg.decode_costs.decode_split`` of the batch's contexts
    before and after the new token (the same on every rank); ``None``
    otherwise. ``ValueError`` for a cost model of another group size."""
    costs = cfg.decode_costs
    if cfg.replicated or cfg.decode_split != "auto" or costs is None:
        return None
    if costs.N != size:
        raise ValueError(f"the decode split's cost model is of {costs.N} ranks; this group has {size}")
    return lambda alloc: costs.decode_split(alloc.seq_lens - 1, alloc.seq_lens)


def thread_buffers() -> SharedBuffers:
    """A ``shared(tag, shape, dtype)`` for ranks that are threads of one
    process: the first call for a tag makes a zeroed tensor, every later call
    (any thread) returns that tensor."""
    made: dict[str, torch.Tensor] = {}
    lock = threading.Lock()

    def shared(tag: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        with lock:
            if tag not in made:
                made[tag] = torch.zeros(shape, dtype=dtype)
            return made[tag]

    return shared

