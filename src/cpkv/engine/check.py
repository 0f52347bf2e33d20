"""``--check``: every finished request against ``transformers``.

The reference is ``transformers``' forward over the request's full sequence
with the cache stored as the run stored it, through
:class:`~cpkv.models.round_trip.RoundTripCache` ([[RFC-0001:C-KV-FORMAT]]):
where the run recorded what it stored and selected (an executor's ``stored``
and ``selected``), the reference holds the run's stored values, each checked
to be a rounding of its own, and selects the run's top-k, checked against its
own (:func:`~cpkv.models.round_trip.run_reference`); elsewhere its own round
trip of its own values. What passes is :mod:`.exactness`'s definition, the
same for float32, bfloat16 and FP8 on every machine. Beside it, the divergence
from the unquantized model: the largest logit difference from the plain float
forward of the same sequence, and how many requests' tokens equal the plain
model's greedy decoding (teacher-forced over the run's own tokens: a request's
tokens equal the plain model's greedy decoding exactly when the plain argmax
at every generated position is the run's token there). The reference runs on
the model's device (``--device cuda``: the GPU) and is compared on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..consumers.kv_pool import Family
from .exactness import TOLERANCE

if TYPE_CHECKING:
    from ..models.round_trip import RunRecord


def check(model, sched, ex, families: Sequence[Family] = ()) -> dict:
    """Every request of ``sched`` (``r.seq``, ``r.prompt``, ``r.generated``)
    against ``transformers``' ``model``, with ``ex.logits[request][position]``
    the logits the run computed and ``families`` the caches as the run stored
    them (their formats, if any, make the reference quantized), and, when
    ``ex`` has them, ``ex.stored[request]`` (``{family: [layers, S,
    *shape]}``, the values its context held) and
    ``ex.selected[request][position]`` (``[indexer layers, k]``, a DSA run's
    top-k), the reference at them (:func:`run_record`). Returns ``max_abs_diff``,
    ``logits_checked``, ``requests``, ``requests_matched``, ``mismatched``
    (spec ids) against that reference, ``tolerance`` (the logits',
    :data:`~cpkv.engine.exactness.TOLERANCE`), ``values_compared`` (how many
    stored values the reference's cache received from the run and compared:
    0, a reference that never used its cache, fails the check), ``agreement``
    (the run's stored values and selection against the reference's,
    :class:`~cpkv.models.round_trip.Agreement`, when recorded), and
    ``unquantized``: ``{"max_abs_diff", "greedy_agreement"}`` against the
    plain float model (the same figures as the check when nothing is
    formatted)."""
    # transformers: imported where the check runs
    from ..models.round_trip import Agreement, reference_logits, run_reference

    formats = {f.name: f.format for f in families if f.format is not None}
    layers = {f.name: tuple(f.layers) for f in families}
    stored, selected = getattr(ex, "stored", None) or {}, getattr(ex, "selected", None) or {}
    worst, plain_worst, mismatched, plain_agree, logits_checked = 0.0, 0.0, [], 0, 0
    agreement = Agreement()
    for r in sched.requests:
        seq = torch.tensor(r.seq[:-1], dtype=torch.int64)
        if stored:
            ref, a = run_reference(model, seq, formats, run_record(r, sched.requests, stored, selected, layers))
            agreement.merge(a)
        else:
            ref = reference_logits(model, seq, formats)
        plain = reference_logits(model, seq) if formats else ref
        got = ex.logits.get(r.index, {})
        if got:
            pos = torch.tensor(sorted(got))
            ours = torch.stack([got[p] for p in pos.tolist()]).cpu()  # compared on the CPU, as the reference
            worst = max(worst, float((ours - ref[pos]).abs().max()))
            plain_worst = max(plain_worst, float((ours - plain[pos]).abs().max()))
            logits_checked += pos.numel()
        n = len(r.prompt)
        if ref[n - 1 :].argmax(-1).tolist() != r.generated:
            mismatched.append(r.spec.id)
        plain_agree += plain[n - 1 :].argmax(-1).tolist() == r.generated
    return {"max_abs_diff": worst, "logits_checked": logits_checked, "requests": len(sched.requests),
            "requests_matched": len(sched.requests) - len(mismatched), "mismatched": mismatched,
            "tolerance": TOLERANCE, "values_compared": agreement.values, **({"agreement": agreement.as_dict()} if stored else {}),
            "unquantized": {"max_abs_diff": plain_worst, "greedy_agreement": plain_agree}}


def run_record(r, requests, stored: dict, selected: dict, layers: dict[str, tuple[int, ...]]) -> RunRecord:
    """The :class:`~cpkv.models.round_trip.RunRecord` of request ``r``'s
    checked sequence (``S = len(r.seq) - 1`` positions): ``stored[r.index]``
    (``{family: [layers, S, *shape]}``, what its context held, read by the
    executor at its last forward), and the selection ``selected[index][position]``
    the run made at each position. A position ``r`` did not compute (a prefix
    it found cached) takes the selection of a request that did, with the same
    tokens up to it, so the reference computes the values the run cached
    there. Raises ``ValueError`` when the run kept no values of ``r``."""
    from ..models.round_trip import RunRecord  # transformers: imported where the check runs

    if r.index not in stored:
        raise ValueError(f"the run recorded no stored values of request {r.spec.id!r}: it cannot be checked")
    S = len(r.seq) - 1
    values = {n: v for n, v in stored[r.index].items() if n in layers}
    if any(v.shape[1] != S for v in values.values()):
        raise ValueError(f"request {r.spec.id!r}: stored values of {[v.shape[1] for v in values.values()]} "
                         f"positions for a sequence of {S}")
    if not selected:
        return RunRecord(values, {n: layers[n] for n in values})
    source: dict[int, torch.Tensor] = {}  # position -> the selection of the request that computed it
    seq = np.asarray(r.seq[:S])
    for other in [r, *(o for o in requests if o is not r)]:
        rec = selected.get(other.index)
        if not rec:
            continue
        o = np.asarray(other.seq[:S])
        n = min(len(o), S)
        same = int(np.argmin(np.append(o[:n] == seq[:n], False)))  # length of the common prefix
        for p, t in rec.items():
            if p < same and p not in source:
                source[p] = t
    if not source:  # no position of it selected anything here: the reference selects on its own
        return RunRecord(values, {n: layers[n] for n in values})
    at, got = torch.tensor(list(source)), torch.stack(list(source.values()))
    sel = torch.full((S, *got.shape[1:]), -1, dtype=got.dtype)
    pinned = torch.zeros(S, dtype=torch.bool)
    sel[at], pinned[at] = got, True
    return RunRecord(values, {n: layers[n] for n in values}, sel, pinned)
