"""The engine: the scheduler on a CP group, every rank computing its share on real KV.

Every rank builds the same scheduler over the same trace and runs the same
steps; a step's plan is carried out by :class:`RankExecutor` (backups, loads,
copies, then the forwards through :class:`~cpkv.runtime.runner.CPRunner`), and
the greedy tokens, all-gathered, close the step on every rank alike. With
``check``, rank 0 keeps every computed logit and compares each finished
request with ``transformers``' own forward of its full sequence (no cache) and
its greedy tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from ..consumers.hicache import HostPool, HostTier
from ..consumers.kv_pool import SharedKVPool
from ..models import build_adapter
from ..runtime.comm import Comm, DistComm, LocalComm, run_threads
from ..runtime.group import RankContext, launch
from ..runtime.progress import progress_bar
from ..runtime.runner import CPRunner
from .config import EngineConfig
from .rank import SharedBuffers, build_cache, build_rank, inject_fault, thread_buffers
from .scheduler import Scheduler
from .step_plan import Forward, StepPlan
from .trace import RequestSpec


class RankExecutor:
    """Carries out a :class:`StepPlan` on one rank; returns each batch's greedy tokens.

    Order: backups (IO rank, fenced before and after), loads (each owner),
    copies (each destination owner) and arrivals (KV from another group, by
    ``receive(plan)``, each owner writing its own segment), a fence, then the
    decode and prefill forwards, reading the scheduler's page table.
    """

    def __init__(self, runner: CPRunner, host: HostPool | None = None, check: bool = False, receive=None):
        self.runner, self.host, self.check, self.receive = runner, host, check, receive
        self.pool: SharedKVPool = runner.pool
        self.logits: dict[int, dict[int, torch.Tensor]] = {}  # request index -> position -> logits (check only)
        self.copied = self.backed_up = self.loaded = 0  # slots this rank moved

    def run(self, plan: StepPlan) -> list[list[int]]:
        """Execute ``plan``; the greedy token of every request of every batch, identical on every rank."""
        pool = self.pool
        if plan.backups:
            pool.fence()
            for b in plan.backups:
                self.backed_up += self.host.backup(pool, b.device, b.host)
            pool.fence()
        for x in plan.loads:
            self.loaded += self.host.load(pool, x.host, x.device)
        for c in plan.copies:
            self.copied += pool.copy_slots(c.src, c.dst)
        if plan.arrivals:
            if self.receive is None:
                raise ValueError(f"step {plan.step} plans KV arrivals but this executor has no receive")
            self.receive(plan)
        if plan.loads or plan.copies or plan.arrivals:
            pool.fence()
        return [self._forward(b) for b in plan.forwards()]

    def _forward(self, b: Forward) -> list[int]:
        run, a = self.runner, b.alloc
        idx, logits = run.forward(b.rows, a, b.ids, decode=b.decode, table=b.table)
        last = a.extend_start_loc + a.extend_lens - 1  # each request's last new token
        where = torch.full((a.out_cache_loc.numel(),), -1, dtype=torch.int64)
        where[idx] = torch.arange(idx.numel())
        mine = where[last] >= 0
        picks = (torch.nonzero(mine).flatten(), logits[where[last][mine]].argmax(-1))
        tokens = torch.empty(a.batch_size, dtype=torch.int64)
        for req, tok in run.comm.all_gather_object(picks):
            tokens[req] = tok
        if self.check:
            full = run.collect(a.out_cache_loc.numel(), idx, logits)
            if run.comm.rank == 0:
                pos, rows = a.positions.tolist(), a.request_of_token.tolist()
                for j, (p, i) in enumerate(zip(pos, rows)):
                    self.logits.setdefault(b.requests[i].index, {})[p] = full[j]
        return tokens.tolist()


def build_scheduler(cfg: EngineConfig, specs: list[RequestSpec]) -> Scheduler:
    """The scheduler every rank builds (same inputs, same state); ``TraceError``
    for a trace whose requests could never fit the cache."""
    host = HostTier(cfg.host_pages, cfg.page_size) if cfg.host_pages else None
    return Scheduler(specs, build_cache(cfg.cp_size, cfg.page_size, cfg.device_pages), chunk=cfg.chunk,
                     max_running=cfg.max_running, admission=cfg.admission, host=host)


def _engine_rank(ctx: RankContext, cfg: EngineConfig) -> dict | None:
    if cfg.device == "cuda":  # untested on hardware: NCCL, KV buffers over CUDA IPC, pinned host tier
        from ..runtime.device import pin_shared, share_device_buffer

        comm: Comm = DistComm(device=ctx.device) if ctx.distributed else LocalComm()
        adapter = build_adapter(cfg.model)
        adapter.model.to(ctx.device)
        return engine_rank(lambda tag, shape, dtype: share_device_buffer(ctx, tag, shape, dtype, ctx.device),
                           comm, cfg, adapter,
                           host_shared=lambda tag, shape, dtype: pin_shared(ctx.shared(tag, shape, dtype)))
    comm = DistComm() if ctx.distributed else LocalComm()
    return engine_rank(ctx.shared, comm, cfg, build_adapter(cfg.model))


def engine_rank(shared: SharedBuffers, comm: Comm, cfg: EngineConfig, adapter,
                host_shared: SharedBuffers | None = None) -> dict | None:
    """One rank of the engine: ``shared(tag, shape, dtype)`` gives the group's
    shared KV buffers (``host_shared`` its host tier's, default ``shared``),
    ``comm`` its collectives. Returns the report on rank 0."""
    specs = cfg.trace()
    sched = build_scheduler(cfg, specs)
    layout = sched.layout
    parts = build_rank(cfg, adapter, layout, comm, shared, sched.max_len + 1, cfg.host_pages, page_table=sched.table,
                       host_shared=host_shared)
    pool, runner = parts.pool, parts.runner
    ex = RankExecutor(runner, parts.host, check=cfg.check)
    bar = progress_bar(desc="steps", unit="step", disable=not (cfg.progress and comm.rank == 0), leave=False)
    t0 = time.perf_counter()
    while not sched.done:
        if sched.step == cfg.fail_step and comm.rank in (cfg.fail_rank, cfg.kill_rank):
            inject_fault(comm.rank, sched.step, kill=comm.rank == cfg.kill_rank)
        plan = sched.plan()
        if sched.complete(plan, ex.run(plan)):
            bar.set_postfix_str(f"{sched.stats.finished}/{len(specs)} requests finished", refresh=False)
        bar.update(1)
    seconds = time.perf_counter() - t0
    bar.close()
    own = layout.rank_pages(comm.rank)  # the logical pages of this rank's lane
    held = own[sched.cache.is_allocated(own)]
    moved = comm.all_gather_object({"rank": comm.rank, "copied": ex.copied, "backed_up": ex.backed_up,
                                    "loaded": ex.loaded, "tokens_computed": runner.tokens_computed,
                                    "kv_read": runner.kv_read, "moved_bytes": runner.moved_bytes,
                                    # at the end of the trace, before the cache is drained: the pages this rank
                                    # holds, by the allocator and by what this rank wrote into its segment
                                    "pages_allocated": int(held.size), "pages_written": pool.written_pages(held)})
    sched.drain()
    sched.check_drained()
    if comm.rank != 0:
        return None
    return report(cfg, sched, pool.page_bytes, moved, seconds, check(adapter.model, sched, ex) if cfg.check else None)


def check(model, sched: Scheduler, ex: RankExecutor) -> dict:
    """Every request against ``transformers``: its full forward (no cache) over
    the request's sequence, every computed logit within tolerance, and greedy
    decoding giving the same tokens."""
    worst, mismatched, logits_checked = 0.0, [], 0
    with torch.no_grad():
        for r in sched.requests:
            seq = torch.tensor(r.seq[:-1], dtype=torch.int64)
            ref = model(seq[None].to(model.device)).logits[0].cpu()
            got = ex.logits.get(r.index, {})
            if got:
                pos = torch.tensor(sorted(got))
                ours = torch.stack([got[p] for p in pos.tolist()])
                worst = max(worst, float((ours - ref[pos]).abs().max()))
                logits_checked += pos.numel()
            n = len(r.prompt)
            if ref[n - 1 :].argmax(-1).tolist() != r.generated:
                mismatched.append(r.spec.id)
    return {"max_abs_diff": worst, "logits_checked": logits_checked, "requests": len(sched.requests),
            "requests_matched": len(sched.requests) - len(mismatched), "mismatched": mismatched}


def report(cfg: EngineConfig, sched: Scheduler, page_bytes: int, ranks: list, seconds: float,
           checked: dict | None) -> dict:
    """The run's figures (see ``cpkv run --help``)."""
    st = sched.stats
    occ = np.array(st.occupancy) if st.occupancy else np.zeros((1, cfg.cp_size))
    peak_lane = occ.max(0)
    return {
        "config": {**asdict(cfg), "model": {"family": type(cfg.model).__name__, **asdict(cfg.model)}},
        "requests": len(sched.requests),
        "finished": st.finished,
        "steps": st.steps,
        "prompt_tokens": st.prompt_tokens,
        "generated_tokens": st.generated_tokens,
        "computed_tokens": st.computed_tokens,
        "device_hit_rate": st.hit_tokens / max(st.prompt_tokens, 1),
        "host_hit_rate": st.host_hit_tokens / max(st.prompt_tokens, 1),
        "mid_page_copies": st.copies,
        "chunk_continuations": st.chunk_continuations,
        "mid_page_continuations": st.mid_page_continuations,
        "evicted_pages": st.evicted_pages,
        "backup_pages": st.backup_pages,
        "backup_bytes": st.backup_pages * page_bytes,
        "load_pages": st.host_hit_tokens // cfg.page_size,
        "load_bytes": st.host_hit_tokens // cfg.page_size * page_bytes,
        "preemptions": st.preemptions,
        "refusals": st.refusals,
        "peak_kv_bytes_per_rank": [int(x) * page_bytes for x in peak_lane],
        "peak_replicated_kv_bytes": int(occ.sum(1).max()) * page_bytes,
        "max_lane_gap_pct": st.lane_gap(cfg.device_pages),
        "seconds": seconds,
        "tokens_per_second": st.generated_tokens / max(seconds, 1e-9),
        "ranks": ranks,
        "check": checked,
        "sequences": [(list(r.prompt), r.spec.max_new_tokens) for r in sched.requests],
        "occupancy": st.occupancy,
        "host_occupancy": st.host_occupancy,
    }


def run_engine_threads(cfg: EngineConfig, adapter=None) -> dict:
    """The engine with its ranks as threads of this process (tests; one shared
    model and one set of buffers, collectives through threads)."""
    adapter = adapter or build_adapter(cfg.model)
    shared = thread_buffers()
    return run_threads(cfg.cp_size, lambda comm: engine_rank(shared, comm, cfg, adapter), timeout=cfg.timeout)[0]


def run_engine(cfg: EngineConfig) -> dict:
    """Run the engine on a CP group of ``cfg.cp_size`` processes; rank 0's report."""
    cfg.model.config()
    specs = cfg.trace()
    build_scheduler(cfg, specs)  # refuse a trace that cannot run before starting any process
    return launch(_engine_rank, cfg.cp_size, cfg, timeout=cfg.timeout, device=cfg.device)
