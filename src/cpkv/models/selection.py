"""``transformers``' DSA indexers at the run's selection, and their own
selection compared with it ([[RFC-0001:C-EXACTNESS]]).

A DSA model's attention reads only the keys its indexer selects, so a
near-tie in the indexer's scores (two keys whose order a rounding decides)
changes which latents a query reads, and every logit after it. Which key wins
such a tie follows the machine's kernels (a sequence computed in chunks by
the engine, whole by the reference), not the engine. So the reference is
asked at the run's selection (:func:`pinned_indexers`: each indexer layer's
top-k replaced, row by row, by the run's record), and the selection is checked
on its own, row by row, against the top-k ``R`` that ``transformers``' own
scores give at the same keys (the run's stored ones,
:class:`~cpkv.models.round_trip.RoundTripCache`) and queries:

* equal: the run's set ``E`` is ``R``;
* a near-tie: they differ only between keys whose scores are within
  float32's noise: for every ``r`` in ``R`` but not ``E`` and every ``e`` in
  ``E`` but not ``R``, ``score(r) - score(e) <= band(r) + band(e)``, with
  ``band[t, l] = NOISE * scale * sum_h |w[t, h]| sum_d |q[t, h, d] k[l, d]|``
  (:data:`NOISE` of the score's magnitude: the two sides' queries differ by
  float32's rounding of the same arithmetic, done in other chunks);
* a mismatch: anything else, or a record that is not ``min(k, position + 1)``
  distinct visible positions.

The scores, queries, weights and keys are ``transformers``' own, taken inside
its indexer's forward (its two matmuls and its top-k, seen by a
``TorchFunctionMode``); an indexer written otherwise is refused with an error
that says what was missing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

#: float32's noise between the engine and the reference at the same stored
#: values and selection, relative to a magnitude (a slot's largest value, a
#: score's ``sum |w| |q . k|``): the two compute the same arithmetic in other
#: chunks, ~1e-7 relative each; 2^-16 (1.5e-5) leaves a margin of over 10x.
NOISE = 2.0**-16


def indexer_layers(model) -> list[int]:
    """The layers of ``model`` (``transformers``' DeepSeek-V3.2 or GLM-5) that
    run their own indexer, in order: the second axis of a recorded selection."""
    return [i for i, blk in enumerate(model.model.layers) if getattr(blk.self_attn, "indexer", None) is not None]


def compare_selection(scores: torch.Tensor, band, own: torch.Tensor, run: torch.Tensor,
                      positions: torch.Tensor) -> dict:
    """One layer's rows, the queries at ``positions [S]`` of one sequence:
    ``scores [S, L]`` the reference's (keys past a row's position are not
    visible, whatever their score), ``band(rows) -> [len(rows), L]`` the band
    of those rows (asked only for the rows that differ), ``own [S, K]`` the
    reference's top-k, ``run [S, K']`` the run's (``-1``: none). Returns
    ``{"rows", "equal", "near_ties", "mismatches", "worst"}`` (``worst``: the
    largest score gap between a dropped and a taken key over the sum of the
    largest bands of both, over the differing rows). Vectorised over rows;
    the module doc gives the rule. Raises ``ValueError`` for shapes that do
    not agree."""
    S, L = scores.shape if scores.dim() == 2 else (-1, -1)
    if S < 0 or own.shape[:1] != (S,) or run.shape[:1] != (S,) or positions.shape != (S,) or own.dim() != 2 \
            or run.dim() != 2:
        raise ValueError(f"scores [S, L], own [S, K], run [S, K'], positions [S] expected; got "
                         f"{tuple(scores.shape)}, {tuple(own.shape)}, {tuple(run.shape)}, {tuple(positions.shape)}")
    visible = torch.arange(L, device=scores.device)[None] <= positions[:, None]
    want = (positions + 1).clamp(max=own.shape[1])  # min(k, position + 1)
    in_r = torch.zeros(S, L + 1, dtype=torch.bool, device=scores.device)
    in_r.scatter_(1, torch.where(visible.gather(1, own), own, L), True)
    e = run.long()
    ok = (e >= -1) & (e < L)
    hits = torch.zeros(S, L + 1, dtype=torch.int64, device=scores.device)
    hits.scatter_add_(1, torch.where(ok & (e >= 0), e, L), torch.ones_like(e))
    in_e, in_r = hits[:, :L] > 0, in_r[:, :L]
    valid = ok.all(-1) & (hits[:, :L] <= 1).all(-1) & ~(in_e & ~visible).any(-1) & (in_e.sum(-1) == want)
    differ = valid & (in_e != in_r).any(-1)
    d = differ.nonzero().flatten()
    sc, b, only_r, only_e = scores[d], band(d), (in_r & ~in_e)[d], (in_e & ~in_r)[d]
    lo = torch.where(only_r, sc - b, float("-inf")).amax(-1)  # the weakest claim of a dropped key
    hi = torch.where(only_e, sc + b, float("inf")).amin(-1)  # the strongest claim of a taken key
    ties = int((lo <= hi).sum())
    gap = torch.where(only_r, sc, float("-inf")).amax(-1) - torch.where(only_e, sc, float("inf")).amin(-1)
    room = torch.where(only_r, b, 0.0).amax(-1) + torch.where(only_e, b, 0.0).amax(-1)
    ratio = gap / room.clamp(min=torch.finfo(room.dtype).tiny)
    return {"rows": S, "equal": int(valid.sum()) - d.numel(), "near_ties": ties,
            "mismatches": S - int(valid.sum()) + d.numel() - ties,
            "worst": float(ratio.max()) if d.numel() else 0.0}


class _Pin(TorchFunctionMode):
    """Inside one indexer forward: keeps the operands of its two matmuls
    (queries . keys, weights . scores) and replaces the result of its top-k
    by ``pins [S, k]`` on the rows ``pinned [S]``."""

    def __init__(self, pins: torch.Tensor, pinned: torch.Tensor):
        super().__init__()
        self.pins, self.pinned = pins, pinned
        self.matmuls: list[tuple] = []
        self.topk: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.matmul:
            self.matmuls.append(args)
        elif func is torch.Tensor.topk and self.topk is None:
            scores, own = args[0], out.indices  # [1, S, L], [1, S, K]
            self.topk = (scores, own)
            pins = self.pins[:, : own.shape[-1]].to(own.device, torch.int64)
            pins = torch.where(pins >= 0, pins, pins[:, :1])  # a short row repeats its first key: the same set
            idx = torch.where(self.pinned.to(own.device)[:, None], pins, own[0])[None]
            out = torch.return_types.topk((scores.gather(-1, idx), idx))
        return out

    def agreement(self, ind) -> dict:
        """:func:`compare_selection` over the pinned rows, from what this forward ran."""
        if len(self.matmuls) != 2 or self.topk is None:
            raise RuntimeError(f"{type(ind).__name__}.forward ran {len(self.matmuls)} matmuls and "
                               f"{'a' if self.topk else 'no'} top-k; the selection check reads transformers' "
                               "scores from its two matmuls (queries . keys, weights . scores) and its top-k")
        (q, kt), (w, _) = self.matmuls  # q [1, S, H, D], kt [1, 1, D, L], w [1, S, 1, H]
        scores, own = self.topk
        rows = self.pinned.nonzero().flatten().to(scores.device)
        scale = NOISE * abs(ind.softmax_scale)

        def band(i):  # [n, L]: NOISE * scale * sum_h |w| sum_d |q k|, for the rows rows[i]
            r = rows[i]
            return scale * torch.matmul(w[0, r].abs(), torch.matmul(q[0, r].abs(), kt[0, 0].abs()))[:, 0].float()

        return compare_selection(scores[0, rows].float(), band, own[0, rows].long(),
                                 self.pins.to(scores.device)[rows], rows)


@contextmanager
def pinned_indexers(model, pins: torch.Tensor, pinned: torch.Tensor, found: list):
    """While open, every indexer of ``model`` selects ``pins [S, indexer
    layers, k]`` (positions, ``-1`` none) on the rows ``pinned [S]`` of a
    whole-sequence forward of ``S`` tokens (its own top-k elsewhere); after
    each indexer forward, the :func:`compare_selection` of its pinned rows is
    appended to ``found``. The indexers are restored on the way out."""
    layers, patched = model.model.layers, []

    def wrap(i, ind, orig):
        def forward(*args, **kwargs):
            mode = _Pin(pins[:, i], pinned)
            with mode:
                out = orig(*args, **kwargs)
            found.append(mode.agreement(ind))
            return out
        return forward

    try:
        for i, layer in enumerate(indexer_layers(model)):
            ind = layers[layer].self_attn.indexer
            ind.forward = wrap(i, ind, ind.forward)
            patched.append(ind)
        yield
    finally:
        for ind in patched:
            del ind.forward  # the class's forward again
