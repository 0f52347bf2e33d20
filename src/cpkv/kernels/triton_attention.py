"""Triton paged GQA attention over the rank-major view (logical slot table
translated in the kernel) and the log-sum-exp merge of partial attentions.
[[RFC-0001:C-READ-PATH]]"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import block, dot_precision, launchable, owner_and_local, usable, view_args, view_offset

BLOCK_N = 32


@triton.jit
def _paged_kernel(q_ptr, k_ptr, v_ptr, koff_ptr, voff_ptr, table_ptr, req_ptr, pos_ptr, out_ptr, lse_ptr,
                  sq_t, sq_h, sk_n, sk_h, sv_n, sv_h, st_b, so_t, so_h,
                  L, H, G, D, DV, N, S, SPR, PAD, CAP, ONLY, scaling,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PREC: tl.constexpr, ONLY_SET: tl.constexpr, HAS_OFF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)  # kv head; its G query heads are the rows of this program
    req = tl.load(req_ptr + t).to(tl.int64)
    n_ctx = tl.minimum(tl.load(pos_ptr + t).to(tl.int64) + 1, L)
    r = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    heads = g * G + r
    q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=(r < G)[:, None] & (d < D)[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(0, n_ctx, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        s = tl.load(table_ptr + req * st_b + offs, mask=offs < n_ctx, other=PAD).to(tl.int64)
        ok = usable(s, PAD, CAP) & (offs < n_ctx)
        owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
        if ONLY_SET:  # the log-sum-exp split: only the slots rank ONLY owns
            ok = ok & (owner == ONLY)
        k_at = view_offset(koff_ptr, owner, local, SPR, sk_n, HAS_OFF)  # the owner's segment, its local row
        v_at = view_offset(voff_ptr, owner, local, SPR, sv_n, HAS_OFF)
        k = tl.load(k_ptr + k_at[:, None] + g * sk_h + d[None, :], mask=ok[:, None] & (d < D)[None, :],
                    other=0.0)
        sc = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scaling
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_at[:, None] + g * sv_h + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :],
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    rm = r < G
    tl.store(lse_ptr + t * H + heads, lse, mask=rm)
    tl.store(out_ptr + t * so_t + heads[:, None] * so_h + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rm[:, None] & (dv < DV)[None, :])


def paged_attention(q, k_view, v_view, table, q_req, q_pos, layout, scaling, only_rank=-1):
    """See :func:`cpkv.kernels.paged_attention`; returns ``(out [T, H, Dv], lse [T, H] fp32)``."""
    launchable(q, k_view, v_view, table)
    T, H, D = q.shape
    Hkv, Dv = k_view.shape[1], v_view.shape[2]
    (k_view, k_off, has_off), (v_view, v_off, _) = view_args(k_view), view_args(v_view)
    out = torch.zeros((T, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or table.shape[1] == 0:
        return out, lse
    q, table = q.contiguous(), table.contiguous()
    G = H // Hkv
    _paged_kernel[(T, Hkv)](
        q, k_view, v_view, k_off, v_off, table, q_req.contiguous(), q_pos.contiguous(), out, lse,
        q.stride(0), q.stride(1), k_view.stride(0), k_view.stride(1), v_view.stride(0), v_view.stride(1),
        table.stride(0), out.stride(0), out.stride(1),
        table.shape[1], H, G, D, Dv, layout.cp_size, layout.slots_per_page, layout.slots_per_rank,
        layout.padding_value, layout.capacity, only_rank, float(scaling), ONLY_SET=only_rank >= 0, HAS_OFF=has_off,
        BLOCK_G=block(G), BLOCK_N=BLOCK_N, BLOCK_D=block(D), BLOCK_DV=block(Dv), PREC=dot_precision(q, k_view))
    return out, lse


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, outs_ptr, lses_ptr, R, M, D, so_r, so_m,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)  # one (token, head) row
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    lr = tl.load(lses_ptr + r * M + m, mask=r < R, other=float("-inf")).to(tl.float32)
    top = tl.max(lr, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(lr == float("-inf"), 0.0, tl.exp(lr - top_safe))
    den = tl.sum(w, 0)
    seen = den > 0
    x = tl.load(outs_ptr + r[:, None] * so_r + m * so_m + d[None, :], mask=(r < R)[:, None] & (d < D)[None, :],
                other=0.0).to(tl.float32)
    o = tl.sum(w[:, None] * x, 0) / tl.where(seen, den, 1.0)
    tl.store(out_ptr + m * D + d, o.to(out_ptr.dtype.element_ty), mask=d < D)
    tl.store(lse_ptr + m, tl.where(seen, top_safe + tl.log(tl.where(seen, den, 1.0)), float("-inf")))


def merge_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`cpkv.kernels.merge_lse`; returns ``(out [T, H, D], lse [T, H] fp32)``."""
    launchable(outs, lses)
    R, T, H, D = outs.shape
    out = torch.zeros((T, H, D), dtype=outs.dtype, device=outs.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=outs.device)
    if T * H == 0 or R == 0:
        return out, lse
    o = outs.reshape(R, T * H, D).contiguous()
    _merge_kernel[(T * H,)](out, lse, o, lses.contiguous(), R, T * H, D, o.stride(0), o.stride(1),
                            BLOCK_R=block(R, 1), BLOCK_D=block(D, 1))
    return out, lse
