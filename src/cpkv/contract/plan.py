"""The planner: request-local owner plans and the per-rank token splits (workstream W1).

Everything here is a small pure function. Requests are planned one by one,
never concatenated first: a request's lane base is a property of its own page
chain ([[RFC-0001:C-REQUEST-RELATIVE]]). Nothing here communicates
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from . import layout
from .errors import UnsupportedPagePlan
from .layout import lane_of_position

BASE_POLICIES = ("least_full", "lane0")


def fresh_lane(free: np.ndarray, cursor: int, remainder: int | None) -> int:
    """The lane of a fresh chain's first page under ``least_full``, for free
    counts ``free [N]`` and the allocator's ``cursor``: the sequential rule
    one request at a time ([[RFC-0001:C-REQUEST-RELATIVE]]).

    With ``remainder = n % N == 0`` (``n`` the chain's pages) every lane
    leaves the same counts, so the chain starts at ``cursor``. Otherwise it
    starts where a run of most-free lanes starts (a most-free lane whose
    predecessor has fewer free pages; any lane when all are equal), the first
    such lane at or after ``cursor``: its ``remainder`` extra pages then take
    most-free lanes first. ``remainder=None`` (length unknown) is the rule for
    a non-zero remainder. O(N)."""
    if remainder == 0:
        return cursor
    return int(np.argmax(np.roll(run_starts(free), -cursor)) + cursor) % free.size


def run_starts(free: np.ndarray) -> np.ndarray:
    """Where a fresh chain with a non-zero remainder may start, bool ``[N]``:
    the most-free lanes whose predecessor (cyclically) has fewer free pages,
    or every lane when all are equally free. From a cleared allocator the
    most-free lanes form one cyclic run, so starting at its head keeps every
    two lanes within one page ([[RFC-0001:C-REQUEST-RELATIVE]])."""
    top = free == free.max()
    if not top.all():
        top &= ~np.roll(top, 1)
    return top


def next_cursor(free_after: np.ndarray, cursor: int, remainder: int) -> int:
    """The cursor after a fresh request of ``remainder = n % N`` took its
    pages, leaving ``free_after [N]``: one lane further when the remainder is
    zero or the lanes are left exactly even (every lane as free as the
    others), unchanged otherwise. So equal requests spread their bases: with
    ``k = n % N`` and ``g = gcd(k, N)`` a run of ``N / g`` of them from even
    lanes takes bases ``c, c + k, ...`` (one residue class mod ``g``) and
    leaves the lanes even, and the next run starts one class further."""
    if remainder == 0 or free_after.min() == free_after.max():
        return (cursor + 1) % free_after.size
    return cursor


def choose_lane_bases(
    fixed_bases: np.ndarray,
    has_prefix: np.ndarray,
    first_positions: np.ndarray,
    new_pages: np.ndarray,
    lane_free: np.ndarray,
    cp_size: int,
    policy: str = "least_full",
    cursor: int = 0,
) -> tuple[np.ndarray, int]:
    """Lane base of every request of a batch, in request order, and the cursor
    after the batch: ``(bases [bs] int64, cursor)``.

    A request with a prefix keeps ``fixed_bases[r]``. One without picks, under
    ``least_full``, the lane :func:`fresh_lane` gives (most free pages; ties to
    the first at or after the cursor, see there), counting the pages that
    earlier requests of the same batch take, so a batch fills lanes evenly
    ([[RFC-0001:C-REQUEST-RELATIVE]]); the cursor then moves as
    :func:`next_cursor` says. Under ``lane0`` it takes lane 0 (the comparison
    baseline) and the cursor stays.

    The rule is sequential; it is computed without a step per request. A
    request of ``n`` pages takes ``n // N`` pages of every lane (which moves no
    argmax) plus one of each of ``k = n % N`` consecutive lanes, so only those
    remainders matter. A fresh request starts where the previous fresh
    request's run ended, on a line of lanes that rotates one lane further each
    time the lanes come out even (always so from a cleared allocator, whose
    free counts differ by at most one, the most-free lanes in one run). So
    every start is guessed along that line and all guesses are checked at
    once against the exact rule (one cumulative count over the batch); the
    first wrong guess is corrected and the rest re-checked. Each correction is
    one vectorised pass; after :data:`MAX_PASSES` of them the remaining
    requests (if any) take the plain sequential step.
    """
    if policy not in BASE_POLICIES:
        raise ValueError(f"unknown lane-base policy {policy!r}; choose from {BASE_POLICIES}")
    N = cp_size
    if N == 1 or has_prefix.all():
        return fixed_bases, cursor
    if policy == "lane0":
        return np.where(has_prefix, fixed_bases, 0), cursor
    rem = new_pages % N
    if not rem.any():  # whole sweeps: the fresh requests take the cursor's lanes in turn
        fresh = ~has_prefix
        turn = fresh.cumsum() - fresh
        bases = np.where(fresh, (cursor + turn) % N, fixed_bases)
        return bases, (cursor + int(turn[-1]) + int(fresh[-1])) % N
    bases = fixed_bases.astype(np.int64, copy=True)
    moves = (~has_prefix | (rem != 0)).nonzero()[0]  # the others change nothing
    fresh = ~has_prefix[moves]
    k = rem[moves]
    start = (fixed_bases[moves] + first_positions[moves]) % N  # where a fixed request's remainder starts
    chosen, cursor = _sweep_bases(fresh, k, start, np.asarray(lane_free, dtype=np.int64), N, cursor)
    bases[moves[fresh]] = chosen
    return bases, cursor


MAX_PASSES = 4


@functools.lru_cache(maxsize=64)
def _rotations(N: int) -> np.ndarray:
    """``rot[l, s] = (l - s) % N``, int64 ``[N, N]`` (read only): how far lane
    ``l`` lies past lane ``s``."""
    lanes = np.arange(N)
    rot = (lanes[:, None] - lanes[None, :]) % N
    rot.flags.writeable = False
    return rot


def _sweep_bases(fresh: np.ndarray, k: np.ndarray, start: np.ndarray, lane_free: np.ndarray, N: int,
                 cursor: int) -> tuple[np.ndarray, int]:
    """Bases of the fresh entries (see :func:`choose_lane_bases`) and the final
    cursor; ``start`` and ``k`` are every entry's first remainder lane (fixed
    entries) and remainder.

    A pass guesses from the exact state at its first entry: the lanes are
    even (front 0) or the most-free lanes are one run of ``h`` lanes starting
    at ``a`` (front ``N - h``, line origin ``a - N + h``). Each fresh
    remainder moves the front; a fresh entry with the front at 0 starts at
    the cursor and becomes the new origin. The check recomputes, from the
    cumulative counts, every entry's exact state, cursor and :func:`fresh_lane`.
    """
    m = k.size
    lanes = np.arange(N)
    gap0 = lane_free.max() - lane_free  # pages taken, relative: the rule sees only differences
    covered = np.zeros(N, dtype=np.int64)  # remainder pages taken before entry r0
    pos = np.zeros(m, dtype=np.int64)  # the lane each fresh entry starts at
    walk_all = np.where(fresh, k, 0)  # the fresh remainders move the front
    zero_all = fresh & (k == 0)  # fresh whole sweeps: take the cursor, move it
    run_all = fresh & (k > 0)
    idx_all = np.arange(m)
    rot, prev = _rotations(N), (lanes - 1) % N  # rot[l, s] = (l - s) % N
    r0, c = 0, cursor
    for _ in range(MAX_PASSES):
        g = gap0 + covered
        f, kk, walk, zero, run = fresh[r0:], k[r0:], walk_all[r0:], zero_all[r0:], run_all[r0:]
        if g.min() == g.max():
            front0, origin0 = 0, c
        else:
            front0 = N - int((g == g.min()).sum())
            origin0 = fresh_lane(-g, c, None) - front0
        end = walk.cumsum()
        end += front0
        end %= N  # the front after each entry
        front = end - walk
        front %= N
        adv = end == 0
        adv &= run
        adv |= zero
        cur = adv.cumsum()
        cur -= adv
        cur += c
        restart = front == 0
        restart &= run
        if restart.any():
            last = np.maximum.accumulate(np.where(restart, idx_all[: kk.size], -1))
            origin = np.where(last >= 0, cur[last], origin0)
        else:
            origin = origin0
        guess = np.where(zero, cur, front + origin)
        guess %= N
        lane = np.where(f, guess, start[r0:])
        # lane-major [N, entries]: the reductions over lanes run along the long axis
        cov = rot[:, lane] < kk
        gb = cov.cumsum(1)
        gb += g[:, None]  # the gaps after each entry
        even = gb.min(0) == gb.max(0)
        gb -= cov  # before each entry
        adv = even & f
        adv |= zero
        cur = adv.cumsum()  # the exact cursor before each entry
        cur -= adv
        cur += c
        cur %= N
        # fresh_lane as one key: fewest taken, then a run's head, then from the cursor on
        key = gb * 2
        key += gb[prev] <= gb
        key *= N
        key += rot[:, cur]
        exact = np.where(zero, cur, key.argmin(0))
        wrong = (f & (exact != guess)).nonzero()[0]
        if wrong.size == 0:
            pos[r0:] = guess
            return pos[fresh], int(cur[-1] + adv[-1]) % N
        w = int(wrong[0])
        pos[r0 : r0 + w] = guess[:w]
        covered, c = gb[:, w] - gap0, int(cur[w])
        r0 = r0 + w
    # the plain sequential rule for what is left (rare: counts far from even)
    rel = lane_free - covered
    for r in range(r0, m):
        s = fresh_lane(rel, c, int(k[r])) if fresh[r] else int(start[r])
        pos[r] = s
        rel[(s + np.arange(int(k[r]))) % N] -= 1
        if fresh[r]:
            c = next_cursor(rel, c, int(k[r]))
    return pos[fresh], c


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
