"""The kernel benchmarks' dry run: every section's code path at tiny sizes on
the CPU (Triton's interpreter), each a dict with a title and rows of the
fields a GPU run reports; the command prints the compile report on the CPU."""

import json

import pytest

import cpkv.kernels.compile_check as cc
from cpkv.tools.bench import kernels as bk
from cpkv.tools.cli import main

FIELDS = {
    "decode": {"batch", "context", "seconds", "bytes_read", "bytes_per_second", "fraction_of_copy", "table_seconds",
               "table_fraction_of_copy", "table_vs_buffer"},  # one buffer and the segment table groups read
    "sparse_mla": {"batch", "heads", "seconds", "bytes_read", "bytes_per_second", "fraction_of_copy"},
    "indexer": {"batch", "context", "seconds", "bytes_read", "bytes_per_second", "fraction_of_copy"},
    "store": {"tokens", "seconds", "bytes_moved", "bytes_per_second", "fraction_of_copy"},
    "prefill": {"tokens", "triton_seconds", "sdpa_seconds", "ratio"},
    "lse_split": {"ranks", "slowest_rank_seconds", "mean_rank_seconds", "vs_one_rank"},
}


def test_every_section_runs_dry_on_the_cpu():
    report = bk.bench_kernels(dry_run=True)
    assert set(report) == set(FIELDS) == set(bk.SECTIONS)
    for name, section in report.items():
        assert section["title"] and section["rows"], name
        for row in section["rows"]:
            assert set(row) == FIELDS[name], name
            assert all(v > 0 for k, v in row.items() if k.endswith("seconds")), (name, row)
        if "copy" in section:
            assert section["copy"]["bytes_per_second"] > 0
    assert set(report["decode"]["timing"]) == {"1x40", "1x40 table"}  # both timed in the same rounds
    assert [r["ranks"] for r in report["lse_split"]["rows"]] == [1, 2]
    assert report["lse_split"]["rows"][0]["vs_one_rank"] == 1.0
    for fp8 in (bk.bench_sparse_mla, bk.bench_indexer, bk.bench_store):  # the FP8 caches, decoded or encoded in the kernel
        assert fp8(dry_run=True, fp8=True)["rows"]


def test_a_timed_run_needs_a_gpu():
    with pytest.raises(ValueError, match="time a GPU"):
        bk.bench_decode(device="cpu")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bk.bench_store(dry_run=True, repeats=0)


def test_the_command_prints_the_compile_report_on_the_cpu(monkeypatch, capsys):
    run = cc.run_check
    monkeypatch.setattr(cc, "run_check", lambda names=None, jobs=1: run(["store fp32"], 1))  # one variant: quick
    assert main(["bench", "kernels", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["compile"] and out["compile"][0]["name"] == "store fp32" and not out["compile"][0]["error"]
    table = cc.format_check(out["compile"])
    assert "store fp32" in table and "grid 64x128K" in table and table.rstrip().endswith("ok")


def test_the_command_says_on_stderr_which_kernel_fails_the_compile_check(monkeypatch, capsys):
    """Exit 1 with each failing kernel and its reason on stderr (torch 2.14's Triton 3.8 spilled in extend fp32
    and the command printed nothing there)."""
    run = cc.run_check

    def spilling(names=None, jobs=1):
        rows = run(["store fp32"], 1)
        return [dict(rows[0], error="spills: 16 bytes of local memory per thread")]

    monkeypatch.setattr(cc, "run_check", spilling)
    assert main(["bench", "kernels"]) == 1
    err = capsys.readouterr().err
    assert "1 kernel(s) fail the sm_90 compile check under Triton" in err
    assert "store fp32: spills: 16 bytes of local memory per thread" in err
