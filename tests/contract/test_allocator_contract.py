"""Regression tests of the hardened allocator contract, one per bug they guard:
an unusable device, absurd sizes, a stale last_loc, coerced inputs, and the
SGLang paged-allocator surface (free groups, backup/restore).
[[RFC-0001:C-FAIL-FAST]]"""

import numpy as np
import pytest
import torch

import cpkv.contract.planner as planner_module
import cpkv.contract.allocator as allocator_module
from cpkv import OwnerLaneAllocator, SGLangAllocator, UnsupportedPagePlan

NONE = -1
sg = SGLangAllocator.over  # SGLang's call shapes over an allocator


def _unusable_device() -> str:
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


# -- an unusable device, and every fallible step before pages move ---------------------------------
@pytest.mark.parametrize("device", [_unusable_device(), "meta"])
def test_unusable_device_is_refused_at_construction(device):
    """An allocator for a device this machine cannot use is refused when built,
    not when its first allocation has already popped pages."""
    with pytest.raises(ValueError, match="device"):
        OwnerLaneAllocator(1024, 4, 4, device=device)


def test_a_failure_while_building_the_result_takes_no_page(monkeypatch):
    """Everything that can fail (the result on the device) runs before any page
    leaves the free lists: a failure there leaves the allocator as it was."""
    a = OwnerLaneAllocator(1024, 4, 4)
    r = a.allocate_extend([0], [6], [NONE])
    before = a.snapshot()

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(planner_module, "_expand_runs", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        a.allocate_extend([0, 0], [5, 9], [NONE, NONE])
    with pytest.raises(RuntimeError, match="device lost"):  # a continuation into its partial page
        a.allocate_extend([6, 0], [11, 4], [int(r.out_cache_loc[-1]), NONE])
    assert a.snapshot() == before
    monkeypatch.setattr(planner_module, "_device_tensor", boom)
    monkeypatch.setattr(allocator_module, "_device_tensor", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        a.allocate_decode([1, 1], [NONE, NONE])
    with pytest.raises(RuntimeError, match="device lost"):
        a.alloc_pages_with_owners([0, 1])
    assert a.snapshot() == before


# -- absurd sizes: "never" raises at once, "not now" returns None ----------------------------------
def test_a_request_larger_than_the_whole_cache_raises_exceeds_capacity():
    """More pages than the cache holds can never fit: raise, do not return None
    (which tells the scheduler to evict and retry)."""
    a = OwnerLaneAllocator(64 * 4, 4, 4)  # 64 pages
    before = a.snapshot()
    with pytest.raises(UnsupportedPagePlan) as e:
        a.allocate_extend([0, 0], [4, 65 * 4], [NONE, NONE])
    assert e.value.rule == "exceeds-capacity" and e.value.request == 1
    assert a.snapshot() == before
    assert a.allocate_extend([0], [64 * 4], [NONE]) is not None  # exactly the whole cache fits


@pytest.mark.parametrize("seq_len", [2**31, 2**33, 2**62])
def test_absurd_sequence_lengths_are_refused_without_work(seq_len):
    """seq_len 2**31 on a 64K-token allocator once took 26 s and 6.8 GB to
    return None, and 2**33 died with MemoryError."""
    a = OwnerLaneAllocator(65536, 64, 8)
    page = int(a.alloc_pages_with_owners([3])[0])  # a whole page: its last slot may be continued
    before = a.snapshot()
    with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):
        a.allocate_extend([0], [seq_len], [NONE])
    with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):
        a.allocate_extend([64], [seq_len], [page * 64 + 63])
    s = torch.tensor([seq_len + 1])
    with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):
        sg(a).alloc_decode(s, s, torch.tensor([page * 64 + 63]))
    assert a.snapshot() == before


def test_a_continuation_no_lane_could_ever_hold_raises():
    """With lanes of unequal size (9 pages over 4 lanes: lane 1 holds 3, the
    others 2), a chain of 9 pages fits only from lane 1; a continuation whose
    lane base is fixed elsewhere can never fit, a fresh request can."""
    S = 4
    a = OwnerLaneAllocator(9 * S, S, 4)
    assert a.lane_pages.tolist() == [2, 3, 2, 2]
    first = a.alloc_pages_with_owners([2])  # a one-page prefix in lane 2 -> base 2
    last = int(first[0]) * S + S - 1
    with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):
        a.allocate_extend([S], [9 * S], [last])
    a.free_pages(first)
    assert a.allocate_extend([0], [9 * S], [NONE]) is not None


def test_a_short_lane_still_returns_none():
    a = OwnerLaneAllocator(8 * 4, 4, 4)
    a.alloc_pages_with_owners([0, 0])
    assert a.allocate_extend([0], [8 * 4], [NONE]) is None
    assert a.last_deficit.tolist() == [2, 0, 0, 0]


# -- a stale last_loc --------------------------------------------------------------------------------
def test_a_stale_last_loc_is_refused_after_its_page_is_reused():
    """A is freed, B reuses A's page; a continuation with A's old last_loc once
    returned B's live slots. The page's fill mark refuses it."""
    S = 8
    a = OwnerLaneAllocator(S, S, 1)  # one page: reuse is certain
    ra = a.allocate_extend([0], [3], [NONE])
    stale = int(ra.out_cache_loc[-1])
    a.free(ra.out_cache_loc)
    rb = a.allocate_extend([0], [5], [NONE])
    live = set(rb.out_cache_loc.tolist())
    assert stale in live  # B now writes where A's last token was
    before = a.snapshot()
    with pytest.raises(UnsupportedPagePlan) as e:
        a.allocate_extend([3], [4], [stale])
    assert e.value.rule == "stale-last-loc"
    assert a.snapshot() == before
    with pytest.raises(UnsupportedPagePlan, match="stale-last-loc"):
        sg(a).alloc_decode(torch.tensor([4]), torch.tensor([4]), torch.tensor([stale]))
    cont = a.allocate_extend([5], [7], [int(rb.out_cache_loc[-1])])  # B itself continues
    assert not live & set(cont.out_cache_loc.tolist())


def test_a_slot_before_the_last_written_one_is_stale():
    """Continuing from a slot that is written but not the last one would hand
    out slots that are already live."""
    a = OwnerLaneAllocator(256, 8, 2)
    r = a.allocate_extend([0], [5], [NONE])
    with pytest.raises(UnsupportedPagePlan, match="stale-last-loc"):
        a.allocate_extend([3], [6], [int(r.out_cache_loc[2])])
    with pytest.raises(UnsupportedPagePlan, match="stale-last-loc"):  # a full page, not this chain's last
        b = a.allocate_extend([0], [8], [NONE])
        a.free(b.out_cache_loc)
        c = a.allocate_extend([0], [2], [NONE])  # reuses b's page, 2 slots written
        a.allocate_extend([8], [9], [int(b.out_cache_loc[-1])])
    assert int(c.out_cache_loc[0]) // 8 == int(b.out_cache_loc[0]) // 8


def test_the_prefix_cache_copy_flow_declares_its_fill():
    """The prefix cache takes a whole page, copies k < S matched tokens into it
    and continues from ``page*S + k - 1``: ``alloc_pages_with_owners(owners,
    fill=[k])`` makes that legal; without ``fill`` the page counts as whole and
    only a continuation from its last slot is."""
    S, N = 8, 4
    a = OwnerLaneAllocator(512, S, N)
    page = int(a.alloc_pages_with_owners([2], fill=[3])[0])
    r = a.allocate_extend([3], [12], [page * S + 2])
    assert r.out_cache_loc[:5].tolist() == [page * S + k for k in range(3, 8)]
    assert int(r.lane_base[0]) == 2
    whole = int(a.alloc_pages_with_owners([1])[0])
    with pytest.raises(UnsupportedPagePlan, match="stale-last-loc"):
        a.allocate_extend([3], [12], [whole * S + 2])
    assert a.allocate_extend([S], [S + 1], [whole * S + S - 1]) is not None
    for bad in ([0], [S + 1], [-1]):
        with pytest.raises(UnsupportedPagePlan, match="fill-out-of-range"):
            a.alloc_pages_with_owners([0], fill=bad)
    with pytest.raises(UnsupportedPagePlan, match="mismatched-lengths"):
        a.alloc_pages_with_owners([0, 1], fill=[2])


def test_decode_fill_marks_follow_the_page():
    """Decode inside a page advances its fill mark; a decode that ends its page
    opens a page in the next lane; a freed page's mark is gone."""
    S, N = 4, 2
    a = OwnerLaneAllocator(64, S, N)
    r = a.allocate_extend([0], [3], [NONE])
    last = int(r.out_cache_loc[-1])
    d1 = a.allocate_decode([4], [last])
    assert int(d1.out_cache_loc[0]) == last + 1
    d2 = a.allocate_decode([5], [last + 1])
    assert (int(d2.out_cache_loc[0]) // S) % N == ((last // S) % N + 1) % N
    with pytest.raises(UnsupportedPagePlan, match="stale-last-loc"):
        a.allocate_decode([4], [last])  # written, but no longer the page's last slot
    a.free(torch.tensor([last, int(d2.out_cache_loc[0])]))
    with pytest.raises(UnsupportedPagePlan, match="last-loc-not-allocated"):
        a.allocate_decode([6], [int(d2.out_cache_loc[0])])


# -- inputs are refused, not coerced -------------------------------------------------------------------
BAD_VECTORS = [
    (torch.tensor([5.0]), TypeError),
    (torch.tensor([True]), TypeError),
    (torch.tensor([5 + 0j]), TypeError),
    (torch.tensor([5], dtype=torch.int16), TypeError),
    (torch.tensor([[5]]), ValueError),
    (torch.tensor(5), ValueError),
    (np.array([5.0]), TypeError),
    (np.array([[5]]), ValueError),
    ([5.0], TypeError),
    ([True], TypeError),
    ([[5]], TypeError),
    ("5", TypeError),
    (None, TypeError),
    (5, TypeError),
]


@pytest.mark.parametrize("bad,err", BAD_VECTORS, ids=[f"{type(b).__name__}-{i}" for i, (b, _) in enumerate(BAD_VECTORS)])
def test_wrong_input_kinds_are_refused_everywhere(bad, err):
    """Floats, bools, complex, narrow ints and multi-dimensional inputs were
    silently truncated or flattened (``free(float_tensor)`` freed pages); now
    every public call refuses them with a clear error and changes nothing."""
    S = 4
    a = OwnerLaneAllocator(256, S, 2)
    r = a.allocate_extend([0], [5], [NONE])
    last = int(r.out_cache_loc[-1])
    before = a.snapshot()
    t = torch.tensor
    calls = [
        lambda: a.allocate_extend(bad, [6], [last]),
        lambda: a.allocate_extend([5], bad, [last]),
        lambda: a.allocate_extend([5], [6], bad),
        lambda: a.allocate_decode(bad, [last]),
        lambda: sg(a).alloc_extend(bad, t([5]), t([6]), t([6]), t([last]), 1),
        lambda: sg(a).alloc_decode(t([6]), t([6]), bad),
        lambda: a.alloc_pages_with_owners(bad),
        lambda: a.alloc_pages_with_owners([0], fill=bad if bad is not None else [1.0]),
        lambda: a.free(bad),
        lambda: a.free_pages(bad),
        lambda: a.is_allocated(bad),
    ]
    for call in calls:
        with pytest.raises(err):
            call()
        assert a.snapshot() == before


def test_free_of_a_float_tensor_frees_nothing():
    a = OwnerLaneAllocator(256, 4, 2)
    r = a.allocate_extend([0], [8], [NONE])
    before = a.snapshot()
    with pytest.raises(TypeError, match="int32 or int64"):
        a.free(r.out_cache_loc.to(torch.float32))
    assert a.snapshot() == before


def test_int32_inputs_and_padding_still_work():
    a = OwnerLaneAllocator(256, 4, 2)
    r = sg(a).alloc_extend(*(torch.zeros(2, dtype=torch.int32),) * 2, *(torch.tensor([3, 6], dtype=torch.int32),) * 2,
                       torch.tensor([NONE, NONE], dtype=torch.int32), 9)
    assert r.numel() == 9
    a.free(torch.cat([r.to(torch.int32), torch.tensor([NONE], dtype=torch.int32)]))
    assert sum(a.lane_free_pages()) == a.num_pages
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="extend_num_tokens"):
        sg(a).alloc_extend(z, z, *(torch.tensor([3]),) * 2, torch.tensor([NONE]), 3.0)


# -- free by pages and free groups -----------------------------------------------------------------------
def test_free_pages_and_double_free_are_atomic():
    a = OwnerLaneAllocator(256, 4, 4)
    pages = a.alloc_pages_with_owners([0, 1, 2, 3])
    a.free_pages(pages[:2])
    before = a.snapshot()
    with pytest.raises(ValueError) as e:
        a.free_pages(pages)  # two of them are free already
    assert e.value.rule == "double-free"
    with pytest.raises(ValueError) as e:
        a.free_pages(torch.cat([pages[2:], pages[2:3]]))  # the same page twice in one call
    assert e.value.rule == "double-free"
    with pytest.raises(ValueError) as e:
        a.free_pages([0])
    assert e.value.rule == "free-out-of-range"
    assert a.snapshot() == before
    a.free_pages(pages[2:])
    assert sum(a.lane_free_pages()) == a.num_pages


def test_free_group_defers_frees_to_its_end():
    """SGLang's free_group_begin/end: frees between them are collected and done
    in one go at the end; each is still checked when it is made."""
    a = OwnerLaneAllocator(256, 4, 4)
    r1 = a.allocate_extend([0], [9], [NONE])
    r2 = a.allocate_extend([0], [5], [NONE])
    free0 = sum(a.lane_free_pages())
    a.free_group_begin()
    a.free(r1.out_cache_loc)
    a.free(r2.out_cache_loc[:1])
    a.free(r2.out_cache_loc[4:])
    assert sum(a.lane_free_pages()) == free0  # nothing freed yet
    before = a.snapshot()
    a.free(r1.out_cache_loc[-1:])  # already in the group: the group frees the union, so this adds nothing
    assert a.snapshot() == before
    with pytest.raises(ValueError) as e:
        a.free([a.num_pages * 4])  # a page that was free before the group
    assert e.value.rule == "double-free"
    with pytest.raises(RuntimeError, match="free group"):
        a.free_group_begin()
    with pytest.raises(RuntimeError, match="free group"):
        a.restore_state(a.backup_state())
    assert a.snapshot() == before
    a.free_group_end()
    assert sum(a.lane_free_pages()) == a.num_pages
    with pytest.raises(RuntimeError, match="free group"):
        a.free_group_end()


def test_backup_and_restore_state():
    """``backup_state()`` returns a copy of the whole state; ``restore_state``
    puts it back (allocations and frees since are undone) and refuses a state
    taken from an allocator of another size, page size or CP size."""
    a = OwnerLaneAllocator(256, 4, 4)
    r = a.allocate_extend([0], [9], [NONE])
    saved, snap = a.backup_state(), a.snapshot()
    a.free(r.out_cache_loc)
    a.allocate_extend([0, 0], [13, 2], [NONE, NONE])
    a.restore_state(saved)
    assert a.snapshot() == snap
    a.allocate_extend([0], [3], [NONE])
    a.restore_state(saved)  # a state can be restored more than once
    assert a.snapshot() == snap
    for other in (OwnerLaneAllocator(512, 4, 4), OwnerLaneAllocator(256, 8, 4), OwnerLaneAllocator(256, 4, 2)):
        with pytest.raises(ValueError, match="another allocator"):
            a.restore_state(other.backup_state())
    with pytest.raises(TypeError):
        a.restore_state((None, None))
    assert a.snapshot() == snap


def test_sglang_sizes():
    a = OwnerLaneAllocator(1000, 16, 1)
    assert (a.size, a.page_size) == (1000, 16)
    assert sg(a).available_size() == (1000 // 16) * 16
