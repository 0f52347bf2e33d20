"""The fixed end-to-end scenario of ``cpkv run``: a batch with cached prefixes,
prefilled and decoded on a CP group, every logit compared with ``transformers``."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, field

import torch

from ..consumers.kv_pool import SharedKVPool, allocate_buffers
from ..contract.allocator import OwnerLaneAllocator
from ..contract.errors import ContractViolation
from ..contract.layout import SharedKVLayout
from ..models import DsaAdapter, LlamaAdapter, ModelAdapter, TinyDsa, TinyLlama
from .comm import DistComm, LocalComm
from .group import RankContext, launch
from .runner import CPRunner


# -- the scenario the demo and the tests run -----------------------------------
@dataclass
class RunConfig:
    """One end-to-end run. ``requests`` are ``(cached_prefix, prompt_len)``: a
    request with a cached prefix is prefilled up to it first (the "cache"),
    then continued by the main batch. ``model`` is a :class:`TinyLlama` (the
    default) or a :class:`TinyDsa` (DeepSeek-V3.2 or GLM-5)."""

    cp_size: int = 4
    page_size: int = 16
    requests: list = field(default_factory=lambda: [(37, 61), (0, 50), (32, 45), (0, 9), (0, 83)])
    decode_steps: int = 8
    model: TinyLlama | TinyDsa = field(default_factory=TinyLlama)
    pages_per_rank: int | None = None  # default: room for the whole run, twice over
    seed: int = 0
    check_plans: bool = False
    prefill_split: str = "page"
    decode_split: str = "owner"
    timeout: float = 120.0
    fail_rank: int | None = None  # fault injection: this rank raises mid-prefill
    kill_rank: int | None = None  # fault injection: this rank is killed mid-prefill


def pages_needed(cfg: RunConfig) -> int:
    """Pages per rank ``cfg`` uses at most, with slack: every request's pages
    spread over the lanes, plus one page per request per lane."""
    pages = sum(-(-(n + cfg.decode_steps) // cfg.page_size) for _, n in cfg.requests)
    return 2 * (-(-pages // cfg.cp_size) + len(cfg.requests)) + 1


def _scenario(runner: CPRunner, cfg: RunConfig, ctx: RankContext) -> dict:
    ad = runner.adapter
    g = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, cfg.model.vocab, (n,), generator=g) for _, n in cfg.requests]
    rids = list(range(len(prompts)))
    logits = {r: [] for r in rids}
    times = {}

    def step(batch, parts, decode=False):
        alloc, idx, lg = runner.extend(batch, parts, decode)
        full = runner.collect(alloc.out_cache_loc.numel(), idx, lg)
        for i, r in enumerate(batch):
            a, n = int(alloc.extend_start_loc[i]), int(alloc.extend_lens[i])
            logits[r].append(full[a : a + n])
        return alloc

    t = time.perf_counter()
    warm = [r for r in rids if cfg.requests[r][0] > 0]
    if warm:
        step(warm, [prompts[r][: cfg.requests[r][0]] for r in warm])
    times["prefill cached prefixes"] = time.perf_counter() - t
    if ctx.rank == cfg.fail_rank:
        raise RuntimeError(f"injected fault on rank {ctx.rank} mid-prefill")
    if ctx.rank == cfg.kill_rank:
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
    lane_pages = int(runner.allocator.lane_pages[ctx.rank]) - runner.allocator.lane_free_pages()[ctx.rank]
    report = {
        "rank": ctx.rank,
        "kv_bytes_held": held,
        "kv_bytes_by_allocation": int(lane_pages) * runner.pool.page_bytes,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": runner.tokens_computed - prefill_tokens,
    }
    reports = ctx.all_gather_object(report)
    total_pages = int(sum(runner.allocator.lane_pages)) - sum(runner.allocator.lane_free_pages())
    result = None
    if ctx.rank == 0:
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


def shared_pool(ctx: RankContext, adapter, layout: SharedKVLayout, comm: DistComm | None = None) -> SharedKVPool:
    """This rank's pool over the group's buffers in shared memory (one segment
    per cache family, created by the group's first rank)."""
    fams = adapter.families()
    if comm is None:
        comm = DistComm() if ctx.distributed else LocalComm()
    bufs = allocate_buffers(layout, fams, lambda tag, shape, dtype: ctx.shared(tag, shape, dtype))
    return SharedKVPool(layout, comm.rank, fams, bufs, fence=comm.barrier)


def build_adapter(model: TinyLlama | TinyDsa) -> ModelAdapter:
    """The adapter for a model configuration: :class:`DsaAdapter` for a
    :class:`TinyDsa`, :class:`LlamaAdapter` for a :class:`TinyLlama`."""
    if isinstance(model, TinyDsa):
        return DsaAdapter(model.build())
    if isinstance(model, TinyLlama):
        return LlamaAdapter(model.build())
    raise TypeError(f"no adapter for a {type(model).__name__}; RunConfig.model is a TinyLlama or a TinyDsa")


def _rank(ctx: RankContext, cfg: RunConfig) -> dict | None:
    adapter = build_adapter(cfg.model)
    layout = SharedKVLayout(cfg.cp_size, cfg.page_size, cfg.pages_per_rank or pages_needed(cfg))
    comm = DistComm() if ctx.distributed else LocalComm()
    pool = shared_pool(ctx, adapter, layout, comm)
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * cfg.page_size, cfg.page_size, cfg.cp_size, layout=layout)
    runner = CPRunner(adapter, pool, alloc, comm, max_requests=len(cfg.requests),
                      max_len=max(n for _, n in cfg.requests) + cfg.decode_steps,
                      prefill_split=cfg.prefill_split, decode_split=cfg.decode_split, check_plans=cfg.check_plans)
    return _scenario(runner, cfg, ctx)


def run_scenario(cfg: RunConfig) -> dict:
    """Run ``cfg`` on a CP group of ``cfg.cp_size`` processes; return rank 0's report.

    Raises :class:`~cpkv.runtime.group.RankFailure` naming the first rank that
    failed; the shared segment is unlinked whatever happens. Before starting
    any process it raises ``TypeError`` for a model that is neither a
    :class:`TinyLlama` nor a :class:`TinyDsa` and ``ValueError`` for an
    impossible configuration.
    """
    if not isinstance(cfg.model, (TinyLlama, TinyDsa)):
        raise TypeError(f"RunConfig.model is a TinyLlama or a TinyDsa, not a {type(cfg.model).__name__}")
    if cfg.cp_size < 1 or cfg.page_size < 1:
        raise ValueError(f"cp_size and page_size must be >= 1, got {cfg.cp_size}, {cfg.page_size}")
    if any(not 0 <= c < n for c, n in cfg.requests):
        raise ValueError(f"every request needs 0 <= cached prefix < prompt length: {cfg.requests}")
    if max(n for _, n in cfg.requests) + cfg.decode_steps > cfg.model.max_positions:
        raise ValueError(f"sequences exceed the model's {cfg.model.max_positions} positions")
    cfg.model.config()  # refuse an impossible model shape before starting any process
    return launch(_rank, cfg.cp_size, cfg, timeout=cfg.timeout)
