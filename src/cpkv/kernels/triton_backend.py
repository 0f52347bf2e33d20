"""The Triton backend: the :class:`~cpkv.kernels.backend.Backend` over the
kernels of :mod:`.triton_attention`, :mod:`.triton_dsa` and :mod:`.triton_store`.

Its plan (once per batch, on the host) sorts the queries: a query that is
the only one of its request in the batch decodes (split-KV: as many context
chunks as fill the GPU, :func:`~.triton_common.split_chunks`), the others
extend in blocks of up to :data:`~.triton_attention.PLAN_M` queries of one
request; under the log-sum-exp split each request's row becomes the slots
the rank owns, packed left, with their positions, so a rank walks only its
own slots. Every run method launches kernels only: no host synchronisation,
no host-to-device copy (sizes come from the plan and from shapes). A cache
whose group memory is N segments is read through its segment table
(:func:`~.triton_common.kernel_view`): the same kernels, one constexpr apart.

Under Triton's interpreter (``TRITON_INTERPRET=1``) launches are serialised
across threads: the interpreter patches module state while a kernel runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..contract.layout import SharedKVLayout
from .backend import Backend, CacheView, QueryPlan, WriteIndex, owned_positions, plan_fields
from .triton_attention import DECODE_CONFIG, PLAN_M, decode_launch, extend_launch, merge_launch
from .triton_common import PROGRAMS_PER_SM, Launch, block, interpreting, kernel_view, launchable, sm_count, \
    split_chunks, unreadable
from .triton_dsa import INDEX_CONFIG, MLA_CONFIG, index_launch, sparse_mla_launch
from .triton_store import store_launch

_INTERPRETER_LOCK = threading.Lock()


def run(launch: Launch) -> None:
    """Launch; one at a time across threads under the interpreter (compiled
    kernels need no lock)."""
    if interpreting():
        with _INTERPRETER_LOCK:
            launch.run()
    else:
        launch.run()


@dataclass(frozen=True)
class TritonPlan(QueryPlan):
    """The Triton backend's plan: :class:`QueryPlan` and

    * ``qidx [Td]`` (int32): the queries the decode kernel takes, ``blocks
      [nb, 3]`` (int32 ``(row, first query, count)``): the extend blocks;
    * ``ctx``, ``ctx_pos``, ``ctx_len``: the rows the kernels walk: ``table``
      itself (positions = columns, no ``ctx_pos``/``ctx_len``), or under
      ``own_rank`` the owned slots packed left ``[B, W]``, their positions
      and counts ``[B]``;
    * ``reach``: the longest context a decode walks (host int); ``programs``:
      the programs a launch should reach (:data:`~.triton_common.PROGRAMS_PER_SM` per SM of the device)."""

    qidx: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    ctx: torch.Tensor | None = None
    ctx_pos: torch.Tensor | None = None
    ctx_len: torch.Tensor | None = None
    reach: int = 0
    programs: int = 0


def query_runs(q_req: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Sort queries by runs of one request (consecutive equal ``q_req``): the
    queries alone in their run (``qidx``, decodes) and blocks ``[nb, 3]`` of
    ``(request, first query, count <= block_m)`` covering the longer runs in
    order (a run's end always ends a block). Vectorised (numpy)."""
    T = q_req.size
    if T == 0:
        return np.zeros(0, np.int32), np.zeros((0, 3), np.int32)
    start = np.flatnonzero(np.r_[True, q_req[1:] != q_req[:-1]])
    length = np.diff(np.r_[start, T])
    single = length == 1
    qidx = start[single]
    s, n = start[~single], length[~single]
    per = -(-n // block_m)  # blocks of each longer run
    run = np.repeat(np.arange(s.size), per)
    k = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)  # block index inside its run
    first = s[run] + k * block_m
    count = np.minimum(block_m, n[run] - k * block_m)
    blocks = np.stack([q_req[first], first, count], 1) if first.size else np.zeros((0, 3), np.int64)
    return qidx.astype(np.int32), blocks.astype(np.int32)


def chunks(work: int, length: int, tile: int, programs: int, splits: int | None = None) -> tuple[int, int]:
    """``(splits, chunk)`` of a launch: :func:`~.triton_common.split_chunks`,
    or ``splits`` as given (a test's choice) with the chunk that covers
    ``length`` in that many (a split past the context's end is empty)."""
    if splits is None:
        return split_chunks(work, length, tile, programs)
    return splits, -(-max(1, -(-length // splits)) // tile) * tile


def _head_view(view: CacheView):
    """``(tensor, format, segment table or None, kv heads, head dim, head stride)``
    of a cache view as a kernel reads it."""
    t, f, off = kernel_view(view.data, view.fmt)
    hkv, D = (view.shape if len(view.shape) == 2 else (1, view.shape[0]))
    head = t.stride(1) if f.FMT == 0 and t.dim() == 3 else D
    return t, f, off, hkv, D, head


def _operand(q: torch.Tensor, *views) -> torch.Tensor:
    """The query in the dtype the kernels compute in: a float view's dtype (q
    cast to it), or q's own over byte formats."""
    for t, f in views:
        if f.FMT == 0 and t.dtype != q.dtype:
            return q.to(t.dtype)
    return q


class TritonBackend(Backend):
    """See the module docstring."""

    name = "triton"

    def unreadable(self, fmt):
        """See :meth:`Backend.unreadable`: :func:`~.triton_common.unreadable`."""
        return unreadable(fmt)

    def plan(self, table, q_req, q_pos, layout: SharedKVLayout, *, own_rank=None, with_lse=True) -> TritonPlan:
        """See :meth:`Backend.plan`."""
        f = plan_fields(table, q_req, q_pos, layout, own_rank, with_lse)
        dev = table.device
        programs = PROGRAMS_PER_SM * sm_count(dev)
        if f["own_rank"] >= 0:
            pos, slots = owned_positions(table, layout, f["own_rank"])
            T = q_req.numel()
            return TritonPlan(**f, qidx=torch.arange(T, dtype=torch.int32, device=dev),
                              blocks=torch.zeros((0, 3), dtype=torch.int32, device=dev), ctx=slots.contiguous(),
                              ctx_pos=pos.to(torch.int32).contiguous(),
                              ctx_len=(pos >= 0).sum(1).to(torch.int32), reach=pos.shape[1], programs=programs)
        req, pos = q_req.cpu().numpy(), q_pos.cpu().numpy()
        qidx, blocks = query_runs(req, PLAN_M)
        reach = int(pos[qidx].max()) + 1 if qidx.size else 0
        return TritonPlan(**f, qidx=torch.from_numpy(qidx).to(dev), blocks=torch.from_numpy(blocks).to(dev),
                          ctx=table.contiguous(), reach=max(0, min(reach, table.shape[1])), programs=programs)

    def store(self, segment: CacheView, values, write: WriteIndex, layout, rank, report) -> None:
        """See :meth:`Backend.store`: one launch, slots translated in the kernel."""
        buf, bf, _ = kernel_view(segment.data, segment.fmt)  # this rank's own segment: one tensor
        W = write.slots.numel()
        width = int(np.prod(segment.shape))
        vals = values.reshape(W, width)
        if bf.FMT == 0 and vals.dtype != buf.dtype and interpreting():
            vals = vals.to(buf.dtype)  # cast on the host side: the interpreter has no bfloat16
        launchable(buf, vals, write.slots)
        run(store_launch(buf, bf, vals.contiguous(), write.slots.contiguous(), report, layout, rank, width))

    def dense(self, plan: TritonPlan, q, k, v, scaling, value_dims=None, *, splits=None):
        """See :meth:`Backend.dense`: the decode kernel (split-KV, merged) on
        the plan's ``qidx``, the extend kernel on its blocks."""
        kt, kf, ko, hkv, D, kh = _head_view(k)
        vt, vf, vo, _, Dv, vh = _head_view(v)
        dv = Dv if value_dims is None else value_dims
        qc = _operand(q, (kt, kf), (vt, vf)).contiguous()
        launchable(qc, kt, vt)
        T, H = q.shape[:2]
        out = torch.empty((T, H, dv), dtype=qc.dtype, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        Td = plan.qidx.shape[0]
        if Td:
            bn = DECODE_CONFIG[qc.dtype][0]
            n, chunk = chunks(Td * hkv, plan.reach, bn, plan.programs, splits)
            o = torch.empty((n, Td, H, dv), dtype=torch.float32, device=q.device)
            s = torch.empty((n, Td, H), dtype=torch.float32, device=q.device)
            run(decode_launch(qc, kt, kf, kh, vt, vf, vh, hkv, dv, plan.ctx, plan.ctx_pos, plan.ctx_len, plan.qidx,
                              plan.q_req, plan.q_pos, o, s, plan.layout, scaling, n, chunk, k_off=ko, v_off=vo))
            run(merge_launch(o, s, out, lse, plan.qidx))
        if plan.blocks.shape[0]:
            run(extend_launch(qc, kt, kf, kh, vt, vf, vh, hkv, dv, plan.ctx, plan.blocks, plan.q_pos, out, lse,
                              plan.layout, scaling, k_off=ko, v_off=vo))
        return out.to(q.dtype), lse

    def selected(self, plan, q, kv, slots, scaling, value_dims, *, splits=None):
        """See :meth:`Backend.selected`: the sparse MLA kernel, its selection
        split into chunks when the queries alone do not fill the GPU."""
        lt, lf, lo = kernel_view(kv.data, kv.fmt)
        qc = _operand(q, (lt, lf)).contiguous()
        slots = slots.contiguous()
        launchable(qc, lt, slots)
        T, H = q.shape[:2]
        out = torch.empty((T, H, value_dims), dtype=qc.dtype, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T == 0:
            return out.to(q.dtype), lse
        bh, bk = MLA_CONFIG[qc.dtype][:2]
        hb = -(-H // min(bh, block(H)))
        K = slots.shape[1]
        n, chunk = chunks(T * hb, K, bk, plan.programs, splits)
        o, s = (out, lse) if n == 1 else (torch.empty((n, T, H, value_dims), dtype=torch.float32, device=q.device),
                                          torch.empty((n, T, H), dtype=torch.float32, device=q.device))
        run(sparse_mla_launch(qc, lt, lf, slots, o, s, plan.layout, scaling, value_dims, plan.own_rank, n, chunk,
                              lat_off=lo))
        if n > 1:
            run(merge_launch(o, s, out, lse))
        return out.to(q.dtype), lse

    def index_scores(self, plan, q, weights, keys, scale, *, splits=None):
        """See :meth:`Backend.index_scores`: each query's block loaded once, its
        context in as many chunks as fill the GPU."""
        kt, kf, ko = kernel_view(keys.data, keys.fmt)
        qc = _operand(q, (kt, kf)).contiguous()
        launchable(qc, weights, kt)
        T = q.shape[0]
        L = plan.table.shape[1]
        out = torch.full((T, L), float("-inf"), dtype=torch.float32, device=q.device)
        if T == 0 or L == 0:
            return out
        reach = plan.context.read.shape[1]
        bl = INDEX_CONFIG[qc.dtype][0]
        n, chunk = chunks(T, reach, bl, plan.programs, splits)
        run(index_launch(qc, weights.contiguous(), kt, kf, plan.table.contiguous(), plan.q_req, plan.q_pos, out,
                         plan.layout, scale, n, chunk, k_off=ko))
        return out

    def merge(self, outs, lses):
        """See :meth:`Backend.merge`: the merge kernel."""
        launchable(outs, lses)
        R, T, H, D = outs.shape
        out = torch.empty((T, H, D), dtype=outs.dtype, device=outs.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=outs.device)
        if R == 0:
            return out.zero_(), lse.fill_(float("-inf"))
        if T * H:
            run(merge_launch(outs.contiguous(), lses.float().contiguous(), out, lse))
        return out, lse


__all__ = ["TritonBackend", "TritonPlan", "chunks", "query_runs", "run"]
