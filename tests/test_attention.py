"""Attention kernels over the paged cache: the per-query gathered form and the
exact log-sum-exp merge that the decode split relies on."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.models.attention import attend, merge_partials, paged_attention


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
