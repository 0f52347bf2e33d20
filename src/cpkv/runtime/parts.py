"""One rank's parts over a group's layout, built one way by the engine, the
benchmarks and the tests: the cache families, the pool over the group's
buffers, the allocator and the runner (:func:`build_parts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..consumers.kv_pool import Family, SharedKVPool, allocate_buffers
from ..consumers.kv_view import KVView
from ..consumers.replicated import ReplicatedKVPool, replicated_buffers
from ..consumers.row_batches import RowBatches
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import SharedKVLayout
from ..models import ModelAdapter
from .comm import Comm, LocalComm
from .runner import CPRunner

#: ``shared(tag, shape, dtype) -> tensor``: a group's buffer by tag, the same memory on every rank of the group
#: (for the KV buffers, a :class:`~cpkv.consumers.kv_view.KVView` of per-rank segments will do as well).
SharedBuffers = Callable[[str, tuple, torch.dtype], "torch.Tensor | KVView"]


@dataclass
class Parts:
    """One rank's parts: ``families`` (the per-slot caches), ``pool`` (its
    handle on the group's buffers), ``rows`` (a
    :class:`~cpkv.consumers.row_batches.RowBatches` over the allocator of every
    usable page, for a caller without a scheduler; ``None`` where a scheduler
    holds the group's allocator and page table) and ``runner`` (the forward)."""

    layout: SharedKVLayout
    families: tuple[Family, ...]
    pool: SharedKVPool
    rows: RowBatches | None
    runner: CPRunner

    @property
    def allocator(self) -> OwnerLaneAllocator | None:
        """The allocator behind :attr:`rows` (``None`` without rows)."""
        return None if self.rows is None else self.rows.allocator

    def extend(self, rows: list[int], new_ids: list[torch.Tensor], decode: bool = False):
        """Allocate ``new_ids[i]`` more positions for row ``rows[i]``
        (:meth:`RowBatches.allocate`) and run this rank's forward of them.
        Returns ``(allocation, token_indices, logits)`` as
        :meth:`CPRunner.forward` does."""
        alloc = self.rows.allocate(rows, [t.numel() for t in new_ids], decode)
        idx, logits = self.runner.forward(rows, alloc, torch.cat(new_ids), decode, table=self.rows.table)
        return alloc, idx, logits

    def finish(self, row: int) -> None:
        """Empty ``row``: its slots back to the allocator, the pool told to forget them."""
        self.pool.release(self.rows.free(row))


def build_parts(adapter: ModelAdapter, layout: SharedKVLayout, comm: Comm | None = None, *,
                shared: SharedBuffers | None = None, families: Sequence[Family] | None = None,
                replicated: bool = False, max_requests: int | None = None, max_len: int | None = None,
                device: torch.device | str | None = None, **runner_options) -> Parts:
    """Rank ``comm.rank``'s parts (one rank alone when ``comm`` is None) over
    ``layout``: the families (default ``adapter.families()``), the pool over
    the buffers ``shared`` gives (default private zeroed buffers, for a group
    of one rank; see :func:`~cpkv.consumers.kv_pool.allocate_buffers`) fenced
    by the group's barrier, a runner with ``runner_options`` (the splits,
    ``kernels``, ``check_plans``) and, given ``max_requests`` and ``max_len``,
    rows for that many requests of up to ``max_len`` tokens over the allocator
    of every usable page of the layout (:meth:`OwnerLaneAllocator.for_layout`);
    without them no rows (a scheduler keeps the allocator and the page table).
    With ``replicated`` the pool is the rank's private full copy over the
    one-rank ``layout`` (:class:`~cpkv.consumers.replicated.ReplicatedKVPool`)
    on ``device`` (default the CPU; the shared pool's device is its buffers').
    Every rank of the group builds the same parts from the same arguments."""
    if (max_requests is None) != (max_len is None):
        raise ValueError("give both max_requests and max_len (rows of the parts' own), or neither")
    comm = comm or LocalComm()
    fams = tuple(adapter.families() if families is None else families)
    if replicated:
        pool = ReplicatedKVPool(layout, fams, replicated_buffers(layout, fams, device or "cpu"), group_rank=comm.rank,
                                group_size=comm.size, barrier=comm.barrier)
    else:
        pool = SharedKVPool(layout, comm.rank, fams, allocate_buffers(layout, fams, shared), fence=comm.barrier)
    rows = (None if max_requests is None
            else RowBatches(OwnerLaneAllocator.for_layout(layout), max_requests, max_len, layout.padding_value))
    return Parts(layout, fams, pool, rows, CPRunner(adapter, pool, comm, **runner_options))
