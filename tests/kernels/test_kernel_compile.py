"""Every Triton kernel compiled for sm_90 by Triton's own compiler on the CPU,
at the real shapes (paged GQA Hkv 8 x D 128 page 64, MLA latent 512 + 64 with
16 and 128 heads, the indexer 64 x 128; float32, bfloat16, FP8 caches): it
compiles, spills nothing (no local memory), and one binary serves batch 1 and
64 at contexts 32K and 128K (per-batch sizes are not specialised). Two halves,
so that ``pytest -n 2`` compiles them side by side; Triton's cache keeps the
binaries between runs. :mod:`cpkv.kernels.compile_check` says how."""

import pytest

from cpkv.kernels.compile_check import SIZES, VARIANTS, run_check


@pytest.mark.parametrize("half", [0, 1])
def test_every_kernel_compiles_for_sm90_without_spills(half):
    names = [v.name for v in VARIANTS[half::2]]
    rows = run_check(names)
    assert [r["name"] for r in rows] == names
    assert [f"{r['name']}: {r['error']}" for r in rows if r["error"]] == []
    for r in rows:
        assert r["local_bytes"] == 0 and 0 < r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024
        assert len(r["grids"]) == len(SIZES)
        assert all(0 < g < 2**31 for grids in r["grids"].values() for g in grids)  # one grid axis, within its limit
