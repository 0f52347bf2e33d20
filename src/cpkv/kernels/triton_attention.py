"""Triton paged GQA attention over the rank-major view, logical slots translated
in the kernel ([[RFC-0001:C-READ-PATH]]), and the log-sum-exp merge.

Every reading kernel takes the group's memory as one rank-major buffer or as N
segments, a table of their bases (``KSEG``/``VSEG``:
:func:`~.triton_common.row_offset`), one constexpr apart.

* :func:`decode_launch` - one query of a request per program row block
  (the ``G`` query heads of one KV head together), the context split into
  chunks (flash-decoding): a launch holds ``queries x kv heads x splits``
  programs, and the partials merge by :func:`merge_launch`. The context is a
  table row of logical slots, or under the log-sum-exp split the row of slots
  one rank owns with their positions (so a rank walks only its own slots).
* :func:`extend_launch` - a block of up to ``BLOCK_M`` queries of one request
  per program (prefill after a cached prefix of any length, chunked prefill):
  ``BLOCK_M x G`` query rows against each key tile, causal per row.
* :func:`merge_launch` - exact merge of partials over disjoint key sets.

Operands of ``tl.dot`` are the query's dtype: float32 runs exact (``ieee``),
float16/bfloat16 run on tensor cores with float32 accumulation (the
probabilities cast to the values' dtype). A cache in a byte format (bfloat16
bytes, scaled FP8) is decoded in the kernel (:func:`~.triton_common.load_values`).
Per-batch sizes are not specialised (``do_not_specialize``): one compiled
kernel serves every batch of a model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import Launch, ViewFormat, block, dot_precision, load_values, owner_and_local, row_offset, usable

#: (BLOCK_N keys per tile, num_warps, num_stages) of the decode kernel, by query dtype
DECODE_CONFIG = {torch.float32: (16, 4, 2), torch.float16: (64, 4, 3), torch.bfloat16: (64, 4, 3)}
#: (query rows per program, BLOCK_N, num_warps, num_stages) of the extend kernel, by query dtype. float32 (the
#: exact path, ``ieee`` products): 16 rows in 4 warps, 88-90 registers and no local memory under Triton 3.6, 3.8
#: and 3.9 (32 rows in 8 warps kept 16-32 bytes of local memory under 3.6 and 3.8: the sm_90 compile check)
EXTEND_CONFIG = {torch.float32: (16, 16, 4, 1), torch.float16: (128, 64, 8, 2), torch.bfloat16: (128, 64, 8, 2)}
#: queries of one request per planned extend block; a program takes BLOCK_M = rows // G of them
PLAN_M = 64

_PER_BATCH = ["T", "L", "st_b", "CHUNK", "SPLITS", "CAP", "SPR"]


@triton.jit(do_not_specialize=_PER_BATCH)
def _decode_kernel(q_ptr, k_ptr, v_ptr, koff_ptr, voff_ptr, table_ptr, tpos_ptr, lens_ptr, qidx_ptr, req_ptr, pos_ptr, out_ptr, lse_ptr,
                   sq_t, sq_h, sk_n, kh, sv_n, vh, st_b, so_s, so_t, so_h, sl_s, sl_t,
                   T, L, CHUNK, SPLITS, SPR, CAP, scaling,
                   N: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr, OWN: tl.constexpr,
                   KFMT: tl.constexpr, KBODY: tl.constexpr, KTILE: tl.constexpr, KTAIL: tl.constexpr,
                   KPART: tl.constexpr, VFMT: tl.constexpr, VBODY: tl.constexpr, VTILE: tl.constexpr,
                   VTAIL: tl.constexpr, VPART: tl.constexpr, KSEG: tl.constexpr, VSEG: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    split = pid % SPLITS
    g = (pid // SPLITS) % HKV
    i = pid // (SPLITS * HKV)  # the i-th query of this launch
    t = tl.load(qidx_ptr + i).to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    qp = tl.load(pos_ptr + t).to(tl.int64)
    if OWN:  # the row holds the slots this rank owns, packed left; lens counts them
        n = tl.load(lens_ptr + req).to(tl.int64)
    else:
        n = tl.minimum(qp + 1, L)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, n)
    r = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    heads = g * G + r
    q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=(r < G)[:, None] & (d < D)[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for s0 in range(start, end, BLOCK_N):
        offs = s0 + tl.arange(0, BLOCK_N)
        inr = offs < end
        s = tl.load(table_ptr + req * st_b + offs, mask=inr, other=PAD).to(tl.int64)
        ok = usable(s, PAD, CAP) & inr
        if OWN:
            ok = ok & (tl.load(tpos_ptr + req * st_b + offs, mask=inr, other=0) <= qp)
        owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
        k_at = row_offset(koff_ptr, owner, local, SPR, sk_n, KSEG)  # the owner's segment, its local row
        k = load_values(k_ptr, k_at[:, None], g * kh, d[None, :], ok[:, None] & (d < D)[None, :],
                        KFMT, KBODY, KTILE, KTAIL, KPART)
        sc = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scaling
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_at = row_offset(voff_ptr, owner, local, SPR, sv_n, VSEG)
        v = load_values(v_ptr, v_at[:, None], g * vh, dv[None, :], ok[:, None] & (dv < DV)[None, :],
                        VFMT, VBODY, VTILE, VTAIL, VPART)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    rm = r < G  # partials are numbered by query of the launch
    tl.store(lse_ptr + split * sl_s + i * sl_t + heads, lse, mask=rm)
    tl.store(out_ptr + split * so_s + i * so_t + heads[:, None] * so_h + dv[None, :], out, mask=rm[:, None] & (dv < DV)[None, :])


def decode_launch(q, k, kf: ViewFormat, kh: int, v, vf: ViewFormat, vh: int, hkv: int, dv: int, table, tpos, lens,
                  qidx, req, pos, out, lse, layout, scaling: float, splits: int, chunk: int, *,
                  k_off=None, v_off=None) -> Launch:
    """The decode launch of ``qidx [Td]`` (int32: which queries of ``q [T, H,
    D]``) over ``table [B, L]`` rows (``tpos [B, L]`` their positions and
    ``lens [B]`` their lengths under the log-sum-exp split, else ``None``):
    ``splits`` chunks of ``chunk`` keys each, into the partials ``out
    [splits, Td, H, dv]`` and ``lse [splits, Td, H]`` (float32) that
    :func:`merge_launch` merges into the queries' rows (also for one split:
    one compiled kernel for every batch, the merge a pass over ``Td x H x dv``).
    ``k``/``v`` and ``k_off``/``v_off`` (their segment tables, or ``None``)
    as :func:`~.triton_common.kernel_view` gives them, ``kh``/``vh`` the
    stride of one head in a row's flat values."""
    Td = qidx.shape[0]
    H, D = q.shape[1], q.shape[2]
    Hkv, G = hkv, H // hkv
    bn, warps, stages = DECODE_CONFIG[q.dtype]
    own = tpos is not None
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, koff_ptr=k if k_off is None else k_off,
                voff_ptr=v if v_off is None else v_off, table_ptr=table, tpos_ptr=tpos if own else table,
                lens_ptr=lens if own else table, qidx_ptr=qidx, req_ptr=req, pos_ptr=pos, out_ptr=out, lse_ptr=lse,
                sq_t=q.stride(0), sq_h=q.stride(1), sk_n=k.stride(0), kh=kh, sv_n=v.stride(0), vh=vh,
                st_b=table.stride(0), so_s=out.stride(0), so_t=out.stride(1), so_h=out.stride(2),
                sl_s=lse.stride(0), sl_t=lse.stride(1), T=q.shape[0], L=table.shape[1],
                CHUNK=chunk, SPLITS=splits, SPR=layout.slots_per_rank, CAP=layout.capacity, scaling=float(scaling))
    const = dict(N=layout.cp_size, S=layout.slots_per_page, PAD=layout.padding_value, HKV=Hkv, G=G, D=D, DV=dv,
                 BLOCK_G=block(G), BLOCK_N=bn, BLOCK_D=block(D), BLOCK_DV=block(dv), PREC=dot_precision(q.dtype),
                 OWN=own, **kf.read("K", 0, kh, Hkv, D, block(D)), **vf.read("V", 0, vh, Hkv, dv, block(dv)),
                 KSEG=k_off is not None, VSEG=v_off is not None)
    return Launch(_decode_kernel, (Td * Hkv * splits,), args, const, warps, stages, "decode")


@triton.jit(do_not_specialize=["T", "L", "st_b", "CAP", "SPR"])
def _extend_kernel(q_ptr, k_ptr, v_ptr, koff_ptr, voff_ptr, table_ptr, blk_ptr, pos_ptr, out_ptr, lse_ptr,
                   sq_t, sq_h, sk_n, kh, sv_n, vh, st_b, so_t, so_h,
                   T, L, SPR, CAP, scaling,
                   N: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, DV: tl.constexpr, SUBS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PREC: tl.constexpr,
                   KFMT: tl.constexpr, KBODY: tl.constexpr, KTILE: tl.constexpr, KTAIL: tl.constexpr,
                   KPART: tl.constexpr, VFMT: tl.constexpr, VBODY: tl.constexpr, VTILE: tl.constexpr,
                   VTAIL: tl.constexpr, VPART: tl.constexpr, KSEG: tl.constexpr, VSEG: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    g = pid % HKV
    sub = (pid // HKV) % SUBS
    b = pid // (HKV * SUBS)
    req = tl.load(blk_ptr + 3 * b).to(tl.int64)
    q0 = tl.load(blk_ptr + 3 * b + 1).to(tl.int64) + sub * BLOCK_M
    cnt = tl.load(blk_ptr + 3 * b + 2) - sub * BLOCK_M
    rr = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = rr // BLOCK_G
    hh = rr % BLOCK_G
    rv = (tok < cnt) & (hh < G)
    t = q0 + tok
    qp = tl.load(pos_ptr + t, mask=rv, other=-1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    heads = g * G + hh
    q = tl.load(q_ptr + t[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=rv[:, None] & (d < D)[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
    hi = tl.minimum(tl.max(qp, 0) + 1, L)  # keys past the block's last query are seen by none of it
    for s0 in range(0, hi, BLOCK_N):
        offs = s0 + tl.arange(0, BLOCK_N)
        inr = offs < hi
        s = tl.load(table_ptr + req * st_b + offs, mask=inr, other=PAD).to(tl.int64)
        ok = usable(s, PAD, CAP) & inr
        owner, local = owner_and_local(tl.where(ok, s, 0), N, S)
        k_at = row_offset(koff_ptr, owner, local, SPR, sk_n, KSEG)  # the owner's segment, its local row
        k = load_values(k_ptr, k_at[:, None], g * kh, d[None, :], ok[:, None] & (d < D)[None, :],
                        KFMT, KBODY, KTILE, KTAIL, KPART)
        sc = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scaling
        sc = tl.where(ok[None, :] & (offs[None, :] <= qp[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_at = row_offset(voff_ptr, owner, local, SPR, sv_n, VSEG)
        v = load_values(v_ptr, v_at[:, None], g * vh, dv[None, :], ok[:, None] & (dv < DV)[None, :],
                        VFMT, VBODY, VTILE, VTAIL, VPART)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    tl.store(lse_ptr + t * (HKV * G) + heads, lse, mask=rv)
    tl.store(out_ptr + t[:, None] * so_t + heads[:, None] * so_h + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rv[:, None] & (dv < DV)[None, :])


def extend_launch(q, k, kf: ViewFormat, kh: int, v, vf: ViewFormat, vh: int, hkv: int, dv: int, table, blocks,
                  pos, out, lse, layout, scaling: float, *, k_off=None, v_off=None) -> Launch:
    """The extend launch of ``blocks [nb, 3]`` (int32 rows ``(table row,
    first query, queries)``, at most :data:`PLAN_M` queries of one request
    each) over ``table [B, L]``: each program takes ``BLOCK_M`` of a block's
    queries and one KV head's ``G`` query heads, causal per query. Writes
    ``out [T, H, dv]`` and ``lse [T, H]`` at the blocks' queries. The caches
    as in :func:`decode_launch`."""
    H, D = q.shape[1], q.shape[2]
    G = H // hkv
    rows, bn, warps, stages = EXTEND_CONFIG[q.dtype]
    bg = block(G, 1)
    bm = max(1, min(PLAN_M, rows // bg))
    if bm * bg < 16:
        bm = 16 // bg
    subs = -(-PLAN_M // bm)
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, koff_ptr=k if k_off is None else k_off,
                voff_ptr=v if v_off is None else v_off, table_ptr=table, blk_ptr=blocks, pos_ptr=pos, out_ptr=out, lse_ptr=lse,
                sq_t=q.stride(0), sq_h=q.stride(1), sk_n=k.stride(0), kh=kh, sv_n=v.stride(0), vh=vh,
                st_b=table.stride(0), so_t=out.stride(0), so_h=out.stride(1), T=q.shape[0], L=table.shape[1],
                SPR=layout.slots_per_rank, CAP=layout.capacity, scaling=float(scaling))
    const = dict(N=layout.cp_size, S=layout.slots_per_page, PAD=layout.padding_value, HKV=hkv, G=G, D=D, DV=dv,
                 SUBS=subs, BLOCK_M=bm, BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=block(D), BLOCK_DV=block(dv),
                 PREC=dot_precision(q.dtype), **kf.read("K", 0, kh, hkv, D, block(D)),
                 **vf.read("V", 0, vh, hkv, dv, block(dv)), KSEG=k_off is not None, VSEG=v_off is not None)
    return Launch(_extend_kernel, (blocks.shape[0] * subs * hkv,), args, const, warps, stages, "extend")


@triton.jit(do_not_specialize=["R", "M", "so_r", "sl_r"])
def _merge_kernel(out_ptr, lse_ptr, outs_ptr, lses_ptr, idx_ptr, R, M, so_r, so_m, so_o, sl_r,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  IDX: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)  # one (query, head) row of the partials
    d = tl.arange(0, BLOCK_D)
    top = tl.max(tl.full([BLOCK_R], float("-inf"), tl.float32), 0)
    for r0 in range(0, R, BLOCK_R):  # the partials a block at a time: any count, one compiled kernel
        r = r0 + tl.arange(0, BLOCK_R)
        top = tl.maximum(top, tl.max(tl.load(lses_ptr + r * sl_r + m, mask=r < R, other=float("-inf")), 0))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    den = tl.sum(tl.zeros([BLOCK_R], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        lr = tl.load(lses_ptr + r * sl_r + m, mask=r < R, other=float("-inf"))
        w = tl.where(lr == float("-inf"), 0.0, tl.exp(lr - top_safe))
        x = tl.load(outs_ptr + r[:, None].to(tl.int64) * so_r + m * so_m + d[None, :],
                    mask=(r < R)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        den += tl.sum(w, 0)
        acc += tl.sum(w[:, None] * x, 0)
    seen = den > 0
    o = acc / tl.where(seen, den, 1.0)
    if IDX:  # partials numbered by query of a launch: the output row is that query's
        dst = tl.load(idx_ptr + m // H).to(tl.int64) * H + m % H
    else:
        dst = m
    tl.store(out_ptr + dst * so_o + d, o.to(out_ptr.dtype.element_ty), mask=d < D)
    tl.store(lse_ptr + dst, tl.where(seen, top_safe + tl.log(tl.where(seen, den, 1.0)), float("-inf")))


#: partials a merge program reads at a time
MERGE_BLOCK_R = 8


def merge_launch(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 idx: torch.Tensor | None = None) -> Launch:
    """Merge ``outs [R, M', H, D]``/``lses [R, M', H]`` (float32 log-sum-exps)
    into ``out [T, H, D]``/``lse [T, H]`` (contiguous): row ``m`` of the
    partials goes to row ``m``, or to row ``idx[m]`` when given (int32 [M'])."""
    R, Mq, H, D = outs.shape
    o = outs.reshape(R, Mq * H, D)
    ls = lses.reshape(R, Mq * H)
    args = dict(out_ptr=out, lse_ptr=lse, outs_ptr=o, lses_ptr=ls, idx_ptr=idx if idx is not None else ls,
                R=R, M=Mq * H, so_r=o.stride(0), so_m=o.stride(1), so_o=D, sl_r=ls.stride(0))
    const = dict(H=H, D=D, BLOCK_R=MERGE_BLOCK_R, BLOCK_D=block(D, 1), IDX=idx is not None)
    return Launch(_merge_kernel, (Mq * H,), args, const, 4 if D >= 256 else 2, 1, "merge")
