"""The trace against the cache, refused after the command line is parsed and before anything is allocated.

Every size was checked against this machine and the work before anything heavy was imported
(:mod:`cpkv.tools.sizes`); what is left needs the contract's lane arithmetic (and so torch): a trace with a
request the device cache could never hold (:func:`~cpkv.engine.trace.check_fits`), refused in one short line
through ``parser.error`` (exit 2) with the memory to give, or, when this machine cannot give it, the trace to
shorten. ``cpkv run`` (:func:`refuse_unless_trace_fits`), ``cpkv simulate``'s built-in traces
(:func:`refuse_simulate_sizes`) and its Mooncake traces (:func:`refuse_mooncake_sizes`); and a ``--cp`` that
torchrun's world disagrees with (:func:`refuse_torchrun_mismatch`).
"""

from __future__ import annotations

import math


def refuse_torchrun_mismatch(parser, cp: int | None) -> None:
    """Under torchrun, ``parser.error`` for a ``--cp`` that is not the world's size
    (every rank of a one-node world is one CP group)."""
    from ..runtime.torchrun import torchrun_env

    try:
        env = torchrun_env()
    except ValueError as e:
        parser.error(f"torchrun's environment: {e}")
    if env is not None and cp is not None and cp != env.world_size:
        parser.error(f"--cp {cp}: torchrun started {env.world_size} ranks, one CP group; give --cp "
                     f"{env.world_size} or leave --cp out")


def _most_pages(cfg, capacity=None) -> int:
    """Device pages per rank the largest cache this machine holds beside the rest of ``cfg``'s run has (the
    search :mod:`cpkv.tools.sizes` refuses a ``--device-pages`` with)."""
    import dataclasses

    from ..engine.config import engine_footprint
    from ..runtime.sizing import GroupTooLarge, check_capacity, machine_capacity
    from .sizes import largest_where

    capacity = capacity or machine_capacity()
    specs = cfg.trace()

    def fits(pages: int) -> bool:
        try:
            check_capacity(engine_footprint(dataclasses.replace(cfg, device_pages=pages), specs),
                           timeout=cfg.timeout, capacity=capacity)
            return True
        except GroupTooLarge:
            return False
    return largest_where(fits, 1, 2**40) or 0


def refuse_unless_trace_fits(parser, cfg, specs) -> None:
    """``cpkv run``: ``parser.error`` for a trace ``cfg``'s device cache could never hold, with the memory to
    give; when this machine cannot give it, the trace to shorten."""
    from ..engine.rank import cache_lane_pages
    from ..engine.trace import CacheTooSmall, check_fits
    from ..runtime.sizing import format_size

    lanes = 1 if cfg.replicated else cfg.cp_size
    try:
        check_fits(specs, cache_lane_pages(lanes, cfg.device_pages), cfg.page_size)
    except CacheTooSmall as e:
        need, page = e.pages_per_rank_needed, cfg.page_bytes()
        now = f"--kv-memory {format_size(cfg.kv_memory)}" if cfg.kv_memory else f"--device-pages {cfg.device_pages}"
        head = (f"{now}: the {cfg.kv} device cache can never hold {len(e.requests)} of the trace's {len(specs)} "
                f"requests (the longest needs {need} pages per rank, it holds {cfg.device_pages})")
        most = _most_pages(cfg)
        if need <= most:
            parser.error(f"{head}; give --kv-memory {format_size(need * page)} or more (--device-pages {need})")
        parser.error(f"{head}, and this machine holds at most {most} beside the run; give a shorter trace "
                     "(--requests, --scale, --max-output) or a smaller --page")


def refuse_simulate_sizes(parser, args) -> None:
    """``cpkv simulate``: ``parser.error`` for a workload whose longest request its cache could never hold,
    with the ``--lane-pages`` to give."""
    from ..engine.rank import cache_lane_pages
    from ..engine.trace import CacheTooSmall, check_fits
    from .simulate import SIM_WORKLOADS

    for name in list(SIM_WORKLOADS) if "all" in args.workload else list(dict.fromkeys(args.workload)):
        w = SIM_WORKLOADS[name](seed=args.seed)
        lane_pages = args.lane_pages or w.lane_pages
        lanes = [(1, args.cp * lane_pages) if p == "oblivious" else (args.cp, lane_pages) for p in args.policies]
        try:
            for n, pages in lanes:
                check_fits(list(w.requests), cache_lane_pages(n, pages), args.page)
        except CacheTooSmall as e:
            parser.error(f"--lane-pages {lane_pages}: {name}'s cache can never hold {len(e.requests)} of its "
                         f"{len(w.requests)} requests (the longest needs {e.pages_per_rank_needed} pages per lane); "
                         f"give --lane-pages {e.pages_per_rank_needed} or more")


def refuse_mooncake_sizes(parser, args) -> None:
    """``cpkv simulate`` with Mooncake traces: reads them (``args.mooncake_traces``, so the command reads them
    once; a malformed line refused with its path and line), then ``parser.error`` for a configuration the replay
    refuses and for a trace with a request that a mode's device cache at ``--kv-memory`` could never hold (every
    mode and KV dtype asked for, one short line, the memory to give)."""
    import dataclasses

    from ..engine.rank import cache_lane_pages
    from ..engine.trace import CacheTooSmall, TraceError, check_fits
    from ..runtime.sizing import format_size
    from .replay import KV_MODES
    from .replay_report import HOST_MEMORY, load_traces, replay_base

    try:
        _, base = replay_base(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.mooncake_traces = load_traces(args)
    except (TraceError, OSError) as e:
        parser.error(f"--workload: {e}")
    hosts = args.host_memory if args.host_memory is not None else [0, HOST_MEMORY]
    for dtype in args.kv_dtype or ("bfloat16", "fp8"):
        for kv in args.kv or KV_MODES:
            cfg = dataclasses.replace(base, kv_dtype=dtype, host_memory=max(hosts))
            token_bytes = cfg.cost_model(kv).kv_token_bytes
            try:
                device, _ = cfg.pages(token_bytes)
            except ValueError as e:
                parser.error(f"--kv-memory: {e}")
            lanes = 1 if kv == "replicated" else cfg.cp_size
            page = cfg.page_size * token_bytes
            for name, trace in args.mooncake_traces:
                try:
                    check_fits(trace.specs, cache_lane_pages(lanes, device), cfg.page_size)
                except CacheTooSmall as e:
                    need = e.pages_per_rank_needed
                    parser.error(f"--kv-memory {format_size(cfg.kv_memory)}: the {kv} {dtype} device cache can never "
                                 f"hold {len(e.requests)} of {name}'s {len(trace.specs)} requests (the longest needs "
                                 f"{need} pages of {format_size(int(page))} per rank, it holds {device}); give "
                                 f"--kv-memory {math.ceil(need * page)} ({format_size(math.ceil(need * page))}) or more")
