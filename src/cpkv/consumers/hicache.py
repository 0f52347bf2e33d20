"""The host tier, one host KV pool for the whole CP group.

Two parts, as the allocator and the pool are two parts on the device:

* :class:`HostTier` - which token chains the host holds, on which host
  slots. It is a prefix cache of its own, over a host page allocator (one lane:
  host pages have no owner), run identically on every rank like every other
  control state, with no collective. Host pages are evicted least recently
  used when the host pool is full.
* :class:`HostPool` - the data: one host buffer per cache family
  (``[len(layers), host slots, *shape]``, in POSIX shared memory for a CP
  group), and the two copies between it and the device pool:

  - backup (device -> host): only the IO rank copies, reading every page
    through the rank-major view (``select_device_to_host_indices``);
  - load (host -> device): every rank copies the slots on pages it owns into
    its own segment (``select_host_to_device_indices``), through the pool's
    owner check.

  Fences go before a backup (the device writes it reads have landed) and after
  it (the host holds the data before its device pages are reused), and after a
  load (before anyone reads the loaded pages).

  On a GPU both copies gather on the device side: a backup reads the device
  rows into one device tensor, moves it with ONE non-blocking copy into
  pinned memory and scatters it into the host rows; a load gathers the host
  rows into pinned memory and moves them with ONE non-blocking copy to the
  device (:mod:`cpkv.consumers.placement`). The host buffers themselves are
  the group's shared segments, page-locked in place
  (:func:`cpkv.runtime.device.pin_host`).

Consumers take the device allocation and its owner lanes as given: the host
tier never recomputes owners ([[RFC-0001:C-DOWNSTREAM-CONTRACT]],
[[RFC-0001:C-HICACHE]]).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ..contract.allocator import OwnerLaneAllocator
from . import placement
from .kv_events import MEDIUM_HOST
from .kv_pool import Family, SharedKVPool
from .prefix_cache import PrefixCache, PrefixHit

_NONE = np.empty(0, dtype=np.int64)  # no run: a match whose pages are all cached, or a release of nothing


class HostTier:
    """Which whole pages of which token chains the host holds (control state only).

    ``host_pages`` pages of ``page_size`` slots. The scheduler asks
    :meth:`lookup` (pure), pins what it loads with :meth:`take` until
    :meth:`step_done`, and backs evicted device nodes up with :meth:`backup`.
    Chains keep the device's namespace keys (``key``). ``events`` (an optional
    :class:`~cpkv.consumers.kv_events.KVEventSink`) hears every full page
    that enters or leaves the host, as medium ``"CPU"`` ([[RFC-0001:C-KV-EVENTS]]).
    """

    def __init__(self, host_pages: int, page_size: int, events=None):
        if host_pages < 1:
            raise ValueError(f"host_pages must be >= 1, got {host_pages}")
        self.S = page_size
        self.alloc = OwnerLaneAllocator(host_pages * page_size, page_size, 1)
        self.index = PrefixCache(self.alloc)
        self.index.events, self.index.medium = events, MEDIUM_HOST
        self._held = []

    @property
    def num_pages(self) -> int:
        """Usable host pages."""
        return self.alloc.num_pages

    def used_pages(self) -> int:
        """Host pages holding data now."""
        return self.num_pages - sum(self.alloc.lane_free_pages())

    def lookup(self, tokens: Sequence[int], device_hit: PrefixHit) -> int:
        """Tokens of ``tokens`` the host holds (whole pages), when that is at
        least one page more than the device's whole-page match and more than
        its whole match (in the hit's namespace); else 0. Pure."""
        hit = self.index.lookup(tokens, key=device_hit.ns)
        n = hit.shared
        return n if n >= device_hit.shared + self.S and n > device_hit.length else 0

    def take(self, tokens: Sequence[int], start: int, end: int, key=None) -> torch.Tensor:
        """Host slots of ``tokens[start:end]`` in namespace ``key`` (held by
        :meth:`lookup`), pinned until :meth:`step_done` so no backup of this
        step reuses them."""
        m = self.index.allocate(self.index.lookup(tokens, max_length=end, key=key))
        if m.length < end or m.copy_dst.numel():
            self.index.finish([m], None, m.copy_dst, [m.copy_dst.numel()], cache=False)
            raise AssertionError(f"host tier holds {m.length} of the {end} tokens lookup promised")
        self._held.append(m)
        return m.slots[start:end].clone()

    def backup(self, tokens: Sequence[int], slots: torch.Tensor, key=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An evicted device chain of namespace ``key``: ``slots[j]`` holds ``tokens[j]`` on the device
        (every token from the root through the evicted node). Allocates host
        slots for the whole pages the host lacks (evicting host pages LRU) and
        indexes them; returns ``(device_slots, host_slots)`` to copy, or
        ``None`` when the host holds them already or has no room (a chain
        longer than the whole tier is not backed up)."""
        n = len(tokens) // self.S * self.S
        if n == 0 or n // self.S > self.num_pages:  # nothing whole, or more than the whole tier could hold
            return None
        tokens, index = np.asarray(tokens)[:n], self.index
        have = index.lookup(tokens, max_length=n, key=key).shared
        m = index.allocate(index.lookup(tokens, max_length=have, key=key))  # whole pages only: nothing is copied
        if m.length == n:
            index.finish([m], tokens[n:], _NONE, [0])  # marks the chain used now
            return None
        a = index.allocate_extend([m.length], [n], torch.tensor([m.last_loc]))
        if a is None:
            index.finish([m], None, _NONE, [0], cache=False)
            return None
        index.finish([m], tokens[m.length :], a.out_cache_loc, [n - m.length])
        return slots[m.length : n].clone(), a.out_cache_loc

    def step_done(self) -> None:
        """The step's loads have run: unpin what :meth:`take` pinned."""
        held, self._held = self._held, []
        self.index.finish(held, None, _NONE, [0] * len(held), cache=False)

    @property
    def open_matches(self) -> int:
        """Host chains pinned and not yet released (0 between steps)."""
        return self.index.open_matches

    @property
    def events(self):
        """The optional :class:`~cpkv.consumers.kv_events.KVEventSink` told of every full
        page that enters or leaves the host (medium ``"CPU"``)."""
        return self.index.events

    @events.setter
    def events(self, sink) -> None:
        self.index.events = sink

    def clear(self) -> None:
        """Drop everything the host holds."""
        self.step_done()
        self.index.clear()


class HostPool:
    """The host tier's data for one rank: a buffer per family, the same memory on every rank.

    ``buffers[name]`` has shape ``[len(family.layers), (host_pages + 1) *
    page_size, *family.row_shape]`` of ``family.dtype`` (host page 0 unused,
    like device page 0): the device pool's stored rows, so a formatted
    (e.g. FP8) family is backed up and loaded as its bytes, never re-encoded
    ([[RFC-0001:C-KV-FORMAT]]).
    """

    def __init__(self, families: Sequence[Family], buffers: Mapping[str, torch.Tensor], io_rank: int = 0):
        self.families = {f.name: f for f in families}
        self.buffers = dict(buffers)
        self.io_rank = io_rank
        if set(self.families) != set(self.buffers):
            raise ValueError(f"families {sorted(self.families)} and host buffers {sorted(self.buffers)} differ")

    @staticmethod
    def allocate(families: Sequence[Family], host_pages: int, page_size: int,
                 make: Callable[[str, tuple, torch.dtype], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Zeroed host buffers; ``make(tag, shape, dtype)`` allocates (default ``torch.zeros``)."""
        make = make or (lambda tag, shape, dtype: torch.zeros(shape, dtype=dtype))
        slots = (host_pages + 1) * page_size
        return {f.name: make(f"host_{f.name}", (len(f.layers), slots, *f.row_shape), f.dtype) for f in families}

    def pinned(self) -> bool:
        """Whether every host buffer is page-locked for CUDA (a
        ``cudaHostRegister`` that took, :func:`cpkv.runtime.device.pin_host`;
        where it was refused the tier stays pageable and works, its copies
        staged through pinned memory): ``False`` without CUDA. One question to
        the driver per buffer (which makes a CUDA context where there was
        none: ask it on a GPU run)."""
        return all(b.is_pinned() for b in self.buffers.values())

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page over every family and layer."""
        return page_size * sum(f.slot_bytes() for f in self.families.values())

    def backup(self, pool: SharedKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Device -> host: the IO rank reads ``device_slots`` through the shared
        view and writes ``host_slots``; other ranks copy nothing. Returns the
        slots this rank copied. The caller fences before and after."""
        host, _ = pool.layout.select_device_to_host_indices(host_slots, device_slots, current_rank=pool.rank,
                                                            io_rank=self.io_rank)
        if not host.numel():
            return 0
        data = pool.read_all_layers(device_slots)  # gathered where the device rows are
        for n, b in self.buffers.items():
            b.index_copy_(1, placement.place(host, b), placement.to_host(data[n]))
        return host.numel()

    def load(self, pool: SharedKVPool, host_slots: torch.Tensor, device_slots: torch.Tensor) -> int:
        """Host -> device: this rank loads the slots on pages it owns into its own
        segment (through the pool's owner check). Returns the slots it loaded.
        The caller fences after."""
        mine = pool.layout.owned_slot_mask(device_slots, owner_rank=pool.rank)
        host, _ = pool.layout.select_host_to_device_indices(host_slots, device_slots, owner_rank=pool.rank)
        rows = {}
        for n, b in self.buffers.items():
            staged = placement.pinned_like((b.shape[0], host.numel(), *b.shape[2:]), b.dtype, pool.device)
            rows[n] = placement.to_device(torch.index_select(b, 1, placement.place(host, b), out=staged),
                                          pool.device)
        pool.write_all_layers(device_slots[mine], rows)
        return host.numel()
