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
  context length, :func:`cpkv.contract.plan.balanced_ranks`) and shared by one
  all-gather; attention over the selected positions is then split by owner.

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
from ..contract import plan
from ..contract.allocation import Allocation
from ..models.attention import attend, merge_partials, paged_attention, topk_positions
from .comm import Comm

PREFILL_SPLITS = ("page", "interleave", "zigzag")
DECODE_SPLITS = ("owner", "lse")


def split_ranks(alloc: Allocation, mode: str, cp_size: int) -> torch.Tensor | None:
    """Rank that computes each token of the flattened batch, or ``None`` when
    every rank computes every token (``lse``). Pure: every rank gets the same."""
    if mode in ("page", "owner"):
        return alloc.token_owners
    if mode == "interleave":
        return plan.interleave_ranks(alloc.out_cache_loc.numel(), cp_size, alloc.out_cache_loc.device)
    if mode == "zigzag":
        return plan.zigzag_ranks(alloc.extend_lens, cp_size)
    if mode == "balanced":  # any batch size, context work balanced: a replicated cache's decode split
        return plan.balanced_ranks(alloc.positions + 1, cp_size)
    if mode == "lse":
        return None
    raise ValueError(f"unknown split {mode!r}; prefill: {PREFILL_SPLITS}, decode: {DECODE_SPLITS}")


class ForwardBatch:
    """This rank's tokens of an allocated batch and its access to the cache.

    ``table [B, L]`` holds the logical slots of every request of the batch at
    positions ``0 .. seq_len - 1`` (padding after), the new slots included.
    """

    def __init__(self, pool: SharedKVPool, comm: Comm, alloc: Allocation, table: torch.Tensor, mode: str):
        self.pool, self.comm, self.alloc, self.mode = pool, comm, alloc, mode
        self.layout = pool.layout
        N = comm.size  # the layout's cp_size, or the group of a replicated copy's one-rank layout
        ranks = split_ranks(alloc, mode, N)
        everyone = torch.arange(alloc.out_cache_loc.numel())
        self.token_indices = everyone if ranks is None else torch.nonzero(ranks == comm.rank).flatten()
        # under a token split, every rank's tokens in rank order: how gathered entries map back
        self._gathered_order = None if mode in ("page", "owner", "lse") else torch.argsort(ranks, stable=True)
        self._rank_sizes = None if ranks is None else torch.bincount(ranks, minlength=N).tolist()
        idx = self.token_indices
        self.req = alloc.request_of_token[idx]
        self.positions = alloc.positions[idx]
        self.slots = alloc.out_cache_loc[idx]
        self.num_tokens = idx.numel()
        self.table = table
        self.scratch: dict = {}
        self._dirty = False
        self._read_all = None
        self._read_own = None
        self._selectors = None
        self.kv_read = 0
        self.reads: dict[str, int] = {}
        self.moved_bytes = 0

    # -- writes ---------------------------------------------------------------------
    def store(self, layer: int, **values: torch.Tensor) -> None:
        """Cache this rank's new entries; under a token split, all-gather them
        first and write the slots this rank owns. [[RFC-0001:C-DIRECT-WRITE]]"""
        if self._gathered_order is None:
            if self.mode == "lse":  # every rank computed every token: the owner writes
                mine = self.layout.owned_slot_mask(self.slots, owner_rank=self.comm.rank)
                self.pool.write(layer, self.slots[mine], **{n: x[mine] for n, x in values.items()})
            else:
                self.pool.write(layer, self.slots, **values)
        else:
            full = {}
            for group in _by_dtype(values):  # one all-gather per dtype, of every family packed side by side
                packed = torch.cat([values[n].reshape(self.num_tokens, math.prod(values[n].shape[1:]))
                                    for n in group], 1)
                parts = self.comm.all_gather(packed, self._rank_sizes)
                self.moved_bytes += sum(p.numel() * p.element_size() for r, p in enumerate(parts)
                                        if r != self.comm.rank)
                every = torch.empty((self.alloc.out_cache_loc.numel(), packed.shape[1]), dtype=packed.dtype)
                every[self._gathered_order] = torch.cat(parts)
                full.update(_unpack(every, {n: values[n].shape[1:] for n in group}))
            loc = self.alloc.out_cache_loc  # a replicated copy (pool.rank 0 of one rank) owns every slot
            mine = self.layout.owned_slot_mask(loc, owner_rank=self.pool.rank)
            self.pool.write(layer, loc[mine], **{n: x[mine] for n, x in full.items()})
        self._dirty = True

    def _fence_if_dirty(self) -> None:
        if self._dirty:
            self.pool.fence()
            self._dirty = False

    def finish(self) -> None:
        """Closing fence: no rank reads this batch's context any more, so its
        slots may be freed and reused."""
        self.pool.fence()
        self._dirty = False

    # -- reads through the shared view -------------------------------------------------
    def _context_index(self, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank-major read index ``[b, L]`` of the contexts of the requests
        ``req [T']`` (a request per token; each once), which entries are real
        (not padding), and each token's row among them. [[RFC-0001:C-READ-PATH]]"""
        rows, inv = torch.unique(req, return_inverse=True)
        L = int(self.alloc.seq_lens[rows].max()) if rows.numel() else 0
        read = self.pool.read_index(self.table[rows, :L])
        return read.clamp(min=0), read >= 0, inv

    def _read_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_context_index` of this rank's tokens, translated once per batch."""
        if self._read_all is None:
            self._read_all = self._context_index(self.req)
        return self._read_all

    def _gather(self, layer: int, index: torch.Tensor, valid: torch.Tensor, names: tuple[str, ...],
                own: bool = False) -> list[torch.Tensor]:
        """Entries of each family in ``names`` at rank-major ``index``,
        ``[*index.shape, *shape]``; entries where ``valid`` is False are read
        from slot 0 and must be masked by the caller. Counts the entries read
        (valid ones). ``own``: only this rank's segment is read, so no fence."""
        if not own:  # another rank's segment: its writes of this layer must have landed
            self._fence_if_dirty()
        n = int(valid.sum())
        self.kv_read += n
        for name in names:
            self.reads[name] = self.reads.get(name, 0) + n
        return list(self.pool.gather(layer, index, *names))

    def _values(self, layer, index, valid, key, value, value_dims, own=False):
        """Keys and values for attention, ``[*index.shape, Hkv, D]`` (a one-head
        family such as the MLA latent gets a head axis of 1)."""
        if key == value:
            (k,) = self._gather(layer, index, valid, (key,), own)
            v = k
        else:
            k, v = self._gather(layer, index, valid, (key, value), own)
        if k.dim() == index.dim() + 1:
            k, v = k.unsqueeze(-2), v.unsqueeze(-2)
        return k, (v if value_dims is None else v[..., :value_dims])

    def context(self, layer: int, family: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's whole context in ``family`` through the shared view:
        ``(values [T, L, *shape], visible [T, L])``."""
        return self._context(layer, family, self._read_index(), self.positions)

    def _context(self, layer, family, index, positions):
        read, valid, inv = index
        (ctx,) = self._gather(layer, read, valid, (family,))
        visible = torch.arange(read.shape[1])[None, :] <= positions[:, None]
        return (ctx if _identity(inv, ctx.shape[0]) else ctx[inv]), visible

    def select(self, layer: int, family: str, k: int, score: Callable[..., torch.Tensor],
               *queries: torch.Tensor) -> torch.Tensor:
        """Each token's best ``min(k, visible)`` context positions by ``score``
        (see :class:`cpkv.models.CacheAccess`), ``[T, K]`` int64, ``-1`` padding.

        Under ``lse`` every rank holds every token, yet each token is scored
        once: by the rank :func:`~cpkv.contract.plan.balanced_ranks` deals it to
        by context length, which reads that token's whole context through the
        shared view; one all-gather of the ``[T', K]`` positions (int32) gives
        every rank every selection, ``K = min(k, longest context)``. Elsewhere
        the rank scores its own tokens. The set is the one scoring every
        token's whole row would pick (the same rows, the same ``topk``)."""
        if self.mode != "lse":
            keys, visible = self.context(layer, family)
            return topk_positions(score(*queries, keys), visible, k)
        mine, order, sizes, index, width = self._selection_plan()
        keys, visible = self._context(layer, family, index, self.positions[mine])
        sel = topk_positions(score(*(x[mine] for x in queries), keys), visible, k)
        packed = torch.full((mine.numel(), min(k, width)), -1, dtype=torch.int32)
        packed[:, : sel.shape[1]] = sel
        parts = self.comm.all_gather(packed, sizes)
        self.moved_bytes += sum(p.numel() * p.element_size() for r, p in enumerate(parts) if r != self.comm.rank)
        out = torch.empty((self.num_tokens, packed.shape[1]), dtype=torch.int64)
        out[order] = torch.cat(parts).to(torch.int64)
        return out

    def _selection_plan(self):
        """Under ``lse``, once per batch: the tokens whose selection this rank
        makes, every token in rank order of who makes it, every rank's count,
        the read index of this rank's share and the longest context."""
        if self._selectors is None:
            ranks = plan.balanced_ranks(self.positions + 1, self.comm.size)
            mine = torch.nonzero(ranks == self.comm.rank).flatten()
            width = int(self.positions.max()) + 1 if self.num_tokens else 0
            self._selectors = (mine, torch.argsort(ranks, stable=True),
                               torch.bincount(ranks, minlength=self.comm.size).tolist(),
                               self._context_index(self.req[mine]), width)
        return self._selectors

    def attend_dense(self, layer: int, q: torch.Tensor, scaling: float, key: str, value: str,
                     value_dims: int | None = None) -> torch.Tensor:
        """Causal attention over each token's whole context (see :class:`cpkv.models.CacheAccess`)."""
        if self.mode == "lse":
            return self._attend_own(layer, q, scaling, key, value, value_dims)
        read, valid, inv = self._read_index()
        k, v = self._values(layer, read, valid, key, value, value_dims)
        return paged_attention(q, inv, self.positions, k, v, scaling)

    def attend_selected(self, layer: int, q: torch.Tensor, positions: torch.Tensor, scaling: float, key: str,
                        value: str, value_dims: int | None = None) -> torch.Tensor:
        """Attention over the selected context positions of each token, gathered;
        under ``lse``, over the selected slots this rank owns only (packed left,
        so a rank's work is its share of each selection), merged."""
        slots = torch.where(positions >= 0, self.table[self.req[:, None], positions.clamp(min=0)], -1)
        if self.mode == "lse":
            slots = _pack_left(self.layout.owned_slot_mask(slots, owner_rank=self.comm.rank), slots)
        seen = slots >= 0
        read = self.pool.read_index(torch.where(seen, slots, 0))
        k, v = self._values(layer, read, seen, key, value, value_dims, own=self.mode == "lse")
        out, lse = attend(q, k, v, seen, scaling)
        return self._merge(out, lse) if self.mode == "lse" else out

    # -- the log-sum-exp decode split ----------------------------------------------------
    def _own_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request of the batch, the context positions on pages this rank
        owns, packed left (``[B, Lown]``, -1 after), and their read index."""
        if self._read_own is None:
            L = int(self.alloc.seq_lens.max()) if self.alloc.batch_size else 0
            table = self.table[:, :L]
            owned = self.layout.owned_slot_mask(table, owner_rank=self.comm.rank)
            pos = _pack_left(owned, torch.arange(L).expand_as(table))
            slots = torch.where(pos >= 0, table.gather(1, pos.clamp(min=0)), 0)
            self._read_own = (pos, self.pool.read_index(slots))
        return self._read_own

    def _attend_own(self, layer, q, scaling, key, value, value_dims):
        pos, read = self._own_positions()
        k, v = self._values(layer, read, pos >= 0, key, value, value_dims, own=True)
        p = pos[self.req]
        seen = (p >= 0) & (p <= self.positions[:, None])
        if not _identity(self.req, pos.shape[0]):  # else a decode batch: one token per request, in order
            k, v = k[self.req], v[self.req]
        out, lse = attend(q, k, v, seen, scaling)
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
        return merge_partials(outs, lses)


def _identity(index: torch.Tensor, n: int) -> bool:
    """Whether ``index`` is ``0 .. n - 1`` (indexing with it would only copy)."""
    return index.numel() == n and torch.equal(index, torch.arange(n, device=index.device))


def _pack_left(keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The entries of ``values [R, L]`` where ``keep [R, L]``, packed left in
    their order in each row: ``[R, most kept in a row]``, ``-1`` after."""
    count = keep.sum(1)
    out = torch.full((keep.shape[0], int(count.max()) if count.numel() else 0), -1, dtype=values.dtype)
    row, col = torch.nonzero(keep, as_tuple=True)  # row-major: each row's kept entries in order
    out[row, (keep.cumsum(1) - 1)[row, col]] = values[row, col]
    return out


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
