"""What the prefix cache hands out, values only: a :class:`PrefixHit` (what a
lookup found), an :class:`Admission` (what admitting a request would take), a
:class:`PrefixMatch` (a request's held prefix, finished once), an
:class:`Evicted` chain and the :class:`CacheSizes` of the cache. The cache
(:class:`~cpkv.consumers.prefix_cache.PrefixCache`) makes them; a match's
tokens and slots are read from the radix tree's chain it holds
(:meth:`~cpkv.consumers.radix_tree.RadixTree.prefix_slots`), never from the
cache. [[RFC-0001:C-PREFIX-CACHE]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .radix_tree import RadixTree, _Node

_NO_TOKENS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class PrefixHit:
    """What :meth:`PrefixCache.lookup` found; nothing was taken.

    ``length`` tokens are cached, ``shared`` of them on whole pages that a
    request would share (a multiple of the page size), ``copy`` more
    (``length - shared``, less than a page) on a partly matched page that
    :meth:`PrefixCache.allocate` would copy into a private page.
    ``last_shared_loc`` is the slot of the last shared token (-1 for none);
    ``copy_lane`` the lane of the page the copy reads (-1 for none).
    ``newly_pinned`` [N] counts, per lane, the cached pages that allocating
    would take out of the evictable ones (matched pages that nobody holds
    now). ``ns`` is the namespace looked in (the request key as bytes);
    ``tokens`` (int64) and ``limit`` the query, which
    :meth:`PrefixCache.allocate` walks again. A hit answers for the cache that
    made it only (the cache refuses another's as ``foreign-hit``).
    """

    length: int
    shared: int
    copy: int
    last_shared_loc: int
    copy_lane: int
    newly_pinned: np.ndarray
    _owner: object = field(default=None, repr=False)  # the cache that looked it up (identity only)
    ns: bytes = b""
    tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS, repr=False)
    limit: int = 0

    @property
    def needs_copy(self) -> bool:
        """Whether allocating takes a copy page."""
        return self.copy > 0


@dataclass(eq=False, slots=True)
class PrefixMatch:
    """A request's cached prefix, held from :meth:`PrefixCache.allocate` until
    :meth:`PrefixCache.finish` ends it, exactly once.

    ``length`` tokens are cached (``tokens``, int64); ``slots`` [length] int64 (host)
    hold them: ``shared`` slots on the cache's pages, then the private copy of
    a partly matched page. ``last_loc`` is the last of them (-1 for none) and
    fixes the request's lane base. ``copy_src`` -> ``copy_dst`` are the KV
    copies the engine must make before the request's first forward (the owner
    of ``copy_dst`` reads ``copy_src`` through the shared view). ``ns``: the
    namespace (request key as bytes) it matched in and caches into.

    ``tokens`` and ``slots`` are derived when asked (O(length), a new array
    each call) from the cached chain the match holds and the copy: a match
    keeps no O(context) copy of its own, so admitting or ending a batch of
    long requests allocates and frees nothing per token. ``shared`` grows
    while the request's pages enter the cache (:meth:`PrefixCache.cache_pages`);
    ``length``, ``tokens`` and ``slots`` stay those of the match. ``live``
    turns False when a page of the request could not be cached (the rest
    waits for :meth:`PrefixCache.finish`).
    """

    length: int
    _src: np.ndarray = field(repr=False)  # int64 host slots of copy_src / copy_dst (see those)
    _dst: np.ndarray = field(repr=False)
    shared: int
    node: _Node | None = field(default=None, repr=False)  # deepest shared node, held
    _owner: object = field(default=None, repr=False)  # the cache that made it (identity only)
    _ended: str | None = field(default=None, repr=False)  # "cached" or "released" once finished
    ns: bytes = b""
    live: bool = True  # its full pages still enter the cache as they are computed
    _base: _Node | None = field(default=None, repr=False)  # the node the match ended on (never evicted under it)
    _copy_tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS, repr=False)

    @property
    def copy_src(self) -> torch.Tensor:
        """Slots the copy reads, int64 ``[length - shared]`` at admission (host; empty: no copy)."""
        return torch.from_numpy(self._src)

    @property
    def copy_dst(self) -> torch.Tensor:
        """Slots the copy writes (the request's private page), int64, as ``copy_src``."""
        return torch.from_numpy(self._dst)

    @property
    def slots(self) -> torch.Tensor:
        """The match's slots, int64 ``[length]`` (host, a new tensor): the shared chain's, then the copy's."""
        shared = RadixTree.prefix_slots(self._base)
        return torch.cat([shared, self.copy_dst]) if self._dst.size else shared

    @property
    def tokens(self) -> np.ndarray:
        """The matched tokens, int64 ``[length]`` (a new array)."""
        shared = RadixTree.prefix_tokens(self._base) if self._base is not None else _NO_TOKENS
        return np.concatenate([shared, self._copy_tokens])

    @property
    def last_loc(self) -> int:
        """Slot of the last cached token, -1 when nothing matched."""
        if self._dst.size:
            return int(self._dst[-1])
        return int(self._base.slots[-1]) if self._base is not None and self._base.parent is not None else -1

    @property
    def consumed(self) -> bool:
        """Whether :meth:`PrefixCache.finish` already ended this match."""
        return self._ended is not None


@dataclass(frozen=True, eq=False)
class Admission:
    """The answer of :meth:`PrefixCache.can_allocate`; nothing was taken.

    ``tokens`` the request's sequence (int64); ``hit`` the device match
    :meth:`PrefixCache.allocate` would take (whole pages only when the host
    tier holds more); ``host_len`` how many leading tokens the host tier holds
    beyond it (0: none; the caller loads them); ``need`` [N] int64 the pages
    per lane the request needs to reach ``end`` tokens once taken; ``spare``
    [N] int64 the pages per lane the cache could give it now (free plus
    evictable, less the cached pages its match would pin).
    [[RFC-0001:C-PREFIX-CACHE]]
    """

    tokens: np.ndarray
    end: int
    hit: PrefixHit
    host_len: int
    need: np.ndarray
    spare: np.ndarray

    def fits(self, reserved) -> bool:
        """Whether ``need`` fits every lane once ``reserved`` [N] (pages kept
        for others, a headroom) is set aside: ``need <= spare - reserved``."""
        return not (self.need > self.spare - reserved).any()


@dataclass(frozen=True)
class CacheSizes:
    """The answer of :meth:`PrefixCache.sizes`, per lane [N] int64: ``cached``
    pages the cache owns, ``evictable`` of them in nodes no live request holds
    (all of them can go, leaves first); ``protected`` the rest. SGLang's
    ``total_size`` / ``evictable_size`` / ``protected_size`` in pages."""

    cached: np.ndarray
    evictable: np.ndarray

    @property
    def protected(self) -> np.ndarray:
        """Cached pages per lane that a live request holds (never evicted under it)."""
        return self.cached - self.evictable


class Evicted:
    """A chain the cache evicted (:attr:`PrefixCache.last_evicted`,
    :meth:`PrefixCache.evict`): ``tokens`` (int64) every token from the root
    through the evicted node, ``slots`` (int64 tensor, same length) the device
    slots that held them (the ancestors', still cached then, and the node's
    own: a host tier backs the chain up from there), ``key`` its namespace
    (bytes, ``b""`` for the default).

    Read on first use from the evicted node's chain (O(chain), then kept), so
    an eviction nobody reads costs nothing per token. The chain of a node
    that left the tree never changes: nothing writes a node's arrays, and a
    later split of a still cached ancestor keeps the chain's tokens and slots
    in order."""

    __slots__ = ("_node", "_tokens", "_slots")

    def __init__(self, node: _Node):
        self._node, self._tokens, self._slots = node, None, None

    @property
    def tokens(self) -> np.ndarray:
        """Every token from the root through the evicted node (int64)."""
        if self._tokens is None:
            self._tokens = RadixTree.prefix_tokens(self._node)
        return self._tokens

    @property
    def slots(self) -> torch.Tensor:
        """The slots that held :attr:`tokens` (int64, host)."""
        if self._slots is None:
            self._slots = RadixTree.prefix_slots(self._node)
        return self._slots

    @property
    def key(self) -> bytes:
        """The chain's namespace (request key as bytes)."""
        return self._node.ns

    def __repr__(self) -> str:
        return f"Evicted({len(self.tokens)} tokens, key={self.key!r})"
