"""The data plane's backend interface: what a forward asks of a kernel library.

A backend is chosen once per batch (:func:`cpkv.kernels.get`) and serves
every layer of it. Like FlashInfer's ``plan``/``run`` and SGLang's
``AttentionBackend``, the work splits in two:

* :meth:`Backend.plan` - once per batch and set of queries: everything that
  depends on the batch alone (which queries decode and which extend, their
  blocks, the slots a rank owns under the log-sum-exp split, the torch path's
  causal grouping). It may synchronise with the host; it runs before the first
  layer.
* the run methods - per layer, on a :class:`QueryPlan`, with no host
  synchronisation: :meth:`~Backend.store` (a family's new entries into this
  rank's segment), :meth:`~Backend.dense` (causal attention over each query's
  context), :meth:`~Backend.selected` (attention over selected slots),
  :meth:`~Backend.index_scores` (DSA's indexer) and :meth:`~Backend.merge`
  (partials over disjoint key sets).

Caches arrive as :class:`CacheView`: one layer of one family in the rank-major
view, with its stored format, so a backend reads a float tensor, bfloat16
bytes or scaled FP8 rows alike (decoded in the kernel, or on the gather of the
torch backend), and the group's memory as one buffer or as N per-rank
segments alike (a :class:`~cpkv.consumers.kv_view.SegmentTable` of their
bases: a kernel adds the owner's base, the torch backend gathers owner by
owner). A new kernel is one run method of each backend.

Two backends: :class:`cpkv.kernels.reference.TorchBackend` (the definition
every kernel must equal, any device) and
:class:`cpkv.kernels.triton_backend.TritonBackend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..consumers.kv_format import KVFormat
from ..consumers.kv_view import SegmentTable
from ..contract.layout import SharedKVLayout


@dataclass(frozen=True)
class CacheView:
    """One layer of one cache family as a backend reads or writes it, with its format.

    ``data``: the rows ``[rows, *row_shape]``: for a read, the group's
    rank-major view of every rank's segment, either one tensor (one buffer
    holds the group's memory) or a :class:`~cpkv.consumers.kv_view.SegmentTable`
    (the group's memory is N segments, one allocation per rank: the table of
    their bases); for a store, this rank's own segment (a tensor). ``fmt``:
    ``None``, a float tensor of ``shape`` values per slot; else ``uint8`` rows
    of ``fmt.bytes_per_slot``. [[RFC-0001:C-READ-PATH]]"""

    data: torch.Tensor | SegmentTable
    fmt: KVFormat | None
    shape: tuple[int, ...]

    @property
    def table(self) -> SegmentTable | None:
        """The segment table when the group's memory is N segments, else ``None``."""
        return self.data if isinstance(self.data, SegmentTable) else None

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """The values at rank-major row index ``rows`` (any shape, no padding):
        ``[*rows.shape, *shape]``, decoded to float32 when formatted. One
        ``index_select`` of one tensor; over a segment table, owner by owner
        (:func:`~cpkv.consumers.kv_view.gather_rows`: one host read of the
        owners' counts)."""
        flat = rows.reshape(-1)
        got = self.data[flat] if isinstance(self.data, SegmentTable) else self.data.index_select(0, flat)
        if self.fmt is not None:
            got = self.fmt.decode(got)
        return got.view(*rows.shape, *self.shape)


@dataclass(frozen=True)
class WriteIndex:
    """The entries one store writes: ``slots [W]`` logical (``-1``: an entry
    this rank does not write), and, when the batch was planned (ownership
    checked once), ``local [W']`` the slots in this rank's segment of the
    entries ``rows [W']`` it writes (int64), else ``None``."""

    slots: torch.Tensor
    local: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class ContextIndex:
    """Rank-major read index of the requests of some queries: ``read [b, L]``
    (int32/int64, padding clamped to 0), ``valid [b, L]`` (not padding),
    ``inv [T]`` each query's row,
    ``identity`` (``inv`` is ``0 .. b - 1``, so indexing by it would only
    copy), ``count`` the entries that are not padding (Python int, for the
    read counters)."""

    read: torch.Tensor
    valid: torch.Tensor
    inv: torch.Tensor
    identity: bool
    count: int

    @classmethod
    def build(cls, table: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor,
              layout: SharedKVLayout) -> "ContextIndex":
        """The index of ``table [B, L]``'s rows that ``q_req [T]`` names (each
        once), up to the furthest position ``q_pos [T]`` sees. Synchronises
        (once per batch)."""
        rows, inv = torch.unique(q_req, return_inverse=True)
        width = int(q_pos.max()) + 1 if q_pos.numel() else 0
        total = layout.cp_size * layout.slots_per_rank
        dtype = torch.int32 if total <= 2**31 - 1 else torch.int64
        read = layout.translate_read_slots(table[rows, :width], output_dtype=dtype)
        identity = inv.numel() == rows.numel() and bool((inv == torch.arange(inv.numel(), device=inv.device)).all())
        valid = read >= 0
        return cls(read.clamp(min=0), valid, inv, identity, int(valid.sum()))


@dataclass(frozen=True)
class QueryPlan:
    """Queries over a batch's page table, planned once per batch by a backend.

    ``table [B, L]`` logical slots by position (``-1``: padding), ``q_req
    [T]`` each query's row, ``q_pos [T]`` its position (it sees positions
    ``0 .. q_pos``); ``own_rank``: the rank whose slots alone are attended
    (the log-sum-exp split), ``-1`` for all; ``context``: the read index of
    the queries' rows (what a gathered read uses; its ``count`` feeds the
    counters); ``own_count``: under ``own_rank``, the owned entries of those
    rows; ``with_lse``: whether :meth:`Backend.dense` must return the
    log-sum-exp (the torch backend may skip it otherwise). Backends add their
    own fields."""

    layout: SharedKVLayout
    table: torch.Tensor
    q_req: torch.Tensor
    q_pos: torch.Tensor
    own_rank: int
    context: ContextIndex
    own_count: int
    with_lse: bool

    @property
    def num_queries(self) -> int:
        """T."""
        return self.q_req.shape[0]


def plan_fields(table: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, layout: SharedKVLayout,
                own_rank: int | None, with_lse: bool) -> dict:
    """The :class:`QueryPlan` fields every backend plans alike."""
    context = ContextIndex.build(table, q_req, q_pos, layout)
    own = -1 if own_rank is None else own_rank
    own_count = 0
    if own >= 0:
        rows = torch.unique(q_req)
        own_count = int(layout.owned_slot_mask(table[rows, :context.read.shape[1]], owner_rank=own).sum())
    return dict(layout=layout, table=table, q_req=q_req, q_pos=q_pos, own_rank=own, context=context,
                own_count=own_count, with_lse=with_lse or own >= 0)


def pack_left(keep: torch.Tensor, values: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """The entries of ``values [R, L]`` where ``keep [R, L]``, packed left in
    their order in each row, ``-1`` after: ``[R, width]`` (default: the most
    kept in a row, which reads the count on the host; give ``width`` >= that
    to stay on the device: a stable sort, no synchronisation)."""
    if width is None:
        width = int(keep.sum(1).max()) if keep.numel() else 0
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]
    out = torch.where(keep.gather(1, order), values.gather(1, order), -1)
    if out.shape[1] < width:  # wider than the rows: -1 after
        out = torch.cat([out, out.new_full((out.shape[0], width - out.shape[1]), -1)], 1)
    return out


def owned_positions(table: torch.Tensor, layout: SharedKVLayout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context positions of ``table [B, L]`` whose slots rank ``rank``
    owns, packed left (``-1`` after), and their slots: ``(pos [B, W], slots
    [B, W])``, ``W`` the most in a row. Synchronises (once per batch)."""
    owned = layout.owned_slot_mask(table, owner_rank=rank)
    pos = pack_left(owned, torch.arange(table.shape[1], device=table.device).expand_as(table))
    return pos, torch.where(pos >= 0, table.gather(1, pos.clamp(min=0)), layout.padding_value)


class Backend(ABC):
    """A data-plane backend: :meth:`plan` once per batch, the run methods per layer.

    Run methods take their arguments checked (by :mod:`cpkv.kernels`'
    functions, or planned by a forward) and never synchronise with the host.
    ``q [T, H, D]`` is the query in its own dtype; outputs are in q's dtype,
    log-sum-exps float32 (``-inf`` and an output of 0 for a query that sees
    nothing)."""

    name: str

    def unreadable(self, fmt: KVFormat | None) -> str | None:
        """Why this backend cannot read and write a cache stored as ``fmt`` in
        place, or ``None`` (every format, for the torch backend)."""
        return None

    @abstractmethod
    def plan(self, table: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, layout: SharedKVLayout, *,
             own_rank: int | None = None, with_lse: bool = True) -> QueryPlan:
        """Plan queries ``q_req [T]``, ``q_pos [T]`` over ``table [B, L]``
        (every tensor on the cache's device), only ``own_rank``'s slots when
        given. May synchronise: call it once per batch."""

    @abstractmethod
    def store(self, segment: CacheView, values: torch.Tensor, write: WriteIndex, layout: SharedKVLayout, rank: int,
              report: torch.Tensor) -> None:
        """Write ``values [W, *shape]`` (float, any dtype: cast or encoded to
        the segment's format) at ``write`` into rank ``rank``'s ``segment``;
        padding skipped; a slot ``rank`` does not own is not written and is
        added to ``report`` (``int32 [2]``: refused count, first refused
        index; the caller initialises it to ``[0, W]``)."""

    @abstractmethod
    def dense(self, plan: QueryPlan, q: torch.Tensor, k: CacheView, v: CacheView, scaling: float,
              value_dims: int | None = None, *, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of ``q [T, H, D]`` over each query's context in
        ``k [.., Hkv, D]`` / ``v [.., Hkv, Dv]`` (the first ``value_dims`` of
        v's values when given; a one-head family such as the MLA latent has
        ``Hkv = 1``). Returns ``out [T, H, Dv]`` and ``lse [T, H]`` (``None``
        when the plan was made without ``with_lse`` and the backend skipped
        it). ``splits``: the context chunks of a decode (a test's choice;
        default the backend's)."""

    @abstractmethod
    def selected(self, plan: QueryPlan, q: torch.Tensor, kv: CacheView, slots: torch.Tensor, scaling: float,
                 value_dims: int, *, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed attention of ``q [T, H, r + dr]`` over the logical ``slots
        [T, K]`` each query selected (``-1``: none), keys the whole row of
        ``kv``, values its first ``value_dims``; only ``plan.own_rank``'s
        slots when set. Returns ``out [T, H, value_dims]``, ``lse [T, H]``."""

    @abstractmethod
    def index_scores(self, plan: QueryPlan, q: torch.Tensor, weights: torch.Tensor, keys: CacheView, scale: float,
                     *, splits: int | None = None) -> torch.Tensor:
        """DSA's indexer: ``sum_h weights[t, h] * relu(scale * q[t, h] . key)``
        over each query's visible context, ``[T, L]`` float32, ``-inf`` where
        not visible."""

    @abstractmethod
    def merge(self, outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact merge of ``outs [R, T, H, D]``, ``lses [R, T, H]`` (float32)
        over disjoint key sets: ``(out [T, H, D], lse [T, H])``."""

    def context(self, plan: QueryPlan, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query's whole context in ``view``, gathered: ``(values [T, L,
        *shape], visible [T, L])`` (positions ``0 .. q_pos``), the input of a
        score callable that no kernel computes. The same on every backend."""
        c = plan.context
        values = view.decode(c.read)
        if not c.identity:
            values = values[c.inv]
        L = values.shape[1]
        return values, torch.arange(L, device=plan.q_pos.device)[None, :] <= plan.q_pos[:, None]


__all__ = ["Backend", "ContextIndex", "CacheView", "QueryPlan", "WriteIndex", "owned_positions", "pack_left",
           "plan_fields"]
