"""OwnerLaneAllocator: worked examples, every fail-fast rule, refusals, frees."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, SGLangAllocator, SharedKVLayout, UnsupportedPagePlan

NONE = -1
sg = SGLangAllocator.over  # SGLang's call shapes over an allocator


def lanes_of(slots, S, N):
    return ((torch.as_tensor(slots) // S) % N).tolist()


def test_for_layout_is_the_allocator_of_every_usable_page():
    """``for_layout(layout)`` is ``OwnerLaneAllocator((num_pages - 1) * S, S, N,
    layout=layout)``; anything but a layout is refused."""
    lay = SharedKVLayout(3, 4, 5)
    a, b = OwnerLaneAllocator.for_layout(lay, need_sort=True), OwnerLaneAllocator(14 * 4, 4, 3, layout=lay,
                                                                                  need_sort=True)
    assert (a.num_pages, a.layout, a.need_sort) == (14, lay, True) and a.snapshot() == b.snapshot()
    with pytest.raises(TypeError, match="SharedKVLayout"):
        OwnerLaneAllocator.for_layout((3, 4, 5))
    with pytest.raises(ValueError, match="holds no page"):
        OwnerLaneAllocator.for_layout(SharedKVLayout(1, 4, 1))


def test_fresh_batch_worked_example():
    """Lane bases pick the least-full lane request by request.
    [[RFC-0001:C-REQUEST-RELATIVE]] [[RFC-0001:C-FLATTENED-ORDER]]"""
    a = OwnerLaneAllocator(1024, page_size=4, cp_size=4)
    r = a.allocate_extend([0, 0, 0], [5, 9, 3], torch.tensor([NONE] * 3))
    # request 0: 2 pages from lane 0 -> lanes 0,1 used; lanes 2,3 now fullest
    assert r.lane_base.tolist() == [0, 2, 1]
    assert r.extend_start_loc.tolist() == [0, 5, 14]
    assert r.new_page_owners.tolist() == [0, 1, 2, 3, 0, 1]
    assert lanes_of(r.new_pages, 1, 4) == [0, 1, 2, 3, 0, 1]
    assert r.out_cache_loc.tolist() == [16, 17, 18, 19, 4, 8, 9, 10, 11, 12, 13, 14, 15, 32, 20, 21, 22]
    assert r.out_cache_loc.dtype == torch.int64


def test_mid_page_continuation_keeps_its_lanes():
    """A prefix ending mid-page fills its own page, then continues its lanes.
    [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-REQUEST-RELATIVE]]"""
    S, N = 4, 4
    a = OwnerLaneAllocator(1024, S, N)
    first = a.allocate_extend([0, 0], [3, 6], torch.tensor([NONE, NONE]))
    b1 = int(first.lane_base[1])
    last = first.out_cache_loc[3 + 5]  # request 1, position 5
    cont = a.allocate_extend([6], [15], last.view(1))
    assert int(cont.lane_base[0]) == b1
    out = cont.out_cache_loc
    assert out[:2].tolist() == [int(last) + 1, int(last) + 2]  # positions 6,7 in the partial page
    for i, t in enumerate(range(6, 15)):
        assert (int(out[i]) // S) % N == (b1 + t // S) % N
        assert int(out[i]) % S == t % S


def _state(a):
    return a.snapshot()


def _prepared():
    a = OwnerLaneAllocator(256, 4, 4)
    r = a.allocate_extend([0, 0], [6, 8], torch.tensor([NONE, NONE]))
    return a, r


@pytest.mark.parametrize(
    "rule,args",
    [
        ("mismatched-lengths", lambda r: ([0], [1, 2], [NONE, NONE])),
        ("negative-prefix", lambda r: ([-1], [3], [NONE])),
        ("prefix-longer-than-sequence", lambda r: ([0, 7], [1, 6], [NONE, int(r.out_cache_loc[5])])),
        ("last-loc-without-prefix", lambda r: ([0, 0], [1, 2], [NONE, 9])),
        ("slot-out-of-range", lambda r: ([0, 6], [1, 8], [NONE, 10_000])),
        ("slot-out-of-range", lambda r: ([6], [8], [2])),  # page 0 is reserved
        ("inconsistent-last-loc", lambda r: ([6], [8], [int(r.out_cache_loc[4])])),
        ("last-loc-not-allocated", lambda r: ([2], [8], [4 * 60 + 1])),
        ("shared-partial-page", lambda r: ([6, 6], [7, 8], [int(r.out_cache_loc[5])] * 2)),
    ],
)
def test_fail_fast_rules(rule, args):
    """Each broken rule raises UnsupportedPagePlan naming the rule and request,
    and leaves the allocator exactly as it was. [[RFC-0001:C-FAIL-FAST]]"""
    a, r = _prepared()
    before = _state(a)
    prefix, seq, last = args(r)
    with pytest.raises(UnsupportedPagePlan) as e:
        a.allocate_extend(prefix, seq, torch.tensor(last))
    assert e.value.rule == rule
    assert f"[{rule}]" in str(e.value)
    if e.value.request is not None:
        assert f"request {e.value.request}" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert _state(a) == before
    print(e.value)


def test_fail_fast_reports_the_offending_request():
    a, r = _prepared()
    with pytest.raises(UnsupportedPagePlan, match=r"request 2: prefix_len 5 > seq_len 4") as e:
        a.allocate_extend([0, 0, 5], [1, 1, 4], torch.tensor([NONE, NONE, int(r.out_cache_loc[4])]))
    assert e.value.request == 2


def test_extend_num_tokens_and_device_lengths_must_agree():
    a, _ = _prepared()
    before = _state(a)
    z, s = torch.zeros(2, dtype=torch.int64), torch.tensor([3, 4])
    with pytest.raises(UnsupportedPagePlan, match="extend-num-tokens"):
        sg(a).alloc_extend(z, z, s, s, torch.tensor([NONE, NONE]), 8)
    with pytest.raises(UnsupportedPagePlan, match="mismatched-lengths"):
        sg(a).alloc_extend(z[:1], z, s, s, torch.tensor([NONE, NONE]), 7)
    with pytest.raises(UnsupportedPagePlan, match="empty-decode"):
        sg(a).alloc_decode(torch.tensor([0]), torch.tensor([0]), torch.tensor([NONE]))
    assert _state(a) == before


def test_layout_must_agree():
    """page_size or cp_size disagreeing with the layout. [[RFC-0001:C-FAIL-FAST]]"""
    with pytest.raises(UnsupportedPagePlan, match="layout-mismatch"):
        OwnerLaneAllocator(256, 4, 4, layout=SharedKVLayout(4, 8, 100))
    with pytest.raises(UnsupportedPagePlan, match="layout-mismatch"):
        OwnerLaneAllocator(256, 4, 4, layout=SharedKVLayout(4, 4, 10))  # too small
    a = OwnerLaneAllocator(256, 4, 4, layout=SharedKVLayout(4, 4, 17))
    r = a.allocate_extend([0], [5], torch.tensor([NONE]))
    r.validate(a.layout)
    with pytest.raises(UnsupportedPagePlan, match="layout-mismatch"):
        r.validate(SharedKVLayout(2, 4, 40))


def test_short_lane_refuses_atomically_with_deficit():
    """A lane without pages: None, nothing changed, per-lane deficit readable.
    [[RFC-0001:C-FAIL-FAST]]"""
    a = OwnerLaneAllocator(8 * 4, 4, 4)  # pages 1..8: lanes 0:{4,8} 1:{1,5} 2:{2,6} 3:{3,7}
    assert a.lane_free_pages() == [2, 2, 2, 2]
    assert a.alloc_pages_with_owners([0, 0]) is not None
    before = _state(a)
    assert a.alloc_pages_with_owners([0, 1]) is None
    assert a.last_deficit.tolist() == [1, 0, 0, 0]
    assert _state(a) == before
    # 7 pages from the fullest lane (1): lanes 1,2,3,0,1,2,3 -> lane 0 is one short
    out = sg(a).alloc_extend(*(torch.tensor([0]),) * 2, *(torch.tensor([28]),) * 2, torch.tensor([NONE]), 28)
    assert out is None and _state(a) == before
    assert a.last_deficit.tolist() == [1, 0, 0, 0]


def test_free_returns_pages_to_their_lanes_and_refuses_double_free():
    a = OwnerLaneAllocator(64, 4, 4)
    r = a.allocate_extend([0], [9], torch.tensor([NONE]))
    assert sum(a.lane_free_pages()) == 16 - 3
    a.free(torch.cat([r.out_cache_loc, torch.tensor([-1])]))
    assert a.lane_free_pages() == [4, 4, 4, 4]
    before = _state(a)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(r.out_cache_loc[:1])
    with pytest.raises(ValueError, match="not a usable page"):
        a.free(torch.tensor([1]))  # page 0
    assert _state(a) == before
    a.free(torch.tensor([], dtype=torch.int64))  # nothing to do
    assert _state(a) == before


def test_alloc_pages_with_owners():
    a = OwnerLaneAllocator(4 * 40, 4, 4)
    pages = a.alloc_pages_with_owners(torch.tensor([3, 0, 3, 1]))
    assert (pages % 4).tolist() == [3, 0, 3, 1]
    assert pages.dtype == torch.int64 and len(set(pages.tolist())) == 4
    assert a.is_allocated(pages).all()
    with pytest.raises(UnsupportedPagePlan, match="owner-out-of-range"):
        a.alloc_pages_with_owners([4])


def test_cp1_is_a_plain_paged_allocator():
    a = OwnerLaneAllocator(64, 4, 1)
    r = a.allocate_extend([0, 0], [5, 4], torch.tensor([NONE, NONE]))
    assert r.out_cache_loc.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15]
    assert sg(a).available_size() == (16 - 3) * 4


def test_clear_restores_the_initial_state():
    a = OwnerLaneAllocator(256, 4, 4)
    fresh = _state(a)
    a.allocate_extend([0, 0], [17, 3], torch.tensor([NONE, NONE]))
    a.clear()
    assert _state(a) == fresh


@given(
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    S=st.sampled_from([1, 4, 16]),
    pages=st.integers(1, 60),
    taken=st.lists(st.integers(0, 7), max_size=40),
    base=st.integers(0, 7),
)
def test_available_size_fits_any_base(cp, S, pages, taken, base):
    """available_size() tokens fit whatever the lane base; one page more does
    not fit some base. (The documented rule of available_size.)"""
    a = OwnerLaneAllocator((pages * cp + 1) * S, S, cp)
    for lane in taken:
        a.alloc_pages_with_owners([lane % cp])
    free = np.array(a.lane_free_pages())
    n = sg(a).available_size() // S
    need = lambda n, b: np.bincount((b + np.arange(n)) % cp, minlength=cp)  # noqa: E731
    for b in range(cp):
        assert (need(n, b) <= free).all()
    assert any((need(n + 1, b) > free).any() for b in range(cp))
    assert sg(a).available_size() % S == 0


def test_identical_allocators_agree_to_the_byte():
    """N ranks, N allocators, same calls: identical tensors, no communication.
    [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""
    g = torch.Generator().manual_seed(3)
    allocs = [OwnerLaneAllocator(4096, 16, 4) for _ in range(4)]
    lens = torch.randint(1, 200, (12,), generator=g)
    results = [a.allocate_extend(torch.zeros(12, dtype=torch.int64), lens, torch.full((12,), NONE)) for a in allocs]
    for r in results[1:]:
        for name in ("out_cache_loc", "lane_base", "new_pages", "new_page_owners", "extend_start_loc"):
            assert torch.equal(getattr(r, name), getattr(results[0], name))
    assert len({a.snapshot() for a in allocs}) == 1


def test_empty_requests_take_nothing():
    """A request with nothing new (seq_len == prefix_len, 0 for a fresh one)
    takes no page and leaves its neighbours' fill marks alone."""
    a = OwnerLaneAllocator(256, 4, 2)
    r = a.allocate_extend([0, 0, 0], [5, 0, 3], [NONE] * 3)
    assert r.extend_lens.tolist() == [5, 0, 3] and r.out_cache_loc.numel() == 8
    pages = r.new_pages.tolist()
    assert len(pages) == 3 and a.page_fill(pages).tolist() == [4, 1, 3]
    last = int(r.out_cache_loc[4])
    r2 = a.allocate_extend([5, 0], [5, 2], [last, NONE])
    assert r2.extend_lens.tolist() == [0, 2] and a.page_fill([last // 4]).tolist() == [1]
