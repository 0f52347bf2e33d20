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
    default = run_config(p.parse_args(["run"])).sized()  # sized at launch
    assert (default.device, default.kernels) == ("cpu", "torch")  # device cpu: the torch path
    chosen = run_config(p.parse_args(["run", "--kernels", "triton"])).sized()
    assert chosen.kernels == "triton" and chosen.run_fields()["kernels"] == "triton"


def test_report_names_device_and_kernels():
    from cpkv.engine import EngineConfig, run_engine_threads
    from cpkv.tools.report import format_engine

    r = run_engine_threads(EngineConfig(cp_size=1, requests=1, scale=0.02, host_pages=0, check=False))
    assert r["config"]["kernels"] == "torch" and r["config"]["device"] == "cpu"  # in --json too
    assert "device cpu, kernels torch" in format_engine(r)


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@NO_CUDA
def test_torchrun_and_replicated_with_device_cuda_get_the_launchers_refusal_word_for_word(monkeypatch, capsys):
    """Under torchrun (before joining) and for --kv replicated, --device cuda is refused as the launcher refuses
    it: the message of runtime.device.plan_devices, the one the GPU path plans with."""
    from cpkv.engine import EngineConfig, run_engine
    from cpkv.engine.joined import run_engine_joined
    from cpkv.runtime.device import plan_devices

    with pytest.raises(RuntimeError) as want:
        plan_devices("cuda", 2)
    import cpkv.engine.joined as joined_mod

    with monkeypatch.context() as m:  # refused before the trace is even planned, let alone joined
        m.setattr(joined_mod, "build_scheduler", lambda *a: pytest.fail("planned the trace before refusing"))
        with pytest.raises(RuntimeError) as joined:
            run_engine_joined(EngineConfig(cp_size=2, device="cuda", requests=1), environ=TORCHRUN)
    with pytest.raises(RuntimeError) as replicated:
        run_engine(EngineConfig(cp_size=2, device="cuda", kv="replicated", requests=1))
    assert str(joined.value) == str(replicated.value) == str(want.value)
    kids = set(children(os.getpid()))
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(["run", "--device", "cuda", "--cp", "2"])
    assert e.value.code == 2 and f"refused before starting: {want.value}" in capsys.readouterr().err
    assert set(children(os.getpid())) <= kids


def test_a_replicated_copy_lives_on_the_device_it_is_given():
    from cpkv.consumers.kv_pool import kv_families
    from cpkv.consumers.replicated import replicated_buffers, replicated_layout

    bufs = replicated_buffers(replicated_layout(4, 3), kv_families(2, 1, 8), "meta")
    assert {b.device.type for b in bufs.values()} == {"meta"}
