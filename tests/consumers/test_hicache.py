"""The host tier: the host index (which chains the host holds, LRU when full)
and the data moves (backup by the IO rank through the shared view, load by
each owner into its own segment). [[RFC-0001:C-HICACHE]] [[RFC-0001:C-DIRECT-WRITE]]"""

import numpy as np
import pytest
import torch

from cpkv import ContractViolation, OwnerLaneAllocator, SharedKVLayout
from cpkv.consumers.hicache import HostPool, HostTier
from cpkv.consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
from cpkv.consumers.prefix_cache import PrefixCache

from support.pool_io import read, write

S = 4


def test_backup_indexes_whole_pages_and_lookup_changes_nothing():
    host = HostTier(8, S)
    dev = torch.arange(100, 110)  # device slots of 10 tokens: 2 whole pages + 2
    got = host.backup(tuple(range(10)), dev)
    assert got is not None
    d, h = got
    assert torch.equal(d, dev[:8]) and h.numel() == 8 and host.used_pages() == 2
    before = host.index.snapshot()
    hit = PrefixCache(OwnerLaneAllocator(64, S, 2)).lookup(tuple(range(12)))  # an empty device cache
    assert host.lookup(tuple(range(12)), hit) == 8
    assert host.index.snapshot() == before
    assert host.backup(tuple(range(10)), dev) is None  # held already: nothing to copy


def test_a_longer_chain_copies_only_the_pages_the_host_lacks():
    host = HostTier(8, S)
    host.backup(tuple(range(8)), torch.arange(8))
    d, h = host.backup(tuple(range(12)), torch.arange(50, 62))
    assert torch.equal(d, torch.arange(58, 62)) and h.numel() == 4 and host.used_pages() == 3


def test_a_chain_longer_than_the_host_leaves_the_older_chains_found():
    """A Mooncake slice's 2,720-token request against 64 host pages of 16 raised exceeds-capacity on a rank: the
    long chain is not backed up (its evicted pages cannot be held), and what the host held is still found."""
    host = HostTier(3, S)
    host.backup((9,) * 4, torch.arange(4))
    assert host.backup(tuple(range(22)), torch.arange(100, 122)) is None  # 5 whole pages against 3
    device = PrefixCache(OwnerLaneAllocator(64, S, 2))
    assert host.lookup(tuple(range(22)), device.lookup(tuple(range(22)))) == 0
    assert host.lookup((9,) * 5, device.lookup((9,) * 5)) == 4  # the older chain, its one page


def test_a_chain_longer_than_the_whole_tier_is_not_backed_up_and_changes_nothing():
    """A tier of 3 pages and an evicted chain of 4 whole pages: no room, ever; backup says so (``None``),
    as it does for a full tier, instead of the allocator's exceeds-capacity refusal."""
    host = HostTier(3, S)
    host.backup(tuple(range(8)), torch.arange(8))
    before = host.index.snapshot()
    assert host.backup(tuple(range(100, 116)), torch.arange(16)) is None
    assert host.index.snapshot() == before and host.used_pages() == 2


def test_a_full_host_evicts_least_recently_used_chains_but_not_pinned_ones():
    host = HostTier(2, S)
    host.backup((1,) * 4, torch.arange(4))
    host.backup((2,) * 4, torch.arange(4, 8))
    pinned = host.take((1,) * 4 + (0,), 0, 4)  # a load of this step holds chain 1
    assert host.backup((3,) * 4, torch.arange(8, 12)) is not None  # evicts chain 2, the only unpinned one
    dev_hit = PrefixCache(OwnerLaneAllocator(64, S, 1)).lookup((2,) * 4 + (0,))
    assert host.lookup((2,) * 4 + (0,), dev_hit) == 0 and host.lookup((1,) * 4 + (0,), dev_hit) == 4
    assert host.backup((4,) * 4, torch.arange(12, 16)) is not None  # evicts chain 3; chain 1 is pinned
    assert host.lookup((3,) * 4 + (0,), dev_hit) == 0 and host.lookup((1,) * 4 + (0,), dev_hit) == 4
    host.step_done()
    assert pinned.numel() == 4
    host.clear()
    assert host.used_pages() == 0


def _group(N=2, ppr=8, host_pages=6):
    lay = SharedKVLayout(N, S, ppr)
    fams = kv_families(2, 1, 3)
    bufs = allocate_buffers(lay, fams)
    pools = [SharedKVPool(lay, r, fams, bufs) for r in range(N)]
    hbufs = HostPool.allocate(fams, host_pages, S)
    return lay, bufs, pools, [HostPool(fams, hbufs) for _ in range(N)], hbufs


def test_only_the_io_rank_backs_up_and_every_owner_loads_its_own_pages():
    lay, bufs, pools, hosts, hbufs = _group()
    alloc = OwnerLaneAllocator.for_layout(lay)
    a = alloc.allocate_extend([0], [12], torch.tensor([-1]))
    slots = a.out_cache_loc
    val = torch.arange(12, dtype=torch.float32)[:, None, None].expand(12, 1, 3)
    for p in pools:
        mine = lay.owned_slot_mask(slots, owner_rank=p.rank)
        for layer in range(2):
            write(p, layer, slots[mine], k=val[mine] + layer, v=-val[mine])
    host_slots = torch.arange(S, S + 12)
    assert hosts[1].backup(pools[1], slots, host_slots) == 0  # not the IO rank: copies nothing
    assert hbufs["k"].abs().sum() == 0
    assert hosts[0].backup(pools[0], slots, host_slots) == 12
    assert torch.equal(hbufs["k"][1, host_slots], val + 1)
    new = alloc.allocate_extend([0], [12], torch.tensor([-1])).out_cache_loc  # fresh device pages
    loaded = [h.load(p, host_slots, new) for h, p in zip(hosts, pools)]
    assert sum(loaded) == 12 and all(0 < x < 12 for x in loaded)  # each owner its own share
    for p in pools:
        k, v = read(p, 1, new)
        assert torch.equal(k, val + 1) and torch.equal(v, -val)


def test_a_load_into_another_ranks_slot_is_refused_before_any_write():
    lay, bufs, pools, hosts, hbufs = _group()
    theirs = torch.tensor([4, 5])  # page 1: rank 1
    before = {n: b.clone() for n, b in bufs.items()}
    with pytest.raises(ContractViolation, match="rank 0 asked to write slot 4"):
        pools[0].write_all_layers(theirs, {n: torch.ones(2, 2, 1, 3) for n in bufs})
    assert all(torch.equal(before[n], bufs[n]) for n in bufs)


def test_host_tier_refuses_nonsense_sizes():
    with pytest.raises(ValueError, match="host_pages must be >= 1"):
        HostTier(0, S)
    np.testing.assert_equal(HostTier(3, S).num_pages, 3)
