"""The lane arithmetic of a chain and the continuation rule, each written once
in the contract and called by the plan, the rules, the prefix cache and the
scheduler."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.consumers.prefix_cache import PrefixCache
from cpkv.contract import layout, plan, rules
from cpkv.engine.scheduler import Scheduler
from cpkv.engine.trace import RequestSpec, TraceError


@given(N=st.sampled_from([1, 2, 3, 4, 8]),
       reqs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 30)), min_size=1, max_size=8))
def test_chain_lane_pages_counts_each_position(N, reqs):
    """Vectorised over requests, the count equals the lanes of the chain's
    positions counted one by one: ``(b + q) % N`` for q in ``q0 .. q0 + n - 1``.
    [[RFC-0001:C-OWNER-LANE]]"""
    b, q0, n = (np.array(x) for x in zip(*reqs))
    got = layout.chain_lane_pages(b, q0, n, N)
    assert got.shape == (len(reqs), N) and got.dtype == np.int64
    for r in range(len(reqs)):
        want = np.bincount(layout.lane_of_position(b[r], np.arange(q0[r], q0[r] + n[r]), N), minlength=N)
        assert got[r].tolist() == want.tolist()
        assert layout.chain_lane_pages(int(b[r]), int(q0[r]), int(n[r]), N).tolist() == want.tolist()


def test_every_lane_count_goes_through_one_function(monkeypatch):
    """Patch :func:`layout.chain_lane_pages` and the plan, the allocation
    rules, the prefix cache (an admission's need, a running chain's need, which
    the scheduler reserves) and the scheduler's coarse capacity rule all
    change together. [[RFC-0001:C-OWNER-LANE]]"""
    S, N = 1, 2
    alloc = OwnerLaneAllocator(5 * S, S, N)  # lanes of 2 (lane 0) and 3 (lane 1) pages
    first = alloc.allocate_extend([0], [1], [-1])  # page 1, lane 1
    cache = PrefixCache(alloc)
    base = np.array([0, 1]), np.array([0, 2]), np.array([3, 4])
    fixed = (np.array([1]), np.array([5]), np.array([True]), first.to_host("new_pages"))  # base 1: fits 3 + 2
    before = (plan.lane_take(*base, N).lane_counts.copy(), cache.can_allocate([1, 2, 3, 4], 4).need.copy(),
              cache.chain_need(int(first.out_cache_loc[0]), 1, 5).copy())
    alloc._rules.check_capacity(*fixed)  # fits unpatched
    Scheduler([RequestSpec("a", 0, (1, 2, 3), 2)], PrefixCache(OwnerLaneAllocator(5 * S, S, N)))

    real = layout.chain_lane_pages
    monkeypatch.setattr(layout, "chain_lane_pages", lambda *a: real(*a) + 100)
    assert (plan.lane_take(*base, N).lane_counts - before[0]).tolist() == [200, 200]
    assert (cache.can_allocate([1, 2, 3, 4], 4).need - before[1]).tolist() == [100, 100]
    assert (cache.chain_need(int(first.out_cache_loc[0]), 1, 5) - before[2]).tolist() == [100, 100]
    with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):
        alloc._rules.check_capacity(*fixed)
    with pytest.raises(TraceError, match="per lane"):
        Scheduler([RequestSpec("a", 0, (1, 2, 3), 2)], PrefixCache(OwnerLaneAllocator(5 * S, S, N)))
    assert alloc.allocate_extend([1], [2], first.out_cache_loc) is None  # the allocation sees the patched need
    assert alloc.last_deficit.sum() > 0


def test_every_continuation_goes_through_one_rule(monkeypatch):
    """Patch :func:`rules.continues_chain` (refuse every continuation) and the
    allocator's extend and decode checks and the prefix cache's guard of its
    partial pages all see it. [[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-PREFIX-CACHE]]"""
    S, N = 4, 2
    alloc = OwnerLaneAllocator(16 * S, S, N)
    cache = PrefixCache(alloc)
    a = alloc.allocate_extend([0], [2], [-1])
    last = a.out_cache_loc[-1:]
    calls = []
    real = rules.continues_chain

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(rules, "continues_chain", spy)
    snap = alloc.snapshot()
    assert alloc.allocate_extend([2], [3], last) is not None and calls  # check_extend
    calls.clear()
    assert alloc.allocate_decode([4], last + 1) is not None and calls  # check_decode
    calls.clear()
    m = cache.allocate(cache.lookup([7, 8, 9]))
    cache._refuse_cached_growth([2], [3], torch.tensor([-1]))
    cache._refuse_cached_growth([2], [3], torch.tensor([int(last[0]) + 2]))
    assert calls, "the prefix cache did not ask the continuation rule"
    cache.finish([m], None, m.copy_dst, [m.copy_dst.numel()], cache=False)
    monkeypatch.setattr(rules, "continues_chain", lambda *args: np.zeros(np.shape(args[0]), dtype=bool))
    alloc.restore_state(alloc.backup_state())
    with pytest.raises(UnsupportedPagePlan):
        alloc.allocate_extend([4], [5], last + 2)  # a valid continuation, refused by the patched rule
    assert snap != alloc.snapshot()  # (the two allocations above went through)


@given(runs=st.lists(st.tuples(st.integers(-5, 50), st.integers(0, 9)), max_size=8))
def test_ranges_are_the_runs_back_to_back(runs):
    """``layout.ranges`` is each run ``start .. start + count - 1`` in turn
    (empty runs add nothing), as int64, for the batches the scheduler, the
    prefix cache and the attention plan hand it."""
    starts, counts = [a for a, _ in runs], [n for _, n in runs]
    got = layout.ranges(np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64))
    assert got.dtype == np.int64 and got.tolist() == [a + i for a, n in runs for i in range(n)]
