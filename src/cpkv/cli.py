"""The ``cpkv`` command: simulate, bench, run."""

from __future__ import annotations

import argparse
import json
import sys


def _simulate(args) -> int:
    from .bench import format_rows
    from .simulate import compare, multiturn_trace

    trace = multiturn_trace(args.conversations, args.seed)
    runs = compare(trace, cp_size=args.cp, page_size=args.page, lane_pages=args.lane_pages,
                   progress=not args.no_progress and not args.json)
    rows = [r.summary() for r in runs]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows, f"multiturn trace: {args.conversations} conversations, seed {args.seed}, "
                                f"N={args.cp}, page {args.page}, {args.lane_pages} pages per lane"))
    return 0


def _bench(args) -> int:
    from .bench import bench_alloc, format_rows

    if args.what in ("alloc", "all"):
        rows = bench_alloc(repeats=args.repeats)
        print(format_rows(rows, "alloc: page 64, cp 8, 262144 extend tokens; median of "
                                f"{args.repeats} interleaved runs; floor = torch.arange of the same length"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cpkv`` console command."""
    p = argparse.ArgumentParser(prog="cpkv", description="Owner-lane shared KV cache for context-parallel inference.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("simulate", help="run a seeded serving trace through the owner-lane allocator")
    s.add_argument("--cp", type=int, default=8, help="ranks in the CP group (default 8)")
    s.add_argument("--page", type=int, default=16, help="tokens per page (default 16)")
    s.add_argument("--lane-pages", type=int, default=448, help="pages per lane, i.e. per rank (default 448)")
    s.add_argument("--conversations", type=int, default=160, help="conversations in the trace (default 160)")
    s.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    s.add_argument("--json", action="store_true", help="print the table as JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_simulate)

    b = sub.add_parser("bench", help="benchmarks: ratios against baselines measured in the same run")
    b.add_argument("what", choices=["alloc", "all"], help="which benchmark")
    b.add_argument("--repeats", type=int, default=21, help="timed rounds; the median is reported (default 21)")
    b.set_defaults(func=_bench)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
