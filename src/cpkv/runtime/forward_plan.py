"""The forward plan: everything one rank's layers need of a batch, built once before the first layer.

FlashInfer splits attention into ``plan`` (per batch: index arithmetic, on
the host, free to synchronise) and ``run`` (per layer: kernels only). cpkv
does the same for its data plane: :meth:`ForwardPlan.build` derives, from an
allocation and its page table, this rank's tokens, the slots it writes (their
ownership checked once: a slot another rank owns raises
:class:`~cpkv.contract.errors.ContractViolation` here, before any layer runs,
[[RFC-0001:C-DIRECT-WRITE]]), the rank-major read index of each context
([[RFC-0001:C-READ-PATH]]), the query grouping of the torch attention, and
under the log-sum-exp decode split the owned positions and who selects which
token. Every tensor lives on the pool's device. Per layer,
:class:`~cpkv.runtime.batch.ForwardBatch` then only stores, fences and
attends, with no host synchronisation (``tests/runtime/test_forward_plan.py``
counts them).

"Plan" elsewhere in cpkv: the *owner plan* of a request (which rank owns each
new page, :mod:`cpkv.contract.plan`), the scheduler's :class:`StepPlan`, the
transfer plan. A :class:`ForwardPlan` is none of these: it is derived from an
allocation and plans no ownership; it is the per-batch index work of one rank.

Writes are described entry by entry (``write_slots``: the logical slot each
computed or gathered entry goes to, ``-1`` where this rank does not write it),
so a mode in which a rank writes every slot of the batch (a replicated cache)
is a different ``write_slots``, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..consumers.kv_pool import SharedKVPool
from ..contract.allocation import Allocation
from ..contract.errors import UnsupportedPagePlan
from ..models.attention import QueryGroups, query_groups

PREFILL_SPLITS = ("page", "interleave", "zigzag")
DECODE_SPLITS = ("owner", "lse")


def split_ranks(alloc: Allocation, mode: str, cp_size: int) -> torch.Tensor | None:
    """Rank that computes each token of the flattened batch, or ``None`` when
    every rank computes every token (``lse``). Pure: every rank gets the same.
    The page and owner splits take the owners the allocation carries, never
    recomputed from lengths ([[RFC-0001:C-DOWNSTREAM-CONTRACT]]); the token
    splits are the three functions below. [[RFC-0001:C-PLANNER-SPLIT]]"""
    if mode in ("page", "owner"):
        return alloc.token_owners
    if mode == "interleave":
        return interleave_ranks(alloc.out_cache_loc.numel(), cp_size, alloc.out_cache_loc.device)
    if mode == "zigzag":
        return zigzag_ranks(alloc.extend_lens, cp_size)
    if mode == "balanced":  # any batch size, context work balanced: a replicated cache's decode split
        return balanced_ranks(alloc.positions + 1, cp_size)
    if mode == "lse":
        return None
    raise ValueError(f"unknown split {mode!r}; prefill: {PREFILL_SPLITS}, decode: {DECODE_SPLITS}")


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
    most the largest item. Pure: every rank gets the same (the log-sum-exp
    decode split spreads each query's top-k selection with it)."""
    n = work.numel()
    order = torch.sort(work, descending=True, stable=True).indices
    j = torch.arange(n, device=work.device)
    snake = torch.where((j // cp_size) % 2 == 0, j % cp_size, cp_size - 1 - j % cp_size)
    ranks = torch.empty(n, dtype=torch.int64, device=work.device)
    ranks[order] = snake
    return ranks


@dataclass(frozen=True)
class ContextIndex:
    """Rank-major read index of some requests' contexts: ``read [b, L]``
    (int32/int64, padding clamped to 0), ``valid [b, L]`` (real entries),
    ``inv [T']`` each token's row, ``identity`` (``inv`` is ``0 .. b - 1``,
    so indexing by it would only copy), ``visible [T', L]`` (positions ``0 ..
    position``), ``count`` the valid entries (Python int, for the counters)."""

    read: torch.Tensor
    valid: torch.Tensor
    inv: torch.Tensor
    identity: bool
    visible: torch.Tensor
    count: int


@dataclass(frozen=True)
class LseParts:
    """Under the log-sum-exp decode split: per batch request, the context
    positions this rank owns packed left (``own_pos [B, Lown]``, -1 after),
    their read index, which each token sees (``own_seen [T, Lown]``) and
    their count; who selects which token (``sel_mine``: this rank's tokens,
    ``sel_order``: every token in selector order, ``sel_sizes``: every
    rank's count), this rank's selectors' context index and the selection
    width bound (the longest context)."""

    own_pos: torch.Tensor
    own_read: torch.Tensor
    own_seen: torch.Tensor
    own_count: int
    req_identity: bool
    sel_mine: torch.Tensor
    sel_order: torch.Tensor
    sel_sizes: list[int]
    sel_context: ContextIndex
    width: int


@dataclass(frozen=True)
class ForwardPlan:
    """One rank's plan of one batch (see the module docstring). Tensors on ``device``.

    * ``token_indices [T]`` (int64): the entries of the flattened batch this
      rank computes; ``req``, ``positions``, ``slots [T]`` theirs (``req``
      indexes the rows of ``table``);
    * ``rank_sizes``: under a token split every rank's token count (all-gather
      sizes), else ``None``; ``gathered_order [E]``: where every rank's
      tokens, gathered in rank order, go in the batch (token splits only);
    * ``write_slots [W]``: logical slot of each entry this rank stores, -1
      where it writes none (``W`` = T, or E under a token split);
      ``write_rows [W']``/``write_local [W']``: the entries it writes and
      their slots in its own segment (int64), ownership checked;
    * ``table [B, Lmax]``: the batch's page-table rows up to the longest
      sequence; ``context``: this rank's tokens' :class:`ContextIndex`;
      ``groups``: the torch attention's :class:`QueryGroups`;
      ``lse``: :class:`LseParts` under the ``lse`` split, else ``None``.
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
    write_slots: torch.Tensor
    write_rows: torch.Tensor
    write_local: torch.Tensor
    table: torch.Tensor
    context: ContextIndex
    groups: QueryGroups
    lse: LseParts | None

    @property
    def num_tokens(self) -> int:
        """T, the tokens this rank computes."""
        return self.token_indices.numel()

    @classmethod
    def build(cls, pool: SharedKVPool, rank: int, alloc: Allocation, table: torch.Tensor, mode: str, *,
              group_size: int | None = None, rows: torch.Tensor | None = None) -> "ForwardPlan":
        """Plan rank ``rank``'s share of ``alloc`` under split ``mode``, in a
        group of ``group_size`` ranks (default the layout's ``cp_size``; a
        replicated copy's layout has one rank while its group has N, and its
        pool, rank 0 of that layout, owns and writes every slot).

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
        N = layout.cp_size if group_size is None else group_size
        ranks = split_ranks(alloc, mode, N)
        E = alloc.out_cache_loc.numel()
        if ranks is None:
            idx = torch.arange(E)
        else:
            idx = torch.nonzero(ranks == rank).flatten()
        req, positions, slots = alloc.request_of_token[idx], alloc.positions[idx], alloc.out_cache_loc[idx]
        token_split = mode in ("interleave", "zigzag", "balanced")  # compute, all-gather, write what one owns
        gathered = torch.argsort(ranks, stable=True) if token_split else None
        sizes = torch.bincount(ranks, minlength=N).tolist() if ranks is not None else None
        # writes: page/owner write every slot they compute (each must be theirs); a token split writes the
        # gathered entries it owns; lse, the computed ones it owns
        if mode in ("page", "owner"):
            cand = slots
            write_slots = slots
        else:
            cand = alloc.out_cache_loc if token_split else slots
            write_slots = torch.where(layout.owned_slot_mask(cand, owner_rank=pool.rank), cand, layout.padding_value)
        write_local, write_rows = pool.write_index(write_slots)
        seq = alloc.seq_lens
        L = int(seq.max()) if seq.numel() else 0
        tab = (table[:, :L] if rows is None else table[:, :L][rows.to(table.device)]).to(dev)
        context = _context_index(pool, tab, seq, req, positions)
        groups = query_groups(context.inv.to(dev), positions.to(dev), context.read.shape[0], context.read.shape[1])
        lse = _lse_parts(pool, rank, tab, seq, req, positions, L) if mode == "lse" else None
        to = lambda x: None if x is None else x.to(dev)  # noqa: E731
        return cls(mode, rank, dev, to(idx), to(req), to(positions), to(slots), sizes, to(gathered),
                   to(write_slots), to(write_rows), to(write_local), tab, context, groups, lse)


def _context_index(pool: SharedKVPool, tab: torch.Tensor, seq: torch.Tensor, req: torch.Tensor,
                   positions: torch.Tensor) -> ContextIndex:
    """:class:`ContextIndex` of the requests of the tokens ``req [T']`` (each row once)."""
    dev = pool.device
    rows, inv = torch.unique(req, return_inverse=True)
    L = int(seq[rows].max()) if rows.numel() else 0
    read = pool.read_index(tab[rows.to(dev), :L])
    valid = read >= 0
    visible = torch.arange(L, device=dev)[None, :] <= positions.to(dev)[:, None]
    identity = inv.numel() == rows.numel() and torch.equal(inv, torch.arange(inv.numel()))
    return ContextIndex(read.clamp(min=0), valid, inv.to(dev), identity, visible, int(valid.sum()))


def _lse_parts(pool: SharedKVPool, rank: int, tab: torch.Tensor, seq: torch.Tensor, req: torch.Tensor,
               positions: torch.Tensor, L: int) -> LseParts:
    layout, dev = pool.layout, pool.device
    owned = layout.owned_slot_mask(tab, owner_rank=rank)
    pos = pack_left(owned, torch.arange(L, device=dev).expand_as(tab))
    slots = torch.where(pos >= 0, tab.gather(1, pos.clamp(min=0)), 0)
    own_read = pool.read_index(slots)
    p = pos[req.to(dev)]
    seen = (p >= 0) & (p <= positions.to(dev)[:, None])
    B = tab.shape[0]
    identity = req.numel() == B and torch.equal(req, torch.arange(B))
    ranks = balanced_ranks(positions + 1, layout.cp_size)
    mine = torch.nonzero(ranks == rank).flatten()
    width = int(positions.max()) + 1 if positions.numel() else 0
    return LseParts(pos, own_read, seen, int((pos >= 0).sum()), identity, mine.to(dev),
                    torch.argsort(ranks, stable=True).to(dev), torch.bincount(ranks, minlength=layout.cp_size).tolist(),
                    _context_index(pool, tab, seq, req[mine], positions[mine]), width)


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
