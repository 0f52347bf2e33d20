"""tools/gpu_check.py, the one prepared device run, proven on the CPU before a GPU is spent: its dry run
runs every step at tiny sizes and fills every section of the same results.json; a failing step is reported
(summary, the tail of its output, exit 1); a misuse exits 2."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.multiproc
def test_the_dry_run_fills_every_section_of_the_same_results(tmp_path):
    out = tmp_path / "out"
    p = _run("--dry-run", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(x.name for x in out.iterdir()) == ["log.txt", "results.json"]
    r = json.loads((out / "results.json").read_text())
    assert r["ok"] and r["dry_run"] and list(r["steps"]) == ["versions", "kernels", "bandwidth", "engine", "ipc"]
    s = {name: step["section"] for name, step in r["steps"].items()}
    assert all(step["ok"] and step["seconds"] <= step["deadline_s"] for step in r["steps"].values())
    assert not s["versions"]["missing"] and s["versions"]["packages"]["torch"] == torch.__version__
    kinds = {(c["shape"], c["dtype"]) for c in s["kernels"]["cases"]}
    assert {"gqa-real", "mla-real", "indexer-real", "gqa-small", "mla-small", "indexer-small"} == {k for k, _ in kinds}
    assert all(c["checks"] for c in s["kernels"]["cases"])
    assert set(s["bandwidth"]["fraction_of_copy"]) == {"store", "decode"}
    runs = s["engine"]["runs"]
    assert runs and all(x["backup_pages"] > 0 and x["load_pages"] > 0 and x["max_abs_diff"] < 1e-4
                        for x in runs.values())
    assert {"llama", "deepseek-v3.2"} == {x["command"].split("--model ")[1].split()[0] for x in runs.values()}
    ranks = s["ipc"]["runs"]["2"]["ranks"]
    assert [x["bad_rounds"] for x in ranks] == [0, 0] and ranks[0]["view_equals_local"]
    log = (out / "log.txt").read_text()
    assert all(f"===== {name}: ok" in log for name in r["steps"])
    assert "gpu_check (dry run): ok" in p.stdout


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
