"""The measurements ``tools/gpu_check.py`` makes, one function per results section.

Each takes the device (``"cuda"``, or ``"cpu"`` for the dry run: the same code
at tiny sizes, the Triton kernels in Triton's interpreter) and returns a
JSON-ready dict whose ``ok`` says whether every check in it passed:

* :func:`kernels_section` - every Triton kernel against the torch reference
  (float32, float16, bfloat16 on a GPU) at small and real shapes, and the
  read through the group's base table (:class:`~cpkv.consumers.kv_view.LayerView`)
  against the same bytes in one buffer;
* :func:`bandwidth_section` - store and decode-attention bytes per second as
  a fraction of a device-to-device copy timed in the same run;
* :func:`ipc_section` - N ranks on one device: each writes its own segment,
  the fence, every rank reads every segment through the view, round after
  round; rank 0 times a read through the view against a local read of the
  same bytes.
"""

from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass

import torch

from .. import kernels as K
from ..consumers.kv_view import KVView
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import SharedKVLayout

#: Tolerances of a kernel against the torch reference, by dtype (float32 exact to rounding).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def dtypes(device: str) -> list[torch.dtype]:
    """The dtypes checked: bfloat16 only on a GPU (the interpreter has no bfloat16 arithmetic)."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


@dataclass(frozen=True)
class Shape:
    """One kernel case: ``kind`` (``gqa``, ``mla``, ``indexer``), heads, dims, page size, cp."""

    name: str
    kind: str
    heads: int
    kv_heads: int
    dim: int
    rope: int
    page: int
    cp: int
    topk: int = 0


def shapes(device: str) -> list[Shape]:
    """Small and real shapes: GQA Hkv 8 D 128, MLA latent 512 + 64 (H 16),
    indexer 64 heads x 128, page 64 (the real ones at tiny contexts in the dry run)."""
    return [
        Shape("gqa-small", "gqa", 4, 2, 16, 0, 4, 3),
        Shape("gqa-real", "gqa", 64, 8, 128, 0, 64, 2),
        Shape("mla-small", "mla", 4, 1, 32, 16, 4, 3, topk=16),
        Shape("mla-real", "mla", 16, 1, 512, 64, 64, 2, topk=2048 if device == "cuda" else 64),
        Shape("indexer-small", "indexer", 4, 1, 16, 0, 4, 3),
        Shape("indexer-real", "indexer", 64, 1, 128, 0, 64, 2),
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


def segments_of(view: torch.Tensor, layout: SharedKVLayout):
    """The same rows as separate allocations, one per rank, and their :class:`LayerView`."""
    spr = layout.slots_per_rank
    segs = [view[None, r * spr: (r + 1) * spr].clone() for r in range(layout.cp_size)]
    return KVView.of_segments(segs).layer(0)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")
    return float((a[fin].float() - b[fin].float()).abs().max()) if bool(fin.any()) else 0.0


def _case(shape: Shape, dtype: torch.dtype, device: str, dry: bool) -> dict:
    """One shape and dtype: triton against torch, and triton through the base table against one buffer."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{shape.name} {dtype}".encode()))
    ctx = 2 * shape.page + 3 if dry else 4096 + 3
    lens = [ctx, shape.page + 1, 5]
    real = not shape.name.endswith("small")  # in the interpreter: decode queries only
    layout, table, q_req, q_pos = make_batch(shape.cp, shape.page, lens, device, prefill=not (dry and real))
    rows = layout.cp_size * layout.slots_per_rank
    T = q_req.numel()

    def rand(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dt).to(device)

    out = {"shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "checks": {}}
    through_table = dtype == torch.float32  # the read through the base table: once per shape (each variant compiles)
    tri, ref = K.get("triton"), K.get("torch")
    if shape.kind == "gqa":
        k, v, q = rand(rows, shape.kv_heads, shape.dim), rand(rows, shape.kv_heads, shape.dim), \
            rand(T, shape.heads, shape.dim)
        args = (table, q_req, q_pos, layout, shape.dim ** -0.5)
        o1, l1 = tri.paged_attention(q, k, v, *args)
        o2, l2 = ref.paged_attention(q, k, v, *args)
        out["checks"]["paged_attention"] = max(_diff(o1, o2), _diff(l1, l2))
        if through_table:
            o3, l3 = tri.paged_attention(q, segments_of(k, layout), segments_of(v, layout), *args)
            out["checks"]["paged_attention_table"] = max(_diff(o1, o3), _diff(l1, l3))
        o4, l4 = tri.paged_attention(q, k, v, *args, only_rank=1)
        o5, l5 = ref.paged_attention(q, k, v, *args, only_rank=1)
        out["checks"]["paged_attention_lse_split"] = max(_diff(o4, o5), _diff(l4, l5))
        outs, lses = torch.stack([o4, o1]), torch.stack([l4, l1])
        m1, m2 = tri.merge_lse(outs, lses), ref.merge_lse(outs, lses)
        out["checks"]["merge_lse"] = max(_diff(m1[0], m2[0]), _diff(m1[1], m2[1]))
        slots = table[q_req, q_pos.clamp(min=0)]
        owned = slots[layout.owned_slot_mask(slots, owner_rank=0)]
        seg1 = torch.zeros(layout.slots_per_rank, shape.kv_heads, shape.dim, dtype=dtype, device=device)
        seg2 = seg1.clone()
        vals = rand(owned.numel(), shape.kv_heads, shape.dim)
        tri.store(seg1, vals, owned, layout, 0)
        ref.store(seg2, vals, owned, layout, 0)
        out["checks"]["store"] = _diff(seg1, seg2)
    elif shape.kind == "mla":
        lat = rand(rows, shape.dim + shape.rope)
        q = rand(T, shape.heads, shape.dim + shape.rope)
        sel = table[q_req][:, : shape.topk]
        sel = torch.where(torch.arange(sel.shape[1], device=device)[None, :] <= q_pos[:, None], sel, -1)
        args = (layout, (shape.dim + shape.rope) ** -0.5, shape.dim)
        o1, l1 = tri.sparse_mla_attention(q, lat, sel, *args)
        o2, l2 = ref.sparse_mla_attention(q, lat, sel, *args)
        out["checks"]["sparse_mla_attention"] = max(_diff(o1, o2), _diff(l1, l2))
        if through_table:
            o3, l3 = tri.sparse_mla_attention(q, segments_of(lat, layout), sel, *args)
            out["checks"]["sparse_mla_attention_table"] = max(_diff(o1, o3), _diff(l1, l3))
    else:
        kv, q, w = rand(rows, shape.dim), rand(T, shape.heads, shape.dim), rand(T, shape.heads, dt=torch.float32)
        args = (table, q_req, q_pos, layout, shape.dim ** -0.5)
        s1, s2 = tri.index_scores(q, w, kv, *args), ref.index_scores(q, w, kv, *args)
        scale = float(s2[torch.isfinite(s2)].abs().max().clamp(min=1.0))  # scores grow with Hi x Di
        out["checks"]["index_scores"] = _diff(s1, s2) / scale
        if through_table:
            out["checks"]["index_scores_table"] = _diff(s1, tri.index_scores(q, w, segments_of(kv, layout), *args))
    tol = TOLERANCE[dtype]
    out["ok"] = all(v <= (0.0 if k.endswith("_table") else tol) for k, v in out["checks"].items())
    out["tolerance"] = tol
    return out


def kernels_section(device: str = "cuda", dry: bool = False) -> dict:
    """Every kernel, compiled on ``device`` (interpreted on the CPU), against the
    torch reference at every shape of :func:`shapes` and dtype of :func:`dtypes`
    (the dry run: real shapes in float32 only, decode queries only);
    ``*_table`` entries (float32) compare the read through a base table with
    the read of one buffer (must be equal to the bit)."""
    cases, t0 = [], time.perf_counter()
    for shape in shapes(device):
        for dt in dtypes(device)[: 1 if dry and not shape.name.endswith("small") else None]:
            try:
                cases.append(_case(shape, dt, device, dry))
            except Exception as e:  # noqa: BLE001 - a failed case is reported, the others still run
                cases.append({"shape": shape.name, "dtype": str(dt), "ok": False, "error": f"{type(e).__name__}: {e}"})
    return {"ok": all(c["ok"] for c in cases), "cases": cases, "seconds": time.perf_counter() - t0,
            "interpreted": device != "cuda"}


# -- bandwidth -------------------------------------------------------------------------------------
def timed_median(fns: dict, repeats: int, device: str) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeats`` interleaved rounds after
    one warm-up round: CUDA events on a GPU, the wall clock on the CPU."""
    times = {k: [] for k in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                dt = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            if i:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def bandwidth_section(device: str = "cuda", dry: bool = False) -> dict:
    """Bytes per second of the store and of decode attention (bfloat16 on a GPU,
    float32 in the dry run; Hkv 8, D 128, page 64), each as a fraction of a
    device-to-device copy timed in the same rounds. Bytes: a copy reads and
    writes its size; the store reads its values and writes them; decode reads
    every context entry's K and V once."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    Hkv, D, H, page = (8, 128, 64, 64) if not dry else (2, 16, 4, 4)
    batch, ctx = (8, 32768) if not dry else (2, 24)
    tokens = 65536 if not dry else 32
    layout, table, _, _ = make_batch(1, page, [ctx] * batch, device)
    q_req = torch.arange(batch, device=device)
    q_pos = torch.full((batch,), ctx - 1, device=device)
    rows = layout.slots_per_rank
    g = torch.Generator().manual_seed(0)
    k = torch.randn(rows, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(rows, Hkv, D, generator=g).to(dtype).to(device)
    q = torch.randn(batch, H, D, generator=g).to(dtype).to(device)
    seg = torch.zeros_like(k)
    slots = table.reshape(-1)[:tokens]
    vals = torch.randn(slots.numel(), Hkv, D, generator=g).to(dtype).to(device)
    src = torch.empty(k.numel() * 2, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    tri = K.get("triton")
    fns = {"copy": lambda: dst.copy_(src),
           "store": lambda: tri.store(seg, vals, slots, layout, 0, check=False),
           "decode": lambda: tri.paged_attention(q, k, v, table, q_req, q_pos, layout, D ** -0.5, check=False)}
    t = timed_median(fns, 3 if dry else 20, device)
    esize = torch.empty((), dtype=dtype).element_size()
    moved = {"copy": 2 * src.numel() * esize, "store": 2 * vals.numel() * esize,
             "decode": 2 * batch * ctx * Hkv * D * esize}
    rate = {n: moved[n] / t[n] for n in fns}
    return {"ok": True, "dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": ctx, "kv_heads": Hkv,
            "head_dim": D, "store_tokens": slots.numel(), "seconds": t, "bytes": moved, "bytes_per_second": rate,
            "fraction_of_copy": {n: rate[n] / rate["copy"] for n in ("store", "decode")},
            "note": "dry run: interpreter timings, not a measurement" if device != "cuda" else ""}


# -- N ranks on one device: segments, IPC, the fence -------------------------------------------------
def _ipc_rank(ctx, spec: dict) -> dict:
    """One rank of :func:`ipc_section`: its own segment, peers' through the view, round after round."""
    from ..runtime.comm import DistComm, LocalComm
    from ..runtime.device import group_segments, host_segments

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
    tri = K.get("triton")
    bad = 0
    for rnd in range(spec["rounds"]):
        val = (mine.to(torch.float32)[:, None, None] * 7 + rnd + cols / (Hkv * D)).to(dtype)
        tri.store(kv.segment(ctx.rank)[0], val, mine, layout, ctx.rank)
        tri.store(vv.segment(ctx.rank)[0], -val, mine, layout, ctx.rank)
        comm.barrier()  # the fence: every owner's writes have landed
        want = (every.to(torch.float32)[:, None, None] * 7 + rnd + cols / (Hkv * D)).to(dtype)
        bad += int((k_view[rows] != want).any()) + int((v_view[rows] != -want).any())
        comm.barrier()  # everyone has read this round before the next overwrites it
    out = {"rank": ctx.rank, "device": str(dev), "bad_rounds": bad}
    if ctx.rank == 0:  # a read through the view against a local read of the same bytes
        lk = torch.cat([kv.segment(r)[0] for r in range(N)])  # rank-major, one local buffer
        lv = torch.cat([vv.segment(r)[0] for r in range(N)])
        B = 4
        per = every.numel() // B
        table = every[: B * per].view(B, per)
        q = torch.randn(B, 4 * Hkv, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
        q_req, q_pos = torch.arange(B, device=dev), torch.full((B,), per - 1, device=dev)

        def through():
            return tri.paged_attention(q, k_view, v_view, table, q_req, q_pos, layout, D ** -0.5, check=False)

        def local():
            return tri.paged_attention(q, lk, lv, table, q_req, q_pos, layout, D ** -0.5, check=False)

        o1, o2 = through()[0], local()[0]
        t = timed_median({"view": through, "local": local}, spec["repeats"], dev.type)
        out.update(view_equals_local=bool(torch.equal(o1, o2)), seconds=t, view_over_local=t["view"] / t["local"],
                   bytes=2 * B * per * Hkv * D * torch.empty((), dtype=dtype).element_size())
    got = comm.all_gather_object(out)
    return {"ranks": got} if ctx.rank == 0 else None


def ipc_section(device: str = "cuda", dry: bool = False, sizes=(2, 3, 4), timeout: float = 120.0) -> dict:
    """For every group size in ``sizes``, on one device: each rank's segment its
    own allocation, the others' opened over CUDA IPC (shared-memory segments on
    the CPU); rounds of owner writes (the store kernel), the fence, reads of
    every slot through the view, checked; rank 0's read through the view
    against the same bytes in one local buffer (equal outputs, time ratio)."""
    from ..runtime.group import launch

    spec = dict(page=4 if dry else 64, pages=4 if dry else 512, kv_heads=2 if dry else 8, dim=16 if dry else 128,
                dtype="float32" if device != "cuda" else "bfloat16", rounds=3 if dry else 20,
                repeats=2 if dry else 20)
    runs = {}
    for n in sizes:
        t0 = time.perf_counter()
        try:
            r = launch(_ipc_rank, n, spec, timeout=timeout, device=device)
            ranks = r["ranks"]
            ok = all(x["bad_rounds"] == 0 for x in ranks) and ranks[0]["view_equals_local"]
            runs[str(n)] = {"ok": ok, "seconds": time.perf_counter() - t0, "ranks": ranks}
        except Exception as e:  # noqa: BLE001 - reported; the other sizes still run
            runs[str(n)] = {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    return {"ok": all(r["ok"] for r in runs.values()), "spec": spec, "runs": runs}
