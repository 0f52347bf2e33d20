"""Nothing outlives its launcher, at any moment (cpkv.runtime.group, .torchrun, .reaper): the launcher is SIGKILLed
while its ranks are at a named moment of their lives, and within 5 s every rank, the reaper and everything of the run
in /dev/shm and in the run's folders are gone, while two busy processes load both cores.

tests/support/moments.py pauses a rank at the moment (blocked in C with the GIL held, as a rank in the rendezvous or
a gloo collective), so the kill lands there, not by a guess at timing; its peers go on and wait for it. A launcher
is a fork of the test process (cpkv and torch already imported, so a case pays no launcher start); it spawns its
ranks as cpkv always does."""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import moments
from support.proc_helpers import children, fork_launcher, gone, semaphores_of, wait_until
from support.torchrun_helpers import log_tail, start_torchrun
from cpkv.runtime import group, reaper
from cpkv.runtime.shm import mapped_segments, shm_names, shm_segments

BOUND_S = 5.0  # from the launcher's death to nothing left
START_S = 240.0  # for ranks to reach their moment (imports of cpkv on a loaded 2-core machine)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds these processes have used (user + system): a case's cost whatever the machine's load."""
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            total += sum(int(x) for x in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
    return total / os.sysconf("SC_CLK_TCK")


def _left(run_tmp: Path) -> list[str]:
    """The run's folders (rendezvous file, abort reports) still in its temporary folder."""
    return sorted(p.name for p in run_tmp.iterdir() if p.name.startswith("cpkv_"))


@contextlib.contextmanager
def _loaded(n: int = 2):
    """``n`` processes spinning on the CPU (this machine has 2 cores) for the duration."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)  # spinning by now
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def _nothing_left(launcher: int, pids: list[int], run_tmp: Path) -> tuple[bool, float]:
    """Wait up to BOUND_S for every process of ``pids`` to be gone and nothing of the run to be left; whether so, and
    when (seconds)."""
    t0 = time.monotonic()
    ok = wait_until(lambda: all(gone(p) for p in pids) and not shm_segments(launcher) and not _left(run_tmp),
                    BOUND_S, step=0.02)
    return ok, time.monotonic() - t0


def _report(pids, launcher, run_tmp) -> str:
    return (f"alive: {[p for p in pids if not gone(p)]}, names: {sorted(shm_segments(launcher))}, "
            f"folders: {_left(run_tmp)}")


def _engine(n: int):
    from cpkv.engine import EngineConfig
    from cpkv.engine import engine

    engine._engine_rank = moments.engine_rank  # the same target, its steps counted (moments.py)
    engine.run_engine(EngineConfig(cp_size=n, requests=2, scale=0.05, device_pages=8, host_pages=0, timeout=600))


def _disagg():
    from cpkv.engine import DisaggConfig
    from cpkv.engine.disagg import driver

    driver._disagg_ranks = moments.disagg_ranks
    driver.run_disagg(DisaggConfig(prefill_size=1, decode_size=1, requests=2, scale=0.05, device_pages=8,
                                   host_pages=0, timeout=600))


def _tiny(n: int):
    group.launch(moments.unreached, n, timeout=600)


# moment: (N, the pause, the launcher's body); N from 1 to 4, every moment of a rank's life
CASES = {
    "right after spawn": (4, None, "tiny"),  # the launcher SIGKILLs itself as soon as its last rank is forked
    "during the imports": (3, "imports:*", "tiny"),
    "during the rendezvous": (2, "imports:1", "tiny"),  # rank 0 in init_process_group, waiting for rank 1
    "in the first step": (1, "step1:0", "engine"),
    # a prefill and a decode group of one rank each; rank 0 in the step's collective, waiting for rank 1
    "mid-trace, disaggregated": (2, "step6:1", "disagg"),
}


def _reached(moment: str, n: int, pause: str, marks: Path, run_tmp: Path) -> bool:
    name, ranks = pause.split(":")
    paused = range(n) if ranks == "*" else [int(r) for r in ranks.split(",")]
    if not all((marks / f"{name}-{r}").exists() for r in paused):
        return False
    if moment == "during the rendezvous":  # rank 0 has opened the rendezvous file and waits in it
        return bool(glob.glob(str(run_tmp / "cpkv_pg_*" / "pg")))
    return True


@pytest.mark.multiproc
@pytest.mark.parametrize("moment", list(CASES))
def test_a_launcher_killed_at_any_moment_leaves_nothing(tmp_path, moment):
    n, pause, body = CASES[moment]
    run_tmp, marks = tmp_path / "tmp", tmp_path / "marks"
    run_tmp.mkdir()
    marks.mkdir()
    env = {moments.MARKS: str(marks)} | ({moments.PAUSE: pause} if pause else {})
    if moment == "right after spawn":  # the launcher SIGKILLs itself as soon as it handed its last rank its work
        pids_file = marks / "pids"

        class DieOnceSent:  # the last rank's inbox: closed right after the launcher wrote the rank's work into it
            def __init__(self, inbox):
                self.inbox, self.send_bytes = inbox, inbox.send_bytes

            def close(self):
                self.inbox.close()
                os.kill(os.getpid(), signal.SIGKILL)  # the last rank is still starting Python: no prctl yet

        def body_fn():
            spawn, pids = group._spawn_rank, [reaper.reaper().pid]

            def spawn_then_die(rank, token, fds):
                proc, inbox, outbox = spawn(rank, token, fds)
                pids.append(proc.pid)
                if rank < n - 1:
                    return proc, inbox, outbox
                pids_file.write_text(" ".join(map(str, pids)))
                return proc, DieOnceSent(inbox), outbox

            group._spawn_rank = spawn_then_die
            _tiny(n)
    else:
        body_fn = {"tiny": lambda: _tiny(n), "engine": lambda: _engine(n), "disagg": _disagg}[body]
    launcher, pids = None, []
    try:
        if moment == "right after spawn":
            with _loaded():
                launcher = fork_launcher(run_tmp, env, body_fn)
                assert os.waitpid(launcher, 0)[1] == signal.SIGKILL  # died by its own hand, as planned
                pids = [int(p) for p in pids_file.read_text().split()]
                ok, took = _nothing_left(launcher, pids, run_tmp)
            cpu = 0.0
        else:
            launcher = fork_launcher(run_tmp, env, body_fn)
            reached = wait_until(lambda: _reached(moment, n, pause, marks, run_tmp) or gone(launcher), START_S)
            assert reached and not gone(launcher), f"the ranks never reached the moment: {sorted(os.listdir(marks))}"
            pids = _descendants(launcher)
            ranks = [p for p in pids if b"cpkv-rank-" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert len(ranks) == n and len(pids) == n + 1, pids  # the ranks and the reaper
            assert not semaphores_of(launcher, *pids)  # no multiprocessing semaphore, no resource tracker
            if body != "tiny":  # mid-run: each rank maps the run's segments, whose names are gone already
                assert all(mapped_segments(r) for r in ranks) and not shm_segments(launcher)
            cpu = _cpu_s([launcher] + pids)
            with _loaded():
                os.kill(launcher, signal.SIGKILL)
                os.waitpid(launcher, 0)
                ok, took = _nothing_left(launcher, pids, run_tmp)
        assert ok, _report(pids, launcher, run_tmp)
        print(f"{moment}: nothing left {took:.2f} s after the launcher's death (the run had used {cpu:.1f} CPU s)")
    finally:
        for p in ([launcher] if launcher else []) + pids:  # after a failure: nothing of the test may stay
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if launcher:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(launcher, 0)


@pytest.mark.multiproc
def test_a_torchrun_agent_killed_in_the_rendezvous_leaves_nothing(tmp_path, monkeypatch):
    """Under torchrun the parent is the agent: rank 1 pauses where join() enters the rendezvous (after join set up
    what ends it), rank 0 waits in the rendezvous for it; SIGKILL to the agent ends both within 5 s (they would
    otherwise wait out the rendezvous's timeout), and their reapers with them."""
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(moments.PAUSE, "rendezvous:1")
    monkeypatch.setenv(moments.MARKS, str(marks))
    p = start_torchrun(tmp_path, ["--standalone", "--nproc-per-node", "2"], "support.torchrun_targets", "hang",
                       str(tmp_path))
    pids = []
    try:
        reached = wait_until(lambda: ((marks / "rendezvous-1").exists() and (marks / "rendezvous-entered-0").exists())
                             or p.poll() is not None, START_S)
        assert reached and p.poll() is None, log_tail(tmp_path)
        pids = _descendants(p.pid)
        ranks = [int((marks / f).read_text()) for f in ("rendezvous-1", "rendezvous-entered-0")]
        assert set(ranks) <= set(pids) and len(pids) == 4, pids  # two ranks, a reaper each
        cpu = _cpu_s([p.pid] + pids)
        with _loaded():
            p.kill()
            p.wait()
            t0 = time.monotonic()
            ok = wait_until(lambda: all(gone(q) for q in pids), BOUND_S, step=0.02)
            took = time.monotonic() - t0
        assert ok, [q for q in pids if not gone(q)]
        assert not [n for r in ranks for n in shm_names(f"cpkv_{r}_")]
        print(f"torchrun, in the rendezvous: every rank and reaper gone {took:.2f} s after the agent's death "
              f"(the run had used {cpu:.1f} CPU s)")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for q in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(q, signal.SIGKILL)
