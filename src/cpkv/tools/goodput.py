"""Goodput: the highest arrival rate at which a group still meets its latency objectives.

``cpkv simulate --goodput`` replays a Mooncake trace (:func:`cpkv.tools.replay.replay`) at
multiples of its own arrival rate, for each mode at the same memory per rank, and reports the
highest multiple at which the run's p99 TTFT and p99 TPOT both meet an :class:`Slo`
(``np.percentile``'s linear p99 over the finished requests, as every replay table reports it).

The multiples form a grid, ``rate(k) = 2 ** (k / STEPS)`` (:data:`STEPS` 16 a doubling: one step
is 4.4 %), and :func:`search` finds the boundary on it exactly: a coarse pass from 1x by
doublings up (or down) until the verdict changes, then, between the last two, the rate where the
runs' margins to the SLO (:func:`margin_of`) say it is crossed (bisection where they cannot say).
What it returns meets the SLO, and the grid point one step above does not. The search runs each
grid point once; nothing assumes that meeting the SLO is monotone in the rate (if it is not, the
boundary found is the one the doublings bracket, and the table of runs shows it).

A run that is certain to miss every SLO it is judged against is stopped early
(:class:`SloWatch`): a p99 is above a bound as soon as at least ``n - floor(0.99 (n - 1))`` of
the ``n`` requests that will count are sure to be above it, and a request is sure to be: its
first token came later than the TTFT bound after its arrival (or has not come and that much
time has passed); its TPOT, ``(finish - first) / (output - 1)``, is above the TPOT bound even if
it finished now. Both are exact (no run is stopped that could still meet an SLO), so a stopped
run is a run that fails.

Default objectives (:data:`DEFAULT_TTFT_S`, :data:`DEFAULT_TPOT_MS`): Mooncake's, from its
real-trace experiment (FAST'25, Qin et al., "Mooncake: Trading More Storage for Less
Computation": the effective request capacity of Mooncake against its baseline under a TTFT
threshold of 30 s and TBT thresholds of 100, 200 and 300 ms, 59 % to 498 % more by its
abstract): the first TBT threshold is the default SLO, the others its sweep. cpkv bounds TPOT (a
request's mean time per output token) where Mooncake bounds TBT (each gap between two tokens): a
request's TPOT is never above its largest gap, so for one request the same bound is never
stricter here.
MLPerf Inference's DeepSeek-R1 server bounds (p99 TTFT 2 s, p99 TPOT 80 ms:
``deepseek-r1.Server.ttft_latency`` / ``tpot_latency`` in mlcommons/inference
``loadgen/mlperf.conf``) are tighter than this trace allows at any rate on the modelled group
(its longest prompts alone take about 3 s to prefill, and a decode that shares a step with an
8,192-token prefill chunk takes about 80 ms): docs/benchmarks.md shows the floor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .replay import KV_MODES, Progress, ReplayConfig, ReplayResult, replay

__all__ = ["DEFAULT_TPOT_MS", "DEFAULT_TTFT_S", "Goodput", "K_MAX", "K_MIN", "STEPS", "Slo", "SloWatch", "sweep_pool",
           "Sweep", "capacity_rows", "cmd_goodput", "compare", "goodput_rows", "margin_of", "p99s", "plot_goodput",
           "point_rows", "rate", "run_goodput", "search", "slos_of", "sweep", "violators_to_fail"]

#: Grid points a doubling of the rate: one step is ``2 ** (1 / 16)``, 4.4 %.
STEPS = 16
#: The grid's ends: 1/8x and 256x the trace's rate.
K_MIN, K_MAX = -3 * STEPS, 8 * STEPS
#: Mooncake FAST'25's TTFT threshold on its real trace (see the module docstring).
DEFAULT_TTFT_S = 30.0
#: Mooncake FAST'25's TBT thresholds, strictest first: the first is the default SLO, the others its sweep.
DEFAULT_TPOT_MS = (100.0, 200.0, 300.0)
#: The percentile judged.
QUANTILE = 99.0


def rate(k: int, steps: int = STEPS) -> float:
    """The arrival-rate multiple of grid point ``k``: ``2 ** (k / steps)``."""
    return 2.0 ** (k / steps)


@dataclass(frozen=True)
class Slo:
    """A latency objective: p99 TTFT at most ``ttft_s`` seconds and p99 TPOT at
    most ``tpot_ms`` ms. ``ValueError`` for a bound that is not a finite number > 0."""

    ttft_s: float
    tpot_ms: float

    def __post_init__(self):
        for name in ("ttft_s", "tpot_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

    def met(self, ttft_p99_s: float, tpot_p99_ms: float) -> bool:
        """Whether p99s of ``ttft_p99_s`` and ``tpot_p99_ms`` meet it (NaN, no such
        request, meets: a trace with no request of two tokens has no TPOT)."""
        return not (ttft_p99_s > self.ttft_s or tpot_p99_ms > self.tpot_ms)

    def label(self) -> str:
        """``TTFT <= 30 s, TPOT <= 100 ms``."""
        return f"TTFT <= {self.ttft_s:g} s, TPOT <= {self.tpot_ms:g} ms"


def violators_to_fail(n: int) -> int:
    """How many of ``n`` values above a bound put their p99 above it for sure:
    ``np.percentile``'s linear p99 lies between the sorted values at ``floor(h)``
    and ``floor(h) + 1``, ``h = 0.99 (n - 1)``, so it is above the bound once the
    value at ``floor(h)`` is, that is once ``n - floor(h)`` values are (at least 1)."""
    return n - math.floor(QUANTILE / 100 * (n - 1)) if n > 0 else 1


class SloWatch:
    """A replay's ``stop`` test (:class:`~cpkv.tools.replay.Progress`): true once the
    run is sure to miss every one of ``slos`` (see the module docstring), the
    requests' output lengths ``outputs`` (int ``[n]``, the trace's) telling how
    many tokens each TPOT divides by. Counts requests that will count: the trace's
    less those refused so far (refusals only shrink that count, so a bound taken
    now holds at the end)."""

    def __init__(self, slos: list[Slo], outputs: np.ndarray):
        if not slos:
            raise ValueError("an SLO watch needs at least one SLO")
        self.ttft_ms = max(s.ttft_s for s in slos) * 1e3  # missing every SLO: missing the loosest bound of each
        self.tpot_ms = max(s.tpot_ms for s in slos)
        self.outputs = np.asarray(outputs, dtype=np.int64)
        self.two = self.outputs > 1

    def __call__(self, p: Progress) -> bool:
        live = ~p.refused
        got = np.isfinite(p.first)
        late = np.where(got, p.first - p.arrival, p.now - p.arrival) > self.ttft_ms  # not yet due: negative
        if int((late & live).sum()) >= violators_to_fail(int(live.sum())):
            return True
        counted = live & self.two
        end = np.where(np.isfinite(p.finish), p.finish, p.now)
        with np.errstate(invalid="ignore"):
            slow = got & ((end - p.first) / np.maximum(self.outputs - 1, 1) > self.tpot_ms)
        return int((slow & counted).sum()) >= violators_to_fail(int(counted.sum()))


def search(margin: Callable[[int], float], *, start: int = 0, coarse: int = STEPS, k_min: int = K_MIN,
           k_max: int = K_MAX) -> tuple[int | None, int | None]:
    """The boundary on the integer grid ``[k_min, k_max]`` of a verdict read as
    a margin: point ``k`` passes when ``margin(k) <= 0`` (``inf``: fails, by how
    much unknown). Returns ``(lo, hi)`` with ``lo`` passing, ``hi`` failing and
    ``hi == lo + 1``; ``(k_max, None)`` when ``k_max`` passes and ``(None, k_min)``
    when ``k_min`` fails (the grid's ends). From ``start``, ``coarse`` points at a
    time up while it passes (down while it fails); then, inside the bracket,
    the point where the line through the two measured margins nearest to it
    crosses 0 (a bisection instead where fewer than two are measured, where
    they do not rise with ``k``, or after two such steps in a row that did not
    halve the bracket).
    Every point is asked once at most; nothing assumes the verdict monotone.
    ``ValueError`` for an empty grid, a ``start`` outside it or ``coarse < 1``."""
    if not k_min <= start <= k_max or coarse < 1:
        raise ValueError(f"need k_min <= start <= k_max and coarse >= 1, got {k_min}, {start}, {k_max}, {coarse}")
    seen: dict[int, float] = {}

    def ok(k: int) -> bool:
        if k not in seen:
            seen[k] = float(margin(k))
        return seen[k] <= 0

    if ok(start):
        lo = start
        while True:
            nxt = min(lo + coarse, k_max)
            if nxt == lo:
                return lo, None
            if not ok(nxt):
                hi = nxt
                break
            lo = nxt
    else:
        hi = start
        while True:
            nxt = max(hi - coarse, k_min)
            if nxt == hi:
                return None, hi
            if ok(nxt):
                lo = nxt
                break
            hi = nxt
    slow = 0  # interpolation steps in a row that did not halve the bracket
    while hi - lo > 1:
        width = hi - lo
        k = _secant(seen, lo, hi) if slow < 2 else None
        k = (lo + hi) // 2 if k is None else k
        lo, hi = (k, hi) if ok(k) else (lo, k)
        slow = 0 if 2 * (hi - lo) <= width else slow + 1
    return lo, hi


def _secant(seen: dict[int, float], lo: int, hi: int) -> int | None:
    """The grid point inside ``(lo, hi)`` nearest to where the line through the two measured margins nearest the
    bracket (its ends if both are measured, else the two nearest on one side) crosses 0; ``None`` when no such
    line rises."""
    ends = [k for k in (lo, hi) if math.isfinite(seen[k])]
    near = sorted((k for k, m in seen.items() if math.isfinite(m)), key=lambda k: max(lo - k, k - hi))
    pts = ends if len(ends) == 2 else near[:2]
    if len(pts) < 2:
        return None
    a, b = sorted(pts)
    ma, mb = seen[a], seen[b]
    if a == b or mb <= ma:
        return None
    cross = a + (0.0 - ma) * (b - a) / (mb - ma)
    return int(min(max(round(cross), lo + 1), hi - 1))


def margin_of(slo: Slo, r: ReplayResult) -> float:
    """How far run ``r`` is from ``slo``: ``max(log(p99 TTFT / bound), log(p99 TPOT / bound))`` (<= 0: met;
    ``inf`` for a stopped run, which missed it by an unknown amount; a p99 with no request: no term)."""
    if r.stopped:
        return math.inf
    ttft, tpot = p99s(r)
    terms = [math.log(x / b) for x, b in ((ttft, slo.ttft_s), (tpot, slo.tpot_ms)) if math.isfinite(x) and x > 0]
    return max(terms, default=-math.inf)


@dataclass
class Goodput:
    """One mode's goodput under one SLO: the grid's boundary (:func:`search`), ``lo`` the
    highest point that met it (``None``: not even the lowest) and ``hi = lo + 1`` the
    point above, which did not (``None``: ``lo`` is the grid's top)."""

    slo: Slo
    lo: int | None
    hi: int | None

    @property
    def rate(self) -> float:
        """The goodput as a multiple of the trace's rate (0 when no grid point met the SLO)."""
        return rate(self.lo) if self.lo is not None else 0.0

    def text(self) -> str:
        """``1.414``, ``>= 256`` (the grid's top met it) or ``< 0.125`` (its bottom did not)."""
        if self.lo is None:
            return f"< {rate(self.hi):.3g}"
        return f">= {self.rate:.4g}" if self.hi is None else f"{self.rate:.4g}"


@dataclass
class Sweep:
    """One mode of one trace, KV dtype and host tier: every run the searches made (by grid
    point; from :func:`run_goodput`, without their per-step series) and the goodput under each SLO."""

    trace: str
    kv: str
    config: ReplayConfig
    runs: dict[int, ReplayResult] = field(default_factory=dict)
    goodputs: list[Goodput] = field(default_factory=list)


def p99s(r: ReplayResult) -> tuple[float, float]:
    """A finished run's ``(p99 TTFT in s, p99 TPOT in ms)`` (NaN where no request has one)."""
    q = lambda x: float(np.percentile(x, QUANTILE)) if x.size else float("nan")  # noqa: E731
    return q(r.ttft_ms) / 1e3, q(r.tpot_ms)


def sweep(trace, kv: str, cfg: ReplayConfig, slos: list[Slo], *, name: str = "trace", coarse: int = STEPS,
          k_min: int = K_MIN, k_max: int = K_MAX, progress: Callable[[str], None] | None = None) -> Sweep:
    """The goodput of mode ``kv`` on ``trace`` (a :class:`~cpkv.engine.mooncake.MooncakeTrace`)
    under each of ``slos`` (:func:`search` per SLO, the runs shared: a grid point runs once, stopped
    early only when it misses them all). ``progress`` hears one line per run."""
    if not slos:
        raise ValueError("goodput needs at least one SLO")
    out = Sweep(name, kv, cfg)
    watch = SloWatch(slos, np.array([s.max_new_tokens for s in trace.specs]))

    def run(k: int) -> ReplayResult:
        if k not in out.runs:
            r = replay(trace, kv, dataclasses.replace(cfg, rate=rate(k)), name=name, stop=watch)
            out.runs[k] = r
            if progress is not None:
                ttft, tpot = p99s(r)
                verdict = "stopped: misses every SLO" if r.stopped else f"p99 TTFT {ttft:.2f} s, TPOT {tpot:.1f} ms"
                progress(f"{name} / {kv} / {cfg.kv_dtype} / host {cfg.host_memory > 0}: {rate(k):.4g}x {verdict} "
                         f"({r.steps} steps, {r.cpu_s:.0f} s CPU)")
        return out.runs[k]

    for slo in slos:
        out.goodputs.append(Goodput(slo, *search(lambda k, slo=slo: margin_of(slo, run(k)), coarse=coarse,
                                                 k_min=k_min, k_max=k_max)))
    return out


def run_goodput(traces: list, kvs=KV_MODES, dtypes=("bfloat16", "fp8"), hosts=(0,), base: ReplayConfig | None = None,
                slos: list[Slo] | None = None, progress: bool = False, jobs: int = 1, **kw) -> list[Sweep]:
    """:func:`sweep` for every ``(name, MooncakeTrace)`` of ``traces``, KV dtype, host-tier bytes and mode,
    on ``base``'s group (its ``rate`` is the sweep's to set), ``jobs`` sweeps at a time (each in a process of
    its own when more than one; the results in the same order), each run's line on stderr with ``progress``.
    ``ValueError`` for ``jobs < 1``."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    base = base or ReplayConfig()
    slos = slos or [Slo(DEFAULT_TTFT_S, t) for t in DEFAULT_TPOT_MS]
    tasks = [(trace, kv, dataclasses.replace(base, kv_dtype=dtype, host_memory=host), slos, name, progress, kw)
             for name, trace in traces for dtype in dtypes for host in hosts for kv in kvs]
    if jobs == 1 or len(tasks) == 1:
        return [_sweep_task(t) for t in tasks]
    with sweep_pool(min(jobs, len(tasks))) as pool:
        return list(pool.map(_sweep_task, tasks))


def sweep_pool(workers: int):
    """The processes that run sweeps side by side (spawned; each ended by the kernel when the command's
    thread that started it ends, however it ends: :func:`cpkv.runtime.lifetime.end_with_parent`)."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from ..runtime.lifetime import end_with_parent

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=end_with_parent,
                               initargs=(os.getpid(),))


def _sweep_task(task: tuple) -> Sweep:
    """One sweep of :func:`run_goodput` (a process's unit of work), its runs slimmed (:func:`_slim`)."""
    import sys

    trace, kv, cfg, slos, name, progress, kw = task
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else None
    out = sweep(trace, kv, cfg, slos, name=name, progress=say, **kw)
    out.runs = {k: _slim(r) for k, r in out.runs.items()}
    return out


def _slim(r: ReplayResult) -> ReplayResult:
    """Run ``r`` without what a sweep's tables and plot do not read: its per-step series (the peak of resident
    tokens kept) and its per-request steps."""
    res = r.series["resident_tokens"]
    series = {"resident_tokens": res[res.argmax():][:1], "first_arrival_ms": r.series["first_arrival_ms"]}
    return dataclasses.replace(r, series=series, per_request=[])


def _where(s: Sweep) -> dict:
    return {"trace": s.trace, "kv dtype": s.config.kv_dtype, "host tier": s.config.host_memory > 0}


def point_rows(sweeps: list[Sweep]) -> list[dict]:
    """One row per run, in rate order per mode: its rate, its p99s (a stopped run: none), the SLOs
    it met, the device KV tokens, peak resident and prefix hit rate (of a stopped run: to its stop),
    and what it cost."""
    rows = []
    for s in sweeps:
        for k in sorted(s.runs):
            r = s.runs[k]
            ttft, tpot = p99s(r)
            met = [i for i, g in enumerate(s.goodputs) if not r.stopped and g.slo.met(ttft, tpot)]
            sm = r.summary()
            rows.append({**_where(s), "kv": sm["kv"], "rate": round(rate(k), 3),
                         "TTFT p99 s": "stopped" if r.stopped else round(ttft, 3),
                         "TPOT p99 ms": "stopped" if r.stopped else round(tpot, 3),
                         "SLOs met": ",".join(str(i + 1) for i in met) or "-",
                         "device KV tokens": r.capacity_tokens, "peak resident": r.peak_resident_tokens,
                         "hit device": round(sm["hit device"], 3), "hit host": round(sm["hit host"], 3),
                         "finished": r.finished, "steps": r.steps, "sim cpu s": round(r.cpu_s, 1)})
    return rows


def _pairs(sweeps: list[Sweep]):
    """``(shared, replicated)`` sweeps of the same trace, KV dtype and host tier."""
    groups: dict[tuple, dict] = {}
    for s in sweeps:
        groups.setdefault(tuple(_where(s).values()), {})[s.kv] = s
    return [(g["shared"], g["replicated"]) for g in groups.values() if set(g) == set(KV_MODES)]


def compare(a: Goodput, b: Goodput, goal: float) -> tuple[str, str]:
    """``(shared / replicated, verdict against goal)`` of two goodputs under one SLO: ``n/a`` where both
    are at the same end of the grid (neither rate is known then)."""
    if a.lo is None and b.lo is None:
        return "n/a", "n/a: neither meets it at the grid's bottom"
    if a.hi is None and b.hi is None:
        return "n/a", "n/a: both meet it at the grid's top"
    ratio = a.rate / b.rate if b.rate else math.inf
    bound = " (at least)" if a.hi is None or b.lo is None else " (at most)" if a.lo is None or b.hi is None else ""
    return f"{ratio:.3f}{bound}", "met" if ratio >= goal else "not met"


def goodput_rows(sweeps: list[Sweep]) -> list[dict]:
    """Shared against replicated at the same memory, per trace, KV dtype, host tier and SLO: each
    mode's goodput (the rate found and the one a step above, which missed), their ratio and the goal
    (the first SLO, the default: shared at least 1.5x; every other SLO of the sweep: at least 1.0x)."""
    rows = []
    for sh, rp in _pairs(sweeps):
        for i, (a, b) in enumerate(zip(sh.goodputs, rp.goodputs)):
            goal = 1.5 if i == 0 else 1.0
            ratio, verdict = compare(a, b, goal)
            above = lambda x: f"{rate(x.hi):.4g}" if x.hi is not None else "-"  # noqa: E731
            rows.append({**_where(sh), "SLO": f"{i + 1}: {a.slo.label()}", "goodput shared": a.text(),
                         "replicated": b.text(), "a step above (missed)": f"{above(a)} / {above(b)}",
                         "shared / replicated": ratio, "goal": f">= {goal:g}", "met": verdict})
    return rows


def capacity_rows(sweeps: list[Sweep]) -> list[dict]:
    """The capacity goals (:func:`~cpkv.tools.replay_report.capacity_goals`) of the runs at the trace's
    own rate (1x, where every search starts), per trace, KV dtype and host tier."""
    from .replay_report import capacity_goals

    rows = []
    for sh, rp in _pairs(sweeps):
        s, p = sh.runs.get(0), rp.runs.get(0)
        if s is not None and p is not None:
            rows.append({**_where(sh), **capacity_goals(s, p),
                         "1x run": "stopped early" if s.stopped or p.stopped else "whole trace"})
    return rows


def plot_goodput(sweeps: list[Sweep], path: str) -> list[str]:
    """p99 TTFT and p99 TPOT against the rate multiple, one file per trace: ``path`` itself for one trace,
    else ``STEM-TRACE.SUFFIX`` beside it; a row per KV dtype and host tier, a line per mode over the runs that
    ended (a stopped run: a cross on the top edge), the SLO bounds dashed and each mode's goodput
    under the first SLO dotted. Returns the paths written."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    p = Path(path)
    out = []
    traces = list(dict.fromkeys(s.trace for s in sweeps))
    for trace in traces:
        mine = [s for s in sweeps if s.trace == trace]
        panels = list(dict.fromkeys((s.config.kv_dtype, s.config.host_memory > 0) for s in mine))
        fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.0 * len(panels)), squeeze=False)
        for s in mine:
            row = axes[panels.index((s.config.kv_dtype, s.config.host_memory > 0))]
            ks = sorted(s.runs)
            done = [k for k in ks if not s.runs[k].stopped]
            vals = np.array([p99s(s.runs[k]) for k in done]).reshape(-1, 2)
            color = "tab:blue" if s.kv == "shared" else "tab:orange"
            for col, ax in enumerate(row):
                ax.plot([rate(k) for k in done], vals[:, col], "o-", color=color, markersize=3, linewidth=1.0,
                        label=s.kv)
                stopped = [rate(k) for k in ks if s.runs[k].stopped]
                if stopped:
                    ax.plot(stopped, [1.0] * len(stopped), "x", color=color, transform=ax.get_xaxis_transform(),
                            clip_on=False, label=f"{s.kv}: stopped, misses every SLO")
                g = s.goodputs[0]
                if g.lo is not None:
                    ax.axvline(g.rate, color=color, linestyle=":", linewidth=0.8)
        dtype_host = lambda d, h: f"{d}, {'with' if h else 'no'} host tier"  # noqa: E731
        slos = mine[0].goodputs
        for (d, h), row in zip(panels, axes):
            row[0].axhline(slos[0].slo.ttft_s, color="grey", linestyle="--", linewidth=0.8)
            for g in slos:
                row[1].axhline(g.slo.tpot_ms, color="grey", linestyle="--", linewidth=0.8)
            for ax, what in zip(row, ("p99 TTFT (s)", "p99 TPOT (ms)")):
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
                ax.set_ylim(bottom=0)
                ax.set_xlabel("arrival rate (x the trace's)")
                ax.set_ylabel(what)
                ax.set_title(f"{trace}: {dtype_host(d, h)}", fontsize=9)
                ax.legend(fontsize=6)
        fig.tight_layout()
        f = str(p if len(traces) == 1 else p.with_name(f"{p.stem}-{trace}{p.suffix}"))
        fig.savefig(f, dpi=110)
        plt.close(fig)
        out.append(f)
    return out


def slos_of(args) -> list[Slo]:
    """``cpkv simulate --goodput``'s SLOs from ``--slo-ttft`` and ``--slo-tpot`` (their defaults where not given)."""
    ttft = args.slo_ttft if args.slo_ttft is not None else DEFAULT_TTFT_S
    return [Slo(ttft, t) for t in (args.slo_tpot or DEFAULT_TPOT_MS)]


def cmd_goodput(args) -> int:
    """``cpkv simulate --goodput``: every trace, KV dtype, host tier and mode asked for swept
    (:func:`run_goodput`), one line per run on stderr (unless ``--no-progress``), then the runs, the
    goodputs against the goal (or ``--json``) and the plots."""
    import json

    from .replay_report import HOST_MEMORY, load_traces, replay_base
    from .table import format_rows

    hw, base = replay_base(args)
    base = dataclasses.replace(base, decode_split=(args.decode_split or ["auto"])[0])
    traces = args.mooncake_traces if getattr(args, "mooncake_traces", None) else load_traces(args)
    hosts = args.host_memory if args.host_memory is not None else [0, HOST_MEMORY]
    slos = slos_of(args)
    sweeps = run_goodput(traces, kvs=args.kv or KV_MODES, dtypes=args.kv_dtype or ("bfloat16", "fp8"), hosts=hosts,
                         base=base, slos=slos, progress=not (args.no_progress or args.json), jobs=args.jobs or 1)
    runs, goodputs = point_rows(sweeps), goodput_rows(sweeps)
    if args.json:
        print(json.dumps({"slos": [dataclasses.asdict(s) for s in slos], "runs": runs, "goodput": goodputs,
                          "capacity": capacity_rows(sweeps)}, indent=2, default=float))
    else:
        names = "; ".join(f"{i + 1}: {s.label()}" for i, s in enumerate(slos))
        print(format_rows(runs, f"Goodput on a modelled {hw.name} group (DeepSeek-V3.2, cpkv.engine.cost_model): "
                                f"CP {base.cp_size}, page {base.page_size}, {base.kv_memory:,} bytes of device KV per "
                                f"rank in both modes, chunk {base.chunk}, max running {base.max_running}, decode "
                                f"split {base.decode_split}; arrivals at 2^(k/{STEPS}) times the trace's rate; SLOs "
                                f"(p99 over the finished requests) {names}; a run sure to miss every SLO is stopped"))
        if goodputs:
            print()
            print(format_rows(goodputs, "goodput: the highest rate multiple meeting each SLO (the step above missed "
                                        "it), shared against replicated at the same memory per rank"))
            print()
            print(format_rows(capacity_rows(sweeps), "capacity and prefix hits at the trace's own rate (the 1x runs)"))
        cpu = sum(r.cpu_s for s in sweeps for r in s.runs.values())
        print(f"\n{sum(len(s.runs) for s in sweeps)} runs, {cpu:.0f} s of CPU")
    if args.plot:
        for f in plot_goodput(sweeps, args.plot):
            print(f"plot: {f}")
    return 0
