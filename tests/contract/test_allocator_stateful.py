"""Stateful property test of the owner-lane allocator against a plain model.

Random interleavings of extend batches (fresh requests and continuations with
page-aligned and mid-page prefixes), decode steps, frees and broken plans,
over cp_size in {1,2,3,4,8} and page_size in {1,4,16,64}. After every step:
no live slot is handed out twice, free + live == pages per lane, every new slot
sits in its owner lane, out_cache_loc is in flattened request order, and a
refused or rejected call left the state identical.
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FLATTENED-ORDER]] [[RFC-0001:C-FAIL-FAST]]
[[RFC-0001:C-REQUEST-RELATIVE]]
"""

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.reqs = {}  # id -> {"slots": [..], "base": lane base}
        self.next_id = 0
        self.refusals = 0

    @initialize(cp=st.sampled_from([1, 2, 3, 4, 8]), S=st.sampled_from([1, 4, 16, 64]), lane_pages=st.integers(2, 24))
    def setup(self, cp, S, lane_pages):
        self.N, self.S = cp, S
        self.a = OwnerLaneAllocator(lane_pages * cp * S, S, cp)

    # -- helpers ---------------------------------------------------------------
    def _never_fits(self, ids, seq):
        """Whether some request's whole chain exceeds the cache, or (lane base
        fixed by its prefix) one lane of it."""
        for rid, n in zip(ids, seq):
            chain = -(-n // self.S)
            if rid not in self.reqs:
                if chain > self.a.num_pages:
                    return True
                continue
            need = np.bincount((self.reqs[rid]["base"] + np.arange(chain)) % self.N, minlength=self.N)
            if (need > self.a.lane_pages).any():
                return True
        return False

    def _apply(self, ids, prefix, seq, last, call):
        before = self.a.snapshot()
        try:
            res = call()
        except UnsupportedPagePlan as e:
            assert e.rule == "exceeds-capacity", e
            event("refused: can never fit")
            assert self._never_fits(ids, seq), "refused a batch that could fit"
            assert self.a.snapshot() == before, "a refused call changed the state"
            return
        assert not self._never_fits(ids, seq), "a request that can never fit was not refused"
        if res is None:
            event("refused: a lane was short")
            self.refusals += 1
            assert self.a.snapshot() == before, "refused call changed the state"
            assert (self.a.last_deficit > 0).any()
            return
        out = res.out_cache_loc.tolist()
        starts = res.extend_start_loc.tolist()
        assert starts == list(np.cumsum([0] + [s - p for p, s in zip(prefix, seq)])[:-1])
        assert len(out) == sum(s - p for p, s in zip(prefix, seq))
        for i, rid in enumerate(ids):
            new = out[starts[i] : starts[i] + seq[i] - prefix[i]]
            b = int(res.lane_base[i])
            if rid in self.reqs:
                assert b == self.reqs[rid]["base"], "a continuation changed its lane base"
            else:
                self.reqs[rid] = {"slots": [], "base": b}
            event("mid-page continuation" if prefix[i] % self.S else ("page-aligned continuation" if prefix[i] else "fresh"))
            for t, slot in zip(range(prefix[i], seq[i]), new):
                assert slot % self.S == t % self.S, "slot offset != position offset"
                if t % self.S:
                    prev = (self.reqs[rid]["slots"] + new)[t - 1]
                    assert slot == prev + 1, "a page was split"
                assert (slot // self.S) % self.N == (b + t // self.S) % self.N, "owner-lane invariant"
            self.reqs[rid]["slots"] += new

    def _last(self, rid):
        s = self.reqs[rid]["slots"]
        return s[-1] if s else -1

    # -- rules -------------------------------------------------------------------
    @rule(data=st.data(), n_fresh=st.integers(0, 8), n_cont=st.integers(0, 8))
    def extend(self, data, n_fresh, n_cont):
        live = sorted(self.reqs)
        cont = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=n_cont)) if live else []
        ids, prefix, seq, last = [], [], [], []
        for rid in cont:
            L = len(self.reqs[rid]["slots"])
            ids.append(rid), prefix.append(L), last.append(self._last(rid))
            seq.append(L + data.draw(st.integers(1, 3 * self.S)))
        for _ in range(n_fresh):
            ids.append(self.next_id), prefix.append(0), last.append(-1)
            seq.append(data.draw(st.integers(1, 4 * self.S)))
            self.next_id += 1
        if not ids:
            return
        order = data.draw(st.permutations(range(len(ids))))
        ids, prefix, seq, last = ([x[k] for k in order] for x in (ids, prefix, seq, last))
        self._apply(ids, prefix, seq, last, lambda: self.a.allocate_extend(prefix, seq, torch.tensor(last)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1))
        prefix = [len(self.reqs[r]["slots"]) for r in ids]
        seq = [p + 1 for p in prefix]
        last = [self._last(r) for r in ids]
        st_ = torch.tensor(seq)
        self._apply(ids, prefix, seq, last, lambda: self._decode(st_, last))

    def _decode(self, seq, last):
        out = self.a.alloc_decode(seq, seq, torch.tensor(last))
        return None if out is None else self.a.last_allocation

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.a.free(torch.tensor(self.reqs.pop(rid)["slots"], dtype=torch.int64))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), shift=st.integers(1, 5))
    def broken_plan(self, data, shift):
        """A last_loc that does not end the prefix: rejected, nothing changes."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        L = len(self.reqs[rid]["slots"])
        if self.S == 1:
            bad = L + shift  # prefix longer than the sequence
            args = ([bad], [L], [self._last(rid)])
        else:
            args = ([L], [L + 1], [self._last(rid) - 1 if L % self.S != 1 else self._last(rid) + 1])
        before = self.a.snapshot()
        with pytest.raises(UnsupportedPagePlan):
            self.a.allocate_extend(args[0], args[1], torch.tensor(args[2]))
        assert self.a.snapshot() == before

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def pages_conserved(self):
        if not hasattr(self, "a"):
            return
        slots = [s for r in self.reqs.values() for s in r["slots"]]
        assert len(slots) == len(set(slots)), "a live slot was handed out twice"
        pages = np.unique(np.array(slots, dtype=np.int64) // self.S)
        live = np.bincount(pages % self.N, minlength=self.N) if pages.size else np.zeros(self.N, int)
        assert (np.array(self.a.lane_free_pages()) + live == self.a.lane_pages).all()
        allocated = np.flatnonzero(self.a.is_allocated(np.arange(self.a.num_pages + 1)))
        assert allocated.tolist() == pages.tolist()


AllocatorMachine.TestCase.settings = settings(settings(), max_examples=150, stateful_step_count=30)
TestAllocatorMachine = AllocatorMachine.TestCase
