"""Benchmarks: every figure is a median ratio against a baseline measured in the
same run (the machine is noisy; timed tests are not used)."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from typing import Callable

import numpy as np
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


class BlockListBaseline:
    """The allocator engines already run, in plain Python: per block, what
    nano-vllm's ``BlockManager`` does (a deque of free block ids, here one per
    owner lane, popped and pushed one block at a time; the set of blocks in
    use; a reference count per block, reset on allocation and dropped on free,
    the block returning to the free list at zero), as vLLM v1's ``BlockPool``
    keeps a free queue and per-block reference counts. It follows the same
    owner-lane rule (lane bases least-full, request by request), so it returns
    the same ``out_cache_loc`` as :class:`OwnerLaneAllocator`."""

    def __init__(self, num_pages: int, page_size: int, cp_size: int):
        self.num_pages, self.S, self.N = num_pages, page_size, cp_size
        self.clear()

    def clear(self) -> None:
        N = self.N
        self.lanes = [deque(range(l if l else N, self.num_pages + 1, N)) for l in range(N)]
        self.used: set[int] = set()
        self.ref = [0] * (self.num_pages + 1)

    def alloc_extend(self, seq_lens: list[int]) -> torch.Tensor:
        """Fresh requests of ``seq_lens`` tokens; the slots of all their pages
        come from one broadcast (and, when a last page is partial, one mask)."""
        S, N, lanes, used, ref = self.S, self.N, self.lanes, self.used, self.ref
        pages, used_in_page = [], []
        for n in seq_lens:
            free = [len(q) for q in lanes]
            b = free.index(max(free))
            k = -(-n // S)
            for q in range(k):
                p = lanes[(b + q) % N].popleft()
                ref[p] = 1
                used.add(p)
                pages.append(p)
            used_in_page += [S] * (k - 1) + [n - (k - 1) * S]
        full = (np.array(pages)[:, None] * S + np.arange(S)).reshape(-1)
        if all(n % S == 0 for n in seq_lens):
            return torch.from_numpy(full)
        return torch.from_numpy(full[(np.arange(S)[None, :] < np.array(used_in_page)[:, None]).reshape(-1)])

    def alloc_decode(self, last_loc: list[int]) -> torch.Tensor:
        """One token per request after ``last_loc`` (every request has one)."""
        S, N, lanes, used, ref = self.S, self.N, self.lanes, self.used, self.ref
        out = []
        for last in last_loc:
            if last % S != S - 1:
                out.append(last + 1)
            else:
                p = lanes[(last // S % N + 1) % N].popleft()
                ref[p] = 1
                used.add(p)
                out.append(p * S)
        return torch.tensor(out)

    def free_pages(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``, one block at a time; a block
        at zero goes back to its lane (``KeyError`` on a double free)."""
        N, lanes, used, ref = self.N, self.lanes, self.used, self.ref
        for p in pages:
            ref[p] -= 1
            if ref[p] == 0:
                used.remove(p)
                lanes[p % N].append(p)


def _lengths(bs: int, tokens: int, ragged: bool) -> torch.Tensor:
    if ragged:  # lengths spread over [per/2, 3per/2), summing to ``tokens``
        g = torch.Generator().manual_seed(1)
        w = torch.rand(bs, generator=g) + 0.5
        seq = (w / w.sum() * tokens).to(torch.int64).clamp_(min=1)
        seq[0] += tokens - int(seq.sum())
        return seq
    per = tokens // bs
    seq = torch.full((bs,), per, dtype=torch.int64)
    seq[: tokens - per * bs] += 1
    return seq


def _extend_case(alloc: OwnerLaneAllocator, seq: torch.Tensor):
    bs, tokens = seq.numel(), int(seq.sum())
    prefix = torch.zeros(bs, dtype=torch.int64)
    last = torch.full((bs,), -1, dtype=torch.int64)

    def run():
        return alloc.alloc_extend(prefix, prefix, seq, seq, last, tokens)

    return run, alloc.clear


def _decode_prompts(bs: int, page: int) -> torch.Tensor:
    """Prompt lengths: half end on a page boundary (their decode takes a page), half do not."""
    g = torch.Generator().manual_seed(0)
    pages = torch.randint(1, 8, (bs,), generator=g)
    off = torch.randint(1, page, (bs,), generator=g)
    return torch.where(torch.arange(bs) % 2 == 0, pages * page, pages * page - off)


def _decode_case(alloc: OwnerLaneAllocator, prompt: torch.Tensor):
    bs = prompt.numel()
    state = {}

    def setup():
        alloc.clear()
        a = alloc.allocate_extend(torch.zeros(bs, dtype=torch.int64), prompt, torch.full((bs,), -1))
        state["last"] = a.out_cache_loc[a.extend_start_loc + a.extend_lens - 1]

    seq = prompt + 1

    def run():
        return alloc.alloc_decode(seq, seq, state["last"])

    return run, setup


def _free_case(alloc: OwnerLaneAllocator, tokens: int, by_pages: bool):
    state = {}

    def setup():
        alloc.clear()
        slots = alloc.alloc_extend(*(torch.zeros(1, dtype=torch.int64),) * 2, *(torch.tensor([tokens]),) * 2,
                                   torch.tensor([-1]), tokens)
        state["x"] = slots[:: alloc.page_size] // alloc.page_size if by_pages else slots

    def run():
        (alloc.free_pages if by_pages else alloc.free)(state["x"])

    return run, setup


def bench_alloc(page: int = 64, cp: int = 8, pool_pages: int = 32768, tokens: int = 262144,
                batch_sizes=(1, 32, 256), decode_bs: int = 1024, repeats: int = 21) -> list[dict]:
    """``OwnerLaneAllocator`` at ``cp`` on a pool of ``pool_pages`` pages against,
    in the same interleaved rounds: a per-block Python free list with the same
    lane rule and the same ``out_cache_loc`` (:class:`BlockListBaseline`), the
    same allocator at cp 1, and the floor (``torch.arange`` of the output's
    length). Rows: extend of ``tokens`` tokens at each batch size and a ragged
    batch, decode at ``decode_bs`` (half the requests take a new page), and a
    free of ``tokens`` slots by slots and by pages.

    Conditions, the same for every case: torch runs one thread (on a shared
    machine a second intra-op thread that is not scheduled stalls a 2 MB op for
    milliseconds); the garbage collector is off while timing, as ``timeit``
    does; and one 8 MB buffer is taken and given back first, so the C
    allocator serves 2 MB results from its heap as a long-running engine's
    does, instead of mapping fresh pages for the first rows only."""
    threads, collecting = torch.get_num_threads(), gc.isenabled()
    torch.set_num_threads(1)
    np.ones(8 << 20, dtype=np.uint8).sum()  # taken, touched, given back
    gc.collect()
    gc.disable()
    try:
        return _bench_alloc(page, cp, pool_pages, tokens, batch_sizes, decode_bs, repeats)
    finally:
        torch.set_num_threads(threads)
        if collecting:
            gc.enable()


def _bench_alloc(page, cp, pool_pages, tokens, batch_sizes, decode_bs, repeats) -> list[dict]:
    size, S, N = pool_pages * page, page, cp
    rows = []

    def allocs():
        return OwnerLaneAllocator(size, S, N), BlockListBaseline(pool_pages, S, N), OwnerLaneAllocator(size, S, 1)

    def row(name, cases, n, check=None):
        t = median_seconds(cases | {"floor": (lambda: torch.arange(n, dtype=torch.int64), None)}, repeats)
        rows.append({"case": name, f"cp{N} ms": t["cp"] * 1e3, "per-block ms": t["block"] * 1e3,
                     "cp1 ms": t["cp1"] * 1e3, "floor ms": t["floor"] * 1e3,
                     f"cp{N}/per-block": t["cp"] / t["block"], f"cp{N}/cp1": t["cp"] / t["cp1"],
                     f"cp{N}/floor": t["cp"] / t["floor"]})

    shapes = [(f"alloc_extend bs={bs}", bs, False) for bs in batch_sizes]
    shapes.append((f"alloc_extend bs={batch_sizes[-1]} ragged", batch_sizes[-1], True))
    for name, bs, ragged in shapes:
        seq = _lengths(bs, tokens, ragged)
        ours, block, one = allocs()
        lens = seq.tolist()
        run, setup = _extend_case(ours, seq)
        setup()
        assert torch.equal(run(), block.alloc_extend(lens)), "the per-block baseline disagrees"
        row(f"{name} ({tokens // page} pages)", {
            "cp": (run, setup),
            "block": (lambda b=block, l=lens: b.alloc_extend(l), block.clear),
            "cp1": _extend_case(one, seq),
        }, tokens)

    prompt = _decode_prompts(decode_bs, page)
    ours, block, one = allocs()
    run, setup = _decode_case(ours, prompt)
    held = {}

    def block_setup(b=block):
        b.clear()
        slots = b.alloc_extend(prompt.tolist())
        held["last"] = slots[torch.cumsum(prompt, 0) - 1].tolist()

    setup(), block_setup()
    assert torch.equal(run(), block.alloc_decode(held["last"])), "the per-block baseline disagrees on decode"
    row(f"alloc_decode bs={decode_bs} (half take a page)", {
        "cp": (run, setup),
        "block": (lambda b=block: b.alloc_decode(held["last"]), block_setup),
        "cp1": _decode_case(one, prompt),
    }, decode_bs)

    for by_pages in (False, True):
        ours, block, one = allocs()

        def block_free_setup(b=block):
            b.clear()
            held["pages"] = (b.alloc_extend([tokens])[::page] // page).tolist()

        what = f"free of {tokens // page} pages by " + ("pages" if by_pages else f"slots ({tokens} slots)")
        row(what, {
            "cp": _free_case(ours, tokens, by_pages),
            "block": (lambda b=block: b.free_pages(held["pages"]), block_free_setup),
            "cp1": _free_case(one, tokens, by_pages),
        }, tokens // page if by_pages else tokens)
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
