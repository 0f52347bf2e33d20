"""The Makefile's TORCH_INDEX: the CPU build of torch for a CPU-only machine, one variable.

``make -n`` prints the recipe without running it; a fresh checkout has no
``.venv``, so the install recipe is what it shows (here a scratch copy of the
Makefile and pyproject.toml, so nothing of this checkout's own ``.venv``
counts)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(tmp_path, *variables) -> list[str]:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    r = subprocess.run(["make", "-n", "demo", *variables], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if "pip install" in line and "torch==" in line]


def test_torch_comes_from_the_configured_index_by_default(tmp_path):
    lines = _dry_run(tmp_path)
    assert len(lines) == 1 and "torch==2.13.0" in lines[0] and "--index-url" not in lines[0], lines


def test_torch_index_sets_pip_index_url(tmp_path):
    url = "https://download.pytorch.org/whl/cpu"
    lines = _dry_run(tmp_path, f"TORCH_INDEX={url}")
    assert len(lines) == 1 and f"--index-url {url} torch==2.13.0" in lines[0], lines


def test_demo_passes_its_small_cache_explicitly(tmp_path):
    _dry_run(tmp_path)
    r = subprocess.run(["make", "-n", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "cpkv run --check --device-pages 8" in r.stdout


def test_sglang_deps_install_without_changing_torch(tmp_path):
    """`make test` (not `make demo`) installs SGLang's wheel with --no-deps and its small packages with torch held
    at the installed version (the drop-in tests, tests/sglang), once per venv under its own stamp, and goes on
    (those tests skip, the stamp unwritten) where they cannot install."""
    for name in ("Makefile", "pyproject.toml", "tests/support/sglang-requirements.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)

    def dry(target):
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under make test
        r = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = dry("test")
    assert "--no-deps sglang==0.5.23" in out and "-r tests/support/sglang-requirements.txt" in out
    assert "torch==$(" in out and "then touch .venv/.sglang-0.5.23; else echo" in out
    assert out.index("sglang==0.5.23") < out.index("pytest")
    assert dry("sglang-deps") == out[: out.index("rm -rf .venv/triton-")]
    assert "sglang" not in dry("demo")
    # and the Tritons the kernels' compile check runs under, each a --target folder with its own stamp
    wheels = dry("triton-wheels")  # the venv first (its stamp), then the Tritons, as under `make test`
    assert wheels[wheels.index("rm -rf .venv/triton-"):] == out[out.index("rm -rf .venv/triton-"):
                                                                 out.index(".venv/bin/python -m pytest")]
    for v in ("3.6.0", "3.8.0"):
        assert f"--no-deps --target .venv/triton-{v} triton=={v}; \\\nthen touch .venv/triton-{v}/.installed" in out
    assert "triton" not in dry("demo")
    reqs = (ROOT / "tests/support/sglang-requirements.txt").read_text()
    assert "torchvision" not in [line.split("=")[0].strip() for line in reqs.splitlines()]
