"""Attention over the shared paged cache: one function per kind, no model code."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(q: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal GQA attention of queries over their requests' gathered context.

    ``q [T, H, D]`` are the queries this rank computes, in request order;
    ``q_req[i]`` indexes the row of ``k_ctx, v_ctx [B, L, Hkv, D]`` holding
    token i's request context in position order, and ``q_pos[i]`` is its
    position: it attends to context positions ``0 .. q_pos[i]``. Queries are
    grouped per request into one padded batch (no loop per token or request).
    """
    T = q.shape[0]
    if T == 0:
        return q.new_zeros(q.shape)
    B, L = k_ctx.shape[:2]
    counts = torch.bincount(q_req, minlength=B)
    j = torch.arange(T, device=q.device) - (torch.cumsum(counts, 0) - counts)[q_req]
    qmax = int(counts.max())
    qp = q.new_zeros(B, qmax, *q.shape[1:])
    qp[q_req, j] = q
    pos = torch.full((B, qmax), -1, dtype=torch.int64, device=q.device)
    pos[q_req, j] = q_pos
    mask = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]
    mask[:, :, 0] |= pos < 0  # padded query rows see one key, so no row is empty; discarded below
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
        attn_mask=mask[:, None], scale=scaling, enable_gqa=True,
    )
    return out.transpose(1, 2)[q_req, j]
