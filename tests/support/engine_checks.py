"""The exactness check every engine test applies to a run's report."""

import threading

import torch

from cpkv.consumers.kv_format import ScaledFp8Format
from cpkv.engine.exactness import failures
from cpkv.runtime.batch import ForwardBatch


def assert_exact(r: dict) -> None:
    """Exact by :mod:`cpkv.engine.exactness` (stored values, selections, every
    logit within 1e-4 at them, greedy tokens), every request finished and
    checked, and every computed position's logits compared (a preempted
    request recomputes positions, so then fewer were compared than computed)."""
    c = r["check"]
    assert failures(c) == [], failures(c)
    assert c["requests_matched"] == c["requests"] == r["requests"] == r["finished"], c["mismatched"]
    assert c["max_abs_diff"] < 1e-4 and c["agreement"]["values"] > 0
    pre = r["preemptions"]
    pre = sum(pre.values()) if isinstance(pre, dict) else pre
    assert (c["logits_checked"] == r["computed_tokens"]) if not pre else (0 < c["logits_checked"] < r["computed_tokens"])


def perturb_first_stored(monkeypatch, family: str, change) -> list:
    """Make the pool hold one wrong row: right after the first store of two
    rows or more of ``family`` in FP8 (one rank's, at layer 0, before any
    read of that layer), ``change(rows, fmt)`` is applied to the encoded
    bytes of the first two rows it wrote and the first is written back.
    Returns a list that holds ``family`` once it has."""
    orig, lock, done = ForwardBatch.store, threading.Lock(), []

    def store(self, layer, **values):
        orig(self, layer, **values)
        f, local = self.pool.families.get(family), self.plan.write.local
        with lock:
            fp8 = f is not None and isinstance(f.format, ScaledFp8Format)
            if family not in values or done or not fp8 or local is None or local.numel() < 2:
                return  # another family, not FP8, an unplanned write or a write of one row
            done.append(family)
        seg = self.pool.segment(family, layer)
        rows = seg[local[:2]].clone()
        change(rows, f.format)
        seg[local[0]] = rows[0]

    monkeypatch.setattr(ForwardBatch, "store", store)
    return done


def scale_off(out, fmt) -> None:
    """The first row's first FP8 tile scale, 10% off."""
    b = fmt.body
    out[0, b : b + 4] = (out[0, b : b + 4].contiguous().view(torch.float32) * 1.1).view(torch.uint8)


def other_row(out, fmt) -> None:
    """The first row holds the second's bytes."""
    out[0] = out[1]
