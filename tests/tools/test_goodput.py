"""Goodput (``cpkv simulate --goodput``): the boundary search on the rate grid, the early stop that may
never stop a run that could still meet its SLO, the sweep on a small trace (the rate found meets the SLO,
one grid step above does not, both checked by runs without any stop), and the command's flags."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.engine.mooncake import load_mooncake
from cpkv.tools.cli import main
from cpkv.engine.cost_model import CostModel
from cpkv.tools.goodput import (DEFAULT_TPOT_MS, DEFAULT_TTFT_S, Goodput, Slo, SloWatch, compare, goodput_rows,
                                p99s, rate, run_goodput, search, sweep, violators_to_fail)
from cpkv.tools.replay import ReplayConfig, replay

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake"
CONVERSATION = DATA / "conversation_trace.jsonl"


def small_trace(path: Path) -> Path:
    """48 requests of 12 conversations, each turn one block longer than the last, arrivals 0.2-1.2 s apart:
    on a group of 40 pages a rank and 8 running requests, TTFT grows from 0.04 s at 1x to over 0.5 s at
    about 45x (shared) and 20x (replicated)."""
    rng = np.random.default_rng(0)
    rows, t = [], 0
    for i in range(48):
        conv = i % 12
        ids = list(range(20 * conv, 20 * conv + 2 + i // 12))
        rows.append({"timestamp": t, "input_length": 512 * len(ids) - 100, "output_length": int(rng.integers(2, 40)),
                     "hash_ids": ids})
        t += int(rng.integers(200, 1200))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return load_mooncake(str(small_trace(tmp_path_factory.mktemp("goodput") / "t.jsonl")), lazy=True)


TOKEN = CostModel.for_dtype("replicated", 8, "bfloat16").kv_token_bytes
GROUP = ReplayConfig(kv_memory=int(40 * 64 * TOKEN), max_running=8, chunk=2048)
SLO = Slo(0.3, 50.0)


# -- the search ----------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(margins=st.lists(st.one_of(st.floats(-5, 5), st.just(float("inf"))), min_size=1, max_size=40),
       data=st.data())
def test_the_search_returns_a_point_that_passes_with_the_point_above_failing(margins, data):
    """Whatever the margins (monotone or not, measured or not): ``lo`` passes, ``hi = lo + 1`` fails, or the
    grid's end says why there is no such pair; every point is asked once at most; a monotone verdict gives its
    true edge."""
    k_min = data.draw(st.integers(-20, 0))
    k_max = k_min + len(margins) - 1
    start = data.draw(st.integers(k_min, k_max))
    coarse = data.draw(st.integers(1, 8))
    asked = []

    def margin(k):
        asked.append(k)
        return margins[k - k_min]

    passes = lambda k: margins[k - k_min] <= 0  # noqa: E731
    lo, hi = search(margin, start=start, coarse=coarse, k_min=k_min, k_max=k_max)
    assert len(asked) == len(set(asked))
    if lo is not None and hi is not None:
        assert hi == lo + 1 and passes(lo) and not passes(hi)
    elif hi is None:
        assert lo == k_max and passes(k_max)
    else:
        assert hi == k_min and not passes(k_min)
    verdicts = [passes(k) for k in range(k_min, k_max + 1)]
    if verdicts == sorted(verdicts, reverse=True):  # passes up to an edge, fails above it
        edge = k_min + sum(verdicts) - 1  # the last passing point (k_min - 1: none)
        assert (lo if lo is not None else k_min - 1) == edge


@settings(max_examples=100, deadline=None)
@given(edge=st.floats(-40, 140), slope=st.floats(0.01, 1.0))
def test_margins_that_rise_linearly_find_the_edge_in_few_runs(edge, slope):
    """Where the margin is a line in ``k`` (TPOT near its bound is close to one), the crossing is found in
    at most two runs past the doublings: the point the line predicts, and its neighbour."""
    asked = []

    def margin(k):
        asked.append(k)
        return slope * (k - edge)

    lo, hi = search(margin)
    if lo is not None and hi is not None:
        assert lo <= edge < hi
    doublings = len({0, *range(0, 129, 16), *range(0, -49, -16)} & set(asked))
    assert len(asked) - doublings <= 2, asked


@pytest.mark.parametrize("edge", [2, 9, 15])
def test_margins_that_jump_do_not_make_the_search_crawl(edge):
    """TTFT's margin jumps as the queue takes off: the line through the bracket's ends then points next to its
    low end every time; after two such steps a bisection, so at most three runs per halving of the bracket."""
    asked = []

    def margin(k):
        asked.append(k)
        return -1.0 if k < edge else 1e6

    assert search(margin, k_max=16) == (edge - 1, edge)
    assert len([k for k in asked if 0 < k < 16]) <= 3 * 4


def test_the_search_refuses_an_empty_grid():
    for kw in (dict(start=5, k_min=0, k_max=3), dict(start=0, k_min=1, k_max=0), dict(coarse=0)):
        with pytest.raises(ValueError, match="k_min <= start <= k_max"):
            search(lambda k: -1.0, **kw)


# -- the early stop ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(x=st.lists(st.floats(0, 100), min_size=1, max_size=300), bound=st.floats(0, 100))
def test_enough_values_above_a_bound_put_np_percentile_p99_above_it(x, bound):
    x = np.asarray(x)
    if int((x > bound).sum()) >= violators_to_fail(x.size):
        assert np.percentile(x, 99) > bound


@pytest.mark.parametrize("k,slos,stops", [
    (0, [SLO], False), (80, [SLO], False),  # 32x: p99 TTFT 0.295 s, just inside 0.3 s: never stopped
    (88, [SLO], True), (88, [SLO, Slo(1.0, 100)], False),  # 45x: p99 TTFT 0.61 s misses the first, meets the second
    (64, [Slo(5.0, 2.0)], True), (64, [Slo(0.05, 1000)], True),  # 16x: TPOT, then TTFT, past their bounds early
])
def test_a_stopped_run_is_one_that_fails_every_slo_and_a_run_that_meets_one_is_never_stopped(trace, k, slos, stops):
    """The same rate with the watch and without it: stopped only when the whole run misses every SLO, and
    then well before its end; not stopped, the same run (the same p99s)."""
    cfg = dataclasses.replace(GROUP, rate=rate(k))
    whole = replay(trace, "shared", cfg)
    watched = replay(trace, "shared", cfg, stop=SloWatch(slos, np.array([s.max_new_tokens for s in trace.specs])))
    assert watched.stopped == stops == (not any(s.met(*p99s(whole)) for s in slos))
    if stops:
        assert watched.steps < whole.steps
    else:
        assert p99s(watched) == p99s(whole) and watched.steps == whole.steps


def test_the_watch_counts_a_request_from_the_moment_it_is_sure_to_miss():
    """A TTFT is sure to miss once the first token, or the time waited without one, passes the bound; a TPOT
    once ``(finish or now - first) / (output - 1)`` does (one request: one is enough)."""
    from cpkv.tools.replay import Progress

    nan = float("nan")
    one = lambda now, first, finish, arrival=0.0: Progress(now, np.array([arrival]), np.array([first]),  # noqa: E731
                                                            np.array([finish]), np.array([False]))
    ttft = SloWatch([Slo(1.0, 1e9)], np.array([3]))  # 1 s
    assert not ttft(one(999.0, nan, nan)) and ttft(one(1001.0, nan, nan))  # waiting, no first token yet
    assert not ttft(one(5000.0, 1000.0, nan)) and ttft(one(1002.0, 1001.0, nan))  # its first token, on time or not
    assert not ttft(one(1001.0, nan, nan, arrival=500.0))  # arrived later: waited 0.5 s
    tpot = SloWatch([Slo(1e9, 10.0)], np.array([3]))  # 10 ms, two tokens after the first
    assert not tpot(one(19.9, 0.0, nan)) and tpot(one(20.1, 0.0, nan))  # still running: (now - first) / 2
    assert not tpot(one(999.0, 0.0, 20.0)) and tpot(one(999.0, 0.0, 20.2))  # finished: (finish - first) / 2
    assert not SloWatch([Slo(1e9, 10.0)], np.array([1]))(one(999.0, 0.0, 500.0))  # one token: no TPOT
    refused = Progress(5000.0, np.array([0.0]), np.array([nan]), np.array([nan]), np.array([True]))
    assert not ttft(refused)


def test_a_stopped_run_releases_everything_and_says_so(trace):
    """Stopped mid-trace: its running requests dropped (the replay's own leak check passes), the figures
    of what had finished; a stop test needs the modelled clock."""
    r = replay(trace, "replicated", dataclasses.replace(GROUP, rate=64.0), stop=lambda p: p.now > 500)
    assert r.stopped and 0 < r.finished < len(trace.specs) and r.ttft_ms.size <= len(trace.specs)
    assert np.isfinite(r.ttft_ms).all() and np.isfinite(r.tpot_ms).all()
    with pytest.raises(ValueError, match="clock='ms'"):
        replay(trace, "shared", GROUP, clock="steps", stop=lambda p: False)


def test_slo_and_watch_refuse_bad_bounds():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="finite number > 0"):
            Slo(bad, 100.0)
        with pytest.raises(ValueError, match="finite number > 0"):
            Slo(30.0, bad)
    with pytest.raises(ValueError, match="at least one SLO"):
        SloWatch([], np.ones(3))
    assert Slo(DEFAULT_TTFT_S, DEFAULT_TPOT_MS[0]).met(29.9, 100.0) and not Slo(30, 100).met(30.1, 1.0)


# -- the sweep -----------------------------------------------------------------------------------------
def test_the_goodput_found_meets_the_slo_and_one_step_above_does_not(trace):
    """Each mode on the small trace: the rate found met the SLO in a run without any stop, the grid point a
    step above missed it in one; the shared group, which keeps every conversation, sustains the higher rate."""
    found = {}
    for kv in ("shared", "replicated"):
        s = sweep(trace, kv, GROUP, [SLO])
        g = s.goodputs[0]
        assert g.lo is not None and g.hi == g.lo + 1, g
        at, above = (replay(trace, kv, dataclasses.replace(GROUP, rate=rate(k))) for k in (g.lo, g.hi))
        assert SLO.met(*p99s(at)) and not SLO.met(*p99s(above))
        assert p99s(s.runs[g.lo]) == p99s(at)  # the sweep's own run at lo is the run without a stop
        assert g.rate == rate(g.lo) and 1 < g.rate < rate(96)
        found[kv] = s
    assert found["shared"].goodputs[0].rate > found["replicated"].goodputs[0].rate
    both = run_goodput([("t", trace)], dtypes=["bfloat16"], base=GROUP, slos=[SLO], jobs=2)  # a process each
    assert [(x.kv, x.goodputs, sorted(x.runs)) for x in both] == \
        [(kv, found[kv].goodputs, sorted(found[kv].runs)) for kv in ("shared", "replicated")]
    assert [p99s(r) for x in both for r in x.runs.values()] == \
        [p99s(r) for kv in found for r in found[kv].runs.values()]


def test_goodput_rows_judge_the_first_slo_at_1_5x_and_the_rest_at_1x():
    a, b = Slo(1, 10), Slo(1, 20)
    assert compare(Goodput(a, 20, 21), Goodput(a, 10, 11), 1.5) == (f"{rate(20) / rate(10):.3f}", "met")
    assert compare(Goodput(a, 12, 13), Goodput(a, 10, 11), 1.5)[1] == "not met"
    assert compare(Goodput(a, None, -48), Goodput(a, None, -48), 1.0) == ("n/a", "n/a: neither meets it at the "
                                                                               "grid's bottom")
    assert compare(Goodput(a, 128, None), Goodput(a, 128, None), 1.0)[0] == "n/a"
    assert compare(Goodput(a, 128, None), Goodput(a, 10, 11), 1.0)[0].endswith("(at least)")
    assert Goodput(a, None, -48).text() == "< 0.125" and Goodput(a, 128, None).text() == ">= 256"

    @dataclasses.dataclass
    class Fake:
        trace: str
        kv: str
        config: ReplayConfig
        goodputs: list

    rows = goodput_rows([Fake("t", kv, ReplayConfig(), [Goodput(a, lo, lo + 1), Goodput(b, lo, lo + 1)])
                         for kv, lo in (("shared", 16), ("replicated", 0))])
    assert [(r["goal"], r["met"]) for r in rows] == [(">= 1.5", "met"), (">= 1", "met")]
    assert rows[0]["shared / replicated"] == "2.000" and rows[0]["a step above (missed)"] == "2.089 / 1.044"


# -- the command ---------------------------------------------------------------------------------------
def test_cpkv_simulate_goodput_prints_the_runs_the_goodputs_and_the_plot(tmp_path, capsys):
    path = small_trace(tmp_path / "t.jsonl")
    argv = ["simulate", "--workload", f"mooncake:{path}", "--requests", "24", "--goodput", "--kv-dtype", "bfloat16",
            "--host-memory", "0",
            "--kv-memory", str(GROUP.kv_memory), "--max-running", "8", "--chunk", "2048", "--slo-ttft", "0.3",
            "--slo-tpot", "50,400", "--no-progress"]
    assert main([*argv, "--plot", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "1: TTFT <= 0.3 s, TPOT <= 50 ms; 2: TTFT <= 0.3 s, TPOT <= 400 ms" in out
    assert "goodput: the highest rate multiple" in out and "capacity and prefix hits" in out
    assert (tmp_path / "g.png").stat().st_size > 0 and f"plot: {tmp_path / 'g.png'}" in out
    assert main([*argv, "--json", "--kv", "shared"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["slos"] == [{"ttft_s": 0.3, "tpot_ms": 50.0}, {"ttft_s": 0.3, "tpot_ms": 400.0}]
    assert {r["kv"] for r in got["runs"]} == {"shared (auto)"} and got["goodput"] == []


@pytest.mark.parametrize("flags,why", [
    (["--slo-ttft", "0"], "argument --slo-ttft: must be a finite number > 0, got 0"),
    (["--slo-ttft", "-2"], "argument --slo-ttft: must be a finite number > 0, got -2"),
    (["--slo-ttft", "soon"], "argument --slo-ttft: must be a number > 0, got 'soon'"),
    (["--slo-ttft", "inf"], "argument --slo-ttft: must be a finite number > 0, got inf"),
    (["--slo-tpot", "100,0"], "argument --slo-tpot: a comma list of numbers > 0: must be a finite number > 0, got 0"),
    (["--slo-tpot", "100,-5"], "argument --slo-tpot: a comma list of numbers > 0: must be a finite number > 0, got -5"),
    (["--slo-tpot", "fast"], "argument --slo-tpot: a comma list of numbers > 0: must be a number > 0, got 'fast'"),
    (["--slo-tpot", ""], "argument --slo-tpot: a comma list of numbers > 0: must be a number > 0, got ''"),
])
def test_bad_slo_values_are_refused_in_one_line(tmp_path, capsys, flags, why):
    path = small_trace(tmp_path / "t.jsonl")
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--workload", f"mooncake:{path}", "--goodput", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"cpkv simulate: error: {why}") and not any("Traceback" in x for x in err), err


@pytest.mark.parametrize("flags,why", [
    (["--slo-ttft", "5"], "--slo-ttft sets how --goodput runs; give --goodput too"),
    (["--slo-tpot", "100", "--jobs", "2"], "--slo-tpot sets how --goodput runs; give --goodput too"),
    (["--jobs", "2"], "--jobs sets how --goodput runs; give --goodput too"),
    (["--goodput", "--jobs", "100000"], "--jobs 100000: this machine has "),
    (["--goodput", "--rate", "2"], "--goodput sweeps the arrival rate of one decode split; it does not take --rate"),
    (["--goodput", "--markdown"], "--goodput sweeps the arrival rate of one decode split; it does not take --markdown"),
    (["--goodput", "--decode-split", "owner,lse"], "--goodput sweeps the arrival rate of one decode split; it does "
                                                   "not take --decode-split with two splits"),
])
def test_goodput_flags_that_do_not_fit_are_refused_before_any_run(tmp_path, capsys, flags, why):
    path = small_trace(tmp_path / "t.jsonl")
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--workload", f"mooncake:{path}", *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"cpkv simulate: error: {why}")
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--workload", "multiturn", "--goodput"])
    assert e.value.code == 2 and "--goodput do not apply to built-in traces" in capsys.readouterr().err


@pytest.mark.skipif(not CONVERSATION.is_file(), reason=f"the Mooncake traces are not at {DATA}")
def test_a_slice_of_the_conversation_trace_at_full_scale(tmp_path):
    """The real trace's first 30 requests on an H200 group with 4 GiB of KV a rank: the default SLO is met
    at 1x (the sweep starts there) and the goodput found is a grid point whose neighbour above missed."""
    trace = load_mooncake(str(CONVERSATION), requests=30, lazy=True)
    s = sweep(trace, "replicated", ReplayConfig(kv_memory=4 * 2**30), [Slo(DEFAULT_TTFT_S, DEFAULT_TPOT_MS[0])],
              k_max=48)
    g = s.goodputs[0]
    assert not s.runs[0].stopped and g.lo is not None and g.lo >= 0
    assert g.hi is None or (g.hi == g.lo + 1 and (s.runs[g.hi].stopped or not g.slo.met(*p99s(s.runs[g.hi]))))


def test_a_killed_command_leaves_no_sweep_process_running(tmp_path):
    """``--jobs``' sweep processes end with the command however it ends: SIGKILL of the command, which runs no
    Python code, ends its workers too (the kernel's parent-death signal)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = ("import os, sys, time\n"
              "from cpkv.tools.goodput import sweep_pool\n"
              "pool = sweep_pool(2)\n"
              "pids = {pool.submit(os.getpid).result() for _ in range(8)}\n"
              "[pool.submit(time.sleep, 120) for _ in range(2)]\n"
              "print(' '.join(map(str, sorted(pids))), flush=True)\n"
              "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(x) for x in p.stdout.readline().split()]
        assert workers and p.pid not in workers

        def alive(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{pid}/stat") as f:  # a zombie (ended, not yet reaped by init) counts as ended
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"

        assert all(alive(w) for w in workers)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(w) for w in workers), workers
    finally:
        p.kill()
        p.wait()
