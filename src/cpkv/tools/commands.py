"""The work of each ``cpkv`` subcommand: ``cmd_<name>(args) -> exit code``, and the
cross-flag checks ``validate_<name>(args, parser)`` that run after parsing, before any
work (they call ``parser.error``). The parser itself is :mod:`cpkv.tools.cli`.
"""

from __future__ import annotations

import json
import sys

from .flags import refuse_unless_fits

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def cmd_simulate(args) -> int:
    """``cpkv simulate``: each workload through the scheduler without a model, policies side by side."""
    from .table import format_rows
    from .simulate import SIM_WORKLOADS as WORKLOADS, compare, plot

    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    results, tables = [], []
    for name in names:
        w = WORKLOADS[name](seed=args.seed)
        runs = compare(w, policies=args.policies, cp_size=args.cp, page_size=args.page,
                       lane_pages=args.lane_pages, admission=args.admission,
                       progress=not args.no_progress and not args.json)
        results += runs
        rows = [r.summary() for r in runs]
        ref = next((r for r in rows if r["policy"] == "oblivious"), None)
        for r in rows:
            if ref is not None:
                r["admitted vs oblivious"] = round(r["tokens before 1st refusal"] / max(ref["tokens before 1st refusal"], 1), 3)
        tables.append((name, w, rows))
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps([row for _, _, rows in tables for row in rows], indent=2))
        return EXIT_OK
    for name, w, rows in tables:
        print(format_rows(rows, f"{name}: {len(w.requests)} requests, seed {args.seed}, N={args.cp}, page {args.page}, "
                                f"{args.lane_pages or w.lane_pages} pages per lane, admission {args.admission}"))
        print()
    if args.plot:
        print(f"lane occupancy plot: {args.plot}")
    return EXIT_OK


def validate_simulate(args, parser) -> None:
    """``--plot`` needs matplotlib."""
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install 'cpkv[plot]'")


def cmd_bench(args) -> int:
    """``cpkv bench``: one table per benchmark asked for (``all``: alloc, kv and engine)."""
    from .bench import bench_alloc, bench_engine, bench_kv
    from .table import format_rows

    tables = {
        "alloc": (bench_alloc, 101, "alloc: a pool of 32768 pages of 64 tokens, cp 8; median of {n} interleaved "
                  "rounds; per-block = a deque of page ids per lane in plain Python; floor = torch.arange of the "
                  "same length"),
        "kv": (bench_kv, 21, "kv: one layer, 64K tokens, page 64, N 4, 2 KV heads x 128, bf16; median of {n} "
               "interleaved rounds; plain = index_copy_/index_select on an unshared buffer of the same size"),
        "engine": (bench_engine, 7, "engine: N 1, one thread, one process; medians of {n} interleaved rounds"),
    }
    if args.what == "splits":
        return cmd_bench_splits(args)
    if args.what == "scheduler":
        return cmd_bench_scheduler(args)
    for what, (bench, repeats, title) in tables.items():
        if args.what in (what, "all"):
            n = args.repeats or repeats
            print(format_rows(bench(repeats=n), title.format(n=n)))
            print()
    return EXIT_OK


def cmd_bench_splits(args) -> int:
    """``cpkv bench splits``: prefill and decode splits on one process group, one table per model."""
    from .bench import SPLIT_MODELS, bench_splits, default_split_tokens, splits_title
    from .table import format_rows

    models = list(SPLIT_MODELS) if args.model == "all" else [args.model]
    sizes = dict(cp=args.cp or 4, tokens=args.tokens, bs=args.bs, decode_bs=args.decode_bs, context=args.context,
                 page=args.page or 16, repeats=args.repeats or 5)
    try:
        report = bench_splits(models, **sizes)
    except ValueError as e:
        print(f"cpkv bench splits: {e}", file=sys.stderr)
        return EXIT_USAGE
    for model, r in report.items():
        r["title"] = splits_title(model, **{**sizes, "tokens": args.tokens or default_split_tokens(model)})
        if not args.json:
            print(format_rows(r["rows"], r["title"]))
            print()
    if args.json:
        print(json.dumps(report, indent=2))
    return EXIT_OK


def cmd_bench_scheduler(args) -> int:
    """``cpkv bench scheduler``: the scheduler alone, one row per batch and context."""
    from .bench.scheduler import BATCHES, CONTEXTS, bench_scheduler, scheduler_title
    from .table import format_rows

    sizes = dict(batches=args.batches or BATCHES, contexts=args.contexts or CONTEXTS, steps=args.steps or 64,
                 cp_size=args.cp or 8, page_size=args.page or 64)
    print(format_rows(bench_scheduler(**sizes), scheduler_title(**sizes)))
    return EXIT_OK


def cmd_bytes(args) -> int:
    """``cpkv bytes``: the DSA models' KV bytes per token per rank, replicated vs shared."""
    from ..models.dsa import real_shape
    from .table import format_rows
    from .kvbytes import kv_bytes_rows

    try:
        rows = kv_bytes_rows(args.model, args.cp, args.index_topk_freq, args.index_skip_topk_offset)
        shape = real_shape(args.model, args.index_topk_freq, args.index_skip_topk_offset)
    except ValueError as e:
        print(f"cpkv bytes: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    pattern = ("an indexer on every layer" if len(shape.index_layers) == shape.num_layers else
               f"an indexer on {len(shape.index_layers)} layers (index_topk_freq {args.index_topk_freq}, "
               f"index_skip_topk_offset {args.index_skip_topk_offset}, GlmMoeDsaConfig's rule)")
    table = [{"": k, **{r["format"]: r[k] for r in rows}} for k in rows[0] if k != "format"]
    print(format_rows(table, f"{args.model}: {shape.num_layers} layers, latent {shape.kv_lora_rank} + "
                             f"{shape.rope_dim} rope on every layer, {pattern}, indexer key {shape.index_head_dim}; "
                             f"CP {args.cp}; fp8 = DeepSeek's packed cache format (fp8 values, fp32 scale per 128, "
                             "bf16 rope)"))
    return EXIT_OK


def run_config(args):
    """The :class:`~cpkv.engine.config.EngineConfig` of ``cpkv run``'s flags."""
    from ..engine.config import EngineConfig
    from ..models import model_config

    return EngineConfig(
        cp_size=args.cp, page_size=args.page, device_pages=args.device_pages, host_pages=args.host_pages,
        chunk=args.chunk, max_running=args.max_running, admission=args.admission,
        prefill_split=args.prefill_split, decode_split=args.decode_split, workload=args.workload,
        requests=args.requests, scale=args.scale, seed=args.seed, model=model_config(args.model, seed=args.seed),
        check=args.check, check_plans=args.check_plans, timeout=args.timeout,
        progress=not (args.json or args.no_progress),
    )


def engine_footprint(cfg):
    """The :class:`~cpkv.runtime.sizing.GroupFootprint` of the engine with
    ``cfg``: every rank holds the model, its page table and (rank 0, with
    ``check``) the logits it keeps; the group shares the device and host KV
    segments of every cache family."""
    import torch

    from ..models import build_adapter
    from ..runtime.sizing import group_footprint

    with torch.device("meta"):
        adapter = build_adapter(cfg.model)
    model = adapter.model
    model_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    slot = sum(f.slot_bytes() for f in adapter.families())
    shared = slot * cfg.page_size * (cfg.cp_size * cfg.device_pages + cfg.host_pages + 1)
    specs = cfg.trace()
    tokens = sum(len(s.tokens) + s.max_new_tokens for s in specs)
    private = 4 * tokens * model.config.vocab_size * 3 if cfg.check else 0  # kept, gathered, reference logits
    return group_footprint(cfg.cp_size, model_bytes=model_bytes, private_bytes=private, shared_bytes=shared)


def validate_disagg(args, parser, cfg) -> None:
    """``--disagg M:N``: the two groups' configuration, refused before any process starts."""
    import dataclasses

    from ..engine.config import DisaggConfig
    from ..engine.disagg import DisaggControl
    from ..engine.trace import TraceError

    if args.plot:
        parser.error("--plot draws one group's occupancy; it does not take --disagg")
    M, N = args.disagg
    d = DisaggConfig.from_engine(cfg, M, N, decode_page=args.decode_page)
    try:
        DisaggControl(d, d.trace())  # a trace either group cannot run is refused before any process starts
    except (TraceError, OSError) as e:
        parser.error(f"--workload: {e}")
    prefill = dataclasses.replace(cfg, cp_size=M)
    decode = dataclasses.replace(cfg, cp_size=N, page_size=d.d_page, device_pages=d.d_pages, host_pages=0)
    refuse_unless_fits(parser, engine_footprint(prefill), engine_footprint(decode), timeout=args.timeout)
    args.config = d


def validate_run(args, parser) -> None:
    """``cpkv run``: cross-flag rules, then the trace and the group(s) refused before any process starts;
    sets ``args.config`` (an engine or a disaggregated configuration)."""
    from ..engine.trace import TraceError

    if args.decode_page is not None and args.disagg is None:
        parser.error("--decode-page sets the decode group's page size; it needs --disagg")
    ranks, flag = (args.disagg[0], "the prefill ranks of --disagg") if args.disagg else (args.cp, "--cp")
    if args.prefill_split == "interleave" and ranks > 1 and args.chunk < ranks:
        parser.error(f"--prefill-split interleave needs --chunk >= {flag} ({ranks}): a batch of fewer tokens "
                     "than ranks cannot be interleaved")
    cfg = run_config(args)
    if args.disagg:
        return validate_disagg(args, parser, cfg)
    try:
        from ..engine.engine import build_scheduler

        build_scheduler(cfg, cfg.trace())  # a trace that cannot run is refused before any process starts
    except (TraceError, OSError) as e:
        parser.error(f"--workload: {e}")
    refuse_unless_fits(parser, engine_footprint(cfg), timeout=args.timeout)
    args.config = cfg


def cmd_run(args) -> int:
    """``cpkv run``: the engine (or, with ``--disagg``, the two groups) on ``args.config``; prints the report."""
    from ..engine import engine

    if args.disagg:
        from ..engine.disagg import format_disagg, run_disagg

        r = run_disagg(args.config)
        print(json.dumps({k: v for k, v in r.items() if k != "sequences"}, indent=2) if args.json
              else format_disagg(r))
        return check_exit(r, args)
    r = engine.run_engine(args.config)
    if args.plot:
        from .report import plot_engine

        plot_engine(r, args.plot)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k not in ("occupancy", "host_occupancy", "sequences")},
                         indent=2))
    else:
        from .report import format_engine

        print(format_engine(r))
        if args.plot:
            print(f"occupancy plot: {args.plot}")
    return check_exit(r, args)


def check_exit(r: dict, args) -> int:
    """:data:`EXIT_CHECK_FAILED` (with one line on stderr) when the run's check failed
    beyond ``--tolerance``, else :data:`EXIT_OK`."""
    c = r["check"]
    if c is not None and (c["max_abs_diff"] > args.tolerance or c["requests_matched"] != c["requests"]):
        print(f"FAIL: max abs logit difference {c['max_abs_diff']:.3g} (tolerance {args.tolerance:g}), "
              f"greedy tokens equal for {c['requests_matched']} of {c['requests']} requests", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK
