"""The engine: the scheduler on a CP group, every rank computing its share on real KV.

Every rank builds the same scheduler over the same trace and runs the same
steps; a step's plan is carried out by :class:`RankExecutor` (backups, loads,
copies, then the step's forward through :class:`~cpkv.runtime.runner.CPRunner`), and
the greedy tokens, all-gathered, close the step on every rank alike. With
``check``, rank 0 keeps every computed logit, every DSA selection and each
request's stored context, and compares each finished request with
``transformers``' own forward of its full sequence at those values and
selections and its greedy tokens (:mod:`.check`, :mod:`.exactness`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch

from ..consumers.hicache import HostPool, HostTier
from ..consumers.kv_events import KVEventSink
from ..consumers.kv_pool import SharedKVPool
from ..models import build_adapter
from ..runtime.batch import choose_backend
from ..runtime.comm import Comm, DistComm, LocalComm, run_threads
from ..runtime.group import RankContext, RankFailure, launch
from ..runtime.progress import RunProgress, progress_bar
from ..runtime.runner import CPRunner
from .check import check
from .config import EngineConfig
from .latency import LatencyClock, latency_report
from .records import outputs
from .rank import SharedBuffers, build_cache, build_rank, thread_buffers
from .scheduler import Scheduler
from .step_plan import Forward, StepPlan
from .trace import RequestSpec


class RankExecutor:
    """Carries out a :class:`StepPlan` on one rank; returns each batch's greedy tokens.

    Order: backups (IO rank, fenced before and after), loads (each owner),
    copies (each destination owner) and arrivals (KV from another group, by
    ``receive(plan)``, each owner writing its own segment), a fence, then the
    step's forward (decodes and prefill chunks in one pass), reading the
    scheduler's page table.
    """

    def __init__(self, runner: CPRunner, host: HostPool | None = None, check: bool = False, receive=None):
        self.runner, self.host, self.check, self.receive = runner, host, check, receive
        self.pool: SharedKVPool = runner.pool
        self.logits: dict[int, dict[int, torch.Tensor]] = {}  # request index -> position -> logits (check only)
        self.selected: dict[int, dict[int, torch.Tensor]] = {}  # the same -> sparse selection (check, DSA only)
        self.stored: dict[int, dict[str, torch.Tensor]] = {}  # request index -> family -> what it read (check)
        self.copied = self.backed_up = self.loaded = 0  # slots this rank moved

    def run(self, plan: StepPlan) -> list[list[int]]:
        """Execute ``plan``; the greedy token of every request of its forward,
        identical on every rank (one list per :meth:`StepPlan.forwards`). The
        step's decodes and prefill chunks are one forward, as the scheduler
        planned them; ``--decode-split`` governs a forward of decodes only."""
        pool = self.pool
        if plan.backups:
            pool.tier_fence()
            for b in plan.backups:
                self.backed_up += self.host.backup(pool, b.device, b.host)
            pool.tier_fence()
        for x in plan.loads:
            self.loaded += self.host.load(pool, x.host, x.device)
        for c in plan.copies:
            self.copied += pool.copy_slots(c.src, c.dst)
        if plan.arrivals:
            if self.receive is None:
                raise ValueError(f"step {plan.step} plans KV arrivals but this executor has no receive")
            self.receive(plan)
        if plan.loads or plan.copies or plan.arrivals:
            pool.tier_fence()
        return [self._forward(b) for b in plan.forwards()]

    def _forward(self, b: Forward) -> list[int]:
        run, a = self.runner, b.alloc
        idx, logits = run.forward(b.rows, a, b.ids, decode=b.decode, table=b.table)
        if self.check and run.comm.rank == 0:  # before the all-gather below: until rank 0 joins, no rank moves on
            self._read_context(b, b.table)
        last = a.extend_start_loc + a.extend_lens - 1  # each request's last new token
        where = torch.full((a.out_cache_loc.numel(),), -1, dtype=torch.int64)
        where[idx] = torch.arange(idx.numel())
        mine = where[last] >= 0
        picks = (torch.nonzero(mine).flatten(), logits[where[last][mine]].argmax(-1))
        tokens = torch.empty(a.batch_size, dtype=torch.int64)
        for req, tok in run.comm.all_gather_object(picks):
            tokens[req] = tok
        if self.check:
            n = a.out_cache_loc.numel()
            full = run.collect(n, idx, logits)
            sel = None if run.selected is None else run.collect(n, idx, run.selected.cpu())
            if run.comm.rank == 0:
                pos, rows = a.positions.tolist(), a.request_of_token.tolist()
                for j, (p, i) in enumerate(zip(pos, rows)):
                    req = b.requests[i].index
                    self.logits.setdefault(req, {})[p] = full[j]
                    if sel is not None:
                        self.selected.setdefault(req, {})[p] = sel[j]
        return tokens.tolist()

    def _read_context(self, b: Forward, table) -> None:
        """Rank 0, with check, after a forward's closing fence and before the
        step's all-gather: for each request
        whose last forward this is (it samples its last token), the values of
        its whole context as the pool holds them, through the shared view and
        decoded, ``self.stored[index] = {name: [len(layers), S, *shape]}``
        (float32, host). What a request read stays in its pages until it
        finishes (a page it holds is never written, and a cached ancestor of
        a page outlives it), so this is what every logit it computed read;
        :mod:`.check` gives it to the reference."""
        for i, r in enumerate(b.requests):
            if not b.sample[i] or len(r.generated) + 1 < r.spec.max_new_tokens:
                continue
            n = int(b.alloc.seq_lens[i])
            slots = table.req_to_token[int(b.rows[i]), :n]
            self.stored[r.index] = {
                name: (rows if (f := self.pool.families[name]).format is None else f.format.decode(rows)).float().cpu()
                for name, rows in self.pool.read_all_layers(slots).items()}


def build_scheduler(cfg: EngineConfig, specs: list[RequestSpec]) -> Scheduler:
    """The scheduler every rank builds (same inputs, same state); ``TraceError``
    for a trace whose requests could never fit the cache, ``ValueError`` for a
    configuration not sized yet (:meth:`~cpkv.engine.config.RunConfig.sized`)."""
    cfg.check_sized()
    host = HostTier(cfg.host_pages, cfg.page_size) if cfg.host_pages else None
    lanes = 1 if cfg.replicated else cfg.cp_size  # a replicated copy: a plain paged allocator, no owner lanes
    return Scheduler(specs, build_cache(lanes, cfg.page_size, cfg.device_pages, cfg.eviction), chunk=cfg.chunk,
                     max_running=cfg.max_running, admission=cfg.admission, host=host,
                     wait_for_prefix=cfg.wait_for_prefix)


def connect_kv_events(sched: Scheduler, publisher) -> KVEventSink:
    """Hook ``publisher`` (a :class:`~cpkv.consumers.kv_events_zmq.KVEventPublisher`)
    to the scheduler's caches: every full page entering or leaving the device
    cache as medium ``"GPU"``, the host tier's as ``"CPU"``; the stream starts
    with ``AllBlocksCleared``. The caller flushes the returned sink once per
    step. [[RFC-0001:C-KV-EVENTS]]"""
    sink = KVEventSink(publisher, sched.S)
    sched.cache.events = sink
    if sched.host is not None:
        sched.host.events = sink
    sink.cleared()
    return sink


@contextmanager
def kv_event_publisher(cfg: EngineConfig, rank: int):
    """Rank 0's publisher: a :class:`~cpkv.consumers.kv_events_zmq.KVEventRelay`
    to ``cfg.kv_events_relay`` (the sockets bound by the launcher), or else one
    bound here on ``cfg.kv_events`` with its replay socket on
    ``cfg.kv_events_replay``; ``None`` elsewhere, or without ``kv_events``.
    Closed on the way out, error or not."""
    if not cfg.kv_events or rank != 0:
        yield None
        return
    from ..consumers.kv_events_zmq import KVEventPublisher, KVEventRelay

    pub = KVEventRelay(cfg.kv_events_relay) if cfg.kv_events_relay else \
        KVEventPublisher(cfg.kv_events, cfg.kv_events_replay, buffer_steps=cfg.kv_events_buffer)
    try:
        yield pub
    finally:
        pub.close()


def _engine_rank(ctx: RankContext, cfg: EngineConfig, progress: RunProgress | None = None) -> dict | None:
    if cfg.device == "cuda":
        return gpu_engine_rank(ctx, DistComm(device=ctx.device) if ctx.distributed else LocalComm(), cfg, progress)
    comm = DistComm() if ctx.distributed else LocalComm()
    return engine_rank(ctx.shared, comm, cfg, build_adapter(cfg.model), progress)


def gpu_engine_rank(ctx, comm: Comm, cfg: EngineConfig, progress: RunProgress | None = None) -> dict | None:
    """One rank of the engine on ``ctx.device`` (a GPU), in ``ctx``'s group
    (:class:`~cpkv.runtime.group.RankContext`, or a torchrun rank's
    :class:`~cpkv.runtime.torchrun.JoinedContext`) with ``comm`` its
    collectives: the model on the device; each family's KV one segment per
    rank on its own GPU, the others' opened over CUDA IPC
    (:func:`~cpkv.runtime.device.group_segments`; a private copy on the device
    for ``--kv replicated``); the host tier in the group's shared memory,
    page-locked until ``ctx`` closes (:func:`~cpkv.runtime.device.pin_host`);
    the fence ``comm.barrier`` (on the device). Returns the report on rank 0."""
    from ..runtime.device import group_segments, pin_host

    adapter = build_adapter(cfg.model)
    adapter.model.to(ctx.device)
    return engine_rank(lambda tag, shape, dtype: group_segments(comm, tag, shape, dtype, ctx.device),
                       comm, cfg, adapter, progress,
                       host_shared=lambda tag, shape, dtype: pin_host(ctx.shared(tag, shape, dtype), ctx.at_close),
                       device=ctx.device)


def engine_rank(shared: SharedBuffers, comm: Comm, cfg: EngineConfig, adapter,
                progress: RunProgress | None = None, host_shared: SharedBuffers | None = None,
                device: torch.device | None = None) -> dict | None:
    """One rank of the engine: ``shared(tag, shape, dtype)`` gives the group's
    shared KV buffers (a rank-major tensor, or a
    :class:`~cpkv.consumers.kv_view.KVView` of per-rank segments;
    ``host_shared`` its host tier's, default ``shared``), ``comm`` its
    collectives, ``device`` where a replicated copy lives (default the CPU);
    rank 0 keeps ``progress`` (when given) up to
    date after every step. Idle steps (nothing runs, nothing is due) are
    skipped (:meth:`Scheduler.skip_idle`). Returns the report on rank 0.
    With ``cfg.kv_events``, rank 0 publishes its caches' KV events there."""
    with kv_event_publisher(cfg, comm.rank) as pub:
        return _run_rank(shared, comm, cfg, adapter, pub, progress, host_shared, device)


def _run_rank(shared: SharedBuffers, comm: Comm, cfg: EngineConfig, adapter, pub,
              progress: RunProgress | None, host_shared: SharedBuffers | None,
              device: torch.device | None = None) -> dict | None:
    specs = cfg.trace()
    sched = build_scheduler(cfg, specs)
    events = connect_kv_events(sched, pub) if pub is not None else None
    layout = sched.layout
    parts = build_rank(cfg, adapter, layout, comm, shared, cfg.host_pages, host_shared=host_shared, device=device)
    pool, runner = parts.pool, parts.runner
    ex = RankExecutor(runner, parts.host, check=cfg.check)
    bar = progress_bar(desc="steps", unit="step", disable=not (cfg.progress and comm.rank == 0), leave=False)
    progress = progress if comm.rank == 0 else None
    t0 = time.perf_counter()
    clock = LatencyClock(t0)
    while not sched.done:
        skipped = sched.skip_idle()
        plan = sched.plan()
        if sched.complete(plan, ex.run(plan)):
            bar.set_postfix_str(f"{sched.stats.finished}/{len(sched.requests)} requests finished", refresh=False)
        clock.observe(plan, time.perf_counter())
        bar.update(1 + skipped)
        if progress is not None:
            st = sched.stats
            progress.update(step=sched.step, finished=st.finished, requests=len(sched.requests),
                            generated_tokens=st.generated_tokens, computed_tokens=st.computed_tokens)
        if events is not None:
            events.flush()  # one batch a step, as vLLM publishes
    seconds = time.perf_counter() - t0
    bar.close()
    own = layout.rank_pages(0 if cfg.replicated else comm.rank)  # this rank's lane, or its whole copy
    held = own[sched.cache.alloc.is_allocated(own)]
    moved = comm.all_gather_object({"rank": comm.rank, "copied": ex.copied, "backed_up": ex.backed_up,
                                    "loaded": ex.loaded, "tokens_computed": runner.tokens_computed,
                                    "kv_read": runner.kv_read, "moved_bytes": runner.moved_bytes,
                                    "traffic": dict(runner.traffic), "decode_splits": dict(runner.decode_choices),
                                    # at the end of the trace, before the cache is drained: the pages this rank
                                    # holds, by the allocator and by what this rank wrote into its segment
                                    "pages_allocated": int(held.size), "pages_written": pool.written_pages(held),
                                    # the host tier page-locked for CUDA: None without one, False on the CPU
                                    # (not asked: asking makes a CUDA context) or where cudaHostRegister refused
                                    "host_pinned": None if parts.host is None else
                                    pool.device.type == "cuda" and parts.host.pinned()})
    sched.drain()
    if events is not None:
        events.flush()
    sched.check_drained()
    if comm.rank != 0:
        return None
    checked = check(adapter.model, sched, ex, list(pool.families.values())) if cfg.check else None
    return report(cfg, sched, pool.page_bytes, moved, seconds, checked, latency_report(sched.requests, clock),
                  kernels_fallback=choose_backend(runner.kernels, pool)[1])


def report(cfg: EngineConfig, sched: Scheduler, page_bytes: int, ranks: list, seconds: float,
           checked: dict | None, latency: dict | None = None, kernels_fallback: str | None = None) -> dict:
    """The run's figures (see ``cpkv run --help``); ``latency`` is
    :func:`~cpkv.engine.latency.latency_report`'s (TTFT, TPOT, per request);
    ``kernels_fallback``: why the data plane asked for is not the one that
    ran (:func:`~cpkv.runtime.batch.choose_backend`), else ``None``."""
    st = sched.stats
    occ = np.array(st.occupancy) if st.occupancy else np.zeros((1, sched.N))
    # a replicated copy holds every used page on every rank; a shared cache each lane on its rank
    peak_lane = np.full(cfg.cp_size, occ.sum(1).max()) if cfg.replicated else occ.max(0)
    return {
        "config": cfg.public(),
        "kernels_fallback": kernels_fallback,
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
        "kv_dtype": cfg.kv_dtype,
        "kv_bytes_per_token": page_bytes // cfg.page_size,
        "peak_kv_bytes_per_rank": [int(x) * page_bytes for x in peak_lane],
        "peak_replicated_kv_bytes": int(occ.sum(1).max()) * page_bytes,
        "max_lane_gap_pct": st.lane_gap(cfg.device_pages),
        "seconds": seconds,
        "tokens_per_second": st.generated_tokens / max(seconds, 1e-9),
        "ranks": ranks,
        "check": checked,
        "decode_splits": ranks[0].get("decode_splits", {}) if ranks else {},
        "latency": latency,
        "outputs": outputs(sched.requests),
        "sequences": [(list(r.prompt), r.spec.max_new_tokens) for r in sched.requests],
        "occupancy": st.occupancy,
        "host_occupancy": st.host_occupancy,
    }


def run_engine_threads(cfg: EngineConfig, adapter=None) -> dict:
    """The engine with its ranks as threads of this process (tests; one shared
    model and one set of buffers, collectives through threads); sized here
    (:meth:`~cpkv.engine.config.RunConfig.sized`)."""
    cfg = cfg.sized()
    adapter = adapter or build_adapter(cfg.model)
    shared = thread_buffers()
    return run_threads(cfg.cp_size, lambda comm: engine_rank(shared, comm, cfg, adapter), timeout=cfg.timeout)[0]


def run_engine(cfg: EngineConfig) -> dict:
    """Run the engine on a CP group of ``cfg.cp_size`` processes; rank 0's report.

    The run is sized here, once (:meth:`~cpkv.engine.config.RunConfig.sized`),
    and every rank receives the sized configuration. A run stopped by its timeout (:class:`~cpkv.runtime.group.RankFailure`)
    or by Ctrl-C (``KeyboardInterrupt``) raises with ``progress`` set on the
    exception: what it finished (:meth:`RunProgress.read`, ``None`` before
    the first step) and ``requests``, the trace's length."""
    cfg = cfg.sized()
    cfg.model.config()
    specs = cfg.trace()
    build_scheduler(cfg, specs)  # refuse a trace that cannot run before starting any process
    progress = RunProgress()
    try:
        return launch(_engine_rank, cfg.cp_size, cfg, progress, timeout=cfg.timeout, device=cfg.device)
    except (KeyboardInterrupt, RankFailure) as e:
        e.progress, e.requests = progress.read(), len(specs)
        raise
