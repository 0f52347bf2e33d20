"""The fail-fast rules of allocation, checked against the allocator state
without changing it ([[RFC-0001:C-FAIL-FAST]]).

:class:`AllocationRules` answers "may this call go ahead?" for extend, decode
and free. Each check is one fused vectorised test on the fast path; only
when it fails does :meth:`AllocationRules.explain_extend` walk the rules in
order to name the first broken one, the request and the value. The allocator
runs these checks before it takes or returns any page.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidFree, UnsupportedPagePlan
from .free_lists import LaneFreeLists
from .inputs import int_vector
from . import layout
from .layout import floor_div, floor_mod, lane_base_of_last_loc


def pages_of(slots: np.ndarray, page_size: int) -> np.ndarray:
    """:func:`cpkv.contract.layout.page_of` (``s // S``, floor for negatives) of a host array."""
    return floor_div(slots, page_size)


def ends_prefix(last: np.ndarray, prefix: np.ndarray, page_size: int) -> np.ndarray:
    """Whether each ``last_loc`` sits at the page offset where a prefix of
    ``prefix`` tokens ends, ``(prefix - 1) % S``. [[RFC-0001:C-FAIL-FAST]]"""
    return _offset(last, page_size) == (prefix - 1) % page_size


def continues_chain(last: np.ndarray, prefix: np.ndarray, fill: np.ndarray, page_size: int,
                    pos: np.ndarray | None = None) -> np.ndarray:
    """The continuation rule: a chain of ``prefix`` tokens may grow from
    ``last_loc`` only where ``last_loc`` ends the prefix (:func:`ends_prefix`)
    and is the last written slot of its page (``fill - 1``, ``fill`` its fill mark); its lane
    base is then :func:`cpkv.contract.layout.lane_base_of_last_loc`. ``fill``
    are the fill marks of ``last_loc``'s pages (a page range the caller has
    checked). The one place cpkv states the rule: the allocation rules and the
    prefix cache both call it. [[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-REQUEST-RELATIVE]]

    With ``pos``, the pages' recorded chain positions, the rule and the chain
    position in one fused test, for a fast path: true where ``last_loc`` is
    its page's last written slot and that slot is position ``prefix - 1`` of
    the chain (``pos * S + fill == prefix``, which implies :func:`ends_prefix`);
    false also where the position is not recorded (``-1``), so false only
    says "not proven here"."""
    if pos is not None:
        return (pos * page_size + fill == prefix) & (_offset(last, page_size) + 1 == fill)
    return ends_prefix(last, prefix, page_size) & (fill - 1 == _offset(last, page_size))


def _offset(slots: np.ndarray, page_size: int) -> np.ndarray:
    """Page offset ``s % S``."""
    return floor_mod(slots, page_size)


def _first(mask: np.ndarray) -> int | None:
    return int(mask.nonzero()[0][0]) if np.count_nonzero(mask) else None


class AllocationRules:
    """Read-only checks over one :class:`LaneFreeLists` (``lists``)."""

    def __init__(self, lists: LaneFreeLists, page_size: int, padding: int, base_policy: str):
        self.lists, self.S, self.pad, self.base_policy = lists, page_size, padding, base_policy
        self.N, self.P = lists.cp_size, lists.num_pages
        self._scratch = np.zeros(self.P + 1, dtype=np.int32)  # for duplicate tests; never read unwritten
        self._iota = np.arange(self.P + 1)  # grown on demand (_idx); never written
        self._fits_any = self.N * int(lists.lane_pages.min())  # a chain this long fits every base

    # -- extend and decode ----------------------------------------------------------
    def check_extend(self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Raise :class:`UnsupportedPagePlan` unless every request may extend.

        Rules, in the order :meth:`explain_extend` reports them:
        ``negative-prefix``, ``prefix-longer-than-sequence``,
        ``last-loc-without-prefix``, ``slot-out-of-range`` (``last_loc`` not a
        slot of a usable page), ``inconsistent-last-loc`` (its page offset does
        not end the prefix), ``last-loc-not-allocated``, ``stale-last-loc``
        (not the last written slot of its page: the chain it ended has moved
        on, or the page was freed and handed to someone else) and
        ``shared-partial-page`` (two requests would extend one partial page).
        Returns ``(has_prefix, page of last_loc)``, or ``(None, None)`` when no
        request has a prefix.
        """
        S = self.S
        if not np.count_nonzero(prefix):  # a batch of fresh requests: no last_loc to check
            if np.count_nonzero(last != self.pad) or (seq.size and seq.min() < 0):
                self.explain_extend(prefix, seq, last)
            return None, None
        has = prefix > 0
        page = pages_of(last, S)
        usable = (page >= 1) & (page <= self.P)
        chain_ok = usable & continues_chain(last, prefix, self.lists.fill[np.where(usable, page, 0)], S)
        bad = (prefix < 0) | (prefix > seq) | np.where(has, ~chain_ok, last != self.pad)
        cont = has & (prefix % S != 0) & (seq > prefix)
        if np.count_nonzero(bad) or self._repeats(page[cont]):
            self.explain_extend(prefix, seq, last)
        return has, page

    def check_decode(self, prefix: np.ndarray, last: np.ndarray, shortest: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """All of :meth:`check_extend` and :meth:`check_chain` (without stamps)
        for a decode batch (``prefix = seq - 1``, ``shortest = seq.min()``) in
        one fused test, when every request continues a chain from a page whose
        chain position is recorded (:func:`continues_chain` with the chain
        positions). Returns ``(page of last_loc, whether last_loc ends its
        page, the fill marks of those pages)``, or None when the batch is not
        of that kind or some request fails the test (then
        :meth:`check_extend` and :meth:`check_chain` explain). Raises
        ``shared-partial-page`` as :meth:`check_extend` does.
        [[RFC-0001:C-FAIL-FAST]]"""
        if shortest < 2:
            return None
        S, lists = self.S, self.lists
        page = pages_of(last, S)
        fill = lists.fill.take(page, mode="clip")  # outside 1..P: the never-allocated page, which fails
        if np.count_nonzero(continues_chain(last, prefix, fill, S, lists.pos.take(page, mode="clip"))) < page.size:
            return None
        ends = fill == S  # last_loc is its page's last slot (the test tied fill to prefix: fill % S == prefix % S)
        if self._repeats(page) and self._repeats(page[~ends]):  # most batches share no page at all
            self.explain_extend(prefix, prefix + 1, last)
        return page, ends, fill

    def check_chain(self, prefix: np.ndarray, last: np.ndarray, gen: np.ndarray | None = None,
                    positions: bool = True) -> None:
        """Refuse a ``last_loc`` (already through :meth:`check_extend`: on an
        allocated page, at the prefix's offset, the page's last written slot)
        whose page has another recorded chain position than ``(prefix - 1) //
        S`` (``inconsistent-last-loc``; with ``positions``), or, with ``gen``
        (what :meth:`~cpkv.contract.allocator.OwnerLaneAllocator.slot_generations`
        said of each ``last_loc``), another stamp (``stale-last-loc``).
        Requests without a prefix are not checked."""
        has = prefix > 0
        if not has.any():
            return
        S, lists = self.S, self.lists
        page = pages_of(np.where(has, last, S), S)
        if positions:
            pos = lists.pos[page]
            bad = has & (pos >= 0) & (pos != floor_div(prefix - 1, S))
            if (r := _first(bad)) is not None:
                raise UnsupportedPagePlan(
                    "inconsistent-last-loc",
                    f"last_loc {last[r]} lies on the page at chain position {pos[r]}, but a prefix of {prefix[r]} "
                    f"tokens ends on page position {(prefix[r] - 1) // S} (do seq_lens include the new token?)", r)
        if gen is not None and (r := _first(has & (lists.gen[page] != gen))) is not None:
            raise UnsupportedPagePlan(
                "stale-last-loc", f"last_loc {last[r]} lies on page {page[r]}, handed out again since the request "
                f"got it (stamp {lists.gen[page[r]]}, the request holds {gen[r]})", r)

    def _idx(self, n: int) -> np.ndarray:
        """``np.arange(n)``, a view of one kept between calls."""
        if self._iota.size < n:
            self._iota = np.arange(max(n, 2 * self._iota.size))
        return self._iota[:n]

    def _repeats(self, pages: np.ndarray) -> bool:
        """Whether some page occurs twice (``pages`` are usable pages)."""
        if pages.size < 2:
            return False
        idx = self._idx(pages.size)
        self._scratch[pages] = idx
        return np.count_nonzero(self._scratch[pages] != idx) > 0

    def explain_extend(self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray) -> None:
        """Raise :class:`UnsupportedPagePlan` for the first broken rule of :meth:`check_extend`."""
        S, pad = self.S, self.pad
        if (r := _first(prefix < 0)) is not None:
            raise UnsupportedPagePlan("negative-prefix", f"prefix_len {prefix[r]} < 0", r)
        if (r := _first(prefix > seq)) is not None:
            raise UnsupportedPagePlan("prefix-longer-than-sequence", f"prefix_len {prefix[r]} > seq_len {seq[r]}", r)
        has = prefix > 0
        if (r := _first(~has & (last != pad))) is not None:
            raise UnsupportedPagePlan(
                "last-loc-without-prefix", f"prefix_len 0 needs last_loc {pad}, got {last[r]}", r
            )
        page = pages_of(last, S)
        if (r := _first(has & ((page < 1) | (page > self.P)))) is not None:
            raise UnsupportedPagePlan(
                "slot-out-of-range", f"last_loc {last[r]} is not a slot of a usable page (1..{self.P})", r
            )
        off = last - page * S
        fill = self.lists.fill[np.where(has, page, 0)]
        broken = has & ~continues_chain(last, prefix, fill, S)  # then name which part of the rule broke
        if (r := _first(broken & ~ends_prefix(last, prefix, S))) is not None:
            raise UnsupportedPagePlan(
                "inconsistent-last-loc",
                f"last_loc {last[r]} sits at page offset {off[r]}, but a prefix of "
                f"{prefix[r]} tokens ends at offset {(prefix[r] - 1) % S}",
                r,
            )
        if (r := _first(broken & (fill == 0))) is not None:
            raise UnsupportedPagePlan("last-loc-not-allocated", f"last_loc {last[r]} lies on free page {page[r]}", r)
        if (r := _first(broken)) is not None:
            raise UnsupportedPagePlan(
                "stale-last-loc",
                f"last_loc {last[r]} is not the last written slot of page {page[r]} "
                f"(that is {page[r] * S + fill[r] - 1}): its chain moved on or the page was reused",
                r,
            )
        cont = (has & (prefix % S != 0) & (seq > prefix)).nonzero()[0]
        _, first_use, counts = np.unique(page[cont], return_index=True, return_counts=True)
        dup = cont[np.isin(page[cont], page[cont][first_use[counts > 1]])]
        raise UnsupportedPagePlan(
            "shared-partial-page",
            f"requests {dup.tolist()} would all extend into partial page {page[dup[0]]}; "
            "give all but one a copy of that page",
            int(dup[1]),
        )

    def check_capacity(self, prefix: np.ndarray, seq: np.ndarray, has: np.ndarray | None, page: np.ndarray) -> None:
        """Raise ``UnsupportedPagePlan("exceeds-capacity")`` for a request whose
        whole chain (``ceil(seq / S)`` pages, its prefix pages included) could
        never be held, however much is freed: more pages than the cache, or, for
        a request whose lane base is fixed (by its prefix, or by the ``lane0``
        policy), more pages in one lane than that lane has. A request that could
        fit after eviction is left to the allocation, which returns None.
        ``has`` None means every request has a prefix, False that none has."""
        if seq.size == 0 or -(-int(seq.max()) // self.S) <= self._fits_any:
            return
        chain = -(-seq // self.S)
        N, lane_pages = self.N, self.lists.lane_pages
        if has is None or has is False:
            has = np.full(seq.size, has is None)
        if page is None:
            page = np.zeros(seq.size, dtype=np.int64)
        big = (chain > self._fits_any).nonzero()[0]
        fixed = has[big] | (self.base_policy == "lane0")
        base = np.where(has[big], lane_base_of_last_loc(page[big] * self.S, prefix[big], self.S, N), 0)
        n = chain[big]
        need = layout.chain_lane_pages(base, 0, n, N)
        never = np.where(fixed, (need > lane_pages).any(1), n > self.P)
        if (i := _first(never)) is not None:
            r = int(big[i])
            where = (f"lane base {base[i]} puts {need[i].max()} of them in lane {int(np.argmax(need[i] - lane_pages))}, "
                     f"which holds {lane_pages[int(np.argmax(need[i] - lane_pages))]}") if fixed[i] else \
                f"the cache holds {self.P}"
            raise UnsupportedPagePlan(
                "exceeds-capacity", f"seq_len {seq[r]} needs {n[i]} pages; {where}: it can never fit", r
            )

    # -- free -------------------------------------------------------------------------
    def pages_to_free(self, slots) -> np.ndarray | None:
        """The distinct pages holding ``slots`` (padding ignored), or None when
        there are none. Raises :class:`InvalidFree` for a slot outside the
        usable pages or a page that is not allocated (one freed earlier in the
        open free group is still allocated); ``TypeError``/``ValueError`` for a wrong input kind.

        No sort: when every run of ``S`` consecutive entries is one whole page
        in order (a request's slots) the pages are read at stride ``S``, after
        one comparison pass that proves it; otherwise every entry counts.
        """
        s = int_vector(slots, "slots")
        if s.size == 0:
            return None
        S = self.S
        rows = s.size // S
        pg = None
        if rows > 1 and S > 1:
            # every row of S entries is one whole page, in order, iff its head is
            # a page start, its tail ends that page and it rises strictly in between
            full = s[: rows * S]
            rises = np.empty(rows * S, dtype=bool)
            np.greater(full[1:], full[:-1], out=rises[:-1])
            rises[S - 1 :: S] = True  # between rows anything goes
            head, tail = full[::S], full[S - 1 :: S]
            if (np.count_nonzero(rises) == rises.size and not np.count_nonzero(floor_mod(head, S))
                    and np.count_nonzero(tail - head == S - 1) == rows):
                pg = np.concatenate([pages_of(head, S), pages_of(s[rows * S :], S)])
        if pg is None:
            pg = pages_of(s, S)
        lo, hi = int(pg.min()), int(pg.max())
        if lo < 0:  # padding, or a slot no layout has
            neg = s < 0
            if (s[neg] != self.pad).any():
                raise InvalidFree("free-out-of-range", f"slot {int(s[neg & (s != self.pad)][0])} is negative and not padding")
            pg = pages_of(s[~neg], S)
            if pg.size == 0:
                return None
            lo, hi = int(pg.min()), int(pg.max())
        if lo < 1 or hi > self.P:
            raise InvalidFree("free-out-of-range", f"page {lo if lo < 1 else hi} is not a usable page (1..{self.P})")
        pages = pg[self._last_of_each(pg)]
        self.check_freeable(pages)
        return pages

    def pages_to_free_by_page(self, pages) -> np.ndarray | None:
        """``pages`` checked as :meth:`pages_to_free` checks the pages of slots;
        a page given twice is a ``double-free`` too."""
        p = int_vector(pages, "pages")
        if p.size == 0:
            return None
        # one test for "usable" and "allocated": outside 1..P the gather reads a page never allocated
        if np.count_nonzero(self.lists.fill.take(p, mode="clip")) < p.size or self._repeats(p):
            lo, hi = int(p.min()), int(p.max())
            if lo < 1 or hi > self.P:
                raise InvalidFree("free-out-of-range", f"page {lo if lo < 1 else hi} is not a usable page (1..{self.P})")
            if np.count_nonzero(last := self._last_of_each(p)) < p.size:
                raise InvalidFree("double-free", f"page {int(p[~last][0])} is given twice")
            self.check_freeable(p)
        return p

    def _last_of_each(self, pages: np.ndarray) -> np.ndarray:
        """Mask of the last occurrence of each distinct page (usable pages only)."""
        idx = self._idx(pages.size)
        self._scratch[pages] = idx  # with repeats, the last write wins
        return self._scratch[pages] == idx

    def check_freeable(self, pages: np.ndarray) -> None:
        """Every page in ``pages`` (distinct, usable) is allocated;
        :class:`InvalidFree` otherwise. A page already freed in the open free
        group is still allocated and passes: the group frees the union of its
        calls, as SGLang's does."""
        free = self.lists.fill[pages] == 0
        if np.count_nonzero(free):
            raise InvalidFree("double-free", f"page {int(pages[free][0])} is not allocated (double free?)")
