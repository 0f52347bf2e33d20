"""The prefix cache's chains keep one lane base, and namespaces (SGLang's
``extra_key``, vLLM's cache salt) partition it.
[[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-REQUEST-RELATIVE]]"""

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from cpkv import OwnerLaneAllocator
from cpkv.consumers.prefix_cache import PrefixCache, PrefixCacheMisuse
from support.cache_engine import admit, end

N, S = 4, 4
PREFIX = tuple(range(10, 18))  # 8 tokens: two pages


def _lanes(slots) -> list:
    return (np.unique(np.asarray(slots) // S) % N).tolist() if len(slots) else []


def _chain_lanes(slots) -> list:
    """The lane of each page position of a request's slot chain."""
    return (np.asarray(slots)[::S] // S % N).tolist()


def _chains_keep_one_base(cache) -> None:
    for leaf in cache.tree.leaves:
        lanes = np.asarray(_chain_lanes(cache.tree.prefix_slots(leaf).tolist()))
        assert (lanes == (lanes[0] + np.arange(lanes.size)) % N).all(), f"a cached chain with lanes {lanes.tolist()}"


def _run_together(cache, seqs, keys=(None, None)):
    """Admit ``seqs`` in one step before either is cached, allocate them in one batch; returns (matches, slots)."""
    ms = [admit(cache, t, key=k) for t, k in zip(seqs, keys)]
    a = cache.allocate_extend([m.length for m in ms], [len(t) for t in seqs],
                              torch.tensor([m.last_loc for m in ms]))
    out = [torch.cat([m.slots, a.out_cache_loc[s : s + n]]) for m, s, n
           in zip(ms, a.extend_start_loc.tolist(), a.extend_lens.tolist())]
    return ms, out, a


def test_a_tail_of_another_lane_base_is_not_grafted_under_a_cached_chain():
    """Two requests of one prefix admitted together take lane bases 0 and 3,
    and both are cached; the second one's tail must not hang under the first
    one's chain (it would give a later request lanes [0, 1, 1] with lane base
    3); its finish stops there and frees the tail."""
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    a_tokens, b_tokens = PREFIX + (1, 1, 1, 1), PREFIX + (2, 2, 2, 2)
    (ma, mb), (sa, sb), alloc = _run_together(cache, [a_tokens, b_tokens])
    assert alloc.lane_base.tolist() == [0, 3]
    end(cache, ma, a_tokens, sa)
    free_before = sum(cache.alloc.lane_free_pages())
    end(cache, mb, b_tokens, sb)
    assert sum(cache.alloc.lane_free_pages()) == free_before + 3, "the second chain's pages all go back"
    assert not cache.alloc.is_allocated(np.unique(sb.numpy() // S)).any()
    _chains_keep_one_base(cache)
    later = b_tokens + (5, 6)
    m = admit(cache, later)
    assert m.length == 8, "only the first chain's pages are shared"
    r = cache.allocate_extend([m.length], [len(later)], torch.tensor([m.last_loc]))
    slots = torch.cat([m.slots, r.out_cache_loc])
    b = int(r.lane_base[0])
    assert _chain_lanes(slots.tolist()) == [(b + q) % N for q in range(-(-len(later) // S))]
    end(cache, m, later, slots)
    _chains_keep_one_base(cache)


def test_a_copy_after_shared_pages_continues_their_lanes():
    """A mid-page match after shared pages: the copy page takes the lane that
    continues the shared chain, so the request (and what it caches) keeps one base."""
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    first = PREFIX + (1, 2, 3, 4, 5)
    (m,), (s,), _ = _run_together(cache, [first])
    end(cache, m, first, s)
    assert cache.alloc.alloc_pages_with_owners([2, 2]) is not None  # lane 2 now has the fewest free pages
    second = PREFIX + (1, 2, 9, 9, 9)
    hit = cache.lookup(second)
    assert hit.shared == 8 and hit.copy == 2
    m2 = admit(cache, second)
    assert _chain_lanes(m2.slots.tolist()) == _chain_lanes(s.tolist())[:3]
    need = cache.can_allocate(second, len(second)).need
    r = cache.allocate_extend([m2.length], [len(second)], torch.tensor([m2.last_loc]))
    slots = torch.cat([m2.slots, r.out_cache_loc])
    assert np.bincount(np.asarray(_chain_lanes(slots.tolist()))[2:], minlength=N).tolist() == need.tolist()
    end(cache, m2, second, slots)
    _chains_keep_one_base(cache)


@pytest.mark.parametrize("key_a,key_b", [(None, "tenant"), ("lora-1", "lora-2"), (7, None), (7, "8")])
def test_requests_with_different_keys_never_share_a_page(key_a, key_b):
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    tokens = PREFIX + (1, 2, 3)
    m = admit(cache, tokens, key=key_a)
    r = cache.allocate_extend([0], [len(tokens)], torch.tensor([-1]))
    end(cache, m, tokens, r.out_cache_loc)
    assert cache.lookup(tokens, key=key_a).length == len(tokens) - 1
    other = cache.lookup(tokens + (4,), key=key_b)
    assert other.length == 0 and other.shared == 0
    mb = admit(cache, tokens + (4,), key=key_b)
    assert mb.length == 0 and not mb.slots.numel()
    rb = cache.allocate_extend([0], [len(tokens) + 1], torch.tensor([-1]))
    end(cache, mb, tokens + (4,), rb.out_cache_loc)
    a_pages, b_pages = set((r.out_cache_loc // S).tolist()), set((rb.out_cache_loc // S).tolist())
    assert not a_pages & b_pages and cache.alloc.is_allocated(sorted(a_pages | b_pages)).all()
    for key, n in ((key_a, len(tokens)), (key_b, len(tokens) + 1)):
        m = admit(cache, tokens + (4, 0), key=key)
        assert set((m.slots[: m.shared] // S).tolist()) <= (a_pages if key == key_a else b_pages)
        end(cache, m, None, m.slots, keep=False)
    cache.clear()
    assert cache.sizes().cached.sum() == 0 and set(cache.tree.roots) == {b""}, "emptied namespaces leave no root"


def test_an_int_key_and_its_decimal_string_are_one_namespace():
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    m = admit(cache, PREFIX, key=7)
    r = cache.allocate_extend([0], [8], torch.tensor([-1]))
    end(cache, m, PREFIX, r.out_cache_loc)
    assert cache.lookup(PREFIX + (1,), key="7").shared == 8
    assert cache.lookup(PREFIX + (1,), key=None).shared == 0


@pytest.mark.parametrize("key", [1.5, True, ("a",), [1], object()])
def test_a_bad_key_is_refused_and_changes_nothing(key):
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    before = cache.snapshot()
    for call in (lambda: cache.lookup(PREFIX, key=key),
                 lambda: cache.can_allocate(PREFIX, 9, key=key)):
        with pytest.raises(PrefixCacheMisuse) as e:
            call()
        assert e.value.rule == "bad-key"
        assert cache.snapshot() == before
