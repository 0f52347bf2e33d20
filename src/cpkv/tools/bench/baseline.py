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


class _Block:
    """vLLM v1's ``KVCacheBlock`` as its free queue uses it: an id, a
    reference count and the two links of the queue."""

    __slots__ = ("block_id", "ref_cnt", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id, self.ref_cnt = block_id, 0
        self.prev_free_block = self.next_free_block = None


class _FreeBlockQueue:
    """vLLM v1's ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``):
    the free blocks as a doubly linked list through the blocks' own links,
    between a fake head and a fake tail, the block freed longest ago first;
    ``popleft_n`` unlinks the first n, ``append_n`` links freed blocks at
    the tail."""

    def __init__(self, blocks: list[_Block]):
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head, self.fake_free_list_tail = _Block(-1), _Block(-1)
        prev = self.fake_free_list_head
        for block in blocks:  # set-up only
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self.fake_free_list_tail.prev_free_block = self.fake_free_list_tail, prev

    def popleft_n(self, n: int) -> list[_Block]:
        """The first ``n`` free blocks, unlinked."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        curr_block = self.fake_free_list_head.next_free_block
        ret = []
        for _ in range(n):
            ret.append(curr_block)
            last_block = curr_block
            curr_block = curr_block.next_free_block
            last_block.prev_free_block = None
            last_block.next_free_block = None
        self.fake_free_list_head.next_free_block = curr_block
        curr_block.prev_free_block = self.fake_free_list_head
        return ret


class BlockPoolBaseline:
    """vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``) as a decode
    step runs it, restated without vLLM (which cpkv does not depend on): one
    free queue for the whole pool (:class:`_FreeBlockQueue`; no owner lanes),
    block 0 the null block taken at start, and ``get_new_blocks(n)``: pop n
    blocks and take a reference on each. Prefix caching is off (with it on,
    each popped block is also looked up for eviction), so this is the pool's
    cheapest form. A decode step, as vLLM's managers and model runner do it:
    each request whose new token starts a block calls ``get_new_blocks(1)``
    (``SingleTypeKVCacheManager.allocate_new_blocks``, one call per request),
    keeps the block in its list and writes its id into its row of the numpy
    block table (``BlockTable.append_row``); then the slot mapping is computed
    for the batch in numpy from the table (``BlockTable.compute_slot_mapping``:
    block id times block size plus offset). Which requests need a block is
    found in numpy (vLLM asks per request), also in the pool's favour."""

    def __init__(self, num_pages: int, page_size: int, max_requests: int, max_pages: int):
        self.num_pages, self.S = num_pages, page_size
        self.table = np.zeros((max_requests, max_pages), dtype=np.int32)
        self.clear()

    def clear(self) -> None:
        """Every block free (block 0 the null block), no request holding any."""
        self.blocks = [_Block(i) for i in range(self.num_pages + 1)]
        self.free_block_queue = _FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft_n(1)[0]
        self.req_blocks: list[list[_Block]] = [[] for _ in range(self.table.shape[0])]
        self.table[...] = 0

    def get_new_blocks(self, num_blocks: int) -> list[_Block]:
        """``num_blocks`` free blocks, each with one reference (``ValueError`` when too few are free)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def alloc_extend(self, seq_lens: list[int]) -> None:
        """Fresh requests ``0 .. bs - 1`` of ``seq_lens`` tokens: their blocks and table rows."""
        for r, n in enumerate(seq_lens):
            blocks = self.get_new_blocks(-(-n // self.S))
            self.req_blocks[r].extend(blocks)
            self.table[r, : len(blocks)] = [b.block_id for b in blocks]

    def alloc_decode(self, seq_lens: np.ndarray) -> torch.Tensor:
        """One new token for each request ``r`` (``seq_lens[r]`` includes it): a
        block for those whose token starts one, then the slot mapping."""
        S, table, req_blocks = self.S, self.table, self.req_blocks
        positions = seq_lens - 1
        for r in np.flatnonzero(positions % S == 0).tolist():
            new_blocks = self.get_new_blocks(1)
            blocks = req_blocks[r]
            blocks.extend(new_blocks)
            table[r, len(blocks) - 1 : len(blocks)] = [b.block_id for b in new_blocks]
        index = np.arange(seq_lens.size) * table.shape[1] + positions // S
        return torch.from_numpy(table.ravel()[index].astype(np.int64) * S + positions % S)
