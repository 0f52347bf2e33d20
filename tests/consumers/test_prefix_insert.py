"""``PrefixCache.cache_chain`` (a chain the caller holds enters the cache), the cache over values its caller manages
(:class:`CallerSlots`), and SGLang's ``RadixCache`` calls on them through ``SGLangPrefixCache``: insert with
values the caller chose, ``all_values_flatten``, ``take_events``, the sizes, ``disable``, and what each mode
refuses in one line. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]"""

from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.consumers.prefix_cache import CallerSlots, PrefixCache, PrefixCacheMisuse
from cpkv.consumers.sglang_cache import SGLangPrefixCache
from cpkv.contract.allocator import OwnerLaneAllocator
from cpkv.contract.layout import lane_base_of_last_loc
from cpkv.contract.sglang import SGLangAllocator

torch.set_num_threads(1)


def _chain(alloc: OwnerLaneAllocator, base: int, pages: int) -> np.ndarray:
    """The slots of ``pages`` whole pages on lanes ``(base + q) % N``."""
    N, S = alloc.cp_size, alloc.page_size
    p = alloc.alloc_pages_with_owners((base + np.arange(pages)) % N).numpy()
    return (p[:, None] * S + np.arange(S)).reshape(-1)


def _paths(cache: PrefixCache):
    """Every cached chain, root to each leaf: (tokens, slots)."""
    for leaf in cache.tree.leaves:
        yield cache.tree.prefix_tokens(leaf), cache.tree.prefix_slots(leaf).numpy()


@settings(max_examples=40)
@given(N=st.sampled_from([1, 2, 4]), S=st.sampled_from([1, 2, 4]),
       ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 4), st.integers(0, 7),
                              st.booleans()), min_size=1, max_size=12))
def test_cache_chain_keeps_every_chain_on_one_lane_base(N, S, ops):
    """Random inserts over cpkv's allocator: a chain that continues a cached one on its lanes is cached from
    where the tree's part ends (the count returned; those slots stay the caller's); one that would change a
    chain's lane base is refused and nothing changes. After every call every cached chain lies on
    ``(b + q) % N`` for one b, and the cache's sizes count its nodes' pages."""
    alloc = OwnerLaneAllocator(256 * S * N, S, N)
    cache = PrefixCache(alloc)
    for prefix_pages, branch, pages, base, wrong in ops:
        tokens = np.concatenate([np.arange(prefix_pages * S), 1000 * (branch + 1) + np.arange(pages * S)])
        held_tree = cache.lookup(tokens, max_length=tokens.size).shared
        b = base % N
        if held_tree:  # continue the cached chain's lane base, or break it
            b = lane_base_of_last_loc(int(cache.lookup(tokens, max_length=held_tree).last_shared_loc), held_tree, S, N)
            b = (b + 1) % N if (wrong and N > 1) else b
        slots = _chain(alloc, (b + held_tree // S) % N, (tokens.size - held_tree) // S)
        full = np.concatenate([np.arange(held_tree), slots])  # the tree's part: the caller's own copies, unread
        before = cache.snapshot()
        if wrong and N > 1 and held_tree and held_tree < tokens.size:
            with pytest.raises(PrefixCacheMisuse) as e:
                cache.cache_chain(tokens, full)
            assert e.value.rule == "lane-base-changed" and cache.snapshot() == before
            alloc.free(slots)
            continue
        assert cache.cache_chain(tokens, full) == held_tree
        for toks, path in _paths(cache):
            lanes = path[::S] // S % N
            assert (lanes == (lanes[0] + np.arange(lanes.size)) % N).all()
        assert cache.sizes().cached.sum() == sum(len(n.key) // S for n in cache.tree.nodes())


def test_cache_chain_refusals_change_nothing():
    alloc = OwnerLaneAllocator(64, 4, 2)
    cache = PrefixCache(alloc)
    slots = _chain(alloc, 0, 2)
    cache.cache_chain(np.arange(8), slots)
    for rule, tokens, s in (("length-mismatch", np.arange(8), slots[:4]), ("not-whole-pages", np.arange(6), slots[:6]),
                            ("bad-tokens", -np.arange(1, 9), slots),
                            ("private-page-cached", np.arange(100, 108), slots),  # the cache's own pages
                            ("private-page-not-allocated", np.arange(200, 204), np.arange(40, 44)),
                            ("not-a-page-chain", np.arange(300, 304), np.array([40, 42, 41, 43]))):
        before = (cache.snapshot(), alloc.snapshot())
        with pytest.raises(PrefixCacheMisuse) as e:
            cache.cache_chain(tokens, s)
        assert e.value.rule == rule and (cache.snapshot(), alloc.snapshot()) == before


def test_cache_over_caller_slots_keeps_values_and_allocates_nothing():
    """Over CallerSlots: any values >= 0 (not pages), matched back as given; an eviction hands them to the
    caller's ``free``; the verbs that allocate refuse (``no-allocator``)."""
    freed = []
    cache = PrefixCache(CallerSlots(2, freed.append))
    assert not cache.owns_pages
    assert cache.cache_chain([1, 2, 3, 4], [10, 20, 30, 40]) == 0
    assert cache.cache_chain([1, 2, 5, 6], [70, 80, 50, 60]) == 2  # the tree's 10, 20 kept; 70, 80 stay the caller's
    hit = cache.lookup([1, 2, 5, 6], max_length=4)
    m = cache.allocate(hit)
    assert m.slots.tolist() == [10, 20, 50, 60]
    cache.finish([m], None, torch.empty(0, dtype=torch.int64), [0], cache=False)
    cache.evict(np.array([3]))
    assert sorted(np.concatenate([f.numpy() for f in freed]).tolist()) == [10, 20, 30, 40, 50, 60]
    for call in (lambda: cache.allocate_extend([0], [4], [-1]), lambda: cache.allocate_decode([1], [-1]),
                 lambda: cache.can_allocate([1, 2], 4), lambda: cache.chain_need(-1, 0, 4)):
        with pytest.raises(PrefixCacheMisuse, match="no-allocator"):
            call()
    with pytest.raises(PrefixCacheMisuse, match="bad-slots"):
        cache.cache_chain([9, 9], [-1, 5])
    with pytest.raises(TypeError):
        PrefixCache(MagicMock())
    with pytest.raises(ValueError):
        CallerSlots(0)


def _key(tokens, extra_key=None):
    return SimpleNamespace(token_ids=list(tokens), extra_key=extra_key)


def test_sglang_radix_calls_over_values_the_caller_chose():
    """SGLang's tests' use: ``create_simulated`` with a mock allocator, ``insert`` of chosen values (an
    ``InsertParams``-shaped object, or ``(key, value)``), matches returning them, ``all_values_flatten``, sizes
    as SGLang counts them (tokens in unlocked / locked nodes), events in SGLang's form, eviction through the
    mock's ``free``."""
    mock = MagicMock()
    mock.device = torch.device("cpu")
    cache = SGLangPrefixCache.create_simulated(mock_allocator=mock, page_size=2, enable_kv_cache_events=True)
    assert not cache.cache.owns_pages and cache.enable_kv_cache_events and len(cache.root_node.key) == 0
    r = cache.insert(SimpleNamespace(key=_key([1, 2, 3, 4, 5]), value=torch.tensor([10, 20, 30, 40, 50])))
    assert (r.prefix_len, cache.total_size(), cache.evictable_size()) == (0, 4, 4)
    assert cache.insert(_key([1, 2, 7, 8]), torch.tensor([90, 91, 70, 80])).prefix_len == 2
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40, 70, 80]
    mr = cache.match_prefix(SimpleNamespace(key=_key([1, 2, 7, 8, 9])))
    assert mr.device_indices.tolist() == [10, 20, 70, 80] and mr.prefix_len == mr.device_prefix_len == 4
    cache.inc_lock_ref(mr.last_device_node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    cache.dec_lock_ref(mr.last_device_node)
    events = cache.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored"]
    assert events[0].token_ids == [1, 2, 3, 4] and events[0].block_size == 2 and events[0].parent_block_hash is None
    assert events[1].parent_block_hash == events[0].block_hashes[0] and cache.take_events() == []
    assert cache.evict(SimpleNamespace(num_tokens=6)).num_tokens_evicted == 6
    assert sorted(torch.cat([c.args[0] for c in mock.free.call_args_list]).tolist()) == [10, 20, 30, 40, 70, 80]
    assert [type(e).__name__ for e in cache.take_events()] == ["BlockRemoved"] * 3  # the two leaves, then their parent
    assert cache.total_size() == 0


def test_sglang_radix_disabled_caches_nothing():
    cache = SGLangPrefixCache.create_simulated(disable=True, enable_kv_cache_events=True)
    assert cache.disable and not cache.supports_prefix_sharing()
    assert cache.insert(_key([1, 2, 3]), torch.tensor([1, 2, 3])).prefix_len == 0
    mr = cache.match_prefix(_key([1, 2, 3]))
    assert mr.device_prefix_len == 0 and cache.inc_lock_ref(mr.last_device_node).delta == 0
    assert cache.total_size() == 0 and cache.take_events() == [] and cache.evict(10).num_tokens_evicted == 0


def test_sglang_radix_refusals_in_one_line():
    """What the cache cannot do in a mode is refused in one line, nothing changed."""
    params = dict(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4)
    for extra, match in (({"is_eagle": True}, "EAGLE"), ({"eviction_policy": "lfu"}, "eviction_policy"),
                         ({"dynamo_kv_event_format": True}, "dynamo")):
        with pytest.raises(NotImplementedError, match=match):
            SGLangPrefixCache(SimpleNamespace(**params, **extra))
    with pytest.raises(NotImplementedError):
        SGLangPrefixCache.create_simulated(dynamo_kv_event_format=True)
    with pytest.raises(ValueError, match="page_size is needed"):
        SGLangPrefixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None)
    cache = SGLangPrefixCache.create_simulated(page_size=4)
    req = SimpleNamespace(fill_ids=[1, 2, 3, 4], last_node=None, req_pool_idx=0, extra_key=None,
                          origin_input_ids=[1, 2, 3, 4], output_ids=[])
    for call in (lambda: cache.cache_unfinished_req(req), lambda: cache.cache_finished_req(req)):
        with pytest.raises(PrefixCacheMisuse, match="no-pool"):
            call()
    alloc = SGLangAllocator(64, 4, cp_size=2)
    owned = SGLangPrefixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    bases = [1]
    slots = alloc.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([8]), torch.tensor([8]),
                               torch.tensor([-1]), 8, rotation_bases=bases)
    before = owned.cache.snapshot()
    with pytest.raises(PrefixCacheMisuse, match="lane-base-changed"):  # InsertParams.rotation_base not the values'
        owned.insert(SimpleNamespace(key=_key(range(8)), value=slots, rotation_base=0))
    assert owned.cache.snapshot() == before
    assert owned.insert(SimpleNamespace(key=_key(range(8)), value=slots, rotation_base=1)).prefix_len == 0
    with pytest.raises(PrefixCacheMisuse, match="private-page"):  # values not allocated to the caller
        owned.insert(_key(range(100, 108)), slots)
