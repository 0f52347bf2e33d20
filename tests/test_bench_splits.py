"""The split benchmark's work counters, on a real process group and a tiny
config, against what each split must do (nothing here is timed):

* ``page`` moves no cache entry; ``interleave`` / ``zigzag`` move, to each
  rank, exactly the new entries it did not compute, every layer;
* ``lse`` computes every decode token on every rank, its attention reads sum
  to one pass over every context (each rank its own pages), and it moves the
  partial outputs; ``owner`` computes each token once and reads its whole context;
* for DSA, ``lse`` splits the attention over the selected positions (one pass
  over each selection in all) while every rank scores every query's whole
  context with the indexer.

[[RFC-0001:C-PLANNER-SPLIT]] [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""

import pytest
import torch

from cpkv.models import TinyDsa, TinyLlama
from cpkv.runtime.comm import LocalComm, run_threads
from cpkv.tools.bench import SplitsSpec, measure_splits
from cpkv.tools.cli import main

pytestmark = pytest.mark.multiproc
N, LAYERS = 4, 2
LLAMA = TinyLlama(layers=LAYERS, max_positions=256)
DSA = TinyDsa(layers=LAYERS, index_topk=8, max_positions=256)


def spec(model):
    # prefill 50 tokens over 3 requests (17, 17, 16: pages of 4 end mid-page); decode 6 requests
    # of context 22, then a ragged batch
    return SplitsSpec(model, cp=N, tokens=50, bs=3, decode_bs=6, context=22, page=4, repeats=1, decode_repeats=1)


@pytest.fixture(scope="module")
def llama():
    return measure_splits(spec(LLAMA), timeout=300)


@pytest.fixture(scope="module")
def dsa():
    return measure_splits(spec(DSA), timeout=300)


def per_rank(result, phase, split, key, family=None):
    ranks = result["phases"][phase][split]["ranks"]
    return [r["reads"].get(family, 0) if key == "reads" else r[key] for r in ranks]


@pytest.mark.parametrize("which", ["llama", "dsa"])
def test_prefill_page_moves_nothing_and_token_splits_move_what_a_rank_did_not_compute(which, request):
    r = request.getfixturevalue(which)
    E = 50
    # bytes per token per layer, from the model's shape: K and V [kv_heads, head_dim]; the latent
    # (kv_lora_rank + rope) and the indexer key, every layer (DeepSeek-V3.2), fp32
    m = LLAMA if which == "llama" else DSA
    per_token = (2 * m.kv_heads * (m.hidden // m.heads) if which == "llama"
                 else m.kv_lora_rank + m.rope_dim + m.index_dim) * 4
    assert per_rank(r, "prefill", "page", "moved") == [0] * N
    for split in ("page", "interleave", "zigzag"):
        tokens = per_rank(r, "prefill", split, "tokens")
        assert sum(tokens) == E and all(t > 0 for t in tokens), split
        if split != "page":
            assert per_rank(r, "prefill", split, "moved") == [(E - t) * per_token * LAYERS for t in tokens], split
    assert per_rank(r, "prefill", "interleave", "tokens") == [13, 13, 12, 12]  # token i on rank i % N


def test_lse_reads_one_pass_over_every_context_and_owner_reads_whole_contexts(llama):
    m = LLAMA
    for phase, contexts in zip(("decode0", "decode1"), llama["contexts"]):
        B, total = len(contexts), sum(contexts)
        assert per_rank(llama, phase, "lse", "tokens") == [B] * N  # every rank computes every token
        lse = per_rank(llama, phase, "lse", "reads", "k")
        assert sum(lse) == LAYERS * total
        assert max(lse) <= LAYERS * (total / N + B * 4)  # lanes even to a page (4) per request
        owner_tokens = per_rank(llama, phase, "owner", "tokens")
        owner = per_rank(llama, phase, "owner", "reads", "k")
        assert sum(owner_tokens) == B and sum(owner) == LAYERS * total
        assert per_rank(llama, phase, "owner", "moved") == [0] * N
        # lse moves each other rank's partial output [B, H, head_dim] and lse [B, H], fp32, every layer
        assert per_rank(llama, phase, "lse", "moved") == [(N - 1) * B * m.heads * (m.hidden // m.heads + 1) * 4
                                                         * LAYERS] * N
    # uniform contexts: a rank's owner reads are exactly its tokens' whole contexts
    ctx = llama["contexts"][0][0]
    assert per_rank(llama, "decode0", "owner", "reads", "k") == [
        LAYERS * ctx * t for t in per_rank(llama, "decode0", "owner", "tokens")]


def test_dsa_lse_splits_the_selected_attention_and_replicates_the_selection(dsa):
    for phase, contexts in zip(("decode0", "decode1"), dsa["contexts"]):
        selected = sum(min(DSA.index_topk, n) for n in contexts)  # each query's top-k of its context
        assert sum(per_rank(dsa, phase, "lse", "reads", "latent")) == LAYERS * selected
        assert sum(per_rank(dsa, phase, "owner", "reads", "latent")) == LAYERS * selected
        assert per_rank(dsa, phase, "lse", "reads", "index_k") == [LAYERS * sum(contexts)] * N
        assert sum(per_rank(dsa, phase, "owner", "reads", "index_k")) == LAYERS * sum(contexts)


def test_cli_bench_splits_runs_on_a_tiny_size(capsys):
    assert main(["bench", "splits", "--model", "llama", "--repeats", "1", "--tokens", "24", "--bs", "2",
                 "--decode-bs", "4", "--context", "12", "--page", "4"]) == 0
    out = capsys.readouterr().out
    assert "prefill 24 tok, bs 2" in out and "decode bs 4, ctx 12" in out
    rows = [line.split() for line in out.splitlines()[2:] if line.split()]  # after the title and the header
    splits = [w for row in rows for w in row if w in ("page", "interleave", "zigzag", "owner", "lse")]
    assert splits == ["page", "interleave", "zigzag", "owner", "lse", "owner", "lse"]


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "3", "--bs", "4"], "3 prefill tokens cannot fill 4 requests"),
    (["--tokens", "3", "--bs", "1"], "the interleave split needs at least cp=4 prefill tokens"),
    (["--context", "1"], "context >= 2, got 1"),
])
def test_cli_bench_splits_refuses_impossible_sizes_before_starting(argv, message, capsys):
    assert main(["bench", "splits", "--model", "llama", *argv]) == 2
    assert message in capsys.readouterr().err


def test_spec_refuses_a_sequence_longer_than_the_model():
    with pytest.raises(ValueError, match="a sequence of 300 exceeds the model's 256 positions"):
        SplitsSpec(LLAMA, tokens=300, bs=1, context=22).check()


def test_cli_bench_splits_refuses_a_non_positive_size(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "splits", "--decode-bs", "0"])
    assert "must be >= 1" in capsys.readouterr().err


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
