"""The engine and disaggregation with the caches in bfloat16 bytes and FP8:
every prefill and decode split exact against ``transformers`` with the same
quantize/dequantize round trip where it caches (a ``DynamicCache`` subclass),
the host tier and the transfer moving stored bytes, peak KV bytes per rank
measured from the pools, and groups of different kv dtypes refused before any
byte moves. Ranks are threads of one process. [[RFC-0001:C-KV-FORMAT]]
[[RFC-0001:C-DISAGG]]"""

import pytest
import torch

from cpkv.consumers.transfer import check_formats
from cpkv.contract.errors import UnsupportedPagePlan
from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine.disagg import DisaggConfig, format_disagg, run_disagg_threads
from cpkv.models import build_adapter, model_config
from cpkv.models.round_trip import RoundTripCache, reference_logits, round_trip
from cpkv.tools.report import format_engine
from support.engine_checks import assert_exact

SPLITS = [("page", "owner"), ("interleave", "lse"), ("zigzag", "owner"), ("page", "lse")]


@pytest.fixture(scope="module")
def dsa():
    return build_adapter(model_config("deepseek-v3.2"))


def _run(adapter, kind, kv_dtype, split, **kw):
    cfg = dict(cp_size=2, page_size=16, device_pages=10, host_pages=32, requests=3, scale=0.08, chunk=40,
               prefill_split=split[0], decode_split=split[1], kv_dtype=kv_dtype, model=model_config(kind),
               check=True)
    return run_engine_threads(EngineConfig(**{**cfg, **kw}), adapter)


@pytest.mark.parametrize("split", SPLITS, ids="-".join)
@pytest.mark.parametrize("kind", ["llama", "deepseek-v3.2"])
def test_every_split_is_exact_under_fp8(llama, dsa, kind, split):
    """Each split (page / interleave / zigzag prefill, owner / lse decode) with
    FP8 pools and a host tier: every logit within 1e-4 of the quantized
    reference, greedy tokens equal, host backups and loads of stored rows."""
    tight = dict(device_pages=6, host_pages=48) if split[0] == "page" else {}  # host loads (interleave refuses
    r = _run(llama if kind == "llama" else dsa, kind, "fp8", split, **tight)  # the 1-token chunk they leave)
    assert_exact(r)
    assert r["kv_dtype"] == "fp8" and r["backup_pages"] > 0 and (r["load_pages"] > 0 or not tight)
    u = r["check"]["unquantized"]  # the divergence from the float model is reported, and it is not zero
    assert u["max_abs_diff"] > 1e-3 and 0 <= u["greedy_agreement"] <= r["requests"]


@pytest.mark.parametrize("kind", ["llama", "deepseek-v3.2"])
def test_bytes_per_rank_scale_with_the_format_on_the_same_trace(llama, dsa, kind):
    """The same trace at float32, bfloat16 and fp8: the same schedule, so peak
    KV bytes per rank and host bytes scale exactly as the pools' measured bytes
    per token; bf16 is exact against its own round trip."""
    ad = llama if kind == "llama" else dsa
    small = dict(requests=2, scale=0.06, device_pages=4, host_pages=48)
    runs = {dt: _run(ad, kind, dt, ("page", "owner"), **small) for dt in ("float32", "bfloat16", "fp8")}
    for dt, r in runs.items():
        assert_exact(r)
        per_token = sum(f.slot_bytes() for f in ad.kv_families(dt))
        assert r["kv_bytes_per_token"] == per_token
    f32 = runs["float32"]
    for dt in ("bfloat16", "fp8"):
        ratio = runs[dt]["kv_bytes_per_token"] / f32["kv_bytes_per_token"]
        assert runs[dt]["peak_kv_bytes_per_rank"] == [int(b * ratio) for b in f32["peak_kv_bytes_per_rank"]]
        assert runs[dt]["backup_bytes"] == int(f32["backup_bytes"] * ratio) > 0
    assert runs["bfloat16"]["kv_bytes_per_token"] * 2 == f32["kv_bytes_per_token"]
    assert runs["fp8"]["kv_bytes_per_token"] < runs["bfloat16"]["kv_bytes_per_token"]
    assert f32["check"]["unquantized"]["max_abs_diff"] == f32["check"]["max_abs_diff"]
    text = format_engine(runs["fp8"])  # the report names the kv dtype, its bytes and the divergence
    assert f"fp8, {runs['fp8']['kv_bytes_per_token']}" in text and "vs unquantized" in text
    assert "vs unquantized" not in format_engine(f32)


def test_round_trip_cache_rounds_what_transformers_caches(llama, dsa):
    """The reference cache stores decode(encode(x)) at the point transformers
    caches: a forward through it differs from the plain one, and equals the
    plain one when no family has a format; misuse is refused."""
    seq = torch.arange(40) % 200
    for ad in (llama, dsa):
        plain = reference_logits(ad.model, seq)
        fmts = {f.name: f.format for f in ad.kv_families("fp8")}
        q = reference_logits(ad.model, seq, fmts)
        assert 1e-3 < float((q - plain).abs().max()) < 1.0
        assert torch.equal(reference_logits(ad.model, seq, {}), plain)
    fmt = dsa.kv_families("fp8")[0].format
    x = torch.randn(2, 3, fmt.values)
    assert torch.equal(round_trip(fmt, x), fmt.decode(fmt.encode(x)))
    with pytest.raises(ValueError, match="neither"):
        RoundTripCache(llama.model.config, {"k": fmt, "latent": fmt})
    with pytest.raises(ValueError, match="1-D"):
        reference_logits(llama.model, seq[None])
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        llama.kv_families("fp16")


def test_disaggregation_between_page_sizes_is_exact_under_fp8(dsa):
    """DeepSeek-V3.2 in FP8 prefilled on 2 ranks of page 16, decoded on 3 ranks
    of page 4: the transfer moves the stored rows (bytes per token the fp8
    families'), and every logit is exact against the quantized reference."""
    cfg = DisaggConfig(prefill_size=2, decode_size=3, page_size=16, decode_page=4, device_pages=6, decode_pages=20,
                       host_pages=0, requests=3, scale=0.06, chunk=40, model=model_config("deepseek-v3.2"),
                       kv_dtype="fp8", check=True)
    r = run_disagg_threads(cfg, dsa)
    assert_exact(r)
    per_slot = sum(f.slot_bytes() for f in dsa.kv_families("fp8"))
    assert r["bytes_moved"] == r["transferred_tokens"] * per_slot > 0 and r["units"] == ["slot-run"]
    assert r["kv_dtype"] == "fp8" and "KV in fp8" in format_disagg(r) and "unquantized" in format_disagg(r)


def test_groups_with_different_kv_dtypes_are_refused_before_any_byte_moves(llama, monkeypatch):
    import cpkv.engine.disagg.link as link

    sent = []
    monkeypatch.setattr(link, "send_transfer", lambda *a, **k: sent.append(a) or (None, {}))
    cfg = DisaggConfig(prefill_size=1, decode_size=1, device_pages=20, host_pages=0, requests=2, scale=0.05,
                       kv_dtype="fp8", decode_kv_dtype="bfloat16")
    with pytest.raises(UnsupportedPagePlan, match="kv-format-mismatch.*'k'"):
        run_disagg_threads(cfg, llama)
    assert sent == []
    with pytest.raises(ValueError, match="d_kv_dtype must be one of"):
        run_disagg_threads(DisaggConfig(decode_kv_dtype="int8"), llama)
    fp8, bf16 = llama.kv_families("fp8"), llama.kv_families("bfloat16")
    check_formats(fp8, llama.kv_families("fp8"))  # the same formats pass
    with pytest.raises(UnsupportedPagePlan, match="kv-format-mismatch"):
        check_formats(fp8, bf16)
    with pytest.raises(UnsupportedPagePlan, match="kv-format-mismatch"):
        check_formats(fp8, fp8[:1])
