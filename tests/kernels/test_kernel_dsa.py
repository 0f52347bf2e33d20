"""DSA kernels: the lightning indexer's scores and absorbed sparse MLA over
selected logical slots; Triton equals the torch reference, the reference
equals cpkv's model path (:mod:`cpkv.models.attention`).
[[RFC-0001:C-INDEXER-POOL]] [[RFC-0001:C-MLA-LATENT-POOL]]"""

import pytest
import torch
from conftest import DTYPES, GEOMETRIES

import cpkv.kernels as K
from cpkv.kernels.reference import attend
from cpkv.models.attention import index_scores, topk_positions

HI, DI, H, R, DR = 16, 32, 4, 32, 8  # indexer heads and dim; MLA heads, kv_lora_rank, rope dim
TOPK = 6


def _selection(b, k=TOPK):
    """Each query's selected logical slots ``[T, k]``: random visible positions of its request,
    -1 where it has fewer (and for the queries that see nothing)."""
    T = b.q_req.numel()
    L = b.table.shape[1]
    score = torch.rand(T, L, generator=b.gen)
    visible = torch.arange(L)[None] <= b.q_pos[:, None]
    pos = topk_positions(score, visible, k)
    return torch.where(pos >= 0, b.table[b.q_req[:, None], pos.clamp(min=0)], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp_size,page_size", GEOMETRIES)
def test_index_scores_triton_equals_torch(batch_of, close, cp_size, page_size, dtype):
    b = batch_of(cp_size, page_size, seed=cp_size * 10 + page_size)
    T = b.q_req.numel()
    q, w, keys = b.randn(T, HI, DI, dtype=dtype), b.randn(T, HI), b.randn(b.rows, DI, dtype=dtype)
    want = K.index_scores(q, w, keys, b.table, b.q_req, b.q_pos, b.layout, DI**-0.5, backend="torch")
    got = K.index_scores(q, w, keys, b.table, b.q_req, b.q_pos, b.layout, DI**-0.5, backend="triton")
    assert got.dtype == torch.float32 and got.shape == (T, b.table.shape[1])
    close(got, want, dtype)
    assert torch.isinf(got[-2:]).all()  # nothing visible: every score -inf


def test_index_scores_reference_equals_model(batch_of, close):
    """Visible entries are models.attention.index_scores over the gathered keys; the rest are -inf."""
    b = batch_of(3, 16, seed=5)
    T = b.q_req.numel()
    q, w, keys = b.randn(T, HI, DI), b.randn(T, HI), b.randn(b.rows, DI)
    got = K.index_scores(q, w, keys, b.table, b.q_req, b.q_pos, b.layout, 0.25, backend="torch")
    ctx = b.table[b.q_req]
    seen = (ctx >= 0) & (torch.arange(ctx.shape[1])[None] <= b.q_pos[:, None])
    want = index_scores(q, w, keys[b.layout.translate_read_slots(ctx).clamp(min=0)], 0.25)
    close(got[seen], want[seen], torch.float32)
    assert torch.isinf(got[~seen]).all() and seen.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp_size,page_size", GEOMETRIES)
def test_sparse_mla_triton_equals_torch(batch_of, close, cp_size, page_size, dtype):
    b = batch_of(cp_size, page_size, seed=cp_size * 7 + page_size)
    sel = _selection(b)
    q, lat = b.randn(sel.shape[0], H, R + DR, dtype=dtype), b.randn(b.rows, R + DR, dtype=dtype)
    want = K.sparse_mla_attention(q, lat, sel, b.layout, 0.2, R, backend="torch")
    got = K.sparse_mla_attention(q, lat, sel.to(torch.int32), b.layout, 0.2, R, backend="triton")
    assert got[0].shape == (sel.shape[0], H, R) and got[0].dtype == dtype and got[1].dtype == torch.float32
    close(got[0], want[0], dtype)
    close(got[1], want[1], dtype)
    assert torch.isinf(got[1][-2:]).all() and not got[0][-2:].any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_mla_rank_partials_merge_to_full(batch_of, close, backend):
    b = batch_of(4, 1, seed=9)
    sel = _selection(b, k=12)
    q, lat = b.randn(sel.shape[0], H, R + DR), b.randn(b.rows, R + DR)
    full = K.sparse_mla_attention(q, lat, sel, b.layout, 0.2, R, backend=backend)
    parts = [K.sparse_mla_attention(q, lat, sel, b.layout, 0.2, R, only_rank=r, backend=backend) for r in range(4)]
    merged = K.merge_lse(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]), backend=backend)
    close(merged[0], full[0], torch.float32)
    close(merged[1], full[1], torch.float32)


def test_sparse_mla_reference_equals_model_attend(batch_of, close):
    """The reference is models.attention.attend with keys the latent row and values its first r
    entries (how DsaAdapter calls attend_selected)."""
    b = batch_of(2, 16, seed=6)
    sel = _selection(b)
    q, lat = b.randn(sel.shape[0], H, R + DR), b.randn(b.rows, R + DR)
    out, lse = K.sparse_mla_attention(q, lat, sel, b.layout, 0.2, R, backend="torch")
    k = lat[b.layout.translate_read_slots(sel).clamp(min=0)].unsqueeze(2)
    want_out, want_lse = attend(q, k, k[..., :R], sel >= 0, 0.2)
    close(out, want_out, torch.float32)
    close(lse, want_lse, torch.float32)
