"""The Triton attention's schedule against the torch backend, under the
interpreter: split-KV decode for every split count (batch 1 with a long
context, ragged contexts), the log-sum-exp split reading only the slots a rank
owns, the tiled prefill (prefixes ending mid-page, GQA groups 1, 4, 8, query
blocks at requests' ends), sparse MLA and the indexer split over their
context. [[RFC-0001:C-READ-PATH]] [[RFC-0001:C-PADDING]]"""

import pytest
import torch
from conftest import TOL

import cpkv.kernels as K
from cpkv.kernels import triton_backend
from cpkv.kernels.triton_attention import DECODE_CONFIG, PLAN_M
from support.kernel_cases import tables

D, DV = 16, 8


def _close(got, want, dtype=torch.float32):
    torch.testing.assert_close(got, want, **TOL[dtype])


def _attn(layout, table, q_req, q_pos, hkv=2, g=2, dtype=torch.float32, seed=0, backend_only=False, **kw):
    """Triton's and the torch backend's attention of seeded queries and caches
    (Triton's only with ``backend_only``)."""
    gen = torch.Generator().manual_seed(seed)
    rows = layout.cp_size * layout.slots_per_rank
    q = torch.randn(q_req.numel(), hkv * g, D, generator=gen).to(dtype)
    k, v = torch.randn(rows, hkv, D, generator=gen).to(dtype), torch.randn(rows, hkv, DV, generator=gen).to(dtype)
    args = (q, k, v, table, q_req, q_pos, layout, D**-0.5)
    got = K.paged_attention(*args, backend="triton", **kw)
    return got if backend_only else (got, K.paged_attention(*args, backend="torch", **kw))


def test_batch_one_long_context_every_split_count():
    """One query over a context of 7 key tiles: every split count from 1 to
    one past the tiles (the last split empty) gives the torch backend's answer."""
    L = 7 * DECODE_CONFIG[torch.float32][0] - 3
    layout, table, _ = tables([L], 4, 16, seed=1)
    q_req, q_pos = torch.tensor([0]), torch.tensor([L - 1])
    ref = _attn(layout, table, q_req, q_pos, hkv=1)[1]
    for n in range(1, 9):
        got = _attn(layout, table, q_req, q_pos, hkv=1, splits=n, backend_only=True)
        _close(got[0], ref[0])
        _close(got[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_contexts_split(dtype):
    """Decodes of 1, 37, 150 and 0 keys (a request of length 0 sees nothing)
    and one whose context is all padding, split 1, 3 and 7 ways."""
    layout, table, _ = tables([1, 37, 90, 5], 2, 16, seed=2)
    table[3] = -1
    q_req, q_pos = torch.tensor([0, 1, 2, 3, 3]), torch.tensor([0, 36, 89, -1, 4])
    for n in (1, 3):
        got, ref = _attn(layout, table, q_req, q_pos, dtype=dtype, splits=n)
        _close(got[0], ref[0], dtype)
        _close(got[1], ref[1], torch.float32 if dtype == torch.float32 else dtype)
        assert torch.isinf(got[1][3:]).all() and not got[0][3:].any()


def test_default_split_fills_the_gpu(monkeypatch):
    """On a GPU of 3 SMs, a decode launches at least PROGRAMS_PER_SM programs per SM where the context has
    that many key tiles (a batch of 1: one split per tile of its 7; 2 queries x 3 heads: split so
    that they make at least 24); 2 queries x 8 heads, as many as 2 SMs take, do not split."""
    from cpkv.kernels.triton_common import PROGRAMS_PER_SM

    grids = []
    run = triton_backend.run
    monkeypatch.setattr(triton_backend, "run", lambda lc: grids.append((lc.name, lc.grid[0])) or run(lc))
    monkeypatch.setattr(triton_backend, "sm_count", lambda dev: 3)  # a small GPU: the interpreter is slow
    layout, table, _ = tables([100, 100], 1, 16, seed=3)
    _attn(layout, table, torch.tensor([0]), torch.tensor([99]), hkv=1, g=1, backend_only=True)
    _attn(layout, table, torch.tensor([0, 1]), torch.tensor([99, 99]), hkv=3, g=1, backend_only=True)
    monkeypatch.setattr(triton_backend, "sm_count", lambda dev: 16 // PROGRAMS_PER_SM)  # 2 x 8 heads fill it
    _attn(layout, table, torch.tensor([0, 1]), torch.tensor([99, 99]), hkv=8, g=1, backend_only=True)
    assert [n for n, _ in grids] == ["decode", "merge"] * 3
    assert grids[0][1] == 7 and grids[2][1] >= PROGRAMS_PER_SM * 3 and grids[4][1] == 16


@pytest.mark.parametrize("cp", [2, 4])
def test_lse_split_reads_only_owned_slots(cp):
    """Under only_rank every slot another rank owns holds NaN: the triton
    partials stay finite and equal the torch backend's; merged over the
    ranks they are the whole attention."""
    layout, table, _ = tables([90, 20], cp, 4, seed=4)
    q_req, q_pos = torch.tensor([0, 1]), torch.tensor([89, 19])
    gen = torch.Generator().manual_seed(5)
    rows = layout.cp_size * layout.slots_per_rank
    q = torch.randn(2, 4, D, generator=gen)
    k, v = torch.randn(rows, 2, D, generator=gen), torch.randn(rows, 2, DV, generator=gen)
    parts = []
    for r in range(cp):
        mine = torch.zeros(rows, dtype=torch.bool)
        mine[r * layout.slots_per_rank : (r + 1) * layout.slots_per_rank] = True
        mine[: layout.slots_per_page] = True  # page 0, padding's: the torch backend reads it masked
        kn, vn = k.masked_fill(~mine[:, None, None], float("nan")), v.masked_fill(~mine[:, None, None], float("nan"))
        args = (q, kn, vn, table, q_req, q_pos, layout, 0.25)
        got = K.paged_attention(*args, only_rank=r, backend="triton")
        ref = K.paged_attention(*args, only_rank=r, backend="torch")
        assert torch.isfinite(got[0]).all()
        _close(got[0], ref[0])
        _close(got[1], ref[1])
        parts.append(got)
    merged = K.merge_lse(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]), backend="triton")
    whole = K.paged_attention(q, k, v, table, q_req, q_pos, layout, 0.25, backend="torch")
    _close(merged[0], whole[0])
    _close(merged[1], whole[1])


def test_lse_split_plan_walks_only_owned_positions_and_a_rank_without_any_is_empty():
    """The plan's rows are the owned slots packed left (as wide as the most a
    rank owns of one request); a rank that owns no slot of the batch gets
    out 0 and lse -inf, with no key walked."""
    layout, table, _ = tables([12], 4, 4, seed=6)  # 3 pages: one rank owns none of them
    owners = layout.owner_of_slots(table[0])
    idle = next(r for r in range(4) if not (owners == r).any())
    b = K.get("triton")
    for r in range(4):
        plan = b.plan(table, torch.tensor([0]), torch.tensor([11]), layout, own_rank=r)
        assert plan.ctx.shape[1] == int((owners == r).sum())
        assert plan.ctx_len.tolist() == [int((owners == r).sum())]
    gen = torch.Generator().manual_seed(7)
    rows = layout.cp_size * layout.slots_per_rank
    q, k, v = torch.randn(1, 2, D, generator=gen), torch.randn(rows, 1, D, generator=gen), torch.randn(rows, 1, DV)
    out, lse = K.paged_attention(q, k, v, table, torch.tensor([0]), torch.tensor([11]), layout, 1.0, only_rank=idle,
                                 backend="triton")
    assert not out.any() and torch.isinf(lse).all()


@pytest.mark.parametrize("g,n", [(1, 70), (4, 20), (8, 20)])
def test_tiled_prefill_after_mid_page_prefixes(g, n):
    """Chunks of n and 5 queries after prefixes of 13 and 7 tokens (both
    mid-page at page 4), and a one-query request between them: blocks of
    PLAN_M queries end at each request's end (70 need two), the single query
    decodes; GQA group g."""
    layout, table, _ = tables([13 + n, 9, 7 + 5], 3, 4, seed=10 + g)
    q_req = torch.tensor([0] * n + [1] + [2] * 5)
    q_pos = torch.cat([torch.arange(13, 13 + n), torch.tensor([8]), torch.arange(7, 12)])
    plan = K.get("triton").plan(table, q_req, q_pos, layout)
    assert plan.qidx.tolist() == [n]
    first = [[0, 0, PLAN_M], [0, PLAN_M, n - PLAN_M]] if n > PLAN_M else [[0, 0, n]]
    assert plan.blocks.tolist() == first + [[2, n + 1, 5]]
    got, ref = _attn(layout, table, q_req, q_pos, hkv=2, g=g, seed=g)
    _close(got[0], ref[0])
    _close(got[1], ref[1])


def test_prefill_with_queries_of_a_request_out_of_order():
    """A token split's share of a request (positions not contiguous, as
    zigzag deals them) runs as one block, causal per query."""
    layout, table, _ = tables([40], 2, 16, seed=20)
    q_pos = torch.tensor([0, 1, 2, 3, 36, 37, 38, 39])
    got, ref = _attn(layout, table, torch.zeros(8, dtype=torch.int64), q_pos, dtype=torch.float16)
    _close(got[0], ref[0], torch.float16)


def test_sparse_mla_and_indexer_every_split_count():
    """Sparse MLA over 40 selected slots and the indexer over a 70-key context,
    split 1 to 4 ways (past their tiles: empty splits), equal the torch backend."""
    layout, table, gen = tables([70], 2, 16, seed=30)  # 70 keys: 3 tiles of the indexer at float32
    rows = layout.cp_size * layout.slots_per_rank
    q, lat = torch.randn(1, 4, 40, generator=gen), torch.randn(rows, 40, generator=gen)
    sel = table[:, torch.randperm(70, generator=gen)[:40]]
    qi, w, keys = torch.randn(1, 16, 32, generator=gen), torch.randn(1, 16, generator=gen), torch.randn(rows, 32)
    ref = K.sparse_mla_attention(q, lat, sel, layout, 0.2, 32, backend="torch")
    ref_i = K.index_scores(qi, w, keys, table, torch.tensor([0]), torch.tensor([69]), layout, 0.3, backend="torch")
    for n in range(1, 5):
        got = K.sparse_mla_attention(q, lat, sel, layout, 0.2, 32, splits=n, backend="triton")
        _close(got[0], ref[0])
        _close(got[1], ref[1])
        got_i = K.index_scores(qi, w, keys, table, torch.tensor([0]), torch.tensor([69]), layout, 0.3, splits=n,
                               backend="triton")
        _close(got_i, ref_i)


def test_merge_of_more_partials_than_one_block_holds():
    """The merge kernel reads the partials a block at a time: 11 partials
    (with empty ones) merge as the torch backend merges them."""
    from cpkv.kernels.triton_attention import MERGE_BLOCK_R

    g = torch.Generator().manual_seed(50)
    R = MERGE_BLOCK_R + 3
    outs, lses = torch.randn(R, 2, 3, 8, generator=g), torch.randn(R, 2, 3, generator=g) * 3
    lses[[0, 5, R - 1]] = float("-inf")
    outs[lses == float("-inf")] = 0
    got, want = K.merge_lse(outs, lses, backend="triton"), K.merge_lse(outs, lses, backend="torch")
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_torch_plan_without_lse_falls_back_to_the_masked_path_on_holes():
    """The torch backend's grouped path assumes no padding before a query's
    position; a table with a hole there is planned on the masked path (exact)."""
    layout, table, _ = tables([20], 2, 4, seed=51)
    b = K.get("torch")
    q_req, q_pos = torch.zeros(3, dtype=torch.int64), torch.tensor([10, 11, 19])
    assert b.plan(table, q_req, q_pos, layout, with_lse=False).groups is not None
    table[0, 5] = -1
    plan = b.plan(table, q_req, q_pos, layout, with_lse=False)
    assert plan.groups is None and plan.with_lse
