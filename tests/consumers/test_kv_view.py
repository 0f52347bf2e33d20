"""The group's view over per-rank segments (cpkv.consumers.kv_view): the base table and the owner-by-owner
read equal one rank-major buffer, and a pool over separate segments behaves as one over a single buffer.
[[RFC-0001:C-READ-PATH]] [[RFC-0001:C-DIRECT-WRITE]]"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import ContractViolation, SharedKVLayout
from cpkv.consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
from cpkv.consumers.kv_view import OFFSET_ALIGN_BYTES, KVView, SegmentTable

from support.pool_io import read


def _split(whole: torch.Tensor, N: int) -> list[torch.Tensor]:
    """The rank-major buffer's segments as separate allocations."""
    spr = whole.shape[1] // N
    return [whole[:, r * spr: (r + 1) * spr].clone() for r in range(N)]


@given(N=st.integers(1, 5), spr=st.integers(1, 9), layers=st.integers(1, 3), seed=st.integers(0, 99),
       m=st.integers(0, 30))
def test_reads_through_separate_segments_equal_one_buffer(N, spr, layers, seed, m):
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(layers, N * spr, 2, 3, generator=g)
    one, seg = KVView.of_buffer(whole, N), KVView.of_segments(_split(whole, N))
    rows = torch.randint(0, N * spr, (m,), generator=g)
    assert torch.equal(seg.read(rows), one.read(rows)) and torch.equal(one.read(rows), whole[:, rows])
    for layer in range(layers):
        assert torch.equal(seg.read(rows, layer), whole[layer, rows])
        lv = seg.layer(layer)
        assert isinstance(lv, SegmentTable) and seg.layer(layer) is lv  # made once
        assert lv.offsets is seg.layer(0).offsets  # one table for every layer
        assert torch.equal(lv[rows.view(-1, 1)], whole[layer, rows].view(-1, 1, 2, 3))
        assert lv.shape == whole[layer].shape and lv.dtype == whole.dtype and lv.num_ranks == N
        assert torch.equal(lv.offsets, torch.tensor([s.data_ptr() - lv.base.data_ptr() for s in lv.segments])
                           // lv.base.element_size())
        assert bool((lv.offsets * lv.base.element_size() % OFFSET_ALIGN_BYTES == 0).all())
        assert torch.equal(lv.offsets_in(1), lv.offsets * lv.base.element_size())  # in bytes
        assert one.layer(layer).data_ptr() == whole[layer].data_ptr()  # one buffer: a plain tensor view


def test_segments_that_do_not_fit_together_are_refused():
    a = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="at least one segment"):
        KVView.of_segments([])
    with pytest.raises(ValueError, match="segment 1 is"):
        KVView.of_segments([a, torch.zeros(2, 5, 3)])
    with pytest.raises(ValueError, match="segment 1 is"):
        KVView.of_segments([a, torch.zeros(2, 4, 3, dtype=torch.float16)])
    with pytest.raises(ValueError, match="rows must be contiguous"):
        KVView.of_segments([a, torch.zeros(2, 4, 6)[..., ::2]])
    with pytest.raises(ValueError, match="segment 1 has strides"):  # layer l would lie elsewhere in each
        KVView.of_segments([a, torch.zeros(2, 5, 3)[:, :4]])
    with pytest.raises(ValueError, match="not \\[layers, 3"):
        KVView.of_buffer(torch.zeros(2, 8, 3), 3)
    big = torch.zeros(2 * 4 * 3 * 2 + 4)
    odd = [big[:24].view(2, 4, 3), big[28:52].view(2, 4, 3)]  # the second starts 112 bytes on: unaligned
    with pytest.raises(ValueError, match="multiples of 64 bytes"):
        KVView.of_segments(odd).layer(0)


def _pool_pair(N=3, S=4, ppr=5):
    lay = SharedKVLayout(N, S, ppr)
    fams = kv_families(2, 2, 3)
    whole = allocate_buffers(lay, fams)
    segs = {n: KVView.of_segments(_split(b, N)) for n, b in whole.items()}
    return lay, fams, whole, segs


def test_a_pool_over_separate_segments_writes_only_its_own_and_reads_everyones():
    lay, fams, whole, segs = _pool_pair()
    one = [SharedKVPool(lay, r, fams, whole) for r in range(3)]
    sep = [SharedKVPool(lay, r, fams, segs) for r in range(3)]
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(lay.slots_per_page, lay.capacity)
    for r in range(3):
        mine = slots[lay.owned_slot_mask(slots, owner_rank=r)]
        vals = {f.name: torch.randn(2, mine.numel(), 2, 3, generator=g) for f in fams}
        before = [s.clone() for s in segs["k"].segments]
        for pools in (one, sep):
            pools[r].write_all_layers(mine, vals)
        assert all(torch.equal(a, b) for q, (a, b) in enumerate(zip(before, segs["k"].segments)) if q != r)
        with pytest.raises(ContractViolation, match="which rank"):
            sep[r].write_index(slots[~lay.owned_slot_mask(slots, owner_rank=r)][:1])
    for r in range(3):
        a, b = one[r].read_all_layers(slots), sep[r].read_all_layers(slots)
        assert all(torch.equal(a[n], b[n]) for n in a)
        table = slots.view(4, -1)  # any shape
        assert all(torch.equal(x, y) for x, y in zip(read(one[r], 1, table), read(sep[r], 1, table)))
    src, dst = slots[:6], slots[-6:]
    for r in range(3):
        assert one[r].copy_slots(src, dst) == sep[r].copy_slots(src, dst)
    assert all(torch.equal(whole[n], torch.cat(segs[n].segments, 1)) for n in whole)
    assert sep[0].page_bytes == one[0].page_bytes and isinstance(sep[0].view("k", 0), SegmentTable)
    with pytest.raises(ValueError, match="has 3 segments for a group of 2"):
        SharedKVPool(SharedKVLayout(2, 4, 6), 0, fams, {n: KVView.of_segments(  # 48 slots either way
            [torch.zeros(2, 16, 2, 3) for _ in range(3)]) for n in segs})
