"""One rank's parts over a group's layout, built one way by the engine, the
benchmarks and the tests: the cache families, the pool over the group's
buffers, the allocator and the runner (:func:`build_parts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..consumers.kv_pool import Family, SharedKVPool, allocate_buffers
from ..consumers.page_table import PageTable
from ..consumers.replicated import ReplicatedKVPool, replicated_buffers
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import SharedKVLayout
from ..models import ModelAdapter
from .comm import Comm, LocalComm
from .runner import CPRunner

#: ``shared(tag, shape, dtype) -> tensor``: a group's buffer by tag, the same memory on every rank of the group.
SharedBuffers = Callable[[str, tuple, torch.dtype], torch.Tensor]


@dataclass
class Parts:
    """One rank's parts: ``families`` (the per-slot caches), ``pool`` (its
    handle on the group's buffers), ``allocator`` (``None`` where a scheduler
    holds the group's allocator) and ``runner``."""

    layout: SharedKVLayout
    families: tuple[Family, ...]
    pool: SharedKVPool
    allocator: OwnerLaneAllocator | None
    runner: CPRunner


def build_parts(adapter: ModelAdapter, layout: SharedKVLayout, comm: Comm | None = None, *,
                shared: SharedBuffers | None = None, families: Sequence[Family] | None = None,
                allocator: bool = True, replicated: bool = False, max_requests: int, max_len: int,
                page_table: PageTable | None = None, **runner_options) -> Parts:
    """Rank ``comm.rank``'s parts (one rank alone when ``comm`` is None) over
    ``layout``: the families (default ``adapter.families()``), the pool over
    the buffers ``shared`` gives (default private zeroed buffers, for a group
    of one rank; see :func:`~cpkv.consumers.kv_pool.allocate_buffers`) fenced
    by the group's barrier, the allocator of every usable page of the layout
    (:meth:`OwnerLaneAllocator.for_layout`; none with ``allocator=False``) and
    a runner for ``max_requests`` rows of up to ``max_len`` tokens reading
    ``page_table`` (default its own), with ``runner_options`` (the splits,
    ``kernels``, ``check_plans``). With ``replicated`` the pool is the rank's
    private full copy over the one-rank ``layout``
    (:class:`~cpkv.consumers.replicated.ReplicatedKVPool`). Every rank of the
    group builds the same parts from the same arguments."""
    comm = comm or LocalComm()
    fams = tuple(adapter.families() if families is None else families)
    if replicated:
        pool = ReplicatedKVPool(layout, fams, replicated_buffers(layout, fams), group_rank=comm.rank,
                                group_size=comm.size, barrier=comm.barrier)
    else:
        pool = SharedKVPool(layout, comm.rank, fams, allocate_buffers(layout, fams, shared), fence=comm.barrier)
    alloc = OwnerLaneAllocator.for_layout(layout) if allocator else None
    runner = CPRunner(adapter, pool, alloc, comm, max_requests=max_requests, max_len=max_len, page_table=page_table,
                      **runner_options)
    return Parts(layout, fams, pool, alloc, runner)
