"""``--kernels`` and ``--device`` of ``cpkv run`` and ``cpkv bench``: defaults,
carried into the run's configuration and report, ``--device cuda`` refused
before any process starts on a machine without CUDA."""

import os

import pytest
import torch

from cpkv.tools.cli import build_parser, main
from cpkv.tools.commands import run_config
from support.proc_helpers import children

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")


@NO_CUDA
@pytest.mark.parametrize("argv", [["run", "--device", "cuda"], ["run", "--device", "cuda", "--kernels", "torch"],
                                  ["bench", "kv", "--device", "cuda"], ["bench", "splits", "--device", "cuda"]])
def test_device_cuda_refused_before_anything_starts(argv, capsys):
    kids = set(children(os.getpid()))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda needs a CUDA GPU" in err and "refused before starting" in err
    assert set(children(os.getpid())) <= kids


def test_kernels_default_and_choice_reach_the_run_config():
    p = build_parser()
    default = run_config(p.parse_args(["run"]))
    assert (default.device, default.kernels) == ("cpu", "torch")  # device cpu: the torch path
    chosen = run_config(p.parse_args(["run", "--kernels", "triton"]))
    assert chosen.kernels == "triton" and chosen.run_fields()["kernels"] == "triton"


def test_report_names_device_and_kernels():
    from cpkv.engine import EngineConfig, run_engine_threads
    from cpkv.tools.report import format_engine

    r = run_engine_threads(EngineConfig(cp_size=1, requests=1, scale=0.02, host_pages=0, check=False))
    assert r["config"]["kernels"] == "torch" and r["config"]["device"] == "cpu"  # in --json too
    assert "device cpu, kernels torch" in format_engine(r)
