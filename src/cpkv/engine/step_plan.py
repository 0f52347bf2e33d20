"""What one scheduler step asks of the executor: typed entries, in order.

A :class:`StepPlan` lists :class:`Backup` (device -> host, by the IO rank),
:class:`Load` (host -> device, by each owner), :class:`Copy` (device ->
device, by the destination's owner) and :class:`Arrival` (KV computed by
another group) entries, then the step's :class:`Forward` passes (a decode, a
prefill). The slots of every request live in the scheduler's one
:class:`~cpkv.consumers.page_table.PageTable`; a forward names its rows there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from ..consumers.page_table import PageTable
from ..contract.allocation import Allocation

if TYPE_CHECKING:
    from .records import Request


class _Entry:
    """A step entry. It also unpacks in field order (``src, dst, request =
    copy``), as the positional tuples it replaced did, for callers not yet
    moved to the field names."""

    def __iter__(self):
        return iter(tuple(getattr(self, f.name) for f in fields(self)))


@dataclass(frozen=True, eq=False)
class Backup(_Entry):
    """Device slots ``device [n]`` -> host slots ``host [n]`` (int64), copied by
    the IO rank before the device pages are reused. [[RFC-0001:C-HICACHE]]"""

    device: torch.Tensor
    host: torch.Tensor


@dataclass(frozen=True, eq=False)
class Load(_Entry):
    """Host slots ``host [n]`` -> new device slots ``device [n]`` of
    ``request``, each owner writing the pages it owns. [[RFC-0001:C-HICACHE]]"""

    host: torch.Tensor
    device: torch.Tensor
    request: "Request"


@dataclass(frozen=True, eq=False)
class Copy(_Entry):
    """A partly matched page's KV ``src [n]`` -> the private copy ``dst [n]``
    of ``request`` (the destination's owner reads through the shared view).
    [[RFC-0001:C-PREFIX-CACHE]]"""

    src: torch.Tensor
    dst: torch.Tensor
    request: "Request"


@dataclass(frozen=True, eq=False)
class Arrival(_Entry):
    """Remote prefill: the KV of positions ``start ..`` of ``request`` arrives
    from another group into the new device ``slots [n]``, written by each owner."""

    request: "Request"
    start: int
    slots: torch.Tensor


@dataclass
class Forward:
    """One forward pass: ``requests`` in batch order, their page-table ``rows
    [bs]`` in ``table``, the ``alloc`` of their new slots, the new token
    ``ids [E]`` (in ``alloc.out_cache_loc`` order), whether each request's
    last token gives a new token (``sample``: a prefill chunk that ends before
    the prompt does not) and whether it is a decode."""

    requests: list
    rows: torch.Tensor
    alloc: Allocation
    ids: torch.Tensor
    sample: list
    decode: bool
    table: PageTable | None = None


@dataclass
class StepPlan:
    """What the executor does in one step, in this order: ``backups``,
    ``loads``, ``copies``, ``arrivals`` (lists of the entries above), then the
    ``decode`` and ``prefill`` forwards."""

    step: int
    backups: list[Backup] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)
    decode: Forward | None = None
    prefill: Forward | None = None

    def forwards(self) -> list[Forward]:
        """The forwards of the step, decode first."""
        return [b for b in (self.decode, self.prefill) if b is not None]

    batches = forwards  # the former name, for callers not yet moved (engine/disagg.py)

    def drop(self, r: "Request") -> None:
        """Forget what was planned for a request preempted or cancelled in this step."""
        self.copies = [c for c in self.copies if c.request is not r]
        self.loads = [x for x in self.loads if x.request is not r]
        self.arrivals = [x for x in self.arrivals if x.request is not r]
