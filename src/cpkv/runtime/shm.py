"""POSIX shared-memory segments of a CP group: create, attach, unlink.

Every segment of one run is named ``cpkv_<launcher pid>_<run id>_<tag>``, so the
launcher, or the reaper once the launcher and its ranks are gone
(:mod:`cpkv.runtime.reaper`), can remove everything a run made by its prefix,
whatever happened to its ranks; both do so only after the last process that
could create a name has ended, so no creation races the last unlink. A name is
needed only while the group's ranks attach;
:meth:`~cpkv.runtime.group.RankContext.shared` unlinks it right after. cpkv owns
these lifetimes; Python's resource tracker is kept out of them (it would unlink
a segment when the first process that touched it exits).
"""

from __future__ import annotations

import contextlib
import math
import os
from multiprocessing import resource_tracker, shared_memory

import torch

from .sizing import SHM_DIR

SHM_PREFIX = "cpkv_"


@contextlib.contextmanager
def _untracked():
    saved = resource_tracker.register, resource_tracker.unregister
    resource_tracker.register = resource_tracker.unregister = lambda *a, **k: None
    try:
        yield
    finally:
        resource_tracker.register, resource_tracker.unregister = saved


def run_prefix(run_id: str, pid: int | None = None) -> str:
    """Name prefix of every segment of one run launched by ``pid`` (default: this process)."""
    return f"{SHM_PREFIX}{os.getpid() if pid is None else pid}_{run_id}_"


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def create(name: str, size: int) -> shared_memory.SharedMemory:
    """Create a segment of ``size`` bytes (``size >= 1``)."""
    with _untracked():
        return shared_memory.SharedMemory(name=name, create=True, size=max(int(size), 1))


def attach(name: str) -> shared_memory.SharedMemory:
    """Attach an existing segment."""
    with _untracked():
        return shared_memory.SharedMemory(name=name)


def as_tensor(shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor view of ``shape`` and ``dtype`` over the segment's memory (no copy)."""
    return torch.frombuffer(shm.buf, dtype=dtype, count=math.prod(shape)).view(shape)


def close(shm: shared_memory.SharedMemory) -> None:
    """Close this process's mapping; a tensor still viewing it keeps the mapping alive."""
    try:
        shm.close()
    except BufferError:
        pass


def unlink(name: str) -> bool:
    """Remove the segment ``name`` from ``/dev/shm`` (mappings stay valid);
    ``False`` if it was already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))
        return True
    except FileNotFoundError:
        return False


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; returns their names."""
    return [name for name in sorted(shm_names(prefix)) if unlink(name)]


#: PyTorch names its shared files (a CUDA IPC producer's reference counters among them) ``torch_<pid>_...``.
TORCH_PREFIX = "torch_"


def unlink_torch_files(pids) -> list[str]:
    """Unlink the ``/dev/shm/torch_<pid>_*`` files of processes ``pids`` (ended
    ranks: a CUDA IPC producer's reference counters stay when it is killed);
    returns their names."""
    return [n for pid in pids for n in unlink_prefix(f"{TORCH_PREFIX}{int(pid)}_")]


def shm_names(prefix: str = SHM_PREFIX) -> set[str]:
    """Names of the segments in ``/dev/shm`` that start with ``prefix``."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def shm_segments(pid: int | None = None) -> set[str]:
    """cpkv's shared-memory segments on the system; with ``pid``, only those of
    runs that process launched."""
    return shm_names(SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}_")


def mapped_shm(pid: int) -> set[str]:
    """Every ``/dev/shm`` name process ``pid`` maps now (segments and named
    semaphores, unlinked ones included), from ``/proc/<pid>/maps``; empty where
    there is no ``/proc`` or no such process."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
            out.add(parts[5][len(SHM_DIR) + 1:].removesuffix(" (deleted)"))
    return out


def mapped_segments(pid: int) -> set[str]:
    """cpkv segments process ``pid`` maps now, unlinked ones included."""
    return {name for name in mapped_shm(pid) if name.startswith(SHM_PREFIX)}
