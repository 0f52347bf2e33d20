"""A misuse state machine: random valid calls interleaved with random invalid
ones. After an invalid call: the right error type and rule, and every
component's snapshot exactly as before. After a valid call: every invariant.

The machine drives *components*; :class:`AllocatorComponent` is the first.
Another part of the system (a prefix cache over the same allocator) joins by
subclassing :class:`Component` and overriding :meth:`MisuseMachine.components_for`.
[[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FLATTENED-ORDER]]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from cpkv import OwnerLaneAllocator, SGLangAllocator, UnsupportedPagePlan


@dataclass
class Misuse:
    """An invalid call and what it must raise (``rule`` checked when given)."""

    what: str
    call: Callable[[], object]
    error: type
    rule: str | None = None


class Component:
    """One part of the system under test. ``valid_calls`` and ``invalid_calls``
    are lists of functions of a hypothesis ``data`` object; a valid one makes
    a call and checks its result, an invalid one returns a :class:`Misuse` (or
    None when it does not apply to the current state)."""

    def snapshot(self):
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def valid_calls(self) -> list[Callable]:
        raise NotImplementedError

    def invalid_calls(self) -> list[Callable]:
        raise NotImplementedError


BAD_KINDS = [
    (lambda v: torch.tensor(v, dtype=torch.float32), TypeError),
    (lambda v: torch.tensor(v).bool(), TypeError),
    (lambda v: torch.tensor(v, dtype=torch.complex64), TypeError),
    (lambda v: torch.tensor(v, dtype=torch.int16), TypeError),
    (lambda v: torch.tensor(v).view(1, -1), ValueError),
    (lambda v: np.array(v, dtype=np.float64), TypeError),
    (lambda v: np.array(v).reshape(1, -1), ValueError),
    (lambda v: [float(x) for x in v], TypeError),
    (lambda v: [bool(x % 2) for x in v], TypeError),
    (lambda v: [list(v)], TypeError),
]


class AllocatorComponent(Component):
    """An :class:`OwnerLaneAllocator` and a plain model of what it handed out:
    requests (slots in position order, lane base), frees pending in an open
    free group, requests that ended (their old ``last_loc``), backups.

    ``allocator`` shares one allocator with other components; each of them
    adds a function to ``co_holders`` that returns the slots it holds, so the
    page accounting in :meth:`check` covers every holder."""

    def __init__(self, cp: int, S: int, lane_pages: int, allocator: OwnerLaneAllocator | None = None):
        self.N, self.S = cp, S
        self.a = allocator if allocator is not None else OwnerLaneAllocator(lane_pages * cp * S, S, cp)
        self.sg = SGLangAllocator.over(self.a)  # SGLang's call shapes over the same allocator
        self.m = {"reqs": {}, "pending": set(), "gone": [], "group": False, "next": 0}
        self.backups = []
        self.co_holders: list[Callable[[], list[int]]] = []

    # -- model helpers ----------------------------------------------------------------------
    @property
    def reqs(self):
        return self.m["reqs"]

    def _active(self):
        return sorted(r for r in self.reqs if r not in self.m["pending"])

    def _last(self, rid):
        s = self.reqs[rid]["slots"]
        return s[-1] if s else -1

    def _free_pages(self):
        return np.flatnonzero(~self.a.is_allocated(np.arange(self.a.num_pages + 1)))[1:]

    def _never_fits(self, ids, seq):
        for rid, n in zip(ids, seq):
            chain = -(-n // self.S)
            if rid not in self.reqs:
                if chain > self.a.num_pages:
                    return True
            elif (np.bincount((self.reqs[rid]["base"] + np.arange(chain)) % self.N, minlength=self.N)
                  > self.a.lane_pages).any():
                return True
        return False

    def _record(self, ids, prefix, seq, res):
        out = res.out_cache_loc.tolist()
        starts = res.extend_start_loc.tolist()
        assert starts == list(np.cumsum([0] + [s - p for p, s in zip(prefix, seq)])[:-1]), "flattened order"
        assert len(out) == sum(s - p for p, s in zip(prefix, seq))
        for i, rid in enumerate(ids):
            new = out[starts[i]: starts[i] + seq[i] - prefix[i]]
            b = int(res.lane_base[i])
            if rid in self.reqs:
                assert b == self.reqs[rid]["base"], "a continuation changed its lane base"
            else:
                self.reqs[rid] = {"slots": [], "base": b}
            event("valid: mid-page continuation" if prefix[i] % self.S else
                  ("valid: page-aligned continuation" if prefix[i] else "valid: fresh"))
            for t, slot in zip(range(prefix[i], seq[i]), new):
                assert slot % self.S == t % self.S, "slot offset != position offset"
                if t % self.S:
                    assert slot == (self.reqs[rid]["slots"] + new)[t - 1] + 1, "a page was split"
                assert (slot // self.S) % self.N == (b + t // self.S) % self.N, "owner-lane invariant"
            self.reqs[rid]["slots"] += new

    def _allocate(self, ids, prefix, seq, call):
        before = self.a.snapshot()
        try:
            res = call()
        except UnsupportedPagePlan as e:
            assert e.rule == "exceeds-capacity", e
            assert self._never_fits(ids, seq) and self.a.snapshot() == before
            event("valid: can never fit")
            return
        assert not self._never_fits(ids, seq)
        if res is None:
            event("valid: refused, a lane was short")
            assert self.a.snapshot() == before and (self.a.last_deficit > 0).any()
            return
        self._record(ids, prefix, seq, res)

    # -- component interface -------------------------------------------------------------------
    def snapshot(self):
        return self.a.snapshot()

    def check(self) -> None:
        S, N = self.S, self.N
        slots = [s for r in self.reqs.values() for s in r["slots"]] + [s for f in self.co_holders for s in f()]
        assert len(slots) == len(set(slots)), "a live slot was handed out twice"
        pages = np.array(slots, dtype=np.int64) // S
        live, fill = np.unique(pages, return_counts=True)
        # pages freed inside an open free group that nobody holds any more stay allocated until its end
        pending = np.setdiff1d(np.array(self.a.snapshot()[3] or (), dtype=np.int64), live)
        held = np.union1d(live, pending)
        used = np.bincount(held % N, minlength=N) if held.size else np.zeros(N, dtype=np.int64)
        assert (np.array(self.a.lane_free_pages()) + used == self.a.lane_pages).all(), "free + live != lane pages"
        allocated = np.flatnonzero(self.a.is_allocated(np.arange(self.a.num_pages + 1)))
        assert allocated.tolist() == held.tolist(), "allocated pages != pages the model holds"
        assert self.a.page_fill(live).tolist() == fill.tolist(), "fill marks != slots handed out per page"
        assert (self.a.page_fill(self._free_pages()) == 0).all()

    def valid_calls(self):
        return [self.extend, self.decode, self.finish, self.copy_pages, self.group, self.backup_restore, self.clear]

    def invalid_calls(self):
        return [self.bad_kind, self.bad_plan, self.bad_continuation, self.stale, self.shared_partial, self.too_big,
                self.bad_counts, self.bad_pages, self.bad_free, self.bad_group, self.bad_state]

    # -- valid calls ---------------------------------------------------------------------------
    def extend(self, data):
        active = self._active()
        cont = data.draw(st.lists(st.sampled_from(active), unique=True, max_size=6)) if active else []
        ids = cont + list(range(self.m["next"], self.m["next"] + data.draw(st.integers(0, 6))))
        self.m["next"] += len(ids) - len(cont)
        if not ids:
            return
        ids = [ids[k] for k in data.draw(st.permutations(range(len(ids))))]  # fresh and continuing, any order
        prefix = [len(self.reqs[r]["slots"]) if r in self.reqs else 0 for r in ids]
        seq = [p + data.draw(st.integers(1, 3 * self.S)) for p in prefix]
        last = [self._last(r) if r in self.reqs else -1 for r in ids]
        event("valid: extend")
        self._allocate(ids, prefix, seq, lambda: self.a.allocate_extend(prefix, seq, torch.tensor(last)))

    def decode(self, data):
        active = self._active()
        if not active:
            return
        ids = data.draw(st.lists(st.sampled_from(active), unique=True, min_size=1))
        prefix = [len(self.reqs[r]["slots"]) for r in ids]
        seq = [p + 1 for p in prefix]
        last = torch.tensor([self._last(r) for r in ids])
        event("valid: decode")
        if data.draw(st.booleans()):  # SGLang's call shape; the plan is last_allocation
            call = lambda: None if self.sg.alloc_decode(torch.tensor(seq), torch.tensor(seq), last) is None \
                else self.sg.last_allocation  # noqa: E731
        else:
            call = lambda: self.a.allocate_decode(torch.tensor(seq), last)  # noqa: E731
        self._allocate(ids, prefix, seq, call)

    def finish(self, data):
        active = self._active()
        if not active:
            return
        rid = data.draw(st.sampled_from(active))
        slots = torch.tensor(self.reqs[rid]["slots"], dtype=torch.int64)
        if data.draw(st.booleans()):
            self.a.free(torch.cat([slots, torch.tensor([-1])]) if data.draw(st.booleans()) else slots.to(torch.int32))
        else:
            self.a.free_pages(torch.unique(slots // self.S))
        event("valid: free" + (" in a group" if self.m["group"] else ""))
        if self.m["group"]:
            self.m["pending"].add(rid)
        else:
            self._end(rid)

    def _end(self, rid):
        r = self.reqs.pop(rid)
        if r["slots"]:
            self.m["gone"].append((len(r["slots"]), r["slots"][-1]))

    def copy_pages(self, data):
        """The prefix cache's flow: whole pages or pages with ``k`` slots written."""
        owners = data.draw(st.lists(st.integers(0, self.N - 1), min_size=1, max_size=3))
        fill = data.draw(st.none() | st.lists(st.integers(1, self.S), min_size=len(owners), max_size=len(owners)))
        pages = self.a.alloc_pages_with_owners(owners, fill=fill)
        event("valid: alloc_pages_with_owners")
        if pages is None:
            return
        for p, lane, k in zip(pages.tolist(), owners, fill or [self.S] * len(owners)):
            assert p % self.N == lane
            self.reqs[self.m["next"]] = {"slots": [p * self.S + j for j in range(k)], "base": lane}
            self.m["next"] += 1

    def group(self, data):
        if self.m["group"]:
            self.a.free_group_end()
            for rid in sorted(self.m["pending"]):
                self._end(rid)
            self.m["pending"].clear()
        else:
            self.a.free_group_begin()
        self.m["group"] = not self.m["group"]
        event("valid: free group begin/end")

    def backup_restore(self, data):
        if self.m["pending"]:
            return
        if self.backups and data.draw(st.booleans()):
            state, model = data.draw(st.sampled_from(self.backups))
            self.a.restore_state(state)
            keep = {k: self.m[k] for k in ("group", "next", "gone")}  # ended requests stay candidates
            self.m = copy.deepcopy(model) | keep
            event("valid: restore_state")
        else:
            self.backups.append((self.a.backup_state(), copy.deepcopy(self.m)))

    def clear(self, data):
        if data.draw(st.integers(0, 7)) != 7:  # rarely (hypothesis favours small values)
            return
        self.a.clear()
        self.m = {"reqs": {}, "pending": set(), "gone": self.m["gone"], "group": False, "next": self.m["next"]}
        event("valid: clear")

    # -- invalid calls -------------------------------------------------------------------------
    def bad_kind(self, data):
        make, err = data.draw(st.sampled_from(BAD_KINDS))
        v = [1, 2]
        t = torch.tensor
        a = self.a
        calls = {
            "allocate_extend prefix": lambda: a.allocate_extend(make(v), [3, 3], [-1, -1]),
            "allocate_extend seq": lambda: a.allocate_extend([0, 0], make(v), [-1, -1]),
            "allocate_extend last_loc": lambda: a.allocate_extend([0, 0], [1, 2], make([-1, -1])),
            "alloc_extend device copy": lambda: self.sg.alloc_extend(make(v), t([0, 0]), t([3, 3]), t([3, 3]),
                                                               t([-1, -1]), 6),
            "allocate_decode": lambda: a.allocate_decode(make(v), [-1, -1]),
            "alloc_pages_with_owners": lambda: a.alloc_pages_with_owners(make([0, 0])),
            "alloc_pages_with_owners fill": lambda: a.alloc_pages_with_owners([0, 0], fill=make([1, 1])),
            "free": lambda: a.free(make([self.S, self.S + 1])),
            "free_pages": lambda: a.free_pages(make(v)),
        }
        what = data.draw(st.sampled_from(sorted(calls)))
        return Misuse(f"bad kind: {what}", calls[what], err)

    def bad_plan(self, data):
        a, S = self.a, self.S
        free = self._free_pages()
        cases = [
            Misuse("mismatched lengths", lambda: a.allocate_extend([0], [1, 2], [-1, -1]), UnsupportedPagePlan,
                   "mismatched-lengths"),
            Misuse("negative prefix", lambda: a.allocate_extend([-1], [3], [-1]), UnsupportedPagePlan,
                   "negative-prefix"),
            Misuse("last_loc without prefix", lambda: a.allocate_extend([0], [2], [S]), UnsupportedPagePlan,
                   "last-loc-without-prefix"),
            Misuse("last_loc on page 0", lambda: a.allocate_extend([1], [2], [0]), UnsupportedPagePlan,
                   "slot-out-of-range"),
            Misuse("last_loc past the cache", lambda: a.allocate_extend([1], [2], [(a.num_pages + 1) * S]),
                   UnsupportedPagePlan, "slot-out-of-range"),
            Misuse("empty decode", lambda: a.allocate_decode([0], [-1]), UnsupportedPagePlan, "empty-decode"),
        ]
        if free.size:
            p = int(data.draw(st.sampled_from(free.tolist())))
            cases.append(Misuse("last_loc on a free page", lambda: a.allocate_extend([S], [S + 1], [p * S + S - 1]),
                                UnsupportedPagePlan, "last-loc-not-allocated"))
        return data.draw(st.sampled_from(cases))

    def bad_continuation(self, data):
        active, a = self._active(), self.a
        if not active:
            return None
        rid = data.draw(st.sampled_from(active))
        L, last = len(self.reqs[rid]["slots"]), self._last(rid)
        cases = [Misuse("prefix longer than the sequence", lambda: a.allocate_extend([L + 1], [L], [last]),
                        UnsupportedPagePlan, "prefix-longer-than-sequence")]
        if self.S > 1:
            cases.append(Misuse("inconsistent last_loc", lambda: a.allocate_extend([L + 1], [L + 2], [last]),
                                UnsupportedPagePlan, "inconsistent-last-loc"))
        return data.draw(st.sampled_from(cases))

    def stale(self, data):
        a, S = self.a, self.S
        gone = [(n, last) for n, last in self.m["gone"] if a.is_allocated([last // S])[0]
                and a.page_fill([last // S])[0] - 1 != last % S]
        inner = [r for r in self._active() if len(self.reqs[r]["slots"]) >= 2 and len(self.reqs[r]["slots"]) % S != 1]
        kinds = [k for k, xs in (("an ended request's last_loc on a reused page", gone),
                                 ("a written slot that is not its page's last", inner)) if xs]
        if not kinds or S == 1:
            return None
        what = data.draw(st.sampled_from(kinds))
        x = data.draw(st.sampled_from(gone if what.startswith("an ended") else inner))
        if isinstance(x, tuple):
            n, last = x
        else:
            n, last = len(self.reqs[x]["slots"]) - 1, self.reqs[x]["slots"][-2]
        decode = data.draw(st.booleans())
        call = (lambda: a.allocate_decode([n + 1], [last])) if decode else (lambda: a.allocate_extend([n], [n + 2], [last]))
        return Misuse(f"stale last_loc: {what}", call, UnsupportedPagePlan, "stale-last-loc")

    def shared_partial(self, data):
        mid = [r for r in self._active() if len(self.reqs[r]["slots"]) % self.S]
        if not mid:
            return None
        rid = data.draw(st.sampled_from(mid))
        L, last = len(self.reqs[rid]["slots"]), self._last(rid)
        return Misuse("two requests extend one partial page", lambda: self.a.allocate_extend([L, L], [L + 1, L + 1],
                      [last, last]), UnsupportedPagePlan, "shared-partial-page")

    def too_big(self, data):
        n = data.draw(st.sampled_from([self.a.num_pages * self.S + 1, 2**31, 2**62]))
        return Misuse("more than the whole cache", lambda: self.a.allocate_extend([0], [n], [-1]),
                      UnsupportedPagePlan, "exceeds-capacity")

    def bad_counts(self, data):
        sg, t = self.sg, torch.tensor
        return data.draw(st.sampled_from([
            Misuse("extend_num_tokens wrong", lambda: sg.alloc_extend(t([0]), t([0]), t([1]), t([1]), t([-1]), 2),
                   UnsupportedPagePlan, "extend-num-tokens"),
            Misuse("device copy of another length", lambda: sg.alloc_extend(t([0, 0]), t([0]), t([3]), t([3]), t([-1]),
                                                                            3), UnsupportedPagePlan, "mismatched-lengths"),
            Misuse("extend_num_tokens a float", lambda: sg.alloc_extend(t([0]), t([0]), t([1]), t([1]), t([-1]), 1.0),
                   TypeError),
        ]))

    def bad_pages(self, data):
        a, N, S = self.a, self.N, self.S
        return data.draw(st.sampled_from([
            Misuse("owner out of range", lambda: a.alloc_pages_with_owners([N]), UnsupportedPagePlan,
                   "owner-out-of-range"),
            Misuse("negative owner", lambda: a.alloc_pages_with_owners([0, -1]), UnsupportedPagePlan,
                   "owner-out-of-range"),
            Misuse("fill past the page", lambda: a.alloc_pages_with_owners([0], fill=[S + 1]), UnsupportedPagePlan,
                   "fill-out-of-range"),
            Misuse("fill 0", lambda: a.alloc_pages_with_owners([0], fill=[0]), UnsupportedPagePlan,
                   "fill-out-of-range"),
            Misuse("fill of another length", lambda: a.alloc_pages_with_owners([0], fill=[1, 1]), UnsupportedPagePlan,
                   "mismatched-lengths"),
        ]))

    def bad_free(self, data):
        a, S = self.a, self.S
        cases = [
            Misuse("free of page 0", lambda: a.free([0]), ValueError, "free-out-of-range"),
            Misuse("free past the cache", lambda: a.free([(a.num_pages + 1) * S]), ValueError, "free-out-of-range"),
            Misuse("free of a negative slot", lambda: a.free([-2]), ValueError, "free-out-of-range"),
            Misuse("free_pages of page 0", lambda: a.free_pages([0]), ValueError, "free-out-of-range"),
        ]
        free = self._free_pages()
        if free.size:
            p = int(data.draw(st.sampled_from(free.tolist())))
            cases.append(Misuse("free of a never-allocated or freed page", lambda: a.free([p * S]), ValueError,
                                "double-free"))
            cases.append(Misuse("free_pages of a free page", lambda: a.free_pages([p]), ValueError, "double-free"))
        active = self._active()
        if active:
            rid = data.draw(st.sampled_from(active))
            first = self.reqs[rid]["slots"][0] // S
            cases.append(Misuse("free_pages listing a page twice", lambda: a.free_pages([first, first]), ValueError,
                                "double-free"))
            if free.size:
                p = int(free[0])
                cases.append(Misuse("free mixing live and free pages",
                                    lambda: a.free(self.reqs[rid]["slots"] + [p * S]), ValueError, "double-free"))
        return data.draw(st.sampled_from(cases))

    def bad_group(self, data):
        a = self.a
        if not self.m["pending"]:
            return None
        # freeing the request's slots again in the same group is no misuse: the group frees the union
        return Misuse("restore inside a free group", lambda: a.restore_state(a.backup_state()), RuntimeError)

    def bad_state(self, data):
        a = self.a
        other = OwnerLaneAllocator(a.size + self.S, self.S, self.N)
        cases = [
            Misuse("restore of another allocator's state", lambda: a.restore_state(other.backup_state()), ValueError),
            Misuse("restore of something else", lambda: a.restore_state(a.snapshot()), TypeError),
            Misuse("free_group_end with no group" if not self.m["group"] else "free_group_begin twice",
                   a.free_group_end if not self.m["group"] else a.free_group_begin, RuntimeError),
        ]
        return data.draw(st.sampled_from(cases))


class MisuseMachine(RuleBasedStateMachine):
    """Drives every component: a valid call (then every invariant) or an
    invalid one (then the error and identical snapshots)."""

    def components_for(self, cp: int, S: int, lane_pages: int) -> list[Component]:
        """The components under test; a subclass adds its own."""
        return [AllocatorComponent(cp, S, lane_pages)]

    @initialize(cp=st.sampled_from([4, 2, 3, 8, 1]), S=st.sampled_from([4, 16, 2, 1, 64]), lane_pages=st.integers(1, 24))
    def setup(self, cp, S, lane_pages):
        self.parts = self.components_for(cp, S, lane_pages)

    @rule(data=st.data())
    def valid(self, data):
        part = data.draw(st.sampled_from(self.parts))
        data.draw(st.sampled_from(part.valid_calls()))(data)
        for p in self.parts:
            p.check()

    @rule(data=st.data())
    def misuse(self, data):
        part = data.draw(st.sampled_from(self.parts))
        gens = part.invalid_calls()
        for i in data.draw(st.permutations(range(len(gens)))):  # the first that applies now
            if (m := gens[i](data)) is not None:
                break
        else:
            return
        event(f"misuse: {m.what}")
        before = [p.snapshot() for p in self.parts]
        with pytest.raises(m.error) as e:
            m.call()
        if m.rule is not None:
            assert getattr(e.value, "rule", None) == m.rule, f"{m.what}: {e.value}"
        assert [p.snapshot() for p in self.parts] == before, f"{m.what} changed the state"
