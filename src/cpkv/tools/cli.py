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
  ``func`` (the work) and optionally ``check`` (cross-flag rules, after parsing,
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
    s.set_defaults(func=_simulate, check=_check_simulate)


# -- bench --------------------------------------------------------------------------
def _bench(args) -> int:
    from .bench import bench_alloc, bench_kv, format_rows

    if args.what in ("alloc", "all"):
        rows = bench_alloc(repeats=args.repeats)
        print(format_rows(rows, "alloc: page 64, cp 8, 262144 extend tokens; median of "
                                f"{args.repeats} interleaved runs; floor = torch.arange of the same length"))
    if args.what in ("kv", "all"):
        rows = bench_kv(repeats=args.repeats)
        print(format_rows(rows, "kv: one layer, 64K tokens, page 64, N 4, 2 KV heads x 128, bf16; median of "
                                f"{args.repeats} interleaved runs; plain = index_copy_/index_select on an "
                                "unshared buffer of the same size"))
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
    b.add_argument("what", choices=["alloc", "kv", "all"], help="which benchmark")
    b.add_argument("--repeats", type=positive, default=21, help="timed rounds; the median is reported (default 21)")
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
def _run_config(args):
    from ..models import TinyLlama
    from ..runtime import RunConfig

    return RunConfig(
        cp_size=args.cp, page_size=args.page, requests=args.requests, decode_steps=args.decode_steps,
        model=TinyLlama(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                        intermediate=2 * args.hidden, vocab=args.vocab, seed=args.seed),
        seed=args.seed, check_plans=args.check_plans, timeout=args.timeout,
    )


def run_footprint(cfg):
    """The :class:`~cpkv.runtime.group.GroupFootprint` of ``cpkv run`` with
    ``cfg`` (a ``RunConfig``): every rank holds the model and the logits it
    gathers; the group shares its KV cache segments."""
    from ..runtime.group import group_footprint
    from ..runtime.scenario import pages_needed

    m = model_footprint(cfg.model)
    pages = cfg.pages_per_rank or pages_needed(cfg)
    slots = cfg.cp_size * pages * cfg.page_size
    kv = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["element_size"] * slots
    tokens = sum(n for _, n in cfg.requests) + cfg.decode_steps * len(cfg.requests)
    logits = 3 * tokens * m["vocab"] * 4  # own, gathered, and rank 0's reference forward
    return group_footprint(cfg.cp_size, model_bytes=m["bytes"], private_bytes=logits, shared_bytes=kv)


def _check_run(args, parser) -> None:
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if (args.hidden // args.heads) % 2:
        parser.error(f"--hidden / --heads = {args.hidden // args.heads} (the head dim) must be even for rotary embeddings")
    cfg = _run_config(args)
    longest = max(n for _, n in args.requests) + args.decode_steps
    if longest > cfg.model.max_positions:
        parser.error(f"--requests and --decode-steps make a sequence of {longest} tokens, more than the model's "
                     f"{cfg.model.max_positions} positions")
    refuse_unless_fits(parser, run_footprint(cfg), timeout=args.timeout)
    args.config = cfg


def _run(args) -> int:
    from .. import runtime

    r = runtime.run_scenario(args.config)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(format_run(r))
    worst = max(r["max_abs_diff"].values())
    if worst > args.tolerance:
        print(f"FAIL: max abs logit difference {worst:.3g} > {args.tolerance}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def format_run(r: dict) -> str:
    """Human-readable report of one ``cpkv run``."""
    from .bench import format_rows

    c = r["config"]
    n = len(r["ranks"])
    lines = [
        f"CP group of {n} ranks, page size {c['page_size']}, batch of {r['batch_size']} requests "
        f"(cached prefix:prompt = {', '.join(f'{a}:{b}' for a, b in c['requests'])}), "
        f"{c['decode_steps']} decode steps each; Llama {c['model']['layers']} layers, hidden "
        f"{c['model']['hidden']}, {c['model']['heads']} heads / {c['model']['kv_heads']} KV heads, fp32",
        "",
        format_rows([{"rank": x["rank"], "KV bytes held": x["kv_bytes_held"],
                      "share of replicated": round(x["kv_bytes_held"] / r["replicated_kv_bytes"], 3),
                      "prefill tokens": x["prefill_tokens"], "decode tokens": x["decode_tokens"]}
                     for x in r["ranks"]], "per rank:"),
        "",
        f"replicated cache (every rank a full copy): {r['replicated_kv_bytes']} bytes per rank; "
        f"shared: {sum(x['kv_bytes_held'] for x in r['ranks'])} bytes in all",
        f"max |logit - transformers|: prefill {r['max_abs_diff']['prefill']:.3g}, "
        f"decode {r['max_abs_diff']['decode']:.3g}",
        "time: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["seconds"].items()),
    ]
    return "\n".join(lines)


def _add_run(sub) -> None:
    r = sub.add_parser(
        "run", allow_abbrev=False,
        help="prefill and decode a batch on an N-process CP group sharing one KV cache, checked against transformers",
        description="Start N rank processes sharing one KV cache in POSIX shared memory; prefill a batch "
        "(each rank computes the tokens on pages it owns, writes them into its own segment, one fence per "
        "layer), then decode; compare every logit with transformers' forward of the full sequence. "
        "A group this machine cannot hold is refused before any process starts. "
        "Exits 1 if a difference exceeds --tolerance, 2 on bad arguments or a failed rank, 130 on Ctrl-C.")
    add_group_flags(r, cp=4, timeout=300.0)
    r.add_argument("--page", "--page-size", dest="page", type=positive, default=16, metavar="S",
                   help="tokens per page (default 16)")
    r.add_argument("--requests", type=requests_spec, default="37:61,0:50,32:45,0:9,0:83",
                   help="comma list of [cached_prefix:]prompt_len; a cached prefix is prefilled first and "
                        "continued by the batch (default 37:61,0:50,32:45,0:9,0:83: one mid-page and one "
                        "page-aligned continuation)")
    r.add_argument("--decode-steps", type=non_negative, default=8, help="greedy decode steps per request (default 8)")
    r.add_argument("--layers", type=positive, default=2, help="decoder layers (default 2)")
    r.add_argument("--hidden", type=positive, default=64, help="hidden size (default 64)")
    r.add_argument("--heads", type=positive, default=4, help="attention heads (default 4)")
    r.add_argument("--kv-heads", type=positive, default=2, help="KV heads, GQA (default 2)")
    r.add_argument("--vocab", type=positive, default=256, help="vocabulary size (default 256)")
    r.add_argument("--seed", type=non_negative, default=0, help="weights and prompts seed (default 0)")
    r.add_argument("--check-plans", action="store_true", help="debug: one collective per batch checks all ranks planned alike")
    r.add_argument("--tolerance", type=finite_float(0), default=1e-4, help="max abs logit difference allowed (default 1e-4)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(func=_run, check=_check_run)


# -- the command ----------------------------------------------------------------------
SUBCOMMANDS = (_add_simulate, _add_run, _add_bench, _add_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The ``cpkv`` argument parser, every subcommand registered (parsing runs
    the per-flag checks; the cross-flag ``check`` runs in :func:`main`)."""
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
        if getattr(args, "check", None):
            args.check(args, _subparser(parser, args.cmd))
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
