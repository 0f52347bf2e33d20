"""Process lifetime of a CP group: start N ranks, watch them, stop them, clean up.

:func:`launch` spawns ``world_size`` rank processes on this machine, joined in
one ``torch.distributed`` group (gloo on the CPU), and runs ``target(ctx,
*args)`` in each, where ``ctx`` is that rank's :class:`RankContext`. It returns
what rank 0's target returned. A rank that raises or dies stops the whole group,
and :class:`RankFailure` names the rank that failed first (not the peers that
failed because it went away).

Nothing outlives the launcher, however it ends (``kill -9`` included), and
nothing that makes it so needs a dying rank to run Python code: a rank blocked
in C++ with the GIL held (the rendezvous, a gloo collective) runs none.

* **Which mechanism ends a rank, moment by moment.** A rank is a plain
  ``python -c`` process (:data:`_BOOT`), not a multiprocessing child.

  - *Spawned, before its first statement:* the boot's first statements set
    ``PR_SET_PDEATHSIG`` to ``SIGKILL`` (``prctl`` through ctypes, before any
    other import) and then check that the parent is still the launcher; a
    launcher that died in between is caught by the check (the rank SIGKILLs
    itself), one that dies later by the kernel.
  - *Importing* (the launcher's ``__main__``, the target's module, cpkv,
    torch), *in the rendezvous* (``dist.init_process_group``), *in a
    collective*, *in a step:* ``PR_SET_PDEATHSIG``: the kernel sends SIGKILL as
    the launcher's spawning thread ends (the thread that runs :func:`launch`,
    which waits for its ranks), whatever the rank is doing. The rendezvous is
    so bounded by the launcher's life, not only by ``timeout``.
  - *Stopped by a living launcher* (a failure, the timeout, Ctrl-C): SIGTERM,
    whose default action the rank keeps (the kernel ends it at once); SIGKILL
    after 5 s.

  Ranks ignore ``SIGINT`` from the moment they are forked (blocked while the
  launcher spawns them, ignored by the boot): Ctrl-C reaches the launcher,
  which stops the group and re-raises :class:`KeyboardInterrupt`.
* **Which mechanism removes what the run leaves.** A shared segment's name is
  unlinked as soon as every rank of its group has mapped it
  (:meth:`RankContext.shared`); the memory goes with the last mapping. The run
  folder (the rendezvous file) and any name left are removed by the launcher in
  its ``finally``, once every rank has been reaped. If the launcher dies first,
  by this process's reaper (:mod:`cpkv.runtime.reaper`): a tiny process holding
  a pipe whose write end the launcher and every rank hold, so that its end of
  file comes when the last of them is gone; it then removes the run's name
  prefix and folder, registered with it before either existed, and exits.
* **No multiprocessing machinery.** Ranks are started with ``subprocess`` and
  talk to the launcher over plain pipes: no resource tracker is started, and a
  run creates no multiprocessing semaphore.

Off Linux there is no ``PR_SET_PDEATHSIG``: the ranks of a dead launcher end
when their rendezvous or collective times out (``timeout``), and the reaper
cleans up after them.

Sizing a group before it starts (memory, cores, start time) is
:mod:`cpkv.runtime.sizing`.

The group runs on the CPU (gloo) or, with ``device="cuda"``, on GPUs as
:func:`cpkv.runtime.device.plan_devices` plans: one GPU per rank on NCCL, or
several ranks per GPU on gloo.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
import uuid
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import reaper as reaper_mod
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
#: What a rank process runs first (``python -c``), before it imports anything of the run: it asks the
#: kernel for SIGKILL at the death of its parent thread (the launcher's thread that spawned it), checks
#: that this parent is still the launcher (a launcher that died before the ``prctl`` is caught here), takes
#: its signals (SIGINT ignored, SIGTERM ends it), then reads from the launcher, in order, the preparation
#: of multiprocessing's spawn (``sys.path``, the working folder, the launcher's ``__main__``), the target
#: with its arguments, and the rank's own parameters, and runs :func:`_rank_main`. A failure before that
#: is reported on the rank's outbox as :func:`_rank_main` reports one.
_BOOT = """\
import os, sys
launcher, inbox, outbox, token = (int(a) for a in sys.argv[2:6])
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != launcher:
    os.kill(os.getpid(), 9)
import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGTERM, signal.SIG_DFL)
for fd in (inbox, outbox, token):
    os.set_inheritable(fd, False)
import pickle
from multiprocessing.connection import Connection
inbox = Connection(inbox, writable=False)
try:
    import multiprocessing.process, multiprocessing.spawn
    me = multiprocessing.process.current_process()
    me._inheriting = True  # as multiprocessing's spawn: a launch while importing __main__ is refused
    try:
        multiprocessing.spawn.prepare(pickle.loads(inbox.recv_bytes()))
        target, args = pickle.loads(inbox.recv_bytes())
        main, params = pickle.loads(inbox.recv_bytes())
    finally:
        del me._inheriting
    inbox.close()
except BaseException as e:
    import traceback
    Connection(outbox, readable=False).send_bytes(pickle.dumps(
        ("error", f"it could not start: {type(e).__name__}: {e}", traceback.format_exc())))
    raise SystemExit(1)
main(*params, outbox, target, args)
"""


def _send(conn, msg) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg))  # plain pickle: tensors travel by value, no fd passing
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        if msg[0] == "result":
            _send(conn, ("error", f"rank 0's result cannot be sent to the launcher: {type(e).__name__}: {e}", None))


def _rank_main(rank: int, world_size: int, prefix: str, run_dir: str, timeout: float, plan, outbox: int,
               target: Callable, args: tuple) -> None:
    from multiprocessing.connection import Connection

    out = Connection(outbox, readable=False)
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
    """The launcher's view of the running ranks: their processes (``subprocess.Popen``, with a pidfd
    each where the system has them, so a rank's end wakes the launcher at once) and their outboxes."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.sentinels: list[int | None] = []
        self.readers: dict = {}  # outbox -> rank
        self.errors: dict[int, tuple[str, str | None]] = {}
        self.result, self.got = None, False

    def add(self, proc: subprocess.Popen, outbox) -> None:
        try:
            sentinel = os.pidfd_open(proc.pid)  # before any wait: the pid is still this child's
        except (AttributeError, OSError):
            sentinel = None
        self.readers[outbox] = len(self.procs)
        self.procs.append(proc)
        self.sentinels.append(sentinel)

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a message or a rank's exit; take in what came."""
        running = [s for p, s in zip(self.procs, self.sentinels) if s is not None and p.poll() is None]
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
        return bool(self.errors) or any(p.poll() not in (None, 0) for p in self.procs)

    @property
    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def root_cause(self) -> RankFailure:
        """Name the rank that failed first, not the peers that failed because of it.

        Waits up to a second for the other ranks' reports, then prefers a rank
        killed by a signal, then a rank whose error is its own (not a broken
        connection to a peer), then the first error reported."""
        end = time.monotonic() + 1.0
        while time.monotonic() < end and (self.readers or self.alive):
            self.poll(0.05)
        codes = [p.poll() for p in self.procs]
        for r, code in enumerate(codes):
            if code is not None and code < 0 and r not in self.errors:
                return RankFailure(r, f"exited with code {code} (killed by {signal.Signals(-code).name})")
        own = [r for r, (m, d) in self.errors.items() if not _is_knock_on(m + (d or ""))]
        if own or self.errors:
            r = (own or list(self.errors))[0]
            return RankFailure(r, *self.errors[r])
        r = next(r for r, code in enumerate(codes) if code not in (None, 0))
        return RankFailure(r, f"exited with code {codes[r]}")

    def stop(self) -> None:
        """Stop every rank still running (SIGTERM, which a rank does not handle: the kernel ends it even
        while it holds the GIL in C++), SIGKILL any still there after 5 s, and reap every rank (waiting
        up to :data:`_REAP_S` more for a killed one), so that the launcher's last unlink of the run's
        names comes after the last rank that could create one has ended."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(_REAP_S)
                except subprocess.TimeoutExpired:
                    pass

    def close(self) -> None:
        for conn in self.readers:
            conn.close()
        for s in self.sentinels:
            if s is not None:
                os.close(s)
        self.readers, self.sentinels = {}, []


_REAP_S = 60.0  # a SIGKILLed rank is gone within moments; this only bounds a process stuck in the kernel


class _SigintDeferred:
    """Hold Ctrl-C back in the launcher while ranks are forked and while it
    cleans up: SIGINT is blocked in this thread, and one that arrives meanwhile
    is delivered (as :class:`KeyboardInterrupt`) when the block ends, not lost.
    Ranks forked meanwhile inherit the block, so a Ctrl-C during their start-up
    prints nothing; :data:`_BOOT` then turns it into "ignored"."""

    def __enter__(self):
        self.saved = None
        if hasattr(signal, "pthread_sigmask"):
            self.saved = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.saved)
        return False


def _preparation(rank: int) -> dict:
    """What multiprocessing's spawn tells a child about its parent (``sys.path``, the working folder,
    ``__main__``), less the parent's authentication key (a rank does not use it)."""
    from multiprocessing.spawn import get_preparation_data

    data = get_preparation_data(f"cpkv-rank-{rank}")
    data.pop("authkey", None)
    return data


class _PassedFd:
    """A descriptor a rank inherits under the same number (multiprocessing's spawn passes them so)."""

    def __init__(self, fd: int):
        self.fd = fd

    def detach(self) -> int:
        return self.fd


class _FdCollector:
    """Stands for multiprocessing's spawning ``Popen`` while the launcher pickles a rank's work, as
    ``multiprocessing`` pickles a spawned child's: a shared-memory tensor among the arguments (torch's
    reduction) travels as its descriptor, which the rank inherits (``pass_fds``)."""

    DupFd = _PassedFd

    def __init__(self):
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return fd


def _pickle_work(target: Callable, args: tuple) -> tuple[bytes, list[int]]:
    """``(target, args)`` pickled as multiprocessing's spawn would (torch's reductions included); the
    descriptors the ranks must inherit for it."""
    from multiprocessing import context
    from multiprocessing.reduction import ForkingPickler

    collector = _FdCollector()
    context.set_spawning_popen(collector)
    try:
        return bytes(ForkingPickler.dumps((target, args))), collector.fds
    finally:
        context.set_spawning_popen(None)


def _spawn_rank(rank: int, token: int, fds: list[int]) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start rank ``rank`` (:data:`_BOOT`); its process, the launcher's end of its inbox and of its
    outbox. ``token`` is the reaper's descriptor the rank holds while it lives, ``fds`` those its
    work refers to."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:  # the interpreter's flags as multiprocessing passes them to its spawned children
        cmd = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _BOOT, f"cpkv-rank-{rank}",
               str(os.getpid()), str(in_r), str(out_w), str(token)]
        proc = subprocess.Popen(cmd, pass_fds=(in_r, out_w, token, *fds))
    except BaseException:
        os.close(in_w)
        os.close(out_r)
        raise
    finally:
        os.close(in_r)
        os.close(out_w)
    return proc, Connection(in_w, readable=False), Connection(out_r, writable=False)


def launch(target: Callable, world_size: int, *args: Any, timeout: float = 300.0, device: str = "cpu") -> Any:
    """Run ``target(ctx, *args)`` on ``world_size`` spawned ranks; return rank 0's result.

    ``target`` must be a module-level function (ranks are spawned) and rank 0's
    result picklable. Raises :class:`RankFailure` naming the first rank that
    failed, or the group (``rank=None``) when it does not finish within
    ``timeout`` seconds, after stopping every other rank. A
    :class:`KeyboardInterrupt` in the launcher stops the group and propagates.
    Whatever happens, the run leaves no process, shared segment or folder (see
    the module docstring for the launcher's own death; on a GPU, a living
    launcher also removes the CUDA IPC reference counters a killed rank leaves,
    ``/dev/shm/torch_<rank pid>_*``). It may run in any
    thread: that thread spawns the ranks and waits for them.
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
    world_size = int(world_size)
    messages = [pickle.dumps(_preparation(r)) for r in range(world_size)]
    work, fds = _pickle_work(target, args)  # refused here, before any process starts, when it cannot travel
    prefix = shm_mod.run_prefix(uuid.uuid4().hex[:8])
    reaper = reaper_mod.reaper()
    reaper.watch(prefix=prefix)  # before the first name exists: the reaper removes it if this process dies
    group, inboxes, run_dir, failure = _Group(), [], None, None
    try:
        run_dir = reaper.folder("cpkv_pg")
        with _SigintDeferred():
            for r in range(world_size):
                proc, inbox, outbox = _spawn_rank(r, reaper.fd, fds)
                group.add(proc, outbox)
                inboxes.append(inbox)
        for r, inbox in enumerate(inboxes):
            try:
                inbox.send_bytes(messages[r])
                inbox.send_bytes(work)
                inbox.send_bytes(pickle.dumps((_rank_main, (r, world_size, prefix, run_dir, timeout, plan))))
            except OSError:
                pass  # the rank is gone already: its exit code says so
            inbox.close()
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
            group.close()
            for inbox in inboxes:
                inbox.close()
            reaper.remove(prefix=prefix)
            if run_dir is not None:
                reaper.remove(path=run_dir)
            if plan.device == "cuda":  # a killed rank's CUDA IPC reference counters
                shm_mod.unlink_torch_files([p.pid for p in group.procs])
    if failure is not None:
        raise failure
    return group.result
