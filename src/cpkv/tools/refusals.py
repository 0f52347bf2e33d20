"""``cpkv run``'s sizes checked against this machine before anything is allocated.

Each check is arithmetic on the flags and the trace (nothing is allocated, no
process starts) and refuses through ``parser.error``: one line, exit 2, naming
the flag, what it would take and the value to give. They run in this order, so
the first flag at fault is the one named: the group's size against the cores
(``--cp``, or the world torchrun made), the device cache (``--kv-memory`` /
``--device-pages``), the host tier (``--host-pages``), the scheduler's page table
(``--max-running``), then the trace against the cache (``--workload``), and
last the whole group together (:func:`~cpkv.tools.flags.refuse_unless_fits`)
and the run's expected time against ``--timeout``. ``cpkv simulate``'s lanes
are checked the same way (:func:`refuse_simulate_sizes`).
"""

from __future__ import annotations

import math
import sys


def usable_bytes(capacity=None) -> int:
    """Memory a run may use here: what the machine has available, less the
    reserve :func:`~cpkv.runtime.sizing.check_capacity` keeps free."""
    from ..runtime.sizing import MEMORY_RESERVE, machine_capacity

    cap = capacity or machine_capacity()
    return int(cap.available_bytes * (1 - MEMORY_RESERVE))


def refuse_group_size(parser, ranks: int, flag: str = "--cp", capacity=None) -> None:
    """``parser.error`` when ``ranks`` are more than this machine's cores can
    schedule (:data:`~cpkv.runtime.sizing.MAX_RANKS_PER_CORE` per core)."""
    from ..runtime.sizing import MAX_RANKS_PER_CORE, machine_capacity

    cores = (capacity or machine_capacity()).cores
    if ranks > MAX_RANKS_PER_CORE * cores:
        parser.error(f"{flag} {ranks}: more than {MAX_RANKS_PER_CORE} ranks per core on {cores} cores; give "
                     f"{flag} {MAX_RANKS_PER_CORE * cores} or fewer")


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


def refuse_sizes(parser, cfg, specs, capacity=None, trace: bool = True) -> None:
    """``parser.error`` for a device cache, host tier or page table this
    machine cannot hold (each alone, before the group's total), then, with
    ``trace``, for a trace the cache could never hold (one short line, the
    memory to give)."""
    from ..engine.rank import cache_lane_pages
    from ..engine.trace import CacheTooSmall, check_fits, kv_tokens
    from ..runtime.sizing import format_size

    usable, page = usable_bytes(capacity), cfg.page_bytes()
    ranks = cfg.cp_size  # each rank holds its lane (shared) or its whole copy (replicated)
    device = cfg.device_pages * page * ranks
    have = f"more than this machine can give ({format_size(usable)} usable)"
    if device > usable:
        most = usable // (page * ranks)
        given = f"--kv-memory {format_size(cfg.kv_memory)}" if cfg.kv_memory else f"--device-pages {cfg.device_pages}"
        parser.error(f"{given}: the device cache takes {format_size(device)} ({cfg.device_pages} pages of "
                     f"{format_size(page)} on each of {ranks} ranks), {have}; give --kv-memory "
                     f"{format_size(most * page)} or less (--device-pages {most})")
    if cfg.host_pages * page > usable - device:
        most = max(usable - device, 0) // page
        parser.error(f"--host-pages {cfg.host_pages}: the host tier takes {format_size(cfg.host_pages * page)} "
                     f"beside the device cache's {format_size(device)}, {have}; give --host-pages {most} or less")
    longest = max(kv_tokens(specs), default=0) + 1
    table = 8 * cfg.max_running * longest * cfg.cp_size  # one page table a rank
    if table > usable - device:
        most = max(usable - device, 0) // (8 * longest * cfg.cp_size)
        parser.error(f"--max-running {cfg.max_running}: the scheduler's page table takes {format_size(table)} "
                     f"({cfg.max_running} rows of {longest} slots on each of {cfg.cp_size} ranks), {have}; give "
                     f"--max-running {max(most, 1)} or less (the trace has {len(specs)} requests)")
    if not trace:
        return
    lanes = 1 if cfg.replicated else cfg.cp_size
    try:
        check_fits(specs, cache_lane_pages(lanes, cfg.device_pages), cfg.page_size)
    except CacheTooSmall as e:
        need = e.pages_per_rank_needed
        now = f"--kv-memory {format_size(cfg.kv_memory)}" if cfg.kv_memory else f"--device-pages {cfg.device_pages}"
        parser.error(f"{now}: the {cfg.kv} device cache can never hold {len(e.requests)} of the trace's "
                     f"{len(specs)} requests (the longest needs {need} pages per rank, it holds "
                     f"{cfg.device_pages}); give --kv-memory {format_size(need * page)} or more "
                     f"(--device-pages {need})")


def refuse_if_past_timeout(parser, cfg, specs, world_size: int, capacity=None) -> float:
    """``parser.error`` when the run is expected to outlast ``--timeout``
    (steps from :func:`~cpkv.engine.trace.expected_steps`, seconds from
    :func:`~cpkv.runtime.sizing.expected_run_seconds`); a run expected to take
    over :data:`SAY_HOW_LONG_S` but within it says so on stderr. Returns the
    estimate."""
    from ..engine.trace import expected_steps
    from ..runtime.sizing import expected_run_seconds, machine_capacity

    steps = expected_steps(specs, cfg.chunk, cfg.max_running)
    cores = (capacity or machine_capacity()).cores
    secs = expected_run_seconds(world_size, steps, cores)
    what = f"about {steps} steps on {world_size} ranks and {cores} cores"
    if secs > cfg.timeout:
        parser.error(f"--timeout {cfg.timeout:g}: the run is expected to take about {secs / 60:.0f} min "
                     f"({secs:.0f} s: {what}); give --timeout {int(secs * 1.5) + 1} or more")
    if secs > SAY_HOW_LONG_S:
        print(f"cpkv run: expect about {secs / 60:.0f} min: {what}", file=sys.stderr)
    return secs


def refuse_simulate_sizes(parser, args) -> None:
    """``cpkv simulate``: ``parser.error`` for lanes whose bookkeeping this
    machine cannot hold (the simulator allocates no KV, only the caches' page
    bookkeeping: ``--cp`` times ``--lane-pages``), then for a workload whose
    longest request its cache could never hold, with the ``--lane-pages`` to give."""
    from ..engine.rank import cache_lane_pages
    from ..engine.trace import CacheTooSmall, check_fits
    from ..engine.config import BOOKKEEPING_BYTES_PER_PAGE
    from ..runtime.sizing import format_size
    from .simulate import SIM_WORKLOADS

    for name in list(SIM_WORKLOADS) if "all" in args.workload else list(dict.fromkeys(args.workload)):
        w = SIM_WORKLOADS[name](seed=args.seed)
        lane_pages = args.lane_pages or w.lane_pages
        pages, usable = args.cp * lane_pages + args.host_pages, usable_bytes()
        if BOOKKEEPING_BYTES_PER_PAGE * pages > usable:  # no KV is simulated, only the caches' page bookkeeping
            most = max((usable // BOOKKEEPING_BYTES_PER_PAGE - args.host_pages) // lane_pages, 1)
            parser.error(f"--cp {args.cp} with --lane-pages {lane_pages}: {pages} pages take "
                         f"{format_size(BOOKKEEPING_BYTES_PER_PAGE * pages)} of bookkeeping, more than this machine "
                         f"can give ({format_size(usable)} usable); give --cp {most} or fewer")
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
    refuses, for caches whose bookkeeping this machine cannot hold, and for a trace with a request that a mode's
    device cache at ``--kv-memory`` could never hold (every mode and KV dtype asked for, one short line, the
    memory to give), as :func:`refuse_sizes` refuses a model run's trace."""
    import dataclasses

    from ..engine.config import BOOKKEEPING_BYTES_PER_PAGE
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
    usable = usable_bytes()
    hosts = args.host_memory if args.host_memory is not None else [0, HOST_MEMORY]
    for dtype in args.kv_dtype or ("bfloat16", "fp8"):
        for kv in args.kv or KV_MODES:
            cfg = dataclasses.replace(base, kv_dtype=dtype, host_memory=max(hosts))
            token_bytes = cfg.cost_model(kv).kv_token_bytes
            try:
                device, host = cfg.pages(token_bytes)
            except ValueError as e:
                parser.error(f"--kv-memory: {e}")
            lanes = 1 if kv == "replicated" else cfg.cp_size
            if BOOKKEEPING_BYTES_PER_PAGE * (lanes * device + host) > usable:
                parser.error(f"--kv-memory {format_size(cfg.kv_memory)} with --host-memory {format_size(max(hosts))}: "
                             f"{lanes * device + host} pages take "
                             f"{format_size(BOOKKEEPING_BYTES_PER_PAGE * (lanes * device + host))} of bookkeeping, "
                             f"more than this machine can give ({format_size(usable)} usable); give less")
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


#: Expected seconds above which ``cpkv run`` says, before it starts, how long it expects to take.
SAY_HOW_LONG_S = 60.0
