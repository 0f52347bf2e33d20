"""The forward plan: everything one rank's layers need of a batch, built once before the first layer.

FlashInfer splits attention into ``plan`` (per batch: index arithmetic, on
the host, free to synchronise) and ``run`` (per layer: kernels only). cpkv
does the same for its data plane: :meth:`ForwardPlan.build` derives, from an
allocation and its page table, this rank's tokens, the slots it writes (their
ownership checked once: a slot another rank owns raises
:class:`~cpkv.contract.errors.ContractViolation` here, before any layer runs,
[[RFC-0001:C-DIRECT-WRITE]]), the rank-major read index of each context
([[RFC-0001:C-READ-PATH]]), the data-plane backend's own plan of the
queries (:meth:`cpkv.kernels.backend.Backend.plan`: the torch backend's causal
grouping and mask, the Triton backend's decode list, extend blocks and, under
the log-sum-exp split, the slots this rank owns), and under that split who
selects which token. Every tensor lives on the pool's device. Per layer,
:class:`~cpkv.runtime.batch.ForwardBatch` then only stores, fences and
attends, with no host synchronisation (``tests/runtime/test_forward_plan.py``
counts them).

"Plan" elsewhere in cpkv: the *owner plan* of a request (which rank owns each
new page, :mod:`cpkv.contract.plan`), the scheduler's :class:`StepPlan`, the
transfer plan. A :class:`ForwardPlan` is none of these: it is derived from an
allocation and plans no ownership; it is the per-batch index work of one rank.

Writes are described entry by entry (``write.slots``: the logical slot each
computed or gathered entry goes to, ``-1`` where this rank does not write it),
so a mode in which a rank writes every slot of the batch (a replicated cache)
is a different ``write.slots``, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..consumers.kv_pool import SharedKVPool
from ..contract.allocation import Allocation
from ..contract.errors import UnsupportedPagePlan
from ..kernels import get as get_backend
from ..kernels.backend import Backend, QueryPlan, WriteIndex

PREFILL_SPLITS = ("page", "interleave", "zigzag")
#: The splits that compute tokens apart from their owners and all-gather the new entries
#: (``balanced``: a replicated cache's decode).
TOKEN_SPLITS = ("interleave", "zigzag", "balanced")
#: The decode splits a forward runs; ``auto`` (:data:`DECODE_SPLITS`) picks one of them per step.
CHOSEN_DECODE_SPLITS = ("owner", "lse")
DECODE_SPLITS = (*CHOSEN_DECODE_SPLITS, "auto")


def split_ranks(alloc: Allocation, mode: str, cp_size: int) -> torch.Tensor:
    """Rank that computes each token of the flattened batch. Pure: every rank
    gets the same. The page, owner and lse splits take the owners the
    allocation carries, never recomputed from lengths
    ([[RFC-0001:C-DOWNSTREAM-CONTRACT]]): under ``lse`` the owner of a
    token's new slot is its *home* rank (its projections, MLP and cache
    writes), while its attention is divided among every rank by pages
    (:mod:`cpkv.runtime.lse`); the token splits are the three functions below.
    [[RFC-0001:C-PLANNER-SPLIT]]"""
    if mode in ("page", "owner", "lse"):
        return alloc.token_owners
    if mode == "interleave":
        return interleave_ranks(alloc.out_cache_loc.numel(), cp_size, alloc.out_cache_loc.device)
    if mode == "zigzag":
        return zigzag_ranks(alloc.extend_lens, cp_size)
    if mode == "balanced":  # any batch size, context work balanced: a replicated cache's decode split
        return balanced_ranks(alloc.positions + 1, cp_size)
    raise ValueError(f"unknown split {mode!r}; prefill: {PREFILL_SPLITS}, decode: {CHOSEN_DECODE_SPLITS}")


def interleave_ranks(num_tokens: int, cp_size: int, device=None) -> torch.Tensor:
    """Rank of every token of a flattened batch of ``num_tokens`` under the
    interleaved split (SGLang DSA CP): token i goes to rank ``i % N``, int64
    ``[num_tokens]`` on ``device``. Raises ``UnsupportedPagePlan
    ("interleave-too-short")`` for fewer than N tokens (some rank would get
    none). [[RFC-0001:C-PLANNER-SPLIT]]"""
    if num_tokens < cp_size:
        raise UnsupportedPagePlan(
            "interleave-too-short", f"interleave split needs at least {cp_size} tokens, batch has {num_tokens}"
        )
    return torch.arange(num_tokens, device=device) % cp_size


def zigzag_ranks(extend_lens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Rank of every token of the flattened batch under the zigzag split.

    Each request's extend of ``n`` tokens is cut into ``2N`` consecutive blocks,
    the first ``n % 2N`` of them one token longer; block ``b`` goes to rank
    ``b`` for ``b < N`` and to rank ``2N - 1 - b`` otherwise, so every rank
    gets one early (cheap) and one late (costly) block of causal attention.
    [[RFC-0001:C-PLANNER-SPLIT]]
    """
    N2 = 2 * cp_size
    n = extend_lens.to(torch.int64)
    req = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
    j = torch.arange(req.numel(), device=n.device) - (torch.cumsum(n, 0) - n)[req]  # index inside the extend
    base, extra = (n // N2)[req], (n % N2)[req]
    long_part = extra * (base + 1)
    block = torch.where(j < long_part, j // (base + 1), extra + (j - long_part) // base.clamp(min=1))
    return torch.where(block < cp_size, block, N2 - 1 - block)


def balanced_ranks(work: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Rank of each item ``[n]`` so that every rank's summed ``work [n]`` is
    near equal and item counts differ by at most one: items sorted by work,
    largest first (ties: lower index first), dealt out in snake order
    ``0 .. N-1, N-1 .. 0, 0 .. N-1, ...``. Any two ranks' sums then differ by at
    most the largest item. Pure: every rank gets the same."""
    n = work.numel()
    order = torch.sort(work, descending=True, stable=True).indices
    j = torch.arange(n, device=work.device)
    snake = torch.where((j // cp_size) % 2 == 0, j % cp_size, cp_size - 1 - j % cp_size)
    ranks = torch.empty(n, dtype=torch.int64, device=work.device)
    ranks[order] = snake
    return ranks


@dataclass(frozen=True)
class LseParts:
    """What the log-sum-exp decode split (:mod:`cpkv.runtime.lse`) plans
    besides the queries' own plan (every token of the batch a query of every
    rank, over that rank's own pages; its all-gathers and all-to-alls move
    rows in :attr:`ForwardPlan.gathered_order`, :attr:`ForwardPlan.rank_sizes`):
    ``sel`` the backend's plan of every query over the batch's table with the
    slots of other ranks masked out (what the indexer scores, all local);
    ``positions`` every query's position on the host, numpy (which queries
    see more than a top-k's ``k`` keys, known without a device read)."""

    sel: QueryPlan
    positions: np.ndarray


@dataclass(frozen=True)
class ForwardPlan:
    """One rank's plan of one batch (see the module docstring). Tensors on ``device``.

    * ``token_indices [T]`` (int64): the entries of the flattened batch this
      rank computes; ``req``, ``positions``, ``slots [T]`` theirs (``req``
      indexes the rows of ``table``);
    * ``rank_sizes``: under a token split and ``lse`` every rank's token count
      (the all-gather's sizes; ``lse``'s all-to-all's too), else ``None``;
      ``gathered_order [E]``: where every rank's tokens, gathered in rank
      order, go in the batch (token splits and ``lse``); ``token_split``:
      whether the new entries are all-gathered (a token split);
    * ``write``, a :class:`~cpkv.kernels.backend.WriteIndex`: ``slots
      [W]`` the logical slot of each entry this rank stores, -1 where it
      writes none (``W`` = T, or E under a token split), ``rows [W']`` /
      ``local [W']`` the entries it writes and their slots in its own segment
      (int64), ownership checked by the pool (:meth:`SharedKVPool.write_index`)
      once: what every layer's store takes;
    * ``table [B, Lmax]``: the batch's page-table rows up to the longest
      sequence; ``backend``: the data plane the batch runs on; ``attn``: its
      plan of this rank's tokens (under ``lse`` over the slots this rank owns
      only, with log-sum-exps to merge); ``lse``: :class:`LseParts` under
      the ``lse`` split, else ``None``.
    """

    mode: str
    rank: int
    device: torch.device
    token_indices: torch.Tensor
    req: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    rank_sizes: list[int] | None
    gathered_order: torch.Tensor | None
    remote_reads: int
    write: WriteIndex
    table: torch.Tensor
    backend: Backend
    attn: QueryPlan
    lse: LseParts | None

    @property
    def num_tokens(self) -> int:
        """T, the tokens this rank computes."""
        return self.token_indices.numel()

    @property
    def token_split(self) -> bool:
        """Whether the batch runs a token split (its new entries all-gathered, each owner writing its own)."""
        return self.mode in TOKEN_SPLITS

    @classmethod
    def build(cls, pool: SharedKVPool, rank: int, alloc: Allocation, table: torch.Tensor, mode: str, *,
              group_size: int | None = None, rows: torch.Tensor | None = None,
              backend: Backend | None = None) -> "ForwardPlan":
        """Plan rank ``rank``'s share of ``alloc`` under split ``mode``, in a
        group of ``group_size`` ranks (default the layout's ``cp_size``; a
        replicated copy's layout has one rank while its group has N, and its
        pool, rank 0 of that layout, owns and writes every slot), for
        ``backend`` (default the torch backend).

        ``table [R, width]`` holds the batch's logical slots by position
        (padding after ``seq_lens``), any device: request ``i`` in row
        ``rows[i]`` (int64 ``[B]``; ``None``: the table is the batch's rows,
        in order). Only ``[rows, :L]`` is read, ``L`` the longest sequence:
        a page table far wider than the batch is never copied whole. Synchronises freely (it runs
        once per batch). Raises ``ValueError`` for an unknown mode,
        :class:`~cpkv.contract.errors.ContractViolation` if this rank would
        write a slot another rank owns (nothing is marked written then), and
        ``IndexError`` for a slot outside the layout."""
        layout, dev = pool.layout, pool.device
        backend = backend or get_backend("torch")
        N = layout.cp_size if group_size is None else group_size
        ranks = split_ranks(alloc, mode, N)
        idx = torch.nonzero(ranks == rank).flatten()
        req, positions, slots = alloc.request_of_token[idx], alloc.positions[idx], alloc.out_cache_loc[idx]
        token_split = mode in TOKEN_SPLITS  # compute, all-gather, write what one owns
        gathers = token_split or mode == "lse"  # entries, or the lse split's queries
        gathered = torch.argsort(ranks, stable=True) if gathers else None
        sizes = torch.bincount(ranks, minlength=N).tolist() if gathers else None
        # writes: page/owner/lse write every slot they compute (each must be theirs); a token split writes the
        # gathered entries it owns
        if token_split:
            cand = alloc.out_cache_loc
            write_slots = torch.where(layout.owned_slot_mask(cand, owner_rank=pool.rank), cand, layout.padding_value)
        else:
            write_slots = slots
        write_local, write_rows = pool.write_index(write_slots)
        seq = alloc.seq_lens
        L = int(seq.max()) if seq.numel() else 0
        tab = (table[:, :L] if rows is None else table[:, :L][rows.to(table.device)]).to(dev)
        to = lambda x: None if x is None else x.to(dev)  # noqa: E731
        if mode == "lse":
            every_req, every_pos = alloc.request_of_token.to(dev), alloc.positions.to(dev)
            attn = backend.plan(tab, every_req, every_pos, layout, own_rank=rank, with_lse=True)
            own = torch.where(layout.owned_slot_mask(tab, owner_rank=rank), tab, layout.padding_value)
            sel = backend.plan(own, every_req, every_pos, layout, with_lse=False)
            lse = LseParts(sel, alloc.positions.cpu().numpy())
            remote = 0
        else:
            attn = backend.plan(tab, to(req), to(positions), layout, with_lse=False)
            lse, remote = None, _remote_reads(layout, pool.rank, tab, to(req), to(positions))
        return cls(mode, rank, dev, to(idx), to(req), to(positions), to(slots), sizes, to(gathered), remote,
                   WriteIndex(to(write_slots), to(write_local), to(write_rows)), tab, backend, attn, lse)


def _remote_reads(layout, rank: int, tab: torch.Tensor, req: torch.Tensor, positions: torch.Tensor) -> int:
    """Entries on pages another rank owns that the queries ``req [T]``,
    ``positions [T]`` over ``tab [B, L]`` read: each request's context once,
    up to the furthest position its queries here see (a kernel reads a key
    once for a block of queries). Host int (once per batch)."""
    if not req.numel() or layout.cp_size == 1:
        return 0
    reach = torch.full((tab.shape[0],), -1, dtype=torch.int64, device=tab.device)
    reach.scatter_reduce_(0, req, positions.to(torch.int64), reduce="amax")
    rows = torch.nonzero(reach >= 0).flatten()
    remote = (tab[rows] >= 0) & ~layout.owned_slot_mask(tab[rows], owner_rank=rank, check=False)
    return int(torch.cumsum(remote.to(torch.int64), 1).gather(1, reach[rows, None]).sum())
