"""Prefix cache misuse: every wrong call an integrating engine is likely to make
raises PrefixCacheMisuse (or UnsupportedPagePlan) with the cache and the
allocator exactly as they were; lookup has no side effect; a match is
finished once; the eviction hook sees the pages before they are freed, and
what an allocation evicted comes back as values.
[[RFC-0001:C-PREFIX-CACHE]]"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.consumers.prefix_cache import PrefixCache, PrefixCacheMisuse, PrefixHit
from support.cache_engine import Engine, admit, cached_sets, end

S, N = 2, 2


def engine(pages=8, **kw):
    return Engine(pages, S, N, **kw)


def cached(e, rid, tokens):
    """Run ``tokens`` as a request and cache it."""
    assert e.start(rid, tokens) is not None
    return e.finish(rid)


def refused(e, call, rule, error=PrefixCacheMisuse):
    before = e.state()
    with pytest.raises(error) as err:
        call()
    assert err.value.rule == rule, err.value
    assert e.state() == before, f"refused call ({rule}) changed the state"
    return err.value


def test_second_finish_never_frees_pages_the_tree_serves():
    e = engine()
    tokens, slots, m = cached(e, 0, (1, 2, 3, 4, 5, 6))
    err = refused(e, lambda: end(e.cache, m, tokens, slots), "match-consumed")
    assert "cached" in str(err)
    refused(e, lambda: end(e.cache, m, None, slots, keep=False), "match-consumed")
    pages = np.unique(slots.numpy() // S)
    assert e.alloc.is_allocated(pages).all()
    # a new request is never handed a page the tree still serves
    e.start(1, (7, 7, 7, 7, 7, 7, 7, 7))
    own = np.unique(e.live[1][1].numpy() // S)
    assert not np.isin(own, pages).any()


def test_second_release_keeps_the_reference_counts():
    e = engine()
    cached(e, 0, (1, 2, 3, 4, 5, 6))
    m1 = e.start(1, (1, 2, 3, 4, 5, 6, 7, 8))  # live, holds (1..6)
    e.start(2, (1, 2, 3, 4, 5, 6, 9, 9))
    tokens, slots, m2 = e.abort(2)
    err = refused(e, lambda: end(e.cache, m2, None, slots, keep=False), "match-consumed")
    assert "released" in str(err)
    refused(e, lambda: end(e.cache, m2, tokens, slots), "match-consumed")
    assert m1.node.ref == 1
    e.cache.evict(np.array([100, 100]))  # the live request's pages survive any eviction
    assert e.alloc.is_allocated(np.unique(m1.slots.numpy() // S)).all()


def test_ranking_lookup_leaves_the_cache_and_allocator_unchanged():
    e = engine()
    cached(e, 0, (1, 2, 3, 4, 5))
    before = e.state()
    for q in [(1, 2, 3, 9, 9), (1, 2, 3, 4, 5, 6), (1,), (8, 8), (1, 2, 3, 4, 5, 6, 7, 8)]:
        hit = e.cache.lookup(q)
        assert isinstance(hit, PrefixHit)
    assert e.state() == before, "lookup took a page, a reference, an LRU touch or a counter"
    hit = e.cache.lookup((1, 2, 3, 9, 9))
    assert (hit.length, hit.shared, hit.copy, hit.needs_copy) == (3, 2, 1, True)


def test_finish_without_caching_frees_the_copy_page():
    e = engine()
    cached(e, 0, (1, 2, 3, 4, 5))
    free = e.alloc.lane_free_pages()
    m = admit(e.cache, (1, 2, 3, 9))  # shares page (1, 2), copies 3
    assert m.copy_dst.numel() == 1 and sum(e.alloc.lane_free_pages()) == sum(free) - 1
    e.cache.finish([m], None, m.copy_dst, [1], cache=False)
    assert e.alloc.lane_free_pages() == free and m.consumed


def test_a_match_or_hit_of_another_cache_is_refused():
    e, other = engine(), PrefixCache(OwnerLaneAllocator(8 * N * S, S, N))
    tokens, slots, m = cached(e, 0, (1, 2, 3, 4))
    fhit = other.lookup(tokens)
    fm = other.allocate(fhit)
    refused(e, lambda: end(e.cache, fm, tokens, slots), "foreign-match")
    refused(e, lambda: e.cache.finish([fm], None, [], [0], cache=False), "foreign-match")
    refused(e, lambda: e.cache.allocate(fhit), "foreign-hit")
    refused(e, lambda: e.cache.allocate(other.can_allocate(tokens, 9)), "foreign-hit")
    hit = e.cache.lookup(tokens)
    refused(e, lambda: e.cache.finish([hit], None, [], [0], cache=False), "not-a-match")
    for bad in (m, None, tokens):
        refused(e, lambda: e.cache.allocate(bad), "not-a-hit")


def test_finish_refuses_runs_that_do_not_extend_the_match():
    """A run must hold as many tokens as slots (counted), and start with the
    match's copy: its slots, and (caching) its tokens."""
    e = engine()
    cached(e, 0, (1, 2, 3, 4, 5))
    m = e.start(1, (1, 2, 3, 4, 5, 6, 6))  # shares (1,2),(3,4), copies 5
    tokens, slots, _ = e.live[1]
    assert (m.shared, m.length) == (4, 5)
    toks, run, c = tokens[4:], slots[4:], e.cache
    refused(e, lambda: c.finish([m], toks, run[:-1], [3]), "length-mismatch")
    refused(e, lambda: c.finish([m], toks, run, [2]), "length-mismatch")
    refused(e, lambda: c.finish([m], toks, run, [3, 0]), "length-mismatch")
    refused(e, lambda: c.finish([m], (9, 6, 6), run, [3]), "tokens-do-not-extend-match")
    for keep in (True, False):
        refused(e, lambda: c.finish([m], toks, torch.cat([slots[:1], run[1:]]), [3], cache=keep),
                "slots-do-not-extend-match")
    refused(e, lambda: c.finish([m], toks, run, [-1, 4]), "length-mismatch")
    refused(e, lambda: c.finish([m, m], toks + toks, torch.cat([run, run]), [3, 3]), "match-twice")
    refused(e, lambda: c.finish([m], toks, run, [[3]]), "bad-counts")
    refused(e, lambda: c.finish(m, toks, run, [3]), "not-a-match")  # one match, not a list of them
    refused(e, lambda: c.cache_pages(iter([m]), toks, run, [3]), "not-a-match")
    e.finish(1)  # the right call still works


def test_end_refuses_private_pages_that_are_free_or_cached():
    e = engine()
    _, cslots, _ = cached(e, 0, (1, 2, 3, 4))
    m = e.start(1, (5, 5, 6, 6))
    tokens, slots, _ = e.live[1]
    free_page = int(np.flatnonzero(~e.alloc.is_allocated(np.arange(1, e.alloc.num_pages + 1)))[0]) + 1
    bent = slots.clone()
    bent[2:] = free_page * S + torch.arange(2)
    for keep in (True, False):
        refused(e, lambda: end(e.cache, m, tokens, bent, keep), "private-page-not-allocated")
    bent[2:] = cslots[:2]  # a page the tree serves, claimed as the request's own
    for keep in (True, False):
        refused(e, lambda: end(e.cache, m, tokens, bent, keep), "private-page-cached")


def test_end_refuses_slots_that_are_not_a_page_chain():
    e = engine()
    m = e.start(0, (1, 2, 3, 4, 5))
    tokens, slots, _ = e.live[0]
    for bent in [torch.cat([slots[:4], torch.tensor([-1])]),  # padding
                 torch.cat([slots[:1], slots[2:], slots[1:2]]),  # off its page offset
                 torch.cat([slots[:2], slots[:2], slots[4:]]),  # one page twice
                 torch.cat([slots[:4], torch.tensor([10_000])])]:  # no such page
        for keep in (True, False):
            refused(e, lambda: end(e.cache, m, tokens, bent, keep), "not-a-page-chain")
    refused(e, lambda: end(e.cache, m, tokens, slots.float()), "bad-slots")
    refused(e, lambda: e.cache.finish([m], tokens, slots.view(1, -1), [5]), "bad-slots")


@pytest.mark.parametrize("bad", [(1, -2, 3), (1.0, 2.0), ((1, 2), (3, 4)), "abc", torch.tensor([True, False]),
                                 np.array([1.5])])
def test_bad_tokens_are_refused_by_every_call(bad):
    e = engine()
    tokens, slots, m = cached(e, 0, (1, 2, 3, 4))
    e.start(1, (1, 2, 3, 4, 5))
    _, s1, m1 = e.live[1]
    refused(e, lambda: e.cache.lookup(bad), "bad-tokens")
    refused(e, lambda: e.cache.can_allocate(bad, 9), "bad-tokens")
    if len(bad) == len(s1):
        refused(e, lambda: end(e.cache, m1, bad, s1), "bad-tokens")


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_max_length_or_end_is_refused(bad):
    e = engine()
    refused(e, lambda: e.cache.lookup((1, 2, 3), max_length=bad), "bad-max-length")
    refused(e, lambda: e.cache.can_allocate((1, 2, 3), bad), "bad-end")


@pytest.mark.parametrize("bad", [[1], [1, 1, 1], [-1, 2], [0.5, 1], [[1, 1]]])
def test_evict_refuses_a_malformed_deficit(bad):
    e = engine()
    cached(e, 0, (1, 2, 3, 4))
    refused(e, lambda: e.cache.evict(bad), "bad-deficit")


def test_a_bad_plan_through_the_cache_changes_nothing():
    e = engine()
    cached(e, 0, (1, 2, 3, 4))
    refused(e, lambda: e.cache.allocate_extend([0], [5], torch.tensor([5])), "last-loc-without-prefix",
            UnsupportedPagePlan)
    refused(e, lambda: e.cache.allocate_decode([0], torch.tensor([-1])), "empty-decode", UnsupportedPagePlan)


def test_on_evict_sees_tokens_and_slots_before_the_pages_are_freed():
    seen = []

    def backup(tokens, slots, key):
        assert tokens.dtype == np.int64
        seen.append((tuple(tokens.tolist()), slots.tolist(), bool(e.alloc.is_allocated(np.unique(slots.numpy() // S)).all())))

    e = engine(on_evict=backup)
    _, slots, _ = cached(e, 0, (1, 2, 3, 4, 5, 6))
    cached(e, 1, (1, 2, 3, 4, 7, 7, 7))  # splits (1..6) after two pages; adds (7,7) and a partial leaf (7,)
    e.cache.clear()
    assert all(alive for _, _, alive in seen), "the hook ran after the pages were freed"
    by_tokens = {t: s for t, s, _ in seen}
    assert by_tokens[(1, 2, 3, 4)] == slots[:4].tolist()  # the upper part
    assert by_tokens[(1, 2, 3, 4, 5, 6)] == slots.tolist()  # the whole chain: the ancestor's slots, then its own
    assert all(len(t) == len(s) for t, s, _ in seen)  # a slot for every token from the root
    assert e.cache.evicted_nodes == len(seen) and e.cache.sizes().cached.sum() == 0
    # the same chains, in the same order, come back as values
    assert [(tuple(x.tokens.tolist()), x.slots.tolist(), x.key) for x in e.cache.last_evicted] == \
        [(t, s, b"") for t, s, _ in seen]


def test_a_failing_on_evict_hook_keeps_the_node():
    def broken(tokens, slots, key):
        raise RuntimeError("host tier full")

    e = engine(on_evict=broken)
    cached(e, 0, (1, 2, 3, 4))
    before = e.state()
    with pytest.raises(RuntimeError, match="host tier full"):
        e.cache.evict(np.array([1, 1]))
    assert e.state() == before


def test_an_on_evict_hook_that_cannot_take_tokens_slots_key_is_refused_when_set():
    """The hook is ``on_evict(tokens, slots, key)``; any other callable (the
    two-argument form before namespaces included) or a non-callable is refused
    at construction or assignment with a ``TypeError``, the hook in force
    unchanged."""
    for bad in (lambda tokens, slots: None, lambda tokens: None, lambda a, b, c, d: None, 7):
        with pytest.raises(TypeError, match="on_evict"):
            PrefixCache(OwnerLaneAllocator(8 * N * S, S, N), on_evict=bad)
    seen = []
    e = engine(on_evict=lambda tokens, slots, key: seen.append((tuple(tokens.tolist()), slots.tolist(), key)))
    kept = e.cache.on_evict
    with pytest.raises(TypeError, match="on_evict"):
        e.cache.on_evict = lambda tokens, slots: None
    assert e.cache.on_evict is kept
    _, slots, _ = cached(e, 0, (1, 2, 3, 4))
    e.cache.clear()
    assert [s[:2] for s in seen] == [((1, 2, 3, 4), slots.tolist())]


def test_what_an_allocation_evicts_comes_back_as_values():
    """``last_evicted`` lists the chains the last evicting call evicted, in
    order, as the hook saw them; read later (after other calls split and
    evicted their ancestors) they still hold the chain at its eviction; a
    call that evicts nothing lists none, a refused one leaves them."""
    seen = []
    e = Engine(3, 1, 2, on_evict=lambda t, s, k: seen.append((tuple(t.tolist()), s.tolist(), k)))
    cached(e, 0, (1, 2, 3, 4))  # 4 cached pages of 6
    m = admit(e.cache, (5, 5, 5, 5, 5))
    a = e.cache.allocate_extend([0], [5], torch.tensor([-1]))  # needs 5 pages: evicts
    assert a is not None and seen
    got, first = list(e.cache.last_evicted), list(seen)  # read only after the calls below
    assert len(got) == len(first)
    e.cache.finish([m], (5, 5, 5, 5, 5), a.out_cache_loc, [5])
    assert len(e.cache.evict([3, 3])) == len(seen) - len(first) > 0
    assert [(tuple(x.tokens.tolist()), x.slots.tolist(), x.key) for x in got] == first, "an evicted chain changed"
    before = e.state()
    with pytest.raises(UnsupportedPagePlan):
        e.cache.allocate_extend([0], [70], torch.tensor([-1]))  # never fits: refused, nothing changes
    assert e.state() == before
    assert e.cache.allocate_extend([0], [1], torch.tensor([-1])) is not None and e.cache.last_evicted == []


def test_lazy_evicted_chains_survive_a_split_of_their_ancestor():
    """A chain evicted from under a cached ancestor reads the same tokens and
    slots after that ancestor is split by a later match."""
    e = Engine(16, 2, 2)
    _, slots, _ = cached(e, 0, (1, 2, 3, 4, 5, 6, 7, 8))
    cached(e, 1, (1, 2, 3, 4, 5, 6, 9, 9))  # node (1..6) and leaves (7, 8), (9, 9)
    leaf = next(n for n in e.cache.tree.leaves if n.key.tolist() == [7, 8])
    leaf.last_access = -1  # the oldest: the next victim
    (x,) = e.cache.evict(np.bincount([int(leaf.pages[0]) % 2], minlength=2))
    m = admit(e.cache, (1, 2, 3, 0))  # splits (1..6) after one page
    assert (tuple(x.tokens.tolist()), x.slots.tolist()) == ((1, 2, 3, 4, 5, 6, 7, 8), slots.tolist())
    end(e.cache, m, None, m.slots, keep=False)


def test_a_preempted_request_keeps_its_kv_through_finish():
    """Preemption may cache what a request computed so far; re-admission finds it."""
    e = engine()
    m = admit(e.cache, (1, 2, 3, 4, 5, 6, 7))
    r = e.cache.allocate_extend([0], [5], torch.tensor([-1]))  # a first chunk of 5 tokens
    e.cache.finish([m], (1, 2, 3, 4, 5), r.out_cache_loc, [5])
    again = admit(e.cache, (1, 2, 3, 4, 5, 6, 7))
    assert again.length == 5 and again.shared == 4
    end(e.cache, again, None, again.slots, keep=False)
    e.cache.clear()
    assert e.alloc.lane_free_pages() == e.alloc.lane_pages.tolist()


def test_the_same_calls_leave_every_rank_identical():
    """No collective: N caches fed the same calls end byte-identical, clear included.
    [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""
    ranks = [engine(6) for _ in range(3)]
    rng = np.random.default_rng(0)
    turns = [tuple(rng.integers(0, 3, int(rng.integers(2, 9))).tolist()) for _ in range(30)]
    for e in ranks:
        for i, t in enumerate(turns):
            if e.start(i, t) is not None:
                e.abort(i) if i % 5 == 0 else e.finish(i)
    assert len({e.state() for e in ranks}) == 1
    for e in ranks:
        e.cache.clear()
    assert len({e.alloc.snapshot() for e in ranks}) == 1


@given(cached_sets(), st.sampled_from([1, 3]), st.none() | st.integers(0, 14))
def test_lookup_predicts_allocate(case, n, max_length):
    s, seqs, query = case
    e = Engine(200, s, n)
    for i, t in enumerate(seqs):
        cached(e, i, t)
    hit = e.cache.lookup(query, max_length)
    m = e.cache.allocate(hit)
    assert (m.length, m.shared, m.copy_src.numel()) == (hit.length, hit.shared, hit.copy)
    assert hit.last_shared_loc == (int(m.slots[m.shared - 1]) if m.shared else -1)
    assert hit.copy_lane == (int(m.copy_src[0]) // s % n if hit.copy else -1)


def test_the_copy_source_survives_the_eviction_for_its_copy_page():
    """The copy page may have to be evicted for, but never from its own source."""
    e = Engine(3, 2, 1)  # three pages of two tokens
    cached(e, 0, (1, 2, 3))  # node (1, 2) and partial leaf (3,): two pages, one free
    assert e.start(1, (5, 5)) is not None  # takes the free page
    m = admit(e.cache, (1, 2, 3, 9))  # shares (1, 2); (3,) needs a copy page, and only the source is evictable
    assert e.cache.tree.page_cached[np.unique(m.copy_src.numpy() // 2)].all()
    assert (m.length, m.shared, m.copy_dst.numel()) == (2, 2, 0)  # so the copy is dropped
    assert e.cache.last_deficit is not None
