"""``--check``: every finished request against ``transformers``.

The reference is ``transformers``' forward over the request's full sequence
with the cache stored as the run stored it: plain (no cache) for float32,
through :class:`~cpkv.models.round_trip.RoundTripCache` for a formatted cache
(bf16 bytes, FP8), the same round trip where its model caches the values
([[RFC-0001:C-KV-FORMAT]]). Every computed logit within tolerance of it and
greedy decoding giving the same tokens is exactness. Beside it, the divergence
from the unquantized model: the largest logit difference from the plain float
forward of the same sequence, and how many requests' tokens equal the plain
model's greedy decoding (teacher-forced over the run's own tokens: a request's
tokens equal the plain model's greedy decoding exactly when the plain argmax
at every generated position is the run's token there). The reference runs on
the model's device (``--device cuda``: the GPU) and is compared on the CPU.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..consumers.kv_pool import Family


def check(model, sched, ex, families: Sequence[Family] = ()) -> dict:
    """Every request of ``sched`` (``r.seq``, ``r.prompt``, ``r.generated``)
    against ``transformers``' ``model``, with ``ex.logits[request][position]``
    the logits the run computed and ``families`` the caches as the run stored
    them (their formats, if any, make the reference quantized). Returns
    ``max_abs_diff``, ``logits_checked``, ``requests``, ``requests_matched``,
    ``mismatched`` (spec ids) against that reference, and ``unquantized``:
    ``{"max_abs_diff", "greedy_agreement"}`` against the plain float model
    (the same figures as the check when nothing is formatted)."""
    from ..models.round_trip import reference_logits  # transformers: imported where the check runs

    formats = {f.name: f.format for f in families if f.format is not None}
    worst, plain_worst, mismatched, plain_agree, logits_checked = 0.0, 0.0, [], 0, 0
    for r in sched.requests:
        seq = torch.tensor(r.seq[:-1], dtype=torch.int64)
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
            "unquantized": {"max_abs_diff": plain_worst, "greedy_agreement": plain_agree}}
