"""The H200 cost model: the model's shapes against DeepSeek's published sizes,
and every term of one step against a hand computation, for both modes and
both decode splits."""

import json

import numpy as np
import pytest

from cpkv.tools.cost_model import H200, MODES, CostModel, DsaModel, kv_memory_per_rank

N = 8
LAT, IDX = 1152 * 61, 256 * 61  # bf16 latent (512 + 64) and indexer key (128) per token, 61 layers
KV = LAT + IDX  # 85888, `cpkv bytes`


@pytest.fixture(scope="module")
def model():
    return DsaModel.deepseek_v32()


def test_the_shapes_are_deepseek_v32s(model):
    p = model.params()
    assert 669e9 < p["total"] < 673e9  # DeepSeek-V3: 671B parameters (the MTP module apart)
    assert 36.5e9 < p["active"] < 38e9  # 37B activated per token
    assert (model.layers, model.heads, model.kv_lora, model.rope, model.index_heads, model.index_dim,
            model.index_topk, model.experts, model.experts_per_token) == (61, 128, 512, 64, 64, 128, 2048, 256, 8)
    always, routed = model.weight_bytes()
    assert routed == p["routed"] and always == p["total"] - p["routed"] - p["embedding"] + p["head"]
    assert CostModel.for_dtype("replicated", N, "bfloat16").kv_token_bytes == KV
    assert CostModel.for_dtype("replicated", N, "fp8").kv_token_bytes == (656 + 132) * 61
    # an H200's KV beside its shard: 141 GB x 0.9 less the checkpoint over 8 ranks
    assert kv_memory_per_rank() == int(141e9 * 0.9 - (always + routed + 2 * p["embedding"]) / 8)
    assert 42e9 < kv_memory_per_rank() < 43.5e9


def hand(model, mode, starts, ends, decode_only=False, loads=0, backups=0):
    """The step written out term by term from the module docstring's formulas."""
    p = model.params()
    always, routed = model.weight_bytes()
    HBM, NV, PCIE, F8, BF = 4.8e12, 450e9, 64e9, 1979e12, 989.5e12
    out = {}
    T = sum(e - s for s, e in zip(starts, ends))
    touched = 1 - (1 - 8 / 256) ** T
    out["linear"] = max(2 * p["active"] * T / (N * F8), (always + routed * touched) / (N * HBM))
    keys = sum(q for s, e in zip(starts, ends) for q in range(s + 1, e + 1))
    selected = sum(min(q, 2048) for s, e in zip(starts, ends) for q in range(s + 1, e + 1))
    flops = (2 * 64 * 128 * 61 * keys / F8 + 2 * 128 * (512 + 64 + 512) * 61 * selected / BF) / N
    per_rank = sum((e * IDX + min(e, 2048 * (e - s)) * LAT) * min(e - s, N) for s, e in zip(starts, ends)) / N
    lse = mode == "shared-lse" and decode_only
    local = per_rank if mode == "replicated" or lse else per_rank / N
    out["attention"] = max(flops, local / HBM) + (per_rank - local) / NV
    out["allgather"] = T * KV * (N - 1) / N / NV if mode == "replicated" else 0.0
    out["lse_merge"] = (N - 1) * len(starts) * 61 * (128 * 513 * 4 + 2048 * 8) / NV if lse else 0.0
    out["pcie"] = (loads * KV / (1 if mode == "replicated" else N) + backups * KV) / PCIE
    return out


STEPS = {
    "decode": dict(starts=[2999, 99], ends=[3000, 100], decode_only=True),  # one past top-k, one under it
    "prefill": dict(starts=[1000, 2000], ends=[1512, 2100]),  # two chunks, one crossing top-k
    "mixed": dict(starts=[2999, 0], ends=[3000, 5]),  # a decode riding with a short chunk (fewer tokens than ranks)
    "host": dict(starts=[499], ends=[500], decode_only=True, loads=640, backups=128),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("step", sorted(STEPS))
def test_every_term_of_one_step_is_the_hand_computation(model, mode, step):
    kw = STEPS[step]
    c = CostModel.for_dtype(mode, N, "bfloat16")
    got = c.step(kw["starts"], kw["ends"], decode_only=kw.get("decode_only", False),
                 load_tokens=kw.get("loads", 0), backup_tokens=kw.get("backups", 0))
    want = hand(model, mode, **kw)
    for term, v in want.items():
        assert getattr(got, term) == pytest.approx(v, rel=1e-12, abs=1e-15), term
    assert got.total == pytest.approx(sum(want.values()), rel=1e-12)
    assert got.tokens == sum(e - s for s, e in zip(kw["starts"], kw["ends"]))


def test_what_each_decode_split_reads_and_moves(model):
    """The owner split reads the peers' pages over NVLink; the lse split reads only its own HBM and merges;
    the replicated group reads its own copy and all-gathers the new KV."""
    e = np.full(64, 12000)
    rep, own, lse = (CostModel.for_dtype(m, N, "bfloat16").step(e - 1, e, decode_only=True) for m in MODES)
    read = 64 * (12000 * IDX + 2048 * LAT) / N  # per rank
    assert rep.hbm_kv_bytes == pytest.approx(read) and rep.nvlink_bytes == pytest.approx(64 * KV * 7 / 8)
    assert own.hbm_kv_bytes == pytest.approx(read / N) and own.nvlink_bytes == pytest.approx(read * 7 / 8)
    assert lse.hbm_kv_bytes == pytest.approx(read) and lse.nvlink_bytes == pytest.approx(lse.lse_merge * 450e9)
    assert own.lse_merge == lse.allgather == own.allgather == 0
    assert rep.linear == own.linear == lse.linear  # equal batch, equal GEMMs
    assert rep.total < own.total  # NVLink is slower than HBM: at equal batch, sharing costs TPOT
    # a mixed step runs its decodes as the owner split does, whatever the split
    mixed = CostModel.for_dtype("shared-lse", N, "bfloat16").step([11999, 0], [12000, 100])
    assert mixed.lse_merge == 0 and mixed.nvlink_bytes > 0


def test_refusals_and_measured_figures(tmp_path):
    with pytest.raises(ValueError, match="unknown mode"):
        CostModel.for_dtype("sharded", N, "bfloat16")
    with pytest.raises(ValueError, match="kv_dtype"):
        CostModel.for_dtype("replicated", N, "float32")
    with pytest.raises(ValueError, match="cp_size"):
        CostModel("replicated", 0, LAT, IDX)
    c = CostModel.for_dtype("replicated", N, "bfloat16")
    with pytest.raises(ValueError, match="0 <= start <= end"):
        c.step([5], [4])
    with pytest.raises(ValueError, match="one length"):
        c.step([1, 2], [3])
    assert c.step([], []).total == 0.0
    good = tmp_path / "results.json"
    good.write_text(json.dumps({"device": "H200", "cost_model": {"hbm_bytes_per_s": 4.2e12, "nvlink_bytes_per_s": 380e9}}))
    hw = H200.with_results(str(good))
    assert (hw.hbm_bytes_per_s, hw.nvlink_bytes_per_s, hw.pcie_bytes_per_s) == (4.2e12, 380e9, H200.pcie_bytes_per_s)
    assert "measured" in hw.name
    slower = CostModel.for_dtype("shared-owner", N, "bfloat16", hw).step([11999], [12000], decode_only=True)
    assert slower.total > CostModel.for_dtype("shared-owner", N, "bfloat16").step([11999], [12000]).total
    for bad, why in (({"cost_model": {"hbm_bytes_per_s": -1}}, "must be a number > 0"),
                     ({"cost_model": {"warp_speed": 3}}, "unknown figure 'warp_speed'"),
                     ({"kernels": {}}, "no 'cost_model' object"), ([1, 2], "no 'cost_model' object")):
        good.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why):
            H200.with_results(str(good))
    with pytest.raises(ValueError, match="cannot read"):
        H200.with_results(str(tmp_path / "missing.json"))
