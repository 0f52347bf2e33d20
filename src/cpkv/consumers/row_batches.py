"""Batches of requests in fixed rows of a page table, allocated without a
scheduler: what tests and benchmarks drive a forward with.

A scheduler keeps each request's row and length and writes the one
:class:`~cpkv.consumers.page_table.PageTable` from each allocation; a caller
without one (a benchmark's fixed batch, a test's few requests) keeps the same
three things here: the allocator, the table, and each row's length. The
forward (:class:`~cpkv.runtime.runner.CPRunner`) reads the table whoever
wrote it. Every rank builds the same one and makes the same calls, so every
rank's table is the same ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
"""

from __future__ import annotations

import torch

from ..contract.allocation import Allocation
from ..contract.allocator import OwnerLaneAllocator
from .page_table import PageTable


class RowBatches:
    """``rows`` requests in rows ``0 .. rows - 1`` of ``table`` (a
    :class:`PageTable` of ``rows`` x ``width``, padding ``padding``) over
    ``allocator``; ``lens[row]`` (int64 ``[rows]``) counts the positions each
    row holds. Rows are named by the caller; a row is empty (length 0) until
    its first allocation and after :meth:`free`."""

    def __init__(self, allocator: OwnerLaneAllocator, rows: int, width: int, padding: int = -1):
        self.allocator = allocator
        self.table = PageTable(rows, width, padding)
        self.lens = torch.zeros(rows, dtype=torch.int64)

    def last_loc(self, rows: torch.Tensor) -> torch.Tensor:
        """Slot of each row's last position (-1 for an empty row), ``[len(rows)]``."""
        lens = self.lens[rows]
        return torch.where(lens > 0, self.table.req_to_token[rows, (lens - 1).clamp(min=0)], -1)

    def allocate(self, rows: list[int], new_lens: list[int], decode: bool = False) -> Allocation:
        """``new_lens[i]`` more positions for row ``rows[i]`` (one each with
        ``decode``), allocated as one extend (or decode) batch continuing each
        row's chain, entered into the table and the lengths. Returns the
        :class:`Allocation`. Raises ``MemoryError`` naming the per-lane
        deficit when the allocator refuses ("not now"; nothing changed), and
        what the allocator raises ("never")."""
        r = torch.tensor(rows, dtype=torch.int64)
        prefix = self.lens[r]
        seq = prefix + torch.tensor(new_lens, dtype=torch.int64)
        last = self.last_loc(r)
        alloc = (self.allocator.allocate_decode(seq, last) if decode
                 else self.allocator.allocate_extend(prefix, seq, last))
        if alloc is None:
            raise MemoryError(f"KV cache full: pages missing per lane {self.allocator.last_deficit.tolist()}")
        self.table.write_allocation(r, alloc)
        self.lens[r] = alloc.seq_lens
        return alloc

    def free(self, row: int) -> torch.Tensor:
        """Empty ``row``: its slots go back to the allocator; returns them
        (a pool forgets what it wrote there with ``pool.release(slots)``)."""
        n = int(self.lens[row])
        slots = self.table.req_to_token[row, :n].clone()
        self.table.req_to_token[row, :n] = self.table.padding
        self.lens[row] = 0
        self.allocator.free(slots)
        return slots
