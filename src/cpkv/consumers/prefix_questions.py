"""The questions a prefix cache answers, with no side effect: what is cached
(:meth:`PrefixCacheQuestions.lookup`), what a request would need per lane
(:meth:`~PrefixCacheQuestions.lane_need`, :meth:`~PrefixCacheQuestions.chain_need`,
:meth:`~PrefixCacheQuestions.can_allocate`) and the counts behind eviction.
:class:`~cpkv.consumers.prefix_cache.PrefixCache` adds the calls that change
state; the invariants are stated there ([[RFC-0001:C-PREFIX-CACHE]]).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..contract import layout
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import lane_base_of_last_loc
from .prefix_match import Admission, PrefixHit
from .prefix_rules import PrefixCacheMisuse, _as_key, _as_limit, _as_tokens
from .radix_tree import RadixTree

__all__ = ["EvictHook", "PrefixCacheQuestions"]

EvictHook = Callable[[np.ndarray, torch.Tensor, bytes], None]


class PrefixCacheQuestions:
    """The questions of a :class:`PrefixCache`: every method here is pure (no
    reference, LRU time, page or counter changes). ``alloc`` is the
    :class:`OwnerLaneAllocator` the cache runs over; a caller asks the cache,
    never the allocator behind it. [[RFC-0001:C-PREFIX-CACHE]]
    """

    def __init__(self, allocator: OwnerLaneAllocator, on_evict: EvictHook | None = None):
        self.alloc = allocator
        self.S, self.N = allocator.page_size, allocator.cp_size
        self.tree = RadixTree(self.S, self.N, allocator.num_pages)
        self.on_evict = on_evict
        self.last_deficit: np.ndarray | None = None
        self.hit_tokens = self.acquired_tokens = self.evicted_nodes = self.evicted_pages = 0
        self.open_matches = 0  # acquired and not yet inserted or released: 0 once an engine drains


    @property
    def events(self):
        """The optional :class:`~cpkv.consumers.kv_events.KVEventSink` told of
        every full page that enters or leaves this cache (``None``: no events,
        no cost); its medium is :attr:`medium`. [[RFC-0001:C-KV-EVENTS]]"""
        return self.tree.events

    @events.setter
    def events(self, sink) -> None:
        self.tree.events = sink

    @property
    def medium(self) -> str:
        """The events' medium of this cache: ``"GPU"`` (device) or ``"CPU"`` (a host tier's index)."""
        return self.tree.medium

    @medium.setter
    def medium(self, medium: str) -> None:
        self.tree.medium = medium

    def lookup(self, tokens: Sequence[int], max_length: int | None = None, key=None) -> PrefixHit:
        """How much of ``tokens`` is cached now in namespace ``key`` (at most
        ``len(tokens) - 1``, or ``max_length``): a :class:`PrefixHit`. Changes
        nothing at all: no reference, LRU time, page or counter. Raises
        :class:`PrefixCacheMisuse` for tokens that are not ints >= 0
        (``bad-tokens``) or a key that is not None, str, int or bytes (``bad-key``)."""
        tokens, ns = _as_tokens(tokens), _as_key(key)
        w = self.tree.walk(tokens, _as_limit(max_length, len(tokens)), ns)
        pinned = np.zeros(self.N, dtype=np.int64)
        for node, m in w.path:
            if node.ref == 0:
                pinned += node.lanes if m * self.S == len(node.key) else self.tree.pages_of(node.slots[: m * self.S])[1]
        last = int(w.path[-1][0].slots[w.path[-1][1] * self.S - 1]) if w.path else -1
        lane = self.tree.lane_of(w.src.slots[w.src_off]) if w.src is not None else -1
        return PrefixHit(w.shared + w.copy, w.shared, w.copy, last, lane, pinned, self, ns)

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
        if hit.shared:  # the copy page (if any) and the rest continue the shared chain's lanes
            base = lane_base_of_last_loc(hit.last_shared_loc, hit.shared, self.S, self.N)
        else:  # a fresh chain (from a copy of page 0, or nothing)
            base = self.alloc.lane_for_new_chain(0, prefer=hit.copy_lane if hit.copy else None, pages=stop)
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

    def snapshot(self) -> tuple:
        """A copy of the whole cache state (tree shape, keys, slots, reference
        counts, LRU clocks, counters, ``last_deficit``), for tests and debugging;
        equal snapshots mean equal states."""
        deficit = None if self.last_deficit is None else tuple(self.last_deficit.tolist())
        return (self.tree.snapshot(), self.hit_tokens, self.acquired_tokens, self.evicted_nodes,
                self.evicted_pages, self.open_matches, deficit)

    def chain_need(self, last_loc: int, length: int, end: int) -> np.ndarray:
        """Pages per lane [N] a running request still needs to grow from
        ``length`` to ``end`` tokens: its lanes fixed by ``last_loc`` (the slot
        of token ``length - 1``) when it has a prefix
        ([[RFC-0001:C-REQUEST-RELATIVE]]); without one, from the lane the
        allocator would pick now. Pure, O(N)."""
        S, N = self.S, self.N
        first, stop = -(-length // S), -(-end // S)
        if stop <= first:
            return np.zeros(N, dtype=np.int64)
        base = lane_base_of_last_loc(last_loc, length, S, N) if length else self.alloc.lane_for_new_chain(0, pages=stop)
        return layout.chain_lane_pages(base, first, stop - first, N)

    def can_allocate(self, tokens: Sequence[int], end: int, host=None, key=None) -> Admission:
        """The admission question: what a request of ``tokens`` in namespace
        ``key`` that will hold ``end`` tokens of KV would take (an
        :class:`Admission`), given its match here and, with ``host`` (a
        :class:`~cpkv.consumers.hicache.HostTier`), what the host tier holds:
        when the host holds more, the request shares the device's whole pages
        only and loads the rest. Pure. Raises :class:`PrefixCacheMisuse` for
        bad tokens, key or ``end``."""
        tokens = _as_tokens(tokens)
        hit = self.lookup(tokens, key=key)
        host_len = host.lookup(tokens, hit) if host is not None else 0
        if host_len:  # the host tier holds more: the device's whole pages only
            hit = self.lookup(tokens, max_length=hit.shared, key=key)
        spare = np.asarray(self.alloc.lane_free_pages()) + self.tree.evictable_lanes - hit.newly_pinned
        return Admission(tokens, end, hit, host_len, self.lane_need(hit, end), spare)

    # -- the allocator's sizes and state, as the cache's callers need them ---------------
    @property
    def layout(self):
        """The :class:`~cpkv.contract.layout.SharedKVLayout` of the cache's pages."""
        return self.alloc.layout

    @property
    def num_pages(self) -> int:
        """Usable logical pages (1 .. num_pages)."""
        return self.alloc.num_pages

    @property
    def lane_pages(self) -> np.ndarray:
        """Usable pages per lane [N] (free or not)."""
        return self.alloc.lane_pages

    def lane_free_pages(self) -> list[int]:
        """Free pages per lane [N] (cached pages are not free)."""
        return self.alloc.lane_free_pages()

    def is_allocated(self, pages) -> np.ndarray:
        """Whether each page [n] is handed out (to the cache or a request)."""
        return self.alloc.is_allocated(pages)
