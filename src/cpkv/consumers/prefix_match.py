"""What the prefix cache hands out: a :class:`PrefixHit` (what a lookup
found), an :class:`Admission` (what admitting a request would take) and a
:class:`PrefixMatch` (a request's held prefix, consumed once). Values only;
the cache (:mod:`cpkv.consumers.prefix_cache`) makes them.
[[RFC-0001:C-PREFIX-CACHE]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache
    from .radix_tree import _Node


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
    nobody holds now). ``ns`` is the namespace looked in (the request key as
    bytes). A hit answers for the cache that made it only
    (:meth:`PrefixCache.lane_need` refuses another's).
    """

    length: int
    shared: int
    copy: int
    last_shared_loc: int
    copy_lane: int
    newly_pinned: np.ndarray
    _owner: "PrefixCache | None" = field(default=None, repr=False)
    ns: bytes = b""

    @property
    def needs_copy(self) -> bool:
        """Whether acquiring takes a copy page."""
        return self.copy > 0


@dataclass(eq=False, slots=True)
class PrefixMatch:
    """A request's cached prefix, held from :meth:`PrefixCache.acquire` until
    it is consumed, exactly once, by :meth:`PrefixCache.insert` or
    :meth:`PrefixCache.release`.

    ``length`` tokens are cached (``tokens``, int64); ``slots`` [length] int64 (host)
    hold them: ``shared`` slots on the cache's pages, then the private copy of
    a partly matched page. ``last_loc`` is the last of them (-1 for none) and
    fixes the request's lane base. ``copy_src`` -> ``copy_dst`` are the KV
    copies the engine must make before the request's first forward (the owner
    of ``copy_dst`` reads ``copy_src`` through the shared view). ``ns``: the
    namespace (request key as bytes) it matched in and inserts into.

    ``tokens`` and ``slots`` are derived when asked (O(length), a new array
    each call) from the cached chain the match holds and the copy: a match
    keeps no O(context) copy of its own, so admitting or ending a batch of
    long requests allocates and frees nothing per token. ``shared`` grows
    while the request's pages enter the cache (:meth:`PrefixCache.cache_pages`);
    ``length``, ``tokens`` and ``slots`` stay those of the match.
    """

    length: int
    _src: np.ndarray = field(repr=False)  # int64 host slots of copy_src / copy_dst (see those)
    _dst: np.ndarray = field(repr=False)
    shared: int
    node: "_Node | None" = field(default=None, repr=False)  # deepest shared node, held
    _owner: "PrefixCache | None" = field(default=None, repr=False)
    _ended: str | None = field(default=None, repr=False)  # "inserted" or "released" once consumed
    ns: bytes = b""
    live: bool = True  # its full pages still enter the cache as they are computed
    _base: "_Node | None" = field(default=None, repr=False)  # the node the match ended on (never evicted under it)
    _copy_tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64), repr=False)

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
        shared = self._owner.tree.prefix_slots(self._base)
        return torch.cat([shared, self.copy_dst]) if self._dst.size else shared

    @property
    def tokens(self) -> np.ndarray:
        """The matched tokens, int64 ``[length]`` (a new array)."""
        shared = self._owner.tree.prefix_tokens(self._base) if self._base is not None else self._copy_tokens[:0]
        return np.concatenate([shared, self._copy_tokens])

    @property
    def last_loc(self) -> int:
        """Slot of the last cached token, -1 when nothing matched."""
        if self._dst.size:
            return int(self._dst[-1])
        return int(self._base.slots[-1]) if self._base is not None and self._base.parent is not None else -1

    @property
    def consumed(self) -> bool:
        """Whether insert or release already ended this match."""
        return self._ended is not None


@dataclass(frozen=True, eq=False)
class Admission:
    """The answer of :meth:`PrefixCache.can_allocate`; nothing was taken.

    ``tokens`` the request's sequence (int64); ``hit`` the device match
    :meth:`PrefixCache.allocate` would acquire (whole pages only when the host
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
