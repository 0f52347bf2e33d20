"""``cpkv bench alloc`` on a small pool: every row's baselines return what the
allocator returns (the benchmark asserts it before timing), each row carries
its ratios, goal and verdict, and a row that misses its goal its profile;
vLLM's BlockPool restated as its free queue does it."""

import numpy as np
import pytest
import torch

from cpkv.tools.bench import bench_alloc
from cpkv.tools.bench.alloc import ARANGE_GOAL, GOALS, VLLM_GOAL, format_alloc, format_why, goals_met
from cpkv.tools.bench.baseline import BlockPoolBaseline


def test_a_small_bench_alloc_agrees_with_its_baselines():
    rows = bench_alloc(page=4, cp=2, pool_pages=256, tokens=64, batch_sizes=(1, 4), decode_bs=8, repeats=1)
    assert [r["case"].split(" (")[0] for r in rows] == [
        "extend bs=1", "extend bs=4", "extend bs=4 ragged", "decode bs=8", "free of 16 pages by slots",
        "free_pages of 16 pages"]
    for r in rows:
        assert r["cp2/deque"] > 0 and r["cp2/cp1"] > 0
        assert r["goal"] == f"<= {next(v for k, v in GOALS.items() if r['case'].startswith(k))}"
        assert (r["cp2/arange"] != "-") == r["case"].startswith("extend")
        assert (r["cp2/vllm"] != "-") == r["case"].startswith("decode")
        assert r["met"] == goals_met(r["cp2/deque"], r["cp2/arange"], float(r["goal"][3:]), r["cp2/vllm"])
        assert ("profile" in r) == (r["met"] != "yes")
        if "profile" in r:
            p = r["profile"]
            assert p["cold ms"] > 0 and p["warm ms"] > 0 and p["goal ms"] > 0
            assert p["functions"] and all(".py:" in f["where"] and 0.03 <= f["share"] <= 1 for f in p["functions"])
    lines, missed = format_alloc(rows, "t").splitlines(), [r for r in rows if "profile" in r]
    assert len(lines) == 2 + len(rows) and "profile" not in lines[1]
    why = format_why(rows).splitlines()
    assert [ln.split(":")[0].strip() for ln in why[1:]] == [r["case"] for r in missed] and len(why) == (
        1 + len(missed) if missed else 0)


@pytest.mark.parametrize("deque, arange, vllm, want", [
    (0.4, 2.0, "-", "yes"), (0.41, 2.0, "-", "no (deque)"), (0.4, 2.01, "-", "no (arange)"),
    (0.5, 3.0, "-", "no (deque, arange)"), (0.39, "-", "-", "yes"), (0.5, "-", "-", "no (deque)"),
    (0.4, "-", 1.0, "yes"), (0.4, "-", 1.01, "no (vllm)"), (0.5, "-", 2.0, "no (deque, vllm)"),
])
def test_goals_met_is_at_most_each_goal(deque, arange, vllm, want):
    """At the goal is met; past any ratio is not, and the verdict names which."""
    assert ARANGE_GOAL == 2.0 and VLLM_GOAL == 1.0 and goals_met(deque, arange, 0.4, vllm) == want


def test_each_row_is_judged_against_its_own_goal(monkeypatch):
    """With every case timed alike (cp 0.45 of the deque, 1.5x arange), the
    rows differ only by their goals: extend at bs 1 (0.6), decode (0.5) and
    free (1.0) meet theirs, extend past bs 1 (0.4) does not."""
    from cpkv.tools.bench import alloc

    times = {"cp": 0.45, "deque": 1.0, "arange": 0.3, "cp1": 1.0, "vllm": 1.0}
    monkeypatch.setattr(alloc, "median_seconds", lambda cases, repeats: {k: times[k] for k in cases})
    rows = bench_alloc(page=4, cp=2, pool_pages=256, tokens=64, batch_sizes=(1, 4), decode_bs=8, repeats=1)
    assert {r["case"].split(" (")[0]: r["met"] for r in rows} == {
        "extend bs=1": "yes", "extend bs=4": "no (deque)", "extend bs=4 ragged": "no (deque)", "decode bs=8": "yes",
        "free of 16 pages by slots": "yes", "free_pages of 16 pages": "yes"}
    assert {r["case"].split(" (")[0] for r in rows if "profile" in r} == {"extend bs=4", "extend bs=4 ragged"}
    assert all(r["profile"]["goal ms"] == pytest.approx(400) and r["profile"]["floor ms"] == pytest.approx(300)
               for r in rows if "profile" in r)
    times["vllm"] = 0.4  # vLLM's pool faster than the allocator: decode misses that goal alone
    rows = bench_alloc(page=4, cp=2, pool_pages=256, tokens=64, batch_sizes=(1,), decode_bs=8, repeats=1)
    assert next(r["met"] for r in rows if r["case"].startswith("decode")) == "no (vllm)"


def test_block_pool_pops_the_longest_free_first_with_one_reference():
    """vLLM's free queue restated: blocks leave from the head in order (block 0
    taken as the null block), each with one reference; asking for more than
    are free is refused and takes none."""
    pool = BlockPoolBaseline(6, 4, 2, 4)
    assert pool.null_block.block_id == 0 and pool.free_block_queue.num_free_blocks == 6
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in got)
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    with pytest.raises(ValueError, match="Cannot get 3 free blocks"):
        pool.get_new_blocks(3)
    assert pool.free_block_queue.num_free_blocks == 2
    assert [b.block_id for b in pool.get_new_blocks(2)] == [5, 6]
    head, tail = pool.free_block_queue.fake_free_list_head, pool.free_block_queue.fake_free_list_tail
    assert head.next_free_block is tail and tail.prev_free_block is head


def test_block_pool_decode_takes_a_block_exactly_where_a_token_starts_one():
    """A decode step over the pool: slots follow each request's own blocks;
    a request whose new token starts a block gets the next free block."""
    S = 4
    pool = BlockPoolBaseline(20, S, 3, 4)
    pool.alloc_extend([4, 5, 7])  # blocks 1 | 2 3 | 4 5
    out = pool.alloc_decode(np.array([5, 6, 8]))  # positions 4 (starts a block), 5, 7
    assert out.tolist() == [6 * S + 0, 3 * S + 1, 5 * S + 3]
    assert [[b.block_id for b in bl] for bl in pool.req_blocks] == [[1, 6], [2, 3], [4, 5]]
    assert out.dtype == torch.int64
