"""One rank's share of one allocated batch, and the cache as its layers see it.

:class:`ForwardBatch` implements :class:`cpkv.models.CacheAccess` for every
way of dividing a batch among the ranks of a CP group:

* ``page`` (prefill) / ``owner`` (decode): rank k computes exactly the tokens
  on pages it owns, taken from the allocation ([[RFC-0001:C-PLANNER-SPLIT]]),
  writes their entries into its own segment ([[RFC-0001:C-DIRECT-WRITE]]), and
  after one fence reads the whole context through the rank-major view
  ([[RFC-0001:C-READ-PATH]]). No cache entry moves between ranks.
* ``interleave`` / ``zigzag`` (prefill, the upstream design), ``balanced``
  (decode over a replicated cache, tokens dealt by context length): a token split
  ([[RFC-0001:C-PLANNER-SPLIT]]); each layer's new entries are all-gathered,
  then every owner writes the slots it owns, fence, read as above.
* ``lse`` (decode): every rank computes every request's token, attends over
  the context positions on pages it owns only (reads of its own segment), and
  the partial outputs merge exactly by log-sum-exp after one all-gather per
  layer; the owner of the new token's page writes its entries. A top-k
  selection over the whole context (DSA's indexer, :meth:`ForwardBatch.select`)
  is not replicated: each token's is made by one rank (tokens dealt out by
  context length, :func:`cpkv.runtime.forward_plan.balanced_ranks`) and shared by one
  all-gather; attention over the selected positions is then split by owner.

Each batch is planned once, before its first layer (:class:`~cpkv.runtime.forward_plan.ForwardPlan`:
tokens, write slots with their ownership checked, read indices, the LSE
split's metadata, on the pool's device); per layer only store, fence and
attend run, without host synchronisation. ``kernels`` chooses the data
plane: ``"torch"`` (the reference) or ``"triton"`` (:mod:`cpkv.kernels`: the
store and the attention kernels translate logical slots themselves).

Fences are collective and lazy: a read of another rank's segment fences first
if this batch wrote since the last fence. Every rank runs the same layers with
the same mode, so they fence alike. Work counters (``kv_read``: context
entries read, and ``reads``: the same per family, ``moved_bytes``: bytes
received from other ranks: cache entries, partial outputs, selections) feed
the split benchmark.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..consumers.kv_pool import SharedKVPool
from ..contract.allocation import Allocation
from ..models.attention import IndexerScore, attend, merge_partials, paged_attention, topk_positions
from .comm import Comm
from .forward_plan import DECODE_SPLITS, PREFILL_SPLITS, ContextIndex, ForwardPlan, pack_left, split_ranks

KERNELS = ("torch", "triton")

__all__ = ["DECODE_SPLITS", "KERNELS", "PREFILL_SPLITS", "ForwardBatch", "default_kernels", "split_ranks"]


def default_kernels(device: torch.device | str) -> str:
    """``"triton"`` on a CUDA device, ``"torch"`` elsewhere (the default of ``--kernels``)."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


class ForwardBatch:
    """This rank's tokens of an allocated batch and its access to the cache.

    ``table [R, W]`` holds the logical slots of the batch's requests, row
    ``rows[i]`` request ``i``'s (every row in order when ``rows`` is
    ``None``) at positions ``0 .. seq_len - 1`` (padding after), the new
    slots included; the plan reads ``[rows, :L]`` of it only. The batch is
    planned here (:meth:`ForwardPlan.build`: a slot this rank would write but
    does not own raises ``ContractViolation`` now, once). ``kernels``:
    ``"torch"`` or ``"triton"`` (``ValueError`` otherwise).
    """

    def __init__(self, pool: SharedKVPool, comm: Comm, alloc: Allocation, table: torch.Tensor, mode: str,
                 kernels: str = "torch", rows: torch.Tensor | None = None):
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.pool, self.comm, self.alloc, self.mode = pool, comm, alloc, mode
        self.layout = pool.layout
        self.plan = ForwardPlan.build(pool, comm.rank, alloc, table, mode, group_size=comm.size, rows=rows)
        p = self.plan
        self.token_indices, self.req, self.positions, self.slots = p.token_indices, p.req, p.positions, p.slots
        self.num_tokens = p.num_tokens
        self.table = p.table
        self._kernels = None
        if kernels == "triton" and all(f.format is None for f in pool.families.values()):
            from .. import kernels as K

            self._kernels = K.get("triton")
        self.kernels = "triton" if self._kernels is not None else "torch"
        self.scratch: dict = {}
        self._dirty = False
        self._reports: list[torch.Tensor] = []
        self._counted: list[tuple[tuple[str, ...], torch.Tensor | int]] = []
        self.kv_read = 0
        self.reads: dict[str, int] = {}
        self.moved_bytes = 0

    # -- writes ---------------------------------------------------------------------
    def store(self, layer: int, **values: torch.Tensor) -> None:
        """Cache this rank's new entries; under a token split, all-gather them
        first and write the slots this rank owns. [[RFC-0001:C-DIRECT-WRITE]]"""
        p = self.plan
        if p.gathered_order is not None:
            values = self._gather_entries(values)
        if self._kernels is not None:
            for n, x in values.items():
                seg = self.pool.segment(n, layer)
                self._reports.append(self._kernels.store(seg, x.to(seg.dtype), p.write_slots, self.layout,
                                                         self.comm.rank, check=False))
        else:
            rows = p.write_rows
            whole = rows.numel() == p.write_slots.numel()  # every entry is written: no row selection
            self.pool.write_at(layer, p.write_local, **{n: (x if whole else x.index_select(0, rows))
                                                        for n, x in values.items()})
        self._dirty = True

    def _gather_entries(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under a token split: every rank's new entries, in batch order (one all-gather per dtype)."""
        full, p = {}, self.plan
        E = p.gathered_order.numel()
        for group in _by_dtype(values):  # every family of one dtype packed side by side
            packed = torch.cat([values[n].reshape(self.num_tokens, math.prod(values[n].shape[1:])) for n in group], 1)
            parts = self.comm.all_gather(packed, p.rank_sizes)
            self.moved_bytes += sum(x.numel() * x.element_size() for r, x in enumerate(parts) if r != self.comm.rank)
            every = torch.empty((E, packed.shape[1]), dtype=packed.dtype, device=packed.device)
            every[p.gathered_order] = torch.cat(parts)
            full.update(_unpack(every, {n: values[n].shape[1:] for n in group}))
        return full

    def _fence_if_dirty(self) -> None:
        if self._dirty:
            self.pool.fence()
            self._dirty = False

    def finish(self) -> None:
        """Closing fence: no rank reads this batch's context any more, so its
        slots may be freed and reused. Reads the batch's counters and the store
        kernels' reports on the host (once per batch) and raises
        ``ContractViolation`` if a kernel refused a slot."""
        self.pool.fence()
        self._dirty = False
        if self._reports:
            reports = torch.stack(self._reports).cpu()
            self._reports.clear()
            for r in reports:
                if int(r[0]):
                    from ..kernels import raise_refused

                    raise_refused(r, self.plan.write_slots.cpu(), self.layout, self.comm.rank)
        for names, n in self._counted:
            n = int(n)
            self.kv_read += n
            for name in names:
                self.reads[name] = self.reads.get(name, 0) + n
        self._counted.clear()

    # -- reads through the shared view -------------------------------------------------
    def _gather(self, layer: int, index: torch.Tensor, count, names: tuple[str, ...],
                own: bool = False) -> list[torch.Tensor]:
        """Entries of each family in ``names`` at rank-major ``index`` (clamped),
        ``[*index.shape, *shape]``; ``count`` valid entries are counted (an
        int, or a device tensor read at :meth:`finish`). ``own``: only this
        rank's segment is read, so no fence."""
        if not own:  # another rank's segment: its writes of this layer must have landed
            self._fence_if_dirty()
        self._counted.append((names, count))
        return list(self.pool.gather(layer, index, *names))

    def _values(self, layer, index, count, key, value, value_dims, own=False):
        """Keys and values for attention, ``[*index.shape, Hkv, D]`` (a one-head
        family such as the MLA latent gets a head axis of 1)."""
        if key == value:
            (k,) = self._gather(layer, index, count, (key,), own)
            v = k
        else:
            k, v = self._gather(layer, index, count, (key, value), own)
        if k.dim() == index.dim() + 1:
            k, v = k.unsqueeze(-2), v.unsqueeze(-2)
        return k, (v if value_dims is None else v[..., :value_dims])

    def context(self, layer: int, family: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's whole context in ``family`` through the shared view:
        ``(values [T, L, *shape], visible [T, L])``."""
        return self._context(layer, family, self.plan.context)

    def _context(self, layer: int, family: str, c: ContextIndex):
        (ctx,) = self._gather(layer, c.read, c.count, (family,))
        return (ctx if c.identity else ctx[c.inv]), c.visible

    def select(self, layer: int, family: str, k: int, score: Callable[..., torch.Tensor],
               *queries: torch.Tensor) -> torch.Tensor:
        """Each token's best ``min(k, visible)`` context positions by ``score``
        (see :class:`cpkv.models.CacheAccess`), ``[T, K]`` int64, ``-1`` padding.

        Under ``lse`` every rank holds every token, yet each token is scored
        once: by the rank :func:`~cpkv.runtime.forward_plan.balanced_ranks` deals it to
        by context length, which reads that token's whole context through the
        shared view; one all-gather of the ``[T', K]`` positions (int32) gives
        every rank every selection, ``K = min(k, longest context)``. Elsewhere
        the rank scores its own tokens. The set is the one scoring every
        token's whole row would pick (the same rows, the same ``topk``). With
        the triton kernels, an :class:`~cpkv.models.attention.IndexerScore`
        is computed by ``cpkv.kernels.index_scores`` over the view."""
        p = self.plan
        if self.mode != "lse":
            return self._select(layer, family, k, score, queries, p.context, None)
        lp = p.lse
        sel = self._select(layer, family, k, score, tuple(x[lp.sel_mine] for x in queries), lp.sel_context,
                           lp.sel_mine)
        K = min(k, lp.width)
        packed = torch.full((lp.sel_mine.numel(), K), -1, dtype=torch.int32, device=p.device)
        w = min(K, sel.shape[1])
        packed[:, :w] = sel[:, :w]
        parts = self.comm.all_gather(packed, lp.sel_sizes)
        self.moved_bytes += sum(x.numel() * x.element_size() for r, x in enumerate(parts) if r != self.comm.rank)
        out = torch.empty((self.num_tokens, K), dtype=torch.int64, device=p.device)
        out[lp.sel_order] = torch.cat(parts).to(torch.int64)
        return out

    def _select(self, layer, family, k, score, queries, c: ContextIndex, mine):
        if self._kernels is not None and isinstance(score, IndexerScore):
            self._fence_if_dirty()
            self._counted.append(((family,), c.count))
            req, pos = (self.req, self.positions) if mine is None else (self.req[mine], self.positions[mine])
            view = self.pool.view(family, layer)
            q, w = queries
            s = self._kernels.index_scores(q.to(view.dtype), w, view, self.table, req, pos, self.layout,
                                           score.scale, check=False)
            L = c.visible.shape[1]  # the torch path's context width: the same top-k width
            return topk_positions(s[:, :L], c.visible, k)
        keys, visible = self._context(layer, family, c)
        return topk_positions(score(*queries, keys), visible, k)

    def attend_dense(self, layer: int, q: torch.Tensor, scaling: float, key: str, value: str,
                     value_dims: int | None = None) -> torch.Tensor:
        """Causal attention over each token's whole context (see :class:`cpkv.models.CacheAccess`)."""
        p = self.plan
        if self._kernels is not None and value_dims is None:
            only = self.comm.rank if self.mode == "lse" else None
            if only is None:  # lse reads this rank's own segment only: no fence
                self._fence_if_dirty()
            self._counted.append(((key, value), p.lse.own_count if only is not None else p.context.count))
            kv, vv = self.pool.view(key, layer), self.pool.view(value, layer)
            out, lse = self._kernels.paged_attention(q.to(kv.dtype), kv, vv, self.table, self.req, self.positions,
                                                     self.layout, scaling, only_rank=only, check=False)
            out = out.to(q.dtype)
            return self._merge(out, lse) if only is not None else out
        if self.mode == "lse":
            return self._attend_own(layer, q, scaling, key, value, value_dims)
        c = p.context
        k, v = self._values(layer, c.read, c.count, key, value, value_dims)
        return paged_attention(q, c.inv, self.positions, k, v, scaling, p.groups)

    def attend_selected(self, layer: int, q: torch.Tensor, positions: torch.Tensor, scaling: float, key: str,
                        value: str, value_dims: int | None = None) -> torch.Tensor:
        """Attention over the selected context positions of each token, gathered;
        under ``lse``, over the selected slots this rank owns only (packed left,
        so a rank's work is its share of each selection), merged."""
        slots = torch.where(positions >= 0, self.table[self.req[:, None], positions.clamp(min=0)], -1)
        lse_split = self.mode == "lse"
        if self._kernels is not None and key == value and value_dims is not None:
            if not lse_split:
                self._fence_if_dirty()
            only = self.comm.rank if lse_split else None
            seen = slots >= 0 if only is None else self.layout.owned_slot_mask(slots, owner_rank=only, check=False)
            self._counted.append(((key,), seen.sum()))
            view = self.pool.view(key, layer)
            out, lse = self._kernels.sparse_mla_attention(q.to(view.dtype), view, slots, self.layout, scaling,
                                                          value_dims, only_rank=only, check=False)
            out = out.to(q.dtype)
            return self._merge(out, lse) if lse_split else out
        if lse_split:
            owned = self.layout.owned_slot_mask(slots, owner_rank=self.comm.rank, check=False)
            slots = pack_left(owned, slots, slots.shape[1])
        seen = slots >= 0
        read = self.layout.translate_read_slots(torch.where(seen, slots, 0), check=False)
        k, v = self._values(layer, read, seen.sum(), key, value, value_dims, own=lse_split)
        out, lse = attend(q, k, v, seen, scaling)
        return self._merge(out, lse) if lse_split else out

    # -- the log-sum-exp decode split ----------------------------------------------------
    def _attend_own(self, layer, q, scaling, key, value, value_dims):
        lp = self.plan.lse
        k, v = self._values(layer, lp.own_read, lp.own_count, key, value, value_dims, own=True)
        if not lp.req_identity:  # else a decode batch: one token per request, in order
            k, v = k[self.req], v[self.req]
        out, lse = attend(q, k, v, lp.own_seen, scaling)
        return self._merge(out, lse)

    def _merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Every rank's partial ``out [T, H, Dv]`` and ``lse [T, H]`` of the same
        tokens, merged; one all-gather when they share a dtype."""
        T, sizes = out.shape[0], [out.shape[0]] * self.comm.size
        if out.dtype == lse.dtype:
            parts = self.comm.all_gather(torch.cat([out.reshape(T, math.prod(out.shape[1:])), lse], 1), sizes)
            got = _unpack(torch.stack(parts), {"out": out.shape[1:], "lse": lse.shape[1:]}, lead=2)
            outs, lses = got["out"], got["lse"]
            self.moved_bytes += sum(p.numel() * p.element_size() for r, p in enumerate(parts) if r != self.comm.rank)
        else:
            outs, lses = self.comm.all_gather(out, sizes), self.comm.all_gather(lse, sizes)
            self.moved_bytes += sum(o.numel() * o.element_size() + s.numel() * s.element_size()
                                    for r, (o, s) in enumerate(zip(outs, lses)) if r != self.comm.rank)
            outs, lses = torch.stack(outs), torch.stack(lses)
        if self._kernels is not None:
            return self._kernels.merge_lse(outs, lses.float())[0]
        return merge_partials(outs, lses)


def _by_dtype(values: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names of ``values`` grouped by dtype, in first-seen order."""
    groups: dict[torch.dtype, list[str]] = {}
    for n, x in values.items():
        groups.setdefault(x.dtype, []).append(n)
    return list(groups.values())


def _unpack(packed: torch.Tensor, shapes: dict[str, torch.Size], lead: int = 1) -> dict[str, torch.Tensor]:
    """Split the last axis of ``packed [*lead dims, sum of widths]`` back into
    one view per name, shaped ``[*lead dims, *shapes[name]]``."""
    out, at = {}, 0
    for n, shape in shapes.items():
        w = math.prod(shape)
        out[n] = packed[..., at : at + w].reshape(*packed.shape[:lead], *shape)
        at += w
    return out
