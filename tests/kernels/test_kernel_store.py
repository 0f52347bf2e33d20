"""Store: a family's new entries written into this rank's own segment at
translated local slots; padding skipped; a slot the rank does not own is not
written and is reported. [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-PADDING]]"""

import pytest
import torch
from conftest import DTYPES, GEOMETRIES

import cpkv.kernels as K
from cpkv.contract.errors import ContractViolation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp_size,page_size", GEOMETRIES)
def test_triton_equals_torch_and_writes_only_owned(batch_of, cp_size, page_size, dtype):
    b = batch_of(cp_size, page_size, seed=cp_size + page_size)
    rank = cp_size - 1
    slots = b.table.reshape(-1)
    vals = b.randn(slots.numel(), 2, 3, dtype=torch.float32)
    bufs = {be: torch.zeros(b.layout.slots_per_rank, 2, 3, dtype=dtype) for be in ("torch", "triton")}
    reports = {be: K.store(bufs[be], vals, slots, b.layout, rank, check=False, backend=be) for be in bufs}
    assert torch.equal(reports["torch"], reports["triton"])
    assert torch.equal(bufs["torch"], bufs["triton"])
    # what the layout says: owned entries at their local slots, every other row untouched
    owned = b.layout.owned_slot_mask(slots, owner_rank=rank)
    local = b.layout.translate_write_slots(slots[owned])
    want = torch.zeros_like(bufs["torch"])
    want[local] = vals[owned].to(dtype)
    assert torch.equal(bufs["triton"], want)
    refused = (slots != -1) & ~owned
    first = int(torch.nonzero(refused)[0, 0]) if refused.any() else slots.numel()
    assert reports["triton"].tolist() == [int(refused.sum()), first]
    assert (cp_size == 1) == (int(refused.sum()) == 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_owned_slot_raises_and_is_not_written(batch_of, backend):
    b = batch_of(4, 16, seed=2, holes=False)
    lay = b.layout
    mine = lay.rank_pages(2)[1:3] * lay.slots_per_page + 5  # two slots rank 2 owns
    other = lay.rank_pages(1)[1] * lay.slots_per_page  # one rank 1 owns
    slots = torch.tensor([mine[0], -1, other, mine[1]])
    buf = torch.zeros(lay.slots_per_rank, 4)
    with pytest.raises(ContractViolation, match=rf"rank 2 asked to write slot {other} \(slots\[2\]\), which rank 1"):
        K.store(buf, torch.ones(4, 4), slots, lay, 2, backend=backend)
    written = buf.any(1)
    assert written.sum() == 2 and written[lay.translate_write_slots(torch.tensor(mine))].all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_slot_outside_layout_is_refused_and_raises(batch_of, backend):
    b = batch_of(2, 16, seed=1)
    lay = b.layout
    buf = torch.zeros(lay.slots_per_rank, 4)
    for bad in (lay.capacity, -3):
        slots = torch.tensor([-1, bad])
        report = K.store(buf, torch.ones(2, 4), slots, lay, 0, check=False, backend=backend)
        assert report.tolist() == [1, 1]
        with pytest.raises(IndexError, match=rf"slots\[1\] = {bad} is outside the layout"):
            K.raise_refused(report, slots, lay, 0)
    assert not buf.any()


def test_empty_store_reports_nothing(batch_of):
    b = batch_of(3, 1, seed=0)
    buf = torch.zeros(b.layout.slots_per_rank, 2)
    for be in ("torch", "triton"):
        rep = K.store(buf, torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64), b.layout, 1, backend=be)
        assert rep.tolist() == [0, 0]
    assert not buf.any()
