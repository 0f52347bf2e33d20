"""W3/W4: the shared KV pool of one rank — direct write, fence, read.

The pool of a CP group is one buffer, rank-major: rank k's segment holds the
``pages_per_rank`` pages that rank k owns. Each rank writes only into its own
segment ([[RFC-0001:C-DIRECT-WRITE]]) and reads the whole buffer through the
rank-major view, after a fence that separates a layer's writes from its reads
([[RFC-0001:C-READ-PATH]]). Slot arithmetic is :class:`SharedKVLayout`'s.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..contract.allocator import ExtendAllocation
from ..contract.errors import ContractViolation
from ..contract.layout import SharedKVLayout


class SharedKVPool:
    """One rank's handle on the group's shared KV buffer.

    ``buffer`` has shape ``[2, num_layers, cp_size * slots_per_rank, kv_heads,
    head_dim]`` (K then V), laid out rank-major; it is the same memory in every
    rank. ``fence`` is called between a layer's writes and its reads (a barrier
    on the CP group; a no-op for a single rank).
    """

    def __init__(self, layout: SharedKVLayout, rank: int, buffer: torch.Tensor,
                 fence: Callable[[], None] | None = None):
        if buffer.dim() != 5 or buffer.shape[0] != 2 or buffer.shape[2] != layout.cp_size * layout.slots_per_rank:
            raise ValueError(f"buffer of shape {tuple(buffer.shape)} does not match {layout}")
        if not 0 <= rank < layout.cp_size:
            raise ValueError(f"rank {rank} is not in a CP group of {layout.cp_size}")
        self.layout, self.rank, self.buffer = layout, rank, buffer
        spr = layout.slots_per_rank
        self._own = buffer[:, :, rank * spr : (rank + 1) * spr]  # write view: this rank's segment
        self._fence = fence or (lambda: None)
        self._written = torch.zeros(layout.pages_per_rank, dtype=torch.bool)

    @property
    def num_layers(self) -> int:
        """Layers in the buffer."""
        return self.buffer.shape[1]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K and V over all layers."""
        b = self.buffer
        return 2 * b.shape[1] * self.layout.slots_per_page * b.shape[3] * b.shape[4] * b.element_size()

    def bytes_held(self) -> int:
        """KV bytes this rank holds: pages of its segment it has written, live or not yet freed."""
        return int(self._written.sum()) * self.page_bytes

    def release(self, slots: torch.Tensor) -> None:
        """Forget the pages of ``slots`` that this rank owns (after the allocator freed them)."""
        mine = slots[self.layout.owned_slot_mask(slots, owner_rank=self.rank)]
        self._written[self.layout.translate_write_slots(mine) // self.layout.slots_per_page] = False

    # -- W3: direct write ---------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of ``slots`` (logical) into this rank's own segment.

        Padding slots are skipped. A slot this rank does not own raises
        :class:`ContractViolation` and nothing is written.
        """
        loc, local_page, owned = self.layout.local_pages_and_mask(slots, self.rank)
        if not bool(owned.all()):
            valid = slots != self.layout.padding_value
            if bool((owned | ~valid).all()):  # only padding besides owned slots: skip it
                loc, local_page, k, v = loc[valid], local_page[valid], k[valid], v[valid]
            else:
                bad = slots[valid & ~owned][:1]
                owner = int(self.layout.owner_of_slots(bad))
                bad = int(bad)
                raise ContractViolation(
                    f"rank {self.rank} asked to write slot {bad}, which rank {owner} owns; "
                    "only the owner of a page writes it"
                )
        self._own[0, layer].index_copy_(0, loc, k.to(self.buffer.dtype))
        self._own[1, layer].index_copy_(0, loc, v.to(self.buffer.dtype))
        self._written[local_page.cpu()] = True

    def fence(self) -> None:
        """Separate this layer's writes from its reads on every rank."""
        self._fence()

    # -- W4: read -------------------------------------------------------------------
    def read_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Translate a page table or slot list to rank-major read indices, once
        per batch: int32 when every value fits, else int64. Padding stays."""
        dtype = torch.int32 if self.buffer.shape[2] <= 2**31 - 1 else torch.int64
        return self.layout.translate_read_slots(slots, output_dtype=dtype)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at rank-major ``index`` (no padding allowed) from the shared view."""
        flat = index.reshape(-1)
        k = self.buffer[0, layer].index_select(0, flat)
        v = self.buffer[1, layer].index_select(0, flat)
        shape = (*index.shape, *self.buffer.shape[3:])
        return k.view(shape), v.view(shape)

    def check(self, alloc: ExtendAllocation) -> None:
        """Validate an allocation result against this pool's layout before use."""
        alloc.validate(self.layout)


def buffer_shape(layout: SharedKVLayout, num_layers: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of the shared buffer of a CP group."""
    return (2, num_layers, layout.cp_size * layout.slots_per_rank, kv_heads, head_dim)


def buffer_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a buffer of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
