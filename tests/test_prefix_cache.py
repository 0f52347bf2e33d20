"""W5 prefix cache: radix behaviour, reference counts, LRU and lane-aware
eviction, and page ownership against the allocator.
[[RFC-0001:C-PREFIX-CACHE]]"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cpkv import OwnerLaneAllocator
from cpkv.consumers.prefix_cache import PrefixCache


class Engine:
    """A toy engine over the cache: 'KV' of a slot is (token, position)."""

    def __init__(self, pages_per_lane, S, N):
        self.S, self.N = S, N
        self.alloc = OwnerLaneAllocator(pages_per_lane * N * S, S, N)
        self.cache = PrefixCache(self.alloc)
        self.kv = {}
        self.live = {}  # id -> (tokens, slots, match)

    def start(self, rid, tokens):
        m = self.cache.match(tokens)
        for s, d in zip(m.copy_src.tolist(), m.copy_dst.tolist()):
            self.kv[d] = self.kv[s]  # the copy the engine makes, inside one lane
        for j in range(m.length):
            assert self.kv[int(m.slots[j])] == (tokens[j], j), "a cached slot holds the wrong KV"
        r = self.cache.allocate_extend([m.length], [len(tokens)], torch.tensor([m.last_loc]))
        if r is None:
            self.cache.release(m, m.slots)
            return None
        slots = torch.cat([m.slots, r.out_cache_loc])
        for j in range(m.length, len(tokens)):
            self.kv[int(slots[j])] = (tokens[j], j)
        self.live[rid] = (tuple(tokens), slots, m)
        return m

    def finish(self, rid):
        tokens, slots, m = self.live.pop(rid)
        self.cache.insert(tokens, slots, m)

    def abort(self, rid):
        tokens, slots, m = self.live.pop(rid)
        self.cache.release(m, slots)


def tree_nodes(cache):
    out, stack = [], [(cache.root, 0)]
    while stack:
        n, depth = stack.pop()
        if n is not cache.root:
            out.append((n, depth))
        for c in n.children.values():
            stack.append((c, depth + len(c.key)))
    return out


class CacheMachine(RuleBasedStateMachine):
    @initialize(S=st.sampled_from([1, 2, 4]), N=st.sampled_from([1, 2, 3, 4]), lane_pages=st.integers(3, 12))
    def setup(self, S, N, lane_pages):
        self.e = Engine(lane_pages, S, N)
        self.next = 0

    @rule(data=st.data())
    def start(self, data):
        # a small alphabet and shared stems make prefixes (full and mid-page) common
        stem = data.draw(st.sampled_from([(), (1, 2, 3), (1, 2, 3, 4, 5, 6, 7), (9,)]))
        tail = tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=10)))
        self.e.start(self.next, stem + tail)
        self.next += 1

    @precondition(lambda self: getattr(self, "e", None) and self.e.live)
    @rule(data=st.data(), abort=st.booleans())
    def end(self, data, abort):
        rid = data.draw(st.sampled_from(sorted(self.e.live)))
        (self.e.abort if abort else self.e.finish)(rid)

    @precondition(lambda self: getattr(self, "e", None) is not None)
    @rule(lane=st.integers(0, 3), n=st.integers(1, 4))
    def pressure(self, lane, n):
        deficit = np.zeros(self.e.N, dtype=np.int64)
        deficit[lane % self.e.N] = n
        held = {id(m.node) for _, _, m in self.e.live.values()}
        self.e.cache.evict(deficit)
        remaining = {id(n) for n, _ in tree_nodes(self.e.cache)}
        assert held <= remaining | {id(None)}, "a node in use was evicted"

    @invariant()
    def consistent(self):
        if not hasattr(self, "e"):
            return
        e, S = self.e, self.e.S
        owners = {}
        for node, depth in tree_nodes(e.cache):
            start = depth - len(node.key)
            for j, (tok, s) in enumerate(zip(node.key, node.slots.tolist())):
                assert e.kv[s] == (tok, start + j), "cached KV does not match its tokens"
            for p in np.unique(node.slots.numpy() // S).tolist():
                assert owners.setdefault(p, "cache") == "cache"
            held = sum(1 for _, _, m in e.live.values() if _on_path(m.node, node))
            assert node.ref == held, "reference count != requests holding the node"
        for rid, (tokens, slots, m) in e.live.items():
            for p in np.unique(slots[m.shared :].numpy() // S).tolist():
                assert p not in owners, "a private page is shared"
                owners[p] = rid
        allocated = np.flatnonzero(e.alloc.is_allocated(np.arange(e.alloc.num_pages + 1)))
        assert sorted(owners) == allocated.tolist(), "cache + requests != allocated pages"

    def teardown(self):
        if hasattr(self, "e"):
            for rid in list(self.e.live):
                self.e.finish(rid)
            self.e.cache.clear()
            assert self.e.alloc.lane_free_pages() == self.e.alloc.lane_pages.tolist(), "pages leaked"


def _on_path(held, node):
    while held is not None:
        if held is node:
            return True
        held = held.parent
    return False


CacheMachine.TestCase.settings = settings(settings(), max_examples=100, stateful_step_count=40)
TestCacheMachine = CacheMachine.TestCase


@st.composite
def cached_sets(draw):
    S = draw(st.sampled_from([1, 2, 4]))
    seqs = draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12).map(tuple), min_size=1, max_size=6))
    query = tuple(draw(st.lists(st.integers(0, 2), min_size=1, max_size=14)))
    return S, seqs, query


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(cached_sets(), st.sampled_from([1, 3]))
def test_match_is_the_longest_cached_prefix(case, N):
    """Whole pages shared, a partly matched page copied: the match is the
    longest common prefix with any cached sequence, up to len - 1."""
    S, seqs, query = case
    e = Engine(200, S, N)
    for i, s in enumerate(seqs):
        assert e.start(i, s) is not None
        e.finish(i)
    m = e.start("q", query)
    assert m is not None
    assert m.length == min(max(_lcp(query, s) for s in seqs), len(query) - 1)
    assert m.shared % S == 0 and m.length - m.shared < S


def _lanes_of(node, S, N):
    return set((np.unique(node.slots.numpy() // S) % N).tolist())


def test_lru_order_and_in_use_protection():
    e = Engine(50, 2, 1)
    for i, t in enumerate([(1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)]):
        e.start(i, t)
        e.finish(i)
    e.start("hold", (2, 2, 2, 2, 9))  # uses (2,2,2,2): most recent and in use
    e.start("touch", (1, 1, 1, 1, 9))
    e.finish("touch")  # (1,1,1,1) is now more recent than (3,3,3,3)
    leaves = lambda: sorted(tuple(n.key) for n, _ in tree_nodes(e.cache) if not n.children)  # noqa: E731
    e.cache.evict(np.array([1]))
    assert (3, 3, 3, 3) not in [k[:4] for k in leaves()]
    e.cache.evict(np.array([100]))  # evict all it can
    remaining = [tuple(n.key) for n, _ in tree_nodes(e.cache)]
    assert remaining == [(2, 2, 2, 2)], remaining  # only the node in use is left
    assert e.cache.evicted_nodes >= 3


def test_lane_aware_eviction_frees_the_short_lane_first():
    S, N = 1, 4
    e = Engine(20, S, N)
    seqs = [(5,), (6,), (7,), (8,)]
    lanes = {}
    for i, s in enumerate(seqs):
        e.start(i, s + (0,))  # two tokens: one cached page each after finish... keep 1 page
        e.finish(i)
    for n, _ in tree_nodes(e.cache):
        lanes[n.key] = _lanes_of(n, S, N)
    # the least recently used leaf overall is seqs[0]; ask for a lane it does not hold
    oldest = min((n for n, _ in tree_nodes(e.cache)), key=lambda n: n.last_access)
    target = next(l for l in range(N) if l not in _lanes_of(oldest, S, N))
    before = {n.key for n, _ in tree_nodes(e.cache)}
    deficit = np.zeros(N, dtype=np.int64)
    deficit[target] = 1
    assert e.cache.evict(deficit)
    gone = before - {n.key for n, _ in tree_nodes(e.cache)}
    assert oldest.key not in gone
    assert all(target in lanes[k] for k in gone)
    assert len(gone) == 1


def test_refused_allocation_evicts_then_reports_the_deficit():
    e = Engine(3, 1, 2)  # 6 pages of 1 token
    assert e.start(0, (1, 2, 3, 4)) is not None
    e.finish(0)  # 4 cached pages, 2 free
    assert e.start(1, (7, 7, 7, 7, 7)) is not None  # needs 5 pages: evicts the cached chain
    assert e.cache.evicted_pages >= 3
    assert e.start(2, (8, 8, 8, 8, 8, 8, 8)) is None  # cannot fit while request 1 lives
    assert e.cache.last_deficit is not None and e.cache.last_deficit.sum() > 0
    e.abort(1)
    e.cache.clear()
    assert e.alloc.lane_free_pages() == e.alloc.lane_pages.tolist()
