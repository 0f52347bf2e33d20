"""Every Triton kernel compiled for sm_90 by Triton's own compiler on the CPU,
at the real shapes (paged GQA Hkv 8 x D 128 page 64, MLA latent 512 + 64 with
16 and 128 heads, the indexer 64 x 128; float32, bfloat16, FP8 caches): it
compiles, spills nothing (no local memory), and one binary serves batch 1 and
64 at contexts 32K and 128K (per-batch sizes are not specialised). Under
every Triton the project can meet: the one installed (``make test``'s), and
each of :data:`~cpkv.kernels.compile_check.CHECKED_TRITONS` (the GPU image's
3.6, torch 2.14's 3.8), which ``make test`` installs into the venv
(:func:`~cpkv.kernels.compile_check.triton_dir`); one process per release, so
that ``pytest -n 2`` compiles two side by side; Triton's cache keeps the
binaries between runs. :mod:`cpkv.kernels.compile_check` says how."""

import os
import re
from pathlib import Path

import pytest

from cpkv.kernels.compile_check import CHECKED_TRITONS, SIZES, VARIANTS, occupancy, run_check, triton_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["installed", *CHECKED_TRITONS])
def test_every_kernel_compiles_for_sm90_without_spills(version):
    folder = None
    if version != "installed":
        folder = triton_dir(version)
        if not os.path.isdir(os.path.join(folder, "triton")):
            pytest.skip(f"triton {version} is not installed in {folder} (make test installs it; it did not install "
                        "here)")
    rows = run_check(triton=folder)
    names = [v.name for v in VARIANTS]
    assert [r["name"] for r in rows] == names
    if version != "installed":
        assert {r["triton"] for r in rows} == {version}
    assert [f"{r['name']}: {r['error']}" for r in rows if r["error"]] == []
    for r in rows:
        assert r["local_bytes"] == 0 and 0 < r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024
        assert len(r["grids"]) == len(SIZES) and r["ctas_per_sm"] >= 1
        assert all(0 < g < 2**31 for grids in r["grids"].values() for g in grids)  # one grid axis, within its limit


def test_occupancy_follows_registers_shared_bytes_and_warps():
    """sm_90's limits: 65536 registers a SM, allocated per warp in units of 256; 228 KB of shared memory, 1 KB
    reserved per program; 64 warps; 32 programs."""
    assert occupancy(128, 40960, 4) == 4  # 4096 registers a warp: 16 warps
    assert occupancy(158, 41472, 4) == 3  # 5120 a warp (158 x 32 rounded up to 256): 12 warps
    assert occupancy(200, 42496, 4) == 2
    assert occupancy(255, 99840, 8) == 1
    assert occupancy(32, 100000, 4) == 2  # shared bytes bound it
    assert occupancy(16, 0, 1) == 32  # at most 32 programs


def test_the_makefile_installs_the_tritons_the_check_names():
    text = (ROOT / "Makefile").read_text()
    assert tuple(re.search(r"^TRITON_CHECKED\s*:?=\s*(.*)$", text, re.M).group(1).split()) == CHECKED_TRITONS
