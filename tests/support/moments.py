"""Pausing a rank, or failing it, at a named moment of its life, so that a test kills its launcher exactly there
or watches the group end (test-only: nothing of it is a setting a user sees).

``CPKV_TEST_PAUSE="<moment>:<ranks>"`` (``<ranks>``: comma-separated ranks, or ``*``) and
``CPKV_TEST_MARKS=<folder>``, in the environment the ranks inherit. A rank that reaches ``<moment>`` writes
``<folder>/<moment>-<rank>`` (its pid), then blocks in C with the GIL held (libc's ``sleep`` through
``ctypes.PyDLL``), so that no Python code of the rank runs any more: the state of a rank blocked in the
rendezvous or in a gloo collective. Moments:

* ``imports``: while the rank imports this module (it is the target's module, which a rank imports before
  cpkv and torch);
* ``step<k>``: at the start of the engine's k-th step (:class:`cpkv.engine.engine.RankExecutor`), under the
  targets :func:`engine_rank` and :func:`disagg_ranks`, which a test puts in the place of the engine's own in
  its launcher (``cpkv.engine.engine._engine_rank``, ``cpkv.engine.disagg.driver._disagg_ranks``);
* ``rendezvous``: under torchrun, instead of joining the rendezvous, after :func:`cpkv.runtime.torchrun.join`
  set up what ends the rank (:func:`pause_rendezvous`).

Ranks that are not paused go on, and wait for the paused one in the rendezvous or the step's collective.
This module imports nothing heavy at its top, so ``imports`` pauses a rank before torch.

Faults: ``CPKV_TEST_FAULT="<moment>:<rank>:<raise|kill>"`` makes rank ``<rank>`` raise ``RuntimeError`` or die
by SIGKILL at ``<moment>`` (a ``step<k>`` under the targets above, or ``transfer<k>`` under
:func:`disagg_ranks`: in the middle of transfer number k, 0-based, of the disaggregation driver, the rank
counted in the world: a prefill rank sends one message of it, then fails; a decode rank fails before it
receives). With ``CPKV_TEST_FAULT_MARKER=<file>`` the rank first writes the time there, so that a test times
the group's reaction from the fault itself.
"""

import ctypes
import os
import re
import signal
import time

PAUSE, MARKS = "CPKV_TEST_PAUSE", "CPKV_TEST_MARKS"
FAULT, FAULT_MARKER = "CPKV_TEST_FAULT", "CPKV_TEST_FAULT_MARKER"


def _rank_of_this_process() -> int | None:
    """A launched rank's number, from its command line (``cpkv-rank-<r>``); torchrun's ``RANK``."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            m = re.search(rb"\0cpkv-rank-(\d+)\0", f.read())
    except OSError:
        m = None
    if m:
        return int(m.group(1))
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def pauses_at(moment: str, rank: int | None) -> bool:
    """Whether this environment pauses ``rank`` at ``moment``."""
    spec = os.environ.get(PAUSE, "")
    if ":" not in spec or rank is None:
        return False
    name, ranks = spec.split(":", 1)
    return name == moment and (ranks == "*" or str(rank) in ranks.split(","))


def mark(what: str, rank: int) -> None:
    """Write ``<marks>/<what>-<rank>``, holding this pid."""
    path = os.path.join(os.environ[MARKS], f"{what}-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def pause(moment: str, rank: int) -> None:
    """Mark ``moment`` reached by ``rank``, then block for an hour without letting Python run."""
    mark(moment, rank)
    ctypes.PyDLL(None).sleep(ctypes.c_uint(3600))  # PyDLL: the GIL stays held


def maybe_pause(moment: str, rank: int | None = None) -> None:
    rank = _rank_of_this_process() if rank is None else rank
    if pauses_at(moment, rank):
        pause(moment, rank)


def fault_at(moment: str, rank: int) -> str | None:
    """``"raise"`` or ``"kill"`` when this environment fails ``rank`` at ``moment``, else ``None``."""
    name, _, rest = os.environ.get(FAULT, "").partition(":")
    who, _, how = rest.partition(":")
    return how if name == moment and who == str(rank) and how in ("raise", "kill") else None


def fail(how: str, moment: str, rank: int) -> None:
    """The fault: write the time to the marker file (when set), then die by SIGKILL or raise. Never returns."""
    if os.environ.get(FAULT_MARKER):
        with open(os.environ[FAULT_MARKER], "w") as f:
            f.write(repr(time.time()))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on rank {rank} at {moment}")


def at(moment: str, rank: int) -> None:
    """What this environment asks of ``rank`` at ``moment``: a pause, a fault, or nothing."""
    maybe_pause(moment, rank)
    how = fault_at(moment, rank)
    if how:
        fail(how, moment, rank)


maybe_pause("imports")


# -- targets ------------------------------------------------------------------------------
def _watch_steps(rank: int) -> None:
    """Make the engine's k-th step pause or fail this rank when the environment says ``step<k>``."""
    from cpkv.engine.engine import RankExecutor

    run, count = RankExecutor.run, [0]

    def counted(self, plan):
        count[0] += 1
        at(f"step{count[0]}", rank)
        return run(self, plan)

    RankExecutor.run = counted


def _watch_transfers() -> None:
    """Make transfer number k fail its rank when the environment says ``transfer<k>``: a prefill rank sends one
    message of it first (mid-transfer), a decode rank fails before it receives."""
    import dataclasses

    from cpkv.consumers.transfer import send_transfer
    from cpkv.engine.disagg.link import TransferLink

    send, receive = TransferLink.send, TransferLink.receive

    def sending(self):
        tp, moment = self.step.transfer, f"transfer{self.step.index}"
        how = fault_at(moment, self.rank) if tp is not None else None
        if how:
            first = tp.destinations_of(self.pool.rank)[:1]
            if first:
                sub = dataclasses.replace(tp, pair_slots=tp.pair_slots * 0)
                sub.pair_slots[self.pool.rank, first[0]] = tp.pair_slots[self.pool.rank, first[0]]
                send_transfer(sub, self.pool, self.transport, lambda b: self.M + b)
            fail(how, moment, self.rank)
        return send(self)

    def receiving(self, plan):
        at(f"transfer{self.step.index}", self.rank)
        return receive(self, plan)

    TransferLink.send, TransferLink.receive = sending, receiving


def engine_rank(ctx, cfg, progress=None):
    """The engine's own rank target, with its steps counted (see the module docstring)."""
    from cpkv.engine import engine

    _watch_steps(ctx.rank)
    return engine._engine_rank(ctx, cfg, progress)


def disagg_ranks(ctx, cfgs, report_dir):
    """The disaggregation driver's own rank target, with its steps and transfers counted."""
    from cpkv.engine.disagg import driver

    _watch_steps(ctx.rank)
    _watch_transfers()
    return driver._disagg_ranks(ctx, cfgs, report_dir)


def unreached(ctx, *args):
    """The target of the tests whose ranks never reach it (paused before, or ended with their launcher)."""
    raise AssertionError(f"rank {ctx.rank} went past its pause")


def pause_rendezvous() -> None:
    """Under torchrun: make this rank, when the environment says ``rendezvous``, pause where
    :func:`~cpkv.runtime.torchrun.join` would enter the rendezvous (after it set up the rank's end)."""
    import torch.distributed as dist

    init = dist.init_process_group

    def paused(*a, **k):
        maybe_pause("rendezvous")
        if os.environ.get(MARKS):
            mark("rendezvous-entered", _rank_of_this_process())
        return init(*a, **k)

    dist.init_process_group = paused
