"""SGLang's paged-allocator calls on the owner-lane allocator, each against a
small reference written here, and the refusals that close the gaps SGLang's
allocator leaves open (free groups, stale and off-by-one ``last_loc``).
[[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-REQUEST-RELATIVE]]"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.contract.allocator import OwnerLaneAllocator, RowPlacement
from cpkv.contract.sglang import SGLangAllocator
from cpkv.contract.errors import InvalidFree, UnsupportedPagePlan

torch.set_num_threads(1)
NONE = -1
sg = SGLangAllocator.over  # SGLang's call shapes over an allocator


def _fresh(a, n):
    return a.allocate_extend([0], [n], [NONE]).out_cache_loc


def _raises(a, cls, rule, call):
    """``call`` raises ``cls`` with ``rule`` and changes nothing."""
    before = a.snapshot()
    with pytest.raises(cls) as e:
        call()
    if rule is not None:
        assert e.value.rule == rule
    assert a.snapshot() == before


# -- free groups ------------------------------------------------------------------------------
def test_free_group_frees_union_of_overlapping_calls():
    a = OwnerLaneAllocator(1024, 16, 2)
    o = _fresh(a, 40)  # pages at positions 0, 1, 2
    pages = np.unique(o.numpy() // 16)
    a.free_group_begin()
    a.free(o[:32])
    a.free(o[24:])  # shares page position 1 with the call before
    assert a.is_allocated(pages).all()  # nothing freed before the end
    a.free_group_end()
    assert not a.is_allocated(pages).any()
    assert sum(a.lane_free_pages()) == a.num_pages


def test_free_group_refused_call_adds_nothing_and_others_still_free():
    a = OwnerLaneAllocator(1024, 16, 2)
    o = _fresh(a, 48)
    gone = _fresh(a, 16)
    a.free(gone)  # freed before the group
    a.free_group_begin()
    a.free(o[:16])
    # names o's other pages and a page freed before the group: refused whole
    _raises(a, InvalidFree, "double-free", lambda: a.free(torch.cat([o[16:], gone])))
    a.free(o[16:])
    a.free_group_end()
    assert sum(a.lane_free_pages()) == a.num_pages


def test_free_group_end_frees_what_a_refused_call_named_only_if_named_again():
    a = OwnerLaneAllocator(1024, 16, 2)
    o = _fresh(a, 48)
    a.free_group_begin()
    _raises(a, InvalidFree, "free-out-of-range", lambda: a.free(torch.cat([o[16:], torch.tensor([10**6])])))
    a.free(o[:16])
    a.free_group_end()
    assert a.is_allocated(np.unique(o[16:].numpy() // 16)).all()  # the refused call freed nothing


# -- alloc -------------------------------------------------------------------------------------
def _lanes_ref(free, n, N, cursor):
    """Reference: a fresh chain of a multiple of N pages starts at the cursor;
    any other at the first lane at or after the cursor that has most free
    pages and whose predecessor has fewer (any most-free lane on a tie of all)."""
    top = [f == max(free) for f in free]
    b = cursor if n % N == 0 else next(
        l % N for l in range(cursor, cursor + N) if top[l % N] and (all(top) or not top[l % N - 1]))
    return [(b + j) % N for j in range(n)]


@given(st.integers(1, 4), st.sampled_from([1, 4]), st.lists(st.integers(0, 6), max_size=6))
def test_alloc_is_a_fresh_chain_of_whole_pages_at_the_least_full_lane(N, S, needs):
    a = OwnerLaneAllocator(16 * N * S, S, N)
    if N > 1:  # a cursor away from 0
        a.allocate_extend([0], [N * S], [-1])
    for n in needs:
        free = a.lane_free_pages()
        before = a.snapshot()
        cursor = before[-1]  # the lane-base cursor (alloc does not move it)
        out = sg(a).alloc(n * S)
        if out is None:
            assert a.snapshot() == before
            continue
        assert out.dtype == torch.int64 and out.numel() == n * S
        pages = out.view(n, S)[:, 0] // S
        assert (out.view(n, S) - (pages * S)[:, None] == torch.arange(S)).all()  # SGLang: each page's slots in order
        assert (pages % N).tolist() == _lanes_ref(free, n, N, cursor)
        assert (a.page_fill(pages.numpy()) == S).all()


def test_alloc_refusals():
    a = OwnerLaneAllocator(256, 4, 2)
    _raises(a, UnsupportedPagePlan, "unaligned-need", lambda: sg(a).alloc(6))
    _raises(a, UnsupportedPagePlan, "unaligned-need", lambda: sg(a).alloc(-4))
    _raises(a, UnsupportedPagePlan, "owner-out-of-range", lambda: sg(a).alloc(4, first_lane=2))
    _raises(a, UnsupportedPagePlan, "exceeds-capacity", lambda: sg(a).alloc(4 * 65))
    _raises(a, TypeError, None, lambda: sg(a).alloc(4.0))
    out = sg(a).alloc(8, first_lane=1)
    assert (out[::4] // 4 % 2).tolist() == [1, 0]


# -- get_num_new_pages -------------------------------------------------------------------------
@given(st.sampled_from([1, 3, 16]), st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), max_size=8))
def test_get_num_new_pages_matches_sglang(S, pairs):
    a = OwnerLaneAllocator(1024 * S, S, 2)
    prefix = [min(p, q) for p, q in pairs]
    seq = [max(p, q) for p, q in pairs]
    ref = sum(-(-s // S) - -(-p // S) for p, s in zip(prefix, seq))
    assert sg(a).get_num_new_pages(torch.tensor(seq, dtype=torch.int64), S,
                                   prefix_lens=torch.tensor(prefix, dtype=torch.int64)) == ref
    dec = [s for s in seq if s >= 1]
    assert sg(a).get_num_new_pages(dec, decode=True) == sum(1 for s in dec if S == 1 or s % S == 1)


def test_get_num_new_pages_refusals():
    a = OwnerLaneAllocator(256, 4, 2)
    with pytest.raises(ValueError, match="page_size"):
        sg(a).get_num_new_pages([4], page_size=8, prefix_lens=[0])
    with pytest.raises(ValueError, match="prefix_lens"):
        sg(a).get_num_new_pages([4])
    with pytest.raises(ValueError, match="decode"):
        sg(a).get_num_new_pages([4], prefix_lens=[3], decode=True)
    for call, rule in ((lambda: sg(a).get_num_new_pages([4], prefix_lens=[5]), "prefix-longer-than-sequence"),
                       (lambda: sg(a).get_num_new_pages([0], decode=True), "empty-decode"),
                       (lambda: sg(a).get_num_new_pages([4, 4], prefix_lens=[0]), "mismatched-lengths")):
        with pytest.raises(UnsupportedPagePlan) as e:
            call()
        assert e.value.rule == rule


def test_alloc_extend_checks_num_new_pages():
    a = OwnerLaneAllocator(256, 4, 2)
    p, s = torch.tensor([0]), torch.tensor([9])
    _raises(a, UnsupportedPagePlan, "num-new-pages", lambda: sg(a).alloc_extend(p, p, s, s, torch.tensor([NONE]), 9, 2))
    assert sg(a).alloc_extend(p, p, s, s, torch.tensor([NONE]), 9, 3).numel() == 9


# -- free_segment / free_segments --------------------------------------------------------------
def test_free_segments_does_not_free_the_shared_page_twice():
    a = OwnerLaneAllocator(1024, 16, 2)
    o = _fresh(a, 48)
    sg(a).free_segments([(o[:20], 0), (o[20:40], 20), (o[40:], 40)])  # both later ones start inside a shared page
    assert sum(a.lane_free_pages()) == a.num_pages


def test_free_segment_frees_the_pages_of_one_aligned_segment():
    a = OwnerLaneAllocator(1024, 16, 2)
    o = _fresh(a, 40)
    sg(a).free_segment(o[16:], start_pos=16)  # the tail page is freed whole
    assert a.is_allocated((o[::16] // 16).numpy()).tolist() == [True, False, False]


def test_free_segment_refusals_change_nothing():
    a = OwnerLaneAllocator(1024, 16, 2)
    o = _fresh(a, 48)
    _raises(a, InvalidFree, "unaligned-segment", lambda: sg(a).free_segment(o[8:], start_pos=8))
    _raises(a, InvalidFree, "unaligned-segment", lambda: sg(a).free_segment(o[8:24], start_pos=16))  # wrong start_pos
    _raises(a, InvalidFree, "unaligned-segment", lambda: sg(a).free_segments([(o[:10], 0), (o[20:], 20)]))  # gap page
    _raises(a, InvalidFree, "overlapping-segments", lambda: sg(a).free_segments([(o[:20], 0), (o[16:], 16)]))
    _raises(a, InvalidFree, "unaligned-segment",
            lambda: sg(a).free_segments([(o[:20], 0), (o[36:], 20)]))  # head elsewhere
    _raises(a, TypeError, None, lambda: sg(a).free_segments([o]))
    sg(a).free_segments([(o[:0], 0), (o, 0)])
    assert sum(a.lane_free_pages()) == a.num_pages


# -- get_cpu_copy / load_cpu_copy --------------------------------------------------------------
def test_cpu_copy_loads_back_only_onto_the_same_lane_base():
    N, S = 4, 4
    a = OwnerLaneAllocator(512, S, N)
    row = _fresh(a, 10)
    copy = sg(a).get_cpu_copy(row)
    assert isinstance(copy, RowPlacement) and copy.length == 10
    assert copy.lane_base == int(row[0]) // S % N
    a.free(row)
    owners = [(copy.lane_base + j) % N for j in range(3)]
    pages = a.alloc_pages_with_owners(owners, fill=[S, S, 2])
    same = (pages[:, None] * S + torch.arange(S)).reshape(-1)[:10]
    assert sg(a).load_cpu_copy(copy, same) is None
    moved = a.alloc_pages_with_owners([(copy.lane_base + 1 + j) % N for j in range(3)], fill=[S, S, 2])
    other = (moved[:, None] * S + torch.arange(S)).reshape(-1)[:10]
    _raises(a, UnsupportedPagePlan, "lane-base-changed", lambda: sg(a).load_cpu_copy(copy, other))
    _raises(a, UnsupportedPagePlan, "mismatched-lengths", lambda: sg(a).load_cpu_copy(copy, same[:9]))
    _raises(a, UnsupportedPagePlan, "not-one-chain", lambda: sg(a).get_cpu_copy(torch.cat([same[:4], other[4:]])))
    _raises(a, TypeError, None, lambda: sg(a).load_cpu_copy(a.backup_state(), same))
    _raises(a, NotImplementedError, None, lambda: sg(a).get_cpu_copy(same, mamba_indices=[0]))
    a.free(same)
    _raises(a, UnsupportedPagePlan, "last-loc-not-allocated", lambda: sg(a).get_cpu_copy(same))


# -- need_sort ---------------------------------------------------------------------------------
@given(st.integers(1, 3), st.lists(st.tuples(st.booleans(), st.integers(1, 3)), max_size=12))
def test_need_sort_hands_out_the_lowest_free_page_of_each_lane(N, ops):
    a = OwnerLaneAllocator(24 * N, 1, N, need_sort=True)
    live = []
    for do_free, n in ops:
        if do_free and live:
            a.free(live.pop(n % len(live)))
            continue
        free = {lane: sorted(p for p in range(1, a.num_pages + 1) if p % N == lane and not a.is_allocated([p])[0])
                for lane in range(N)}
        out = sg(a).alloc(n)
        if out is not None:
            for p in out.tolist():  # the lowest free page of its lane, taken in chain order
                assert p == free[p % N].pop(0)
            live.append(out)


# -- stale and off-by-one last_loc -------------------------------------------------------------
def test_stale_last_loc_refused_after_reuse_to_the_same_mark():
    a = OwnerLaneAllocator(64, 4, 1)
    old = _fresh(a, 3)
    last, gen = old[-1:], a.slot_generations(old[-1:])
    a.free(old)
    new = _fresh(a, 3)
    assert new.tolist() == old.tolist()  # the same page, refilled to the same mark
    seq, pre = torch.tensor([4]), torch.tensor([3])
    _raises(a, UnsupportedPagePlan, "stale-last-loc", lambda: a.allocate_extend(pre, seq, last, last_loc_gen=gen))
    _raises(a, UnsupportedPagePlan, "stale-last-loc", lambda: sg(a).alloc_decode(seq, seq, last, last_loc_gen=gen))
    ok = sg(a).alloc_decode(seq, seq, new[-1:], last_loc_gen=a.slot_generations(new[-1:]))
    assert ok.tolist() == [int(new[-1]) + 1]


def test_stale_stamp_stays_dead_across_restore():
    a = OwnerLaneAllocator(64, 4, 1)
    state = a.backup_state()
    undone = _fresh(a, 3)
    gen = a.slot_generations(undone[-1:])
    a.restore_state(state)
    again = _fresh(a, 3)
    assert again.tolist() == undone.tolist()
    _raises(a, UnsupportedPagePlan, "stale-last-loc",
            lambda: a.allocate_decode([4], undone[-1:], last_loc_gen=gen))


def test_decode_seq_lens_missing_the_new_token_refused_at_page_size_one():
    a = OwnerLaneAllocator(128, 1, 2)
    row = _fresh(a, 40)
    last = row[-1:]
    _raises(a, UnsupportedPagePlan, "inconsistent-last-loc", lambda: sg(a).alloc_decode(torch.tensor([40]),
                                                                                     torch.tensor([40]), last))
    _raises(a, UnsupportedPagePlan, "inconsistent-last-loc", lambda: a.allocate_extend([38], [45], last))
    adapter = sg(a)
    out = adapter.alloc_decode(torch.tensor([41]), torch.tensor([41]), last)
    assert adapter.last_allocation.to_host("new_page_positions").tolist() == [40] and out.numel() == 1


def test_last_loc_gen_refusals():
    a = OwnerLaneAllocator(64, 4, 1)
    row = _fresh(a, 3)
    _raises(a, UnsupportedPagePlan, "mismatched-lengths", lambda: a.allocate_decode([4], row[-1:], last_loc_gen=[1, 2]))
    _raises(a, TypeError, None, lambda: a.allocate_decode([4], row[-1:], last_loc_gen=[1.0]))
    with pytest.raises(IndexError):
        a.slot_generations([10**6])
    assert a.slot_generations([NONE]).tolist() == [0]


# -- the adapter over the core ------------------------------------------------------------------
def test_the_adapter_holds_no_allocator_state():
    """Calls through :class:`SGLangAllocator` change the core it wraps and
    nothing else: two adapters over one core, or the adapter and the core's
    own verbs, see one state; built with the core's arguments it wraps a core
    of that shape."""
    ad = SGLangAllocator(256, 4, cp_size=2, need_sort=True)
    a = ad.allocator
    assert (a.size, a.page_size, a.cp_size, a.need_sort, ad.page_size) == (256, 4, 2, True, 4)
    out = ad.alloc_extend(*(torch.tensor([0]),) * 2, *(torch.tensor([6]),) * 2, torch.tensor([NONE]), 6)
    assert torch.equal(ad.last_allocation.out_cache_loc, out)
    other = SGLangAllocator.over(a)
    assert other.allocator is a and other.available_size() == ad.available_size()
    d = a.allocate_decode([7], out[-1:])  # the core's verb continues the adapter's chain
    other.free(torch.cat([out, d.out_cache_loc]))
    assert sum(a.lane_free_pages()) == a.num_pages
    ad.clear()
    assert a.snapshot() == OwnerLaneAllocator(256, 4, 2, need_sort=True).snapshot()


def test_the_adapter_refuses_what_the_core_refuses():
    """A wrong core or wrong arguments raise at once (``TypeError`` /
    ``ValueError``), as the core's constructor does."""
    with pytest.raises(TypeError, match="OwnerLaneAllocator"):
        SGLangAllocator.over(SGLangAllocator(64, 4))
    with pytest.raises(ValueError, match="page_size and cp_size"):
        SGLangAllocator(64, 0)
    with pytest.raises(ValueError, match="holds no page"):
        SGLangAllocator(3, 4)
    with pytest.raises(TypeError, match="size must be an int"):
        SGLangAllocator(64.0, 4)
