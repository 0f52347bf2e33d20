"""What every Triton kernel of :mod:`cpkv.kernels` shares: the layout's slot
arithmetic and the cache formats' decoding in Triton, block sizes, the launch
record that both a run and the sm_90 compile check use, and the interpreter's
limits.

Imported only when the ``triton`` backend is asked for, after
:mod:`cpkv.kernels` has set ``TRITON_INTERPRET=1`` on a machine without CUDA
(the interpreter runs kernels on CPU tensors, one program after another).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from ..consumers.kv_format import KVFormat, ScaledFp8Format, TorchFormat
from ..consumers.kv_view import SegmentTable

#: Programs a split launch should hold at least, per streaming multiprocessor: eight. A decode at batch 1
#: then fills the GPU (flash-decoding), and a larger batch is split too until it makes several waves: the
#: decode kernels fit 2-5 programs per SM (registers and shared bytes of the sm_90 compile check,
#: :mod:`.compile_check`'s ``ctas/SM``), so 8 per SM is at least 1.6 waves and the last, partial wave idles
#: little of the GPU (batch 64 x 8 KV heads: 512 programs were 1.3 waves at 3 per SM; split 3 ways, 3.9).
PROGRAMS_PER_SM = 8
#: SMs of the GPU the kernels are tuned for (an H200), used where no CUDA device answers
DEFAULT_SMS = 132
_SMS: dict[int, int] = {}


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_fn(fn):
    """A helper the kernels call: ``triton.jit`` when compiling; under the
    interpreter the plain function (the running kernel has patched
    ``triton.language`` already, and a jitted helper would patch it again on
    every call, most of the interpreter's time)."""
    return fn if interpreting() else triton.jit(fn)


@device_fn
def owner_and_local(s, N: tl.constexpr, S: tl.constexpr):
    """Owner rank ``p % N`` and local slot ``(p // N) * S + s % S`` of logical
    slots ``s >= 0`` (``p = s // S``): :class:`~cpkv.contract.layout.SharedKVLayout`'s
    formulas, in Triton. The rank-major row is ``owner * slots_per_rank + local``.
    [[RFC-0001:C-LAYOUT-OWNER]]"""
    p = s // S
    return p % N, (p // N) * S + (s - p * S)


@device_fn
def row_offset(off_ptr, owner, local, SPR, stride, SEG: tl.constexpr):
    """Element offset, from the tensor a kernel is launched with, of rank-major
    row ``owner * SPR + local`` (``stride``: elements per row). ``SEG``
    false: one rank-major buffer, ``(owner * SPR + local) * stride``. ``SEG``
    true: the group's memory is N segments, the launched tensor segment 0
    (:class:`~cpkv.consumers.kv_view.SegmentTable`), and ``off_ptr [N]`` the
    offset of each segment from it (a multiple of 16 elements:
    :data:`~cpkv.consumers.kv_view.OFFSET_ALIGN_BYTES`): the owner's base plus
    its local row, ``off_ptr[owner] + local * stride``. [[RFC-0001:C-READ-PATH]]"""
    if SEG:
        return tl.multiple_of(tl.load(off_ptr + owner), 16) + local * stride
    return (owner * SPR + local) * stride


@device_fn
def usable(s, PAD: tl.constexpr, CAP):
    """Entries of ``s`` that name a slot: not padding and inside ``[0, CAP)``."""
    return (s != PAD) & (s >= 0) & (s < CAP)


@device_fn
def bf16_bits_to_f32(b):
    """bfloat16 values given as their int16 bits, widened to float32 (exact)."""
    return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@device_fn
def load_values(ptr, at, c0, cols, mask, FMT: tl.constexpr, BODY: tl.constexpr, TILE: tl.constexpr,
                TAIL: tl.constexpr, PART: tl.constexpr):
    """Values at flat index ``c0 + cols`` of the cache rows that start at
    element ``at`` of ``ptr`` (:func:`row_offset`; ``at [K, 1]``, ``cols [1,
    C]``, ``c0`` a scalar), decoded where ``mask`` (0 elsewhere): ``FMT`` 0 a
    float tensor read as it is (its dtype kept); 1 bfloat16 bytes (uint8
    rows, float32 out); 2 scaled FP8
    (:class:`~cpkv.consumers.kv_format.ScaledFp8Format`: ``BODY`` e4m3 bytes,
    one float32 scale per ``TILE`` of them, then ``TAIL`` bfloat16 values;
    float32 out). ``PART`` (FP8 only) says what the columns are, so that a
    kernel loads no more than it needs: 0 any (a scale gathered per value),
    1 body inside one tile (one scale per row), 2 body of ``C // TILE``
    whole tiles from a tile boundary (one scale per tile, broadcast), 3 tail
    only. A formatted row must be 4-byte aligned, its body a multiple of 4
    bytes (:func:`unreadable`). [[RFC-0001:C-KV-FORMAT]]"""
    col = c0 + cols
    if FMT == 0:
        x = tl.load(ptr + at + col, mask=mask, other=0.0)
    elif FMT == 1:
        half = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        x = bf16_bits_to_f32(tl.load(half + at // 2 + col, mask=mask, other=0))
    elif PART == 3:
        half = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        tail = (BODY + 4 * ((BODY + TILE - 1) // TILE)) // 2
        x = bf16_bits_to_f32(tl.load(half + at // 2 + tail + (col - BODY), mask=mask, other=0))
    else:
        body = col < BODY
        b = tl.load(ptr + at + col, mask=mask & body, other=0)
        x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scales = ptr.to(tl.pointer_type(tl.float32), bitcast=True) + at // 4 + BODY // 4
        if PART == 1:  # rows outside the mask read row 0's scale (in bounds) and are zeroed
            x = tl.where(mask, x * tl.load(scales + c0 // TILE), 0.0)
        elif PART == 2:
            NT: tl.constexpr = cols.shape[1] // TILE
            s = tl.load(scales + c0 // TILE + tl.arange(0, NT)[None, :])  # [K, NT]
            x = tl.reshape(tl.reshape(x, [x.shape[0], NT, TILE]) * s[:, :, None], [x.shape[0], NT * TILE])
            x = tl.where(mask, x, 0.0)
        else:
            x = x * tl.load(scales + col // TILE, mask=mask & body, other=0.0)
            if TAIL > 0:
                half = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
                tail = (BODY + 4 * ((BODY + TILE - 1) // TILE)) // 2
                t = tl.load(half + at // 2 + tail + (col - BODY), mask=mask & (col >= BODY), other=0)
                x = tl.where(body, x, bf16_bits_to_f32(t))
    return x


def fp8_part(vf: "ViewFormat", start: int, step: int, count: int, width: int, block: int) -> int:
    """The ``PART`` of :func:`load_values` for the column ranges ``c0 .. c0 +
    width - 1``, ``c0 = start + k * step`` for ``k < count`` (one per head),
    read in a block of ``block`` columns: 3 when all are tail, 1 when each
    lies in one scale tile of the body, 2 when each is whole tiles of the body
    from a tile boundary and the block is exactly as wide, else 0."""
    if vf.FMT != 2:
        return 0
    starts = [start + k * step for k in range(count)]
    if start >= vf.BODY:
        return 3
    if starts[-1] + width > vf.BODY:
        return 0
    if all(c % vf.TILE + width <= vf.TILE for c in starts):
        return 1
    if all(c % vf.TILE == 0 for c in starts) and width % vf.TILE == 0 and block == width:
        return 2
    return 0


@device_fn
def f32_to_bf16_bits(x):
    """float32 ``x`` rounded to bfloat16 (nearest, ties to even; torch's
    rounding, overflow to inf as torch's), as int16 bits."""
    bits = x.to(tl.int32, bitcast=True)
    r = bits + 0x7FFF + ((bits >> 16) & 1)
    return (r >> 16).to(tl.int16)


@device_fn
def f32_to_e4m3_bits(x):
    """float32 ``x`` with ``|x| <= 448`` rounded to float8 e4m3fn (nearest,
    ties to even, subnormals kept: torch's ``.to(torch.float8_e4m3fn)``), as
    uint8 bits, in integer arithmetic (so the interpreter and a GPU agree)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal: keep 3 mantissa bits, rounding to even; a carry moves into the exponent
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal (|x| < 2^-6): the multiple of 2^-9 nearest |x|, ties to even (8 is 2^-6, the first normal)
    e = (mag >> 23) - 127
    sig = (mag & 0x7FFFFF) | 0x800000
    sh = tl.minimum(14 - e, 31)
    q = sig >> sh
    rem = sig - (q << sh)
    half = 1 << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    m = tl.where(mag < 0x3C800000, q, normal)  # 0x3C800000 is 2^-6
    return (sign | m).to(tl.uint8)


def block(n: int, least: int = 16) -> int:
    """Power-of-two block covering ``n``, at least ``least`` (``tl.dot`` needs 16)."""
    return max(least, triton.next_power_of_2(max(int(n), 1)))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (asked once per device), or
    :data:`DEFAULT_SMS` where no CUDA device answers (the CPU, the interpreter)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def split_chunks(work: int, length: int, tile: int, programs: int) -> tuple[int, int]:
    """Split a context of ``length`` keys (the longest of a launch) so that
    ``work`` programs per split (queries x heads) make at least ``programs``
    in all where the context allows: returns ``(splits, chunk)``, ``chunk`` a
    multiple of ``tile`` and ``splits = ceil(length / chunk)``, so no split
    of the longest context is empty. ``work >= programs`` or a context of one
    tile gives one split over it all. Pure (host integers, no device read)."""
    tiles = max(1, -(-int(length) // tile))
    if work <= 0 or work >= programs or tiles == 1:
        return 1, tiles * tile
    want = -(-programs // work)
    per = max(1, tiles // want)  # tiles per split, rounded down: at least `want` splits when tiles allow
    return -(-tiles // per), per * tile


@dataclass(frozen=True)
class ViewFormat:
    """How a kernel reads a cache view: ``FMT`` (see :func:`load_values`) and
    ``BODY``/``TILE``/``TAIL`` of a scaled FP8 format (0, 1, 0 otherwise)."""

    FMT: int
    BODY: int = 0
    TILE: int = 1
    TAIL: int = 0

    def const(self, prefix: str) -> dict[str, int]:
        """The four constexprs of a kernel, named ``{prefix}FMT`` etc."""
        return {f"{prefix}FMT": self.FMT, f"{prefix}BODY": self.BODY, f"{prefix}TILE": self.TILE,
                f"{prefix}TAIL": self.TAIL}

    def read(self, prefix: str, start: int, step: int, count: int, width: int, block: int) -> dict[str, int]:
        """:meth:`const` and ``{prefix}PART`` (:func:`fp8_part`) of one read site."""
        return {**self.const(prefix), f"{prefix}PART": fp8_part(self, start, step, count, width, block)}


def kernel_view(view: torch.Tensor | SegmentTable,
                fmt: KVFormat | None) -> tuple[torch.Tensor, ViewFormat, torch.Tensor | None]:
    """What a kernel reads for a cache ``view`` stored in ``fmt`` (``None``: a
    float tensor, read as it is): ``(tensor, format, offsets)``. ``tensor``
    is the one launched: the rank-major rows, or over a
    :class:`~cpkv.consumers.kv_view.SegmentTable` its segment 0 (the base),
    with ``offsets`` the table (int64 ``[N]``, each segment's offset from the
    base in ``tensor``'s elements; ``None`` for one tensor: :func:`row_offset`).
    Float32 bytes are read through a float32 view of their rows, bfloat16
    bytes and scaled FP8 rows as the uint8 rows they are. ``ValueError`` for a
    format no kernel reads (:func:`unreadable`)."""
    table = view if isinstance(view, SegmentTable) else None
    t = view if table is None else table.base
    if fmt is None:
        vf = ViewFormat(0)
    else:
        why = unreadable(fmt)
        if why:
            raise ValueError(why)
        if isinstance(fmt, TorchFormat):
            if fmt.dtype == torch.float32:
                t, vf = t.view(torch.float32), ViewFormat(0)
            else:
                vf = ViewFormat(1)
        else:
            vf = ViewFormat(2, fmt.body, fmt.tile, fmt.tail)
    return t, vf, (None if table is None else table.offsets_in(t.element_size()))


def unreadable(fmt: KVFormat | None) -> str | None:
    """Why the Triton kernels cannot read or write ``fmt`` in place, or ``None``:
    they read float tensors, bfloat16 bytes and scaled FP8 rows whose scales
    are 4-byte aligned (body and row a multiple of 4 bytes, as every cpkv
    format at a head size that is a multiple of 4)."""
    if fmt is None:
        return None
    if isinstance(fmt, TorchFormat):
        return None
    if isinstance(fmt, ScaledFp8Format):
        if fmt.body % 4 or fmt.bytes_per_slot % 4:
            return f"{fmt}: body of {fmt.body} and row of {fmt.bytes_per_slot} bytes must be multiples of 4"
        return None
    return f"{type(fmt).__name__} has no Triton decoder"


def launchable(*tensors: torch.Tensor) -> None:
    """Refuse what the active Triton cannot run: CPU tensors without the
    interpreter, and bfloat16 in the interpreter (it has no bfloat16
    arithmetic; bfloat16 is GPU-only)."""
    if interpreting():
        if any(t.dtype == torch.bfloat16 for t in tensors):
            raise TypeError("bfloat16 is GPU-only for the triton backend: the Triton interpreter "
                            "(TRITON_INTERPRET=1) has no bfloat16 arithmetic; use float32/float16 or backend='torch'")
    elif any(t.device.type != "cuda" for t in tensors):
        raise RuntimeError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           "imported to run on CPU tensors")


def dot_precision(dtype: torch.dtype) -> str:
    """``"ieee"`` for float32 operands (exact fp32 products, no TF32); 16-bit
    operands run on tensor cores with float32 accumulation (the value is then unused)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass
class Launch:
    """One kernel launch, described before it runs: the jitted ``kernel``, its
    ``grid``, its runtime ``args`` and ``const`` (constexprs) by name, and
    ``num_warps``/``num_stages``. :meth:`run` launches it; the sm_90 compile
    check (:mod:`cpkv.kernels.compile_check`) compiles the same description
    from meta tensors, so both see one configuration."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    const: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    name: str = field(default="")

    def run(self) -> None:
        """Launch (nothing when the grid is empty)."""
        if all(g > 0 for g in self.grid):
            self.kernel[self.grid](**self.args, **self.const, num_warps=self.num_warps, num_stages=self.num_stages)


__all__ = ["DEFAULT_SMS", "Launch", "device_fn", "fp8_part", "PROGRAMS_PER_SM", "ViewFormat", "bf16_bits_to_f32", "block", "dot_precision",
           "f32_to_bf16_bits", "f32_to_e4m3_bits", "interpreting", "launchable", "load_values", "owner_and_local",
           "kernel_view", "row_offset", "sm_count", "split_chunks", "unreadable", "usable", "tl"]
