"""The engine on the triton data plane (Triton's interpreter on the CPU):
exact against transformers for Llama and DeepSeek-V3.2 (what ``cpkv run
--kernels triton --check`` runs), on a tiny trace. Every split is covered by
tests/runtime/test_forward_plan.py. [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""

import pytest

from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.models import model_config
from support.engine_checks import assert_exact as exact


@pytest.mark.parametrize("kind,split", [("llama", ("page", "owner")), ("deepseek-v3.2", ("zigzag", "lse"))])
def test_engine_on_triton_kernels_matches_transformers(kind, split):
    cfg = EngineConfig(cp_size=2, page_size=4, device_pages=24, host_pages=0, requests=1, scale=0.03, chunk=24,
                       prefill_split=split[0], decode_split=split[1], check=True, kernels="triton",
                       model=model_config(kind, seed=0))
    r = run_engine_threads(cfg)
    assert r["config"]["kernels"] == "triton" and r["kernels_fallback"] is None
    exact(r)
