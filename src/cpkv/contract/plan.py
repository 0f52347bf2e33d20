"""W1 planner: request-local owner plans and the per-rank token split.

Everything here is a small pure function. Requests are planned one by one,
never concatenated first: a request's lane base is a property of its own page
chain ([[RFC-0001:C-REQUEST-RELATIVE]]). Nothing here communicates
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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

    A request of ``n`` pages takes ``n // N`` pages of every lane (which moves
    no argmax) plus one of each of ``n % N`` consecutive lanes, so only those
    remainders are tracked, one Python step per request. When no request of
    the batch leaves a remainder the counts never move and every chosen base
    is the same argmax, computed once.
    """
    if policy not in BASE_POLICIES:
        raise ValueError(f"unknown lane-base policy {policy!r}; choose from {BASE_POLICIES}")
    N = cp_size
    if N == 1 or has_prefix.all():
        return fixed_bases
    if policy == "lane0":
        return np.where(has_prefix, fixed_bases, 0)
    rem = new_pages % N
    if not rem.any():
        return np.where(has_prefix, fixed_bases, int(np.argmax(lane_free)))
    rel = lane_free.tolist()
    best = None
    bases = fixed_bases.tolist()
    moves = np.flatnonzero(~has_prefix | (rem != 0))  # the others change nothing
    for r, pre, f, k in zip(moves.tolist(), has_prefix[moves].tolist(), first_positions[moves].tolist(),
                            rem[moves].tolist()):
        if not pre:
            if best is None:
                best = rel.index(max(rel))
            bases[r] = best
        if k:
            start = bases[r] + f
            for j in range(k):
                rel[lane_of_position(start, j, N)] -= 1
            best = None
    return np.asarray(bases, dtype=np.int64)


@dataclass(frozen=True)
class OwnerPlan:
    """Owners of the new pages of a batch, in request order then position order.

    Per new page: ``owners``, request-local ``positions`` q, ``request`` index
    and ``rank_in_lane`` (how many earlier pages of the batch share its lane).
    ``lane_counts[l]`` is how many new pages lane l must supply.
    """

    owners: np.ndarray
    positions: np.ndarray
    request: np.ndarray
    rank_in_lane: np.ndarray
    lane_counts: np.ndarray


def owner_plan(lane_base: np.ndarray, first_position: np.ndarray, num_pages: np.ndarray, cp_size: int) -> OwnerPlan:
    """Owner plan of a batch: request r gets ``num_pages[r]`` pages at positions
    ``first_position[r] + j``, owned by ``(lane_base[r] + q) % N``
    ([[RFC-0001:C-OWNER-LANE]]).

    Lane counts come from the cyclic structure: a request of n pages starting
    at lane s takes ``n // N`` pages of every lane plus one of each of the
    ``n % N`` lanes from s on; its page j is the ``j // N``-th of its lane.
    """
    N, bs = cp_size, num_pages.size
    req = np.repeat(np.arange(bs), num_pages)
    j = np.arange(req.size) - (np.cumsum(num_pages) - num_pages)[req]
    q = first_position[req] + j
    owners = lane_of_position(lane_base[req], q, N)
    act = np.flatnonzero(num_pages)  # only requests that get pages count
    n = num_pages[act]
    start = lane_of_position(lane_base[act], first_position[act], N)
    per_req = n[:, None] // N + ((np.arange(N)[None, :] - start[:, None]) % N < (n % N)[:, None])
    before = np.cumsum(per_req, 0) - per_req
    rank = before.ravel()[np.repeat(np.arange(act.size), n) * N + owners] + j // N
    return OwnerPlan(owners, q, req, rank, per_req.sum(0))


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


def split_interleave(
    request_of_token: torch.Tensor, positions: torch.Tensor, bs: int, rank: int, cp_size: int
) -> RankSplit:
    """Interleaved split (SGLang DSA CP): token i of the flattened batch goes to
    rank ``i % N``. Needs at least N tokens. [[RFC-0001:C-PLANNER-SPLIT]]"""
    E = request_of_token.numel()
    if E < cp_size:
        raise UnsupportedPagePlan(
            "interleave-too-short", f"interleave split needs at least {cp_size} tokens, batch has {E}"
        )
    i = torch.arange(E, device=request_of_token.device)
    return _split(i % cp_size == rank, request_of_token, positions, bs)


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


def split_zigzag(request_of_token: torch.Tensor, positions: torch.Tensor, extend_lens: torch.Tensor, bs: int,
                 rank: int, cp_size: int) -> RankSplit:
    """Zigzag split (SGLang's in-sequence CP split, balanced for causal
    attention): rank r computes blocks r and 2N-1-r of every request's extend
    (:func:`zigzag_ranks`). [[RFC-0001:C-PLANNER-SPLIT]]"""
    return _split(zigzag_ranks(extend_lens, cp_size) == rank, request_of_token, positions, bs)
