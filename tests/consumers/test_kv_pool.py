"""The shared KV pool in one process: direct write only to owned slots, read through the rank-major view."""

import pytest
import torch

from cpkv import ContractViolation, OwnerLaneAllocator, SharedKVLayout
from cpkv.consumers.kv_pool import Family, SharedKVPool, allocate_buffers, kv_families
from cpkv.kernels.reference import gathered_attention as paged_attention

from support.pool_io import read, write


def _pools(N=2, S=4, ppr=6, H=2, D=3):
    lay = SharedKVLayout(N, S, ppr)
    fams = kv_families(1, H, D)
    bufs = allocate_buffers(lay, fams)
    return lay, bufs, [SharedKVPool(lay, r, fams, bufs) for r in range(N)]


def _both(bufs):
    """K and V as one ``[2, layers, slots, H, D]`` copy."""
    return torch.stack([bufs["k"], bufs["v"]])


def test_write_to_unowned_slot_raises_and_writes_nothing():
    """[[RFC-0001:C-DIRECT-WRITE]]"""
    lay, bufs, (p0, p1) = _pools()
    slots = torch.tensor([8, 4])  # page 2 (rank 0), page 1 (rank 1)
    kv = torch.ones(2, 2, 3)
    with pytest.raises(ContractViolation, match="rank 0 asked to write slot 4, which rank 1 owns"):
        p0.write_index(slots)  # the forward's one check, before any layer stores
    with pytest.raises(ContractViolation, match="rank 0 asked to write slot 4, which rank 1 owns"):
        write(p0, 0, slots, k=kv, v=kv)
    assert _both(bufs).abs().sum() == 0 and p0.bytes_held() == 0


def test_owners_write_their_segments_and_everyone_reads_the_whole():
    """[[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""
    lay, bufs, pools = _pools()
    a = OwnerLaneAllocator.for_layout(lay)
    r = a.allocate_extend([0, 0], [7, 6], torch.tensor([-1, -1]))
    T = r.out_cache_loc.numel()
    k = torch.arange(T, dtype=torch.float32)[:, None, None].expand(T, 2, 3)
    for pool in pools:
        before = _both(bufs)
        idx = r.rank_token_indices(pool.rank)
        write(pool, 0, r.out_cache_loc[idx], k=k[idx] + 1, v=-k[idx] - 1)
        changed = (_both(bufs) != before).flatten(3).any(-1).any(0).any(0)  # per rank-major slot
        seg = torch.zeros(changed.numel(), dtype=torch.bool)
        seg[pool.rank * lay.slots_per_rank : (pool.rank + 1) * lay.slots_per_rank] = True
        assert changed.any() and not (changed & ~seg).any(), "a rank wrote outside its own segment"
    for pool in pools:
        kk, vv = read(pool, 0, r.out_cache_loc)
        assert torch.equal(kk, k + 1) and torch.equal(vv, -k - 1)
    assert sum(p.bytes_held() for p in pools) == 4 * pools[0].page_bytes  # 2 + 2 pages


def test_families_with_their_own_layers_and_shapes():
    """A family kept on some layers only (GLM-5's indexer keys): its buffer has
    those layers, a write to another layer is refused before anything changes.
    [[RFC-0001:C-DIRECT-WRITE]]"""
    lay = SharedKVLayout(2, 4, 4)
    fams = (Family("latent", (5,), (0, 1, 2)), Family("index_k", (3,), (0, 2)))
    bufs = allocate_buffers(lay, fams)
    assert bufs["latent"].shape == (3, 32, 5) and bufs["index_k"].shape == (2, 32, 3)
    p0 = SharedKVPool(lay, 0, fams, bufs)
    slots = torch.tensor([8, 9])  # page 2: rank 0
    write(p0, 2, slots, latent=torch.ones(2, 5), index_k=torch.full((2, 3), 2.0))
    (got,) = read(p0, 2, slots, "index_k")
    assert torch.equal(got, torch.full((2, 3), 2.0))
    before = {n: b.clone() for n, b in bufs.items()}
    with pytest.raises(KeyError, match="layer 1 keeps no 'index_k' cache"):
        p0.segment("index_k", 1)
    with pytest.raises(KeyError, match="layer 1 keeps no 'index_k' cache"):
        p0.view("index_k", 1)
    with pytest.raises(ValueError, match="must be uint8 rows|values of shape"):
        write(p0, 0, slots, latent=torch.ones(2, 5), index_k=torch.ones(2, 4))
    assert all(torch.equal(before[n], bufs[n]) for n in bufs)
    assert p0.page_bytes == 4 * (3 * 5 + 2 * 3) * 4


def test_copy_writes_only_the_destination_owners_segment():
    """A mid-page prefix copy: the owner of the destination reads the source
    through the shared view and writes its own segment; the other rank copies
    nothing. [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""
    lay, bufs, (p0, p1) = _pools()
    src = torch.tensor([4, 5, 6])  # page 1: rank 1
    write(p1, 0, src, k=torch.ones(3, 2, 3), v=torch.full((3, 2, 3), 2.0))
    dst = torch.tensor([8, 9, 10])  # page 2: rank 0
    before = _both(bufs)
    assert p1.copy_slots(src, dst) == 0 and torch.equal(_both(bufs), before)
    assert p0.copy_slots(src, dst) == 3
    k, v = read(p0, 0, dst)
    assert torch.equal(k, torch.ones(3, 2, 3)) and torch.equal(v, torch.full((3, 2, 3), 2.0))


def test_pool_refuses_buffers_that_do_not_match():
    lay = SharedKVLayout(2, 4, 4)
    fams = kv_families(1, 2, 3)
    bufs = allocate_buffers(lay, fams)
    with pytest.raises(ValueError, match="must name the same caches"):
        SharedKVPool(lay, 0, fams, {"k": bufs["k"]})
    with pytest.raises(ValueError, match="does not match"):
        SharedKVPool(lay, 0, fams, {"k": bufs["k"], "v": bufs["v"][:, :8]})
    with pytest.raises(ValueError, match="not in a CP group of 2"):
        SharedKVPool(lay, 2, fams, bufs)
    with pytest.raises(ValueError, match="identifier"):
        Family("k v", (1,), (0,))


def test_an_allocation_for_another_layout_is_refused_against_the_pools():
    """[[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""
    lay, _, (p0, _) = _pools()
    other = OwnerLaneAllocator(64, 8, 2)
    r = other.allocate_extend([0], [3], torch.tensor([-1]))
    with pytest.raises(ValueError, match="layout-mismatch"):
        r.validate(p0.layout)


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


#: The pool's verbs, by job (see its class doc): a forward's writes and views, copies and tier moves, what a rank
#: holds. A one-call write or read of a layer is no job of the pool's (tests/support/pool_io.py has them).
POOL_VERBS = {"write_index", "segment", "view", "fence", "copy_slots", "write_all_layers", "read_all_layers",
              "read_owned_all_layers", "tier_fence", "release", "bytes_held", "written_pages"}


def test_the_pool_answers_its_jobs_and_nothing_more():
    names = {n for n in dir(SharedKVPool) if not n.startswith("_")}
    verbs = {n for n in names if callable(getattr(SharedKVPool, n))}
    assert verbs == POOL_VERBS and names - verbs == {"page_bytes", "device"}
