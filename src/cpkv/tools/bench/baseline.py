"""The per-block allocator engines already run, in plain Python: the allocator benchmark's baseline."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class BlockListBaseline:
    """The allocator engines already run, in plain Python: per block, what
    nano-vllm's ``BlockManager`` does (a deque of free block ids, here one per
    owner lane, popped and pushed one block at a time; the set of blocks in
    use; a reference count per block, reset on allocation and dropped on free,
    the block returning to the free list at zero), as vLLM v1's ``BlockPool``
    keeps a free queue and per-block reference counts. It follows the same
    owner-lane rule (lane bases least-full, round groups from the rotating
    cursor, :func:`~cpkv.contract.plan.choose_lane_bases`, request by request),
    so it returns the same ``out_cache_loc`` as :class:`OwnerLaneAllocator`."""

    def __init__(self, num_pages: int, page_size: int, cp_size: int):
        self.num_pages, self.S, self.N = num_pages, page_size, cp_size
        self.clear()

    def clear(self) -> None:
        N = self.N
        self.lanes = [deque(range(l if l else N, self.num_pages + 1, N)) for l in range(N)]
        self.used: set[int] = set()
        self.ref = [0] * (self.num_pages + 1)
        self.cursor = 0

    def alloc_extend(self, seq_lens: list[int]) -> torch.Tensor:
        """Fresh requests of ``seq_lens`` tokens; the slots of all their pages
        come from one broadcast (and, when a last page is partial, one mask)."""
        S, N, lanes, used, ref = self.S, self.N, self.lanes, self.used, self.ref
        pages, used_in_page = [], []
        rems = [-(-n // S) % N for n in seq_lens]
        heads, at = [], 0  # round groups: where the remainders so far make whole rounds
        for i, k in enumerate(rems):
            if at % N == 0:
                heads.append(i)
            at += k
        ends = dict(zip(heads, heads[1:] + ([len(rems)] if at % N == 0 else [None])))
        c, until, origin, at = self.cursor, -1, 0, 0
        for i, n in enumerate(seq_lens):
            free = [len(q) for q in lanes]
            k, top, low = -(-n // S), max(free), min(free)
            r = k % N
            if i < until:
                b = (origin + at) % N
            elif ends.get(i) is not None and (r == 0 or _balanced(free, top, low)):
                until, origin, b, at, c = ends[i], c, c, 0, (c + 1) % N
            elif r == 0 or low == top:
                b, c = c, (c + 1) % N
            else:
                b = next(l % N for l in range(c, c + N) if free[l % N] == top and free[l % N - 1] != top)
            at += r
            for q in range(k):
                p = lanes[(b + q) % N].popleft()
                ref[p] = 1
                used.add(p)
                pages.append(p)
            used_in_page += [S] * (k - 1) + [n - (k - 1) * S]
        self.cursor = c
        full = (np.array(pages)[:, None] * S + np.arange(S)).reshape(-1)
        if all(n % S == 0 for n in seq_lens):
            return torch.from_numpy(full)
        return torch.from_numpy(full[(np.arange(S)[None, :] < np.array(used_in_page)[:, None]).reshape(-1)])

    def alloc_decode(self, last_loc: list[int]) -> torch.Tensor:
        """One token per request after ``last_loc`` (every request has one)."""
        S, N, lanes, used, ref = self.S, self.N, self.lanes, self.used, self.ref
        out = []
        for last in last_loc:
            if last % S != S - 1:
                out.append(last + 1)
            else:
                p = lanes[(last // S % N + 1) % N].popleft()
                ref[p] = 1
                used.add(p)
                out.append(p * S)
        return torch.tensor(out)

    def free_pages(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``, one block at a time; a block
        at zero goes back to its lane (``KeyError`` on a double free)."""
        N, lanes, used, ref = self.N, self.lanes, self.used, self.ref
        for p in pages:
            ref[p] -= 1
            if ref[p] == 0:
                used.remove(p)
                lanes[p % N].append(p)


def _balanced(free: list[int], top: int, low: int) -> bool:
    """Free counts within one page, the most-free lanes one cyclic run (or all)."""
    return top - low <= 1 and (low == top or sum(free[l] == top and free[l - 1] != top for l in range(len(free))) == 1)
