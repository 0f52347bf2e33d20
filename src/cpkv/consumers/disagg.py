"""W7: prefill -> decode transfer between CP groups of different sizes.

A request prefilled by a group of ``N_p`` ranks continues decoding in a group of
``N_d`` ranks. The decode group allocates the request's slots with its own
owner-lane allocator; this module pairs each source slot with its destination,
by sequence position, as ``(src_rank, src_local) -> (dst_rank, dst_local)``,
each side through its own layout ([[RFC-0001:C-DISAGG]]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.errors import UnsupportedPagePlan
from ..contract.layout import SharedKVLayout


@dataclass(frozen=True)
class TransferPairs:
    """One row per transferred slot: who sends what, who receives it where."""

    src_rank: torch.Tensor
    src_local: torch.Tensor
    dst_rank: torch.Tensor
    dst_local: torch.Tensor

    def between(self, src_rank: int, dst_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local slots that ``src_rank`` sends to ``dst_rank`` (source, destination)."""
        m = (self.src_rank == src_rank) & (self.dst_rank == dst_rank)
        return self.src_local[m], self.dst_local[m]


def transfer_pairs(
    src: SharedKVLayout, dst: SharedKVLayout, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> TransferPairs:
    """Pair a request's slots in the prefill group with its slots in the decode
    group, position by position. Both sides keep their in-page offset, so the
    page size must agree."""
    if src.slots_per_page != dst.slots_per_page:
        raise UnsupportedPagePlan(
            "page-size-mismatch", f"prefill page size {src.slots_per_page} != decode page size {dst.slots_per_page}"
        )
    if src_slots.shape != dst_slots.shape:
        raise UnsupportedPagePlan("mismatched-lengths", f"{src_slots.numel()} source slots, {dst_slots.numel()} destination")
    S = src.slots_per_page
    if bool((src_slots % S != dst_slots % S).any()):
        i = int(torch.nonzero(src_slots % S != dst_slots % S)[0])
        raise UnsupportedPagePlan("offset-mismatch", f"position {i}: source offset {int(src_slots[i]) % S}, "
                                  f"destination offset {int(dst_slots[i]) % S}")
    return TransferPairs(
        src_rank=src.owner_of_slots(src_slots),
        src_local=src.translate_write_slots(src_slots),
        dst_rank=dst.owner_of_slots(dst_slots),
        dst_local=dst.translate_write_slots(dst_slots),
    )
