"""The engine: the one scheduler on a CP group, on real KV, exact against transformers.

Traces with shared prefixes ending mid-page and on page ends, chunked prefill
(continuations from mid-page slots), eviction, preemption, host backup and
restore, for N in {1, 2, 4} and page sizes {1, 16}. Ranks run as threads of
one process here (fast); tests/engine/test_engine_group.py runs the process group.
[[RFC-0001:C-NO-PLANNER-COLLECTIVE]] [[RFC-0001:C-HICACHE]] [[RFC-0001:C-PREFIX-CACHE]]
[[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""

import pytest

from cpkv.engine import EngineConfig, run_engine_threads
from support.engine_checks import assert_exact as exact


CASES = {
    # N, page, device pages per lane, host pages, chunk, admission: what the case must exercise
    "n1-host": (1, 16, 12, 48, 24, "lanes"),
    "n2-page1-host": (2, 1, 120, 400, 40, "lanes"),
    "n4-host": (4, 16, 5, 48, 40, "lanes"),  # 6 pages: live sharing hits it all on the device
    "n2-preempt": (2, 16, 8, 0, 40, "none"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers_under_pressure(llama, case):
    N, S, dp, hp, chunk, adm = CASES[case]
    r = run_engine_threads(EngineConfig(cp_size=N, page_size=S, device_pages=dp, host_pages=hp, requests=5,
                                        scale=0.08, chunk=chunk, admission=adm, check=True), llama)
    exact(r)
    assert r["evicted_pages"] > 0 and r["chunk_continuations"] > 0
    if S > 1:
        assert r["mid_page_continuations"] > 0
    if hp:
        assert r["backup_pages"] > 0 and r["load_pages"] > 0 and r["host_hit_rate"] > 0
    if adm == "none":
        assert r["preemptions"] > 0
    if case == "n4-host":
        assert r["mid_page_copies"] > 0 and r["device_hit_rate"] > 0


@pytest.mark.parametrize("prefill,decode", [("interleave", "lse"), ("zigzag", "owner")])
def test_engine_with_token_splits_and_lse_decode(llama, prefill, decode):
    r = run_engine_threads(EngineConfig(cp_size=2, page_size=16, device_pages=10, host_pages=32, requests=4,
                                        scale=0.08, chunk=40, prefill_split=prefill, decode_split=decode,
                                        check=True), llama)
    exact(r)


@pytest.mark.parametrize("kind,N,S,dp,split", [("deepseek-v3.2", 2, 16, 6, ("page", "lse")),
                                                ("glm-5", 4, 16, 4, ("zigzag", "owner")),
                                                ("deepseek-v3.2", 1, 1, 120, ("page", "owner"))])
def test_engine_runs_the_dsa_models_exactly(kind, N, S, dp, split):
    """DeepSeek-V3.2 and GLM-5 through the same engine: latent and indexer pools
    in the owner-lane cache, eviction, host backup and restore, mid-page prefixes.
    [[RFC-0001:C-MLA-LATENT-POOL]] [[RFC-0001:C-INDEXER-POOL]]"""
    from cpkv.models import model_config

    r = run_engine_threads(EngineConfig(cp_size=N, page_size=S, device_pages=dp, host_pages=48 * 16 // S,
                                        requests=3, scale=0.08, chunk=40, prefill_split=split[0], decode_split=split[1],
                                        model=model_config(kind), check=True))
    exact(r)
    assert r["evicted_pages"] > 0 and r["load_pages"] > 0


def test_auto_decode_split_runs_the_cost_models_choice_each_step_exactly(tmp_path):
    """``decode_split="auto"``: each step of decodes runs the split the run's
    cost model prices lower: owner while the short request's context lies in
    one page (it reads no peer's page and moves nothing), lse once the long
    one decodes over three pages (moving its partials costs less than reading
    the peer's page); the report counts them; exact against transformers."""
    import dataclasses
    import json

    from cpkv.engine.cost_model import CostModel

    p = tmp_path / "two.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in (
        {"id": "short", "arrival": 0, "tokens": [(3 * j) % 256 for j in range(10)], "max_new_tokens": 6},
        {"id": "long", "arrival": 12, "tokens": [(5 * j + 1) % 256 for j in range(150)], "max_new_tokens": 4})))
    cfg = EngineConfig(cp_size=2, page_size=64, device_pages=8, host_pages=0, workload=str(p), chunk=200,
                       decode_split="auto", check=True)
    costs = CostModel.for_run(cfg)
    assert costs.decode_split([10], [11]) == "owner" and costs.decode_split([150], [151]) == "lse"
    r = run_engine_threads(dataclasses.replace(cfg, decode_costs=costs))
    exact(r)
    assert r["decode_splits"] == {"owner": 5, "lse": 3}  # the short one's 5 decode steps, then the long one's 3
    assert r["config"]["decode_costs"].startswith("CostModel(shared-auto, 2 ranks, page 64, DenseModel")


def test_auto_is_the_default_and_sized_builds_the_cost_model_of_the_group_that_decodes():
    """``decode_split="auto"`` is the default; :meth:`RunConfig.sized` builds its cost model of the group that
    decodes (a disaggregated run's decode group: its ranks, page and KV dtype), keeps one given, builds none for
    a fixed split or a replicated cache; a cost model of another group size is refused by the rank."""
    import dataclasses

    from cpkv.engine.config import DisaggConfig
    from cpkv.engine.rank import decode_chooser
    from cpkv.engine.cost_model import CostModel

    cfg = EngineConfig(cp_size=2, device_pages=8)
    assert cfg.decode_split == "auto" and cfg.decode_costs is None
    costs = cfg.sized().decode_costs
    assert (costs.mode, costs.N, costs.S) == ("shared-auto", 2, cfg.page_size)
    assert dataclasses.replace(cfg, decode_split="owner").sized().decode_costs is None
    assert dataclasses.replace(cfg, kv="replicated").sized().decode_costs is None
    four = CostModel.for_run(dataclasses.replace(cfg, cp_size=4))
    assert dataclasses.replace(cfg, decode_costs=four).sized().decode_costs is four  # one given is kept
    d = DisaggConfig.from_engine(cfg, 1, 3, decode_page=32, decode_pages=8).sized().decode_costs
    assert (d.N, d.S) == (3, 32)
    with pytest.raises(ValueError, match="cost model is of 4 ranks; this group has 2"):
        decode_chooser(dataclasses.replace(cfg, decode_costs=four), 2)
    assert decode_chooser(dataclasses.replace(cfg, kv="replicated", decode_costs=four), 2) is None


@pytest.mark.parametrize("kind", ["deepseek-v3.2", "glm-5"])
def test_lse_decode_on_a_128k_mooncake_conversation_scaled_is_exact(tmp_path, kind):
    """A Mooncake trace (hash-id blocks) with a 128K-token conversation and a
    continuation sharing most of its blocks, in the tests' scaled form (one
    token a 512-token block: 256 tokens of context, 16 times the top-k), on 4
    ranks under the lse decode split: every decode's top-k all-local over
    contexts much longer than k, exact against transformers.
    [[RFC-0001:C-INDEXER-POOL]] [[RFC-0001:C-EXACTNESS]]"""
    import json

    from cpkv.models import model_config

    p = tmp_path / "conversation.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in (
        {"timestamp": 0, "input_length": 131072, "output_length": 2048, "hash_ids": list(range(256))},
        {"timestamp": 3000, "input_length": 126000, "output_length": 1024,
         "hash_ids": list(range(200)) + list(range(1000, 1047))})))
    r = run_engine_threads(EngineConfig(cp_size=4, page_size=4, device_pages=40, host_pages=0,
                                        workload=f"mooncake:{p}", block_tokens=1, max_output=4, step_ms=1000,
                                        chunk=128, decode_split="lse", model=model_config(kind), check=True))
    exact(r)
    assert r["prompt_tokens"] == 256 + 247 and r["device_hit_rate"] > 0.3  # the continuation hits the shared blocks
    assert all(x["traffic"]["topk_exchange"] > 0 for x in r["ranks"])  # the decodes' top-k found all-local
