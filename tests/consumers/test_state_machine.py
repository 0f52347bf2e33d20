"""The state machine of cpkv's control state: the allocator and the prefix
cache on the SAME allocator. It is the one machine (it replaced the
allocator's own stateful test and its allocator-only misuse machine, whose
rules and invariants live on in :class:`support.misuse.AllocatorComponent`): requests the allocator serves directly and requests the cache
admits (matching cached prefixes, whole pages and mid-page, continuing in
their copy page, caching their full pages while they run, finishing one or
several at once with their KV cached or freed, evicting) take pages from one
set of free lists, interleaved with invalid calls of every kind against both.

After an invalid call: the right error type and rule, and the allocator's and
the cache's snapshots exactly as before. After a valid call: every invariant
of both (the allocator component's page accounting counts the cache's pages
and its requests' private pages too), checked against a plain model: which
pages the cache owns, what each cache request holds, and the 'KV' written in
every slot (``(namespace, token, position)``), so a cached or live slot that
is handed out again, a copy that read the wrong page, or a match that
crosses namespace keys (requests carry a key: None, a str or an int) shows
as wrong KV. Every cached chain keeps one lane base (page q in lane
``(b + q) % N``): a finish that would graft a tail of another base stops.
The allocator's own invariants, after every valid call: no live slot handed
out twice, free plus live pages equal each lane's pages, fill marks equal the
slots handed out, every new slot in its owner lane at its position's page
offset, pages never split, ``out_cache_loc`` in flattened request order
(fresh and continuing requests in any order), a continuation keeps its lane
base, and a refusal ("cannot now" or "never") leaves the state identical.
[[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]] [[RFC-0001:C-OWNER-LANE]]
[[RFC-0001:C-FLATTENED-ORDER]] [[RFC-0001:C-REQUEST-RELATIVE]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import event, settings
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.consumers.radix_tree import lane_mask
from cpkv.consumers.kv_events import key_bytes
from cpkv.consumers.prefix_cache import PrefixCache, PrefixCacheMisuse, PrefixMatch
from cpkv.contract.layout import lane_base_from_prefix
from support.cache_engine import admit, end
from support.misuse import AllocatorComponent, Component, Misuse, MisuseMachine

STEMS = [(), (1, 2, 3), (1, 2, 3, 4, 5, 6, 7), (2,), (1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2)]
KEYS = [None, None, "lora-a", 7]  # namespaces; 7 and "7" are one

BAD_TOKENS = [(1, -2, 3), (1.0, 2.0), ((1, 2), (3, 4)), "abc", torch.tensor([True, False]), np.array([1.5]),
              torch.tensor([[1, 2]]), (2**70,)]


@dataclass
class Req:
    """A request the cache admitted: its prompt (decode appends to it), the
    slots of the tokens computed so far (the match's, then its own), its match."""

    tokens: list
    slots: list
    m: PrefixMatch
    key: object = None

    @property
    def ns(self) -> bytes:
        return key_bytes(self.key)

    @property
    def private(self) -> list:
        return self.slots[self.m.shared :]


def _pages(slots, S) -> set:
    return set((np.asarray(slots, dtype=np.int64) // S).tolist())


class CacheComponent(Component):
    """A :class:`PrefixCache` over the shared allocator, its requests, and a
    plain model: ``cached`` (pages the cache owns, changed only as each call
    allows), ``kv`` (what each held slot holds), ``live`` and ``ended``."""

    def __init__(self, alloc: OwnerLaneAllocator, S: int, N: int):
        self.a, self.S, self.N = alloc, S, N
        self.c = PrefixCache(alloc)
        self.cached: set = set()
        self.kv: dict = {}
        self.live: dict[int, Req] = {}
        self.ended: list = []  # (tokens, slots, match) of consumed matches
        self.finished: list = []  # (token run, key) inserted: stems of follow-ups
        self.next = 0
        # another cache, on an allocator of another shape, with something cached (its hits and matches are foreign)
        self.other = PrefixCache(OwnerLaneAllocator(4 * (N + 2) * 2, 2, N + 2))
        om = admit(self.other, (1, 2, 3, 4, 5))
        r = self.other.allocate_extend([0], [5], torch.tensor([-1]))
        self.other.finish([om], (1, 2, 3, 4, 5), r.out_cache_loc, [5])
        self.foreign = admit(self.other, (1, 2, 3, 4, 5, 6))  # a match of the other cache, never finished
        self._warm((1, 2, 3))  # a cached chain ending mid-page (for S > 1) from the start, when it fits

    def _warm(self, tokens: tuple) -> None:
        m = admit(self.c, tokens)
        self.live[-1] = Req(list(tokens), m.slots.tolist(), m)
        self._allocate([-1], [len(tokens)], decode=False)
        r = self.live.pop(-1)
        if len(r.slots) == len(tokens):
            end(self.c, m, tokens, torch.tensor(r.slots))
            self._sync(joined=_pages(r.private, self.S))
            self.finished.append((tokens, None))
        else:
            end(self.c, m, None, torch.tensor(r.slots, dtype=torch.int64), keep=False)
            self._sync()

    # -- model helpers ---------------------------------------------------------------------
    def held_slots(self) -> list[int]:
        """Every slot of the shared allocator this component holds: the cache's and its requests' own."""
        return [s for n in self.c.tree.nodes() for s in n.slots.tolist()] + \
            [s for r in self.live.values() for s in r.private]

    def quiet(self) -> bool:
        """No cache request is live: the cache may be emptied."""
        return not self.live

    def empty(self) -> None:
        """Evict everything (only when quiet)."""
        self.c.clear()
        self._sync()
        assert not self.cached

    def _sync(self, joined: set = frozenset()) -> None:
        """After a call that may change the cache: only ``joined`` pages may
        join it; a page that leaves it is one no live request shares; the KV
        of slots nobody holds any more is forgotten."""
        now = set(np.flatnonzero(self.c.tree.page_cached).tolist())
        assert now - self.cached <= set(joined), "a page joined the cache from nowhere"
        shared = {p for r in self.live.values() for p in _pages(r.slots[: r.m.shared], self.S)}
        assert not (self.cached - now) & shared, "a page that a live request shares left the cache"
        self.cached = now
        held = set(self.held_slots())
        self.kv = {s: v for s, v in self.kv.items() if s in held}

    def _tokens(self, data) -> tuple:
        return self._keyed(data)[0]

    def _keyed(self, data) -> tuple:
        """Tokens (a stem, cut, plus new ones) and a key: mostly the stem's own."""
        stem, key = data.draw(st.sampled_from([(s, None) for s in STEMS] + self.finished[-3:]))
        stem = stem[: data.draw(st.integers(len(stem) // 2, len(stem)))]
        key = key if data.draw(st.booleans()) else data.draw(st.sampled_from(KEYS))
        return tuple(stem) + tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2 * self.S + 1))), key

    def _never_fits(self, prefix, seq, last) -> bool:
        S, N = self.S, self.N
        for p, n, l in zip(prefix, seq, last):
            chain = -(-n // S)
            if p == 0:
                if chain > self.a.num_pages:
                    return True
            else:
                base = lane_base_from_prefix(l // S % N, p, S, N)
                if (np.bincount((base + np.arange(chain)) % N, minlength=N) > self.a.lane_pages).any():
                    return True
        return False

    def _allocate(self, ids, seq, decode: bool) -> None:
        """Allocate through the cache (which evicts on a refusal) and check the result."""
        reqs = [self.live[r] for r in ids]
        prefix = [len(r.slots) for r in reqs]
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        try:
            res = (self.c.allocate_decode(seq, torch.tensor(last)) if decode
                   else self.c.allocate_extend(prefix, seq, torch.tensor(last)))
        except UnsupportedPagePlan as e:
            assert e.rule == "exceeds-capacity", e
            assert self._never_fits(prefix, seq, last)
            event("cache: can never fit")
            self._sync()
            return
        self._sync()
        if res is None:
            assert self.c.last_deficit is not None and (self.c.last_deficit > 0).any()
            event("cache: refused, a lane was short")
            return
        assert not self._never_fits(prefix, seq, last)
        out, starts = res.out_cache_loc.tolist(), res.extend_start_loc.tolist()
        assert starts == np.cumsum([0] + [s - p for p, s in zip(prefix, seq)])[:-1].tolist(), "flattened order"
        S, N = self.S, self.N
        for i, r in enumerate(reqs):
            b = int(res.lane_base[i])
            if prefix[i]:
                assert b == lane_base_from_prefix(last[i] // S % N, prefix[i], S, N), "lane base not from last_loc"
            new = out[starts[i] : starts[i] + seq[i] - prefix[i]]
            for t, s in zip(range(prefix[i], seq[i]), new):
                assert s % S == t % S and s // S % N == (b + t // S) % N, "owner-lane invariant"
                assert s // S not in self.cached, "a new slot lies on a page the cache owns"
                self.kv[s] = (r.ns, r.tokens[t], t)
            r.slots += new
        event("cache: decode" if decode else "cache: extend")

    # -- component interface -------------------------------------------------------------
    def snapshot(self):
        return self.c.snapshot()

    def check(self) -> None:
        c, S, N = self.c, self.S, self.N
        nodes = list(c.tree.nodes())
        pages, lanes, free_lanes = set(), np.zeros(N, dtype=np.int64), np.zeros(N, dtype=np.int64)
        for n in nodes:
            toks = c.tree.prefix_tokens(n)
            start = len(toks) - len(n.key)
            assert start % S == 0 and len(n.key) == n.slots.size > 0, "an edge off the page grid"
            assert not n.children or len(n.key) % S == 0, "a partial page inside the tree"
            for j, (tok, s) in enumerate(zip(n.key, n.slots.tolist())):
                assert s % S == (start + j) % S, "a cached slot off its page offset"
                assert self.kv.get(s) == (n.ns, tok, start + j), "cached KV lost or overwritten (or of another key)"
            own = _pages(n.slots.tolist(), S)
            assert not own & pages, "a page in two nodes"
            pages |= own
            per_lane = np.bincount(np.array(sorted(own)) % N, minlength=N)
            assert n.lanes.tolist() == per_lane.tolist() and n.mask == lane_mask(per_lane), "a node's lanes or mask stale"
            lanes += per_lane
            if n.ref == 0:
                free_lanes += per_lane
            holders = 0
            for r in self.live.values():
                up = r.m.node
                while up is not None and up is not n:
                    up = up.parent
                holders += up is n
            assert n.ref == holders, "reference count != live requests holding the node"
        assert pages == self.cached == set(np.flatnonzero(c.tree.page_cached).tolist()), "cache pages != model"
        sizes = c.sizes()
        assert sizes.cached.tolist() == lanes.tolist() and sizes.evictable.tolist() == free_lanes.tolist()
        assert set(c.tree.leaves) == {n for n in nodes if not n.children}
        assert c.open_matches == len(self.live), "allocated matches != live requests"
        for r in self.live.values():
            for t, s in enumerate(r.slots):
                assert self.kv.get(s) == (r.ns, r.tokens[t], t), "a live request's KV lost, overwritten or of another key"
            assert _pages(r.slots[: r.m.shared], S) <= self.cached, "a shared page left the cache"
            assert not _pages(r.private, S) & self.cached, "a private page is the cache's"
        for leaf in c.tree.leaves:  # whatever is cached can be found, in its own namespace; one lane base a chain
            toks = c.tree.prefix_tokens(leaf)
            assert c.lookup(toks, max_length=len(toks), key=leaf.ns).length == len(toks), "a cached chain is lost"
            lanes = c.tree.prefix_slots(leaf).numpy()[::S] // S % N
            assert (lanes == (lanes[0] + np.arange(lanes.size)) % N).all(), "a cached chain of two lane bases"

    def valid_calls(self):
        return [self.admit, self.turn, self.turn, self.twins, self.extend, self.extend, self.decode, self.finish,
                self.cache_live, self.finish_together, self.abort, self.evict, self.lookup, self.clear]

    def invalid_calls(self):
        return [self.extends_cached_page, self.consumed, self.foreign_or_not_a_match, self.bad_inputs,
                self.bad_end, self.bad_admission, self.bad_live, self.stale_through_cache, self.too_big]

    # -- valid calls ---------------------------------------------------------------------------
    def turn(self, data):
        """A request finishes (its tokens computed so far are cached) and its
        follow-up arrives at once: its tokens, cut anywhere, plus new ones, so
        matches on whole pages and mid-page are common."""
        if not self.live:
            return self.admit(data)
        tokens, key = self.finish(data)
        cut = data.draw(st.integers(len(tokens) // 2, len(tokens)))
        key = key if data.draw(st.integers(0, 3)) else data.draw(st.sampled_from(KEYS))
        self.admit(data, tokens[:cut] + tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=self.S + 1))),
                   key)

    def admit(self, data, tokens=None, key=None):
        (tokens, key), c = ((tokens, key) if tokens else self._keyed(data)), self.c
        ns = key_bytes(key)
        before = self.snapshot(), self.a.snapshot()
        hit = c.lookup(tokens, key=key)
        assert (self.snapshot(), self.a.snapshot()) == before, "lookup changed the cache or the allocator"
        m = c.allocate(hit if data.draw(st.booleans()) else c.can_allocate(tokens, len(tokens), key=key))
        assert m.shared == hit.shared and m.length in (hit.length, hit.shared)
        assert m.length == hit.length or c.last_deficit is not None, "the copy was dropped with pages to spare"
        for s in m.slots[: m.shared].tolist() + m.copy_src.tolist():
            assert self.kv[s][0] == ns, "a match crossed namespace keys"
        for s, d in zip(m.copy_src.tolist(), m.copy_dst.tolist()):  # the engine's copy, before the first forward
            assert s in self.kv, "the copy source left the cache before the copy"
            self.kv[d] = self.kv[s]
        lanes = np.asarray(m.slots.tolist()[::self.S]) // self.S % self.N
        assert not lanes.size or (lanes == (lanes[0] + np.arange(lanes.size)) % self.N).all(), \
            "a match of two lane bases"
        rid, self.next = self.next, self.next + 1
        self.live[rid] = Req(list(tokens), m.slots.tolist(), m, key)
        self._sync()
        event("cache: admit, " + ("mid-page match" if m.copy_dst.numel() else "page match" if m.length else "no match"))
        if data.draw(st.integers(0, 3)):  # the first chunk at once, mostly
            self._allocate([rid], [data.draw(st.integers(m.length + 1, len(tokens)))], decode=False)

    def twins(self, data):
        """Two requests of one fresh prefix admitted and allocated in one batch
        before either is cached: different lane bases, so the second insert
        must not graft its tail under the first one's chain."""
        stem = tuple(data.draw(st.lists(st.integers(4, 6), min_size=2 * self.S, max_size=3 * self.S)))
        key = data.draw(st.sampled_from(KEYS))
        ids = []
        for tail in (0, 1):
            self.admit(data, stem + (tail,) * self.S, key)
            rid = self.next - 1
            if len(self.live[rid].slots) == 0:
                ids.append(rid)
        if ids:
            self._allocate(ids, [len(self.live[r].tokens) for r in ids], decode=False)
        event(f"cache: twins, {len(ids)} fresh")

    def extend(self, data):
        ready = sorted(r for r, q in self.live.items() if len(q.slots) < len(q.tokens))
        if not ready:
            return
        ids = data.draw(st.lists(st.sampled_from(ready), unique=True, min_size=1, max_size=3))
        self._allocate(ids, [data.draw(st.integers(len(self.live[r].slots) + 1, len(self.live[r].tokens)))
                             for r in ids], decode=False)

    def decode(self, data):
        done = sorted(r for r, q in self.live.items() if q.slots and len(q.slots) == len(q.tokens))
        if not done:
            return
        ids = data.draw(st.lists(st.sampled_from(done), unique=True, min_size=1, max_size=3))
        for r in ids:
            self.live[r].tokens.append(data.draw(st.integers(0, 3)))
        self._allocate(ids, [len(self.live[r].tokens) for r in ids], decode=True)

    def finish(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        tokens, slots = tuple(r.tokens[: len(r.slots)]), torch.tensor(r.slots, dtype=torch.int64)
        private = _pages(r.private, self.S)
        end(self.c, r.m, tokens, slots)
        assert r.m.consumed
        self._sync(joined=private)
        gone = private - self.cached  # private pages the tree already had, or a tail it declined: freed
        assert not self.a.is_allocated(sorted(gone)).any() or self.a.snapshot()[3] is not None
        hit = self.c.lookup(tokens, max_length=len(tokens), key=r.key)
        if hit.length < len(tokens):  # only where the request's next page is in another lane than the chain's
            S, N = self.S, self.N
            assert 0 < hit.shared < len(tokens), "cached but not found"
            base = lane_base_from_prefix(hit.last_shared_loc // S % N, hit.shared, S, N)
            assert slots[hit.shared] // S % N != (base + hit.shared // S) % N, "a finish stopped where lanes agree"
            event("cache: finish declined a graft of another lane base")
        self.ended.append((tokens, slots, r.m))
        self.finished.append((tokens, r.key))
        event("cache: finish")
        return tokens, r.key

    def cache_live(self, data):
        """Running requests' next full pages enter the cache in one batch
        (``cache_pages``): each run is cached and held (its pages join the
        cache, ``shared`` grows), or declined with nothing changed for it (the
        tree has those tokens there, or the lanes would break a chain's base)
        and the request stops caching live."""
        S = self.S
        cands = sorted(rid for rid, r in self.live.items() if r.m.live and (len(r.slots) - r.m.shared) // S)
        if not cands:
            return
        reqs = [self.live[i] for i in data.draw(st.lists(st.sampled_from(cands), unique=True, min_size=1, max_size=3))]
        before = [r.m.shared for r in reqs]
        ends = [b + S * data.draw(st.integers(1, (len(r.slots) - b) // S)) for r, b in zip(reqs, before)]
        runs = [r.slots[b:e] for r, b, e in zip(reqs, before, ends)]
        got = self.c.cache_pages([r.m for r in reqs], np.array([t for r, b, e in zip(reqs, before, ends)
                                                               for t in r.tokens[b:e]], dtype=np.int64),
                                 [x for run in runs for x in run], [len(x) for x in runs])
        self._sync(joined=set().union(*(_pages(x, S) for x in runs)))
        for r, ok, b, e, run in zip(reqs, got.tolist(), before, ends, runs):
            if ok:
                assert r.m.live and r.m.shared == e and _pages(run, S) <= self.cached, "a cached run is not the cache's"
            else:
                assert not r.m.live and r.m.shared == b, "a declined run changed its match"
        event(f"cache: cache_pages, {sum(got)} of {len(got)} cached")

    def finish_together(self, data):
        """Two or three requests end in one ``finish`` (their KV cached, or freed):
        as many ends, one call; every page either the cache's or free after."""
        if len(self.live) < 2:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=2, max_size=3))
        keep = data.draw(st.booleans())
        reqs = [self.live.pop(i) for i in ids]
        private = set().union(*(_pages(r.private, self.S) for r in reqs))
        toks = np.array([t for r in reqs for t in r.tokens[r.m.shared : len(r.slots)]], dtype=np.int64)
        self.c.finish([r.m for r in reqs], toks if keep else None, [x for r in reqs for x in r.private],
                      [len(r.private) for r in reqs], cache=keep)
        assert all(r.m.consumed for r in reqs)
        self._sync(joined=private if keep else set())
        gone = private - self.cached
        assert not self.a.is_allocated(sorted(gone)).any() or self.a.snapshot()[3] is not None
        for r in reqs:
            tokens = tuple(r.tokens[: len(r.slots)])
            self.ended.append((tokens, torch.tensor(r.slots, dtype=torch.int64), r.m))
            if keep:
                self.finished.append((tokens, r.key))
        event("cache: finish together, " + ("cached" if keep else "freed"))

    def abort(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        slots = torch.tensor(r.slots, dtype=torch.int64)
        end(self.c, r.m, None, slots, keep=False)
        self._sync()
        if self.a.snapshot()[3] is None:
            assert not self.a.is_allocated(sorted(_pages(r.private, self.S))).any(), "release kept a private page"
        self.ended.append((tuple(r.tokens[: len(r.slots)]), slots, r.m))
        event("cache: finish, freed")

    def evict(self, data):
        deficit = np.array(data.draw(st.lists(st.integers(0, 3), min_size=self.N, max_size=self.N)))
        nodes = self.c.evicted_nodes
        got = self.c.evict(deficit)
        assert len(got) == self.c.evicted_nodes - nodes and got == self.c.last_evicted
        self._sync()
        event("cache: evict")

    def lookup(self, data):
        tokens, key = self._keyed(data)
        limit = data.draw(st.none() | st.integers(0, 2 * len(tokens)))
        before = self.snapshot(), self.a.snapshot()
        hit = self.c.lookup(tokens, limit, key=key)
        assert (self.snapshot(), self.a.snapshot()) == before, "lookup changed the cache or the allocator"
        assert hit.shared % self.S == 0 and 0 <= hit.copy < self.S
        assert hit.length <= (len(tokens) - 1 if limit is None else min(limit, len(tokens)))
        end = data.draw(st.sampled_from([len(tokens), hit.length, 0, self.a.num_pages * self.S + 1, 2**62]))
        adm = self.c.can_allocate(tokens, end, key=key)
        need, whole = adm.need, self.c.lookup(tokens, key=key).shared
        assert (need >= 0).all() and int(need.sum()) == max(0, -(-end // self.S) - whole // self.S)
        assert (self.snapshot(), self.a.snapshot()) == before, "can_allocate changed the cache or the allocator"

    def clear(self, data):
        if data.draw(st.integers(0, 3)) == 3:
            self.c.clear()
            self._sync()
            assert all(n.ref > 0 for n in self.c.tree.nodes()), "clear left an unreferenced node"
            event("cache: clear")

    # -- invalid calls -------------------------------------------------------------------------
    def extends_cached_page(self, data):
        """A chain that would grow inside a page the cache holds: a request
        that matched mid-page continuing from the cached page its match read
        instead of its copy, or any chain ending on a cached partial page.
        Where that slot ends the page's written part, only the cache can tell
        (``extends-cached-page``); where the match read part of what the page
        holds, the allocator sees a stale ``last_loc``."""
        S, c, a = self.S, self.c, self.a
        cands = [(r.m.length, int(r.m.copy_src[-1])) for r in self.live.values() if r.m.copy_src.numel()]
        cands += [(len(c.tree.prefix_tokens(n)), int(n.slots[-1])) for n in c.tree.leaves if len(n.key) % S]
        cands = [(p, l, "extends-cached-page" if a.page_fill([l // S])[0] - 1 == l % S else "stale-last-loc")
                 for p, l in cands if l // S in self.cached]
        if not cands:
            return None
        p, l, rule = data.draw(st.sampled_from(cands))
        k = data.draw(st.integers(1, 2 * S))
        # a valid request may come first: the refusal names the bad one
        ready = [q for q in self.live.values() if q.slots and len(q.slots) < len(q.tokens) and q.slots[-1] != l]
        lead = [data.draw(st.sampled_from(ready))] if ready and data.draw(st.booleans()) else []
        pre = [len(q.slots) for q in lead] + [p]
        seq = [len(q.tokens) for q in lead] + [p + k]
        last = [q.slots[-1] for q in lead] + [l]
        if data.draw(st.booleans()) and not lead:
            call = lambda: c.allocate_decode([p + 1], torch.tensor([l]))  # noqa: E731
        else:
            call = lambda: c.allocate_extend(pre, seq, torch.tensor(last))  # noqa: E731
        return Misuse(f"a chain grows inside a cached page ({rule})", call, UnsupportedPagePlan, rule)

    def consumed(self, data):
        if not self.ended:
            return None
        tokens, slots, m = data.draw(st.sampled_from(self.ended))
        c = self.c
        call = data.draw(st.sampled_from([lambda: end(c, m, tokens, slots), lambda: end(c, m, None, slots, False),
                                          lambda: c.finish([m], None, [], [0], cache=False)]))
        return Misuse(f"second end of a match ({m._ended})", call, PrefixCacheMisuse, "match-consumed")

    def foreign_or_not_a_match(self, data):
        c, fm = self.c, self.foreign
        hit = c.lookup((1, 2, 3))
        cases = [
            Misuse("finish of another cache's match", lambda: end(c, fm, fm.tokens, fm.slots), PrefixCacheMisuse,
                   "foreign-match"),
            Misuse("release of another cache's match", lambda: end(c, fm, None, fm.slots, False), PrefixCacheMisuse,
                   "foreign-match"),
            Misuse("release of a PrefixHit", lambda: c.finish([hit], None, [], [0], cache=False), PrefixCacheMisuse,
                   "not-a-match"),
            Misuse("finish of None", lambda: c.finish([None], None, [], [0], cache=False), PrefixCacheMisuse,
                   "not-a-match"),
            Misuse("cache_pages of a PrefixHit", lambda: c.cache_pages(
                [hit], (1,) * self.S, list(range(self.S, 2 * self.S)), [self.S]), PrefixCacheMisuse, "not-a-match"),
            Misuse("cache_pages of another cache's match", lambda: c.cache_pages([fm], (), [], [0]),
                   PrefixCacheMisuse, "foreign-match"),
        ]
        return data.draw(st.sampled_from(cases))

    def bad_inputs(self, data):
        c, N = self.c, self.N
        bad = data.draw(st.sampled_from(BAD_TOKENS))
        cases = [
            Misuse("lookup of bad tokens", lambda: c.lookup(bad), PrefixCacheMisuse, "bad-tokens"),
            Misuse("can_allocate of bad tokens", lambda: c.can_allocate(bad, 9), PrefixCacheMisuse, "bad-tokens"),
        ]
        for key in (1.5, True, (1,), ["a"]):
            cases.append(Misuse(f"key {key!r}", lambda key=key: c.can_allocate((1, 2, 3), 4, key=key),
                                PrefixCacheMisuse, "bad-key"))
            cases.append(Misuse(f"key {key!r} to lookup", lambda key=key: c.lookup((1, 2, 3), key=key),
                                PrefixCacheMisuse, "bad-key"))
        for limit in (-1, 1.5, True, "2"):
            cases.append(Misuse(f"max_length {limit!r}", lambda limit=limit: c.lookup((1, 2, 3), max_length=limit),
                                PrefixCacheMisuse, "bad-max-length"))
        for d in ([1] * (N + 1), [-1] * N, [0.5] * N, [[1] * N], np.full(N, 1.0), torch.ones(N, dtype=torch.bool)):
            cases.append(Misuse(f"deficit {d!r}", lambda d=d: c.evict(d), PrefixCacheMisuse, "bad-deficit"))
        live = sorted(self.live)
        if live:
            r = self.live[data.draw(st.sampled_from(live))]
            run = r.slots[r.m.shared :]
            if len(run) == len(bad) if hasattr(bad, "__len__") else False:
                cases.append(Misuse("finish of bad tokens", lambda: c.finish([r.m], bad, run, [len(run)]),
                                    PrefixCacheMisuse, "bad-tokens"))
            cases += self._bad_end_of(r, data)
        return data.draw(st.sampled_from(cases))

    def _bad_end_of(self, r: Req, data) -> list:
        """A live request finished with a wrong run (its positions past
        ``m.shared``), its KV cached or freed."""
        S, c, m = self.S, self.c, r.m
        tokens, slots = tuple(r.tokens[: len(r.slots)]), torch.tensor(r.slots, dtype=torch.int64)
        s = m.shared
        toks, run = np.array(tokens[s:], dtype=np.int64), slots[s:]
        ends = lambda bent: [lambda: c.finish([m], toks[: len(bent)], bent, [len(bent)]),  # noqa: E731
                             lambda: c.finish([m], None, bent, [len(bent)], cache=False)]
        out = [Misuse("finish of counts that do not add up", lambda: c.finish([m], toks, run, [len(run) + 1]),
                      PrefixCacheMisuse, "length-mismatch"),
               Misuse("finish of float slots", lambda: c.finish([m], toks, run.float(), [len(run)]),
                      PrefixCacheMisuse, "bad-slots"),
               Misuse("finish of a match twice", lambda: c.finish([m, m], np.concatenate([toks, toks]),
                                                                  torch.cat([run, run]), [len(run)] * 2),
                      PrefixCacheMisuse, "match-twice"),
               Misuse("finish of negative counts", lambda: c.finish([m], None, [], [-1], cache=False),
                      PrefixCacheMisuse, "bad-counts")]
        if len(run):
            out.append(Misuse("finish of fewer slots than tokens", lambda: c.finish([m], toks, run[:-1], [len(toks)]),
                              PrefixCacheMisuse, "length-mismatch"))
        if m.length > s:  # a copy not cached yet: the run starts with it
            j = data.draw(st.integers(0, m.length - s - 1))
            off = toks.copy()
            off[j] += 1
            out.append(Misuse("finish of tokens that do not extend the match",
                              lambda: c.finish([m], off, run, [len(run)]), PrefixCacheMisuse,
                              "tokens-do-not-extend-match"))
            bent = run.clone()
            bent[j] = run[j] + 1 if S > 1 and run[j] % S < S - 1 else run[j] - 1 if S > 1 else 0
            for call in ends(bent):
                out.append(Misuse("a copy slot changed", call, PrefixCacheMisuse, "slots-do-not-extend-match"))
            for call in ends(run[: m.length - s - 1]):
                out.append(Misuse("fewer slots than the copy", call, PrefixCacheMisuse, "slots-do-not-extend-match"))
        if len(run) > max(m.length - s, 0):  # own slots past the copy (past what cache_pages cached)
            n = len(run)
            chains = [torch.cat([run[:-1], torch.tensor([-1])]),  # padding
                      torch.cat([run[:-1], torch.tensor([(self.a.num_pages + 1) * S + (len(slots) - 1) % S])])]
            if S > 1:
                shifted = run.clone()
                shifted[-1] = shifted[-1] + 1 if shifted[-1] % S < S - 1 else shifted[-1] - 1
                chains.append(shifted)  # off its page offset
            elif n >= 2:
                chains.append(torch.cat([run[:-1], run[-2:-1]]))  # one page twice
            for bent in chains:
                for call in ends(bent):
                    out.append(Misuse("slots that are not a page chain", call, PrefixCacheMisuse, "not-a-page-chain"))
            q = (len(slots) - 1) // S
            if q * S >= max(m.length, s):  # the last page is the request's own: put another there
                free = np.flatnonzero(~self.a.is_allocated(np.arange(1, self.a.num_pages + 1))) + 1
                for pool, rule in ((free, "private-page-not-allocated"),
                                   (np.array(sorted(self.cached - _pages(r.slots, S))), "private-page-cached")):
                    if pool.size:
                        bent = run.clone()
                        bent[q * S - s :] = int(data.draw(st.sampled_from(pool.tolist()))) * S + \
                            torch.arange(len(slots) - q * S)
                        for call in ends(bent):
                            out.append(Misuse(f"another page as the request's own ({rule})", call, PrefixCacheMisuse,
                                              rule))
        return out

    def bad_end(self, data):
        if not self.live:
            return None
        return data.draw(st.sampled_from(self._bad_end_of(self.live[data.draw(st.sampled_from(sorted(self.live)))],
                                                          data)))

    def bad_admission(self, data):
        """``allocate`` of anything but this cache's hit or admission, ``can_allocate`` of a bad end."""
        c = self.c
        fhit, fm = self.other.lookup((1, 2, 3, 4, 5, 6)), self.foreign
        return data.draw(st.sampled_from([
            Misuse("allocate of a match", lambda: c.allocate(fm), PrefixCacheMisuse, "not-a-hit"),
            Misuse("allocate of tokens", lambda: c.allocate((1, 2, 3)), PrefixCacheMisuse, "not-a-hit"),
            Misuse("allocate of another cache's hit", lambda: c.allocate(fhit), PrefixCacheMisuse, "foreign-hit"),
            Misuse("allocate of another cache's admission", lambda: c.allocate(self.other.can_allocate((1, 2), 3)),
                   PrefixCacheMisuse, "foreign-hit"),
            Misuse("can_allocate of a negative end", lambda: c.can_allocate((1, 2, 3, 4), -1), PrefixCacheMisuse,
                   "bad-end"),
            Misuse("can_allocate of a float end", lambda: c.can_allocate((1, 2, 3, 4), 2.5), PrefixCacheMisuse,
                   "bad-end"),
            Misuse("can_allocate of a str end", lambda: c.can_allocate((1, 2, 3, 4), "7"), PrefixCacheMisuse,
                   "bad-end"),
        ]))

    def bad_live(self, data):
        """``cache_pages`` of a run that is not whole pages, of a match that
        stopped caching, or of a consumed match."""
        S, c = self.S, self.c
        cands = [r for r in self.live.values() if (len(r.slots) - r.m.shared) // S]
        cases = []
        if cands:
            r = data.draw(st.sampled_from(cands))
            s = r.m.shared
            toks, run = r.tokens[s : s + S], r.slots[s : s + S]
            if S > 1 and r.m.live:
                cases.append(Misuse("cache_pages of less than a page", lambda: c.cache_pages(
                    [r.m], toks[:-1], run[:-1], [S - 1]), PrefixCacheMisuse, "not-whole-pages"))
            if r.m.live:
                cases.append(Misuse("cache_pages of an empty run", lambda: c.cache_pages([r.m], (), [], [0]),
                                    PrefixCacheMisuse, "not-whole-pages"))
            else:
                cases.append(Misuse("cache_pages of a match that stopped caching", lambda: c.cache_pages(
                    [r.m], toks, run, [S]), PrefixCacheMisuse, "match-not-live"))
        if self.ended:
            _, _, m = data.draw(st.sampled_from(self.ended))
            cases.append(Misuse("cache_pages of a finished match", lambda: c.cache_pages([m], (), [], [0]),
                                PrefixCacheMisuse, "match-consumed"))
        return data.draw(st.sampled_from(cases)) if cases else None

    def stale_through_cache(self, data):
        """An ended request's ``last_loc`` used again through the cache: its
        page was freed, reused, or is the cache's now."""
        S, a = self.S, self.a
        cases = []
        for tokens, slots, m in self.ended:
            n = len(tokens)
            if not n:
                continue
            last = int(slots[-1])
            page, off = last // S, last % S
            fill = int(a.page_fill([page])[0])
            if fill == 0:
                rule = "last-loc-not-allocated"
            elif fill - 1 != off:
                rule = "stale-last-loc"
            elif page in self.cached and n % S:
                rule = "extends-cached-page"
            else:
                continue  # a continuation the allocator cannot tell from a live one
            cases.append((n, last, rule))
        if not cases:
            return None
        n, last, rule = data.draw(st.sampled_from(cases))
        c = self.c
        call = data.draw(st.sampled_from([lambda: c.allocate_extend([n], [n + 2], torch.tensor([last])),
                                          lambda: c.allocate_decode([n + 1], torch.tensor([last]))]))
        return Misuse(f"an ended request's last_loc ({rule})", call, UnsupportedPagePlan, rule)

    def too_big(self, data):
        c = self.c
        n = data.draw(st.sampled_from([self.a.num_pages * self.S + 1, 2**31, 2**62]))
        return Misuse("more than the whole cache, through the cache", lambda: c.allocate_extend([0], [n], [-1]),
                      UnsupportedPagePlan, "exceeds-capacity")


class SharedAllocator(AllocatorComponent):
    """The allocator component on the shared allocator: clearing it, or
    restoring a backup, empties the cache first, and only while no cache
    request is live (an allocator reset under live requests is no valid call)."""

    def __init__(self, cp, S, lane_pages, alloc, cache: CacheComponent):
        super().__init__(cp, S, lane_pages, allocator=alloc)
        self.cache = cache
        self.co_holders.append(cache.held_slots)

    def clear(self, data):
        if self.cache.quiet():
            self.cache.empty()
            super().clear(data)

    def backup_restore(self, data):
        if self.cache.quiet() and not self.m["group"]:  # emptying the cache inside a group leaves frees pending
            self.cache.empty()
            super().backup_restore(data)


class SharedMisuseMachine(MisuseMachine):
    def components_for(self, cp, S, lane_pages):
        alloc = OwnerLaneAllocator(lane_pages * cp * S, S, cp)
        cache = CacheComponent(alloc, S, cp)
        return [SharedAllocator(cp, S, lane_pages, alloc, cache), cache]


SharedMisuseMachine.TestCase.settings = settings(settings(), max_examples=100, stateful_step_count=100, deadline=None)
TestSharedMisuseMachine = SharedMisuseMachine.TestCase
