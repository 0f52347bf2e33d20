"""Paged GQA attention and the log-sum-exp merge: the Triton kernels equal the
torch references, and the references equal cpkv's model path
(:mod:`cpkv.models.attention`). [[RFC-0001:C-READ-PATH]] [[RFC-0001:C-PADDING]]"""

import pytest
import torch
from conftest import DTYPES, GEOMETRIES

import cpkv.kernels as K
from cpkv.kernels.reference import attend, gathered_attention, merge_partials

H, HKV, D, DV = 4, 2, 8, 16
SCALE = D**-0.5


def _views(b, dtype, hkv=HKV):
    return b.randn(b.rows, hkv, D, dtype=dtype), b.randn(b.rows, hkv, DV, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp_size,page_size", GEOMETRIES)
def test_triton_equals_torch(batch_of, close, cp_size, page_size, dtype):
    b = batch_of(cp_size, page_size, seed=cp_size * 100 + page_size)
    q = b.randn(b.q_req.numel(), H, D, dtype=dtype)
    k, v = _views(b, dtype)
    want = K.paged_attention(q, k, v, b.table, b.q_req, b.q_pos, b.layout, SCALE, backend="torch")
    got = K.paged_attention(q, k, v, b.table.to(torch.int32), b.q_req, b.q_pos, b.layout, SCALE, backend="triton")
    close(got[0], want[0], dtype)
    close(got[1], want[1], torch.float32 if dtype == torch.float32 else dtype)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    # the query of length 0 and the one whose visible slots are all padding see nothing
    assert torch.isinf(got[1][-2:]).all() and not got[0][-2:].any()
    assert torch.isfinite(got[1][:-2]).all()


@pytest.mark.parametrize("cp_size,page_size", [(3, 1), (4, 16)])
def test_rank_partials_merge_to_full(batch_of, close, cp_size, page_size):
    """The decode split on the torch backend: attention over each rank's own
    slots, merged, equals attention over all (the triton backend's:
    test_kernel_split.test_lse_split_reads_only_owned_slots)."""
    backend = "torch"
    b = batch_of(cp_size, page_size, seed=7)
    q = b.randn(b.q_req.numel(), H, D)
    k, v = _views(b, torch.float32)
    full = K.paged_attention(q, k, v, b.table, b.q_req, b.q_pos, b.layout, SCALE, backend=backend)
    parts = [K.paged_attention(q, k, v, b.table, b.q_req, b.q_pos, b.layout, SCALE, only_rank=r, backend=backend)
             for r in range(cp_size)]
    merged = K.merge_lse(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]), backend=backend)
    close(merged[0], full[0], torch.float32)
    close(merged[1], full[1], torch.float32)


@pytest.mark.parametrize("gqa", [1, 4])
def test_reference_equals_gathered_attention(batch_of, close, gqa):
    """On a table without holes, the reference is reference.gathered_attention over each
    request's context gathered through the rank-major view."""
    b = batch_of(4, 16, seed=3, holes=False)
    T = b.q_req.numel()
    q = b.randn(T, 2 * gqa, D)
    k, v = b.randn(b.rows, 2, D), b.randn(b.rows, 2, D)
    out, _ = K.paged_attention(q, k, v, b.table, b.q_req, b.q_pos, b.layout, SCALE, backend="torch")
    rows = b.layout.translate_read_slots(b.table).clamp(min=0)
    live = torch.arange(T) < T - 2  # the model path has no query that sees nothing
    want = gathered_attention(q[live], b.q_req[live], b.q_pos[live], k[rows], v[rows], SCALE)
    close(out[live], want, torch.float32)


def test_reference_equals_model_attend(batch_of, close):
    """With padding inside contexts and queries that see nothing, the reference's out and lse are
    reference.attend's over each query's keys and visibility mask."""
    b = batch_of(3, 16, seed=4)
    q = b.randn(b.q_req.numel(), H, D)
    k, v = _views(b, torch.float32)
    out, lse = K.paged_attention(q, k, v, b.table, b.q_req, b.q_pos, b.layout, SCALE, backend="torch")
    ctx = b.table[b.q_req]
    seen = (ctx >= 0) & (torch.arange(ctx.shape[1])[None] <= b.q_pos[:, None])
    rows = b.layout.translate_read_slots(ctx).clamp(min=0)
    want_out, want_lse = attend(q, k[rows], v[rows], seen, SCALE)
    close(out, want_out, torch.float32)
    close(lse, want_lse, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_triton_equals_torch_and_model(close, dtype):
    g = torch.Generator().manual_seed(11)
    outs = torch.randn(3, 5, 4, 24, generator=g).to(dtype)
    lses = torch.randn(3, 5, 4, generator=g) * 4
    lses[0, 1] = float("-inf")  # one partial saw nothing
    lses[:, 2] = float("-inf")  # no partial saw anything
    outs[lses == float("-inf")] = 0
    want = K.merge_lse(outs, lses, backend="torch")
    got = K.merge_lse(outs, lses, backend="triton")
    close(got[0], want[0], dtype)
    close(got[1], want[1], torch.float32)
    close(want[0], merge_partials(outs, lses), dtype)
    assert torch.isinf(got[1][2]).all() and not got[0][2].any()
