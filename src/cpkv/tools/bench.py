"""Benchmarks: every figure is a median ratio against a baseline measured in the
same run (the machine is noisy; timed tests are not used)."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from dataclasses import dataclass
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
    from ..engine.config import EngineConfig
    from ..engine.engine import run_engine_threads
    from ..models import LlamaAdapter, TinyLlama
    from ..runtime.runner import CPRunner

    torch.set_num_threads(1)
    model = TinyLlama(max_positions=8192)
    adapter = LlamaAdapter(model.build())
    cfg = EngineConfig(cp_size=1, page_size=16, device_pages=4096, host_pages=0, requests=requests, scale=scale,
                       chunk=4096,
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


# -- prefill and decode splits on a process group -------------------------------------------------
SPLIT_MODELS = ("llama", "deepseek-v3.2")


def splits_model(name: str, max_positions: int):
    """The model configuration the split benchmark runs for ``name`` (see
    :data:`SPLIT_MODELS`), larger than the test configurations so that compute,
    not Python, dominates a forward on the CPU; fp32, seeded.

    * ``llama``: hidden 256, 8 heads of 32, 2 KV heads (GQA 4:1 as Llama-3-8B),
      MLP 896 (3.5x, as Llama-3-8B), 4 layers: K+V are 512 bytes per token per layer;
    * ``deepseek-v3.2``: hidden 256, 8 heads, MLA latent 128 + rope 32 on every
      layer, an indexer of 16 heads x 64 picking the top 256 positions per
      query, 3 layers (one dense, two MoE of 8 experts): latent + indexer key
      are 896 bytes per token per layer.
    """
    from ..models import model_config

    if name == "llama":
        return model_config("llama", hidden=256, layers=4, heads=8, kv_heads=2, intermediate=896,
                            max_positions=max_positions)
    if name == "deepseek-v3.2":
        return model_config("deepseek-v3.2", hidden=256, layers=3, heads=8, q_lora_rank=192, kv_lora_rank=128,
                            rope_dim=32, nope_dim=32, v_dim=32, intermediate=896, moe_intermediate=224,
                            index_heads=16, index_dim=64, index_topk=256, max_positions=max_positions)
    raise ValueError(f"unknown model {name!r} for the split benchmark; choose from {SPLIT_MODELS}")


@dataclass(frozen=True)
class SplitsSpec:
    """One model's split matrix on a CP group of ``cp`` ranks.

    Prefill: ``tokens`` new tokens over ``bs`` requests of equal length (no
    cached prefix), under every prefill split. Decode: one new token for each
    of ``decode_bs`` requests whose context (cached entries plus the new one)
    is ``context`` positions, under every decode split; with ``ragged`` a
    second decode batch has contexts drawn from ``[context/2, 3context/2)``.
    Decode contexts are filled with seeded random entries, written by their
    owners, instead of being prefilled (the timing does not depend on them).
    ``repeats`` timed rounds for prefill, ``decode_repeats`` (default ``4 *
    repeats``) for decode, each after two warm-up rounds.
    """

    model: object
    cp: int = 4
    tokens: int = 16384
    bs: int = 4
    decode_bs: int = 64
    context: int = 4096
    page: int = 16
    repeats: int = 5
    ragged: bool = True
    seed: int = 0
    decode_repeats: int | None = None

    def decode_rounds(self) -> int:
        """Timed decode rounds."""
        return 4 * self.repeats if self.decode_repeats is None else self.decode_repeats

    def prefill_lens(self) -> list[int]:
        """Prefill lengths: ``tokens`` split as evenly as possible over ``bs``."""
        per, extra = divmod(self.tokens, self.bs)
        return [per + (i < extra) for i in range(self.bs)]

    def decode_contexts(self) -> list[list[int]]:
        """Context lengths of each decode batch: uniform, then (``ragged``) spread."""
        out = [[self.context] * self.decode_bs]
        if self.ragged:
            g = torch.Generator().manual_seed(self.seed + 1)
            lo = max(self.context // 2, 2)
            out.append(torch.randint(lo, lo + self.context, (self.decode_bs,), generator=g).tolist())
        return out

    def check(self) -> None:
        """Refuse an impossible matrix (``ValueError``) before any rank starts."""
        sizes = dict(cp=self.cp, tokens=self.tokens, bs=self.bs, decode_bs=self.decode_bs, context=self.context,
                     page=self.page, repeats=self.repeats, decode_repeats=self.decode_rounds())
        for name, v in sizes.items():
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.context < 2:
            raise ValueError(f"a decode context holds a cached entry and the new token: context >= 2, "
                             f"got {self.context}")
        if self.tokens < self.bs:
            raise ValueError(f"{self.tokens} prefill tokens cannot fill {self.bs} requests")
        if self.tokens < self.cp:
            raise ValueError(f"the interleave split needs at least cp={self.cp} prefill tokens, got {self.tokens}")
        longest = max(max(self.prefill_lens()), *(max(c) for c in self.decode_contexts()))
        if longest > self.model.max_positions:
            raise ValueError(f"a sequence of {longest} exceeds the model's {self.model.max_positions} positions")
        self.model.config()

    def pages_per_rank(self) -> int:
        """Room for the larger phase (phases run one after the other), with a
        page per request per lane of slack."""
        S, N = self.page, self.cp
        need = [sum(-(-n // S) for n in self.prefill_lens())] + [sum(-(-n // S) for n in c)
                                                                 for c in self.decode_contexts()]
        return -(-max(need) // N) + max(self.bs, self.decode_bs) + 2


def _split_counters(runner) -> dict:
    return {"tokens": runner.tokens_computed, "reads": dict(runner.reads), "moved": runner.moved_bytes}


def _time_splits(runner, comm, cases: dict, repeats: int) -> dict:
    """Median seconds of each case (a whole forward of every rank: a barrier
    before, untimed, and one after, timed) and this rank's work counters of one
    forward of it (they are the same every time)."""
    counts, busy = {}, {name: [] for name in cases}

    def timed(name, fn):
        def run():
            before = _split_counters(runner)
            cpu = time.process_time()
            fn()
            busy[name].append(time.process_time() - cpu)
            comm.barrier()
            after = _split_counters(runner)
            counts[name] = {"tokens": after["tokens"] - before["tokens"], "moved": after["moved"] - before["moved"],
                            "reads": {k: v - before["reads"].get(k, 0) for k, v in after["reads"].items()}}
        return run

    t = median_seconds({name: (timed(name, fn), comm.barrier) for name, fn in cases.items()}, repeats)
    for name in cases:  # CPU seconds of this rank's forward, median of the timed rounds
        counts[name]["cpu"] = statistics.median(busy[name][2:] or busy[name])
    return {name: {"seconds": t[name], "counts": counts[name]} for name in cases}


def _fill_random(runner, slots: torch.Tensor, seed: int) -> None:
    """Seeded random entries of every family and layer at the slots of
    ``slots`` this rank owns, written by it (the owner) into its own segment."""
    pool = runner.pool
    mine = slots[pool.layout.owned_slot_mask(slots, owner_rank=pool.rank)]
    g = torch.Generator().manual_seed(seed * 1009 + pool.rank)
    values = {n: torch.randn((len(f.layers), mine.numel(), *f.shape), generator=g).to(f.dtype)
              for n, f in pool.families.items()}
    pool.write_all_layers(mine, values)


def _splits_matrix(ctx, comm, spec: SplitsSpec) -> dict | None:
    """One model's matrix on this rank: prefill, then each decode batch, every
    split of each interleaved in rounds; rank 0 returns every rank's counters."""
    from ..consumers.kv_pool import SharedKVPool, allocate_buffers
    from ..contract.layout import SharedKVLayout
    from ..models import build_adapter
    from ..runtime.batch import DECODE_SPLITS, PREFILL_SPLITS
    from ..runtime.runner import CPRunner

    adapter = build_adapter(spec.model)
    layout = SharedKVLayout(spec.cp, spec.page, spec.pages_per_rank())
    fams = adapter.families()
    tag = f"{type(spec.model).__name__}_"  # one pool per model in the one group
    bufs = allocate_buffers(layout, fams, lambda name, shape, dtype: ctx.shared(tag + name, shape, dtype))
    pool = SharedKVPool(layout, comm.rank, fams, bufs, fence=comm.barrier)
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * spec.page, spec.page, spec.cp, layout=layout)
    contexts = spec.decode_contexts()
    runner = CPRunner(adapter, pool, alloc, comm, max_requests=max(spec.bs, spec.decode_bs),
                      max_len=max(max(spec.prefill_lens()), *(max(c) for c in contexts)))
    g = torch.Generator().manual_seed(spec.seed)
    vocab = spec.model.vocab
    out = {}

    rows = list(range(spec.bs))
    a = runner.allocate(rows, spec.prefill_lens())
    ids = torch.randint(0, vocab, (spec.tokens,), generator=g)

    def prefill(split):
        def fn():
            runner.prefill_split = split
            runner.forward(rows, a, ids)
        return fn

    out["prefill"] = _time_splits(runner, comm, {s: prefill(s) for s in PREFILL_SPLITS}, spec.repeats)
    for r in rows:
        runner.finish(r)

    for i, ctx_lens in enumerate(contexts):
        rows = list(range(spec.decode_bs))
        cached = runner.allocate(rows, [n - 1 for n in ctx_lens])
        _fill_random(runner, cached.out_cache_loc, spec.seed + i)
        comm.barrier()  # every owner's entries are in before anyone reads them
        d = runner.allocate(rows, [1] * spec.decode_bs, decode=True)
        ids = torch.randint(0, vocab, (spec.decode_bs,), generator=g)

        def decode(split, d=d, ids=ids, rows=rows):
            def fn():
                runner.decode_split = split
                runner.forward(rows, d, ids, decode=True)
            return fn

        out[f"decode{i}"] = _time_splits(runner, comm, {s: decode(s) for s in DECODE_SPLITS}, spec.decode_rounds())
        for r in rows:
            runner.finish(r)

    everyone = comm.all_gather_object({k: {s: c["counts"] for s, c in v.items()} for k, v in out.items()})
    if comm.rank != 0:
        return None
    for phase, cases in out.items():
        for s, c in cases.items():
            c["ranks"] = [e[phase][s] for e in everyone]
            del c["counts"]
    return {"phases": out, "layers": adapter.num_layers, "contexts": contexts, "attention_family": fams[0].name,
            "family_layers": {f.name: len(f.layers) for f in fams}}


def _splits_rank(ctx, specs: list[SplitsSpec]) -> list[dict] | None:
    """One rank of the split benchmark: every model's matrix, one after the other, in this one group."""
    from ..runtime.comm import DistComm, LocalComm

    comm = DistComm() if ctx.distributed else LocalComm()
    results = [_splits_matrix(ctx, comm, spec) for spec in specs]
    return results if comm.rank == 0 else None


def measure_splits(*specs: SplitsSpec, timeout: float = 3600.0) -> list[dict]:
    """Run each spec's split matrix, one after the other, on one group of
    ``cp`` processes (every case of a matrix interleaved in rounds inside it),
    and return rank 0's raw result per spec: per phase (``prefill``,
    ``decode0`` the same-length contexts, ``decode1`` the ragged ones) and
    split, the median ``seconds`` of a forward and every rank's counters of one
    forward (``tokens`` computed, context entries ``reads`` per family, cache
    bytes ``moved`` to it from other ranks, median ``cpu`` seconds). Raises
    ``ValueError`` on an impossible spec, or specs of different group sizes,
    before any process starts."""
    from ..runtime.group import launch

    if not specs:
        raise ValueError("measure_splits needs at least one spec")
    if len({s.cp for s in specs}) != 1:
        raise ValueError(f"one group runs every spec: cp must agree, got {[s.cp for s in specs]}")
    if len({type(s.model) for s in specs}) != len(specs):
        raise ValueError("one spec per model family: their pools share the group")
    for s in specs:
        s.check()
    return launch(_splits_rank, specs[0].cp, list(specs), timeout=timeout)


def _ratio(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def default_split_tokens(model: str) -> int:
    """Prefill tokens of the split benchmark: 16384 for Llama; 4096 for DSA,
    whose indexer copies each query's whole context (``[T, L, index_dim]``),
    more than 4 ranks of this benchmark hold at 16K."""
    return 16384 if model == "llama" else 4096


def bench_splits(models=SPLIT_MODELS, cp: int = 4, tokens: int | None = None, bs: int = 4, decode_bs: int = 64,
                 context: int = 4096, page: int = 16, repeats: int = 5, ragged: bool = True) -> dict[str, dict]:
    """Prefill and decode splits of each of ``models`` (:func:`splits_model`;
    a name or a sequence of names), medians of interleaved rounds, on one
    process group of ``cp`` ranks (:class:`SplitsSpec`, :func:`measure_splits`);
    ``tokens`` defaults to :func:`default_split_tokens`.

    Returns ``{model: {"rows": rows, "raw": raw}}``. One row per phase and
    split: time of a forward and per layer; against the baseline (prefill: the
    fastest all-gather split; decode: ``owner``); cache bytes moved between
    ranks per layer (all ranks together); per-rank tokens computed and
    attention reads (context entries of the attention family: K for Llama,
    the latent for DSA), max and max / mean; per-rank CPU time, max and sum;
    for DSA also the indexer's reads (``index_k``): each query's whole
    context, read once, by the rank that computes it (under ``lse``, by the
    one rank that selects for it).
    Raises ``ValueError`` on impossible sizes before any process starts.
    """
    models = [models] if isinstance(models, str) else list(models)
    specs = []
    for model in models:
        n = tokens or default_split_tokens(model)
        longest = max(-(-n // max(bs, 1)), context + context // 2 + 1 if ragged else context)
        specs.append(SplitsSpec(splits_model(model, max(longest, 512)), cp, n, bs, decode_bs, context, page,
                                repeats, ragged))
    raws = measure_splits(*specs)
    return {model: {"rows": _split_rows(model, spec, raw), "raw": raw} for model, spec, raw in zip(models, specs, raws)}


def _split_rows(model: str, spec: SplitsSpec, raw: dict) -> list[dict]:
    L, fam, per = raw["layers"], raw["attention_family"], raw["family_layers"]
    rows = []
    for phase, cases in raw["phases"].items():
        if phase == "prefill":
            label = f"prefill {spec.tokens} tok, bs {spec.bs}"
            base = min(c["seconds"] for s, c in cases.items() if s != "page")
        else:
            ctx = raw["contexts"][int(phase[-1])]
            label = (f"decode bs {spec.decode_bs}, ctx {spec.context}" if len(set(ctx)) == 1 else
                     f"decode bs {spec.decode_bs}, ctx {min(ctx)}-{max(ctx)} (mean {sum(ctx) // len(ctx)})")
            base = cases["owner"]["seconds"]
        for split, c in cases.items():
            ranks = c["ranks"]
            tok = [r["tokens"] for r in ranks]
            att = [r["reads"].get(fam, 0) // per[fam] for r in ranks]
            row = {"case": label, "split": split, "ms/fwd": c["seconds"] * 1e3, "ms/layer": c["seconds"] * 1e3 / L,
                   "vs base": c["seconds"] / base, "moved KB/layer": sum(r["moved"] for r in ranks) / L / 1024,
                   "tokens max": max(tok), "tok max/mean": _ratio(tok),
                   "reads/layer max": max(att), "reads max/mean": _ratio(att),
                   "cpu ms max": max(r["cpu"] for r in ranks) * 1e3, "cpu ms sum": sum(r["cpu"] for r in ranks) * 1e3}
            if "index_k" in per:
                idx = [r["reads"].get("index_k", 0) // per["index_k"] for r in ranks]
                row["index reads/layer max"] = max(idx)
                row["index max/mean"] = _ratio(idx)
            rows.append(row)
    return rows


def splits_title(model: str, cp: int, tokens: int, bs: int, decode_bs: int, context: int, page: int,
                 repeats: int) -> str:
    """The heading of a :func:`bench_splits` table: model, sizes, machine and its load."""
    import os

    m = splits_model(model, 8192)
    shape = (f"Llama {m.layers} layers, hidden {m.hidden}, {m.heads} heads / {m.kv_heads} KV heads, MLP "
             f"{m.intermediate}" if model == "llama" else
             f"DeepSeek-V3.2 {m.layers} layers, hidden {m.hidden}, {m.heads} heads, latent {m.kv_lora_rank} + rope "
             f"{m.rope_dim}, indexer {m.index_heads} x {m.index_dim}, top-{m.index_topk}")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"splits: {shape}, fp32; CP {cp} processes in one group (gloo, 1 torch thread each), page {page}; "
            f"prefill {tokens} tokens over bs {bs}, median of {repeats} rounds; decode bs {decode_bs}, context "
            f"{context} (and a ragged batch), median of {4 * repeats} rounds; vs base: prefill / fastest all-gather "
            f"split, decode / owner; moved: bytes received from other ranks, all ranks; reads: context entries of "
            f"the attention family per rank; cpu: per-rank CPU time of a forward. Machine: {os.cpu_count()} CPU "
            f"cores, load average (1/5/15 min) {load} at the end")
