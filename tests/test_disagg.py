"""W7 transfer pairs between CP groups of different sizes."""

import pytest
import torch

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.consumers.disagg import transfer_pairs


@pytest.mark.parametrize("n_src,n_dst", [(4, 2), (2, 8), (3, 3), (1, 4)])
def test_every_position_moves_to_its_destination_owner(n_src, n_dst):
    """Data written by the source owners lands, after the pairs are applied, at
    the destination owners' local slots for the same positions. [[RFC-0001:C-DISAGG]]
    [[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""
    S, T = 4, 37
    pa, da = OwnerLaneAllocator(400, S, n_src), OwnerLaneAllocator(800, S, n_dst)
    pa.allocate_extend([0], [5], torch.tensor([-1]))  # make the two groups differ
    src = pa.allocate_extend([0], [T], torch.tensor([-1])).out_cache_loc
    dst = da.allocate_extend([0], [T], torch.tensor([-1])).out_cache_loc
    L_s, L_d = pa.layout, da.layout
    src_mem = torch.full((n_src, L_s.slots_per_rank), -1.0)
    for k in range(n_src):  # each prefill owner holds positions of its pages
        m = L_s.owned_slot_mask(src, owner_rank=k)
        src_mem[k, L_s.translate_write_slots(src[m])] = torch.arange(T, dtype=torch.float32)[m]
    dst_mem = torch.full((n_dst, L_d.slots_per_rank), -1.0)
    pairs = transfer_pairs(L_s, L_d, src, dst)
    for a in range(n_src):
        for b in range(n_dst):
            s_loc, d_loc = pairs.between(a, b)
            dst_mem[b, d_loc] = src_mem[a, s_loc]
    got = torch.stack([dst_mem[int(r), int(l)] for r, l in zip(pairs.dst_rank, pairs.dst_local)])
    assert got.tolist() == list(range(T))
    assert ((dst // S) % n_dst == pairs.dst_rank).all()


def test_mismatched_pairs_are_refused():
    a, b = OwnerLaneAllocator(64, 4, 2), OwnerLaneAllocator(64, 8, 2)
    s = torch.tensor([4, 5])
    with pytest.raises(UnsupportedPagePlan, match="page-size-mismatch"):
        transfer_pairs(a.layout, b.layout, s, s)
    with pytest.raises(UnsupportedPagePlan, match="mismatched-lengths"):
        transfer_pairs(a.layout, a.layout, s, s[:1])
    with pytest.raises(UnsupportedPagePlan, match="offset-mismatch"):
        transfer_pairs(a.layout, a.layout, s, torch.tensor([4, 6]))
