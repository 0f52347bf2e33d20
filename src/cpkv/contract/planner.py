"""Planning one extend or decode batch against the allocator state, without
changing it: lane bases, the pages each lane hands out, the slots
(``out_cache_loc``, already on the device) and the fill marks to set.

:class:`BatchPlanner` answers; the allocator then commits the :class:`PendingAllocation`
in steps that cannot fail, so every fallible step (checks, the device copy)
runs before a page moves ([[RFC-0001:C-FAIL-FAST]]). Nothing loops per
request, page or token: the pages of a request cycle through consecutive
lanes, so a batch's pages come from per-lane counts and a few vectorised
passes ([[RFC-0001:C-OWNER-LANE]]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import layout, plan
from .errors import UnsupportedPagePlan
from .free_lists import LaneFreeLists
from .layout import floor_div, floor_mod, lane_base_of_last_loc, slot_at
from .rules import AllocationRules


#: A batch of one request takes its pages as one chain (:meth:`LaneFreeLists.peek_cycle`), its lane counts from
#: Python ints; False sends it through the general path, as the tests do to compare the two.
ONE_CHAIN = True


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    return x.cumsum() - x


def _device_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (no copy on the CPU)."""
    return torch.from_numpy(a).to(device)


def _expand_runs(first: np.ndarray, n: np.ndarray, total: int, iota: np.ndarray, device: torch.device | None
                 ) -> torch.Tensor:
    """Token-level slots of a batch on ``device``: run k is ``n[k]`` consecutive
    slots from ``first[k]``, the runs laid end to end (``total`` slots).

    One repeat of each run's offset and one add of ``iota`` (an ``arange`` at
    least ``total`` long). On the CPU (``device`` None) it is built in numpy
    and handed over without a copy; on another device the runs travel in one
    packed copy and the expansion runs there.
    """
    at = n.cumsum() - n
    if device is None:
        out = (first - at).repeat(n)
        out += iota[:total]
        return torch.from_numpy(out)
    off, n = _device_tensor(np.stack([first - at, n]), device)
    return torch.repeat_interleave(off, n, output_size=total) + torch.arange(total, device=device)


@dataclass
class PendingAllocation:
    """What one allocation will do, computed before anything changes (the
    allocator commits it, or keeps the deficit instead).

    ``new_pages [P]`` come ``lane_counts[l]`` from each lane and get fill marks
    ``new_fill`` (an array, or one value for all); ``grown`` are allocated
    pages the batch writes further (a full page among them keeps its mark),
    their new marks ``grown_fill``;
    ``new_positions`` are the new pages' request-local page positions;
    ``out`` is ``out_cache_loc`` on the device and ``host_plan`` makes the
    plan fields of :class:`~cpkv.contract.allocation.Allocation`; ``cursor``
    is the lane-base cursor once the batch is in.
    """

    out: torch.Tensor
    new_pages: np.ndarray
    lane_counts: np.ndarray
    new_fill: np.ndarray | int
    grown: np.ndarray | None
    grown_fill: np.ndarray | None
    host_plan: Callable[[], dict[str, np.ndarray]]
    new_positions: np.ndarray
    cursor: int


class BatchPlanner:
    """Plans extend and decode batches over ``lists`` (read only)."""

    def __init__(self, lists: LaneFreeLists, rules: AllocationRules, page_size: int, cp_size: int, base_policy: str,
                 device: torch.device):
        self.lists, self.rules = lists, rules
        self.S, self.N, self.base_policy, self.device = page_size, cp_size, base_policy, device
        self._expand_on = None if device.type == "cpu" else device  # None: build in numpy
        self._iota_cache = np.arange(0, dtype=np.int64)
        self._page_iota = torch.arange(page_size, device=device)  # the slot offsets of a page

    def _iota(self, n: int) -> np.ndarray:
        """``np.arange(k)`` for some ``k >= n``, kept between calls (never written)."""
        if self._iota_cache.size < n:
            self._iota_cache = np.arange(max(n, 2 * self._iota_cache.size), dtype=np.int64)
        return self._iota_cache

    def extend(self, prefix, seq, last, total: int, has, last_page, wanted=None) -> PendingAllocation | np.ndarray:
        """An extend batch that passed :meth:`AllocationRules.check_extend` and
        ``check_capacity`` (``total`` new tokens): the :class:`PendingAllocation`, or the
        per-lane deficit when some lane lacks pages. ``wanted [bs]`` (checked; None for none): a request's
        given lane base, -1 where the policy picks."""
        S, N, lists = self.S, self.N, self.lists
        # request level: lane bases and pages per lane  [[RFC-0001:C-REQUEST-RELATIVE]]
        fresh = has is None
        n_new = floor_div(seq + (S - 1), S)
        if fresh:  # no request has a prefix
            ext, first_new = seq, 0
            if wanted is None:
                base, cursor = plan.choose_lane_bases(None, None, 0, n_new, lists.free, N, self.base_policy,
                                                      lists.cursor)
            else:  # the given bases are fixed, the rule picks the rest
                given = wanted >= 0
                base, cursor = plan.choose_lane_bases(np.maximum(wanted, 0), given, np.zeros_like(seq), n_new,
                                                      lists.free, N, self.base_policy, lists.cursor)
        else:
            ext, first_new = seq - prefix, floor_div(prefix + (S - 1), S)
            n_new -= first_new
            fixed, kept = np.where(has, lane_base_of_last_loc(last, prefix, S, N), 0), has
            if wanted is not None:  # a given base of a request with a prefix is the one its last_loc continues
                fixed, kept = np.where(has, fixed, np.maximum(wanted, 0)), has | (wanted >= 0)
            base, cursor = plan.choose_lane_bases(fixed, kept, first_new, n_new, lists.free, N, self.base_policy,
                                                  lists.cursor)
        ends = n_new.cumsum()
        starts = ends - n_new
        n = int(ends[-1]) if ends.size else 0
        iota = self._iota(max(total, n + seq.size))
        # page level: a request's pages cycle through the lanes from its first; every lane
        # hands out its pages in batch order  [[RFC-0001:C-OWNER-LANE]]
        if ONE_CHAIN and seq.size == 1:  # one chain: page j is the (j // N)-th page the batch takes from lane (first + j) % N
            f = (int(base[0]) + (0 if fresh else int(first_new[0]))) % N  # layout.lane_of_position
            lane_counts = layout.chain_lane_pages(f, 0, n, N)
            if (deficit := lists.deficit(lane_counts)) is not None:
                return deficit
            new_pages, j = lists.peek_cycle(f, n), iota[:n]
        else:
            take = plan.lane_take(base, first_new, n_new, N)
            lane_counts = take.lane_counts
            if (deficit := lists.deficit(lane_counts)) is not None:
                return deficit
            new_pages, j = lists.peek_chains(take.first_lane, take.before, n_new, starts, n, iota)
        partial = None if fresh else has & (prefix % S != 0) & (ext > 0)
        grown = grown_fill = None
        if (partial is None or not np.count_nonzero(partial)) and total == new_pages.size * S:  # whole new pages only
            written = S  # one broadcast on the device (torch's is faster than numpy's on the CPU)
            out = slot_at(_device_tensor(new_pages * S, self.device)[:, None], self._page_iota, S).view(-1)
        else:
            written = np.full(new_pages.size, S, dtype=np.int64)  # slots written on each new page
            last_new, tail = starts + n_new - 1, seq - (first_new + n_new - 1) * S  # each request's last new page
            if np.count_nonzero(n_new) == n_new.size:
                written[last_new] = tail
            else:
                grows = n_new > 0
                written[last_new[grows]] = tail[grows]
            if partial is not None and np.count_nonzero(partial):  # a run into the partial page before the request's new pages
                lead = partial.astype(np.int64)
                mask = np.ones(new_pages.size + int(lead.sum()), dtype=bool)
                mask[(starts + lead.cumsum() - lead)[partial]] = False  # where those runs go
                runs, n = np.empty(mask.size, dtype=np.int64), np.empty(mask.size, dtype=np.int64)
                runs[mask], n[mask] = new_pages * S, written
                runs[~mask] = last[partial] + 1
                n[~mask] = np.minimum(seq[partial], first_new[partial] * S) - prefix[partial]
                out = _expand_runs(runs, n, total, iota, self._expand_on)
                grown, grown_fill = last_page[partial], np.minimum(seq[partial] - prefix[partial] // S * S, S)
            else:
                out = _expand_runs(new_pages * S, written, total, iota, self._expand_on)

        positions = j if fresh else first_new.repeat(n_new) + j

        def host_plan():
            return {"prefix_lens": prefix, "seq_lens": seq, "extend_lens": ext, "extend_start_loc": _excl_cumsum(ext),
                    "lane_base": base, "new_page_start": starts, "new_pages": new_pages,
                    "new_page_owners": floor_mod(new_pages, N), "new_page_positions": positions}

        return PendingAllocation(out, new_pages, lane_counts, written, grown, grown_fill, host_plan, positions,
                                 cursor)

    def decode(self, seq: np.ndarray, last: np.ndarray, gen: np.ndarray | None) -> PendingAllocation | np.ndarray:
        """A decode batch (``seq [bs]`` include the new token, ``last [bs]`` the
        previous token's slot, padding for none; ``gen`` their stamps or
        None), checked here: the :class:`PendingAllocation`, or the per-lane
        deficit. Raises as an extend with ``prefix = seq - 1`` would, plus
        ``empty-decode`` for ``seq < 1``."""
        S, N, lists, rules = self.S, self.N, self.lists, self.rules
        if last.size != seq.size:
            raise UnsupportedPagePlan("mismatched-lengths", f"{seq.size} seq_lens, {last.size} last_loc")
        shortest = int(seq.min()) if seq.size else 1
        if shortest < 1:
            r = int((seq < 1).nonzero()[0][0])
            raise UnsupportedPagePlan("empty-decode", f"decode needs seq_len >= 1, got {seq[r]}", r)
        prefix = seq - 1  # a fresh array: the caller's seq_lens may change after the call
        base, cursor = None, lists.cursor
        if (fast := rules.check_decode(prefix, last, shortest)) is not None:  # every request goes on its chain
            last_page, needs, fill = fast
            rules.check_capacity(prefix, seq, None, last_page)
            if gen is not None:
                rules.check_chain(prefix, last, gen, positions=False)
            grown, grown_fill = last_page, fill + ~needs  # a full page keeps its mark: S, written again
            idx = needs.nonzero()[0]
            lanes = floor_mod(last_page[idx] + 1, N)  # the lane after the last page's: owner(p) + 1 = (p + 1) % N
        else:
            has, last_page = rules.check_extend(prefix, seq, last)
            rules.check_capacity(prefix, seq, False if has is None else has, last_page)
            needs = floor_mod(prefix, S) == 0  # the prefix ended its page, or there is none
            idx = needs.nonzero()[0]
            if has is None:
                has = np.zeros(seq.size, dtype=bool)
                last_page = np.zeros(seq.size, dtype=np.int64)
            else:
                rules.check_chain(prefix, last, gen)
            grown = last_page[~needs]
            grown_fill = lists.fill[grown] + 1
            lanes = floor_mod(last_page[idx] + 1, N)
            if not has.all():  # fresh requests: the lane-base rule for the whole batch
                fixed = np.where(has, lane_base_of_last_loc(last, prefix, S, N), 0)
                base, cursor = plan.choose_lane_bases(fixed, has, floor_div(prefix, S), needs.astype(np.int64),
                                                      lists.free, N, self.base_policy, cursor)
                lanes = np.where(has[idx], lanes, base[idx])
        counts = np.bincount(lanes, minlength=N)
        if (deficit := lists.deficit(counts)) is not None:
            return deficit
        new_pages = lists.peek_unordered(lanes, counts, self._iota(lanes.size))
        slots = last + 1
        slots[idx] = new_pages * S
        positions = floor_div(prefix[idx], S)

        def host_plan():  # every request has a prefix unless ``base`` was chosen
            b = lane_base_of_last_loc(last_page * S, prefix, S, N) if base is None else base  # last may change
            return {
                "prefix_lens": prefix, "seq_lens": prefix + 1, "extend_lens": np.ones(prefix.size, dtype=np.int64),
                "extend_start_loc": np.arange(prefix.size), "lane_base": b,
                "new_page_start": _excl_cumsum(needs.astype(np.int64)), "new_pages": new_pages,
                "new_page_owners": lanes, "new_page_positions": positions,
            }

        return PendingAllocation(_device_tensor(slots, self.device), new_pages, counts, 1, grown, grown_fill,
                                 host_plan, positions, cursor)
