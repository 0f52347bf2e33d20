"""Benchmarks: every figure is a median ratio against a baseline measured in the
same run (the machine is noisy; timed tests are not used)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..contract.allocator import OwnerLaneAllocator


def median_seconds(cases: dict[str, tuple[Callable, Callable | None]], repeats: int = 21) -> dict[str, float]:
    """Median wall time of each case's ``fn`` over ``repeats`` rounds.

    Cases run round-robin (one of each per round) so machine noise hits them
    alike; ``setup`` runs untimed before each timed call, and each result is
    kept until that case's next call, as a caller would keep it.
    """
    times = {k: [] for k in cases}
    kept = {}
    for i in range(repeats + 2):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            kept[name] = fn()
            dt = time.perf_counter() - t0
            if i >= 2:  # the first two rounds warm up
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def _extend_case(cp: int, bs: int, tokens: int, page: int, ragged: bool = False):
    if ragged:  # lengths spread over [per/2, 3per/2), summing to ``tokens``
        g = torch.Generator().manual_seed(1)
        w = torch.rand(bs, generator=g) + 0.5
        seq = (w / w.sum() * tokens).to(torch.int64).clamp_(min=1)
        seq[0] += tokens - int(seq.sum())
    else:
        per = tokens // bs
        seq = torch.full((bs,), per, dtype=torch.int64)
        seq[: tokens - per * bs] += 1
    prefix = torch.zeros(bs, dtype=torch.int64)
    last = torch.full((bs,), -1, dtype=torch.int64)
    alloc = OwnerLaneAllocator(2 * tokens + 4 * page * cp * bs, page, cp)

    def run():
        out = alloc.alloc_extend(prefix, prefix, seq, seq, last, tokens)
        assert out is not None and out.numel() == tokens
        return out

    return run, alloc.clear


def _decode_case(cp: int, bs: int, page: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 8 * page, (bs,), generator=g)
    alloc = OwnerLaneAllocator(int(prompt.sum()) * 2 + 4 * page * cp * bs, page, cp)
    state = {}

    def setup():
        alloc.clear()
        a = alloc.allocate_extend(torch.zeros(bs, dtype=torch.int64), prompt, torch.full((bs,), -1))
        state["last"] = a.out_cache_loc[a.extend_start_loc + a.extend_lens - 1]

    seq = prompt + 1

    def run():
        out = alloc.alloc_decode(seq, seq, state["last"])
        assert out is not None and out.numel() == bs
        return out

    return run, setup


def bench_alloc(page: int = 64, cp: int = 8, tokens: int = 262144, batch_sizes=(1, 32, 256),
                decode_bs: int = 1024, repeats: int = 21) -> list[dict]:
    """Owner-lane ``alloc_extend`` against the same allocator at cp 1 and
    against the floor (``torch.arange`` of the same length); decode at
    ``decode_bs`` against cp 1. Also one ragged-length extend row, where lane
    bases must be chosen request by request."""
    rows = []
    cases = [(f"extend bs={bs}", _extend_case, (bs, tokens, page), tokens) for bs in batch_sizes]
    cases.append((f"extend bs={batch_sizes[-1]} ragged", _extend_case, (batch_sizes[-1], tokens, page, True), tokens))
    cases.append((f"decode bs={decode_bs}", _decode_case, (decode_bs, page), decode_bs))
    for name, make, args, n in cases:
        t = median_seconds({
            "cp": make(cp, *args),
            "cp1": make(1, *args),
            "floor": (lambda n=n: torch.arange(n, dtype=torch.int64), None),
        }, repeats)
        rows.append({"case": name, f"cp{cp} ms": t["cp"] * 1e3, "cp1 ms": t["cp1"] * 1e3,
                     "floor ms": t["floor"] * 1e3, f"cp{cp}/cp1": t["cp"] / t["cp1"],
                     f"cp{cp}/floor": t["cp"] / t["floor"]})
    return rows


def format_rows(rows: list[dict], title: str) -> str:
    """A plain text table of benchmark rows."""
    keys = list(rows[0])
    width = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys}
    lines = [title, "  ".join(k.rjust(width[k]) for k in keys)]
    lines += ["  ".join(_fmt(r[k]).rjust(width[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def bench_kv(tokens: int = 65536, page: int = 64, cp: int = 4, kv_heads: int = 2, head_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, repeats: int = 21) -> list[dict]:
    """Write and read paths of one layer against plain ``index_copy_`` /
    ``index_select`` on an unshared buffer of the same size.

    Write: rank 0 writes the tokens it owns under the page split (owner check,
    write translation, copy into its segment). Read: every token of the batch
    through the rank-major view, with and without the once-per-batch
    translation.
    """
    from ..consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
    from ..contract.layout import SharedKVLayout

    ppr = -(-(tokens // page + 1) // cp) + 1
    layout = SharedKVLayout(cp, page, ppr)
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * page, page, cp, layout=layout)
    bs = 64
    a = alloc.allocate_extend([0] * bs, [tokens // bs] * bs, torch.full((bs,), -1))
    fams = kv_families(1, kv_heads, head_dim, dtype)
    shared = allocate_buffers(layout, fams)
    pool = SharedKVPool(layout, 0, fams, shared)
    plain = torch.zeros((2, *shared["k"].shape), dtype=dtype)  # same size, unshared, logical slot order
    mine = a.rank_token_indices(0)
    slots_w = a.out_cache_loc[mine]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(slots_w.numel(), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn_like(k)
    slots_r = a.out_cache_loc
    read = pool.read_index(slots_r)

    def plain_write():
        plain[0, 0].index_copy_(0, slots_w, k)
        plain[1, 0].index_copy_(0, slots_w, v)

    def plain_read():
        return plain[0, 0].index_select(0, slots_r), plain[1, 0].index_select(0, slots_r)

    t = median_seconds({
        "write": (lambda: pool.write(0, slots_w, k=k, v=v), None),
        "plain write": (plain_write, None),
        "read": (lambda: pool.gather(0, pool.read_index(slots_r)), None),
        "read, translated once per batch": (lambda: pool.gather(0, read), None),
        "plain read": (plain_read, None),
    }, repeats)
    return [
        {"path": "write (rank 0's tokens)", "tokens": slots_w.numel(), "ms": t["write"] * 1e3,
         "plain ms": t["plain write"] * 1e3, "ratio": t["write"] / t["plain write"]},
        {"path": "read incl. translation", "tokens": tokens, "ms": t["read"] * 1e3,
         "plain ms": t["plain read"] * 1e3, "ratio": t["read"] / t["plain read"]},
        {"path": "read, translated once per batch", "tokens": tokens,
         "ms": t["read, translated once per batch"] * 1e3, "plain ms": t["plain read"] * 1e3,
         "ratio": t["read, translated once per batch"] / t["plain read"]},
    ]


def _median_rounds(cases: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Median seconds of each whole-run case over ``repeats`` interleaved rounds (no warm-up rounds)."""
    times = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_engine(repeats: int = 3, requests: int = 24, scale: float = 0.1, prefix: int = 2048) -> list[dict]:
    """The engine against ``transformers``, medians of interleaved rounds, one thread, one process.

    * throughput: generated tokens per second of the engine (N 1, continuous
      batching, paged cache) on a multiturn trace, against ``generate()``
      with its dynamic cache, one request at a time, on the same requests
      (the engine's resolved prompts) and the same number of new tokens;
    * restore: making a ``prefix``-token prefix usable again from the host
      tier (device allocation plus the host -> device load of every layer)
      against recomputing it (allocation plus a prefill forward).
    """
    from ..consumers.hicache import HostPool
    from ..consumers.kv_pool import SharedKVPool, allocate_buffers
    from ..contract.layout import SharedKVLayout
    from ..engine.engine import EngineConfig, run_engine_threads
    from ..engine.scheduler import Scheduler  # noqa: F401  (the engine's scheduler is what runs)
    from ..models import LlamaAdapter, TinyLlama
    from ..runtime.runner import CPRunner

    torch.set_num_threads(1)
    model = TinyLlama(max_positions=8192)
    adapter = LlamaAdapter(model.build())
    cfg = EngineConfig(cp_size=1, page_size=16, device_pages=4096, requests=requests, scale=scale, chunk=4096,
                       max_running=64, model=model)
    report = run_engine_threads(cfg, adapter)  # warm-up, and the requests' resolved prompts
    seqs = report["sequences"]

    def hf():
        with torch.no_grad():
            for prompt, new in seqs:
                ids = torch.tensor([prompt])
                adapter.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       pad_token_id=0)

    gen = sum(n for _, n in seqs)
    t = _median_rounds({"engine": lambda: run_engine_threads(cfg, adapter), "transformers": hf}, repeats)
    rows = [{"case": f"generate: {len(seqs)} requests, {gen} new tokens (N 1)", "cpkv s": t["engine"],
             "baseline s": t["transformers"], "cpkv tok/s": gen / t["engine"],
             "baseline tok/s": gen / t["transformers"], "speed-up": t["transformers"] / t["engine"]}]

    # restore a prefix from the host tier vs recompute it
    S = 16
    layout = SharedKVLayout(1, S, prefix // S + 2)
    fams = adapter.families()
    pool = SharedKVPool(layout, 0, fams, allocate_buffers(layout, fams))
    host = HostPool(fams, HostPool.allocate(fams, prefix // S, S))
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * S, S, 1, layout=layout)
    runner = CPRunner(adapter, pool, alloc, max_requests=1, max_len=prefix)
    ids = torch.randint(0, model.vocab, (prefix,), generator=torch.Generator().manual_seed(0))
    host_slots = torch.arange(S, S + prefix)

    def recompute():
        a = runner.allocate([0], [prefix])
        runner.forward([0], a, ids)
        runner.finish(0)

    def restore():
        a = alloc.allocate_extend([0], [prefix], torch.tensor([-1]))
        host.load(pool, host_slots, a.out_cache_loc)
        alloc.free(a.out_cache_loc)

    t = median_seconds({"recompute": (recompute, None), "restore": (restore, None)}, max(repeats, 5))
    rows.append({"case": f"restore a {prefix}-token prefix from the host tier vs recompute it", "cpkv s": t["restore"],
                 "baseline s": t["recompute"], "cpkv tok/s": prefix / t["restore"],
                 "baseline tok/s": prefix / t["recompute"], "speed-up": t["recompute"] / t["restore"]})
    return rows
