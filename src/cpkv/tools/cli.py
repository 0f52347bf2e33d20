"""The ``cpkv`` command: simulate, bench, run.

Layout, so a subcommand or a flag is added in one place:

* value checkers (:func:`int_at_least`, :func:`finite_float`, :func:`comma_choices`,
  :func:`requests_spec`, :func:`output_file`) are ``type=`` callables: a bad value
  is refused while parsing, by argparse itself, naming the flag;
* :func:`add_group_flags` adds the flags of anything that starts a CP group
  (``--cp``/``--ranks``, ``--timeout``), and :func:`refuse_unless_fits` refuses,
  with the reason, groups this machine cannot hold
  (:func:`cpkv.runtime.group.check_capacity`);
* each subcommand is one ``_add_<name>(sub)`` that declares its flags and sets
  ``func`` (the work) and optionally ``validate`` (cross-flag rules, after parsing,
  before any work; it calls ``parser.error``).

Exit codes, every subcommand: 0 done; 1 the run's own check failed (``run``:
a logit beyond ``--tolerance``); 2 bad arguments (argparse's message) or a failed
rank (one line naming it); 130 interrupted by Ctrl-C (one line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# -- value checkers (type= callables) ---------------------------------------------
def int_at_least(lo: int):
    """A ``type=`` for integers ``>= lo``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def finite_float(lo: float, *, inclusive: bool = True):
    """A ``type=`` for finite floats ``>= lo`` (``> lo`` unless ``inclusive``)."""
    rel = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {rel} {lo:g}, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (v == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a finite number {rel} {lo:g}, got {text}")
        return v

    parse.__name__ = f"number {rel} {lo:g}"
    return parse


def comma_choices(choices):
    """A ``type=`` for a comma list of distinct values out of ``choices``."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; a comma list of "
                                             f"{', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"{text!r} names a value twice")
        return items

    parse.__name__ = "comma list"
    return parse


def requests_spec(text: str) -> list[tuple[int, int]]:
    """A ``type=`` for ``[cached_prefix:]prompt_len,...`` with ``0 <= cached < prompt``."""
    out = []
    for item in text.split(","):
        cached, _, total = item.strip().rpartition(":")
        try:
            c, t = int(cached or 0), int(total)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not [cached_prefix:]prompt_len") from None
        if not 0 <= c < t:
            raise argparse.ArgumentTypeError(f"{item!r}: need 0 <= cached prefix < prompt length")
        out.append((c, t))
    return out


def output_file(*suffixes: str):
    """A ``type=`` for a file to write: its folder must exist, its suffix be one of ``suffixes``."""

    def parse(text: str) -> str:
        p = Path(text)
        if p.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: the file must end in {' or '.join(suffixes)}")
        if not p.parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: folder {str(p.parent)!r} does not exist")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder")
        return text

    parse.__name__ = "output file"
    return parse


positive = int_at_least(1)
non_negative = int_at_least(0)


# -- CP groups ----------------------------------------------------------------------
def add_group_flags(p: argparse.ArgumentParser, *, cp: int = 4, timeout: float = 300.0) -> None:
    """Flags of a subcommand that starts a CP group: ``--cp``/``--ranks`` and ``--timeout``."""
    p.add_argument("--cp", "--ranks", dest="cp", type=positive, default=cp, metavar="N",
                   help=f"ranks in the CP group, one process each (default {cp})")
    p.add_argument("--timeout", type=finite_float(0, inclusive=False), default=timeout, metavar="SECONDS",
                   help=f"seconds before the group is stopped (default {timeout:g})")


def refuse_unless_fits(parser: argparse.ArgumentParser, *footprints, timeout: float, capacity=None) -> None:
    """``parser.error`` (exit 2) with the reason when the groups described by
    ``footprints`` (:class:`~cpkv.runtime.group.GroupFootprint`) cannot run
    together on this machine within ``timeout``."""
    from ..runtime.group import GroupTooLarge, check_capacity

    try:
        check_capacity(*footprints, timeout=timeout, capacity=capacity)
    except GroupTooLarge as e:
        parser.error(f"refused before starting: {e}")


def model_footprint(model_spec) -> dict:
    """Sizes of a model spec with a ``build()`` returning a ``transformers``
    model, built on the meta device (no memory, no weights): its parameter and
    buffer bytes and the KV shape per token (layers, KV heads, head dim)."""
    import torch

    with torch.device("meta"):
        model = model_spec.build()
    cfg = model.config
    nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    return {"bytes": int(nbytes), "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "element_size": torch.empty((), dtype=dtype).element_size(),
            "vocab": cfg.vocab_size}


# -- simulate ---------------------------------------------------------------------
def _simulate(args) -> int:
    from .bench import format_rows
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


def _check_simulate(args, parser) -> None:
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install 'cpkv[plot]'")


def _add_simulate(sub) -> None:
    from .simulate import ADMISSION, POLICIES, WORKLOADS

    s = sub.add_parser("simulate", allow_abbrev=False,
                       help="seeded serving traces through the allocator and prefix cache, policies side by side")
    s.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all", help="which built-in trace (default all)")
    s.add_argument("--policies", type=comma_choices(POLICIES), default=list(POLICIES),
                   help=f"comma list of {', '.join(POLICIES)} (default all three)")
    s.add_argument("--cp", "--ranks", dest="cp", type=positive, default=8, metavar="N",
                   help="ranks in the CP group (default 8)")
    s.add_argument("--page", "--page-size", dest="page", type=positive, default=16, metavar="S",
                   help="tokens per page (default 16)")
    s.add_argument("--lane-pages", type=positive, default=None, help="pages per lane (default: the workload's own)")
    s.add_argument("--admission", choices=ADMISSION, default="lanes",
                   help="lanes: admit while every lane can hold the running requests' needs (default); "
                        "none: admit everything, a stress mode")
    s.add_argument("--seed", type=non_negative, default=0, help="trace seed (default 0)")
    s.add_argument("--plot", metavar="FILE.png", type=output_file(".png", ".pdf", ".svg"),
                   help="write lane occupancy over time per policy (.png, .pdf or .svg)")
    s.add_argument("--json", action="store_true", help="print the table as JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_simulate, validate=_check_simulate)


# -- bench --------------------------------------------------------------------------
def _bench(args) -> int:
    """``cpkv bench``: one table per benchmark asked for (``all``: alloc, kv and engine)."""
    from .bench import bench_alloc, bench_engine, bench_kv, format_rows

    tables = {
        "alloc": (bench_alloc, 101, "alloc: a pool of 32768 pages of 64 tokens, cp 8; median of {n} interleaved "
                  "rounds; per-block = a deque of page ids per lane in plain Python; floor = torch.arange of the "
                  "same length"),
        "kv": (bench_kv, 21, "kv: one layer, 64K tokens, page 64, N 4, 2 KV heads x 128, bf16; median of {n} "
               "interleaved rounds; plain = index_copy_/index_select on an unshared buffer of the same size"),
        "engine": (bench_engine, 7, "engine: N 1, one thread, one process; medians of {n} interleaved rounds"),
    }
    if args.what == "splits":
        return _bench_splits(args)
    for what, (bench, repeats, title) in tables.items():
        if args.what in (what, "all"):
            n = args.repeats or repeats
            print(format_rows(bench(repeats=n), title.format(n=n)))
            print()
    return EXIT_OK


def _bench_splits(args) -> int:
    """``cpkv bench splits``: prefill and decode splits on one process group, one table per model."""
    from .bench import SPLIT_MODELS, bench_splits, default_split_tokens, format_rows, splits_title

    models = list(SPLIT_MODELS) if args.model == "all" else [args.model]
    sizes = dict(cp=args.cp, tokens=args.tokens, bs=args.bs, decode_bs=args.decode_bs, context=args.context,
                 page=args.page, repeats=args.repeats or 5)
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


def _bytes(args) -> int:
    """``cpkv bytes``: the DSA models' KV bytes per token per rank, replicated vs shared."""
    from ..models.dsa import real_shape
    from .bench import format_rows
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


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", allow_abbrev=False, help="benchmarks: ratios against baselines measured in the same run")
    b.add_argument("what", choices=["alloc", "kv", "engine", "splits", "all"],
                   help="which benchmark (all: alloc, kv and engine; splits runs a process group for minutes, "
                        "by name only)")
    b.add_argument("--repeats", type=positive, default=None,
                   help="timed rounds; the median is reported (default alloc 101, kv 21, engine 7; splits: R "
                        "prefill and 4R decode rounds, R 5)")
    b.add_argument("--model", choices=["llama", "deepseek-v3.2", "all"], default="all", help="splits: which model")
    b.add_argument("--cp", "--ranks", dest="cp", type=positive, default=4, metavar="N",
                   help="splits: ranks in the group (default 4)")
    b.add_argument("--tokens", type=positive, default=None,
                   help="splits: prefill tokens (default 16384 for llama, 4096 for deepseek-v3.2)")
    b.add_argument("--bs", type=positive, default=4, help="splits: prefill requests (default 4)")
    b.add_argument("--decode-bs", type=positive, default=64, help="splits: decode requests (default 64)")
    b.add_argument("--context", type=positive, default=4096, help="splits: decode context per request (default 4096)")
    b.add_argument("--page", "--page-size", dest="page", type=positive, default=16, metavar="S",
                   help="splits: tokens per page (default 16)")
    b.add_argument("--json", action="store_true", help="splits: print the rows and every rank's counters as JSON")
    b.set_defaults(func=_bench)


def _add_bytes(sub) -> None:
    k = sub.add_parser("bytes", allow_abbrev=False,
                       help="KV bytes per token per rank of DeepSeek-V3.2 / GLM-5, replicated vs shared",
                       description="Per-token KV bytes of the real DSA shapes (MLA latent on every layer, indexer "
                       "keys on indexer layers), from the pool's families, in bf16 and DeepSeek's FP8 format: "
                       "replicated on every rank, latent shared with the indexer replicated, or both shared.")
    k.add_argument("--model", choices=["deepseek-v3.2", "glm-5"], default="deepseek-v3.2", help="which model")
    k.add_argument("--cp", type=positive, default=8, help="ranks in the CP group (default 8)")
    k.add_argument("--index-topk-freq", type=positive, default=1,
                   help="GLM-5: every how many layers an indexer runs (default 1: all, transformers' default)")
    k.add_argument("--index-skip-topk-offset", type=non_negative, default=2,
                   help="GLM-5: the offset of that pattern (default 2; GLM-5.2 configs use freq 4, offset 3)")
    k.add_argument("--json", action="store_true", help="print the rows as JSON")
    k.set_defaults(func=_bytes)




# -- run ----------------------------------------------------------------------------
def workload_arg(text: str) -> str:
    """A ``type=`` for ``--workload``: a built-in trace name or an existing JSONL file."""
    from ..engine.trace import WORKLOADS

    if text in WORKLOADS or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a built-in workload ({', '.join(WORKLOADS)}) "
                                     "nor a file")


def disagg_arg(text: str) -> tuple[int, int]:
    """A ``type=`` for ``--disagg``: ``M:N`` prefill and decode ranks, both >= 1."""
    from ..engine.disagg import parse_disagg

    try:
        return parse_disagg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_config(args):
    from ..engine import EngineConfig
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
    """The :class:`~cpkv.runtime.group.GroupFootprint` of the engine with
    ``cfg``: every rank holds the model, its page table and (rank 0, with
    ``check``) the logits it keeps; the group shares the device and host KV
    segments of every cache family."""
    import torch

    from ..models import build_adapter
    from ..runtime.group import group_footprint

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


def _check_disagg(args, parser, cfg) -> None:
    """``--disagg M:N``: the two groups' configuration, refused before any process starts."""
    import dataclasses

    from ..engine.disagg import DisaggConfig, DisaggControl
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


def _check_run(args, parser) -> None:
    from ..engine.trace import TraceError

    if args.decode_page is not None and args.disagg is None:
        parser.error("--decode-page sets the decode group's page size; it needs --disagg")
    ranks, flag = (args.disagg[0], "the prefill ranks of --disagg") if args.disagg else (args.cp, "--cp")
    if args.prefill_split == "interleave" and ranks > 1 and args.chunk < ranks:
        parser.error(f"--prefill-split interleave needs --chunk >= {flag} ({ranks}): a batch of fewer tokens "
                     "than ranks cannot be interleaved")
    cfg = _engine_config(args)
    if args.disagg:
        return _check_disagg(args, parser, cfg)
    try:
        from ..engine.engine import build_scheduler

        build_scheduler(cfg, cfg.trace())  # a trace that cannot run is refused before any process starts
    except (TraceError, OSError) as e:
        parser.error(f"--workload: {e}")
    refuse_unless_fits(parser, engine_footprint(cfg), timeout=args.timeout)
    args.config = cfg


def _run(args) -> int:
    from ..engine import engine

    if args.disagg:
        from ..engine.disagg import format_disagg, run_disagg

        r = run_disagg(args.config)
        print(json.dumps({k: v for k, v in r.items() if k != "sequences"}, indent=2) if args.json
              else format_disagg(r))
        return _check_exit(r, args)
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
    return _check_exit(r, args)


def _check_exit(r: dict, args) -> int:
    c = r["check"]
    if c is not None and (c["max_abs_diff"] > args.tolerance or c["requests_matched"] != c["requests"]):
        print(f"FAIL: max abs logit difference {c['max_abs_diff']:.3g} (tolerance {args.tolerance:g}), "
              f"greedy tokens equal for {c['requests_matched']} of {c['requests']} requests", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _add_run(sub) -> None:
    from ..engine.scheduler import ADMISSION
    from ..engine.trace import WORKLOADS
    from ..models import MODELS
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
        "the KV moving between the two groups point to point. A group this machine cannot hold is refused "
        "before any process starts. Exits 1 if the check fails, 2 on bad arguments or a failed rank, 130 on Ctrl-C.")
    add_group_flags(r, cp=4, timeout=300.0)
    r.add_argument("--page", "--page-size", dest="page", type=positive, default=16, metavar="S",
                   help="tokens per page (default 16)")
    r.add_argument("--model", choices=MODELS, default="llama",
                   help="model family, small random weights (default llama; deepseek-v3.2 and glm-5 are the DSA models)")
    r.add_argument("--workload", type=workload_arg, default="multiturn",
                   help=f"a built-in trace ({', '.join(WORKLOADS)}) or a JSONL file, one request a line "
                        "(default multiturn)")
    r.add_argument("--requests", type=positive, default=8,
                   help="built-in traces: sessions, questions or documents (default 8)")
    r.add_argument("--scale", type=finite_float(0, inclusive=False), default=0.1,
                   help="built-in traces: lengths times this (default 0.1)")
    r.add_argument("--chunk", type=positive, default=64, help="prefill tokens per step, all requests together (default 64)")
    r.add_argument("--device-pages", type=positive, default=8, help="device KV pages per rank (default 8)")
    r.add_argument("--host-pages", type=non_negative, default=96, help="host-tier pages, 0 for none (default 96)")
    r.add_argument("--max-running", type=positive, default=16, help="requests running at once (default 16)")
    r.add_argument("--admission", choices=ADMISSION, default="lanes",
                   help="lanes: admit while every lane holds what the running requests still need (default); "
                        "none: admit up to --max-running and preempt when a lane runs dry")
    r.add_argument("--prefill-split", choices=PREFILL_SPLITS, default="page",
                   help="who computes a prefill token: page (the owner of its page, no K/V moves; default), "
                        "interleave or zigzag (token splits with an all-gather of new K/V)")
    r.add_argument("--decode-split", choices=DECODE_SPLITS, default="owner",
                   help="owner (the owner of the new slot computes the token; default) or lse (every rank "
                        "attends over its own pages, partials merged by log-sum-exp)")
    r.add_argument("--seed", type=non_negative, default=0, help="trace and weights seed (default 0)")
    r.add_argument("--check", action="store_true",
                   help="compare every logit and every request's greedy tokens with transformers")
    r.add_argument("--tolerance", type=finite_float(0), default=1e-4,
                   help="with --check: max abs logit difference allowed (default 1e-4)")
    r.add_argument("--check-plans", action="store_true",
                   help="debug: one collective per batch checks that every rank allocated alike")
    r.add_argument("--disagg", type=disagg_arg, default=None, metavar="M:N",
                   help="prefill on M ranks and decode on N other ranks, one world of M+N processes (--cp is "
                        "not used): each request's KV moves from the prefill owners to the decode owners, one "
                        "message per rank pair and transfer; prints the bytes per rank pair and the transfer time")
    r.add_argument("--decode-page", type=positive, default=None, metavar="S",
                   help="with --disagg: the decode group's page size (default --page)")
    r.add_argument("--plot", metavar="FILE.png", type=output_file(".png", ".pdf", ".svg"),
                   help="write device lane occupancy and host occupancy over steps")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_run, validate=_check_run)


# -- the command ----------------------------------------------------------------------
SUBCOMMANDS = (_add_simulate, _add_run, _add_bench, _add_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The ``cpkv`` argument parser, every subcommand registered (parsing runs
    the per-flag checks; the cross-flag ``validate`` runs in :func:`main`)."""
    p = argparse.ArgumentParser(prog="cpkv", allow_abbrev=False,
                                description="Owner-lane shared KV cache for context-parallel inference.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join(
        f.__name__.removeprefix("_add_") for f in SUBCOMMANDS) + "}")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def _subparser(parser: argparse.ArgumentParser, cmd: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[cmd]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cpkv`` console command (and ``python -m cpkv``);
    returns the exit code (see the module docstring)."""
    from ..runtime.group import RankFailure

    parser = build_parser()
    name = "cpkv"
    try:
        args = parser.parse_args(argv)
        name = f"cpkv {args.cmd}"
        if getattr(args, "validate", None):
            args.validate(args, _subparser(parser, args.cmd))
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RankFailure as e:
        print(f"{name}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of our output went away (| head): not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
