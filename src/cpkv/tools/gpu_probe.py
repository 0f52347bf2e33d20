"""The correctness probes ``tools/gpu_check.py`` runs, one function per results section.

Each takes the device (``"cuda"``, or ``"cpu"`` for the dry run: the same code
at tiny sizes, the Triton kernels in Triton's interpreter) and returns a
JSON-ready dict whose ``ok`` says whether every check in it passed:

* :func:`kernels_section` - every Triton kernel, compiled on the GPU, against
  the torch reference (float32, float16, bfloat16 on a GPU) at small and real
  shapes, the FP8 cache formats at the real shapes, and the read through a
  :class:`~cpkv.consumers.kv_view.SegmentTable` (the group's memory as N
  segments) against the same bytes in one buffer; on a GPU the cases run in
  several processes at once (each compiles its own kernels: compiling, not
  running, is what takes the time);
* :func:`ipc_section` - N ranks on one device: each writes its own segment,
  the fence, every rank reads every segment through the view, round after
  round; rank 0 times a read through the view against a local read of the
  same bytes (:func:`~cpkv.tools.bench.kernels.medians`): the batch planned
  once, then the read path alone (the backend's run step, in a CUDA graph on
  a GPU).

The timed kernel figures (bytes per second against a device copy, prefill
against SDPA, the lse split) are :mod:`cpkv.tools.bench.kernels`'.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from .. import kernels as K
from ..consumers.kv_format import gqa_fp8, indexer_key_fp8, mla_latent_fp8
from ..consumers.kv_view import KVView, SegmentTable
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import SharedKVLayout
from ..kernels.backend import CacheView

#: Tolerances of a kernel against the torch reference, by dtype (float32 exact to rounding).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: Processes that compile and run the kernel cases at once on a GPU (at most; fewer on a machine of fewer cores).
KERNEL_WORKERS = 8


def dtypes(device: str) -> list[torch.dtype]:
    """The dtypes checked: bfloat16 only on a GPU (the interpreter has no bfloat16 arithmetic)."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@dataclass(frozen=True)
class Shape:
    """One kernel case: ``kind`` (``gqa``, ``mla``, ``indexer``), heads, dims,
    page size, cp; ``fp8``: the cache in DeepSeek's FP8 format of its kind."""

    name: str
    kind: str
    heads: int
    kv_heads: int
    dim: int
    rope: int
    page: int
    cp: int
    topk: int = 0
    fp8: bool = False


def shapes(device: str) -> list[Shape]:
    """Small and real shapes: GQA Hkv 8 D 128, MLA latent 512 + 64 (H 16),
    indexer 64 heads x 128, page 64, and each kind over its FP8 cache (the
    real ones at tiny contexts in the dry run)."""
    topk = 2048 if device == "cuda" else 64
    return [
        Shape("gqa-small", "gqa", 4, 2, 16, 0, 4, 3),
        Shape("gqa-real", "gqa", 64, 8, 128, 0, 64, 2),
        Shape("mla-small", "mla", 4, 1, 32, 16, 4, 3, topk=16),
        Shape("mla-real", "mla", 16, 1, 512, 64, 64, 2, topk=topk),
        Shape("indexer-small", "indexer", 4, 1, 16, 0, 4, 3),
        Shape("indexer-real", "indexer", 64, 1, 128, 0, 64, 2),
        Shape("gqa-small-fp8", "gqa", 4, 2, 16, 0, 4, 3, fp8=True),
        Shape("gqa-real-fp8", "gqa", 64, 8, 128, 0, 64, 2, fp8=True),
        Shape("mla-small-fp8", "mla", 4, 1, 32, 16, 4, 3, topk=16, fp8=True),
        Shape("mla-real-fp8", "mla", 16, 1, 512, 64, 64, 2, topk=topk, fp8=True),
        Shape("indexer-small-fp8", "indexer", 4, 1, 16, 0, 4, 3, fp8=True),
        Shape("indexer-real-fp8", "indexer", 64, 1, 128, 0, 64, 2, fp8=True),
    ]


def make_batch(cp: int, page: int, lens: list[int], device, prefill: bool = True):
    """An owner-lane allocation of requests of ``lens`` tokens: ``(layout,
    table [B, L], q_req [T], q_pos [T])`` with T the last token of every
    request, plus (``prefill``) the three before it in request 0 (a prefill
    block), on ``device``."""
    pages = sum(-(-n // page) for n in lens)
    layout = SharedKVLayout(cp, page, -(-(pages + 2) // cp) + 2)
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * page, page, cp, layout=layout)
    a = alloc.allocate_extend([0] * len(lens), lens, torch.full((len(lens),), -1))
    L = max(lens)
    table = torch.full((len(lens), L), -1, dtype=torch.int64)
    for r, (start, n) in enumerate(zip(a.extend_start_loc.tolist(), lens)):  # fixture only
        table[r, :n] = a.out_cache_loc[start: start + n]
    first = [0, 0, 0] if prefill else []
    q_req = torch.tensor(first + list(range(len(lens))))
    q_pos = torch.tensor([lens[0] - 4, lens[0] - 3, lens[0] - 2][: len(first)] + [n - 1 for n in lens])
    return layout, table.to(device), q_req.to(device), q_pos.to(device)


def segments_of(view: torch.Tensor, layout: SharedKVLayout) -> SegmentTable:
    """The same rows as separate allocations, one per rank, read through their :class:`SegmentTable`."""
    spr = layout.slots_per_rank
    segs = [view[None, r * spr: (r + 1) * spr].clone() for r in range(layout.cp_size)]
    return KVView.of_segments(segs).layer(0)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")
    return float((a[fin].float() - b[fin].float()).abs().max()) if bool(fin.any()) else 0.0


def _pairs(got, want) -> float:
    """The largest difference over ``(out, lse)`` pairs."""
    return max(_diff(x, y) for x, y in zip(got, want))


def _case(shape: Shape, dtype: torch.dtype, device: str, dry: bool) -> dict:
    """One shape and dtype: triton against torch; in float32 triton through a
    segment table against one buffer (equal to the bit); an FP8 cache's store
    byte for byte the format's encoding."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{shape.name} {dtype}".encode()))
    ctx = 2 * shape.page + 3 if dry else 4096 + 3
    lens = [ctx, shape.page + 1, 5]
    layout, table, q_req, q_pos = make_batch(shape.cp, shape.page, lens, device)
    rows = layout.cp_size * layout.slots_per_rank
    T = q_req.numel()

    def rand(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dt).to(device)

    def cache(values: torch.Tensor, fmt):
        return (values, None) if fmt is None else (fmt.encode(values.float()), fmt)

    out = {"shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "checks": {}}
    checks = out["checks"]
    table_too = dtype == torch.float32  # the read through a segment table: once per shape (each variant compiles)
    tri, ref = dict(backend="triton"), dict(backend="torch")
    if shape.kind == "gqa":
        fmt = gqa_fp8(shape.kv_heads, shape.dim) if shape.fp8 else None
        (k, _), (v, _) = cache(rand(rows, shape.kv_heads, shape.dim), fmt), \
            cache(rand(rows, shape.kv_heads, shape.dim), fmt)
        q = rand(T, shape.heads, shape.dim)
        args = (table, q_req, q_pos, layout, shape.dim ** -0.5)
        o1 = K.paged_attention(q, k, v, *args, fmt=fmt, **tri)
        checks["paged_attention"] = _pairs(o1, K.paged_attention(q, k, v, *args, fmt=fmt, **ref))
        if table_too:
            o3 = K.paged_attention(q, segments_of(k, layout), segments_of(v, layout), *args, fmt=fmt, **tri)
            checks["paged_attention_table"] = _pairs(o3, o1)
        o4 = K.paged_attention(q, k, v, *args, fmt=fmt, only_rank=1, **tri)
        checks["paged_attention_lse_split"] = _pairs(o4, K.paged_attention(q, k, v, *args, fmt=fmt, only_rank=1,
                                                                           **ref))
        outs, lses = torch.stack([o4[0], o1[0]]), torch.stack([o4[1], o1[1]])
        checks["merge_lse"] = _pairs(K.merge_lse(outs, lses, **tri), K.merge_lse(outs, lses, **ref))
        slots = table[q_req, q_pos.clamp(min=0)]
        owned = slots[layout.owned_slot_mask(slots, owner_rank=0)]
        seg = torch.zeros((layout.slots_per_rank, fmt.bytes_per_slot) if fmt else
                          (layout.slots_per_rank, shape.kv_heads, shape.dim), dtype=torch.uint8 if fmt else dtype,
                          device=device)
        seg2, vals = seg.clone(), rand(owned.numel(), shape.kv_heads, shape.dim)
        K.store(seg, vals, owned, layout, 0, fmt=fmt, **tri)
        K.store(seg2, vals, owned, layout, 0, fmt=fmt, **ref)
        checks["store"] = 0.0 if torch.equal(seg, seg2) else _diff(seg.float(), seg2.float()) if fmt is None \
            else float("inf")  # a format's bytes: equal or wrong
    elif shape.kind == "mla":
        fmt = mla_latent_fp8(shape.dim, shape.rope) if shape.fp8 else None
        lat, _ = cache(rand(rows, shape.dim + shape.rope), fmt)
        q = rand(T, shape.heads, shape.dim + shape.rope)
        sel = table[q_req][:, : shape.topk]
        sel = torch.where(torch.arange(sel.shape[1], device=device)[None, :] <= q_pos[:, None], sel, -1)
        args = (layout, (shape.dim + shape.rope) ** -0.5, shape.dim)
        o1 = K.sparse_mla_attention(q, lat, sel, *args, fmt=fmt, **tri)
        checks["sparse_mla_attention"] = _pairs(o1, K.sparse_mla_attention(q, lat, sel, *args, fmt=fmt, **ref))
        if table_too:
            o3 = K.sparse_mla_attention(q, segments_of(lat, layout), sel, *args, fmt=fmt, **tri)
            checks["sparse_mla_attention_table"] = _pairs(o3, o1)
        if fmt is not None:  # the latent's FP8 store, byte for byte
            owned = sel[0][layout.owned_slot_mask(sel[0], owner_rank=0)]
            owned = owned[owned >= 0]
            seg = torch.zeros((layout.slots_per_rank, fmt.bytes_per_slot), dtype=torch.uint8, device=device)
            seg2, vals = seg.clone(), rand(owned.numel(), shape.dim + shape.rope)
            K.store(seg, vals, owned, layout, 0, fmt=fmt, **tri)
            K.store(seg2, vals, owned, layout, 0, fmt=fmt, **ref)
            checks["store"] = 0.0 if torch.equal(seg, seg2) else float("inf")
    else:
        fmt = indexer_key_fp8(shape.dim) if shape.fp8 else None
        kv, _ = cache(rand(rows, shape.dim), fmt)
        q, w = rand(T, shape.heads, shape.dim), rand(T, shape.heads, dt=torch.float32)
        args = (table, q_req, q_pos, layout, shape.dim ** -0.5)
        s1 = K.index_scores(q, w, kv, *args, fmt=fmt, **tri)
        s2 = K.index_scores(q, w, kv, *args, fmt=fmt, **ref)
        scale = float(s2[torch.isfinite(s2)].abs().max().clamp(min=1.0))  # scores grow with Hi x Di
        checks["index_scores"] = _diff(s1, s2) / scale
        if table_too:
            checks["index_scores_table"] = _diff(s1, K.index_scores(q, w, segments_of(kv, layout), *args, fmt=fmt,
                                                                    **tri))
    tol = TOLERANCE[dtype]
    out["ok"] = all(v <= (0.0 if k.endswith("_table") or (k == "store" and shape.fp8) else tol)
                    for k, v in checks.items())
    out["tolerance"] = tol
    return out


def _safe_case(shape: Shape, dtype: torch.dtype, device: str, dry: bool) -> dict:
    """:func:`_case`, a failure reported as the case's result (the others still run)."""
    t0 = time.perf_counter()
    try:
        r = _case(shape, dtype, device, dry)
    except Exception as e:  # noqa: BLE001 - a failed case is reported, the others still run
        r = {"shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "ok": False,
             "error": f"{type(e).__name__}: {e}"}
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r


def kernel_cases(device: str, dry: bool) -> list[tuple[Shape, torch.dtype]]:
    """The cases of :func:`kernels_section`. On a GPU: every real and small
    shape of :func:`shapes` in every dtype of :func:`dtypes`, the FP8 caches
    at the real shapes with bfloat16 queries. The dry run: the small shapes,
    plain and FP8, in float32 (every path of a case, at tiny sizes; the
    interpreter runs the kernels at every dtype in ``tests/kernels``)."""
    if dry:
        return [(s, torch.float32) for s in shapes(device) if "small" in s.name]
    cases = []
    for s in shapes(device):
        if not s.fp8:
            cases += [(s, dt) for dt in dtypes(device)]
        elif "real" in s.name:
            cases.append((s, torch.bfloat16))
    return cases


def kernels_section(device: str = "cuda", dry: bool = False, workers: int | None = None) -> dict:
    """Every kernel, compiled on ``device`` (interpreted in the dry run), against
    the torch reference at every case of :func:`kernel_cases`; ``*_table``
    entries (float32) compare the read through a segment table with the read
    of one buffer (must be equal to the bit), an FP8 ``store`` the stored
    bytes with the format's own encoding (equal). On a GPU the cases run in
    ``workers`` processes at once (default: :data:`KERNEL_WORKERS`, at most
    half the machine's cores), each its own CUDA context on the same GPU;
    on the CPU in this process."""
    cases, t0 = kernel_cases(device, dry), time.perf_counter()
    if device != "cuda":
        workers = 1
    elif workers is None:
        workers = max(1, min(KERNEL_WORKERS, (os.cpu_count() or 2) // 2, len(cases)))
    if workers == 1:
        results = [_safe_case(s, dt, device, dry) for s, dt in cases]
    else:  # the longest first: the real shapes compile the largest kernels
        order = sorted(range(len(cases)), key=lambda i: "small" in cases[i][0].name)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = {i: pool.submit(_safe_case, *cases[i], device, dry) for i in order}
            results = [futs[i].result() for i in range(len(cases))]
    return {"ok": all(c["ok"] for c in results), "cases": results, "seconds": time.perf_counter() - t0,
            "workers": workers, "interpreted": device != "cuda"}


# -- N ranks on one device: segments, IPC, the fence -------------------------------------------------
def _ipc_rank(ctx, spec: dict) -> dict:
    """One rank of :func:`ipc_section`: its own segment, peers' through the view, round after round."""
    from ..runtime.comm import DistComm, LocalComm
    from ..runtime.device import group_segments, host_segments
    from .bench.kernels import medians

    N, dev = ctx.world_size, ctx.device
    comm = DistComm(device=dev) if ctx.distributed else LocalComm()
    layout = SharedKVLayout(N, spec["page"], spec["pages"])
    Hkv, D, dtype = spec["kv_heads"], spec["dim"], getattr(torch, spec["dtype"])
    shape = (1, N * layout.slots_per_rank, Hkv, D)
    make = (lambda tag: group_segments(comm, tag, shape, dtype, dev)) if dev.type == "cuda" \
        else (lambda tag: host_segments(ctx, tag, shape, dtype))
    kv, vv = make("probe_k"), make("probe_v")
    k_view, v_view = kv.layer(0), vv.layer(0)
    every = torch.arange(layout.slots_per_page, layout.capacity, device=dev)  # page 0 is padding's
    mine = every[layout.owned_slot_mask(every, owner_rank=ctx.rank)]
    rows = layout.translate_read_slots(every)
    cols = torch.arange(Hkv * D, device=dev).view(Hkv, D).to(torch.float32)
    bad = 0
    for rnd in range(spec["rounds"]):
        val = (mine.to(torch.float32)[:, None, None] * 7 + rnd + cols / (Hkv * D)).to(dtype)
        K.store(kv.segment(ctx.rank)[0], val, mine, layout, ctx.rank, backend="triton")
        K.store(vv.segment(ctx.rank)[0], -val, mine, layout, ctx.rank, backend="triton")
        comm.barrier()  # the fence: every owner's writes have landed
        want = (every.to(torch.float32)[:, None, None] * 7 + rnd + cols / (Hkv * D)).to(dtype)
        bad += int((k_view[rows] != want).any()) + int((v_view[rows] != -want).any())
        comm.barrier()  # everyone has read this round before the next overwrites it
    out = {"rank": ctx.rank, "device": str(dev), "bad_rounds": bad, "segment_table": isinstance(k_view, SegmentTable)}
    if ctx.rank == 0:  # a read through the view against a local read of the same bytes
        lk = torch.cat([kv.segment(r)[0] for r in range(N)])  # rank-major, one local buffer
        lv = torch.cat([vv.segment(r)[0] for r in range(N)])
        B = spec["requests"]
        per = every.numel() // B
        table = every[: B * per].view(B, per)
        q = torch.randn(B, 4 * Hkv, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
        q_req, q_pos = torch.arange(B, device=dev), torch.full((B,), per - 1, device=dev)

        b = K.get("triton", dev)
        plan = b.plan(table, q_req, q_pos, layout)  # once, as a batch is planned before its layers: not timed
        views = [CacheView(x, None, (Hkv, D)) for x in (k_view, v_view, lk, lv)]

        def through():  # the read path alone: the kernels of the run step, no planning, no host sync
            return b.dense(plan, q, views[0], views[1], D ** -0.5)

        def local():
            return b.dense(plan, q, views[2], views[3], D ** -0.5)

        want = K.paged_attention(q, k_view, v_view, table, q_req, q_pos, layout, D ** -0.5, backend="triton")[0]
        o1, o2 = through()[0], local()[0]
        how: dict[str, str] = {}
        t = medians({"view": through, "local": local}, dev, spec["repeats"], how)
        out.update(view_equals_local=bool(torch.equal(o1, o2) and torch.equal(o1, want)), seconds=t,
                   view_over_local=t["view"] / t["local"], timing=how,
                   bytes=2 * B * per * Hkv * D * torch.empty((), dtype=dtype).element_size())
    got = comm.all_gather_object(out)
    return {"ranks": got} if ctx.rank == 0 else None


def ipc_section(device: str = "cuda", dry: bool = False, sizes=(2, 3, 4), timeout: float = 120.0) -> dict:
    """For every group size in ``sizes``, on one device: each rank's segment its
    own allocation, the others' opened over CUDA IPC (shared-memory segments on
    the CPU), read through a segment table; rounds of owner writes (the store
    kernel), the fence, reads of every slot through the view, checked; rank
    0's read through the view against the same bytes in one local buffer
    (equal outputs, time ratio)."""
    from ..runtime.group import launch

    spec = dict(page=4 if dry else 64, pages=4 if dry else 512, kv_heads=2 if dry else 8, dim=16 if dry else 128,
                dtype="float32" if device != "cuda" else "bfloat16", rounds=2 if dry else 20,
                repeats=1 if dry else 10, requests=2 if dry else 4)
    runs = {}
    for n in sizes:
        t0 = time.perf_counter()
        try:
            r = launch(_ipc_rank, n, spec, timeout=timeout, device=device)
            ranks = r["ranks"]
            ok = all(x["bad_rounds"] == 0 and x["segment_table"] for x in ranks) and ranks[0]["view_equals_local"]
            eager = [f"{k}: {m}" for k, m in ranks[0]["timing"].items() if m not in ("graph", "wall")]
            ok = ok and not eager  # on a GPU the read path is timed in a CUDA graph, or the figure is not its own
            runs[str(n)] = {"ok": ok, "seconds": time.perf_counter() - t0, "ranks": ranks,
                            **({"error": f"timed eagerly ({'; '.join(eager)})"} if eager else {})}
        except Exception as e:  # noqa: BLE001 - reported; the other sizes still run
            runs[str(n)] = {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    return {"ok": all(r["ok"] for r in runs.values()), "spec": spec, "runs": runs}
