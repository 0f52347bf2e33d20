"""Attention over the shared paged cache: one function per kind, no model code."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class QueryGroups(NamedTuple):
    """How :func:`paged_attention` batches queries by request, planned once per
    batch (:func:`query_groups`): ``one_per_row`` (query t is row t's only
    query: a decode batch), ``visible [B, L]`` for that case; otherwise each
    query's place ``j [T]`` in its row's padded group, the group ``width``,
    and ``mask [B, width, L]`` (causal; a padded query row sees key 0)."""

    one_per_row: bool
    visible: torch.Tensor
    j: torch.Tensor
    width: int
    mask: torch.Tensor


def query_groups(q_req: torch.Tensor, q_pos: torch.Tensor, B: int, L: int) -> QueryGroups:
    """The :class:`QueryGroups` of queries ``q_req [T]`` (row of each) at
    positions ``q_pos [T]`` over ``B`` context rows of length ``L``. Reads
    the counts on the host (a synchronisation): call it once per batch."""
    dev, T = q_req.device, q_req.numel()
    one = T == B and torch.equal(q_req, torch.arange(B, device=dev))
    visible = torch.arange(L, device=dev)[None, :] <= q_pos[:, None] if one else q_pos.new_zeros((0, L), dtype=torch.bool)
    counts = torch.bincount(q_req, minlength=B)
    j = torch.arange(T, device=dev) - (torch.cumsum(counts, 0) - counts)[q_req]
    width = int(counts.max()) if T else 0
    pos = torch.full((B, width), -1, dtype=torch.int64, device=dev)
    pos[q_req, j] = q_pos.to(torch.int64)
    mask = torch.arange(L, device=dev)[None, None, :] <= pos[:, :, None]
    if L:
        mask[:, :, 0] |= pos < 0  # padded query rows see one key, so no row is empty; discarded below
    return QueryGroups(one, visible, j, width, mask)


def paged_attention(q: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, scaling: float, groups: QueryGroups | None = None) -> torch.Tensor:
    """Causal GQA attention of queries over their requests' gathered context.

    ``q [T, H, D]`` are the queries this rank computes, in request order;
    ``q_req[i]`` indexes the row of ``k_ctx, v_ctx [B, L, Hkv, D]`` holding
    token i's request context in position order, and ``q_pos[i]`` is its
    position: it attends to context positions ``0 .. q_pos[i]``. Queries are
    grouped per request into one padded batch (no loop per token or request);
    a batch of one query per row (decode) runs on :func:`attend`'s grouped kernel.
    ``groups``: that grouping, planned once per batch (:func:`query_groups`);
    with it the call does not synchronise with the host.
    """
    T = q.shape[0]
    if T == 0:
        return q.new_zeros(q.shape)
    B, L = k_ctx.shape[:2]
    if groups is None:
        groups = query_groups(q_req, q_pos, B, L)
    if groups.one_per_row and _flash_fits(q, k_ctx, v_ctx):
        # one query per context row, in order (a decode batch): the grouped kernel of attend
        return attend(q, k_ctx, v_ctx, groups.visible, scaling)[0]
    j = groups.j
    qp = q.new_zeros(B, groups.width, *q.shape[1:])
    qp[q_req, j] = q
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
        attn_mask=groups.mask[:, None], scale=scaling, enable_gqa=True,
    )
    return out.transpose(1, 2)[q_req, j]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its own key set, with the log-sum-exp.

    ``q [T, H, D]``; ``k [T, K, Hkv, D]`` and ``v [T, K, Hkv, Dv]`` are the K
    keys of query t (``H`` a multiple of ``Hkv``: grouped-query attention);
    ``mask [T, K]`` marks the keys query t may see. Returns ``out [T, H, Dv]``
    and ``lse [T, H]`` (the log of the softmax denominator, on the scaled
    scores), in fp32 math. A query that sees no key gets ``out = 0`` and
    ``lse = -inf``, so it drops out of :func:`merge_partials`.
    """
    T, H, D = q.shape
    Hkv = k.shape[2]
    if _flash_fits(q, k, v):
        return _attend_flash(q, k, v, mask, scaling)
    qg = q.float().view(T, Hkv, H // Hkv, D)
    s = torch.einsum("tgrd,tkgd->tgrk", qg, k.float()) * scaling  # [T, Hkv, H/Hkv, K]
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [T, Hkv, H/Hkv]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("tgrk,tkgd->tgrd", p, v.float())
    return out.reshape(T, H, v.shape[-1]).to(q.dtype), lse.reshape(T, H)


# the CPU flash-attention kernel that F.scaled_dot_product_attention dispatches to; it also returns the
# log-sum-exp, which the public function does not
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (_FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype and v.shape[-1] == q.shape[-1] and q.shape[0] > 0 and k.shape[1] > 0)


def _attend_flash(q, k, v, mask, scaling):
    """:func:`attend` on the CPU flash kernel, reading ``k``/``v`` in place
    (strided, no copy): query t is a batch of its own, each KV head a head,
    and the ``H // Hkv`` query heads of a group its query rows, which is
    grouped-query attention without repeating any key."""
    T, H, D = q.shape
    K, Hkv = k.shape[1], k.shape[2]
    bias = torch.zeros((T, 1, 1, K), dtype=q.dtype).masked_fill_(~mask[:, None, None, :], float("-inf"))
    out, lse = _FLASH_CPU(q.reshape(T, Hkv, H // Hkv, D), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                          scale=scaling)
    seen = mask.any(1)[:, None]  # the kernel reports lse 0 for a query that sees no key
    return (torch.where(seen[..., None], out.reshape(T, H, D), 0.0).to(q.dtype),
            torch.where(seen, lse.reshape(T, H).float(), float("-inf")))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of partial attentions over disjoint key sets.

    ``outs [R, T, H, Dv]`` and ``lses [R, T, H]`` from :func:`attend` on R
    disjoint parts of each query's keys; the result equals attention over the
    union: ``sum_r exp(lse_r - lse) * out_r`` with ``lse = logsumexp_r lse_r``.
    """
    lse = torch.logsumexp(lses, 0)  # [T, H]
    w = torch.exp(lses - torch.where(torch.isinf(lse), 0.0, lse)[None])
    w = torch.where(torch.isinf(lses), 0.0, w)
    return (w[..., None] * outs.float()).sum(0).to(outs.dtype)


# -- MLA (multi-head latent attention) in absorbed form, and DSA's lightning indexer --------
def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """MLA query absorbed into the latent space: ``q_abs[t, h] = W_UK[h]^T q_nope[t, h]``.

    ``q_nope [T, H, dn]``, ``w_uk [H, dn, r]`` (the key half of each head's
    ``kv_b_proj`` rows). Returns ``[T, H, r]``: its dot product with a cached
    latent ``c`` equals ``q_nope . (W_UK c)``, the expanded key, so attention
    runs over the latent without expanding any key.
    """
    return torch.einsum("thd,hdr->thr", q_nope, w_uk)


def absorbed_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """MLA output from attention over latents: ``o[t, h] = W_UV[h] o_latent[t, h]``.

    ``o_latent [T, H, r]`` is the softmax-weighted sum of the latents,
    ``w_uv [H, dv, r]`` the value half of ``kv_b_proj``. Returns ``[T, H, dv]``,
    equal to attention over the expanded values ``W_UV c``.
    """
    return torch.einsum("thr,hvr->thv", o_latent, w_uv)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Lightning-indexer scores of each query over its context, fp32.

    ``I[t, l] = sum_h weights[t, h] * relu(scale * q[t, h] . keys[t, l])`` with
    ``q [T, Hi, Di]``, ``weights [T, Hi]`` (signed, already scaled by the
    model), ``keys [T, L, Di]`` (query t's context). Returns ``[T, L]``.
    """
    s = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale)  # [T, Hi, L]
    return torch.matmul(weights.float().unsqueeze(-2), s).squeeze(-2)


class IndexerScore:
    """DSA's lightning-indexer score at softmax ``scale``, as a ``score``
    callable for :meth:`cpkv.models.CacheAccess.select`: ``score(q, weights,
    keys)`` is :func:`index_scores`. A cache that recognises it may compute
    the same scores in a kernel over its own view instead (``cpkv.kernels.index_scores``)."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def __call__(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """:func:`index_scores` of ``q [T, Hi, Di]``, ``weights [T, Hi]``, ``keys [T, L, Di]``: ``[T, L]`` fp32."""
        return index_scores(q, weights, keys, self.scale)


def topk_positions(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The ``min(k, visible positions)`` best visible context positions per query.

    ``scores [T, L]``, ``visible [T, L]`` (causal: positions ``0 .. position``).
    Returns ``[T, min(k, L)]`` int64 positions, ``-1`` where a query sees fewer
    than that many positions (it then selects all it sees: the row is dense).
    Ties are broken by ``torch.topk``, so the set is the reference's when no two
    scores tie at the k-th place.
    """
    if k < 1:
        raise ValueError(f"top-k needs k >= 1, got {k}")
    K = min(k, scores.shape[-1])
    idx = scores.masked_fill(~visible, float("-inf")).topk(K, dim=-1).indices
    return torch.where(visible.gather(-1, idx), idx, -1)
