"""The exactness check every engine test applies to a run's report."""

import threading

import torch

from cpkv.consumers.kv_format import ScaledFp8Format
from cpkv.consumers.kv_pool import SharedKVPool
from cpkv.engine.exactness import failures


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
    """Make the pool store one wrong row: the first write of two rows or more
    of ``family`` in FP8 (one rank's, at layer 0) has ``change(rows, fmt)``
    applied to its encoded bytes. Returns a list that holds ``family`` once it has."""
    orig, lock, done = SharedKVPool._stored, threading.Lock(), []

    def stored(self, name, x):
        out = orig(self, name, x)
        with lock:
            fp8 = isinstance(self.families[name].format, ScaledFp8Format)
            if name != family or done or out.shape[0] < 2 or not fp8:
                return out  # another family, a write of one row, or not FP8
            done.append(name)
        out = out.clone()
        change(out, self.families[name].format)
        return out

    monkeypatch.setattr(SharedKVPool, "_stored", stored)
    return done


def scale_off(out, fmt) -> None:
    """The first row's first FP8 tile scale, 10% off."""
    b = fmt.body
    out[0, b : b + 4] = (out[0, b : b + 4].contiguous().view(torch.float32) * 1.1).view(torch.uint8)


def other_row(out, fmt) -> None:
    """The first row holds the second's bytes."""
    out[0] = out[1]
