"""The replicated KV cache: the design before shared KV, kept as a baseline in the same engine.

Every rank of a CP group keeps a full copy of every page in its own private
buffer. The allocator is a plain paged one: an
:class:`~cpkv.contract.allocator.OwnerLaneAllocator` of one lane over the
whole pool (``cp_size`` 1: no owner lanes), run identically on every rank,
under the same prefix cache and scheduler as the shared cache. A batch is
divided by a token split (``zigzag``; decode ``balanced``): each layer's new
entries are all-gathered and every rank writes every slot into its own copy;
every read is local, so no fence separates a layer's writes from its reads.
Per rank it holds ``pages`` pages, the same bytes as a shared cache of
``pages`` pages per rank, which holds N times the pages of the group.

* :class:`ReplicatedKVPool` - one rank's private copy (a
  :class:`~cpkv.consumers.kv_pool.SharedKVPool` over a one-rank layout);
* :class:`ReplicatedHostPool` - the group's shared host tier over private
  copies: only the IO rank backs up (from its own copy), every rank loads
  every page into its own copy;
* :func:`replicated_buffers` - the private buffers of one copy.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ..contract.layout import SharedKVLayout
from .hicache import HostPool
from .kv_pool import Family, SharedKVPool, allocate_buffers

#: Splits of a replicated cache: prefill by the zigzag token split (it takes a batch of any length;
#: interleave refuses one shorter than N tokens, as a chunk after a prefix hit can be), decode tokens
#: dealt by context length (``balanced``).
REPLICATED_PREFILL_SPLITS = ("zigzag",)
REPLICATED_DECODE_SPLITS = ("balanced",)


def replicated_layout(page_size: int, pages: int) -> SharedKVLayout:
    """The layout of one full copy: one rank of ``pages`` pages (page 0 reserved)."""
    return SharedKVLayout(1, page_size, pages)


def replicated_buffers(layout: SharedKVLayout, families: Sequence[Family],
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One zeroed private buffer per family for one copy, on ``device`` (the
    rank's GPU under ``--device cuda``; never shared memory, never exported)."""
    if layout.cp_size != 1:
        raise ValueError(f"a replicated copy has a one-rank layout, got {layout}")
    return allocate_buffers(layout, families, lambda tag, shape, dtype: torch.zeros(shape, dtype=dtype, device=device))


class ReplicatedKVPool(SharedKVPool):
    """Rank ``group_rank``'s full copy of a replicated cache, in a group of ``group_size``.

    ``layout`` is the one-rank layout of the copy (:func:`replicated_layout`);
    ``buffers`` are private to this rank (:func:`replicated_buffers`). The
    pool owns every slot of its copy (``rank`` is 0 of the copy's layout), so
    :meth:`write_index` takes every slot of a batch; :meth:`fence` is a no-op (a
    rank reads only what it wrote itself), while :meth:`tier_fence`, around
    moves through the group's shared host tier, is the group's ``barrier``.
    Raises ``ValueError`` for a layout of more than one rank or a
    ``group_rank`` outside ``0 .. group_size - 1``.
    """

    def __init__(self, layout: SharedKVLayout, families: Sequence[Family], buffers: Mapping[str, torch.Tensor], *,
                 group_rank: int, group_size: int, barrier: Callable[[], None] | None = None):
        if layout.cp_size != 1:
            raise ValueError(f"a replicated copy has a one-rank layout, got {layout}")
        if not 0 <= group_rank < group_size:
            raise ValueError(f"group_rank {group_rank} is not a rank of a group of {group_size}")
        super().__init__(layout, 0, families, buffers)
        self.group_rank, self.group_size = group_rank, group_size
        self._barrier = barrier or (lambda: None)

    def fence(self) -> None:
        """Nothing to publish: every rank reads its own copy only."""

    def tier_fence(self) -> None:
        """The group's barrier: the shared host tier is written by one rank and read by all."""
        self._barrier()


class ReplicatedHostPool(HostPool):
    """The group's host tier over replicated copies: backups by the IO rank
    only, from its own copy; loads by every rank, every page, into its own copy."""

    def backup(self, pool: SharedKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Device -> host on the IO rank (group rank ``io_rank``) only; returns the slots copied."""
        if not isinstance(pool, ReplicatedKVPool):
            raise TypeError(f"a replicated host tier backs up a ReplicatedKVPool, got {type(pool).__name__}")
        if pool.group_rank != self.io_rank:
            return 0
        return super().backup(pool, device_slots, host_slots)
