"""The torch backend: the definition every kernel of :mod:`cpkv.kernels` must
equal, and the data plane of a forward on any device torch runs on.

Reads gather the rows of each query's context through the rank-major view
(:class:`~cpkv.kernels.backend.CacheView.decode`: a byte format decoded to
float32 on the gather) and attend in float32 math:

* :func:`attend` - each query over its own key set, with the log-sum-exp (the
  CPU flash kernel where it fits, else plain softmax);
* :func:`gathered_attention` - causal GQA of a batch's queries over their
  requests' gathered contexts, grouped once per batch by :func:`query_groups`
  (the one-query rows unpadded, the others one padded batch with a causal mask);
* :func:`merge_partials` - the exact log-sum-exp merge;
* :func:`indexer_scores` - DSA's lightning-indexer formula;
* :class:`TorchBackend` - the :class:`~cpkv.kernels.backend.Backend` over them.

Vectorised: no loop per token, page or request. Slot arithmetic is
:class:`~cpkv.contract.layout.SharedKVLayout`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..contract.layout import SharedKVLayout, ranges
from .backend import Backend, CacheView, QueryPlan, WriteIndex, owned_positions, pack_left, plan_fields

#: a part of a batch's queries or context rows: a slice when they lie contiguous (a view, no copy), else
#: the int64 indices
Rows = slice | torch.Tensor


#: :func:`query_groups` pads the S one-query rows of a mixed batch after all (one padded batch, no kernel of
#: their own) while the query-key pairs that adds, ``S * (width - 1) * K`` (``K``: the keys up to the furthest
#: position a query sees), stay within this many: below
#: about that, a second kernel call costs more than the padding (measured on the CPU with 4 heads of 16,
#: chunks of 16 to 64 queries, contexts of 200 to 1000 keys)
PAD_LIMIT = 20_000


class QueryGroups(NamedTuple):
    """How :func:`gathered_attention` batches one batch's queries by request,
    planned once per batch (:func:`query_groups`) so that every layer's call
    reads nothing back from the device. The rows with exactly one query (a
    decode, or a one-token extend riding in a prefill step) are not padded:
    they run on :func:`attend`'s grouped kernel, one query over its own row;
    only the rows with more queries run as one padded batch, as wide as the
    widest of *them* (the one-query rows join it only where that padding is
    small: :data:`PAD_LIMIT`). A part's queries and rows are a ``slice`` when
    contiguous (read in place), else int64 index tensors; an empty part is
    ``slice(0, 0)``.

    * ``shape``: ``(T, B, L)``, the queries, context rows and context length
      planned for;
    * ``single_q``, ``single_rows`` ``[S]``: the queries that are their row's
      only query, and their rows; ``visible [S, Ls]`` (bool): the keys each
      sees (causal), over the first ``Ls`` keys (the furthest any of them
      sees, when that is at most 7/8 of ``L``, else ``L``), on the queries'
      device;
    * ``multi_q [Tm]``, ``multi_rows [M]``: the other queries, and their rows
      (ascending: those with two or more queries, and any one-query rows
      padded after all); ``slot [Tm]`` (int64, or a slice when no query is
      padded): where each goes in the row-major padded ``[M, width]``
      queries; ``width``: the most queries of one such row (0 when ``M`` is
      0); ``mask [M, width, Lm]`` (bool): causal over the first ``Lm`` keys
      (chosen as ``Ls``), a padded query seeing key 0 (so no row is empty;
      its output is dropped).

    ``S + Tm = T``; a pure decode batch (query i on row i) is
    ``single_q = single_rows = slice(0, T)`` and no multi part.
    """

    shape: tuple[int, int, int]
    single_q: Rows
    single_rows: Rows
    visible: torch.Tensor
    multi_q: Rows
    multi_rows: Rows
    slot: Rows
    width: int
    mask: torch.Tensor


def _rows(idx: np.ndarray, dev: torch.device) -> Rows:
    """``idx`` as a slice when it is ``a, a+1, ..`` (or empty), else an int64 tensor on ``dev``."""
    n = idx.size
    if n == 0 or (idx[-1] - idx[0] == n - 1 and np.array_equal(idx, np.arange(idx[0], idx[0] + n))):
        return slice(int(idx[0]) if n else 0, int(idx[0]) + n if n else 0)
    return torch.from_numpy(idx).to(dev)


def query_groups(q_req: torch.Tensor, q_pos: torch.Tensor, B: int, L: int,
                 pad_limit: int = PAD_LIMIT) -> QueryGroups:
    """The :class:`QueryGroups` of queries ``q_req [T]`` (the context row of
    each, any order) at positions ``q_pos [T]`` over ``B`` context rows of
    length ``L``, both integer tensors on the device the attention runs on.
    The one-query rows of a mixed batch get a kernel of their own unless
    padding them adds at most ``pad_limit`` query-key pairs (0: always their
    own). Reads the queries on the host (one synchronisation): call it once
    per batch.
    Raises ``ValueError`` when the two are not 1-D of one length, a row is
    outside ``0 .. B-1`` or a position outside ``0 .. L-1``."""
    if q_req.dim() != 1 or q_pos.shape != q_req.shape:
        raise ValueError(f"q_req and q_pos must be 1-D of one length, got {tuple(q_req.shape)} and "
                         f"{tuple(q_pos.shape)}")
    dev, T = q_req.device, q_req.numel()
    req, pos = torch.stack([q_req.to(torch.int64), q_pos.to(torch.int64)]).cpu().numpy()
    if T and (req.min() < 0 or req.max() >= B):
        raise ValueError(f"q_req must index the {B} context rows, got rows {req.min()} .. {req.max()}")
    if T and (pos.min() < 0 or pos.max() >= L):
        raise ValueError(f"q_pos must lie in the {L} context positions, got {pos.min()} .. {pos.max()}")
    counts = np.bincount(req, minlength=B)
    single = counts[req] == 1
    wide = int(counts.max(initial=0))
    if single.any() and wide > 1 and single.sum() * (wide - 1) * (int(pos.max()) + 1) <= pad_limit:
        single[:] = False  # padding the one-query rows costs less than a kernel of their own
    s_q, m_q = np.flatnonzero(single), np.flatnonzero(~single)
    m_rows, m_of = np.unique(req[m_q], return_inverse=True)  # the padded rows; each query's one
    m_counts = counts[m_rows]
    width = int(m_counts.max()) if m_rows.size else 0
    j = np.empty(m_q.size, dtype=np.int64)  # each padded query's place in its row, in query order
    j[np.argsort(m_of, kind="stable")] = ranges(np.zeros_like(m_counts), m_counts)
    Ls = _keys(pos[s_q], L)
    Lm = _keys(pos[m_q], L)
    visible = torch.arange(Ls, device=dev)[None, :] <= torch.from_numpy(pos[s_q]).to(dev)[:, None]
    padded = np.full((m_rows.size, width), -1, dtype=np.int64)
    padded[m_of, j] = pos[m_q]
    padded = torch.from_numpy(padded).to(dev)
    mask = torch.arange(Lm, device=dev)[None, None, :] <= padded[:, :, None]
    if Lm:
        mask[:, :, 0] |= padded < 0  # padded query rows see one key, so no row is empty; discarded below
    return QueryGroups((T, B, L), _rows(s_q, dev), _rows(req[s_q], dev), visible, _rows(m_q, dev),
                       _rows(m_rows, dev), _rows(m_of * width + j, dev), width, mask)


def _keys(pos: np.ndarray, L: int) -> int:
    """The context keys a part of queries at ``pos`` reads: up to the furthest
    it sees, when that drops an eighth of the ``L`` or more (a slice costs more
    than a few masked keys); 0 for no query."""
    n = int(pos.max()) + 1 if pos.size else 0
    return n if n <= L - L // 8 else L


def gathered_attention(q: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, scaling: float, groups: QueryGroups | None = None) -> torch.Tensor:
    """Causal GQA attention of queries over their requests' gathered context.

    ``q [T, H, D]`` are the queries this rank computes; ``q_req[i]`` indexes
    the row of ``k_ctx [B, L, Hkv, D]``, ``v_ctx [B, L, Hkv, Dv]`` holding
    token i's request context in position order, and ``q_pos[i]`` is its
    position: it attends to context positions ``0 .. q_pos[i]``. Returns
    ``[T, H, Dv]`` in ``q``'s dtype, in query order. No loop per token or
    request: the rows with one query (decodes) run together on
    :func:`attend`'s grouped kernel (on the padded kernel at width 1 where
    that kernel does not fit), unpadded even beside a prefill chunk (unless
    padding them is cheaper: :data:`PAD_LIMIT`); the rows with more run as
    one batch padded to their widest row; each part reads the keys up to the
    furthest its queries see, and the outputs are put back in query order.
    ``groups``: that split, planned once per batch (:func:`query_groups`);
    with it the call does not synchronise with the host. Raises
    ``ValueError`` when ``groups`` was planned for another ``(T, B, L)``, or
    (without ``groups``) ``q_req`` names another number of queries than ``q``.
    """
    T, H = q.shape[:2]
    if groups is None and q_req.numel() != T:
        raise ValueError(f"q holds {T} queries but q_req names {q_req.numel()}")
    if T == 0:
        return q.new_zeros((0, H, v_ctx.shape[-1]))
    B, L = k_ctx.shape[:2]
    if groups is None:
        groups = query_groups(q_req, q_pos, B, L)
    elif tuple(groups.shape) != (T, B, L):
        raise ValueError(f"groups were planned for (T, B, L) = {tuple(groups.shape)}, not {(T, B, L)}")
    g, parts = groups, []
    if g.visible.shape[0]:
        qs, Ls = _part(q, g.single_q), g.visible.shape[1]
        k, v = _part(k_ctx, g.single_rows, Ls), _part(v_ctx, g.single_rows, Ls)
        if _flash_fits(qs, k, v):  # one query per row: the grouped kernel of attend, no padding
            out = attend(qs, k, v, g.visible, scaling)[0]
        else:
            out = _sdpa(qs[:, None], k, v, g.visible[:, None], scaling)[:, 0]
        parts.append((g.single_q, out))
    if g.width:
        M, Lm = g.mask.shape[0], g.mask.shape[2]
        qm = _part(q, g.multi_q)
        if _whole(g.slot, M * g.width):  # no padding, queries in order: a view
            qp = qm.reshape(M, g.width, *q.shape[1:])
        else:
            qp = q.new_zeros(M * g.width, *q.shape[1:])
            qp[g.slot] = qm
            qp = qp.view(M, g.width, *q.shape[1:])
        out = _sdpa(qp, _part(k_ctx, g.multi_rows, Lm), _part(v_ctx, g.multi_rows, Lm), g.mask, scaling)
        parts.append((g.multi_q, out.reshape(M * g.width, H, -1)[g.slot]))
    if len(parts) == 1 and _whole(parts[0][0], T):
        return parts[0][1]  # every query in one part, in order
    if all(isinstance(i, slice) for i, _ in parts):  # two contiguous runs of queries
        return torch.cat([o for _, o in sorted(parts, key=lambda x: x[0].start)])
    out = q.new_empty((T, H, v_ctx.shape[-1]))
    for idx, o in parts:
        out[idx] = o
    return out


def _whole(rows: Rows, n: int) -> bool:
    """Whether ``rows`` are all of ``0 .. n-1``, in order (known on the host, no synchronisation)."""
    return isinstance(rows, slice) and rows == slice(0, n)


def _part(x: torch.Tensor, rows: Rows, n: int | None = None) -> torch.Tensor:
    """``x[rows, :n]``; ``x`` itself (no op) when that is all of it."""
    if _whole(rows, x.shape[0]) and (n is None or n == x.shape[1]):
        return x
    return x[rows] if n is None else x[rows, :n]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Padded GQA attention: ``q [B, W, H, D]`` over ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]`` where
    ``mask [B, W, L]``; returns ``[B, W, H, Dv]``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its own key set, with the log-sum-exp.

    ``q [T, H, D]``; ``k [T, K, Hkv, D]`` and ``v [T, K, Hkv, Dv]`` are the K
    keys of query t (``H`` a multiple of ``Hkv``: grouped-query attention);
    ``mask [T, K]`` marks the keys query t may see. Returns ``out [T, H, Dv]``
    and ``lse [T, H]`` (the log of the softmax denominator, on the scaled
    scores), in fp32 math. A query that sees no key gets ``out = 0`` and
    ``lse = -inf``, so it drops out of :func:`merge_partials`.
    """
    T, H, D = q.shape
    Hkv = k.shape[2]
    if _flash_fits(q, k, v):
        return _attend_flash(q, k, v, mask, scaling)
    qg = q.float().view(T, Hkv, H // Hkv, D)
    s = torch.einsum("tgrd,tkgd->tgrk", qg, k.float()) * scaling  # [T, Hkv, H/Hkv, K]
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [T, Hkv, H/Hkv]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("tgrk,tkgd->tgrd", p, v.float())
    return out.reshape(T, H, v.shape[-1]).to(q.dtype), lse.reshape(T, H)


# the CPU flash-attention kernel that F.scaled_dot_product_attention dispatches to; it also returns the
# log-sum-exp, which the public function does not
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (_FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype and v.shape[-1] == q.shape[-1] and q.shape[0] > 0 and k.shape[1] > 0)


def _attend_flash(q, k, v, mask, scaling):
    """:func:`attend` on the CPU flash kernel, reading ``k``/``v`` in place
    (strided, no copy): query t is a batch of its own, each KV head a head,
    and the ``H // Hkv`` query heads of a group its query rows, which is
    grouped-query attention without repeating any key."""
    T, H, D = q.shape
    K, Hkv = k.shape[1], k.shape[2]
    bias = torch.zeros((T, 1, 1, K), dtype=q.dtype).masked_fill_(~mask[:, None, None, :], float("-inf"))
    out, lse = _FLASH_CPU(q.reshape(T, Hkv, H // Hkv, D), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                          scale=scaling)
    seen = mask.any(1)[:, None]  # the kernel reports lse 0 for a query that sees no key
    return (torch.where(seen[..., None], out.reshape(T, H, D), 0.0).to(q.dtype),
            torch.where(seen, lse.reshape(T, H).float(), float("-inf")))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of partial attentions over disjoint key sets.

    ``outs [R, T, H, Dv]`` and ``lses [R, T, H]`` from :func:`attend` on R
    disjoint parts of each query's keys; the result equals attention over the
    union: ``sum_r exp(lse_r - lse) * out_r`` with ``lse = logsumexp_r lse_r``.
    """
    lse = torch.logsumexp(lses, 0)  # [T, H]
    w = torch.exp(lses - torch.where(torch.isinf(lse), 0.0, lse)[None])
    w = torch.where(torch.isinf(lses), 0.0, w)
    return (w[..., None] * outs.float()).sum(0).to(outs.dtype)


def merge_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials` with the merged log-sum-exp: ``(out [T, H, D]
    in outs' dtype, lse [T, H] float32)``; a row every partial missed stays
    ``0, -inf``."""
    lses = lses.float()
    lse = torch.logsumexp(lses, 0)
    w = torch.exp(lses - torch.where(torch.isinf(lse), 0.0, lse)[None])
    w = torch.where(torch.isinf(lses), 0.0, w)
    return (w[..., None] * outs.float()).sum(0).to(outs.dtype), lse


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Lightning-indexer scores of each query over its context, fp32:
    ``I[t, l] = sum_h weights[t, h] * relu(scale * q[t, h] . keys[t, l])``
    with ``q [T, Hi, Di]``, ``weights [T, Hi]`` (signed, already scaled by the
    model), ``keys [T, L, Di]`` (query t's context). Returns ``[T, L]``."""
    s = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale)  # [T, Hi, L]
    return torch.matmul(weights.float().unsqueeze(-2), s).squeeze(-2)


@dataclass(frozen=True)
class TorchPlan(QueryPlan):
    """The torch backend's plan: :class:`QueryPlan` and ``groups`` (the causal
    grouping of :func:`gathered_attention`, for a plan without log-sum-exp and
    without holes in its contexts; ``None`` otherwise), and under ``own_rank``
    the read index of the owned slots packed left (``own_read [B, W]``) and
    which each query sees (``own_seen [T, W]``)."""

    groups: QueryGroups | None = None
    own_read: torch.Tensor | None = None
    own_seen: torch.Tensor | None = None


def _heads(x: torch.Tensor, lead: int) -> torch.Tensor:
    """A one-head family's values ``[*lead dims, D]`` with a head axis of 1 (others as they are)."""
    return x.unsqueeze(-2) if x.dim() == lead + 1 else x


def _kv(k: CacheView, v: CacheView, rows: torch.Tensor, value_dims: int | None):
    """Keys and values at rank-major ``rows`` with a head axis (the view's
    dtype, float32 when decoded from a byte format)."""
    kk = _heads(k.decode(rows), rows.dim())
    vv = kk if v is k or (v.data is k.data and v.fmt == k.fmt) else _heads(v.decode(rows), rows.dim())
    return kk, (vv if value_dims is None else vv[..., :value_dims])


class TorchBackend(Backend):
    """The reference backend (see the module docstring). Stores through
    ``index_copy_`` (encoding a byte format in torch, without the finiteness
    check's host read: a forward checks finiteness once per batch)."""

    name = "torch"

    def plan(self, table, q_req, q_pos, layout: SharedKVLayout, *, own_rank=None, with_lse=True) -> TorchPlan:
        """See :meth:`Backend.plan`; builds :func:`query_groups` (reading the
        queries on the host) only for a plan without log-sum-exp."""
        f = plan_fields(table, q_req, q_pos, layout, own_rank, with_lse)
        c = f["context"]
        if f["own_rank"] >= 0:
            pos, slots = owned_positions(table, layout, f["own_rank"])
            own_read = layout.translate_read_slots(slots).clamp(min=0)
            p = pos[q_req.to(torch.int64)]
            return TorchPlan(**f, own_read=own_read, own_seen=(p >= 0) & (p <= q_pos[:, None]))
        groups = None
        if not f["with_lse"]:
            L = c.read.shape[1]
            seen = torch.arange(L, device=q_pos.device)[None, :] <= q_pos[:, None]
            if q_req.numel() and bool((seen & ~c.valid[c.inv]).any()):  # a hole: only the masked path is exact
                f["with_lse"] = True
            else:
                groups = query_groups(c.inv, q_pos, c.read.shape[0], L)
        return TorchPlan(**f, groups=groups)

    def store(self, segment: CacheView, values, write: WriteIndex, layout, rank, report) -> None:
        """See :meth:`Backend.store`. Planned (``write.local`` given): one
        ``index_copy_``; else the owned entries are selected here (a boolean
        index: a host synchronisation on a GPU) and the others reported."""
        encode = (lambda x: x.to(segment.data.dtype)) if segment.fmt is None else \
            (lambda x: segment.fmt.encode(x, check=False))
        if write.local is not None:  # planned: every written slot is this rank's (checked at plan time)
            x = values if write.rows.numel() == values.shape[0] else values.index_select(0, write.rows)
            segment.data.index_copy_(0, write.local, encode(x))
            return
        slots, pad = write.slots, layout.padding_value
        inside = (slots >= 0) & (slots < layout.capacity)
        safe = torch.where(inside, slots, pad)
        owned = layout.owned_slot_mask(safe, owner_rank=rank)
        local = layout.translate_write_slots(safe)
        segment.data.index_copy_(0, local[owned].to(torch.int64), encode(values[owned]))
        refused = (slots != pad) & ~owned
        n = slots.numel()
        first = torch.where(refused, torch.arange(n, device=slots.device), n).min() if n else report[1]
        report[0] += refused.sum().to(torch.int32)
        torch.minimum(report[1:], first.reshape(1).to(torch.int32), out=report[1:])

    def dense(self, plan: TorchPlan, q, k, v, scaling, value_dims=None, *, splits=None):
        """See :meth:`Backend.dense` (``splits`` has no meaning here)."""
        if plan.own_rank >= 0:
            kk, vv = _kv(k, v, plan.own_read, value_dims)
            rows = plan.q_req.to(torch.int64)
            if not (rows.numel() == kk.shape[0] and plan.context.identity):
                kk, vv = kk[rows], vv[rows]
            return attend(q, kk, vv, plan.own_seen, scaling)
        c = plan.context
        kk, vv = _kv(k, v, c.read, value_dims)
        if plan.groups is not None:
            return gathered_attention(q, c.inv, plan.q_pos, kk.to(q.dtype), vv.to(q.dtype), scaling, plan.groups), None
        if not c.identity:
            kk, vv = kk[c.inv], vv[c.inv]
        L = kk.shape[1]
        seen = c.valid[c.inv] & (torch.arange(L, device=q.device)[None, :] <= plan.q_pos[:, None])
        return attend(q, kk, vv, seen, scaling)

    def selected(self, plan, q, kv, slots, scaling, value_dims, *, splits=None):
        """See :meth:`Backend.selected`: under ``own_rank`` the owned slots of
        each selection packed left, so a rank's work is its share."""
        layout = plan.layout
        if plan.own_rank >= 0:
            owned = layout.owned_slot_mask(slots, owner_rank=plan.own_rank, check=False)
            slots = pack_left(owned, slots, slots.shape[1])
        seen = slots != layout.padding_value
        rows = layout.translate_read_slots(torch.where(seen, slots, 0), check=False)
        kk, vv = _kv(kv, kv, rows, value_dims)
        return attend(q, kk, vv, seen, scaling)

    def index_scores(self, plan, q, weights, keys, scale, *, splits=None):
        """See :meth:`Backend.index_scores`: :func:`indexer_scores` over the gathered context."""
        values, visible = self.context(plan, keys)
        c = plan.context
        valid = c.valid if c.identity else c.valid[c.inv]
        return indexer_scores(q, weights, values, scale).masked_fill(~(visible & valid), float("-inf"))

    def merge(self, outs, lses):
        """See :meth:`Backend.merge`: :func:`merge_lse`."""
        return merge_lse(outs, lses)
