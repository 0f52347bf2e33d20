"""SGLang's further allocator calls, as a mixin of
:class:`~cpkv.contract.allocator.OwnerLaneAllocator`: ``free_segment(s)``,
``alloc``, ``get_num_new_pages`` and the retraction copies
``get_cpu_copy`` / ``load_cpu_copy``, each with SGLang's meaning under owner
lanes (where a lane changes it, the docstring says so). They answer or change
state only through the allocator's own calls (``free``,
``alloc_pages_with_owners``, ``lane_for_new_chain``) and its read-only state.
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import InvalidFree, UnsupportedPagePlan
from .inputs import int_scalar, int_vector
from .kv_row import RowPlacement, check_row_offsets, new_pages, row_lane_base, segments_to_slots
from .layout import lane_of_position
from .rules import pages_of


class SGLangCalls:
    """The calls of SGLang's paged allocators beyond extend, decode and free;
    mixed into :class:`~cpkv.contract.allocator.OwnerLaneAllocator` (uses its
    ``page_size``, ``cp_size``, ``num_pages``, ``lane_pages``, ``free``,
    ``alloc_pages_with_owners``, ``lane_for_new_chain`` and fill marks)."""

    def free_segment(self, free_index, *, start_pos: int) -> None:
        """SGLang's ``free_segment``: free ``free_index [n]``, the slots of
        positions ``start_pos .. start_pos + n - 1`` of one request's row,
        releasing each page it touches (the last one whole, even if the
        segment ends mid-page), as :meth:`free` does. Refused with
        :class:`InvalidFree` ``unaligned-segment`` when ``start_pos`` is not
        on a page boundary or a slot does not sit at its position's page
        offset (SGLang asserts the first); otherwise as :meth:`free`. Lanes
        change nothing here: a page is freed to its own lane."""
        s = int_vector(free_index, "free_index")
        start = int_scalar(start_pos, "start_pos")
        if start < 0 or start % self.page_size:
            raise InvalidFree("unaligned-segment", f"start_pos {start} is not on a page boundary (page_size "
                              f"{self.page_size})")
        check_row_offsets(s, start, self.page_size)
        self.free(s)

    def free_segments(self, segments) -> None:
        """SGLang's ``free_segments``: free ascending ``(free_index, start_pos)``
        segments of one request's row in one call. A segment that starts
        inside the page the previous segment ends on does not free that page
        again (its head up to the page boundary is skipped); any other
        segment must start on a page boundary. Checked whole before anything
        is freed (see :func:`~cpkv.contract.kv_row.segments_to_slots` for the
        ``InvalidFree`` rules), then freed as :meth:`free` frees."""
        self.free(segments_to_slots(segments, self.page_size))

    def alloc(self, need_size: int, *, first_lane: int | None = None) -> torch.Tensor | None:
        """SGLang's paged ``alloc``: ``need_size / S`` whole pages as their slots,
        int64 ``[need_size]`` on ``device``, page after page, each page's
        slots in order; ``None`` (nothing changed, ``last_deficit`` set) when a
        lane is short.

        Under owner lanes the pages form one chain: page j lies in lane
        ``(first_lane + j) % N``, ``first_lane`` by default the lane a fresh
        chain gets (:meth:`lane_for_new_chain`: the lane with the most free
        pages under ``least_full``). To place pages that continue a request
        at page position q, pass ``first_lane = (b + q) % N``. The pages are
        whole (fill S) and their chain position is not recorded, so the only
        continuation is from a page's last slot (SGLang's HiCache loads whole
        pages this way). Raises ``UnsupportedPagePlan`` ``unaligned-need``
        (``need_size`` negative or not a multiple of S; SGLang asserts it in
        debug mode only), ``owner-out-of-range`` and ``exceeds-capacity``
        (a lane has fewer pages than the chain needs from it)."""
        need, S, N = int_scalar(need_size, "need_size"), self.page_size, self.cp_size
        if need < 0 or need % S:
            raise UnsupportedPagePlan("unaligned-need", f"need_size {need} is not a non-negative multiple of {S}")
        first = self.lane_for_new_chain(0) if first_lane is None else int_scalar(first_lane, "first_lane")
        if not 0 <= first < N:
            raise UnsupportedPagePlan("owner-out-of-range", f"first_lane {first} not in [0, {N})")
        owners = lane_of_position(first, np.arange(need // S), N)
        if (np.bincount(owners, minlength=N) > self.lane_pages).any():
            raise UnsupportedPagePlan("exceeds-capacity", f"{need // S} pages from lane {first} on: some lane "
                                      "holds fewer pages than the chain needs from it; it can never fit")
        pages = self.alloc_pages_with_owners(owners)
        return None if pages is None else (pages[:, None] * S + torch.arange(S, device=pages.device)).reshape(-1)

    def get_num_new_pages(self, seq_lens, page_size: int | None = None, prefix_lens=None, decode: bool = False) -> int:
        """SGLang's ``get_num_new_pages``: how many pages an extend (``seq_lens``,
        ``prefix_lens``, both ``[bs]``) or a decode (``decode=True``: the
        prefix is ``seq_lens - 1``) adds, ``sum(ceil(seq/S) - ceil(prefix/S))``.
        ``page_size``, if given, must be this allocator's (SGLang passes it).
        Under owner lanes the total fitting ``sum(lane_free_pages())`` does
        not mean the batch fits: each lane must supply its share, which
        ``allocate_extend`` checks (``last_deficit``). Raises ``ValueError``
        for a decode with ``prefix_lens``, an extend without them or another
        page size, ``UnsupportedPagePlan`` as an extend would for lengths no
        allocation takes (``empty-decode`` for ``seq_lens < 1`` in a decode)."""
        if page_size is not None and int_scalar(page_size, "page_size") != self.page_size:
            raise ValueError(f"page_size {page_size} is not this allocator's {self.page_size}")
        seq = int_vector(seq_lens, "seq_lens")
        if decode:
            if prefix_lens is not None:
                raise ValueError("decode=True takes no prefix_lens: a decode's prefix is seq_lens - 1")
            if seq.size and seq.min() < 1:
                r = int((seq < 1).nonzero()[0][0])
                raise UnsupportedPagePlan("empty-decode", f"decode needs seq_len >= 1, got {seq[r]}", r)
            return new_pages(seq, seq - 1, self.page_size)
        if prefix_lens is None:
            raise ValueError("prefix_lens is needed unless decode=True")
        return new_pages(seq, int_vector(prefix_lens, "prefix_lens"), self.page_size)

    # -- SGLang's retraction copies -----------------------------------------------------------
    def get_cpu_copy(self, indices, mamba_indices=None) -> RowPlacement:
        """SGLang's ``get_cpu_copy`` at allocator level: where the row
        ``indices [n]`` (a request's slots for positions ``0 .. n-1``, as
        SGLang's retraction passes ``req_to_token[req, :seqlen - 1]``) lies:
        its lane base and length, a :class:`RowPlacement`.

        SGLang's allocator hands this call to its KV cache, which copies the
        row's KV data to the host. cpkv's allocator holds no KV data: on each
        rank the pool copies the slots that rank owns
        (``SharedKVPool.read_owned_all_layers(indices)``). Those copies load
        back without any communication only if the new row puts every
        position on the same lane, i.e. keeps the lane base, which
        :meth:`load_cpu_copy` checks. Refuses ``NotImplementedError`` for
        ``mamba_indices`` (cpkv keeps no Mamba state), ``UnsupportedPagePlan``
        ``last-loc-not-allocated`` for a slot on a free page and
        ``not-one-chain`` for a row that is not one owner-lane chain from
        position 0. Changes nothing. [[RFC-0001:C-REQUEST-RELATIVE]]"""
        return RowPlacement(self._row_base(indices, mamba_indices), int(int_vector(indices, "indices").size),
                            self.page_size, self.cp_size)

    def load_cpu_copy(self, kv_cache_cpu: RowPlacement, indices, mamba_indices=None) -> None:
        """SGLang's ``load_cpu_copy`` at allocator level: check that the new
        row ``indices [n]`` can take back what :meth:`get_cpu_copy` recorded:
        same length and same lane base, so each rank writes its own copy into
        its own pages (``SharedKVPool.write_all_layers(indices, ...)``).
        Allocate such a row with ``alloc_pages_with_owners((b + arange(P)) %
        N, fill=[S, ..., S, tail])``. Refuses ``TypeError`` for something that
        is not a :class:`RowPlacement`, ``ValueError`` for one of another page
        or CP size, ``UnsupportedPagePlan`` ``mismatched-lengths``,
        ``lane-base-changed`` and the refusals of :meth:`get_cpu_copy`.
        Changes nothing."""
        if not isinstance(kv_cache_cpu, RowPlacement):
            raise TypeError(f"load_cpu_copy takes what get_cpu_copy returned, got {type(kv_cache_cpu).__name__}")
        if (kv_cache_cpu.page_size, kv_cache_cpu.cp_size) != (self.page_size, self.cp_size):
            raise ValueError(f"copy of a row with page_size, cp_size = {kv_cache_cpu.page_size}, "
                             f"{kv_cache_cpu.cp_size}; this allocator has {self.page_size}, {self.cp_size}")
        n = int(int_vector(indices, "indices").size)
        if n != kv_cache_cpu.length:
            raise UnsupportedPagePlan("mismatched-lengths", f"the copy holds {kv_cache_cpu.length} positions, "
                                      f"indices {n}")
        base = self._row_base(indices, mamba_indices)
        if n and base != kv_cache_cpu.lane_base:
            raise UnsupportedPagePlan("lane-base-changed", f"the row was copied from lane base "
                                      f"{kv_cache_cpu.lane_base}, the new one has {base}: each rank's copy "
                                      "would land on another rank's pages")

    def _row_base(self, indices, mamba_indices) -> int:
        if mamba_indices is not None:
            raise NotImplementedError("cpkv keeps no Mamba state: mamba_indices must be None")
        s = int_vector(indices, "indices")
        if s.size:
            p = pages_of(s, self.page_size)
            if p.min() < 1 or p.max() > self.num_pages:
                raise UnsupportedPagePlan("slot-out-of-range", f"a slot is not on a usable page (1..{self.num_pages})")
            if (off := (self._lists.fill[p] == 0)).any():
                raise UnsupportedPagePlan("last-loc-not-allocated", f"slot {s[off][0]} lies on free page {p[off][0]}")
        return row_lane_base(s, self.page_size, self.cp_size)
