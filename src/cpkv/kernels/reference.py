"""Torch references of the data-plane kernels: the definition each Triton
kernel must equal, vectorised (no loop per token, page or request).

Arguments arrive checked by :mod:`cpkv.kernels` (shapes, dtypes, devices,
slots inside the layout); these functions only compute. Slot arithmetic is
:class:`~cpkv.contract.layout.SharedKVLayout`'s. Math runs in float32 whatever
the input dtype; outputs take the query's (or partials') dtype, log-sum-exps
are float32. Any device torch runs on.
"""

from __future__ import annotations

import torch

from ..contract.layout import SharedKVLayout


def store(buffer: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, layout: SharedKVLayout,
          rank: int) -> torch.Tensor:
    """Write ``values [T, *shape]`` at logical ``slots [T]`` into ``buffer
    [slots_per_rank, *shape]`` (rank ``rank``'s own segment) at local slots
    ``(p // N) * S + s % S``; padding is skipped. A slot ``rank`` does not own
    (or outside the layout) is not written and is counted. Returns the report
    ``int32 [2]``: refused slots, index of the first refused one (``T`` when
    none). [[RFC-0001:C-DIRECT-WRITE]]"""
    pad = layout.padding_value
    valid = slots != pad
    inside = (slots >= 0) & (slots < layout.capacity)
    safe = torch.where(inside, slots, pad)
    owned = layout.owned_slot_mask(safe, owner_rank=rank)
    local = layout.translate_write_slots(safe)
    buffer.index_copy_(0, local[owned].to(torch.int64), values[owned].to(buffer.dtype))
    refused = valid & ~owned
    first = torch.where(refused, torch.arange(slots.numel(), device=slots.device), slots.numel()).min() \
        if slots.numel() else torch.zeros((), dtype=torch.int64, device=slots.device)
    return torch.stack([refused.sum(), first]).to(torch.int32)


def _read_rows(slots: torch.Tensor, seen: torch.Tensor, layout: SharedKVLayout) -> torch.Tensor:
    """Rank-major rows of ``slots`` where ``seen`` (row 0 elsewhere, to be masked)."""
    pad = torch.full_like(slots, layout.padding_value)
    return layout.translate_read_slots(torch.where(seen, slots, pad)).clamp(min=0).to(torch.int64)


def _masked(slots: torch.Tensor, layout: SharedKVLayout, only_rank: int) -> torch.Tensor:
    """Non-padding entries of ``slots`` (owned by ``only_rank`` when >= 0)."""
    seen = slots != layout.padding_value
    if only_rank >= 0:
        seen &= layout.owned_slot_mask(torch.where(seen, slots, layout.padding_value), owner_rank=only_rank)
    return seen


def softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query over its own keys, in fp32: ``q [T, H, D]``, ``k [T, K, Hkv, D]``,
    ``v [T, K, Hkv, Dv]``, ``seen [T, K]`` bool. Returns ``out [T, H, Dv]``
    (``q.dtype``) and ``lse [T, H]`` (fp32, natural log over the scaled
    scores); a query that sees no key gets ``out = 0``, ``lse = -inf``."""
    T, H, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().view(T, Hkv, H // Hkv, D)
    s = torch.einsum("tgrd,tkgd->tgrk", qg, k.float()) * scaling
    s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("tgrk,tkgd->tgrd", p, v.float())
    return out.reshape(T, H, v.shape[-1]).to(q.dtype), lse.reshape(T, H)


def _context(table, q_req, q_pos, layout, only_rank=-1):
    """Each query's visible context: its request's table row ``[T, L]``, the
    mask of entries it sees (position <= q_pos, not padding, owned by
    ``only_rank`` when >= 0) and their rank-major rows."""
    slots = table[q_req.to(torch.int64)]
    seen = _masked(slots, layout, only_rank)
    seen &= torch.arange(table.shape[1], device=table.device)[None, :] <= q_pos[:, None]
    return seen, _read_rows(slots, seen, layout)


def paged_attention(q, k_view, v_view, table, q_req, q_pos, layout, scaling, only_rank=-1):
    """Causal GQA attention over the shared view: query ``t`` sees positions
    ``0 .. q_pos[t]`` of table row ``q_req[t]``. See :func:`cpkv.kernels.paged_attention`."""
    seen, rows = _context(table, q_req, q_pos, layout, only_rank)
    return softmax_attend(q, k_view[rows], v_view[rows], seen, scaling)


def index_scores(q, weights, k_view, table, q_req, q_pos, layout, scale):
    """Lightning-indexer scores ``sum_h w[t, h] * relu(scale * q[t, h] . k[l])``
    over the shared view, ``-inf`` where not visible. See :func:`cpkv.kernels.index_scores`."""
    seen, rows = _context(table, q_req, q_pos, layout)
    s = torch.relu(torch.einsum("thd,tld->thl", q.float(), k_view[rows].float()) * scale)
    scores = torch.einsum("th,thl->tl", weights.float(), s)
    return scores.masked_fill(~seen, float("-inf"))


def sparse_mla_attention(q, latent_view, slots, layout, scaling, value_dims, only_rank=-1):
    """Absorbed MLA over the selected logical ``slots [T, K]``: keys the whole
    latent row, values its first ``value_dims``. See :func:`cpkv.kernels.sparse_mla_attention`."""
    seen = _masked(slots, layout, only_rank)
    lat = latent_view[_read_rows(slots, seen, layout)].unsqueeze(2)  # [T, K, 1, Dl]
    return softmax_attend(q, lat, lat[..., :value_dims], seen, scaling)


def merge_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partials over disjoint key sets: ``lse = logsumexp_r lse_r``,
    ``out = sum_r exp(lse_r - lse) * out_r``. See :func:`cpkv.kernels.merge_lse`."""
    lses = lses.float()
    lse = torch.logsumexp(lses, 0)
    w = torch.exp(lses - torch.where(torch.isinf(lse), 0.0, lse)[None])
    w = torch.where(torch.isinf(lses), 0.0, w)
    return (w[..., None] * outs.float()).sum(0).to(outs.dtype), lse
