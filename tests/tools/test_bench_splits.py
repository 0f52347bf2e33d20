"""The split benchmark's work counters, on a real process group and a tiny
config, against what each split must do (nothing here is timed):

* ``page`` moves no cache entry; ``interleave`` / ``zigzag`` move, to each
  rank, exactly the new entries it did not compute, every layer;
* ``lse`` computes each decode token once, on its home rank, its attention
  reads sum to one pass over every context (each rank its own pages), and it
  moves the queries and the partial outputs; ``owner`` computes each token
  once and reads its whole context;
* for DSA, ``lse`` splits the attention over the selected positions (one pass
  over each selection in all) and the indexer's scoring (each rank its own
  keys: one pass over every context, balanced), and moves the queries' inputs,
  the top-k exchange's scores and the partials.

One ``cpkv bench splits --json --repeats 1`` on a tiny size supplies them all.

[[RFC-0001:C-PLANNER-SPLIT]] [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""

import contextlib
import io
import json

import pytest
import torch

from cpkv.runtime.lse import exchange_width
from cpkv.models import TinyLlama
from cpkv.runtime.comm import LocalComm, run_threads
from cpkv.tools.bench import SplitsSpec, splits_model
from cpkv.tools.cli import main

pytestmark = pytest.mark.multiproc
N, E, CONTEXT = 4, 50, 300
LLAMA, DSA = splits_model("llama", 512), splits_model("deepseek-v3.2", 512)
# prefill 50 tokens over 3 requests (17, 17, 16: pages of 4 end mid-page); decode 5 requests of
# context 300, then a ragged batch (150 .. 449); DSA's indexer keeps 256 positions per query
ARGV = ["bench", "splits", "--json", "--repeats", "1", "--cp", str(N), "--tokens", str(E), "--bs", "3",
        "--decode-bs", "5", "--context", str(CONTEXT), "--page", "4"]


@pytest.fixture(scope="module")
def report():
    """One ``cpkv bench splits --repeats 1`` of both models on a tiny size: a
    process group per model."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(ARGV) == 0
    return json.loads(out.getvalue())


def per_rank(raw, phase, split, key, family=None):
    ranks = raw["phases"][phase][split]["ranks"]
    return [r["reads"].get(family, 0) if key == "reads" else r[key] for r in ranks]


def test_cli_bench_splits_runs_on_a_tiny_size(report):
    assert list(report) == ["llama", "deepseek-v3.2"]
    for model, r in report.items():
        assert [(row["case"].split()[0], row["split"]) for row in r["rows"]] == [
            ("prefill", "page"), ("prefill", "interleave"), ("prefill", "zigzag"),
            ("decode", "owner"), ("decode", "lse"), ("decode", "owner"), ("decode", "lse")]
        assert all(row["ms/fwd"] > 0 and row["cpu ms max"] > 0 for row in r["rows"])
        assert r["title"].startswith("splits: ") and "CPU cores" in r["title"]


@pytest.mark.parametrize("model", ["llama", "deepseek-v3.2"])
def test_prefill_page_moves_nothing_and_token_splits_move_what_a_rank_did_not_compute(model, report):
    raw = report[model]["raw"]
    # bytes per token per layer, from the model's shape: K and V [kv_heads, head_dim]; or the latent
    # (kv_lora_rank + rope) and the indexer key, on every layer of DeepSeek-V3.2; fp32
    m = LLAMA if model == "llama" else DSA
    per_token = (2 * m.kv_heads * (m.hidden // m.heads) if model == "llama"
                 else m.kv_lora_rank + m.rope_dim + m.index_dim) * 4
    assert per_rank(raw, "prefill", "page", "moved") == [0] * N
    for split in ("page", "interleave", "zigzag"):
        tokens = per_rank(raw, "prefill", split, "tokens")
        assert sum(tokens) == E and all(t > 0 for t in tokens), split
        if split != "page":
            assert per_rank(raw, "prefill", split, "moved") == [(E - t) * per_token * m.layers for t in tokens], split
    assert per_rank(raw, "prefill", "interleave", "tokens") == [13, 13, 12, 12]  # token i on rank i % N


def test_lse_reads_one_pass_over_every_context_and_owner_reads_whole_contexts(report):
    raw, m = report["llama"]["raw"], LLAMA
    D = m.hidden // m.heads
    for phase, contexts in zip(("decode0", "decode1"), raw["contexts"]):
        B, total = len(contexts), sum(contexts)
        home = per_rank(raw, phase, "lse", "tokens")
        assert sum(home) == B  # each token computed once, by its home rank
        lse = per_rank(raw, phase, "lse", "reads", "k")
        assert sum(lse) == m.layers * total
        assert max(lse) <= m.layers * (total / N + B * 4)  # lanes even to a page (4) per request
        owner_tokens = per_rank(raw, phase, "owner", "tokens")
        assert sum(owner_tokens) == B and sum(per_rank(raw, phase, "owner", "reads", "k")) == m.layers * total
        assert per_rank(raw, phase, "owner", "moved") == [0] * N
        # lse moves, every layer, the other ranks' queries [B - home, H, D] and the partial outputs of this
        # rank's tokens from every other rank [home, H, D] with their LSEs [home, H]; fp32
        assert per_rank(raw, phase, "lse", "moved") == [
            m.layers * 4 * ((B - h) * m.heads * D + (N - 1) * h * m.heads * (D + 1)) for h in home]
    # same-length contexts: a rank's owner reads are exactly its tokens' whole contexts
    assert raw["contexts"][0] == [CONTEXT] * 5
    assert per_rank(raw, "decode0", "owner", "reads", "k") == [
        m.layers * CONTEXT * t for t in per_rank(raw, "decode0", "owner", "tokens")]


def test_dsa_lse_splits_the_selected_attention_and_the_selection(report):
    raw, m = report["deepseek-v3.2"]["raw"], DSA
    assert CONTEXT // 2 < m.index_topk < CONTEXT  # sparse on every uniform context, dense on some ragged ones
    for phase, contexts in zip(("decode0", "decode1"), raw["contexts"]):
        B, total = len(contexts), sum(contexts)
        selected = sum(min(m.index_topk, n) for n in contexts)  # each query's top-k of its context
        lat = per_rank(raw, phase, "lse", "reads", "latent")
        assert sum(lat) == m.layers * selected and max(lat) <= m.layers * (selected / N + B * 4)
        assert sum(per_rank(raw, phase, "owner", "reads", "latent")) == m.layers * selected
        # each rank scores its own keys of every query: one pass over every context in all, balanced
        idx = per_rank(raw, phase, "lse", "reads", "index_k")
        assert sum(idx) == m.layers * total and max(idx) <= m.layers * (total / N + B * 4)
        assert sum(per_rank(raw, phase, "owner", "reads", "index_k")) == m.layers * total
        # moved, every layer: the other ranks' q_lora latents and indexer head weights, the top-k exchange's
        # scores of each query over more than k keys (exchange_width a rank), the partial outputs of this
        # rank's tokens (after W_UV: v_head wide) with their LSEs; fp32. The fallback and tie rounds on top.
        home, over = per_rank(raw, phase, "lse", "tokens"), sum(n > m.index_topk for n in contexts)
        for h, t, moved in zip(home, per_rank(raw, phase, "lse", "traffic"), per_rank(raw, phase, "lse", "moved")):
            assert t["query_allgather"] == m.layers * 4 * (B - h) * (m.q_lora_rank + m.index_heads)
            assert t["topk_exchange"] == m.layers * 4 * (N - 1) * over * exchange_width(m.index_topk, N)
            assert t["partial_alltoall"] == m.layers * 4 * (N - 1) * h * m.heads * (m.v_dim + 1)
            assert moved == sum(t.values()) and set(t) <= {"query_allgather", "topk_exchange", "partial_alltoall",
                                                           "topk_fallback", "topk_ties"}
        assert sum(home) == B


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "3", "--bs", "4"], "--bs 4: more than llama's prefill tokens (a request takes one at least) (3)"),
    (["--tokens", "3", "--bs", "1"], "the interleave split needs at least cp=4 prefill tokens"),
    (["--context", "1"], "context >= 2, got 1"),
])
def test_cli_bench_splits_refuses_impossible_sizes_before_starting(argv, message, capsys):
    try:
        code = main(["bench", "splits", "--model", "llama", *argv])  # the benchmark's own refusal
    except SystemExit as e:  # the sizes checked before anything (cpkv.tools.sizes)
        code = e.code
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_spec_refuses_a_sequence_longer_than_the_model():
    with pytest.raises(ValueError, match="a sequence of 300 exceeds the model's 256 positions"):
        SplitsSpec(TinyLlama(max_positions=256), tokens=300, bs=1, context=22).check()


def test_cli_bench_splits_refuses_a_non_positive_size(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "splits", "--decode-bs", "0"])
    assert "must be an integer >= 1" in capsys.readouterr().err


def test_all_gather_refuses_sizes_that_disagree_with_the_tensor():
    with pytest.raises(ValueError, match="sizes \\[2\\] do not match its 3 rows"):
        LocalComm().all_gather(torch.zeros(3), sizes=[2])

    def rank(comm):
        x = torch.full((comm.rank + 1, 2), float(comm.rank))
        got = comm.all_gather(x, sizes=[1, 2])
        with pytest.raises(ValueError, match="do not match"):
            comm.all_gather(x, sizes=[1])
        return [t.shape[0] for t in got]

    assert run_threads(2, rank) == [[1, 2], [1, 2]]


def test_measure_splits_refuses_specs_one_group_cannot_run():
    from cpkv.tools.bench import measure_splits

    tiny = TinyLlama(max_positions=256)
    with pytest.raises(ValueError, match="cp must agree"):
        measure_splits(SplitsSpec(tiny, cp=2, context=22), SplitsSpec(splits_model("deepseek-v3.2", 256), cp=4,
                                                                      context=22))
    with pytest.raises(ValueError, match="one spec per model family"):
        measure_splits(SplitsSpec(tiny, context=22), SplitsSpec(tiny, context=22))
    with pytest.raises(ValueError, match="at least one spec"):
        measure_splits()
