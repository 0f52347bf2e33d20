"""The log-sum-exp decode split's all-local top-k: each rank scores only the
keys on its own pages, and the shares of N ranks are exactly the top-k one
rank scoring the whole row picks (ties to the lower position), with ties at
the threshold on purpose, a rank holding most of the top-k (the fallback
round), N 2 to 8 (thread ranks) and 128K-token rows. What moves is counted.
[[RFC-0001:C-INDEXER-POOL]]"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.models.attention import rank_keys, topk_positions
from cpkv.runtime.comm import LocalComm, run_threads
from cpkv.runtime.lse import Traffic, exchange_width, global_topk, pack_rows, unpack_rows


def owners(L: int, page: int, N: int, base: int = 0) -> torch.Tensor:
    """The rank owning each position of a request whose page q lies on lane ``(base + q) % N``."""
    return (base + torch.arange(L) // page) % N


def split_topk(scores: torch.Tensor, pos: torch.Tensor, k: int, N: int, owner: torch.Tensor):
    """Every rank's :func:`global_topk` share (thread ranks) and traffic, each
    rank seeing the scores of its own positions only."""
    T, L = scores.shape
    visible = torch.arange(L)[None] <= pos[:, None]
    exchange = torch.nonzero(pos + 1 > k).flatten()

    def rank(comm):
        own = visible & (owner == comm.rank)
        traffic = Traffic()
        return global_topk(scores.masked_fill(~own, float("-inf")), exchange, k, comm, traffic, 0), traffic

    return run_threads(N, rank), visible


def assert_exact(scores, pos, k, N, owner):
    """The shares are disjoint, each on its rank's own positions and a prefix
    of its row, and together the whole row's top-k; returns the traffic."""
    results, visible = split_topk(scores, pos, k, N, owner)
    want = topk_positions(scores, visible, k)
    for t in range(scores.shape[0]):
        got = [set(s[t][s[t] >= 0].tolist()) for s, _ in results]
        assert sum(len(g) for g in got) == len(set().union(*got))  # disjoint
        assert set().union(*got) == set(want[t][want[t] >= 0].tolist()), t
        for r, (s, _) in enumerate(results):
            row = s[t]
            n = int((row >= 0).sum())
            assert (row[:n] >= 0).all() and (row[n:] == -1).all()  # packed left
            assert (owner[row[:n]] == r).all()
    return [tr.by_term() for _, tr in results]


def test_rank_keys_order_by_score_then_lower_position():
    """Keys sort as (score descending, position ascending); -0.0 equals 0.0;
    -inf last; every key of a row distinct."""
    s = torch.tensor([[1.0, -0.0, 0.0, -2.5, float("-inf"), 1.0, -1e-30, 3e38, -3e38, 0.0]])
    order = rank_keys(s).argsort(descending=True)[0].tolist()
    want = sorted(range(s.shape[1]), key=lambda i: (-float(s[0, i]) if s[0, i] > float("-inf") else float("inf"), i))
    assert order == want
    assert rank_keys(s).unique().numel() == s.shape[1]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 12), st.integers(1, 5), st.integers(1, 4), st.integers(0, 7),
       st.integers(0, 2**31 - 1))
def test_shares_are_the_whole_rows_top_k(N, k, page, levels, base, seed):
    """Random rows over few score levels (ties everywhere, at the threshold
    too), queries at every depth (some see fewer than k keys: all selected),
    any page size and lane base: the union of the shares is the row's top-k."""
    g = torch.Generator().manual_seed(seed)
    T, L = 5, int(torch.randint(k, 4 * k + 3 * N + 2, (), generator=g))
    scores = torch.randint(0, levels + 1, (T, L), generator=g).float() * 0.5 - 0.5  # -0.5 .. levels/2 - 0.5
    scores[torch.rand(T, L, generator=g) < 0.1] = -0.0  # -0.0 ties with 0.0
    pos = torch.randint(0, L, (T,), generator=g)
    pos[0] = L - 1
    assert_exact(scores, pos, k, N, owners(L, page, N, base))


def test_what_moves_is_counted_and_ties_spread_over_ranks_take_one_round():
    """Distinct scores: one exchange of exchange_width float32 scores per
    query that sees more than k keys, nothing else. Scores tied at the
    threshold on several ranks: then one tie round of positions."""
    N, k, L, page = 4, 8, 64, 2
    scores = torch.rand(3, L, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([L - 1, L - 2, 7])  # the last sees 8 keys: all selected, no exchange
    traffic = assert_exact(scores, pos, k, N, owners(L, page, N))
    m = exchange_width(k, N)
    assert m == 4
    for t in traffic:
        assert t == {"topk_exchange": (N - 1) * 2 * m * 4}
    scores = torch.zeros(3, L)
    scores[:, torch.arange(6) * 9] = torch.arange(1.0, 7.0)  # 6 above, then every other key tied at 0
    traffic = assert_exact(scores, pos, k, N, owners(L, page, N))
    assert all(t["topk_ties"] > 0 and "topk_fallback" not in t for t in traffic)


def test_a_rank_holding_most_of_the_top_k_takes_the_fallback_round():
    """Every high score on rank 0's pages: its best exchange_width scores all
    lie above the threshold, so the rows are exchanged again with k scores a
    rank (topk_fallback); the result is still exact."""
    N, k, L, page = 8, 16, 256, 4
    owner = owners(L, page, N)
    scores = torch.rand(2, L, generator=torch.Generator().manual_seed(1))
    scores[:, owner == 0] += 10.0
    traffic = assert_exact(scores, torch.tensor([L - 1, L - 3]), k, N, owner)
    assert all(t["topk_fallback"] == (N - 1) * 2 * k * 4 for t in traffic)


def test_128k_contexts_with_ties_at_the_threshold():
    """Rows of 131,072 keys (the real DeepSeek-V3.2 top-k of 2048, page 64, N
    8), scores on 64 levels so the 2048th place is a tie many ranks share:
    exact, and each rank receives only the exchange's scores and the tie
    round's positions, never the candidates."""
    N, k, L, page = 8, 2048, 131072, 64
    g = torch.Generator().manual_seed(7)
    scores = torch.randint(0, 64, (2, L), generator=g).float()
    traffic = assert_exact(scores, torch.tensor([L - 1, L - 1000]), k, N, owners(L, page, N, base=3))
    m = exchange_width(k, N)
    for t in traffic:
        assert t["topk_exchange"] == (N - 1) * 2 * m * 4 and t["topk_ties"] > 0
        assert sum(t.values()) < (N - 1) * 2 * k * 8  # less than every candidate (score, position) to every rank


def test_a_group_of_one_needs_no_exchange():
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0]])
    tr = Traffic()
    got = global_topk(scores, torch.tensor([0]), 2, LocalComm(), tr, 0)
    assert got.tolist() == [[0, 2]] and tr.by_term() == {}


def test_pack_rows_round_trips_every_dtype():
    a, b = torch.randn(3, 2, 5), torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    c = torch.randn(3, 7).to(torch.bfloat16)
    packed = pack_rows(a, b, c)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 40 + 16 + 14)
    x, y, z = unpack_rows(packed, [(a.dtype, (2, 5)), (b.dtype, (4,)), (c.dtype, (7,))])
    assert torch.equal(x, a) and torch.equal(y, b) and torch.equal(z, c)
    assert pack_rows(torch.zeros(0, 3)).shape == (0, 12)


def test_misuse():
    with pytest.raises(ValueError, match="unknown traffic term"):
        Traffic().add(0, "kv_teleport", 1)
    assert exchange_width(2048, 8) == 512 and exchange_width(16, 2) == 16 and exchange_width(5, 8) == 2
    assert all(exchange_width(k, n) * n >= k for k in range(1, 40) for n in range(1, 9))
    assert np.all([exchange_width(k, n) <= k for k in range(1, 40) for n in range(1, 9)])


def vllm_merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """vLLM's decode-context-parallel merge, written from
    ``vllm/attention/ops/common.py``: ``cp_lse_ag_out_rs`` all-gathers the
    LSEs, ``_correct_attn_cp_out_kernel`` (``correct_attn_out``) takes
    ``lse = log(sum_r exp(lse_r - max)) + max`` (a NaN or +inf LSE read as
    -inf, the max of an all -inf column read as 0) and scales rank r's output
    by ``exp(lse_r - lse)`` (NaN or +inf exponents as -inf), and the
    reduce-scatter sums the scaled outputs."""
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)
    mx = lses.max(0).values
    mx = torch.where(mx == float("-inf"), 0.0, mx)
    lse = torch.log(torch.exp(lses - mx).sum(0)) + mx
    x = lses - lse
    x = torch.where(torch.isnan(x) | (x == float("inf")), float("-inf"), x)
    return (torch.exp(x)[..., None] * outs).sum(0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_merge_is_vllms(backend):
    """The log-sum-exp merge the lse split's home rank runs
    (:meth:`cpkv.kernels.backend.Backend.merge`) equals vLLM's DCP merge, a
    rank that saw no key (LSE -inf) and a query no rank saw included."""
    from cpkv.kernels import get

    g = torch.Generator().manual_seed(0)
    R, T, H, D = 5, 6, 4, 16
    outs, lses = torch.randn(R, T, H, D, generator=g), torch.randn(R, T, H, generator=g) * 4
    lses[1, 2] = float("-inf")
    outs[1, 2] = 0.0
    lses[:, 4, 1] = float("-inf")
    outs[:, 4, 1] = 0.0
    got, lse = get(backend).merge(outs, lses)
    want = vllm_merge(outs, lses)
    assert torch.allclose(got, torch.nan_to_num(want), atol=1e-6)
    assert not got[4, 1].any() and lse[4, 1] == float("-inf")


def test_all_to_all_sends_each_rank_its_chunk_and_refuses_misuse():
    from cpkv.runtime.reorder import ReorderedComm

    def rank(comm):
        chunks = [torch.full((r + 1, 2), 10 * comm.rank + r) for r in range(comm.size)]
        got = comm.all_to_all(chunks, [comm.rank + 1] * comm.size)
        re = ReorderedComm(comm, [2, 0, 1])
        back = re.all_to_all([torch.full((1,), 10 * re.rank + r) for r in range(3)], [1, 1, 1])
        return [g[:, 0].tolist() for g in got], [int(b) for b in back]

    for r, (got, back) in enumerate(run_threads(3, rank)):
        assert got == [[10 * s + r] * (r + 1) for s in range(3)]
        new = [2, 0, 1].index(r)  # this thread's rank in the reordered group
        assert back == [10 * s + new for s in range(3)]
    local = LocalComm()
    assert local.all_to_all([torch.ones(2)], [2])[0].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="one chunk and one receive size per rank"):
        local.all_to_all([torch.ones(1), torch.ones(1)], [1])
    with pytest.raises(ValueError, match="its own chunk has 1 rows"):
        local.all_to_all([torch.ones(1)], [3])


def test_torch_topk_does_not_break_ties_by_position():
    """Why the check compares selections up to ties: ``torch.topk`` (what
    transformers' indexer runs over its own row) picks among equal scores by
    its sort, not by position, so its set differs from the lower-position
    rule on rows with ties, and with the row's length."""
    g = torch.Generator().manual_seed(0)
    differ = 0
    for L in (100, 1000, 5000):
        x = torch.randint(0, 4, (20, L), generator=g).float()
        ours = topk_positions(x, torch.ones_like(x, dtype=torch.bool), 16)
        theirs = x.topk(16).indices
        differ += sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ours, theirs))
    assert differ > 0
