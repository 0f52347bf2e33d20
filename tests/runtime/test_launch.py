"""The launcher itself (cpkv.runtime.group): shared segments, faults, timeouts,
a rank stopped while it creates names. (A killed launcher:
test_launcher_death.py.) Multi-process tests use
the tiny targets of tests/support/launch_targets.py, so a group costs a torch import
per rank, not a model."""

import contextlib
import math
import os
import pickle
import signal
import time

import pytest

from support import launch_targets as lt
from support.proc_helpers import children, fork_launcher, gone, spawned_ranks, wait_until
from cpkv.runtime.group import RankFailure, launch
from cpkv.runtime.shm import shm_segments


# -- multi-process -----------------------------------------------------------------
@pytest.mark.multiproc
def test_a_shared_tensor_is_one_memory_and_its_name_goes_once_every_rank_has_it():
    """[[RFC-0001:C-DIRECT-WRITE]]: the creator's writes are what every rank reads."""
    out = launch(lt.share, 2, 1000, timeout=120)
    assert [ok for ok, *_ in out] == [True, True]
    assert [names for _, names, *_ in out] == [[], []]  # unlinked before the target went on
    pids = {pid for _, _, pid, _ in out}
    assert len(pids) == 2 and os.getpid() not in pids
    assert [sems for *_, sems in out] == [[], []], "the launcher or a rank opened multiprocessing semaphores"
    assert not spawned_ranks(os.getpid())
    assert not shm_segments(os.getpid())


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_stops_the_group_and_is_named(how):
    t = time.monotonic()
    with pytest.raises(RankFailure) as e:
        launch(lt.fail_on, 2, 1, how, timeout=120)
    assert time.monotonic() - t < 60
    assert e.value.rank == 1  # not a peer that failed on the broken connection
    assert not spawned_ranks(os.getpid())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 1 failed: ")
    if how == "raise":
        assert "RuntimeError: injected fault on rank 1 second line of the message" in msg
        assert "Traceback" in e.value.details and "injected fault on rank 1\nsecond line" in e.value.details
    else:
        assert "exited with code -9 (killed by SIGKILL)" in msg
    assert not shm_segments(os.getpid())


@pytest.mark.multiproc
def test_a_group_that_does_not_finish_in_time_is_stopped(tmp_path):
    t = time.monotonic()
    with pytest.raises(RankFailure, match=r"^CP group failed: did not finish within 12 s$") as e:
        launch(lt.hang, 2, str(tmp_path), timeout=12)
    assert e.value.rank is None and time.monotonic() - t < 40
    assert not spawned_ranks(os.getpid())  # stopped and reaped before launch returned
    assert not shm_segments(os.getpid())


def test_launch_refuses_bad_arguments_before_starting_anything():
    kids = set(children(os.getpid()))
    for bad in (dict(world_size=0), dict(world_size=1.5), dict(timeout=0), dict(timeout=-1), dict(timeout=math.nan),
                dict(timeout=math.inf)):
        kw = {"world_size": 2, "timeout": 10, **bad}
        with pytest.raises(ValueError):
            launch(lt.share, kw.pop("world_size"), 4, **kw)
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        launch(lambda ctx: 0, 2)  # ranks are spawned: a target must be importable by name
    assert set(children(os.getpid())) <= kids


def test_rank_failure_is_one_line_with_the_traceback_kept():
    e = RankFailure(3, "ValueError: bad\n  shape\t(2,)", details="Traceback ...\nValueError: bad")
    assert str(e) == "rank 3 failed: ValueError: bad shape (2,)" and e.rank == 3 and e.details.startswith("Traceback")
    assert str(RankFailure(None, "did not finish within 5 s")) == "CP group failed: did not finish within 5 s"


# -- sizing a group -------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_creating_segments_while_stopped_leaves_no_name(how, tmp_path):
    """A rank creates one new segment after another when its launcher is
    SIGKILLed (``kill``: the rank dies with it, and the reaper alone cleans up
    once it has) or stops it (``stop``: Ctrl-C to the launcher, which stops the
    rank, reaps it and unlinks): no name of the run is left, however the stop
    meets a creation in progress. (The launcher is a fork of this process:
    tests/support/proc_helpers.py.)"""
    pid = fork_launcher(tmp_path, {}, lambda: launch(lt.create_forever, 1, str(tmp_path), timeout=600))
    kids, status = [], None
    try:
        assert wait_until(lambda: (tmp_path / "0").exists() or gone(pid), 240), "the rank never started"
        kids = children(pid)  # the rank and the reaper
        assert len(kids) == 2
        time.sleep(0.2)  # let names pile up
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGINT)
        _, status = os.waitpid(pid, 0)
        assert wait_until(lambda: all(gone(k) for k in kids) and not shm_segments(pid), 10), \
            ([k for k in kids if not gone(k)], sorted(shm_segments(pid)))
    finally:
        for k in kids + [pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    assert status == (signal.SIGKILL if how == "kill" else 1 << 8)  # killed; or KeyboardInterrupt, exit status 1
