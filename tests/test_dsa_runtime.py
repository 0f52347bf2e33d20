"""DeepSeek-V3.2 and GLM-5 on a CP group of processes sharing one cache in
POSIX shared memory, through the same scenario as Llama: exact logits, each
rank holding its share of both families.
[[RFC-0001:C-MLA-LATENT-POOL]] [[RFC-0001:C-INDEXER-POOL]]"""

import os

import pytest

from cpkv.models import TinyDsa
from cpkv.runtime import RunConfig, run_scenario, shm_segments

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("kind,cp,page,prefill,decode", [("deepseek-v3.2", 2, 16, "page", "lse"),
                                                         ("glm-5", 3, 5, "zigzag", "owner")])
def test_dsa_group_matches_transformers_and_holds_a_share(kind, cp, page, prefill, decode):
    mine = os.getpid()
    requests = [(21, 45), (16, 40), (0, 9)]  # mid-page and page-aligned continuations at 16 (aligned 10 at 5)
    r = run_scenario(RunConfig(cp_size=cp, page_size=page, requests=requests, decode_steps=4,
                               model=TinyDsa(kind=kind), prefill_split=prefill, decode_split=decode))
    assert r["max_abs_diff"]["prefill"] < 1e-4 and r["max_abs_diff"]["decode"] < 1e-4
    held = [x["kv_bytes_held"] for x in r["ranks"]]
    assert held == [x["kv_bytes_by_allocation"] for x in r["ranks"]] and sum(held) == r["replicated_kv_bytes"]
    assert all(h <= r["replicated_kv_bytes"] / cp + len(requests) * r["page_bytes"] for h in held)
    # one page of both families: latent (32 + 8) on 3 layers, indexer keys (32) on the indexer layers, fp32
    index_layers = 3 if kind == "deepseek-v3.2" else 2
    assert r["page_bytes"] == page * 4 * (3 * 40 + index_layers * 32)
    assert r["config"]["model"]["kind"] == kind
    assert not shm_segments(mine)


def test_run_scenario_refuses_an_unknown_model():
    with pytest.raises(TypeError, match="RunConfig.model is a TinyLlama or a TinyDsa"):
        run_scenario(RunConfig(model="deepseek"))
    with pytest.raises(ValueError, match="unknown DSA model"):
        run_scenario(RunConfig(model=TinyDsa(kind="deepseek")))
