"""A :class:`PrefixMatch` derives its tokens and slots from the chain it holds:
no O(context) copy per request, and the same answer after the tree splits
that chain or the match ends. [[RFC-0001:C-PREFIX-CACHE]]"""

import dataclasses

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator
from cpkv.consumers.prefix_cache import PrefixCache
from support.cache_engine import admit, end


def _cached(S: int, N: int, seq: list[int]) -> tuple[PrefixCache, torch.Tensor]:
    """A cache holding ``seq`` (inserted through a match of nothing), and its slots."""
    cache = PrefixCache(OwnerLaneAllocator(64 * N * S, S, N))
    m = admit(cache, seq + [0])
    a = cache.allocate_extend([0], [len(seq)], torch.tensor([-1]))
    cache.finish([m], seq, a.out_cache_loc, [len(seq)])
    return cache, a.out_cache_loc


@settings(max_examples=40, deadline=None)
@given(S=st.sampled_from([1, 2, 4]), N=st.sampled_from([1, 2, 4]), pages=st.integers(2, 12), data=st.data())
def test_tokens_and_slots_are_the_chain_the_match_holds(S, N, pages, data):
    """A match's tokens and slots are the cached ones of its shared pages, then
    its copy's; no array it keeps has a page's worth of entries or more; a
    second match that splits the first one's chain, and the first match's
    end, change neither."""
    seq = [int(x) for x in np.random.default_rng(pages).integers(1, 50, pages * S)]
    cache, slots = _cached(S, N, seq)
    cut = data.draw(st.integers(1, len(seq) - 1))  # the first request's prompt shares seq[:cut]
    m = admit(cache, seq[:cut] + [99])
    want_slots = slots[: m.shared].tolist()
    assert m.length == cut and m.tokens.tolist() == seq[:cut]
    assert m.slots.tolist() == want_slots + m.copy_dst.tolist() and m.slots[: m.shared].tolist() == want_slots
    assert m.last_loc == (m.slots.tolist() or [-1])[-1]
    kept = [getattr(m, f.name) for f in dataclasses.fields(m)]
    kept = [v for v in kept if isinstance(v, (np.ndarray, torch.Tensor))]
    assert all(len(v) < S for v in kept), "a match keeps a copy of its prefix"
    before = (m.tokens.tolist(), m.slots.tolist(), m.last_loc)
    other = admit(cache, seq[: data.draw(st.integers(1, len(seq) - 1))] + [98])  # may split m's node
    assert (m.tokens.tolist(), m.slots.tolist(), m.last_loc) == before
    end(cache, m, None, m.slots, keep=False)
    end(cache, other, None, other.slots, keep=False)
    assert (m.tokens.tolist(), m.slots.tolist(), m.last_loc) == before and cache.open_matches == 0


def test_a_live_match_keeps_its_matched_slots_while_its_pages_are_cached():
    """``cache_pages`` moves ``shared`` and the held node on; ``length``,
    ``tokens`` and ``slots`` stay those of the match."""
    S, N = 4, 2
    seq = list(range(1, 13))
    cache, slots = _cached(S, N, seq)
    m = admit(cache, seq[:6] + [50, 51, 52, 53, 54, 55, 56])  # 4 shared, 2 copied
    before = (m.length, m.tokens.tolist(), m.slots.tolist())
    a = cache.allocate_extend([6], [12], torch.tensor([m.last_loc]))
    run = torch.cat([m.copy_dst, a.out_cache_loc[:2]])  # positions 4..7: the copy's page, now full
    assert cache.cache_pages([m], seq[4:6] + [50, 51], run, [4])[0] and m.shared == 8
    assert (m.length, m.tokens.tolist(), m.slots.tolist()) == before and before[2][:4] == slots[:4].tolist()
    cache.finish([m], [52, 53, 54, 55], a.out_cache_loc[2:], [4])
    assert (m.length, m.tokens.tolist(), m.slots.tolist()) == before
