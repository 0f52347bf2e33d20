"""The decode fast path against the general extend path, on random states:
same slots, same plan, same state afterwards, same refusals.
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]"""

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.contract.allocation import PAGE_FIELDS, REQUEST_FIELDS


def _outcome(call):
    try:
        return call()
    except UnsupportedPagePlan as e:
        return e.rule


@st.composite
def decode_cases(draw):
    N = draw(st.sampled_from([1, 2, 3, 4, 8]))
    S = draw(st.sampled_from([1, 2, 4, 16]))
    lane_pages = draw(st.integers(1, 8))
    a = OwnerLaneAllocator(lane_pages * N * S, S, N)
    live = []  # (seq_len, last slot) of each request
    for lens in draw(st.lists(st.lists(st.integers(1, 3 * S), min_size=1, max_size=6), max_size=4)):
        r = _outcome(lambda: a.allocate_extend([0] * len(lens), lens, [-1] * len(lens)))
        if not hasattr(r, "out_cache_loc"):
            break
        ends = (r.extend_start_loc + r.extend_lens - 1).tolist()
        live += [(n, int(r.out_cache_loc[e])) for n, e in zip(lens, ends)]
    drop = draw(st.lists(st.booleans(), min_size=len(live), max_size=len(live)))
    keep, gone = [], []
    for (n, last), d in zip(live, drop):
        if d:  # free the page of the last slot only: the request is gone, its page reusable
            a.free([last])
            gone.append((n, last))
        else:
            keep.append((n, last))
    if gone and draw(st.booleans()):  # reuse freed pages, then a gone request tries to go on
        _outcome(lambda: a.allocate_extend([0], [draw(st.integers(1, 2 * S))], [-1]))
        keep.append(draw(st.sampled_from(gone)))
    picked = draw(st.lists(st.sampled_from(keep), unique=True)) if keep else []
    fresh = draw(st.integers(0, 3))
    seq = [n + 1 for n, _ in picked] + [1] * fresh
    last = [l for _, l in picked] + [-1] * fresh
    order = draw(st.permutations(range(len(seq))))
    return a, [seq[i] for i in order], [last[i] for i in order]


@given(decode_cases())
def test_decode_fast_path_equals_the_extend_path(case):
    a, seq, last = case
    start = a.backup_state()
    fast = _outcome(lambda: a.allocate_decode(seq, last))
    fast_state, fast_deficit = a.snapshot(), a.last_deficit
    a.restore_state(start)
    general = _outcome(lambda: a.allocate_extend([s - 1 for s in seq], seq, last))
    event(f"outcome: {'refused' if fast is None else fast if isinstance(fast, str) else 'allocated'}")
    event(f"with fresh requests: {-1 in last}; some new page: {any((s - 1) % a.page_size == 0 for s in seq)}")
    assert a.snapshot() == fast_state
    if fast is None or isinstance(fast, str):
        assert fast == general
        if fast is None:
            assert fast_deficit.tolist() == a.last_deficit.tolist()
        return
    assert fast.out_cache_loc.tolist() == general.out_cache_loc.tolist()
    for name in REQUEST_FIELDS + PAGE_FIELDS:
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
    assert fast.positions.tolist() == general.positions.tolist()
    assert fast.request_of_token.tolist() == general.request_of_token.tolist()


def test_decode_fast_path_refuses_what_extend_refuses():
    a = OwnerLaneAllocator(64, 4, 2)
    r = a.allocate_extend([0, 0], [3, 3], [-1, -1])
    l0, l1 = (int(r.out_cache_loc[i]) for i in (2, 5))
    before = a.snapshot()
    for seq, last, rule in [([4, 4], [l0, l0], "shared-partial-page"), ([4], [l0 - 1], "inconsistent-last-loc"),
                            ([0], [-1], "empty-decode"), ([4, 4], [l0], "mismatched-lengths"),
                            ([1], [l1], "last-loc-without-prefix")]:
        with pytest.raises(UnsupportedPagePlan) as e:
            a.allocate_decode(seq, last)
        assert e.value.rule == rule
        assert a.snapshot() == before
    assert np.array_equal(a.page_fill([l0 // 4, l1 // 4]), [3, 3])
