"""Triton kernels of DSA's sparse attention over the shared view, logical slots
translated in the kernel, byte formats decoded in it:

* :func:`index_launch` - the lightning indexer's scores
  ([[RFC-0001:C-INDEXER-POOL]]): one program per query and chunk of its
  context, the query's ``[Hi, Di]`` block loaded once and held while it walks
  the chunk's key tiles (a batch-1 decode still fills the GPU: the context is
  split into as many chunks as that takes);
* :func:`sparse_mla_launch` - absorbed MLA over selected logical slots
  ([[RFC-0001:C-MLA-LATENT-POOL]]): one program per query, block of heads and
  chunk of its selection, partials merged by
  :func:`~cpkv.kernels.triton_attention.merge_launch`.

Both read the group's memory as one rank-major buffer or as N segments through
a table of their bases (``KSEG``/``LSEG``: :func:`~.triton_common.row_offset`).

Grids are one-dimensional (at most ``2**31 - 1`` programs, the hardware's x
limit; the y and z limits of 65,535 never apply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import Launch, ViewFormat, block, dot_precision, fp8_part, load_values, owner_and_local, row_offset, \
    usable

#: (BLOCK_L keys per tile, num_warps, num_stages) of the indexer, by query dtype
INDEX_CONFIG = {torch.float32: (32, 8, 1), torch.float16: (64, 4, 2), torch.bfloat16: (64, 4, 2)}
#: (BLOCK_H heads, BLOCK_K selected slots per tile, num_warps, num_stages) of sparse MLA, by query dtype
MLA_CONFIG = {torch.float32: (16, 16, 8, 1), torch.float16: (16, 16, 8, 2), torch.bfloat16: (16, 16, 8, 2)}


@triton.jit(do_not_specialize=["T", "L", "st_b", "so_t", "CHUNK", "SPLITS", "CAP", "SPR"])
def _index_kernel(q_ptr, w_ptr, k_ptr, koff_ptr, table_ptr, req_ptr, pos_ptr, out_ptr,
                  sq_t, sq_h, sw_t, sk_n, st_b, so_t, T, L, CHUNK, SPLITS, SPR, CAP, scale,
                  N: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PREC: tl.constexpr,
                  KFMT: tl.constexpr, KBODY: tl.constexpr, KTILE: tl.constexpr, KTAIL: tl.constexpr,
                  KPART: tl.constexpr, KSEG: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    split = pid % SPLITS
    t = pid // SPLITS
    req = tl.load(req_ptr + t).to(tl.int64)
    n = tl.minimum(tl.load(pos_ptr + t).to(tl.int64) + 1, L)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, n)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + d[None, :], mask=(h < HI)[:, None] & (d < DI)[None, :],
                other=0.0)
    w = tl.load(w_ptr + t * sw_t + h, mask=h < HI, other=0.0).to(tl.float32)
    for s0 in range(start, end, BLOCK_L):
        offs = s0 + tl.arange(0, BLOCK_L)
        inr = offs < end
        s = tl.load(table_ptr + req * st_b + offs, mask=inr, other=PAD).to(tl.int64)
        ok = usable(s, PAD, CAP) & inr
        owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
        at = row_offset(koff_ptr, owner, local, SPR, sk_n, KSEG)  # the owner's segment, its local row
        k = load_values(k_ptr, at[:, None], 0, d[None, :], ok[:, None] & (d < DI)[None, :],
                        KFMT, KBODY, KTILE, KTAIL, KPART)
        sc = tl.maximum(tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scale, 0.0)  # [BLOCK_H, BLOCK_L]
        score = tl.sum(w[:, None] * sc, 0)
        tl.store(out_ptr + t * so_t + offs, tl.where(ok, score, float("-inf")), mask=inr)


def index_launch(q, w, k, kf: ViewFormat, table, req, pos, out, layout, scale: float, splits: int,
                 chunk: int, *, k_off=None) -> Launch:
    """The indexer launch: ``q [T, Hi, Di]``, ``w [T, Hi]``, keys ``k`` (as
    :func:`~.triton_common.kernel_view` gives them, ``k_off`` their segment
    table or ``None``) over ``table [B, L]``,
    into ``out [T, L]`` (float32, filled with ``-inf`` by the caller): each
    query's visible context in ``splits`` chunks of ``chunk`` keys."""
    T, Hi, Di = q.shape
    bl, warps, stages = INDEX_CONFIG[q.dtype]
    args = dict(q_ptr=q, w_ptr=w, k_ptr=k, koff_ptr=k if k_off is None else k_off, table_ptr=table, req_ptr=req, pos_ptr=pos, out_ptr=out,
                sq_t=q.stride(0), sq_h=q.stride(1), sw_t=w.stride(0), sk_n=k.stride(0), st_b=table.stride(0),
                so_t=out.stride(0), T=T, L=table.shape[1], CHUNK=chunk, SPLITS=splits, SPR=layout.slots_per_rank,
                CAP=layout.capacity, scale=float(scale))
    const = dict(N=layout.cp_size, S=layout.slots_per_page, PAD=layout.padding_value, HI=Hi, DI=Di,
                 BLOCK_H=block(Hi), BLOCK_D=block(Di), BLOCK_L=bl, PREC=dot_precision(q.dtype),
                 **kf.read("K", 0, 0, 1, Di, block(Di)), KSEG=k_off is not None)
    return Launch(_index_kernel, (T * splits,), args, const, warps, stages, "index")


@triton.jit(do_not_specialize=["T", "KSEL", "CHUNK", "SPLITS", "CAP", "SPR", "ONLY"])
def _sparse_mla_kernel(q_ptr, lat_ptr, loff_ptr, slot_ptr, out_ptr, lse_ptr, sq_t, sq_h, sl_n, ss_t, so_s, so_t, so_h, sl_s,
                       T, KSEL, CHUNK, SPLITS, SPR, CAP, ONLY, scaling,
                       N: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, H: tl.constexpr, HB: tl.constexpr,
                       VD: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr, ONLY_SET: tl.constexpr,
                       LFMT: tl.constexpr, LBODY: tl.constexpr, LTILE: tl.constexpr, LTAIL: tl.constexpr,
                       CPART: tl.constexpr, RPART: tl.constexpr, LSEG: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    split = pid % SPLITS
    hb = (pid // SPLITS) % HB
    t = pid // (SPLITS * HB)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_V)  # latent part: keys and values
    e = tl.arange(0, BLOCK_R)  # rope part: keys only, after the latent
    hm = h < H
    q_c = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + c[None, :], mask=hm[:, None] & (c < VD)[None, :], other=0.0)
    q_r = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + VD + e[None, :], mask=hm[:, None] & (e < RD)[None, :],
                  other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, KSEL)
    for s0 in range(start, end, BLOCK_K):
        offs = s0 + tl.arange(0, BLOCK_K)
        inr = offs < end
        s = tl.load(slot_ptr + t * ss_t + offs, mask=inr, other=PAD).to(tl.int64)
        ok = usable(s, PAD, CAP) & inr
        owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
        if ONLY_SET:  # the log-sum-exp split: only the slots rank ONLY owns
            ok = ok & (owner == ONLY)
        at = row_offset(loff_ptr, owner, local, SPR, sl_n, LSEG)  # the owner's segment, its local row
        lat_c = load_values(lat_ptr, at[:, None], 0, c[None, :], ok[:, None] & (c < VD)[None, :],
                            LFMT, LBODY, LTILE, LTAIL, CPART).to(q_c.dtype)
        lat_r = load_values(lat_ptr, at[:, None], VD, e[None, :], ok[:, None] & (e < RD)[None, :],
                            LFMT, LBODY, LTILE, LTAIL, RPART).to(q_c.dtype)
        sc = tl.dot(q_c, tl.trans(lat_c), input_precision=PREC) + tl.dot(q_r, tl.trans(lat_r), input_precision=PREC)
        sc = tl.where(ok[None, :], sc * scaling, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_c.dtype), lat_c, input_precision=PREC)
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    tl.store(lse_ptr + split * sl_s + t * H + h, lse, mask=hm)
    tl.store(out_ptr + split * so_s + t * so_t + h[:, None] * so_h + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & (c < VD)[None, :])


def sparse_mla_launch(q, lat, lf: ViewFormat, slots, out, lse, layout, scaling: float, value_dims: int,
                      only_rank: int, splits: int, chunk: int, *, lat_off=None) -> Launch:
    """The sparse MLA launch: ``q [T, H, r + dr]`` over the latent rows ``lat``
    (as :func:`~.triton_common.kernel_view` gives them, ``lat_off`` their
    segment table or ``None``) at ``slots [T, K]``,
    ``splits`` chunks of ``chunk`` selected slots each; writes ``out [T, H,
    r]``/``lse [T, H]`` with one split, else partials ``out [splits, T, H, r]``
    and ``lse [splits, T, H]`` (float32) to merge."""
    T, H, Dl = q.shape
    bh, bk, warps, stages = MLA_CONFIG[q.dtype]
    bh = min(bh, block(H))
    part = out.dim() == 4
    args = dict(q_ptr=q, lat_ptr=lat, loff_ptr=lat if lat_off is None else lat_off, slot_ptr=slots, out_ptr=out, lse_ptr=lse, sq_t=q.stride(0), sq_h=q.stride(1),
                sl_n=lat.stride(0), ss_t=slots.stride(0), so_s=out.stride(0) if part else 0, so_t=out.stride(-3),
                so_h=out.stride(-2), sl_s=lse.stride(0) if part else 0, T=T, KSEL=slots.shape[1], CHUNK=chunk,
                SPLITS=splits, SPR=layout.slots_per_rank, CAP=layout.capacity, ONLY=max(only_rank, 0),
                scaling=float(scaling))
    const = dict(N=layout.cp_size, S=layout.slots_per_page, PAD=layout.padding_value, H=H, HB=triton.cdiv(H, bh),
                 VD=value_dims, RD=Dl - value_dims, BLOCK_H=bh, BLOCK_K=bk, BLOCK_V=block(value_dims),
                 BLOCK_R=block(Dl - value_dims), PREC=dot_precision(q.dtype), ONLY_SET=only_rank >= 0,
                 **lf.const("L"), CPART=fp8_part(lf, 0, 0, 1, value_dims, block(value_dims)),
                 RPART=fp8_part(lf, value_dims, 0, 1, Dl - value_dims, block(Dl - value_dims)),
                 LSEG=lat_off is not None)
    return Launch(_sparse_mla_kernel, (T * triton.cdiv(H, bh) * splits,), args, const, warps, stages, "sparse_mla")
