"""A CP group of processes sharing one KV cache, end to end on a real model.

:func:`launch` starts N rank processes on one machine. Rank 0 creates the
group's KV buffer (every layer, rank-major) in POSIX shared memory and the
others attach; each rank writes only its own segment and reads the whole.
Every rank runs the same allocator on the same inputs (no planner collective,
[[RFC-0001:C-NO-PLANNER-COLLECTIVE]]); :class:`CPRunner` then computes, per
batch, exactly the tokens on pages its rank owns (the page split), writes their
K/V into its own segment, fences once per layer and attends over the whole
context through the shared view — no all-gather of K/V.

Decode is divided the same way: the rank that owns the page of a request's new
slot computes that request's token (q/k/v, attention over the full context,
MLP, logits) and is the only one that writes it. Over many requests, lane bases
spread those owners evenly.

The group runs on the CPU (gloo); a GPU path (NCCL, a CUDA IPC buffer) is not
built yet. The shared segment is unlinked on every exit path: rank 0 unlinks it when it
ends, and the launcher unlinks it again in a ``finally`` (after a rank raised,
was killed, or the launcher got Ctrl-C), so no segment outlives a run.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .allocator import ExtendAllocation, OwnerLaneAllocator
from .errors import ContractViolation
from .kv_pool import SharedKVPool, buffer_bytes, buffer_shape
from .layout import SharedKVLayout
from .models import LlamaAdapter, ModelAdapter, TinyLlama, paged_attention

SHM_PREFIX = "cpkv_"


class RankFailure(RuntimeError):
    """A rank of the CP group failed; ``rank`` names it (``None``: the group as
    a whole, e.g. it did not finish in time)."""

    def __init__(self, rank: int | None, message: str):
        self.rank = rank
        super().__init__(f"{'CP group' if rank is None else f'rank {rank}'} failed: {message}")


# -- one rank ---------------------------------------------------------------------
class CPRunner:
    """One rank's view of the CP group: its allocator replica, its pool, the model.

    ``extend`` runs a batch (prefill or decode) and returns the logits this rank
    computed; ``collect`` shares them with every rank. ``check_plans`` compares
    every allocation across ranks with one collective (debug only).
    """

    def __init__(self, adapter: ModelAdapter, pool: SharedKVPool, allocator: OwnerLaneAllocator,
                 *, max_requests: int, max_len: int, check_plans: bool = False, distributed: bool = False):
        self.adapter, self.pool, self.allocator = adapter, pool, allocator
        self.rank, self.cp_size = pool.rank, pool.layout.cp_size
        self.check_plans, self.distributed = check_plans, distributed
        # req_to_token: logical slots of request r's positions 0 .. lens[r]-1, padding after
        self.req_to_token = torch.full((max_requests, max_len), pool.layout.padding_value, dtype=torch.int64)
        self.lens = torch.zeros(max_requests, dtype=torch.int64)
        self.tokens_computed = 0

    def _agree(self, alloc: ExtendAllocation) -> None:
        h = hashlib.sha256()
        for t in (alloc.out_cache_loc, alloc.lane_base, alloc.new_pages, alloc.extend_start_loc):
            h.update(t.cpu().numpy().tobytes())
        digests = [None] * self.cp_size
        dist.all_gather_object(digests, h.hexdigest())
        if len(set(digests)) != 1:
            raise ContractViolation(f"ranks planned differently: {digests}")

    def allocate(self, rids: list[int], new_lens: list[int], decode: bool = False) -> ExtendAllocation:
        """Allocate a batch on this rank's allocator replica (identical on every rank)."""
        rows = torch.tensor(rids, dtype=torch.int64)
        prefix = self.lens[rows]
        seq = prefix + torch.tensor(new_lens, dtype=torch.int64)
        if int(seq.max()) > self.req_to_token.shape[1]:
            raise ValueError(f"a request would exceed {self.req_to_token.shape[1]} tokens")
        last = torch.where(prefix > 0, self.req_to_token[rows, (prefix - 1).clamp(min=0)], -1)
        alloc = (self.allocator.allocate_decode(seq, last) if decode
                 else self.allocator.allocate_extend(prefix, seq, last))
        if alloc is None:
            raise MemoryError(f"KV cache full: pages missing per lane {self.allocator.last_deficit.tolist()}")
        self.pool.check(alloc)
        if self.check_plans:
            self._agree(alloc)
        self.req_to_token[rows[alloc.request_of_token], alloc.positions] = alloc.out_cache_loc
        self.lens[rows] = seq
        return alloc

    def forward(self, rids: list[int], alloc: ExtendAllocation, ids: torch.Tensor):
        """Compute this rank's tokens of an allocated batch; ``ids`` are the batch's
        new token ids in flattened order. Returns ``(token_indices, logits)``."""
        ad, pool = self.adapter, self.pool
        split = alloc.rank_split(self.rank)  # taken from the allocation, never re-derived
        idx = split.token_indices
        slots = alloc.out_cache_loc[idx]
        req = alloc.request_of_token[idx]
        pos = split.positions
        # the batch's page table, translated to rank-major once for every layer
        table = self.req_to_token[torch.tensor(rids, dtype=torch.int64), : int(alloc.seq_lens.max())]
        read = pool.read_index(table)
        read = torch.where(read < 0, 0, read)  # padding is masked by position in attention
        h = ad.embed(ids[idx])
        with torch.no_grad():
            for layer in range(ad.num_layers):
                q, k, v = ad.qkv(layer, h, pos)
                pool.write(layer, slots, k, v)
                pool.fence()  # every rank's writes of this layer land before anyone reads
                kc, vc = pool.gather(layer, read)
                h = ad.finish_layer(layer, h, paged_attention(q, req, pos, kc, vc, ad.scaling))
            logits = ad.logits(h)
        pool.fence()  # nobody reads this batch any more: its slots may be freed and reused
        self.tokens_computed += idx.numel()
        return idx, logits

    def extend(self, rids: list[int], new_ids: list[torch.Tensor], decode: bool = False):
        """Allocate and compute one batch. Returns ``(alloc, token_indices, logits)``."""
        alloc = self.allocate(rids, [t.numel() for t in new_ids], decode)
        idx, logits = self.forward(rids, alloc, torch.cat(new_ids))
        return alloc, idx, logits

    def collect(self, alloc: ExtendAllocation, idx: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits of a batch, in flattened order, on every rank."""
        if not self.distributed:
            return logits
        parts = [None] * self.cp_size
        dist.all_gather_object(parts, (idx, logits))
        out = torch.empty(alloc.out_cache_loc.numel(), logits.shape[-1], dtype=logits.dtype)
        for i, lg in parts:
            out[i] = lg
        return out

    def finish(self, rid: int) -> None:
        """Free a request's pages."""
        slots = self.req_to_token[rid, : int(self.lens[rid])].clone()
        self.req_to_token[rid] = self.pool.layout.padding_value
        self.lens[rid] = 0
        self.allocator.free(slots)
        self.pool.release(slots)


# -- the scenario the demo and the tests run -----------------------------------
@dataclass
class RunConfig:
    """One end-to-end run. ``requests`` are ``(cached_prefix, prompt_len)``: a
    request with a cached prefix is prefilled up to it first (the "cache"),
    then continued by the main batch."""

    cp_size: int = 4
    page_size: int = 16
    requests: list = field(default_factory=lambda: [(37, 61), (0, 50), (32, 45), (0, 9), (0, 83)])
    decode_steps: int = 8
    model: TinyLlama = field(default_factory=TinyLlama)
    pages_per_rank: int | None = None  # default: room for the whole run, twice over
    seed: int = 0
    check_plans: bool = False
    timeout: float = 120.0
    fail_rank: int | None = None  # fault injection: this rank raises mid-prefill
    kill_rank: int | None = None  # fault injection: this rank is killed mid-prefill


def pages_needed(cfg: RunConfig) -> int:
    """Pages per rank ``cfg`` uses at most, with slack: every request's pages
    spread over the lanes, plus one page per request per lane."""
    pages = sum(-(-(n + cfg.decode_steps) // cfg.page_size) for _, n in cfg.requests)
    return 2 * (-(-pages // cfg.cp_size) + len(cfg.requests)) + 1


def _scenario(runner: CPRunner, cfg: RunConfig, rank: int) -> dict:
    ad = runner.adapter
    g = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, cfg.model.vocab, (n,), generator=g) for _, n in cfg.requests]
    rids = list(range(len(prompts)))
    logits = {r: [] for r in rids}
    times = {}

    def step(batch, parts, decode=False):
        alloc, idx, lg = runner.extend(batch, parts, decode)
        full = runner.collect(alloc, idx, lg)
        for i, r in enumerate(batch):
            a, n = int(alloc.extend_start_loc[i]), int(alloc.extend_lens[i])
            logits[r].append(full[a : a + n])
        return alloc

    t = time.perf_counter()
    warm = [r for r in rids if cfg.requests[r][0] > 0]
    if warm:
        step(warm, [prompts[r][: cfg.requests[r][0]] for r in warm])
    times["prefill cached prefixes"] = time.perf_counter() - t
    if rank == cfg.fail_rank:
        raise RuntimeError(f"injected fault on rank {rank} mid-prefill")
    if rank == cfg.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.perf_counter()
    step(rids, [prompts[r][cfg.requests[r][0] :] for r in rids])
    times["prefill batch"] = time.perf_counter() - t
    prefill_tokens = runner.tokens_computed
    generated = {r: [] for r in rids}
    t = time.perf_counter()
    for _ in range(cfg.decode_steps):
        nxt = [logits[r][-1][-1].argmax().view(1) for r in rids]
        for r, tok in zip(rids, nxt):
            generated[r].append(int(tok))
        step(rids, nxt, decode=True)
    times["decode"] = time.perf_counter() - t

    # what this rank holds, measured by the pool and counted by the allocator
    held = runner.pool.bytes_held()
    lane_pages = int(runner.allocator.lane_pages[rank]) - runner.allocator.lane_free_pages()[rank]
    report = {
        "rank": rank,
        "kv_bytes_held": held,
        "kv_bytes_by_allocation": int(lane_pages) * runner.pool.page_bytes,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": runner.tokens_computed - prefill_tokens,
    }
    reports = [None] * runner.cp_size
    if runner.distributed:
        dist.all_gather_object(reports, report)
    else:
        reports = [report]
    total_pages = int(sum(runner.allocator.lane_pages)) - sum(runner.allocator.lane_free_pages())
    result = None
    if rank == 0:
        model = ad.model
        diffs = {"prefill": 0.0, "decode": 0.0}
        with torch.no_grad():
            for r in rids:
                seq = torch.cat([prompts[r], torch.tensor(generated[r], dtype=torch.int64)])
                ref = model(seq[None]).logits[0]
                ours = torch.cat(logits[r])
                n_pre = prompts[r].numel()
                diffs["prefill"] = max(diffs["prefill"], float((ours[:n_pre] - ref[:n_pre]).abs().max()))
                if cfg.decode_steps:
                    d = (ours[n_pre:] - ref[n_pre : n_pre + cfg.decode_steps]).abs().max()
                    diffs["decode"] = max(diffs["decode"], float(d))
        result = {
            "config": {**asdict(cfg), "model": asdict(cfg.model)},
            "ranks": reports,
            "replicated_kv_bytes": total_pages * runner.pool.page_bytes,
            "page_bytes": runner.pool.page_bytes,
            "batch_size": len(rids),
            "max_abs_diff": diffs,
            "seconds": times,
            "generated": generated,
        }
    for r in rids:
        runner.finish(r)
    if sum(runner.allocator.lane_free_pages()) != runner.allocator.num_pages:
        raise ContractViolation("pages leaked after every request finished")
    return result


@contextlib.contextmanager
def _untracked():
    """Keep Python's resource tracker out of cpkv's segment.

    cpkv owns the segment's lifetime (rank 0 and the launcher unlink it); the
    tracker, shared by every rank, would otherwise unlink it or complain as each
    process exits.
    """
    saved = resource_tracker.register, resource_tracker.unregister
    resource_tracker.register = resource_tracker.unregister = lambda *a, **k: None
    try:
        yield
    finally:
        resource_tracker.register, resource_tracker.unregister = saved


def _open_segment(name: str, size: int = 0) -> shared_memory.SharedMemory:
    """Create (``size > 0``) or attach the group's POSIX shared-memory segment."""
    with _untracked():
        return shared_memory.SharedMemory(name=name, create=size > 0, size=size)


def _unlink_segment(shm: shared_memory.SharedMemory) -> None:
    with _untracked():
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def _rank_main(rank: int, cfg: RunConfig, shm_name: str, init_file: str, out) -> None:
    shm = None
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=cfg.cp_size, timeout=timedelta(seconds=cfg.timeout))
        adapter = LlamaAdapter(cfg.model.build())
        layout = SharedKVLayout(cfg.cp_size, cfg.page_size, cfg.pages_per_rank or pages_needed(cfg))
        shape = buffer_shape(layout, adapter.num_layers, adapter.num_kv_heads, adapter.head_dim)
        if rank == 0:
            shm = _open_segment(shm_name, buffer_bytes(shape, torch.float32))
        dist.barrier()
        if rank != 0:
            shm = _open_segment(shm_name)
        result = _run_rank(cfg, rank, shm, shape, layout, adapter)
        if rank == 0:
            out.put(("result", 0, result))
    except BaseException as e:  # report, then exit non-zero so the launcher stops the group
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        gc.collect()
        if shm is not None:
            try:
                shm.close()
            except BufferError:
                pass
            if rank == 0:
                _unlink_segment(shm)
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(cfg, rank, shm, shape, layout, adapter) -> dict | None:
    buf = torch.frombuffer(shm.buf, dtype=torch.float32, count=math.prod(shape)).view(shape)
    if rank == 0:
        buf.zero_()
    dist.barrier()
    pool = SharedKVPool(layout, rank, buf, fence=dist.barrier)
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * cfg.page_size, cfg.page_size, cfg.cp_size, layout=layout)
    runner = CPRunner(adapter, pool, alloc, max_requests=len(cfg.requests),
                      max_len=max(n for _, n in cfg.requests) + cfg.decode_steps,
                      check_plans=cfg.check_plans, distributed=True)
    return _scenario(runner, cfg, rank)


def shm_segments(pid: int | None = None) -> set[str]:
    """cpkv's POSIX shared-memory segments currently on the system; with
    ``pid``, only those of runs that process launched."""
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}_"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def _is_knock_on(message: str) -> bool:
    """An error a rank raises only because a peer went away."""
    return any(w in message for w in ("gloo", "Gloo", "NCCL", "DistBackendError", "Connection closed", "timed out"))


def _root_cause(procs, errors: dict, out, *, timed_out: bool, timeout: float) -> RankFailure:
    """Name the rank that failed first, not the peers that failed because of it.

    Waits up to a second for the other ranks' reports, then prefers a rank
    killed by a signal, then a rank whose error is its own (not a broken
    connection to a peer), then the first error reported.
    """
    if timed_out:
        return RankFailure(None, f"did not finish within {timeout} s")
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            kind, rank, payload = out.get(timeout=0.05)
            if kind == "error":
                errors.setdefault(rank, payload)
        except queue_mod.Empty:
            pass
    for r, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode < 0 and r not in errors:
            return RankFailure(r, f"exited with code {p.exitcode} (killed by {signal.Signals(-p.exitcode).name})")
    own = [r for r, m in errors.items() if not _is_knock_on(m)]
    if own or errors:
        r = (own or list(errors))[0]
        return RankFailure(r, errors[r])
    r = next(r for r, p in enumerate(procs) if p.exitcode not in (None, 0))
    return RankFailure(r, f"exited with code {procs[r].exitcode}")


def launch(cfg: RunConfig) -> dict:
    """Run ``cfg`` on a CP group of ``cfg.cp_size`` processes; return rank 0's report.

    Raises :class:`RankFailure` naming the first rank that failed; every other
    rank is then stopped, and the shared segment is unlinked whatever happens.
    """
    if cfg.cp_size < 1 or cfg.page_size < 1:
        raise ValueError(f"cp_size and page_size must be >= 1, got {cfg.cp_size}, {cfg.page_size}")
    if any(not 0 <= c < n for c, n in cfg.requests):
        raise ValueError(f"every request needs 0 <= cached prefix < prompt length: {cfg.requests}")
    if max(n for _, n in cfg.requests) + cfg.decode_steps > cfg.model.max_positions:
        raise ValueError(f"sequences exceed the model's {cfg.model.max_positions} positions")
    cfg.model.config()  # refuse an impossible model shape before starting any process
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    name = f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
    result, failure = None, None
    with tempfile.TemporaryDirectory(prefix="cpkv_pg_") as d:
        procs = [ctx.Process(target=_rank_main, args=(r, cfg, name, os.path.join(d, "pg"), out), daemon=True)
                 for r in range(cfg.cp_size)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + cfg.timeout
            errors: dict[int, str] = {}
            while result is None or any(p.is_alive() for p in procs):
                try:
                    kind, rank, payload = out.get(timeout=0.1)
                    if kind == "error":
                        errors.setdefault(rank, payload)
                    else:
                        result = payload
                except queue_mod.Empty:
                    pass
                broken = errors or any(p.exitcode not in (None, 0) for p in procs)
                if broken or time.monotonic() > deadline:
                    failure = _root_cause(procs, errors, out, timed_out=not broken, timeout=cfg.timeout)
                    break
                if result is None and not any(p.is_alive() for p in procs):
                    failure = RankFailure(0, "the group ended without a result")
                    break
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            try:
                s = _open_segment(name)
                s.close()
                _unlink_segment(s)
            except FileNotFoundError:
                pass
    if failure is not None:
        raise failure
    return result
