"""The replicated-cache baseline (``kv="replicated"``): every rank a full private
copy, a zigzag token split with an all-gather of the new K/V, every rank writing
every slot; exact against transformers for every model at N 1, 2 and 4, and,
at the same memory per rank, refusing up front a request the shared group runs
to the end. [[RFC-0001:C-PLANNER-SPLIT]] [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

import dataclasses

import pytest
import torch

from cpkv.consumers.kv_pool import kv_families
from cpkv.consumers.replicated import ReplicatedHostPool, ReplicatedKVPool, replicated_buffers, replicated_layout
from cpkv.contract.layout import SharedKVLayout
from cpkv.engine import EngineConfig, run_engine, run_engine_threads
from cpkv.engine.engine import build_scheduler
from cpkv.engine.trace import RequestSpec, TraceError
from cpkv.models import model_config
from cpkv.runtime.runner import CPRunner
from support.engine_checks import assert_exact as exact


def every_rank_holds_the_copy(r, N):
    """Each rank wrote every page the one-lane allocator holds into its own copy."""
    alloc = [x["pages_allocated"] for x in r["ranks"]]
    assert [x["pages_written"] for x in r["ranks"]] == alloc == [r["occupancy"][-1][0]] * N and alloc[0] > 0
    assert r["peak_kv_bytes_per_rank"] == [r["peak_replicated_kv_bytes"]] * N


@pytest.mark.parametrize("N", [1, 2, 4])
def test_replicated_llama_exact_with_eviction_and_host_tier(llama, N):
    r = run_engine_threads(EngineConfig(cp_size=N, page_size=16, device_pages=12, host_pages=48, requests=5,
                                        scale=0.08, chunk=40, kv="replicated", check=True), llama)
    exact(r)
    every_rank_holds_the_copy(r, N)
    assert r["evicted_pages"] > 0 and r["load_pages"] > 0 and r["chunk_continuations"] > 0
    backed = [x["backed_up"] for x in r["ranks"]]
    assert backed[0] > 0 and not any(backed[1:])  # the IO rank alone backs up
    if N > 1:  # a token split: ranks received the others' new entries
        assert all(x["moved_bytes"] > 0 for x in r["ranks"])


@pytest.mark.parametrize("kind,N", [("deepseek-v3.2", 1), ("deepseek-v3.2", 2), ("glm-5", 4), ("deepseek-v3.2", 4)])
def test_replicated_dsa_models_exact(kind, N):
    r = run_engine_threads(EngineConfig(cp_size=N, page_size=16, device_pages=12, host_pages=48, requests=3,
                                        scale=0.08, chunk=40, kv="replicated", model=model_config(kind), check=True))
    exact(r)
    every_rank_holds_the_copy(r, N)


@pytest.mark.multiproc
def test_replicated_on_a_process_group(llama):
    r = run_engine(EngineConfig(cp_size=2, page_size=16, device_pages=12, host_pages=48, requests=4, scale=0.08,
                                chunk=40, kv="replicated", check=True, timeout=240))
    exact(r)
    every_rank_holds_the_copy(r, 2)


def test_same_memory_replicated_refuses_what_shared_runs(llama):
    """At 64 KiB per rank (8 pages of 8 KiB), the replicated copy holds 7 usable
    pages and the shared group of 2 holds 15: a 150-token request is refused up
    front by the first and runs to the end, exact, on the second."""
    base = EngineConfig(cp_size=2, page_size=16, kv_memory=64 * 2**10, host_pages=0, check=True).sized()
    assert base.device_pages == 8
    spec = [RequestSpec("long", 0, tuple(range(3, 150)), 4)]
    with pytest.raises(TraceError, match="long"):
        build_scheduler(dataclasses.replace(base, kv="replicated"), spec)
    build_scheduler(base, spec)
    from cpkv.tools.bench.capacity import _run_specs

    r = _run_specs(base, spec)
    exact(r)
    assert r["finished"] == 1 and r["generated_tokens"] == 4


def test_replicated_pool_and_runner_misuse(llama):
    fams = kv_families(2, 1, 4)
    lay = replicated_layout(4, 6)
    with pytest.raises(ValueError, match="one-rank layout"):
        ReplicatedKVPool(SharedKVLayout(2, 4, 6), fams, replicated_buffers(lay, fams), group_rank=0, group_size=2)
    with pytest.raises(ValueError, match="one-rank layout"):
        replicated_buffers(SharedKVLayout(2, 4, 6), fams)
    with pytest.raises(ValueError, match="group_rank 2"):
        ReplicatedKVPool(lay, fams, replicated_buffers(lay, fams), group_rank=2, group_size=2)
    pool = ReplicatedKVPool(lay, fams, replicated_buffers(lay, fams), group_rank=0, group_size=1)
    with pytest.raises(ValueError, match="unknown prefill split 'page'"):
        CPRunner(llama, pool, prefill_split="page", decode_split="balanced")
    with pytest.raises(ValueError, match="unknown decode split 'owner'"):
        CPRunner(llama, pool, prefill_split="zigzag", decode_split="owner")
    other = ReplicatedKVPool(lay, fams, replicated_buffers(lay, fams), group_rank=1, group_size=2)
    with pytest.raises(ValueError, match="the pool is rank 1 of 2"):
        CPRunner(llama, other, prefill_split="zigzag", decode_split="balanced")
    host = ReplicatedHostPool(fams, ReplicatedHostPool.allocate(fams, 2, 4))
    from cpkv.consumers.kv_pool import SharedKVPool, allocate_buffers

    shared = SharedKVPool(lay, 0, fams, allocate_buffers(lay, fams))
    with pytest.raises(TypeError, match="ReplicatedKVPool"):
        host.backup(shared, torch.tensor([4]), torch.tensor([4]))
    with pytest.raises(ValueError, match="unknown kv"):
        EngineConfig(kv="copied")
    with pytest.raises(ValueError, match="kv_memory"):
        EngineConfig(kv_memory=0)
    with pytest.raises(ValueError, match="holds no page"):
        EngineConfig(kv_memory=100).sized()


def test_private_copies_do_not_share_memory():
    fams = kv_families(1, 1, 2)
    lay = replicated_layout(2, 3)
    a, b = replicated_buffers(lay, fams), replicated_buffers(lay, fams)
    a["k"].fill_(1.0)
    assert float(b["k"].abs().sum()) == 0.0
