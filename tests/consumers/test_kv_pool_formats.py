"""Pools of formatted families: uint8 rows of the format's width, the data
plane's store encodes, a read decodes to float32, every copy (prefix-cache copy, host
backup and load, disaggregation transfer) moves the stored bytes as they are.
[[RFC-0001:C-KV-FORMAT]] [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""

import pytest
import torch

from cpkv import ContractViolation, OwnerLaneAllocator, SharedKVLayout
from cpkv.consumers.transfer import plan_transfer, receive_transfer, send_transfer
from cpkv.consumers.hicache import HostPool
from cpkv.consumers.kv_format import TorchFormat, gqa_fp8, indexer_key_fp8, mla_latent_fp8
from cpkv.consumers.kv_pool import Family, SharedKVPool, allocate_buffers, kv_families
from cpkv.models.dsa import DsaCacheShape, real_shape
from cpkv.runtime.p2p import thread_p2p

from support.pool_io import read, write

torch.set_num_threads(1)

S = 4
SMALL_DSA = DsaCacheShape(3, 20, 4, 12, (0, 2))  # widths below one 128-tile, as cpkv's test models
LATENT_BYTES = 20 + 4 + 2 * 4  # one partial tile: 20 fp8, one fp32 scale, 4 bf16


def _group(families, N=2, ppr=8):
    lay = SharedKVLayout(N, S, ppr)
    bufs = allocate_buffers(lay, families)
    return lay, bufs, [SharedKVPool(lay, r, families, bufs) for r in range(N)]


def _alloc(lay, n):
    a = OwnerLaneAllocator.for_layout(lay)
    return a, a.allocate_extend([0], [n], torch.tensor([-1])).out_cache_loc


def _write_everywhere(pools, lay, slots, values_of):
    """Every owner writes its slots of every layer each family keeps."""
    for p in pools:
        mine = lay.owned_slot_mask(slots, owner_rank=p.rank)
        for layer in sorted({x for f in p.families.values() for x in f.layers}):
            vals = {f.name: values_of(f, layer)[mine] for f in p.families.values() if layer in f.layers}
            write(p, layer, slots[mine], **vals)


def _random_values(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda f, layer: torch.randn(T, *f.shape, generator=g) * (10.0 ** (layer - 1))


FAMILY_SETS = {"dsa-fp8": SMALL_DSA.fp8_families(), "gqa-fp8": kv_families(2, 2, 5, format=gqa_fp8(2, 5)),
               "gqa-bf16-bytes": kv_families(2, 2, 5, format=TorchFormat((2, 5), torch.bfloat16))}


@pytest.mark.parametrize("name", FAMILY_SETS)
def test_write_then_read_is_decode_of_encode_and_bytes_are_the_formats(name):
    """Each rank writes its own pages; every rank reads decode(encode(x)) in
    float32. The buffer stores uint8 rows of exactly the format's bytes per slot
    (measured from the buffer), and page_bytes counts those bytes."""
    fams = FAMILY_SETS[name]
    lay, bufs, pools = _group(fams)
    _, slots = _alloc(lay, 11)
    values = {}

    def remember(f, layer):
        values[f.name, layer] = _random_values(11, seed=layer)(f, layer)
        return values[f.name, layer]

    _write_everywhere(pools, lay, slots, remember)
    for f in fams:
        b = bufs[f.name]
        assert b.dtype == torch.uint8 and b.element_size() * b[0, 0].numel() == f.format.bytes_per_slot
    assert name != "dsa-fp8" or bufs["latent"].shape[-1] == LATENT_BYTES
    assert pools[0].page_bytes == S * sum(len(f.layers) * f.format.bytes_per_slot for f in fams)
    for p in pools:
        for (n, layer), x in values.items():
            (got,) = read(p, layer, slots, n)
            want = p.families[n].format.decode(p.families[n].format.encode(x))
            assert got.dtype == torch.float32 and torch.equal(got, want)
            assert not torch.equal(got, x) or p.families[n].format.bytes_per_slot == 4 * x[0].numel()


def test_real_shapes_store_656_and_132_bytes_per_slot():
    """DeepSeek-V3.2's fp8 families, allocated: 656 bytes per latent and 132
    per indexer key per slot and layer, measured from the buffers."""
    fams = real_shape("deepseek-v3.2").fp8_families()
    lay = SharedKVLayout(1, 1, 1)
    bufs = allocate_buffers(lay, fams)
    assert [bufs[f.name].element_size() * bufs[f.name][0, 0].numel() for f in fams] == [656, 132]
    assert SharedKVPool(lay, 0, fams, bufs).page_bytes == 61 * (656 + 132)
    gqa = allocate_buffers(lay, kv_families(32, 8, 128, format=gqa_fp8(8, 128)))
    assert gqa["k"].element_size() * gqa["k"][0, 0].numel() == 1056


def test_a_write_of_a_slot_the_rank_does_not_own_raises_and_writes_nothing():
    lay, bufs, (p0, _) = _group(SMALL_DSA.fp8_families())
    theirs = torch.tensor([8, 4])  # page 2 (rank 0), page 1 (rank 1)
    before = {n: b.clone() for n, b in bufs.items()}
    with pytest.raises(ContractViolation, match="rank 0 asked to write slot 4, which rank 1 owns"):
        p0.write_index(theirs)
    with pytest.raises(ContractViolation, match="rank 0 asked to write slot 4"):
        p0.write_all_layers(theirs, {"latent": torch.zeros(3, 2, LATENT_BYTES, dtype=torch.uint8)})
    assert all(torch.equal(before[n], bufs[n]) for n in bufs) and p0.bytes_held() == 0


def test_misuse_is_refused_and_changes_nothing():
    """Float rows for a formatted family's raw write, rows of another width:
    ValueError, every buffer unchanged. (A layer's store refuses its own
    misuse in the data plane: tests/kernels/test_kernel_misuse.py.)"""
    lay, bufs, (p0, _) = _group(SMALL_DSA.fp8_families())
    mine = torch.tensor([8, 9])
    before = {n: b.clone() for n, b in bufs.items()}
    with pytest.raises(ValueError, match="uint8, not torch.float32"):
        p0.write_all_layers(mine, {"latent": torch.zeros(3, 2, LATENT_BYTES)})
    with pytest.raises(ValueError, match="rows of shape"):
        p0.write_all_layers(mine, {"latent": torch.zeros(3, 2, LATENT_BYTES + 1, dtype=torch.uint8)})
    assert all(torch.equal(before[n], bufs[n]) for n in bufs) and p0.bytes_held() == 0
    with pytest.raises(ValueError, match="KVFormat of shape"):
        Family("latent", (25,), (0,), format=mla_latent_fp8(20, 4))
    with pytest.raises(ValueError, match="uint8 rows"):
        Family("index_k", (12,), (0,), torch.float32, indexer_key_fp8(12))
    with pytest.raises(ValueError, match="does not match"):  # a float buffer for a formatted family
        SharedKVPool(lay, 0, SMALL_DSA.fp8_families(), allocate_buffers(lay, SMALL_DSA.families()))


def test_the_float_path_is_unchanged():
    """No format: the family stores its dtype (default float32) as before."""
    f = Family("k", (2, 3), (0,))
    assert f.dtype == torch.float32 and f.format is None and f.row_shape == (2, 3)
    assert kv_families(1, 2, 3) == (f, Family("v", (2, 3), (0,), torch.float32))
    assert Family("k", (2, 3), (0,), torch.bfloat16).slot_bytes() == 12


def _raw_rows(pool, slots, seed):
    """Arbitrary stored bytes (NaN codes and all), which no decode + re-encode would keep."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, (len(f.layers), slots.numel(), *f.row_shape), generator=g, dtype=torch.uint8)
            for n, f in pool.families.items()}


def _fill(pools, lay, slots, rows):
    for p in pools:
        mine = lay.owned_slot_mask(slots, owner_rank=p.rank)
        p.write_all_layers(slots[mine], {n: r[:, mine] for n, r in rows.items()})


def test_copy_slots_and_host_backup_and_load_move_stored_bytes_bit_exactly():
    fams = SMALL_DSA.fp8_families()
    lay, bufs, pools = _group(fams)
    alloc, src = _alloc(lay, 12)
    rows = _raw_rows(pools[0], src, 0)
    _fill(pools, lay, src, rows)
    assert all(torch.equal(pools[1].read_all_layers(src)[n], r) for n, r in rows.items())
    dst = alloc.allocate_extend([0], [12], torch.tensor([-1])).out_cache_loc
    assert sum(p.copy_slots(src, dst) for p in pools) == 12
    assert all(torch.equal(pools[0].read_all_layers(dst)[n], r) for n, r in rows.items())
    hbufs = HostPool.allocate(fams, 6, S)
    hosts = [HostPool(fams, hbufs) for _ in pools]
    host_slots = torch.arange(S, S + 12)
    assert hosts[0].backup(pools[0], src, host_slots) == 12
    assert all(hbufs[n].dtype == torch.uint8 and torch.equal(hbufs[n][:, host_slots], r) for n, r in rows.items())
    new = alloc.allocate_extend([0], [12], torch.tensor([-1])).out_cache_loc
    assert sum(h.load(p, host_slots, new) for h, p in zip(hosts, pools)) == 12
    assert all(torch.equal(pools[1].read_all_layers(new)[n], r) for n, r in rows.items())


def test_a_transfer_between_groups_moves_stored_bytes_bit_exactly():
    """Two source ranks (page 4) to three destination ranks (page 2)."""
    fams = SMALL_DSA.fp8_families()
    src_lay, _, src_pools = _group(fams, N=2)
    dst_lay = SharedKVLayout(3, 2, 12)
    dst_bufs = allocate_buffers(dst_lay, fams)
    dst_pools = [SharedKVPool(dst_lay, r, fams, dst_bufs) for r in range(3)]
    _, src = _alloc(src_lay, 13)
    da = OwnerLaneAllocator.for_layout(dst_lay)
    dst = da.allocate_extend([0], [13], torch.tensor([-1])).out_cache_loc
    rows = _raw_rows(src_pools[0], src, 1)
    _fill(src_pools, src_lay, src, rows)
    plan = plan_transfer(src_lay, dst_lay, src, dst)
    links = thread_p2p(5)
    for a, pool in enumerate(src_pools):
        pending, sent = send_transfer(plan, pool, links[a], lambda b: 2 + b)
        pending.wait()
    got = {}
    for b, pool in enumerate(dst_pools):
        for a, nbytes in receive_transfer(plan, pool, links[2 + b], lambda a: a).items():
            got[a] = got.get(a, 0) + nbytes
    assert sum(got.values()) == 13 * sum(f.slot_bytes() for f in fams)  # stored bytes, not float32
    assert all(torch.equal(dst_pools[2].read_all_layers(dst)[n], r) for n, r in rows.items())


def test_adapters_build_their_fp8_families():
    """The families an engine builds for ``--kv-dtype fp8``: the DSA shape's and
    the GQA ones, stored as the formats' bytes."""
    lat, idx = real_shape("glm-5").fp8_families()
    assert (lat.format, idx.format) == (mla_latent_fp8(512, 64), indexer_key_fp8(128))
    assert (lat.slot_bytes(), idx.slot_bytes()) == (78 * 656, 78 * 132)
    k, v = kv_families(32, 8, 128, format=gqa_fp8(8, 128))
    assert k.slot_bytes() == v.slot_bytes() == 32 * 1056
