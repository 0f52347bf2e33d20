"""The ``cpkv`` command: simulate, bench, run."""

from __future__ import annotations

import argparse
import json
import sys


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
        return 0
    for name, w, rows in tables:
        print(format_rows(rows, f"{name}: {len(w.requests)} requests, seed {args.seed}, N={args.cp}, page {args.page}, "
                                f"{args.lane_pages or w.lane_pages} pages per lane, admission {args.admission}"))
        print()
    if args.plot:
        print(f"lane occupancy plot: {args.plot}")
    return 0


def _bench(args) -> int:
    from .bench import bench_alloc, bench_kv, format_rows

    if args.what == "splits":
        return _bench_splits(args)
    args.repeats = args.repeats or 21
    if args.what in ("alloc", "all"):
        rows = bench_alloc(repeats=args.repeats)
        print(format_rows(rows, "alloc: page 64, cp 8, 262144 extend tokens; median of "
                                f"{args.repeats} interleaved runs; floor = torch.arange of the same length"))
    if args.what in ("kv", "all"):
        rows = bench_kv(repeats=args.repeats)
        print(format_rows(rows, "kv: one layer, 64K tokens, page 64, N 4, 2 KV heads x 128, bf16; median of "
                                f"{args.repeats} interleaved runs; plain = index_copy_/index_select on an "
                                "unshared buffer of the same size"))
    return 0


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
        return 2
    for model, r in report.items():
        r["title"] = splits_title(model, **{**sizes, "tokens": args.tokens or default_split_tokens(model)})
        if not args.json:
            print(format_rows(r["rows"], r["title"]))
            print()
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


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
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    pattern = ("an indexer on every layer" if len(shape.index_layers) == shape.num_layers else
               f"an indexer on {len(shape.index_layers)} layers (index_topk_freq {args.index_topk_freq}, "
               f"index_skip_topk_offset {args.index_skip_topk_offset}, GlmMoeDsaConfig's rule)")
    table = [{"": k, **{r["format"]: r[k] for r in rows}} for k in rows[0] if k != "format"]
    print(format_rows(table, f"{args.model}: {shape.num_layers} layers, latent {shape.kv_lora_rank} + "
                             f"{shape.rope_dim} rope on every layer, {pattern}, indexer key {shape.index_head_dim}; "
                             f"CP {args.cp}; fp8 = DeepSeek's packed cache format (fp8 values, fp32 scale per 128, "
                             "bf16 rope)"))
    return 0


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _requests(text: str) -> list[tuple[int, int]]:
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


def _run(args) -> int:
    from ..models import TinyLlama
    from ..runtime import RankFailure, RunConfig, run_scenario

    cfg = RunConfig(
        cp_size=args.cp, page_size=args.page, requests=args.requests, decode_steps=args.decode_steps,
        model=TinyLlama(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                        intermediate=2 * args.hidden, vocab=args.vocab, seed=args.seed),
        seed=args.seed, check_plans=args.check_plans, timeout=args.timeout,
    )
    try:
        r = run_scenario(cfg)
    except (RankFailure, ValueError) as e:
        print(f"cpkv run: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(format_run(r))
    worst = max(r["max_abs_diff"].values())
    if worst > args.tolerance:
        print(f"FAIL: max abs logit difference {worst:.3g} > {args.tolerance}", file=sys.stderr)
        return 1
    return 0


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cpkv`` console command."""
    p = argparse.ArgumentParser(prog="cpkv", description="Owner-lane shared KV cache for context-parallel inference.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("simulate", help="seeded serving traces through the allocator and prefix cache, policies side by side")
    s.add_argument("--workload", choices=["multiturn", "shared-prompt", "longdoc", "all"], default="all",
                   help="which built-in trace (default all)")
    s.add_argument("--policies", type=lambda t: t.split(","), default=["least_full", "lane0", "oblivious"],
                   help="comma list of least_full, lane0, oblivious (default all three)")
    s.add_argument("--cp", type=_positive, default=8, help="ranks in the CP group (default 8)")
    s.add_argument("--page", type=_positive, default=16, help="tokens per page (default 16)")
    s.add_argument("--lane-pages", type=_positive, default=None, help="pages per lane (default: the workload's own)")
    s.add_argument("--admission", choices=["lanes", "none"], default="lanes",
                   help="lanes: admit while every lane can hold the running requests' needs (default); "
                        "none: admit everything, a stress mode")
    s.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    s.add_argument("--plot", metavar="FILE.png", help="write lane occupancy over time per policy")
    s.add_argument("--json", action="store_true", help="print the table as JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_simulate)

    r = sub.add_parser(
        "run", help="prefill and decode a batch on an N-process CP group sharing one KV cache, checked against transformers",
        description="Start N rank processes sharing one KV cache in POSIX shared memory; prefill a batch "
        "(each rank computes the tokens on pages it owns, writes them into its own segment, one fence per "
        "layer), then decode; compare every logit with transformers' forward of the full sequence. "
        "Exits 1 if a difference exceeds --tolerance, 2 if a rank fails.")
    r.add_argument("--cp", type=_positive, default=4, help="ranks in the CP group (default 4)")
    r.add_argument("--page", type=_positive, default=16, help="tokens per page (default 16)")
    r.add_argument("--requests", type=_requests, default="37:61,0:50,32:45,0:9,0:83",
                   help="comma list of [cached_prefix:]prompt_len; a cached prefix is prefilled first and "
                        "continued by the batch (default 37:61,0:50,32:45,0:9,0:83: one mid-page and one "
                        "page-aligned continuation)")
    r.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps per request (default 8)")
    r.add_argument("--layers", type=_positive, default=2, help="decoder layers (default 2)")
    r.add_argument("--hidden", type=_positive, default=64, help="hidden size (default 64)")
    r.add_argument("--heads", type=_positive, default=4, help="attention heads (default 4)")
    r.add_argument("--kv-heads", type=_positive, default=2, help="KV heads, GQA (default 2)")
    r.add_argument("--vocab", type=_positive, default=256, help="vocabulary size (default 256)")
    r.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    r.add_argument("--check-plans", action="store_true", help="debug: one collective per batch checks all ranks planned alike")
    r.add_argument("--tolerance", type=float, default=1e-4, help="max abs logit difference allowed (default 1e-4)")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds before the group is stopped (default 300)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(func=_run)

    b = sub.add_parser("bench", help="benchmarks: ratios against baselines measured in the same run")
    b.add_argument("what", choices=["alloc", "kv", "splits", "all"],
                   help="which benchmark (all: alloc and kv; splits runs process groups for minutes, by name only)")
    b.add_argument("--repeats", type=_positive, default=None,
                   help="timed rounds; the median is reported (default 21; splits: R prefill and 4R decode "
                        "rounds, R 5)")
    b.add_argument("--model", choices=["llama", "deepseek-v3.2", "all"], default="all", help="splits: which model")
    b.add_argument("--cp", type=_positive, default=4, help="splits: ranks in the group (default 4)")
    b.add_argument("--tokens", type=_positive, default=None,
                   help="splits: prefill tokens (default 16384 for llama, 4096 for deepseek-v3.2)")
    b.add_argument("--bs", type=_positive, default=4, help="splits: prefill requests (default 4)")
    b.add_argument("--decode-bs", type=_positive, default=64, help="splits: decode requests (default 64)")
    b.add_argument("--context", type=_positive, default=4096, help="splits: decode context per request (default 4096)")
    b.add_argument("--page", type=_positive, default=16, help="splits: tokens per page (default 16)")
    b.add_argument("--json", action="store_true", help="splits: print the rows and every rank's counters as JSON")
    b.set_defaults(func=_bench)
    k = sub.add_parser("bytes", help="KV bytes per token per rank of DeepSeek-V3.2 / GLM-5, replicated vs shared",
                       description="Per-token KV bytes of the real DSA shapes (MLA latent on every layer, indexer "
                       "keys on indexer layers), from the pool's families, in bf16 and DeepSeek's FP8 format: "
                       "replicated on every rank, latent shared with the indexer replicated, or both shared.")
    k.add_argument("--model", choices=["deepseek-v3.2", "glm-5"], default="deepseek-v3.2", help="which model")
    k.add_argument("--cp", type=_positive, default=8, help="ranks in the CP group (default 8)")
    k.add_argument("--index-topk-freq", type=_positive, default=1,
                   help="GLM-5: every how many layers an indexer runs (default 1: all, transformers' default)")
    k.add_argument("--index-skip-topk-offset", type=int, default=2,
                   help="GLM-5: the offset of that pattern (default 2; GLM-5.2 configs use freq 4, offset 3)")
    k.add_argument("--json", action="store_true", help="print the rows as JSON")
    k.set_defaults(func=_bytes)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
