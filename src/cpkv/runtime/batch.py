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
tokens, write slots with their ownership checked, the data plane's own plan,
the LSE split's metadata, on the pool's device); per layer only store, fence
and attend run, without host synchronisation or host-to-device copy.
``kernels`` chooses the data plane once per batch, one
:class:`~cpkv.kernels.backend.Backend` every method calls: ``"torch"`` (the
reference) or ``"triton"`` (:mod:`cpkv.kernels`: the store and the attention
kernels translate logical slots themselves and decode byte formats in the
kernel). A cache format the Triton kernels cannot read runs the batch on the
torch backend, named in :attr:`ForwardBatch.fallback`.

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

from ..consumers.kv_format import all_finite
from ..consumers.kv_pool import SharedKVPool
from ..contract.allocation import Allocation
from ..kernels import BACKENDS
from ..kernels import get as get_backend
from ..kernels import raise_refused
from ..kernels.backend import Backend, CacheView, QueryPlan
from ..models.attention import IndexerScore, topk_positions
from .comm import Comm
from .forward_plan import DECODE_SPLITS, PREFILL_SPLITS, ForwardPlan, split_ranks

__all__ = ["DECODE_SPLITS", "PREFILL_SPLITS", "ForwardBatch", "choose_backend", "default_kernels",
           "split_ranks"]


def default_kernels(device: torch.device | str) -> str:
    """``"triton"`` on a CUDA device, ``"torch"`` elsewhere (the default of ``--kernels``)."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def choose_backend(kernels: str, pool: SharedKVPool) -> tuple[Backend, str | None]:
    """The backend a batch of ``pool`` runs on for ``kernels`` (``"torch"`` or
    ``"triton"``; ``ValueError`` otherwise), and the fallback taken, or
    ``None``: the torch backend when a family's format is one the Triton
    kernels cannot read in place (the reason named)."""
    backend = get_backend(BACKENDS.check(kernels))
    for f in pool.families.values():
        why = backend.unreadable(f.format)
        if why:
            return get_backend("torch"), f"family {f.name}: {why}; torch backend"
    return backend, None


class ForwardBatch:
    """This rank's tokens of an allocated batch and its access to the cache.

    ``table [R, W]`` holds the logical slots of the batch's requests, row
    ``rows[i]`` request ``i``'s (every row in order when ``rows`` is
    ``None``) at positions ``0 .. seq_len - 1`` (padding after), the new
    slots included; the plan reads ``[rows, :L]`` of it only.
    The batch is planned here (:meth:`ForwardPlan.build`: a slot this rank
    would write but does not own raises ``ContractViolation`` now, once).
    ``kernels``: ``"torch"`` or ``"triton"`` (``ValueError`` otherwise), the
    backend chosen once (:func:`choose_backend`; ``kernels`` then names the
    one that runs, ``fallback`` why it is not the one asked for, else
    ``None``); ``rows`` as :meth:`ForwardPlan.build` takes them.
    """

    def __init__(self, pool: SharedKVPool, comm: Comm, alloc: Allocation, table: torch.Tensor, mode: str,
                 kernels: str = "torch", rows: torch.Tensor | None = None):
        self.backend, self.fallback = choose_backend(kernels, pool)
        self.kernels = self.backend.name
        self.pool, self.comm, self.alloc, self.mode = pool, comm, alloc, mode
        self.layout = pool.layout
        self.plan = ForwardPlan.build(pool, comm.rank, alloc, table, mode, group_size=comm.size, rows=rows,
                                      backend=self.backend)
        p = self.plan
        self.token_indices, self.req, self.positions, self.slots = p.token_indices, p.req, p.positions, p.slots
        self.num_tokens = p.num_tokens
        self.table = p.table
        self.scratch: dict = {}
        self._dirty = False
        dev = pool.device
        self._report = torch.zeros(2, dtype=torch.int32, device=dev)  # every store's refusals, read at finish
        self._report[1] = p.write_slots.numel()
        self._stores = 0
        self._finite = torch.ones((), dtype=torch.bool, device=dev)  # formatted values cached, read at finish
        self._counted: list[tuple[tuple[str, ...], torch.Tensor | int]] = []
        self.kv_read = 0
        self.reads: dict[str, int] = {}
        self.moved_bytes = 0

    def _view(self, name: str, layer: int) -> CacheView:
        """One layer of family ``name`` in the rank-major view, with its format."""
        f = self.pool.families[name]
        return CacheView(self.pool.view(name, layer), f.format, f.shape)

    # -- writes ---------------------------------------------------------------------
    def store(self, layer: int, **values: torch.Tensor) -> None:
        """Cache this rank's new entries; under a token split, all-gather them
        first and write the slots this rank owns. A formatted family's values
        are checked finite on the device, read once at :meth:`finish`.
        [[RFC-0001:C-DIRECT-WRITE]]"""
        p = self.plan
        if p.gathered_order is not None:
            values = self._gather_entries(values)
        for n, x in values.items():
            f = self.pool.families[n]
            if f.format is not None:
                self._finite &= all_finite(x)
            segment = CacheView(self.pool.segment(n, layer), f.format, f.shape)
            self.backend.store(segment, x, p.write, self.layout, self.pool.rank, self._report)
            self._stores += 1
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
        slots may be freed and reused. Reads the batch's counters, the store
        reports and the finiteness flag on the host (once per batch) and
        raises ``ContractViolation`` if a store refused a slot, ``ValueError``
        if a formatted family was given a NaN or infinite value (its bytes
        were written, as garbage: the run must stop)."""
        self.pool.fence()
        self._dirty = False
        if self._stores:
            count, first, finite = torch.cat([self._report, self._finite.view(1).to(torch.int32)]).tolist()
            if count:
                report = torch.tensor([count // self._stores, first], dtype=torch.int32)
                raise_refused(report, self.plan.write_slots.cpu(), self.layout, self.pool.rank)
            if not finite:
                raise ValueError("a layer cached a NaN or infinite value in a formatted family (its FP8 scale or "
                                 "bfloat16 bytes are garbage now): the model's values must be finite")
        for names, n in self._counted:
            n = int(n)
            self.kv_read += n
            for name in names:
                self.reads[name] = self.reads.get(name, 0) + n
        self._counted.clear()

    # -- reads through the shared view -------------------------------------------------
    def context(self, layer: int, family: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's whole context in ``family`` through the shared view:
        ``(values [T, L, *shape], visible [T, L])``."""
        self._fence_if_dirty()
        plan = self.plan.attn
        self._counted.append(((family,), plan.context.count))
        return self.backend.context(plan, self._view(family, layer))

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
        token's whole row would pick (the same rows, the same ``topk``). An
        :class:`~cpkv.models.attention.IndexerScore` is computed by the
        backend's ``index_scores`` over the view; another score gets the
        gathered context."""
        p = self.plan
        if self.mode != "lse":
            return self._select(layer, family, k, score, queries, p.attn)
        lp = p.lse
        sel = self._select(layer, family, k, score, tuple(x[lp.sel_mine] for x in queries), lp.sel)
        K = min(k, lp.width)
        packed = torch.full((lp.sel_mine.numel(), K), -1, dtype=torch.int32, device=p.device)
        w = min(K, sel.shape[1])
        packed[:, :w] = sel[:, :w]
        parts = self.comm.all_gather(packed, lp.sel_sizes)
        self.moved_bytes += sum(x.numel() * x.element_size() for r, x in enumerate(parts) if r != self.comm.rank)
        out = torch.empty((self.num_tokens, K), dtype=torch.int64, device=p.device)
        out[lp.sel_order] = torch.cat(parts).to(torch.int64)
        return out

    def _select(self, layer, family, k, score, queries, plan: QueryPlan):
        self._fence_if_dirty()
        self._counted.append(((family,), plan.context.count))
        view = self._view(family, layer)
        if isinstance(score, IndexerScore):
            q, w = queries
            L = plan.context.read.shape[1]  # the gathered path's context width: the same top-k width
            s = self.backend.index_scores(plan, q, w, view, score.scale)[:, :L]
            return topk_positions(s, s > float("-inf"), k)
        keys, visible = self.backend.context(plan, view)
        return topk_positions(score(*queries, keys), visible, k)

    def attend_dense(self, layer: int, q: torch.Tensor, scaling: float, key: str, value: str,
                     value_dims: int | None = None) -> torch.Tensor:
        """Causal attention over each token's whole context (see
        :class:`cpkv.models.CacheAccess`); under ``lse``, over the context
        slots this rank owns only (its own segment: no fence), merged."""
        a, lse_split = self.plan.attn, self.mode == "lse"
        if not lse_split:
            self._fence_if_dirty()
        self._counted.append(((key, value), a.own_count if lse_split else a.context.count))
        out, lse = self.backend.dense(a, q, self._view(key, layer), self._view(value, layer), scaling, value_dims)
        out = out.to(q.dtype)
        return self._merge(out, lse) if lse_split else out

    def attend_selected(self, layer: int, q: torch.Tensor, positions: torch.Tensor, scaling: float, key: str,
                        value: str, value_dims: int | None = None) -> torch.Tensor:
        """Attention over the selected context positions of each token, keys
        the rows of family ``key`` and values their first ``value_dims``
        entries (``value`` must be ``key``: one family, as MLA's latent;
        ``ValueError`` otherwise); under ``lse``, over the selected slots this
        rank owns only, merged."""
        if key != value:
            raise ValueError(f"attend_selected reads keys and values from one family (MLA's latent), got "
                             f"{key!r} and {value!r}")
        a, lse_split = self.plan.attn, self.mode == "lse"
        slots = torch.where(positions >= 0, self.table[self.req[:, None], positions.clamp(min=0)], -1)
        if lse_split:
            seen = self.layout.owned_slot_mask(slots, owner_rank=a.own_rank, check=False)
        else:
            self._fence_if_dirty()
            seen = slots >= 0
        self._counted.append(((key,), seen.sum()))
        view = self._view(key, layer)
        dims = value_dims if value_dims is not None else view.shape[-1]
        out, lse = self.backend.selected(a, q, view, slots, scaling, dims)
        out = out.to(q.dtype)
        return self._merge(out, lse) if lse_split else out

    # -- the log-sum-exp decode split ----------------------------------------------------
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
        return self.backend.merge(outs, lses.float())[0]


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
