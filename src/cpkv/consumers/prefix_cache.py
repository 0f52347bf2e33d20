"""The prefix (radix) cache over the owner-lane allocator, with lane-aware eviction
(workstream W5 of RFC-0001).

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
  never write the same slot. After shared pages the copy takes the lane that
  continues their chain; a copy of page 0 starts a chain, so its lane is
  free: the allocator's rule for a fresh request picks it (the lane with the
  most free pages; on a tie, the source page's own lane). The destination's
  owner reads the source through the shared view and writes its own
  segment; nothing else moves;
* every cached chain keeps one lane base: page position q in lane
  ``(b + q) % N`` from the root down. An insert whose tail would hang under
  a chain of another base (two requests admitted before either was cached)
  stops there and frees the tail (:meth:`RadixTree.graft_length`);
* a namespace key (SGLang's ``extra_key``, vLLM's cache salt: a LoRA id, a
  tenant salt; ``None``, str, int or bytes, see
  :func:`~cpkv.consumers.kv_events.key_bytes`) partitions the cache: two
  requests with equal tokens and different keys never share a page;
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

A scheduler asks the cache one admission question,
:meth:`PrefixCache.can_allocate` (what a request would need per lane, given
its match and the host tier: an :class:`Admission`), and takes it with one
verb, :meth:`PrefixCache.allocate` (nano-vllm's ``can_allocate`` /
``allocate``); it never reaches the allocator behind the cache.

Four rooms: :mod:`~cpkv.consumers.radix_tree` (the tree, its derived
per-lane counts, and every question about it; it never calls the allocator),
:mod:`~cpkv.consumers.prefix_rules` (the misuse rules, read only),
:mod:`~cpkv.consumers.prefix_questions` (:class:`PrefixCacheQuestions`:
answers, no side effect) and this module's :class:`PrefixCache` (the calls that change state: pinning, allocation,
insertion, eviction). Tree, pages and slots live on the host, as the
allocator's control state does.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..contract.allocator import Allocation
from ..contract.inputs import int_vector
from .prefix_match import Admission, PrefixHit, PrefixMatch
from .prefix_questions import EvictHook, PrefixCacheQuestions
from .prefix_live import LivePages
from .prefix_rules import PrefixCacheMisuse, _as_key, _as_limit, _as_tokens, _int_vector, check_end, refuse_cached_growth
from .radix_tree import RadixTree, _Node, page_key

__all__ = ["Admission", "EvictHook", "PrefixCache", "PrefixCacheMisuse", "PrefixCacheQuestions", "PrefixHit", "PrefixMatch",
           "RadixTree"]


_NO_COPY = np.empty(0, dtype=np.int64)  # the copy of a match that copies nothing (shared: never written)
_NO_TOKENS = np.empty(0, dtype=np.int64)


class PrefixCache(LivePages, PrefixCacheQuestions):
    """Radix prefix cache over an :class:`~cpkv.contract.allocator.OwnerLaneAllocator`.

    Use: ``hit = lookup(tokens)`` to rank, ``a = can_allocate(tokens, end,
    host)`` to budget (no side effect, see :class:`PrefixCacheQuestions`);
    ``m = allocate(a)`` (or ``acquire(tokens)``) on admission; allocate the rest with
    :meth:`allocate_extend` / :meth:`allocate_decode` (which evict on a
    refusal); on finish ``insert(tokens, slots, m)``; on abort or preemption
    ``release(m, slots)``. ``on_evict(tokens, slots, key)``, if given, is called
    for every evicted node before its pages are freed: ``tokens`` (int64) are all
    tokens from the root through the node, ``slots`` (a copy) the slots
    holding them, the ancestors' (still cached) and the node's own (a host
    tier backs the chain up from there), and ``key`` the chain's namespace
    (bytes, ``b""`` for the default).
    It must not call the cache; if it raises, that node stays cached and the
    error propagates (nodes evicted before it in the same call stay evicted).
    [[RFC-0001:C-PREFIX-CACHE]]
    """

    # __init__: see PrefixCacheQuestions

    # -- admission -------------------------------------------------------------------
    def allocate(self, admission: Admission) -> PrefixMatch:
        """Take what :meth:`can_allocate` answered: acquire the request's match
        (whole pages only when the host tier holds more, as the answer says).
        Raises :class:`PrefixCacheMisuse` for anything but an
        :class:`Admission`. [[RFC-0001:C-PREFIX-CACHE]]"""
        if not isinstance(admission, Admission):
            raise PrefixCacheMisuse("not-an-admission",
                                    f"allocate takes the Admission of can_allocate(), got {type(admission).__name__}")
        a = admission
        return self.acquire(a.tokens, max_length=a.hit.shared if a.host_len else None, key=a.hit.ns)

    def acquire(self, tokens: Sequence[int], max_length: int | None = None, key=None) -> PrefixMatch:
        """Admit a request: the longest cached prefix of ``tokens`` in
        namespace ``key`` (as :meth:`lookup` finds it), its path pinned, and a
        partly matched page copied into a private page (evicting if needed;
        the copy is dropped, and the match ends at the shared pages, when no
        page can be had; after shared pages the copy takes the lane that
        continues their chain). The returned :class:`PrefixMatch` must be
        consumed once by :meth:`insert` or :meth:`release`. Raises
        :class:`PrefixCacheMisuse` (nothing changed) for bad tokens, key or
        ``max_length``."""
        S, tokens, ns = self.S, _as_tokens(tokens), _as_key(key)
        w = self.tree.walk(tokens, _as_limit(max_length, len(tokens)), ns)
        held = None
        if w.path:
            held, m = w.path[-1]
            if m * S < len(held.key):  # the match ends inside an edge: cut it there
                lower, held = held, self.tree.split(held, m)
                if w.src is lower:
                    w.src_off -= m * S
        self.tree.pin(held, +1)
        copy_src = copy_dst = _NO_COPY
        if w.src is not None:
            lane = self.tree.chain_lane(held, w.shared) if held is not None else \
                self.alloc.lane_for_new_chain(0, prefer=self.tree.lane_of(w.src.slots[w.src_off]))
            self.tree.pin(w.src, +1)  # the source must survive the eviction the copy page may cause
            page = self._with_eviction(lambda: self._take_copy_page(lane, w.copy))
            self.tree.pin(w.src, -1)
            if page is not None:
                copy_src = w.src.slots[w.src_off : w.src_off + w.copy].copy()
                copy_dst = int(page[0]) * S + (copy_src % S)
        length = w.shared + copy_dst.size
        self.acquired_tokens += len(tokens)
        self.hit_tokens += length
        self.open_matches += 1
        return PrefixMatch(length, copy_src, copy_dst, w.shared, held, self, ns=ns, _base=held,
                           _copy_tokens=tokens[w.shared : length].copy() if length > w.shared else _NO_TOKENS)

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

    def allocate_extend(self, prefix_lens, seq_lens, last_loc) -> Allocation | None:
        """``allocator.allocate_extend``, evicting lane-aware on a refusal;
        ``None`` (``last_deficit`` set) when even eviction does not help.
        Raises what the allocator raises, and ``extends-cached-page`` (see
        :func:`~cpkv.consumers.prefix_rules.refuse_cached_growth`), before anything is evicted."""
        refuse_cached_growth(self, prefix_lens, seq_lens, last_loc)
        return self._with_eviction(lambda: self.alloc.allocate_extend(prefix_lens, seq_lens, last_loc))

    def allocate_decode(self, seq_lens, last_loc) -> Allocation | None:
        """``allocator.allocate_decode``, evicting lane-aware on a refusal;
        ``None`` (``last_deficit`` set) when even eviction does not help.
        Refuses as :meth:`allocate_extend` does."""
        seq = int_vector(seq_lens, "seq_lens")
        refuse_cached_growth(self, seq - 1, seq, last_loc)
        return self._with_eviction(lambda: self.alloc.allocate_decode(seq_lens, last_loc))

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

    def _evict(self, leaf: _Node, notify: bool = True) -> None:
        if notify and self.on_evict is not None:
            self.on_evict(self.tree.prefix_tokens(leaf), self.tree.prefix_slots(leaf), leaf.ns)
        self.evicted_nodes += 1
        self.evicted_pages += int(leaf.pages.size)
        self._drop(leaf)

    def _drop(self, leaf: _Node) -> None:
        self.tree.detach(leaf)
        self.alloc.free(leaf.slots)

    def clear(self, notify: bool = True) -> None:
        """Evict every unreferenced node, least recently used leaves first;
        ``notify=False`` drops them without calling ``on_evict`` (nothing is
        backed up: the end of a run)."""
        while True:
            leaves = sorted((x for x in self.tree.leaves if x.ref == 0), key=lambda x: (x.last_access, x.serial))
            if not leaves:
                return
            for leaf in leaves:
                self._evict(leaf, notify)

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
        tokens = _as_tokens(tokens)
        arr = _int_vector(slots, "slots", "bad-slots")
        if len(tokens) != arr.size:
            raise PrefixCacheMisuse("length-mismatch", f"insert: {len(tokens)} tokens but {arr.size} slots")
        check_end(self, match, arr, "insert")
        if not np.array_equal(tokens[: match.length], match.tokens):
            raise PrefixCacheMisuse("tokens-do-not-extend-match", "insert: the tokens do not start with the matched")
        # -- nothing refuses past this line
        self._free_spare(self._end_insert(match, tokens, arr.copy(), 0, match.shared))

    def _free_spare(self, spare: list) -> None:
        """Free the slots :meth:`_end_insert` did not cache (int64 arrays, some empty), in one call."""
        spare = [s for s in spare if s.size]
        if spare:
            self.alloc.free(np.concatenate(spare))

    def _end_match(self, match: PrefixMatch, how: str = "inserted") -> None:
        """``match`` ends (``how``: inserted or released): its path is unpinned (and used now)."""
        self._end_matches([match], how)

    def _end_matches(self, matches: list, how: str = "inserted", ticks=None) -> None:
        """:meth:`_end_match` for each of ``matches``, in order (one batched
        unpin; ``ticks``: see :meth:`RadixTree.unpin_many`)."""
        for m in matches:
            m._ended = how
        self.open_matches -= len(matches)
        self.tree.unpin_many([m.node for m in matches], ticks)

    def _end_insert(self, match: PrefixMatch, tokens: np.ndarray, slots: np.ndarray, offset: int,
                    own: int) -> list:
        """End ``match`` by caching ``tokens``/``slots``: positions ``offset ..``
        of the request (0: the whole sequence, walked from the root; else
        from ``match.node``); ``slots[own:]`` are the request's own pages.
        Returns the slots not cached (for :meth:`_free_spare`, which a batch calls once)."""
        S, n = self.S, len(tokens)
        self._end_match(match)
        start = match.node if offset else None
        w = self.tree.walk(tokens, n, match.ns, start)
        node, i, spare = start or self.tree.root_of(match.ns, create=n > w.shared), w.shared, []
        assert offset + i >= match.shared, "a held path left the tree"
        if w.path:
            node, m = w.path[-1]
            if m * S < len(node.key):
                node = self.tree.split(node, m)
            self.tree.pin(node, 0)  # used now
            spare.append(slots[own:i])  # the tree has these tokens already
        if i < n:  # a tail of another lane base stops here
            keep = i + self.tree.graft_length(node, offset + i, slots[i:])
            spare.append(slots[keep:])
            slots, n = slots[:keep], keep
        if n - i >= S:
            end = i + (n - i) // S * S
            node = self._attach(node, tokens[i:end], slots[i:end])
            i = end
        if i < n:  # the trailing partial page: a partial leaf, unless a child already serves it
            rest = tokens[i:n]
            serving = next((c for k, c in node.children.items() if k.startswith(rest.tobytes())), None)
            if serving is not None:
                spare.append(slots[i:])
                self.tree.pin(serving, 0)
            else:
                self._attach(node, rest, slots[i:])
        return spare

    def _attach(self, parent: _Node, key: np.ndarray, slots: np.ndarray) -> _Node:
        """Attach a node, then free the unreferenced partial leaves under
        ``parent`` that it dominates (whose tokens start it): it serves every
        match they could, so their pages are dead weight."""
        new = self.tree.attach(parent, key, slots)
        if not parent.partials:  # no partial leaf to dominate: O(1)
            return new
        first, width = page_key(new.key, self.S), min(self.S, len(key)) * new.key.itemsize
        for k, leaf in list(parent.children.items()):
            if len(k) < width and first.startswith(k) and leaf.ref == 0 and not leaf.children:
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
        check_end(self, match, arr, "release")
        self._end_match(match, "released")
        private = arr[match.shared :]
        if private.size:
            self.alloc.free(private)
