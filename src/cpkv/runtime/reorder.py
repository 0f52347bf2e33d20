"""A group's collectives and messages under another numbering of its ranks.

cpkv's disaggregation numbers the world prefill first: world rank ``i < M`` is
prefill rank ``i``, world rank ``M + j`` decode rank ``j``
(:func:`cpkv.engine.disagg.disagg_rank`). A world torchrun made numbers its
ranks as its rendezvous pleases (the c10d rendezvous orders nodes by host and
agent process id, never by ``--node-rank``), so the decode node may hold global
rank 0. :class:`ReorderedComm` and :class:`ReorderedP2P` give the same ranks the
numbering the caller needs, with no extra collective or message:

    order = ctx.role_ranks("prefill") + ctx.role_ranks("decode")   # global ranks, prefill first
    world = ReorderedComm(ctx.world_comm, order)
    transport = ReorderedP2P(DistP2P(timeout=t), order)

``order[i]`` is the inner rank (in the wrapped object's own numbering) that is
rank ``i`` in the new numbering; it must be a permutation of the inner ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .comm import Comm


def _permutation(order: Sequence[int], size: int) -> list[int]:
    order = [int(r) for r in order]
    if sorted(order) != list(range(size)):
        raise ValueError(f"order must be a permutation of the group's {size} ranks 0..{size - 1}, got {order}")
    return order


class ReorderedComm(Comm):
    """``inner``'s collectives with rank ``i`` being ``inner``'s rank ``order[i]``.

    ``rank`` is this process's new rank; ``all_gather`` and
    ``all_gather_object`` return the ranks' values in the new order (``sizes``
    too is given in the new order). Raises ``ValueError`` when ``order`` is not
    a permutation of ``0 .. inner.size - 1``."""

    def __init__(self, inner: Comm, order: Sequence[int]):
        self.inner, self.order = inner, _permutation(order, inner.size)
        self.rank, self.size = self.order.index(inner.rank), inner.size

    def barrier(self) -> None:
        """``inner``'s barrier."""
        self.inner.barrier()

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Every rank's ``x``, new rank order (one ``inner.all_gather``)."""
        inner_sizes = None
        if sizes is not None:
            if len(sizes) != self.size or int(sizes[self.rank]) != x.shape[0]:
                raise ValueError(f"rank {self.rank} of {self.size}: all_gather sizes {list(sizes)} do not match its "
                                 f"{x.shape[0]} rows")
            inner_sizes = [0] * self.size
            for i, r in enumerate(self.order):
                inner_sizes[r] = int(sizes[i])
        got = self.inner.all_gather(x, inner_sizes)
        return [got[r] for r in self.order]

    def all_to_all(self, chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """``chunks[i]`` to new rank ``i``; what every rank sent, new rank order (one ``inner.all_to_all``)."""
        if len(chunks) != self.size or len(recv_sizes) != self.size:
            raise ValueError(f"rank {self.rank} of {self.size}: all_to_all takes one chunk and one receive size per "
                             f"rank, got {len(chunks)} chunks and {len(recv_sizes)} sizes")
        inner_chunks, inner_sizes = [None] * self.size, [0] * self.size
        for i, r in enumerate(self.order):
            inner_chunks[r], inner_sizes[r] = chunks[i], int(recv_sizes[i])
        got = self.inner.all_to_all(inner_chunks, inner_sizes)
        return [got[r] for r in self.order]

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``, new rank order."""
        got = self.inner.all_gather_object(obj)
        return [got[r] for r in self.order]


class ReorderedP2P:
    """``inner``'s point-to-point messages (``post(sends, recvs)``, see
    :mod:`cpkv.runtime.p2p`) with peer ``i`` being ``inner``'s peer ``order[i]``.
    Raises ``ValueError`` when ``order`` has repeats or negative ranks, and on a
    peer outside ``0 .. len(order) - 1``."""

    def __init__(self, inner, order: Sequence[int]):
        order = [int(r) for r in order]
        if len(set(order)) != len(order) or any(r < 0 for r in order):
            raise ValueError(f"order must list distinct ranks >= 0, got {order}")
        self.inner, self.order = inner, order

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < len(self.order):
            raise ValueError(f"peer {peer} is outside the reordered group of {len(self.order)} ranks")
        return self.order[peer]

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]):
        """``inner.post`` with every peer translated; returns its pending operations."""
        return self.inner.post([(self._peer(p), t) for p, t in sends], [(self._peer(p), t) for p, t in recvs])
