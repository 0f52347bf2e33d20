"""``cpkv bench capacity`` in a small configuration: both modes at the same memory,
every figure from a checked run; the shared group holds N times the longest request."""

import pytest

from cpkv.engine import EngineConfig
from cpkv.tools.bench.capacity import bench_capacity, fits, longest_prompt
from cpkv.tools.cli import main


def test_capacity_small():
    rows, m = bench_capacity(EngineConfig(cp_size=2, page_size=16, kv_memory=128 * 2**10), documents=3,
                             trace_scale=0.005, rounds=2, ranks="threads")
    s, r = m["shared"], m["replicated"]
    assert s["longest"] >= 0.95 * 2 * r["longest"]
    for mode in (s, r):
        assert mode["longest_run"]["check"]["requests_matched"] == 1 == mode["longest_run"]["finished"]
        assert mode["trace"]["finished"] == mode["trace"]["requests"]
        assert len(mode["traces"]) == 2 and all(t["check"]["requests_matched"] == t["requests"] for t in mode["traces"])
    assert r["trace"]["evicted_pages"] + r["trace"]["preemptions"] > 0
    assert rows[0]["figure"].startswith("longest request") and rows[0]["shared / replicated"] == "2.00"
    assert any(x["figure"] == "trace: TPOT p99 (ms, median of 2)" for x in rows)


def test_longest_prompt_is_the_refusal_edge():
    cfg = EngineConfig(cp_size=2, page_size=16, kv_memory=64 * 2**10, kv="replicated")
    n = longest_prompt(cfg, 4)
    assert fits(cfg, n, 4) and not fits(cfg, n + 1, 4)
    assert n + 3 == 7 * 16  # 8 pages of memory, page 0 reserved


def test_bench_capacity_refuses_a_memory_without_a_page(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "capacity", "--kv-memory", "0"])
    assert e.value.code == 2
    assert main(["bench", "capacity", "--cp", "2", "--kv-memory", "100"]) == 2
    assert "holds no page" in capsys.readouterr().err
