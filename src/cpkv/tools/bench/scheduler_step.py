"""``cpkv bench scheduler``: the scheduler alone (no model, as the simulator
runs it), its decode step timed at a batch and a context.

One case: ``batch`` requests on one ``context``-token document (the prompt
every request has but its last token: a shared system prompt or document,
the serving pattern the prefix cache is for). The first request prefills it in one step; its
full pages enter the prefix cache as they are computed, so the others,
arriving a step later, share all but its last page (a mid-page copy each)
and prefill one token. Then every request decodes ``steps`` tokens (pseudo
tokens, distinct per request, so their decode pages never coincide) and all
finish in the same step, which is timed with the rest: median, p99 and the
slowest decode step, and microseconds per running request at the median.
A decode step must not grow with the context (the goal: <= 2 us per
running request at the median, no step over 5 ms at batch 256 and 128K).
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import torch

from ...consumers.prefix_cache import PrefixCache
from ...contract.allocator import OwnerLaneAllocator
from ...engine.scheduler import Scheduler
from ...engine.trace import RequestSpec

from ..sizes import BENCH_SIZES

#: The cases ``cpkv bench scheduler`` runs when not given (:data:`cpkv.tools.sizes.BENCH_SIZES`).
BATCHES, CONTEXTS = tuple(BENCH_SIZES["scheduler"]["batches"]), tuple(BENCH_SIZES["scheduler"]["contexts"])


def _token(r) -> int:
    """A pseudo sampled token: a fixed function of the request and its length (O(1))."""
    return (r.index * 7919 + (len(r.prompt) + len(r.generated)) * 104729) % 50_000


def scheduler_case(batch: int, context: int, *, steps: int = 64, cp_size: int = 8, page_size: int = 64,
                   seed: int = 0) -> dict:
    """Time the decode steps of one case (see the module doc). Returns its
    table row: median, p99 and max step in ms (wall clock), us per running
    request at the median, the same from the thread's CPU time (a loaded
    machine's waits left out), decode steps timed, prefix hit rate. Raises ``ValueError`` for a
    batch, context or steps below 1."""
    if min(batch, context, steps) < 1:
        raise ValueError(f"batch, context and steps must be >= 1, got {batch}, {context}, {steps}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs it: a host op never waits on a thread pool
    gc.collect()  # the cases before this one leave cyclic garbage (their trees): not this case's to collect
    try:
        return _timed_case(batch, context, steps, cp_size, page_size, seed)
    finally:
        torch.set_num_threads(threads)


def _timed_case(batch: int, context: int, steps: int, cp_size: int, page_size: int, seed: int) -> dict:
    S, N = page_size, cp_size
    doc = tuple(np.random.default_rng(seed).integers(0, 50_000, context - 1).tolist())
    specs = [RequestSpec(f"r{i}", int(i > 0), doc + (i,), steps + 2 - int(i > 0)) for i in range(batch)]
    # every request continues the document's chain, so their own pages (a copy page and the decode
    # pages) all land on the same few lanes: each lane is sized for all of them
    lane = -(-context // (S * N)) + batch * (2 + -(-(steps + 2) // S)) + 2
    alloc = OwnerLaneAllocator(lane * N * S, S, N)
    sched = Scheduler(specs, PrefixCache(alloc), chunk=max(context, batch), max_running=batch)
    times, cpu = [], []
    while not sched.done:
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = sched.plan()
        t1, c1 = time.perf_counter(), time.thread_time()
        tokens = [[_token(r) for r in f.requests] for f in plan.forwards()]  # the model's part: not timed
        t2, c2 = time.perf_counter(), time.thread_time()
        sched.complete(plan, tokens)
        dt, dc = time.perf_counter() - t2 + t1 - t0, time.thread_time() - c2 + c1 - c0
        if plan.forward is not None and plan.forward.decode and len(plan.forward.requests) == batch:
            times.append(dt)
            cpu.append(dc)
    if not times:
        raise RuntimeError(f"no decode step ran the whole batch of {batch} (admission held some back)")
    t, c = np.array(times) * 1e3, np.array(cpu) * 1e3
    st = sched.stats
    return {"batch": batch, "context": context, "steps timed": t.size,
            "median ms": round(float(np.median(t)), 3), "p99 ms": round(float(np.percentile(t, 99)), 3),
            "max ms": round(float(t.max()), 3), "us/request": round(float(np.median(t)) * 1e3 / batch, 2),
            # CPU time of the step's thread: what the step costs, less the waits of a loaded machine
            "cpu median ms": round(float(np.median(c)), 3), "cpu max ms": round(float(c.max()), 3),
            "cpu us/request": round(float(np.median(c)) * 1e3 / batch, 2),
            "hit rate": round(st.hit_tokens / max(st.prompt_tokens, 1), 4)}


#: Figures in time: each reported as its median over the rounds.
TIMED = ("median ms", "p99 ms", "max ms", "us/request", "cpu median ms", "cpu max ms", "cpu us/request")


def bench_scheduler(batches=BATCHES, contexts=CONTEXTS, steps: int = 64, cp_size: int = 8, page_size: int = 64,
                    rounds: int = 3) -> list[dict]:
    """One row per (batch, context) case of :func:`scheduler_case`. The
    cases run ``rounds`` times, interleaved (each round runs every case once),
    so that a slow stretch of a noisy machine falls on one round of each; a
    figure in time is its median over the rounds (the slowest step: the median
    of the rounds' slowest steps), the counts are the same in every round.
    Raises ``ValueError`` for ``rounds < 1``, ``RuntimeError`` when a case's
    counts (decode steps timed, hit rate) differ between rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    runs = [[scheduler_case(b, c, steps=steps, cp_size=cp_size, page_size=page_size) for b in batches
             for c in contexts] for _ in range(rounds)]
    rows = []
    for case in zip(*runs):
        counts = {(r["steps timed"], r["hit rate"]) for r in case}
        if len(counts) > 1:
            raise RuntimeError(f"batch {case[0]['batch']}, context {case[0]['context']}: the rounds scheduled "
                               f"differently ({sorted(counts)})")
        row = dict(case[0], rounds=rounds)
        row.update({k: round(float(np.median([r[k] for r in case])), 3) for k in TIMED})
        rows.append(row)
    return rows


def scheduler_title(batches=BATCHES, contexts=CONTEXTS, steps: int = 64, cp_size: int = 8, page_size: int = 64,
                    rounds: int = 3) -> str:
    """The table title of :func:`bench_scheduler` with these settings (and the load average, which moves the figures)."""
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"scheduler: no model, N {cp_size}, page {page_size}, {steps} decode steps per case on one shared "
            f"document, every request finishing in the last; medians over {rounds} interleaved rounds; "
            f"load average {load}")


if __name__ == "__main__":  # a quick look: python -m cpkv.tools.bench.scheduler_step
    for row in bench_scheduler():
        print(row, flush=True)
