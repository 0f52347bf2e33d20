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

Memory runs out per lane, so eviction knows lanes: when an allocation is
refused, the least recently used unreferenced leaves that free pages in the
short lanes go first, until the request fits or nothing evictable helps (the
per-lane deficit is then kept in ``last_deficit``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..contract.allocator import ExtendAllocation, OwnerLaneAllocator
from ..contract.layout import owner_of, page_of


_serial = itertools.count()


@dataclass(eq=False)
class _Node:
    key: tuple  # tokens of this edge: whole pages, or fewer than a page (partial leaf)
    slots: torch.Tensor
    parent: "_Node | None"
    children: dict = field(default_factory=dict)  # first page (or partial key) -> node
    ref: int = 0  # requests whose prefix runs through this node
    last_access: int = 0
    serial: int = field(default_factory=lambda: next(_serial))  # tie-break: older first
    lanes: np.ndarray | None = None  # pages of this node per lane

    def lane_counts(self, S: int, N: int) -> np.ndarray:
        if self.lanes is None:
            pages = np.unique(page_of(self.slots.numpy(), S))
            self.lanes = np.bincount(owner_of(pages, N), minlength=N)
        return self.lanes


@dataclass
class PrefixMatch:
    """A request's cached prefix.

    ``length`` tokens are cached; ``slots`` hold them (shared full pages, then
    the private copy of a partially matched page); ``last_loc`` is the last of
    them (-1 for none) and fixes the request's lane base. ``copy_src`` ->
    ``copy_dst`` are the KV copies the engine must make before the request's
    first forward (the owner of ``copy_dst`` reads ``copy_src`` through the
    shared view). ``shared`` is how
    many leading slots belong to the cache; the rest belong to the request.
    """

    length: int
    slots: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    shared: int
    node: "_Node | None" = field(default=None, repr=False)  # deepest shared node, held

    @property
    def last_loc(self) -> int:
        """Slot of the last cached token, -1 when nothing matched."""
        return int(self.slots[-1]) if self.length else -1


class PrefixCache:
    """Radix prefix cache over an :class:`OwnerLaneAllocator`.

    Use: ``m = match(tokens)``; allocate the rest with
    :meth:`allocate_extend` / :meth:`allocate_decode` (which evict on a
    refusal); on finish ``insert(tokens, slots, m)``; on abort
    ``release(m, slots)``.
    """

    def __init__(self, allocator: OwnerLaneAllocator):
        self.alloc = allocator
        self.S = allocator.page_size
        self.root = _Node((), torch.empty(0, dtype=torch.int64), None, ref=1)
        self._clock = itertools.count(1)
        self._leaves: set[_Node] = set()
        self.last_deficit: np.ndarray | None = None
        self.hit_tokens = self.lookup_tokens = self.evicted_nodes = self.evicted_pages = 0

    # -- tree helpers -------------------------------------------------------------
    def _attach(self, parent: _Node, node: _Node) -> None:
        parent.children[node.key[: self.S]] = node
        self._leaves.discard(parent)
        self._leaves.add(node)

    def _split(self, node: _Node, pages: int) -> _Node:
        """Cut ``node`` after ``pages`` whole pages; return the new upper part."""
        n = pages * self.S
        upper = _Node(node.key[:n], node.slots[:n], node.parent, ref=node.ref, last_access=node.last_access)
        node.parent.children[upper.key[: self.S]] = upper
        node.key, node.slots, node.parent, node.lanes = node.key[n:], node.slots[n:], upper, None
        upper.children[node.key[: self.S]] = node
        return upper

    def _follow(self, child: _Node, tokens: tuple, i: int, limit: int) -> tuple[_Node, int]:
        """How many whole pages of ``child`` (whose first page matched at ``i``)
        ``tokens[:limit]`` follows; splits ``child`` there. Returns the node
        covering exactly those pages and their count."""
        S, m, n_pages = self.S, 1, len(child.key) // self.S
        while m < n_pages and i + (m + 1) * S <= limit and child.key[m * S : (m + 1) * S] == tokens[i + m * S : i + (m + 1) * S]:
            m += 1
        return (self._split(child, m) if m < n_pages else child), m

    def _touch(self, node: _Node | None, delta: int) -> None:
        """Add ``delta`` to the reference count of ``node`` and every ancestor,
        and mark them used now (splits keep counts, so walking parents is exact)."""
        t = next(self._clock)
        while node is not None and node is not self.root:
            node.ref += delta
            node.last_access = t
            node = node.parent

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root:
                yield n

    def _npages(self, node: _Node) -> int:
        return int(node.lane_counts(self.S, self.alloc.cp_size).sum())

    def cached_pages(self) -> int:
        """Pages the cache owns."""
        return sum(self._npages(n) for n in self._nodes())

    def evictable_pages(self) -> np.ndarray:
        """Pages per lane in unreferenced nodes (all of them can be evicted, leaves first)."""
        N = self.alloc.cp_size
        out = np.zeros(N, dtype=np.int64)
        for n in self._nodes():
            if n.ref == 0:
                out += n.lane_counts(self.S, N)
        return out

    # -- match --------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_length: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``len(tokens) - 1`` so the
        request computes at least one token, or ``max_length``). Whole pages are
        shared; a partly matched page is copied into a private page of the same
        lane (dropped if no page can be had even after eviction)."""
        S, tokens = self.S, tuple(tokens)
        limit = len(tokens) - 1 if max_length is None else min(max_length, len(tokens))
        node, i, path = self.root, 0, []
        while i + S <= limit:
            child = node.children.get(tokens[i : i + S])
            if child is None or len(child.key) < S:
                break
            child, m = self._follow(child, tokens, i, limit)
            path.append(child)
            node, i = child, i + m * S
        # a partly matched page: the child sharing the longest run of tokens
        rest = tokens[i : min(i + S, limit)]
        src, k = None, 0
        for child in node.children.values():
            n = next((j for j, (a, b) in enumerate(zip(child.key, rest)) if a != b), min(len(child.key), len(rest)))
            if n > k:
                src, k = child, n
        held = path[-1] if path else None
        self._touch(held, +1)
        shared = node.slots.new_empty(0) if not path else torch.cat([p.slots for p in path])
        copy_src = copy_dst = shared.new_empty(0)
        if src is not None:
            natural = int(owner_of(page_of(int(src.slots[0]), S), self.alloc.cp_size))
            lane = self.alloc.lane_for_new_chain(i // S, prefer=natural)
            self._touch(src, +1)  # the source must survive the eviction the copy page may cause
            page = self._with_eviction(lambda: self.alloc.alloc_pages_with_owners([lane]))
            self._touch(src, -1)
            if page is not None:
                copy_src = src.slots[:k]
                copy_dst = int(page[0]) * S + (copy_src % S)
            else:
                k = 0
        self.lookup_tokens += len(tokens)
        self.hit_tokens += i + k
        return PrefixMatch(i + k, torch.cat([shared, copy_dst]), copy_src, copy_dst, shared.numel(), held)

    # -- allocation with eviction ---------------------------------------------------
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
        """``allocator.allocate_extend``, evicting lane-aware on a refusal."""
        return self._with_eviction(lambda: self.alloc.allocate_extend(prefix_lens, seq_lens, last_loc))

    def allocate_decode(self, seq_lens, last_loc) -> ExtendAllocation | None:
        """``allocator.allocate_decode``, evicting lane-aware on a refusal."""
        return self._with_eviction(lambda: self.alloc.allocate_decode(seq_lens, last_loc))

    # -- eviction -----------------------------------------------------------------
    def evict(self, deficit: np.ndarray) -> bool:
        """Evict least recently used unreferenced leaves that free pages in lanes
        with a deficit, until the deficit is covered. Returns whether anything
        was evicted. A leaf that frees no short lane is evicted only when doing
        so exposes an unreferenced ancestor that does."""
        N, S = self.alloc.cp_size, self.S
        need = np.asarray(deficit).copy()
        evicted = False
        while need.any():
            short = need > 0
            best, best_key = None, None
            for leaf in self._leaves:
                if leaf.ref:
                    continue
                helps = bool(leaf.lane_counts(S, N)[short].any())
                rank = 0
                if not helps:  # would removing this leaf expose a helpful ancestor?
                    rank, up = 1, leaf.parent
                    while up is not self.root and up.ref == 0 and len(up.children) == 1 and not helps:
                        helps = bool(up.lane_counts(S, N)[short].any())
                        up = up.parent
                if helps and (best_key is None or (rank, leaf.last_access, leaf.serial) < best_key):
                    best, best_key = leaf, (rank, leaf.last_access, leaf.serial)
            if best is None:
                break
            need = np.maximum(need - best.lane_counts(S, N), 0)
            self._remove(best)
            evicted = True
        return evicted

    def _remove(self, leaf: _Node, evicted: bool = True) -> None:
        self.alloc.free(leaf.slots)
        if evicted:
            self.evicted_nodes += 1
            self.evicted_pages += self._npages(leaf)
        parent = leaf.parent
        del parent.children[leaf.key[: self.S]]
        self._leaves.discard(leaf)
        if not parent.children and parent is not self.root:
            self._leaves.add(parent)

    # -- finish ---------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], slots: torch.Tensor, match: PrefixMatch) -> None:
        """A request finished: cache its KV and drop its hold on the prefix.

        ``slots[j]`` holds token ``tokens[j]``. The first ``match.shared``
        slots are the cache's own; every later page either becomes a node or,
        when the tree already holds the same tokens, goes back to the free lists.
        """
        S, tokens = self.S, tuple(tokens)
        if len(tokens) != slots.numel():
            raise ValueError(f"{len(tokens)} tokens but {slots.numel()} slots")
        self._touch(match.node, -1)
        node, i, n, spare = self.root, 0, len(tokens), []
        while i < n:
            child = node.children.get(tokens[i : i + S])
            if n - i >= S and child is not None and len(child.key) >= S:
                child, m = self._follow(child, tokens, i, n)
                mine = slots[i : i + m * S]
                if i + m * S > match.shared:
                    spare.append(mine[max(0, match.shared - i) :])  # the tree has these tokens already
                child.last_access = next(self._clock)
                self._drop_dominated(node, child)
                node, i = child, i + m * S
            elif n - i >= S:
                end = i + (n - i) // S * S
                new = _Node(tokens[i:end], slots[i:end].clone(), node, last_access=next(self._clock))
                self._attach(node, new)
                self._drop_dominated(node, new)
                node, i = new, end
            else:  # the trailing partial page becomes a partial leaf
                if child is not None and child.key == tokens[i:]:
                    spare.append(slots[i:])
                    child.last_access = next(self._clock)
                else:
                    self._attach(node, _Node(tokens[i:], slots[i:].clone(), node, last_access=next(self._clock)))
                i = n
        spare = [s for s in spare if s.numel()]
        if spare:
            self.alloc.free(torch.cat(spare))

    def _drop_dominated(self, parent: _Node, full: _Node) -> None:
        """Free unreferenced partial leaves under ``parent`` whose tokens start
        ``full``'s first page: ``full`` serves every match they could, so their
        page (the one a continuation copied from) is dead weight."""
        page = full.key[: self.S]
        for key, leaf in list(parent.children.items()):
            if len(key) < self.S and leaf.ref == 0 and not leaf.children and page[: len(key)] == key:
                self._remove(leaf, evicted=False)

    def release(self, match: PrefixMatch, slots: torch.Tensor) -> None:
        """A request ended without caching: free its private pages, drop its hold."""
        self._touch(match.node, -1)
        private = slots[match.shared :]
        if private.numel():
            self.alloc.free(private)

    def clear(self) -> None:
        """Evict every unreferenced node."""
        changed = True
        while changed:
            changed = False
            for leaf in [x for x in self._leaves if x.ref == 0]:
                self._remove(leaf)
                changed = True

    def hit_rate(self) -> float:
        """Cached tokens matched / tokens looked up."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
