"""A toy engine over the prefix cache for tests: the 'KV' of a slot is (token, position);
and the two calls tests make of one request given its whole sequence."""

import numpy as np
import torch
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator, UnsupportedPagePlan
from cpkv.consumers.prefix_cache import PrefixCache


def admit(cache, tokens, max_length=None, key=None):
    """A request admitted: ``allocate(lookup(tokens))``."""
    return cache.allocate(cache.lookup(tokens, max_length, key=key))


def end(cache, m, tokens, slots, keep=True):
    """One request ends, given its whole sequence (``tokens`` may be None
    without ``keep``): :meth:`PrefixCache.finish` of its run past ``m.shared``,
    cached (``keep``) or freed."""
    s = m.shared
    cache.finish([m], None if tokens is None else tokens[s:], slots[s:], [len(slots) - s], cache=keep)


#: The orders as the module doc states them, written here apart from the policies' own keys.
SPEC = {"lru": lambda n: (n.last_access, n.serial), "lfu": lambda n: (n.hits, n.last_access, n.serial)}


def lanes_of(node, S, N) -> set:
    """The lanes of the pages of a tree node."""
    return set((np.unique(node.slots // S) % N).tolist())


def reference_victim(cache, short: set):
    """The first unreferenced leaf, in the policy's order (:data:`SPEC`), with a
    page in a ``short`` lane; else the first whose removal (its unreferenced
    single-child ancestors going after it, one by one) reaches a node with one."""
    S, N, tree = cache.S, cache.N, cache.tree
    order = sorted((leaf for leaf in tree.leaves if leaf.ref == 0), key=SPEC[tree.policy.name])
    for leaf in order:
        if lanes_of(leaf, S, N) & short:
            return leaf
    for leaf in order:
        up = leaf.parent
        while up.parent is not None and up.ref == 0 and len(up.children) == 1:
            if lanes_of(up, S, N) & short:
                return leaf
            up = up.parent
    return None


class Engine:
    """A toy engine over the cache: 'KV' of a slot is (token, position)."""

    def __init__(self, pages_per_lane, S, N, **kw):
        self.S, self.N = S, N
        self.alloc = OwnerLaneAllocator(pages_per_lane * N * S, S, N)
        self.cache = PrefixCache(self.alloc, **kw)
        self.kv = {}
        self.live = {}  # id -> (tokens, slots, match)

    def start(self, rid, tokens):
        return self.run(rid, tokens, admit(self.cache, tokens))

    def run(self, rid, tokens, m):
        """Copy, check the matched KV, allocate the rest and 'compute' it."""
        src_pages = np.unique(m.copy_src.numpy() // self.S)
        assert self.cache.tree.page_cached[src_pages].all(), "the copy source left the cache before the copy"
        for s, d in zip(m.copy_src.tolist(), m.copy_dst.tolist()):
            self.kv[d] = self.kv[s]  # the copy the engine makes, inside one lane
        matched = m.slots.tolist()  # derived from the tree: read once
        for j in range(m.length):
            assert self.kv[matched[j]] == (tokens[j], j), "a cached slot holds the wrong KV"
        try:
            r = self.cache.allocate_extend([m.length], [len(tokens)], torch.tensor([m.last_loc]))
        except UnsupportedPagePlan as e:  # "never": the request is longer than the cache could ever hold
            assert e.rule == "exceeds-capacity", e
            r = None
        if r is None:
            end(self.cache, m, None, m.slots, keep=False)
            return None
        slots = torch.cat([m.slots, r.out_cache_loc])
        for j in range(m.length, len(tokens)):
            self.kv[int(slots[j])] = (tokens[j], j)
        self.live[rid] = (tuple(tokens), slots, m)
        return m

    def finish(self, rid):
        tokens, slots, m = self.live.pop(rid)
        end(self.cache, m, tokens, slots)
        return tokens, slots, m

    def abort(self, rid):
        tokens, slots, m = self.live.pop(rid)
        end(self.cache, m, None, slots, keep=False)
        return tokens, slots, m

    def state(self):
        return self.cache.snapshot(), self.alloc.snapshot()


@st.composite
def cached_sets(draw):
    """A page size, a few short token sequences to cache (tokens 0..2, so they
    share prefixes) and a query: ``(S, seqs, query)``."""
    S = draw(st.sampled_from([1, 2, 4]))
    seqs = draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12).map(tuple), min_size=1, max_size=6))
    query = tuple(draw(st.lists(st.integers(0, 2), min_size=1, max_size=14)))
    return S, seqs, query
