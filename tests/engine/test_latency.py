"""Per-request latency in the engine's report: TTFT and TPOT p50/p99 in steps and
seconds, consistent with each request's own figures. [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

import numpy as np
import pytest

from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine.latency import LatencyClock, percentiles
from cpkv.engine.step_plan import StepPlan


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
