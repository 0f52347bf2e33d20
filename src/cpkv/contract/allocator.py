"""The owner-lane paged allocator: the core an engine calls.

:class:`OwnerLaneAllocator` checks inputs, commits plans and answers
questions. Its parts: :class:`~cpkv.contract.free_lists.LaneFreeLists` holds
the state (one free list per owner lane, a fill mark per page) and is the only
code that changes it; :class:`~cpkv.contract.rules.AllocationRules` answers
whether a call may go ahead; :class:`~cpkv.contract.planner.BatchPlanner` plans
an extend or decode batch and builds its result without changing anything.
SGLang's call shapes (``alloc_extend``, ``alloc_decode``, ``alloc``, segment
frees, retraction copies) are an adapter over this core,
:class:`cpkv.contract.sglang.SGLangAllocator`. Invariants, held after every
call:

* every usable page is either on exactly one free list (its own lane's) or
  allocated, never both; per lane, free + allocated == the lane's pages;
* an allocated page's fill mark is how many of its slots are handed out, and a
  chain continues only from the last of them;
* after a successful extend or decode, every new slot of request r at position
  t lies on a page owned by ``(b_r + t // S) % N`` ([[RFC-0001:C-OWNER-LANE]]);
* ``out_cache_loc`` is flattened in request order, then position order
  ([[RFC-0001:C-FLATTENED-ORDER]]);
* a call that cannot fit now returns None and one that can never fit, or is
  wrong, raises; either way the state is exactly as it was: every step that
  can fail (checks, the result on the device) runs before a page moves
  ([[RFC-0001:C-FAIL-FAST]]);
* the result depends only on the inputs and the state, so N ranks running N
  allocators on the same calls agree to the byte with no communication
  ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).

Control state lives on the host in numpy, as a scheduler's does; results are
torch tensors on ``device``. Nothing loops per request, page or token.
"""

from __future__ import annotations

import numpy as np
import torch

from . import plan
from .allocation import Allocation
from .errors import UnsupportedPagePlan
from .planner import BatchPlanner, PendingAllocation, _device_tensor
from .free_lists import AllocatorState, LaneFreeLists, rank_in_lane
from .inputs import int_scalar, int_vector, usable_device
from .kv_row import RowPlacement
from .layout import SharedKVLayout, lane_base_of_last_loc, lane_of_position
from .rules import AllocationRules, pages_of

__all__ = ["Allocation", "AllocatorState", "OwnerLaneAllocator", "RowPlacement"]


class OwnerLaneAllocator:
    """Paged KV allocator with one free list per owner lane.

    ``size`` tokens make ``size // page_size`` usable pages, numbered from 1
    (SGLang's ``size`` and ``page_size``). ``base_policy`` picks lane bases for
    requests without a prefix: ``"least_full"`` (default; the lane-base rule of
    :func:`~cpkv.contract.plan.choose_lane_bases`), ``"least_full_lowest"``
    (SGLang's kv-shard rule: the lane with the most free pages, ties to the
    lowest) or ``"lane0"`` (a baseline). ``layout``, if given, must agree with
    ``page_size`` and ``cp_size`` and hold every page. Results are torch
    tensors on ``device``, which must be usable here (``ValueError``
    otherwise). ``need_sort`` (SGLang's flag): keep every lane's free list
    sorted, so the lowest free page of a lane is handed out next; off, a
    lane hands out its most recently freed page first. Inputs are 1-D int32/int64 tensors (any device), arrays or
    lists of ints; anything else is refused (``TypeError``/``ValueError``).
    :meth:`for_layout` builds the allocator of a whole layout.

    The verbs: ``allocate_extend`` / ``allocate_decode`` (a batch, with its
    owner plan), ``alloc_pages_with_owners`` (pages by lane), ``free`` /
    ``free_pages``; the state: ``clear``, ``backup_state`` /
    ``restore_state``, free groups; questions that change nothing. SGLang's
    call shapes live in :class:`cpkv.contract.sglang.SGLangAllocator`, an
    adapter over this class; nothing is attached to it from outside.
    """

    def __init__(self, size: int, page_size: int, cp_size: int, device: str | torch.device = "cpu", *,
                 base_policy: str = "least_full", layout: SharedKVLayout | None = None, need_sort: bool = False):
        size, page_size, cp_size = (int_scalar(v, n) for v, n in ((size, "size"), (page_size, "page_size"),
                                                                   (cp_size, "cp_size")))
        if page_size < 1 or cp_size < 1:
            raise ValueError(f"page_size and cp_size must be >= 1, got {page_size}, {cp_size}")
        num_pages = size // page_size
        if num_pages < 1:
            raise ValueError(f"size {size} holds no page of {page_size} tokens")
        if base_policy not in plan.BASE_POLICIES:
            raise ValueError(f"unknown base_policy {base_policy!r}; choose from {plan.BASE_POLICIES}")
        if layout is None:
            layout = SharedKVLayout(cp_size, page_size, -(-(num_pages + 1) // cp_size))
        elif layout.slots_per_page != page_size or layout.cp_size != cp_size or layout.num_pages < num_pages + 1:
            raise UnsupportedPagePlan(
                "layout-mismatch",
                f"allocator (page_size={page_size}, cp_size={cp_size}, pages 1..{num_pages}) does not fit {layout}",
            )
        self.device = usable_device(device)
        self.size, self.page_size, self.cp_size, self.num_pages = size, page_size, cp_size, num_pages
        self.base_policy, self.layout, self.need_sort = base_policy, layout, bool(need_sort)
        self._lists = LaneFreeLists(num_pages, cp_size, self.need_sort)
        self._rules = AllocationRules(self._lists, page_size, layout.padding_value, base_policy)
        self.lane_pages = self._lists.lane_pages
        self.last_deficit: np.ndarray | None = None
        self._planner = BatchPlanner(self._lists, self._rules, page_size, cp_size, base_policy, self.device)

    @classmethod
    def for_layout(cls, layout: SharedKVLayout, device: str | torch.device = "cpu", *,
                   base_policy: str = "least_full", need_sort: bool = False) -> OwnerLaneAllocator:
        """The allocator of every usable page of ``layout`` (all its pages but
        the reserved page 0), with its page and CP size; ``TypeError`` for
        anything but a :class:`SharedKVLayout`, ``ValueError`` for a layout
        with no usable page."""
        if not isinstance(layout, SharedKVLayout):
            raise TypeError(f"for_layout takes a SharedKVLayout, got {type(layout).__name__}")
        S = layout.slots_per_page
        return cls((layout.num_pages - 1) * S, S, layout.cp_size, device, base_policy=base_policy, layout=layout,
                   need_sort=need_sort)

    # -- questions ----------------------------------------------------------------------
    def lane_free_pages(self) -> list[int]:
        """Free pages per lane."""
        return self._lists.free.tolist()

    def lane_free_lists(self) -> list[np.ndarray]:
        """Each lane's free pages (int64, copies), the one handed out next
        first. O(free pages): for inspection, not a hot path."""
        lists = self._lists
        return [lists.stack[lane, : lists.free[lane]][::-1].copy() for lane in range(self.cp_size)]

    def lane_for_new_chain(self, position: int, prefer: int | None = None, pages: int | None = None) -> int:
        """Lane for a request's first own page at request-local position
        ``position`` when nothing fixes it yet, as the next fresh request of
        an extend would get it: under ``least_full`` the lane
        :func:`~cpkv.contract.plan.fresh_lane` gives for the free counts and
        the allocator's cursor (``pages``, the chain's new pages if known,
        decides whether its remainder is zero; ``prefer`` wins if it has the
        most free pages and the remainder is not known to be zero), or the lane that gives base 0
        (``lane0``). A question: the cursor does not move.
        [[RFC-0001:C-REQUEST-RELATIVE]]"""
        free, N = self._lists.free, self.cp_size
        if self.base_policy == "lane0":
            return int(lane_of_position(0, position, N))
        if N == 1:
            return 0
        if self.base_policy == "least_full_lowest":  # SGLang's kv-shard rule: the most free, ties to the lowest
            return int(lane_of_position(int(np.argmax(free)), position, N))
        rem = None if pages is None else int(pages) % N
        if prefer is not None and rem != 0 and free[prefer] == free.max():
            return int(prefer)
        return plan.fresh_lane(free, self._lists.cursor, rem)

    def snapshot(self) -> tuple:
        """The whole state as a hashable value (free lists in order, fill marks,
        pages pending in an open free group), for tests and debugging."""
        return self._lists.snapshot()

    def is_allocated(self, pages) -> np.ndarray:
        """Whether each page ``[n]`` is currently handed out (bool ``[n]``)."""
        p = int_vector(pages, "pages")
        if p.size and (p.min() < 0 or p.max() > self.num_pages):
            raise IndexError(f"pages must lie in 0..{self.num_pages}")
        return self._lists.fill[p] > 0

    def page_fill(self, pages) -> np.ndarray:
        """How many slots of each page are written (0 for a free page)."""
        return self._lists.fill[int_vector(pages, "pages")].copy()

    def slot_generations(self, slots) -> np.ndarray:
        """The allocation stamp of the page of each slot ``[n]`` (int64; 0 for
        a free page or padding). Every allocation call stamps the pages it
        hands out with a number no call got before, so a request that keeps
        ``slot_generations([last_loc])`` next to its ``last_loc`` and passes
        it as ``last_loc_gen`` is refused (``stale-last-loc``) once that page
        was freed, even after another request refilled it to the same mark.
        Raises ``IndexError`` for a slot outside the usable pages."""
        s = int_vector(slots, "slots")
        pad = s == self.layout.padding_value
        p = pages_of(np.where(pad, self.page_size, s), self.page_size)
        if p.size and (p.min() < 1 or p.max() > self.num_pages):
            raise IndexError(f"slots must lie on pages 1..{self.num_pages} (or be padding)")
        return np.where(pad | (self._lists.fill[p] == 0), 0, self._lists.gen[p])

    # -- SGLang's state surface ---------------------------------------------------------
    def clear(self) -> None:
        """Every page back on its lane's free list, lowest page on top; an open
        free group is dropped with it."""
        self._lists.clear()

    def backup_state(self) -> AllocatorState:
        """A copy of the whole state (free lists, fill marks), as SGLang's
        ``backup_state``: hand it to :meth:`restore_state` to undo every
        allocation and free made since (speculative decoding does)."""
        return self._lists.copy_out(self.size, self.page_size)

    def restore_state(self, state: AllocatorState) -> None:
        """Put a :meth:`backup_state` copy back. Refuses (``TypeError``) what is
        not one, (``ValueError``) one taken from an allocator of another size,
        page size or CP size, and (``RuntimeError``) while frees wait in an
        open free group; nothing changes then. A state may be restored twice."""
        if not isinstance(state, AllocatorState):
            raise TypeError(f"restore_state takes what backup_state returned, got {type(state).__name__}")
        mine = (self.size, self.page_size, self.cp_size)
        if (state.size, state.page_size, state.cp_size) != mine:
            raise ValueError(f"state of another allocator: size, page_size, cp_size = "
                             f"{(state.size, state.page_size, state.cp_size)}, this one has {mine}")
        if self._lists.pending is not None and self._lists.pending.any():
            raise RuntimeError("restore_state while frees wait in an open free group; end the group first")
        self._lists.copy_in(state)

    def free_group_begin(self) -> None:
        """Open a free group (SGLang): later frees are checked when made but
        done together at :meth:`free_group_end`, which frees the union of
        their pages. A page named by several calls of the group (two slot
        ranges that share a page) is freed once; a page that was free before
        the group is still a ``double-free``, raised by the call that names
        it, and that call adds nothing to the group. Raises ``RuntimeError``
        if a group is open already."""
        if self._lists.pending is not None:
            raise RuntimeError("a free group is open already")
        self._lists.pending = self._lists.page_bitmap()

    def free_group_end(self) -> None:
        """Close the free group, freeing every page collected in it in one go
        (the lowest of them handed out first, as SGLang's ``free`` orders a
        freed batch). Raises ``RuntimeError`` if none is open."""
        pending = self._lists.pending
        if pending is None:
            raise RuntimeError("no free group is open")
        self._lists.pending = None
        self._lists.put(pending.nonzero()[0][::-1])  # the lowest page handed out first, as SGLang's free does

    # -- page level -------------------------------------------------------------------------
    def alloc_pages_with_owners(self, owners, fill=None) -> torch.Tensor | None:
        """int64 pages ``[n]`` on ``device``, page i in lane ``owners[i]``;
        ``None`` (state unchanged, ``last_deficit`` set) if a lane lacks pages.

        ``fill[i]`` (1..S) is how many of page i's slots the caller writes
        itself; a chain may continue from slot ``page*S + fill[i] - 1``. The
        prefix cache copies k matched tokens into a fresh page and continues
        from there: ``fill=[k]``. ``None`` means whole pages: only a
        continuation from a page's last slot is legal. Raises
        ``UnsupportedPagePlan`` (``owner-out-of-range``, ``fill-out-of-range``,
        ``mismatched-lengths``) before anything changes.
        """
        owners = int_vector(owners, "owners")
        N, S = self.cp_size, self.page_size
        if owners.size and (owners.min() < 0 or owners.max() >= N):
            bad = int(((owners < 0) | (owners >= N)).nonzero()[0][0])
            raise UnsupportedPagePlan("owner-out-of-range", f"owner {owners[bad]} not in [0, {N})", bad)
        if fill is None:
            fill = np.full(owners.size, S, dtype=np.int64)
        else:
            fill = int_vector(fill, "fill").copy()
            if fill.size != owners.size:
                raise UnsupportedPagePlan("mismatched-lengths", f"{owners.size} owners but {fill.size} fill marks")
            if fill.size and (fill.min() < 1 or fill.max() > S):
                bad = int(((fill < 1) | (fill > S)).nonzero()[0][0])
                raise UnsupportedPagePlan("fill-out-of-range", f"fill {fill[bad]} not in [1, {S}]", bad)
        counts = np.bincount(owners, minlength=N)
        if (deficit := self._lists.deficit(counts)) is not None:
            self.last_deficit = deficit
            return None
        pages = self._lists.peek(owners, rank_in_lane(owners, counts))
        out = _device_tensor(pages, self.device)
        self._lists.take(pages, counts, fill)
        return out

    def free(self, slots) -> None:
        """Return the pages holding ``slots [n]`` (int32/int64) to their own lanes.

        Padding is ignored. Raises :class:`~cpkv.contract.errors.InvalidFree`
        and frees nothing if a slot is outside the usable pages
        (``free-out-of-range``) or a page is not allocated (``double-free``).
        Inside a free group the pages stay allocated until its end, and a page
        an earlier call of the group named already is not a double free. No sort:
        pages come from the slots at stride ``S`` when they are in page runs.
        """
        pages = self._rules.pages_to_free(slots)
        if pages is not None:
            self._release(pages)

    def free_pages(self, pages) -> None:
        """Return ``pages [n]`` to their lanes, as :meth:`free` does for slots;
        a page listed twice is a ``double-free`` too."""
        pages = self._rules.pages_to_free_by_page(pages)
        if pages is not None:
            self._release(pages)

    def _release(self, pages: np.ndarray) -> None:
        """Free ``pages`` (checked): the first one given is handed out first,
        as SGLang puts a freed run at the front of its free list."""
        if self._lists.pending is not None:
            self._lists.pending[pages] = True
        else:
            self._lists.put(pages[::-1])

    # -- extend / decode ----------------------------------------------------------------------
    def allocate_extend(self, prefix_lens_cpu, seq_lens_cpu, last_loc, extend_num_tokens=None, *, last_loc_gen=None,
                        lane_bases=None):
        """Allocate the new slots of a batch on owner lanes, with the batch plan.

        ``prefix_lens_cpu``, ``seq_lens_cpu``, ``last_loc`` ``[bs]``
        (``last_loc`` the last prefix slot, padding for none). Returns an
        :class:`Allocation`, or ``None`` when some lane lacks pages
        (``last_deficit`` says how many per lane; nothing changed). Raises
        :class:`UnsupportedPagePlan` for a plan the owner-lane path cannot
        honour or a request that can never fit (``exceeds-capacity``), before
        anything changes.

        What a ``last_loc`` is checked against: its page offset ends the
        prefix, it is its page's last written slot (the fill mark), and,
        when the page was taken by an extend or decode (which record each
        page's chain position), its page is at chain position
        ``(prefix - 1) // S`` (``inconsistent-last-loc``; at page size 1 this
        is the only check that sees a ``prefix_lens`` off by some tokens).
        ``last_loc_gen [bs]`` (optional; ignored where there is no prefix) is
        what :meth:`slot_generations` said of each ``last_loc`` when the
        request got it; a page freed and handed out again since has another
        stamp (``stale-last-loc``). Without it, a ``last_loc`` kept from a
        request whose page was freed and refilled by another request to the
        same mark and chain position cannot be told from the new owner's.

        ``lane_bases [bs]`` (optional; SGLang's kv-shard ``rotation_bases``):
        each request's lane base, or -1 where the ``base_policy`` picks it (the
        pages of the batch's earlier requests counted). A fresh request takes
        the base given; a request with a prefix must be given the base its
        ``last_loc`` continues, ``(owner(last_loc) - (prefix - 1) // S) mod
        N``, or -1 (``lane-base-changed`` otherwise: another base would put its
        new pages on lanes that break its chain's owner lanes,
        [[RFC-0001:C-OWNER-LANE]]); a base outside ``[-1, N)`` is
        ``lane-base-out-of-range``. The bases used are the result's
        ``lane_base``.
        """
        prefix, seq, last = self._lengths(prefix_lens_cpu, seq_lens_cpu, last_loc)
        gen = self._gens(last_loc_gen, seq.size)
        has, last_page = self._rules.check_extend(prefix, seq, last)
        wanted = self._wanted_bases(lane_bases, prefix, last, seq.size)
        self._rules.check_capacity(prefix, seq, False if has is None else has, last_page)
        if has is not None:
            self._rules.check_chain(prefix, last, gen)
        total = int(seq.sum()) if has is None else int((seq - prefix).sum())
        if extend_num_tokens is not None and int_scalar(extend_num_tokens, "extend_num_tokens") != total:
            raise UnsupportedPagePlan(
                "extend-num-tokens", f"extend_num_tokens={extend_num_tokens} but seq_lens - prefix_lens sum to {total}"
            )
        return self._commit(self._planner.extend(prefix, seq, last, total, has, last_page, wanted))

    def allocate_decode(self, seq_lens_cpu, last_loc, *, last_loc_gen=None) -> Allocation | None:
        """One new token per request (``seq_lens`` include it; ``last_loc`` is
        the previous token's slot, padding for none): the same result, state
        and refusals as :meth:`allocate_extend` with ``prefix_lens = seq_lens -
        1``, on a fast path. The new slot is ``last_loc + 1`` unless
        ``last_loc`` ends its page; then the request takes one page from lane
        ``(owner(last_loc) + 1) % N``. A fresh request (no ``last_loc``) takes
        a lane by the lane-base rule. ``seq_lens`` that miss the new token
        name the previous token's position for it: refused
        (``inconsistent-last-loc``) wherever the page of ``last_loc`` has a
        recorded chain position, as at page size 1 after an extend or decode;
        ``last_loc_gen`` as in :meth:`allocate_extend`."""
        seq, last = int_vector(seq_lens_cpu, "seq_lens"), int_vector(last_loc, "last_loc")
        gen = self._gens(last_loc_gen, seq.size)
        return self._commit(self._planner.decode(seq, last, gen))

    def _wanted_bases(self, lane_bases, prefix: np.ndarray, last: np.ndarray, bs: int) -> np.ndarray | None:
        """``lane_bases`` checked (see :meth:`allocate_extend`): None when no base is given."""
        if lane_bases is None:
            return None
        wanted, N = int_vector(lane_bases, "lane_bases").copy(), self.cp_size
        if wanted.size != bs:
            raise UnsupportedPagePlan("mismatched-lengths", f"{bs} requests but {wanted.size} lane_bases")
        if wanted.size and (wanted.min() < -1 or wanted.max() >= N):
            r = int(((wanted < -1) | (wanted >= N)).nonzero()[0][0])
            raise UnsupportedPagePlan("lane-base-out-of-range", f"lane base {wanted[r]} not in [0, {N}) or -1", r)
        has = (prefix > 0) & (wanted >= 0)
        if np.count_nonzero(has):
            implied = lane_base_of_last_loc(np.where(has, last, 0), prefix, self.page_size, N)
            if (bad := has & (wanted != implied)).any():
                r = int(bad.nonzero()[0][0])
                raise UnsupportedPagePlan(
                    "lane-base-changed", f"lane base {wanted[r]} given, but last_loc {last[r]} continues a chain of "
                    f"lane base {implied[r]}: the new pages would leave its owner lanes", r)
        return wanted if np.count_nonzero(wanted >= 0) else None

    @staticmethod
    def _gens(last_loc_gen, bs: int) -> np.ndarray | None:
        if last_loc_gen is None:
            return None
        gen = int_vector(last_loc_gen, "last_loc_gen")
        if gen.size != bs:
            raise UnsupportedPagePlan("mismatched-lengths", f"{bs} requests but {gen.size} last_loc_gen")
        return gen

    def _commit(self, batch: PendingAllocation | np.ndarray) -> Allocation | None:
        """Apply a checked, planned batch (nothing here can fail), or record the
        per-lane deficit of a refused one."""
        if isinstance(batch, np.ndarray):
            self.last_deficit = batch
            return None
        lists = self._lists
        lists.take(batch.new_pages, batch.lane_counts, batch.new_fill, batch.new_positions)
        lists.cursor = batch.cursor
        if batch.grown is not None:
            lists.write(batch.grown, batch.grown_fill)
        return Allocation(batch.out, self.page_size, self.cp_size, batch.host_plan)

    def _lengths(self, prefix, seq, last) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host copies of a batch's prefix lengths, sequence lengths and last
        slots, refused unless they are int vectors of one length."""
        prefix, seq = int_vector(prefix, "prefix_lens").copy(), int_vector(seq, "seq_lens").copy()
        last = int_vector(last, "last_loc")
        if prefix.size != seq.size or last.size != seq.size:
            raise UnsupportedPagePlan(
                "mismatched-lengths", f"{prefix.size} prefix_lens, {seq.size} seq_lens, {last.size} last_loc"
            )
        return prefix, seq, last
