"""Sizing a group before it starts (cpkv.runtime.sizing): footprints, this machine, the refusals."""

import math
import os

import pytest

from cpkv.runtime.sizing import (
    RANK_BASELINE_BYTES,
    GroupFootprint,
    GroupTooLarge,
    MachineCapacity,
    check_capacity,
    group_footprint,
    machine_capacity,
)

GiB = 2**30


MACHINE = MachineCapacity(available_bytes=16 * GiB, cores=2)


def test_footprint_adds_the_baseline_and_model_per_rank_and_the_shared_bytes_once():
    fp = group_footprint(4, model_bytes=100, private_bytes=20, shared_bytes=1000)
    assert fp == GroupFootprint(4, RANK_BASELINE_BYTES + 120, 1000)
    assert fp.total_bytes == 4 * (RANK_BASELINE_BYTES + 120) + 1000
    for bad in (dict(world_size=0), dict(world_size=2.5), dict(model_bytes=-1), dict(shared_bytes=-5),
                dict(baseline_bytes=-1)):
        kw = {"world_size": 2, **bad}
        with pytest.raises(ValueError):
            group_footprint(kw.pop("world_size"), **kw)


def test_a_group_that_fits_passes():
    assert check_capacity(group_footprint(4), timeout=300, capacity=MACHINE) is None
    # the limit itself: 16 ranks per core, 0.9 of the memory
    assert check_capacity(group_footprint(32, baseline_bytes=1), timeout=300, capacity=MACHINE) is None
    assert check_capacity(GroupFootprint(1, int(0.9 * 16 * GiB)), timeout=300, capacity=MACHINE) is None


def test_memory_refusal_names_the_need_and_what_is_available():
    with pytest.raises(GroupTooLarge, match=r"^8 ranks need about 17\.\d GiB of memory \(8 x 2\.1 GiB \+ 0\.0 MiB "
                                            r"shared\), more than this machine can give: 16\.0 GiB available"):
        check_capacity(group_footprint(8, model_bytes=2 * GiB - RANK_BASELINE_BYTES + 2**27), timeout=300,
                       capacity=MACHINE)
    with pytest.raises(GroupTooLarge):
        check_capacity(GroupFootprint(1, int(0.9 * 16 * GiB) + 1), timeout=300, capacity=MACHINE)
    with pytest.raises(GroupTooLarge, match="memory"):  # the shared segments count too
        check_capacity(group_footprint(2, shared_bytes=15 * GiB), timeout=300, capacity=MACHINE)


def test_core_refusal_past_16_ranks_per_core():
    with pytest.raises(GroupTooLarge, match=r"^33 ranks on 2 cores: more than 16 per core.*at most 32 ranks here"):
        check_capacity(group_footprint(33, baseline_bytes=1), timeout=10_000, capacity=MACHINE)
    with pytest.raises(GroupTooLarge, match="64 ranks on 2 cores"):  # the cp 64 that ran into its timeout
        check_capacity(group_footprint(64, baseline_bytes=1), timeout=300, capacity=MACHINE)


def test_start_time_refusal_when_starting_alone_outlasts_the_timeout():
    # 8 ranks x 5 CPU seconds on 2 cores: at least 20 s before the first collective
    with pytest.raises(GroupTooLarge, match=r"^8 ranks need at least 20 s to start on 2 cores .*timeout of 19 s"):
        check_capacity(group_footprint(8), timeout=19, capacity=MACHINE)
    assert check_capacity(group_footprint(8), timeout=21, capacity=MACHINE) is None


def test_two_groups_are_sized_together():
    prefill, decode = group_footprint(16, baseline_bytes=1), group_footprint(17, baseline_bytes=1)
    assert check_capacity(prefill, timeout=300, capacity=MACHINE) is None
    with pytest.raises(GroupTooLarge, match=r"^2 groups of 16 \+ 17 = 33 ranks on 2 cores"):
        check_capacity(prefill, decode, timeout=300, capacity=MACHINE)
    big = GroupFootprint(2, 4 * GiB, 0)
    with pytest.raises(GroupTooLarge, match=r"2 groups of 2 \+ 2 = 4 ranks need about 16\.0 GiB"):
        check_capacity(big, big, timeout=300, capacity=MACHINE)


def test_check_capacity_misuse():
    with pytest.raises(ValueError):
        check_capacity(timeout=300, capacity=MACHINE)
    for t in (0, -1, math.nan, math.inf):
        with pytest.raises(ValueError):
            check_capacity(group_footprint(1), timeout=t, capacity=MACHINE)


def test_machine_capacity_reads_this_machine():
    cap = machine_capacity()
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0 < cap.available_bytes <= avail * 1.2 + 2**28  # MemAvailable moves between the two reads
    assert 1 <= cap.cores <= len(os.sched_getaffinity(0))


# -- the device KV cache sized from memory ---------------------------------------------------------
from hypothesis import given, strategies as st  # noqa: E402

from cpkv.runtime.sizing import (KV_MEMORY_CAP, default_kv_memory, expected_run_seconds, group_pages, pages_for_memory,  # noqa: E402
                                 parse_size)


@pytest.mark.parametrize("text,n", [("64MiB", 64 * 2**20), ("2GiB", 2 * GiB), ("1.5 gib", 3 * 2**29),
                                    ("500MB", 500 * 10**6), ("4096", 4096), (" 1kB ", 1000), ("1TiB", 2**40),
                                    ("1e9", 10**9), ("1e12", 10**12), ("2.5e3", 2500), ("1e-3GiB", 1073741)])
def test_parse_size_reads_units_and_plain_bytes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "MiB", "64XB", "64 M", "-1", "0", "0.5", "1.5", "2 GiBs", "1e-3", "1e", "nan",
                                 "inf"])
def test_parse_size_refuses_what_is_not_a_size(bad):
    with pytest.raises(ValueError, match="size|whole number"):
        parse_size(bad)


@given(kv=st.integers(1, 2**40), page=st.integers(1, 2**24))
def test_pages_for_memory_is_the_most_pages_the_bytes_hold(kv, page):
    if kv < page:
        with pytest.raises(ValueError, match="holds no page"):
            pages_for_memory(kv, page)
        return
    n = pages_for_memory(kv, page)
    assert n * page <= kv < (n + 1) * page


def test_pages_for_memory_misuse_and_the_group_pages_of_either_mode():
    for args in ((0, 8), (8, 0), (8.0, 8), (True, 1), (7, 8)):
        with pytest.raises(ValueError):
            pages_for_memory(*args)
    n = pages_for_memory(64 * 2**10, 2**10)  # the same pages per rank in either mode (equal memory)
    assert group_pages(n, cp_size=4) == 4 * n  # shared: each page on its owner only
    assert group_pages(n, replicated=True, cp_size=4) == n  # replicated: every page on every rank


def test_default_kv_memory_is_a_capped_share_of_what_the_ranks_leave():
    small = MachineCapacity(2 * GiB, 2)
    left = 2 * GiB * 0.9 - 4 * RANK_BASELINE_BYTES - 2**20
    assert default_kv_memory(4, other_bytes=2**20, capacity=small) == int(0.25 * left / 4)
    assert default_kv_memory(4, capacity=MACHINE) == KV_MEMORY_CAP  # 16 GiB: the cap binds
    assert default_kv_memory(4, capacity=MachineCapacity(64 * GiB, 8, shm_free_bytes=64 * 2**20)) == 8 * 2**20
    assert default_kv_memory(8, capacity=MachineCapacity(2 * GiB, 2)) == 0  # nothing left: the caller's floor
    for bad in (dict(world_size=0), dict(world_size=2, fraction=0), dict(world_size=2, other_bytes=-1)):
        with pytest.raises(ValueError):
            default_kv_memory(capacity=MACHINE, **bad)


def test_machine_capacity_knows_the_free_shared_memory():
    st_ = os.statvfs("/dev/shm")
    assert 0 <= machine_capacity().shm_free_bytes <= st_.f_blocks * st_.f_frsize


def test_expected_run_seconds_grows_with_steps_and_ranks():
    assert expected_run_seconds(4, 0, 2) == pytest.approx(16.0)  # 4 ranks x 8 s on 2 cores
    assert expected_run_seconds(4, 1000, 2) == pytest.approx(16.0 + 1000 * (7.3e-3 + 4.8e-3 * 8))
    assert expected_run_seconds(2, 1000, 2) < expected_run_seconds(4, 1000, 2) < expected_run_seconds(4, 2000, 2)
    with pytest.raises(ValueError):
        expected_run_seconds(0, 10, 2)
