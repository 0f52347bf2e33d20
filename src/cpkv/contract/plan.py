"""Request-local owner plans: the lane base of every request of a batch, and
what the batch takes from each lane.

Everything here is a small pure function. Requests are planned one by one,
never concatenated first: a request's lane base is a property of its own page
chain ([[RFC-0001:C-REQUEST-RELATIVE]]). Nothing here communicates
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). The lane-base rule is written once, as
the request-by-request loop :func:`sequential_lane_bases`;
:func:`choose_lane_bases` computes the same in closed form where that pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout
from .layout import floor_mod

BASE_POLICIES = ("least_full", "least_full_lowest", "lane0")


def sequential_lane_bases(fixed_bases, has_prefix, first_positions, new_pages, lane_free, cp_size: int,
                          cursor: int = 0) -> tuple[np.ndarray, int]:
    """The least-full lane-base rule, request by request: the specification
    ([[RFC-0001:C-REQUEST-RELATIVE]]). Returns ``(bases [bs] int64, cursor)``
    for ``fixed_bases``, ``has_prefix``, ``first_positions`` (each request's
    first new page position), ``new_pages`` ``[bs]``, the free pages per lane
    ``lane_free [N]`` and the tie ``cursor``.

    A request with a prefix keeps ``fixed_bases[r]``. Only a chain's remainder
    ``k = new_pages % N`` changes how full the lanes are relative to each other
    (its whole rounds take one page of every lane). A *stretch* is a run of the
    batch that no request with a prefix and ``k != 0`` interrupts; in it the
    fresh requests are cut, in order, into *round groups*: a group starts where
    the stretch's remainders so far sum to a multiple of N, and is complete
    when its own remainders do (before the stretch ends). A fresh request r:

    1. inside a group laid from the cursor: that group's origin plus the
       remainders of the group before r (end to end);
    2. else, starting a complete group that is one request of ``k == 0`` or
       begins on *balanced* lanes (any two within one free page, the most-free
       lanes one cyclic run or all of them): the group is laid from the
       cursor, which moves one lane;
    3. else, ``k == 0`` or every lane equally free: the cursor, which moves;
    4. else the first lane at or after the cursor that is most free and whose
       predecessor is not (the head of a most-free run).

    Free counts include what the earlier requests of the batch take. From
    balanced lanes every batch of fresh requests leaves them balanced; a batch
    of equal requests spreads its bases over every lane. O(bs * N) on host ints.
    """
    N, m = cp_size, len(new_pages)
    k = [int(x) % N for x in new_pages]
    has = [bool(h) for h in has_prefix]
    first = [int(q) for q in first_positions]
    bases = [int(b) for b in fixed_bases]
    rel, c = [int(f) for f in lane_free], int(cursor)
    ends = _complete_groups(has, k, N)
    until, origin, laid = -1, 0, 0
    for r in range(m):
        kr = k[r]
        if has[r]:
            if kr == 0:
                continue  # whole rounds: every lane alike
        elif r < until:
            bases[r] = (origin + laid) % N
        elif r in ends and (kr == 0 or _balanced(rel)):
            until, origin, laid, bases[r], c = ends[r], c, 0, c, (c + 1) % N
        elif kr == 0 or max(rel) == min(rel):
            bases[r], c = c, (c + 1) % N
        else:
            top = max(rel)
            bases[r] = next(lane % N for lane in range(c, c + N) if rel[lane % N] == top and rel[lane % N - 1] != top)
        laid += kr
        start = bases[r] + first[r]
        for lane in range(start, start + kr):
            rel[lane % N] -= 1
    return np.array(bases, dtype=np.int64), c


def lowest_tie_lane_bases(fixed_bases, has_prefix, first_positions, new_pages, lane_free,
                          cp_size: int) -> np.ndarray:
    """SGLang's kv-shard rule (``least_full_lowest``), request by request:
    a request with a fixed base keeps ``fixed_bases[r]``; a fresh one takes
    the lane with the most free pages, ties to the lowest lane, the pages of
    the requests before it in the batch counted (SGLang's
    ``PageInterleavePoolAllocator.alloc_extend`` resolving a ``None``
    rotation base). Same arguments as :func:`sequential_lane_bases`; no
    cursor. O(bs * N) on host ints. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    N = cp_size
    free = [int(f) for f in lane_free]
    bases = [int(b) for b in fixed_bases]
    for r, (h, q, n) in enumerate(zip(has_prefix, first_positions, new_pages)):
        if not h:
            bases[r] = max(range(N), key=lambda lane: (free[lane], -lane))
        start, n = bases[r] + int(q), int(n)
        for lane in range(N):  # a chain of n pages from lane `start` takes n // N of every lane, one more of n % N
            free[lane] -= n // N + ((lane - start) % N < n % N)
    return np.array(bases, dtype=np.int64)


def _complete_groups(has: list[bool], k: list[int], N: int) -> dict[int, int]:
    """The complete round groups of :func:`sequential_lane_bases`: the index of
    each one's first request -> the index after its last."""
    ends, start, total = {}, None, 0
    for r, (h, kr) in enumerate(zip(has, k)):
        if h:
            if kr:  # a request with a prefix and a remainder ends the stretch
                if start is not None and total % N == 0:
                    ends[start] = r
                start, total = None, 0
            continue
        if total % N == 0:
            if start is not None:
                ends[start] = r
            start = r
        total += kr
    if start is not None and total % N == 0:
        ends[start] = len(k)
    return ends


def _balanced(free: list[int]) -> bool:
    """Any two lanes within one free page, the most-free lanes one cyclic run (or all)."""
    return _front(free, 0) is not None


def _front(free: list[int], cursor: int) -> tuple[int, int] | None:
    """For balanced free counts (see :func:`sequential_lane_bases`): ``(u,
    e)``, how many lanes have one page fewer free, and the head of the
    most-free run (the cursor when all lanes are equal); None when the counts
    are not balanced."""
    hi, lo = max(free), min(free)
    if hi == lo:
        return 0, cursor
    if hi - lo > 1:
        return None
    heads = [lane for lane in range(len(free)) if free[lane] == hi and free[lane - 1] != hi]
    return (free.count(lo), heads[0]) if len(heads) == 1 else None


def fresh_lane(free: np.ndarray, cursor: int, remainder: int | None) -> int:
    """The lane base a fresh chain gets as a batch of its own, under
    ``least_full``, for free counts ``free [N]``, the ``cursor`` and the
    chain's ``remainder = new_pages % N`` (None: unknown, taken as non-zero):
    :func:`sequential_lane_bases` of one request. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    k = 1 if remainder is None else remainder
    bases, _ = sequential_lane_bases([0], [False], [0], [k], free, free.size, cursor)
    return int(bases[0])


def choose_lane_bases(fixed_bases: np.ndarray | None, has_prefix: np.ndarray | None, first_positions,
                      new_pages: np.ndarray, lane_free: np.ndarray, cp_size: int, policy: str = "least_full",
                      cursor: int = 0) -> tuple[np.ndarray, int]:
    """Lane base of every request of a batch and the cursor after it, ``(bases
    [bs] int64, cursor)``, under ``policy``: ``least_full`` is the rule of
    :func:`sequential_lane_bases` (same arguments); ``least_full_lowest``
    SGLang's kv-shard rule, :func:`lowest_tie_lane_bases` (the cursor is
    kept); ``lane0`` (the comparison baseline) gives every fresh request base
    0 and keeps the cursor.
    ``has_prefix`` None says no request has a prefix (``fixed_bases`` and
    ``first_positions`` are not read then).

    One fast path, exactly equal to the rule: when the only requests with a
    remainder are fresh and the lanes are balanced (as a cleared allocator
    leaves them, and every batch of fresh requests keeps them) or no request
    has a remainder, the bases are a closed form over the batch
    (:func:`_tape_bases`), with no step per request. The bases depend on the
    batch and the state only, so every rank computes the same
    ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
    """
    if policy not in BASE_POLICIES:
        raise ValueError(f"unknown lane-base policy {policy!r}; choose from {BASE_POLICIES}")
    N, m = cp_size, new_pages.size
    if has_prefix is None:
        if N == 1 or policy == "lane0":
            return np.zeros(m, dtype=np.int64), cursor
    elif N == 1 or np.count_nonzero(has_prefix) == m:
        return fixed_bases, cursor
    elif policy == "lane0":
        return np.where(has_prefix, fixed_bases, 0), cursor
    if policy == "least_full_lowest":
        if has_prefix is None:
            fixed_bases = has_prefix = first_positions = np.zeros(m, dtype=np.int64)
        return lowest_tie_lane_bases(fixed_bases, has_prefix, np.broadcast_to(first_positions, (m,)), new_pages,
                                     lane_free, N), cursor
    rem = floor_mod(new_pages, N)
    if has_prefix is None:
        moving, fixed_moving = np.count_nonzero(rem), 0
    else:
        moving_mask = rem != 0
        moving, fixed_moving = np.count_nonzero(moving_mask), np.count_nonzero(moving_mask & has_prefix)
    if not fixed_moving and (m > TAPE_FROM or not moving):
        front = _front(lane_free.tolist(), cursor) if moving else (0, cursor)
        if front is not None:
            if has_prefix is None:
                return _tape_bases(rem, *front, N, cursor)
            fresh = ~has_prefix
            if np.count_nonzero(fresh) == m:
                return _tape_bases(rem, *front, N, cursor)
            bases = fixed_bases.astype(np.int64, copy=True)
            bases[fresh], cursor = _tape_bases(rem[fresh], *front, N, cursor)
            return bases, cursor
    if has_prefix is None:
        fixed_bases = has_prefix = first_positions = np.zeros(m, dtype=np.int64)
    return sequential_lane_bases(fixed_bases, has_prefix, first_positions, new_pages, lane_free, N, cursor)


#: Up to this many requests with a remainder the request-by-request rule is as fast as the closed form.
TAPE_FROM = 16


def _tape_bases(k: np.ndarray, u: int, e: int, N: int, cursor: int) -> tuple[np.ndarray, int]:
    """:func:`sequential_lane_bases` for fresh requests only (remainders ``k
    [m]``) from balanced lanes (``u`` lanes with one page fewer free, ``e``
    the head of the most-free run), in closed form. The complete groups come
    first; they leave the lanes as they were. The requests after them are laid
    end to end from ``e``: the lanes are even exactly where ``u`` plus the
    remainders laid so far is a multiple of N, and there the next request
    takes the cursor, as does a request of remainder 0."""
    m = k.size
    if not np.count_nonzero(k):  # whole rounds only: each request a group of its own, from the cursor on
        return floor_mod(np.arange(cursor, cursor + m), N), (cursor + m) % N
    ends = k.cumsum()
    offset = floor_mod(ends - k, N)  # each request's offset in its group
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
    return floor_mod(bases, N), cursor % N


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
    start = floor_mod(lane_base + first_position, cp_size)  # layout.lane_of_position
    per_req = layout.chain_lane_pages(start, 0, num_pages, cp_size)
    before = per_req.cumsum(0)
    counts = before[-1].copy() if per_req.size else per_req.sum(0)
    before -= per_req
    return LaneTake(start, before, counts)
