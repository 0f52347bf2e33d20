"""Workload simulator: the engine's own scheduler, without a model.

The simulator runs :class:`cpkv.engine.scheduler.Scheduler` (the one the
engine runs on a CP group) over seeded traces, with an executor that computes
nothing: a request's "generated" tokens are a fixed function of the request
and its position, so follow-up turns find their history in the prefix cache
as they would in the engine. Placement policies are compared side by side on
the same trace:

* ``least_full``: owner lanes, a fresh chain based at the lane with the most
  free pages (ours);
* ``lane0``: owner lanes, every fresh chain based at lane 0;
* ``oblivious``: pages taken from one free list, as a plain paged allocator
  does (lane of page p is still ``p % N`` for the occupancy figures, but the
  owner-lane invariant does not hold, so neither the page split nor direct
  write could be used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..engine.trace import WORKLOADS, RequestSpec

if TYPE_CHECKING:
    from ..engine.scheduler import StepPlan

POLICIES = ("least_full", "lane0", "oblivious")


@dataclass(frozen=True)
class Workload:
    """A named trace with the engine settings it is meant for."""

    name: str
    requests: tuple
    lane_pages: int  # default capacity: pages per lane
    chunk: int = 8192  # prefill tokens per step, all requests together
    max_running: int = 64


def multiturn(n: int = 600, seed: int = 0) -> Workload:
    """600 conversations of 1-4 turns (:func:`cpkv.engine.trace.multiturn`), 4096 pages per lane."""
    return Workload("multiturn", tuple(WORKLOADS["multiturn"](n, seed=seed)), lane_pages=4096)


def shared_prompt(n: int = 400, seed: int = 0, system: int = 3000) -> Workload:
    """400 questions on one 3000-token prompt (:func:`cpkv.engine.trace.shared_prompt`), 256 pages per lane."""
    return Workload("shared-prompt", tuple(WORKLOADS["shared-prompt"](n, seed=seed, system=system)), lane_pages=256)


def longdoc(n: int = 8, seed: int = 0) -> Workload:
    """8 documents of 8K-32K tokens and their questions (:func:`cpkv.engine.trace.longdoc`), 2048 pages per lane."""
    return Workload("longdoc", tuple(WORKLOADS["longdoc"](n, seed=seed)), lane_pages=2048, max_running=8)


SIM_WORKLOADS = {"multiturn": multiturn, "shared-prompt": shared_prompt, "longdoc": longdoc}


def pseudo_token(r, vocab: int = 50_000) -> int:
    """The simulator's stand-in for a sampled token: a fixed function of the
    request and how many tokens it has (its ``length``: O(1), no sequence built)."""
    return (r.index * 7919 + r.length * 104729) % vocab


def null_execute(plan: StepPlan) -> list[list[int]]:
    """Carry out a plan without a model: every batch yields pseudo tokens."""
    return [[pseudo_token(r) for r in b.requests] for b in plan.forwards()]


@dataclass
class RunResult:
    """Metrics of one policy on one trace (the scheduler's :class:`Stats`)."""

    workload: str
    policy: str
    cp_size: int
    lane_pages: int
    stats: object = None
    evictions: int = 0
    evicted_pages: int = 0
    requests: int = 0
    host_pages: int = 0
    latency: dict | None = None  # TTFT and TPOT in steps (:func:`~cpkv.engine.latency.latency_report`)

    @property
    def occupancy(self) -> list:
        """Used device pages per lane, per step."""
        return self.stats.occupancy

    def summary(self) -> dict:
        """The table row of this run."""
        st = self.stats
        occ = np.array(st.occupancy) if st.occupancy else np.zeros((1, self.cp_size))
        peak = occ.max(0)
        row = {
            "workload": self.workload,
            "policy": self.policy,
            "hit rate": round(st.hit_tokens / max(st.prompt_tokens, 1), 4),
            "evictions": self.evictions,
            "refusals": st.refusals,
            "preemptions": st.preemptions,
            "finished": st.finished,
            "peak pages/lane min": int(peak.min()),
            "peak pages/lane max": int(peak.max()),
            "max lane gap %": round(st.lane_gap(self.lane_pages), 3),
            "max request skew": st.max_request_skew,
            "tokens before 1st refusal": st.served_tokens if st.tokens_before_refusal is None
            else st.tokens_before_refusal,
        }
        if self.host_pages:
            row["host hit rate"] = round(st.host_hit_tokens / max(st.prompt_tokens, 1), 4)
        if self.latency is not None:
            for q in ("p50", "p99"):
                row[f"TTFT {q} steps"] = self.latency["ttft_steps"][q]
            row["prefix waits"] = st.prefix_waits
        return row


def run(workload: Workload, policy: str = "least_full", cp_size: int = 8, page_size: int = 16,
        lane_pages: int | None = None, admission: str = "lanes", headroom: float = 0.02, host_pages: int = 0,
        progress: bool = True, events=None, wait_for_prefix: bool = True, eviction: str = "lru") -> RunResult:
    """Run ``workload`` under one placement ``policy`` through the engine's scheduler.

    ``admission="lanes"`` admits a request only while every lane can hold what
    the running requests and it still need (free plus evictable pages, less
    ``headroom`` of a lane); ``"none"`` admits every due request up to the
    running limit, a stress mode in which allocations are refused and requests
    preempted once a lane runs dry. ``events`` (a
    :class:`~cpkv.consumers.kv_events_zmq.KVEventPublisher`, or ``None``)
    hears the caches' KV events, one batch a step, as the engine publishes
    them (:func:`cpkv.engine.engine.connect_kv_events`). ``wait_for_prefix``:
    the scheduler's in-batch prefix rule (a request waits for the pages of a
    prefix another is computing; :class:`~cpkv.engine.scheduler.Scheduler`).
    ``eviction``: the prefix cache's eviction policy (a name of
    :data:`~cpkv.consumers.eviction.EVICTION_POLICIES`).
    TTFT and TPOT come in steps (``RunResult.latency``).
    """
    # imported here: the workloads above are read before torch is imported (cpkv.tools.sizes)
    from ..consumers.hicache import HostTier
    from ..consumers.prefix_cache import PrefixCache
    from ..contract.allocator import OwnerLaneAllocator
    from ..engine.latency import LatencyClock, latency_report
    from ..engine.scheduler import ADMISSION, Scheduler
    from ..runtime.progress import progress_bar

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if admission not in ADMISSION:
        raise ValueError(f"unknown admission {admission!r}; choose from {ADMISSION}")
    S, N = page_size, cp_size
    lane_pages = lane_pages or workload.lane_pages
    size = lane_pages * N * S
    alloc = (OwnerLaneAllocator(size, S, 1) if policy == "oblivious"
             else OwnerLaneAllocator(size, S, N, base_policy=policy))
    host = HostTier(host_pages, S) if host_pages else None
    sched = Scheduler(list(workload.requests), PrefixCache(alloc, eviction=eviction), chunk=workload.chunk,
                      max_running=workload.max_running, admission=admission, headroom=headroom, host=host,
                      report_lanes=N, wait_for_prefix=wait_for_prefix)
    clock = LatencyClock(0.0)
    sink = None
    if events is not None:
        from ..engine.engine import connect_kv_events

        sink = connect_kv_events(sched, events)
    bar = progress_bar(total=len(workload.requests), desc=f"{workload.name} / {policy}", disable=not progress, leave=False)
    while not sched.done:
        plan = sched.plan()
        bar.update(len(sched.complete(plan, null_execute(plan))))
        clock.observe(plan, float(plan.step))
        if sink is not None:
            sink.flush()
    bar.close()
    res = RunResult(workload.name, policy, N, lane_pages, sched.stats, sched.stats.evicted_nodes,
                    sched.stats.evicted_pages, len(workload.requests), host_pages,
                    {k: v for k, v in latency_report(sched.requests, clock).items() if k.endswith("_steps")})
    sched.drain()
    if sink is not None:
        sink.flush()
    sched.check_drained()
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
        occ = np.array(r.stats.occupancy)
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
    from .report import save_figure

    save_figure(fig, path)


__all__ = ["POLICIES", "RequestSpec", "RunResult", "SIM_WORKLOADS", "Workload", "compare", "longdoc", "multiturn",
           "null_execute", "plot", "run", "shared_prompt"]
