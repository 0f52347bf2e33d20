"""``cpkv bench alloc`` on a small pool: every row's baselines return what the
allocator returns (the benchmark asserts it before timing), and each row
carries its ratios and goal."""

from cpkv.tools.bench import bench_alloc
from cpkv.tools.bench.alloc import GOALS


def test_a_small_bench_alloc_agrees_with_its_baselines():
    rows = bench_alloc(page=4, cp=2, pool_pages=256, tokens=64, batch_sizes=(1, 4), decode_bs=8, repeats=1)
    assert [r["case"].split(" (")[0] for r in rows] == [
        "extend bs=1", "extend bs=4", "extend bs=4 ragged", "decode bs=8", "free of 16 pages by slots",
        "free_pages of 16 pages"]
    for r in rows:
        assert r["cp2/deque"] > 0 and r["cp2/cp1"] > 0
        assert r["goal"] == f"<= {next(v for k, v in GOALS.items() if r['case'].startswith(k))}"
        assert (r["cp2/arange"] != "-") == r["case"].startswith("extend")
