"""One page table per group, as SGLang's ``ReqToTokenPool``.

``req_to_token[row, pos]`` (int64, host) is the logical slot of position
``pos`` of the request in ``row``; padding where nothing is written. A row is
taken per request (:meth:`PageTable.take_row`), written once from each
allocation (:meth:`PageTable.write`, :meth:`PageTable.write_allocation`) and
given back when the request ends (:meth:`PageTable.free_row`, O(1): the
positions it held are reset to padding when the row is next taken, so a
step in which many long requests end costs nothing per token). The scheduler
keeps each request's row index and length; the forward reads the rows it
computes. Nothing else holds a request's slots, so nothing copies them
between tables. Every rank keeps the same table, as it keeps the same
allocator ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
"""

from __future__ import annotations

import numpy as np
import torch

from ..contract.allocation import Allocation


class PageTable:
    """``rows`` x ``width`` slots, padding ``padding`` (negative) where unwritten.

    Rows and width grow on demand (a request longer than ``width``, more live
    requests than ``rows``); growth keeps every row's content. A row is all
    padding when it is taken. [[RFC-0001:C-DOWNSTREAM-CONTRACT]]
    """

    def __init__(self, rows: int, width: int, padding: int = -1):
        if rows < 1 or width < 1:
            raise ValueError(f"rows and width must be >= 1, got {rows}, {width}")
        if padding >= 0:
            raise ValueError(f"padding must be negative, got {padding}")
        self.padding = padding
        self.req_to_token = torch.full((rows, width), padding, dtype=torch.int64)
        self._free = list(range(rows - 1, -1, -1))  # lowest row on top
        self._dirty = [0] * rows  # per row: positions a freed row still holds (reset when taken)
        self._taken = [False] * rows

    @property
    def width(self) -> int:
        """Positions a row holds now."""
        return self.req_to_token.shape[1]

    def take_row(self) -> int:
        """A free row (all padding), the lowest first; the table grows when none is free."""
        if not self._free:
            n = self.req_to_token.shape[0]
            self._grow(2 * n, self.width)
            self._free = list(range(2 * n - 1, n - 1, -1))
            self._dirty += [0] * n
            self._taken += [False] * n
        row = self._free.pop()
        if self._dirty[row]:
            self.req_to_token[row, : self._dirty[row]] = self.padding
            self._dirty[row] = 0
        self._taken[row] = True
        return row

    def free_row(self, row: int, used: int | None = None) -> None:
        """Give ``row`` back. ``used``: how many leading positions were
        written (the whole row by default); they are reset to padding when the
        row is next taken, so this is O(1). Raises ``ValueError`` for a row that
        is not taken or a ``used`` outside ``0 .. width``."""
        self.free_rows([row], None if used is None else [used])

    def free_rows(self, rows: list[int], used: list[int] | None = None) -> None:
        """:meth:`free_row` for many rows (``used[i]`` for ``rows[i]``), O(1)
        each; all are checked before any is freed, and a row named twice is
        refused (``ValueError``, nothing changed)."""
        width, taken = self.width, self._taken
        used = [width] * len(rows) if used is None else used
        if len(used) != len(rows):
            raise ValueError(f"{len(rows)} rows but {len(used)} used")
        for row, u in zip(rows, used):
            if not (isinstance(row, int) and 0 <= row < len(taken) and taken[row]):
                raise ValueError(f"row {row} is not taken")
            if not 0 <= u <= width:
                raise ValueError(f"used must lie in 0..{width}, got {u}")
        if len(set(rows)) != len(rows):
            raise ValueError("a row is named twice")
        for row, u in zip(rows, used):
            taken[row] = False
            self._dirty[row] = u
        self._free += rows

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Positions ``start .. start + len(slots) - 1`` of ``row`` hold ``slots [n]``."""
        end = start + slots.numel()
        if end > self.width:
            self._grow(self.req_to_token.shape[0], max(end, 2 * self.width))
        self.req_to_token[row, start:end] = slots

    def write_allocation(self, rows: torch.Tensor, alloc: Allocation) -> None:
        """Enter an allocation's new slots: request i of ``alloc`` lives in
        ``rows[i]`` (int64 ``[bs]``); one vectorised scatter, no loop per
        request. [[RFC-0001:C-FLATTENED-ORDER]]"""
        ext, prefix, seq = alloc.to_host("extend_lens"), alloc.to_host("prefix_lens"), alloc.to_host("seq_lens")
        if seq.size and int(seq.max()) > self.width:
            self._grow(self.req_to_token.shape[0], max(int(seq.max()), 2 * self.width))
        req = np.repeat(np.arange(ext.size), ext)
        pos = np.arange(req.size) - alloc.to_host("extend_start_loc")[req] + prefix[req]
        rows = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        self.scatter(rows[req], pos, alloc.out_cache_loc.cpu().numpy())

    def scatter(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """``req_to_token[rows[i], positions[i]] = slots[i]`` for every i (int64
        ``[n]`` each, within the table's width): one numpy scatter, as a decode
        step writes one slot per request (torch's ``index_put`` on a host
        tensor may wake its thread pool for a few slots)."""
        self.req_to_token.numpy()[rows, positions] = slots

    def gather(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``req_to_token[rows[i], positions[i]]`` for every i (int64 ``[n]``, a copy)."""
        return self.req_to_token.numpy()[rows, positions]

    def slots(self, row: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """A view of positions ``start .. end - 1`` of ``row`` (to the row's end by default)."""
        return self.req_to_token[row, start:end]

    def _grow(self, rows: int, width: int) -> None:
        old = self.req_to_token
        self.req_to_token = torch.full((rows, width), self.padding, dtype=torch.int64)
        self.req_to_token[: old.shape[0], : old.shape[1]] = old
