"""Every Triton kernel compiled for sm_90 (H100/H200) on a machine without a GPU.

Triton's own compiler runs the whole pipeline to a cubin for
``GPUTarget("cuda", 90, 32)`` on the CPU; the wheel's ``cuobjdump`` then reads
the cubin's registers per thread and its local-memory (stack) bytes per
thread, and the compiled kernel's metadata its shared memory. A kernel that
spills (any local memory) or does not compile fails the check.

Each :class:`Variant` is one kernel at the real shapes of the models cpkv
serves: paged GQA at ``Hkv`` 8, ``D`` 128, 32 query heads, page 64; DSA's MLA
at latent 512 + 64 rope, 16 and 128 heads, top-k 2048; the indexer at 64 heads
x 128; in float32, bfloat16 and the FP8 cache formats; every reading kernel
also with the group's memory as N segments read through a table of their
bases (``, segment table``: what a GPU group runs). Its launches are the
ones the Triton backend makes (:mod:`.triton_backend`), built from meta
tensors at batch 1 and 64 and contexts 32K and 128K, so the reported grid is
the one a run launches; the kernel compiles once for all of them (per-batch
sizes are not specialised: the check fails if two sizes compile twice).

Each row also says how many programs of the kernel an SM holds at once
(``ctas_per_sm``: :func:`occupancy` of its registers, shared bytes and warps)
and how many waves of them each reported grid makes on 132 SMs.

Run it in a process where ``TRITON_INTERPRET`` is ``0`` (the kernels must be
jitted, not interpreted): ``python -m cpkv.kernels.compile_check [--json]
[--only NAME ...] [--jobs N]``, or :func:`run_check` from any process (it
starts that process; ``triton=`` a folder holding another Triton, put first on
its path). ``cpkv bench kernels --compile`` prints the table. Besides the
Triton installed, the check runs under each of :data:`CHECKED_TRITONS`
(``make test`` installs them, ``--target`` folders in the venv: :func:`triton_dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

#: The other Triton releases every kernel must compile under without spills, besides the one installed (``make
#: test``'s, the newest): 3.6.0, the GPU image's (torch 2.11), and 3.8.0, what torch 2.14 (a plain ``pip install``
#: of cpkv today) requires. The Makefile's ``TRITON_CHECKED`` installs the same list (a test compares them).
CHECKED_TRITONS = ("3.6.0", "3.8.0")
#: sm_90 (H100/H200) per SM: registers, shared bytes (228 KB, 1 KB of it reserved per program), warps, programs
SM90 = dict(registers=65536, shared=233472, shared_reserved=1024, warps=64, programs=32, sms=132)

#: batch sizes and contexts the launch grids are reported at
SIZES = ((1, 32768), (1, 131072), (64, 32768), (64, 131072))
#: paged GQA: kv heads, head dim, query heads, page size; N ranks of the layout
GQA = dict(hkv=8, d=128, heads=32, page=64, cp=8)
#: DSA: latent, rope dims, head counts (the same compiled kernel), top-k; indexer heads x dim
MLA = dict(r=512, dr=64, heads=(16, 128), topk=2048)
INDEX = dict(heads=64, dim=128)
#: prefill chunk of the extend kernel's grid, per request
EXTEND_CHUNK = 8192
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int16: "i16"}


@dataclass(frozen=True)
class Variant:
    """One kernel in one configuration: ``name``, the query ``dtype``, the
    cache ``fmt`` name, ``build(batch, context)`` -> the launches a run
    makes at that size (one per model shape, e.g. MLA's 16 and 128 heads),
    and ``binaries``: the compiled kernels each launch may take over the
    sizes (sparse MLA: 2, writing float32 partials where it splits a
    selection, its output directly where it does not)."""

    name: str
    kernel: str
    dtype: torch.dtype
    fmt: str
    build: Callable[[int, int], list]
    binaries: int = 1


def _meta(*shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _layout(tokens: int, page: int, cp: int):
    from ..contract.layout import SharedKVLayout

    return SharedKVLayout(cp, page, -(-(tokens // page + cp) // cp) + 1)


def _programs() -> int:
    from .triton_common import DEFAULT_SMS, PROGRAMS_PER_SM

    return PROGRAMS_PER_SM * DEFAULT_SMS


def _cache(rows: int, shape: tuple, dtype: torch.dtype, fmt_name: str, seg: int = 0):
    """A meta cache view of ``rows`` slots of ``shape`` values as the kernel
    reads it: ``(tensor, format, offsets)``; with ``seg`` ranks, the group's
    memory as that many segments (the tensor one segment of ``rows // seg``
    slots, ``offsets`` its segment table), else one buffer (``offsets`` None)."""
    from ..consumers.kv_format import gqa_fp8, indexer_key_fp8, mla_latent_fp8
    from .triton_common import kernel_view

    n = rows // seg if seg else rows
    if fmt_name == "plain":
        t, f, _ = kernel_view(_meta(n, *shape, dtype=dtype), None)
    else:
        fmt = {"gqa": lambda: gqa_fp8(*shape), "mla": lambda: mla_latent_fp8(MLA["r"], MLA["dr"]),
               "index": lambda: indexer_key_fp8(shape[0])}[fmt_name]()
        t, f, _ = kernel_view(_meta(n, fmt.bytes_per_slot, dtype=torch.uint8), fmt)
    return t, f, (_meta(seg, dtype=torch.int64) if seg else None)


def _decode(dtype, fmt="plain", own=False, seg=False):
    def build(batch, ctx):
        from .triton_attention import DECODE_CONFIG, decode_launch
        from .triton_backend import chunks

        g = GQA
        lay = _layout(batch * ctx, g["page"], g["cp"])
        rows = lay.cp_size * lay.slots_per_rank
        k, kf, ko = _cache(rows, (g["hkv"], g["d"]), dtype, "gqa" if fmt == "fp8" else "plain", seg and g["cp"])
        kh = k.stride(1) if k.dim() == 3 else g["d"]
        width = -(-ctx // g["cp"]) if own else ctx
        n, chunk = chunks(batch * g["hkv"], width, DECODE_CONFIG[dtype][0], _programs())
        q = _meta(batch, g["heads"], g["d"], dtype=dtype)
        out = _meta(n, batch, g["heads"], g["d"], dtype=torch.float32)
        lse = _meta(*out.shape[:-1], dtype=torch.float32)
        table = _meta(batch, width, dtype=torch.int64)
        tpos = _meta(batch, width, dtype=torch.int32) if own else None
        lens = _meta(batch, dtype=torch.int32) if own else None
        idx, req = _meta(batch, dtype=torch.int32), _meta(batch, dtype=torch.int64)
        return [decode_launch(q, k, kf, kh, k, kf, kh, g["hkv"], g["d"], table, tpos, lens, idx, req, req, out, lse,
                              lay, g["d"] ** -0.5, n, chunk, k_off=ko, v_off=ko)]
    return build


def _extend(dtype, fmt="plain", seg=False):
    def build(batch, ctx):
        from .triton_attention import PLAN_M, extend_launch

        g = GQA
        lay = _layout(batch * ctx, g["page"], g["cp"])
        rows = lay.cp_size * lay.slots_per_rank
        k, kf, ko = _cache(rows, (g["hkv"], g["d"]), dtype, "gqa" if fmt == "fp8" else "plain", seg and g["cp"])
        kh = k.stride(1) if k.dim() == 3 else g["d"]
        T = batch * min(ctx, EXTEND_CHUNK)
        q, out = _meta(T, g["heads"], g["d"], dtype=dtype), _meta(T, g["heads"], g["d"], dtype=dtype)
        blocks = _meta(-(-T // PLAN_M), 3, dtype=torch.int32)
        return [extend_launch(q, k, kf, kh, k, kf, kh, g["hkv"], g["d"], _meta(batch, ctx, dtype=torch.int64), blocks,
                              _meta(T, dtype=torch.int64), out, _meta(T, g["heads"], dtype=torch.float32), lay,
                              g["d"] ** -0.5, k_off=ko, v_off=ko)]
    return build


def _merge(dtype, d):
    def build(batch, ctx):
        from .triton_attention import DECODE_CONFIG, merge_launch
        from .triton_backend import chunks

        heads = GQA["heads"] if d == GQA["d"] else MLA["heads"][0]
        n, _ = chunks(batch * (GQA["hkv"] if d == GQA["d"] else 1), ctx, DECODE_CONFIG[dtype][0], _programs())
        n = max(n, 2)
        return [merge_launch(_meta(n, batch, heads, d, dtype=torch.float32), _meta(n, batch, heads, dtype=torch.float32),
                             _meta(batch, heads, d, dtype=dtype), _meta(batch, heads, dtype=torch.float32),
                             _meta(batch, dtype=torch.int32))]
    return build


def _sparse_mla(dtype, fmt="plain", seg=False):
    def build(batch, ctx):
        from .triton_backend import chunks
        from .triton_dsa import MLA_CONFIG, sparse_mla_launch

        m = MLA
        lay = _layout(batch * ctx, 64, 8)
        lat, lf, lo = _cache(lay.cp_size * lay.slots_per_rank, (m["r"] + m["dr"],), dtype,
                             "mla" if fmt == "fp8" else "plain", seg and lay.cp_size)
        out = []
        for H in m["heads"]:
            bh, bk = MLA_CONFIG[dtype][:2]
            n, chunk = chunks(batch * -(-H // bh), min(m["topk"], ctx), bk, _programs())
            q = _meta(batch, H, m["r"] + m["dr"], dtype=dtype)
            o = _meta(n, batch, H, m["r"], dtype=torch.float32) if n > 1 else _meta(batch, H, m["r"], dtype=dtype)
            out.append(sparse_mla_launch(q, lat, lf, _meta(batch, min(m["topk"], ctx), dtype=torch.int64), o,
                                         _meta(*o.shape[:-1], dtype=torch.float32), lay, 0.1, m["r"], -1, n, chunk,
                                         lat_off=lo))
        return out
    return build


def _index(dtype, fmt="plain", seg=False):
    def build(batch, ctx):
        from .triton_backend import chunks
        from .triton_dsa import INDEX_CONFIG, index_launch

        i = INDEX
        lay = _layout(batch * ctx, 64, 8)
        k, kf, ko = _cache(lay.cp_size * lay.slots_per_rank, (i["dim"],), dtype, "index" if fmt == "fp8" else "plain",
                           seg and lay.cp_size)
        n, chunk = chunks(batch, ctx, INDEX_CONFIG[dtype][0], _programs())
        return [index_launch(_meta(batch, i["heads"], i["dim"], dtype=dtype), _meta(batch, i["heads"], dtype=torch.float32),
                             k, kf, _meta(batch, ctx, dtype=torch.int64), _meta(batch, dtype=torch.int64),
                             _meta(batch, dtype=torch.int64), _meta(batch, ctx, dtype=torch.float32), lay, 0.1, n, chunk,
                             k_off=ko)]
    return build


def _store(dtype, fmt="plain"):
    def build(batch, ctx):
        from .triton_store import store_launch

        lay = _layout(batch * ctx, 64, 8)
        shape = (MLA["r"] + MLA["dr"],) if fmt == "mla" else (GQA["hkv"], GQA["d"])
        seg, sf, _ = _cache(lay.slots_per_rank, shape, dtype, fmt)
        width = shape[0] * (shape[1] if len(shape) > 1 else 1)
        return [store_launch(seg, sf, _meta(batch, width, dtype=dtype), _meta(batch, dtype=torch.int64),
                             _meta(2, dtype=torch.int32), lay, 0, width)]
    return build


F32, BF16 = torch.float32, torch.bfloat16
VARIANTS = (
    Variant("decode bf16", "decode", BF16, "plain", _decode(BF16)),
    Variant("decode fp32", "decode", F32, "plain", _decode(F32)),
    Variant("decode bf16, fp8 cache", "decode", BF16, "fp8", _decode(BF16, "fp8")),
    Variant("decode bf16, own slots (lse)", "decode", BF16, "plain", _decode(BF16, own=True)),
    Variant("extend bf16", "extend", BF16, "plain", _extend(BF16)),
    Variant("extend fp32", "extend", F32, "plain", _extend(F32)),
    Variant("extend bf16, fp8 cache", "extend", BF16, "fp8", _extend(BF16, "fp8")),
    Variant("merge bf16, D 128", "merge", BF16, "plain", _merge(BF16, 128)),
    Variant("merge bf16, D 512", "merge", BF16, "plain", _merge(BF16, 512)),
    Variant("sparse MLA bf16", "sparse_mla", BF16, "plain", _sparse_mla(BF16), 2),
    Variant("sparse MLA fp32", "sparse_mla", F32, "plain", _sparse_mla(F32), 2),
    Variant("sparse MLA bf16, fp8 latent", "sparse_mla", BF16, "fp8", _sparse_mla(BF16, "fp8"), 2),
    Variant("indexer bf16", "index", BF16, "plain", _index(BF16)),
    Variant("indexer fp32", "index", F32, "plain", _index(F32)),
    Variant("indexer bf16, fp8 keys", "index", BF16, "fp8", _index(BF16, "fp8")),
    Variant("store bf16", "store", BF16, "plain", _store(BF16)),
    Variant("store fp32", "store", F32, "plain", _store(F32)),
    Variant("store fp8 (K/V)", "store", BF16, "gqa", _store(BF16, "gqa")),
    Variant("store fp8 (MLA latent)", "store", BF16, "mla", _store(BF16, "mla")),
    # the group's memory as N segments, read through the table of their bases (GPUs: one allocation per rank)
    Variant("decode bf16, segment table", "decode", BF16, "plain", _decode(BF16, seg=True)),
    Variant("decode fp32, segment table", "decode", F32, "plain", _decode(F32, seg=True)),
    Variant("decode bf16, fp8 cache, segment table", "decode", BF16, "fp8", _decode(BF16, "fp8", seg=True)),
    Variant("decode bf16, own slots (lse), segment table", "decode", BF16, "plain", _decode(BF16, own=True, seg=True)),
    Variant("extend bf16, segment table", "extend", BF16, "plain", _extend(BF16, seg=True)),
    Variant("extend fp32, segment table", "extend", F32, "plain", _extend(F32, seg=True)),
    Variant("extend bf16, fp8 cache, segment table", "extend", BF16, "fp8", _extend(BF16, "fp8", seg=True)),
    Variant("sparse MLA bf16, segment table", "sparse_mla", BF16, "plain", _sparse_mla(BF16, seg=True), 2),
    Variant("sparse MLA fp32, segment table", "sparse_mla", F32, "plain", _sparse_mla(F32, seg=True), 2),
    Variant("sparse MLA bf16, fp8 latent, segment table", "sparse_mla", BF16, "fp8", _sparse_mla(BF16, "fp8", seg=True),
            2),
    Variant("indexer bf16, segment table", "index", BF16, "plain", _index(BF16, seg=True)),
    Variant("indexer fp32, segment table", "index", F32, "plain", _index(F32, seg=True)),
    Variant("indexer bf16, fp8 keys, segment table", "index", BF16, "fp8", _index(BF16, "fp8", seg=True)),
)


def _signature(launch):
    """Triton's signature, constexprs and attributes of a :class:`~.triton_common.Launch`,
    specialised as a launch would be: pointers and multiples of 16 aligned, a
    1 made constant, except the ``do_not_specialize`` arguments."""
    fn = launch.kernel
    sig, const, attrs = {}, dict(launch.const), {}
    for i, name in enumerate(fn.arg_names):
        if name in launch.const:
            sig[name] = "constexpr"
            continue
        v, dns = launch.args[name], fn.params[i].do_not_specialize
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not dns:
                sig[name], const[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0 and not dns:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, const, attrs


def _resources(cubin: bytes) -> dict:
    """Registers and local (stack) bytes per thread of a cubin's kernel, from the wheel's ``cuobjdump``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not m:
        raise RuntimeError(f"cuobjdump gave no resource usage:\n{text}")
    reg, stack, shared, local = map(int, m.groups())
    return dict(registers=reg, local_bytes=stack + local, static_shared=shared)


def compile_launch(launch) -> dict:
    """Compile one launch for sm_90: ``{registers, local_bytes, shared_bytes,
    hash, seconds}``. Raises ``RuntimeError`` in an interpreting process, and
    Triton's own error when the kernel does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(launch.kernel, "cache_key"):
        raise RuntimeError("the compile check needs jitted kernels: run it with TRITON_INTERPRET=0 "
                           "(python -m cpkv.kernels.compile_check)")
    sig, const, attrs = _signature(launch)
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(launch.kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    res = _resources(k.asm["cubin"])
    return dict(res, shared_bytes=k.metadata.shared + res["static_shared"], hash=k.hash,
                seconds=round(time.perf_counter() - t0, 2))


def occupancy(registers: int, shared: int, warps: int) -> int:
    """Programs (CTAs) of a kernel one sm_90 SM holds at once: registers
    allocated per warp in units of 256 (``registers`` per thread x 32, rounded
    up), shared bytes plus the 1 KB reserved per program, at most 64 warps
    and 32 programs (:data:`SM90`)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (SM90["registers"] // per_warp) // warps if per_warp else SM90["programs"]
    by_shared = SM90["shared"] // (shared + SM90["shared_reserved"])
    return max(0, min(by_regs, by_shared, SM90["warps"] // warps, SM90["programs"]))


def triton_dir(version: str, prefix: str | None = None) -> str:
    """Where ``make test`` installs Triton ``version`` for this check: ``triton-VERSION`` in the venv
    (``prefix``, default ``sys.prefix``), a ``pip install --target`` folder."""
    return os.path.join(prefix or sys.prefix, f"triton-{version}")


def check_variant(name: str) -> dict:
    """One row: the variant ``name`` compiled at every size of :data:`SIZES`
    (once: a second binary is an error), its resources and every launch's grid."""
    import triton

    v = next(x for x in VARIANTS if x.name == name)
    row = dict(name=v.name, kernel=v.kernel, dtype=str(v.dtype).removeprefix("torch."), fmt=v.fmt, grids={},
               error=None, triton=triton.__version__)
    try:
        hashes: dict[int, set] = {}
        for batch, ctx in SIZES:
            launches = v.build(batch, ctx)
            row["grids"][f"{batch}x{ctx // 1024}K"] = [lc.grid[0] for lc in launches]
            for j, lc in enumerate(launches):
                info = compile_launch(lc)
                hashes.setdefault(j, set()).add(info.pop("hash"))
                for k, x in info.items():  # the worst over the launches and sizes
                    row[k] = max(row.get(k, 0), x) if k != "seconds" else round(row.get(k, 0) + x, 2)
                row.update(num_warps=lc.num_warps, num_stages=lc.num_stages)
        most = max(len(h) for h in hashes.values())
        row["binaries"] = most
        row["ctas_per_sm"] = occupancy(row["registers"], row["shared_bytes"], row["num_warps"])
        row["waves"] = {k: [round(g / max(1, row["ctas_per_sm"] * SM90["sms"]), 2) for g in gs]
                        for k, gs in row["grids"].items()}
        if most > v.binaries:
            row["error"] = f"compiled {most} binaries over the sizes (expected {v.binaries}): a per-batch size is " \
                           "specialised"
        elif row["local_bytes"]:
            row["error"] = f"spills: {row['local_bytes']} bytes of local memory per thread"
    except Exception as e:  # noqa: BLE001 - a compile error is the row's finding
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return row


def check(names: list[str] | None = None, jobs: int = 1) -> list[dict]:
    """:func:`check_variant` of every variant (or ``names``), ``jobs`` processes at a time."""
    names = names or [v.name for v in VARIANTS]
    if jobs <= 1:
        return [check_variant(n) for n in names]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(check_variant, names))


def run_check(names: list[str] | None = None, jobs: int = 1, timeout: float = 600,
              triton: str | None = None) -> list[dict]:
    """:func:`check` in a fresh Python process with ``TRITON_INTERPRET=0``
    (callable from a process that interprets), under the Triton in folder
    ``triton`` (first on its path; default: the one installed). Raises
    ``RuntimeError`` if the process fails."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION",
                                                                                         "1"))
    if triton is not None:
        env["PYTHONPATH"] = os.pathsep.join([triton, *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "cpkv.kernels.compile_check", "--json", "--jobs", str(jobs)]
    for n in names or []:
        cmd += ["--only", n]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"the compile check failed to run (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def format_check(rows: list[dict]) -> str:
    """The compile report as a table: one row per variant."""
    from ..tools.table import format_rows

    table = []
    for r in rows:
        t = dict(kernel=r["name"], regs=r.get("registers", "-"), local=r.get("local_bytes", "-"),
                 shared=r.get("shared_bytes", "-"), warps=r.get("num_warps", "-"), stages=r.get("num_stages", "-"),
                 **{"ctas/SM": r.get("ctas_per_sm", "-")})
        waves = r.get("waves", {})
        t.update({f"grid {k}": "/".join(f"{x} ({w}w)" for x, w in zip(g, waves.get(k, [])))
                  or "/".join(map(str, g)) for k, g in r["grids"].items()})
        t["result"] = r["error"] or "ok"
        table.append(t)
    version = rows[0].get("triton", "?") if rows else "?"
    return format_rows(table, f"Triton {version} kernels compiled for sm_90 (GPUTarget cuda 90) on the CPU: "
                              "registers and local (spill) bytes per thread, shared bytes per program, programs "
                              "an SM holds (ctas/SM); grid = programs at batch x context (two for sparse MLA: "
                              "16 / 128 heads), in waves of ctas/SM x 132 SMs")


def main(argv: list[str] | None = None) -> int:
    """``python -m cpkv.kernels.compile_check``: exit 1 when a variant fails."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--only", action="append", default=None, help="a variant's name (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="compile processes")
    args = ap.parse_args(argv)
    rows = check(args.only, args.jobs)
    print(json.dumps(rows, indent=1) if args.json else format_check(rows))
    return 0 if args.json or not any(r["error"] for r in rows) else 1


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: the compile check compiles jitted kernels")
    sys.exit(main())
