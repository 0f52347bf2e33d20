"""One rank of a disaggregated run, and the two ways to run one: processes or threads."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from types import SimpleNamespace

from ...consumers.transfer import check_formats
from ...models import build_adapter
from ...runtime.comm import Comm, DistComm, run_threads, thread_group
from ...runtime import reaper as reaper_mod
from ...runtime.group import RankContext, RankFailure, launch
from ...runtime.p2p import DistP2P, thread_p2p
from ...runtime.progress import progress_bar
from ..config import DisaggConfig
from ..check import check
from ..engine import RankExecutor
from ..rank import SharedBuffers, build_rank, thread_buffers
from .control import DisaggControl
from .figures import disagg_report
from .link import TransferLink

SIDES = ("prefill", "decode")


class DisaggFailure(RankFailure):
    """A disaggregated run failed: ``rank`` is the world rank that failed
    first (as :class:`RankFailure` names it); ``aborts`` holds the abort
    reports the surviving ranks wrote (side, world rank, transfer, requests,
    pages freed, time), in world-rank order."""

    def __init__(self, cause: RankFailure, aborts: list[dict]):
        self.rank, self.details, self.cause, self.aborts = cause.rank, getattr(cause, "details", None), cause, aborts
        text = str(cause)
        if aborts:
            by_side = {}
            for a in aborts:
                by_side.setdefault(a["side"], []).append(a)
            text += "; " + "; ".join(
                f"{side} ranks {[a['world_rank'] for a in got]} aborted transfer {got[0]['transfer']}, each freeing "
                f"{got[0]['freed_pages']} pages of {got[0]['requests']} in its allocator" for side, got in by_side.items())
        RuntimeError.__init__(self, text)


def disagg_rank(world: Comm, group: Comm, side: str, shared: SharedBuffers, transport, cfg: DisaggConfig, adapter,
                report_dir: str | None = None) -> dict | None:
    """One rank of a disaggregated run. ``world`` spans both groups (world
    rank = prefill group rank, or M + decode group rank), ``group`` is this
    rank's own group, ``shared(tag, shape, dtype)`` gives that group's shared
    buffers, ``transport`` its point-to-point messages to world ranks. Returns
    the report on world rank 0."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    M = cfg.prefill_size
    fams = adapter.kv_families(cfg.kv_dtype if side == "prefill" else cfg.d_kv_dtype)
    agree(world, side, fams, cfg.prefill_size)
    ctl = DisaggControl(cfg, cfg.trace(), fams)
    mine = ctl.prefill if side == "prefill" else ctl.decode
    # the prefill group runs no decode: its runner gets a fixed split, not the decode group's cost model
    rank_cfg = cfg if side == "decode" else dataclasses.replace(cfg, decode_split="owner", decode_costs=None)
    parts = build_rank(rank_cfg, adapter, mine.layout, group, shared, cfg.host_pages if side == "prefill" else 0)
    runner = parts.runner
    link = TransferLink(cfg, world.rank, side, parts.pool, transport)
    ex = RankExecutor(runner, parts.host, check=cfg.check, receive=link.receive if side == "decode" else None)
    bar = progress_bar(total=len(ctl.decode.requests), desc="requests", unit="req",
                       disable=not (cfg.progress and world.rank == 0), leave=False)
    t0, limit = time.perf_counter(), 100 * (len(ctl.decode.requests) + ctl.max_len) + 1000
    while not ctl.done:
        if ctl.decode.step > limit:
            raise RuntimeError(f"no progress after {ctl.decode.step} steps")
        st = link.step = ctl.plan()
        try:
            if side == "prefill":
                pending = link.send()
                tokens = ex.run(st.prefill)
                link.wait(pending)
            else:
                tokens = ex.run(st.decode)
            got = world.all_gather_object(tokens if group.rank == 0 else None)  # closes (and confirms) the step
        except Exception as e:
            if st.transfer is not None:
                raise link.abort(ctl, e, report_dir) from e
            raise
        before = ctl.decode.stats.finished
        ctl.complete(st, got[0], got[M])
        bar.update(ctl.decode.stats.finished - before)
    seconds = time.perf_counter() - t0
    bar.close()
    records = (ex.logits, ex.stored, ex.selected) if cfg.check and group.rank == 0 else None
    ranks = world.all_gather_object({"world_rank": world.rank, "side": side, "group_rank": group.rank,
                                     "bytes": link.bytes, "messages": link.messages,
                                     "transfer_seconds": link.seconds, "digest": ctl.digest,
                                     "tokens_computed": runner.tokens_computed, "records": records,
                                     "decode_splits": dict(runner.decode_choices)})
    if ctl.prefill.held:
        raise AssertionError(f"prefill requests {sorted(ctl.prefill.held)} still hold KV after the trace")
    for sched in (ctl.prefill, ctl.decode):
        sched.drain()
        sched.check_drained()
    if world.rank != 0:
        return None
    checked = None
    if cfg.check:
        # logits and selections by request and position; the stored values a request read, by request (the
        # decode side's, from its last forward, replace the prefill side's: ranks come in world order)
        merged: tuple[dict, dict, dict] = ({}, {}, {})
        for x in ranks:
            if x["records"] is None:
                continue
            for into, got in zip(merged, x["records"]):
                for idx, by_pos in got.items():
                    into.setdefault(ctl.origin[idx] if x["side"] == "prefill" else idx, {}).update(by_pos)
        checked = check(adapter.model, ctl.decode, SimpleNamespace(logits=merged[0], stored=merged[1],
                                                                   selected=merged[2]), fams)
    return disagg_report(cfg, ctl, ranks, seconds, checked)


def agree(world: Comm, side: str, families, prefill_size: int) -> None:
    """Every rank of both groups, at the start: one all-gather of each rank's
    cache families, then :func:`~cpkv.consumers.transfer.check_formats`
    between the prefill side's (world rank 0) and the decode side's (world
    rank ``prefill_size``). Groups that store their KV differently (another kv
    dtype) are refused on every rank alike with ``UnsupportedPagePlan``
    before any byte moves. [[RFC-0001:C-KV-FORMAT]]"""
    got = world.all_gather_object((side, list(families)))
    check_formats(got[0][1], got[prefill_size][1])


# -- the two ways to run it -------------------------------------------------------------------
def _disagg_ranks(ctx: RankContext, cfgs: list[DisaggConfig], report_dir: str | None) -> list | None:
    """Run every configuration in turn on the first ``M + N`` ranks of the
    launched world (the others wait); world rank 0 returns the reports."""
    import torch.distributed as dist

    reports = []
    for i, cfg in enumerate(cfgs):
        M, W = cfg.prefill_size, cfg.world_size
        ranks, prefill_ranks, decode_ranks = list(range(W)), list(range(M)), list(range(M, W))
        # every launched rank makes every group, in the same order
        wg, pg, dg = dist.new_group(ranks), dist.new_group(prefill_ranks), dist.new_group(decode_ranks)
        if ctx.rank < W:
            side = "prefill" if ctx.rank < M else "decode"
            sub, members, creator = (pg, prefill_ranks, 0) if side == "prefill" else (dg, decode_ranks, M)
            tag = f"c{i}_{side[0]}_"

            def shared(name, shape, dtype, tag=tag, creator=creator, sub=sub):
                return ctx.shared(tag + name, shape, dtype, creator=creator, group=sub)

            reports.append(disagg_rank(DistComm(wg, ranks), DistComm(sub, members), side, shared,
                                       DistP2P(wg, timeout=cfg.transfer_timeout), cfg, build_adapter(cfg.model),
                                       report_dir))
        if ctx.world_size > 1:
            dist.barrier()
    return reports if ctx.rank == 0 else None


def _read_reports(folder: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("abort-") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda a: a["world_rank"])


def run_disagg(cfg: DisaggConfig) -> dict:
    """Run a prefill group of ``cfg.prefill_size`` and a decode group of
    ``cfg.decode_size`` processes in one world; world rank 0's report.
    Raises :class:`DisaggFailure` (a :class:`RankFailure`) naming the rank
    that failed first, with the surviving ranks' abort reports."""
    return run_disagg_sweep([cfg])[0]


def run_disagg_sweep(cfgs: list[DisaggConfig]) -> list[dict]:
    """Run several configurations one after the other in ONE launched world of
    ``max(M + N)`` processes (each on its first ``M + N`` ranks, with its own
    groups and segments), paying the processes' start once; their reports in
    order. Raises as :func:`run_disagg` does.

    Nothing outlives this process, however it ends (``kill -9`` included): the
    two groups are one launched world, whose every rank dies with this process
    at any moment (:mod:`cpkv.runtime.group`), and the folder of the abort
    reports is registered with this process's reaper before it exists
    (:mod:`cpkv.runtime.reaper`), which removes it once the ranks are gone."""
    if not cfgs:
        raise ValueError("no configuration to run")
    for cfg in cfgs:
        cfg.validate()
    cfgs = [cfg.sized() for cfg in cfgs]  # at launch, once: every rank receives the sized configurations
    for cfg in cfgs:
        cfg.model.config()
        DisaggControl(cfg, cfg.trace())  # refuse a trace that cannot run before starting any process
    reaper = reaper_mod.reaper()
    folder = reaper.folder("cpkv_disagg")  # the abort reports; the reaper's if this process dies
    try:
        return launch(_disagg_ranks, max(c.world_size for c in cfgs), list(cfgs), folder,
                      timeout=sum(c.timeout for c in cfgs))
    except RankFailure as e:
        raise DisaggFailure(e, _read_reports(folder)) from e
    finally:
        reaper.remove(path=folder)


def run_disagg_threads(cfg: DisaggConfig, adapter=None) -> dict:
    """The same run with every rank of both groups a thread of this process
    (tests; one shared model, one set of buffers per group, collectives and
    messages through threads); sized here."""
    cfg.validate()
    cfg = cfg.sized()
    DisaggControl(cfg, cfg.trace())  # refuse a trace that cannot run before starting any thread
    adapter = adapter or build_adapter(cfg.model)
    M, W = cfg.prefill_size, cfg.world_size
    groups = {"prefill": thread_group(M, cfg.timeout), "decode": thread_group(cfg.decode_size, cfg.timeout)}
    links = thread_p2p(W, cfg.transfer_timeout)
    buffers = {side: thread_buffers() for side in SIDES}

    def body(world):
        side = "prefill" if world.rank < M else "decode"
        group = groups[side][world.rank if side == "prefill" else world.rank - M]
        try:
            return disagg_rank(world, group, side, buffers[side], links[world.rank], cfg, adapter)
        except BaseException:
            links[world.rank].abort()
            for g in groups.values():
                g[0].abort()
            raise

    return run_threads(W, body, timeout=cfg.timeout)[0]
