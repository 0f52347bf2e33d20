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
    run head at or after the cursor, counting earlier requests of the batch;
    a tie broken by the cursor outright moves it. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    fixed = np.array([0, 3, 0, 0])
    has = np.array([False, True, False, False])
    first = np.array([0, 2, 0, 0])
    n = np.array([1, 3, 2, 1])
    free = np.array([5, 5, 5, 5])
    # r1 (base 3, from q 2, three pages) splits the batch: no round group is complete.
    # r0: even lanes, the cursor (0 -> 1); r1 takes lanes 1,2,3 -> [4,4,4,4];
    # r2: even again, the cursor (1 -> 2), takes 1,2 -> [4,3,3,4]; r3: lanes 3 and 0, one run from 3
    bases, cursor = choose_lane_bases(fixed, has, first, n, free, 4)
    assert (bases.tolist(), cursor) == ([0, 3, 1, 3], 2)
    # from cursor 2: r0 takes lane 2 (2 -> 3) -> [5,5,4,5]; r1 -> [5,4,3,4]; r2 at lane 0, the only
    # most-free one -> [4,3,3,4]; r3: lanes 3 and 0 most free, one run that starts at 3
    bases, cursor = choose_lane_bases(fixed, has, first, n, free, 4, cursor=2)
    assert (bases.tolist(), cursor) == ([2, 3, 0, 3], 3)
    bases, cursor = choose_lane_bases(fixed, has, first, n, free, 4, "lane0", cursor=3)
    assert (bases.tolist(), cursor) == ([0, 3, 0, 0], 3)
    with pytest.raises(ValueError):
        choose_lane_bases(fixed, has, first, n, free, 4, "random")


def test_round_groups_start_at_the_cursor():
    """Lane 0 one page short (balanced, never even): two pages each at N 4.
    r0, r1 take one round (a group from the cursor 0: lanes 0 and 2; cursor
    1), r2, r3 the next (lanes 1 and 3; cursor 2); r4 is left over and takes
    the head of the most-free run, lane 1. The old tie rule laid them all from
    that head: 1, 3, 1, 3, 1. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    z = np.zeros(5, dtype=np.int64)
    bases, cursor = choose_lane_bases(z, z.astype(bool), z, np.array([2, 2, 2, 2, 1]), np.array([4, 5, 5, 5]), 4)
    assert (bases.tolist(), cursor) == ([0, 2, 1, 3, 1], 2)


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
    definition. Remainders ``k = n % N``. A stretch is a run of fresh requests
    that no request with a prefix and ``k != 0`` interrupts; in it a round
    group starts at each fresh request where the stretch's remainders so far
    sum to a multiple of N and is complete if the remainders from there sum
    to a multiple of N again within the stretch. A complete group that is one
    request with ``k == 0``, or that begins on balanced lanes (any two within
    one free page, the most-free lanes one cyclic run), goes end to end from
    the cursor, which moves one lane. Any other fresh request: the cursor if
    ``k == 0`` or all lanes are equally free (the cursor moves), else the
    first lane at or after the cursor that is most free and whose
    predecessor is not."""
    rel, bases, c = list(free), list(fixed), cursor
    k = [x % N for x in n]

    def balanced():
        top = [x == max(rel) for x in rel]
        heads = sum(top[l] and not top[l - 1] for l in range(N))
        return max(rel) - min(rel) <= 1 and (all(top) or heads == 1)

    def group_end(r):  # a group from r: the index after it if complete, else None
        total, j = 0, r
        while j < len(n) and not (has[j] and k[j]):
            if not has[j]:
                if j > r and total % N == 0:
                    return j
                total += k[j]
            j += 1
        return j if total % N == 0 else None

    stretch, until, origin = 0, -1, 0
    for r in range(len(n)):
        if has[r]:
            if k[r]:
                stretch = 0
        elif r < until:
            bases[r] = (origin + stretch) % N
        elif stretch % N == 0 and (end := group_end(r)) is not None and (k[r] == 0 or balanced()):
            until, origin, bases[r], stretch, c = end, c, c, 0, (c + 1) % N
        elif k[r] == 0 or min(rel) == max(rel):
            bases[r], c = c, (c + 1) % N
        else:
            top = [x == max(rel) for x in rel]
            ok = [top[l] and (all(top) or not top[l - 1]) for l in range(N)]
            bases[r] = next(l % N for l in range(c, c + N) if ok[l % N])
        if not has[r]:
            stretch += k[r]
        start = (bases[r] + first[r]) % N
        for j in range(n[r]):
            rel[(start + j) % N] -= 1
    return bases, c


@st.composite
def lane_batches(draw):
    N = draw(st.sampled_from([2, 3, 4, 6, 8]))
    kind = draw(st.sampled_from(["even", "balanced", "disturbed"]))  # as a cleared allocator leaves them, or not
    if kind == "even":
        free = [100] * N
    elif kind == "balanced":  # within one page, the most-free lanes one run (lane sizes that differ, or batches since)
        head, run = draw(st.integers(0, N - 1)), draw(st.integers(1, N - 1))
        free = [100 if (lane - head) % N < run else 99 for lane in range(N)]
    else:
        free = draw(st.lists(st.integers(90, 100), min_size=N, max_size=N))
    reqs = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 3), st.integers(0, 20)),
                         min_size=1, max_size=40))
    has = np.array([h for h, *_ in reqs]) & (not draw(st.booleans()))  # or fresh requests only
    fixed = np.where(has, np.array([b for _, b, _, _ in reqs]) % N, 0)
    first = np.where(has, np.array([f for _, _, f, _ in reqs]), 0)
    n = np.array([k for *_, k in reqs])
    if draw(st.booleans()):  # whole sweeps, or equal lengths
        n = n - n % N if draw(st.booleans()) else np.full(n.size, n[0])
    return N, np.array(free), has, fixed, first, n, draw(st.integers(0, N - 1))


@given(lane_batches())
def test_lane_bases_equal_the_sequential_rule(case):
    """The vectorised choice (closed form from balanced lanes, checked sweep
    otherwise) gives exactly the bases and cursor of the request-by-request
    rule, from even, balanced and disturbed lane counts, with fixed-base
    requests interleaved or none. [[RFC-0001:C-REQUEST-RELATIVE]]"""
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
