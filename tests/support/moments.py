"""Pausing a rank at a named moment of its life, so that a test kills its launcher exactly there (test-only:
nothing of it is a setting a user sees).

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
"""

import ctypes
import os
import re

PAUSE, MARKS = "CPKV_TEST_PAUSE", "CPKV_TEST_MARKS"


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


maybe_pause("imports")


# -- targets ------------------------------------------------------------------------------
def _pause_in_steps(rank: int) -> None:
    """Make the engine's k-th step pause this rank when the environment says ``step<k>``."""
    from cpkv.engine.engine import RankExecutor

    run, count = RankExecutor.run, [0]

    def counted(self, plan):
        count[0] += 1
        maybe_pause(f"step{count[0]}", rank)
        return run(self, plan)

    RankExecutor.run = counted


def engine_rank(ctx, cfg, progress=None):
    """The engine's own rank target, with its steps counted (see the module docstring)."""
    from cpkv.engine import engine

    _pause_in_steps(ctx.rank)
    return engine._engine_rank(ctx, cfg, progress)


def disagg_ranks(ctx, cfgs, report_dir):
    """The disaggregation driver's own rank target, with its steps counted."""
    from cpkv.engine.disagg import driver

    _pause_in_steps(ctx.rank)
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
