"""free(slots) reads pages at stride S only when one pass proves every row of
S slots is a whole page in order; any other slot list frees exactly the pages
it names, like free_pages of those pages. [[RFC-0001:C-FAIL-FAST]]"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator


def _state(a):
    return a.lane_free_pages(), a.is_allocated(np.arange(a.num_pages + 1)).tolist()


@st.composite
def free_cases(draw):
    N = draw(st.sampled_from([1, 2, 4]))
    S = draw(st.sampled_from([1, 2, 4, 8]))
    a = OwnerLaneAllocator(40 * N * S, S, N)
    lens = draw(st.lists(st.integers(1, 5 * S), min_size=2, max_size=6))
    r = a.allocate_extend([0] * len(lens), lens, [-1] * len(lens))
    out, starts = r.out_cache_loc.tolist(), r.extend_start_loc.tolist()
    reqs = [out[b: b + n] for b, n in zip(starts, lens)]
    chosen = draw(st.lists(st.sampled_from(range(len(reqs))), min_size=1, unique=True))
    slots = [s for i in chosen for s in reqs[i]]
    how = draw(st.sampled_from(["in order", "shuffled", "foreign slot", "padding", "twice"]))
    if how == "shuffled":
        slots = draw(st.permutations(slots))
    elif how == "foreign slot":
        others = [s for i in range(len(reqs)) if i not in chosen for s in reqs[i]]
        if others:
            slots.insert(draw(st.integers(0, len(slots))), draw(st.sampled_from(others)))
    elif how == "padding":
        slots.insert(draw(st.integers(0, len(slots))), -1)
    elif how == "twice":
        slots = slots + slots
    return a, slots


@given(free_cases())
def test_free_by_slots_frees_exactly_the_pages_named(case):
    a, slots = case
    start = a.backup_state()
    a.free(slots)
    by_slots = _state(a)
    a.restore_state(start)
    pages = list(dict.fromkeys(s // a.page_size for s in slots if s >= 0))
    a.free_pages(pages)
    assert by_slots == _state(a)


def test_a_foreign_slot_inside_a_page_row_is_not_skipped():
    """The strided read would miss a slot of another page placed mid-row; the
    check sends such a list to the general path."""
    a = OwnerLaneAllocator(4096, 8, 2)
    r1 = a.allocate_extend([0], [16], [-1]).out_cache_loc.tolist()
    r2 = a.allocate_extend([0], [8], [-1]).out_cache_loc.tolist()
    slots = r1[:3] + [r2[3]] + r1[4:]  # 16 entries, rows of 8; r1[3] swapped for a slot of r2's page
    a.free(slots)
    assert not a.is_allocated([r2[0] // 8])[0]  # r2's page was named, so it is freed
    assert not a.is_allocated([r1[0] // 8, r1[8] // 8]).any()
    with pytest.raises(ValueError, match="double-free"):
        a.free(r2)
