"""The Triton kernels at the speed of the hardware: one section per function,
each a dict with its ``title``, its ``rows`` and the sizes it ran.

Every figure is a ratio against a baseline measured in the same run, the
median of interleaved rounds (:func:`medians`: on a GPU each call captured in
a CUDA graph and replayed back to back between CUDA events, so the kernels
are timed, not the Python that launches them; each section's ``timing`` says
how each case was timed): decode attention, sparse MLA, the indexer and
the store as bytes per second against a device-to-device copy
(:func:`copy_bandwidth`: bytes read plus bytes written per second); the
prefill against torch's scaled-dot-product attention (flash) on the same
tokens; the log-sum-exp split's per-rank decode time against N = 1.

On a GPU (``device="cuda"``) they run at the real sizes (bfloat16, Hkv 8 x D
128, page 64; DeepSeek-V3.2's MLA and indexer); ``dry_run=True`` runs every
code path at tiny sizes on the CPU (float32, Triton's interpreter): figures
that mean nothing, a shape that a test checks. ``cpkv bench kernels --compile``
prints the sm_90 compile report (:mod:`cpkv.kernels.compile_check`), the
only part that means something without a GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from ...contract.layout import SharedKVLayout
from ...kernels import get
from ...kernels.backend import CacheView, WriteIndex

#: the decode sizes timed: batch x context
DECODE_BATCHES, DECODE_CONTEXTS = (1, 8, 64), (32768, 131072)
_DRY = dict(batches=(1,), contexts=(40,), prefill=40, topk=24, store=16)


#: A timed round on a GPU keeps it busy at least this long (a captured call replayed back to back), so that the
#: Python launching the kernels is not what is timed; at most :data:`MAX_CALLS` calls a round.
ROUND_S, MAX_CALLS = 3e-3, 200


def medians(cases: dict[str, Callable[[], object]], dev: torch.device, repeats: int,
            how: dict[str, str] | None = None) -> dict[str, float]:
    """Median seconds per call of each of ``cases`` (name -> callable) over
    ``repeats`` rounds, interleaved (one round of every case, then the next),
    after a first call of each (compiles, warms).

    On a GPU each case is captured once in a CUDA graph (its launches without
    the Python around them; a case that cannot be captured runs as it is) and
    a round replays it back to back, as many times as keep the GPU busy
    :data:`ROUND_S` or longer, between two CUDA events: the kernels' time per
    call. On the CPU: the wall clock of one call per round. ``how``, when
    given, gets each case's method: ``graph``, ``eager (why)`` or ``wall``."""
    how = {} if how is None else how
    times: dict[str, list[float]] = {k: [] for k in cases}
    if dev.type != "cuda":
        for fn in cases.values():
            fn()
        for _ in range(repeats):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        how.update({k: "wall" for k in cases})
        return {k: statistics.median(v) for k, v in times.items()}
    runs, calls = {}, {}
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        once = time.perf_counter() - t0  # with the launch overhead: an upper bound of a call
        runs[name], how[name] = _graphed(fn, dev)
        calls[name] = max(1, min(MAX_CALLS, math.ceil(ROUND_S / max(once, 1e-6))))
    for _ in range(repeats):
        for name, run in runs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls[name]):
                run()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) / 1e3 / calls[name])
    return {k: statistics.median(v) for k, v in times.items()}


def _graphed(fn: Callable[[], object], dev: torch.device) -> tuple[Callable[[], object], str]:
    """``fn`` captured in a CUDA graph (warmed on a side stream first, as
    capture wants): its replay and ``"graph"``; where capture fails, ``fn``
    itself and ``"eager (the error)"``."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    try:
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize(dev)
        return g.replay, "graph"
    except Exception as e:  # noqa: BLE001 - reported in the section: timed as it runs instead
        torch.cuda.synchronize(dev)
        return fn, f"eager ({type(e).__name__}: {str(e)[:120]})"


def _setup(device: str, dry_run: bool, repeats: int) -> tuple[torch.device, torch.dtype, int]:
    """The device, the dtype (bfloat16 on a GPU, float32 in a dry run) and the
    timed rounds (one in a dry run). ``ValueError`` for a timed run off a GPU."""
    dev = torch.device("cpu" if dry_run else device)
    if not dry_run and dev.type != "cuda":
        raise ValueError("the kernel benchmarks time a GPU (device='cuda'); on the CPU use dry_run=True")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return dev, (torch.float32 if dry_run else torch.bfloat16), (1 if dry_run else repeats)


def _paged(batch: int, context: int, page: int, cp: int, dev: torch.device, seed: int = 0):
    """A layout holding ``batch`` requests of ``context`` tokens on shuffled
    pages, and their table ``[batch, context]`` (int64) on ``dev``."""
    pages = batch * (-(-context // page))
    layout = SharedKVLayout(cp, page, -(-(pages + 1) // cp) + 1)
    g = torch.Generator().manual_seed(seed)
    order = (torch.randperm(layout.num_pages - 1, generator=g)[:pages] + 1).view(batch, -1)
    pos = torch.arange(context)
    table = (order.repeat_interleave(page, 1)[:, :context] * page + pos % page).to(dev)
    return layout, table


def copy_bandwidth(device: str = "cuda", nbytes: int = 2**31, repeats: int = 20, dry_run: bool = False) -> dict:
    """The baseline every bandwidth figure is a fraction of: a device-to-device
    copy of ``nbytes`` (``dst.copy_(src)``, timed as :func:`medians` times);
    ``bytes_per_second`` counts the bytes read and the bytes written."""
    dev, _, reps = _setup(device, dry_run, repeats)
    n = 2**20 if dry_run else nbytes
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    how: dict[str, str] = {}
    t = medians({"copy": lambda: dst.copy_(src)}, dev, reps, how)["copy"]
    return dict(title=f"device-to-device copy of {n} bytes", bytes=2 * n, seconds=t, bytes_per_second=2 * n / t,
                timing=how["copy"])


def _fraction(bps: float, copy: dict) -> float:
    """``bps`` as a fraction of the copy's bytes per second, to three significant digits."""
    return float(f"{bps / copy['bytes_per_second']:.3g}")


def bench_decode(device: str = "cuda", batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS, kv_heads: int = 8,
                 heads: int = 32, head_dim: int = 128, page: int = 64, cp: int = 8, repeats: int = 20,
                 dry_run: bool = False) -> dict:
    """Paged GQA decode attention (one query per request, split-KV and the
    merge) at each batch x context over a group of ``cp`` ranks' pages: the K
    and V bytes read per second, as a fraction of :func:`copy_bandwidth`
    measured in the same run, for the group's memory read as one buffer
    (``fraction_of_copy``) and as ``cp`` segments through their table
    (``table_fraction_of_copy``: what every multi-rank group runs;
    ``table_vs_buffer`` its time over the one buffer's), timed in the same
    interleaved rounds. The segments are views of the one buffer (the
    kernel's arithmetic is a table of bases either way; no second copy of
    the cache)."""
    from ...consumers.kv_view import KVView

    dev, dtype, reps = _setup(device, dry_run, repeats)
    if dry_run:
        batches, contexts, kv_heads, heads, head_dim, page = _DRY["batches"], _DRY["contexts"], 2, 4, 16, 16
    copy = copy_bandwidth(device, dry_run=dry_run, repeats=repeats)
    b, rows, how = get("triton"), [], {}
    for batch in batches:
        for ctx in contexts:
            layout, table = _paged(batch, ctx, page, cp, dev)
            n, spr = layout.cp_size * layout.slots_per_rank, layout.slots_per_rank
            k = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
            v = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
            q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
            req = torch.arange(batch, device=dev)
            plan = b.plan(table, req, torch.full((batch,), ctx - 1, device=dev), layout, with_lse=False)
            kv = (CacheView(k, None, (kv_heads, head_dim)), CacheView(v, None, (kv_heads, head_dim)))
            segs = [KVView.of_segments([x[None, r * spr: (r + 1) * spr] for r in range(cp)]).layer(0) for x in (k, v)]
            kv_table = tuple(CacheView(x, None, (kv_heads, head_dim)) for x in segs)
            name = f"{batch}x{ctx}"
            t = medians({name: lambda: b.dense(plan, q, *kv, head_dim**-0.5),
                         f"{name} table": lambda: b.dense(plan, q, *kv_table, head_dim**-0.5)}, dev, reps, how)
            read = 2 * batch * ctx * kv_heads * head_dim * k.element_size()
            one, seg = t[name], t[f"{name} table"]
            rows.append(dict(batch=batch, context=ctx, seconds=one, table_seconds=seg, bytes_read=read,
                             bytes_per_second=read / one, fraction_of_copy=_fraction(read / one, copy),
                             table_fraction_of_copy=_fraction(read / seg, copy),
                             table_vs_buffer=round(seg / one, 3)))
            kv = kv_table = segs = None  # the views hold the buffers: free them before the next size
            del k, v
    return dict(title=f"decode attention, {dtype}, Hkv {kv_heads} x D {head_dim}, {heads} heads, page {page}, "
                      f"{cp} ranks' pages: K/V bytes read per second against a device-to-device copy, from one "
                      "buffer and through the segment table", copy=copy, rows=rows, timing=how)


def bench_sparse_mla(device: str = "cuda", batches=DECODE_BATCHES, heads=(16, 128), kv_lora_rank: int = 512,
                     rope_dim: int = 64, topk: int = 2048, context: int = 32768, fp8: bool = False,
                     repeats: int = 20, dry_run: bool = False) -> dict:
    """DeepSeek-V3.2's sparse MLA decode (each query over its ``topk``
    selected latents, in bfloat16 or the FP8 cache format decoded in the
    kernel): latent bytes read per second against a copy."""
    from ...consumers.kv_format import mla_latent_fp8

    dev, dtype, reps = _setup(device, dry_run, repeats)
    if dry_run:
        batches, heads, kv_lora_rank, rope_dim, topk, context = _DRY["batches"], (4,), 32, 8, _DRY["topk"], 64
    copy = copy_bandwidth(device, dry_run=dry_run, repeats=repeats)
    b, rows, width, how = get("triton"), [], kv_lora_rank + rope_dim, {}
    fmt = mla_latent_fp8(kv_lora_rank, rope_dim) if fp8 else None
    for batch in batches:
        layout, table = _paged(batch, context, 64, 1, dev)
        n = layout.cp_size * layout.slots_per_rank
        values = torch.randn(n, width, device=dev)
        lat = CacheView(fmt.encode(values) if fp8 else values.to(dtype), fmt, (width,))
        g = torch.Generator(device=dev).manual_seed(1)
        sel = table.gather(1, torch.randint(0, context, (batch, topk), device=dev, generator=g))
        empty = table[:, :0]
        for h in heads:
            q = torch.randn(batch, h, width, device=dev, dtype=dtype)
            plan = b.plan(empty, torch.arange(batch, device=dev), torch.full((batch,), -1, device=dev), layout)
            t = medians({f"{batch}x{h}": lambda: b.selected(plan, q, lat, sel, 0.1, kv_lora_rank)}, dev, reps,
                        how)[f"{batch}x{h}"]
            read = batch * topk * (fmt.bytes_per_slot if fp8 else width * lat.data.element_size())
            rows.append(dict(batch=batch, heads=h, seconds=t, bytes_read=read, bytes_per_second=read / t,
                             fraction_of_copy=_fraction(read / t, copy)))
    return dict(title=f"sparse MLA decode, latent {kv_lora_rank} + {rope_dim} ({'fp8' if fp8 else dtype}), top-k "
                      f"{topk}: latent bytes read per second against a copy", copy=copy, rows=rows, timing=how)


def bench_indexer(device: str = "cuda", batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS, heads: int = 64,
                  dim: int = 128, fp8: bool = False, repeats: int = 20, dry_run: bool = False) -> dict:
    """DeepSeek-V3.2's lightning indexer at decode (each query scores its
    whole context, bfloat16 or FP8 keys): key bytes read per second against a copy."""
    from ...consumers.kv_format import indexer_key_fp8

    dev, dtype, reps = _setup(device, dry_run, repeats)
    if dry_run:
        batches, contexts, heads, dim = _DRY["batches"], _DRY["contexts"], 16, 32
    copy = copy_bandwidth(device, dry_run=dry_run, repeats=repeats)
    b, rows, how = get("triton"), [], {}
    fmt = indexer_key_fp8(dim) if fp8 else None
    for batch in batches:
        for ctx in contexts:
            layout, table = _paged(batch, ctx, 64, 1, dev)
            n = layout.cp_size * layout.slots_per_rank
            values = torch.randn(n, dim, device=dev)
            keys = CacheView(fmt.encode(values) if fp8 else values.to(dtype), fmt, (dim,))
            q, w = torch.randn(batch, heads, dim, device=dev, dtype=dtype), torch.randn(batch, heads, device=dev)
            plan = b.plan(table, torch.arange(batch, device=dev), torch.full((batch,), ctx - 1, device=dev), layout)
            t = medians({f"{batch}x{ctx}": lambda: b.index_scores(plan, q, w, keys, dim**-0.5)}, dev, reps,
                        how)[f"{batch}x{ctx}"]
            read = batch * ctx * (fmt.bytes_per_slot if fp8 else dim * keys.data.element_size())
            rows.append(dict(batch=batch, context=ctx, seconds=t, bytes_read=read, bytes_per_second=read / t,
                             fraction_of_copy=_fraction(read / t, copy)))
    return dict(title=f"indexer, {heads} heads x {dim} ({'fp8' if fp8 else dtype}): key bytes read per second "
                      "against a copy", copy=copy, rows=rows, timing=how)


def bench_store(device: str = "cuda", tokens=(64, 32768), kv_heads: int = 8, head_dim: int = 128,
                fp8: bool = False, repeats: int = 20, dry_run: bool = False) -> dict:
    """The store of one family's new entries (a decode batch, a prefill chunk;
    bfloat16, or FP8 encoded in the kernel): bytes read plus written per
    second against a copy (which counts both too)."""
    from ...consumers.kv_format import gqa_fp8

    dev, dtype, reps = _setup(device, dry_run, repeats)
    if dry_run:
        tokens, kv_heads, head_dim = (_DRY["store"],), 2, 16
    copy = copy_bandwidth(device, dry_run=dry_run, repeats=repeats)
    b, rows, how = get("triton"), [], {}
    fmt = gqa_fp8(kv_heads, head_dim) if fp8 else None
    for T in tokens:
        layout, table = _paged(1, T, 64, 1, dev)
        shape = (kv_heads, head_dim)
        seg = torch.zeros((layout.slots_per_rank, fmt.bytes_per_slot) if fp8 else (layout.slots_per_rank, *shape),
                          dtype=torch.uint8 if fp8 else dtype, device=dev)
        x = torch.randn(T, *shape, device=dev, dtype=dtype)
        report = torch.zeros(2, dtype=torch.int32, device=dev)
        write = WriteIndex(table[0])
        view = CacheView(seg, fmt, shape)
        t = medians({str(T): lambda: b.store(view, x, write, layout, 0, report)}, dev, reps, how)[str(T)]
        moved = T * (x[0].numel() * x.element_size() + (fmt.bytes_per_slot if fp8 else x[0].numel() * seg.element_size()))
        rows.append(dict(tokens=T, seconds=t, bytes_moved=moved, bytes_per_second=moved / t,
                         fraction_of_copy=_fraction(moved / t, copy)))
    return dict(title=f"store, {kv_heads} x {head_dim} ({'fp8' if fp8 else dtype}): bytes read and written per second "
                      "against a copy", copy=copy, rows=rows, timing=how)


def bench_prefill(device: str = "cuda", tokens: int = 32768, kv_heads: int = 8, heads: int = 32,
                  head_dim: int = 128, page: int = 64, repeats: int = 10, dry_run: bool = False) -> dict:
    """One request's causal prefill of ``tokens`` (no prefix): the Triton
    extend kernel over the paged cache against torch's
    ``scaled_dot_product_attention`` (the flash backend on a GPU) on the same
    tokens held contiguously; ``ratio`` = Triton's time / torch's."""
    import torch.nn.functional as F

    dev, dtype, reps = _setup(device, dry_run, repeats)
    if dry_run:
        tokens, kv_heads, heads, head_dim, page = _DRY["prefill"], 2, 4, 16, 16
    layout, table = _paged(1, tokens, page, 1, dev)
    n = layout.cp_size * layout.slots_per_rank
    k = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
    q = torch.randn(tokens, heads, head_dim, device=dev, dtype=dtype)
    rows_ = layout.translate_read_slots(table[0])
    kc, vc = k[rows_].transpose(0, 1)[None], v[rows_].transpose(0, 1)[None]  # [1, Hkv, T, D], contiguous order
    qc = q.transpose(0, 1)[None]
    b = get("triton")
    plan = b.plan(table, torch.zeros(tokens, dtype=torch.int64, device=dev), torch.arange(tokens, device=dev), layout,
                  with_lse=False)
    kv = (CacheView(k, None, (kv_heads, head_dim)), CacheView(v, None, (kv_heads, head_dim)))

    def sdpa():
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)

    how: dict[str, str] = {}
    t = medians({"triton": lambda: b.dense(plan, q, *kv, head_dim**-0.5), "sdpa": sdpa}, dev, reps, how)
    return dict(title=f"prefill of {tokens} tokens, {dtype}, {heads} heads / Hkv {kv_heads} x D {head_dim}: Triton "
                      "extend over the paged cache vs torch SDPA (flash) on the same tokens",
                rows=[dict(tokens=tokens, triton_seconds=t["triton"], sdpa_seconds=t["sdpa"],
                           ratio=round(t["triton"] / t["sdpa"], 3))], timing=how)


def bench_lse_split(device: str = "cuda", ranks=(1, 2, 4), batch: int = 8, context: int = 131072,
                    kv_heads: int = 8, heads: int = 32, head_dim: int = 128, page: int = 64, repeats: int = 10,
                    dry_run: bool = False) -> dict:
    """Decode under the log-sum-exp split on one GPU: for each N, every rank's
    attention over the slots it owns (its own plan), timed rank by rank; the
    slowest rank's time against N = 1's (it should fall as 1/N)."""
    dev, dtype, reps = _setup(device, dry_run, repeats)
    if dry_run:
        ranks, batch, context, kv_heads, heads, head_dim, page = (1, 2), 1, 48, 2, 4, 16, 16
    b, rows, base, how = get("triton"), [], None, {}
    for N in ranks:
        layout, table = _paged(batch, context, page, N, dev)
        n = layout.cp_size * layout.slots_per_rank
        k = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
        v = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
        q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
        kv = (CacheView(k, None, (kv_heads, head_dim)), CacheView(v, None, (kv_heads, head_dim)))
        req, pos = torch.arange(batch, device=dev), torch.full((batch,), context - 1, device=dev)
        plans = [b.plan(table, req, pos, layout, own_rank=r) for r in range(N)]
        t = medians({f"N {N} rank {r}": (lambda p=p: b.dense(p, q, *kv, head_dim**-0.5)) for r, p in enumerate(plans)},
                    dev, reps, how)
        slowest = max(t.values())
        base = base or slowest
        rows.append(dict(ranks=N, slowest_rank_seconds=slowest, mean_rank_seconds=statistics.mean(t.values()),
                         vs_one_rank=round(slowest / base, 3)))
        del k, v
    return dict(title=f"lse split on one GPU, batch {batch} x context {context}: each rank attends over its own "
                      "slots; slowest rank's time against N = 1", rows=rows, timing=how)


#: every section, by name, as gpu_check would call them
SECTIONS = {"decode": bench_decode, "sparse_mla": bench_sparse_mla, "indexer": bench_indexer, "store": bench_store,
            "prefill": bench_prefill, "lse_split": bench_lse_split}


def bench_kernels(device: str = "cuda", dry_run: bool = False, sections=tuple(SECTIONS)) -> dict:
    """Every section of :data:`SECTIONS` (or ``sections``): ``{name: its dict}``."""
    return {name: SECTIONS[name](device=device, dry_run=dry_run) for name in sections}


def format_kernels(report: dict) -> str:
    """The sections as tables."""
    from ..table import format_rows

    return "\n\n".join(format_rows(s["rows"], s["title"]) for s in report.values())


def run_kernels_command(args) -> int:
    """``cpkv bench kernels``: on ``--device cuda`` every section (and with
    ``--compile`` the compile report); on the CPU the compile report only.
    Exit 1 when a kernel fails the compile check, each failing kernel and why
    on stderr (one line each, after the report)."""
    import json
    import sys

    from ...kernels.compile_check import format_check, run_check

    out, failed = {}, False
    if args.device == "cuda":
        out["sections"] = bench_kernels("cuda")
    if args.device != "cuda" or args.compile:
        out["compile"] = run_check(jobs=2)
        failed = any(r["error"] for r in out["compile"])
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        if "sections" in out:
            print(format_kernels(out["sections"]))
            print()
        if "compile" in out:
            print(format_check(out["compile"]))
        if args.device != "cuda":
            print("\n(no GPU here: the timed sections run with --device cuda)")
    if failed:
        bad = [r for r in out["compile"] if r["error"]]
        version = out["compile"][0].get("triton", "?")
        print(f"cpkv bench kernels: {len(bad)} kernel(s) fail the sm_90 compile check under Triton {version}:",
              file=sys.stderr)
        for r in bad:
            print(f"  {r['name']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


__all__ = ["SECTIONS", "medians", "bench_decode", "bench_indexer", "bench_kernels", "bench_lse_split", "bench_prefill",
           "bench_sparse_mla", "bench_store", "copy_bandwidth", "format_kernels", "run_kernels_command"]
