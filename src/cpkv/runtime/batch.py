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
* ``lse`` (decode): decode context parallelism (:mod:`cpkv.runtime.lse`).
  Each token is computed by its home rank, the owner of its new slot, which
  writes its entries as under ``owner``; the queries are all-gathered
  (:meth:`ForwardBatch.queries`) and every rank attends every query over the
  context on its own pages only (its own segment: no fence); a top-k
  selection is found from each rank's own scores
  (:func:`~cpkv.runtime.lse.global_topk`); the partial outputs go to the
  home rank by one all-to-all and merge there exactly by log-sum-exp.

Each batch is planned once, before its first layer (:class:`~cpkv.runtime.forward_plan.ForwardPlan`:
tokens, write slots with their ownership checked, the data plane's own plan,
the LSE split's metadata, on the pool's device); per layer only store, fence
and attend run, without host synchronisation or host-to-device copy (but
the lse split's top-k, which reads on the host whether a second exchange is
needed: :func:`~cpkv.runtime.lse.global_topk`).
``kernels`` chooses the data plane once per batch, one
:class:`~cpkv.kernels.backend.Backend` every method calls: ``"torch"`` (the
reference) or ``"triton"`` (:mod:`cpkv.kernels`: the store and the attention
kernels translate logical slots themselves and decode byte formats in the
kernel). A cache format the Triton kernels cannot read runs the batch on the
torch backend, named in :attr:`ForwardBatch.fallback`.

Fences are collective and lazy: a read of another rank's segment fences first
if this batch wrote since the last fence. Every rank runs the same layers with
the same mode, so they fence alike. Work counters (``kv_read``: context
entries read, and ``reads``: the same per family; ``traffic``: bytes received
from other ranks by layer and term, :data:`~cpkv.runtime.lse.TERMS`, cache
entries read from other ranks' pages included) feed the split benchmark and
the cost model's check.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..consumers.kv_format import all_finite
from ..consumers.kv_pool import SharedKVPool
from ..contract.allocation import Allocation
from ..kernels import BACKENDS
from ..kernels import get as get_backend
from ..kernels import raise_refused
from ..kernels.backend import Backend, CacheView, QueryPlan, pack_left
from ..models.attention import IndexerScore, topk_positions
from .comm import Comm
from .forward_plan import DECODE_SPLITS, PREFILL_SPLITS, ForwardPlan, split_ranks
from .lse import Traffic, global_topk, pack_rows, unpack_rows

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
    The batch is planned here, once (:meth:`ForwardPlan.build`: a slot this
    rank would write but does not own raises ``ContractViolation`` now), and
    :attr:`plan` is the one object that holds the plan: the runner reads its
    tokens, the backend its query plan and write index, every layer's store
    the write index the pool checked; this class keeps no copy of it
    (``positions``, ``num_tokens`` and ``kernels`` read it).
    ``kernels``: ``"torch"`` or ``"triton"`` (``ValueError`` otherwise), the
    backend chosen once (:func:`choose_backend`; ``kernels`` then names the
    one that runs, ``fallback`` why it is not the one asked for, else
    ``None``); ``rows`` as :meth:`ForwardPlan.build` takes them.
    """

    def __init__(self, pool: SharedKVPool, comm: Comm, alloc: Allocation, table: torch.Tensor, mode: str,
                 kernels: str = "torch", rows: torch.Tensor | None = None):
        backend, self.fallback = choose_backend(kernels, pool)
        self.pool, self.comm, self.layout = pool, comm, pool.layout
        self.plan = ForwardPlan.build(pool, comm.rank, alloc, table, mode, group_size=comm.size, rows=rows,
                                      backend=backend)
        p = self.plan
        self.scratch: dict = {}
        self._dirty = False
        dev = pool.device
        self._report = torch.zeros(2, dtype=torch.int32, device=dev)  # every store's refusals, read at finish
        self._report[1] = p.write.slots.numel()
        self._stores = 0
        self._finite = torch.ones((), dtype=torch.bool, device=dev)  # formatted values cached, read at finish
        self._counted: list[tuple[int, tuple[str, ...], torch.Tensor | int, torch.Tensor | int, str]] = []
        self._exchange: dict[int, torch.Tensor] = {}  # k -> the queries that see more than k keys (lse)
        self.kv_read = 0
        self.reads: dict[str, int] = {}
        self.traffic = Traffic()

    @property
    def positions(self) -> torch.Tensor:
        """``[T]``: the positions of this rank's tokens (the plan's; :class:`cpkv.models.CacheAccess`)."""
        return self.plan.positions

    @property
    def num_tokens(self) -> int:
        """T, the tokens this rank computes (the plan's)."""
        return self.plan.num_tokens

    @property
    def kernels(self) -> str:
        """The backend the batch runs on (the plan's; ``fallback`` says why when it is not the one asked for)."""
        return self.plan.backend.name

    @property
    def query_positions(self) -> torch.Tensor:
        """``[Tq]``: the positions of the queries this rank attends (see
        :meth:`queries`): its own tokens', or under ``lse`` every token's of
        the batch, in batch order."""
        return self.plan.attn.q_pos

    @property
    def moved_bytes(self) -> int:
        """Bytes this rank received from the others in the batch's
        collectives (every term of :attr:`traffic` but reads of other ranks'
        pages through the shared view)."""
        return sum(n for t, n in self.traffic.by_term().items() if not t.startswith("kv_remote"))

    def _view(self, name: str, layer: int) -> CacheView:
        """One layer of family ``name`` in the rank-major view, with its format."""
        f = self.pool.families[name]
        return CacheView(self.pool.view(name, layer), f.format, f.shape)

    def _slot_bytes(self, name: str) -> int:
        """Stored bytes of one slot of family ``name`` at one layer."""
        f = self.pool.families[name]
        return f.slot_bytes() // len(f.layers)

    def _count(self, layer: int, families: tuple[str, ...], n, remote, term: str = "kv_remote_read") -> None:
        """Count ``n`` context entries read of ``families`` at ``layer`` and
        ``remote`` entries on other ranks' pages as ``term`` (ints or device
        scalars, read at :meth:`finish`)."""
        self._counted.append((layer, families, n, remote, term))

    # -- writes ---------------------------------------------------------------------
    def store(self, layer: int, **values: torch.Tensor) -> None:
        """Cache this rank's new entries; under a token split, all-gather them
        first and write the slots this rank owns. A formatted family's values
        are checked finite on the device, read once at :meth:`finish`.
        [[RFC-0001:C-DIRECT-WRITE]]"""
        p = self.plan
        if p.token_split:
            values = self._gather_entries(layer, values)
        for n, x in values.items():
            f = self.pool.families[n]
            if f.format is not None:
                self._finite &= all_finite(x)
            segment = CacheView(self.pool.segment(n, layer), f.format, f.shape)
            p.backend.store(segment, x, p.write, self.layout, self.pool.rank, self._report)
            self._stores += 1
        self._dirty = True

    def _gather_entries(self, layer: int, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under a token split: every rank's new entries, in batch order."""
        p = self.plan
        got = self._gather_rows(layer, "kv_allgather", p.gathered_order, p.rank_sizes, *values.values())
        return dict(zip(values, got))

    def _gather_rows(self, layer: int, term: str, order: torch.Tensor, sizes: list[int],
                     *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's rows of ``xs`` (``sizes`` rows a rank), row ``j`` of the
        gather (rank by rank) at ``order[j]``: one all-gather of the tensors
        packed side by side, each in its own dtype, counted as ``term``."""
        parts = self.comm.all_gather(pack_rows(*xs), sizes)
        self.traffic.received(layer, term, parts, self.comm.rank)
        every = torch.cat(parts)
        out = torch.empty_like(every)
        out[order] = every
        return tuple(unpack_rows(out, [(x.dtype, tuple(x.shape[1:])) for x in xs]))

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
                raise_refused(report, self.plan.write.slots.cpu(), self.layout, self.pool.rank)
            if not finite:
                raise ValueError("a layer cached a NaN or infinite value in a formatted family (its FP8 scale or "
                                 "bfloat16 bytes are garbage now): the model's values must be finite")
        for layer, names, n, remote, term in self._counted:
            n, remote = int(n), int(remote)
            self.kv_read += n
            for name in names:
                self.reads[name] = self.reads.get(name, 0) + n
                self.traffic.add(layer, term, remote * self._slot_bytes(name))
        self._counted.clear()

    # -- the queries ----------------------------------------------------------------
    def queries(self, layer: int, *x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-token tensors ``x [T, ...]`` of this rank's tokens for the
        queries it attends at ``layer`` (:attr:`query_positions`): ``x``
        itself, or under ``lse`` every token's of the batch, in batch order
        (one all-gather of every tensor packed side by side, each in its own
        dtype)."""
        if self.plan.mode != "lse":
            return x
        p = self.plan
        return self._gather_rows(layer, "query_allgather", p.gathered_order, p.rank_sizes, *x)

    # -- reads through the shared view -------------------------------------------------
    def context(self, layer: int, family: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query's whole context in ``family`` through the shared view:
        ``(values [Tq, L, *shape], visible [Tq, L])`` (under ``lse`` too: a
        read of every rank's pages)."""
        self._fence_if_dirty()
        plan = self.plan.attn
        self._count(layer, (family,), plan.context.count, self.plan.remote_reads)
        return self.plan.backend.context(plan, self._view(family, layer))

    def select(self, layer: int, family: str, k: int, score: Callable[..., torch.Tensor],
               *queries: torch.Tensor) -> torch.Tensor:
        """Each query's best ``min(k, visible)`` context positions by ``score``
        (see :class:`cpkv.models.CacheAccess`), ``[Tq, K]`` int64, ``-1``
        padding, ties to the lower position
        (:func:`~cpkv.models.attention.topk_positions`).

        Under ``lse`` each rank scores the keys on its own pages only and
        returns its own share of every query's selection: the exchange of
        :func:`~cpkv.runtime.lse.global_topk` fixes the global threshold, so
        the shares together are the set one rank scoring every key would
        pick. Elsewhere the rank scores its own tokens' whole contexts
        through the shared view. An
        :class:`~cpkv.models.attention.IndexerScore` is computed by the
        backend's ``index_scores`` over the view; another score gets the
        gathered context."""
        if self.plan.mode != "lse":
            self._fence_if_dirty()
            plan = self.plan.attn
            self._count(layer, (family,), plan.context.count, self.plan.remote_reads)
            return topk_positions(*self._scores(plan, layer, family, score, queries), k)
        plan = self.plan.lse.sel  # the batch's table with other ranks' slots masked out: all local
        self._count(layer, (family,), plan.context.count, 0)
        s, visible = self._scores(plan, layer, family, score, queries)
        if k not in self._exchange:  # the queries that see more than k keys in all: host positions, no device read
            x = torch.from_numpy(np.flatnonzero(self.plan.lse.positions + 1 > k))
            self._exchange[k] = x.to(self.plan.device)
        return global_topk(s.masked_fill(~visible, float("-inf")), self._exchange[k], k, self.comm, self.traffic,
                           layer)

    def _scores(self, plan: QueryPlan, layer: int, family: str, score, queries):
        """``(scores [Tq, L], visible [Tq, L])`` of the plan's queries over their contexts in ``family``."""
        view = self._view(family, layer)
        if isinstance(score, IndexerScore):
            q, w = queries
            L = plan.context.read.shape[1]  # the gathered path's context width: the same top-k width
            s = self.plan.backend.index_scores(plan, q, w, view, score.scale)[:, :L]
            return s, s > float("-inf")
        keys, visible = self.plan.backend.context(plan, view)
        valid = plan.context.valid if plan.context.identity else plan.context.valid[plan.context.inv]
        return score(*queries, keys), visible & valid

    def attend_dense(self, layer: int, q: torch.Tensor, scaling: float, key: str, value: str,
                     value_dims: int | None = None, project: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """Causal attention of the queries ``q [Tq, H, D]`` over each one's
        whole context (see :class:`cpkv.models.CacheAccess`), ``project``
        applied to the output; this rank's tokens' rows, ``[T, H, Dv']``.
        Under ``lse``, over the context slots this rank owns only (its own
        segment: no fence), ``project`` applied to each rank's partial and the
        partials merged at each token's home rank."""
        a, lse_split = self.plan.attn, self.plan.mode == "lse"
        if not lse_split:
            self._fence_if_dirty()
        self._count(layer, (key, value), a.own_count if lse_split else a.context.count, self.plan.remote_reads)
        out, lse = self.plan.backend.dense(a, q, self._view(key, layer), self._view(value, layer), scaling, value_dims)
        out = out.to(q.dtype)
        if project is not None:
            out = project(out)
        return self._merge_home(layer, out, lse) if lse_split else out

    def attend_selected(self, layer: int, q: torch.Tensor, positions: torch.Tensor, scaling: float, key: str,
                        value: str, value_dims: int | None = None,
                        project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of the queries ``q [Tq, H, D]`` over their selected
        context positions ``positions [Tq, K]`` (``-1``: none; under ``lse``
        this rank's share, as :meth:`select` returns it), keys the rows of
        family ``key`` and values their first ``value_dims`` entries
        (``value`` must be ``key``: one family, as MLA's latent;
        ``ValueError`` otherwise), ``project`` applied to the output (under
        ``lse`` to each rank's partial, then merged at the home rank; it must
        act on each head alone, as MLA's ``W_UV`` does, for the merge to
        commute with it). Returns this rank's tokens' rows, ``[T, H, Dv']``."""
        if key != value:
            raise ValueError(f"attend_selected reads keys and values from one family (MLA's latent), got "
                             f"{key!r} and {value!r}")
        a, lse_split = self.plan.attn, self.plan.mode == "lse"
        slots = torch.where(positions >= 0, self.plan.table[a.q_req[:, None], positions.clamp(min=0)], -1)
        if lse_split:
            seen = self.layout.owned_slot_mask(slots, owner_rank=a.own_rank, check=False)
            remote = 0
        else:
            self._fence_if_dirty()
            seen = slots >= 0
            remote = (seen & ~self.layout.owned_slot_mask(slots, owner_rank=self.pool.rank, check=False)).sum()
        self._count(layer, (key,), seen.sum(), remote, "kv_remote_selected")
        view = self._view(key, layer)
        dims = value_dims if value_dims is not None else view.shape[-1]
        out, lse = self.plan.backend.selected(a, q, view, slots, scaling, dims)
        out = out.to(q.dtype)
        if project is not None:
            out = project(out)
        return self._merge_home(layer, out, lse) if lse_split else out

    def selection(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """The whole selection ``[T, K]`` (int32, ``-1`` after) of this rank's
        tokens from what :meth:`select` returned at ``layer``: that itself, or under
        ``lse`` every rank's share of each token, met at its home rank (one
        all-to-all, counted as ``selection_record``; collective). The order
        inside a row is not the selection's."""
        if self.plan.mode != "lse":
            return positions.to(torch.int32)
        p, N = self.plan, self.comm.size
        mine = positions.to(torch.int32)[p.gathered_order]
        got = self.comm.all_to_all(list(mine.split(p.rank_sizes)), [self.num_tokens] * N)
        self.traffic.received(layer, "selection_record", got, self.comm.rank)
        every = torch.cat(got, 1)  # [T, N K]: the shares are disjoint and together K at most
        return pack_left(every >= 0, every, positions.shape[1]).to(torch.int32)

    # -- the log-sum-exp decode split ----------------------------------------------------
    def _merge_home(self, layer: int, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Every query's partial ``out [Tq, H, Dv]`` (its dtype) and ``lse
        [Tq, H]`` (float32) sent to its home rank (one all-to-all of both,
        packed), merged there exactly: this rank's tokens' ``[T, H, Dv]``."""
        p, N = self.plan, self.comm.size
        packed = pack_rows(out, lse.float())[p.gathered_order]
        got = self.comm.all_to_all(list(packed.split(p.rank_sizes)), [self.num_tokens] * N)
        self.traffic.received(layer, "partial_alltoall", got, self.comm.rank)
        outs, lses = unpack_rows(torch.stack(got).flatten(0, 1), [(out.dtype, tuple(out.shape[1:])),
                                                                  (torch.float32, tuple(lse.shape[1:]))])
        T = self.num_tokens
        return self.plan.backend.merge(outs.view(N, T, *out.shape[1:]), lses.view(N, T, *lse.shape[1:]))[0]
