"""``cpkv bench alloc`` on a small pool: every row's baselines return what the
allocator returns (the benchmark asserts it before timing), and each row
carries its ratios, goal and verdict."""

import pytest

from cpkv.tools.bench import bench_alloc
from cpkv.tools.bench.alloc import ARANGE_GOAL, GOALS, goals_met


def test_a_small_bench_alloc_agrees_with_its_baselines():
    rows = bench_alloc(page=4, cp=2, pool_pages=256, tokens=64, batch_sizes=(1, 4), decode_bs=8, repeats=1)
    assert [r["case"].split(" (")[0] for r in rows] == [
        "extend bs=1", "extend bs=4", "extend bs=4 ragged", "decode bs=8", "free of 16 pages by slots",
        "free_pages of 16 pages"]
    for r in rows:
        assert r["cp2/deque"] > 0 and r["cp2/cp1"] > 0
        assert r["goal"] == f"<= {next(v for k, v in GOALS.items() if r['case'].startswith(k))}"
        assert (r["cp2/arange"] != "-") == r["case"].startswith("extend")
        assert r["met"] == goals_met(r["cp2/deque"], r["cp2/arange"], float(r["goal"][3:]))


@pytest.mark.parametrize("deque, arange, want", [
    (0.4, 2.0, "yes"), (0.41, 2.0, "no (deque)"), (0.4, 2.01, "no (arange)"), (0.5, 3.0, "no (both)"),
    (0.39, "-", "yes"), (0.5, "-", "no (deque)"),
])
def test_goals_met_is_at_most_each_goal(deque, arange, want):
    """At the goal is met; past either ratio is not, and the verdict names which."""
    assert ARANGE_GOAL == 2.0 and goals_met(deque, arange, 0.4) == want


def test_each_row_is_judged_against_its_own_goal(monkeypatch):
    """With every case timed alike (cp 0.45 of the deque, 1.5x arange), the
    rows differ only by their goals: extend at bs 1 (0.6), decode (0.5) and
    free (1.0) meet theirs, extend past bs 1 (0.4) does not."""
    from cpkv.tools.bench import alloc

    times = {"cp": 0.45, "deque": 1.0, "arange": 0.3, "cp1": 1.0}
    monkeypatch.setattr(alloc, "median_seconds", lambda cases, repeats: {k: times[k] for k in cases})
    rows = bench_alloc(page=4, cp=2, pool_pages=256, tokens=64, batch_sizes=(1, 4), decode_bs=8, repeats=1)
    assert {r["case"].split(" (")[0]: r["met"] for r in rows} == {
        "extend bs=1": "yes", "extend bs=4": "no (deque)", "extend bs=4 ragged": "no (deque)", "decode bs=8": "yes",
        "free of 16 pages by slots": "yes", "free_pages of 16 pages": "yes"}
