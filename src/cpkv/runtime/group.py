"""Process lifetime of a CP group: start N ranks, watch them, stop them, clean up.

:func:`launch` spawns ``world_size`` rank processes on this machine, joined in
one ``torch.distributed`` group (gloo on the CPU), and runs ``target(ctx,
*args)`` in each, where ``ctx`` is that rank's :class:`RankContext`. It returns
what rank 0's target returned. A rank that raises or dies stops the whole group,
and :class:`RankFailure` names the rank that failed first (not the peers that
failed because it went away).

Nothing outlives the launcher, however it ends:

* Each rank talks to the launcher over its own pipe, so a run creates no
  multiprocessing semaphore (a ``Queue`` would leave three ``/dev/shm/sem.mp-*``
  behind a killed launcher).
* A rank dies with the launcher: ``PR_SET_PDEATHSIG`` on Linux, and on every
  POSIX system a lifeline pipe per rank, of which only the launcher holds the
  write end: a watchdog thread in the rank takes its end of file as the
  launcher's death, a byte on it as the launcher's stop. The watchdog also
  handles ``SIGTERM``. It unlinks the run's segments (and, for an orphaned
  rank, the run's folder) and ends the rank, even while the rank's main thread
  is blocked in a collective; from that unlink on, the rank creates no segment
  (:func:`~cpkv.runtime.shm.stop_creating`), so a creation racing the stop
  cannot leave a name behind an orphaned rank.
* Ranks ignore ``SIGINT`` (from the moment they are forked): Ctrl-C reaches
  the launcher, which stops the group and re-raises :class:`KeyboardInterrupt`.
* A shared segment's name is unlinked as soon as every rank of its group has
  mapped it (:meth:`RankContext.shared`); the memory lives while a rank maps it
  and goes with the last one. The launcher unlinks the run's name prefix again
  in a ``finally``, once every rank has been reaped.

Sizing a group before it starts (memory, cores, start time) is
:mod:`cpkv.runtime.sizing`.

The group runs on the CPU (gloo) or, with ``device="cuda"``, on GPUs as
:func:`cpkv.runtime.device.plan_devices` plans: one GPU per rank on NCCL, or
several ranks per GPU on gloo.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from datetime import timedelta
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import shm as shm_mod

# -- one rank's handle ----------------------------------------------------------
class RankFailure(RuntimeError):
    """A rank of the CP group failed; ``rank`` names it (``None``: the group as
    a whole, e.g. it did not finish in time). ``str()`` is one line; ``details``
    holds the rank's traceback when it sent one."""

    def __init__(self, rank: int | None, message: str, details: str | None = None):
        self.rank = rank
        self.details = details
        line = " ".join(str(message).split())
        super().__init__(f"{'CP group' if rank is None else f'rank {rank}'} failed: {line}")


class RankContext:
    """One rank's handle on its group: identity, barriers, shared tensors.

    ``shared(tag, shape, dtype)`` returns a tensor in POSIX shared memory that
    every rank of ``group`` maps: rank ``creator`` creates it (zeroed), the
    others attach after a barrier, and the creator unlinks the name once all
    have (so no name outlives the group, however it ends). Segments are closed
    when the rank ends.
    """

    def __init__(self, rank: int, world_size: int, prefix: str, device: torch.device | None = None):
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.device = torch.device("cpu") if device is None else device  # this rank's device
        self._segments = []
        self._at_close: list[Callable[[], None]] = []

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
        """A zeroed tensor in shared memory, the same memory on every rank of ``group``.

        Collective over ``group`` (two barriers). The segment's name exists only
        between its creation and the second barrier."""
        name = self.prefix + tag
        if self.rank == creator:
            seg = shm_mod.create(name, shm_mod.nbytes(shape, dtype))
            self._segments.append((seg, True))
            t = shm_mod.as_tensor(seg, shape, dtype)
            t.zero_()
            self.barrier(group)
            self.barrier(group)  # every rank of the group has it mapped
            shm_mod.unlink(name)
        else:
            self.barrier(group)
            seg = shm_mod.attach(name)
            self._segments.append((seg, False))
            t = shm_mod.as_tensor(seg, shape, dtype)
            self.barrier(group)
        return t

    def at_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at :meth:`close`, before any segment is unmapped (the
        host tier's ``cudaHostUnregister``); last registered, first run."""
        self._at_close.append(fn)

    def close(self) -> None:
        """Run the :meth:`at_close` calls, then unmap every segment; the creator
        also unlinks a name still there."""
        while self._at_close:
            self._at_close.pop()()
        gc.collect()
        for seg, mine in self._segments:
            shm_mod.close(seg)
            if mine:
                shm_mod.unlink(seg.name)
        self._segments.clear()


# -- inside a rank ----------------------------------------------------------------
PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die(sig: int = signal.SIGTERM) -> None:
    """End this process by ``sig`` with its default action (the exit status then
    names the signal), whatever handler Python installed."""
    try:
        libc = ctypes.CDLL(None)
        libc.signal(int(sig), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), sig)
        time.sleep(1.0)
    finally:
        os._exit(128 + int(sig))


def _watch(lifeline, wake_fd: int, prefix: str, run_dir: str) -> None:
    """Watchdog thread of a rank: wait for the launcher to stop this rank (a byte
    on the lifeline), to die (end of file on the lifeline) or for SIGTERM, then
    remove what the run left and end the process.

    A SIGTERM alone does not say who sent it: the launcher (its stop byte is
    already on the lifeline), the launcher's death (``PR_SET_PDEATHSIG``; the end
    of file follows within moments, as the dying process's last thread closes
    its files) or someone else. So it waits up to :data:`_SIGTERM_GRACE_S` for
    the lifeline to tell. Only an orphaned rank removes the run directory; a
    living launcher removes it itself."""
    lf = lifeline.fileno()
    orphaned, deadline = None, None
    while orphaned is None:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            ready, _, _ = select.select([lf, wake_fd], [], [], timeout)
        except InterruptedError:
            continue
        except (OSError, ValueError):
            orphaned = False
            break
        if lf in ready:
            try:
                lifeline.recv_bytes()
                orphaned = False  # the launcher asks this rank to stop
            except (EOFError, OSError):
                orphaned = True  # its write end closed: the launcher is gone
        elif wake_fd in ready:
            try:
                woken = os.read(wake_fd, 64)  # one byte per signal Python handled
            except BlockingIOError:
                woken = b""
            if signal.SIGTERM in woken and deadline is None:
                deadline = time.monotonic() + _SIGTERM_GRACE_S
        elif deadline is not None and time.monotonic() >= deadline:
            orphaned = False  # a SIGTERM from someone else
    shm_mod.stop_creating(prefix)  # no thread of this rank creates a name after this unlink
    if orphaned:  # nobody else will remove the run directory
        shutil.rmtree(run_dir, ignore_errors=True)
    _die(signal.SIGTERM)


_SIGTERM_GRACE_S = 2.0


def _guard_rank(launcher_pid: int, lifeline, prefix: str, run_dir: str) -> None:
    """Make this rank ignore Ctrl-C and die with the launcher (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked since the fork (_SigintDeferred): now simply ignored
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the watchdog acts on the wakeup byte
    _set_parent_death_signal(signal.SIGTERM)
    threading.Thread(target=_watch, args=(lifeline, r, prefix, run_dir), daemon=True,
                     name="cpkv-watchdog").start()
    if os.getppid() != launcher_pid:  # the launcher died before the guard was up
        os.kill(os.getpid(), signal.SIGTERM)


def _send(conn, msg) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg))  # plain pickle: tensors travel by value, no fd passing
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        if msg[0] == "result":
            _send(conn, ("error", f"rank 0's result cannot be sent to the launcher: {type(e).__name__}: {e}", None))


def _rank_main(rank: int, world_size: int, prefix: str, run_dir: str, timeout: float, launcher_pid: int,
               lifeline, out, target: Callable, args: tuple, plan=None) -> None:
    _guard_rank(launcher_pid, lifeline, prefix, run_dir)
    ctx = RankContext(rank, world_size, prefix)
    try:
        torch.set_num_threads(1)
        ctx.device = plan.rank_device(rank)
        if world_size > 1:
            dist.init_process_group(plan.backend, init_method=f"file://{os.path.join(run_dir, 'pg')}",
                                    rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = target(ctx, *args)
        if rank == 0:
            _send(out, ("result", result, None))
    except BaseException as e:  # report, then exit non-zero so the launcher stops the group
        _send(out, ("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        ctx.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------
def _is_knock_on(message: str) -> bool:
    """An error a rank raises only because a peer went away."""
    return any(w in message for w in ("gloo", "Gloo", "NCCL", "DistBackendError", "Connection closed", "timed out",
                                      "Connection reset", "Broken pipe"))


class _Group:
    """The launcher's view of the running ranks: their processes and pipes."""

    def __init__(self, procs, readers, lifelines):
        self.procs, self.readers, self.lifelines = procs, dict(zip(readers, range(len(readers)))), lifelines
        self.errors: dict[int, tuple[str, str | None]] = {}
        self.result, self.got = None, False

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a message or a rank's exit; take in what came."""
        running = [p.sentinel for p in self.procs if p.exitcode is None]
        ready = wait_ready(list(self.readers) + running, timeout)
        for conn in ready:
            rank = self.readers.get(conn)
            if rank is None:
                continue
            try:
                kind, payload, details = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                del self.readers[conn]  # the rank closed its end: it is ending
                conn.close()
                continue
            except Exception as e:  # a result the launcher cannot unpickle
                kind, payload, details = "error", f"its message cannot be read: {type(e).__name__}: {e}", None
            if kind == "error":
                self.errors.setdefault(rank, (payload, details))
            else:
                self.result, self.got = payload, True

    @property
    def broken(self) -> bool:
        return bool(self.errors) or any(p.exitcode not in (None, 0) for p in self.procs)

    @property
    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def root_cause(self) -> RankFailure:
        """Name the rank that failed first, not the peers that failed because of it.

        Waits up to a second for the other ranks' reports, then prefers a rank
        killed by a signal, then a rank whose error is its own (not a broken
        connection to a peer), then the first error reported."""
        end = time.monotonic() + 1.0
        while time.monotonic() < end and (self.readers or self.alive):
            self.poll(0.05)
        for r, p in enumerate(self.procs):
            if p.exitcode is not None and p.exitcode < 0 and r not in self.errors:
                return RankFailure(r, f"exited with code {p.exitcode} (killed by {signal.Signals(-p.exitcode).name})")
        own = [r for r, (m, d) in self.errors.items() if not _is_knock_on(m + (d or ""))]
        if own or self.errors:
            r = (own or list(self.errors))[0]
            return RankFailure(r, *self.errors[r])
        r = next(r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0))
        return RankFailure(r, f"exited with code {self.procs[r].exitcode}")

    def stop(self) -> None:
        """Ask every rank still running to stop (a byte on its lifeline, and
        SIGTERM), SIGKILL any still there after 5 s, and reap every rank
        (waiting up to :data:`_REAP_S` more for a killed one), so that the
        launcher's last unlink of the run's names comes after the last rank
        that could create one has ended."""
        started = [p for p in self.procs if p.pid is not None]
        for p, life in zip(self.procs, self.lifelines):
            if p.pid is not None and p.is_alive():
                try:
                    life.send_bytes(b"stop")
                except OSError:
                    pass
                p.terminate()
        for p in started:
            p.join(5)
            if p.is_alive():
                p.kill()
            end = time.monotonic() + _REAP_S
            while p.is_alive() and time.monotonic() < end:
                p.join(1)


_REAP_S = 60.0  # a SIGKILLed rank is gone within moments; this only bounds a process stuck in the kernel


class _SigintDeferred:
    """Hold Ctrl-C back in the launcher while ranks are forked and while it
    cleans up: SIGINT is blocked in this thread, and one that arrives meanwhile
    is delivered (as :class:`KeyboardInterrupt`) when the block ends, not lost.
    Ranks forked meanwhile inherit the block, so a Ctrl-C during their start-up
    prints nothing; :func:`_guard_rank` then turns it into "ignored"."""

    def __enter__(self):
        self.saved = None
        if hasattr(signal, "pthread_sigmask"):
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()  # starting it later would unblock SIGINT in this thread
            self.saved = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.saved)
        return False


def launch(target: Callable, world_size: int, *args: Any, timeout: float = 300.0, device: str = "cpu") -> Any:
    """Run ``target(ctx, *args)`` on ``world_size`` spawned ranks; return rank 0's result.

    ``target`` must be a module-level function (ranks are spawned) and rank 0's
    result picklable. Raises :class:`RankFailure` naming the first rank that
    failed, or the group (``rank=None``) when it does not finish within
    ``timeout`` seconds, after stopping every other rank. A
    :class:`KeyboardInterrupt` in the launcher stops the group and propagates.
    Whatever happens, the run leaves no process, shared segment or semaphore
    (on a GPU also no CUDA IPC reference-counter file of a rank,
    ``/dev/shm/torch_<rank pid>_*``, which a killed rank cannot remove).
    ``device="cuda"``: as :func:`~cpkv.runtime.device.plan_devices` plans
    (rank r on ``cuda:(r % GPUs)``; NCCL with one GPU per rank, gloo when
    ranks share a GPU), or its ``RuntimeError`` before any process starts.
    """
    from .device import plan_devices

    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    plan = plan_devices(device, int(world_size))
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    ctx = mp.get_context("spawn")
    prefix = shm_mod.run_prefix(uuid.uuid4().hex[:8])
    run_dir = tempfile.mkdtemp(prefix="cpkv_pg_")
    lifelines = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # the launcher holds the write ends
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [ctx.Process(target=_rank_main, daemon=True, name=f"cpkv-rank-{r}",
                         args=(r, world_size, prefix, run_dir, timeout, os.getpid(), lifelines[r][0], pipes[r][1],
                               target, args, plan))
             for r in range(world_size)]
    group, failure = _Group(procs, [rd for rd, _ in pipes], [w for _, w in lifelines]), None
    try:
        with _SigintDeferred():
            for p in procs:
                p.start()
        for conn in [wr for _, wr in pipes] + [rd for rd, _ in lifelines]:
            conn.close()
        deadline = time.monotonic() + timeout
        while not group.got or group.alive:
            group.poll(min(0.5, max(deadline - time.monotonic(), 0.0)))
            if group.broken:
                failure = group.root_cause()
                break
            if time.monotonic() > deadline:
                failure = RankFailure(None, f"did not finish within {timeout:g} s")
                break
            if not group.got and not group.alive and not group.readers:
                failure = RankFailure(0, "the group ended without a result")
                break
    finally:
        with _SigintDeferred():
            group.stop()
            for conn in list(group.readers) + [c for pair in pipes + lifelines for c in pair]:
                conn.close()
            shm_mod.unlink_prefix(prefix)
            if plan.device == "cuda":
                shm_mod.unlink_torch_files([p.pid for p in procs if p.pid is not None])
            shutil.rmtree(run_dir, ignore_errors=True)
    if failure is not None:
        raise failure
    return group.result
