"""SharedKVLayout: the index arithmetic against a per-slot reference."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import SharedKVLayout


def ref_read(s, N, S, ppr):
    p = s // S
    return ((p % N) * ppr + p // N) * S + s % S


def ref_write(s, N, S):
    p = s // S
    return (p // N) * S + s % S


layouts = st.builds(
    SharedKVLayout,
    cp_size=st.integers(1, 9),
    slots_per_page=st.sampled_from([1, 2, 4, 16, 64]),
    pages_per_rank=st.integers(1, 40),
)


@st.composite
def layout_and_slots(draw):
    lay = draw(layouts)
    slots = draw(st.lists(st.one_of(st.just(-1), st.integers(0, lay.capacity - 1)), max_size=50))
    return lay, torch.tensor(slots, dtype=torch.int64)


@given(layout_and_slots())
def test_translations_match_reference(case):
    """[[RFC-0001:C-LAYOUT-OWNER]] [[RFC-0001:C-READ-PATH]] [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-PADDING]]"""
    lay, slots = case
    N, S, ppr = lay.cp_size, lay.slots_per_page, lay.pages_per_rank
    read = lay.translate_read_slots(slots)
    write = lay.translate_write_slots(slots)
    for i, s in enumerate(slots.tolist()):
        if s == -1:
            assert read[i] == -1 and write[i] == -1
            for r in range(N):
                assert not lay.owned_slot_mask(slots, owner_rank=r)[i]
            continue
        assert read[i] == ref_read(s, N, S, ppr)
        assert write[i] == ref_write(s, N, S)
        # the write slot is where the owner's segment starts in the read view
        owner = (s // S) % N
        assert read[i] == owner * lay.slots_per_rank + write[i]
        assert 0 <= write[i] < lay.slots_per_rank
        for r in range(N):
            assert bool(lay.owned_slot_mask(slots, owner_rank=r)[i]) == (r == owner)


@given(layouts)
def test_read_translation_is_a_bijection(lay):
    """Every logical slot maps to a distinct rank-major slot. [[RFC-0001:C-READ-PATH]]"""
    slots = torch.arange(lay.capacity)
    read = lay.translate_read_slots(slots)
    assert torch.equal(torch.sort(read).values, slots)


def test_cp1_is_identity():
    lay = SharedKVLayout(1, 16, 10)
    s = torch.tensor([-1, 0, 17, 159])
    assert torch.equal(lay.translate_read_slots(s), s)
    assert torch.equal(lay.translate_write_slots(s), s)
    assert lay.owned_slot_mask(s, owner_rank=0).tolist() == [False, True, True, True]


def test_worked_example():
    """N 4, S 64, 8 pages a rank: pages 0..3 belong to ranks 0..3."""
    lay = SharedKVLayout(cp_size=4, slots_per_page=64, pages_per_rank=8)
    dev = torch.tensor([0, 64, 2 * 64 + 3, 3 * 64 + 5, 4 * 64 + 1, -1])
    assert lay.translate_read_slots(dev).tolist() == [0, 512, 1027, 1541, 65, -1]
    assert lay.translate_write_slots(dev).tolist() == [0, 0, 3, 5, 65, -1]


def test_int32_output_refuses_overflow():
    """int32 output raises rather than wrap. [[RFC-0001:C-READ-PATH]]"""
    lay = SharedKVLayout(cp_size=8, slots_per_page=64, pages_per_rank=2**23)
    small = torch.tensor([-1, 5, 64 * 9])
    out = lay.translate_read_slots(small, output_dtype=torch.int32)
    assert out.dtype == torch.int32 and out.tolist() == lay.translate_read_slots(small).tolist()
    big = torch.tensor([64 * 7])  # page 7 -> rank 7 -> slot 7 * 2**29
    assert int(lay.translate_read_slots(big)) >= 2**31
    with pytest.raises(OverflowError, match="int32"):
        lay.translate_read_slots(big, output_dtype=torch.int32)
    with pytest.raises(TypeError):
        lay.translate_read_slots(small, output_dtype=torch.float32)


def test_out_of_range_slots_raise():
    lay = SharedKVLayout(2, 4, 3)
    for bad in ([24], [-2], [3, 99]):
        with pytest.raises(IndexError, match="outside the layout"):
            lay.translate_read_slots(torch.tensor(bad))
        with pytest.raises(IndexError):
            lay.translate_write_slots(torch.tensor(bad))
    with pytest.raises(ValueError):
        lay.owned_slot_mask(torch.tensor([1]), owner_rank=2)
    with pytest.raises(ValueError):
        SharedKVLayout(0, 4, 3)


def test_hicache_index_selection():
    """Only the owner loads host->device; only the IO rank backs up. [[RFC-0001:C-HICACHE]]"""
    lay = SharedKVLayout(cp_size=4, slots_per_page=64, pages_per_rank=8)
    host = torch.tensor([10, 11, 12, 13])
    dev = torch.tensor([0, 64, 2 * 64 + 3, 3 * 64 + 5])
    h, d = lay.select_host_to_device_indices(host, dev, owner_rank=2)
    assert h.tolist() == [12] and d.tolist() == [3]
    h, d = lay.select_device_to_host_indices(host, dev, current_rank=0, io_rank=0)
    assert h.tolist() == host.tolist() and d.tolist() == [0, 512, 1027, 1541]
    h, d = lay.select_device_to_host_indices(host, dev, current_rank=1, io_rank=0)
    assert h.numel() == 0 and d.numel() == 0
    with pytest.raises(ValueError):
        lay.select_host_to_device_indices(host, dev[:2], owner_rank=0)
