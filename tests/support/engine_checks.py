"""The exactness check every engine test applies to a run's report."""

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
