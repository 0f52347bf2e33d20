"""Per-request latency in the engine's report: TTFT and TPOT p50/p99 in steps and
seconds, consistent with each request's own figures. [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

from types import SimpleNamespace

import numpy as np
import pytest

from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine.latency import STEP_KINDS, LatencyClock, percentiles, step_kind
from cpkv.engine.step_plan import Forward, StepPlan


def test_report_latency_is_consistent(llama):
    r = run_engine_threads(EngineConfig(cp_size=2, page_size=16, device_pages=10, host_pages=0, requests=4,
                                        scale=0.08, chunk=40), llama)
    lat = r["latency"]
    per = lat["requests"]
    assert len(per) == r["finished"] == r["requests"]
    assert lat["ttft_steps"]["count"] == lat["ttft_s"]["count"] == len(per)
    assert lat["tpot_steps"]["count"] == sum(x["generated"] > 1 for x in per)
    for key in ("ttft_steps", "ttft_s", "tpot_steps", "tpot_s"):
        assert lat[key]["p50"] <= lat[key]["p99"]
        vals = [x[key] for x in per if x[key] is not None]
        assert lat[key]["p50"] == pytest.approx(float(np.median(vals)))
        assert min(vals) <= lat[key]["p99"] <= max(vals)
    for x in per:
        assert x["arrival_step"] <= x["first_token_step"] <= x["finished_step"] < r["steps"]
        assert x["ttft_steps"] == x["first_token_step"] - x["arrival_step"] + 1 and x["ttft_s"] > 0
        if x["generated"] > 1:  # one decode step per further token at least
            assert x["tpot_steps"] >= 1.0 and x["tpot_s"] > 0
    assert sum(x["generated"] for x in per) == r["generated_tokens"]
    kinds = lat["step_s"]
    assert set(kinds) == set(STEP_KINDS) and kinds["decode"]["count"] > 0 and kinds["prefill"]["count"] > 0
    assert sum(k["count"] for k in kinds.values()) <= r["steps"]  # idle steps are skipped, never observed
    assert all(k["p50"] > 0 for k in kinds.values() if k["count"])


def _plan(step, decode, prefill):
    """A plan whose forward holds ``decode`` decodes then ``prefill`` chunks (only their counts matter)."""
    p = StepPlan(step)
    if decode or prefill:
        n = decode + prefill
        p.forward = Forward([SimpleNamespace()] * n, None, None, None, [False] * n, decode, None)
    return p


def test_step_seconds_by_kind():
    """Each observed step lasts from the end of the one before (or the start), filed under its kind."""
    clock = LatencyClock(10.0)
    plans = [(0, 1, 0, 11.0), (1, 1, 1, 14.0), (3, 0, 1, 16.0), (4, 1, 0, 18.0), (6, 0, 0, 18.5)]
    for step, d, f, now in plans:
        clock.observe(_plan(step, d, f), now)
    assert [step_kind(_plan(0, d, f)) for d, f in ((1, 0), (1, 1), (0, 1), (0, 0))] == list(STEP_KINDS)
    got = clock.step_seconds()
    assert got["decode"] == percentiles([1.0, 2.0]) and got["mixed"] == percentiles([3.0])
    assert got["prefill"] == percentiles([2.0]) and got["none"] == percentiles([0.5])
    assert LatencyClock(0.0).step_seconds() == {k: percentiles([]) for k in STEP_KINDS}


def test_clock_misuse_and_empty():
    clock = LatencyClock(0.0)
    clock.observe(StepPlan(0), 1.0)
    clock.observe(StepPlan(5), 2.0)  # steps 1-4 skipped (nothing ran): they take no time
    for step in (5, 4):
        with pytest.raises(ValueError, match=f"step {step} observed after step 5"):
            clock.observe(StepPlan(step), 3.0)
    assert clock.ends == [1.0, 2.0]
    assert clock.step_start([0, 1, 4, 5]).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert clock.step_end([0, 1, 4, 5]).tolist() == [1.0, 1.0, 1.0, 2.0]
    assert percentiles([]) == {"p50": None, "p99": None, "count": 0}
