"""The allocator's fast paths against the general ones, on random states: a
batch of one request (one chain of pages, lane counts from Python ints), a
free of one chain's pages in order (ranks without a sort), a decode whose
requests share no page (one duplicate test), the fused free_pages check, the
lane-base rule for batches without prefixes and the slot write: the same
slots, plan, state afterwards and refusals as the general path.
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-REQUEST-RELATIVE]]"""

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.contract import layout, planner
from cpkv.contract.allocation import PAGE_FIELDS, REQUEST_FIELDS
from cpkv.contract.errors import InvalidFree
from cpkv.contract.plan import choose_lane_bases, sequential_lane_bases


def _outcome(call):
    try:
        return call()
    except (UnsupportedPagePlan, InvalidFree) as e:
        return e.rule


def _same_result(fast, general):
    if fast is None or isinstance(fast, str):
        assert fast == general
        return
    assert fast.out_cache_loc.tolist() == general.out_cache_loc.tolist()
    for name in REQUEST_FIELDS + PAGE_FIELDS:
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name


@st.composite
def churned(draw, max_lanes=8):
    """An allocator after a few extends, frees of whole requests and of single
    pages, and pages taken by owner: free lists in no particular order, live
    chains to continue. Returns ``(alloc, live)``, ``live`` the ``(seq_len,
    last slot)`` of each request still holding its pages."""
    N = draw(st.sampled_from([n for n in (1, 2, 3, 4, 8) if n <= max_lanes]))
    S = draw(st.sampled_from([1, 2, 4, 16]))
    a = OwnerLaneAllocator(draw(st.integers(1, 10)) * N * S, S, N, need_sort=draw(st.booleans()))
    live = []
    for _ in range(draw(st.integers(0, 4))):
        lens = draw(st.lists(st.integers(1, 4 * S), min_size=1, max_size=4))
        r = _outcome(lambda: a.allocate_extend([0] * len(lens), lens, [-1] * len(lens)))
        if hasattr(r, "out_cache_loc"):
            out, starts = r.out_cache_loc.tolist(), r.extend_start_loc.tolist()
            live += [(n, out[b: b + n]) for n, b in zip(lens, starts)]
        if live and draw(st.booleans()):  # a whole request ends
            _, slots = live.pop(draw(st.integers(0, len(live) - 1)))
            a.free(slots)
        if draw(st.booleans()):
            _outcome(lambda: a.alloc_pages_with_owners(draw(st.lists(st.integers(0, N - 1), max_size=3))))
    return a, [(n, slots[-1]) for n, slots in live]


@st.composite
def one_request(draw):
    a, live = draw(churned())
    S = a.page_size
    if live and draw(st.booleans()):  # continue a live chain
        n, last = draw(st.sampled_from(live))
        return a, [n], [n + draw(st.integers(0, 3 * S))], [last]
    return a, [0], [draw(st.integers(0, 5 * S))], [-1]


@given(one_request())
def test_one_request_takes_the_same_pages_as_the_general_path(case):
    """A batch of one request plans its pages as one chain; with the one-chain
    path off (:data:`cpkv.contract.planner.ONE_CHAIN`) the general path gives
    the same slots, plan, refusal or deficit, and leaves the same state."""
    a, prefix, seq, last = case
    start = a.backup_state()
    fast = _outcome(lambda: a.allocate_extend(prefix, seq, last))
    fast_state, fast_deficit = a.snapshot(), a.last_deficit
    a.restore_state(start)
    planner.ONE_CHAIN = False
    try:
        general = _outcome(lambda: a.allocate_extend(prefix, seq, last))
    finally:
        planner.ONE_CHAIN = True
    event(f"one request: {'refused' if fast is None else fast if isinstance(fast, str) else 'allocated'}, "
          f"{'continues' if prefix[0] else 'fresh'}")
    assert a.snapshot() == fast_state
    _same_result(fast, general)
    if fast is None:
        assert fast_deficit.tolist() == a.last_deficit.tolist()


@st.composite
def page_frees(draw):
    """Pages to free: one chain's, in order (they cycle through the lanes) or
    backwards, that chain and more, or held pages in any order."""
    a, _ = draw(churned())
    S, N = a.page_size, a.cp_size
    r = _outcome(lambda: a.allocate_extend([0], [draw(st.integers(1, 4 * N * S))], [-1]))
    chain = r.to_host("new_pages").tolist() if hasattr(r, "out_cache_loc") else []
    held = np.nonzero(a.is_allocated(np.arange(a.num_pages + 1)))[0].tolist()
    how = draw(st.sampled_from(["one chain", "chain backwards", "chain then more", "any pages"]))
    if how == "any pages" or not chain:
        return a, draw(st.lists(st.sampled_from(held), unique=True)) if held else []
    if how == "chain backwards":
        return a, chain[::-1]
    if how == "chain then more":
        chain += draw(st.lists(st.sampled_from(held), unique=True).map(lambda x: [p for p in x if p not in chain]))
    return a, chain


@given(page_frees())
def test_freed_pages_go_back_in_the_order_given(case):
    """Each lane's free list grows by its freed pages, the first one given on
    top (handed out first, SGLang's order; or, with ``need_sort``, sorted
    again): what the general rank (a sort of the lanes) and the one-chain rank
    (``i // N``, for a chain given in order or backwards) both give."""
    a, pages = case
    if not pages:
        return
    N = a.cp_size
    lists_before = a.snapshot()[1]
    a.free_pages(pages)
    event(f"pages cycle through the lanes: {all((pages[0] + i - p) % N == 0 for i, p in enumerate(pages))}")
    after = a.snapshot()[1]
    for lane in range(N):
        want = list(lists_before[lane]) + [p for p in pages[::-1] if p % N == lane]
        if a.need_sort:
            want = sorted(want, reverse=True)
        assert list(after[lane]) == want, lane
    assert not a.is_allocated(pages).any()


def test_decodes_from_one_full_page_both_take_a_page():
    """Two requests whose last slot ends the same full page (a shared prefix)
    both go on, each on a page of its own, as the extend path allows; two on
    one partial page are still refused, and nothing changes."""
    a = OwnerLaneAllocator(256, 4, 2)
    r = a.allocate_extend([0, 0], [4, 3], [-1, -1])
    full, part = (int(r.out_cache_loc[i]) for i in (3, 6))
    start = a.backup_state()
    fast = a.allocate_decode([5, 5, 4], [full, full, part])
    fast_state = a.snapshot()
    a.restore_state(start)
    _same_result(fast, a.allocate_extend([4, 4, 3], [5, 5, 4], [full, full, part]))
    assert a.snapshot() == fast_state
    assert len(set(fast.out_cache_loc.tolist())) == 3 and fast.new_pages.numel() == 2
    a.restore_state(start)
    before = a.snapshot()
    with pytest.raises(UnsupportedPagePlan, match="shared-partial-page"):
        a.allocate_decode([5, 4, 4], [full, part, part])
    assert a.snapshot() == before


@pytest.mark.parametrize("make, rule, words", [
    (lambda held, freed: [held[0], 0, held[1]], "free-out-of-range", "page 0"),
    (lambda held, freed: [held[0], freed, held[0], 10**6], "free-out-of-range", "page 1000000"),
    (lambda held, freed: [held[0], freed, held[0]], "double-free", "given twice"),
    (lambda held, freed: [held[0], held[1], held[0]], "double-free", "given twice"),  # all held: only the repeat test sees it
    (lambda held, freed: [held[1], freed], "double-free", "not allocated"),
])
def test_free_pages_names_the_first_broken_rule(make, rule, words):
    """One fused test finds a wrong free_pages; the rules are then named in
    their order (out of range, given twice, not allocated) and nothing changes."""
    a = OwnerLaneAllocator(64 * 4, 4, 2)
    held = a.allocate_extend([0], [40], [-1]).to_host("new_pages").tolist()
    a.free_pages([held[-1]])
    before = a.snapshot()
    with pytest.raises(InvalidFree, match=words) as e:
        a.free_pages(make(held, held[-1]))
    assert e.value.rule == rule and a.snapshot() == before


@given(N=st.sampled_from([1, 2, 3, 5, 8, 33]), k=st.lists(st.integers(0, 70), max_size=20),
       free=st.lists(st.integers(0, 9), min_size=40, max_size=40), cursor=st.integers(0, 32))
def test_lane_bases_of_a_fresh_batch_need_no_prefix_arrays(N, k, free, cursor):
    """``has_prefix=None`` (no request has a prefix) gives what all-zero arrays
    give, which is the sequential rule. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    n, lane_free, cursor = np.array(k, dtype=np.int64), np.array(free[:N], dtype=np.int64), cursor % N
    z = np.zeros(n.size, dtype=np.int64)
    fast = choose_lane_bases(None, None, 0, n, lane_free, N, cursor=cursor)
    arrays = choose_lane_bases(z, z != 0, z, n, lane_free, N, cursor=cursor)
    rule = sequential_lane_bases(z, z != 0, z, n, lane_free, N, cursor)
    assert fast[0].tolist() == arrays[0].tolist() == rule[0].tolist() and fast[1] == arrays[1] == rule[1]
    assert choose_lane_bases(None, None, 0, n, lane_free, N, "lane0", cursor)[0].tolist() == [0] * n.size


@given(N=st.sampled_from([33, 40]), reqs=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 9),
                                                            st.integers(0, 200)), min_size=1, max_size=6))
def test_chain_lane_pages_past_its_table(N, reqs):
    """Past N = 32 the remainder's lanes are computed, not read from the
    table: the same counts as the chain's positions counted one by one."""
    b, q0, n = (np.array(x) for x in zip(*reqs))
    got = layout.chain_lane_pages(b, q0, n, N)
    for r in range(len(reqs)):
        want = np.bincount(layout.lane_of_position(b[r], np.arange(q0[r], q0[r] + n[r]), N), minlength=N)
        assert got[r].tolist() == want.tolist()
        assert layout.chain_lane_pages(int(b[r]), int(q0[r]), int(n[r]), N).tolist() == want.tolist()


@pytest.mark.parametrize("S", [1, 3, 4, 6, 64])
def test_slot_at_is_page_start_plus_offset(S):
    """``slot_at`` equals ``start + offset`` for page starts and offsets below
    S, on numpy and torch, power of two or not."""
    starts = np.arange(0, 50 * S, S, dtype=np.int64)
    want = (starts[:, None] + np.arange(S)).ravel()
    assert layout.slot_at(starts[:, None], np.arange(S), S).ravel().tolist() == want.tolist()
    got = layout.slot_at(torch.from_numpy(starts)[:, None], torch.arange(S), S).view(-1)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
