"""Progress bars that leave nothing behind.

``tqdm`` guards its output with a multiprocessing lock by default, and that
lock is a POSIX semaphore in ``/dev/shm`` for as long as the process lives; a
rank killed with its launcher would leave it there. cpkv's bars take a thread
lock instead (ranks never share a terminal line).
"""

from __future__ import annotations

import threading

from tqdm import tqdm

tqdm.set_lock(threading.RLock())


def progress_bar(**kw) -> tqdm:
    """A ``tqdm`` bar (same arguments) guarded by a thread lock, not a semaphore."""
    return tqdm(**kw)
