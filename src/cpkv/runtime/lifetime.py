"""A process's lifetime tied to its parent's: Linux's parent-death signal (``PR_SET_PDEATHSIG``).

The kernel sends the signal when the *thread* that started the process ends, however it ends (a raise, a
signal, ``SIGKILL``): no Python code of the parent has to run. A parent that died before the child asked is
caught by comparing ``os.getppid()`` with the pid that started it. Off Linux there is no such signal: the
functions say so (``False``, ``0``) and :func:`end_with_parent` makes its check only.

Imports nothing but the standard library, so a worker pays no import for it (:mod:`cpkv.runtime.group`'s
ranks, :mod:`cpkv.runtime.torchrun`'s joined ranks, ``cpkv simulate --goodput --jobs``'s sweeps).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["end_with_parent", "parent_death_signal", "set_parent_death_signal"]

PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread ends (0: never); whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_death_signal() -> int:
    """The signal this process gets when its parent thread ends (0: none, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    got = ctypes.c_int(0)
    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(got), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return 0
    return got.value if ok else 0


def end_with_parent(parent: int) -> None:
    """End this process (SIGKILL) when its parent thread ends, however it ends; at once when ``parent`` (the
    pid that started it) is already gone. A worker's initializer: a command killed by any signal leaves none
    of its workers running."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
