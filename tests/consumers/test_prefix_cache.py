"""The prefix cache: radix behaviour, reference counts, lane-aware eviction
under each eviction policy (LRU, LFU), page ownership against the allocator, lookup without side effects,
and misuse refused with nothing changed.
[[RFC-0001:C-PREFIX-CACHE]]"""

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.consumers.prefix_cache import PrefixCache, PrefixCacheMisuse

from support.cache_engine import Engine, admit, cached_sets, end, reference_victim


def tree_nodes(cache):
    out, stack = [], [(cache.tree.root, 0)]
    while stack:
        n, depth = stack.pop()
        if n is not cache.tree.root:
            out.append((n, depth))
        for c in n.children.values():
            stack.append((c, depth + len(c.key)))
    return out


def lanes_by_walk(cache, which):
    """Pages per lane of the nodes ``which`` selects, counted from scratch."""
    out = np.zeros(cache.N, dtype=np.int64)
    for n, _ in tree_nodes(cache):
        if which(n):
            out += np.bincount(np.unique(n.slots // cache.S) % cache.N, minlength=cache.N)
    return out


STEMS = [(), (1, 2, 3), (1, 2, 3, 4, 5, 6, 7), (9,)]
LIVE_MISUSE = ["foreign", "length", "tokens-off", "slots-off", "chain", "free-page", "cached-page"]


class CacheMachine(RuleBasedStateMachine):
    @initialize(S=st.sampled_from([1, 2, 4]), N=st.sampled_from([1, 2, 3, 4]), lane_pages=st.integers(3, 16),
                eviction=st.sampled_from(["lru", "lfu"]))
    def setup(self, S, N, lane_pages, eviction):
        self.e = Engine(lane_pages, S, N, eviction=eviction)
        self.other = PrefixCache(OwnerLaneAllocator(lane_pages * N * S, S, N))  # for foreign matches
        self.ended = []  # (tokens, slots, match) already finished
        self.finished = []  # tokens of cached requests, stems of follow-ups
        self.next = 0

    def _tokens(self, data):
        # a small alphabet, shared stems and follow-ups of ended requests (cut
        # anywhere) make prefixes, full and mid-page, common
        stem = data.draw(st.sampled_from(STEMS + self.finished[-3:]))
        stem = stem[: data.draw(st.integers(len(stem) // 2, len(stem)))] if len(stem) > 7 else stem
        return stem + tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6)))

    @precondition(lambda self: hasattr(self, "e"))
    @rule(data=st.data())
    def start(self, data):
        self._admit(self._tokens(data))

    def _admit(self, tokens):
        """lookup predicts allocate: same match, the pages it pins, and (when no
        eviction intervenes) the lanes the request then allocates, as
        can_allocate says."""
        c = self.e.cache
        hit, evictable, evicted = c.lookup(tokens), c.sizes().evictable, c.evicted_nodes
        need = c.can_allocate(tokens, len(tokens)).need
        m = c.allocate(hit)
        event("start: matched" if m.length else "start: no match")
        assert m.shared == hit.shared
        if m.length != hit.length:  # only when no page could be had for the copy
            assert m.length == hit.shared and c.last_deficit is not None
        calm = c.evicted_nodes == evicted and m.length == hit.length
        if calm:
            assert (evictable - c.sizes().evictable).tolist() == hit.newly_pinned.tolist()
        rid, self.next = self.next, self.next + 1
        if self.e.run(rid, tokens, m) is not None and calm and c.evicted_nodes == evicted:
            own = self.e.live[rid][1][m.shared :].numpy() // self.e.S
            got = np.bincount(np.unique(own) % self.e.N, minlength=self.e.N)
            assert got.tolist() == need.tolist(), "can_allocate mispredicted the lanes the request took"

    @precondition(lambda self: hasattr(self, "e"))
    @rule(data=st.data(), max_length=st.none() | st.integers(0, 12))
    def lookup_changes_nothing(self, data, max_length):
        before = self.e.state()
        hit = self.e.cache.lookup(self._tokens(data), max_length)
        assert self.e.state() == before, "lookup changed the cache or the allocator"
        assert hit.shared % self.e.S == 0 and 0 <= hit.copy < self.e.S

    @precondition(lambda self: getattr(self, "e", None) and self.e.live)
    @rule(data=st.data(), abort=st.booleans())
    def end(self, data, abort):
        rid = data.draw(st.sampled_from(sorted(self.e.live)))
        self.ended.append((self.e.abort if abort else self.e.finish)(rid))
        if not abort:
            self.finished.append(self.ended[-1][0])

    @precondition(lambda self: getattr(self, "e", None) and self.e.live)
    @rule(data=st.data())
    def next_turn(self, data):
        """A request finishes and its follow-up (its tokens, cut anywhere, plus
        new ones) arrives at once: matches, full and mid-page, are common."""
        tokens = self.e.finish(data.draw(st.sampled_from(sorted(self.e.live))))[0]
        self.finished.append(tokens)
        cut = data.draw(st.integers(len(tokens) // 2, len(tokens)))
        self._admit(tokens[:cut] + tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))))

    @precondition(lambda self: hasattr(self, "e"))
    @rule(lane=st.integers(0, 3), n=st.integers(1, 4))
    def pressure(self, lane, n):
        deficit = np.zeros(self.e.N, dtype=np.int64)
        deficit[lane % self.e.N] = n
        held = {id(m.node) for _, _, m in self.e.live.values()}
        first = reference_victim(self.e.cache, {lane % self.e.N})  # the policy's first leaf that helps the lane
        first = None if first is None else self.e.cache.tree.prefix_tokens(first)
        got = self.e.cache.evict(deficit)
        assert got == self.e.cache.last_evicted
        assert (first is None) == (not got) and (first is None or np.array_equal(got[0].tokens, first))
        remaining = {id(n) for n, _ in tree_nodes(self.e.cache)}
        assert held <= remaining | {id(None)}, "a node in use was evicted"

    @precondition(lambda self: hasattr(self, "e"))
    @rule(kind=st.sampled_from(["tokens", "deficit", "max-length"]), data=st.data())
    def misuse_input(self, kind, data):
        """Malformed arguments: the right error, and nothing changed."""
        c, N = self.e.cache, self.e.N
        if kind == "tokens":
            bad = data.draw(st.sampled_from([(1, -2, 3), (1.0, 2.0), ((1, 2), (3, 4)), "ab", torch.tensor([0.5])]))
            call = data.draw(st.sampled_from([lambda: c.lookup(bad), lambda: c.can_allocate(bad, 9)]))
        elif kind == "deficit":
            bad = data.draw(st.sampled_from([np.full(N + 1, 1), np.full(N, -1), np.full(N, 0.5)]))
            call = lambda: c.evict(bad)  # noqa: E731
        else:
            bad = data.draw(st.sampled_from([-1, 2.5, True]))
            call = lambda: c.lookup((1, 2, 3), max_length=bad)  # noqa: E731
        self._refused(call, {"tokens": "bad-tokens", "deficit": "bad-deficit"}.get(kind, "bad-max-length"))

    @precondition(lambda self: getattr(self, "ended", None))
    @rule(data=st.data(), keep=st.booleans())
    def misuse_ended_match(self, data, keep):
        """A second finish of a match (caching or not): refused, nothing freed."""
        tokens, slots, m = data.draw(st.sampled_from(self.ended))
        self._refused(lambda: end(self.e.cache, m, tokens, slots, keep), "match-consumed")

    @precondition(lambda self: getattr(self, "e", None) and self.e.live)
    @rule(kind=st.sampled_from(LIVE_MISUSE), data=st.data(), keep=st.booleans())
    def misuse_live(self, kind, data, keep):
        """A live request finished with the wrong run (its positions past
        ``m.shared``): refused, nothing changed."""
        e, c, S = self.e, self.e.cache, self.e.S
        needs_copy = kind in ("tokens-off", "slots-off")
        pick = [r for r, (_, _, m) in e.live.items() if m.length > m.shared or not needs_copy]
        if not pick:
            return
        tokens, slots, m = e.live[data.draw(st.sampled_from(sorted(pick)))]
        run, toks = slots[m.shared :].clone(), np.array(tokens[m.shared :], dtype=np.int64)
        if kind == "foreign":
            fm = admit(self.other, tokens)
            try:
                self._refused(lambda: c.finish([fm], toks, run, [run.numel()], cache=keep), "foreign-match")
            finally:
                end(self.other, fm, None, fm.slots, keep=False)
            return
        rule, counts = None, [run.numel()]
        if kind == "length":
            toks, rule, keep = toks[:-1], "length-mismatch", True
        elif kind == "tokens-off":  # the copy's tokens are the match's
            toks[data.draw(st.integers(0, m.length - m.shared - 1))] += 1
            rule, keep = "tokens-do-not-extend-match", True
        elif kind == "slots-off":  # the run starts with the match's copy
            j = data.draw(st.integers(0, m.length - m.shared - 1))
            run[j] = int(slots[-1]) if j != run.numel() - 1 else 0
            rule = "slots-do-not-extend-match"
        elif kind == "chain":  # own slots off their page offsets, or (S = 1) one page twice
            if S > 1 and run.numel() > m.length - m.shared:
                run[m.length - m.shared :] += 1
            elif S == 1 and run.numel() >= 2:
                run[-1] = run[-2]
            else:
                return
            rule = "not-a-page-chain"
        else:  # another page in place of the request's last own page: a free one, or one the cache holds
            q = (len(tokens) - 1) // S
            free = np.flatnonzero(~e.alloc.is_allocated(np.arange(1, e.alloc.num_pages + 1))) + 1
            pool = free if kind == "free-page" else np.flatnonzero(c.tree.page_cached)
            pool = np.setdiff1d(pool, slots.numpy() // S)  # another page, not one of its own
            if q * S < m.length or not pool.size:
                return
            run[q * S - m.shared :] = int(data.draw(st.sampled_from(pool.tolist()))) * S + \
                torch.arange(len(tokens) - q * S)
            rule = "private-page-not-allocated" if kind == "free-page" else "private-page-cached"
        self._refused(lambda: c.finish([m], toks if keep else None, run, counts, cache=keep), rule)

    def _refused(self, call, rule):
        event(f"refused: {rule}")
        before = self.e.state()
        with pytest.raises(PrefixCacheMisuse) as err:
            call()
        assert err.value.rule == rule, err.value
        assert self.e.state() == before, f"a refused call ({rule}) changed the state"

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
            for p in np.unique(node.slots // S).tolist():
                assert owners.setdefault(p, "cache") == "cache"
            held = sum(1 for _, _, m in e.live.values() if _on_path(m.node, node))
            assert node.ref == held, "reference count != requests holding the node"
        for rid, (tokens, slots, m) in e.live.items():
            for p in np.unique(slots[m.shared :].numpy() // S).tolist():
                assert p not in owners, "a private page is shared"
                owners[p] = rid
        allocated = np.flatnonzero(e.alloc.is_allocated(np.arange(e.alloc.num_pages + 1)))
        assert sorted(owners) == allocated.tolist(), "cache + requests != allocated pages"
        # the derived counts kept incrementally agree with a full walk
        c = e.cache
        sizes = c.sizes()
        assert sizes.cached.tolist() == lanes_by_walk(c, lambda n: True).tolist()
        assert sizes.evictable.tolist() == lanes_by_walk(c, lambda n: n.ref == 0).tolist()
        assert sizes.protected.tolist() == lanes_by_walk(c, lambda n: n.ref > 0).tolist()
        assert np.flatnonzero(c.tree.page_cached).tolist() == sorted(p for p, o in owners.items() if o == "cache")
        assert set(c.tree.leaves) == {n for n, _ in tree_nodes(c) if not n.children}
        assert c.open_matches == len(e.live), "allocated matches != live requests"

    def teardown(self):
        if hasattr(self, "e"):
            for rid in list(self.e.live):
                self.e.finish(rid)
            self.e.cache.clear()
            assert self.e.alloc.lane_free_pages() == self.e.alloc.lane_pages.tolist(), "pages leaked"
            assert self.other.alloc.lane_free_pages() == self.other.alloc.lane_pages.tolist()


def _on_path(held, node):
    while held is not None:
        if held is node:
            return True
        held = held.parent
    return False


CacheMachine.TestCase.settings = settings(settings(), max_examples=100, stateful_step_count=40)
TestCacheMachine = CacheMachine.TestCase


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
    return set((np.unique(node.slots // S) % N).tolist())


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
    key = lambda n: tuple(n.key.tolist())  # noqa: E731
    for n, _ in tree_nodes(e.cache):
        lanes[key(n)] = _lanes_of(n, S, N)
    # the least recently used leaf overall is seqs[0]; ask for a lane it does not hold
    oldest = min((n for n, _ in tree_nodes(e.cache)), key=lambda n: n.last_access)
    target = next(l for l in range(N) if l not in _lanes_of(oldest, S, N))
    before = {key(n) for n, _ in tree_nodes(e.cache)}
    deficit = np.zeros(N, dtype=np.int64)
    deficit[target] = 1
    got = e.cache.evict(deficit)
    assert len(got) == 1
    gone = before - {key(n) for n, _ in tree_nodes(e.cache)}
    assert key(oldest) not in gone
    assert all(target in lanes[k] for k in gone)
    assert len(gone) == 1


def test_refused_allocation_evicts_then_reports_the_deficit():
    e = Engine(3, 1, 2)  # 6 pages of 1 token
    assert e.start(0, (1, 2, 3, 4)) is not None
    e.finish(0)  # 4 cached pages, 2 free
    assert e.start(1, (7, 7, 7, 7, 7)) is not None  # needs 5 pages: evicts the cached chain
    assert e.cache.evicted_pages >= 3
    assert e.start(2, (8, 8)) is None  # 2 pages: cannot fit while request 1 lives ("not now")
    assert e.cache.last_deficit is not None and e.cache.last_deficit.sum() > 0
    before = e.alloc.snapshot()
    with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):  # 7 pages of 6: "never"
        e.cache.allocate_extend([0], [7], torch.tensor([-1]))
    assert e.alloc.snapshot() == before
    e.abort(1)
    e.cache.clear()
    assert e.alloc.lane_free_pages() == e.alloc.lane_pages.tolist()
