"""The ``cpkv`` command: simulate, bench, run.

This module is the parser, so a subcommand or a flag is added in one place:
each subcommand is one ``_add_<name>(sub)`` that declares its flags and sets
``func`` (the work, in :mod:`cpkv.tools.commands`) and optionally ``validate``
(cross-flag rules, after parsing, before any work; it calls ``parser.error``).
The flag checkers and the flags of anything that starts a CP group are in
:mod:`cpkv.tools.flags`; ``cpkv run``'s defaults are
:class:`~cpkv.engine.config.RunConfig`'s. Before this parser is built (it
imports the command's modules), every size of the command line is checked by
:mod:`cpkv.tools.sizes`, which imports nothing heavy: a new size flag joins its
table (:data:`~cpkv.tools.sizes.FLAGS`) with the checker it is declared with
here.

Exit codes, every subcommand: 0 done; 1 the run's own check failed (``run``:
a logit beyond ``--tolerance``); 2 bad arguments (one line: the flag, the limit,
a value that works) or a failed rank (one line naming it); 130 interrupted by
Ctrl-C (one line).
"""

from __future__ import annotations

import argparse
import os
import sys

from .commands import (EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, cmd_bench, cmd_bytes, cmd_run,
                       cmd_simulate, validate_bench, validate_run, validate_simulate)
from .sizes import refuse_sizes
from .flags import (OneLineParser, add_device_flags, add_eviction_flag, add_group_flags, add_kv_dtype_flag,
                    add_kv_events_flags, add_mooncake_flags, comma_choices, disagg_arg, existing_file, finite_float,
                    mooncake_arg, non_negative, output_file, positive, positive_float, positive_floats, positive_list,
                    scale_arg, simulate_workload_arg, size_arg, size_list, workload_arg)

__all__ = ["EXIT_CHECK_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main", "parse_command"]


def _add_simulate(sub) -> None:
    from ..engine.scheduler import ADMISSION
    from .simulate import POLICIES, WORKLOADS

    s = sub.add_parser("simulate", allow_abbrev=False,
                       help="serving traces through the scheduler without a model: seeded traces with placement "
                            "policies side by side, or a Mooncake trace replayed on a modelled H200 group, shared "
                            "against replicated KV")
    s.add_argument("--workload", nargs="+", type=simulate_workload_arg, default=["all"], metavar="W",
                   help=f"built-in traces ({', '.join(WORKLOADS)}, or all: the default), or Mooncake trace files "
                        "(mooncake:PATH, or a file recognised by its fields), replayed in their own milliseconds")
    s.add_argument("--policies", type=comma_choices(POLICIES), default=None,
                   help=f"built-in traces: comma list of {', '.join(POLICIES)} (default all three)")
    s.add_argument("--cp", "--ranks", dest="cp", type=positive, default=8, metavar="N",
                   help="ranks in the CP group (default 8)")
    s.add_argument("--page", "--page-size", dest="page", type=positive, default=None, metavar="S",
                   help="tokens per page (default 16; Mooncake traces 64, FlashMLA's page)")
    s.add_argument("--lane-pages", type=positive, default=None,
                   help="built-in traces: pages per lane (default: the workload's own)")
    s.add_argument("--admission", choices=ADMISSION, default="lanes",
                   help="lanes: admit while every lane can hold the running requests' needs (default); "
                        "none: admit everything, a stress mode")
    s.add_argument("--seed", type=non_negative, default=0, help="built-in traces: trace seed (default 0)")
    s.add_argument("--plot", metavar="FILE.png", type=output_file(".png", ".pdf", ".svg"),
                   help="built-in traces: lane occupancy over time per policy; Mooncake traces: one file per "
                        "figure beside FILE (resident tokens against capacity, hit rate over time, TTFT and TPOT "
                        "CDFs), their paths printed")
    s.add_argument("--host-pages", type=non_negative, default=0,
                   help="built-in traces: host-tier pages, 0 for none (default 0)")
    s.add_argument("--no-prefix-wait", action="store_true",
                   help="admit a request that shares a prefix another running request is still computing at once "
                        "(it computes the prefix again); by default it waits until those pages are cached")
    add_eviction_flag(s)
    add_kv_events_flags(s, "the simulated caches' (one --workload, one of --policies)")
    s.add_argument("--json", action="store_true", help="print the table as JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_replay_flags(s)
    s.set_defaults(func=cmd_simulate, validate=validate_simulate)


def _add_replay_flags(s) -> None:
    """``cpkv simulate``'s flags for Mooncake traces (:mod:`cpkv.tools.replay`), in one group."""
    from .replay import KV_MODES

    g = s.add_argument_group("Mooncake replay on a modelled H200 group (DeepSeek-V3.2; cpkv.engine.cost_model)")
    g.add_argument("--kv", type=comma_choices(KV_MODES), default=None, metavar="LIST",
                   help="the group's cache, a comma list of shared, replicated (default both, same memory per rank)")
    g.add_argument("--kv-memory", type=size_arg, default=None, metavar="SIZE",
                   help="device KV bytes per rank, both modes (default: what an H200 keeps beside a DeepSeek-V3.2 "
                        "shard, as cpkv.engine.cost_model.kv_memory_per_rank derives it)")
    g.add_argument("--kv-dtype", type=comma_choices(("bfloat16", "fp8")), default=None, metavar="LIST",
                   help="comma list of bfloat16, fp8 (DeepSeek's 656 + 132 bytes a token and layer) (default both)")
    g.add_argument("--host-memory", type=size_list, default=None, metavar="LIST",
                   help="host-tier bytes for the group, a comma list of sizes, 0 for none (default 0,1TiB: without "
                        "and with a host tier of half a DGX H200's 2 TB)")
    g.add_argument("--decode-split", type=comma_choices(("auto", "owner", "lse")), default=None, metavar="LIST",
                   help="the shared group's decode split in the cost model, a comma list of auto (each step of "
                        "decodes the cheaper of the two), owner, lse (default auto)")
    g.add_argument("--chunk", type=positive, default=None, help="prefill tokens per step (default 8192)")
    g.add_argument("--max-running", type=positive, default=None, help="requests running at once (default 256)")
    g.add_argument("--requests", type=positive, default=None, help="only the trace's first K requests")
    g.add_argument("--rate", type=positive_float, default=None, metavar="X",
                   help="arrivals X times as fast as the timestamps say (default 1: the trace's own)")
    g.add_argument("--gpu-results", type=existing_file, default=None, metavar="PATH",
                   help="a results.json whose cost_model object replaces the H200 datasheet figures by measured ones")
    g.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    g.add_argument("--goodput", action="store_true",
                   help="sweep the arrival-rate multiple for each mode and report the highest at which p99 TTFT and "
                        "p99 TPOT meet each SLO (cpkv.tools.goodput: 2^(k/16) multiples, doublings from 1x then "
                        "bisection; the rate found meets it, one step above does not)")
    g.add_argument("--slo-ttft", type=finite_float(0, inclusive=False), default=None, metavar="SECONDS",
                   help="--goodput: the p99 TTFT bound of every SLO (default 30: Mooncake FAST'25's TTFT threshold)")
    g.add_argument("--slo-tpot", type=positive_floats, default=None, metavar="MS,..",
                   help="--goodput: p99 TPOT bounds in ms, a comma list: the first is the SLO the goal is judged at, "
                        "the others the sweep (default 100,200,300: Mooncake FAST'25's TBT thresholds)")
    g.add_argument("--jobs", type=positive, default=None, metavar="N",
                   help="--goodput: sweeps at a time, each in a process of its own (default 1; at most this "
                        "machine's cores)")
    add_mooncake_flags(s, block=512, step_ms=False)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", allow_abbrev=False, help="benchmarks: ratios against baselines measured in the same run")
    b.add_argument("what", choices=["alloc", "kv", "engine", "splits", "kvdtype", "capacity", "plan", "scheduler",
                                    "kernels", "all"],
                   help="which benchmark (all: alloc, kv and engine; splits runs a process group for minutes, "
                        "by name only; plan: host synchronisations per layer and step time before and after "
                        "the forward plan; scheduler: the scheduler alone, by name only; kernels: the Triton "
                        "kernels against a device copy and torch SDPA on a GPU, their sm_90 compile report "
                        "(registers, spills, shared memory, grids) anywhere)")
    b.add_argument("--repeats", type=positive, default=None,
                   help="timed rounds; the median is reported (default alloc 101, kv 21, engine 7; splits: R "
                        "prefill and 4R decode rounds, R 5; scheduler: rounds of every case, 3; capacity: trace "
                        "rounds of each mode, 5)")
    from .bench.splits import SPLIT_MODELS

    b.add_argument("--model", choices=[*SPLIT_MODELS, "all"], default="all", help="splits: which model")
    b.add_argument("--cp", "--ranks", dest="cp", type=positive, default=None, metavar="N",
                   help="splits, kvdtype, capacity: ranks in the group (default 4); scheduler: lanes (default 8)")
    b.add_argument("--tokens", type=positive, default=None,
                   help="splits: prefill tokens (default 16384 for llama, 4096 for deepseek-v3.2); kv: tokens of "
                        "the batch (default 65536)")
    b.add_argument("--bs", type=positive, default=None, help="splits: prefill requests (default 4)")
    b.add_argument("--decode-bs", type=positive, default=None, help="splits: decode requests (default 64)")
    b.add_argument("--context", type=positive, default=None, help="splits: decode context per request (default 4096)")
    b.add_argument("--page", "--page-size", dest="page", type=positive, default=None, metavar="S",
                   help="splits, capacity: tokens per page (default 16); scheduler: (default 64)")
    b.add_argument("--batches", type=positive_list, default=None, metavar="B,..",
                   help="scheduler: running requests per case (default 64,256,1024)")
    b.add_argument("--contexts", type=positive_list, default=None, metavar="T,..",
                   help="scheduler: context tokens per case (default 4096,32768,131072)")
    b.add_argument("--steps", type=positive, default=None, help="scheduler: decode steps per case (default 64)")
    b.add_argument("--json", action="store_true",
                   help="print the rows as JSON (splits: and every rank's counters; kernels: the sections; "
                        "all: one object by benchmark)")
    b.add_argument("--compile", action="store_true",
                   help="kernels: the sm_90 compile report too on a GPU (without a GPU it is all that runs)")
    add_kv_dtype_flag(b, "all")
    b.add_argument("--kv-memory", type=size_arg, default=None, metavar="SIZE",
                   help="capacity: device KV bytes per rank of both modes (default 256KiB)")
    b.add_argument("--check", action="store_true",
                   help="capacity: check every run against transformers (every logit within 1e-4, every greedy "
                        "token); without it no run computes the reference forward")
    b.add_argument("--ranks-as", choices=["processes", "threads"], default="processes",
                   help="capacity: start each run's ranks as processes (default, as a deployment runs them) or as "
                        "threads of this process (quicker to start; their Python runs one rank at a time)")
    add_device_flags(b)
    b.add_argument("--workload", type=mooncake_arg, default=None, metavar="PATH",
                   help="capacity: a Mooncake trace (mooncake:PATH, or a file with its fields) instead of the longdoc "
                        "trace, sliced and scaled by the flags below")
    b.add_argument("--requests", type=positive, default=None,
                   help="capacity with a Mooncake --workload: its first K requests (default 200)")
    add_mooncake_flags(b, block=16)
    # a flag not given stays unset, so cpkv.tools.sizes tells which were given and refuses those the benchmark
    # does not take (BENCH_FLAGS); validate_bench then fills in its sizes (BENCH_SIZES) and the defaults here
    b.set_defaults(func=cmd_bench, validate=validate_bench, bench_defaults={
        a.dest: a.default for a in b._actions if a.option_strings and a.dest != "help"})
    for a in b._actions:
        if a.option_strings and a.dest != "help":
            a.default = argparse.SUPPRESS


def _add_bytes(sub) -> None:
    k = sub.add_parser("bytes", allow_abbrev=False,
                       help="KV bytes per token per rank of DeepSeek-V3.2 / GLM-5, replicated vs shared",
                       description="Per-token KV bytes of the real DSA shapes (MLA latent on every layer, indexer "
                       "keys on indexer layers), from the pool's families, in bf16 and DeepSeek's FP8 format: "
                       "replicated on every rank, latent shared with the indexer replicated, or both shared.")
    from ..models.dsa import KINDS

    k.add_argument("--model", choices=list(KINDS), default="deepseek-v3.2", help="which model")
    k.add_argument("--cp", type=positive, default=8, help="ranks in the CP group (default 8)")
    k.add_argument("--index-topk-freq", type=positive, default=1,
                   help="GLM-5: every how many layers an indexer runs (default 1: all, transformers' default)")
    k.add_argument("--index-skip-topk-offset", type=non_negative, default=2,
                   help="GLM-5: the offset of that pattern (default 2; GLM-5.2 configs use freq 4, offset 3)")
    k.add_argument("--json", action="store_true", help="print the rows as JSON")
    k.set_defaults(func=cmd_bytes)


def _add_run(sub) -> None:
    from ..engine.config import EngineConfig
    from ..engine.scheduler import ADMISSION
    from ..engine.trace import MAX_SCALE, TRACE_LIMITS, WORKLOADS
    from ..models import MODELS
    from ..runtime.sizing import KV_MEMORY_CAP, KV_MEMORY_FRACTION, format_size
    from ..runtime.batch import DECODE_SPLITS, PREFILL_SPLITS

    r = sub.add_parser(
        "run", allow_abbrev=False,
        help="the engine: a serving trace on an N-process CP group sharing one KV cache, checked against transformers",
        description="Start N rank processes sharing one KV cache (and a host tier) in POSIX shared memory and run "
        "a serving trace through the engine: admission by lanes, chunked prefill, decode, the prefix cache with "
        "mid-page copies, lane-aware eviction, preemption, host backup and restore. Every rank runs the same "
        "scheduler; each computes the tokens of its split and writes only its own segment. With --check, every "
        "computed logit is compared with transformers' forward of the request's full sequence and every "
        "request's tokens with its greedy decoding. With --disagg M:N, M ranks prefill and N other ranks decode, "
        "the KV moving between the two groups point to point. A group this machine cannot hold, and a trace with "
        "a request the device cache could never hold, are refused before any process starts. The device cache is "
        "sized from memory unless --device-pages is given. A trace file: " + TRACE_LIMITS + ". A run expected to "
        "take over a minute says so on stderr before it starts; a run stopped by --timeout or Ctrl-C says what it "
        "finished. Exits 1 if the check fails, 2 on bad arguments or a failed rank, 130 on Ctrl-C.")
    D = EngineConfig()  # the defaults, written once in cpkv.engine.config (a plain value: nothing is sized)
    from ..engine.config import KV_MODES

    add_group_flags(r, cp=D.cp_size, timeout=D.timeout)
    r.add_argument("--page", "--page-size", dest="page", type=positive, default=D.page_size, metavar="S",
                   help=f"tokens per page (default {D.page_size})")
    r.add_argument("--model", choices=MODELS.names(), default=MODELS.names()[0],
                   help=f"model family, small random weights: {MODELS.describe()} (default {MODELS.names()[0]})")
    r.add_argument("--workload", type=workload_arg, default=D.workload,
                   help=f"a built-in trace ({', '.join(WORKLOADS)}), a JSONL file, one request a line (its format "
                        "is in the description above), or a Mooncake trace (mooncake:PATH, or a file recognised by "
                        f"its fields) (default {D.workload})")
    r.add_argument("--requests", type=positive, default=D.requests,
                   help=f"built-in traces: sessions, questions or documents; a Mooncake trace: its first K requests "
                        f"(default {D.requests})")
    r.add_argument("--scale", type=scale_arg, default=D.scale,
                   help=f"built-in traces: lengths times this, at most {MAX_SCALE:g} (default {D.scale:g})")
    r.add_argument("--chunk", type=positive, default=D.chunk,
                   help=f"prefill tokens per step, all requests together (default {D.chunk})")
    cache = r.add_mutually_exclusive_group()
    cache.add_argument("--kv-memory", type=size_arg, default=D.kv_memory, metavar="SIZE",
                       help="device KV cache bytes per rank, e.g. 64MiB or 2GiB (binary units KiB MiB GiB TiB, "
                            "decimal kB MB GB TB, or a plain number of bytes); pages per rank = SIZE // bytes per "
                            "page. Default, as SGLang's --mem-fraction-static or vLLM's --gpu-memory-utilization: "
                            f"{KV_MEMORY_FRACTION:g} of the memory this machine has left once the ranks have "
                            f"started, split over the ranks, at most {format_size(KV_MEMORY_CAP)} per rank and half "
                            "of the free shared memory")
    cache.add_argument("--device-pages", type=positive, default=D.device_pages,
                       help="device KV pages per rank, instead of --kv-memory (lane 0 holds one fewer: page 0 is "
                            "reserved)")
    r.add_argument("--kv", choices=KV_MODES, default=D.kv,
                   help="the device cache: shared (one owner-lane cache for the group) or replicated (the "
                        "baseline: every rank a full copy, zigzag prefill and balanced decode token splits with an "
                        f"all-gather of the new K/V; the split flags then do not apply; --kv-memory gives both "
                        f"modes the same pages per rank, so a shared group holds N times the pages) (default {D.kv})")
    r.add_argument("--host-pages", type=non_negative, default=D.host_pages,
                   help=f"host-tier pages, 0 for none (default {D.host_pages})")
    r.add_argument("--max-running", type=positive, default=D.max_running,
                   help=f"requests running at once (default {D.max_running})")
    r.add_argument("--no-prefix-wait", action="store_true",
                   help="admit a request that shares a prefix another running request is still computing at once "
                        "(it computes the prefix again, the same tokens); by default it waits until those pages are "
                        "cached and hits them")
    add_eviction_flag(r)
    r.add_argument("--admission", choices=ADMISSION, default=D.admission,
                   help="lanes: admit while every lane holds what the running requests still need (default); "
                        "none: admit up to --max-running and preempt when a lane runs dry")
    r.add_argument("--prefill-split", choices=PREFILL_SPLITS, default=D.prefill_split,
                   help="who computes a prefill token: page (the owner of its page, no K/V moves; default), "
                        "interleave or zigzag (token splits with an all-gather of new K/V)")
    r.add_argument("--decode-split", choices=DECODE_SPLITS, default=D.decode_split,
                   help="owner (the owner of the new slot computes the token), lse (decode context "
                        "parallelism: every rank attends over its own pages, partials merged by log-sum-exp at the "
                        "token's rank) or auto (each step of decodes the one the cost model prices lower; default)")
    add_kv_dtype_flag(r, D.kv_dtype)
    r.add_argument("--seed", type=non_negative, default=D.seed, help=f"trace and weights seed (default {D.seed})")
    r.add_argument("--check", action="store_true",
                   help="compare every logit and every request's greedy tokens with transformers")
    r.add_argument("--tolerance", type=finite_float(0), default=None,
                   help="with --check: max abs logit difference allowed (default 1e-4, in every --kv-dtype: "
                        "the reference reads the run's stored values, each checked to be a rounding of its own)")
    r.add_argument("--check-plans", action="store_true",
                   help="debug: one collective per batch checks that every rank allocated alike")
    r.add_argument("--disagg", type=disagg_arg, default=None, metavar="M:N",
                   help="prefill on M ranks and decode on N other ranks, one world of M+N processes (it sets both "
                        "group sizes, so it refuses --cp): each request's KV moves from the prefill owners to the decode owners, one "
                        "message per rank pair and transfer; prints the bytes per rank pair and the transfer time")
    r.add_argument("--decode-page", type=positive, default=None, metavar="S",
                   help="with --disagg: the decode group's page size (default --page)")
    add_kv_events_flags(r, "the group's caches' (bound as the command starts, before anything slow; rank 0 relays "
                           "its batches there)")
    r.add_argument("--plot", metavar="FILE.png", type=output_file(".png", ".pdf", ".svg"),
                   help="write device lane occupancy and host occupancy over steps")
    r.add_argument("--json", action="store_true",
                   help="print the report as JSON (outputs: every request's id, prompt length and generated tokens)")
    r.add_argument("--print-tokens", action="store_true",
                   help="after the text report, every request's generated token ids, one line a request")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_flags(r)
    add_mooncake_flags(r, block=D.block_tokens)
    r.set_defaults(func=cmd_run, validate=validate_run)


# -- the command ----------------------------------------------------------------------
SUBCOMMANDS = (_add_simulate, _add_run, _add_bench, _add_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The ``cpkv`` argument parser, every subcommand registered (parsing runs
    the per-flag checks; the cross-flag ``validate`` runs in :func:`main`)."""
    p = OneLineParser(prog="cpkv", allow_abbrev=False,
                                description="Owner-lane shared KV cache for context-parallel inference.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join(
        f.__name__.removeprefix("_add_") for f in SUBCOMMANDS) + "}")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def _subparser(parser: argparse.ArgumentParser, cmd: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[cmd]


def parse_command(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed and validated as the ``cpkv`` command takes it (its
    sizes first, :func:`~cpkv.tools.sizes.refuse_sizes`, then its parser, its
    cross-flag rules and up-front refusals, nothing run): the namespace its
    subcommand runs on (``args.func(args)``; ``cpkv run`` sets
    ``args.config``). A command line the command refuses raises
    ``SystemExit(2)`` after the one line on stderr, as the command exits."""
    refuse_sizes(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "validate", None):
        args.validate(args, _subparser(parser, args.cmd))
    return args


def _what_it_finished(name: str, e: BaseException, bar: bool) -> None:
    """A stopped run's line of what it finished, when the run said (``e.progress``), on its own line: after
    the progress bar a rank left mid-line (``bar``), cleared on a terminal, ended elsewhere."""
    if hasattr(e, "requests"):
        from ..runtime.progress import describe_progress

        lead = ("\r\x1b[K" if sys.stderr.isatty() else "\n") if bar else ""
        print(f"{lead}{name}: {describe_progress(e.progress, e.requests)}", file=sys.stderr)


def _draws_a_bar(args) -> bool:
    """Whether the command shows a progress bar (which a stopped run may leave mid-line)."""
    return args is not None and args.cmd in ("run", "simulate") and not (
        args.json or args.no_progress or getattr(args, "markdown", False))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cpkv`` console command (and ``python -m cpkv``);
    returns the exit code (see the module docstring). The sizes are checked
    first, before anything heavy is imported (:mod:`cpkv.tools.sizes`); then
    ``cpkv run --kv-events`` binds its sockets, still before anything slow
    (:func:`~cpkv.tools.kv_events_start.bind_at_start`), and they close when
    the command ends. A Ctrl-C at any moment from then on ends with one line
    and 130. Called as the program (``argv`` ``None``), a Ctrl-C after the
    command's work (while the interpreter exits) is ignored, so nothing prints
    a traceback then."""
    from .kv_events_start import bind_at_start

    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    name, args, publisher = f"cpkv {argv[0]}" if argv and not argv[0].startswith("-") else "cpkv", None, None
    try:
        refuse_sizes(argv)
        publisher = bind_at_start(argv)
        parser = build_parser()
        args = parser.parse_args(argv)
        args.kv_publisher = publisher
        name = f"cpkv {args.cmd}"
        if getattr(args, "validate", None):
            args.validate(args, _subparser(parser, args.cmd))
        return args.func(args)
    except KeyboardInterrupt as e:
        _what_it_finished(name, e, _draws_a_bar(args))
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of our output went away (| head): not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except Exception as e:
        group = sys.modules.get("cpkv.runtime.group")  # a failed rank: imported by whatever launched it
        if group is None or not isinstance(e, group.RankFailure):
            raise
        _what_it_finished(name, e, _draws_a_bar(args))
        print(f"{name}: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if publisher is not None:
            publisher.close()
        if program:
            import signal

            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
