"""Per-request latency of a run: time to first token and time per output token.

:class:`LatencyClock` watches a run from outside the scheduler: after each
step it is told the step's plan and the time, and notes the step in which each
request got its first token. A request's arrival is the step it became due
(its trace arrival, or for a follow-up turn ``delay`` steps after its parent
finished, as the scheduler makes it due) and its end the step it finished
(``Request.finished_at``). From those, :func:`latency_report`:

* TTFT: from the start of the arrival step to the end of the first-token step,
  in steps (``first - arrival + 1``) and seconds;
* TPOT: from the end of the first-token step to the end of the last step,
  per token after the first: ``(finished - first) / (generated - 1)`` steps
  and the same in seconds (requests of one generated token have none);

with p50 and p99 of each over the finished requests, and every request's
figures; and the duration of the observed steps by kind (:data:`STEP_KINDS`:
decodes only, decodes with a prefill chunk in the same forward, a prefill
only), which says where a decode step's milliseconds go. Nothing loops per
token.
"""

from __future__ import annotations

import numpy as np

from .step_plan import StepPlan

#: The kinds of an observed step, by its forwards: decodes only; decodes and a
#: prefill chunk (one forward, the decodes riding as one-token extends); a
#: prefill only; no forward (the step only moved KV, or nothing ran).
STEP_KINDS = ("decode", "mixed", "prefill", "none")


def step_kind(plan: StepPlan) -> str:
    """The :data:`STEP_KINDS` entry of ``plan`` (by what its forward computes)."""
    return "none" if plan.forward is None else plan.forward.kind


class LatencyClock:
    """Step times and first-token steps of one run (identical on every rank).

    Steps the scheduler skipped (nothing ran, nothing was due:
    :meth:`~cpkv.engine.scheduler.Scheduler.skip_idle`) are never observed and
    take no time: such a step begins and ends when the last observed step
    before it ended. Memory is per observed step, not per step number."""

    def __init__(self, start: float):
        self.start = start
        self.steps: list[int] = []  # observed step numbers, ascending
        self.ends: list[float] = []  # perf_counter at the end of each observed step
        self.first: dict[int, int] = {}  # request index -> step of its first generated token
        self.kinds: list[str] = []  # the STEP_KINDS entry of each observed step

    def observe(self, plan: StepPlan, now: float) -> None:
        """Step ``plan.step`` ended at ``now``: note the requests that now hold
        their first token. Raises ``ValueError`` for a step not after the last
        one observed."""
        if self.steps and plan.step <= self.steps[-1]:
            raise ValueError(f"step {plan.step} observed after step {self.steps[-1]}")
        self.steps.append(plan.step)
        self.ends.append(now)
        self.kinds.append(step_kind(plan))
        for b in plan.forwards():
            for r, s in zip(b.requests, b.sample):
                if s and r.generated and r.index not in self.first:
                    self.first[r.index] = plan.step

    def step_seconds(self) -> dict:
        """The duration of the observed steps by kind: ``{kind: {"p50", "p99",
        "count"}}`` for every entry of :data:`STEP_KINDS` (``None``
        percentiles for a kind that never ran). A step lasts from the end of
        the observed step before it (or the start) to its own end."""
        ends = np.asarray([self.start, *self.ends])
        took, kinds = np.diff(ends), np.asarray(self.kinds, dtype=object)
        return {k: percentiles(took[kinds == k]) for k in STEP_KINDS}

    def _end_before(self, idx: np.ndarray) -> np.ndarray:
        ends = np.asarray([self.start, *self.ends])
        return ends[idx]  # idx 0: the start; idx i: the end of the i-th observed step

    def step_start(self, steps: np.ndarray) -> np.ndarray:
        """The time each step in ``steps`` began: the end of the last observed step before it, or the start."""
        return self._end_before(np.searchsorted(self.steps, np.asarray(steps, dtype=np.int64), side="left"))

    def step_end(self, steps: np.ndarray) -> np.ndarray:
        """The time each step in ``steps`` ended: the end of the last observed step at or before it."""
        return self._end_before(np.searchsorted(self.steps, np.asarray(steps, dtype=np.int64), side="right"))


def arrival_step(r, by_id: dict) -> int:
    """The step request ``r`` became due: its arrival, or for a follow-up turn
    ``max(arrival, parent finished + 1 + delay)`` (the scheduler's rule)."""
    s = r.spec
    if s.after is None:
        return s.arrival
    return max(s.arrival, by_id[s.after].finished_at + 1 + s.delay)


def percentiles(x) -> dict:
    """``{"p50", "p99", "count"}`` of ``x`` (``None`` percentiles when empty)."""
    x = np.asarray(x, dtype=np.float64)
    if not x.size:
        return {"p50": None, "p99": None, "count": 0}
    p50, p99 = np.percentile(x, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "count": int(x.size)}


def latency_report(requests: list, clock: LatencyClock) -> dict:
    """TTFT and TPOT (steps and seconds; p50, p99 and count over the finished
    requests), each request's figures (``requests``: id, arrival,
    first-token and finish steps, generated tokens, preemptions, TTFT, TPOT)
    and the steps' durations by kind (``step_s``:
    :meth:`LatencyClock.step_seconds`), from the finished ``requests`` of a
    run watched by ``clock``."""
    by_id = {r.spec.id: r for r in requests}
    done = [r for r in requests if r.finished_at >= 0 and r.index in clock.first]
    arrival = np.array([arrival_step(r, by_id) for r in done], dtype=np.int64)
    first = np.array([clock.first[r.index] for r in done], dtype=np.int64)
    end = np.array([r.finished_at for r in done], dtype=np.int64)
    gen = np.array([len(r.generated) for r in done], dtype=np.int64)
    ttft_steps = first - arrival + 1
    ttft_s = clock.step_end(first) - clock.step_start(arrival) if done else np.zeros(0)
    more = gen > 1
    tpot_steps = (end - first)[more] / (gen[more] - 1)
    tpot_s = (clock.step_end(end) - clock.step_end(first))[more] / (gen[more] - 1) if done else np.zeros(0)
    tpot_of = np.full(len(done), np.nan)
    tpot_of[more] = tpot_s
    tpot_steps_of = np.full(len(done), np.nan)
    tpot_steps_of[more] = tpot_steps
    per = [{"id": r.spec.id, "arrival_step": int(a), "first_token_step": int(f), "finished_step": int(e),
            "generated": int(g), "preemptions": r.preemptions, "ttft_steps": int(ts), "ttft_s": float(t),
            "tpot_steps": None if np.isnan(ps) else float(ps), "tpot_s": None if np.isnan(p) else float(p)}
           for r, a, f, e, g, ts, t, ps, p in zip(done, arrival, first, end, gen, ttft_steps, ttft_s,
                                                  tpot_steps_of, tpot_of)]
    return {"ttft_steps": percentiles(ttft_steps), "ttft_s": percentiles(ttft_s),
            "tpot_steps": percentiles(tpot_steps), "tpot_s": percentiles(tpot_s), "requests": per,
            "step_s": clock.step_seconds()}
