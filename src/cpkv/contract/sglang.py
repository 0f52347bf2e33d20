"""SGLang's paged-allocator calls over the owner-lane core.

:class:`SGLangAllocator` speaks the call shapes of SGLang's paged allocators
(``alloc_extend``, ``alloc_decode``, ``alloc``, ``free``,
``free_segment(s)``, ``get_num_new_pages``, ``available_size``, ``clear`` and
the retraction copies ``get_cpu_copy`` / ``load_cpu_copy``) and of its
kv-shard allocator (``rotation_bases``, ``least_full_class``,
``class_free_pages``, ``aggregate_free_size``), each with SGLang's meaning
under owner lanes (where a lane changes it, the docstring says so);
:class:`SGLangKVShardAllocator` is built as SGLang builds that kv-shard
allocator and numbers pages as it does. It holds no allocator state of its own (only the last
:class:`~cpkv.contract.allocation.Allocation` it made, whose slots SGLang's
calls return): every call answers or changes state through the public verbs
of the :class:`~cpkv.contract.allocator.OwnerLaneAllocator` it wraps
(``allocator``), so an engine may call both.
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .allocation import Allocation
from .allocator import OwnerLaneAllocator
from .planner import _device_tensor
from .errors import InvalidFree, UnsupportedPagePlan
from .inputs import check_int_tensor, int_scalar, int_vector
from .kv_row import RowPlacement, check_row_offsets, new_pages, row_lane_base, segments_to_slots
from .layout import SharedKVLayout, floor_div, lane_of_position
from .rules import pages_of


class SGLangAllocator:
    """SGLang's paged allocator (``BaseTokenToKVPoolAllocator``'s surface) over
    an :class:`OwnerLaneAllocator`.

    Built as SGLang builds its allocators, ``(size, page_size, dtype, device,
    kvcache, need_sort)`` (positional or keyword), plus cpkv's keywords: the
    CP size from ``cp_size`` or from ``cp_group`` (SGLang's
    ``GroupCoordinator``, as ``get_attn_cp_group()`` returns it, or a
    ``torch.distributed`` process group: its size, and this process's rank in
    it as ``cp_rank``),
    ``layout`` and ``base_policy`` as :class:`OwnerLaneAllocator` takes them;
    or over an existing core with :meth:`over`. ``dtype`` and ``kvcache`` are
    kept for SGLang's readers (``get_kvcache()``); the allocator never touches
    KV. Results are torch tensors on the core's device. ``allocator`` is the
    core; ``last_allocation`` the full plan of this adapter's last extend or
    decode (``alloc_extend`` and ``alloc_decode`` return only its slots).

    At ``cp_size`` 1 (and ``need_sort`` off) every call answers as SGLang's
    ``PagedTokenToKVPoolAllocator`` does, slot for slot: a freed batch of
    pages goes to the front of the free list, lowest first. Where SGLang and
    cpkv differ (refusals, ``need_sort``, lanes), ``docs/sglang.md`` says so.
    [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]"""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", kvcache=None, need_sort: bool = False, *,
                 cp_size: int | None = None, cp_rank: int | None = None, cp_group=None,
                 layout: SharedKVLayout | None = None, base_policy: str = "least_full"):
        cp_size, cp_rank = _cp_of(cp_size, cp_rank, cp_group)
        self.allocator = OwnerLaneAllocator(size, page_size, cp_size, device, base_policy=base_policy, layout=layout,
                                            need_sort=need_sort)
        self.dtype, self._kvcache, self.cp_rank = dtype, kvcache, cp_rank
        self.last_allocation: Allocation | None = None

    @classmethod
    def over(cls, allocator: OwnerLaneAllocator, *, kvcache=None, dtype: torch.dtype | None = None,
             cp_rank: int = 0) -> SGLangAllocator:
        """The adapter over an existing core (which keeps every state); ``SGLangAllocator``'s only (a kv-shard
        allocator builds its own core: ``TypeError``)."""
        if cls is not SGLangAllocator:
            raise TypeError(f"{cls.__name__} builds its own core; over() makes an SGLangAllocator")
        if not isinstance(allocator, OwnerLaneAllocator):
            raise TypeError(f"SGLangAllocator.over takes an OwnerLaneAllocator, got {type(allocator).__name__}")
        adapter = cls.__new__(cls)
        adapter.allocator, adapter.last_allocation = allocator, None
        adapter.dtype, adapter._kvcache, adapter.cp_rank = dtype, kvcache, _rank_in(cp_rank, allocator.cp_size)
        return adapter

    # -- what SGLang reads ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Tokens, as given (``size // page_size`` usable pages, numbered from 1)."""
        return self.allocator.size

    @property
    def num_pages(self) -> int:
        """Usable pages."""
        return self.allocator.num_pages

    @property
    def device(self) -> torch.device:
        """Where results live."""
        return self.allocator.device

    @property
    def need_sort(self) -> bool:
        """SGLang's flag: every lane's free list is kept sorted (cpkv sorts at
        free time; SGLang stages freed pages until a call runs short)."""
        return self.allocator.need_sort

    @property
    def cp_size(self) -> int:
        """Ranks in the CP group (owner lanes)."""
        return self.allocator.cp_size

    @property
    def size_full(self) -> int:
        """SGLang's ``size_full``: :attr:`size`."""
        return self.allocator.size

    @property
    def free_pages(self) -> torch.Tensor:
        """Free pages as SGLang reads its ``free_pages`` tensor (int64, on
        ``device``): at ``cp_size`` 1 in the order they are handed out; at
        ``N`` > 1 lane after lane (:attr:`class_free_pages`). Read-only: state
        changes go through the calls."""
        return _device_tensor(np.concatenate(self.allocator.lane_free_lists()), self.device)

    @property
    def release_pages(self) -> torch.Tensor:
        """SGLang's staged frees: always empty (a freed page is free at once)."""
        return torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def class_free_pages(self) -> list[torch.Tensor]:
        """Each lane's free pages, handed-out order first (SGLang's kv-shard
        allocator's per-owner-class lists)."""
        return [_device_tensor(p, self.device) for p in self.allocator.lane_free_lists()]

    def class_free_page_counts(self) -> list[int]:
        """Free pages per lane (SGLang's kv-shard allocator's name)."""
        return self.allocator.lane_free_pages()

    def least_full_class(self) -> int:
        """SGLang's kv-shard rule for a new chain's lane base: the lane with the
        most free pages, ties to the lowest (whatever ``base_policy`` the
        allocator runs; ``base_policy="least_full_lowest"`` makes a ``None``
        rotation base resolve the same way). Changes nothing."""
        return int(np.argmax(self.allocator.lane_free_pages()))

    def aggregate_free_size(self) -> int:
        """Free tokens over every lane (SGLang's kv-shard allocator's name): not
        what fits one request, which :meth:`available_size` says."""
        return self.page_size * int(sum(self.allocator.lane_free_pages()))

    def get_kvcache(self):
        """The KV cache given at construction (SGLang's call sites read it)."""
        return self._kvcache

    def get_all_free_pages(self) -> torch.Tensor:
        """Every free page (:attr:`free_pages`; nothing is staged)."""
        return self.free_pages

    def merge_and_sort_free(self) -> None:
        """SGLang's ``merge_and_sort_free``: nothing to merge (frees are never
        staged) and, with ``need_sort``, the lists are sorted already; a no-op
        as SGLang's is when nothing is staged."""

    def debug_print(self) -> str:
        """One line: free pages per lane and :meth:`available_size`."""
        return f"free pages per lane {self.allocator.lane_free_pages()}, available_size {self.available_size()}"

    def backup_state(self):
        """SGLang's ``backup_state``: :meth:`OwnerLaneAllocator.backup_state`."""
        return self.allocator.backup_state()

    def restore_state(self, state) -> None:
        """SGLang's ``restore_state``: :meth:`OwnerLaneAllocator.restore_state`
        (refusals there)."""
        self.allocator.restore_state(state)

    def free_group_begin(self) -> None:
        """Open a free group: :meth:`OwnerLaneAllocator.free_group_begin`."""
        self.allocator.free_group_begin()

    def free_group_end(self) -> None:
        """Close it, freeing the union of its pages (lowest handed out first):
        :meth:`OwnerLaneAllocator.free_group_end`."""
        self.allocator.free_group_end()

    # -- SGLang's scheduler-facing capacity hooks ------------------------------------------------
    def get_extend_allocation_demand(self, prefix_lens_cpu, seq_lens_cpu, *, conservative_num_tokens: int,
                                     shard_size: int = 1) -> int:
        """Tokens to make available before an extend: SGLang's conservative
        count (one page per request over the new tokens) plus, at ``N`` > 1,
        one page per request in each other lane (a request's pages cycle the
        lanes, so its share of the tightest lane rounds up)."""
        return int(conservative_num_tokens) + len(seq_lens_cpu) * self.page_size * (self.cp_size - 1)

    def evict_to_free_tokens(self, tree_cache, num_tokens: int):
        """SGLang's hook: evict from ``tree_cache`` (lane-aware, in tokens of
        :meth:`available_size`) until ``num_tokens`` fit or nothing evictable
        helps; ``None`` (the caller checks), as SGLang's."""
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return None
        shortfall = int(num_tokens) - self.available_size()
        if shortfall > 0:
            tree_cache.evict(shortfall)
        return None

    def check_decode_capacity(self, *, num_tokens: int, tree_cache, requests=None, spec_algorithm=None) -> bool:
        """Whether a decode step of ``num_tokens`` fits after evicting (SGLang's hook)."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.available_size() >= int(num_tokens)

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.allocator.page_size

    # -- extend and decode --------------------------------------------------------------
    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None, rotation_bases: list | None = None, *,
                     last_loc_gen=None) -> torch.Tensor | None:
        """SGLang's paged ``alloc_extend``: ``out_cache_loc [extend_num_tokens]``
        or ``None`` when a lane is short (state unchanged; the core's
        ``last_deficit`` says where). The device copies are checked for kind
        and length, never read; the full plan is :attr:`last_allocation`.
        ``num_new_pages`` (SGLang's precomputed :meth:`get_num_new_pages`), if
        given, must match the lengths (rule ``num-new-pages``). Refusals and
        ``last_loc_gen``: :meth:`OwnerLaneAllocator.allocate_extend`.

        ``rotation_bases`` (SGLang's kv-shard allocator): a list, one entry per
        request, the lane base its chain takes (an int, taken mod N) or
        ``None`` for a fresh chain, whose base the allocator's ``base_policy``
        picks at that request's turn (the earlier requests' pages counted) and
        writes back into the list, as SGLang resolves them in place (only on
        success). A request with a prefix must be given the base its
        ``last_loc`` continues: another one is ``lane-base-changed``, refused
        before anything changes; ``None`` there takes that base.
        [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-REQUEST-RELATIVE]]"""
        _device_copies(prefix_lens, prefix_lens_cpu, "prefix_lens")
        _device_copies(seq_lens, seq_lens_cpu, "seq_lens")
        if num_new_pages is not None:
            want = self.get_num_new_pages(seq_lens_cpu, prefix_lens=prefix_lens_cpu)
            if int_scalar(num_new_pages, "num_new_pages") != want:
                raise UnsupportedPagePlan("num-new-pages", f"num_new_pages={num_new_pages} but the lengths add {want}")
        wanted = None if rotation_bases is None else _given_bases(rotation_bases, self.cp_size)
        alloc = self.allocator.allocate_extend(prefix_lens_cpu, seq_lens_cpu, last_loc,
                                               int_scalar(extend_num_tokens, "extend_num_tokens"),
                                               last_loc_gen=last_loc_gen, lane_bases=wanted)
        if alloc is None:
            return None
        self.last_allocation = alloc
        if rotation_bases is not None:  # SGLang reads the resolved bases back from its list
            used = alloc.to_host("lane_base")
            for i in np.flatnonzero(wanted < 0).tolist():
                rotation_bases[i] = int(used[i])
        return alloc.out_cache_loc

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, *,
                     last_loc_gen=None) -> torch.Tensor | None:
        """SGLang's paged ``alloc_decode``: ``seq_lens`` include the new token,
        ``last_loc`` is the previous token's slot (-1 for none). Returns
        ``out_cache_loc [bs]`` or ``None`` (state unchanged). Refusals and
        ``last_loc_gen``: :meth:`OwnerLaneAllocator.allocate_decode`."""
        _device_copies(seq_lens, seq_lens_cpu, "seq_lens")
        alloc = self.allocator.allocate_decode(seq_lens_cpu, last_loc, last_loc_gen=last_loc_gen)
        if alloc is None:
            return None
        self.last_allocation = alloc
        return alloc.out_cache_loc

    def alloc(self, need_size: int, *, first_lane: int | None = None) -> torch.Tensor | None:
        """SGLang's paged ``alloc``: ``need_size / S`` whole pages as their slots,
        int64 ``[need_size]``, page after page, each page's slots in order;
        ``None`` (nothing changed, ``last_deficit`` set) when a lane is short.

        Under owner lanes the pages form one chain: page j lies in lane
        ``(first_lane + j) % N``, ``first_lane`` by default the lane a fresh
        chain gets (:meth:`OwnerLaneAllocator.lane_for_new_chain`; the cursor
        does not move). To place pages that continue a request at page
        position q, pass ``first_lane = (b + q) % N``. The pages are whole
        (fill S) and their chain position is not recorded, so the only
        continuation is from a page's last slot (SGLang's HiCache loads whole
        pages this way). Raises ``UnsupportedPagePlan`` ``unaligned-need``
        (``need_size`` negative or not a multiple of S; SGLang asserts it in
        debug mode only), ``owner-out-of-range`` and ``exceeds-capacity`` (a
        lane has fewer pages than the chain needs from it)."""
        core = self.allocator
        need, S, N = int_scalar(need_size, "need_size"), core.page_size, core.cp_size
        if need < 0 or need % S:
            raise UnsupportedPagePlan("unaligned-need", f"need_size {need} is not a non-negative multiple of {S}")
        first = core.lane_for_new_chain(0, pages=need // S) if first_lane is None else int_scalar(first_lane,
                                                                                                "first_lane")
        if not 0 <= first < N:
            raise UnsupportedPagePlan("owner-out-of-range", f"first_lane {first} not in [0, {N})")
        owners = lane_of_position(first, np.arange(need // S), N)
        if (np.bincount(owners, minlength=N) > core.lane_pages).any():
            raise UnsupportedPagePlan("exceeds-capacity", f"{need // S} pages from lane {first} on: some lane "
                                      "holds fewer pages than the chain needs from it; it can never fit")
        pages = core.alloc_pages_with_owners(owners)
        return None if pages is None else (pages[:, None] * S + torch.arange(S, device=pages.device)).reshape(-1)

    def get_num_new_pages(self, seq_lens, page_size: int | None = None, prefix_lens=None, decode: bool = False) -> int:
        """SGLang's ``get_num_new_pages``: how many pages an extend (``seq_lens``,
        ``prefix_lens``, both ``[bs]``) or a decode (``decode=True``: the
        prefix is ``seq_lens - 1``) adds, ``sum(ceil(seq/S) - ceil(prefix/S))``.
        ``page_size``, if given, must be this allocator's (SGLang passes it).
        Under owner lanes the total fitting the free pages does not mean the
        batch fits: each lane must supply its share, which the extend checks
        (``last_deficit``). Raises ``ValueError`` for a decode with
        ``prefix_lens``, an extend without them or another page size,
        ``UnsupportedPagePlan`` as an extend would for lengths no allocation
        takes (``empty-decode`` for ``seq_lens < 1`` in a decode)."""
        S = self.allocator.page_size
        if page_size is not None and int_scalar(page_size, "page_size") != S:
            raise ValueError(f"page_size {page_size} is not this allocator's {S}")
        seq = int_vector(seq_lens, "seq_lens")
        if decode:
            if prefix_lens is not None:
                raise ValueError("decode=True takes no prefix_lens: a decode's prefix is seq_lens - 1")
            if seq.size and seq.min() < 1:
                r = int((seq < 1).nonzero()[0][0])
                raise UnsupportedPagePlan("empty-decode", f"decode needs seq_len >= 1, got {seq[r]}", r)
            return new_pages(seq, seq - 1, S)
        if prefix_lens is None:
            raise ValueError("prefix_lens is needed unless decode=True")
        return new_pages(seq, int_vector(prefix_lens, "prefix_lens"), S)

    # -- frees and sizes ------------------------------------------------------------------
    def free(self, free_index) -> None:
        """SGLang's ``free``: the pages holding the slots ``free_index [n]``
        (padding ignored) go back to their lanes, lowest page handed out first
        (SGLang frees ``unique(free_index // page_size)`` to the front of its
        list). Refusals: :meth:`OwnerLaneAllocator.free_pages` (``InvalidFree``
        ``free-out-of-range``, ``double-free``; nothing freed). One sort of
        the freed pages, as SGLang's ``torch.unique``."""
        s = int_vector(free_index, "free_index")
        s = s[s != self.allocator.layout.padding_value]
        if s.size:
            self.allocator.free_pages(np.unique(floor_div(s, self.page_size)))

    def free_page_ids(self, page_ids) -> None:
        """SGLang's ``free_page_ids``: free exactly these pages (each once), the first handed out first."""
        p = int_vector(page_ids, "page_ids")
        if p.size:
            self.allocator.free_pages(p)

    def free_segment(self, free_index, *, start_pos: int) -> None:
        """SGLang's ``free_segment``: free ``free_index [n]``, the slots of
        positions ``start_pos .. start_pos + n - 1`` of one request's row,
        releasing each page it touches (the last one whole, even if the
        segment ends mid-page), as :meth:`free` does. Refused with
        :class:`InvalidFree` ``unaligned-segment`` when ``start_pos`` is not
        on a page boundary or a slot does not sit at its position's page
        offset (SGLang asserts the first); otherwise as :meth:`free`. Lanes
        change nothing here: a page is freed to its own lane."""
        S = self.allocator.page_size
        s = int_vector(free_index, "free_index")
        start = int_scalar(start_pos, "start_pos")
        if start < 0 or start % S:
            raise InvalidFree("unaligned-segment", f"start_pos {start} is not on a page boundary (page_size {S})")
        check_row_offsets(s, start, S)
        self.free(s)

    def free_segments(self, segments) -> None:
        """SGLang's ``free_segments``: free ascending ``(free_index, start_pos)``
        segments of one request's row in one call. A segment that starts
        inside the page the previous segment ends on does not free that page
        again (its head up to the page boundary is skipped); any other
        segment must start on a page boundary. Checked whole before anything
        is freed (see :func:`~cpkv.contract.kv_row.segments_to_slots` for the
        ``InvalidFree`` rules), then freed as :meth:`free` frees."""
        self.free(segments_to_slots(segments, self.allocator.page_size))

    def available_size(self) -> int:
        """Tokens on new pages that fit whatever lane base the next request gets.

        A request of n new pages takes at most ``ceil(n / N)`` pages of any
        lane, so it fits for every base iff ``ceil(n / N) <= min lane free``:
        ``N * min(lane free pages) * page_size`` tokens. With ``cp_size == 1``
        that is SGLang's free-token count.
        """
        core = self.allocator
        return core.cp_size * min(core.lane_free_pages()) * core.page_size

    def clear(self) -> None:
        """SGLang's ``clear``: :meth:`OwnerLaneAllocator.clear`."""
        self.allocator.clear()

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
        core = self.allocator
        return RowPlacement(self._row_base(indices, mamba_indices), int(int_vector(indices, "indices").size),
                            core.page_size, core.cp_size)

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
        core = self.allocator
        if not isinstance(kv_cache_cpu, RowPlacement):
            raise TypeError(f"load_cpu_copy takes what get_cpu_copy returned, got {type(kv_cache_cpu).__name__}")
        if (kv_cache_cpu.page_size, kv_cache_cpu.cp_size) != (core.page_size, core.cp_size):
            raise ValueError(f"copy of a row with page_size, cp_size = {kv_cache_cpu.page_size}, "
                             f"{kv_cache_cpu.cp_size}; this allocator has {core.page_size}, {core.cp_size}")
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
        core = self.allocator
        s = int_vector(indices, "indices")
        if s.size:
            p = pages_of(s, core.page_size)
            if p.min() < 1 or p.max() > core.num_pages:
                raise UnsupportedPagePlan("slot-out-of-range", f"a slot is not on a usable page (1..{core.num_pages})")
            if (off := ~core.is_allocated(p)).any():
                raise UnsupportedPagePlan("last-loc-not-allocated", f"slot {s[off][0]} lies on free page {p[off][0]}")
        return row_lane_base(s, core.page_size, core.cp_size)


def _given_bases(rotation_bases, n: int) -> np.ndarray:
    """SGLang's ``rotation_bases`` list as the core's ``lane_bases``: an int mod ``n``, -1 for ``None``."""
    if not isinstance(rotation_bases, list):
        raise TypeError(f"rotation_bases is a list (SGLang resolves it in place), got {type(rotation_bases).__name__}")
    return np.array([-1 if b is None else int_scalar(b, "rotation_bases") % n for b in rotation_bases],
                    dtype=np.int64)


def _rank_in(rank, n: int) -> int:
    rank = int_scalar(rank, "cp_rank")
    if not 0 <= rank < n:
        raise ValueError(f"cp_rank {rank} not in [0, {n})")
    return rank


def _cp_of(cp_size, cp_rank, cp_group) -> tuple[int, int]:
    """CP size and this rank from the keywords or a group: SGLang's
    ``GroupCoordinator`` (its ``world_size`` and ``rank_in_group``, read
    without a collective) or a ``torch.distributed`` group. The group's size
    and rank win; a ``cp_size`` or ``cp_rank`` that disagrees is refused."""
    if cp_group is not None:
        if hasattr(cp_group, "world_size") and hasattr(cp_group, "rank_in_group"):  # SGLang's GroupCoordinator
            n = int_scalar(cp_group.world_size, "cp_group.world_size")
            if n < 1:
                raise ValueError(f"cp_group.world_size must be >= 1, got {n}")
            r = _rank_in(cp_group.rank_in_group, n)
        else:
            import torch.distributed as dist

            n, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        if (cp_size is not None and int_scalar(cp_size, "cp_size") != n) or (cp_rank is not None and cp_rank != r):
            raise ValueError(f"cp_size/cp_rank {cp_size}/{cp_rank} disagree with cp_group (size {n}, rank {r})")
        return n, r
    n = 1 if cp_size is None else int_scalar(cp_size, "cp_size")
    if n < 1:
        raise ValueError(f"cp_size must be >= 1, got {n}")
    return n, _rank_in(0 if cp_rank is None else cp_rank, n)


def _device_copies(device_copy, host_copy, name: str) -> None:
    """SGLang passes lengths twice, on the device and on the host: the device
    copy is checked for kind and length, never read."""
    check_int_tensor(device_copy, name)
    check_int_tensor(host_copy, name)
    size = (lambda x: x.shape[0] if isinstance(x, (torch.Tensor, np.ndarray)) else len(x))
    if size(device_copy) != size(host_copy):
        raise UnsupportedPagePlan("mismatched-lengths", f"device and cpu copies of {name} differ in size")


#: SGLang's kv-shard allocator module: when it is loaded, :class:`SGLangKVShardAllocator` registers with its class.
SGLANG_KV_SHARD = "sglang.srt.mem_cache.allocator.page_interleave"


class SGLangKVShardAllocator(SGLangAllocator):
    """cpkv where SGLang builds its kv-shard allocator (``PageInterleavePoolAllocator``,
    server option enable-kv-cache-sharding), built as SGLang builds it:
    ``(size, physical_page_size, shard_size, dtype, device, kvcache,
    need_sort, shard_spec=None)``, ``size`` the token slots of ONE rank;
    ``cp_rank`` / ``cp_group`` as :class:`SGLangAllocator` takes them, and
    ``base_policy`` (default ``"least_full_lowest"``, SGLang's rule for a
    ``None`` rotation base).

    Pages are numbered as SGLang numbers them: logical page ``l`` lies on rank
    ``l % N`` at local page ``l // N``, and pages ``0 .. N-1`` (local page 0
    of every rank) are never handed out: SGLang's kv-shard pool reads loc
    ``0 .. N*ps - 1`` as its padding range. So each lane holds
    ``size // physical_page_size`` pages, local pages ``1 ..`` of its rank;
    ``size`` reads ``N`` times the given one (the logical slots, SGLang's
    reading) and ``num_pages`` the usable pages. A free that names pages
    ``0 .. N-1`` is refused (``InvalidFree`` ``free-out-of-range``); ``clear``
    keeps them out. ``shard_size`` is N: where SGLang's module is loaded the
    class is registered as a virtual subclass of its
    ``PageInterleavePoolAllocator``, so SGLang's ``page_interleave_shard_size``
    and its scheduler's kv-shard branches read it. Unlike SGLang's, ``alloc``
    and ``alloc_decode`` allocate (on owner lanes) and a prefix need not end on
    a page boundary. ``shard_size`` must be at least 2 (SGLang's
    assertion; at one rank, :class:`SGLangAllocator`).
    [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]"""

    def __init__(self, size: int, physical_page_size: int, shard_size: int, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", kvcache=None, need_sort: bool = False, shard_spec=None, *,
                 cp_rank: int | None = None, cp_group=None, base_policy: str = "least_full_lowest"):
        n, S = int_scalar(shard_size, "shard_size"), int_scalar(physical_page_size, "physical_page_size")
        if n < 2:
            raise ValueError(f"shard_size must be >= 2 (SGLang's kv-shard allocator), got {n}; at one rank use "
                             "SGLangAllocator")
        if S < 1:
            raise ValueError(f"physical_page_size must be >= 1, got {S}")
        per_rank = int_scalar(size, "size") // S
        if per_rank < 1:
            raise ValueError(f"size {size} holds no page of {S} tokens on a rank")
        # one more local page per rank (local page 0), of which the pages 1 .. N-1 are held out below
        super().__init__(((per_rank + 1) * n - 1) * S, S, dtype, device, kvcache, need_sort, cp_size=n,
                         cp_rank=cp_rank, cp_group=cp_group, base_policy=base_policy)
        self.shard_spec, self._per_rank = shard_spec, per_rank
        self._hold_out_padding_pages()
        _register_with_sglang()

    def _hold_out_padding_pages(self) -> None:
        """Take pages ``1 .. N-1`` (local page 0 of ranks 1 .. N-1: the head of each lane of a cleared core) for
        good, so no call hands them out."""
        held = self.allocator.alloc_pages_with_owners(np.arange(1, self.cp_size))
        assert held is not None and held.tolist() == list(range(1, self.cp_size)), "a cleared core's lane heads"

    @property
    def size(self) -> int:
        """Logical token slots, ``N`` times one rank's (SGLang's kv-shard ``size``)."""
        return self._per_rank * self.page_size * self.cp_size

    @property
    def size_full(self) -> int:
        """SGLang's ``size_full``: :attr:`size`."""
        return self.size

    @property
    def num_pages(self) -> int:
        """Usable pages, ``N`` times one rank's."""
        return self._per_rank * self.cp_size

    @property
    def shard_size(self) -> int:
        """N, what SGLang's ``page_interleave_shard_size`` reads."""
        return self.cp_size

    @property
    def physical_page_size(self) -> int:
        """Tokens per page (SGLang's kv-shard name; ``page_size`` is the same)."""
        return self.page_size

    def clear(self) -> None:
        """Every page free, pages ``0 .. N-1`` still held out."""
        self.allocator.clear()
        self._hold_out_padding_pages()

    def free(self, free_index) -> None:
        """:meth:`SGLangAllocator.free`, refusing (``InvalidFree``
        ``free-out-of-range``, nothing freed) a slot on pages ``0 .. N-1``."""
        s = int_vector(free_index, "free_index")
        s = s[s != self.allocator.layout.padding_value]
        if s.size and (s < self.cp_size * self.page_size).any():
            raise InvalidFree("free-out-of-range", f"pages 0..{self.cp_size - 1} are SGLang's padding range, never "
                              "handed out")
        super().free(s)

    def free_page_ids(self, page_ids) -> None:
        """:meth:`SGLangAllocator.free_page_ids`, refusing pages ``0 .. N-1`` as :meth:`free` does."""
        p = int_vector(page_ids, "page_ids")
        if p.size and (p < self.cp_size).any():
            raise InvalidFree("free-out-of-range", f"pages 0..{self.cp_size - 1} are SGLang's padding range, never "
                              "handed out")
        super().free_page_ids(p)

    def alloc_cyclic(self, start_class: int, need_size: int) -> torch.Tensor | None:
        """SGLang's ``alloc_cyclic`` (its HiCache loads whole pages back this way): :meth:`alloc` of
        ``need_size`` tokens whose pages cycle the lanes from ``start_class`` (taken mod N)."""
        return self.alloc(need_size, first_lane=int_scalar(start_class, "start_class") % self.cp_size)


def _register_with_sglang() -> None:
    """Register :class:`SGLangKVShardAllocator` as a virtual subclass of SGLang's kv-shard allocator class when
    SGLang's module is loaded (its isinstance checks then see cpkv's allocator there); cpkv never imports it."""
    mod = sys.modules.get(SGLANG_KV_SHARD)
    cls = getattr(mod, "PageInterleavePoolAllocator", None)
    if cls is not None and not issubclass(SGLangKVShardAllocator, cls):
        cls.register(SGLangKVShardAllocator)
