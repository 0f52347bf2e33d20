"""``cpkv bench capacity``: the shared cache against the replicated one, at equal memory per rank.

Both modes run in the same engine, the ranks as processes (one per rank on
POSIX shared memory, as a deployment runs them; ``ranks="threads"``: threads
of this process, quicker to start, but the ranks' Python then runs one at a
time) with the same ``kv_memory`` bytes per rank (:func:`~cpkv.runtime.sizing.pages_for_memory`);
with ``check``, every figure comes from a run that passed it (every logit against
``transformers`` within ``tolerance``, every request its greedy tokens). Without
it no run computes ``transformers``' reference forward, which took most of the
time a Mooncake slice spent outside the engine (the longest request's reference
alone holds a ``T x T`` attention matrix per head):

* the longest single request each mode holds: the scheduler's up-front
  refusal (the allocator's lanes, ``TraceError``) marks the limit, found by
  binary search on the prompt length; a request of that length then runs to
  the end. Goal: shared at least ``0.95 x N x`` replicated;
* a long-context trace (``longdoc``: long documents with follow-up questions)
  sized so that the replicated group must evict or preempt, or ``base``'s
  own Mooncake trace (``workload`` a Mooncake slice, :mod:`cpkv.engine.mooncake`): requests
  finished, generated tokens per second, TTFT and TPOT p50/p99 (steps and
  milliseconds), preemptions, evicted pages, prefix hit rate.

Each row gives both figures and their ratio (shared / replicated). The trace
runs ``rounds`` times per mode, the modes interleaved (shared first in even
rounds, replicated first in odd ones), so that a slow stretch of a loaded
machine falls on both. The scheduler's figures (requests, steps, pages, hits)
are the same in every round (the same trace gives the same schedule; a round
that differs is refused); a figure in time (tokens per second, TTFT and TPOT
in ms) is the median over the rounds, and its ratio the median of the
ratios measured in the same round, not the ratio of the two medians.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

from ...engine.config import EngineConfig
from ...engine.mooncake import mooncake_path
from ...engine.trace import CacheTooSmall, RequestSpec, TraceError, dump_jsonl

MODES = ("shared", "replicated")
#: How the ranks of a run are started: processes (:func:`~cpkv.engine.engine.run_engine`) or threads
#: of this process (:func:`~cpkv.engine.engine.run_engine_threads`).
RANKS = ("processes", "threads")


class CheckFailed(RuntimeError):
    """A run of the benchmark did not match ``transformers``: no figure of it is reported."""


def _checked(r: dict, tolerance: float) -> dict:
    """``r``, or :class:`CheckFailed` when its check (if it ran one) failed."""
    from ...engine.exactness import failures

    if r["check"] is None:
        return r
    why = failures(r["check"], tolerance)
    if why:
        raise CheckFailed(f"{r['config']['kv']} run failed its check: {'; '.join(why)}")
    return r


def fits(cfg: EngineConfig, prompt: int, new_tokens: int) -> bool:
    """Whether the scheduler of ``cfg`` takes one request of ``prompt`` tokens
    and ``new_tokens`` generated ones (it refuses up front one its cache could
    never hold)."""
    from ...engine.engine import build_scheduler

    try:
        build_scheduler(cfg, [RequestSpec("long", 0, (1,) * prompt, new_tokens)])
    except TraceError:
        return False
    return True


def longest_prompt(cfg: EngineConfig, new_tokens: int) -> int:
    """The longest prompt :func:`fits` takes (0 for none): binary search
    between 0 and the group's whole cache."""
    lo, hi = 0, cfg.page_size * cfg.device_pages * cfg.cp_size + 1  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(cfg, mid, new_tokens) else (lo, mid)
    return lo


def _run_specs(cfg: EngineConfig, specs: list[RequestSpec], ranks: str = "processes") -> dict:
    """One engine run of ``specs`` on ``cfg``, its ranks started as ``ranks`` (:data:`RANKS`)."""
    from ...engine.engine import run_engine, run_engine_threads

    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    try:
        dump_jsonl(specs, path)
        run = run_engine if ranks == "processes" else run_engine_threads
        return run(dataclasses.replace(cfg, workload=path))
    finally:
        os.unlink(path)


#: The figures of a trace run that are the scheduler's (equal in every round of one configuration).
SCHEDULE_FIGURES = ("requests", "finished", "steps", "preemptions", "evicted_pages", "device_hit_rate")
#: The figures of a trace run in time, ``(report path, scale)``: the median over the rounds is reported.
#: ``{kind}_step_s_p50``: the median step of a kind (:data:`~cpkv.engine.latency.STEP_KINDS`), in ms.
TIMED_FIGURES = {"tokens_per_second": (("tokens_per_second",), 1.0),
                 **{f"{k}_s_{q}": (("latency", f"{k}_s", q), 1e3) for k in ("ttft", "tpot") for q in ("p50", "p99")},
                 **{f"{k}_step_s_p50": (("latency", "step_s", k, "p50"), 1e3) for k in ("decode", "mixed", "prefill")}}


def measure_capacity(base: EngineConfig, *, new_tokens: int = 4, trace_scale: float = 0.012, documents: int = 6,
                     tolerance: float = 1e-4, rounds: int = 5, ranks: str = "processes", check: bool = False) -> dict:
    """Both modes of ``base`` (its ``kv_memory``, ``cp_size``, model, pages):
    ``{mode: {"longest": tokens, "longest_run": report, "trace": report,
    "traces": [report per round]}}`` (``trace`` is the first round's), the
    trace run ``rounds`` times per mode, the modes interleaved, every run's
    ranks started as ``ranks`` (:data:`RANKS`), every run checked against
    ``transformers`` with ``check`` (each report's ``check``; ``None`` without).
    Raises :class:`CheckFailed` when a checked run does not match ``transformers``,
    ``ValueError`` when ``base`` has no ``kv_memory``, ``rounds < 1`` or
    ``ranks`` is unknown, or a request of the trace could never fit either
    mode's cache (before any run, naming the memory to give),
    ``RuntimeError`` when two rounds of one mode scheduled differently."""
    if base.kv_memory is None:
        raise ValueError("the capacity benchmark compares the modes at equal memory: give kv_memory")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if ranks not in RANKS:
        raise ValueError(f"unknown ranks {ranks!r}; choose from {RANKS}")
    base = base.sized()  # at launch: kv_memory's pages, the same in both modes
    out, cfgs = {}, {mode: dataclasses.replace(base, kv=mode, check=check, host_pages=0) for mode in MODES}
    specs = base.trace() if mooncake_path(base.workload) else _trace(base, documents, trace_scale)
    for mode in MODES:  # before any rank starts
        _refuse_unless_trace_fits(cfgs[mode], specs)
    rng = np.random.default_rng(base.seed)
    for mode in MODES:
        cfg = cfgs[mode]
        n = longest_prompt(cfg, new_tokens)
        if n < 1:
            raise ValueError(f"{base.kv_memory} bytes per rank hold no request in the {mode} cache")
        tokens = tuple(rng.integers(0, cfg.model.vocab, n).tolist())
        run = _checked(_run_specs(cfg, [RequestSpec("long", 0, tokens, new_tokens)], ranks), tolerance)
        out[mode] = {"longest": n + new_tokens - 1, "longest_run": run, "traces": []}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            out[mode]["traces"].append(_checked(_run_specs(cfgs[mode], specs, ranks), tolerance))
    for mode in MODES:
        _same_schedule(mode, out[mode]["traces"])
        out[mode]["trace"] = out[mode]["traces"][0]
    return out


def _refuse_unless_trace_fits(cfg: EngineConfig, specs: list[RequestSpec]) -> None:
    """Raise ``ValueError`` (one short line, the memory to give) when a
    request of the trace could never fit ``cfg``'s cache: the scheduler's own
    up-front refusal (:class:`~cpkv.engine.trace.CacheTooSmall`), before any rank starts."""
    from ...engine.engine import build_scheduler
    from ...runtime.sizing import format_size

    try:
        build_scheduler(cfg, specs)
    except CacheTooSmall as e:
        need = e.pages_per_rank_needed * cfg.page_bytes()
        raise ValueError(f"{format_size(cfg.kv_memory)} per rank: the {cfg.kv} cache can never hold "
                         f"{len(e.requests)} of the trace's {len(specs)} requests (the longest needs "
                         f"{e.pages_per_rank_needed} pages per rank); give --kv-memory {format_size(need)} or more")


def _same_schedule(mode: str, traces: list[dict]) -> None:
    """Refuse rounds of one mode whose schedules differ (the same trace must give the same steps)."""
    def key(t):
        return ({k: t[k] for k in SCHEDULE_FIGURES},
                [{k: v for k, v in r.items() if not k.endswith("_s")} for r in t["latency"]["requests"]])

    first = key(traces[0])
    for i, t in enumerate(traces[1:], 1):
        if key(t) != first:
            raise RuntimeError(f"{mode}: round {i} scheduled differently from round 0: {key(t)[0]} vs {first[0]}")


def timed(shared: list[dict], replicated: list[dict], name: str) -> tuple[float, float, float]:
    """Figure ``name`` of :data:`TIMED_FIGURES` over the rounds (``shared[i]``
    and ``replicated[i]`` ran in round ``i``): the median of each mode and the
    median of the same-round ratios (``inf`` where a replicated figure is 0
    and the shared one is not, 1 where both are 0). ``ValueError`` for an
    unknown name or rounds of different counts."""
    if name not in TIMED_FIGURES:
        raise ValueError(f"unknown timed figure {name!r}; choose from {sorted(TIMED_FIGURES)}")
    if len(shared) != len(replicated) or not shared:
        raise ValueError(f"need the same number of rounds of both modes (>= 1), got {len(shared)} and "
                         f"{len(replicated)}")
    path, scale = TIMED_FIGURES[name]

    def values(traces):
        out = []
        for t in traces:
            for k in path:
                t = t[k]
            out.append((t or 0.0) * scale)
        return np.asarray(out, dtype=np.float64)

    s, r = values(shared), values(replicated)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(r > 0, s / np.where(r > 0, r, 1.0), np.where(s > 0, np.inf, 1.0))
    return float(np.median(s)), float(np.median(r)), float(np.median(ratio))


def _trace(base: EngineConfig, documents: int, scale: float, replies: tuple[int, int] = (8, 24)) -> list[RequestSpec]:
    """``longdoc`` at ``scale``, each reply ``replies`` tokens long (drawn
    seeded; ``longdoc``'s own replies shrink with ``scale`` to a token)."""
    from ...engine.trace import longdoc

    rng = np.random.default_rng(base.seed + 1)
    specs = longdoc(documents, seed=base.seed, vocab=base.model.vocab, scale=scale)
    lens = rng.integers(replies[0], replies[1] + 1, len(specs)).tolist()
    return [dataclasses.replace(x, max_new_tokens=n) for x, n in zip(specs, lens)]


def capacity_rows(m: dict) -> list[dict]:
    """The benchmark's table: one row per figure, both modes and shared /
    replicated; a figure in time is the median over the rounds and its ratio
    the median of the same-round ratios (:func:`timed`)."""
    s, r = m["shared"], m["replicated"]
    traces = s.get("traces", [s["trace"]]), r.get("traces", [r["trace"]])
    n = len(traces[0])
    lat = lambda x, k, q: x["trace"]["latency"][k][q] or 0.0  # noqa: E731
    figures = [
        ("longest request (KV tokens), ran to the end", s["longest"], r["longest"], None, "higher"),
        ("trace: requests finished", s["trace"]["finished"], r["trace"]["finished"], None, "higher"),
        (f"trace: generated tokens per second (median of {n})", *timed(*traces, "tokens_per_second"), "higher"),
    ]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        for q in ("p50", "p99"):
            figures.append((f"trace: {name} {q} (steps)", lat(s, f"{key}_steps", q), lat(r, f"{key}_steps", q),
                            None, "lower"))
            figures.append((f"trace: {name} {q} (ms, median of {n})", *timed(*traces, f"{key}_s_{q}"), "lower"))
    for kind, label in (("decode", "decode-only step"), ("mixed", "step of decodes and a prefill chunk")):
        sv, rv, ratio = timed(*traces, f"{kind}_step_s_p50")  # where the TPOT milliseconds come from
        figures.append((f"trace: {label}, p50 (ms, median of {n})", sv, rv, ratio if sv and rv else "-", "lower"))
    figures += [
        ("trace: preemptions", s["trace"]["preemptions"], r["trace"]["preemptions"], None, "lower"),
        ("trace: evicted pages", s["trace"]["evicted_pages"], r["trace"]["evicted_pages"], None, "lower"),
        ("trace: prefix hit rate", s["trace"]["device_hit_rate"], r["trace"]["device_hit_rate"], None, "higher"),
    ]
    return [{"figure": name, "shared": _fmt(a), "replicated": _fmt(b), "shared / replicated": _ratio(a, b, ratio),
             "better": better} for name, a, b, ratio, better in figures]


def _ratio(a, b, ratio: float | str | None) -> str:
    if ratio is None:  # a figure of the schedule: one ratio
        return f"{a / b:.2f}" if b else ("=" if a == b else "inf")
    return ratio if isinstance(ratio, str) else f"{ratio:.2f}"  # "-": a step kind one mode never ran


def _fmt(x) -> str:
    return str(x) if isinstance(x, (int, np.integer)) else f"{x:.3f}"


def bench_capacity(base: EngineConfig, **kw) -> tuple[list[dict], dict]:
    """The table rows and the raw figures of :func:`measure_capacity`."""
    m = measure_capacity(base, **kw)
    return capacity_rows(m), m
