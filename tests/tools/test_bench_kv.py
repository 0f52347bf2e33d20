"""``cpkv bench kv`` on a small pool: the write and read paths the engine takes, each against plain
``index_copy_`` / ``index_select`` (figures only in the benchmark; here that it runs and what it reports)."""

from cpkv.tools.bench import bench_kv


def test_a_small_bench_kv_reports_each_path_against_its_plain_side():
    rows = bench_kv(tokens=512, page=8, cp=2, kv_heads=1, head_dim=4, repeats=1)
    assert [r["path"] for r in rows] == ["write incl. planning (rank 0's tokens)", "write, planned once per batch",
                                         "read incl. translation", "read, translated once per batch"]
    assert rows[0]["tokens"] == rows[1]["tokens"] < rows[2]["tokens"] == 512
    assert all(r["ms"] > 0 and r["ratio"] > 0 and r["kernels"] == "torch" for r in rows)
