"""What exact means for a run checked against ``transformers`` (``--check``,
``cpkv bench kvdtype``, the tests): one definition, for every kv dtype and
every machine ([[RFC-0001:C-EXACTNESS]]).

A run is exact when

1. every stored value is a rounding of the reference's value that the
   format allows (:func:`~cpkv.models.round_trip.admit`): its own rounding,
   or, where the reference's value lies within float32's noise of a rounding
   boundary of bf16 or FP8, the neighbouring one (a *flip*, counted and
   reported); in float32, the reference's value within float32's noise;
2. every selection a DSA run made is the reference's own top-k at the same
   stored keys, or differs from it only between keys whose scores are within
   float32's noise (a *near-tie*, counted and reported)
   (:func:`~cpkv.models.selection.compare_selection`);
3. every logit is within :data:`TOLERANCE` of the reference's at those stored
   values and that selection, and every request's greedy tokens equal the
   reference's;
4. something was compared: the reference's cache received the run's stored
   values (``values_compared > 0``). A ``transformers`` that ignores the cache
   it is handed would otherwise compare the plain forward, a vacuous pass in
   float32 and a false failure in bf16 or FP8.

Why the format's tolerance sits at the stored values, not at the logits:
the engine computes a sequence in chunks and the reference whole, so their
float32 values differ by a few ulps, and which side of a bf16 or FP8
rounding boundary such a value falls on follows the CPU's kernels
(``ATEN_CPU_CAPABILITY``). One value stored a step apart moves logits by up
to ~1e-3 in FP8; one indexer score on the other side of a tie changes which
keys a query reads, ~1e-1. A logit tolerance wide enough for both would also
pass a wrong FP8 scale (a scale 10% off moves logits by ~2e-2). Checked
value by value, a flip is told from an error by where the reference's value
lies (at a boundary, or not); the reference then reads the run's values and
selection, so the logits differ by float32's arithmetic alone, and
float32's tolerance holds for every format.
"""

from __future__ import annotations

#: Max |logit difference| from the reference at the run's stored values and
#: selection, in every kv dtype (the rest is float32 arithmetic in another order).
TOLERANCE = 1e-4


def failures(c: dict | None, tolerance: float | None = None) -> list[str]:
    """Why the check ``c`` (:func:`~cpkv.engine.check.check`'s result) is not
    exact, one line per broken condition of the module doc; ``[]`` when it
    is. ``tolerance`` replaces the logits' (default ``c["tolerance"]``, else
    :data:`TOLERANCE`). ``None`` (no check ran) is a failure."""
    if c is None:
        return ["no check ran"]
    tol = c.get("tolerance", TOLERANCE) if tolerance is None else tolerance
    out = []
    if c["max_abs_diff"] > tol:
        out.append(f"max abs logit difference {c['max_abs_diff']:.3g} > tolerance {tol:g}")
    if c["requests_matched"] != c["requests"]:
        out.append(f"greedy tokens equal for {c['requests_matched']} of {c['requests']} requests "
                   f"(mismatched: {c['mismatched']})")
    a = c.get("agreement")
    compared = c.get("values_compared", a["values"] if a else None)
    if not compared:
        out.append(f"{compared or 0} stored values compared: the reference never received the run's cache")
    if a and a["outside"]:
        out.append(f"{a['outside']} of {a['values']} stored values are no rounding of the reference's "
                   f"(worst {a['worst_value']:.3g} of its slot's largest value)")
    if a and a["mismatches"]:
        out.append(f"{a['mismatches']} of {a['rows']} selections differ from the reference's top-k beyond a near-tie")
    return out
