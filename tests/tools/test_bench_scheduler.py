"""``cpkv bench scheduler``: the scheduler alone, timed per decode step, on a
tiny configuration (the figures are timings: only their shape and the
workload's own counts are checked). [[RFC-0001:C-PREFIX-CACHE]]"""

import pytest

from cpkv.tools.bench import scheduler_step as sb
from cpkv.tools.bench.scheduler_step import bench_scheduler, scheduler_case
from cpkv.tools.cli import main


def test_a_case_times_every_decode_step_and_shares_the_document():
    row = scheduler_case(6, 200, steps=5, cp_size=4, page_size=16)
    # every decode step with the whole batch running is timed: the first request decodes alone while the
    # others arrive (one step), then all six decode together until they finish in the same step
    assert row["batch"] == 6 and row["context"] == 200 and row["steps timed"] >= 4
    assert 0 < row["median ms"] <= row["p99 ms"] <= row["max ms"]
    assert row["us/request"] == pytest.approx(row["median ms"] * 1e3 / 6, rel=0.01)
    assert 0 < row["cpu median ms"] <= row["cpu max ms"]
    assert row["cpu us/request"] == pytest.approx(row["cpu median ms"] * 1e3 / 6, rel=0.01)
    # the five later requests share the document's full pages, cached while the first request ran
    assert row["hit rate"] >= 5 * (199 // 16 * 16) / (6 * 200)


def test_one_row_per_batch_and_context_with_medians_over_interleaved_rounds(monkeypatch):
    """Every case runs once per round, the rounds one after another; a figure
    in time is its median over the rounds, a count is the case's own."""
    calls = []
    real = sb.scheduler_case

    def timed(batch, context, **kw):  # the real case, its times replaced by one per call
        row = real(batch, context, **kw)
        calls.append((batch, context))
        return dict(row, **{k: float(len(calls) ** 2) for k in sb.TIMED})

    monkeypatch.setattr(sb, "scheduler_case", timed)
    rows = sb.bench_scheduler(batches=(2, 3), contexts=(40, 70), steps=2, cp_size=2, page_size=8, rounds=3)
    assert calls == [(2, 40), (2, 70), (3, 40), (3, 70)] * 3  # interleaved: each round runs every case
    assert [(r["batch"], r["context"], r["rounds"]) for r in rows] == [(2, 40, 3), (2, 70, 3), (3, 40, 3), (3, 70, 3)]
    assert [r["max ms"] for r in rows] == [25.0, 36.0, 49.0, 64.0]  # the median of calls i, i + 4, i + 8, squared
    assert all(r["steps timed"] >= 1 and r["hit rate"] > 0 for r in rows)


def test_rounds_that_schedule_differently_are_refused(monkeypatch):
    """The counts of a case are the same in every round, or the bench refuses to report it."""
    real, calls = sb.scheduler_case, []

    def drifting(batch, context, **kw):
        calls.append(1)
        return dict(real(batch, context, **kw), **({"steps timed": 1} if len(calls) == 2 else {}))

    monkeypatch.setattr(sb, "scheduler_case", drifting)
    with pytest.raises(RuntimeError, match="scheduled differently"):
        sb.bench_scheduler(batches=(2,), contexts=(40,), steps=2, cp_size=2, page_size=8, rounds=2)


def test_a_case_that_cannot_run_is_a_clean_error(capsys):
    """A context too short for the whole batch to decode together: exit 2 and one line, no traceback."""
    assert main(["bench", "scheduler", "--batches", "64", "--contexts", "100", "--steps", "4", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpkv bench scheduler: no decode step ran the whole batch of 64") and "Traceback" not in err


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="batch, context and steps"):
        scheduler_case(0, 100)
    with pytest.raises(ValueError, match="rounds"):
        bench_scheduler(batches=(2,), contexts=(40,), rounds=0)


def test_the_command_prints_the_table(capsys):
    assert main(["bench", "scheduler", "--batches", "2,4", "--contexts", "100", "--steps", "3", "--cp", "2",
                 "--page", "16", "--repeats", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("scheduler: no model, N 2, page 16, 3 decode steps") and "load average" in out[0] and "2 interleaved rounds" in out[0]
    assert out[1].split()[:2] == ["batch", "context"] and "median" in out[1] and "us/request" in out[1]
    assert [line.split()[:2] for line in out[2:4]] == [["2", "100"], ["4", "100"]]
