"""W3/W4 in one process: direct write only to owned slots, read via rank-major."""

import pytest
import torch

from cpkv import ContractViolation, OwnerLaneAllocator, SharedKVLayout
from cpkv.consumers.kv_pool import SharedKVPool, buffer_shape
from cpkv.models import paged_attention


def _pools(N=2, S=4, ppr=6, H=2, D=3):
    lay = SharedKVLayout(N, S, ppr)
    buf = torch.zeros(buffer_shape(lay, 1, H, D))
    return lay, buf, [SharedKVPool(lay, r, buf) for r in range(N)]


def test_write_to_unowned_slot_raises_and_writes_nothing():
    """[[RFC-0001:C-DIRECT-WRITE]]"""
    lay, buf, (p0, p1) = _pools()
    slots = torch.tensor([8, 4])  # page 2 (rank 0), page 1 (rank 1)
    kv = torch.ones(2, 2, 3)
    with pytest.raises(ContractViolation, match="rank 0 asked to write slot 4, which rank 1 owns"):
        p0.write(0, slots, kv, kv)
    assert buf.abs().sum() == 0 and p0.bytes_held() == 0


def test_owners_write_their_segments_and_everyone_reads_the_whole():
    """[[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""
    lay, buf, pools = _pools()
    a = OwnerLaneAllocator((lay.num_pages - 1) * 4, 4, 2, layout=lay)
    r = a.allocate_extend([0, 0], [7, 6], torch.tensor([-1, -1]))
    T = r.out_cache_loc.numel()
    k = torch.arange(T, dtype=torch.float32)[:, None, None].expand(T, 2, 3)
    for pool in pools:
        before = buf.clone()
        idx = r.rank_token_indices(pool.rank)
        pool.write(0, r.out_cache_loc[idx], k[idx] + 1, -k[idx] - 1)
        changed = (buf != before).flatten(3).any(-1).any(0).any(0)  # per rank-major slot
        seg = torch.zeros(buf.shape[2], dtype=torch.bool)
        seg[pool.rank * lay.slots_per_rank : (pool.rank + 1) * lay.slots_per_rank] = True
        assert changed.any() and not (changed & ~seg).any(), "a rank wrote outside its own segment"
    for pool in pools:
        read = pool.read_index(r.out_cache_loc)
        assert read.dtype == torch.int32
        kk, vv = pool.gather(0, read)
        assert torch.equal(kk, k + 1) and torch.equal(vv, -k - 1)
    assert sum(p.bytes_held() for p in pools) == 4 * pools[0].page_bytes  # 2 + 2 pages


def test_pool_rejects_an_allocation_for_another_layout():
    """[[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""
    lay, buf, (p0, _) = _pools()
    other = OwnerLaneAllocator(64, 8, 2)
    r = other.allocate_extend([0], [3], torch.tensor([-1]))
    with pytest.raises(ValueError, match="layout-mismatch"):
        p0.check(r)


def test_paged_attention_matches_dense_causal_attention():
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    k = torch.randn(2, 5, Hkv, D)
    v = torch.randn(2, 5, Hkv, D)
    q = torch.randn(4, H, D)
    q_req, q_pos = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 4, 0, 2])
    out = paged_attention(q, q_req, q_pos, k, v, D**-0.5)
    for i in range(4):
        r, p = int(q_req[i]), int(q_pos[i])
        kk = k[r, : p + 1].repeat_interleave(H // Hkv, 1)  # [p+1, H, D]
        vv = v[r, : p + 1].repeat_interleave(H // Hkv, 1)
        w = torch.softmax(torch.einsum("hd,thd->ht", q[i], kk) * D**-0.5, -1)
        assert torch.allclose(out[i], torch.einsum("ht,thd->hd", w, vv), atol=1e-6)
