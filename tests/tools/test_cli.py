"""The ``cpkv`` command: every flag validated while parsing (exit 2, the flag
named), groups this machine cannot hold refused before any process starts, a
failed rank and Ctrl-C reported in one line (exit 2 and 130), ``python -m cpkv``
the same command."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cpkv.engine.engine
import cpkv.runtime
import cpkv.runtime.sizing as sizing_mod
from cpkv.runtime.group import RankFailure
from cpkv.runtime.sizing import MachineCapacity
from cpkv.runtime.shm import mapped_segments, shm_segments
from cpkv.tools.cli import _subparser, build_parser, main

from support.proc_helpers import children, gone, semaphores_of, sigint_held_off, spawned_ranks, wait_until

CPKV = Path(sys.executable).with_name("cpkv")

# (argv, the flag the error must name); every option of every subcommand appears
BAD = [
    (["simulate", "--workload", "nope"], "--workload"),
    (["simulate", "--policies", "foo"], "--policies"),
    (["simulate", "--policies", "lane0,foo"], "--policies"),
    (["simulate", "--policies", "lane0,lane0"], "--policies"),
    (["simulate", "--policies", ""], "--policies"),
    (["simulate", "--cp", "0"], "--cp"),
    (["simulate", "--ranks", "-2"], "--ranks"),
    (["simulate", "--page", "0"], "--page"),
    (["simulate", "--page-size", "x"], "--page-size"),
    (["simulate", "--lane-pages", "0"], "--lane-pages"),
    (["simulate", "--admission", "all"], "--admission"),
    (["simulate", "--eviction", "fifo"], "--eviction"),
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--plot", "occupancy.jpg"], "--plot"),
    (["simulate", "--plot", "/no/such/folder/x.png"], "--plot"),
    (["simulate", "--json=yes"], "--json"),
    (["simulate", "--no-progress=yes"], "--no-progress"),
    (["simulate", "--no-prefix-wait=1"], "--no-prefix-wait"),
    (["run", "--cp", "0"], "--cp"),
    (["run", "--ranks", "two"], "--ranks"),
    (["run", "--timeout", "0"], "--timeout"),
    (["run", "--timeout", "-5"], "--timeout"),
    (["run", "--timeout", "nan"], "--timeout"),
    (["run", "--timeout", "inf"], "--timeout"),
    (["run", "--page", "0"], "--page"),
    (["run", "--page-size", "-1"], "--page-size"),
    (["run", "--model", "gpt"], "--model"),
    (["run", "--workload", "no-such-trace"], "--workload"),
    (["run", "--requests", "0"], "--requests"),
    (["run", "--scale", "0"], "--scale"),
    (["run", "--scale", "nan"], "--scale"),
    (["run", "--chunk", "0"], "--chunk"),
    (["run", "--device-pages", "0"], "--device-pages"),
    (["run", "--kv-memory", "0"], "--kv-memory"),
    (["run", "--kv-memory", "-64MiB"], "--kv-memory"),
    (["run", "--kv-memory", "64XB"], "--kv-memory"),
    (["run", "--kv-memory", "MiB"], "--kv-memory"),
    (["run", "--kv-memory", "1.5"], "--kv-memory"),  # a fraction of a byte
    (["run", "--kv-memory", "100"], "--kv-memory"),  # holds no page of 8 KiB
    (["run", "--kv-memory", "1MiB", "--device-pages", "8"], "--kv-memory"),  # one or the other
    (["run", "--disagg", "2:1", "--cp", "2"], "--disagg"),  # --disagg sets both group sizes
    (["run", "--kv", "copied"], "--kv"),
    (["run", "--kv-memory", "12parsecs"], "--kv-memory"),
    (["run", "--kv", "replicated", "--disagg", "1:1"], "--kv"),
    (["bench", "capacity", "--kv-memory", "0"], "--kv-memory"),
    (["bench", "capacity", "--ranks-as", "fibers"], "--ranks-as"),
    (["run", "--host-pages", "-1"], "--host-pages"),
    (["run", "--max-running", "0"], "--max-running"),
    (["run", "--admission", "maybe"], "--admission"),
    (["run", "--eviction", "LRU"], "--eviction"),
    (["run", "--prefill-split", "ring"], "--prefill-split"),
    (["run", "--decode-split", "page"], "--decode-split"),
    (["run", "--seed", "-1"], "--seed"),
    (["run", "--kv-dtype", "fp16"], "--kv-dtype"),
    (["run", "--check=1"], "--check"),
    (["run", "--check-plans=1"], "--check-plans"),
    (["run", "--tolerance", "-1"], "--tolerance"),
    (["run", "--tolerance", "nan"], "--tolerance"),
    (["run", "--plot", "occupancy.jpg"], "--plot"),
    (["run", "--json=1"], "--json"),
    (["run", "--no-progress=1"], "--no-progress"),
    (["run", "--no-prefix-wait=yes"], "--no-prefix-wait"),
    # cross-flag rules, checked after parsing and before anything runs
    (["run", "--prefill-split", "interleave", "--cp", "4", "--chunk", "3"], "--chunk"),
    (["run", "--device-pages", "1"], "--device-pages"),  # a request that could never fit the cache
    (["run", "--disagg", "4"], "--disagg"),
    (["run", "--disagg", "0:2"], "--disagg"),
    (["run", "--decode-page", "0"], "--decode-page"),
    (["run", "--decode-page", "8"], "--decode-page"),  # needs --disagg
    (["run", "--disagg", "2:1", "--plot", "occupancy.png"], "--plot"),
    (["run", "--disagg", "2:1", "--decode-page", "1", "--device-pages", "4"], "--workload"),  # the decode cache
    (["run", "--disagg", "3:1", "--prefill-split", "interleave", "--chunk", "2"], "--chunk"),
    (["run", "--kv-events", "127.0.0.1:5557"], "--kv-events"),
    (["run", "--kv-events", "tcp://127.0.0.1:99999"], "--kv-events"),  # ZMQ would bind port 34463
    (["run", "--kv-events", "tcp://127.0.0.1:*"], "--kv-events"),  # a router must know the port
    (["run", "--kv-events-replay", "tcp://127.0.0.1:5558"], "--kv-events-replay"),  # without --kv-events
    (["run", "--kv-events", "tcp://127.0.0.1:5557", "--kv-events-replay", "tcp://127.0.0.1:5557"],
     "--kv-events-replay"),
    (["run", "--kv-events-buffer", "0"], "--kv-events-buffer"),
    (["run", "--print-tokens=1"], "--print-tokens"),
    (["simulate", "--host-pages", "-1"], "--host-pages"),
    (["simulate", "--kv-events", "tcp://127.0.0.1:5557"], "--kv-events"),  # all workloads, three policies
    (["simulate", "--kv-events-replay", "tcp://127.0.0.1:5558"], "--kv-events-replay"),
    (["simulate", "--kv-events-buffer", "x"], "--kv-events-buffer"),
    (["run", "--kv-events", "tcp://127.0.0.1:5557", "--disagg", "2:1"], "--kv-events"),
    (["bytes", "--model", "llama"], "--model"),
    (["bytes", "--cp", "0"], "--cp"),
    (["bytes", "--index-topk-freq", "0"], "--index-topk-freq"),
    (["bytes", "--index-skip-topk-offset", "-1"], "--index-skip-topk-offset"),
    (["bytes", "--json=1"], "--json"),
    (["bench", "nope"], "what"),
    (["bench", "alloc", "--repeats", "0"], "--repeats"),
    (["bench", "splits", "--model", "glm"], "--model"),
    (["bench", "splits", "--cp", "0"], "--cp"),
    (["bench", "splits", "--tokens", "0"], "--tokens"),
    (["bench", "splits", "--bs", "0"], "--bs"),
    (["bench", "splits", "--decode-bs", "-1"], "--decode-bs"),
    (["bench", "splits", "--context", "0"], "--context"),
    (["bench", "splits", "--page", "0"], "--page"),
    (["bench", "splits", "--json=1"], "--json"),
    (["bench", "kernels", "--compile=yes"], "--compile"),
    (["bench", "scheduler", "--batches", "64,0"], "--batches"),
    (["bench", "scheduler", "--contexts", "4096,x"], "--contexts"),
    (["bench", "scheduler", "--steps", "0"], "--steps"),
    (["bench", "kvdtype", "--kv-dtype", "fp8,int8"], "--kv-dtype"),
    (["bench", "kvdtype", "--kv-dtype", "fp8,fp8"], "--kv-dtype"),
    (["run", "--kernels", "cuda"], "--kernels"),
    (["run", "--device", "tpu"], "--device"),
    (["bench", "kv", "--kernels", "cuda"], "--kernels"),
    (["bench", "plan", "--device", "cuda"], "--device"),  # refused without CUDA, and bench plan is CPU-only
    # Mooncake traces: cpkv run's slice of one, cpkv simulate's replay (its flags refused with built-in traces)
    (["run", "--workload", "mooncake:/no/such/trace.jsonl"], "--workload"),
    (["run", "--block-tokens", "0"], "--block-tokens"),
    (["run", "--block-tokens", "513"], "--block-tokens"),
    (["run", "--window", "0"], "--window"),
    (["run", "--max-output", "-1"], "--max-output"),
    (["run", "--step-ms", "0"], "--step-ms"),
    (["simulate", "--kv", "copied"], "--kv"),
    (["simulate", "--kv-memory", "1XB"], "--kv-memory"),
    (["simulate", "--kv-dtype", "float32"], "--kv-dtype"),
    (["simulate", "--host-memory", "0,lots"], "--host-memory"),
    (["simulate", "--decode-split", "page"], "--decode-split"),
    (["simulate", "--chunk", "0"], "--chunk"),
    (["simulate", "--max-running", "0"], "--max-running"),
    (["simulate", "--requests", "0"], "--requests"),
    (["simulate", "--rate", "0"], "--rate"),
    (["simulate", "--gpu-results", "/no/such/results.json"], "--gpu-results"),
    (["simulate", "--markdown=1"], "--markdown"),
    (["simulate", "--block-tokens", "0"], "--block-tokens"),
    (["simulate", "--window", "x"], "--window"),
    (["simulate", "--max-output", "0"], "--max-output"),
    (["simulate", "--workload", "longdoc", "--kv", "shared"], "--kv"),  # a replay flag with a built-in trace
    (["simulate", "--goodput=1"], "--goodput"),
    (["simulate", "--slo-ttft", "0"], "--slo-ttft"),
    (["simulate", "--slo-tpot", "100,-1"], "--slo-tpot"),
    (["simulate", "--jobs", "0"], "--jobs"),
    (["bench", "capacity", "--check=1"], "--check"),
    (["bench", "capacity", "--workload", "multiturn"], "--workload"),  # bench takes a Mooncake trace only
    (["bench", "alloc", "--workload", "README.md"], "--workload"),
    (["bench", "capacity", "--requests", "0"], "--requests"),
    (["bench", "capacity", "--block-tokens", "1000"], "--block-tokens"),
    (["bench", "capacity", "--window", "0"], "--window"),
    (["bench", "capacity", "--max-output", "0"], "--max-output"),
    (["bench", "capacity", "--step-ms", "-1"], "--step-ms"),
]


def _options(parser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            if not isinstance(a, argparse._HelpAction):
                yield name, a


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_refused_naming_its_flag(argv, flag, capsys):
    kids = set(children(os.getpid()))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"cpkv {argv[0]}: error:" in err and flag in err.splitlines()[-1], err
    assert set(children(os.getpid())) <= kids  # nothing was started


def test_every_option_of_every_subcommand_has_a_refusal_case():
    tried = {(a[0], f) for a, f in BAD}
    missing = [(name, a.option_strings or a.dest) for name, a in _options(build_parser())
               if not any((name, f) in tried for f in (a.option_strings or [a.dest]))]
    assert not missing, f"add a bad value for each of these to BAD: {missing}"


@pytest.mark.parametrize("argv", [[], ["nope"], ["run", "--dev", "3"], ["simulate", "--pol", "lane0"], ["-v"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_group_the_machine_cannot_hold_is_refused_before_it_starts(monkeypatch, capsys):
    kids = set(children(os.getpid()))
    for gib, argv, why in (
            (64, ["run", "--cp", "64"], "--cp 64: 64 ranks, more than this machine schedules (16 per core on 2 cores"),
            (4, ["run", "--cp", "16"], "--cp 16: 16 ranks, more than this machine schedules (16 per core on 2 cores, "
             "300.0 MiB each of 3.6 GiB usable: at most 12); give --cp 12 or fewer"),
            (8, ["run", "--cp", "4", "--device-pages", "2000000"], "--device-pages 2000000: the device cache takes "
             "61.0 GiB (2000000 pages of 8.0 KiB on each of 4 ranks), more than this machine can give beside the rest "
             "of the run (7.2 GiB usable); give --kv-memory 1.4GiB or less (--device-pages 192927)"),
            (8, ["run", "--cp", "8", "--timeout", "10"], "--timeout 10: starting 8 ranks takes at least 20 s on 2 cores")):
        monkeypatch.setattr(sizing_mod, "machine_capacity", lambda gib=gib: MachineCapacity(gib * 2**30, 2))
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("cpkv run: error: ") and why in err[0], err
    assert set(children(os.getpid())) <= kids


def test_a_failed_rank_is_one_line_and_exit_2(monkeypatch, capsys):
    def fail(cfg):
        raise RankFailure(1, "RuntimeError: injected\nsecond line", details="Traceback (most recent call last): ...")

    monkeypatch.setattr(cpkv.engine.engine, "run_engine", fail)
    assert main(["run", "--cp", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "cpkv run: rank 1 failed: RuntimeError: injected second line\n"


def test_ctrl_c_in_process_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpkv.engine.engine, "run_engine", interrupted)
    assert main(["run", "--cp", "2"]) == 130
    assert capsys.readouterr().err == "cpkv run: interrupted\n"


@pytest.mark.multiproc
def test_kv_dtype_flag_reaches_the_run_config_and_the_bench():
    """``--kv-dtype`` on ``run`` (one value, default float32) reaches the engine
    and the disaggregated configuration; on ``bench`` it is a comma list
    (default all three). [[RFC-0001:C-KV-FORMAT]]"""
    p = build_parser()
    base = ["run", "--cp", "2", "--requests", "2", "--scale", "0.05"]
    for extra, want in (([], "float32"), (["--kv-dtype", "fp8"], "fp8"), (["--kv-dtype", "bfloat16"], "bfloat16")):
        a = p.parse_args(base + extra)
        a.validate(a, p)
        assert a.config.kv_dtype == want
    a = p.parse_args(base[:1] + base[3:] + ["--kv-dtype", "fp8", "--disagg", "1:1"])  # --disagg takes no --cp
    a.validate(a, p)
    assert a.config.kv_dtype == a.config.d_kv_dtype == "fp8" and a.config.decode_size == 1
    for argv, want in ((["bench", "kvdtype"], ["float32", "bfloat16", "fp8"]),
                       (["bench", "kvdtype", "--kv-dtype", "fp8,bfloat16"], ["fp8", "bfloat16"])):
        a = p.parse_args(argv)
        a.validate(a, _subparser(p, "bench"))  # a flag not given takes its default here
        assert a.kv_dtype == want


def test_cli_run_reports_and_fails_on_a_large_difference(capsys, monkeypatch, tmp_path):
    png = tmp_path / "occ.png"
    argv = ["run", "--cp", "2", "--requests", "2", "--scale", "0.05", "--device-pages", "6", "--host-pages", "24",
            "--check", "--no-progress"]
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["ranks"]) == 2 and report["check"]["max_abs_diff"] < 1e-4
    assert report["check"]["requests_matched"] == report["requests"]
    full = dict(report, occupancy=[[1, 2]], host_occupancy=[3], sequences=[])
    full["check"] = dict(report["check"], max_abs_diff=1e-3)  # the same run with a difference over tolerance
    monkeypatch.setattr(cpkv.engine.engine, "run_engine", lambda cfg: full)
    assert main(argv + ["--plot", str(png)]) == 1
    out = capsys.readouterr()
    assert "per rank:" in out.out and "FAIL: max abs logit difference 0.001" in out.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiproc
@pytest.mark.parametrize("phase", ["starting", "decoding", "decoding with the bar"])
def test_ctrl_c_to_the_real_command(phase, tmp_path):
    """SIGINT to the whole process group of ``cpkv run`` (as a terminal's Ctrl-C
    does) while its ranks start up or while they decode: one line, exit 130,
    and nothing left - no rank, no segment, no semaphore, no temporary folder.
    With the progress bar on, what the run finished is a line of its own, not
    glued to the bar the rank left mid-line."""
    run_tmp = tmp_path / "tmp"
    run_tmp.mkdir()
    trace = tmp_path / "long.jsonl"  # one request decoding for thousands of steps
    trace.write_text(json.dumps({"id": "a", "arrival": 0, "tokens": list(range(40)), "max_new_tokens": 3000}) + "\n")
    bar = phase.endswith("bar")
    p = subprocess.Popen([str(CPKV), "run", "--cp", "2", "--workload", str(trace), "--device-pages", "128",
                          "--timeout", "3000", *([] if bar else ["--no-progress"])],
                         start_new_session=True, env={**os.environ, "TMPDIR": str(run_tmp)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def ready():
            if phase == "starting":  # both rank processes exist, still importing
                return len(spawned_ranks(p.pid)) == 2 or p.poll() is not None
            # both ranks map the KV segment: the group is set up and running
            return len([k for k in children(p.pid) if mapped_segments(k)]) == 2 or p.poll() is not None

        assert wait_until(ready, 120, 0.05) and p.poll() is None, p.communicate()
        kids = children(p.pid)
        assert all(sigint_held_off(k) for k in spawned_ranks(p.pid)), "a rank would take the Ctrl-C itself"
        if phase.startswith("decoding"):
            # each name goes once both ranks have it; the host tier's (host_k, host_v) may still be between
            # its creation and the second barrier here, the more so on a loaded machine
            assert wait_until(lambda: not shm_segments(p.pid), 10), shm_segments(p.pid)
            assert not semaphores_of(p.pid, *kids)
            time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert (p.returncode, out) == (130, "")
    before = r"cpkv run: stopped before the first step: 0 of 1 requests finished"
    at = r"cpkv run: stopped at step \d+: 0 of 1 requests finished, \d+ tokens generated \(\d+ computed\)"
    said = before if phase == "starting" else f"(?:{at}|{before})"  # a loaded machine may not have stepped yet
    if bar:  # the bar's frames (each after a carriage return, read here as a line), then the two lines
        frames, err = err.splitlines(keepends=True)[:-2], "".join(err.splitlines(keepends=True)[-2:])
        assert frames and all(f.startswith("steps: ") or not f.strip() for f in frames), frames
    assert re.fullmatch(said + "\ncpkv run: interrupted\n", err), err
    assert wait_until(lambda: all(gone(k) for k in kids), 10), [k for k in kids if not gone(k)]
    assert not shm_segments(p.pid)
    assert not list(run_tmp.glob("cpkv_*"))


@pytest.mark.multiproc
def test_ctrl_c_at_any_moment_after_the_interpreter_started(tmp_path):
    """SIGINT to ``python -m cpkv run`` while it imports, parses, checks, starts its ranks and runs: each time
    one line, exit 130, no traceback, nothing left (the interpreter's own start-up, before the first line of
    cpkv runs, is the one moment left open)."""
    run_tmp = tmp_path / "tmp"
    run_tmp.mkdir()
    for delay in (0.25, 0.8, 2.5):  # importing, checking and parsing, the ranks starting
        p = subprocess.Popen([sys.executable, "-m", "cpkv", "run", "--cp", "2", "--requests", "2", "--scale", "0.05",
                              "--no-progress"], start_new_session=True, env={**os.environ, "TMPDIR": str(run_tmp)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        kids = children(p.pid)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
        lines = err.splitlines()
        # -SIGINT: CPython 3.11 can end the process by SIGINT at exit after a KeyboardInterrupt passed through one
        # of its PyRun_* calls (its flag for an unhandled interrupt stays set), even one cpkv then caught; seen once
        # under load, after the one line; a shell reports it as 130 too
        assert p.returncode in (130, -signal.SIGINT, 0) and "Traceback" not in err, (delay, p.returncode, err)
        if p.returncode != 0:  # (0: a loaded machine let the short run finish first)
            assert out == "" and lines[-1] in ("cpkv: interrupted", "cpkv run: interrupted"), (delay, err)
            assert all(x.startswith("cpkv") for x in lines), (delay, err)
        assert wait_until(lambda: all(gone(k) for k in kids), 10), (delay, [k for k in kids if not gone(k)])
        assert not shm_segments(p.pid) and not list(run_tmp.glob("cpkv_*")), delay


def _python_m(*argv):
    return subprocess.run([sys.executable, "-m", "cpkv", *argv], capture_output=True, text=True, timeout=120)


def test_python_m_cpkv_is_the_command():
    r = _python_m("--help")
    assert r.returncode == 0 and "usage: cpkv" in r.stdout and all(c in r.stdout for c in ("simulate", "run", "bench"))
    r = _python_m("run", "--timeout", "0")
    assert r.returncode == 2 and "cpkv run: error: argument --timeout" in r.stderr
    r = _python_m("simulate", "--workload", "longdoc", "--policies", "lane0", "--lane-pages", "4096", "--json",
                  "--seed", "1")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["policy"] for row in rows] == ["lane0"] and rows[0]["workload"] == "longdoc"
