"""tools/gpu_check.py, the one prepared device run, proven on the CPU before a GPU is spent: its dry run
runs every step at tiny sizes and fills every section of the same results.json; a failing step is reported
(summary, the tail of its output, exit 1); a step past its deadline is stopped with what it started; a misuse
exits 2."""

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
    every engine run's command line and one run judged exact with its eviction round trip and host tier
    recorded, N = 2 ranks' own segments read through the table after the fence."""
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
    runs = s["engine"]["runs"]
    assert list(runs) == [run.name for run in gpu_check.engine_runs(False)]
    ran = runs[gpu_check.DRY_RUN]
    assert ran["backup_pages"] > 0 and ran["load_pages"] > 0 and ran["max_abs_diff"] < 1e-4
    assert ran["host_pinned"] == [False, False] and "no CUDA" in s["engine"]["host_tier"]
    assert all(x["ok"] and "--device cuda" in x["command"] for n, x in runs.items() if n != gpu_check.DRY_RUN)
    ranks = s["ipc"]["runs"]["2"]["ranks"]
    assert [x["bad_rounds"] for x in ranks] == [0, 0] and ranks[0]["view_equals_local"]
    assert all(x["segment_table"] for x in ranks)
    log = (out / "log.txt").read_text()
    assert all(f"===== {name}: ok" in log for name in r["steps"])
    assert "gpu_check (dry run): ok" in p.stdout and "host tier: not page-locked" in p.stdout


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


def test_a_failed_step_is_summarised_with_its_output_and_exits_1(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the versions step passes")
    p = _run("--only", "versions", tmp_path, timeout=300)
    assert p.returncode == 1
    r = json.loads((tmp_path / "results.json").read_text())
    assert not r["ok"] and "needs a CUDA GPU" in r["steps"]["versions"]["error"]
    assert "versions   FAILED" in p.stdout and "the last" in p.stdout and "lines of versions's output" in p.stdout
    assert sorted(x.name for x in tmp_path.iterdir()) == ["log.txt", "results.json"]


def test_misuse_exits_2_and_writes_nothing(tmp_path):
    assert _run(timeout=60).returncode == 2
    p = _run("--only", "nonsense", tmp_path / "x", timeout=60)
    assert p.returncode == 2 and "--only takes step names" in p.stderr and not (tmp_path / "x").exists()


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
