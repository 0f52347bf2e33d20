"""SGLang's kv-shard allocator's calls on cpkv's allocators: ``rotation_bases`` (given bases honoured, ``None``
resolved in place, a base that breaks a chain's owner lanes refused), ``least_full_class``, the
``least_full_lowest`` policy (SGLang's tie rule), and :class:`SGLangKVShardAllocator`'s page numbers, against
small references written here (SGLang's own class: tests/sglang and tests/sglang/upstream).
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-REQUEST-RELATIVE]] [[RFC-0001:C-FAIL-FAST]]"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.contract.errors import InvalidFree, UnsupportedPagePlan
from cpkv.contract.plan import choose_lane_bases, lowest_tie_lane_bases
from cpkv.contract.sglang import SGLangAllocator, SGLangKVShardAllocator

torch.set_num_threads(1)
T = torch.tensor


def _extend(a, prefix, seq, last, bases):
    return a.alloc_extend(T(prefix), T(prefix), T(seq), T(seq), T(last), sum(s - p for p, s in zip(prefix, seq)),
                          rotation_bases=bases)


def _lanes(out, S, N):
    return (out[::S] // S % N).tolist()


def _reference_bases(free, bases, new_pages, N):
    """SGLang's resolution, written out: a None base is the lane with the most free pages (the lowest on a tie),
    the pages of the requests before it taken off; every request's chain takes n // N of each lane and one
    more of n % N lanes from its base."""
    free, out = list(free), []
    for b, n in zip(bases, new_pages):
        b = max(range(N), key=lambda r: (free[r], -r)) if b is None else b % N
        out.append(b)
        for r in range(N):
            free[r] -= n // N + ((r - b) % N < n % N)
    return out


@given(N=st.sampled_from([2, 3, 4, 8]), S=st.sampled_from([1, 4]),
       reqs=st.lists(st.tuples(st.integers(1, 40), st.one_of(st.none(), st.integers(0, 15))), min_size=1, max_size=6),
       policy=st.sampled_from(["least_full", "least_full_lowest"]))
def test_rotation_bases_given_honoured_none_resolved_in_place(N, S, reqs, policy):
    """Fresh requests: a given base is the chain's base (pages cycle the lanes from it, taken mod N); a ``None``
    is written back with the base used; under ``least_full_lowest`` that is SGLang's choice (the reference), and
    ``least_full_class`` answers it for a batch of one."""
    a = SGLangAllocator(64 * N * S, S, cp_size=N, base_policy=policy)
    lens, bases = [n for n, _ in reqs], [b for _, b in reqs]
    free = a.class_free_page_counts()
    given_bases = list(bases)
    if len(reqs) == 1 and bases[0] is None and policy == "least_full_lowest":
        assert a.least_full_class() == _reference_bases(free, [None], [-(-lens[0] // S)], N)[0]
    out = _extend(a, [0] * len(reqs), lens, [-1] * len(reqs), bases)
    assert out is not None and None not in bases
    assert [b for b, g in zip(bases, given_bases) if g is not None] == [g for g in given_bases if g is not None]
    used = a.last_allocation.lane_base.tolist()
    assert used == [b % N for b in bases]
    if policy == "least_full_lowest":
        assert used == _reference_bases(free, given_bases, [-(-n // S) for n in lens], N)
    at = 0
    for n, b in zip(lens, used):
        assert _lanes(out[at : at + n], S, N) == [(b + q) % N for q in range(-(-n // S))]
        at += n


def test_rotation_base_of_a_continuation_must_be_its_chains():
    """A request with a prefix continues the base its ``last_loc`` gives: that base (or ``None``, resolved to it)
    is taken; another is ``lane-base-changed`` and nothing changes; a wrong list is refused likewise."""
    S, N = 4, 4
    a = SGLangAllocator(64 * N * S, S, cp_size=N)
    first = _extend(a, [0], [10], [-1], [2])
    assert _lanes(first, S, N) == [2, 3, 0]
    last = int(first[-1])
    for bad, cls, rule in (([1], UnsupportedPagePlan, "lane-base-changed"),
                           ([None, None], UnsupportedPagePlan, "mismatched-lengths"),
                           ((2,), TypeError, None)):
        before = a.allocator.snapshot()
        with pytest.raises(cls) as e:
            _extend(a, [10], [20], [last], bad)
        assert rule is None or e.value.rule == rule
        assert a.allocator.snapshot() == before
    bases = [None]
    more = _extend(a, [10], [20], [last], bases)
    assert bases == [2] and more[:2].tolist() == [last + 1, last + 2] and _lanes(more[2:], S, N) == [1, 2]
    with pytest.raises(UnsupportedPagePlan) as e:  # the core's check, without the adapter
        a.allocator.allocate_extend([0], [4], [-1], lane_bases=[N])
    assert e.value.rule == "lane-base-out-of-range"


def test_a_refused_batch_writes_no_base_back():
    """``None`` when a lane is short: the state and the caller's list as they were."""
    a = SGLangAllocator(2 * 4 * 4, 4, cp_size=4)
    bases = [0, None]
    before = a.allocator.snapshot()
    assert _extend(a, [0, 0], [16, 20], [-1, -1], bases) is None
    assert bases == [0, None] and a.allocator.snapshot() == before


@given(N=st.sampled_from([2, 4, 8]),
       reqs=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 9), st.integers(1, 20)),
                     min_size=1, max_size=8),
       free=st.lists(st.integers(0, 30), min_size=8, max_size=8))
def test_lowest_tie_rule_is_the_reference(N, reqs, free):
    """``least_full_lowest`` through :func:`choose_lane_bases` (fixed bases kept, fresh ones by the rule) is the
    reference at every request."""
    has = np.array([h for h, *_ in reqs])
    fixed = np.array([b % N for _, b, _, _ in reqs])
    first = np.array([q for *_, q, _ in reqs])
    n = np.array([k for *_, k in reqs])
    lane_free = np.array(free[:N])
    bases, cursor = choose_lane_bases(fixed, has, first, n, lane_free, N, "least_full_lowest", cursor=3 % N)
    assert cursor == 3 % N
    assert bases.tolist() == lowest_tie_lane_bases(fixed, has, first, n, lane_free, N).tolist()
    ref, free_now = [], list(lane_free)
    for h, b, q, k in zip(has, fixed, first, n):
        b = int(b) if h else max(range(N), key=lambda r: (free_now[r], -r))
        ref.append(b)
        for r in range(N):
            free_now[r] -= k // N + ((r - (b + q)) % N < k % N)
    assert bases.tolist() == ref


@pytest.mark.parametrize("N", [2, 4, 8])
def test_kv_shard_numbers_pages_as_sglang(N):
    """Logical page l on lane l % N at local page l // N, local pages 1 .. per-rank pages (pages 0 .. N-1 held
    out, after ``clear`` too); ``size``, ``num_pages``, ``shard_size`` in SGLang's readings; the lowest lane on
    a tie."""
    S, per_rank = 16, 32
    a = SGLangKVShardAllocator(per_rank * S, S, N, torch.bfloat16, "cpu", None, False)
    assert (a.size, a.page_size, a.physical_page_size, a.shard_size, a.num_pages) == (
        per_rank * S * N, S, S, N, per_rank * N)
    for _ in range(2):
        assert a.class_free_page_counts() == [per_rank] * N and a.least_full_class() == 0
        for r, pages in enumerate(a.class_free_pages):
            assert (pages % N == r).all() and torch.equal(pages // N, torch.arange(1, per_rank + 1))
        assert a.available_size() == a.aggregate_free_size() == per_rank * N * S
        out = _extend(a, [0], [3 * S], [-1], [None])
        assert _lanes(out, S, N) == [q % N for q in range(3)] and int(out.min()) >= N * S
        a.clear()


def test_kv_shard_refusals_change_nothing():
    """A shard size below 2 and pages of SGLang's padding range are refused; ``alloc_cyclic`` is ``alloc`` from
    a lane; a free of a held-out page frees nothing."""
    with pytest.raises(ValueError, match="shard_size must be >= 2"):
        SGLangKVShardAllocator(64, 4, 1)
    with pytest.raises(ValueError, match="holds no page"):
        SGLangKVShardAllocator(3, 4, 2)
    with pytest.raises(TypeError, match="builds its own core"):
        SGLangKVShardAllocator.over(SGLangAllocator(64, 4, cp_size=2).allocator)
    a = SGLangKVShardAllocator(8 * 4, 4, 4)
    out = a.alloc_cyclic(6, 8)
    assert _lanes(out, 4, 4) == [2, 3]
    for call in (lambda: a.free(T([4, 5])), lambda: a.free(torch.cat([out, T([1])])), lambda: a.free_page_ids(T([3]))):
        before = a.allocator.snapshot()
        with pytest.raises(InvalidFree, match="padding range"):
            call()
        assert a.allocator.snapshot() == before
    a.free(out)
    assert a.class_free_page_counts() == [8] * 4
