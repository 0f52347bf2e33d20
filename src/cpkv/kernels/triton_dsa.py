"""Triton kernels of DSA's sparse attention over the shared view: the
lightning indexer's scores ([[RFC-0001:C-INDEXER-POOL]]) and absorbed MLA over
selected logical slots ([[RFC-0001:C-MLA-LATENT-POOL]]), slots translated in
the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import block, dot_precision, launchable, owner_and_local, usable, view_args, view_offset

BLOCK_L = 32
BLOCK_K = 32


@triton.jit
def _index_kernel(q_ptr, w_ptr, k_ptr, koff_ptr, table_ptr, req_ptr, pos_ptr, out_ptr,
                  sq_t, sq_h, sw_t, sk_n, st_b, HI, DI, L, N, S, SPR, PAD, CAP, scale,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PREC: tl.constexpr,
                  HAS_OFF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    req = tl.load(req_ptr + t).to(tl.int64)
    n_ctx = tl.minimum(tl.load(pos_ptr + t).to(tl.int64) + 1, L)
    vis = offs < n_ctx
    s = tl.load(table_ptr + req * st_b + offs, mask=vis, other=PAD).to(tl.int64)
    ok = usable(s, PAD, CAP) & vis
    owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
    at = view_offset(koff_ptr, owner, local, SPR, sk_n, HAS_OFF)  # the owner's segment, its local row
    q = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + d[None, :], mask=(h < HI)[:, None] & (d < DI)[None, :],
                other=0.0)
    k = tl.load(k_ptr + at[:, None] + d[None, :], mask=ok[:, None] & (d < DI)[None, :], other=0.0)
    sc = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC) * scale, 0.0)  # [BLOCK_H, BLOCK_L]
    w = tl.load(w_ptr + t * sw_t + h, mask=h < HI, other=0.0).to(tl.float32)
    score = tl.sum(w[:, None] * sc, 0)
    tl.store(out_ptr + t * L + offs, tl.where(ok, score, float("-inf")), mask=offs < L)


def index_scores(q, weights, k_view, table, q_req, q_pos, layout, scale):
    """See :func:`cpkv.kernels.index_scores`; returns ``[T, L]`` float32."""
    launchable(q, weights, k_view, table)
    T, Hi, Di = q.shape
    L = table.shape[1]
    out = torch.full((T, L), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or L == 0:
        return out
    q, weights, table = q.contiguous(), weights.contiguous(), table.contiguous()
    k_view, k_off, has_off = view_args(k_view)
    _index_kernel[(T, triton.cdiv(L, BLOCK_L))](
        q, weights, k_view, k_off, table, q_req.contiguous(), q_pos.contiguous(), out,
        q.stride(0), q.stride(1), weights.stride(0), k_view.stride(0), table.stride(0), Hi, Di, L,
        layout.cp_size, layout.slots_per_page, layout.slots_per_rank, layout.padding_value, layout.capacity,
        float(scale), BLOCK_H=block(Hi), BLOCK_D=block(Di), BLOCK_L=BLOCK_L, PREC=dot_precision(q, k_view),
        HAS_OFF=has_off)
    return out


@triton.jit
def _sparse_mla_kernel(q_ptr, lat_ptr, loff_ptr, slot_ptr, out_ptr, lse_ptr, sq_t, sq_h, sl_n, ss_t, so_t, so_h,
                       H, KSEL, VD, RD, N, S, SPR, PAD, CAP, ONLY, scaling,
                       BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                       BLOCK_R: tl.constexpr, PREC: tl.constexpr, ONLY_SET: tl.constexpr, HAS_OFF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_V)  # latent part: keys and values
    e = tl.arange(0, BLOCK_R)  # rope part: keys only, after the latent
    hm = h < H
    q_c = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + c[None, :], mask=hm[:, None] & (c < VD)[None, :], other=0.0)
    q_r = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + VD + e[None, :], mask=hm[:, None] & (e < RD)[None, :],
                  other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for start in range(0, KSEL, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        s = tl.load(slot_ptr + t * ss_t + offs, mask=offs < KSEL, other=PAD).to(tl.int64)
        ok = usable(s, PAD, CAP) & (offs < KSEL)
        owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
        if ONLY_SET:  # the log-sum-exp split: only the slots rank ONLY owns
            ok = ok & (owner == ONLY)
        at = view_offset(loff_ptr, owner, local, SPR, sl_n, HAS_OFF)  # the owner's segment, its local row
        lat_c = tl.load(lat_ptr + at[:, None] + c[None, :], mask=ok[:, None] & (c < VD)[None, :], other=0.0)
        lat_r = tl.load(lat_ptr + at[:, None] + VD + e[None, :], mask=ok[:, None] & (e < RD)[None, :],
                        other=0.0)
        sc = tl.dot(q_c, tl.trans(lat_c), input_precision=PREC) + tl.dot(q_r, tl.trans(lat_r), input_precision=PREC)
        sc = tl.where(ok[None, :], sc * scaling, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, lat_c.to(tl.float32), input_precision="ieee")
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    tl.store(lse_ptr + t * H + h, lse, mask=hm)
    tl.store(out_ptr + t * so_t + h[:, None] * so_h + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & (c < VD)[None, :])


def sparse_mla_attention(q, latent_view, slots, layout, scaling, value_dims, only_rank=-1):
    """See :func:`cpkv.kernels.sparse_mla_attention`; returns ``(out [T, H, value_dims], lse [T, H] fp32)``."""
    launchable(q, latent_view, slots)
    T, H, Dl = q.shape
    out = torch.zeros((T, H, value_dims), dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or slots.shape[1] == 0:
        return out, lse
    q, slots = q.contiguous(), slots.contiguous()
    BLOCK_H = block(min(H, 16))  # heads per program: a [16, r] fp32 accumulator at r = 512
    latent_view, l_off, has_off = view_args(latent_view)
    _sparse_mla_kernel[(T, triton.cdiv(H, BLOCK_H))](
        q, latent_view, l_off, slots, out, lse, q.stride(0), q.stride(1), latent_view.stride(0), slots.stride(0),
        out.stride(0), out.stride(1), H, slots.shape[1], value_dims, Dl - value_dims,
        layout.cp_size, layout.slots_per_page, layout.slots_per_rank, layout.padding_value, layout.capacity,
        only_rank, float(scaling), BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, BLOCK_V=block(value_dims),
        BLOCK_R=block(Dl - value_dims), PREC=dot_precision(q, latent_view), ONLY_SET=only_rank >= 0,
        HAS_OFF=has_off)
    return out, lse
