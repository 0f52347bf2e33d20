"""The work of each ``cpkv`` subcommand: ``cmd_<name>(args) -> exit code``, and the
cross-flag checks ``validate_<name>(args, parser)`` that run after parsing, before any
work (they call ``parser.error``). The parser itself is :mod:`cpkv.tools.cli`.
"""

from __future__ import annotations

import json
import sys

from .flags import (refuse_cuda_unless_available, refuse_unless_fits,
                    refuse_unless_kv_events_bind, refuse_without)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def cmd_simulate(args) -> int:
    """``cpkv simulate``: each workload through the scheduler without a model, policies side by side; or
    Mooncake traces replayed on a modelled H200 group (:func:`cpkv.tools.replay_report.cmd_replay`; with
    ``--goodput``, their rate sweep: :func:`cpkv.tools.goodput.cmd_goodput`)."""
    if args.mooncake and args.goodput:
        from .goodput import cmd_goodput

        return cmd_goodput(args)
    if args.mooncake:
        from .replay_report import cmd_replay

        return cmd_replay(args)
    from .table import format_rows
    from .simulate import POLICIES, SIM_WORKLOADS as WORKLOADS, compare, plot

    names = list(WORKLOADS) if "all" in args.workload else list(dict.fromkeys(args.workload))
    results, tables = [], []
    with simulate_publisher(args) as pub:
        for name in names:
            w = WORKLOADS[name](seed=args.seed)
            runs = compare(w, policies=args.policies or list(POLICIES), cp_size=args.cp, page_size=args.page,
                           lane_pages=args.lane_pages, admission=args.admission, host_pages=args.host_pages,
                           progress=not args.no_progress and not args.json, events=pub,
                           wait_for_prefix=not args.no_prefix_wait, eviction=args.eviction)
            results += runs
            rows = [r.summary() for r in runs]
            tables.append((name, w, rows))
    for _, _, rows in tables:
        ref = next((r for r in rows if r["policy"] == "oblivious"), None)
        for r in rows:
            if ref is not None:
                r["admitted vs oblivious"] = round(r["tokens before 1st refusal"] / max(ref["tokens before 1st refusal"], 1), 3)
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


def simulate_publisher(args):
    """``cpkv simulate --kv-events``: the publisher, bound before the first
    step (a context manager; a null one without the flag)."""
    from contextlib import nullcontext

    if args.kv_events is None:
        return nullcontext()
    from ..consumers.kv_events_zmq import KVEventPublisher

    return KVEventPublisher(args.kv_events, args.kv_events_replay, buffer_steps=args.kv_events_buffer)


def validate_simulate(args, parser) -> None:
    """``--plot`` needs matplotlib; sets ``args.mooncake`` and ``args.page`` (its default for the kind of trace,
    :data:`~cpkv.tools.sizes.SIMULATE_PAGE`; the kinds, their own flags and every size were checked first:
    :func:`~cpkv.tools.sizes.refuse_sizes`). Built-in traces: their requests against the cache, ``--kv-events``
    one trace under one policy and endpoints this machine can bind; Mooncake traces: a request the cache could
    never hold refused (:func:`~cpkv.tools.refusals.refuse_mooncake_sizes`)."""
    if args.plot:
        refuse_without(parser, "matplotlib", "--plot")
    from .refusals import refuse_mooncake_sizes, refuse_simulate_sizes
    from .simulate import POLICIES
    from .sizes import SIMULATE_PAGE, simulate_kind

    kind = simulate_kind(args.workload)
    if kind is None:
        parser.error("--workload: built-in traces and Mooncake traces are simulated apart; give one kind")
    args.mooncake = kind == "mooncake"
    if args.page is None:
        args.page = SIMULATE_PAGE[kind]
    if args.mooncake:
        refuse_mooncake_sizes(parser, args)
        return
    args.policies = args.policies or list(POLICIES)
    refuse_simulate_sizes(parser, args)
    if args.kv_events is not None and ("all" in args.workload or len(args.workload) != 1 or len(args.policies) != 1):
        parser.error("--kv-events publishes one cache: name one --workload and one of --policies "
                     f"(got --workload {' '.join(args.workload)}, --policies {','.join(args.policies)})")
    refuse_unless_kv_events_bind(parser, args)


def cmd_bench(args) -> int:
    """``cpkv bench``: one table per benchmark asked for (``all``: alloc, kv and engine)."""
    from .bench import bench_alloc, bench_engine, bench_kv
    from .bench.alloc import format_alloc, format_why
    from .table import format_rows

    from .sizes import BENCH_SIZES

    tables = {
        "alloc": (bench_alloc, "alloc: a pool of 32768 pages of 64 tokens, cp 8; median of {n} interleaved "
                  "rounds; deque = a bare free list per lane in plain Python, one pop per page, the same "
                  "out_cache_loc; arange = writing that out_cache_loc from the same pages; vllm = vLLM v1's "
                  "BlockPool on the same decode batch (one free queue, no lanes); goal = the most cp8/deque may "
                  "be (extend also cp8/arange <= 2, decode cp8/vllm <= 1); met = whether this run met it"),
        "kv": (bench_kv, "kv: one layer, 64K tokens, page 64, N 4, 2 KV heads x 128, bf16; median of {n} "
               "interleaved rounds; plain = index_copy_/index_select on an unshared buffer of the same size"),
        "engine": (bench_engine, "engine: N 1, one thread, one process; medians of {n} interleaved rounds"),
    }
    if args.what == "splits":
        return cmd_bench_splits(args)
    if args.what == "scheduler":
        return cmd_bench_scheduler(args)
    if args.what == "kvdtype":
        return cmd_bench_kvdtype(args)
    if args.what == "capacity":
        return cmd_bench_capacity(args)
    if args.what == "kernels":
        from .bench.kernels import run_kernels_command

        return run_kernels_command(args)
    if args.what == "plan":
        from .bench import bench_plan

        n = args.repeats
        rows = bench_plan(repeats=n)
        print(json.dumps(rows, indent=2) if args.json else format_rows(
            rows, f"plan: a Llama of 4 layers on one rank, torch path, CPU; prefill 4 x 256 tokens, decode 32 at "
                  f"512; median of {n} interleaved rounds; syncs = host synchronisations counted in each layer"))
        return EXIT_OK
    out = {}
    for what, (bench, title) in tables.items():
        if args.what in (what, "all"):
            n = args.repeats or BENCH_SIZES[what]["repeats"]
            if what == "kv":
                kw = dict(device=args.device, kernels=args.kernels, tokens=args.tokens or BENCH_SIZES["kv"]["tokens"])
                title = title.replace("64K tokens", f"{kw['tokens']} tokens") + \
                    f"; device {args.device}, kernels {args.kernels}"
                rows = bench(repeats=n, **kw)
            else:
                rows = bench(repeats=n)
            out[what] = rows
            if not args.json:
                print((format_alloc if what == "alloc" else format_rows)(rows, title.format(n=n)))
                if what == "alloc" and (why := format_why(rows)):
                    print(why, file=sys.stderr)
                print()
    if args.json:
        print(json.dumps(out if args.what == "all" else out[args.what], indent=2))
    return EXIT_OK


def cmd_bench_kvdtype(args) -> int:
    """``cpkv bench kvdtype``: KV bytes and accuracy of each ``--kv-dtype`` on the same traces;
    :data:`EXIT_CHECK_FAILED` (one line on stderr) when an accuracy row is not exact."""
    from .bench.kvdtype import bench_kvdtype, format_kvdtype

    report = bench_kvdtype(args.kv_dtype, cp=args.cp)
    print(json.dumps(report, indent=2) if args.json else format_kvdtype(report))
    bad = [f"{r['model']} {r['trace']} {r['kv dtype']}: {r['exact']}" for r in report["accuracy"]
           if r["exact"] != "yes"]
    if bad:
        print(f"FAIL: not exact: {'; '.join(bad)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def cmd_bench_capacity(args) -> int:
    """``cpkv bench capacity``: shared against replicated KV at equal memory per rank (every run checked against
    ``transformers`` with ``--check``)."""
    from .bench.capacity import CheckFailed, bench_capacity
    from .table import format_rows

    try:
        rows, _ = bench_capacity(capacity_config(args), ranks=args.ranks_as, rounds=args.repeats,
                                 check=args.check)
    except ValueError as e:
        print(f"cpkv bench capacity: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckFailed as e:
        print(f"cpkv bench capacity: {e}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    trace = (f"{args.workload}, its first {args.requests} requests at {args.block_tokens} tokens a block" if args.workload
             else "longdoc trace")
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    checked = ("every run checked against transformers" if args.check
               else "not checked (--check checks every run against transformers)")
    print(format_rows(rows, f"capacity: CP {args.cp}, {args.kv_memory} bytes of device KV per rank in both modes, "
                            f"TinyLlama, ranks as {args.ranks_as}, chunk {capacity_config(args).chunk}; longest "
                            f"request by the scheduler's up-front refusal, then run to the end; {trace}; {checked}"))
    return EXIT_OK


def validate_bench(args, parser) -> None:
    """``cpkv bench``: the flags not given take the benchmark's sizes and the parser's defaults (a flag the
    benchmark does not take and every size were refused first, :mod:`cpkv.tools.sizes`); ``--device cuda`` needs
    CUDA; ``--device``/``--kernels`` apply to kv, splits and plan; sets ``args.kernels`` to its default when not
    given."""
    from .sizes import fill_bench_defaults

    fill_bench_defaults(args)
    if args.what in ("engine", "splits", "kvdtype", "capacity", "plan", "all"):
        refuse_without(parser, "transformers", f"bench {args.what} (its models are transformers' own)")
    if args.kernels == "triton":
        refuse_without(parser, "triton", "--kernels triton")
    refuse_cuda_unless_available(parser, args.device, args.cp if args.what == "splits" else 1)
    if args.kernels is None:
        from ..runtime.batch import default_kernels

        args.kernels = default_kernels(args.device)
    if args.what in ("kv", "all") and args.kernels == "triton" and args.device == "cpu":
        parser.error("bench kv --kernels triton needs --device cuda: it times bf16, which Triton's interpreter "
                     "(the CPU) does not run")
    if args.what == "plan" and args.device != "cpu":
        parser.error("bench plan measures the torch path on the CPU; it does not take --device cuda")
    if args.what == "capacity":
        refuse_capacity_unless_fits(args, parser)


def refuse_capacity_unless_fits(args, parser) -> None:
    """``cpkv bench capacity``: ``parser.error`` (exit 2), before any rank
    starts, when a run of either mode is a group this machine cannot hold
    (memory, cores, start time: :func:`refuse_unless_fits`, as ``cpkv run``
    refuses). A ``--kv-memory`` that holds no page is left to the command's
    own message."""
    import dataclasses

    from ..engine.config import engine_footprint
    from ..engine.trace import TraceError

    try:
        base = capacity_config(args).sized()
        if args.workload:
            base.trace()
    except TraceError as e:
        parser.error(f"--workload: {e}")
    except ValueError:
        return
    for kv in ("shared", "replicated"):
        cfg = dataclasses.replace(base, kv=kv, check=args.check, host_pages=0)
        refuse_unless_fits(parser, engine_footprint(cfg), timeout=cfg.timeout)


def capacity_config(args):
    """``cpkv bench capacity``'s :class:`~cpkv.engine.config.EngineConfig`: the group, the memory, and a
    Mooncake ``--workload`` slice when one is given, prefilled in chunks scaled as its blocks are
    (:func:`~cpkv.engine.mooncake.scaled_chunk`) (``ValueError`` for a memory that holds no page)."""
    from ..engine.config import EngineConfig
    from ..engine.mooncake import scaled_chunk

    trace = {} if not args.workload else dict(workload=args.workload, requests=args.requests, step_ms=args.step_ms,
                                               block_tokens=args.block_tokens, window_ms=args.window,
                                               max_output=args.max_output, chunk=scaled_chunk(args.block_tokens))
    return EngineConfig(cp_size=args.cp, page_size=args.page, kv_memory=args.kv_memory, **trace)


def cmd_bench_splits(args) -> int:
    """``cpkv bench splits``: prefill and decode splits on one process group, one table per model."""
    from .bench import SPLIT_MODELS, bench_splits, default_split_tokens, splits_title
    from .table import format_rows

    models = list(SPLIT_MODELS) if args.model == "all" else [args.model]
    sizes = dict(cp=args.cp, tokens=args.tokens, bs=args.bs, decode_bs=args.decode_bs, context=args.context,
                 page=args.page, repeats=args.repeats)
    try:
        report = bench_splits(models, **sizes, device=args.device, kernels=args.kernels)
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
    from .bench.scheduler_step import bench_scheduler, scheduler_title
    from .table import format_rows

    sizes = dict(batches=args.batches, contexts=args.contexts, steps=args.steps, cp_size=args.cp,
                 page_size=args.page, rounds=args.repeats)
    try:
        rows = bench_scheduler(**sizes)
    except (ValueError, RuntimeError) as e:  # e.g. a context too short for the whole batch to decode together
        print(f"cpkv bench scheduler: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print(format_rows(rows, scheduler_title(**sizes)))
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
    """The :class:`~cpkv.engine.config.EngineConfig` of ``cpkv run``'s flags
    (``--cp`` not given: the default group size), not yet sized; with
    the KV event sockets bound at the start (``args.kv_publisher``), rank 0
    relays its batches there."""
    from ..engine.config import EngineConfig
    from ..models import model_config

    cfg = EngineConfig(
        cp_size=default_cp_size() if args.cp is None else args.cp, page_size=args.page,
        device_pages=args.device_pages, kv_memory=args.kv_memory, host_pages=args.host_pages,
        chunk=args.chunk, max_running=args.max_running, admission=args.admission,
        prefill_split=args.prefill_split, decode_split=args.decode_split, workload=args.workload,
        requests=args.requests, scale=args.scale, seed=args.seed, model=model_config(args.model, seed=args.seed),
        kv_dtype=args.kv_dtype, check=args.check, check_plans=args.check_plans, timeout=args.timeout,
        progress=not (args.json or args.no_progress), kv=args.kv, kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay, kv_events_buffer=args.kv_events_buffer,
        kv_events_relay=getattr(getattr(args, "kv_publisher", None), "relay_endpoint", None), device=args.device,
        kernels=args.kernels, block_tokens=args.block_tokens,
        window_ms=args.window, max_output=args.max_output, step_ms=args.step_ms,
        wait_for_prefix=not args.no_prefix_wait, eviction=args.eviction,
    )
    return cfg


def validate_disagg(args, parser, cfg) -> None:
    """``--disagg M:N``: the two groups' configuration, refused before any process starts."""
    import dataclasses

    from ..engine.config import DisaggConfig, engine_footprint
    from ..engine.disagg import DisaggControl
    from ..engine.trace import CacheTooSmall, TraceError

    if args.plot:
        parser.error("--plot draws one group's occupancy; it does not take --disagg")
    M, N = args.disagg
    try:  # sized here, at launch, for this world of M + N ranks
        d = DisaggConfig.from_engine(cfg, M, N, decode_page=args.decode_page).sized()
    except ValueError as e:  # a --kv-memory that holds no page
        parser.error(f"--kv-memory: {e}")
    prefill = dataclasses.replace(cfg, cp_size=M, device_pages=d.device_pages, kernels=d.kernels)
    try:
        DisaggControl(d, d.trace())  # a trace either group cannot run is refused before any process starts
    except CacheTooSmall as e:
        parser.error(f"--workload: {e}; raise --kv-memory or --device-pages")
    except (TraceError, OSError) as e:
        parser.error(f"--workload: {e}")
    decode = dataclasses.replace(prefill, cp_size=N, page_size=d.d_page, device_pages=d.d_pages, host_pages=0)
    refuse_unless_fits(parser, engine_footprint(prefill), engine_footprint(decode), timeout=args.timeout)
    say_how_long(d, d.trace(), d.world_size)
    args.config = d


def validate_run(args, parser) -> None:
    """``cpkv run``: cross-flag rules (every size was checked against this machine and the work first,
    :mod:`cpkv.tools.sizes`), then the trace against the cache, before anything is allocated or any process
    starts (:mod:`cpkv.tools.refusals`); sets ``args.config`` (an engine or a disaggregated configuration)."""
    from ..engine.config import engine_footprint
    from ..engine.trace import TraceError
    from .refusals import refuse_torchrun_mismatch, refuse_unless_trace_fits

    refuse_without(parser, "transformers", "cpkv run (its models are transformers' own)")
    if args.plot:
        refuse_without(parser, "matplotlib", "--plot")
    if args.kernels == "triton":
        refuse_without(parser, "triton", "--kernels triton")
    if args.disagg is not None and args.cp is not None:
        parser.error(f"--disagg M:N sets both group sizes (here {args.disagg[0]} prefill and {args.disagg[1]} "
                     f"decode ranks); it does not take --cp {args.cp}")
    refuse_torchrun_mismatch(parser, args.cp)
    refuse_cuda_unless_available(parser, args.device, sum(args.disagg) if args.disagg
                                 else args.cp or default_cp_size())
    if args.device == "cuda" and args.disagg:
        from ..engine.joined import DISAGG_ON_GPU

        parser.error(DISAGG_ON_GPU)
    if args.kv_events is not None and args.disagg is not None:
        parser.error("--kv-events publishes one CP group's prefix cache; it does not take --disagg")
    from .kv_events_start import refuse_unless_bound

    refuse_unless_bound(parser, args)
    cfg = run_config(args)  # sized below, at launch (for --disagg, for its world)
    ranks, flag = (args.disagg[0], "the prefill ranks of --disagg") if args.disagg else (cfg.cp_size, "--cp")
    if args.prefill_split == "interleave" and ranks > 1 and args.chunk < ranks:
        parser.error(f"--prefill-split interleave needs --chunk >= {flag} ({ranks}): a batch of fewer tokens "
                     "than ranks cannot be interleaved")
    if args.disagg and args.kv == "replicated":
        parser.error("--kv replicated runs one CP group; --disagg moves a shared cache's pages")
    if args.disagg:
        return validate_disagg(args, parser, cfg)
    try:
        cfg = cfg.sized()
    except ValueError as e:  # a --kv-memory that holds no page
        parser.error(f"--kv-memory: {e}")
    try:
        specs = cfg.trace()
    except (TraceError, OSError) as e:
        parser.error(f"--workload: {e}")
    refuse_unless_trace_fits(parser, cfg, specs)
    refuse_unless_fits(parser, engine_footprint(cfg, specs), timeout=args.timeout)
    say_how_long(cfg, specs, cfg.cp_size)
    args.config = cfg


#: Expected seconds above which ``cpkv run`` says, before it starts, how long it expects to take.
SAY_HOW_LONG_S = 60.0


def say_how_long(cfg, specs, world_size: int, capacity=None) -> float:
    """A run expected to take over :data:`SAY_HOW_LONG_S` says so on stderr (steps from
    :func:`~cpkv.engine.trace.expected_steps`, seconds from :func:`~cpkv.runtime.sizing.expected_run_seconds`;
    one past its ``--timeout`` was refused first, :mod:`cpkv.tools.sizes`). Returns the estimate."""
    from ..engine.trace import expected_steps
    from ..runtime.sizing import expected_run_seconds, machine_capacity

    steps = expected_steps(specs, cfg.chunk, cfg.max_running)
    cores = (capacity or machine_capacity()).cores
    secs = expected_run_seconds(world_size, steps, cores)
    if secs > SAY_HOW_LONG_S:
        print(f"cpkv run: expect about {secs / 60:.0f} min: about {steps} steps on {world_size} ranks and {cores} "
              "cores", file=sys.stderr)
    return secs


def cmd_run(args) -> int:
    """``cpkv run``: the engine (or, with ``--disagg``, the two groups) on ``args.config``; prints the report.

    Started by torchrun (:func:`~cpkv.runtime.torchrun.torchrun_env`), the
    ranks join torchrun's world instead of spawning their own
    (:mod:`cpkv.engine.joined`); the rank that holds the report prints it,
    the others print nothing and exit 0."""
    from ..engine import engine
    from ..runtime.torchrun import torchrun_env
    from .report import format_outputs

    joined = torchrun_env() is not None
    if args.disagg:
        from ..engine.disagg import format_disagg, run_disagg

        if joined:
            from ..engine.joined import run_disagg_joined

            r = run_disagg_joined(args.config)
            if r is None:
                return EXIT_OK
        else:
            r = run_disagg(args.config)
        print(json.dumps({k: v for k, v in r.items() if k != "sequences"}, indent=2) if args.json
              else format_disagg(r))
        if args.print_tokens and not args.json:
            print(format_outputs(r["outputs"]))
        return check_exit(r, args)
    if joined:
        from ..engine.joined import run_engine_joined

        r = run_engine_joined(args.config)
        if r is None:
            return EXIT_OK
    else:
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
    if args.print_tokens and not args.json:
        print(format_outputs(r["outputs"]))
    return check_exit(r, args)


def default_cp_size() -> int:
    """``--cp`` when not given: the world's size under torchrun (every rank of
    a one-node world is one CP group), else the run configuration's default."""
    from ..engine.config import EngineConfig
    from ..runtime.torchrun import torchrun_env

    env = torchrun_env()
    return env.world_size if env is not None else EngineConfig().cp_size


def check_exit(r: dict, args) -> int:
    """:data:`EXIT_CHECK_FAILED` (with one line on stderr) when the run's check
    failed (:func:`~cpkv.engine.exactness.failures`, logits within
    ``--tolerance`` when given), else :data:`EXIT_OK`."""
    from ..engine.exactness import failures

    c = r["check"]
    why = failures(c, args.tolerance) if c is not None else []
    if why:
        print(f"FAIL: {'; '.join(why)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK
