"""Live caching (``cache_pages``, then ``finish``) keeps the rules of a
finish of the whole sequence: pages are cached under the request's namespace
only, every cached chain keeps one lane base, and a page cached live is
announced once.
[[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-KV-EVENTS]]"""

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from cpkv import OwnerLaneAllocator
from cpkv.consumers.prefix_cache import PrefixCache
from support.cache_engine import admit, end

N, S = 4, 4
PREFIX = tuple(range(10, 18))  # 8 tokens: two pages


class _Recorder:
    """A KV event sink that records the pages each call names: (event, key, first page index, pages)."""

    def __init__(self):
        self.calls = []

    def stored(self, tokens, first, n, medium, key=None):
        self.calls.append(("stored", key, tuple(tokens[: (first + n) * S]), first, n))

    def removed(self, tokens, first, n, medium, key=None):
        self.calls.append(("removed", key, tuple(tokens[: (first + n) * S]), first, n))


def _admit_together(cache, seqs, keys):
    """Acquire ``seqs`` (nothing cached between) and allocate them in one batch; returns (matches, slots, alloc)."""
    ms = [admit(cache, t, key=k) for t, k in zip(seqs, keys)]
    a = cache.allocate_extend([m.length for m in ms], [len(t) for t in seqs], torch.tensor([m.last_loc for m in ms]))
    out = [torch.cat([m.slots, a.out_cache_loc[s : s + n]]) for m, s, n
           in zip(ms, a.extend_start_loc.tolist(), a.extend_lens.tolist())]
    return ms, out, a


def _chains_keep_one_base(cache) -> None:
    for leaf in cache.tree.leaves:
        lanes = cache.tree.prefix_slots(leaf).numpy()[::S] // S % N
        assert (lanes == (lanes[0] + np.arange(lanes.size)) % N).all(), f"a cached chain with lanes {lanes.tolist()}"


@pytest.mark.parametrize("key_a,key_b", [(None, "tenant"), ("lora-1", "lora-2")])
def test_live_caching_under_two_keys_shares_nothing(key_a, key_b):
    """Two requests of equal tokens under two keys, each caching its prefix
    pages while it runs: both are cached (one chain per namespace), no page is
    shared, a lookup under each key finds its own pages only, each page is
    announced stored once under its key, and the tails settle without a
    second announcement."""
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    cache.events = rec = _Recorder()
    tokens = PREFIX + (1, 2, 3)
    (ma, mb), (sa, sb), _ = _admit_together(cache, [tokens, tokens], [key_a, key_b])
    assert cache.cache_pages([ma, mb], PREFIX + PREFIX, torch.cat([sa[:8], sb[:8]]), [8, 8]).all()
    assert ma.live and mb.live and ma.shared == mb.shared == 8
    a_pages, b_pages = set((sa[:8] // S).tolist()), set((sb[:8] // S).tolist())
    assert not a_pages & b_pages
    for key, own in ((key_a, a_pages), (key_b, b_pages)):
        m = admit(cache, tokens + (4,), key=key)
        assert m.shared == 8 and set((m.slots[:8] // S).tolist()) == own
        end(cache, m, None, m.slots, keep=False)
    assert cache.lookup(tokens, key="a third key").length == 0
    kb = [k.encode() if isinstance(k, str) else k for k in (key_a, key_b)]
    assert sorted((c[1] or b"") for c in rec.calls) == sorted(k or b"" for k in kb)
    assert all(c[0] == "stored" and c[2] == PREFIX and (c[3], c[4]) == (0, 2) for c in rec.calls)
    cache.finish([ma], tokens[8:], sa[8:], [len(sa[8:])])
    cache.finish([mb], tokens[8:], sb[8:], [len(sb[8:])])
    assert len(rec.calls) == 2, "a page cached live is announced once; a partial tail is not announced"
    assert cache.open_matches == 0 and cache.sizes().cached.sum() == 6
    cache.clear()
    assert sum(c[0] == "removed" for c in rec.calls) == 2 and set(cache.tree.roots) == {b""}


def test_a_live_page_of_another_lane_base_is_not_cached_and_its_tail_is_freed():
    """A request's next page whose lane does not continue the cached chain it
    would join (chain base 0 ends at position 8, so page position 2 must sit
    on lane 2; this one is on lane 1): cache_pages declines, nothing changes,
    the match stops caching live; finish then frees that tail as a finish of
    the whole sequence does, and every cached chain keeps one lane base."""
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    (m,), (s,), a = _admit_together(cache, [PREFIX + (9,)], [None])
    assert int(a.lane_base[0]) == 0 and cache.cache_pages([m], PREFIX, s[:8], [8])[0]
    later = PREFIX + (5, 6, 7, 8, 9)
    mc = admit(cache, later)
    assert mc.shared == 8 and mc.node is m.node
    page = int(cache.alloc.alloc_pages_with_owners([1])[0])  # lane 1, not the chain's lane 2
    slots = torch.arange(page * S, page * S + S)
    before, free = cache.snapshot(), cache.alloc.lane_free_pages()
    assert not cache.cache_pages([mc], later[8:12], slots, [4])[0]
    assert not mc.live and cache.snapshot() == before and cache.alloc.lane_free_pages() == free
    cache.finish([mc], later[8:12], slots, [len(slots)])
    assert not cache.alloc.is_allocated([page]).any(), "the tail of another lane base goes back to the free lists"
    cache.finish([m], (9,), s[8:], [1])
    _chains_keep_one_base(cache)
    assert cache.open_matches == 0 and cache.sizes().cached.sum() == 3


def test_a_live_chain_declined_for_its_tokens_keeps_one_base_at_finish():
    """The same with live caching: bases 0 and 3 admitted together; the first
    caches the shared prefix live, so the second's cache_pages declines (the
    tokens are there) and at finish its pages of base 3 are not grafted
    under the base-0 chain: they all go back."""
    cache = PrefixCache(OwnerLaneAllocator(N * 8 * S, S, N))
    a_tokens, b_tokens = PREFIX + (1, 1, 1, 1), PREFIX + (2, 2, 2, 2)
    (ma, mb), (sa, sb), alloc = _admit_together(cache, [a_tokens, b_tokens], [None, None])
    assert alloc.lane_base.tolist() == [0, 3]
    assert cache.cache_pages([ma], a_tokens, sa, [12])[0] and ma.shared == 12
    assert not cache.cache_pages([mb], b_tokens, sb, [12])[0] and not mb.live
    free = sum(cache.alloc.lane_free_pages())
    cache.finish([mb], b_tokens, sb, [len(sb)])
    assert sum(cache.alloc.lane_free_pages()) == free + 3 and not cache.alloc.is_allocated(np.unique(sb.numpy() // S)).any()
    cache.finish([ma], (), sa[12:], [len(sa[12:])])
    _chains_keep_one_base(cache)
    assert cache.open_matches == 0 and cache.sizes().cached.sum() == 3
