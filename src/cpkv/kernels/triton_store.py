"""Triton store: a family's new entries written into this rank's own segment,
logical slots translated in the kernel ([[RFC-0001:C-DIRECT-WRITE]]), encoded
in the kernel when the family has a byte format ([[RFC-0001:C-KV-FORMAT]]):
bfloat16 bytes rounded as torch rounds, scaled FP8 with one float32 scale per
tile (``amax / 448``, IEEE division) and the bfloat16 tail, byte for byte
what :meth:`~cpkv.consumers.kv_format.KVFormat.encode` writes.

The report is written into a caller's ``int32 [2]`` tensor (refused slots,
first refused index; initialised to ``[0, T]``), so a store makes no
host-to-device copy and a caller may keep one report for a whole batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..consumers.kv_format import BF16_MAX, FP8_MAX
from .triton_common import Launch, ViewFormat, block, f32_to_bf16_bits, f32_to_e4m3_bits, owner_and_local, usable

BLOCK_T = 16
_FP8_MAX = tl.constexpr(FP8_MAX)
_BF16_MAX = tl.constexpr(float(BF16_MAX))


@triton.jit(do_not_specialize=["T", "CAP"])
def _store_kernel(buf_ptr, val_ptr, slot_ptr, report_ptr, T, stride_buf, stride_val, CAP, RANK,
                  N: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, W: tl.constexpr, CHUNKS: tl.constexpr,
                  FMT: tl.constexpr, BODY: tl.constexpr, TILE: tl.constexpr, TAIL: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid % CHUNKS
    t = (pid // CHUNKS) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    s = tl.load(slot_ptr + t, mask=in_t, other=PAD).to(tl.int64)
    ok = usable(s, PAD, CAP)
    owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
    owned = ok & (owner == RANK)
    w = tl.arange(0, BLOCK_W)
    src = val_ptr + t.to(tl.int64)[:, None] * stride_val
    if FMT == 2:
        TILES = (BODY + TILE - 1) // TILE
        if chunk < TILES:  # one scale tile of the FP8 body
            c = chunk * TILE + w
            m = owned[:, None] & ((w < TILE) & (c < BODY))[None, :]
            x = tl.load(src + c[None, :], mask=m, other=0.0).to(tl.float32)
            scale = tl.math.div_rn(tl.max(tl.abs(x), 1), tl.full([BLOCK_T], _FP8_MAX, tl.float32))
            y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
            y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
            tl.store(buf_ptr + local[:, None] * stride_buf + c[None, :], f32_to_e4m3_bits(y), mask=m)
            scales = buf_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
            tl.store(scales + local * (stride_buf // 4) + BODY // 4 + chunk, scale, mask=owned)
        else:  # the bfloat16 tail
            c = BODY + (chunk - TILES) * BLOCK_W + w
            m = owned[:, None] & (c < W)[None, :]
            x = tl.load(src + c[None, :], mask=m, other=0.0).to(tl.float32)
            x = tl.minimum(tl.maximum(x, -_BF16_MAX), _BF16_MAX)
            half = buf_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
            at = (BODY + 4 * TILES) // 2
            tl.store(half + local[:, None] * (stride_buf // 2) + at + (c[None, :] - BODY), f32_to_bf16_bits(x),
                     mask=m)
    else:
        c = chunk * BLOCK_W + w
        m = owned[:, None] & (c < W)[None, :]
        x = tl.load(src + c[None, :], mask=m)
        if FMT == 1:  # bfloat16 bytes
            half = buf_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
            tl.store(half + local[:, None] * (stride_buf // 2) + c[None, :], f32_to_bf16_bits(x.to(tl.float32)),
                     mask=m)
        else:
            tl.store(buf_ptr + local[:, None] * stride_buf + c[None, :], x.to(buf_ptr.dtype.element_ty), mask=m)
    refused = in_t & (s != PAD) & ~owned
    if chunk == 0:  # one chunk of each token block reports
        tl.atomic_add(report_ptr, tl.sum(refused.to(tl.int32), 0))
        tl.atomic_min(report_ptr + 1, tl.min(tl.where(refused, t, T), 0))


def store_launch(buffer: torch.Tensor, bf: ViewFormat, values: torch.Tensor, slots: torch.Tensor,
                 report: torch.Tensor, layout, rank: int, width: int) -> Launch:
    """The store launch: ``values [T, width]`` (float, row-major) at logical
    ``slots [T]`` into ``buffer`` (this rank's segment as
    :func:`~.triton_common.kernel_view` gives it, ``bf`` its format), the
    refusals added into ``report``."""
    T = slots.shape[0]
    if bf.FMT == 2:
        bw = block(bf.TILE, 1)
        chunks = -(-bf.BODY // bf.TILE) + -(-bf.TAIL // bw)
    else:
        bw = block(min(width, 256), 1)
        chunks = -(-width // bw)
    args = dict(buf_ptr=buffer, val_ptr=values, slot_ptr=slots, report_ptr=report, T=T, stride_buf=buffer.stride(0),
                stride_val=values.stride(0), CAP=layout.capacity, RANK=rank)
    const = dict(N=layout.cp_size, S=layout.slots_per_page, PAD=layout.padding_value, W=width, CHUNKS=chunks,
                 **bf.const(""), BLOCK_T=BLOCK_T, BLOCK_W=bw)
    return Launch(_store_kernel, (triton.cdiv(T, BLOCK_T) * chunks,), args, const, 4, 1, "store")
