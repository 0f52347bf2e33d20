"""The group on a GPU (cpkv.runtime.device): what can be checked without one
(backend choice, refusals, no-ops), and, marked ``gpu``, what needs one:
buffers over CUDA IPC that every rank's kernels read, the pinned host tier,
the engine exact on ``--device cuda`` (run by ``make gpu-check``)."""

import pytest
import torch

from cpkv.runtime.device import check_devices, pin_shared, process_group_backend, rank_device, share_device_buffer
from cpkv.runtime.group import RankContext, launch


def test_backend_follows_the_device():
    assert process_group_backend("cpu") == "gloo" and process_group_backend("cuda") == "nccl"
    with pytest.raises(ValueError, match="device must be one of"):
        process_group_backend("tpu")
    assert rank_device("cpu", 3) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")
def test_cuda_refused_without_a_gpu_before_any_process_starts():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        check_devices("cuda", 1)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        launch(print, 2, device="cuda")  # refused before spawning: print is never called
    check_devices("cpu", 64)


def test_device_buffer_refuses_a_cpu_device_and_pinning_is_a_no_op_without_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        share_device_buffer(RankContext(0, 1, "x"), "kv_k", (2, 3), torch.float32, torch.device("cpu"))
    t = torch.zeros(8)
    assert pin_shared(t) is t


def _ipc_rank(ctx, N):
    """Each rank writes its own segment of a buffer rank 0 allocated, through
    the store kernel; after the device fence every rank reads every segment."""
    from cpkv import SharedKVLayout, kernels
    from cpkv.runtime.comm import DistComm

    layout = SharedKVLayout(N, 4, 4)
    spr = layout.slots_per_rank
    buf = share_device_buffer(ctx, "kv", (N * spr, 8), torch.float32, ctx.device)
    slots = torch.tensor([s for s in range(layout.capacity) if int(layout.owner_of_slots(torch.tensor([s]))[0])
                          == ctx.rank], device=ctx.device)
    vals = (slots.float()[:, None] + torch.arange(8, device=ctx.device)).contiguous()
    kernels.store(buf[ctx.rank * spr:(ctx.rank + 1) * spr], vals, slots, layout, ctx.rank, backend="triton")
    DistComm(device=ctx.device).barrier()
    every = torch.arange(layout.capacity, device=ctx.device)
    got = buf[layout.translate_read_slots(every)]
    return bool(torch.equal(got[:, 0].cpu(), every.float().cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ranks_read_the_segments_the_others_wrote_over_cuda_ipc():
    assert launch(_ipc_rank, 2, 2, device="cuda", timeout=120)


@pytest.mark.gpu
def test_host_tier_is_pinned_in_place():
    t = torch.zeros(1024)
    assert pin_shared(t).is_pinned()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama", "deepseek-v3.2"])
def test_engine_on_cuda_matches_transformers(model):
    from cpkv.engine import EngineConfig, run_engine
    from cpkv.models import model_config
    from support.engine_checks import assert_exact

    r = run_engine(EngineConfig(cp_size=1, device="cuda", requests=2, scale=0.05, model=model_config(model, seed=0),
                                check=True))
    assert r["config"]["kernels"] == "triton"
    assert_exact(r)
