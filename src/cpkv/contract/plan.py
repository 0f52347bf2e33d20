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
    """The lane of a fresh chain's first page under ``least_full`` when the
    chain is a batch of its own, for free counts ``free [N]`` and the
    allocator's ``cursor`` ([[RFC-0001:C-REQUEST-RELATIVE]]).

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
    or every lane when all are equally free. From balanced lanes (see
    :func:`choose_lane_bases`) that is one lane, and starting there keeps them
    balanced ([[RFC-0001:C-REQUEST-RELATIVE]])."""
    top = free == free.max()
    if not top.all():
        top &= ~np.roll(top, 1)
    return top


def _front(free: list[int], cursor: int) -> tuple[int, int] | None:
    """For balanced free counts (a list of N ints; see :func:`choose_lane_bases`):
    ``(u, e)``, how many lanes have one page fewer free and the head of the
    most-free run (the cursor when all lanes are equal); None when the counts
    are not balanced. O(N) on host ints."""
    hi, lo = max(free), min(free)
    if hi == lo:
        return 0, cursor
    heads = [lane for lane in range(len(free)) if free[lane] == hi and free[lane - 1] != hi]
    return (free.count(lo), heads[0]) if hi - lo == 1 and len(heads) == 1 else None


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
    after the batch: ``(bases [bs] int64, cursor)``, for ``fixed_bases``,
    ``has_prefix``, ``first_positions`` (each request's first new page
    position), ``new_pages`` ``[bs]`` and the free pages per lane ``lane_free [N]``.

    A request with a prefix keeps ``fixed_bases[r]``. Under ``lane0`` a fresh
    one takes lane 0 (the comparison baseline) and the cursor stays. Under
    ``least_full`` ([[RFC-0001:C-REQUEST-RELATIVE]]) only a chain's
    remainder ``k = n % N`` matters: its ``n // N`` rounds take a page of
    every lane. In each stretch of the batch where only fresh requests take
    partial rounds (no request with a prefix and a non-zero remainder
    between them), the fresh requests are cut in order into *round groups*:
    a group ends where the stretch's remainders so far sum to a multiple of
    N. A complete group takes the same pages of every lane whatever lane it
    starts at, so all its starts tie:

    * a complete group that begins on balanced lanes (any two lanes within
      one free page, the most-free lanes one cyclic run or all of them, as a
      cleared allocator leaves them), or that is one request of remainder 0,
      is laid end to end from the cursor (its i-th request at ``cursor + k_0
      + .. + k_{i-1}``), and the cursor moves one lane;
    * every other fresh request takes a most-free lane, counting the pages
      earlier requests of the batch take: the cursor when its remainder is 0
      or every lane is equally free (the cursor then moves one lane), else
      the first head of a run of most-free lanes at or after the cursor
      (:func:`fresh_lane`, which is the rule for a batch of one request).

    A tie broken by the cursor moves it. From balanced lanes every batch of
    fresh requests leaves them balanced, any two lanes within one page. A
    batch of ``bs`` equal requests lays each group of ``N / gcd(k, N)`` over
    one residue class mod ``gcd(k, N)`` and the next group from the next
    lane, so with ``bs >= N`` every lane is a base and none is the base of
    more than ``ceil(bs / N) + 1`` requests, whatever the lanes' sizes. The
    bases depend on the batch and the state (free counts, cursor) only, so
    every rank computes the same ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).

    No step per request: fresh requests from balanced lanes in closed form
    (:func:`_tape_bases`), any other batch by checked guesses
    (:func:`_sweep_bases`).
    """
    if policy not in BASE_POLICIES:
        raise ValueError(f"unknown lane-base policy {policy!r}; choose from {BASE_POLICIES}")
    N, prefixed = cp_size, np.count_nonzero(has_prefix)
    if N == 1 or prefixed == has_prefix.size:
        return fixed_bases, cursor
    if policy == "lane0":
        return np.where(has_prefix, fixed_bases, 0), cursor
    rem = new_pages % N
    if not np.count_nonzero(rem):  # whole sweeps: every fresh request is a group of its own, from the cursor on
        fresh = ~has_prefix
        turn = fresh.cumsum() - fresh
        bases = np.where(fresh, (cursor + turn) % N, fixed_bases)
        return bases, (cursor + int(turn[-1]) + int(fresh[-1])) % N
    free = np.asarray(lane_free, dtype=np.int64)
    if not prefixed:
        if (front := _front(free.tolist(), cursor)) is not None:
            return _tape_bases(rem, *front, N, cursor)
        return _sweep_bases(np.ones(rem.size, dtype=bool), rem, np.zeros_like(rem), free, N, cursor)
    bases = fixed_bases.astype(np.int64, copy=True)
    moves = (~has_prefix | (rem != 0)).nonzero()[0]  # the others change nothing
    fresh = ~has_prefix[moves]
    start = (fixed_bases[moves] + first_positions[moves]) % N  # where a fixed request's remainder starts
    chosen, cursor = _sweep_bases(fresh, rem[moves], start, free, N, cursor)
    bases[moves[fresh]] = chosen
    return bases, cursor


def _tape_bases(k: np.ndarray, u: int, e: int, N: int, cursor: int) -> tuple[np.ndarray, int]:
    """:func:`choose_lane_bases` for fresh requests only (remainders ``k [m]``)
    from balanced lanes (``u`` lanes with one page fewer free, ``e`` the head
    of the most-free run), in closed form. The complete groups come first;
    they leave the lanes as they were. The requests after them are laid end
    to end from ``e``: the lanes are even exactly where ``u`` plus the
    remainders laid so far is a multiple of N, and there the next request
    takes the cursor, as does a request of remainder 0."""
    m = k.size
    ends = k.cumsum()
    offset = ends - k
    _mod(offset, N)  # each request's offset in its group
    starts = offset == 0
    last = m if ends[-1] % N == 0 else m - 1 - int(starts[::-1].argmax())  # where the incomplete group starts
    bases = np.empty(m, dtype=np.int64)
    if last:
        group = starts[:last].cumsum()  # 1 + the group's number: it starts at cursor + number
        np.add(group, offset[:last], out=bases[:last])
        bases[:last] += cursor - 1
        cursor += int(group[-1])
    if last < m:
        x = offset[last:]  # how far along the tape each request starts
        even = x == (N - u) % N  # the lanes are even before these requests
        kx = k[last:]
        uses = even if np.count_nonzero(kx) == kx.size else even | (kx == 0)  # the requests that take the cursor
        taking = np.count_nonzero(uses)
        if taking == 0:  # u > 0: all laid from the most-free run's head
            np.add(x, e, out=bases[last:])
        elif u == 0 and taking == 1:  # even lanes: the first takes the cursor, the rest follow it
            np.add(x, cursor, out=bases[last:])
            cursor += 1
        else:
            cur = uses.cumsum()
            cur -= uses
            cur += cursor
            cursor += taking
            seg = np.maximum.accumulate(np.where(even, np.arange(x.size), -1))
            tape = np.where(seg >= 0, cur[seg] - x[seg], e) + x
            bases[last:] = np.where(uses, cur, tape)
    _mod(bases, N)
    return bases, cursor % N


def _mod(a: np.ndarray, N: int) -> None:
    """``a %= N`` in place for non-negative ``a``; a mask when N is a power of two."""
    if N & (N - 1):
        np.remainder(a, N, out=a)
    else:
        np.bitwise_and(a, N - 1, out=a)


MAX_PASSES = 4


@functools.lru_cache(maxsize=64)
def _rotations(N: int) -> np.ndarray:
    """``rot[l, s] = (l - s) % N``, int64 ``[N, N]`` (read only): how far lane
    ``l`` lies past lane ``s``."""
    lanes = np.arange(N)
    rot = (lanes[:, None] - lanes[None, :]) % N
    rot.flags.writeable = False
    return rot


def _round_groups(fresh: np.ndarray, k: np.ndarray, N: int):
    """The round groups of :func:`choose_lane_bases` over the entries
    (``fresh [m]``, remainders ``k [m]``): ``(offset, complete, end, head)``,
    each ``[m]``: a fresh entry's offset in its group mod N; whether a
    complete group starts at it; the index where the group that starts at it
    ends (its next group start or fixed entry, or m); where its group starts
    (-1 before the first fresh entry)."""
    m = k.size
    idx = np.arange(m)
    kf = np.where(fresh, k, 0)
    C = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(kf, out=C[1:])
    offset = (C[:-1] - np.maximum.accumulate(np.where(fresh, 0, C[:-1]))) % N
    starts = fresh & (offset == 0)
    bound = np.where(starts | ~fresh, idx, m)
    end = np.append(np.minimum.accumulate(bound[::-1])[::-1][1:], m)
    complete = starts & ((C[end] - C[:-1]) % N == 0)
    head = np.maximum.accumulate(np.where(starts, idx, -1))
    return offset, complete, end, head


def _sweep_bases(fresh: np.ndarray, k: np.ndarray, start: np.ndarray, lane_free: np.ndarray, N: int,
                 cursor: int) -> tuple[np.ndarray, int]:
    """Bases of the fresh entries (see :func:`choose_lane_bases`) and the final
    cursor; ``start`` and ``k`` are every entry's first remainder lane (fixed
    entries) and remainder.

    A pass guesses every base from the exact state at its first entry, as if
    the lanes were balanced there with the most-free run's head as the front
    (the rule :func:`_tape_bases` computes), and checks all guesses at once
    against the exact rule: one cumulative count over the entries gives the
    state before each, hence whether a group begins balanced, the cursor
    and :func:`fresh_lane`. The first wrong guess is where the next pass
    starts (never inside a group laid from the cursor: a group whose first
    base is right is right throughout). After :data:`MAX_PASSES` passes the
    remaining entries (if any) take the plain sequential step.
    """
    m = k.size
    offset, complete, end, head = _round_groups(fresh, k, N)
    gap0 = lane_free.max() - lane_free
    covered = np.zeros(N, dtype=np.int64)  # remainder pages taken before entry r0
    pos = np.zeros(m, dtype=np.int64)  # the lane each fresh entry starts at
    idx = np.arange(m)
    rot, prev = _rotations(N), (np.arange(N) - 1) % N  # rot[l, s] = (l - s) % N
    r0, c = 0, cursor
    for _ in range(MAX_PASSES):
        g = gap0 + covered
        f, kk, off, full = fresh[r0:], k[r0:], offset[r0:], complete[r0:]
        hd = head[r0:] - r0  # < 0: the group began before this pass (not one laid from the cursor)
        hd0 = np.maximum(hd, 0)
        local = idx[: kk.size]
        # the guess: a tape from the most-free run's head, groups from the cursor when the lanes are balanced now
        state = _front((-g).tolist(), c)
        u, front = state if state is not None else (N - int((g == g.min()).sum()), fresh_lane(-g, c, None))
        first_guess = full & ((kk == 0) | (state is not None))
        grouped = f & (hd >= 0) & first_guess[hd0]
        alone = f & ~grouped
        walk = np.where(alone, kk, 0)
        x = walk.cumsum() - walk
        even = alone & ((x + u) % N == 0)
        uses = first_guess | even | (alone & (kk == 0))
        cur = uses.cumsum() - uses + c
        seg = np.maximum.accumulate(np.where(even, local, -1))
        tape = np.where(seg >= 0, cur[seg] - x[seg], front) + x
        guess = np.where(grouped, cur[hd0] + off, np.where(uses, cur, tape)) % N
        # the check, lane-major [N, entries]: the reductions over lanes run along the long axis
        lane = np.where(f, guess, start[r0:])
        cov = rot[:, lane] < kk
        gb = cov.cumsum(1)
        gb += g[:, None]
        gb -= cov  # pages taken before each entry
        lo, hi = gb.min(0), gb.max(0)
        low = gb == lo
        balanced = (hi - lo <= 1) & ((low & ~low[prev]).sum(0) <= 1)
        first = full & ((kk == 0) | balanced)
        grouped = f & (hd >= 0) & first[hd0]
        alone = f & ~grouped
        uses = first | (alone & ((kk == 0) | (lo == hi)))
        cur = uses.cumsum() - uses + c
        cur %= N  # the exact cursor before each entry
        # fresh_lane as one key: fewest taken, then a run's head, then from the cursor on
        key = gb * 2
        key += gb[prev] <= gb
        key *= N
        key += rot[:, cur]
        exact = np.where(grouped, cur[hd0] + off, np.where(uses, cur, key.argmin(0))) % N
        wrong = ((f & (exact != guess)) | (first != first_guess)).nonzero()[0]
        if wrong.size == 0:
            pos[r0:] = guess
            return pos[fresh], int(cur[-1] + uses[-1]) % N
        w = int(wrong[0])
        pos[r0 : r0 + w] = guess[:w]
        covered, c = gb[:, w] - gap0, int(cur[w])
        r0 = r0 + w
    # the plain sequential rule for what is left (counts far from balanced), on host ints
    rel, until, origin = (lane_free - covered).tolist(), -1, 0
    lists = (a[r0:].tolist() for a in (fresh, k, start, offset, complete, end))
    for r, (f, kr, s, off, full, stop) in enumerate(zip(*lists), r0):  # s: a fixed entry's start
        if f and r < until:
            s = (origin + off) % N
        elif f and full and (kr == 0 or _front(rel, c) is not None):
            until, origin, s, c = stop, c, c, (c + 1) % N
        elif f and (kr == 0 or max(rel) == min(rel)):
            s, c = c, (c + 1) % N
        elif f:
            hi = max(rel)
            s = next(lane % N for lane in range(c, c + N) if rel[lane % N] == hi and rel[lane % N - 1] != hi)
        pos[r] = s
        for lane in range(s, s + kr):  # the remainder's lanes (fewer than N)
            rel[lane % N] -= 1
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
