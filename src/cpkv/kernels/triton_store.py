"""Triton store: a family's new entries written into this rank's own segment,
logical slots translated in the kernel. [[RFC-0001:C-DIRECT-WRITE]]"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import block, launchable, owner_and_local, usable

BLOCK_T = 16


@triton.jit
def _store_kernel(buf_ptr, val_ptr, slot_ptr, report_ptr, T, W, stride_buf, stride_val,
                  N, S, PAD, CAP, RANK, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_w = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    in_t = t < T
    s = tl.load(slot_ptr + t, mask=in_t, other=PAD).to(tl.int64)
    ok = usable(s, PAD, CAP)
    owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
    owned = ok & (owner == RANK)
    m = owned[:, None] & (w < W)[None, :]
    x = tl.load(val_ptr + t.to(tl.int64)[:, None] * stride_val + w[None, :], mask=m)
    tl.store(buf_ptr + local[:, None] * stride_buf + w[None, :], x.to(buf_ptr.dtype.element_ty), mask=m)
    refused = in_t & (s != PAD) & ~owned
    if pid_w == 0:  # one column of programs reports
        n = tl.sum(refused.to(tl.int32), 0)
        first = tl.min(tl.where(refused, t, T), 0)
        tl.atomic_add(report_ptr, n)
        tl.atomic_min(report_ptr + 1, first)


def store(buffer: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """See :func:`cpkv.kernels.store`; returns the report ``int32 [2]``."""
    launchable(buffer, values, slots)
    T = slots.numel()
    W = values[0].numel() if T else buffer[0].numel()
    report = torch.tensor([0, T], dtype=torch.int32, device=buffer.device)
    if T == 0:
        return report
    vals = values.reshape(T, W)
    buf = buffer.view(buffer.shape[0], W)
    BLOCK_W = block(min(W, 256), 1)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(W, BLOCK_W))
    _store_kernel[grid](buf, vals, slots.contiguous(), report, T, W, buf.stride(0), vals.stride(0),
                        layout.cp_size, layout.slots_per_page, layout.padding_value, layout.capacity, rank,
                        BLOCK_T=BLOCK_T, BLOCK_W=BLOCK_W)
    return report
