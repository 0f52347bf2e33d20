"""Looking at processes and /dev/shm from a test (Linux /proc)."""

import os
import tempfile
import time
import traceback

from cpkv.runtime.shm import mapped_shm


def gone(pid: int) -> bool:
    """No such process any more (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def spawned_ranks(pid: int) -> set[int]:
    """Children of ``pid`` that are cpkv rank processes (``cpkv-rank-<r>`` on their command line)."""
    out = set()
    for k in children(pid):
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"cpkv-rank-" in f.read():
                    out.add(k)
        except OSError:
            pass
    return out


def wait_until(cond, seconds: float, step: float = 0.1) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def semaphores_of(*pids: int) -> set[str]:
    """multiprocessing semaphores these processes have open."""
    return {n for p in pids for n in mapped_shm(p) if n.startswith("sem.")}


def sigint_held_off(pid: int) -> bool:
    """Whether process ``pid`` blocks or ignores SIGINT (from /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in f.read().splitlines()
                                                 if line.startswith(("SigBlk:", "SigIgn:")))}
    except (OSError, ValueError):
        return False
    bit = 1 << (2 - 1)  # SIGINT is signal 2
    return bool((masks.get("SigBlk", 0) | masks.get("SigIgn", 0)) & bit)


def fork_launcher(tmp, env: dict, body) -> int:
    """Fork this process and run ``body()`` in the child, as a launcher (its ``TMPDIR`` is ``tmp``, ``env`` is set
    for it and for the ranks it starts); the child's pid. The child exits 0 when ``body`` returns, 1 (traceback on
    stderr) when it raises. A fork has cpkv and torch imported already: a launcher that costs no start."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.update(env)
            tempfile.tempdir = str(tmp)
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid
