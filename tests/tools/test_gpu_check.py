"""tools/gpu_check.py, the one prepared device run, proven on the CPU before a GPU is spent: its dry run
runs every step at tiny sizes and fills every section of the same results.json, every engine configuration
run for real (the same flags, on the CPU); a failing step or engine run is reported (as it ends, with the tail
of its output; the summary last; exit 1); a step past its deadline is stopped with what it started, and no
wait is unbounded; a misuse exits 2, and so does a run without a GPU, writing nothing."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("tools_gpu_check", SCRIPT)
gpu_check = sys.modules["tools_gpu_check"] = importlib.util.module_from_spec(_spec)  # the script, as a module
_spec.loader.exec_module(gpu_check)


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


STEPS = ["versions", "kernels", "decode", "sparse_mla", "indexer", "store", "prefill", "lse_split", "engine", "ipc"]
BENCHES = {"decode": "batch", "sparse_mla": "heads", "indexer": "context", "store": "tokens", "prefill": "ratio",
           "lse_split": "vs_one_rank"}  # a field of each bench section's rows


@pytest.mark.multiproc
def test_the_dry_run_fills_every_section_of_the_same_results(tmp_path):
    """Every step's function, on the CPU at tiny sizes, in a process of its own: the kernels against the
    reference (each kind, plain and FP8, the segment table), every timed kernel section with its baseline,
    every engine run (float32, bfloat16 and FP8 each at N 1, 2 and 4) run and judged exact with stored values
    compared, the evicting ones with their round trip, the host tier recorded, N = 2 ranks' own segments
    read through the table after the fence."""
    out = tmp_path / "out"
    p = _run("--dry-run", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(x.name for x in out.iterdir()) == ["log.txt", "results.json"]
    r = json.loads((out / "results.json").read_text())
    assert r["ok"] and r["dry_run"] and list(r["steps"]) == STEPS
    s = {name: step["section"] for name, step in r["steps"].items()}
    assert all(step["ok"] and step["seconds"] <= step["deadline_s"] for step in r["steps"].values())
    spans = [(x["started_s"], x["ended_s"]) for x in r["steps"].values()]
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)  # started in order
    at_once = [sum(a <= t < b for a, b in spans) for t, _ in spans]  # steps running when each one starts
    assert max(at_once) == gpu_check.DRY_LANES == 2 and gpu_check.LANES == 1  # two lanes on the CPU, one on a GPU
    assert not s["versions"]["missing"] and s["versions"]["packages"]["torch"] == torch.__version__
    cases = s["kernels"]["cases"]
    assert {c["shape"] for c in cases} == {f"{k}-small{f}" for k in ("gqa", "mla", "indexer") for f in ("", "-fp8")}
    assert all(c["checks"] for c in cases) and all(c["checks"]["store"] == 0.0 for c in cases if "gqa" in c["shape"])
    assert {k for c in cases for k in c["checks"] if k.endswith("_table")} == {
        "paged_attention_table", "sparse_mla_attention_table", "index_scores_table"}
    for name, field in BENCHES.items():
        assert s[name]["rows"] and all(field in row for row in s[name]["rows"]), name
        assert s[name]["goal"] and s[name]["goal_met"] is None and s[name]["timing"], name
        if name not in ("prefill", "lse_split"):
            assert s[name]["copy"]["bytes_per_second"] > 0 and all(x["fraction_of_copy"] > 0 for x in s[name]["rows"])
    runs, planned = s["engine"]["runs"], gpu_check.engine_runs(False)
    assert list(runs) == [run.name for run in planned]
    assert all(x["ok"] and x["values_compared"] > 0 and x["max_abs_diff"] < 1e-4 and x["requests_matched"]
               == x["requests"] and "--device cpu" in x["command"] for x in runs.values())
    cp = {run.name: int(run.flags[run.flags.index("--cp") + 1]) for run in planned}
    assert {(x["kv_dtype"], cp[n]) for n, x in runs.items()} >= {
        (dt, n) for dt in ("float32", "bfloat16", "fp8") for n in (1, 2, 4)}
    for run in planned:
        if run.evicts:
            assert runs[run.name]["backup_pages"] > 0 and runs[run.name]["load_pages"] > 0
            assert runs[run.name]["host_pinned"] == [False] * cp[run.name]
    assert "no CUDA" in s["engine"]["host_tier"]
    ranks = s["ipc"]["runs"]["2"]["ranks"]
    assert [x["bad_rounds"] for x in ranks] == [0, 0] and ranks[0]["view_equals_local"]
    assert all(x["segment_table"] for x in ranks)
    log = (out / "log.txt").read_text()
    assert all(f"===== {name}: ok" in log for name in r["steps"])
    assert "gpu_check (dry run): ok" in p.stdout and "host tier: not page-locked" in p.stdout
    head, summary = p.stdout.split("\ngpu_check (dry run): ok")
    assert all(f"  {name:10s} ok" in head for name in STEPS)  # each step's line as it ended, then the summary
    assert [line.split()[0] for line in summary.splitlines()[1:] if line.startswith("  ") and
            not line.startswith("      ")] == STEPS


def test_a_step_past_its_deadline_is_stopped_with_the_processes_it_started(tmp_path, monkeypatch, capsys):
    """A step's process is a fork of gpu_check's, its own process group: at its deadline the group is killed
    (a process the step started goes with it), the step is recorded as stopped, the next step still runs."""
    pid_file = tmp_path / "pid"

    def hang(dry):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        pid_file.write_text(str(child.pid))
        time.sleep(120)

    monkeypatch.setattr(gpu_check, "STEPS", [gpu_check.Step("hang", hang, 2, 2),
                                             gpu_check.Step("after", lambda dry: {"ok": True, "ran": dry}, 30, 30)])
    env = dict(os.environ)
    try:
        assert gpu_check.main(["--dry-run", str(tmp_path / "out")]) == 1
    finally:  # main sets the steps' environment in its own
        os.environ.clear()
        os.environ.update(env)
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "past its deadline of 2 s: stopped" in r["steps"]["hang"]["error"]
    assert r["steps"]["after"]["ok"] and r["steps"]["after"]["section"]["ran"] is True
    assert r["steps"]["after"]["ended_s"] < r["steps"]["hang"]["ended_s"]  # the dry run's second lane: alongside
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # killed; reaped by init
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
    assert "hang       FAILED" in capsys.readouterr().out


def test_a_command_line_cpkv_run_refuses_is_refused_as_the_command_refuses_it(capsys):
    from cpkv.tools.cli import parse_command

    with pytest.raises(SystemExit) as e:
        parse_command(["run", "--cp", "0"])
    assert e.value.code == 2 and "--cp" in capsys.readouterr().err  # what it parses: the dry run's engine run


def _main_with(monkeypatch, steps, out, *args) -> int:
    """``gpu_check.main`` in this process over ``steps`` (each step a fork of it), the environment restored."""
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    env = dict(os.environ)
    try:
        return gpu_check.main(["--dry-run", str(out), *args])
    finally:  # main sets the steps' environment in its own
        os.environ.clear()
        os.environ.update(env)


def _fails(dry):
    os.write(1, b"a line of the failing step's output\n")  # its process's stdout: the step's log
    raise RuntimeError("the probe broke")


def test_a_failed_step_is_printed_as_it_ends_with_its_output_and_the_summary_last(tmp_path, monkeypatch, capsys):
    steps = [gpu_check.Step("versions", lambda dry: {"ok": True}, 30, 30),
             gpu_check.Step("broken", _fails, 30, 30), gpu_check.Step("after", lambda dry: {"ok": True}, 30, 30)]
    assert _main_with(monkeypatch, steps, tmp_path) == 1
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "results.json").read_text())
    assert not r["ok"] and r["steps"]["broken"]["error"] == "RuntimeError: the probe broke" and r["steps"]["after"]["ok"]
    tail = out.index("lines of broken's output:")
    assert out.index("  broken     FAILED") < tail < out.index("a line of the failing step's output", tail)
    summary = out[out.index("\ngpu_check (dry run): FAILED"):]  # last: what comes back of a long output
    assert "broken     FAILED" in summary and "RuntimeError: the probe broke" in summary and "the last" not in summary
    assert sorted(x.name for x in tmp_path.iterdir()) == ["log.txt", "results.json"]


def test_a_failed_versions_step_ends_the_run(tmp_path, monkeypatch, capsys):
    steps = [gpu_check.Step("versions", lambda dry: {"ok": False, "error": "transformers 5.10.0 is outside"}, 30, 30),
             gpu_check.Step("after", lambda dry: {"ok": True}, 30, 30)]
    assert _main_with(monkeypatch, steps, tmp_path) == 1
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["steps"]["after"]["error"] == "not run: the versions step failed" and r["steps"]["after"]["seconds"] == 0


def test_transformers_outside_the_tested_range_is_refused_in_one_line():
    from cpkv.models.round_trip import transformers_refusal

    assert transformers_refusal("5.17.0") is None and transformers_refusal("5.25.0") is None
    for v in ("5.16.1", "4.57.6", "6.0.0"):
        why = transformers_refusal(v)
        assert why.startswith(f"transformers {v} is outside >=5.17,<6") and "\n" not in why


def test_a_failing_engine_configuration_fails_the_dry_run(tmp_path, monkeypatch):
    """Each engine run is run, not only parsed: one the engine refuses at run time (a cache too small for its
    trace) fails the step, naming it; a good one beside it still passes."""
    good, bad = gpu_check.Run("good", ("--model", "llama", "--requests", "1", "--scale", "0.06", "--cp", "1")), \
        gpu_check.Run("too-small", ("--model", "llama", "--requests", "2", "--scale", "0.06", "--cp", "2",
                                    "--device-pages", "1"))
    monkeypatch.setattr(gpu_check, "engine_runs", lambda dry: [good, bad])
    assert _main_with(monkeypatch, [gpu_check.Step("engine", gpu_check.step_engine, 120, 120)], tmp_path) == 1
    runs = json.loads((tmp_path / "results.json").read_text())["steps"]["engine"]["section"]["runs"]
    assert runs["good"]["ok"] and runs["good"]["values_compared"] > 0
    assert not runs["too-small"]["ok"] and runs["too-small"]["error"]


def test_a_killed_command_is_not_waited_on_for_what_it_started():
    """An engine run's process group goes at its timeout, a grandchild holding its output pipe with it: the
    wait ends within REAP_S (subprocess.run would wait for the pipe's last holder)."""
    t0 = time.monotonic()
    rc, out, _ = gpu_check.run_bounded(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"], timeout=2)
    assert rc is None and "started" in out and time.monotonic() - t0 < 2 + gpu_check.REAP_S


def test_misuse_exits_2_and_writes_nothing(tmp_path):
    assert _run(timeout=60).returncode == 2
    p = _run("--only", "nonsense", tmp_path / "x", timeout=60)
    assert p.returncode == 2 and "--only takes step names" in p.stderr and not (tmp_path / "x").exists()


def test_without_a_gpu_it_prints_one_line_exits_2_and_writes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = _run(tmp_path / "x", timeout=120)
    assert p.returncode == 2 and not (tmp_path / "x").exists() and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "no CUDA GPU here" in p.stderr


def test_make_gpu_check_calls_it_with_the_machines_python_where_there_is_no_venv(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("needs make")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    r = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "GPU_OUT=/tmp/o"], cwd=tmp_path,
                       capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "python3 tools/gpu_check.py /tmp/o", r.stdout + r.stderr


def test_the_host_tier_line_says_whether_cudahostregister_took():
    """The engine step's ``host_tier``: the runs' ``host_pinned`` (per rank; None where a rank had no host tier)."""
    runs = [{"host_pinned": [True, True]}, {"host_pinned": [None]}, {}]
    assert gpu_check.host_tier(runs, False) == "page-locked (cudaHostRegister took) on all 2 rank(s) that had one"
    refused = gpu_check.host_tier([{"host_pinned": [True, False]}, {"host_pinned": [False]}], False)
    assert refused.startswith("pageable on 2 of 3 rank(s): cudaHostRegister was refused")
    assert gpu_check.host_tier([{"host_pinned": [None, None]}, {}], False) == "no host tier ran"
    assert gpu_check.host_tier([{"host_pinned": [False]}], True) == "not page-locked: no CUDA in the dry run"
