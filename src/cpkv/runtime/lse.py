"""The log-sum-exp decode split's exchanges: what moves between the ranks, and the all-local top-k.

Decode context parallelism (vLLM's DCP, TensorRT-LLM's Helix) on the shared
cache: each decode token is computed by its *home* rank, the owner of its new
slot (it writes the token's cache entries into its own segment and runs the
token's projections and MLP); the attention is divided by pages, every rank
attending every token's query over the context on its own pages only. Per
layer that takes, per rank (bytes received are counted by term, see
:data:`TERMS`):

* ``query_allgather``: one all-gather of what the queries are made from (the
  home ranks' rows, back in batch order): a model gathers the smallest input
  its queries follow from (Llama its rotated queries; DeepSeek-V3.2 / GLM-5
  the ``q_lora`` latent and the indexer's head weights, each rank then runs
  the query up-projections itself);
* ``topk_exchange`` (DSA): each rank scores the indexer keys on its own pages
  and sends its best :func:`exchange_width` scores of each query whose
  context holds more than ``k`` keys (float32: a top-k decides on exact
  equality and order, which no narrower type keeps); from the union every
  rank reads the global k-th score, the *threshold*, and keeps the keys of
  its own above it (:func:`global_topk`). A rank whose sent scores all lie
  above the threshold may hold more: those rows repeat the exchange with
  ``k`` scores a rank (``topk_fallback``, rare); equal scores at the
  threshold spread over ranks exchange their positions once
  (``topk_ties``), so the set is exactly the one
  :func:`~cpkv.models.attention.topk_positions` picks from the whole row;
* ``partial_alltoall``: every rank sends each token's partial output and
  log-sum-exp to the token's home rank (one all-to-all: the step's layout is
  a home rank per token, so the merged output is needed there only), which
  merges them exactly (:meth:`cpkv.kernels.backend.Backend.merge`).

The merge is vLLM's (``vllm/attention/ops/common.py``: ``cp_lse_ag_out_rs``,
whose ``correct_attn_out`` kernel scales each rank's output by
``exp(lse_r - logsumexp_r lse_r)`` after an all-gather of the LSEs, then
reduce-scatters the outputs over heads): written here as one all-to-all,
since each token's output is needed on one rank, not each head's on one
rank (vLLM's DCP divides the heads among its tensor-parallel ranks). It
moves ``(N-1)/N B H (Dv + 1)`` values a layer per rank against vLLM's
``(N-1)/N B H Dv`` outputs plus ``(N-1) B H`` LSEs. The output moves in
the attention's compute dtype (the partial is a normalised softmax mean
each rank's kernel already rounded to that dtype; float32 would double the
bytes for no exactness) and, for MLA, after ``W_UV`` (the merge is a
per-head weighted sum, so ``W_UV`` commutes with it; ``v_head`` values a head
instead of ``kv_lora_rank``). The LSE moves in float32: the merge weight
``exp(lse_r - lse)`` multiplies the relative error of the difference by the
LSE's magnitude, and a bfloat16 LSE of ~10 is off by ~0.03, a 3% weight.

What no rank moves: cache entries (every read is of the rank's own segment)
and the context.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..models.attention import rank_keys
from .comm import Comm

#: The terms the engine counts bytes by (received by a rank from the others,
#: per layer): the collectives of the splits, and the reads of other ranks'
#: pages through the shared view (``kv_remote_read``: keys every query reads,
#: a dense model's K and V, DSA's indexer keys, each request's context once
#: per rank; ``kv_remote_selected``: the latents a DSA top-k selected, per query).
TERMS = ("kv_allgather", "kv_remote_read", "kv_remote_selected", "query_allgather", "topk_exchange",
         "topk_fallback", "topk_ties", "partial_alltoall", "selection_record")

_POS_MAX = 2**31 - 1  # a position padding value above every position


class Traffic:
    """Bytes a rank received (or read from other ranks' pages), by ``(layer, term)``."""

    def __init__(self):
        self.by_layer: dict[tuple[int, str], int] = defaultdict(int)

    def add(self, layer: int, term: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``term`` (one of :data:`TERMS`) at ``layer``."""
        if term not in TERMS:
            raise ValueError(f"unknown traffic term {term!r}; terms: {TERMS}")
        if nbytes:
            self.by_layer[(layer, term)] += int(nbytes)

    def received(self, layer: int, term: str, parts: list[torch.Tensor], rank: int) -> None:
        """Count the bytes of every part but rank ``rank``'s own."""
        self.add(layer, term, sum(p.numel() * p.element_size() for r, p in enumerate(parts) if r != rank))

    def by_term(self) -> dict[str, int]:
        """Every layer's bytes summed, by term."""
        out: dict[str, int] = defaultdict(int)
        for (_, term), n in self.by_layer.items():
            out[term] += n
        return dict(out)


def exchange_width(k: int, cp_size: int) -> int:
    """Scores a rank sends per query in the top-k exchange's first round:
    ``min(k, ceil(2 k / N))``, twice a rank's even share of the ``k`` (at
    least ``ceil(k / N)``, so the union holds ``k``)."""
    return min(k, -(-2 * k // cp_size))


def pack_rows(*xs: torch.Tensor) -> torch.Tensor:
    """Tensors with the same first dimension ``T``, any dtypes, as one
    ``uint8 [T, bytes]`` (each row's bytes side by side): one collective moves
    them all, each in its own dtype."""
    T = xs[0].shape[0]
    return torch.cat([x.reshape(T, math.prod(x.shape[1:])).contiguous().view(torch.uint8) for x in xs], 1)


def unpack_rows(packed: torch.Tensor, likes: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """:func:`pack_rows` undone: ``packed [T, bytes]`` into one tensor per
    ``(dtype, per-row shape)``, ``[T, *shape]``."""
    out, at, T = [], 0, packed.shape[0]
    for dtype, shape in likes:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(packed[:, at : at + n].contiguous().view(dtype).reshape(T, *shape))
        at += n
    return out


def global_topk(scores: torch.Tensor, exchange: torch.Tensor, k: int, comm: Comm, traffic: Traffic,
                layer: int) -> torch.Tensor:
    """This rank's share of every query's global top-k.

    ``scores [T, L]`` float32: each query's scores of the keys on this rank's
    own pages that it sees, ``-inf`` elsewhere (column = position);
    ``exchange [X]`` int64: the queries that see more than ``k`` keys in all
    (the same on every rank); the others select every key they see. Returns
    ``[T, min(k, L)]`` int64: this rank's positions of each query's top-k,
    best first, ``-1`` after. The union over the ranks is, for every query,
    :func:`~cpkv.models.attention.topk_positions` of the whole row (ties to
    the lower position). Collective: every rank calls it alike. The scores
    never leave a rank but :func:`exchange_width` of them per query (and, for
    the rare rows that need it, ``k`` of them and the positions of equal
    scores at the threshold); one host read per round decides whether the
    next is needed."""
    T, L = scores.shape
    K = min(k, L)
    s = scores.float() + 0.0
    top = rank_keys(s).topk(K, dim=-1).indices  # best first: score, then the lower position
    top_s = s.gather(1, top)
    tau = torch.full((T,), float("-inf"), device=s.device)  # keep own keys above tau ...
    tie_pos = torch.full((T,), _POS_MAX, dtype=torch.int64, device=s.device)  # ... and at tau up to this position
    X = exchange.numel()
    if X:
        N, rank, m = comm.size, comm.rank, exchange_width(k, comm.size)
        mine = top_s[exchange]  # [X, k]: a query seeing more than k keys has a row wider than k
        sent = torch.stack(comm.all_gather(mine[:, :m].contiguous(), [X] * N))  # [N, X, m]
        traffic.add(layer, "topk_exchange", (N - 1) * sent[0].numel() * 4)
        union = sent.permute(1, 0, 2).reshape(X, N * m)
        t = union.topk(k, dim=1).values[:, k - 1]
        last = sent[:, :, m - 1].T  # [X, N]: each rank's smallest score sent
        ok = ((last == float("-inf")) | (last <= t[:, None])).all(1)
        if m < k and not bool(ok.all()):  # a rank may hold more above t than it sent: k scores a rank
            redo = torch.nonzero(~ok).flatten()
            more = torch.stack(comm.all_gather(mine[redo].contiguous(), [redo.numel()] * N))  # [N, R, k]
            traffic.add(layer, "topk_fallback", (N - 1) * more[0].numel() * 4)
            full = torch.full((X, N, k), float("-inf"), device=s.device)
            full[:, :, :m] = sent.permute(1, 0, 2)
            full[redo] = more.permute(1, 0, 2)
            last = torch.where(ok[:, None], last, full[:, :, k - 1])
            union = full.reshape(X, N * k)
            t = torch.where(ok, t, union.topk(k, dim=1).values[:, k - 1])
        # ties at t: need of them are taken, the lowest positions first
        need = k - (union > t[:, None]).sum(1)
        got = (union.view(X, N, -1) == t[:, None, None]).sum(2)  # [X, N] ties each rank sent
        holds = (got > 0) | (last == t[:, None])  # ranks that hold ties (sent, or maybe unsent)
        every = ~(last == t[:, None]).any(1) & (got.sum(1) == need)  # all the ties are taken
        alone = holds.sum(1) == 1  # one rank holds them all: it takes its need lowest
        own_gt = (mine > t[:, None]).sum(1)
        at = (own_gt + need - 1).clamp(max=k - 1)
        nth = torch.where(mine.gather(1, at[:, None])[:, 0] == t, top[exchange].gather(1, at[:, None])[:, 0], -1)
        tp = torch.where(every, _POS_MAX, torch.where(alone & holds[:, rank], nth, _POS_MAX))
        spread = ~(every | alone)
        if bool(spread.any()):  # ties over several ranks: each sends its need lowest tied positions
            rows = torch.nonzero(spread).flatten()
            w = int(need[rows].max())
            cols = own_gt[rows, None] + torch.arange(w, device=s.device)[None]
            inside = cols < k
            cols = cols.clamp(max=k - 1)
            tied = inside & (mine[rows].gather(1, cols) == t[rows, None]) & (torch.arange(w, device=s.device)[None]
                                                                            < need[rows, None])
            pos = torch.where(tied, top[exchange][rows].gather(1, cols), _POS_MAX).to(torch.int32)
            every_pos = torch.stack(comm.all_gather(pos, [rows.numel()] * N))  # [N, R, w]
            traffic.add(layer, "topk_ties", (N - 1) * pos.numel() * 4)
            allp = every_pos.permute(1, 0, 2).reshape(rows.numel(), N * w).to(torch.int64)
            tp[rows] = allp.sort(1).values.gather(1, (need[rows] - 1)[:, None])[:, 0]
        tau[exchange], tie_pos[exchange] = t, tp
    keep = (top_s > tau[:, None]) | ((top_s == tau[:, None]) & (top <= tie_pos[:, None]))
    keep &= top_s > float("-inf")
    return torch.where(keep, top, -1)  # a prefix of each row: the order is the selection's
