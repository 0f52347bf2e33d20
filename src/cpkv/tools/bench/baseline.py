"""The allocator benchmark's baselines: a bare per-lane free list in plain
Python, and the cost of writing ``out_cache_loc`` itself."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ...contract.layout import slot_at
from ...contract.plan import sequential_lane_bases


def slots_of_pages(pages: np.ndarray, used: np.ndarray | None, page_size: int) -> torch.Tensor:
    """``out_cache_loc`` of fresh chains from their pages: page i's first
    ``used[i]`` slots (all ``S`` when ``used`` is None), page after page. The
    floor of any allocator that returns these slots, written the fastest way
    known here: whole pages in one broadcast of ``torch.arange(S)`` onto the
    page starts (:func:`~cpkv.contract.layout.slot_at`: a bitwise or when
    ``S`` is a power of two, several times faster than torch's int64 add on
    the CPU); with partial pages, one repeat of each page's start and one
    in-place numpy add of an ``arange``."""
    S = page_size
    if used is None:
        return slot_at(torch.from_numpy(pages * S)[:, None], torch.arange(S), S).view(-1)
    ends = used.cumsum()
    out = np.repeat(pages * S - (ends - used), used)
    out += np.arange(int(ends[-1]))
    return torch.from_numpy(out)


class DequeBaseline:
    """The bare free list, in plain Python: one ``collections.deque`` of free
    pages per owner lane, one pop per page handed out and one push per page
    returned (the last page returned is handed out next, as
    :class:`~cpkv.contract.allocator.OwnerLaneAllocator` does). Lane bases
    come from the rule itself (:func:`~cpkv.contract.plan.sequential_lane_bases`),
    so ``out_cache_loc`` is the allocator's; ``out_cache_loc`` is written by
    :func:`slots_of_pages`. Nothing else: no input check, no fill mark, no
    owner plan, no double-free check."""

    def __init__(self, num_pages: int, page_size: int, cp_size: int):
        self.num_pages, self.S, self.N = num_pages, page_size, cp_size
        self.clear()

    def clear(self) -> None:
        """Every page free, the lowest of each lane handed out first."""
        N = self.N
        self.lanes = [deque(range(lane or N, self.num_pages + 1, N)) for lane in range(N)]
        self.cursor = 0

    def alloc_extend(self, seq_lens: list[int]) -> torch.Tensor:
        """Fresh requests of ``seq_lens`` tokens."""
        S, N, lanes = self.S, self.N, self.lanes
        n = [-(-x // S) for x in seq_lens]
        bs = len(n)
        bases, self.cursor = sequential_lane_bases([0] * bs, [False] * bs, [0] * bs, n, [len(q) for q in lanes], N,
                                                   self.cursor)
        pages = []
        for b, k in zip(bases.tolist(), n):
            for q in range(k):
                pages.append(lanes[(b + q) % N].popleft())
        pages = np.array(pages, dtype=np.int64)
        if all(x % S == 0 for x in seq_lens):
            return slots_of_pages(pages, None, S)
        used = np.full(pages.size, S, dtype=np.int64)
        used[np.cumsum(n) - 1] = [x - (k - 1) * S for x, k in zip(seq_lens, n)]
        return slots_of_pages(pages, used, S)

    def alloc_decode(self, last_loc: list[int]) -> torch.Tensor:
        """One token per request after ``last_loc`` (every request has one)."""
        S, N, lanes = self.S, self.N, self.lanes
        out = []
        for last in last_loc:
            if (last + 1) % S:
                out.append(last + 1)
            else:
                out.append(lanes[(last // S + 1) % N].popleft() * S)
        return torch.from_numpy(np.array(out, dtype=np.int64))

    def free_pages(self, pages: list[int]) -> None:
        """Return ``pages`` to their lanes, one push each."""
        N, lanes = self.N, self.lanes
        for p in pages:
            lanes[p % N].appendleft(p)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages of ``slots``, taken on trust to be whole pages in
        order (a bare list checks nothing): one strided read of the page
        heads, then one push per page."""
        self.free_pages((slots[:: self.S] // self.S).tolist())
