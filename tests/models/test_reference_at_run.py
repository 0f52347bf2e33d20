"""The reference at what a run stored and selected: each format's rounding
bound, stored values told apart as the same rounding, a flip at a boundary or
an error, selections as equal, near-tied or mismatched, and transformers'
forward reading the run's values and pinned to its selection.
[[RFC-0001:C-EXACTNESS]] [[RFC-0001:C-KV-FORMAT]]"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.consumers.kv_format import TorchFormat, gqa_fp8, indexer_key_fp8, mla_latent_fp8
from cpkv.models import LlamaAdapter, TinyDsa, TinyLlama
from cpkv.models.round_trip import (RoundTripCache, RunRecord, admit, cache_forward, reference_logits, round_trip,
                                     run_reference)
from cpkv.models.selection import NOISE, compare_selection, indexer_layers

torch.set_num_threads(1)
FORMATS = [TorchFormat((3, 8), torch.float32), TorchFormat((3, 8), torch.bfloat16), mla_latent_fp8(32, 8, tile=16),
           indexer_key_fp8(24, tile=16), gqa_fp8(2, 16)]


def _values(fmt, seed, spread):
    g = torch.Generator().manual_seed(seed)
    shape = (6, *fmt.shape)
    mags = torch.exp(torch.randn(shape, generator=g) * spread)  # values over many binades, tiny ones included
    return torch.randn(shape, generator=g) * mags * torch.exp(torch.randn(6, *[1] * len(fmt.shape), generator=g) * 4)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.0, 4.0))
def test_every_round_trip_stays_within_the_formats_rounding_bound(fmt, seed, spread):
    x = _values(fmt, seed, spread)
    assert bool(((round_trip(fmt, x) - x).abs() <= fmt.rounding(x)).all())
    assert fmt.rounding(x).shape == x.shape and bool((fmt.rounding(x) >= 0).all())


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(seed=st.integers(0, 2**31 - 1), noise=st.floats(0.0, 0.5))
def test_a_run_within_float32_noise_is_admitted_and_a_wrong_scale_is_not(fmt, seed, noise):
    """The run's values differ from the reference's by up to half the noise
    allowance: every rounding of them is admitted (the same one or, at a
    boundary, a flip). A stored slot scaled by 1.1 (a wrong FP8 scale, a
    wrong bf16 value) is not."""
    x = _values(fmt, seed, 1.0)
    g = torch.Generator().manual_seed(seed + 1)
    m = x.flatten(1).abs().amax(1).view(-1, *[1] * len(fmt.shape))
    ran = x + (torch.rand(x.shape, generator=g) * 2 - 1) * noise * NOISE * m
    own = round_trip(fmt, x)
    got = admit(own, x, round_trip(fmt, ran))
    assert got["values"] == x.numel() and got["outside"] == 0 and got["worst"] == 0.0
    wrong = round_trip(fmt, ran).clone()
    wrong[2] *= 1.1
    bad = admit(own, x, wrong)
    assert bad["outside"] > 0 and 0.05 < bad["worst"] < 0.2


def test_a_flip_is_the_neighbouring_rounding_at_a_boundary_only():
    fmt = TorchFormat((4,), torch.bfloat16)
    mid = 1 + 2.0**-8  # halfway between the bf16 values 1 and 1 + 2^-7
    x = torch.tensor([[mid, 1.0, 0.5, -1.0]])
    own = round_trip(fmt, x)
    up = own.clone()
    up[0, 0] = 1 + 2.0**-7  # the other neighbour of a value at the midpoint: a flip
    assert admit(own, x, up) == {"values": 4, "flips": 1, "outside": 0, "worst": 0.0}
    off = own.clone()
    off[0, 1] = 1 + 2.0**-7  # the next value up from 1.0, which is far from any boundary: an error
    got = admit(own, x, off)
    assert (got["flips"], got["outside"]) == (0, 1)
    assert got["worst"] == pytest.approx(2.0**-7 / mid)  # of the slot's largest value
    assert admit(own[:0], x[:0], own[:0])["values"] == 0


def test_selection_rows_are_equal_near_tied_or_mismatched():
    """Five queries at position 3 over four keys, k = 2: the reference keeps
    {0, 1}; a run that keeps {0, 1} is equal, {0, 2} (key 2 ties key 1
    within the band) a near-tie, {0, 3} (key 3 far below) a mismatch, and a
    repeated or a future position a mismatch, whatever the scores."""
    scores = torch.tensor([[4.0, 3.0, 3.0 - 1e-6, 1.0, 9.0]]).repeat(6, 1)
    band = lambda rows: torch.full((rows.numel(), 5), 1e-5)  # noqa: E731
    own = torch.tensor([[0, 1]]).repeat(6, 1)
    run = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 3], [0, 0], [0, 4]])
    got = compare_selection(scores, band, own, run, torch.full((6,), 3))
    assert {k: got[k] for k in ("rows", "equal", "near_ties", "mismatches")} == {
        "rows": 6, "equal": 2, "near_ties": 1, "mismatches": 3}
    assert 1.0 < got["worst"]  # the mismatch's gap is far beyond its bands
    short = compare_selection(scores[:2], band, own[:2], torch.tensor([[0, -1], [0, -1]]), torch.tensor([0, 3]))
    assert (short["equal"], short["mismatches"]) == (1, 1)  # position 0 sees one key; position 3 must keep two


@pytest.fixture(scope="module")
def dsa():
    return TinyDsa(kind="glm-5").build()  # shared layers reuse a pinned selection too


def _own_selection(model, seq):
    """transformers' own top-k of every indexer layer, ``[S, layers, k]``, as
    a run records it (``-1`` for the picks past a query's position, which
    transformers' mask drops)."""
    found = {}
    hooks = [model.model.layers[i].self_attn.indexer.register_forward_hook(
        lambda m, a, out, j=j: found.__setitem__(j, out[0])) for j, i in enumerate(indexer_layers(model))]
    try:
        with torch.no_grad():
            model(seq[None])
    finally:
        for h in hooks:
            h.remove()
    own = torch.stack([found[j] for j in range(len(found))], 1).long()
    return torch.where(own <= torch.arange(seq.numel())[:, None, None], own, -1)


def test_the_reference_pinned_to_a_selection_reads_it_and_reports_its_disagreement(dsa):
    seq = torch.arange(40) * 7 % 256
    plain = reference_logits(dsa, seq)
    own = _own_selection(dsa, seq)
    pinned = torch.ones(40, dtype=torch.bool)
    logits, agree = run_reference(dsa, seq, {}, RunRecord({}, {}, own, pinned))
    assert (logits - plain).abs().max() < 1e-5
    assert (agree.rows, agree.equal, agree.mismatches) == (40 * own.shape[1], 40 * own.shape[1], 0)
    wrong = own.clone()
    p, k = 30, own.shape[2]
    unseen = sorted(set(range(p + 1)) - set(wrong[p, 0].tolist()))
    wrong[p, 0, 0] = unseen[0]  # layer 0, query 30: its best key swapped for one transformers dropped
    logits, agree = run_reference(dsa, seq, {}, RunRecord({}, {}, wrong, pinned))
    assert agree.mismatches >= 1 and agree.near_ties == 0  # that row, and rows whose keys or queries it moved
    assert (logits[:p] - plain[:p]).abs().max() < 1e-5 and (logits[p] - plain[p]).abs().max() > 1e-3
    assert all("forward" not in vars(dsa.model.layers[i].self_attn.indexer) for i in indexer_layers(dsa))
    unpinned = torch.zeros(40, dtype=torch.bool)  # no row pinned: its own selection, nothing compared
    logits, agree = run_reference(dsa, seq, {}, RunRecord({}, {}, wrong, unpinned))
    assert (logits - plain).abs().max() < 1e-5 and agree.rows == 0
    assert k == min(TinyDsa().index_topk, 40)


def test_the_reference_reads_the_runs_stored_values_and_checks_each():
    """Llama with FP8 K and V: the reference holding its own rounding gives
    the round-trip reference's logits; holding a copy with one slot's values
    10% off, it reads them (its logits move) and counts them outside."""
    ad = LlamaAdapter(TinyLlama().build())
    seq = torch.arange(30) * 5 % 200
    fams = ad.kv_families("fp8")
    fmts = {f.name: f.format for f in fams}
    keep = {}
    cache = RoundTripCache(ad.model.config, fmts)
    with torch.no_grad(), cache_forward(ad.model, cache) as forward:  # cache= or past_key_values=, as it takes
        ref = forward(seq[None]).logits[0]
    for name, i in (("k", 0), ("v", 1)):
        keep[name] = torch.stack([layer_states(cache, layer, i) for layer in range(ad.num_layers)])
    layers = {f.name: tuple(f.layers) for f in fams}
    logits, agree = run_reference(ad.model, seq, fmts, RunRecord(keep, layers))
    assert (logits - ref).abs().max() < 1e-6 and agree.outside == 0 and agree.values == sum(
        v.numel() for v in keep.values())
    keep["v"][0, 10] *= 1.1
    logits, agree = run_reference(ad.model, seq, fmts, RunRecord(keep, layers))
    assert agree.outside > 0 and (logits[10:] - ref[10:]).abs().max() > 1e-4
    assert (logits[:10] - ref[:10]).abs().max() < 1e-6


def layer_states(cache, layer, i):
    """The cached keys (``i`` 0) or values (1) of ``layer``, ``[S, Hkv, D]``."""
    x = cache.layers[layer].keys if i == 0 else cache.layers[layer].values
    return x[0].transpose(0, 1)


def test_misuse_is_refused(dsa):
    seq = torch.arange(12)
    fmt = mla_latent_fp8(32, 8)
    with pytest.raises(ValueError, match="neither"):
        RoundTripCache(dsa.config, {}, RunRecord({"k": torch.zeros(1), "latent": torch.zeros(1)}, {}))
    with pytest.raises(ValueError, match="1-D"):
        run_reference(dsa, seq[None], {}, RunRecord({}, {}))
    wrong = RunRecord({"latent": torch.zeros(3, 11, 40)}, {"latent": (0, 1, 2)})
    with pytest.raises(ValueError, match="the run stored"):
        run_reference(dsa, seq, {"latent": fmt}, wrong)
    with pytest.raises(ValueError, match="do not end in"):
        fmt.rounding(torch.zeros(3, 7))
    n = len(indexer_layers(dsa))
    for sel, pinned in ((torch.zeros(12, n + 1, 4), torch.ones(12)), (torch.zeros(12, n, 4), None),
                        (torch.zeros(11, n, 4), torch.ones(11))):
        with pytest.raises(ValueError, match="indexer layers"):
            run_reference(dsa, seq, {}, RunRecord({}, {}, sel, pinned))
    assert all("forward" not in vars(dsa.model.layers[i].self_attn.indexer) for i in indexer_layers(dsa))
    with pytest.raises(ValueError, match="expected"):
        compare_selection(torch.zeros(3, 5), None, torch.zeros(3, 2, dtype=torch.long),
                          torch.zeros(2, 2, dtype=torch.long), torch.arange(3))
