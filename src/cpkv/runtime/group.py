"""Process lifetime of a CP group: start N ranks, watch them, stop them, clean up.

:func:`launch` spawns ``world_size`` rank processes on this machine, joined in
one ``torch.distributed`` group (gloo on the CPU), and runs ``target(ctx,
*args)`` in each, where ``ctx`` is that rank's :class:`RankContext`. It returns
what rank 0's target returned. A rank that raises or dies stops the whole group,
and :class:`RankFailure` names the rank that failed first (not the peers that
failed because it went away). Every shared-memory segment the run made
(:meth:`RankContext.shared`) is unlinked on every exit path: rank 0 unlinks
when it ends, and the launcher unlinks the run's whole name prefix again in a
``finally``.

The group runs on the CPU; a GPU path (NCCL, a CUDA IPC buffer) is not built.
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import shm as shm_mod


class RankFailure(RuntimeError):
    """A rank of the CP group failed; ``rank`` names it (``None``: the group as
    a whole, e.g. it did not finish in time)."""

    def __init__(self, rank: int | None, message: str):
        self.rank = rank
        super().__init__(f"{'CP group' if rank is None else f'rank {rank}'} failed: {message}")


class RankContext:
    """One rank's handle on its group: identity, barriers, shared tensors.

    ``shared(tag, shape, dtype)`` returns a tensor in POSIX shared memory that
    every rank of ``group`` maps: rank ``creator`` creates it (zeroed), the
    others attach after a barrier. Segments are closed when the rank ends.
    """

    def __init__(self, rank: int, world_size: int, prefix: str):
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self._segments = []

    @property
    def distributed(self) -> bool:
        """Whether there are other ranks to talk to."""
        return self.world_size > 1

    def barrier(self, group=None) -> None:
        """A barrier on ``group`` (default: the whole world)."""
        if self.distributed:
            dist.barrier(group=group)

    def all_gather_object(self, obj, group=None) -> list:
        """``obj`` of every rank of ``group``, in rank order."""
        if not self.distributed:
            return [obj]
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def shared(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype, *, creator: int = 0,
               group=None) -> torch.Tensor:
        """A zeroed tensor in shared memory, the same memory on every rank of ``group``."""
        name = self.prefix + tag
        if self.rank == creator:
            seg = shm_mod.create(name, shm_mod.nbytes(shape, dtype))
            self._segments.append((seg, True))
            t = shm_mod.as_tensor(seg, shape, dtype)
            t.zero_()
            self.barrier(group)
        else:
            self.barrier(group)
            seg = shm_mod.attach(name)
            self._segments.append((seg, False))
            t = shm_mod.as_tensor(seg, shape, dtype)
        return t

    def close(self) -> None:
        """Unmap every segment; the creator also unlinks it."""
        gc.collect()
        for seg, mine in self._segments:
            shm_mod.close(seg)
            if mine:
                try:
                    os.unlink(os.path.join(shm_mod.SHM_DIR, seg.name.lstrip("/")))
                except FileNotFoundError:
                    pass
        self._segments.clear()


def _rank_main(rank: int, world_size: int, prefix: str, init_file: str, timeout: float, out,
               target: Callable, args: tuple) -> None:
    ctx = RankContext(rank, world_size, prefix)
    try:
        torch.set_num_threads(1)
        if world_size > 1:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
        result = target(ctx, *args)
        if rank == 0:
            out.put(("result", 0, result))
    except BaseException as e:  # report, then exit non-zero so the launcher stops the group
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        ctx.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_knock_on(message: str) -> bool:
    """An error a rank raises only because a peer went away."""
    return any(w in message for w in ("gloo", "Gloo", "NCCL", "DistBackendError", "Connection closed", "timed out"))


def _root_cause(procs, errors: dict, out, *, timed_out: bool, timeout: float) -> RankFailure:
    """Name the rank that failed first, not the peers that failed because of it.

    Waits up to a second for the other ranks' reports, then prefers a rank
    killed by a signal, then a rank whose error is its own (not a broken
    connection to a peer), then the first error reported.
    """
    if timed_out:
        return RankFailure(None, f"did not finish within {timeout} s")
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            kind, rank, payload = out.get(timeout=0.05)
            if kind == "error":
                errors.setdefault(rank, payload)
        except queue_mod.Empty:
            pass
    for r, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode < 0 and r not in errors:
            return RankFailure(r, f"exited with code {p.exitcode} (killed by {signal.Signals(-p.exitcode).name})")
    own = [r for r, m in errors.items() if not _is_knock_on(m)]
    if own or errors:
        r = (own or list(errors))[0]
        return RankFailure(r, errors[r])
    r = next(r for r, p in enumerate(procs) if p.exitcode not in (None, 0))
    return RankFailure(r, f"exited with code {procs[r].exitcode}")


def launch(target: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> Any:
    """Run ``target(ctx, *args)`` on ``world_size`` spawned ranks; return rank 0's result.

    ``target`` must be a module-level function (ranks are spawned). Raises
    :class:`RankFailure` naming the first rank that failed, after stopping every
    other rank; the run's shared segments are unlinked whatever happens.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    prefix = shm_mod.run_prefix(uuid.uuid4().hex[:8])
    result, failure = None, None
    with tempfile.TemporaryDirectory(prefix="cpkv_pg_") as d:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world_size, prefix, os.path.join(d, "pg"), timeout, out, target, args))
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            errors: dict[int, str] = {}
            got = False
            while not got or any(p.is_alive() for p in procs):
                try:
                    kind, rank, payload = out.get(timeout=0.1)
                    if kind == "error":
                        errors.setdefault(rank, payload)
                    else:
                        result, got = payload, True
                except queue_mod.Empty:
                    pass
                broken = errors or any(p.exitcode not in (None, 0) for p in procs)
                if broken or time.monotonic() > deadline:
                    failure = _root_cause(procs, errors, out, timed_out=not broken, timeout=timeout)
                    break
                if not got and not any(p.is_alive() for p in procs):
                    failure = RankFailure(0, "the group ended without a result")
                    break
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            shm_mod.unlink_prefix(prefix)
    if failure is not None:
        raise failure
    return result
