"""The engine over per-rank KV segments (the GPU's layout: each rank allocates its own segment, the group reads
through a base table) is the engine over one shared buffer: exact against transformers, the same run. Ranks
are threads; the exchange of segments is runtime.device.group_segments with in-process stand-ins for CUDA IPC.
[[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""

import uuid

import pytest
import torch

from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine.engine import engine_rank
from cpkv.engine.rank import thread_buffers
from cpkv.models import build_adapter, model_config
from cpkv.runtime import device as D
from cpkv.runtime.comm import run_threads
from support.engine_checks import assert_exact


@pytest.fixture
def in_process_ipc(monkeypatch):
    """CUDA IPC's export and open, for ranks that are threads of one process: a handle names the tensor."""
    made = {}

    def export(t):
        made[key := uuid.uuid4().hex] = t
        return key

    monkeypatch.setattr(D, "export_segment", export)
    monkeypatch.setattr(D, "open_segment", lambda key, device: made[key])
    return made


def _segmented(cfg, adapter):
    host = thread_buffers()

    def rank(comm):
        seg = lambda tag, shape, dtype: D.group_segments(comm, tag, shape, dtype, torch.device("cpu"))  # noqa: E731
        return engine_rank(seg, comm, cfg, adapter, host_shared=host)

    return run_threads(cfg.cp_size, rank, timeout=cfg.timeout)[0]


CASES = {  # model, kernels, splits, device pages, requests, scale: the torch case evicts and loads back
    "llama-torch-evict": ("llama", "torch", ("page", "lse"), 5, 4, 0.06),
    "llama-triton": ("llama", "triton", ("page", "owner"), 32, 2, 0.02),  # the kernels read the base table
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_over_per_rank_segments_is_the_engine_over_one_buffer(in_process_ipc, case):
    model, kernels, split, dp, requests, scale = CASES[case]
    cfg = EngineConfig(cp_size=2, page_size=16, device_pages=dp, host_pages=48, requests=requests, scale=scale,
                       chunk=40, prefill_split=split[0], decode_split=split[1], kernels=kernels,
                       model=model_config(model, seed=0), check=True)
    adapter = build_adapter(cfg.model)
    seg = _segmented(cfg, adapter)
    assert len(in_process_ipc) == 2 * len(adapter.kv_families(cfg.kv_dtype))  # every rank exported each family
    assert_exact(seg)
    if kernels == "torch":  # the same run as over one buffer, figure for figure
        one = run_engine_threads(cfg, adapter)
        for k in ("computed_tokens", "generated_tokens", "backup_pages", "load_pages", "evicted_pages"):
            assert seg[k] == one[k], k
        assert seg["backup_pages"] > 0 and seg["load_pages"] > 0
        assert seg["check"]["max_abs_diff"] == one["check"]["max_abs_diff"]
