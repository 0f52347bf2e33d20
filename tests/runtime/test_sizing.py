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
