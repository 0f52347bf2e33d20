"""The batched calls (``cache_pages``, ``finish``) do what the calls of one
request each, one by one in order, do, checked at once: the same cache state,
the same answers, the same allocator state; a batch a single call would
refuse (or a match twice, or two runs on one page) raises with nothing
changed. ``RadixTree.graft_pages`` answers for a batch what
``graft_length`` answers chain by chain. [[RFC-0001:C-PREFIX-CACHE]]
[[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

torch.set_num_threads(1)

from cpkv import OwnerLaneAllocator
from cpkv.consumers.prefix_cache import PrefixCache, PrefixCacheMisuse
from support.cache_engine import admit, end

N, S = 3, 4


def _world(seqs, keys, base_len=13):
    """A cache with ``seqs`` admitted (each its prefix match, nothing cached
    between) and allocated in one batch: (cache, matches, per-request slots)."""
    cache = PrefixCache(OwnerLaneAllocator(N * 40 * S, S, N))
    # a cached chain of 9s: some requests share a page of it, or copy into one, or (base_len 12) match all of a leaf
    base = admit(cache, (9,) * base_len)
    a = cache.allocate_extend([0], [base_len], torch.tensor([-1]))
    end(cache, base, (9,) * base_len, a.out_cache_loc)
    ms = [admit(cache, t, key=k) for t, k in zip(seqs, keys)]
    a = cache.allocate_extend([m.length for m in ms], [len(t) for t in seqs], torch.tensor([m.last_loc for m in ms]))
    slots = [torch.cat([m.slots, a.out_cache_loc[s : s + n]]) for m, s, n
             in zip(ms, a.extend_start_loc.tolist(), a.extend_lens.tolist())]
    return cache, ms, slots


def _state(cache, ms):
    return (cache.snapshot(), cache.alloc.lane_free_pages(), [(m.shared, m.live, m.consumed) for m in ms])


def _end_general(cache, m, tokens, slots):
    """End ``m`` by the general path alone (walk, graft, attach, dominance), as
    ``finish`` does a run its batched shortcut does not take."""
    spare = [x for x in cache._cache_run(m, tokens, slots.numpy().copy()) if x.size]
    if spare:
        cache.alloc.free(np.concatenate(spare))


def _runs(seqs, ms, slots, ends):
    toks = [np.asarray(t[m.shared : e], dtype=np.int64) for t, m, e in zip(seqs, ms, ends)]
    sl = [s[m.shared : e] for s, m, e in zip(slots, ms, ends)]
    return toks, sl


seq_st = st.lists(st.tuples(st.sampled_from([(9,) * 12, (9,) * 8, (9,) * 5, ()]), st.lists(st.integers(0, 2), min_size=1,
                                                                              max_size=14)),
                  min_size=1, max_size=5)


@settings(max_examples=80, deadline=None)
@given(seq_st, st.lists(st.sampled_from([None, "k"]), min_size=5, max_size=5), st.sampled_from([12, 13]))
def test_a_batch_does_what_the_calls_one_by_one_do(parts, keys, base_len):
    """Requests on a shared prefix (or none), some with equal tokens: caching
    their full pages in one batch, then ending them in one batch, leaves the
    cache, the allocator and the matches as the calls one by one do, with the
    same answers, and as the general end (walk, graft, attach, dominance) one
    by one, which the batch's shortcut for partial last pages skips; nothing
    leaks once the cache is cleared."""
    seqs = [p + tuple(r) for p, r in parts]
    seqs = [s if len(s) > 1 else s + (1, 1) for s in seqs]
    keys = keys[: len(seqs)]
    outs = []
    for batched in (False, True, None):  # None: ended by the general path one by one (no batched shortcut)
        cache, ms, slots = _world(seqs, keys, base_len)
        live = [i for i, (t, m) in enumerate(zip(seqs, ms)) if (len(t) - m.shared) // S]
        ends = [ms[i].shared + (len(seqs[i]) - ms[i].shared) // S * S for i in live]
        toks, sl = _runs([seqs[i] for i in live], [ms[i] for i in live], [slots[i] for i in live], ends)
        if batched:
            got = cache.cache_pages([ms[i] for i in live], np.concatenate(toks or [np.empty(0, np.int64)]),
                                    torch.cat(sl) if sl else torch.empty(0, dtype=torch.int64),
                                    [t.size for t in toks]).tolist()
        else:
            got = [bool(cache.cache_pages([ms[i]], t, s, [t.size])[0]) for i, t, s in zip(live, toks, sl)]
        mid = _state(cache, ms)
        toks, sl = _runs(seqs, ms, slots, [len(t) for t in seqs])
        if batched:
            cache.finish(ms, np.concatenate(toks), torch.cat(sl), [t.size for t in toks])
        elif batched is None:
            for m, t, s in zip(ms, toks, sl):
                _end_general(cache, m, t, s)
        else:
            for m, t, s in zip(ms, toks, sl):
                cache.finish([m], t, s, [t.size])
        outs.append((got, mid, _state(cache, ms)))
        cache.clear()
        assert cache.alloc.lane_free_pages() == cache.alloc.lane_pages.tolist(), "pages leaked"
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("tails", [[(0,), (0, 1)], [(2,), (2,)], [(0, 1), (0,), (3,)]])
def test_partial_tails_under_one_node_end_as_the_general_path_does(tails):
    """Requests that matched a whole cached leaf end with partial last pages
    under that one node: a later tail the earlier one starts dominates it, an
    equal one is served by it (its page freed). The batch does what the
    general end one by one does."""
    seqs = [(9,) * 12 + t for t in tails]
    outs = []
    for batched in (True, False):
        cache, ms, slots = _world(seqs, [None] * len(seqs), base_len=12)
        assert len({id(m.node) for m in ms}) == 1 and not ms[0].node.children
        toks, sl = _runs(seqs, ms, slots, [len(t) for t in seqs])
        if batched:
            cache.finish(ms, np.concatenate(toks), torch.cat(sl), [t.size for t in toks])
        else:
            for m, t, s in zip(ms, toks, sl):
                _end_general(cache, m, t, s)
        outs.append(_state(cache, ms))
    assert outs[0] == outs[1]


def test_a_batch_the_single_calls_would_refuse_changes_nothing():
    """A match twice, two runs on one page, counts that do not add up, a run
    that is not whole pages, a consumed match: each raises its rule and the
    cache is as before."""
    seqs = [(1, 2, 3, 4, 5, 6, 7, 8, 1), (2, 2, 3, 4, 5, 6, 7, 8, 2)]
    cache, ms, slots = _world(seqs, [None, None])
    t = [np.array(s[:8]) for s in seqs]
    before = _state(cache, ms)
    cases = {
        "match-twice": ([ms[0], ms[0]], np.concatenate(t), torch.cat([slots[0][:8], slots[1][:8]]), [8, 8]),
        "not-a-page-chain": (ms, np.concatenate(t), torch.cat([slots[0][:8], slots[0][:8]]), [8, 8]),
        "length-mismatch": (ms, np.concatenate(t), torch.cat([slots[0][:8], slots[1][:8]]), [8, 4]),
        "not-whole-pages": (ms, np.concatenate([t[0], t[1][:6]]), torch.cat([slots[0][:8], slots[1][:6]]), [8, 6]),
        "bad-counts": (ms, np.concatenate(t), torch.cat([slots[0][:8], slots[1][:8]]), [16, -8]),
    }
    for rule, (mm, tt, ss, cc) in cases.items():
        with pytest.raises(PrefixCacheMisuse) as e:
            cache.cache_pages(mm, tt, ss, cc)
        assert e.value.rule == rule, (rule, e.value)
        assert _state(cache, ms) == before, rule
    cache.finish([ms[1]], seqs[1], slots[1], [9])
    before = _state(cache, ms)
    with pytest.raises(PrefixCacheMisuse, match="match-consumed"):
        cache.finish(ms, np.concatenate([np.array(s) for s in seqs]), torch.cat(slots), [9, 9])
    assert _state(cache, ms) == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, N - 1), max_size=6)), min_size=1, max_size=6))
def test_graft_pages_answers_each_chain_as_graft_length_does(chains):
    """For chains of any lanes under the root or under a cached node, the
    batch answer is each chain's own (pages that continue the lane base)."""
    cache = PrefixCache(OwnerLaneAllocator(N * 30 * S, S, N))
    m = admit(cache, tuple(range(2 * S)))
    a = cache.allocate_extend([0], [2 * S], torch.tensor([-1]))
    end(cache, m, tuple(range(2 * S)), a.out_cache_loc)
    node = next(iter(cache.tree.leaves))
    tree = cache.tree
    nodes, starts, lanes, pages, want = [], [], [], [], []
    for under, ls in chains:
        parent, start = (tree.root, 0) if under == 0 else (node, 2 * S)
        # pages of the given lanes: page p has lane p % N; 3 * N + lane is a page of that lane
        slots = torch.tensor([(3 * N * (j + 1) + lane) * S + o for j, lane in enumerate(ls) for o in range(S)],
                             dtype=torch.int64)
        nodes.append(parent)
        starts.append(start)
        lanes += ls
        pages.append(len(ls))
        # written out here: the first page continues the chain (the lane after the node's last page's), or
        # under a root starts its own; every later page takes the next lane
        first = (ls[0] if ls else 0) if under == 0 else (int(node.slots[-1]) // S + 1) % N
        ok = next((q for q, lane in enumerate(ls) if lane != (first + q) % N), len(ls))
        want.append(ok)
        if ls:
            assert tree.graft_length(parent, start, slots) == (slots.numel() if ok == len(ls) else ok * S)
    got = tree.graft_pages(nodes, np.array(starts), np.array(lanes, dtype=np.int64), np.array(pages))
    assert got.tolist() == want
