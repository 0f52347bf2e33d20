"""The check still catches a real error once the format's rounding no longer
counts against a run: one stored FP8 scale, one latent row or one indexer
key perturbed in the pool, or one DSA selection changed, each fails
:func:`cpkv.engine.exactness.failures` with the reason; the same run
unperturbed passes. Ranks are threads. [[RFC-0001:C-EXACTNESS]]"""

import functools
import threading

import pytest
import torch

from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine.check import run_record
from cpkv.engine.exactness import TOLERANCE, failures
from cpkv.models import build_adapter, model_config
from support.engine_checks import other_row, perturb_first_stored, scale_off

torch.set_num_threads(1)
CFG = dict(cp_size=2, page_size=16, device_pages=10, host_pages=0, requests=1, scale=0.03, chunk=16,
           model=model_config("deepseek-v3.2"), kv_dtype="fp8", check=True)


@pytest.fixture(scope="module")
def dsa():
    return build_adapter(model_config("deepseek-v3.2"))


@pytest.mark.parametrize("family,change", [("latent", scale_off), ("latent", other_row), ("index_k", scale_off)],
                         ids=["latent-scale", "latent-row", "index-key-scale"])
def test_a_perturbed_stored_value_fails_the_check(dsa, monkeypatch, family, change):
    done = perturb_first_stored(monkeypatch, family, change)
    c = run_engine_threads(EngineConfig(**CFG), dsa)["check"]
    assert done == [family]
    why = failures(c)
    assert len(why) == 1 and "no rounding of the reference's" in why[0], why
    assert c["agreement"]["outside"] > 0 and c["max_abs_diff"] < TOLERANCE  # the reference read what was stored


def test_a_changed_selection_fails_the_check_and_the_run_unchanged_passes(dsa, monkeypatch):
    c = run_engine_threads(EngineConfig(**CFG), dsa)["check"]
    assert failures(c) == [] and c["agreement"]["rows"] > 0 and c["agreement"]["values"] > 0
    select, lock, done = type(dsa).select, threading.Lock(), []

    def changed(self, layer, q, w, cache):
        out = select(self, layer, q, w, cache)
        rows = (cache.positions + 1 > self.index_topk).nonzero().flatten()
        with lock:
            if done or not rows.numel():
                return out
            done.append(int(rows[0]))
        t, picked = int(rows[0]), set(out[int(rows[0])].tolist())
        out = out.clone()  # its best key swapped for a visible one it dropped
        out[t, 0] = next(p for p in range(int(cache.positions[t]) + 1) if p not in picked)
        return out

    monkeypatch.setattr(type(dsa), "select", changed)
    c = run_engine_threads(EngineConfig(**CFG), dsa)["check"]
    assert done and c["agreement"]["mismatches"] >= 1
    assert any("beyond a near-tie" in w for w in failures(c)), failures(c)


def test_failures_name_each_broken_condition():
    ok = {"max_abs_diff": 1e-6, "requests": 2, "requests_matched": 2, "mismatched": [], "tolerance": TOLERANCE,
          "agreement": {"values": 10, "flips": 1, "outside": 0, "worst_value": 0.0, "rows": 4, "equal": 3,
                        "near_ties": 1, "mismatches": 0, "worst_gap": 0.5}}
    assert failures(ok) == [] and failures(None) == ["no check ran"]
    assert failures(ok, tolerance=1e-7) == ["max abs logit difference 1e-06 > tolerance 1e-07"]
    bad = dict(ok, requests_matched=1, mismatched=["r1"],
               agreement=dict(ok["agreement"], outside=2, worst_value=0.1, mismatches=1))
    assert [w.split()[0] for w in failures(bad)] == ["greedy", "2", "1"]


def test_a_request_without_a_record_is_refused():
    class R:
        index, seq, spec = 5, [1, 2, 3], type("S", (), {"id": "r5"})

    with pytest.raises(ValueError, match="no stored values of request 'r5'"):
        run_record(R(), [R()], {}, {}, {"latent": (0,)})


def test_a_reference_that_drops_its_cache_fails_naming_the_count(dsa, monkeypatch):
    """A ``transformers`` that ignores the cache it is handed (5.17 took ``cache=`` silently) compares
    nothing of what the run stored: the check fails, and says it compared 0 values."""
    forward = type(dsa.model).forward

    @functools.wraps(forward)
    def dropping(self, *args, **kwargs):
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(dsa.model), "forward", dropping)
    c = run_engine_threads(EngineConfig(**dict(CFG, kv_dtype="float32")), dsa)["check"]
    assert c["values_compared"] == 0
    assert "0 stored values compared: the reference never received the run's cache" in failures(c), failures(c)
