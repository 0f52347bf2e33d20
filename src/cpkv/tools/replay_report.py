"""``cpkv simulate --workload mooncake:PATH``: the runs, their tables, the goals and the plots.

:func:`run_replays` replays each trace in every mode asked for
(:func:`cpkv.tools.replay.replay`); :func:`replay_rows` and
:func:`markdown_table` print them (the README's table is
:func:`markdown_table`'s output); :func:`goal_rows` judges the shared group
against the replicated one at the same memory; :func:`equal_batch_rows` gives
the cost model's decode step of each mode at equal batch; :func:`plot_replays`
draws the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .replay import ReplayConfig, ReplayResult, replay
from .report import save_figure

__all__ = ["capacity_goals", "cmd_replay", "equal_batch_rows", "goal_rows", "markdown_table", "plot_replays", "replay_rows",
           "run_replays"]

#: Half of a DGX H200's 2 TB of system memory: the host tier of the default runs.
HOST_MEMORY = 2**40


def run_replays(traces: list, kvs=("shared", "replicated"), dtypes=("bfloat16", "fp8"), hosts=(0, HOST_MEMORY),
                splits=("owner",), base: ReplayConfig | None = None, progress: bool = False) -> list[ReplayResult]:
    """Every ``(name, MooncakeTrace)`` of ``traces`` in every combination of
    KV dtype, host-tier bytes, mode and (shared) decode split, on ``base``'s group."""
    import dataclasses

    base = base or ReplayConfig()
    out = []
    for name, trace in traces:
        for dtype in dtypes:
            for host in hosts:
                for kv in kvs:
                    for split in (splits if kv == "shared" else splits[:1]):
                        cfg = dataclasses.replace(base, kv_dtype=dtype, host_memory=host, decode_split=split)
                        out.append(replay(trace, kv, cfg, name=name, progress=progress))
    return out


def replay_rows(results: list[ReplayResult]) -> list[dict]:
    """One row of figures per run (:meth:`ReplayResult.summary`), rounded for print."""
    rows = []
    for r in results:
        row = r.summary()
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def _key(r: ReplayResult) -> tuple:
    return r.trace, r.config.kv_dtype, r.config.host_memory


def goal_rows(results: list[ReplayResult]) -> list[dict]:
    """The shared group against the replicated one at the same memory, per
    trace, dtype and host tier (the first shared split of each): device KV
    tokens (goal >= 0.95 N x), the prefix hit rate where the replicated group
    evicts (goal: replicated no higher) and modelled throughput (goal >= 1.5x)."""
    groups: dict[tuple, dict] = {}
    for r in results:
        groups.setdefault(_key(r), {}).setdefault(r.kv, r)
    rows = []
    for (trace, dtype, host), g in groups.items():
        if "shared" not in g or "replicated" not in g:
            continue
        s, p = g["shared"], g["replicated"]
        ts, tp = s.summary()["tokens/s"], p.summary()["tokens/s"]
        rows.append({"trace": trace, "kv dtype": dtype, "host tier": host > 0, **capacity_goals(s, p),
                     "throughput shared / replicated": round(ts / max(tp, 1e-9), 3),
                     "goal >= 1.5": "met" if ts >= 1.5 * tp else "not met"})
    return rows


def capacity_goals(s: ReplayResult, p: ReplayResult) -> dict:
    """The shared run ``s`` against the replicated run ``p`` (the same trace and memory): device KV tokens (goal
    >= 0.95 N x) and the prefix hit rate, device and host together, where the replicated group evicts (goal:
    replicated no higher)."""
    N = s.config.cp_size
    cap = s.capacity_tokens / p.capacity_tokens
    hs, hp = ((x.hit_tokens + x.host_hit_tokens) / max(x.prompt_tokens, 1) for x in (s, p))
    return {"KV tokens shared / replicated": round(cap, 3),
            f"goal >= {0.95 * N:g}": "met" if cap >= 0.95 * N else "not met",
            "replicated evicts": p.evicted_pages > 0,
            "hit rate shared / replicated": f"{hs:.3f} / {hp:.3f}",
            "goal: replicated no higher": ("met" if hp <= hs else "not met") if p.evicted_pages else "n/a"}


def equal_batch_rows(cfg: ReplayConfig, context: int, batches=(1, 8, 32, 64, 128, 256)) -> list[dict]:
    """The cost model's decode step (ms) of every mode at the same batch of
    requests of ``context`` tokens each: TPOT judged at equal batch."""
    import dataclasses

    rows = []
    models = {"replicated": cfg.cost_model("replicated"),
              **{f"shared ({s})": dataclasses.replace(cfg, decode_split=s).cost_model("shared")
                 for s in ("owner", "lse", "auto")}}
    for b in batches:
        e = np.full(b, context)
        steps = {name: m.step(e - 1, e, decode_only=True).total * 1e3 for name, m in models.items()}
        rows.append({"batch": b, "context": context, **{f"{k} ms": round(v, 3) for k, v in steps.items()},
                     **{f"{k} / replicated": round(v / steps["replicated"], 3) for k, v in steps.items()
                        if k != "replicated"}})
    return rows


#: The README table's columns: ``(header, summary key or a function of the summary)``.
MARKDOWN_COLUMNS = (
    ("trace", "trace"), ("KV", "kv dtype"), ("host tier", lambda s: "yes" if s["host tier"] else "no"),
    ("mode", "kv"), ("device KV tokens", "device KV tokens"), ("peak resident", "peak resident"),
    ("longest request", "longest request"),
    ("hit rate device / host", lambda s: f"{s['hit device']:.3f} / {s['hit host']:.3f}"),
    ("evicted tokens", "evicted tokens"), ("preemptions", "preemptions"), ("refused", "refused"),
    ("TTFT p50 / p99 (s)", lambda s: f"{s['TTFT p50 s']:.2f} / {s['TTFT p99 s']:.2f}"),
    ("TPOT p50 / p99 (ms)", lambda s: f"{s['TPOT p50 ms']:.1f} / {s['TPOT p99 ms']:.1f}"),
    ("tokens/s", lambda s: f"{s['tokens/s']:.0f}"),
    ("max wait / behind (s)", lambda s: f"{s['max wait s']:.1f} / {s['behind s']:.1f}"),
    ("sim wall / cpu (s)", lambda s: f"{s['sim s']:.0f} / {s['sim cpu s']:.0f}"),
)


def markdown_table(results: list[ReplayResult]) -> str:
    """The runs as one markdown table (the README's), one row per run."""
    head = [h for h, _ in MARKDOWN_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in results:
        s = r.summary()
        cells = [f(s) if callable(f) else (f"{s[f]:,}" if isinstance(s[f], int) and not isinstance(s[f], bool)
                                           else str(s[f])) for _, f in MARKDOWN_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cdf(ax, x, label):
    x = np.sort(np.asarray(x, dtype=np.float64))
    x = x[np.isfinite(x)]
    if x.size:
        ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label, linewidth=1.0)


def plot_replays(results: list[ReplayResult], path: str) -> list[str]:
    """Four figures beside ``path`` (``NAME-resident.png``, ``-hits``,
    ``-ttft``, ``-tpot``, the suffix of ``path``): resident tokens against
    capacity over time, the prefix hit rate over time (device and host, over
    a window of a sixtieth of the run), TTFT and TPOT CDFs; one line per run.
    Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    label = lambda r: f"{r.trace} {r.summary()['kv']} {r.config.kv_dtype}" + (" +host" if r.host_tokens else "")  # noqa: E731
    out = []
    figs = {name: plt.subplots(figsize=(7.5, 4.2)) for name in ("resident", "hits", "ttft", "tpot")}
    for r in results:
        t = r.series["time_ms"] / 1e3
        ax = figs["resident"][1]
        line, = ax.plot(t, r.series["resident_tokens"], linewidth=0.8, label=label(r))
        ax.axhline(r.capacity_tokens, color=line.get_color(), linestyle=":", linewidth=0.8)
        if t.size > 1:  # hit rate over a sliding window of steps
            w = max(t.size // 60, 1)
            d = lambda k: r.series[k][w:] - r.series[k][:-w]  # noqa: E731
            prompt = np.maximum(d("prompt_tokens"), 1)
            h = figs["hits"][1]
            h.plot(t[w:], d("hit_tokens") / prompt, linewidth=0.8, label=f"{label(r)} device")
            if r.host_tokens:
                h.plot(t[w:], d("host_hit_tokens") / prompt, linewidth=0.8, linestyle="--", label=f"{label(r)} host")
        _cdf(figs["ttft"][1], r.ttft_ms / 1e3, label(r))
        _cdf(figs["tpot"][1], r.tpot_ms, label(r))
    titles = {"resident": ("time (s)", "device KV tokens resident (dotted: capacity)"),
              "hits": ("time (s)", "prefix hit rate (window)"), "ttft": ("TTFT (s)", "fraction of requests"),
              "tpot": ("TPOT (ms)", "fraction of requests")}
    for name, (fig, ax) in figs.items():
        ax.set_xlabel(titles[name][0])
        ax.set_ylabel(titles[name][1])
        if name in ("ttft", "tpot"):
            ax.set_xscale("log")
        ax.legend(fontsize=6)
        fig.tight_layout()
        f = str(p.with_name(f"{p.stem}-{name}{p.suffix}"))
        save_figure(fig, f)
        out.append(f)
    return out


def replay_base(args):
    """``cpkv simulate``'s ``(Hardware, ReplayConfig)`` for Mooncake traces from its flags (every mode, dtype and
    host tier varies from this one); ``ValueError`` for a configuration :class:`ReplayConfig` refuses."""
    from ..engine.cost_model import H200

    hw = H200.with_results(args.gpu_results) if args.gpu_results else H200
    return hw, ReplayConfig(cp_size=args.cp, page_size=args.page, kv_memory=args.kv_memory, hw=hw,
                            chunk=args.chunk or 8192, max_running=args.max_running or 256, admission=args.admission,
                            rate=args.rate or 1.0, wait_for_prefix=not args.no_prefix_wait, eviction=args.eviction)


def load_traces(args) -> list:
    """``[(name, MooncakeTrace)]``: every ``--workload`` of ``cpkv simulate`` read, sliced and scaled by its flags
    (lazy prompts); :class:`~cpkv.engine.trace.TraceError` for a malformed line."""
    from ..engine.mooncake import load_mooncake

    return [(Path(w.removeprefix("mooncake:")).stem,
             load_mooncake(w, block=args.block_tokens, requests=args.requests, window_ms=args.window,
                           max_output=args.max_output, lazy=True)) for w in args.workload]


def cmd_replay(args) -> int:
    """``cpkv simulate`` with Mooncake traces: every trace in every mode asked for, the table (or
    ``--markdown``, ``--json``), the goals, the cost model's decode step at equal batch, the plots."""
    import dataclasses

    from ..engine.cost_model import kv_memory_per_rank
    from .table import format_rows

    hw, base = replay_base(args)
    traces = args.mooncake_traces if getattr(args, "mooncake_traces", None) else load_traces(args)
    hosts = args.host_memory if args.host_memory is not None else [0, HOST_MEMORY]
    results = run_replays(traces, kvs=args.kv or ("shared", "replicated"), dtypes=args.kv_dtype or ("bfloat16", "fp8"),
                          hosts=hosts, splits=args.decode_split or ("auto",), base=base,
                          progress=not (args.no_progress or args.json or args.markdown))
    rows, goals = replay_rows(results), goal_rows(results)
    mean_in = int(np.mean([len(s.tokens) for _, t in traces for s in t.specs]))
    batch = equal_batch_rows(dataclasses.replace(base, kv_dtype=(args.kv_dtype or ["bfloat16"])[0]), mean_in)
    if args.json:
        print(json.dumps({"runs": rows, "goals": goals, "equal_batch": batch}, indent=2, default=float))
    elif args.markdown:
        print(markdown_table(results))
    else:
        default = "" if args.kv_memory else " (an H200's KV beside a DeepSeek-V3.2 shard)"
        print(format_rows(rows, f"Mooncake replay: CP {args.cp}, page {args.page}, {base.kv_memory:,} bytes of device KV "
                                f"per rank{default}, chunk {base.chunk}, max running {base.max_running}, arrivals at "
                                f"{base.rate:g}x the trace's rate; "
                                f"DeepSeek-V3.2 on {hw.name}; times modelled (cpkv.engine.cost_model)"))
        if goals:
            print()
            print(format_rows(goals, "shared against replicated at the same memory per rank"))
        print()
        print(format_rows(batch, f"decode step at equal batch, the cost model, {mean_in}-token contexts (the traces' "
                                 f"mean input), {batch and (args.kv_dtype or ['bfloat16'])[0]}"))
        if not args.kv_memory:
            print(f"\ndevice KV per rank: {kv_memory_per_rank(hw, cp_size=args.cp):,} bytes = HBM {hw.hbm_bytes:,.0f} "
                  f"x {hw.mem_fraction} - the FP8 checkpoint / {args.cp}")
    if args.plot:
        for f in plot_replays(results, args.plot):
            print(f"plot: {f}")
    return 0
