"""Attention kernels over the paged cache: the per-query gathered form and the
exact log-sum-exp merge that the decode split relies on."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.kernels.reference import attend, merge_partials, query_groups
from cpkv.kernels.reference import gathered_attention as paged_attention


def dense(q, k, v, mask, scaling):
    """Plain softmax attention of each query over its visible keys."""
    H, Hkv = q.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    s = torch.einsum("thd,tkhd->thk", q, kk) * scaling
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("thk,tkhd->thd", torch.softmax(s, -1), vv)


@given(st.integers(1, 5), st.integers(1, 12), st.sampled_from([(4, 2), (2, 2), (4, 1)]), st.integers(1, 4),
       st.integers(0, 2**16))
def test_partials_over_any_partition_merge_to_the_whole(T, K, heads, R, seed):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    q, k, v = torch.randn(T, H, 8, generator=g), torch.randn(T, K, Hkv, 8, generator=g), torch.randn(T, K, Hkv, 6, generator=g)
    mask = torch.rand(T, K, generator=g) < 0.7
    mask[:, 0] = True  # every query sees a key
    part = torch.randint(0, R, (T, K), generator=g)  # which part each key falls in
    outs, lses = zip(*(attend(q, k, v, mask & (part == r), 0.3) for r in range(R)))
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.allclose(merged, dense(q, k, v, mask, 0.3), atol=1e-5)
    whole, _ = attend(q, k, v, mask, 0.3)
    assert torch.allclose(whole, merged, atol=1e-5)


def test_a_part_with_no_visible_key_drops_out():
    q, k, v = torch.randn(2, 2, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    none = torch.zeros(2, 3, dtype=torch.bool)
    out, lse = attend(q, k, v, none, 1.0)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    full, lse_full = attend(q, k, v, ~none, 1.0)
    assert torch.allclose(merge_partials(torch.stack([out, full]), torch.stack([lse, lse_full])), full)


def test_paged_attention_equals_attend_with_a_causal_mask():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 7, 2, 4, generator=g), torch.randn(2, 7, 2, 4, generator=g)
    q = torch.randn(5, 4, 4, generator=g)
    req, pos = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 6, 0, 3, 4])
    mask = torch.arange(7)[None, :] <= pos[:, None]
    out, _ = attend(q, k[req], v[req], mask, 0.5)
    assert torch.allclose(paged_attention(q, req, pos, k, v, 0.5), out, atol=1e-6)


@given(st.integers(1, 6), st.integers(1, 40), st.sampled_from([(8, 2), (4, 4), (4, 1)]), st.integers(0, 2**16))
def test_grouped_kernel_equals_plain_attention_and_drops_queries_that_see_nothing(T, K, heads, seed):
    """Same head size for keys and values: ``attend`` runs on the CPU flash
    kernel, reading strided keys in place; it must equal plain softmax
    attention, with out 0 and lse -inf for a query that sees no key."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    q = torch.randn(T, H, 8, generator=g)
    k, v = torch.randn(T, K, Hkv, 8, generator=g), torch.randn(T, K, Hkv, 8, generator=g)
    mask = torch.rand(T, K, generator=g) < 0.6
    mask[0] = False  # the first query sees nothing
    out, lse = attend(q, k, v, mask, 0.3)
    seen = mask.any(1)
    assert torch.allclose(out[seen], dense(q, k, v, mask, 0.3)[seen], atol=1e-5)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen])) and torch.isinf(lse[~seen]).all()
    s = torch.einsum("thd,tkhd->thk", q, k.repeat_interleave(H // Hkv, 2)) * 0.3
    want = torch.logsumexp(s.masked_fill(~mask[:, None, :], float("-inf")), -1)
    assert torch.allclose(lse[seen], want[seen], atol=1e-5)


def test_paged_attention_of_one_query_per_row_equals_the_padded_batch():
    """A decode batch (query i on context row i) takes the grouped kernel, and
    so do the same queries beside a context row no query reads; both equal
    plain attention."""
    g = torch.Generator().manual_seed(2)
    B, L = 5, 9
    k, v = torch.randn(B, L, 2, 8, generator=g), torch.randn(B, L, 2, 8, generator=g)
    q = torch.randn(B, 4, 8, generator=g)
    pos = torch.tensor([8, 0, 3, 5, 8])
    fast = paged_attention(q, torch.arange(B), pos, k, v, 0.4)
    extra = torch.randn(1, L, 2, 8, generator=g)  # a context row no query reads: not one query per row
    slow = paged_attention(q, torch.arange(B), pos, torch.cat([k, extra]), torch.cat([v, extra]), 0.4)
    mask = torch.arange(L)[None, :] <= pos[:, None]
    assert torch.allclose(fast, dense(q, k, v, mask, 0.4), atol=1e-5)
    assert torch.allclose(fast, slow, atol=1e-5)


@st.composite
def mixed_batches(draw):
    """Query counts per context row for a pure decode batch (one each), a pure
    prefill batch (two or more each) or a mixed one (any, rows without a query
    too); queries in row order or shuffled."""
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    B = draw(st.integers(1, 6))
    lo, hi = {"decode": (1, 1), "prefill": (2, 5), "mixed": (0, 5)}[kind]
    counts = draw(st.lists(st.integers(lo, hi), min_size=B, max_size=B))
    return counts, draw(st.booleans()), draw(st.integers(0, 2**16))


@given(mixed_batches(), st.integers(1, 24), st.sampled_from([(4, 2), (2, 2), (4, 1)]), st.sampled_from([8, 6]),
       st.sampled_from([0, 10**9]))
def test_paged_attention_of_mixed_batches_equals_attention_per_request(batch, L, heads, dv, pad_limit):
    """Rows with one query (decodes) beside rows with many (prefill chunks), in
    any query order, with or without a plan made beforehand: each query's
    output is plain softmax attention over its row's keys ``0 .. position``;
    the plan pads the rows with more than one query, to their widest, and the
    one-query rows only where ``pad_limit`` allows (never at 0, always beside a
    wider row at 10**9). ``dv`` 6 takes the width-1 padded kernel for the
    one-query rows."""
    counts, shuffle, seed = batch
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    B = len(counts)
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
    if shuffle:
        req = req[torch.randperm(req.numel(), generator=g)]
    T = req.numel()
    pos = torch.randint(0, L, (T,), generator=g)
    q = torch.randn(T, H, 8, generator=g)
    k, v = torch.randn(B, L, Hkv, 8, generator=g), torch.randn(B, L, Hkv, dv, generator=g)
    groups = query_groups(req, pos, B, L, pad_limit)
    many = [c for c in counts if c > 1]
    assert groups.width == max(many, default=0)
    assert groups.visible.shape[0] == (counts.count(1) if pad_limit == 0 or not many else 0)
    mask = torch.arange(L)[None, :] <= pos[:, None]
    want = dense(q, k[req], v[req], mask, 0.4)
    for got in (paged_attention(q, req, pos, k, v, 0.4), paged_attention(q, req, pos, k, v, 0.4, groups)):
        assert got.shape == (T, H, dv)
        assert torch.allclose(got, want, atol=1e-5)


def test_query_groups_refuse_rows_positions_and_shapes_out_of_range():
    req, pos = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 1])
    with pytest.raises(ValueError, match="q_req must index"):
        query_groups(req, pos, 1, 4)
    with pytest.raises(ValueError, match="q_pos must lie"):
        query_groups(req, pos, 2, 3)
    with pytest.raises(ValueError, match="1-D of one length"):
        query_groups(req, pos[:2], 2, 4)


def test_paged_attention_refuses_groups_planned_for_another_batch():
    req, pos = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 1])
    k = torch.randn(2, 4, 1, 8)
    q = torch.randn(3, 2, 8)
    groups = query_groups(req, pos, 2, 4)
    with pytest.raises(ValueError, match="groups were planned for"):
        paged_attention(q[:2], req[:2], pos[:2], k, k, 0.5, groups)
    with pytest.raises(ValueError, match="groups were planned for"):
        paged_attention(q, req, pos, k[:, :3], k[:, :3], 0.5, groups)


def test_paged_attention_refuses_queries_that_q_req_does_not_name():
    """Without planned groups, ``q`` and ``q_req`` must name the same queries (a decode of two rows
    given three queries, or none given two), else the call raises instead of dropping or inventing rows."""
    req, pos = torch.tensor([0, 1]), torch.tensor([3, 2])
    k = torch.randn(2, 4, 1, 8)
    for q in (torch.randn(3, 2, 8), torch.randn(0, 2, 8)):
        with pytest.raises(ValueError, match="q holds"):
            paged_attention(q, req, pos, k, k, 0.5)
