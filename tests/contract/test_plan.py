"""The planner: owner plans, lane bases and the per-rank token splits."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan, split_interleave
from cpkv.contract import plan
from cpkv.contract.plan import choose_lane_bases, lane_take


@st.composite
def batches(draw):
    N = draw(st.sampled_from([1, 2, 3, 4, 8]))
    S = draw(st.sampled_from([1, 4, 16]))
    lens = draw(st.lists(st.integers(1, 5 * S), min_size=1, max_size=12))
    return N, S, lens


@given(batches())
def test_page_split_partitions_the_batch_by_owner(case):
    """Rank k computes exactly the tokens on pages it owns; ranks partition the
    batch. [[RFC-0001:C-PLANNER-SPLIT]] [[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""
    N, S, lens = case
    a = OwnerLaneAllocator(sum(lens) * 2 + 4 * S * N * len(lens), S, N)
    r = a.allocate_extend([0] * len(lens), lens, torch.full((len(lens),), -1))
    seen = torch.zeros(r.out_cache_loc.numel(), dtype=torch.int64)
    total_q = torch.zeros(len(lens), dtype=torch.int64)
    for k in range(N):
        sp = r.rank_split(k)
        seen[sp.token_indices] += 1
        total_q += sp.query_lens
        assert ((r.out_cache_loc[sp.token_indices] // S) % N == k).all()
        assert torch.equal(sp.positions, r.positions[sp.token_indices])
        assert torch.equal(sp.token_indices, r.rank_token_indices(k))
    assert (seen == 1).all()
    assert total_q.tolist() == lens
    with pytest.raises(ValueError):
        r.rank_split(N)


@given(batches())
def test_interleave_split(case):
    """Token i goes to rank i % N. [[RFC-0001:C-PLANNER-SPLIT]]"""
    N, S, lens = case
    lens_t = torch.tensor(lens)
    req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    pos = torch.cat([torch.arange(n) for n in lens])
    if len(req) < N:
        with pytest.raises(UnsupportedPagePlan, match="interleave-too-short"):
            split_interleave(req, pos, len(lens), 0, N)
        return
    counts = torch.zeros(len(lens), dtype=torch.int64)
    for k in range(N):
        sp = split_interleave(req, pos, len(lens), k, N)
        assert (sp.token_indices % N == k).all()
        counts += sp.query_lens
        assert torch.equal(sp.positions, pos[sp.token_indices])
    assert counts.tolist() == lens


def test_lane_bases_are_request_relative_and_least_full():
    """Fixed bases stay; chosen ones take the fullest lane, on ties the first
    at or after the cursor, counting earlier requests of the batch.
    [[RFC-0001:C-REQUEST-RELATIVE]]"""
    fixed = np.array([0, 3, 0, 0])
    has = np.array([False, True, False, False])
    first = np.array([0, 2, 0, 0])
    n = np.array([1, 3, 2, 1])
    free = np.array([5, 5, 5, 5])
    # r0 takes lane 0; r1 (base 3, from q 2) takes lanes 1,2,3; r2 picks lane 0?
    # after r0, r1: free [4,4,4,4] -> lane 0, takes 0,1; r3: [3,3,4,4] -> lane 2
    # (only a fresh request moves the cursor: r1 evens the lanes, the cursor stays at 0)
    bases, cursor = choose_lane_bases(fixed, has, first, n, free, 4)
    assert (bases.tolist(), cursor) == ([0, 3, 0, 2], 0)
    # from cursor 2: r0 takes lane 2 -> [5,5,4,5]; r1 -> [5,4,3,4]; r2 at lane 0, the only
    # most-free one -> [4,3,3,4]; r3: lanes 3 and 0 most free, one run that starts at 3
    bases, cursor = choose_lane_bases(fixed, has, first, n, free, 4, cursor=2)
    assert (bases.tolist(), cursor) == ([2, 3, 0, 3], 2)
    bases, cursor = choose_lane_bases(fixed, has, first, n, free, 4, "lane0", cursor=3)
    assert (bases.tolist(), cursor) == ([0, 3, 0, 0], 3)
    with pytest.raises(ValueError):
        choose_lane_bases(fixed, has, first, n, free, 4, "random")


@given(
    N=st.sampled_from([1, 2, 3, 8]),
    reqs=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 9), st.integers(0, 20)), min_size=1, max_size=10),
)
def test_lane_take_matches_its_definition(N, reqs):
    """Page j of request r lies in lane ``(b + q0 + j) % N`` and is the
    ``before[r, lane] + j // N``-th page the batch takes from that lane; lane
    counts agree with a per-page count (the owner plan, page by page).
    [[RFC-0001:C-OWNER-LANE]]"""
    base, first, n = (np.array(x) for x in zip(*reqs))
    base = base % N
    take = lane_take(base, first, n, N)
    seen = [0] * N
    for r in range(len(n)):
        for j in range(n[r]):
            lane = (base[r] + first[r] + j) % N
            assert (take.first_lane[r] + j) % N == lane
            assert take.before[r, lane] + j // N == seen[lane]
            seen[lane] += 1
    assert take.lane_counts.tolist() == seen


def sequential_lane_bases(fixed, has, first, n, free, N, cursor=0):
    """The least-full rule one request at a time, written out from its
    definition: a fresh request with remainder ``k = n % N == 0`` starts at
    the cursor; otherwise at the first lane at or after the cursor that is
    most free and whose predecessor is not (any most-free lane when all are
    equal). The cursor moves one lane after a fresh request with ``k == 0``
    or one that leaves every lane equally free."""
    rel, bases, c = list(free), list(fixed), cursor
    for r in range(len(n)):
        k = n[r] % N
        if not has[r]:
            if k == 0:
                bases[r] = c
            else:
                top = [x == max(rel) for x in rel]
                ok = [top[l] and (all(top) or not top[l - 1]) for l in range(N)]
                bases[r] = next(l % N for l in range(c, c + N) if ok[l % N])
        start = (bases[r] + first[r]) % N
        for j in range(n[r]):
            rel[(start + j) % N] -= 1
        if not has[r] and (k == 0 or min(rel) == max(rel)):
            c = (c + 1) % N
    return bases, c


@st.composite
def lane_batches(draw):
    N = draw(st.sampled_from([2, 3, 4, 8]))
    even = draw(st.booleans())  # counts as a cleared allocator leaves them, or disturbed ones
    free = [100] * N if even else draw(st.lists(st.integers(90, 100), min_size=N, max_size=N))
    reqs = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 3), st.integers(0, 20)),
                         min_size=1, max_size=40))
    has = np.array([h for h, *_ in reqs])
    fixed = np.array([b % N if h else 0 for h, b, _, _ in reqs])
    first = np.array([f if h else 0 for h, _, f, _ in reqs])
    n = np.array([k for *_, k in reqs])
    if draw(st.booleans()):  # whole sweeps, or equal lengths
        n = n - n % N if draw(st.booleans()) else np.full(n.size, n[0])
    return N, np.array(free), has, fixed, first, n, draw(st.integers(0, N - 1))


@given(lane_batches())
def test_lane_bases_equal_the_sequential_rule(case):
    """The vectorised choice (checked sweep) gives exactly the bases of the
    request-by-request rule, from even and from disturbed lane counts, with
    fixed-base requests interleaved. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    N, free, has, fixed, first, n, cursor = case
    want = sequential_lane_bases(fixed, has, first, n, free, N, cursor)
    default = plan.MAX_PASSES
    try:  # every mix of vectorised passes and the sequential step gives the same bases and cursor
        for passes in (default, 1, 0):
            plan.MAX_PASSES = passes
            bases, c = choose_lane_bases(fixed, has, first, n, free, N, cursor=cursor)
            assert (bases.tolist(), c) == want, passes
    finally:
        plan.MAX_PASSES = default


@given(N=st.sampled_from([2, 3, 4, 8]), S=st.sampled_from([1, 4]), extra=st.integers(0, 7),
       batches=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=30), min_size=1, max_size=4))
def test_fresh_batches_keep_lanes_within_one_page(N, S, extra, batches):
    """From a cleared allocator, batch after batch of fresh requests leaves the
    free counts of any two lanes at most one page apart (the balance the
    least-full rule promises). [[RFC-0001:C-REQUEST-RELATIVE]]"""
    pages = 64 * N + extra % N
    a = OwnerLaneAllocator(pages * S, S, N)
    for lens in batches:
        r = a.allocate_extend([0] * len(lens), [x * S for x in lens], [-1] * len(lens))
        if r is None:
            break
        free = np.array(a.lane_free_pages())
        assert free.max() - free.min() <= 1
