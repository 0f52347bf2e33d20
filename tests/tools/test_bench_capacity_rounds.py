"""``cpkv bench capacity`` over rounds: the modes interleaved, figures in time as
medians, their ratios the median of the ratios measured in the same round, and
rounds that scheduled differently refused. No engine runs here: the runs are
stand-ins with the report's shape."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.engine import EngineConfig
from cpkv.engine.trace import RequestSpec
from cpkv.tools.bench import capacity
from cpkv.tools.bench.capacity import TIMED_FIGURES, capacity_rows, measure_capacity, timed

BASE = EngineConfig(cp_size=2, page_size=16, kv_memory=64 * 2**10)


def fake_report(kv: str, tpot_p99: float = 0.01, steps: int = 10, tps: float = 100.0) -> dict:
    """A trace report with the fields the benchmark reads (times in seconds), its check passed."""
    per = [{"id": "a", "arrival_step": 0, "first_token_step": 2, "finished_step": steps, "generated": 4,
            "preemptions": 0, "ttft_steps": 3, "ttft_s": 0.02, "tpot_steps": 1.0, "tpot_s": tpot_p99}]
    lat = {"ttft_steps": {"p50": 3.0, "p99": 3.0}, "ttft_s": {"p50": 0.02, "p99": 0.02},
           "tpot_steps": {"p50": 1.0, "p99": 1.0}, "tpot_s": {"p50": tpot_p99 / 2, "p99": tpot_p99},
           "requests": per, "step_s": {"decode": {"p50": tpot_p99 / 2}, "prefill": {"p50": 0.004},
                                       "mixed": {"p50": tpot_p99 if kv == "shared" else None}}}
    return {"config": {"kv": kv}, "check": {"requests": 1, "requests_matched": 1, "max_abs_diff": 0.0,
                                       "values_compared": 4096},
            "requests": 1, "finished": 1, "steps": steps, "preemptions": 0, "evicted_pages": 0,
            "device_hit_rate": 0.5, "tokens_per_second": tps, "latency": lat}


def tpot_reports(kv: str, p99s) -> list[dict]:
    return [fake_report(kv, tpot_p99=float(x)) for x in p99s]


def test_step_kinds_are_timed_figures():
    """The median step of each kind is a figure in time; a kind one mode never ran (the replicated group's
    mixed steps, ``None``) gives an infinite ratio, not an error."""
    def with_steps(kv, decode, mixed):
        x = fake_report(kv)
        x["latency"]["step_s"] = {"decode": {"p50": decode}, "mixed": {"p50": mixed}, "prefill": {"p50": 0.004}}
        return x

    s, r = [with_steps("shared", 0.006, 0.010)], [with_steps("replicated", 0.003, None)]
    assert timed(s, r, "decode_step_s_p50") == pytest.approx((6.0, 3.0, 2.0))
    assert timed(s, r, "mixed_step_s_p50") == (pytest.approx(10.0), 0.0, float("inf"))
    assert timed(s, r, "prefill_step_s_p50")[2] == pytest.approx(1.0)


def test_timed_is_the_median_of_same_round_ratios():
    s, r = tpot_reports("shared", [0.001, 0.010, 0.003]), tpot_reports("replicated", [0.002, 0.005, 0.001])
    a, b, ratio = timed(s, r, "tpot_s_p99")
    assert (a, b) == pytest.approx((3.0, 2.0))  # medians, in ms
    assert ratio == pytest.approx(2.0)  # median of 0.5, 2 and 3, not 3 / 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-4, 1.0), st.floats(1e-4, 1.0), st.floats(0.5, 20.0)), min_size=1,
                max_size=7), st.randoms(use_true_random=False))
def test_a_slow_round_slows_both_modes_and_cancels(rounds, rnd):
    """The ratio is the median of the per-round ratios: it does not change when a
    round is slower for both modes by one factor, nor with the order of the rounds."""
    s = [x for x, _, _ in rounds]
    r = [y for _, y, _ in rounds]
    slow = [k for _, _, k in rounds]
    ratio = timed(tpot_reports("shared", s), tpot_reports("replicated", r), "tpot_s_p99")[2]
    assert ratio == pytest.approx(float(np.median(np.array(s) / np.array(r))))
    loaded = timed(tpot_reports("shared", np.multiply(s, slow)), tpot_reports("replicated", np.multiply(r, slow)),
                   "tpot_s_p99")[2]
    assert loaded == pytest.approx(ratio)
    order = list(range(len(s)))
    rnd.shuffle(order)
    shuffled = timed(tpot_reports("shared", [s[i] for i in order]), tpot_reports("replicated", [r[i] for i in order]),
                     "tpot_s_p99")[2]
    assert shuffled == pytest.approx(ratio)


def test_timed_zero_figures():
    z = [fake_report("shared", tpot_p99=0.0)], [fake_report("replicated", tpot_p99=0.0)]
    assert timed(*z, "tpot_s_p99")[2] == 1.0
    assert timed(tpot_reports("shared", [0.01]), z[1], "tpot_s_p99")[2] == float("inf")


def test_timed_misuse():
    s, r = tpot_reports("shared", [0.01, 0.02]), tpot_reports("replicated", [0.01, 0.02])
    with pytest.raises(ValueError, match="unknown timed figure"):
        timed(s, r, "tpot_steps_p99")
    with pytest.raises(ValueError, match="same number of rounds"):
        timed(s, r[:1], "tpot_s_p99")
    with pytest.raises(ValueError, match="same number of rounds"):
        timed([], [], "tpot_s_p99")
    assert set(TIMED_FIGURES) == {"tokens_per_second", "ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "tpot_s_p99",
                                  "decode_step_s_p50", "mixed_step_s_p50", "prefill_step_s_p50"}


class FakeRuns:
    """Stand-ins for the engine's runs: every run recorded in ``calls`` as
    ``(kind, mode)``; a trace run's report is ``make(mode, i)`` (``i``: that
    mode's i-th trace run)."""

    def __init__(self):
        self.calls, self.made, self.ranks = [], {"shared": 0, "replicated": 0}, set()
        self.make = lambda mode, i: fake_report(mode, tpot_p99=0.01 * (i + 1))

    def run_specs(self, cfg, specs, ranks):
        kind = "longest" if [s.id for s in specs] == ["long"] else "trace"
        self.calls.append((kind, cfg.kv))
        self.ranks.add(ranks)
        if kind == "longest":
            return fake_report(cfg.kv)
        self.made[cfg.kv] += 1
        return self.make(cfg.kv, self.made[cfg.kv] - 1)


@pytest.fixture
def fake_runs(monkeypatch):
    runs = FakeRuns()
    monkeypatch.setattr(capacity, "_run_specs", runs.run_specs)
    monkeypatch.setattr(capacity, "longest_prompt", lambda cfg, new_tokens: 40)
    monkeypatch.setattr(capacity, "_refuse_unless_trace_fits", lambda cfg, specs: None)  # BASE's cache is tiny
    return runs


def test_rounds_interleave_the_modes(fake_runs):
    m = measure_capacity(BASE, rounds=3)
    assert [c for c in fake_runs.calls if c[0] == "trace"] == [
        ("trace", "shared"), ("trace", "replicated"), ("trace", "replicated"), ("trace", "shared"),
        ("trace", "shared"), ("trace", "replicated")]
    for mode in ("shared", "replicated"):
        assert len(m[mode]["traces"]) == 3 and m[mode]["trace"] is m[mode]["traces"][0]
    rows = {x["figure"]: x for x in capacity_rows(m)}
    tpot = rows["trace: TPOT p99 (ms, median of 3)"]
    assert (tpot["shared"], tpot["replicated"], tpot["shared / replicated"]) == ("20.000", "20.000", "1.00")
    assert rows["trace: TPOT p99 (steps)"]["shared / replicated"] == "1.00"
    decode = rows["trace: decode-only step, p50 (ms, median of 3)"]
    assert (decode["shared"], decode["replicated"], decode["shared / replicated"]) == ("10.000", "10.000", "1.00")
    mixed = rows["trace: step of decodes and a prefill chunk, p50 (ms, median of 3)"]
    assert (mixed["shared"], mixed["replicated"], mixed["shared / replicated"]) == ("20.000", "0.000", "-")


@pytest.mark.parametrize("field", ["steps", "finished_step"])
def test_rounds_that_schedule_differently_are_refused(fake_runs, field):
    def make(mode, i):
        r = fake_report(mode)
        if mode == "replicated" and i == 1:
            if field == "steps":
                r["steps"] += 1
            else:
                r["latency"]["requests"][0]["finished_step"] += 1
        return r

    fake_runs.make = make
    with pytest.raises(RuntimeError, match="replicated: round 1 scheduled differently"):
        measure_capacity(BASE, rounds=2)
    fake_runs.make = lambda mode, i: fake_report(mode, tpot_p99=0.01 * (i + 1))  # only times differ: taken
    assert len(measure_capacity(BASE, rounds=2)["shared"]["traces"]) == 2


def test_a_failed_check_in_any_round_is_refused(fake_runs):
    def make(mode, i):
        r = fake_report(mode)
        if i == 2:
            r["check"] = {**r["check"], "max_abs_diff": 1.0}
        return r

    fake_runs.make = make
    with pytest.raises(capacity.CheckFailed):
        measure_capacity(BASE, rounds=3)


def test_every_run_starts_its_ranks_as_asked(fake_runs, monkeypatch):
    """Processes by default (as a deployment runs them), threads on request;
    ``_run_specs`` starts them with the engine's matching runner."""
    measure_capacity(BASE, rounds=1)
    assert fake_runs.ranks == {"processes"}
    fake_runs.ranks.clear()
    measure_capacity(BASE, rounds=1, ranks="threads")
    assert fake_runs.ranks == {"threads"}
    monkeypatch.undo()
    from cpkv.engine import engine

    started = []
    monkeypatch.setattr(engine, "run_engine", lambda cfg: started.append(("processes", cfg.workload)) or {})
    monkeypatch.setattr(engine, "run_engine_threads", lambda cfg: started.append(("threads", cfg.workload)) or {})
    for ranks in ("processes", "threads"):
        capacity._run_specs(BASE, [RequestSpec("a", 0, (1, 2), 2)], ranks)
    assert [k for k, _ in started] == ["processes", "threads"] and all(w.endswith(".jsonl") for _, w in started)


def test_unknown_ranks_are_refused(fake_runs):
    with pytest.raises(ValueError, match="unknown ranks"):
        measure_capacity(BASE, rounds=1, ranks="fibers")
    assert fake_runs.calls == []


def test_measure_capacity_refuses_bad_rounds(fake_runs):
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="rounds must be an int >= 1"):
            measure_capacity(BASE, rounds=bad)
    assert fake_runs.calls == []  # refused before any run
