"""Every way of dividing a batch among ranks gives transformers' logits: the
page split, the interleave and zigzag token splits (all-gather, then owner
writes), the owner and log-sum-exp decode splits. Ranks run as threads of one
process over one shared buffer; the process group runs the same code
(tests/engine/test_engine_group.py).
[[RFC-0001:C-PLANNER-SPLIT]] [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""

import pytest
import torch

from cpkv import UnsupportedPagePlan
from cpkv.models import LlamaAdapter, TinyLlama
from cpkv.runtime.forward_plan import balanced_ranks, interleave_ranks, zigzag_ranks

from support.groups import run_group as support_run_group

MODEL = TinyLlama()
REQUESTS = [(37, 61), (0, 50), (5, 13), (0, 9), (16, 40)]  # (cached prefix, prompt): mid-page, aligned, fresh


@pytest.fixture(scope="module")
def llama():
    return LlamaAdapter(MODEL.build())


def run_group(adapter, N, S, prefill, decode, steps=5, requests=REQUESTS, decode_counters_only=True):
    """Prefill cached prefixes, then the batch, then ``steps`` greedy decode
    steps, on N thread ranks; returns every request's logits and the runners
    (their work counters count the decode steps only, unless told otherwise)."""
    return support_run_group(adapter, N, S, prefill, decode, steps=steps, requests=requests, pages_per_rank=64,
                             decode_counters_only=decode_counters_only)


@pytest.mark.parametrize("N,S", [(1, 16), (2, 4), (3, 16), (4, 1), (8, 2)])
@pytest.mark.parametrize("prefill,decode", [("page", "owner"), ("interleave", "lse"), ("zigzag", "lse"),
                                            ("page", "lse")])
def test_every_split_matches_transformers(llama, N, S, prefill, decode):
    prompts, results = run_group(llama, N, S, prefill, decode)
    logits, gen, _ = results[0]
    for other in results[1:]:  # every rank ends with the same logits and tokens
        assert other[1] == gen
    with torch.no_grad():
        for r, p in enumerate(prompts):
            seq = torch.cat([p, torch.tensor(gen[r])])
            ref = llama.model(seq[None]).logits[0]
            assert (logits[r] - ref[: logits[r].shape[0]]).abs().max() < 1e-4
            assert ref[p.numel() - 1 : -1].argmax(-1).tolist() == gen[r]  # greedy tokens equal


def test_page_split_moves_no_entries_and_token_splits_do(llama):
    for prefill, moved in (("page", False), ("interleave", True), ("zigzag", True)):
        _, results = run_group(llama, 2, 4, prefill, "owner", steps=1, decode_counters_only=False)
        runs = [r[2] for r in results]
        assert (sum(r.traffic.get("kv_allgather", 0) for r in runs) > 0) == moved, prefill
        assert sum(r.moved_bytes for r in runs) == sum(r.traffic.get("kv_allgather", 0) for r in runs)
        prefilled = sum(p for _, p in REQUESTS)
        assert sum(r.tokens_computed for r in runs) == prefilled + len(REQUESTS)  # the one decode step, once each


def test_lse_decode_divides_context_reads_and_owner_decode_does_not_replicate(llama):
    """Under ``lse`` each decode token is computed once, by its home rank (the
    owner of its new slot), while every rank attends it over the context on
    its own pages: reads sum to one pass over every context, none of another
    rank's pages; what moves is the queries and the partial outputs. Under
    ``owner`` each token is computed once, by one rank, reading its whole
    context through the shared view (pages of other ranks included), and no
    collective moves anything."""
    steps, N = 3, 4
    ctx = sum(p + 1 + j for _, p in REQUESTS for j in range(steps))  # context lengths at each decode step
    _, lse = run_group(llama, N, 1, "page", "lse", steps=steps)
    lse = [r[2] for r in lse]
    assert sum(r.tokens_computed for r in lse) == steps * len(REQUESTS)
    layers = llama.num_layers
    assert sum(r.kv_read for r in lse) == layers * ctx
    assert max(r.kv_read for r in lse) <= layers * (ctx / N + steps * len(REQUESTS))  # page 1: lanes even to a page
    assert all(r.traffic.get("kv_remote_read", 0) == 0 for r in lse)
    assert all(r.traffic["query_allgather"] > 0 and r.traffic["partial_alltoall"] > 0 for r in lse)
    _, own = run_group(llama, N, 1, "page", "owner", steps=steps)
    own = [r[2] for r in own]
    assert sum(r.tokens_computed for r in own) == steps * len(REQUESTS)
    assert sum(r.traffic["kv_remote_read"] for r in own) > 0 and all(r.moved_bytes == 0 for r in own)


def test_a_batch_shorter_than_the_group_runs_under_interleave_as_the_page_split(llama):
    """A prefill of 3 tokens on 4 ranks under interleave (the planner refuses it: a rank would have none) runs
    under the page split, nothing moved, transformers' logits; a batch of N tokens or more still interleaves.
    (tools/gpu_check.py's llama-n4-interleave met such a batch at step 28 and exited 2.)"""
    prompts, results = run_group(llama, 4, 4, "interleave", "owner", steps=1, requests=[(0, 3)],
                                 decode_counters_only=False)
    logits, gen, _ = results[0]
    assert sum(r[2].moved_bytes for r in results) == 0
    with torch.no_grad():
        ref = llama.model(torch.cat([prompts[0], torch.tensor(gen[0])])[None]).logits[0]
    assert (logits[0] - ref[: logits[0].shape[0]]).abs().max() < 1e-4
    _, results = run_group(llama, 4, 4, "interleave", "owner", steps=0, requests=[(0, 4)], decode_counters_only=False)
    assert sum(r[2].moved_bytes for r in results) > 0


def test_interleave_ranks_deal_tokens_in_turn():
    """Token i goes to rank i % N; fewer tokens than ranks is refused (a rank would get none)."""
    assert interleave_ranks(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(UnsupportedPagePlan, match="interleave-too-short"):
        interleave_ranks(2, 3)


@pytest.mark.parametrize("n,N", [(10, 2), (3, 2), (8, 2), (1, 4), (17, 3), (0, 2)])
def test_zigzag_blocks(n, N):
    ranks = zigzag_ranks(torch.tensor([n]), N).tolist()
    sizes = [n // (2 * N) + (b < n % (2 * N)) for b in range(2 * N)]
    want = [b if b < N else 2 * N - 1 - b for b, k in enumerate(sizes) for _ in range(k)]
    assert ranks == want


@pytest.mark.parametrize("n,N,seed", [(64, 4, 0), (5, 4, 1), (3, 4, 2), (0, 2, 3), (33, 3, 4), (7, 1, 5)])
def test_balanced_ranks_deal_work_evenly(n, N, seed):
    """Counts differ by at most one and sums by at most the largest item; the
    largest item goes to rank 0; pure (the same on every call)."""
    work = torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed))
    ranks = balanced_ranks(work, N)
    assert torch.equal(ranks, balanced_ranks(work, N)) and ranks.shape == (n,)
    counts = torch.bincount(ranks, minlength=N)
    sums = torch.zeros(N, dtype=work.dtype).index_add_(0, ranks, work)
    assert counts.numel() == N and int(counts.max() - counts.min()) <= 1
    if n:
        assert int(sums.max() - sums.min()) <= int(work.max()) and int(ranks[work.argmax()]) == 0


def test_auto_decode_split_asks_its_chooser_and_refuses_misuse(llama):
    """``decode_split="auto"`` runs each forward of decodes under the split
    ``choose_split(alloc)`` names (counted in ``decode_choices``), exactly;
    without a chooser, or for a chooser's answer that is no split, it refuses."""
    from cpkv import SharedKVLayout
    from cpkv.runtime.parts import build_parts

    asked = []

    def choose(alloc):  # a function of the batch: every rank gets the same answer
        asked.append(alloc.batch_size)
        return "lse" if int(alloc.seq_lens.max()) % 2 else "owner"

    _, lse = support_run_group(llama, 2, 4, "page", "auto", steps=3, requests=REQUESTS, pages_per_rank=64,
                               choose_split=choose)
    _, ref = run_group(llama, 2, 4, "page", "owner", steps=3)
    for (lg, gen, run), (lg_ref, gen_ref, _) in zip(lse, ref):
        assert gen == gen_ref and all((lg[r] - lg_ref[r]).abs().max() < 1e-5 for r in lg)
        assert sorted(run.decode_choices.values()) == [1, 2] and set(run.decode_choices) == {"lse", "owner"}
    assert asked == [len(REQUESTS)] * 6  # each rank asked once a decode step
    with pytest.raises(ValueError, match="give choose_split"):
        build_parts(llama, SharedKVLayout(1, 4, 8), decode_split="auto")
    own = build_parts(llama, SharedKVLayout(1, 4, 8), decode_split="auto", choose_split=lambda a: "ring",
                      max_requests=1, max_len=8)
    own.extend([0], [torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="choose_split chose 'ring'"):
        own.extend([0], [torch.tensor([3])], decode=True)
