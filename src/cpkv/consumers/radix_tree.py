"""The radix tree of the prefix cache: cached token chains and their slots,
page granular, with per-lane counts kept exact. It answers questions and
changes only its own shape; it never calls the allocator (the cache,
:class:`~cpkv.consumers.prefix_cache.PrefixCache`, does). [[RFC-0001:C-PREFIX-CACHE]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..contract.inputs import int_vector
from .eviction import EvictionPolicy, eviction_policy
from ..contract.layout import lane_base_of_last_loc, lane_of_position, owner_of, page_of, ranges


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token runs (int64 arrays); vectorised."""
    n = min(a.size, b.size)
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if d.size else n


def page_key(tokens: np.ndarray, page_size: int) -> bytes:
    """The children-dict key of a node whose tokens start with ``tokens``: the
    bytes of its first page (or of the whole key, for a partial leaf)."""
    return tokens[:page_size].tobytes()


@dataclass(eq=False, slots=True)
class _Node:
    key: np.ndarray  # int64 tokens of this edge: whole pages, or fewer than a page (partial leaf)
    slots: np.ndarray  # int64 (numpy: a node is small, and a torch op on it costs ten times a numpy one)
    parent: "_Node | None"
    lanes: np.ndarray  # pages of this node per lane
    pages: np.ndarray  # the node's logical pages, in chain order
    serial: int  # the last tie-break of every eviction order: older first
    children: dict = field(default_factory=dict)  # page_key(first page, or partial key) -> node
    ref: int = 0  # live requests whose prefix runs through this node
    last_access: int = 0  # the tree's clock when last used
    ns: bytes = b""  # the namespace (request key) of the chain: one root per namespace
    partials: int = 0  # children that are partial leaves (shorter than a page)
    mask: int = 0  # bit i set when the node has a page in lane i (kept with ``lanes``: what eviction asks)
    hits: int = 0  # admitted requests that matched a prefix through this node (what LFU reads)


def lane_mask(lanes: np.ndarray) -> np.ndarray | int:
    """The lanes with a page as a bit mask (bit i: lane i), of one ``lanes`` [N] or of each row of [B, N]."""
    bits = (np.asarray(lanes) > 0).astype(np.int64) << np.arange(np.shape(lanes)[-1], dtype=np.int64)
    return int(bits.sum()) if bits.ndim == 1 else bits.sum(-1)


@dataclass
class _Walk:
    """Where ``tokens`` leave the tree (a pure walk, nothing split)."""

    path: list  # (node, whole pages of it matched), root downwards
    shared: int  # tokens on those pages
    src: "_Node | None" = None  # node holding the partly matched page
    src_off: int = 0  # that page's offset in src.key
    copy: int = 0  # matched tokens on it


class RadixTree:
    """The radix tree of cached chains, with per-lane counts kept up to date.

    Holds no allocator: it answers questions (:meth:`walk`,
    :meth:`victim`, :meth:`snapshot`, the counts) and changes only its own
    shape (:meth:`attach`, :meth:`split`, :meth:`detach`, :meth:`pin`).
    ``policy`` (a name of :data:`~cpkv.consumers.eviction.EVICTION_POLICIES`
    or an :class:`~cpkv.consumers.eviction.EvictionPolicy`; default ``lru``)
    orders the leaves :meth:`victim` chooses from.
    Chains are partitioned by namespace (a request key as bytes, see
    :func:`~cpkv.consumers.kv_events.key_bytes`): one root per namespace
    (``roots``; ``root`` is the default namespace ``b""``), so no walk crosses
    keys. ``events`` (a :class:`~cpkv.consumers.kv_events.KVEventSink`, or
    ``None``: no cost) hears every full page that enters (:meth:`attach`) or
    leaves (:meth:`detach`) the tree, in ``medium``
    ([[RFC-0001:C-KV-EVENTS]]). Derived state, exact after every call: ``cached_lanes`` [N] (pages of all
    nodes per lane), ``evictable_lanes`` [N] (pages of unreferenced nodes per
    lane; an unreferenced node's whole subtree is unreferenced, so all of them
    can go, leaves first) and ``page_cached`` [num_pages + 1] (whether the tree
    holds a page; ``None`` when ``num_pages`` is ``None``: the slots are values
    a caller manages, not pages of an allocator, and nothing tracks them).
    """

    def __init__(self, page_size: int, cp_size: int, num_pages: int | None, policy: str | EvictionPolicy = "lru"):
        self.S, self.N = page_size, cp_size
        self.policy = eviction_policy(policy)
        self._serial = 0
        self.now = 0  # the clock of last_access: advanced by every pin and every new node
        self.roots: dict[bytes, _Node] = {}
        self.root = self.root_of(b"", create=True)
        self.events, self.medium = None, "GPU"
        self.leaves: dict[_Node, None] = {}  # insertion-ordered, so iteration is deterministic
        self.cached_lanes = np.zeros(cp_size, dtype=np.int64)
        self.evictable_lanes = np.zeros(cp_size, dtype=np.int64)
        self.page_cached = None if num_pages is None else np.zeros(num_pages + 1, dtype=bool)

    def pages_of(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """The distinct pages under ``slots`` (an int tensor or array) and their count per lane."""
        pages = np.unique(page_of(int_vector(slots, "slots"), self.S))
        return pages, np.bincount(owner_of(pages, self.N), minlength=self.N)

    def _node(self, key: np.ndarray, slots: np.ndarray, parent: _Node | None) -> _Node:
        pages = page_of(slots[:: self.S], self.S)  # a node's slots are a page chain from a page start
        lanes = np.bincount(owner_of(pages, self.N), minlength=self.N)
        self._serial += 1
        return _Node(key, slots, parent, lanes, pages, self._serial, last_access=self.now, mask=lane_mask(lanes))

    def root_of(self, ns: bytes, create: bool = False) -> _Node | None:
        """The root of namespace ``ns`` (made when ``create``; else ``None`` if absent)."""
        root = self.roots.get(ns)
        if root is None and create:
            # a root takes no serial and no access time (it is never evicted): a tree is the same whatever
            # order its namespaces were opened in
            root = self.roots[ns] = _Node(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), None,
                                          np.zeros(self.N, dtype=np.int64), np.empty(0, dtype=np.int64), 0)
            root.ref, root.ns = 1, ns
        return root

    def lane_of(self, slot) -> int:
        """Owner lane of the page holding ``slot``."""
        return int(owner_of(page_of(int(slot), self.S), self.N))

    def tick(self) -> int:
        """Advance the clock of ``last_access``; return the new time."""
        self.now += 1
        return self.now

    # -- questions ------------------------------------------------------------------
    def walk(self, tokens: np.ndarray, limit: int, ns: bytes = b"", start: _Node | None = None) -> _Walk:
        """How far ``tokens[:limit]`` (int64) follows the chains of namespace
        ``ns``: whole pages, then the child (or next page of the same edge)
        sharing the longest run of the next page's tokens. From the root of
        ``ns``, or from the end of node ``start`` (``tokens`` then continue its
        path, in its namespace). Pure: nothing is split or touched. One
        vectorised comparison per edge and one dict lookup per node: never a
        step per page or per token."""
        S = self.S
        node = self.roots.get(ns) if start is None else start
        if node is None:
            return _Walk([], 0)
        off, i, path = len(node.key), 0, []
        whole = limit // S * S
        while i < whole:
            if off < len(node.key):  # inside an edge: as many of its next pages as match
                m = min(len(node.key) - off, whole - i) // S * S
                eq = _common(node.key[off : off + m], tokens[i : i + m]) // S * S
                off, i = off + eq, i + eq
                path[-1] = (node, off // S)
                if eq < m or m == 0:
                    break
            else:
                child = node.children.get(page_key(tokens[i:], S))
                if child is None or len(child.key) < S:
                    break
                node, off = child, S
                path.append((child, 1))
                i += S
        w = _Walk(path, i)
        rest = tokens[i : min(i + S, limit)]
        if rest.size:
            cands = [(node, off)] if off < len(node.key) else [(c, 0) for c in node.children.values()]
            for c, o in cands:
                n = _common(c.key[o : o + S], rest)
                if n > w.copy:
                    w.src, w.src_off, w.copy = c, o, n
        return w

    def victim(self, short: np.ndarray) -> _Node | None:
        """The unreferenced leaf to evict next for the lanes ``short`` [N] bool:
        the first in the policy's order (:attr:`policy`) that frees a page in a
        short lane, else the first whose removal exposes an unreferenced
        ancestor that does; ``None`` when nothing evictable helps. One pass over
        the leaves comparing each node's lane mask (a cache evicting under a long
        trace holds thousands of leaves); the walk up only when no leaf helps.
        [[RFC-0001:C-PREFIX-CACHE]]"""
        want, key = lane_mask(short), self.policy.key
        best = min((leaf for leaf in self.leaves if not leaf.ref and leaf.mask & want), key=key, default=None)
        if best is not None:
            return best
        return min((leaf for leaf in self.leaves if not leaf.ref and self._exposes(leaf, want)), key=key, default=None)

    @staticmethod
    def _exposes(leaf: _Node, want: int) -> bool:
        """Whether removing ``leaf`` (and then its parents, each left an
        unreferenced leaf in turn) reaches an ancestor with a page in the lanes
        of ``want``."""
        up = leaf.parent
        while up.parent is not None and up.ref == 0 and len(up.children) == 1:
            if up.mask & want:
                return True
            up = up.parent
        return False

    def ordered_leaves(self) -> list:
        """The unreferenced leaves in the policy's order, the first evicted first."""
        return sorted((leaf for leaf in self.leaves if not leaf.ref), key=self.policy.key)

    @staticmethod
    def prefix_tokens(node: _Node) -> np.ndarray:
        """Every token from the root through the end of ``node`` (int64, a copy).
        Reads the node's chain only (a node that left the tree keeps it)."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return np.concatenate(keys[::-1]) if keys else np.empty(0, dtype=np.int64)

    @staticmethod
    def prefix_slots(node: _Node | None) -> torch.Tensor:
        """The slots of every token from the root through the end of ``node``
        (int64, a copy; empty for ``None`` or a root). Reads the node's chain only."""
        parts = []
        while node is not None and node.parent is not None:
            parts.append(node.slots)
            node = node.parent
        return torch.from_numpy(np.concatenate(parts[::-1])) if parts else torch.empty(0, dtype=torch.int64)

    def nodes(self):
        """Every node but the roots (depth first)."""
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.parent is not None:
                yield n

    def chain_lane(self, node: _Node, length: int) -> int | None:
        """The lane page position ``length // S`` must take to continue the
        cached chain that ends at ``node`` after ``length`` tokens (a multiple
        of S), keeping its lane base; ``None`` at a root (any lane starts a
        chain). [[RFC-0001:C-OWNER-LANE]]"""
        if node.parent is None:
            return None
        base = lane_base_of_last_loc(int(node.slots[-1]), length, self.S, self.N)
        return int(lane_of_position(base, length // self.S, self.N))

    def graft_length(self, node: _Node, start: int, slots) -> int:
        """How many of ``slots`` (a page chain from position ``start``, a
        multiple of S) may hang under ``node`` (ending at ``start``): every
        page up to the first whose lane is not ``(b + q) % N`` of the chain it
        would join, so every cached chain keeps one lane base at every
        position (SGLang's kv-shard radix cache declines such a graft
        likewise). Vectorised. [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-PREFIX-CACHE]]"""
        slots = int_vector(slots, "slots")
        lanes = owner_of(page_of(slots[:: self.S], self.S), self.N)
        ok = int(self.graft_pages([node], np.array([start]), lanes, np.array([lanes.size]))[0])
        return int(slots.size) if ok == lanes.size else ok * self.S

    def graft_pages(self, nodes: list, starts: np.ndarray, lanes: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """:meth:`graft_length` in pages for a batch of chains: chain ``i``
        (``pages[i]`` pages at positions ``starts[i] ..``, a multiple of S,
        lanes ``lanes`` back to back) would hang under ``nodes[i]``. Returns
        int64 ``[len(nodes)]``: how many lead pages of each continue the lane
        base of the chain they join (under a root: the base of the chain's own
        first page). One vectorised pass over the batch."""
        S, N, B = self.S, self.N, len(nodes)
        first_page = np.cumsum(pages) - pages
        last = np.fromiter((-1 if n.parent is None else int(n.slots[-1]) for n in nodes), np.int64, B)
        own = lanes[np.minimum(first_page, max(lanes.size - 1, 0))] if lanes.size else np.zeros(B, dtype=np.int64)
        joined = lane_of_position(lane_base_of_last_loc(np.maximum(last, 0), starts, S, N), starts // S, N)
        first = np.where(last < 0, own, joined)  # the lane the chain's first page must take
        run = np.repeat(np.arange(B), pages)
        q = np.arange(lanes.size) - first_page[run]
        bad = lanes != lane_of_position(first[run], q, N)
        ok = np.asarray(pages, dtype=np.int64).copy()
        np.minimum.at(ok, run[bad], q[bad])
        return ok

    def snapshot(self) -> tuple:
        """The whole tree as nested tuples: per node key, slots, ref, access
        time, hits, serial and children in order; then the clock and the
        derived counts."""

        def one(n: _Node) -> tuple:
            kids = tuple((k, one(c)) for k, c in n.children.items())
            return tuple(n.key.tolist()), tuple(n.slots.tolist()), n.ref, n.last_access, n.hits, n.serial, kids

        cached = None if self.page_cached is None else self.page_cached.tobytes()
        return (tuple((ns, one(r)) for ns, r in self.roots.items()), self.now, self._serial, tuple(self.cached_lanes.tolist()),
                tuple(self.evictable_lanes.tolist()), cached)

    # -- shape changes (counts kept exact) ---------------------------------------------
    def attach(self, parent: _Node, key: np.ndarray, slots) -> _Node:
        """A new unreferenced node under ``parent`` (which has no child on
        its first page), used now (``key`` and ``slots`` are copied)."""
        return self.attach_many([parent], key, slots, np.array([len(key)]), held=False)[0]

    def attach_many(self, parents: list, tokens: np.ndarray, slots, counts: np.ndarray, held: bool,
                    ticks=None) -> list:
        """Run ``i`` (``counts[i] >= 1`` tokens and slots, back to back, a page
        chain from a page start) as a new node under ``parents[i]``, in order,
        as :meth:`attach` one by one would: skipped (``None`` in the returned
        list) where ``parents[i]`` is None or already has a child on the run's
        first page (one of the batch may have put it there). Every new node is
        used now (one tick each, or at ``ticks[i]``: LRU times past the clock
        that a caller interleaving other calls reserved; the clock then
        stands at the latest) and, with
        ``held``, referenced by one live request (as :meth:`hold_child`).
        Tokens and slots are copied once for the batch; the per-lane counts
        are updated once. Returns the new nodes."""
        S, N, B = self.S, self.N, len(parents)
        tokens, slots = np.array(tokens, dtype=np.int64), int_vector(slots, "slots").copy()
        starts = np.cumsum(counts) - counts
        heads = np.flatnonzero(ranges(np.zeros_like(counts), counts) % S == 0)  # each page's first slot
        pages = page_of(slots[heads], S)
        per_run = -(-np.asarray(counts) // S)
        run = np.repeat(np.arange(B), per_run)
        lanes = np.bincount(run * N + owner_of(pages, N), minlength=B * N).reshape(B, N)
        first_page = np.cumsum(per_run) - per_run
        nodes, ref, leaves, raw, w = [None] * B, int(held), self.leaves, tokens.tobytes(), tokens.itemsize
        ends, page_ends = (starts + counts).tolist(), (first_page + per_run).tolist()
        masks = lane_mask(lanes).tolist()
        for i, (parent, a, b, p, q, lane) in enumerate(zip(parents, starts.tolist(), ends, first_page.tolist(), page_ends,
                                                            lanes)):
            k = raw[a * w : min(a + S, b) * w]  # page_key: a partial run's key ends with the run
            if parent is None or k in parent.children:
                continue
            self._serial += 1
            if ticks is None:  # used now: one tick per node, as attach one by one
                t = self.now = self.now + 1
            else:
                t = ticks[i]
                self.now = max(self.now, t)
            node = nodes[i] = _Node(tokens[a:b], slots[a:b], parent, lane, pages[p:q], self._serial, {}, ref, t,
                                    parent.ns, mask=masks[i])
            parent.children[k] = node
            if b - a < S:
                parent.partials += 1
            leaves.pop(parent, None)
            leaves[node] = None
            if self.events is not None:
                self._announce(node, self.events.stored)
        made = np.fromiter((n is not None for n in nodes), bool, B)
        got = lanes[made].sum(0)
        self.cached_lanes += got
        if not held:
            self.evictable_lanes += got
        if self.page_cached is not None:
            self.page_cached[pages[made[run]]] = True
        return nodes

    def _announce(self, node: _Node, call) -> None:
        """Tell ``events`` about the full pages of ``node`` (none for a partial leaf)."""
        full = len(node.key) // self.S
        if full:
            toks = self.prefix_tokens(node)
            call(toks, (len(toks) - len(node.key)) // self.S, full, self.medium, key=node.ns or None)

    def split(self, node: _Node, pages: int) -> _Node:
        """Cut ``node`` after ``pages`` whole pages; ``node`` keeps the lower
        part, the returned new node the upper. Counts are unchanged."""
        n = pages * self.S
        upper = self._node(node.key[:n], node.slots[:n], node.parent)
        upper.ref, upper.last_access, upper.hits, upper.ns = node.ref, node.last_access, node.hits, node.ns
        node.parent.children[page_key(upper.key, self.S)] = upper  # same dict key: keeps the children's order
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        node.pages = node.pages[pages:]  # in chain order
        node.lanes = np.bincount(owner_of(node.pages, self.N), minlength=self.N)
        node.mask = lane_mask(node.lanes)
        upper.children[page_key(node.key, self.S)] = node
        return upper

    def detach(self, leaf: _Node) -> None:
        """Take an unreferenced leaf out of the tree (its pages are the caller's to free)."""
        assert leaf.ref == 0 and not leaf.children, "only an unreferenced leaf can leave the tree"
        if self.events is not None:
            self._announce(leaf, self.events.removed)
        parent = leaf.parent
        del parent.children[page_key(leaf.key, self.S)]
        parent.partials -= len(leaf.key) < self.S
        del self.leaves[leaf]
        if not parent.children and parent.parent is not None:
            self.leaves[parent] = None
        elif not parent.children and parent is not self.root:
            del self.roots[parent.ns]  # an emptied namespace leaves no root behind
        self.cached_lanes -= leaf.lanes
        self.evictable_lanes -= leaf.lanes
        if self.page_cached is not None:
            self.page_cached[leaf.pages] = False

    def hold_child(self, child: _Node) -> None:
        """One live request whose path ends at ``child``'s parent (and holds
        it) now ends at ``child``, a new unreferenced leaf: ``child`` gets the
        reference, the ancestors keep theirs. O(1), unlike :meth:`pin`, which
        walks every ancestor."""
        assert child.ref == 0 and child.parent is not None and (child.parent.parent is None or child.parent.ref > 0)
        child.ref = 1
        self.evictable_lanes -= child.lanes

    def unpin_many(self, nodes: list, ticks=None) -> None:
        """:meth:`pin` ``(node, -1)`` for each of ``nodes`` in order (one tick
        each, as the calls one by one, or at ``ticks[i]``, as
        :meth:`attach_many`), the per-lane counts updated once."""
        freed = []
        for i, node in enumerate(nodes):
            t = self.now + 1 if ticks is None else ticks[i]
            self.now = max(self.now, t)
            while node is not None and node.parent is not None:
                node.ref -= 1
                assert node.ref >= 0, "reference count below zero"
                if node.ref == 0:
                    freed.append(node.lanes)
                node.last_access = t
                node = node.parent
        if freed:
            self.evictable_lanes += np.sum(freed, axis=0)

    def pin(self, node: _Node | None, delta: int, hit: bool = False) -> None:
        """Add ``delta`` to the reference count of ``node`` and every ancestor
        and mark them used now (``delta=0`` only marks them); with ``hit``
        (a request admitted on a prefix ending at ``node``) count a hit on
        each. Splits copy counts, so walking parents is exact."""
        t = self.tick()
        while node is not None and node.parent is not None:
            before = node.ref
            node.ref += delta
            assert node.ref >= 0, "reference count below zero"
            if before == 0 and node.ref > 0:
                self.evictable_lanes -= node.lanes
            elif before > 0 and node.ref == 0:
                self.evictable_lanes += node.lanes
            node.last_access = t
            node.hits += hit
            node = node.parent
