"""Workload simulator: seeded serving traces through an owner-lane allocator.

A trace is a list of conversations. Each arrives at a step, sends a prompt,
decodes a reply, and may come back (after a pause, holding its KV) with more
turns that extend its own history, so continuations start mid-page as often as
not. Every step the simulator admits due extends as one batch, runs one decode
step for every replying request, and frees finished conversations. It records
lane occupancy over time and compares lane-base policies on the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from .allocator import OwnerLaneAllocator


@dataclass
class Turn:
    """One user turn: ``prompt`` new tokens to prefill, then ``reply`` decode steps."""

    prompt: int
    reply: int
    pause: int  # steps the conversation idles before this turn


@dataclass
class Conversation:
    """A conversation of the trace and its live state during a run."""

    cid: int
    arrival: int
    turns: list[Turn]
    slots: list = field(default_factory=list)  # tensors of this conversation's slots
    length: int = 0
    turn: int = 0
    left: int = 0  # decode steps left in the current turn
    due: int = 0
    stalled: int = 0

    @property
    def last_loc(self) -> int:
        return int(self.slots[-1][-1]) if self.slots else -1


def multiturn_trace(n: int = 160, seed: int = 0, page_size: int = 16) -> list[Conversation]:
    """The built-in trace: ``n`` conversations of 1-4 turns arriving over time;
    prompts 64-1024 tokens, follow-ups 8-256, replies 8-192 decode steps.
    Lengths are drawn without regard to the page size, so most prefixes end
    mid-page."""
    rng = np.random.default_rng(seed)
    convs, t = [], 0
    for cid in range(n):
        t += int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        turns = [Turn(int(rng.integers(64, 1025)), int(rng.integers(8, 193)), 0)]
        turns += [Turn(int(rng.integers(8, 257)), int(rng.integers(8, 193)), int(rng.integers(1, 30))) for _ in range(k - 1)]
        convs.append(Conversation(cid, t, turns))
    return convs


def _fresh(trace: list[Conversation]) -> list[Conversation]:
    return [Conversation(c.cid, c.arrival, c.turns) for c in trace]


@dataclass
class RunResult:
    """Metrics of one policy on one trace, and lane occupancy over time."""

    policy: str
    lane_pages: int
    refusals: int = 0
    aborted: int = 0
    finished: int = 0
    tokens: int = 0
    tokens_before_refusal: int | None = None
    max_request_skew: int = 0
    occupancy: list = field(default_factory=list)  # per step: used pages per lane

    def summary(self) -> dict:
        """The table row of this run."""
        occ = np.array(self.occupancy)
        peak = occ.max(0)
        gap = (occ.max(1) - occ.min(1)).max()
        return {
            "policy": self.policy,
            "peak pages/lane min": int(peak.min()),
            "peak pages/lane max": int(peak.max()),
            "max lane gap %": round(100.0 * gap / self.lane_pages, 2),
            "max request skew": self.max_request_skew,
            "refusals": self.refusals,
            "aborted": self.aborted,
            "finished": self.finished,
            "tokens before 1st refusal": self.tokens_before_refusal if self.tokens_before_refusal is not None else self.tokens,
        }


def run_trace(trace, policy: str = "least_full", cp_size: int = 8, page_size: int = 16,
              lane_pages: int = 512, max_stall: int = 20, headroom: float = 0.1,
              progress: bool = True) -> RunResult:
    """Run ``trace`` through one allocator; ``policy`` is the allocator's
    lane-base policy. A request that cannot be served for ``max_stall`` steps
    is aborted and freed."""
    size = (lane_pages * cp_size) * page_size
    alloc = OwnerLaneAllocator(size, page_size, cp_size, base_policy=policy)
    res = RunResult(policy, lane_pages)
    convs = _fresh(trace)
    for c in convs:
        c.due = c.arrival
    live, step = list(convs), 0
    S, N = page_size, cp_size
    bar = tqdm(total=len(convs), desc=f"simulate {policy}", disable=not progress, leave=False)

    def refused():
        res.refusals += 1
        if res.tokens_before_refusal is None:
            res.tokens_before_refusal = res.tokens

    def finish(c, aborted=False):
        slots = torch.cat(c.slots) if c.slots else torch.empty(0, dtype=torch.int64)
        if slots.numel():
            per_lane = np.bincount(np.unique(slots.numpy() // S) % N, minlength=N)
            res.max_request_skew = max(res.max_request_skew, int(per_lane.max() - per_lane.min()))
        alloc.free(slots)
        live.remove(c)
        res.aborted += aborted
        res.finished += not aborted
        bar.update(1)

    while live:
        # 1. extends that are due: one batch; on refusal, admit a prefix of it
        due = [c for c in live if c.left == 0 and c.turn < len(c.turns) and c.due <= step]
        # admission control: continuations first; a new conversation only while
        # the tokens every lane base can take leave ``headroom`` for decoding
        due.sort(key=lambda c: (c.turn == 0, c.due, c.cid))
        budget = alloc.available_size() - int(headroom * size)
        admit = []
        for c in due:
            budget -= c.turns[c.turn].prompt
            if c.turn > 0 or budget >= 0:
                admit.append(c)
        due = admit
        if due:
            batch = due
            while batch:
                prefix = [c.length for c in batch]
                seq = [c.length + c.turns[c.turn].prompt for c in batch]
                out = alloc.allocate_extend(prefix, seq, torch.tensor([c.last_loc for c in batch]))
                if out is not None:
                    break
                refused()
                batch = batch[: len(batch) // 2]
            if batch:
                for i, c in enumerate(batch):
                    a, n = int(out.extend_start_loc[i]), int(out.extend_lens[i])
                    c.slots.append(out.out_cache_loc[a : a + n])
                    c.length += n
                    c.left = c.turns[c.turn].reply
                    c.stalled = 0
                res.tokens += int(out.extend_lens.sum())
            for c in due[len(batch):]:
                c.stalled += 1
        # 2. one decode step for every replying request
        dec = [c for c in live if c.left > 0]
        if dec:
            seq = torch.tensor([c.length + 1 for c in dec])
            out = alloc.alloc_decode(seq, seq, torch.tensor([c.last_loc for c in dec]))
            if out is None:
                refused()
                for c in dec:
                    c.stalled += 1
            else:
                res.tokens += len(dec)
                for c, s in zip(dec, out.split(1)):
                    c.slots.append(s)
                    c.length += 1
                    c.left -= 1
                    if c.left == 0:
                        c.turn += 1
                        if c.turn < len(c.turns):
                            c.due = step + c.turns[c.turn].pause
                    c.stalled = 0
        # 3. finished or hopelessly stalled conversations give their pages back
        for c in list(live):
            if c.turn >= len(c.turns):
                finish(c)
            elif c.stalled > max_stall:
                finish(c, aborted=True)
        res.occupancy.append((alloc.lane_pages - np.array(alloc.lane_free_pages())).tolist())
        step += 1
    bar.close()
    assert sum(alloc.lane_free_pages()) == alloc.num_pages, "pages leaked"
    return res


def compare(trace, policies=("least_full", "lane0"), **kw) -> list[RunResult]:
    """Run every policy on the same trace."""
    return [run_trace(trace, p, **kw) for p in policies]
