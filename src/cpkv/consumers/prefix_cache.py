"""W5: prefix (radix) cache over the owner-lane allocator, with lane-aware eviction.

A radix tree keyed by token ids holds cached chains of slots, page granular:
every edge covers whole pages, except a *partial leaf*, the last page of a
finished request that ends mid-page. Requests share cached full pages (a
reference count per node keeps them alive while in use). Invariants
([[RFC-0001:C-PREFIX-CACHE]]):

* every page is owned by exactly one party: the cache (a node), or one live
  request (its private pages), or the free lists;
* a node in use (``ref > 0``) is never evicted, nor is any node on its path;
* a partially matched page is never shared: the matched tokens' KV is copied
  to a private page and the request extends that copy, so two live requests
  never write the same slot. The copy is the first page the request owns, so
  its lane is free to choose: the allocator's rule for a fresh request picks
  it (the lane with the most free pages; on a tie, the source page's own
  lane, which keeps the chain's lanes). Continuations of one long shared
  prefix therefore spread over the lanes instead of all starting in the lane
  after the prefix. The destination's owner reads the source through the
  shared view and writes its own segment; nothing else moves;
* a continuation keeps the owner lanes of what it matched: ``last_loc`` of
  the match (in the copy, when there is one) fixes the request's lane base
  ([[RFC-0001:C-REQUEST-RELATIVE]]). A match that ends on a page boundary
  continues the cached chain's lanes.

Life of a request (the scheduler's calls):

* :meth:`PrefixCache.lookup` answers "how much of this is cached?" with a
  :class:`PrefixHit` and changes nothing (no reference, no LRU touch, no
  page, no counter): use it to rank waiting requests and to budget lanes;
* :meth:`PrefixCache.acquire` admits the request: it pins the matched path
  and takes the copy page, and returns a :class:`PrefixMatch`;
* the match is consumed exactly once, by :meth:`PrefixCache.insert` (finish:
  cache the KV) or :meth:`PrefixCache.release` (abort or preemption: free the
  private pages). A second use, a match of another cache, or slots that do
  not extend the match raise :class:`PrefixCacheMisuse` and change nothing.

Memory runs out per lane, so eviction knows lanes: when an allocation is
refused, the least recently used unreferenced leaves that free pages in the
short lanes go first, until the request fits or nothing evictable helps (the
per-lane deficit is then kept in ``last_deficit``).

The module holds two classes: :class:`RadixTree` (the tree, its derived
per-lane counts, and every question about it; it never calls the allocator)
and :class:`PrefixCache` (the calls that change state: pinning, allocation,
insertion, eviction). Tree, pages and slots live on the host, as the
allocator's control state does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..contract.allocator import ExtendAllocation, OwnerLaneAllocator
from ..contract.errors import UnsupportedPagePlan
from ..contract.inputs import int_vector
from ..contract import layout, rules
from ..contract.layout import lane_base_from_prefix, lane_base_of_last_loc, owner_of, page_of

EvictHook = Callable[[tuple, torch.Tensor], None]


class PrefixCacheMisuse(ValueError):
    """A call the prefix cache refuses; nothing changed.

    ``rule`` is a short stable name of the broken rule (``match-consumed``,
    ``foreign-match``, ``bad-tokens``, ``slots-do-not-extend-match``, ...), so
    an engine can branch on it. [[RFC-0001:C-PREFIX-CACHE]]
    """

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"[{rule}] {message}")


# -- input checks (pure) ---------------------------------------------------------
def _int_vector(x, what: str, rule: str) -> np.ndarray:
    """A flat int64 host copy of a 1-D integer list, array or tensor, or raise."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool or x.dim() != 1:
            raise PrefixCacheMisuse(rule, f"{what} must be a 1-D integer tensor, got {x.dtype} {tuple(x.shape)}")
        return x.detach().cpu().numpy().astype(np.int64, copy=False)
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise PrefixCacheMisuse(rule, f"{what} must be a flat sequence of ints, got dtype {a.dtype}, shape {a.shape}")
    return a.astype(np.int64, copy=False)


def _as_tokens(tokens) -> tuple:
    """Token ids as a tuple of Python ints >= 0 (the tree's keys), or raise."""
    a = _int_vector(tokens, "tokens", "bad-tokens")
    if a.size and a.min() < 0:
        raise PrefixCacheMisuse("bad-tokens", f"token ids must be >= 0, got {int(a.min())}")
    return tuple(a.tolist())


def _as_limit(max_length, n: int) -> int:
    """Most tokens a match may cover: ``n - 1`` by default, so at least one is computed."""
    if max_length is None:
        return n - 1
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 0:
        raise PrefixCacheMisuse("bad-max-length", f"max_length must be an int >= 0 or None, got {max_length!r}")
    return min(int(max_length), n)


def _common(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two token runs (at most one page long)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- data ------------------------------------------------------------------------
@dataclass(eq=False)
class _Node:
    key: tuple  # tokens of this edge: whole pages, or fewer than a page (partial leaf)
    slots: torch.Tensor  # int64, host
    parent: "_Node | None"
    lanes: np.ndarray  # pages of this node per lane
    pages: np.ndarray  # the node's logical pages
    serial: int  # tie-break in LRU order: older first
    children: dict = field(default_factory=dict)  # first page (or partial key) -> node
    ref: int = 0  # live requests whose prefix runs through this node
    last_access: int = 0


@dataclass(frozen=True, eq=False)
class PrefixHit:
    """What :meth:`PrefixCache.lookup` found; nothing was taken.

    ``length`` tokens are cached, ``shared`` of them on whole pages that a
    request would share (a multiple of the page size), ``copy`` more
    (``length - shared``, less than a page) on a partly matched page that
    :meth:`PrefixCache.acquire` would copy into a private page.
    ``last_shared_loc`` is the slot of the last shared token (-1 for none);
    ``copy_lane`` the lane of the page the copy reads (-1 for none).
    ``newly_pinned`` [N] counts, per lane, the cached pages that acquiring
    would take out of :meth:`PrefixCache.evictable_pages` (matched pages that
    nobody holds now). A hit answers for the cache that made it only
    (:meth:`PrefixCache.lane_need` refuses another's).
    """

    length: int
    shared: int
    copy: int
    last_shared_loc: int
    copy_lane: int
    newly_pinned: np.ndarray
    _owner: "PrefixCache | None" = field(default=None, repr=False)

    @property
    def needs_copy(self) -> bool:
        """Whether acquiring takes a copy page."""
        return self.copy > 0


@dataclass(eq=False)
class PrefixMatch:
    """A request's cached prefix, held from :meth:`PrefixCache.acquire` until
    it is consumed, exactly once, by :meth:`PrefixCache.insert` or
    :meth:`PrefixCache.release`.

    ``length`` tokens are cached (``tokens``); ``slots`` [length] int64 (host)
    hold them: ``shared`` slots on the cache's pages, then the private copy of
    a partly matched page. ``last_loc`` is the last of them (-1 for none) and
    fixes the request's lane base. ``copy_src`` -> ``copy_dst`` are the KV
    copies the engine must make before the request's first forward (the owner
    of ``copy_dst`` reads ``copy_src`` through the shared view).
    """

    length: int
    slots: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    shared: int
    tokens: tuple = field(default=(), repr=False)
    node: "_Node | None" = field(default=None, repr=False)  # deepest shared node, held
    _owner: "PrefixCache | None" = field(default=None, repr=False)
    _ended: str | None = field(default=None, repr=False)  # "inserted" or "released" once consumed

    @property
    def last_loc(self) -> int:
        """Slot of the last cached token, -1 when nothing matched."""
        return int(self.slots[-1]) if self.length else -1

    @property
    def consumed(self) -> bool:
        """Whether insert or release already ended this match."""
        return self._ended is not None


@dataclass
class _Walk:
    """Where ``tokens`` leave the tree (a pure walk, nothing split)."""

    path: list  # (node, whole pages of it matched), root downwards
    shared: int  # tokens on those pages
    src: "_Node | None" = None  # node holding the partly matched page
    src_off: int = 0  # that page's offset in src.key
    copy: int = 0  # matched tokens on it


def _check_end(cache: "PrefixCache", match: PrefixMatch, slots: np.ndarray, what: str) -> None:
    """Every rule :meth:`PrefixCache.insert` and :meth:`PrefixCache.release`
    share, checked before anything changes (reads ``cache``, changes nothing)."""
    if not isinstance(match, PrefixMatch):
        raise PrefixCacheMisuse("not-a-match", f"{what} takes the PrefixMatch of acquire(), got {type(match).__name__}")
    if match._owner is not cache:
        raise PrefixCacheMisuse("foreign-match", f"{what}: the match was not acquired from this cache")
    if match.consumed:
        raise PrefixCacheMisuse("match-consumed", f"{what}: the match was already {match._ended}; a match ends once")
    S, n, L = cache.S, slots.size, match.length
    if n < L or not np.array_equal(slots[:L], match.slots.numpy()):
        raise PrefixCacheMisuse("slots-do-not-extend-match",
                                f"{what}: the first {L} slots must be the match's own slots")
    pages = page_of(slots, S)
    first = pages[np.arange(n) // S * S]  # the page each position's page starts on
    if n and (pages.min() < 1 or pages.max() > cache.alloc.num_pages or (slots % S != np.arange(n) % S).any()
              or (pages != first).any() or np.unique(first[::S]).size != first[::S].size):
        raise PrefixCacheMisuse("not-a-page-chain", f"{what}: slot j must sit at offset j % {S} of the request's "
                                f"own page j // {S}, every page a usable one, none twice")
    private = np.unique(pages[match.shared :])
    if private.size and not cache.alloc.is_allocated(private).all():
        bad = int(private[~cache.alloc.is_allocated(private)][0])
        raise PrefixCacheMisuse("private-page-not-allocated", f"{what}: page {bad} of the request is free")
    if private.size and cache.tree.page_cached[private].any():
        bad = int(private[cache.tree.page_cached[private]][0])
        raise PrefixCacheMisuse("private-page-cached", f"{what}: page {bad} past the shared prefix is the cache's")


# -- the tree: structure, derived counts, questions --------------------------------
class RadixTree:
    """The radix tree of cached chains, with per-lane counts kept up to date.

    Holds no allocator: it answers questions (:meth:`walk`,
    :meth:`victim`, :meth:`snapshot`, the counts) and changes only its own
    shape (:meth:`attach`, :meth:`split`, :meth:`detach`, :meth:`pin`).
    Derived state, exact after every call: ``cached_lanes`` [N] (pages of all
    nodes per lane), ``evictable_lanes`` [N] (pages of unreferenced nodes per
    lane; an unreferenced node's whole subtree is unreferenced, so all of them
    can go, leaves first) and ``page_cached`` [num_pages + 1] (whether the tree
    holds a page).
    """

    def __init__(self, page_size: int, cp_size: int, num_pages: int):
        self.S, self.N = page_size, cp_size
        self._serial = 0
        self.now = 0  # LRU clock: advanced by every pin and every new node
        self.root = self._node((), torch.empty(0, dtype=torch.int64), None)
        self.root.ref = 1
        self.leaves: dict[_Node, None] = {}  # insertion-ordered, so iteration is deterministic
        self.cached_lanes = np.zeros(cp_size, dtype=np.int64)
        self.evictable_lanes = np.zeros(cp_size, dtype=np.int64)
        self.page_cached = np.zeros(num_pages + 1, dtype=bool)

    def pages_of(self, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The distinct pages under ``slots`` and their count per lane."""
        pages = np.unique(page_of(slots.numpy(), self.S))
        return pages, np.bincount(owner_of(pages, self.N), minlength=self.N)

    def _node(self, key: tuple, slots: torch.Tensor, parent: _Node | None) -> _Node:
        pages, lanes = self.pages_of(slots)
        self._serial += 1
        return _Node(key, slots, parent, lanes, pages, self._serial, last_access=self.now)

    def lane_of(self, slot) -> int:
        """Owner lane of the page holding ``slot``."""
        return int(owner_of(page_of(int(slot), self.S), self.N))

    def tick(self) -> int:
        """Advance the LRU clock; return the new time."""
        self.now += 1
        return self.now

    # -- questions ------------------------------------------------------------------
    def walk(self, tokens: tuple, limit: int) -> _Walk:
        """How far ``tokens[:limit]`` follows the tree: whole pages, then the
        child (or next page of the same edge) sharing the longest run of the
        next page's tokens. Pure: nothing is split or touched."""
        S = self.S
        node, off, i, path = self.root, 0, 0, []
        while i + S <= limit:
            page = tokens[i : i + S]
            if off < len(node.key):  # inside an edge: its next page
                if node.key[off : off + S] != page:
                    break
                off += S
                path[-1] = (node, off // S)
            else:
                child = node.children.get(page)
                if child is None or len(child.key) < S:
                    break
                node, off = child, S
                path.append((child, 1))
            i += S
        w = _Walk(path, i)
        rest = tokens[i : min(i + S, limit)]
        if rest:
            cands = [(node, off)] if off < len(node.key) else [(c, 0) for c in node.children.values()]
            for c, o in cands:
                n = _common(c.key[o : o + S], rest)
                if n > w.copy:
                    w.src, w.src_off, w.copy = c, o, n
        return w

    def victim(self, short: np.ndarray) -> _Node | None:
        """The unreferenced leaf to evict next for the lanes ``short`` [N] bool:
        the least recently used one that frees a page in a short lane, else the
        least recently used one whose removal exposes an unreferenced ancestor
        that does; ``None`` when nothing evictable helps."""
        best, best_key = None, None
        for leaf in self.leaves:
            if leaf.ref:
                continue
            helps, rank = bool(leaf.lanes[short].any()), 0
            if not helps:
                rank, up = 1, leaf.parent
                while up is not self.root and up.ref == 0 and len(up.children) == 1 and not helps:
                    helps = bool(up.lanes[short].any())
                    up = up.parent
            key = (rank, leaf.last_access, leaf.serial)
            if helps and (best_key is None or key < best_key):
                best, best_key = leaf, key
        return best

    def prefix_tokens(self, node: _Node) -> tuple:
        """Every token from the root through the end of ``node``."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return tuple(t for k in reversed(keys) for t in k)

    def prefix_slots(self, node: _Node) -> torch.Tensor:
        """The slots of every token from the root through the end of ``node`` (a copy)."""
        parts = []
        while node is not self.root:
            parts.append(node.slots)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)

    def nodes(self):
        """Every node but the root (depth first)."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root:
                yield n

    def snapshot(self) -> tuple:
        """The whole tree as nested tuples: per node key, slots, ref, LRU time,
        serial and children in order; then the clock and the derived counts."""

        def one(n: _Node) -> tuple:
            kids = tuple((k, one(c)) for k, c in n.children.items())
            return n.key, tuple(n.slots.tolist()), n.ref, n.last_access, n.serial, kids

        return (one(self.root), self.now, self._serial, tuple(self.cached_lanes.tolist()),
                tuple(self.evictable_lanes.tolist()), self.page_cached.tobytes())

    # -- shape changes (counts kept exact) ---------------------------------------------
    def attach(self, parent: _Node, key: tuple, slots: torch.Tensor) -> _Node:
        """A new unreferenced node under ``parent``, used now."""
        node = self._node(key, slots.clone(), parent)
        node.last_access = self.tick()
        parent.children[key[: self.S]] = node
        self.leaves.pop(parent, None)
        self.leaves[node] = None
        self.cached_lanes += node.lanes
        self.evictable_lanes += node.lanes
        self.page_cached[node.pages] = True
        return node

    def split(self, node: _Node, pages: int) -> _Node:
        """Cut ``node`` after ``pages`` whole pages; ``node`` keeps the lower
        part, the returned new node the upper. Counts are unchanged."""
        n = pages * self.S
        upper = self._node(node.key[:n], node.slots[:n], node.parent)
        upper.ref, upper.last_access = node.ref, node.last_access
        node.parent.children[upper.key[: self.S]] = upper  # same dict key: keeps the children's order
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        node.pages, node.lanes = self.pages_of(node.slots)
        upper.children[node.key[: self.S]] = node
        return upper

    def detach(self, leaf: _Node) -> None:
        """Take an unreferenced leaf out of the tree (its pages are the caller's to free)."""
        assert leaf.ref == 0 and not leaf.children, "only an unreferenced leaf can leave the tree"
        parent = leaf.parent
        del parent.children[leaf.key[: self.S]]
        del self.leaves[leaf]
        if not parent.children and parent is not self.root:
            self.leaves[parent] = None
        self.cached_lanes -= leaf.lanes
        self.evictable_lanes -= leaf.lanes
        self.page_cached[leaf.pages] = False

    def pin(self, node: _Node | None, delta: int) -> None:
        """Add ``delta`` to the reference count of ``node`` and every ancestor
        and mark them used now (``delta=0`` only marks them). Splits copy
        counts, so walking parents is exact."""
        t = self.tick()
        while node is not None and node is not self.root:
            before = node.ref
            node.ref += delta
            assert node.ref >= 0, "reference count below zero"
            if before == 0 and node.ref > 0:
                self.evictable_lanes -= node.lanes
            elif before > 0 and node.ref == 0:
                self.evictable_lanes += node.lanes
            node.last_access = t
            node = node.parent


# -- the cache: calls that change state ----------------------------------------------
class PrefixCache:
    """Radix prefix cache over an :class:`OwnerLaneAllocator`.

    Use: ``hit = lookup(tokens)`` to rank and budget (no side effect);
    ``m = acquire(tokens)`` on admission; allocate the rest with
    :meth:`allocate_extend` / :meth:`allocate_decode` (which evict on a
    refusal); on finish ``insert(tokens, slots, m)``; on abort or preemption
    ``release(m, slots)``. ``on_evict(tokens, slots)``, if given, is called
    for every evicted node before its pages are freed: ``tokens`` are all
    tokens from the root through the node and ``slots`` (a copy) the slots
    holding them, the ancestors' (still cached) and the node's own (a host
    tier backs the chain up from there).
    It must not call the cache; if it raises, that node stays cached and the
    error propagates (nodes evicted before it in the same call stay evicted).
    [[RFC-0001:C-PREFIX-CACHE]]
    """

    def __init__(self, allocator: OwnerLaneAllocator, on_evict: EvictHook | None = None):
        self.alloc = allocator
        self.S, self.N = allocator.page_size, allocator.cp_size
        self.tree = RadixTree(self.S, self.N, allocator.num_pages)
        self.on_evict = on_evict
        self.last_deficit: np.ndarray | None = None
        self.hit_tokens = self.acquired_tokens = self.evicted_nodes = self.evicted_pages = 0
        self.open_matches = 0  # acquired and not yet inserted or released: 0 once an engine drains

    # -- questions (no side effect) ------------------------------------------------------
    def lookup(self, tokens: Sequence[int], max_length: int | None = None) -> PrefixHit:
        """How much of ``tokens`` is cached now (at most ``len(tokens) - 1``, or
        ``max_length``): a :class:`PrefixHit`. Changes nothing at all: no
        reference, LRU time, page or counter. Raises
        :class:`PrefixCacheMisuse` for tokens that are not ints >= 0."""
        tokens = _as_tokens(tokens)
        w = self.tree.walk(tokens, _as_limit(max_length, len(tokens)))
        pinned = np.zeros(self.N, dtype=np.int64)
        for node, m in w.path:
            if node.ref == 0:
                pinned += node.lanes if m * self.S == len(node.key) else self.tree.pages_of(node.slots[: m * self.S])[1]
        last = int(w.path[-1][0].slots[w.path[-1][1] * self.S - 1]) if w.path else -1
        lane = self.tree.lane_of(w.src.slots[w.src_off]) if w.src is not None else -1
        return PrefixHit(w.shared + w.copy, w.shared, w.copy, last, lane, pinned, self)

    def lane_need(self, hit: PrefixHit, end: int) -> np.ndarray:
        """Pages per lane [N] a request with ``hit`` needs to reach ``end``
        tokens once acquired: the copy page (if any) and every later page. The
        lanes of a chain that starts fresh (a copy, or no match) are the ones
        the allocator would pick now. Pure, and O(N) for any ``end``.

        Raises :class:`PrefixCacheMisuse`: ``not-a-hit`` for anything but a
        :class:`PrefixHit`, ``foreign-hit`` for a hit of another cache (its
        lanes and slots mean nothing here), ``bad-end`` unless ``end`` is an
        int >= 0. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]"""
        if not isinstance(hit, PrefixHit):
            raise PrefixCacheMisuse("not-a-hit", f"lane_need takes the PrefixHit of lookup(), got {type(hit).__name__}")
        if hit._owner is not self:
            raise PrefixCacheMisuse("foreign-hit", "lane_need: the hit was not looked up in this cache")
        if isinstance(end, bool) or not isinstance(end, (int, np.integer)) or end < 0:
            raise PrefixCacheMisuse("bad-end", f"end must be an int >= 0, got {end!r}")
        q0, stop = hit.shared // self.S, -(-int(end) // self.S)
        if stop <= q0:
            return np.zeros(self.N, dtype=np.int64)
        if hit.copy:  # a fresh chain from the copy page on: the base that puts page q0 in the chosen lane
            lane = self.alloc.lane_for_new_chain(q0, prefer=hit.copy_lane)
            base = lane_base_from_prefix(lane, q0 * self.S + 1, self.S, self.N)
        elif hit.shared:
            base = lane_base_of_last_loc(hit.last_shared_loc, hit.shared, self.S, self.N)
        else:
            base = self.alloc.lane_for_new_chain(0)
        return layout.chain_lane_pages(base, q0, stop - q0, self.N)

    def evictable_pages(self) -> np.ndarray:
        """Pages per lane [N] in unreferenced nodes (all of them can be evicted,
        leaves first). Kept up to date as the tree changes; O(N)."""
        return self.tree.evictable_lanes.copy()

    def lane_cached_pages(self) -> np.ndarray:
        """Pages per lane [N] the cache owns; O(N)."""
        return self.tree.cached_lanes.copy()

    def cached_pages(self) -> int:
        """Pages the cache owns."""
        return int(self.tree.cached_lanes.sum())

    def hit_rate(self) -> float:
        """Cached tokens matched / tokens acquired."""
        return self.hit_tokens / self.acquired_tokens if self.acquired_tokens else 0.0

    def snapshot(self) -> tuple:
        """A copy of the whole cache state (tree shape, keys, slots, reference
        counts, LRU clocks, counters, ``last_deficit``), for tests and debugging;
        equal snapshots mean equal states."""
        deficit = None if self.last_deficit is None else tuple(self.last_deficit.tolist())
        return (self.tree.snapshot(), self.hit_tokens, self.acquired_tokens, self.evicted_nodes,
                self.evicted_pages, self.open_matches, deficit)

    # -- admission -------------------------------------------------------------------
    def acquire(self, tokens: Sequence[int], max_length: int | None = None) -> PrefixMatch:
        """Admit a request: the longest cached prefix of ``tokens`` (as
        :meth:`lookup` finds it), its path pinned, and a partly matched page
        copied into a private page (evicting if needed; the copy is dropped,
        and the match ends at the shared pages, when no page can be had). The
        returned :class:`PrefixMatch` must be consumed once by :meth:`insert`
        or :meth:`release`. Raises :class:`PrefixCacheMisuse` (nothing changed)
        for bad tokens or ``max_length``."""
        S, tokens = self.S, _as_tokens(tokens)
        w = self.tree.walk(tokens, _as_limit(max_length, len(tokens)))
        held, parts = None, [torch.empty(0, dtype=torch.int64)]
        if w.path:
            parts += [node.slots[: m * S] for node, m in w.path]
            held, m = w.path[-1]
            if m * S < len(held.key):  # the match ends inside an edge: cut it there
                lower, held = held, self.tree.split(held, m)
                if w.src is lower:
                    w.src_off -= m * S
        shared = torch.cat(parts)
        self.tree.pin(held, +1)
        copy_src = copy_dst = shared.new_empty(0)
        if w.src is not None:
            lane = self.alloc.lane_for_new_chain(w.shared // S, prefer=self.tree.lane_of(w.src.slots[w.src_off]))
            self.tree.pin(w.src, +1)  # the source must survive the eviction the copy page may cause
            page = self._with_eviction(lambda: self._take_copy_page(lane, w.copy))
            self.tree.pin(w.src, -1)
            if page is not None:
                copy_src = w.src.slots[w.src_off : w.src_off + w.copy].clone()
                copy_dst = int(page[0]) * S + (copy_src % S)
        length = shared.numel() + copy_dst.numel()
        self.acquired_tokens += len(tokens)
        self.hit_tokens += length
        self.open_matches += 1
        return PrefixMatch(length, torch.cat([shared, copy_dst]), copy_src, copy_dst, shared.numel(),
                           tokens[:length], held, self)

    def _take_copy_page(self, lane: int, fill: int) -> torch.Tensor | None:
        """One page in ``lane`` that will hold ``fill`` copied tokens (``None``:
        the lane is short). The only page the cache itself allocates; its fill
        mark says ``fill`` slots are written, so the continuation from
        ``page * S + fill - 1`` is the page's last written slot."""
        return self.alloc.alloc_pages_with_owners([lane], fill=[fill])

    # -- allocation with eviction -----------------------------------------------------------
    def _with_eviction(self, call: Callable):
        while True:
            out = call()
            if out is not None:
                self.last_deficit = None
                return out
            deficit = self.alloc.last_deficit
            if not self.evict(deficit):
                self.last_deficit = deficit
                return None

    def allocate_extend(self, prefix_lens, seq_lens, last_loc) -> ExtendAllocation | None:
        """``allocator.allocate_extend``, evicting lane-aware on a refusal;
        ``None`` (``last_deficit`` set) when even eviction does not help.
        Raises what the allocator raises, and ``extends-cached-page`` (see
        :meth:`_refuse_cached_growth`), before anything is evicted."""
        self._refuse_cached_growth(prefix_lens, seq_lens, last_loc)
        return self._with_eviction(lambda: self.alloc.allocate_extend(prefix_lens, seq_lens, last_loc))

    def allocate_decode(self, seq_lens, last_loc) -> ExtendAllocation | None:
        """``allocator.allocate_decode``, evicting lane-aware on a refusal;
        ``None`` (``last_deficit`` set) when even eviction does not help.
        Refuses as :meth:`allocate_extend` does."""
        seq = int_vector(seq_lens, "seq_lens")
        self._refuse_cached_growth(seq - 1, seq, last_loc)
        return self._with_eviction(lambda: self.alloc.allocate_decode(seq_lens, last_loc))

    def _refuse_cached_growth(self, prefix_lens, seq_lens, last_loc) -> None:
        """Raise ``UnsupportedPagePlan("extends-cached-page")``, nothing
        changed, if a request would grow its chain inside a partly filled page
        that the cache holds: ``last_loc`` is the last written slot of a cached
        page that is not full (a partial leaf, say) and the request adds tokens
        after it. The allocator alone would accept that (the slot ends its
        page's writes) and hand out the rest of the cache's page, so a second
        request matching that prefix would read another request's KV. A request
        that matched a prefix ending mid-page continues in its private copy
        (``PrefixMatch.last_loc``), never in the page the copy read.
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]

        Only chains the allocator would otherwise take are checked here; a
        malformed batch is left to the allocator's own rules."""
        S = self.S
        prefix, seq = int_vector(prefix_lens, "prefix_lens"), int_vector(seq_lens, "seq_lens")
        last = int_vector(last_loc, "last_loc")
        if not prefix.size == seq.size == last.size:
            return
        grows = (prefix > 0) & (seq > prefix) & (prefix % S != 0)  # the next token lands on last_loc's page
        if not grows.any():
            return
        page = page_of(last, S)
        grows &= (page >= 1) & (page <= self.alloc.num_pages)
        page = np.where(grows, page, 0)
        grows &= self.tree.page_cached[page] & rules.continues_chain(last, prefix, self.alloc.page_fill(page), S)
        if grows.any():
            r = int(grows.nonzero()[0][0])
            raise UnsupportedPagePlan(
                "extends-cached-page",
                f"last_loc {last[r]} ends the written part of page {page[r]}, a partly filled page the prefix cache "
                "holds; a request that matched it continues in its own copy (the match's last_loc)", r)

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, deficit) -> bool:
        """Evict least recently used unreferenced leaves that free pages in lanes
        with a deficit (``deficit`` [N] ints >= 0, pages per lane), until it is
        covered (see :meth:`RadixTree.victim`). Returns whether anything was
        evicted. Raises :class:`PrefixCacheMisuse` for a malformed deficit."""
        need = _int_vector(deficit, "deficit", "bad-deficit").copy()
        if need.size != self.N or (need.size and need.min() < 0):
            raise PrefixCacheMisuse("bad-deficit", f"deficit must be {self.N} ints >= 0, got {need.tolist()}")
        evicted = False
        while need.any():
            leaf = self.tree.victim(need > 0)
            if leaf is None:
                break
            need = np.maximum(need - leaf.lanes, 0)
            self._evict(leaf)
            evicted = True
        return evicted

    def _evict(self, leaf: _Node) -> None:
        if self.on_evict is not None:
            self.on_evict(self.tree.prefix_tokens(leaf), self.tree.prefix_slots(leaf))
        self.evicted_nodes += 1
        self.evicted_pages += int(leaf.pages.size)
        self._drop(leaf)

    def _drop(self, leaf: _Node) -> None:
        self.tree.detach(leaf)
        self.alloc.free(leaf.slots)

    def clear(self) -> None:
        """Evict every unreferenced node, least recently used leaves first."""
        while True:
            leaves = sorted((x for x in self.tree.leaves if x.ref == 0), key=lambda x: (x.last_access, x.serial))
            if not leaves:
                return
            for leaf in leaves:
                self._evict(leaf)

    # -- the end of a request --------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], slots, match: PrefixMatch) -> None:
        """A request finished (or is preempted and keeps its KV): cache it and
        end ``match``.

        ``slots[j]`` (int64 [len(tokens)]) holds token ``tokens[j]``; the first
        ``match.length`` are the match's. Every later page becomes a node or,
        when the tree already holds the same tokens, goes back to the free
        lists. Raises :class:`PrefixCacheMisuse`, nothing changed, for: a match
        already ended or of another cache, bad tokens, tokens or slots that do
        not extend the match, lengths that differ, slots that are not a page
        chain, private pages that are free or cached.
        """
        S, tokens = self.S, _as_tokens(tokens)
        arr = _int_vector(slots, "slots", "bad-slots")
        if len(tokens) != arr.size:
            raise PrefixCacheMisuse("length-mismatch", f"insert: {len(tokens)} tokens but {arr.size} slots")
        _check_end(self, match, arr, "insert")
        if tokens[: match.length] != match.tokens:
            raise PrefixCacheMisuse("tokens-do-not-extend-match", "insert: the tokens do not start with the matched")
        # -- nothing refuses past this line
        match._ended = "inserted"
        self.open_matches -= 1
        slots, n = torch.from_numpy(arr.copy()), len(tokens)
        self.tree.pin(match.node, -1)
        w = self.tree.walk(tokens, n)
        node, i, spare = self.tree.root, w.shared, []
        assert i >= match.shared, "a held path left the tree"
        if w.path:
            node, m = w.path[-1]
            if m * S < len(node.key):
                node = self.tree.split(node, m)
            self.tree.pin(node, 0)  # used now
            spare.append(slots[match.shared : i])  # the tree has these tokens already
        if n - i >= S:
            end = i + (n - i) // S * S
            node = self._attach(node, tokens[i:end], slots[i:end])
            i = end
        if i < n:  # the trailing partial page: a partial leaf, unless a child already serves it
            rest = tokens[i:]
            serving = next((c for k, c in node.children.items() if k[: len(rest)] == rest), None)
            if serving is not None:
                spare.append(slots[i:])
                self.tree.pin(serving, 0)
            else:
                self._attach(node, rest, slots[i:])
        spare = [s for s in spare if s.numel()]
        if spare:
            self.alloc.free(torch.cat(spare))

    def _attach(self, parent: _Node, key: tuple, slots: torch.Tensor) -> _Node:
        """Attach a node, then free the unreferenced partial leaves under
        ``parent`` that it dominates (whose tokens start it): it serves every
        match they could, so their pages are dead weight."""
        new = self.tree.attach(parent, key, slots)
        for k, leaf in list(parent.children.items()):
            if len(k) < min(self.S, len(key)) and key[: len(k)] == k and leaf.ref == 0 and not leaf.children:
                self._drop(leaf)
        return new

    def release(self, match: PrefixMatch, slots=None) -> None:
        """A request ended without caching (abort, preemption): free its
        private pages (``slots`` past ``match.shared``; default the match's own
        slots) and end ``match``. Raises :class:`PrefixCacheMisuse`, nothing
        changed, for a match already ended or of another cache, or slots that
        do not extend the match or are not its own pages."""
        if slots is None:
            slots = match.slots if isinstance(match, PrefixMatch) else []
        arr = _int_vector(slots, "slots", "bad-slots")
        _check_end(self, match, arr, "release")
        match._ended = "released"
        self.open_matches -= 1
        self.tree.pin(match.node, -1)
        private = arr[match.shared :]
        if private.size:
            self.alloc.free(private)
