"""The models' own attention math: MLA's absorbed query and output, DSA's
lightning-indexer score and its top-k. Attention over the cache itself (the
gathered softmax, the grouped causal batch, the log-sum-exp merge) is the data
plane's: :mod:`cpkv.kernels.reference` defines it, the backends of
:mod:`cpkv.kernels` run it."""

from __future__ import annotations

import torch

from ..kernels.reference import indexer_scores


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
    model), ``keys [T, L, Di]`` (query t's context). Returns ``[T, L]``: the
    formula the indexer kernels equal, written once
    (:func:`cpkv.kernels.reference.indexer_scores`).
    """
    return indexer_scores(q, weights, keys, scale)


class IndexerScore:
    """DSA's lightning-indexer score at softmax ``scale``, as a ``score``
    callable for :meth:`cpkv.models.CacheAccess.select`: ``score(q, weights,
    keys)`` is :func:`index_scores`. A cache that recognises it may compute
    the same scores in a kernel over its own view instead (a backend's ``index_scores``)."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def __call__(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """:func:`index_scores` of ``q [T, Hi, Di]``, ``weights [T, Hi]``, ``keys [T, L, Di]``: ``[T, L]`` fp32."""
        return index_scores(q, weights, keys, self.scale)


def rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """One int64 per score that orders a row the way a top-k selects from it:
    by score, then, between equal scores, the lower position first (column
    ``l`` of ``scores [..., L]`` is position ``l``). All keys of a row are
    distinct, so the best ``k`` keys are one set whatever splits the row:
    every rank of a group, each scoring its own positions, and one rank
    scoring them all, pick the same keys. Key = ``ordered(score) * 2**32 +
    (2**32 - 1 - l)``, where ``ordered`` is the float32's bits as an int32
    whose order is the floats' (negative floats' magnitude bits flipped),
    ``-0.0`` taken as ``+0.0`` (they are equal scores); ``-inf`` orders
    last. ``scores`` float32 (a NaN has no place in the order)."""
    s = scores.float() + 0.0  # -0.0 + 0.0 is +0.0: equal scores, equal keys
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    pos = torch.arange(s.shape[-1], dtype=torch.int64, device=s.device)
    return ordered * 2**32 + (2**32 - 1 - pos)


def topk_positions(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The ``min(k, visible positions)`` best visible context positions per query.

    ``scores [T, L]``, ``visible [T, L]`` (causal: positions ``0 .. position``).
    Returns ``[T, min(k, L)]`` int64 positions, best first, ``-1`` where a
    query sees fewer than that many positions (it then selects all it sees:
    the row is dense). Equal scores at the k-th place go to the lower
    positions (:func:`rank_keys`): the set is the same on every split of the
    row (the log-sum-exp split's all-local top-k picks it from each rank's
    own positions). ``transformers``' indexer breaks such a tie by
    ``torch.topk`` over its own row, an order that depends on the row's
    length and the sort ``torch.topk`` runs; the check compares selections
    up to ties (:func:`cpkv.models.selection.compare_selection`).
    """
    if k < 1:
        raise ValueError(f"top-k needs k >= 1, got {k}")
    K = min(k, scores.shape[-1])
    idx = rank_keys(scores.masked_fill(~visible, float("-inf"))).topk(K, dim=-1).indices
    return torch.where(visible.gather(-1, idx), idx, -1)
