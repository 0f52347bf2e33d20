"""The planner: request-local owner plans and the per-rank token splits (workstream W1).

Everything here is a small pure function. Requests are planned one by one,
never concatenated first: a request's lane base is a property of its own page
chain ([[RFC-0001:C-REQUEST-RELATIVE]]). Nothing here communicates
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import layout
from .errors import UnsupportedPagePlan
from .layout import lane_of_position

BASE_POLICIES = ("least_full", "lane0")


def choose_lane_bases(
    fixed_bases: np.ndarray,
    has_prefix: np.ndarray,
    first_positions: np.ndarray,
    new_pages: np.ndarray,
    lane_free: np.ndarray,
    cp_size: int,
    policy: str = "least_full",
) -> np.ndarray:
    """Lane base of every request of a batch, in request order.

    A request with a prefix keeps ``fixed_bases[r]``. One without picks, under
    ``least_full``, the lane with the most free pages (ties to the lowest lane),
    counting the pages that earlier requests of the same batch take, so a batch
    fills lanes evenly ([[RFC-0001:C-REQUEST-RELATIVE]]); under ``lane0`` it
    takes lane 0 (the comparison baseline).

    The rule is sequential; it is computed without a step per request. A
    request of ``n`` pages takes ``n // N`` pages of every lane (which moves no
    argmax) plus one of each of ``k = n % N`` consecutive lanes, so only those
    remainders matter. Lay the chosen requests' remainders end to end on an
    unrolled line of lanes (position ``x`` is lane ``x % N`` in sweep
    ``x // N``): a fresh request starts at the lowest lane of most free pages,
    which is where the previous fresh request's run ended whenever the counts
    are as even as a sweep leaves them (always from a cleared allocator). So
    every start is guessed as the previous run's end and all guesses are
    checked at once against the exact rule (one cumulative count over the
    batch); the first wrong guess is corrected and the rest re-checked. Each
    correction is one vectorised pass; after :data:`MAX_PASSES` of them the
    remaining requests (if any) take the plain sequential step.
    """
    if policy not in BASE_POLICIES:
        raise ValueError(f"unknown lane-base policy {policy!r}; choose from {BASE_POLICIES}")
    N = cp_size
    if N == 1 or has_prefix.all():
        return fixed_bases
    if policy == "lane0":
        return np.where(has_prefix, fixed_bases, 0)
    rem = new_pages % N
    if not rem.any():  # whole sweeps: every fresh request starts at the same lane
        b = int(np.argmax(lane_free))
        return np.full(has_prefix.size, b, dtype=np.int64) if not has_prefix.any() else np.where(has_prefix, fixed_bases, b)
    bases = fixed_bases.astype(np.int64, copy=True)
    moves = (~has_prefix | (rem != 0)).nonzero()[0]  # the others change nothing
    fresh = ~has_prefix[moves]
    k = rem[moves]
    start = (fixed_bases[moves] + first_positions[moves]) % N  # where a fixed request's remainder starts
    chosen = _sweep_bases(fresh, k, start, np.asarray(lane_free, dtype=np.int64), N)
    bases[moves[fresh]] = chosen
    return bases


MAX_PASSES = 4


def _sweep_bases(fresh: np.ndarray, k: np.ndarray, start: np.ndarray, lane_free: np.ndarray, N: int) -> np.ndarray:
    """Bases of the fresh entries (see :func:`choose_lane_bases`); ``start`` and
    ``k`` are every entry's first remainder lane (fixed entries) and remainder.

    With ``gap[l] = max(lane_free) - lane_free[l]`` the exact rule puts fresh
    request r in lane ``min_l(gap_l(r) * N + l) % N`` (the lowest lane of the
    fewest pages taken), where ``gap(r)`` adds the remainder pages of the
    requests before r. Only the lane of a guess is checked: the guesses that
    follow depend on it alone.
    """
    m = k.size
    lanes = np.arange(N)
    gap0 = lane_free.max() - lane_free
    covered = np.zeros(N, dtype=np.int64)  # remainder pages taken before entry r0
    pos = np.zeros(m, dtype=np.int64)  # unrolled start of each fresh entry
    r0, at = 0, int((gap0 * N + lanes).min())
    for _ in range(MAX_PASSES):
        kf = np.where(fresh[r0:], k[r0:], 0)
        guess = at + kf.cumsum() - kf
        lane = np.where(fresh[r0:], guess % N, start[r0:])
        cov = (lanes[None, :] - lane[:, None]) % N < k[r0:, None]
        before = covered + cov.cumsum(0) - cov
        exact = ((gap0 + before) * N + lanes).min(1)
        wrong = (fresh[r0:] & (exact % N != lane)).nonzero()[0]
        if wrong.size == 0:
            pos[r0:] = guess
            return pos[fresh] % N
        w = int(wrong[0])
        pos[r0 : r0 + w] = guess[:w]
        covered = before[w]
        r0, at = r0 + w, int(exact[w])
    # the plain sequential rule for what is left (rare: counts far from even)
    rel = (lane_free - covered).tolist()
    for r in range(r0, m):
        if fresh[r]:
            s = rel.index(max(rel))
            pos[r] = s
        else:
            s = int(start[r])
        for j in range(int(k[r])):
            rel[(s + j) % N] -= 1
    return pos[fresh] % N


@dataclass(frozen=True)
class LaneTake:
    """How many pages a batch takes from each lane, request by request.

    ``first_lane[r]`` is the lane of request r's first new page (its pages
    cycle from there), ``before[r, l]`` how many pages of lane l the requests
    before r take, ``lane_counts[l]`` the batch total. ``O(bs * N)``: nothing
    per page.
    """

    first_lane: np.ndarray
    before: np.ndarray
    lane_counts: np.ndarray


def lane_take(lane_base: np.ndarray, first_position: np.ndarray, num_pages: np.ndarray, cp_size: int) -> LaneTake:
    """Per-lane page counts of a batch: request r's chain counted by
    :func:`cpkv.contract.layout.chain_lane_pages`, then summed in request
    order ([[RFC-0001:C-OWNER-LANE]]). Page j of request r lies in lane
    ``(first_lane[r] + j) % N`` and is the ``before[r, lane] + j // N``-th
    page of that lane the batch takes."""
    start = lane_of_position(lane_base, first_position, cp_size)
    per_req = layout.chain_lane_pages(lane_base, first_position, num_pages, cp_size)
    before = per_req.cumsum(0)
    before -= per_req
    return LaneTake(start, before, before[-1] + per_req[-1] if per_req.size else per_req.sum(0))


@dataclass(frozen=True)
class RankSplit:
    """What one rank computes of a batch.

    ``token_indices`` index the flattened batch (``out_cache_loc``),
    ``query_lens[r]`` is how many of request r's tokens this rank computes
    (zero when none) and ``positions`` their sequence positions.
    """

    token_indices: torch.Tensor
    query_lens: torch.Tensor
    positions: torch.Tensor


def _split(selected: torch.Tensor, request_of_token: torch.Tensor, positions: torch.Tensor, bs: int) -> RankSplit:
    idx = torch.nonzero(selected).flatten()
    return RankSplit(
        token_indices=idx,
        query_lens=torch.bincount(request_of_token[idx], minlength=bs),
        positions=positions[idx],
    )


def split_page(
    token_owners: torch.Tensor, request_of_token: torch.Tensor, positions: torch.Tensor, bs: int, rank: int
) -> RankSplit:
    """Page-granular split: rank k computes exactly the tokens on pages it owns.

    ``token_owners`` comes from the allocation result, never recomputed from
    prefix and extend lengths ([[RFC-0001:C-DOWNSTREAM-CONTRACT]],
    [[RFC-0001:C-PLANNER-SPLIT]]).
    """
    return _split(token_owners == rank, request_of_token, positions, bs)


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


def split_interleave(
    request_of_token: torch.Tensor, positions: torch.Tensor, bs: int, rank: int, cp_size: int
) -> RankSplit:
    """Interleaved split for ``rank``: the tokens :func:`interleave_ranks`
    gives it. Raises as that does. [[RFC-0001:C-PLANNER-SPLIT]]"""
    ranks = interleave_ranks(request_of_token.numel(), cp_size, request_of_token.device)
    return _split(ranks == rank, request_of_token, positions, bs)


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
