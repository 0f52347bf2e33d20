"""The group on GPUs (cpkv.runtime.device): what can be decided and checked without one (the device plan
and its refusals, the segment exchange, the host tier's registration and release), and, marked ``gpu``,
what needs one (run by ``tools/gpu_check.py``'s machine): N ranks on one GPU over CUDA IPC with the fence,
the engine exact at N 1, 2, 4 on one GPU, torchrun and the replicated cache on the GPU, a killed rank
leaving nothing behind."""

import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.runtime import device as D
from cpkv.runtime import shm as shm_mod
from cpkv.runtime.comm import LocalComm, run_threads
from cpkv.runtime.device import group_segments, pin_host, plan_devices
from cpkv.runtime.group import RankContext, RankFailure, launch

GPU = dict(cuda=True, environ={})


def test_the_cpu_plan_and_bad_calls():
    p = plan_devices("cpu", 64)
    assert (p.backend, p.gpus, p.shared_gpu, p.rank_device(5)) == ("gloo", 0, False, torch.device("cpu"))
    with pytest.raises(ValueError, match="device must be one of"):
        plan_devices("tpu", 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size must be an int"):
            plan_devices("cpu", bad)


@given(world=st.integers(1, 16), count=st.integers(1, 8))
def test_ranks_share_gpus_on_gloo_exactly_when_there_are_more_ranks_than_gpus(world, count):
    p = plan_devices("cuda", world, device_count=count, peer_access=lambda i, j: True, **GPU)
    assert p.gpus == min(world, count) and p.shared_gpu == (world > count)
    assert p.backend == ("gloo" if world > count else "cpu:gloo,cuda:nccl")
    assert str(world) in p.describe()


def test_every_combination_that_cannot_work_is_refused_with_its_reason():
    with pytest.raises(RuntimeError, match="--device cuda needs a CUDA GPU, and torch sees none"):
        plan_devices("cuda", 2, cuda=False)
    for var in D.ALLOC_CONF_VARS:
        env = {var: "max_split_size_mb:64,expandable_segments:True"}
        with pytest.raises(RuntimeError, match=f"expandable_segments off; {var}=max_split"):
            plan_devices("cuda", 2, cuda=True, environ=env, device_count=1)
    plan_devices("cuda", 2, cuda=True, environ={D.ALLOC_CONF_VARS[0]: "expandable_segments:False"}, device_count=1)
    with pytest.raises(RuntimeError, match="GPU 0 cannot access GPU 1's memory"):
        plan_devices("cuda", 2, device_count=2, peer_access=lambda i, j: False, **GPU)
    plan_devices("cuda", 4, device_count=1, peer_access=lambda i, j: False, **GPU)  # one GPU: no peer needed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")
def test_launch_and_cpkv_run_refuse_cuda_without_a_gpu_before_any_process_starts():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU") as e:
        launch(print, 2, device="cuda")  # refused before spawning: print is never called
    with pytest.raises(RuntimeError) as same:
        plan_devices("cuda", 2)
    assert str(e.value) == str(same.value)


def test_a_group_of_one_creates_no_ipc_handle(monkeypatch):
    def no(*a):
        raise AssertionError("a group of one exported or opened a segment")

    monkeypatch.setattr(D, "export_segment", no)
    monkeypatch.setattr(D, "open_segment", no)
    v = group_segments(LocalComm(), "kv_k", (2, 12, 3), torch.float32, torch.device("cpu"))
    assert v.num_ranks == 1 and v.shape == (2, 12, 3) and not bool(v.segment(0).any())
    assert isinstance(v.layer(0), torch.Tensor)  # its own buffer: no base table


def test_each_rank_allocates_its_own_segment_and_opens_only_its_peers(monkeypatch):
    """The exchange of handles over the group, with in-process stand-ins for CUDA IPC: every rank exports its
    own segment once and opens every peer's, never its own (CUDA opens a handle only in another process)."""
    made, exporter, opened = {}, {}, []

    def export(t):
        key = uuid.uuid4().hex
        made[key], exporter[key] = t, threading.get_ident()
        return key

    def open_(key, device):
        opened.append((threading.get_ident(), key))
        return made[key]

    monkeypatch.setattr(D, "export_segment", export)
    monkeypatch.setattr(D, "open_segment", open_)

    def rank(comm):
        v = group_segments(comm, "kv_k", (2, 3 * 4, 5), torch.float32, torch.device("cpu"))
        own = [k for k, t in made.items() if t is v.segment(comm.rank)]
        v.segment(comm.rank)[:, :, 0] = comm.rank + 1  # the owner writes its own segment only
        comm.barrier()
        seen = v.read(torch.arange(12))[:, :, 0]
        return own, [s.data_ptr() for s in v.segments], seen

    got = run_threads(3, rank)
    owns = [o for o, _, _ in got]
    assert all(len(o) == 1 for o in owns) and len(made) == 3
    assert sorted(k for _, k in opened) == sorted(k for o in owns for k in o for _ in range(2))  # by both peers
    assert all(exporter[k] != who for who, k in opened)  # never its own
    assert len({tuple(p) for _, p, _ in got}) == 1  # every rank sees the same three allocations, in rank order
    for _, _, seen in got:
        assert torch.equal(seen, torch.tensor([1.0] * 4 + [2.0] * 4 + [3.0] * 4).expand(2, 12))
    with pytest.raises(ValueError, match="not \\[layers, 3 \\* slots_per_rank"):
        run_threads(3, lambda c: group_segments(c, "kv_k", (2, 10, 5), torch.float32, torch.device("cpu")))


class FakeCudart:
    """What pin_host calls of ``torch.cuda.cudart()``, recorded."""

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def cudaHostRegister(self, ptr, size, flags):
        self.log.append(("register", ptr, size, flags))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr):
        self.log.append(("unregister", ptr))
        return 0


def test_the_host_tier_is_registered_portable_and_unregistered_before_its_mapping_goes(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(D, "_cudart", lambda: FakeCudart(log))
    real_close = shm_mod.close
    monkeypatch.setattr(shm_mod, "close", lambda seg: (log.append(("unmap", seg.name)), real_close(seg)))
    ctx = RankContext(0, 1, shm_mod.run_prefix(uuid.uuid4().hex[:8]))
    try:
        t = ctx.shared("host_k", (4, 16), torch.float32)
        assert pin_host(t, ctx.at_close) is t
        assert log == [("register", t.data_ptr(), 256, D.CUDA_HOST_REGISTER_PORTABLE)]
    finally:
        ctx.close()
    assert [x[0] for x in log] == ["register", "unregister", "unmap"] and log[1][1] == log[0][1]
    monkeypatch.setattr(D, "_cudart", lambda: FakeCudart(log, fail=True))
    before = len(log)
    t = torch.zeros(16)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister of 64 bytes .* stays pageable"):
        assert pin_host(t, lambda fn: log.append("kept a release")) is t
    assert [x[0] for x in log[before:]] == ["register"]  # refused: nothing kept to release


def test_pinning_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = torch.zeros(8)
    assert pin_host(t, lambda fn: pytest.fail("nothing to release")) is t


def test_a_killed_ranks_torch_files_are_removed_by_pid():
    mine, other = f"torch_{2**22 + 7}_1_0", f"torch_{2**22 + 70}_1_0"
    for n in (mine, other):
        Path(shm_mod.SHM_DIR, n).write_bytes(b"x")
    try:
        assert shm_mod.unlink_torch_files([2**22 + 7]) == [mine]
        assert os.path.exists(Path(shm_mod.SHM_DIR, other))
    finally:
        shm_mod.unlink(other)


# -- on a GPU --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_n_ranks_on_one_gpu_write_their_own_segments_and_read_every_one_after_the_fence():
    from cpkv.tools.gpu_probe import ipc_section

    r = ipc_section("cuda", sizes=(2, 3, 4))
    assert r["ok"], r


@pytest.mark.gpu
def test_the_kernels_compile_and_equal_the_reference_on_the_gpu():
    from cpkv.tools.gpu_probe import kernels_section

    r = kernels_section("cuda")
    assert r["ok"], [c for c in r["cases"] if not c["ok"]]


@pytest.mark.gpu
def test_the_host_tier_is_pinned_in_place_until_the_context_closes():
    ctx = RankContext(0, 1, shm_mod.run_prefix(uuid.uuid4().hex[:8]))
    t = ctx.shared("host_k", (1024,), torch.float32)
    assert pin_host(t, ctx.at_close).is_pinned()
    x = torch.randn(1024, device="cuda")
    t.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t, x.cpu())
    ctx.close()


def _engine(model, N, **kw):
    from cpkv.engine import EngineConfig, run_engine
    from cpkv.models import model_config

    return run_engine(EngineConfig(cp_size=N, device="cuda", page_size=16, requests=kw.pop("requests", 3),
                                   scale=0.06, chunk=40, device_pages=kw.pop("device_pages", 64),
                                   model=model_config(model, seed=0), check=True, timeout=240, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 2, 4])
@pytest.mark.parametrize("model", ["llama", "deepseek-v3.2"])
def test_the_engine_on_one_gpu_matches_transformers(model, N):
    from support.engine_checks import assert_exact

    r = _engine(model, N)
    assert r["config"]["kernels"] == "triton"
    assert_exact(r)


@pytest.mark.gpu
@pytest.mark.parametrize("model,split", [("llama", ("page", "lse")), ("deepseek-v3.2", ("zigzag", "lse"))])
def test_the_engine_on_one_gpu_evicts_to_the_host_tier_and_loads_back_exactly(model, split):
    from support.engine_checks import assert_exact

    r = _engine(model, 2, requests=4 if model == "llama" else 3, device_pages=5, host_pages=48,
                prefill_split=split[0], decode_split=split[1])
    assert r["backup_pages"] > 0 and r["load_pages"] > 0
    assert all(isinstance(x["host_pinned"], bool) for x in r["ranks"])  # a refused registration only warns
    assert_exact(r)


@pytest.mark.gpu
def test_the_replicated_cache_on_one_gpu_matches_transformers():
    from support.engine_checks import assert_exact

    assert_exact(_engine("llama", 2, kv="replicated"))


@pytest.mark.gpu
def test_torchrun_with_device_cuda_on_one_gpu(tmp_path):
    from support.torchrun_helpers import finish, log_tail, start_torchrun

    p = start_torchrun(tmp_path, ["--standalone", "--nproc-per-node", "2"], "support.torchrun_engine", "engine-cuda",
                       str(tmp_path), "2")
    assert finish(p, tmp_path, 300) == 0, log_tail(tmp_path)
    import json

    report = json.loads((tmp_path / "report.0.json").read_text())
    assert report["config"]["device"] == "cuda" and report["check"]["max_abs_diff"] < 1e-4
    assert report["check"]["requests_matched"] == report["requests"]


@pytest.mark.gpu
def test_a_killed_rank_on_the_gpu_leaves_nothing_behind():
    from support.proc_helpers import children

    before, kids = set(os.listdir(shm_mod.SHM_DIR)), set(children(os.getpid()))
    from support import moments
    from cpkv.engine import engine

    with pytest.MonkeyPatch.context() as mp:  # rank 1 dies by SIGKILL at its second step (tests/support/moments.py)
        mp.setenv(moments.FAULT, "step2:1:kill")
        mp.setattr(engine, "_engine_rank", moments.engine_rank)
        with pytest.raises(RankFailure, match="rank 1"):
            _engine("llama", 2)
    assert set(os.listdir(shm_mod.SHM_DIR)) - before == set()  # no cpkv segment, no torch_<rank pid> counter
    assert set(children(os.getpid())) <= kids
