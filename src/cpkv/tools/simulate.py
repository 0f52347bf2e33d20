"""Workload simulator: seeded serving traces through the allocator and prefix cache.

A trace is a list of sessions; a session is a list of turns. Each turn is one
request whose tokens are the session's history plus a new prompt; it is
matched against the prefix cache, prefilled (in chunks), decodes its reply
and, when done, is inserted into the cache so the next turn finds its history
there. Every step the engine admits due requests, runs one extend batch and
one decode batch, and finishes or aborts requests. Placement policies are
compared side by side on the same trace:

* ``least_full``: owner lanes, a fresh request based at the lane with the most
  free pages (ours);
* ``lane0``: owner lanes, every fresh request based at lane 0;
* ``oblivious``: pages taken from one free list, as a plain paged allocator
  does (lane of page p is still ``p % N`` for the occupancy figures).

Admission asks the cache with ``lookup`` (no side effect) whether a request
fits, and only then ``acquire``s its match; a finished request is
``insert``ed, an aborted one ``release``d.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import lane_base_from_prefix, lane_of_position, owner_of, page_of
from ..consumers.prefix_cache import PrefixCache

POLICIES = ("least_full", "lane0", "oblivious")
ADMISSION = ("lanes", "none")


@dataclass(frozen=True)
class Turn:
    """A user turn: new prompt tokens, the reply's tokens, and the pause before it."""

    prompt: tuple
    reply: tuple
    pause: int


@dataclass(frozen=True)
class Session:
    """A conversation: arrives at ``arrival`` and sends ``turns`` one after another."""

    sid: int
    arrival: int
    turns: tuple


@dataclass(frozen=True)
class Workload:
    """A named trace with the engine settings it is meant for."""

    name: str
    sessions: tuple
    lane_pages: int  # default capacity: pages per lane
    chunk: int = 512  # prefill chunk, tokens per request per step
    max_running: int = 64


def _tokens(rng, n) -> tuple:
    return tuple(rng.integers(0, 50_000, n).tolist())


def multiturn(n: int = 600, seed: int = 0) -> Workload:
    """Conversations of 1-4 turns that extend their own history: prompts 64-1024
    tokens, follow-ups 8-256, replies 8-192, pauses 1-30 steps. Lengths ignore
    the page size, so most continuations start mid-page."""
    rng = np.random.default_rng(seed)
    sessions, t = [], 0
    for sid in range(n):
        t += int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        turns = [Turn(_tokens(rng, int(rng.integers(64, 1025))), _tokens(rng, int(rng.integers(8, 193))), 0)]
        turns += [Turn(_tokens(rng, int(rng.integers(8, 257))), _tokens(rng, int(rng.integers(8, 193))),
                       int(rng.integers(1, 31))) for _ in range(k - 1)]
        sessions.append(Session(sid, t, tuple(turns)))
    return Workload("multiturn", tuple(sessions), lane_pages=4096)


def shared_prompt(n: int = 400, seed: int = 0, system: int = 3000) -> Workload:
    """One long system prompt (``system`` tokens) and many short questions
    (16-128 tokens) with replies of 8-64 tokens."""
    rng = np.random.default_rng(seed)
    sys_prompt = _tokens(rng, system)
    sessions = [Session(sid, sid // 4, (Turn(sys_prompt + _tokens(rng, int(rng.integers(16, 129))),
                                             _tokens(rng, int(rng.integers(8, 65))), 0),))
                for sid in range(n)]
    return Workload("shared-prompt", tuple(sessions), lane_pages=256)


def longdoc(n: int = 8, seed: int = 0) -> Workload:
    """Few very long documents (8K-32K tokens, chunked prefill), each followed by
    one or two questions about it."""
    rng = np.random.default_rng(seed)
    sessions = []
    for sid in range(n):
        turns = [Turn(_tokens(rng, int(rng.integers(8192, 32769))), _tokens(rng, int(rng.integers(32, 129))), 0)]
        turns += [Turn(_tokens(rng, int(rng.integers(16, 65))), _tokens(rng, int(rng.integers(32, 129))),
                       int(rng.integers(5, 40))) for _ in range(int(rng.integers(1, 3)))]
        sessions.append(Session(sid, 12 * sid, tuple(turns)))
    return Workload("longdoc", tuple(sessions), lane_pages=2048, chunk=2048, max_running=8)


WORKLOADS = {"multiturn": multiturn, "shared-prompt": shared_prompt, "longdoc": longdoc}


@dataclass
class _Req:
    session: Session
    turn: int
    tokens: tuple  # history + this turn's prompt
    due: int
    match: object = None
    slots: list = field(default_factory=list)
    computed: int = 0
    decoded: int = 0
    stalled: int = 0

    @property
    def reply(self) -> tuple:
        return self.session.turns[self.turn].reply

    @property
    def length(self) -> int:
        return self.computed + self.decoded

    @property
    def last_loc(self) -> int:
        return int(self.slots[-1][-1]) if self.length else -1


@dataclass
class RunResult:
    """Metrics of one policy on one trace, and lane occupancy over time."""

    workload: str
    policy: str
    cp_size: int
    lane_pages: int
    hit_tokens: int = 0
    prompt_tokens: int = 0
    evictions: int = 0
    evicted_pages: int = 0
    refusals: int = 0
    aborted: int = 0
    finished: int = 0
    tokens: int = 0  # tokens served: cached prefixes matched, prefilled and decoded
    tokens_before_refusal: int | None = None
    max_request_skew: int = 0  # max over requests of (most - fewest pages in a lane)
    occupancy: list = field(default_factory=list)  # per step: used pages per lane

    def summary(self) -> dict:
        """The table row of this run."""
        occ = np.array(self.occupancy) if self.occupancy else np.zeros((1, self.cp_size))
        peak = occ.max(0)
        return {
            "workload": self.workload,
            "policy": self.policy,
            "hit rate": round(self.hit_tokens / max(self.prompt_tokens, 1), 4),
            "evictions": self.evictions,
            "refusals": self.refusals,
            "finished": self.finished,
            "aborted": self.aborted,
            "peak pages/lane min": int(peak.min()),
            "peak pages/lane max": int(peak.max()),
            "max lane gap %": round(100.0 * float((occ.max(1) - occ.min(1)).max()) / self.lane_pages, 3),
            "max request skew": self.max_request_skew,
            "tokens before 1st refusal": self.tokens if self.tokens_before_refusal is None else self.tokens_before_refusal,
        }


def lane_need(alloc: OwnerLaneAllocator, last_loc: int, length: int, end: int) -> np.ndarray:
    """Pages per lane a request still needs to grow from ``length`` to ``end``
    tokens. With a prefix its lanes are fixed by ``last_loc``; without one the
    allocator will pick the fullest lane, assumed here."""
    S, N = alloc.page_size, alloc.cp_size
    first, stop = -(-length // S), -(-end // S)
    if stop <= first:
        return np.zeros(N, dtype=np.int64)
    if length:
        base = lane_base_from_prefix(owner_of(page_of(last_loc, S), N), length, S, N)
    else:
        base = int(np.argmax(alloc.lane_free_pages()))
    return np.bincount(lane_of_position(base, np.arange(first, stop), N), minlength=N)


def run(workload: Workload, policy: str = "least_full", cp_size: int = 8, page_size: int = 16,
        lane_pages: int | None = None, max_stall: int = 50, headroom: float = 0.02,
        admission: str = "lanes", progress: bool = True) -> RunResult:
    """Run ``workload`` under one placement ``policy``; see the module doc.

    ``admission="lanes"`` admits a request only while every lane can hold what
    the running requests and it still need (free plus evictable pages, less
    ``headroom``); ``"none"`` admits every due request up to the running limit,
    a stress mode in which allocations are refused once a lane runs dry.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if admission not in ADMISSION:
        raise ValueError(f"unknown admission {admission!r}; choose from {ADMISSION}")
    S, N = page_size, cp_size
    lane_pages = lane_pages or workload.lane_pages
    size = lane_pages * N * S
    if policy == "oblivious":
        alloc = OwnerLaneAllocator(size, S, 1)
    else:
        alloc = OwnerLaneAllocator(size, S, N, base_policy=policy)
    cache = PrefixCache(alloc)
    res = RunResult(workload.name, policy, N, lane_pages)
    pending = [_Req(s, 0, s.turns[0].prompt, s.arrival) for s in workload.sessions]
    running: list[_Req] = []
    total = sum(len(s.turns) for s in workload.sessions)
    bar = tqdm(total=total, desc=f"{workload.name} / {policy}", disable=not progress, leave=False)
    all_pages = np.arange(alloc.num_pages + 1)
    step = 0

    def refused():
        res.refusals += 1
        if res.tokens_before_refusal is None:
            res.tokens_before_refusal = res.tokens

    def batch_alloc(reqs, call):
        """Allocate for as long a prefix of ``reqs`` as fits (halving on refusal)."""
        while reqs:
            out = call(reqs)
            if out is not None:
                return reqs, out
            refused()
            reqs = reqs[: len(reqs) // 2]
        return [], None

    def end(r: _Req, aborted: bool):
        slots = torch.cat(r.slots) if r.slots else torch.empty(0, dtype=torch.int64)
        if slots.numel():  # how unevenly this request's pages sit over the lanes
            per_lane = np.bincount(owner_of(np.unique(page_of(slots.numpy(), S)), N), minlength=N)
            res.max_request_skew = max(res.max_request_skew, int(per_lane.max() - per_lane.min()))
        running.remove(r)
        bar.update(1)
        if aborted:
            cache.release(r.match, slots)
            res.aborted += 1
            return
        kv_tokens = r.tokens + r.reply
        cache.insert(kv_tokens, slots, r.match)
        res.finished += 1
        if r.turn + 1 < len(r.session.turns):
            nxt = r.session.turns[r.turn + 1]
            pending.append(_Req(r.session, r.turn + 1, kv_tokens + nxt.prompt, step + nxt.pause))

    while pending or running:
        # 1. admit due requests while every lane can hold what the running ones
        # and the new one still need (free + evictable pages, less headroom):
        # memory runs out per lane, so the scheduler budgets per lane
        pending.sort(key=lambda r: (r.due, r.session.sid))
        reserved = sum((lane_need(alloc, r.last_loc, r.length, len(r.tokens) + len(r.reply)) for r in running),
                       np.zeros(alloc.cp_size, dtype=np.int64))
        while pending and pending[0].due <= step and len(running) < workload.max_running:
            r = pending[0]
            hit = cache.lookup(r.tokens)  # no side effect: nothing to give back if it does not fit
            need = cache.lane_need(hit, len(r.tokens) + len(r.reply))  # with the copy page, if any
            spare = (np.array(alloc.lane_free_pages()) + cache.evictable_pages() - hit.newly_pinned
                     - headroom * alloc.lane_pages - reserved)
            if admission == "lanes" and running and (need > spare).any():
                break
            m = cache.acquire(r.tokens)
            pending.pop(0)
            res.tokens += m.length  # served from the cache
            res.hit_tokens += m.length
            res.prompt_tokens += len(r.tokens)
            r.match, r.slots, r.computed = m, [m.slots], m.length
            running.append(r)
            reserved = reserved + lane_need(alloc, r.last_loc, r.length, len(r.tokens) + len(r.reply))
        # 2. one extend batch: the next chunk of every request still prefilling
        pre = [r for r in running if r.computed < len(r.tokens)]
        if pre:
            def extend(rs):
                chunks = [min(workload.chunk, len(r.tokens) - r.computed) for r in rs]
                return cache.allocate_extend([r.computed for r in rs], [r.computed + c for r, c in zip(rs, chunks)],
                                             torch.tensor([r.last_loc for r in rs]))
            done, out = batch_alloc(pre, extend)
            for i, r in enumerate(done):
                a, n = int(out.extend_start_loc[i]), int(out.extend_lens[i])
                r.slots.append(out.out_cache_loc[a : a + n])
                r.computed += n
                r.stalled = 0
            res.tokens += 0 if out is None else int(out.extend_lens.sum())
            for r in pre[len(done):]:
                r.stalled += 1
        # 3. one decode batch
        dec = [r for r in running if r.computed == len(r.tokens) and r.decoded < len(r.reply)]
        if dec:
            def decode(rs):
                return cache.allocate_decode([r.length + 1 for r in rs], torch.tensor([r.last_loc for r in rs]))
            done, out = batch_alloc(dec, decode)
            for r, s in zip(done, out.out_cache_loc.split(1) if out is not None else []):
                r.slots.append(s)
                r.decoded += 1
                r.stalled = 0
            res.tokens += len(done)
            for r in dec[len(done):]:
                r.stalled += 1
        # 4. finish, or abort what cannot progress
        for r in list(running):
            if r.decoded == len(r.reply) and r.computed == len(r.tokens):
                end(r, aborted=False)
            elif r.stalled > max_stall:
                end(r, aborted=True)
        used = np.flatnonzero(alloc.is_allocated(all_pages))
        res.occupancy.append(np.bincount(owner_of(used, N), minlength=N).tolist())
        step += 1
    bar.close()
    res.evictions, res.evicted_pages = cache.evicted_nodes, cache.evicted_pages
    cache.clear()
    if sum(alloc.lane_free_pages()) != alloc.num_pages:
        raise AssertionError("pages leaked: the cache and the allocator disagree")
    return res


def compare(workload: Workload, policies=POLICIES, **kw) -> list[RunResult]:
    """Run every policy on the same trace."""
    return [run(workload, p, **kw) for p in policies]


def plot(results: list[RunResult], path: str) -> None:
    """Lane occupancy over time, one panel per (workload, policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    fig, axes = plt.subplots(len(workloads), len(policies), figsize=(4.2 * len(policies), 3.0 * len(workloads)),
                             squeeze=False, sharey="row")
    for r in results:
        ax = axes[workloads.index(r.workload)][policies.index(r.policy)]
        occ = np.array(r.occupancy)
        for lane in range(occ.shape[1]):
            ax.plot(occ[:, lane], linewidth=0.7)
        ax.axhline(r.lane_pages, color="black", linestyle=":", linewidth=0.8)
        s = r.summary()
        ax.set_title(f"{r.workload} / {r.policy}\nmax lane gap {s['max lane gap %']}%, refusals {s['refusals']}",
                     fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("pages used per lane", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
