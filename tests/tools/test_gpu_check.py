"""``make gpu-check`` (tools/gpu_check.sh) stops at once, exit 2, saying why, on a machine without CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_gpu_check_fails_fast_and_clearly_without_cuda(tmp_path):
    out = tmp_path / "results"
    p = subprocess.run([str(SCRIPT), str(out)], env={**os.environ, "PY": sys.executable}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    assert "needs a CUDA GPU" in p.stderr and "nothing was run" in p.stderr
    assert not out.exists()  # no results folder: nothing ran
