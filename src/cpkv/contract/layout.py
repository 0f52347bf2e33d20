"""Shared-KV layout: the one place where cpkv does its index arithmetic.

A logical slot ``s`` lies on logical page ``p = s // S`` at offset ``s % S``.

* owner ``p % N``                                   [[RFC-0001:C-LAYOUT-OWNER]]
* local slot ``(p // N) * S + s % S`` in the owner's own segment
* rank-major slot ``((p % N) * pages_per_rank + p // N) * S + s % S``
  in the shared view of all N segments laid end to end

The padding value passes through every translation unchanged
([[RFC-0001:C-PADDING]]); any other negative slot, or a slot past the
layout's capacity, raises. With ``cp_size == 1`` every translation is the
identity. Method names follow SGLang's shared-KV layout so an engine can swap
this class in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

_INT_LIMITS = {
    torch.int32: (-(2**31), 2**31 - 1),
    torch.int64: (-(2**63), 2**63 - 1),
}


def page_of(slots, page_size: int):
    """Logical page of each (non-negative) slot: ``s // S``. Ints, numpy or torch."""
    return slots // page_size


def floor_div(a, n: int):
    """``a // n`` (floor, for ints, numpy or torch), as a shift when ``n`` is a
    power of two: numpy's integer division is several times slower than a
    shift on large arrays. The one place cpkv takes that shortcut."""
    return a >> (n.bit_length() - 1) if n & (n - 1) == 0 else a // n


def floor_mod(a, n: int):
    """``a % n`` (floor: non-negative for positive ``n``), as a mask when ``n``
    is a power of two (see :func:`floor_div`)."""
    return a & (n - 1) if n & (n - 1) == 0 else a % n


def slot_at(page_starts, offsets, page_size: int):
    """The slot ``offsets`` into the page that starts at slot ``page_starts``:
    ``page_starts + offsets`` for page starts (multiples of ``S``) and
    offsets in ``0 .. S - 1`` (ints, numpy or torch, broadcast), as a bitwise
    or when ``S`` is a power of two: the two are equal there, and on the CPU
    torch's int64 add takes several times as long as a bitwise or over the
    same 2 MB (``cpkv bench alloc`` writes ``out_cache_loc`` this way, in the
    allocator and in its floor alike). The shortcut of :func:`floor_div`."""
    return page_starts | offsets if page_size & (page_size - 1) == 0 else page_starts + offsets


def owner_of(pages, cp_size: int):
    """Owner rank (lane) of each logical page: ``p % N``. Ints, numpy or torch."""
    return pages % cp_size


def lane_of_position(lane_base, page_position, cp_size: int):
    """Lane of request-local page position q for lane base b: ``(b + q) % N``.

    Works on ints and tensors alike. [[RFC-0001:C-OWNER-LANE]]
    """
    return (lane_base + page_position) % cp_size


def lane_base_from_prefix(owner_of_last, prefix_len, page_size: int, cp_size: int):
    """Lane base implied by a prefix whose last slot sits in lane ``owner_of_last``:
    ``b = (owner(last_loc) - (prefix_len - 1) // S) mod N``. Ints or tensors.
    [[RFC-0001:C-REQUEST-RELATIVE]]
    """
    return (owner_of_last - (prefix_len - 1) // page_size) % cp_size


def lane_base_of_last_loc(last_loc, prefix_len, page_size: int, cp_size: int):
    """Lane base of a chain that continues from ``last_loc``, the slot of its
    ``prefix_len``-th token: :func:`lane_base_from_prefix` of the lane of
    ``last_loc``'s page. Ints, numpy or torch. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    return lane_base_from_prefix(owner_of(page_of(last_loc, page_size), cp_size), prefix_len, page_size, cp_size)


def ranges(starts, counts) -> np.ndarray:
    """The runs ``starts[i] .. starts[i] + counts[i] - 1`` back to back, int64
    ``[sum(counts)]`` (``counts >= 0``): the positions of a batch's runs in
    its requests (a page-table row, a token buffer), or with ``starts`` 0 each
    entry's place in its run. Vectorised: nothing per run or per entry."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if counts.size else 0) + np.repeat(np.asarray(starts, dtype=np.int64) - ends + counts,
                                                                      counts)


def chain_lane_pages(lane_base, first_position, num_pages, cp_size: int) -> np.ndarray:
    """Pages per lane a chain takes: ``num_pages`` pages at request-local
    positions ``first_position ..`` of a request with lane base ``lane_base``
    cycle through the lanes from ``lane_of_position(lane_base, first_position)``,
    so they are ``n // N`` pages of every lane plus one of each of the
    ``n % N`` lanes from that one on. The one place cpkv counts a chain's
    pages per lane (the plan, the allocation rules, the prefix cache and the
    scheduler all call it). [[RFC-0001:C-OWNER-LANE]]

    Vectorised over requests: ints or numpy arrays ``[bs]`` (broadcast) give
    int64 ``[..., N]`` (``[N]`` for scalars). ``O(bs * N)``: nothing per page;
    up to N = 32 the remainder's lanes are read from a table made once per N.
    """
    N = cp_size
    if type(lane_base) is int and type(first_position) is int and type(num_pages) is int:  # one chain, no array
        q, k = divmod(num_pages, N)
        if N <= _TABLE_UP_TO:
            return np.add(_remainder_lanes(N)[(lane_base + first_position) % N, k], q, dtype=np.int64)
        return ((lane_ids(N) - (lane_base + first_position)) % N < k) + q
    start = floor_mod(np.asarray(lane_base + first_position, dtype=np.int64), N)  # lane_of_position
    n = np.asarray(num_pages, dtype=np.int64)
    if N <= _TABLE_UP_TO:
        return floor_div(n, N)[..., None] + _remainder_lanes(N)[start, floor_mod(n, N)]
    return floor_div(n, N)[..., None] + (floor_mod(lane_ids(N) - start[..., None], N) < floor_mod(n, N)[..., None])


#: Up to this group size :func:`chain_lane_pages` reads the lanes of a remainder from a table (N**3 bytes).
_TABLE_UP_TO = 32


@functools.lru_cache(maxsize=64)
def _remainder_lanes(cp_size: int) -> np.ndarray:
    """``t[f, k, l]``: whether lane l holds one of the ``k`` remainder pages of
    a chain whose first page is in lane f, ``(l - f) % N < k`` (uint8 ``[N, N,
    N]``, read-only)."""
    N = cp_size
    lanes = np.arange(N)
    t = (floor_mod(lanes[None, None, :] - lanes[:, None, None], N) < lanes[None, :, None]).astype(np.uint8)
    t.flags.writeable = False
    return t


@functools.lru_cache(maxsize=64)
def lane_ids(cp_size: int) -> np.ndarray:
    """The lanes of a group, ``np.arange(N)`` (int64, read-only), made once per group size."""
    lanes = np.arange(cp_size)
    lanes.flags.writeable = False
    return lanes


def _cast(out: torch.Tensor, output_dtype: torch.dtype | None) -> torch.Tensor:
    if output_dtype is None or output_dtype == out.dtype:
        return out
    lo, hi = _INT_LIMITS.get(output_dtype, (None, None))
    if lo is None:
        raise TypeError(f"output_dtype must be torch.int32 or torch.int64, got {output_dtype}")
    if out.numel() and (int(out.max()) > hi or int(out.min()) < lo):
        raise OverflowError(
            f"translated slots span [{int(out.min())}, {int(out.max())}], "
            f"which does not fit {output_dtype}"
        )
    return out.to(output_dtype)


@dataclass(frozen=True)
class SharedKVLayout:
    """Where every logical slot of one CP group's shared KV cache is stored.

    ``cp_size`` ranks each hold ``pages_per_rank`` pages of ``slots_per_page``
    slots. Logical pages ``0 .. cp_size * pages_per_rank - 1`` exist; page 0 is
    reserved for padding by the allocator.
    """

    cp_size: int
    slots_per_page: int
    pages_per_rank: int
    padding_value: int = -1

    def __post_init__(self):
        for name in ("cp_size", "slots_per_page", "pages_per_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.padding_value >= 0:
            raise ValueError(f"padding_value must be negative, got {self.padding_value}")

    # -- sizes --------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Logical pages in the whole group (page 0 included)."""
        return self.cp_size * self.pages_per_rank

    @property
    def capacity(self) -> int:
        """Logical slots in the whole group."""
        return self.num_pages * self.slots_per_page

    @property
    def slots_per_rank(self) -> int:
        """Slots in one rank's segment."""
        return self.pages_per_rank * self.slots_per_page

    def rank_pages(self, rank: int):
        """The logical pages rank ``rank`` owns, ascending (page 0 included for rank 0):
        ``rank, rank + N, rank + 2N, ...``. [[RFC-0001:C-LAYOUT-OWNER]]"""
        self._check_rank(rank, "rank")
        return np.arange(rank, self.num_pages, self.cp_size)

    # -- checks -------------------------------------------------------------
    def _valid(self, slots: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Mask of non-padding slots; raises on any other out-of-range slot
        (``check=False``: trusts the caller, which reads nothing on the host)."""
        if slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slots must be int32 or int64, got {slots.dtype}")
        valid = slots != self.padding_value
        if check and slots.numel():
            lo = int(torch.where(valid, slots, 0).min())
            hi = int(slots.max())
            if lo < 0 or hi >= self.capacity:
                bad = slots[valid & ((slots < 0) | (slots >= self.capacity))]
                raise IndexError(
                    f"slot {int(bad[0])} is outside the layout "
                    f"[0, {self.capacity}) (padding {self.padding_value} excepted)"
                )
        return valid

    # -- translations ---------------------------------------------------------
    def owner_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Owner rank of each slot; padding maps to the padding value."""
        valid = self._valid(slots)
        own = owner_of(page_of(slots, self.slots_per_page), self.cp_size)
        return torch.where(valid, own, slots.new_tensor(self.padding_value))

    def _local(self, slots: torch.Tensor) -> torch.Tensor:
        """``(p // N) * S + s % S``: the slot within its owner's segment."""
        p = page_of(slots, self.slots_per_page)
        return (p // self.cp_size) * self.slots_per_page + (slots - p * self.slots_per_page)

    def _translate(self, slots: torch.Tensor, output_dtype, rank_major: bool, check: bool = True) -> torch.Tensor:
        valid = self._valid(slots, check)
        if self.cp_size == 1:
            return _cast(slots, output_dtype)
        out = self._local(slots)
        if rank_major:  # segments laid end to end: owner * slots_per_rank + local slot
            out = out + owner_of(page_of(slots, self.slots_per_page), self.cp_size) * self.slots_per_rank
        return _cast(torch.where(valid, out, slots), output_dtype)

    def translate_read_slots(
        self, slot_indices: torch.Tensor, *, output_dtype: torch.dtype | None = None, check: bool = True
    ) -> torch.Tensor:
        """Logical slots -> rank-major slots of the shared view:
        ``((p % N) * pages_per_rank + p // N) * S + s % S``. ``check=False``
        skips the range check (a host read), for slots validated once per
        batch (a forward plan's page table). [[RFC-0001:C-READ-PATH]]"""
        return self._translate(slot_indices, output_dtype, rank_major=True, check=check)

    def translate_write_slots(
        self, slot_indices: torch.Tensor, *, output_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logical slots -> slots in the owner's own segment:
        ``(p // N) * S + s % S``. [[RFC-0001:C-DIRECT-WRITE]]"""
        return self._translate(slot_indices, output_dtype, rank_major=False)

    def local_pages_and_mask(self, slot_indices: torch.Tensor, owner_rank: int):
        """For a writer: ``(local_slots, local_pages, owned)`` in one pass, where
        ``owned`` marks non-padding slots on pages ``owner_rank`` owns and the
        other two are meaningful where ``owned`` holds. [[RFC-0001:C-DIRECT-WRITE]]"""
        self._check_rank(owner_rank, "owner_rank")
        valid = self._valid(slot_indices)
        local = self._local(slot_indices)
        if self.cp_size == 1:
            return local, local // self.slots_per_page, valid
        owned = valid & (owner_of(page_of(slot_indices, self.slots_per_page), self.cp_size) == owner_rank)
        return local, local // self.slots_per_page, owned

    def owned_slot_mask(self, slot_indices: torch.Tensor, *, owner_rank: int, check: bool = True) -> torch.Tensor:
        """True where a slot is not padding and lies on a page ``owner_rank``
        owns (``check=False``: no range check, no host read)."""
        self._check_rank(owner_rank, "owner_rank")
        valid = self._valid(slot_indices, check)
        if self.cp_size == 1:
            return valid
        return valid & (owner_of(page_of(slot_indices, self.slots_per_page), self.cp_size) == owner_rank)

    def select_host_to_device_indices(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, *, owner_rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a host->device load: the pairs ``owner_rank`` loads, device side as
        local (write) slots. Only the owner loads a page. [[RFC-0001:C-HICACHE]]"""
        if host_indices.shape != device_indices.shape:
            raise ValueError("host_indices and device_indices must have the same shape")
        mask = self.owned_slot_mask(device_indices, owner_rank=owner_rank)
        return host_indices[mask], self.translate_write_slots(device_indices[mask])

    def select_device_to_host_indices(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        *,
        current_rank: int,
        io_rank: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a device->host backup: the IO rank copies every pair, reading the
        shared view (rank-major slots); every other rank copies nothing.
        [[RFC-0001:C-HICACHE]]"""
        if host_indices.shape != device_indices.shape:
            raise ValueError("host_indices and device_indices must have the same shape")
        self._check_rank(current_rank, "current_rank")
        self._check_rank(io_rank, "io_rank")
        if current_rank != io_rank:
            return host_indices[:0], device_indices[:0]
        return host_indices, self.translate_read_slots(device_indices)

    def _check_rank(self, rank: int, name: str) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"{name}={rank} is not a rank of a CP group of {self.cp_size}")
