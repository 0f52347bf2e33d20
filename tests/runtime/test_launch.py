"""The launcher itself (cpkv.runtime.group): shared segments, faults, timeouts, a
killed launcher, and sizing a group before it starts. Multi-process tests use
the tiny targets of tests/support/launch_targets.py, so a group costs a torch import
per rank, not a model."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import launch_targets as lt
from support.proc_helpers import children, gone, semaphores_of, spawned_ranks, wait_until
from cpkv.runtime.group import RankFailure, launch
from cpkv.runtime.shm import mapped_segments, shm_segments

TESTS = Path(__file__).resolve().parents[1]


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


@pytest.mark.multiproc
def test_a_killed_launcher_takes_its_ranks_and_leaves_nothing(tmp_path):
    """SIGKILL to the launcher alone, mid-run: its ranks die within seconds and
    nothing of the run stays in /dev/shm or in the launcher's temporary folder.
    No semaphore can stay: neither the launcher nor a rank ever opens one."""
    run_tmp = tmp_path / "tmp"
    run_tmp.mkdir()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from support import launch_targets
        from cpkv.runtime import launch
        launch(launch_targets.hang, 2, {str(tmp_path)!r}, timeout=300)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(run_tmp)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        markers = [tmp_path / "0", tmp_path / "1"]
        assert wait_until(lambda: all(m.exists() for m in markers) or p.poll() is not None, 120), "ranks never started"
        assert p.poll() is None, p.stderr.read().decode()
        ranks = [int(m.read_text()) for m in markers]
        kids = children(p.pid)
        assert set(ranks) <= set(kids)
        # mid-run: each rank maps the run's segment, whose name is already gone from /dev/shm
        seg = mapped_segments(ranks[0])
        assert seg and seg == mapped_segments(ranks[1]) and all(s.startswith(f"cpkv_{p.pid}_") for s in seg)
        assert not shm_segments(p.pid)
        assert list(run_tmp.glob("cpkv_pg_*")), "the run's folder is where TMPDIR says"
        assert not semaphores_of(p.pid, *kids)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert wait_until(lambda: all(gone(k) for k in kids), 10), [k for k in kids if not gone(k)]
    finally:
        if p.poll() is None:
            p.kill()
        p.stderr.close()
    assert not shm_segments(p.pid)
    assert wait_until(lambda: not list(run_tmp.glob("cpkv_*")), 5), list(run_tmp.iterdir())


def test_launch_refuses_bad_arguments_before_starting_anything():
    kids = set(children(os.getpid()))
    for bad in (dict(world_size=0), dict(world_size=1.5), dict(timeout=0), dict(timeout=-1), dict(timeout=math.nan),
                dict(timeout=math.inf)):
        kw = {"world_size": 2, "timeout": 10, **bad}
        with pytest.raises(ValueError):
            launch(lt.share, kw.pop("world_size"), 4, **kw)
    assert set(children(os.getpid())) <= kids


def test_rank_failure_is_one_line_with_the_traceback_kept():
    e = RankFailure(3, "ValueError: bad\n  shape\t(2,)", details="Traceback ...\nValueError: bad")
    assert str(e) == "rank 3 failed: ValueError: bad shape (2,)" and e.rank == 3 and e.details.startswith("Traceback")
    assert str(RankFailure(None, "did not finish within 5 s")) == "CP group failed: did not finish within 5 s"


# -- sizing a group -------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["kill", "timeout"])
def test_a_rank_creating_segments_while_stopped_leaves_no_name(how, tmp_path):
    """A rank creates one new segment after another when its launcher is
    SIGKILLed (``kill``: the rank's watchdog alone cleans up) or stops it
    (``timeout``): no name of the run is left, however the stop meets a
    creation in progress."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from support import launch_targets
        from cpkv.runtime import launch
        launch(launch_targets.create_forever, 1, {str(tmp_path)!r}, timeout={300 if how == "kill" else 2})
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: (tmp_path / "0").exists() or p.poll() is not None, 60), "the rank never started"
        kids = children(p.pid)
        if how == "kill":
            time.sleep(0.2)  # let names pile up
            p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert wait_until(lambda: all(gone(k) for k in kids), 10), [k for k in kids if not gone(k)]
    finally:
        if p.poll() is None:
            p.kill()
        p.stderr.close()
    assert p.returncode == (-signal.SIGKILL if how == "kill" else 1)
    assert not shm_segments(p.pid)
