"""SGLang's prefix-cache interface (``BasePrefixCache``, as its ``RadixCache`` speaks it) over cpkv's
:class:`~cpkv.consumers.prefix_cache.PrefixCache`.

:class:`SGLangPrefixCache` answers SGLang's calls, each through the cache's own verbs, so the owner lanes and
the lane-aware eviction stay cpkv's ([[RFC-0001:C-PREFIX-CACHE]]): ``match_prefix`` is a pure ``lookup``; a lock
(``inc_lock_ref``) is an ``allocate`` of that match (it pins the path), its release (``dec_lock_ref``) a
``finish`` that caches nothing; ``insert`` caches a chain the caller holds (``PrefixCache.cache_chain``);
``cache_unfinished_req`` / ``checkpoint`` put a running request's full pages in the tree (``cache_pages``),
``cache_finished_req`` ends it (``finish``). Like SGLang's radix cache it keys whole pages only: a match is page
aligned, a request's partial last page is freed, never cached. Requests are read as SGLang's are: their
``req_to_token`` row (``req_to_token_pool.req_to_token[req_pool_idx]``), their token ids, ``last_node`` and
``extra_key``.

Over cpkv's :class:`~cpkv.contract.sglang.SGLangAllocator` the cache owns its pages and keeps owner lanes. Over
any other allocator (SGLang's own, a test's mock) or none, it keeps the values its caller inserts
(:class:`~cpkv.consumers.prefix_cache.CallerSlots`): no lanes, nothing allocated, evicted values handed to that
allocator's ``free`` (or dropped without one), as SGLang's ``RadixCache`` does.

Importable without SGLang: the values it returns carry SGLang's field names (:class:`MatchResult`,
:class:`InsertResult`, :class:`LockDelta`, :class:`EvictResult`) and, where SGLang's own modules are loaded in
the process (an engine that runs SGLang has them), ``insert``, ``evict`` and ``take_events`` return SGLang's own
classes, so a caller that checks them by type gets what it expects. Where it differs from SGLang's
``RadixCache``, ``docs/sglang.md`` says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..contract.inputs import int_vector
from ..contract.kv_row import row_lane_base
from ..contract.sglang import SGLangAllocator
from .kv_events import KVEventSink
from .prefix_cache import CallerSlots, PrefixCache
from .prefix_match import PrefixMatch
from .prefix_rules import PrefixCacheMisuse, _as_key

__all__ = ["EvictResult", "InsertResult", "LockDelta", "MatchResult", "PrefixNode", "SGLangPrefixCache"]

#: SGLang's modules whose classes the adapter returns when they are loaded (see :func:`_sglang_class`).
SGLANG_RESULTS = "sglang.srt.mem_cache.base_prefix_cache"
SGLANG_EVENTS = "sglang.srt.disaggregation.kv_events"

_EMPTY = torch.empty(0, dtype=torch.int64)


class MatchResult(NamedTuple):
    """SGLang's ``MatchResult``, its fields in its order: ``device_prefix_len`` tokens matched (page aligned),
    the :class:`PrefixNode` they end on (``last_device_node`` = ``last_host_node`` = ``best_match_node``: no
    host tier here), the host, SWA and Mamba fields at their defaults; ``device_indices`` (older SGLang's
    field, last) the matched slots."""

    device_prefix_len: int
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
    full_kv_hit_length: int = 0
    cache_actions: tuple = ()
    last_visited_node_id: int | None = None
    full_device_match_len: int | None = None
    device_indices: torch.Tensor = _EMPTY

    @property
    def prefix_len(self) -> int:
        """Earlier SGLang's name for :attr:`device_prefix_len`."""
        return self.device_prefix_len


@dataclass
class InsertResult:
    """SGLang's ``InsertResult``: ``prefix_len`` tokens of the key were cached already (the caller's values for
    them stay the caller's), ``last_device_node`` the node the key ends on."""

    prefix_len: int
    total_len: int = 0
    last_device_node: Any = None


@dataclass
class LockDelta:
    """SGLang's ``IncLockRefResult`` / ``DecLockRefResult``: ``delta`` tokens moved from protected to evictable
    (negative: the other way)."""

    delta: int = 0


@dataclass
class EvictResult:
    """SGLang's ``EvictResult``: tokens evicted (the SWA and Mamba counts stay 0)."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclass(eq=False)
class PrefixNode:
    """A matched prefix, as SGLang's scheduler holds a tree node (``req.last_node``): its ``tokens`` (int64,
    ``length`` of them, page aligned) in namespace ``ns``. ``lock_ref`` counts the locks taken on it
    (:meth:`SGLangPrefixCache.inc_lock_ref`), each a cpkv :class:`PrefixMatch` that pins the path."""

    tokens: np.ndarray
    length: int
    ns: Any = None
    locks: list = field(default_factory=list, repr=False)

    @property
    def lock_ref(self) -> int:
        """Locks held on this node."""
        return len(self.locks)

    @property
    def key(self) -> np.ndarray:
        """The node's tokens from the root (SGLang's ``node.key`` holds the edge's; ``len`` is what callers read)."""
        return self.tokens


class SGLangPrefixCache:
    """SGLang's prefix-cache calls over a :class:`PrefixCache` (see the module doc).

    Built as SGLang builds ``RadixCache``: from its ``CacheInitParams`` (read: ``disable``,
    ``req_to_token_pool``, ``token_to_kv_pool_allocator``, ``page_size``, ``enable_kv_cache_events``,
    ``is_eagle``, ``eviction_policy``, ``dynamo_kv_event_format``) or the same keywords, or as SGLang's tests build
    it, :meth:`create_simulated`. Over a :class:`~cpkv.contract.sglang.SGLangAllocator` the cache runs over its
    core (owner lanes; ``page_size`` must be the allocator's); over any other allocator or ``None`` it keeps
    the values its caller inserts (``page_size`` needed). ``cache`` is the cpkv cache (``cache.owns_pages``
    says which); ``root_node`` the empty prefix; ``enable_kv_cache_events`` whether :meth:`take_events` has
    events. With ``disable=True`` it caches nothing, as SGLang's disabled ``RadixCache``: a match is empty, an
    insert keeps nothing, locks and evictions do nothing, a finished request's slots are all freed. Refused in
    one line: EAGLE bigram keys (``is_eagle``), an eviction policy but ``"lru"`` and Dynamo's event hashes
    (``NotImplementedError``); a page size that disagrees (``ValueError``). Call refusals raise
    :class:`~cpkv.consumers.prefix_rules.PrefixCacheMisuse` before anything changes."""

    def __init__(self, params=None, *, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                 page_size: int | None = None, disable: bool = False, enable_kv_cache_events: bool = False):
        if params is not None:
            req_to_token_pool, token_to_kv_pool_allocator = params.req_to_token_pool, params.token_to_kv_pool_allocator
            page_size, disable = params.page_size, params.disable
            enable_kv_cache_events = bool(getattr(params, "enable_kv_cache_events", False))
            if getattr(params, "is_eagle", False):
                raise NotImplementedError("is_eagle: EAGLE bigram keys are not supported")
            if str(getattr(params, "eviction_policy", "lru")).lower() != "lru":
                raise NotImplementedError(f"eviction_policy {params.eviction_policy!r}: cpkv evicts least recently "
                                          "used leaves, lane-aware ('lru')")
            if getattr(params, "dynamo_kv_event_format", False):
                raise NotImplementedError("dynamo_kv_event_format: cpkv's events carry its own block hashes")
        alloc = token_to_kv_pool_allocator
        if isinstance(alloc, SGLangAllocator):
            core = alloc.allocator
            if page_size is not None and int(page_size) != core.page_size:
                raise ValueError(f"page_size {page_size} is not the allocator's {core.page_size}")
            self.cache, self.device = PrefixCache(core), core.device
        else:
            if page_size is None:
                raise ValueError("page_size is needed when the allocator is not cpkv's SGLangAllocator")
            dev = getattr(alloc, "device", None)
            self.cache = PrefixCache(CallerSlots(page_size, getattr(alloc, "free", None)))
            self.device = torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")
        self.req_to_token_pool, self.token_to_kv_pool_allocator = req_to_token_pool, alloc
        self.page_size, self.disable = self.cache.S, bool(disable)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self._events: list = []
        if self.enable_kv_cache_events and not self.disable:
            self.cache.events = KVEventSink(_Collected(self._events), self.page_size)
        self.root_node = PrefixNode(np.empty(0, dtype=np.int64), 0)

    @classmethod
    def create_simulated(cls, disable: bool = False, mock_allocator=None, page_size: int = 1,
                         enable_kv_cache_events: bool = False, dynamo_kv_event_format: bool = False,
                         kv_event_lora_names=None) -> SGLangPrefixCache:
        """SGLang's ``create_simulated``: a cache without memory pools (``mock_allocator``, if given, gets the
        evicted values' ``free``), for tests and simulation. ``kv_event_lora_names`` and
        ``dynamo_kv_event_format`` are refused (``NotImplementedError``)."""
        if dynamo_kv_event_format or kv_event_lora_names is not None:
            raise NotImplementedError("dynamo_kv_event_format and kv_event_lora_names: cpkv's events carry its own "
                                      "block hashes and no LoRA names")
        return cls(req_to_token_pool=None, token_to_kv_pool_allocator=mock_allocator, page_size=page_size,
                   disable=disable, enable_kv_cache_events=enable_kv_cache_events)

    # -- questions ---------------------------------------------------------------------------------
    def match_prefix(self, params) -> MatchResult:
        """The longest cached page-aligned prefix of the key (SGLang's ``MatchPrefixParams``, a ``RadixKey`` or
        token ids): all of it may match, as SGLang's does (the key's ``limit`` caps it). Pure: nothing is
        locked, split or touched (cpkv's ``lookup``); lock the node to keep it. Returns a :class:`MatchResult`
        whose node is a new :class:`PrefixNode` (the match of nothing is one too, in the key's namespace)."""
        tokens, ns = _key_of(getattr(params, "key", params))
        n = 0 if self.disable else tokens.size // self.page_size * self.page_size
        hit = self.cache.lookup(tokens, max_length=n, key=ns)
        node = PrefixNode(tokens[: hit.shared].copy(), hit.shared, ns)
        return MatchResult(hit.shared, node, node, node, device_indices=self._path_slots(node))

    def path_device_indices(self, node: PrefixNode) -> torch.Tensor:
        """The slots of ``node``'s tokens (int64): the locked chain's, or the tree's now."""
        return self._path_slots(_node(node))

    def prefix_device_indices(self, req) -> torch.Tensor:
        """The slots of ``req``'s matched prefix (``req.prefix_len`` of ``req.last_node``)."""
        return self.path_device_indices(req.last_node)[: int(req.prefix_len)]

    def evictable_size(self) -> int:
        """Tokens in cached pages no lock holds."""
        return int(self.cache.sizes().evictable.sum()) * self.page_size

    def protected_size(self) -> int:
        """Tokens in cached pages a lock holds."""
        return int(self.cache.sizes().protected.sum()) * self.page_size

    def total_size(self) -> int:
        """Tokens the cache holds."""
        return int(self.cache.sizes().cached.sum()) * self.page_size

    def full_evictable_size(self) -> int:
        """SGLang's name for :meth:`evictable_size` (no SWA part)."""
        return self.evictable_size()

    def full_protected_size(self) -> int:
        """SGLang's name for :meth:`protected_size`."""
        return self.protected_size()

    def supports_prefix_sharing(self) -> bool:
        """Whether prefixes stay for other requests (not when disabled)."""
        return not self.disable

    def supports_swa(self) -> bool:
        """False: no sliding-window part."""
        return False

    def supports_mamba(self) -> bool:
        """False: no Mamba state."""
        return False

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached slot (int64, on ``device``), node after node, depth first (SGLang's order is its own;
        callers compare sets)."""
        parts = [n.slots for n in self.cache.tree.nodes()]
        flat = torch.from_numpy(np.concatenate(parts)) if parts else _EMPTY
        return flat.to(self.device)

    def take_events(self) -> list:
        """The KV events since the last call, in order: one ``BlockStored`` per chain of full pages that entered
        (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size`` = ``page_size``, ``medium``
        ``GPU``), one ``BlockRemoved`` per chain evicted; SGLang's own event classes when its
        ``disaggregation.kv_events`` module is loaded, vLLM's (cpkv's wire schema, the same fields) otherwise.
        Block hashes are cpkv's (:func:`~cpkv.consumers.kv_events.block_hashes`: the namespace is hashed in).
        Empty when built without ``enable_kv_cache_events``."""
        sink = self.cache.events
        if sink is None:
            return []
        sink.flush()
        events, self._events[:] = list(self._events), []
        kinds = sys.modules.get(SGLANG_EVENTS)
        return events if kinds is None else [_sglang_event(kinds, e) for e in events]

    def available_and_evictable_str(self) -> str:
        """SGLang's out-of-memory line: available and evictable tokens."""
        a, e = self.token_to_kv_pool_allocator.available_size(), self.evictable_size()
        return f"Available tokens: {a + e} (available_size={a} + evictable_size={e})\n"

    def pretty_print(self) -> None:
        """Print the tree (one line per node: depth, tokens, first ten, locks; per-lane cached pages)."""
        depth = {}
        for node in sorted(self.cache.tree.nodes(), key=lambda n: n.serial):
            d = depth[node] = depth.get(node.parent, 0) + 1
            print(" " * (2 * d), len(node.key), node.key[:10].tolist(), f"r={node.ref}")
        print(f"#tokens: {self.total_size()} (cached pages per lane {self.cache.sizes().cached.tolist()})")

    # -- locks --------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: PrefixNode) -> LockDelta:
        """Lock ``node``: its path is pinned (never evicted) until :meth:`dec_lock_ref`. Returns the tokens it
        moved from evictable to protected, negated (SGLang's ``delta``). Raises ``stale-node`` when the cache no
        longer holds the whole prefix (evicted since the match), nothing changed."""
        node = _node(node)
        if self.disable:
            return LockDelta()
        hit = self.cache.lookup(node.tokens, max_length=node.length, key=node.ns)
        if hit.shared < node.length:
            raise PrefixCacheMisuse("stale-node", f"the node's {node.length} tokens are no longer all cached "
                                    f"({hit.shared} are): match again")
        before = self.evictable_size()
        node.locks.append(self.cache.allocate(hit))
        return LockDelta(self.evictable_size() - before)

    def dec_lock_ref(self, node: PrefixNode, params=None) -> LockDelta:
        """Release a lock on ``node`` (the most recent). Raises ``not-locked`` for a node with no lock."""
        node = _node(node)
        if self.disable:
            return LockDelta()
        if not node.locks:
            raise PrefixCacheMisuse("not-locked", "dec_lock_ref on a node that holds no lock")
        before = self.evictable_size()
        self.cache.finish([node.locks.pop()], None, _EMPTY, [0], cache=False)
        return LockDelta(self.evictable_size() - before)

    def lock(self, node: PrefixNode) -> PrefixNode:
        """SGLang's ``lock``: :meth:`inc_lock_ref`; the receipt is the node (pass it to :meth:`unlock`)."""
        self.inc_lock_ref(node)
        return node

    def unlock(self, lock: PrefixNode | None) -> None:
        """SGLang's ``unlock``: :meth:`dec_lock_ref` (``None``: nothing)."""
        if lock is not None:
            self.dec_lock_ref(lock)

    # -- insert ------------------------------------------------------------------------------------
    def insert(self, params, value=None):
        """Cache ``value`` (int slots, the caller's) under the key: SGLang's ``insert(InsertParams(key, value))``,
        or ``insert(key, value)`` as earlier SGLang took it (``key`` a ``RadixKey`` or token ids). The key is cut
        to whole pages first, and ``value`` to the key (``None``: the token ids themselves, SGLang's test
        fallback). Returns an ``InsertResult`` (SGLang's when its module is loaded): ``prefix_len`` tokens were
        cached already, their values stay the caller's to free, as SGLang's; the rest now belong to the cache
        (``PrefixCache.cache_chain``). Under cpkv's allocator the new values must be a chain of allocated pages that
        continues the lane base of the chain it joins (``lane-base-changed`` otherwise), and an
        ``InsertParams.rotation_base`` (SGLang's kv-shard lane base) must be the values' own lane base;
        refusals change nothing. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]]"""
        key = getattr(params, "key", params)
        value = getattr(params, "value", value) if hasattr(params, "key") else value
        tokens, ns = _key_of(key)
        result = _sglang_class(SGLANG_RESULTS, "InsertResult", InsertResult)
        if self.disable:
            return result(prefix_len=0)
        end = tokens.size // self.page_size * self.page_size
        tokens = tokens[:end]
        if value is None:
            slots = tokens.copy()
        else:
            slots = int_vector(value, "value")[:end]
            if slots.size < end:
                raise PrefixCacheMisuse("length-mismatch", f"insert: {end} tokens but {slots.size} values")
        base = getattr(params, "rotation_base", None)
        if base is not None and self.cache.owns_pages and end:
            S, N = self.page_size, self.cache.N
            own = row_lane_base(slots, S, N)
            if int(base) % N != own:
                raise PrefixCacheMisuse("lane-base-changed", f"insert: rotation_base {base} but the values' pages "
                                        f"start lane base {own}")
        held = self.cache.cache_chain(tokens, slots, key=ns)
        return result(prefix_len=held, total_len=end, last_device_node=PrefixNode(tokens.copy(), end, ns))

    # -- requests -----------------------------------------------------------------------------------
    def cache_unfinished_req(self, req, chunked: bool = False) -> None:
        """A running request's computed tokens (``req.fill_ids``) enter the cache: see :meth:`checkpoint`."""
        self.checkpoint(req, up_to=len(req.fill_ids))

    def checkpoint(self, req, *, up_to: int) -> None:
        """Cache the whole pages of ``req``'s first ``up_to`` tokens (read from its ``req_to_token`` row), as
        SGLang's ``cache_unfinished_req`` does: pages the tree holds already are taken from the tree (the
        request's own copies freed and its row repointed, as SGLang does), the rest enter it (cpkv's
        ``cache_pages``; a run that would change a chain's lane base stays the request's). The lock moves to
        the new node: ``req.last_node``, ``req.prefix_indices`` (the row) and ``cache_protected_len`` (the
        cached length) are set. Needs ``req.last_node`` locked (``not-locked``) unless it matched nothing."""
        self._need_pool("checkpoint")
        if self.disable:
            return
        tokens, row, ns = self._request(req, up_to)
        S, m = self.page_size, self._match_of(req, tokens, ns)
        end = tokens.size // S * S
        hit = self.cache.lookup(tokens, max_length=end, key=ns)
        if hit.shared > m.shared:  # the tree holds more of it: use the tree's pages, free the request's
            hit = self.cache.lookup(tokens, max_length=hit.shared, key=ns)
            mine = row[m.shared : hit.shared].clone()
            take = self.cache.allocate(hit)
            self.cache.finish([m], None, _EMPTY, [0], cache=False)
            self.token_to_kv_pool_allocator.free(mine)
            self._row_write(req, slice(m.shared, take.shared), take.slots[m.shared : take.shared])
            m = take
        if end > m.shared and m.live:
            self.cache.cache_pages([m], tokens[m.shared : end], row[m.shared : end].to(torch.int64),
                                   [end - m.shared])
        self._settle(req, m, row, ns)

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """A request ends: with ``is_insert`` its whole pages enter the cache (pages the tree holds already
        and a run of another lane base are freed, cpkv's ``finish``), then its partial last page and everything
        past the committed tokens are freed and its lock released; without, its pages past the lock are freed.
        Reads ``req.origin_input_ids + req.output_ids`` (cut at ``kv_committed_len`` when the request has it)."""
        self._need_pool("cache_finished_req")
        ids = list(req.origin_input_ids) + list(req.output_ids)
        committed = _req_attr(req, "kv_committed_len")
        n = len(ids) if committed is None else min(len(ids), int(committed))
        tokens, row, ns = self._request(req, n, ids)
        if self.disable:  # nothing is cached: the request's whole row goes back
            allocated = _req_attr(req, "kv_allocated_len")
            stop = n if allocated is None else max(n, int(allocated))
            self.token_to_kv_pool_allocator.free(self.req_to_token_pool.req_to_token[_pool_idx(req), :stop])
            return
        S, m = self.page_size, self._match_of(req, tokens, ns)
        end = n // S * S if is_insert else m.shared
        self.cache.finish([m], tokens[m.shared : end], row[m.shared : end].to(torch.int64), [end - m.shared])
        allocated = _req_attr(req, "kv_allocated_len")
        stop = n if allocated is None else max(n, int(allocated))
        tail = self.req_to_token_pool.req_to_token[_pool_idx(req), end:stop].to(torch.int64)
        self.token_to_kv_pool_allocator.free(tail)

    # -- changes ----------------------------------------------------------------------------------
    def evict(self, params) -> EvictResult:
        """Evict at least ``num_tokens`` (SGLang's ``EvictParams`` or an int), least recently used unlocked
        leaves first, lane-aware: the pages go where :meth:`available_size` is short, so that it grows by
        ``num_tokens`` (at ``N`` 1, and over the caller's values: ``ceil(num_tokens / page_size)`` pages, as
        SGLang's; the caller's values go to its allocator's ``free``). Returns the tokens evicted (less when
        nothing evictable helps), an ``EvictResult`` (SGLang's when its module is loaded)."""
        num = int(getattr(params, "num_tokens", params))
        result = _sglang_class(SGLANG_RESULTS, "EvictResult", EvictResult)
        if num <= 0 or self.disable:
            return result()
        cache, S = self.cache, self.page_size
        if cache.owns_pages:
            free = np.asarray(cache.alloc.lane_free_pages())
            target = free.min() + -(-num // (S * cache.N))
            deficit = np.maximum(target - free, 0)
        else:  # the caller's values: whole pages, least recently used first
            deficit = np.array([-(-num // S)])
        before = cache.evicted_pages
        cache.evict(deficit)
        return result(num_tokens_evicted=(cache.evicted_pages - before) * S)

    def evict_for_alloc(self, params, *, allocation_reclaim_satisfied=None) -> EvictResult:
        """SGLang's name for :meth:`evict` before an allocation."""
        if allocation_reclaim_satisfied is not None:
            raise NotImplementedError("joint reclaim is not supported")
        return self.evict(params)

    def reset(self) -> None:
        """Drop every cached prefix (their pages freed: to cpkv's allocator, or the caller's values to its
        allocator's ``free``; SGLang's drops them without a free). Refused (``reset-while-locked``) while a lock
        is held: SGLang resets only when no request runs."""
        if self.cache.open_matches:
            raise PrefixCacheMisuse("reset-while-locked", f"reset with {self.cache.open_matches} locks held")
        self.cache.clear(notify=False)

    # -- helpers ----------------------------------------------------------------------------------
    def _need_pool(self, what: str) -> None:
        if self.req_to_token_pool is None or self.token_to_kv_pool_allocator is None:
            raise PrefixCacheMisuse("no-pool", f"{what} reads a request's row and frees its slots: build the cache "
                                    "with a req_to_token_pool and an allocator")

    def _path_slots(self, node: PrefixNode) -> torch.Tensor:
        if node.locks:
            return node.locks[-1].slots[: node.length]
        if node.length == 0:
            return _EMPTY
        w = self.cache.tree.walk(node.tokens, node.length, _as_key(node.ns))
        S = self.page_size
        return torch.from_numpy(np.concatenate([n.slots[: k * S] for n, k in w.path]))[: node.length]

    def _request(self, req, n: int, ids=None):
        """``req``'s first ``n`` token ids (int64), its ``req_to_token`` row (a view) and namespace."""
        ids = req.fill_ids if ids is None else ids
        tokens = np.asarray(list(ids)[: int(n)], dtype=np.int64)
        row = self.req_to_token_pool.req_to_token[_pool_idx(req), : tokens.size]
        return tokens, row, _ns(getattr(req, "extra_key", None), getattr(req, "cache_salt", None))

    def _match_of(self, req, tokens: np.ndarray, ns) -> PrefixMatch:
        """The lock ``req`` holds (taken off its node), or a fresh match of nothing when its node matched
        nothing and holds no lock."""
        node = getattr(req, "last_node", None)
        if node is not None and _node(node).locks:
            node = _node(node)
            if node.ns != ns:
                raise PrefixCacheMisuse("key-mismatch", f"the request's extra_key {ns!r} is not its node's "
                                        f"{node.ns!r}")
            return node.locks.pop()
        if node is not None and _node(node).length:
            raise PrefixCacheMisuse("not-locked", "the request's last_node holds no lock: inc_lock_ref it first")
        return self.cache.allocate(self.cache.lookup(tokens, max_length=0, key=ns))

    def _settle(self, req, m: PrefixMatch, row: torch.Tensor, ns) -> None:
        node = PrefixNode(m.tokens[: m.shared] if m.shared else np.empty(0, dtype=np.int64), m.shared, ns)
        node.locks.append(m)
        req.last_node = node
        req.prefix_indices = row.clone()
        if hasattr(req, "kv") and hasattr(req.kv, "cache_protected_len"):
            req.kv.cache_protected_len = m.shared
        else:
            req.cache_protected_len = m.shared

    def _row_write(self, req, cols: slice, slots: torch.Tensor) -> None:
        pool = self.req_to_token_pool
        value = slots.to(pool.req_to_token.dtype)
        if hasattr(pool, "write"):
            pool.write((_pool_idx(req), cols), value)
        else:
            pool.req_to_token[_pool_idx(req), cols] = value


class _Collected:
    """The publisher of the cache's own event sink: batches land in a list that :meth:`SGLangPrefixCache.take_events`
    drains."""

    def __init__(self, into: list):
        self.into = into

    def publish(self, batch) -> None:
        self.into.extend(batch.events)


def _sglang_class(module: str, name: str, own):
    """SGLang's own class ``name`` when its ``module`` is loaded in this process, else cpkv's ``own`` (the same
    fields): cpkv never imports SGLang, and a caller that runs SGLang gets SGLang's types."""
    mod = sys.modules.get(module)
    return getattr(mod, name, own) if mod is not None else own


def _sglang_event(kinds, event):
    """One of cpkv's (vLLM's) events as SGLang's class of the same name, its fields copied."""
    name = type(event).__name__
    medium = getattr(event, "medium", None)
    medium = {"GPU": kinds.StorageMedium.GPU, "CPU": kinds.StorageMedium.CPU}.get(medium, medium)
    if name == "BlockStored":
        return kinds.BlockStored(block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                                 token_ids=list(event.token_ids), block_size=event.block_size,
                                 lora_id=event.lora_id, medium=medium)
    if name == "BlockRemoved":
        return kinds.BlockRemoved(block_hashes=list(event.block_hashes), medium=medium)
    return kinds.AllBlocksCleared()


def _node(node) -> PrefixNode:
    if not isinstance(node, PrefixNode):
        raise PrefixCacheMisuse("not-a-node", f"takes the PrefixNode of match_prefix, got {type(node).__name__}")
    return node


def _key_of(key) -> tuple[np.ndarray, Any]:
    """Token ids (int64) and namespace of SGLang's ``RadixKey`` (``extra_key``, ``cache_salt``, ``limit``) or a
    plain sequence of ids. An EAGLE bigram key is refused."""
    if hasattr(key, "token_ids"):
        if getattr(key, "is_bigram", False):
            raise NotImplementedError("EAGLE bigram keys are not supported")
        ids = key.raw_token_ids() if hasattr(key, "raw_token_ids") else key.token_ids
        ns = _ns(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))
        tokens = np.asarray(list(ids), dtype=np.int64)
    else:
        tokens, ns = int_vector(list(key) if not isinstance(key, (np.ndarray, torch.Tensor)) else key, "key"), None
    return tokens, ns


def _ns(extra_key, cache_salt):
    """The cpkv namespace of SGLang's ``extra_key`` and ``cache_salt`` (both partition the tree)."""
    return extra_key if cache_salt is None else f"{'' if extra_key is None else extra_key}\x00salt\x00{cache_salt}"


def _pool_idx(req) -> int:
    kv = getattr(req, "kv", None)
    idx = getattr(kv, "req_pool_idx", None) if kv is not None else None
    return int(req.req_pool_idx if idx is None else idx)


def _req_attr(req, name: str):
    kv = getattr(req, "kv", None)
    value = getattr(kv, name, None) if kv is not None else None
    return getattr(req, name, None) if value is None else value
