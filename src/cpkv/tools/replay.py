"""A trace's own milliseconds replayed through the engine's scheduler on a modelled GPU group.

``cpkv simulate --workload mooncake:PATH`` runs a Mooncake trace
(:mod:`cpkv.engine.mooncake`) at full scale, without a model, through the
scheduler the engine runs (:class:`~cpkv.engine.scheduler.Scheduler`, built as
:func:`cpkv.engine.engine.build_scheduler` builds it), once per mode at the
same memory per rank:

* ``shared``: one owner-lane cache of ``cp_size`` lanes, ``pages`` pages each;
* ``replicated``: every rank a full copy, so the group holds ``pages`` pages.

Time is the trace's: a request is handed to the scheduler
(:meth:`~cpkv.engine.scheduler.Scheduler.submit`) when the clock reaches its
``timestamp``, and each step advances the clock by what
:class:`~cpkv.engine.cost_model.CostModel` says the group takes for it. A
group slower than the arrivals queues them (admission waits while the lanes
are full); the result says how long the queue grew and how far behind the
clock fell. A request the cache could never hold is refused (counted) and the
rest run. ``clock="steps"`` runs the engine's own loop instead (arrivals at
their step, idle steps skipped), the loop a model run has, so a slice can be
compared with the engine's run of it.

A run may be stopped early (``stop``, a :class:`Progress` test every
:data:`STOP_EVERY` steps): the goodput sweep (:mod:`cpkv.tools.goodput`) stops
a run as soon as it is certain to miss its latency objectives. A stopped
run's figures cover what had happened by then (``ReplayResult.stopped``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..consumers.eviction import EVICTION_POLICIES
from ..engine.mooncake import FULL_SCALE_CHUNK, MooncakeTrace
from ..engine.trace import CacheTooSmall
from ..engine.cost_model import H200, CostModel, Hardware, kv_memory_per_rank

if TYPE_CHECKING:  # the engine's scheduler is imported when a replay builds one
    from ..engine.scheduler import Scheduler

__all__ = ["DECODE_SPLITS", "KV_MODES", "Progress", "ReplayConfig", "ReplayResult", "STOP_EVERY", "build_replay_scheduler", "replay"]

#: The group's cache: one shared owner-lane cache, or a full copy on every rank.
KV_MODES = ("shared", "replicated")
CLOCKS = ("ms", "steps")
#: The shared group's decode split in the cost model: each step of decodes at the cheaper of owner and lse
#: (``auto``, the default: never dearer than either), or one of them throughout.
DECODE_SPLITS = ("auto", "owner", "lse")
#: How many steps apart a run's ``stop`` test is asked.
STOP_EVERY = 32


@dataclass(frozen=True)
class ReplayConfig:
    """One group: ``cp_size`` ranks, ``page_size`` tokens a page,
    ``kv_memory`` bytes of device KV per rank (default: what an H200 keeps
    beside a DeepSeek-V3.2 shard, :func:`~cpkv.engine.cost_model.kv_memory_per_rank`),
    ``kv_dtype`` (``"bfloat16"`` or ``"fp8"``), ``host_memory`` bytes of
    host tier for the group (0: none), the scheduler's ``chunk``,
    ``max_running`` and ``admission``, the shared cache's ``decode_split``
    (``"owner"`` or ``"lse"``), the GPU's figures ``hw``, and ``rate``: the
    arrivals come ``rate`` times as fast as the trace's timestamps say (1:
    the trace's own; more loads the group until it falls behind);
    ``wait_for_prefix`` the scheduler's in-batch prefix rule
    (:class:`~cpkv.engine.scheduler.Scheduler`); ``eviction`` the prefix
    cache's eviction policy (a name of
    :data:`~cpkv.consumers.eviction.EVICTION_POLICIES`)."""

    cp_size: int = 8
    page_size: int = 64
    kv_memory: int | None = None
    kv_dtype: str = "bfloat16"
    host_memory: int = 0
    chunk: int = FULL_SCALE_CHUNK
    max_running: int = 256
    admission: str = "lanes"
    decode_split: str = "auto"
    hw: Hardware = H200
    rate: float = 1.0
    wait_for_prefix: bool = True
    eviction: str = "lru"

    def __post_init__(self):
        if self.kv_memory is None:
            object.__setattr__(self, "kv_memory", kv_memory_per_rank(self.hw, cp_size=self.cp_size))
        for name in ("cp_size", "page_size", "kv_memory", "chunk", "max_running"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.host_memory, bool) or not isinstance(self.host_memory, int) or self.host_memory < 0:
            raise ValueError(f"host_memory must be an int >= 0, got {self.host_memory!r}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not self.rate > 0:
            raise ValueError(f"rate must be a number > 0, got {self.rate!r}")
        if not isinstance(self.wait_for_prefix, bool):
            raise ValueError(f"wait_for_prefix must be a bool, got {self.wait_for_prefix!r}")
        EVICTION_POLICIES.get(self.eviction)  # ValueError naming the choices
        if self.decode_split not in DECODE_SPLITS:
            raise ValueError(f"decode_split must be one of {DECODE_SPLITS}, got {self.decode_split!r}")

    def cost_model(self, kv: str) -> CostModel:
        """The step costs of mode ``kv`` (:data:`KV_MODES`)."""
        if kv not in KV_MODES:
            raise ValueError(f"unknown kv mode {kv!r}; choose from {KV_MODES}")
        mode = "replicated" if kv == "replicated" else f"shared-{self.decode_split}"
        return CostModel.for_dtype(mode, self.cp_size, self.kv_dtype, self.hw)

    def pages(self, token_bytes: float) -> tuple[int, int]:
        """``(device pages per rank, host pages)`` for KV of ``token_bytes`` a token
        (every layer and family): the same in both modes. ``ValueError`` for a
        ``kv_memory`` that holds no page."""
        page = self.page_size * token_bytes
        device = int(self.kv_memory // page)
        if device < 2:
            raise ValueError(f"{self.kv_memory} bytes per rank hold {device} pages of {page:.0f} bytes; "
                             "a cache needs 2 or more (page 0 is reserved)")
        return device, int(self.host_memory // page)


def build_replay_scheduler(cfg: ReplayConfig, kv: str, specs: list, token_bytes: float) -> Scheduler:
    """The scheduler of mode ``kv`` for ``specs``, as the engine builds it
    (:func:`cpkv.engine.engine.build_scheduler`: one lane for a replicated
    copy, ``cp_size`` lanes shared; the same pages per rank; the host tier)."""
    from ..consumers.hicache import HostTier  # here: ReplayConfig is read before torch is imported (cpkv.tools.sizes)
    from ..engine.rank import build_cache
    from ..engine.scheduler import Scheduler

    device, host = cfg.pages(token_bytes)
    lanes = 1 if kv == "replicated" else cfg.cp_size
    return Scheduler(specs, build_cache(lanes, cfg.page_size, device, cfg.eviction), chunk=cfg.chunk,
                     max_running=cfg.max_running, admission=cfg.admission,
                     host=HostTier(host, cfg.page_size) if host else None, wait_for_prefix=cfg.wait_for_prefix)


@dataclass(frozen=True)
class Progress:
    """Where a run stands, as its ``stop`` test sees it (arrays ``[n]`` over the
    trace's requests, times in ms of the modelled clock): ``now``, each
    request's ``arrival``, the end of its ``first``-token step and of its
    ``finish`` step (NaN: not yet), and whether it was ``refused``. A request
    whose arrival is after ``now`` has not been handed to the scheduler yet."""

    now: float
    arrival: np.ndarray
    first: np.ndarray
    finish: np.ndarray
    refused: np.ndarray


@dataclass
class ReplayResult:
    """What one mode did on one trace (times in ms of the modelled clock)."""

    trace: str
    kv: str
    config: ReplayConfig
    capacity_tokens: int  # the group's device KV, in tokens
    longest_tokens: int  # the most KV tokens one request can hold
    host_tokens: int
    requests: int
    refused: int
    finished: int
    prompt_tokens: int
    hit_tokens: int
    host_hit_tokens: int
    generated_tokens: int
    evicted_pages: int
    preemptions: int
    steps: int
    makespan_ms: float  # the end of the last step
    last_arrival_ms: float
    max_waiting: int  # requests due and not admitted, at most
    max_wait_ms: float  # the longest a due request waited for admission
    wall_s: float  # how long the simulation took here
    cpu_s: float  # of which this process's CPU time
    ttft_ms: np.ndarray = field(repr=False)
    tpot_ms: np.ndarray = field(repr=False)
    decode_batch: np.ndarray = field(repr=False)  # requests decoding, per step with a decode
    series: dict = field(repr=False)  # per step: time_ms, resident_tokens, hit_tokens, host_hit_tokens, prompt_tokens
    per_request: list = field(repr=False, default_factory=list)  # (id, first-token step, finish step) per request
    stopped: bool = False  # its ``stop`` test ended it before the trace did: figures of what had happened by then

    @property
    def peak_resident_tokens(self) -> int:
        """The most device KV tokens the group held at once."""
        r = self.series["resident_tokens"]
        return int(r.max()) if r.size else 0

    @property
    def behind_ms(self) -> float:
        """How much later than the last arrival the last request finished (0 at best)."""
        return max(self.makespan_ms - self.last_arrival_ms, 0.0)

    def summary(self) -> dict:
        """The figures of one row of the report."""
        q = lambda x, p: float(np.percentile(x, p)) if x.size else float("nan")  # noqa: E731
        busy_s = max(self.makespan_ms - float(self.series["first_arrival_ms"]), 1e-9) / 1e3
        return {
            "trace": self.trace, "kv": self.kv if self.kv == "replicated" else f"shared ({self.config.decode_split})",
            "kv dtype": self.config.kv_dtype, "host tier": self.host_tokens > 0,
            "device KV tokens": self.capacity_tokens, "peak resident": self.peak_resident_tokens,
            "longest request": self.longest_tokens,
            "hit device": self.hit_tokens / max(self.prompt_tokens, 1),
            "hit host": self.host_hit_tokens / max(self.prompt_tokens, 1),
            "evicted tokens": self.evicted_pages * self.config.page_size, "preemptions": self.preemptions,
            "refused": self.refused, "finished": self.finished,
            "TTFT p50 s": q(self.ttft_ms, 50) / 1e3, "TTFT p99 s": q(self.ttft_ms, 99) / 1e3,
            "TPOT p50 ms": q(self.tpot_ms, 50), "TPOT p99 ms": q(self.tpot_ms, 99),
            "tokens/s": self.generated_tokens / busy_s,
            "decode batch mean": float(self.decode_batch.mean()) if self.decode_batch.size else 0.0,
            "max queue": self.max_waiting, "max wait s": self.max_wait_ms / 1e3, "behind s": self.behind_ms / 1e3,
            "steps": self.steps, "sim s": self.wall_s, "sim cpu s": self.cpu_s,
        }


def replay(trace: MooncakeTrace, kv: str, cfg: ReplayConfig, *, name: str = "trace", clock: str = "ms",
           progress: bool = False, stop: Callable[[Progress], bool] | None = None) -> ReplayResult:
    """Run ``trace`` in mode ``kv`` (:data:`KV_MODES`) on ``cfg``'s group
    (see the module docstring); ``clock`` ``"ms"`` (the trace's milliseconds,
    the cost model's steps) or ``"steps"`` (the engine's loop). ``stop``
    (``clock="ms"`` only) is asked every :data:`STOP_EVERY` steps; when it
    answers true the run ends there: every running request is dropped and the
    result is marked ``stopped``, its figures over what had happened."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; choose from {CLOCKS}")
    if stop is not None and clock != "ms":
        raise ValueError("a stop test needs clock='ms' (it reads the modelled clock)")
    from ..runtime.progress import progress_bar
    from .simulate import null_execute

    model = cfg.cost_model(kv)
    t0, c0 = time.perf_counter(), time.process_time()
    arrival = np.asarray(trace.arrival_ms, dtype=np.float64) / cfg.rate
    n = len(trace.specs)
    if clock == "steps":
        sched = build_replay_scheduler(cfg, kv, trace.specs, model.kv_token_bytes)
        accepted = list(range(n))
    else:
        sched = build_replay_scheduler(cfg, kv, [], model.kv_token_bytes)
        accepted = []  # trace index of each request the scheduler holds, in its order
    refused = np.zeros(n, dtype=bool)
    stopped = False
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    series = {k: [] for k in ("time_ms", "resident_tokens", "hit_tokens", "host_hit_tokens", "prompt_tokens")}
    decode_batch = []
    now, i, max_waiting, max_wait = 0.0, 0, 0, 0.0
    S, st = cfg.page_size, sched.stats
    total_pages = int(sched.cache.alloc.lane_pages.sum())
    bar = progress_bar(total=n, desc=f"{name} / {kv} / {cfg.kv_dtype}", disable=not progress, leave=False)
    while True:
        if clock == "ms":
            while i < n and arrival[i] <= now:
                try:
                    sched.submit(dataclasses.replace(trace.specs[i], arrival=0))
                    accepted.append(i)
                except CacheTooSmall:
                    refused[i] = True
                    bar.update(1)
                i += 1
            if not sched.running and not sched.waiting:
                if i >= n:
                    break
                now = max(now, arrival[i])
                continue
        else:
            if sched.done:
                break
            sched.skip_idle()
        plan = sched.plan()
        f = plan.forward
        if f is not None and f.decodes:
            decode_batch.append(f.decodes)
        cost = model.step(f.alloc.to_host("prefix_lens") if f is not None else np.zeros(0),
                          f.alloc.to_host("seq_lens") if f is not None else np.zeros(0),
                          decode_only=f is None or f.decode,
                          load_tokens=sum(x.device.numel() for x in plan.loads),
                          backup_tokens=sum(x.device.numel() for x in plan.backups))
        now += cost.total * 1e3
        if f is not None and not f.decode:
            for r, sampled in zip(f.requests[f.decodes :], f.sample[f.decodes :]):
                if sampled and np.isnan(first[accepted[r.index]]):
                    first[accepted[r.index]] = now if clock == "ms" else plan.step
        done = sched.complete(plan, null_execute(plan))
        for r in done:
            finish[accepted[r.index]] = now if clock == "ms" else plan.step
        bar.update(len(done))
        if sched.waiting and clock == "ms":  # every waiting request is due: it was submitted on arrival
            max_waiting = max(max_waiting, len(sched.waiting))
            max_wait = max(max_wait, now - arrival[accepted[sched.waiting[0].index]])
        series["time_ms"].append(now)
        series["resident_tokens"].append((total_pages - int(np.sum(sched.cache.alloc.lane_free_pages()))) * S)
        series["hit_tokens"].append(st.hit_tokens)
        series["host_hit_tokens"].append(st.host_hit_tokens)
        series["prompt_tokens"].append(st.prompt_tokens)
        if stop is not None and plan.step % STOP_EVERY == 0 and stop(Progress(now, arrival, first, finish, refused)):
            stopped = True
            for r in list(sched.running):
                sched.cancel(r.index)
            break
    bar.close()
    reqs = sched.requests
    gen = np.array([len(r.generated) for r in reqs], dtype=np.int64)
    idx = np.array(accepted, dtype=np.int64)
    f, e = first[idx], finish[idx]
    more = (gen > 1) & np.isfinite(e)  # a stopped run: the requests that had finished
    per_request = [(r.spec.id, float(first[j]), float(finish[j])) for r, j in zip(reqs, accepted)]
    res = ReplayResult(
        trace=name, kv=kv, config=cfg,
        capacity_tokens=total_pages * S, longest_tokens=int(sched.cache.alloc.lane_pages.min()) * sched.N * S,
        host_tokens=(sched.host.alloc.size if sched.host is not None else 0), requests=n, refused=int(refused.sum()),
        finished=int(np.isfinite(finish).sum()), prompt_tokens=st.prompt_tokens, hit_tokens=st.hit_tokens,
        host_hit_tokens=st.host_hit_tokens, generated_tokens=st.generated_tokens, evicted_pages=st.evicted_pages,
        preemptions=st.preemptions, steps=st.steps, makespan_ms=now,
        last_arrival_ms=float(arrival[-1]) if n else 0.0, max_waiting=max_waiting, max_wait_ms=max_wait,
        wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0,
        ttft_ms=((f - arrival[idx]) if clock == "ms" else f - np.array([trace.specs[j].arrival for j in idx]))[
            np.isfinite(f)],
        tpot_ms=(e - f)[more] / (gen[more] - 1),
        decode_batch=np.asarray(decode_batch, dtype=np.int64),
        series={**{k: np.asarray(v) for k, v in series.items()}, "first_arrival_ms": float(arrival[0]) if n else 0.0},
        per_request=per_request, stopped=stopped)
    sched.drain()
    sched.check_drained()
    return res

