"""What one scheduler step asks of the executor: typed entries, in order.

A :class:`StepPlan` lists :class:`Backup` (device -> host, by the IO rank),
:class:`Load` (host -> device, by each owner), :class:`Copy` (device ->
device, by the destination's owner) and :class:`Arrival` (KV computed by
another group) entries, then the step's one :class:`Forward`: the decodes,
then the prefill chunks, in one pass (SGLang's mixed chunk). The slots of
every request live in the scheduler's one
:class:`~cpkv.consumers.page_table.PageTable`; the forward names its rows there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..consumers.page_table import PageTable
from ..contract.allocation import Allocation

if TYPE_CHECKING:
    from .records import Request


@dataclass(frozen=True, eq=False)
class Backup:
    """Device slots ``device [n]`` -> host slots ``host [n]`` (int64), copied by
    the IO rank before the device pages are reused. [[RFC-0001:C-HICACHE]]"""

    device: torch.Tensor
    host: torch.Tensor


@dataclass(frozen=True, eq=False)
class Load:
    """Host slots ``host [n]`` -> new device slots ``device [n]`` of
    ``request``, each owner writing the pages it owns. [[RFC-0001:C-HICACHE]]"""

    host: torch.Tensor
    device: torch.Tensor
    request: "Request"


@dataclass(frozen=True, eq=False)
class Copy:
    """A partly matched page's KV ``src [n]`` -> the private copy ``dst [n]``
    of ``request`` (the destination's owner reads through the shared view).
    [[RFC-0001:C-PREFIX-CACHE]]"""

    src: torch.Tensor
    dst: torch.Tensor
    request: "Request"


@dataclass(frozen=True, eq=False)
class Arrival:
    """Remote prefill: the KV of positions ``start ..`` of ``request`` arrives
    from another group into the new device ``slots [n]``, written by each owner."""

    request: "Request"
    start: int
    slots: torch.Tensor


@dataclass
class Forward:
    """One forward pass: ``requests`` in batch order, their page-table ``rows
    [bs]`` (int64) in ``table``, the ``alloc`` of their new slots, the new
    token ``ids [E]`` (in ``alloc.out_cache_loc`` order), whether each
    request's last token gives a new token (``sample``: a prefill chunk that
    ends before the prompt does not), and ``decodes``: how many of the
    requests, first in the batch, decode one token (the rest are prefill
    chunks). [[RFC-0001:C-FLATTENED-ORDER]]"""

    requests: list
    rows: torch.Tensor
    alloc: Allocation
    ids: torch.Tensor
    sample: list
    decodes: int
    table: PageTable

    @property
    def decode(self) -> bool:
        """Whether every request decodes (the forward then runs the decode split)."""
        return self.decodes == len(self.requests)

    @property
    def kind(self) -> str:
        """``"decode"`` (decodes only), ``"mixed"`` (decodes and prefill chunks) or ``"prefill"``."""
        return "decode" if self.decode else "mixed" if self.decodes else "prefill"

    @classmethod
    def mixed(cls, decode: "Forward | None", prefill: "Forward | None") -> "Forward | None":
        """One forward of ``decode``'s requests then ``prefill``'s (either may
        be ``None``): the decodes ride in the prefill pass as one-token
        extends; the allocation is the one a single call would have made
        (:meth:`Allocation.concat`)."""
        if decode is None or prefill is None:
            return decode or prefill
        return cls(decode.requests + prefill.requests, torch.cat([decode.rows, prefill.rows]),
                   Allocation.concat(decode.alloc, prefill.alloc), torch.cat([decode.ids, prefill.ids]),
                   decode.sample + prefill.sample, decode.decodes + prefill.decodes, decode.table)


@dataclass
class StepPlan:
    """What the executor does in one step, in this order: ``backups``,
    ``loads``, ``copies``, ``arrivals`` (lists of the entries above), then
    the step's ``forward`` (``None``: nothing to compute)."""

    step: int
    backups: list[Backup] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)
    forward: Forward | None = None

    def forwards(self) -> list[Forward]:
        """The step's forwards: ``[forward]``, or none."""
        return [] if self.forward is None else [self.forward]

    def drop(self, r: "Request") -> None:
        """Forget what was planned for a request preempted or cancelled in this step."""
        self.copies = [c for c in self.copies if c.request is not r]
        self.loads = [x for x in self.loads if x.request is not r]
        self.arrivals = [x for x in self.arrivals if x.request is not r]
