"""Progress that leaves nothing behind: the bar on the terminal, and what a stopped run finished.

``tqdm`` guards its output with a multiprocessing lock by default, and that
lock is a POSIX semaphore in ``/dev/shm`` for as long as the process lives; a
rank killed with its launcher would leave it there. cpkv's bars take a thread
lock instead (ranks never share a terminal line). :class:`RunProgress` is the
run's counts shared by rank 0 with its launcher, :func:`describe_progress` the
line a stopped run prints.
"""

from __future__ import annotations

import threading

from tqdm import tqdm

tqdm.set_lock(threading.RLock())


def progress_bar(**kw) -> tqdm:
    """A ``tqdm`` bar (same arguments) guarded by a thread lock, not a semaphore."""
    return tqdm(**kw)


class RunProgress:
    """How far a run got, shared between the rank that runs its scheduler and
    the launcher, so a run stopped by its timeout or by Ctrl-C can say what it
    finished.

    One int64 tensor of :data:`FIELDS` in shared memory (torch's
    ``share_memory_``: an unnamed segment handed to spawned ranks by file
    descriptor, so nothing is left in ``/dev/shm`` however the run ends). The
    rank writes with :meth:`update` (a few scalar stores per step); the
    launcher reads with :meth:`read`. -1 everywhere until the first update.
    """

    FIELDS = ("step", "finished", "requests", "generated_tokens", "computed_tokens")

    def __init__(self):
        import torch

        self.values = torch.full((len(self.FIELDS),), -1, dtype=torch.int64).share_memory_()

    def update(self, **counts: int) -> None:
        """Store ``counts`` (names of :data:`FIELDS`; ``KeyError`` for another name)."""
        for name, v in counts.items():
            self.values[self.FIELDS.index(name)] = int(v)

    def read(self) -> dict | None:
        """The last counts by name, ``None`` before the first :meth:`update`."""
        vals = self.values.tolist()
        return None if vals[0] < 0 else dict(zip(self.FIELDS, vals))


def describe_progress(progress: dict | None, requests: int) -> str:
    """One line of what a stopped run finished: ``"stopped at step 412: 3 of 8
    requests finished, 1024 tokens generated (2048 computed)"``; before its
    first step, ``"stopped before the first step: 0 of 8 requests finished"``."""
    if progress is None:
        return f"stopped before the first step: 0 of {requests} requests finished"
    p = progress
    return (f"stopped at step {p['step']}: {p['finished']} of {p['requests']} requests finished, "
            f"{p['generated_tokens']} tokens generated ({p['computed_tokens']} computed)")
