"""The prefix (radix) cache over the owner-lane allocator, with lane-aware eviction.

A radix tree (:class:`~cpkv.consumers.radix_tree.RadixTree`) keyed by token
ids holds cached chains of slots, page granular: every edge covers whole
pages, except a *partial leaf*, the last page of a finished request that ends
mid-page. Requests share cached full pages (a reference count per node keeps
them alive while in use). Invariants ([[RFC-0001:C-PREFIX-CACHE]]):

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
  ``(b + q) % N`` from the root down. A chain whose tail would hang under
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

The verbs, each answering one caller's question (nano-vllm's block manager,
SGLang's radix cache). Questions change nothing:

* :meth:`~PrefixCache.lookup` - how much of these tokens is cached? (:class:`PrefixHit`)
* :meth:`~PrefixCache.can_allocate` - what would admitting this request take, per lane? (:class:`Admission`)
* :meth:`~PrefixCache.chain_need` - what does a running request still need, per lane?
* :meth:`~PrefixCache.sizes` - how many pages does the cache hold, and how many could go? (:class:`CacheSizes`)
* :meth:`~PrefixCache.snapshot` - the whole state, to compare (tests);

changes:

* :meth:`~PrefixCache.allocate` - admit: pin the match, take its copy page (:class:`PrefixMatch`);
* :meth:`~PrefixCache.allocate_extend` / :meth:`~PrefixCache.allocate_decode` - the rest of the KV
  (evicting on a refusal);
* :meth:`~PrefixCache.cache_pages` - running requests' full pages enter the cache;
* :meth:`~PrefixCache.cache_chain` - a chain the caller holds enters the cache (SGLang's ``insert``);
* :meth:`~PrefixCache.finish` - requests end: their KV cached, or their private pages freed;
* :meth:`~PrefixCache.evict` / :meth:`~PrefixCache.clear` - free cached pages.

Life of a request: ``lookup`` (rank the queue) or ``can_allocate`` (budget the
lanes), then ``allocate`` once admitted; ``allocate_extend`` /
``allocate_decode`` as it runs, ``cache_pages`` as its pages fill, and
``finish`` exactly once (a second finish, a match of another cache, or slots
that do not extend the match raise :class:`PrefixCacheMisuse` and change
nothing). Every call that changes pages takes a batch, so a step costs one
call per verb, vectorised, whatever its size.

Memory runs out per lane, so eviction knows lanes: when an allocation is
refused, the unreferenced leaves that free pages in the short lanes go first,
in the order of the cache's eviction policy (least recently used by default;
:mod:`cpkv.consumers.eviction`), until the request fits or nothing evictable helps (the
per-lane deficit is then kept in ``last_deficit``). What a call evicted is
returned as values (:attr:`PrefixCache.last_evicted`, :class:`Evicted`), for
the caller to back up; ``on_evict`` hears each chain before its pages are
freed. Tree, pages and slots live on the host, as the allocator's control
state does.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np
import torch

from ..contract import layout, rules
from ..contract.allocation import Allocation
from ..contract.allocator import OwnerLaneAllocator
from ..contract.errors import UnsupportedPagePlan
from ..contract.inputs import int_vector
from ..contract.layout import lane_base_of_last_loc, owner_of, page_of, ranges
from .eviction import EvictionPolicy
from .prefix_match import Admission, CacheSizes, Evicted, PrefixHit, PrefixMatch
from .prefix_rules import PrefixCacheMisuse, _as_end, _as_key, _as_limit, _as_tokens, _int_vector
from .radix_tree import RadixTree, _Node, page_key

__all__ = ["Admission", "CacheSizes", "CallerSlots", "EvictHook", "Evicted", "PrefixCache", "PrefixCacheMisuse",
           "PrefixHit", "PrefixMatch", "RadixTree"]

#: ``on_evict(tokens, slots, key)``: int64 tokens ``[n]``, int64 slots ``[n]`` (tensor), the namespace (bytes).
EvictHook = Callable[[np.ndarray, torch.Tensor, bytes], None]

_NO_COPY = np.empty(0, dtype=np.int64)  # the copy of a match that copies nothing (shared: never written)
_NO_TOKENS = np.empty(0, dtype=np.int64)


class CallerSlots:
    """The slots of a prefix cache whose caller manages them: SGLang's
    ``RadixCache`` built with no memory pool, or over SGLang's own allocator.
    The cache keeps the values it is given (ints >= 0, in any order: no page,
    lane or fill rule applies to them) and allocates nothing; ``free(slots)``
    hands the values of a node it drops back (an int64 tensor ``[n]``), or,
    with ``free=None``, they are just dropped (as SGLang's simulated tree
    does). One lane (``cp_size`` 1). A :class:`PrefixCache` over it refuses the
    verbs that allocate (``no-allocator``)."""

    cp_size = 1
    num_pages = None

    def __init__(self, page_size: int, free: Callable[[torch.Tensor], None] | None = None):
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if free is not None and not callable(free):
            raise TypeError(f"free must be callable or None, got {type(free).__name__}")
        self.page_size, self._free = int(page_size), free

    def free(self, slots) -> None:
        """Hand ``slots`` (values the cache dropped) back to the caller's ``free``."""
        if self._free is not None and len(slots):
            self._free(torch.as_tensor(np.asarray(slots, dtype=np.int64)))


class PrefixCache:
    """Radix prefix cache over an :class:`~cpkv.contract.allocator.OwnerLaneAllocator`
    (see the module doc for its invariants and verbs), or over
    :class:`CallerSlots` (values its caller manages: no lanes, nothing
    allocated; ``owns_pages`` is False and the verbs that allocate refuse,
    ``no-allocator``).

    ``alloc`` is the allocator it runs over: ask it about free pages
    (``lane_free_pages``, ``lane_pages``, ``is_allocated``); change pages only
    through the cache's verbs, so the cache's pages and a live request's
    private pages are never handed out again. ``tree`` is the radix tree
    (for inspection). Counters: ``hit_tokens`` and ``acquired_tokens`` (matched
    and asked at :meth:`allocate`), ``evicted_nodes``, ``evicted_pages``,
    ``open_matches`` (allocated, not yet finished: 0 once an engine drains).
    ``last_deficit`` [N] is the per-lane deficit of the last refused
    allocation (``None`` after one that succeeded); ``last_evicted`` the
    chains the last evicting call evicted, in order (:class:`Evicted`).

    ``on_evict(tokens, slots, key)``, if given, is called for every evicted
    node before its pages are freed, with the values of its :class:`Evicted`
    (``tokens`` from the root through the node, the ``slots`` holding them,
    the namespace ``key``). It must not call the cache; if it raises, that
    node stays cached and the error propagates (nodes evicted before it in the
    same call stay evicted; ``last_evicted`` is not updated); a hook that
    cannot take three arguments is a ``TypeError``.

    ``eviction`` is the eviction policy, a name of
    :data:`~cpkv.consumers.eviction.EVICTION_POLICIES` (``"lru"``, the
    default; ``"lfu"``) or an :class:`~cpkv.consumers.eviction.EvictionPolicy`
    (``ValueError`` for an unknown name): the order in which the leaves that
    help a short lane go. [[RFC-0001:C-PREFIX-CACHE]]
    """

    def __init__(self, allocator: OwnerLaneAllocator | CallerSlots, on_evict: EvictHook | None = None,
                 eviction: str | EvictionPolicy = "lru"):
        if not isinstance(allocator, (OwnerLaneAllocator, CallerSlots)):
            raise TypeError(f"PrefixCache runs over an OwnerLaneAllocator or CallerSlots, got {type(allocator).__name__}")
        self.alloc = allocator
        self.owns_pages = isinstance(allocator, OwnerLaneAllocator)
        self.S, self.N = allocator.page_size, allocator.cp_size
        self.tree = RadixTree(self.S, self.N, allocator.num_pages, eviction)
        self._set_hook(on_evict)
        self.last_deficit: np.ndarray | None = None
        self.last_evicted: list[Evicted] = []
        self.hit_tokens = self.acquired_tokens = self.evicted_nodes = self.evicted_pages = 0
        self.open_matches = 0

    @property
    def on_evict(self) -> Callable | None:
        """The eviction hook as given (see the class doc); setting it checks its arity."""
        return self._hook

    @on_evict.setter
    def on_evict(self, hook: Callable | None) -> None:
        self._set_hook(hook)

    def _set_hook(self, hook: Callable | None) -> None:
        self._notify = None if hook is None else _three_argument_hook(hook)
        self._hook = hook

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

    # -- questions (nothing changes) -----------------------------------------------------------
    def lookup(self, tokens: Sequence[int], max_length: int | None = None, key=None) -> PrefixHit:
        """How much of ``tokens`` is cached now in namespace ``key``: a
        :class:`PrefixHit` of at most ``len(tokens) - 1`` tokens (so at least
        one is computed), or ``max_length``. The one pure question of the
        prefix: no reference, access time, hit, page or counter changes
        ([[RFC-0001:C-PREFIX-CACHE]]). Raises :class:`PrefixCacheMisuse` for
        tokens that are not ints >= 0 (``bad-tokens``), a key that is not
        None, str, int or bytes (``bad-key``) or a ``max_length`` that is not
        an int >= 0 (``bad-max-length``)."""
        tokens, ns = _as_tokens(tokens), _as_key(key)
        limit = _as_limit(max_length, len(tokens))
        w = self.tree.walk(tokens, limit, ns)
        pinned = np.zeros(self.N, dtype=np.int64)
        for node, m in w.path:
            if node.ref == 0:
                pinned += node.lanes if m * self.S == len(node.key) else self.tree.pages_of(node.slots[: m * self.S])[1]
        last = int(w.path[-1][0].slots[w.path[-1][1] * self.S - 1]) if w.path else -1
        lane = self.tree.lane_of(w.src.slots[w.src_off]) if w.src is not None else -1
        return PrefixHit(w.shared + w.copy, w.shared, w.copy, last, lane, pinned, self, ns, tokens, limit)

    def can_allocate(self, tokens: Sequence[int], end: int, host=None, key=None) -> Admission:
        """The admission question: what a request of ``tokens`` in namespace
        ``key`` that will hold ``end`` tokens of KV would take (an
        :class:`Admission`: its match, the pages it needs per lane, the pages
        the cache could give), given its match here and, with ``host`` (a
        :class:`~cpkv.consumers.hicache.HostTier`), what the host tier holds:
        when the host holds more, the request shares the device's whole pages
        only and loads the rest. ``Admission.fits(reserved)`` says whether it
        fits now (nano-vllm's ``can_allocate``); :meth:`allocate` takes it.
        Pure, O(N + the walk). Raises :class:`PrefixCacheMisuse` for bad tokens
        or key, or an ``end`` that is not an int >= 0 (``bad-end``).
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]"""
        self._need_allocator("can_allocate")
        tokens, end = _as_tokens(tokens), _as_end(end, "can_allocate")
        hit = self.lookup(tokens, key=key)
        host_len = host.lookup(tokens, hit) if host is not None else 0
        if host_len:  # the host tier holds more: the device's whole pages only
            hit = self.lookup(tokens, max_length=hit.shared, key=key)
        spare = np.asarray(self.alloc.lane_free_pages()) + self.tree.evictable_lanes - hit.newly_pinned
        return Admission(tokens, end, hit, host_len, self._lane_need(hit, end), spare)

    def chain_need(self, last_loc: int, length: int, end: int) -> np.ndarray:
        """Pages per lane [N] a running request still needs to grow from
        ``length`` to ``end`` tokens: its lanes fixed by ``last_loc`` (the slot
        of token ``length - 1``) when it has a prefix
        ([[RFC-0001:C-REQUEST-RELATIVE]]); without one, from the lane the
        allocator would pick now. Pure, O(N); the scheduler's reservation of
        what its running requests will take (its inputs are the scheduler's
        own, unchecked)."""
        self._need_allocator("chain_need")
        S, N = self.S, self.N
        first, stop = -(-length // S), -(-end // S)
        if stop <= first:
            return np.zeros(N, dtype=np.int64)
        base = lane_base_of_last_loc(last_loc, length, S, N) if length else self.alloc.lane_for_new_chain(0, pages=stop)
        return layout.chain_lane_pages(base, first, stop - first, N)

    def sizes(self) -> CacheSizes:
        """Cached and evictable pages per lane (:class:`CacheSizes`, copies),
        kept up to date as the tree changes: O(N). Pure."""
        return CacheSizes(self.tree.cached_lanes.copy(), self.tree.evictable_lanes.copy())

    def snapshot(self) -> tuple:
        """A copy of the whole cache state (tree shape, keys, slots, reference
        counts, access clocks and hits, counters, ``last_deficit``, ``last_evicted``), for
        tests and debugging. Compare snapshots (equal snapshots mean equal
        states); their shape is not an interface."""
        deficit = None if self.last_deficit is None else tuple(self.last_deficit.tolist())
        evicted = tuple((e.key, tuple(e.tokens.tolist()), tuple(e.slots.tolist())) for e in self.last_evicted)
        return (self.tree.snapshot(), self.hit_tokens, self.acquired_tokens, self.evicted_nodes,
                self.evicted_pages, self.open_matches, deficit, evicted)

    def _lane_need(self, hit: PrefixHit, end: int) -> np.ndarray:
        """Pages per lane [N] a request with ``hit`` needs to reach ``end``
        tokens once allocated: the copy page (if any) and every later page. The
        lanes of a chain that starts fresh (a copy, or no match) are the ones
        the allocator would pick now. O(N) for any ``end``."""
        q0, stop = hit.shared // self.S, -(-int(end) // self.S)
        if stop <= q0:
            return np.zeros(self.N, dtype=np.int64)
        if hit.shared:  # the copy page (if any) and the rest continue the shared chain's lanes
            base = lane_base_of_last_loc(hit.last_shared_loc, hit.shared, self.S, self.N)
        else:  # a fresh chain (from a copy of page 0, or nothing)
            base = self.alloc.lane_for_new_chain(0, prefer=hit.copy_lane if hit.copy else None, pages=stop)
        return layout.chain_lane_pages(base, q0, stop - q0, self.N)

    # -- admission ---------------------------------------------------------------------------
    def allocate(self, what: PrefixHit | Admission) -> PrefixMatch:
        """Admit a request: take what :meth:`lookup` found (a :class:`PrefixHit`)
        or what :meth:`can_allocate` answered (an :class:`Admission`: whole
        pages only when the host tier holds more, as it says). The match is
        found again now, from the hit's tokens, limit and namespace (a hit
        looked up before other calls changed the cache may match differently:
        the returned ``length`` is the one that holds); its path is pinned, and
        a partly matched page is copied into a private page (evicting if
        needed; the copy is dropped, and the match ends at the shared pages,
        when no page can be had: ``last_deficit`` says why; over
        :class:`CallerSlots` there is no copy). After shared pages the copy
        takes the lane that continues their chain.

        Returns the :class:`PrefixMatch`, which :meth:`finish` must end once;
        ``last_evicted`` holds what the copy page evicted. Raises
        :class:`PrefixCacheMisuse`, nothing changed: ``not-a-hit`` for anything
        but a hit or an admission, ``foreign-hit`` for one of another cache.
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-REQUEST-RELATIVE]]"""
        hit = what.hit if isinstance(what, Admission) else what
        if not isinstance(hit, PrefixHit):
            raise PrefixCacheMisuse("not-a-hit", "allocate takes the PrefixHit of lookup() or the Admission of "
                                    f"can_allocate(), got {type(what).__name__}")
        if hit._owner is not self:
            raise PrefixCacheMisuse("foreign-hit", "allocate: the hit was not looked up in this cache")
        # -- nothing refuses past this line
        S, tokens, ns = self.S, hit.tokens, hit.ns
        w = self.tree.walk(tokens, hit.limit, ns)
        held = None
        if w.path:
            held, m = w.path[-1]
            if m * S < len(held.key):  # the match ends inside an edge: cut it there
                lower, held = held, self.tree.split(held, m)
                if w.src is lower:
                    w.src_off -= m * S
        self.tree.pin(held, +1, hit=True)
        self.last_evicted = []
        copy_src = copy_dst = _NO_COPY
        if w.src is not None and self.owns_pages:  # over caller slots nothing is copied: the match ends at whole pages
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

    # -- allocation with eviction --------------------------------------------------------------
    def allocate_extend(self, prefix_lens, seq_lens, last_loc) -> Allocation | None:
        """The allocator's ``allocate_extend`` (SGLang's extend shape: lengths
        ``[bs]``, ``last_loc`` the slot of each request's last token with KV,
        -1 for none), evicting lane-aware on a refusal: the unreferenced leaves
        that free pages in the short lanes go first, in the eviction policy's
        order, until the batch fits. Returns the :class:`Allocation` (its owner lanes as the
        contract says, [[RFC-0001:C-OWNER-LANE]]), or ``None``, nothing
        allocated and ``last_deficit`` [N] set, when even eviction does not
        help ("not now": the scheduler preempts or shrinks the batch);
        ``last_evicted`` holds what it evicted either way. Raises what the
        allocator raises ("never", nothing changed), and
        ``UnsupportedPagePlan("extends-cached-page")`` for a chain that would
        grow inside a partly filled page the cache holds, before anything is
        evicted. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]"""
        self._need_allocator("allocate_extend")
        self._refuse_cached_growth(prefix_lens, seq_lens, last_loc)
        return self._with_eviction(lambda: self.alloc.allocate_extend(prefix_lens, seq_lens, last_loc))

    def allocate_decode(self, seq_lens, last_loc) -> Allocation | None:
        """The allocator's ``allocate_decode`` (one new token per request;
        ``seq_lens`` include it), evicting, returning and refusing as
        :meth:`allocate_extend` does. [[RFC-0001:C-PREFIX-CACHE]]"""
        self._need_allocator("allocate_decode")
        seq = int_vector(seq_lens, "seq_lens")
        self._refuse_cached_growth(seq - 1, seq, last_loc)
        return self._with_eviction(lambda: self.alloc.allocate_decode(seq_lens, last_loc))

    def _with_eviction(self, call: Callable):
        """``call()`` (an allocation), evicting for its deficit and calling it
        again until it succeeds or nothing evictable helps; sets
        ``last_deficit`` and ``last_evicted``. A ``call`` that raises on its
        first try leaves both as they were."""
        out, evicted = call(), []
        while out is None:
            deficit = self.alloc.last_deficit
            got = self._evict_for(deficit.copy())
            if not got:
                self.last_deficit, self.last_evicted = deficit, evicted
                return None
            evicted += got
            out = call()
        self.last_deficit, self.last_evicted = None, evicted
        return out

    def _refuse_cached_growth(self, prefix_lens, seq_lens, last_loc) -> None:
        """Raise ``UnsupportedPagePlan("extends-cached-page")``, nothing
        changed, if a request would grow its chain inside a partly filled page
        that the cache holds: ``last_loc`` is the last written slot of a cached
        page that is not full (a partial leaf, say) and the request adds tokens
        after it. The allocator alone would accept that (the slot ends its
        page's writes) and hand out the rest of the cache's page, so a second
        request matching that prefix would read another request's KV. A request
        that matched a prefix ending mid-page continues in its private copy
        (``PrefixMatch.last_loc``), never in the page the copy read. Only
        chains the allocator would otherwise take are checked here; a
        malformed batch is left to the allocator's own rules.
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]"""
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

    # -- a running request's pages ---------------------------------------------------------------
    def cache_pages(self, matches: Sequence[PrefixMatch], tokens, slots, counts=None) -> np.ndarray:
        """Running requests' next full pages have their KV: cache them now, so
        a request arriving while these run shares them (vLLM caches a block
        when it fills; SGLang's ``cache_unfinished_req``).

        ``tokens`` and ``slots`` (int64) are the runs of the requests back to
        back: run ``i``, ``counts[i]`` long (whole pages, at least one), holds
        positions ``matches[i].shared ..`` of request ``i``, on its own pages.
        Each run becomes one node under the match's held node (or the root of
        its namespace ``match.ns``: pages are cached under the request's key
        only), held by the request (referenced until it finishes, so never
        evicted), and is announced once to the cache's KV event sink;
        ``match.shared`` grows by the run. The batch does what the calls one
        by one in order would (a request may find the page another of the
        batch cached just before): O(its slots), whatever the requests'
        lengths.

        Returns a bool ``[len(matches)]``: True where the run was cached;
        False, with ``match.live`` set False and nothing else changed for that
        request, where the tree already holds a page of those tokens there
        (another request cached them first) or a page would not continue the
        lane base of the chain it joins (:meth:`RadixTree.graft_length`): the
        request keeps its pages private and :meth:`finish` settles them.
        Raises :class:`PrefixCacheMisuse`, nothing changed, for any run the
        rules of :meth:`finish` refuse, a run that is not whole pages
        (``not-whole-pages``) or a match that stopped caching
        (``match-not-live``).
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]]"""
        matches = _match_list(matches, "cache_pages")
        tokens, arr, counts = self._runs(matches, tokens, slots, counts, "cache_pages", whole_pages=True)
        S, tree = self.S, self.tree
        fresh = [m.node is None and tree.root_of(m.ns) is None for m in matches]  # a namespace's first chain
        parents = [m.node or tree.root_of(m.ns, create=True) for m in matches]
        lanes = owner_of(page_of(arr[::S], S), self.N)  # each page's lane, run after run
        shared = np.fromiter((m.shared for m in matches), np.int64, len(matches))
        grafts = tree.graft_pages(parents, shared, lanes, counts // S) == counts // S
        nodes = tree.attach_many([p if ok else None for p, ok in zip(parents, grafts.tolist())], tokens, arr, counts,
                                 held=True)
        for m, node, c, new in zip(matches, nodes, counts.tolist(), fresh):
            if node is None:  # the tree holds a page of it there, or it would change a chain's lane base
                root = tree.roots.get(m.ns)
                if new and root is not None and not root.children:
                    del tree.roots[m.ns]  # nothing changed: no empty root left behind
                m.live = False
            else:
                m.node, m.shared = node, m.shared + c
        return np.fromiter((n is not None for n in nodes), bool, len(nodes))

    # -- a chain the caller holds ------------------------------------------------------------------
    def cache_chain(self, tokens, slots, key=None) -> int:
        """Cache a chain of whole pages that the caller holds (SGLang's
        ``RadixCache.insert``): ``tokens`` and ``slots`` ``[n]`` (int64, ``n``
        a multiple of the page size), in namespace ``key``. The tokens the
        tree holds already keep the tree's slots: their count is returned, and
        the caller's slots for them stay the caller's (to free, as SGLang's
        ``insert`` leaves them); the rest become one new unreferenced node,
        announced to the event sink, and the cache's (freed when evicted).
        Uses the path now (LRU).

        Over an :class:`~cpkv.contract.allocator.OwnerLaneAllocator` the slots
        past the held part must be a page chain of allocated pages the cache
        does not hold, continuing the lane base of the chain they join
        ([[RFC-0001:C-OWNER-LANE]]); over :class:`CallerSlots` they are values
        >= 0. Raises :class:`PrefixCacheMisuse`, nothing changed:
        ``bad-tokens``, ``bad-key``, ``bad-slots``, ``length-mismatch``,
        ``not-whole-pages``, the page-chain rules of :meth:`finish`
        (``not-a-page-chain``, ``private-page-not-allocated``,
        ``private-page-cached``) and ``lane-base-changed`` (a page whose lane
        is not ``(b + q) % N`` of the chain it would join).
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]"""
        tokens, ns = _as_tokens(tokens), _as_key(key)
        arr = _int_vector(slots, "slots", "bad-slots")
        S, n, tree = self.S, tokens.size, self.tree
        if arr.size != n:
            raise PrefixCacheMisuse("length-mismatch", f"cache_chain: {n} tokens but {arr.size} slots")
        if n % S:
            raise PrefixCacheMisuse("not-whole-pages", f"cache_chain: {n} tokens are not whole pages of {S}")
        w = tree.walk(tokens, n, ns)
        held, node, m = w.shared, None, 0
        if w.path:
            node, m = w.path[-1]
        rest = arr[held:]
        if rest.size:
            self._check_chains(rest, np.arange(rest.size), "cache_chain")
            if self.owns_pages:  # page q of the new run lies in the lane after page q - 1's
                lanes = owner_of(page_of(rest[::S], S), self.N)
                first = lanes[0] if node is None else (tree.lane_of(node.slots[m * S - 1]) + 1) % self.N
                if (bad := np.flatnonzero(lanes != (first + np.arange(lanes.size)) % self.N)).size:
                    raise PrefixCacheMisuse("lane-base-changed", f"cache_chain: the page at position {held // S + bad[0]} "
                                            f"is in lane {lanes[bad[0]]}, the chain it joins continues in lane "
                                            f"{(first + bad[0]) % self.N}; a cached chain keeps one lane base")
        # -- nothing refuses past this line
        if not rest.size:
            if node is not None:
                tree.pin(node, 0)
            return held
        if node is None:
            node = tree.root_of(ns, create=True)
        elif m * S < len(node.key):
            node = tree.split(node, m)
        tree.pin(node, 0)
        self._attach(node, tokens[held:], rest)
        return held

    # -- the end of a request --------------------------------------------------------------------
    def finish(self, matches: Sequence[PrefixMatch], tokens, slots, counts, *, cache: bool = True) -> None:
        """Requests end: each match ends, exactly once. ``tokens`` and
        ``slots`` (int64) are the runs of the requests back to back, run ``i``
        ``counts[i]`` long (possibly empty): positions ``matches[i].shared``
        to the request's end, starting with the match's private copy if it has
        one not cached yet. What :meth:`cache_pages` cached is not read again:
        O(the runs + the depth of each path).

        ``cache=True`` (finished, or preempted keeping its KV; SGLang's
        ``cache_finished_req``): every run's pages become nodes in the match's
        namespace, or go back to the free lists where the tree already holds
        the same tokens, or where a page would not continue the lane base of
        the chain it joins (the rest of that run is freed). ``cache=False``
        (abort, or preemption dropping the KV): every run's pages are freed;
        ``tokens`` may be ``None``. Either way the matches' paths are unpinned
        and used now, in order; the slots no node keeps are freed in one call.

        Raises :class:`PrefixCacheMisuse`, nothing changed: ``not-a-match``,
        ``foreign-match``, ``match-consumed`` (a match ended already),
        ``match-twice``, ``length-mismatch`` (counts, tokens and slots that do
        not add up), ``bad-counts``, ``bad-slots``, ``bad-tokens``,
        ``slots-do-not-extend-match`` / ``tokens-do-not-extend-match`` (a run
        that does not start with the match's copy), ``not-a-page-chain`` (a
        slot off its page offset, a page twice, a page out of range),
        ``private-page-not-allocated`` / ``private-page-cached`` (a run's page
        free, or the cache's). [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]"""
        matches = _match_list(matches, "finish")
        if not cache:
            tokens, arr, counts = self._runs(matches, tokens, slots, counts, "finish", whole_pages=False,
                                             need_tokens=False)
            # -- nothing refuses past this line
            self._end_matches(matches, "released")
            if arr.size:
                self.alloc.free(arr)
            return
        tokens, arr, counts = self._runs(matches, tokens, slots, counts, "finish", whole_pages=False)
        # -- nothing refuses past this line
        S, arr, spare = self.S, arr.copy(), []
        starts = np.cumsum(counts) - counts
        part = np.flatnonzero((counts > 0) & (counts < S))
        part = [i for i in part.tolist() if matches[i].node is not None and matches[i].shared > 0]
        leaf_ok = np.zeros(len(matches), dtype=bool)
        if part:  # the partial page continues the lane base of the chain it hangs under
            lanes = owner_of(page_of(arr[starts[part]], S), self.N)
            shared = np.fromiter((matches[i].shared for i in part), np.int64, len(part))
            leaf_ok[part] = self.tree.graft_pages([matches[i].node for i in part], shared, lanes,
                                                  np.ones(len(part), dtype=np.int64)) == 1
        # The common ends go in batches (_end_simple): a match whose pages are all cached (an empty run), and one
        # whose run is less than a page that continues the lane base under its held node, a node with no child and
        # no earlier such run of the batch (the run becomes a partial leaf there: nothing to walk, split, share or
        # dominate). Any other run ends alone (_cache_run), in its place in the order.
        batch, under = [], set()  # the simple ends not yet made, and the nodes their leaves go under
        for i, (m, c) in enumerate(zip(matches, counts.tolist())):
            if c == 0 or (leaf_ok[i] and not m.node.children and m.node not in under):
                batch.append(i)
                if c:
                    under.add(m.node)
                continue
            self._end_simple(matches, tokens, arr, starts, counts, batch)  # in order: those before it end first
            batch, under = [], set()
            spare += self._cache_run(m, tokens[starts[i] : starts[i] + c], arr[starts[i] : starts[i] + c])
        self._end_simple(matches, tokens, arr, starts, counts, batch)
        spare = [s for s in spare if s.size]
        if spare:
            self.alloc.free(np.concatenate(spare))

    def _end_matches(self, matches: list, how: str, ticks=None) -> None:
        """``matches`` end (``how``: cached or released), in order: their paths
        unpinned and used now (one batched unpin; ``ticks``: see
        :meth:`RadixTree.unpin_many`)."""
        for m in matches:
            m._ended = how
        self.open_matches -= len(matches)
        self.tree.unpin_many([m.node for m in matches], ticks)

    def _end_simple(self, matches, tokens, arr, starts, counts, batch: list) -> None:
        """End ``matches[i]`` for ``i`` in ``batch`` as :meth:`_cache_run`
        would one by one: each unpinned (one tick), then, for a non-empty run,
        its run attached as a partial leaf under its node (one tick). One
        unpin and one attach for the batch, with the ticks the calls one by
        one would take."""
        if not batch:
            return
        c = counts[batch]
        per = 1 + (c > 0)  # ticks each takes
        last = self.tree.now + np.cumsum(per)
        self._end_matches([matches[i] for i in batch], "cached", ticks=(last - per + 1).tolist())
        leaf = c > 0
        if leaf.any():
            runs = [batch[j] for j in np.flatnonzero(leaf).tolist()]
            n = c[leaf]
            pos = ranges(starts[runs], n)
            made = self.tree.attach_many([matches[i].node for i in runs], tokens[pos], arr[pos], n, held=False,
                                         ticks=last[leaf].tolist())
            assert all(x is not None for x in made), "a partial leaf's node had a child"

    def _cache_run(self, match: PrefixMatch, tokens: np.ndarray, slots: np.ndarray) -> list:
        """End ``match`` by caching ``tokens``/``slots``, its positions from
        ``match.shared`` on (walked from the node the match holds, or from its
        namespace's root). Returns the slots not cached (freed by the caller
        in one call)."""
        S, n, offset = self.S, len(tokens), match.shared
        self._end_matches([match], "cached")
        start = match.node if offset else None
        w = self.tree.walk(tokens, n, match.ns, start)
        node, i, spare = start or self.tree.root_of(match.ns, create=n > w.shared), w.shared, []
        if w.path:
            node, m = w.path[-1]
            if m * S < len(node.key):
                node = self.tree.split(node, m)
            self.tree.pin(node, 0)  # used now
            spare.append(slots[:i])  # the tree has these tokens already
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

    # -- eviction ------------------------------------------------------------------------------
    def evict(self, deficit) -> list[Evicted]:
        """Evict unreferenced leaves that free pages in lanes with a deficit,
        in the eviction policy's order (``deficit`` [N] ints >= 0, pages per lane), until
        it is covered or nothing evictable helps (see :meth:`RadixTree.victim`);
        a node a live request holds, or any node on its path, is never
        evicted. Returns the evicted chains in order (empty: nothing evictable
        helps), also kept in ``last_evicted``. Raises
        :class:`PrefixCacheMisuse` (``bad-deficit``), nothing changed, for a
        malformed deficit. [[RFC-0001:C-PREFIX-CACHE]]"""
        need = _int_vector(deficit, "deficit", "bad-deficit").copy()
        if need.size != self.N or (need.size and need.min() < 0):
            raise PrefixCacheMisuse("bad-deficit", f"deficit must be {self.N} ints >= 0, got {need.tolist()}")
        self.last_evicted = self._evict_for(need)
        return list(self.last_evicted)

    def _evict_for(self, need: np.ndarray) -> list[Evicted]:
        """Evict for the per-lane ``need`` (changed in place); the evicted chains."""
        out = []
        while need.any():
            leaf = self.tree.victim(need > 0)
            if leaf is None:
                break
            need[:] = np.maximum(need - leaf.lanes, 0)
            out.append(self._evict(leaf))
        return out

    def _evict(self, leaf: _Node, notify: bool = True) -> Evicted:
        e = Evicted(leaf)
        if notify and self._notify is not None:
            self._notify(e.tokens, e.slots, leaf.ns)
        self.evicted_nodes += 1
        self.evicted_pages += int(leaf.pages.size)
        self._drop(leaf)
        return e

    def _drop(self, leaf: _Node) -> None:
        self.tree.detach(leaf)
        self.alloc.free(leaf.slots)

    def clear(self, notify: bool = True) -> None:
        """Evict every unreferenced node, leaves first, each round in the
        eviction policy's order (``last_evicted`` lists them); ``notify=False`` drops them without
        calling ``on_evict`` and lists none (nothing is backed up: the end of
        a run). Nodes a live request holds stay."""
        evicted = []
        while True:
            leaves = self.tree.ordered_leaves()
            if not leaves:
                break
            evicted += [self._evict(leaf, notify) for leaf in leaves]
        self.last_evicted = evicted if notify else []

    # -- the rules of the ends (read the state, change nothing) ----------------------------------
    def _need_allocator(self, what: str) -> None:
        """Raise ``no-allocator`` when the cache runs over :class:`CallerSlots`."""
        if not self.owns_pages:
            raise PrefixCacheMisuse("no-allocator", f"{what}: this cache keeps slots its caller manages "
                                    "(CallerSlots); it allocates nothing")

    def _check_match(self, match, what: str) -> None:
        """``match`` is a live match of this cache, or raise."""
        if not isinstance(match, PrefixMatch):
            raise PrefixCacheMisuse("not-a-match", f"{what} takes the PrefixMatch of allocate(), got "
                                    f"{type(match).__name__}")
        if match._owner is not self:
            raise PrefixCacheMisuse("foreign-match", f"{what}: the match was not allocated from this cache")
        if match.consumed:
            raise PrefixCacheMisuse("match-consumed", f"{what}: the match was already {match._ended}; a match "
                                    "ends once")

    def _runs(self, matches: list, tokens, slots, counts, what: str, whole_pages: bool, need_tokens: bool = True):
        """The checked inputs of a batch of runs (see :meth:`finish`): tokens
        (``None`` stays ``None`` unless ``need_tokens``), slots and counts as
        int64 arrays. Vectorised over the batch: O(total slots +
        len(matches)); nothing before a match's ``shared`` is read."""
        if tokens is not None or need_tokens:
            tokens = _as_tokens(tokens)
        arr, counts = _int_vector(slots, "slots", "bad-slots"), _int_vector(counts, "counts", "bad-counts")
        if len(matches) != counts.size:
            raise PrefixCacheMisuse("length-mismatch", f"{what}: {len(matches)} matches but {counts.size} counts")
        if not all(type(m) is PrefixMatch and m._owner is self and m._ended is None and (m.live or not whole_pages)
                   for m in matches):  # the common case in one pass; else find the bad one
            for m in matches:
                self._check_match(m, what)
                if whole_pages and not m.live:
                    raise PrefixCacheMisuse("match-not-live", f"{what}: the match stopped caching pages; it ends "
                                            "with finish")
        if len({id(m) for m in matches}) != len(matches):
            raise PrefixCacheMisuse("match-twice", f"{what}: a match appears twice in one batch")
        if counts.size and counts.min() < 0:
            raise PrefixCacheMisuse("bad-counts", f"{what}: counts must be >= 0, got {int(counts.min())}")
        total = int(counts.sum())
        if arr.size != total or (tokens is not None and tokens.size != total):
            have = "no" if tokens is None else tokens.size
            raise PrefixCacheMisuse("length-mismatch", f"{what}: {have} tokens but {arr.size} slots ({total} counted)")
        if whole_pages and (counts.size and (counts.min() == 0 or (counts % self.S).any())):
            bad = int(counts[(counts == 0) | (counts % self.S != 0)][0])
            raise PrefixCacheMisuse("not-whole-pages", f"{what}: {bad} slots are not whole pages (>= 1)")
        starts = np.cumsum(counts) - counts
        for i, m in enumerate(matches):
            if m.shared >= m.length:  # no private copy waiting to be cached
                continue
            copied, a = m._dst, int(starts[i])  # the private copy's slots, while not cached yet
            if counts[i] < copied.size or not np.array_equal(arr[a : a + copied.size], copied):
                raise PrefixCacheMisuse("slots-do-not-extend-match", f"{what}: the slots must start with the "
                                        "match's copy")
            if tokens is not None and not np.array_equal(tokens[a : a + copied.size], m._copy_tokens):
                raise PrefixCacheMisuse("tokens-do-not-extend-match", f"{what}: the tokens must start with the "
                                        "match's copied tokens")
        self._check_chains(arr, ranges(np.zeros_like(counts), counts), what)
        return tokens, arr, counts

    def _check_chains(self, slots: np.ndarray, run_pos: np.ndarray, what: str) -> None:
        """Runs of slots, ``run_pos`` each slot's position in its run (a run
        starts on a page boundary), are page chains (slot j at offset j % S of
        the run's page j // S, every page a usable one, no page in two places),
        and their pages are allocated and not the cache's, or raise. Vectorised."""
        S, n = self.S, slots.size
        if not n:
            return
        if not self.owns_pages:  # values the caller manages: only their sign is a rule
            if slots.min() < 0:
                raise PrefixCacheMisuse("bad-slots", f"{what}: slots must be >= 0, got {int(slots.min())}")
            return
        pages = page_of(slots, S)
        heads = np.flatnonzero(run_pos % S == 0)  # each page's first position
        first = np.repeat(pages[heads], np.diff(np.append(heads, n)))
        if (pages.min() < 1 or pages.max() > self.alloc.num_pages or (slots % S != run_pos % S).any()
                or (pages != first).any() or np.unique(pages[heads]).size != heads.size):
            raise PrefixCacheMisuse("not-a-page-chain", f"{what}: slot j must sit at offset j % {S} of the request's "
                                    f"own page j // {S}, every page a usable one, none twice")
        own = np.sort(pages[heads])  # distinct (checked above)
        if not (ok := self.alloc.is_allocated(own)).all():
            raise PrefixCacheMisuse("private-page-not-allocated", f"{what}: page {int(own[~ok][0])} of the request "
                                    "is free")
        if self.tree.page_cached[own].any():
            bad = int(own[self.tree.page_cached[own]][0])
            raise PrefixCacheMisuse("private-page-cached", f"{what}: page {bad} past the shared prefix is the cache's")


def _three_argument_hook(hook: Callable) -> Callable:
    """``hook``, checked to take ``(tokens, slots, key)``: ``TypeError`` for
    anything else."""
    if not callable(hook):
        raise TypeError(f"on_evict must be callable, got {type(hook).__name__}")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # no signature to read (a builtin): taken as the three-argument form
        return hook
    try:
        sig.bind(None, None, None)
    except TypeError:
        raise TypeError(f"on_evict must take (tokens, slots, key), got a callable of signature {sig}") from None
    return hook


def _match_list(matches, what: str) -> list:
    """``matches`` (a list or tuple) as a list, or raise ``not-a-match``."""
    if not isinstance(matches, (list, tuple)):
        raise PrefixCacheMisuse("not-a-match", f"{what} takes a list of PrefixMatch (one per run), got "
                                f"{type(matches).__name__}")
    return list(matches)
