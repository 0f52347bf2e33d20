"""Prefill/decode disaggregation: a prefill CP group and a decode CP group serve one trace.

One ``torch.distributed`` world holds both groups: ranks ``0 .. M-1`` prefill,
ranks ``M .. M+N-1`` decode. Each group has its own subgroup (the fences and
all-gathers of its forward), its own shared segments, its own allocator
replicas and owner lanes, and its own page size. The KV of a prefilled request
moves from the prefill owners to the decode owners point to point
(:mod:`cpkv.consumers.disagg`), which also works where the two groups share no
memory ([[RFC-0001:C-DISAGG]]).

Control state: every rank of both groups runs BOTH schedulers (the engine's
one :class:`~cpkv.engine.scheduler.Scheduler`) on the same trace and the same
sampled tokens, so every decision, every allocation and every transfer plan
is identical everywhere with no planning collective
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]):

* the decode scheduler holds the trace (arrivals, follow-up turns, lengths)
  with ``remote_prefill``: a due request waits for its KV;
* each such request is submitted to the prefill scheduler (``hold_finished``)
  with its whole sequence so far as the prompt and one token to generate, so
  the prefill group runs it to its first token. The prefill side's prefix
  cache is on: shared prompts and earlier turns are matched, not recomputed;
* the finished prefill request keeps its pages; the decode scheduler gets the
  token (``arrive``) and, when it admits the request, matches its own prefix
  cache (on as well: a follow-up's earlier turns are still there and do not
  move) and allocates the rest with its own owner lanes, like a host load;
* the transfer plan pairs the held source slots with those destination slots
  (:func:`~cpkv.consumers.disagg.plan_transfer`) on every rank.

A step: both schedulers plan; prefill ranks post their messages, run their
forward and wait for the sends; decode ranks receive and write their own
segments inside their executor (after copies, before the fence) and run their
forward; one all-gather of the sampled tokens over the world (data, not
planning) closes the step on both schedulers and confirms the transfer, after
which the prefill side caches the transferred pages.

If anything fails between posting a transfer and that all-gather (a peer group
died mid-transfer), every surviving rank frees the transfer's pages on its side
(prefill: the held requests; decode: the requests that were to receive), writes
an abort report into the run's report folder and raises
:class:`TransferAborted`; :func:`run_disagg` raises :class:`DisaggFailure` with
those reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from ..consumers.disagg import TransferPlan, payload_nbytes, plan_transfer, receive_transfer, send_transfer
from ..consumers.hicache import HostPool, HostTier
from ..consumers.kv_pool import SharedKVPool, allocate_buffers
from ..consumers.prefix_cache import PrefixCache
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import SharedKVLayout
from ..models import TinyDsa, TinyLlama, build_adapter
from ..runtime.comm import Comm, DistComm, run_threads, thread_group
from ..runtime.group import RankContext, RankFailure, launch
from ..runtime.p2p import DistP2P, thread_p2p
from ..runtime.progress import progress_bar
from ..runtime.runner import CPRunner
from .engine import RankExecutor, _inject_fault, check
from .scheduler import Scheduler, StepPlan
from .trace import WORKLOADS, RequestSpec, load_jsonl

SIDES = ("prefill", "decode")


class TransferAborted(RuntimeError):
    """A transfer could not complete on this rank (a peer went away or timed
    out); the transfer's pages on this rank's side were freed first."""


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


@dataclass
class DisaggConfig:
    """One disaggregated run: the model, the two CP groups and their caches, the trace.

    ``prefill_size`` (M) and ``decode_size`` (N) ranks; ``page_size`` and
    ``device_pages`` (pages per rank) of the prefill group, ``decode_page``
    and ``decode_pages`` of the decode group (defaults: the prefill group's
    page size and the same tokens per rank). ``host_pages`` gives the prefill
    group a host tier. Fault injection: world rank ``kill_rank`` is killed in
    the middle of transfer number ``fail_transfer`` (0-based).
    """

    prefill_size: int = 2
    decode_size: int = 2
    page_size: int = 16
    decode_page: int | None = None
    device_pages: int = 64
    decode_pages: int | None = None
    host_pages: int = 0
    chunk: int = 256
    max_running: int = 16
    admission: str = "lanes"
    prefill_split: str = "page"
    decode_split: str = "owner"
    workload: str = "multiturn"
    requests: int = 8
    scale: float = 0.1
    seed: int = 0
    model: TinyLlama | TinyDsa = field(default_factory=TinyLlama)
    check: bool = False
    check_plans: bool = False
    timeout: float = 300.0
    transfer_timeout: float = 60.0
    progress: bool = False
    kill_rank: int | None = None
    fail_transfer: int = 0

    @property
    def world_size(self) -> int:
        """Ranks of both groups."""
        return self.prefill_size + self.decode_size

    @property
    def d_page(self) -> int:
        """The decode group's page size."""
        return self.decode_page or self.page_size

    @property
    def d_pages(self) -> int:
        """The decode group's pages per rank."""
        return self.decode_pages or max(1, self.device_pages * self.page_size // self.d_page)

    def validate(self) -> None:
        """Refuse a configuration that cannot run (``ValueError`` naming the field)."""
        for name in ("prefill_size", "decode_size", "page_size", "device_pages", "chunk", "max_running"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("decode_page", "decode_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        if self.kill_rank is not None and not 0 <= self.kill_rank < self.world_size:
            raise ValueError(f"kill_rank {self.kill_rank} is not a rank of a world of {self.world_size}")
        if not (self.timeout > 0 and self.transfer_timeout > 0):
            raise ValueError("timeout and transfer_timeout must be > 0 seconds")

    @classmethod
    def from_engine(cls, engine, prefill: int, decode: int, decode_page: int | None = None,
                    decode_pages: int | None = None) -> "DisaggConfig":
        """The disaggregated form of an :class:`~cpkv.engine.engine.EngineConfig`:
        the same model, trace, caches and policies, prefill on ``prefill``
        ranks (the engine's page size, pages per rank and host tier), decode
        on ``decode`` ranks (``decode_page``, ``decode_pages``; defaults as in
        the class doc). ``cpkv run --disagg M:N`` builds its run this way."""
        keep = ("page_size", "device_pages", "host_pages", "chunk", "max_running", "admission", "prefill_split",
                "decode_split", "workload", "requests", "scale", "seed", "model", "check", "check_plans", "timeout",
                "progress")
        return cls(prefill_size=prefill, decode_size=decode, decode_page=decode_page, decode_pages=decode_pages,
                   **{k: getattr(engine, k) for k in keep})

    def trace(self) -> list[RequestSpec]:
        """The requests of this run."""
        vocab = self.model.vocab
        if self.workload in WORKLOADS:
            return WORKLOADS[self.workload](self.requests, seed=self.seed, vocab=vocab, scale=self.scale)
        return load_jsonl(self.workload, vocab=vocab)


def parse_disagg(text: str) -> tuple[int, int]:
    """``"M:N"`` (prefill ranks, decode ranks, both >= 1) as ``(M, N)``; raises
    ``ValueError`` saying what is wrong (the ``--disagg`` flag's parser)."""
    m, sep, n = str(text).strip().partition(":")
    try:
        out = (int(m), int(n)) if sep else None
    except ValueError:
        out = None
    if out is None or min(out) < 1:
        raise ValueError(f"{text!r} is not M:N with M prefill ranks and N decode ranks, both >= 1")
    return out


def _cache(n: int, page: int, pages: int) -> PrefixCache:
    layout = SharedKVLayout(n, page, pages)
    return PrefixCache(OwnerLaneAllocator((layout.num_pages - 1) * page, page, n, layout=layout))


@dataclass
class DisaggStep:
    """One step of both groups: each scheduler's plan and the transfer (``None``: nothing moves)."""

    prefill: StepPlan
    decode: StepPlan
    transfer: TransferPlan | None
    index: int  # transfer number when ``transfer`` is set


class DisaggControl:
    """Both schedulers and the hand-offs between them: identical on every rank of both groups.

    ``families`` (the model's cache families) are needed only to count bytes.
    Raises ``TraceError`` for a trace whose requests could never fit either
    group's cache.
    """

    def __init__(self, cfg: DisaggConfig, specs: list[RequestSpec], families=None):
        M, N = cfg.prefill_size, cfg.decode_size
        common = dict(chunk=cfg.chunk, max_running=cfg.max_running, admission=cfg.admission)
        host = HostTier(cfg.host_pages, cfg.page_size) if cfg.host_pages else None
        self.decode = Scheduler(specs, _cache(N, cfg.d_page, cfg.d_pages), remote_prefill=True, **common)
        Scheduler(specs, _cache(M, cfg.page_size, cfg.device_pages), **common)  # every request fits the prefill side
        self.prefill = Scheduler([], _cache(M, cfg.page_size, cfg.device_pages), host=host, hold_finished=True, **common)
        self.max_len = self.decode.max_len
        self.inflight: dict[int, int] = {}  # decode request -> prefill request computing or holding its KV
        self.origin: dict[int, int] = {}  # prefill request -> decode request
        self._attempts: dict[int, int] = {}
        self.transfers = 0
        self.slot_bytes = payload_nbytes(families, 1) if families is not None else 0
        self.pair_slots = np.zeros((M, N), dtype=np.int64)
        self.pair_messages = np.zeros((M, N), dtype=np.int64)
        self.units: set[str] = set()
        self._digest = hashlib.sha256()

    @property
    def done(self) -> bool:
        """Whether every request of the trace has finished."""
        return self.decode.done

    @property
    def digest(self) -> str:
        """SHA-256 over every transfer plan so far (equal on every rank)."""
        return self._digest.copy().hexdigest()

    def plan(self) -> DisaggStep:
        """Submit the requests awaiting KV to the prefill side, plan both
        schedulers' steps and the transfer of the KV the decode side admits."""
        for r in self.decode.awaiting_kv():
            if r.index in self.inflight:
                continue
            k = self._attempts[r.index] = self._attempts.get(r.index, 0) + 1
            pr = self.prefill.submit(RequestSpec(f"{r.spec.id}#{k}", self.prefill.step, r.seq, 1))
            self.inflight[r.index], self.origin[pr.index] = pr.index, r.index
        pp, dp = self.prefill.plan(), self.decode.plan()
        tp = None
        if dp.arrivals:
            src = [self.prefill.held[self.inflight[r.index]].slots[start : start + slots.numel()]
                   for r, start, slots in dp.arrivals]
            tp = plan_transfer(self.prefill.alloc.layout, self.decode.alloc.layout, src,
                               [slots for _, _, slots in dp.arrivals])
        return DisaggStep(pp, dp, tp, self.transfers)

    def complete(self, st: DisaggStep, prefill_tokens: list, decode_tokens: list) -> None:
        """Close the step on both schedulers; cache the transferred pages on the
        prefill side; hand the requests the prefill side finished to the decode side."""
        finished = self.prefill.complete(st.prefill, prefill_tokens)
        self.decode.complete(st.decode, decode_tokens)
        if st.transfer is not None:
            self.transfers += 1
            self.pair_slots += st.transfer.pair_slots.numpy()
            self.pair_messages += (st.transfer.pair_slots > 0).numpy()
            self.units.add(st.transfer.unit)
            self._digest.update(st.transfer.digest().encode())
            for r, _, _ in st.decode.arrivals:
                self.prefill.release_finished(self.inflight.pop(r.index))
        for pr in finished:
            d = self.origin[pr.index]
            if self.decode.arrive(d, pr.generated[-1]):  # that token finished it: no KV needs to move
                self.prefill.release_finished(self.inflight.pop(d))

    def abort(self, st: DisaggStep, side: str) -> dict:
        """A transfer failed: free its pages on ``side`` (the prefill side's
        held requests; the decode side's receiving requests). Returns what was freed."""
        sched = self.prefill if side == "prefill" else self.decode
        before = sum(sched.alloc.lane_free_pages())
        reqs = [r for r, _, _ in st.decode.arrivals]
        for r in reqs:
            if side == "prefill":
                self.prefill.release_finished(self.inflight.pop(r.index), cache=False)
            else:
                self.decode.cancel(r.index)
        after = sum(sched.alloc.lane_free_pages())
        return {"requests": [r.spec.id for r in reqs], "freed_pages": int(after - before),
                "used_pages_after": int(sched.alloc.num_pages - after)}


class _Link:
    """One rank's end of the transfers: posts or receives, counts bytes and
    time, and injects the configured fault."""

    def __init__(self, cfg: DisaggConfig, world_rank: int, side: str, pool: SharedKVPool, transport):
        self.cfg, self.rank, self.side, self.pool, self.transport = cfg, world_rank, side, pool, transport
        self.M = cfg.prefill_size
        self.bytes: dict[int, int] = {}  # peer (group rank of the other side) -> KV bytes
        self.messages = 0
        self.seconds = 0.0
        self.step: DisaggStep | None = None

    def _fault(self) -> None:
        if self.cfg.kill_rank == self.rank and self.step.index == self.cfg.fail_transfer:
            _inject_fault(self.rank, self.step.decode.step, kill=True)  # tests time the other group from here

    def send(self):
        """Prefill rank: post this step's messages (``None`` when nothing moves)."""
        tp = self.step.transfer
        if tp is None:
            return None
        t0 = time.perf_counter()
        if self.cfg.kill_rank == self.rank and self.step.index == self.cfg.fail_transfer:
            first = tp.destinations_of(self.pool.rank)[:1]  # mid-transfer: one message goes, then the rank dies
            if first:
                sub = dataclasses.replace(tp, pair_slots=tp.pair_slots * 0)
                sub.pair_slots[self.pool.rank, first[0]] = tp.pair_slots[self.pool.rank, first[0]]
                send_transfer(sub, self.pool, self.transport, lambda b: self.M + b)
            self._fault()
        pending, sent = send_transfer(tp, self.pool, self.transport, lambda b: self.M + b)
        self._account(sent, t0)
        return pending

    def wait(self, pending) -> None:
        """Prefill rank: wait for this step's sends."""
        if pending is not None:
            t0 = time.perf_counter()
            pending.wait()
            self.seconds += time.perf_counter() - t0

    def receive(self, plan: StepPlan) -> None:
        """Decode rank (the executor's hook): receive and write this step's messages."""
        tp = self.step.transfer
        if tp is None or plan is not self.step.decode:
            raise AssertionError("the executor's arrivals are not this step's transfer")
        self._fault()
        t0 = time.perf_counter()
        self._account(receive_transfer(tp, self.pool, self.transport, lambda a: a), t0)

    def _account(self, moved: dict, t0: float) -> None:
        for peer, n in moved.items():
            self.bytes[peer] = self.bytes.get(peer, 0) + n
        self.messages += len(moved)
        self.seconds += time.perf_counter() - t0

    def abort(self, ctl: DisaggControl, error: BaseException, report_dir: str | None) -> TransferAborted:
        """Free this side's pages of the failed transfer, write the abort report, return the error to raise."""
        st = self.step
        freed = ctl.abort(st, self.side)
        report = {"side": self.side, "world_rank": self.rank, "group_rank": self.pool.rank, "transfer": st.index,
                  "step": st.decode.step, "error": f"{type(error).__name__}: {error}"[:400], "time": time.time(),
                  **freed}
        if report_dir:
            path = os.path.join(report_dir, f"abort-{self.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(path + ".tmp", path)
        other = "decode" if self.side == "prefill" else "prefill"
        return TransferAborted(f"{self.side} rank {self.rank}: transfer {st.index} (step {st.decode.step}) with the "
                               f"{other} group failed ({report['error']}); freed {freed['freed_pages']} pages of "
                               f"requests {freed['requests']}")


def disagg_rank(world: Comm, group: Comm, side: str, shared, transport, cfg: DisaggConfig, adapter,
                report_dir: str | None = None) -> dict | None:
    """One rank of a disaggregated run. ``world`` spans both groups (world
    rank = prefill group rank, or M + decode group rank), ``group`` is this
    rank's own group, ``shared(tag, shape, dtype)`` gives that group's shared
    buffers, ``transport`` its point-to-point messages to world ranks. Returns
    the report on world rank 0."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    M = cfg.prefill_size
    fams = adapter.families()
    ctl = DisaggControl(cfg, cfg.trace(), fams)
    mine = ctl.prefill if side == "prefill" else ctl.decode
    layout = mine.alloc.layout
    pool = SharedKVPool(layout, group.rank, fams, allocate_buffers(layout, fams, shared), fence=group.barrier)
    host = None
    if side == "prefill" and cfg.host_pages:
        host = HostPool(fams, HostPool.allocate(fams, cfg.host_pages, cfg.page_size, shared))
    runner = CPRunner(adapter, pool, comm=group, max_requests=cfg.max_running, max_len=ctl.max_len + 1,
                      prefill_split=cfg.prefill_split, decode_split=cfg.decode_split, check_plans=cfg.check_plans)
    link = _Link(cfg, world.rank, side, pool, transport)
    ex = RankExecutor(runner, host, check=cfg.check, receive=link.receive if side == "decode" else None)
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
    logits = ex.logits if cfg.check and group.rank == 0 else None
    ranks = world.all_gather_object({"world_rank": world.rank, "side": side, "group_rank": group.rank,
                                     "bytes": link.bytes, "messages": link.messages,
                                     "transfer_seconds": link.seconds, "digest": ctl.digest,
                                     "tokens_computed": runner.tokens_computed, "logits": logits})
    if ctl.prefill.held:
        raise AssertionError(f"prefill requests {sorted(ctl.prefill.held)} still hold KV after the trace")
    for sched in (ctl.prefill, ctl.decode):
        sched.drain()
        sched.check_drained()
    if world.rank != 0:
        return None
    checked = None
    if cfg.check:
        merged: dict[int, dict] = {}
        for x in ranks:
            if x["logits"] is None:
                continue
            for idx, by_pos in x["logits"].items():
                merged.setdefault(ctl.origin[idx] if x["side"] == "prefill" else idx, {}).update(by_pos)
        checked = check(adapter.model, ctl.decode, SimpleNamespace(logits=merged))
    return disagg_report(cfg, ctl, ranks, seconds, checked)


def disagg_report(cfg: DisaggConfig, ctl: DisaggControl, ranks: list[dict], seconds: float,
                  checked: dict | None) -> dict:
    """The run's figures: ``bytes_per_pair[a][b]`` is the KV bytes prefill
    rank ``a`` sent decode rank ``b`` over the run (as planned; the senders'
    and receivers' own counts are ``sent_bytes_per_pair`` and
    ``received_bytes_per_pair``), ``transfer_seconds`` the longest time a
    decode rank spent receiving and writing transferred KV."""
    M, N = cfg.prefill_size, cfg.decode_size
    sent, received = np.zeros((M, N), dtype=np.int64), np.zeros((M, N), dtype=np.int64)
    for x in ranks:
        for peer, n in x["bytes"].items():
            if x["side"] == "prefill":
                sent[x["group_rank"], peer] += n
            else:
                received[peer, x["group_rank"]] += n
    P, D = ctl.prefill.stats, ctl.decode.stats
    dec = [x for x in ranks if x["side"] == "decode"]
    return {
        "config": {**asdict(cfg), "model": {"family": type(cfg.model).__name__, **asdict(cfg.model)}},
        "prefill_ranks": M, "decode_ranks": N, "prefill_page": cfg.page_size, "decode_page": cfg.d_page,
        "units": sorted(ctl.units),
        "requests": len(ctl.decode.requests),
        "finished": D.finished,
        "steps": D.steps,
        "prefill_requests": len(ctl.prefill.requests),
        "prefill_prompt_tokens": P.prompt_tokens,
        "prefill_computed_tokens": P.computed_tokens,
        "prefill_hit_rate": P.hit_tokens / max(P.prompt_tokens, 1),
        "prefill_host_hit_tokens": P.host_hit_tokens,
        "prefill_backup_pages": P.backup_pages,
        "decode_hit_tokens": D.hit_tokens,
        "decode_computed_tokens": D.computed_tokens,
        "computed_tokens": P.computed_tokens + D.computed_tokens,
        "generated_tokens": D.generated_tokens,
        "preemptions": {"prefill": P.preemptions, "decode": D.preemptions},
        "evicted_pages": {"prefill": P.evicted_pages, "decode": D.evicted_pages},
        "transfers": ctl.transfers,
        "transferred_tokens": D.arrived_tokens,
        "messages": int(ctl.pair_messages.sum()),
        "messages_per_pair": ctl.pair_messages.tolist(),
        "bytes_per_pair": (ctl.pair_slots * ctl.slot_bytes).tolist(),
        "sent_bytes_per_pair": sent.tolist(),
        "received_bytes_per_pair": received.tolist(),
        "bytes_moved": int(ctl.pair_slots.sum() * ctl.slot_bytes),
        "transfer_seconds": max((x["transfer_seconds"] for x in dec), default=0.0),
        "transfer_seconds_per_rank": [x["transfer_seconds"] for x in ranks],
        "plan_digests": [x["digest"] for x in ranks],
        "seconds": seconds,
        "tokens_per_second": D.generated_tokens / max(seconds, 1e-9),
        "check": checked,
        "sequences": [(list(r.prompt), r.spec.max_new_tokens) for r in ctl.decode.requests],
    }


def format_disagg(r: dict) -> str:
    """Human-readable summary of a disaggregated run: the bytes-per-pair table and the transfer time."""
    M, N = r["prefill_ranks"], r["decode_ranks"]
    lines = [f"prefill group {M} ranks (page {r['prefill_page']}) -> decode group {N} ranks (page {r['decode_page']}),"
             f" by {'/'.join(r['units']) or 'nothing'}",
             f"{r['finished']}/{r['requests']} requests, {r['steps']} steps, {r['transfers']} transfers, "
             f"{r['transferred_tokens']} tokens moved in {r['messages']} messages, {r['bytes_moved']:,} bytes, "
             f"transfer time {r['transfer_seconds'] * 1e3:.1f} ms",
             f"prefix caches: prefill side {100 * r['prefill_hit_rate']:.1f}% of prompt tokens hit "
             f"({r['prefill_host_hit_tokens']} from its host tier), decode side {r['decode_hit_tokens']} tokens "
             f"already there (not moved); preemptions prefill {r['preemptions']['prefill']}, decode "
             f"{r['preemptions']['decode']}",
             "KV bytes sent, prefill rank (rows) -> decode rank (columns):",
             "      " + "".join(f"{'d' + str(b):>12}" for b in range(N))]
    for a in range(M):
        lines.append(f"{'p' + str(a):>6}" + "".join(f"{v:>12,}" for v in r["bytes_per_pair"][a]))
    c = r.get("check")
    if c:
        lines.append(f"check: {c['requests_matched']}/{c['requests']} requests' greedy tokens equal transformers', "
                     f"{c['logits_checked']} logits within {c['max_abs_diff']:.2e}")
    return "\n".join(lines)


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
    order. Raises as :func:`run_disagg` does."""
    if not cfgs:
        raise ValueError("no configuration to run")
    for cfg in cfgs:
        cfg.validate()
        cfg.model.config()
        DisaggControl(cfg, cfg.trace())  # refuse a trace that cannot run before starting any process
    folder = tempfile.mkdtemp(prefix="cpkv_disagg_")
    try:
        return launch(_disagg_ranks, max(c.world_size for c in cfgs), list(cfgs), folder,
                      timeout=sum(c.timeout for c in cfgs))
    except RankFailure as e:
        raise DisaggFailure(e, _read_reports(folder)) from e
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_disagg_threads(cfg: DisaggConfig, adapter=None) -> dict:
    """The same run with every rank of both groups a thread of this process
    (tests; one shared model, one set of buffers per group, collectives and
    messages through threads)."""
    import threading

    cfg.validate()
    DisaggControl(cfg, cfg.trace())  # refuse a trace that cannot run before starting any thread
    adapter = adapter or build_adapter(cfg.model)
    M, W = cfg.prefill_size, cfg.world_size
    groups = {"prefill": thread_group(M, cfg.timeout), "decode": thread_group(cfg.decode_size, cfg.timeout)}
    links = thread_p2p(W, cfg.transfer_timeout)
    made, lock = {}, threading.Lock()

    def shared_of(side):
        def shared(tag, shape, dtype):
            with lock:
                if (side, tag) not in made:
                    made[(side, tag)] = torch.zeros(shape, dtype=dtype)
                return made[(side, tag)]
        return shared

    def body(world):
        side = "prefill" if world.rank < M else "decode"
        group = groups[side][world.rank if side == "prefill" else world.rank - M]
        try:
            return disagg_rank(world, group, side, shared_of(side), links[world.rank], cfg, adapter)
        except BaseException:
            links[world.rank].abort()
            for g in groups.values():
                g[0]._rv.barrier.abort()
            raise

    return run_threads(W, body, timeout=cfg.timeout)[0]
