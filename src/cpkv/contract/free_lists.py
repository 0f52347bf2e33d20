"""The state of an owner-lane allocator, and the only code that changes it.

Logical pages ``1 .. num_pages`` (page 0 is reserved for padding); page ``p``
belongs to lane ``p % N``. State:

* ``stack[l, :free[l]]``: lane l's free pages, the next one to hand out last;
* ``fill[p]``: how many slots of page p are written (handed out), ``0`` when
  the page is free (and for ``p = num_pages + 1``, a page that never is). A
  page is allocated iff ``fill[p] > 0``; a chain may only continue from the
  last written slot of its page, ``p*S + fill[p] - 1``;
* ``gen[p]``, while page p is allocated: the stamp of the allocation that
  handed it out. Stamps come from one counter, ``epoch``, that only grows:
  every allocation call takes the next one, and neither a free, a restore nor
  ``clear`` hands a stamp out twice, so a ``(page, stamp)`` pair kept from a
  dead allocation never matches a live one;
* ``pos[p]``, while page p is allocated: its request-local page position q in
  its chain when the allocation knew it (extend, decode), ``-1`` when it did
  not (pages taken by owner or by ``alloc``). A free leaves ``gen`` and
  ``pos`` as they were (only ``fill`` says whether a page is allocated);
* ``pending``: pages freed inside an open free group, still allocated until
  the group ends (a page freed by several calls of one group is one free);
* ``cursor``: the lane where a fresh request's lane base goes on a tie
  (:func:`cpkv.contract.plan.choose_lane_bases`); it moves only when an
  extend or decode commits, and a restore puts it back;
* ``need_sort``: when set, every lane's free list is kept sorted, the lowest
  page handed out next; otherwise a freed page is handed out before the
  older free pages of its lane (a stack).

Invariants (checked by the tests after every call): every usable page is on
exactly one free list, its own lane's, or has ``fill > 0``, never both; per
lane, free + allocated == the lane's pages; ``pending`` pages are allocated.
Callers validate first and change state last, through :meth:`take` and
:meth:`put`, which cannot fail on validated input ([[RFC-0001:C-FAIL-FAST]]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout
from .layout import floor_div, floor_mod, lane_ids


def rank_in_lane(lanes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries share its lane. When the lanes
    cycle (``lanes[i] = (lanes[0] + i) % N``, a chain's pages in order) that
    is ``i // N``; otherwise one stable radix sort of the lane ids."""
    N, i = counts.size, np.arange(lanes.size)
    if lanes.size and not np.count_nonzero(floor_mod(lanes - lanes[0] - i, N)):  # a multiple of N everywhere iff they cycle
        return floor_div(i, N)
    return _rank_by_sort(lanes, counts, i)


def _rank_by_sort(lanes: np.ndarray, counts: np.ndarray, i: np.ndarray) -> np.ndarray:
    """:func:`rank_in_lane` by one stable radix sort of the lane ids (``i`` an ``arange`` of their length)."""
    N = counts.size
    order = np.argsort(lanes.astype(np.int16) if N < 2**15 else lanes, kind="stable")
    rank = np.empty(lanes.size, dtype=np.int64)
    rank[order] = i - (counts.cumsum() - counts)[lanes[order]]
    return rank


@dataclass(frozen=True, eq=False)
class AllocatorState:
    """A copy of an allocator's state from :meth:`OwnerLaneAllocator.backup_state`,
    tagged with the shape of the allocator it came from."""

    size: int
    page_size: int
    cp_size: int
    free: np.ndarray
    stack: np.ndarray
    fill: np.ndarray
    gen: np.ndarray
    pos: np.ndarray
    cursor: int = 0


class LaneFreeLists:
    """Per-lane free lists of pages, fill marks, and the free-group buffer."""

    def __init__(self, num_pages: int, cp_size: int, need_sort: bool = False):
        self.num_pages, self.cp_size, self.need_sort = num_pages, cp_size, bool(need_sort)
        self.lane_pages = np.bincount(np.arange(1, num_pages + 1) % cp_size, minlength=cp_size)
        self.cap = int(self.lane_pages.max())
        # every lane's pages, next one to hand out last; clear() copies it in place
        self._initial = np.zeros((cp_size, self.cap), dtype=np.int64)
        for lane in range(cp_size):  # once per lane, at set-up only
            pages = np.arange(lane if lane else cp_size, num_pages + 1, cp_size)
            self._initial[lane, : pages.size] = pages[::-1]
        self.stack = self._initial.copy()
        self._lane_top = np.arange(cp_size) * self.cap - 1  # stack index of lane l's top is this + free[l]
        self._lane_mod = self._lane_div = np.zeros(0, dtype=np.int64)  # see _cycle
        self.free = self.lane_pages.copy()
        # fill and pos have one more entry, a page that is never allocated: a gather clipped to it
        # (np.take(..., mode="clip")) reads a free page for any index outside the usable pages
        self.fill = np.zeros(num_pages + 2, dtype=np.int32)  # a page holds at most S < 2**31 slots
        self.gen = np.zeros(num_pages + 1, dtype=np.int64)
        self.pos = np.full(num_pages + 2, -1, dtype=np.int64)
        self.epoch = 1  # the next allocation's stamp; never reset, never restored
        self.cursor = 0  # where lane-base ties go (plan.choose_lane_bases)
        self.pending: np.ndarray | None = None  # a bitmap while a free group is open

    def clear(self) -> None:
        """Every page free, on its lane's list, lowest page handed out first
        (in place: the arrays stay where they are)."""
        self.stack[...] = self._initial
        self.free[...] = self.lane_pages
        self.fill[...] = 0
        self.gen[...] = 0
        self.pos[...] = -1
        self.cursor = 0
        self.pending = None

    # -- questions --------------------------------------------------------------
    def deficit(self, counts: np.ndarray) -> np.ndarray | None:
        """Pages each lane lacks to hand out ``counts[l]`` pages, or None if none lacks."""
        short = counts > self.free
        return np.where(short, counts - self.free, 0) if np.count_nonzero(short) else None

    def peek(self, lanes: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The pages :meth:`take` would hand out: entry i is the ``rank[i]``-th
        next page of lane ``lanes[i]``. Nothing changes."""
        return self.stack.ravel()[lanes * self.cap + self.free[lanes] - 1 - rank]

    def peek_unordered(self, lanes: np.ndarray, counts: np.ndarray, iota: np.ndarray) -> np.ndarray:
        """:meth:`peek` with ranks by order of appearance (entry i is the next
        page of its lane after those of the earlier entries of that lane), for
        lanes in no particular order (``counts`` per lane, ``iota`` an
        ``arange`` at least ``lanes.size`` long): one stable sort of the lane
        ids, the pages read lane after lane, put back in entry order."""
        m = lanes.size
        order = np.argsort(lanes.astype(np.int16) if m > 256 and counts.size < 2**15 else lanes, kind="stable")
        before = counts.cumsum() - counts  # entries of the lanes before each lane, in sorted order
        top = self._lane_top + self.free + before  # sorted entry p of lane l reads stack index top[l] - p
        pages = np.empty(m, dtype=np.int64)
        pages[order] = self.stack.ravel()[np.repeat(top, counts) - iota[:m]]
        return pages

    def peek_chains(self, first_lane: np.ndarray, before: np.ndarray, counts: np.ndarray, starts: np.ndarray, n: int,
                    iota: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`peek` for whole chains: request r takes ``counts[r]`` pages
        cycling from lane ``first_lane[r]``, after the ``before[r, l]`` pages
        of lane l that earlier requests take (``starts`` is the exclusive
        cumulative sum of ``counts``, ``n`` their sum, ``iota`` an ``arange``
        at least ``n`` long). Returns ``(pages, j)`` in request order, ``j``
        each page's place in its request's new pages. Nothing changes.

        Page j of request r is the ``before[r, l] + j // N``-th page the batch
        takes from lane ``l = (first_lane[r] + j) % N``: with ``top[r, i]``
        the stack index of request r's next page of its i-th lane from
        ``first_lane[r]``, its stack index is ``top[r, j % N] - j // N``
        (:meth:`peek_cycle` for one chain)."""
        N, bs = self.cp_size, counts.size
        lanes = floor_mod(first_lane[:, None] + lane_ids(N), N)  # [bs, N]: request r's lanes from its first
        top = (self._lane_top + self.free)[lanes] - before[iota[:bs, None], lanes]
        j = iota[:n] - starts.repeat(counts)
        idx = top.ravel()[(iota[:bs] * N).repeat(counts) + floor_mod(j, N)]
        idx -= floor_div(j, N)
        return self.stack.ravel()[idx], j

    def peek_cycle(self, first_lane: int, n: int) -> np.ndarray:
        """:meth:`peek` for one chain of ``n`` pages cycling from ``first_lane``
        (a batch of one request): page j is the ``j // N``-th next page of
        lane ``(first_lane + j) % N``."""
        lane_mod, lane_div = self._cycle(n)
        idx = (self._lane_top + self.free)[floor_mod(first_lane + lane_ids(self.cp_size), self.cp_size)][lane_mod]
        idx -= lane_div
        return self.stack.ravel()[idx]

    def _cycle(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``j % N`` and ``j // N`` for ``j = 0 .. n - 1``: where page j of a
        chain lies relative to its first lane, and its round. Made once for
        the longest chain seen (views of them; never written)."""
        if self._lane_mod.size < n:
            j = np.arange(max(n, 2 * self._lane_mod.size))
            self._lane_mod, self._lane_div = floor_mod(j, self.cp_size), floor_div(j, self.cp_size)
        return self._lane_mod[:n], self._lane_div[:n]

    def page_bitmap(self) -> np.ndarray:
        """An empty bitmap over pages ``0 .. num_pages``."""
        return np.zeros(self.num_pages + 1, dtype=bool)

    def snapshot(self) -> tuple:
        """The whole state as a hashable value: free pages per lane in order,
        fill marks, pages pending in a free group (None when none is open),
        the chain positions of allocated pages, the lane-base cursor.
        Allocation stamps are left out: they name allocations, and two
        allocators on the same calls with a restore between them stamp
        differently (a restore never rewinds ``epoch``)."""
        lanes = tuple(tuple(self.stack[l, : self.free[l]].tolist()) for l in range(self.cp_size))
        pending = None if self.pending is None else tuple(self.pending.nonzero()[0].tolist())
        pos = np.where(self.fill > 0, self.pos, -1)
        return tuple(self.free.tolist()), lanes, self.fill.tobytes(), pending, pos.tobytes(), self.cursor

    # -- changes ----------------------------------------------------------------
    def take(self, pages: np.ndarray, counts: np.ndarray, fill, positions=None) -> int:
        """Hand out ``pages`` (from :meth:`peek`, ``counts`` per lane) with fill
        marks ``fill`` and chain positions ``positions`` (None: unknown), all
        under one new stamp, which it returns."""
        self.free -= counts
        self.fill[pages] = fill
        self.pos[pages] = -1 if positions is None else positions
        stamp, self.epoch = self.epoch, self.epoch + 1
        self.gen[pages] = stamp
        return stamp

    def write(self, pages: np.ndarray, fill: np.ndarray) -> None:
        """Set the fill marks of allocated ``pages`` (a chain wrote more of them)."""
        self.fill[pages] = fill

    def put(self, pages: np.ndarray) -> None:
        """Return distinct allocated ``pages`` to their lanes: in the order given
        (the last one of a lane is handed out next), or, with ``need_sort``,
        each touched lane's list sorted again, its lowest page handed out next."""
        N, n = self.cp_size, pages.size
        if n == 0:
            return
        lanes = floor_mod(pages, N)
        first, last = int(lanes[0]), int(lanes[-1])
        lane_mod, lane_div = self._cycle(max(first, last) + n)
        # one chain's pages, in order or backwards (a chain freed in order is put back reversed, so that its
        # first page is handed out first): either way the i-th is its lane's i // N-th
        if not np.count_nonzero(lanes != lane_mod[first : first + n]):
            counts, rank = layout.chain_lane_pages(first, 0, n, N), lane_div[:n]
        elif not np.count_nonzero(lanes[::-1] != lane_mod[last : last + n]):
            counts, rank = layout.chain_lane_pages(last, 0, n, N), lane_div[:n]
        else:
            counts = np.bincount(lanes, minlength=N)
            rank = _rank_by_sort(lanes, counts, np.arange(n))
        self.stack.ravel()[(self._lane_top + 1 + self.free)[lanes] + rank] = pages
        self.free += counts
        self.fill[pages] = 0  # gen and pos mean nothing on a free page
        if self.need_sort:
            self._sort_lanes(counts.nonzero()[0])

    def _sort_lanes(self, lanes: np.ndarray) -> None:
        """Sort the free lists of ``lanes`` so the lowest page is on top (one
        row sort per lane, ``O(cap log cap)``; pages are >= 1, so the ``0``
        fill past a list's end sorts below every page)."""
        rows = self.stack[lanes]
        rows[np.arange(self.cap)[None, :] >= self.free[lanes][:, None]] = 0
        rows.sort(axis=1)  # ascending, the zeros first: reversed, the list is at the bottom, lowest on top
        self.stack[lanes] = rows[:, ::-1]

    def copy_out(self, size: int, page_size: int) -> AllocatorState:
        """A copy of the state (the free-group buffer is not part of it)."""
        return AllocatorState(size, page_size, self.cp_size, self.free.copy(), self.stack.copy(), self.fill.copy(),
                              self.gen.copy(), self.pos.copy(), self.cursor)

    def copy_in(self, state: AllocatorState) -> None:
        """Put a copy of ``state`` back (the caller checked it fits). ``epoch``
        keeps counting: an allocation undone by the restore keeps its stamp
        dead, since no later allocation gets it again."""
        self.free[...], self.stack[...], self.fill[...] = state.free, state.stack, state.fill
        self.gen[...], self.pos[...] = state.gen, state.pos
        self.cursor = state.cursor
