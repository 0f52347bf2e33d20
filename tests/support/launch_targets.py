"""Tiny module-level targets for testing the launcher itself (spawned ranks
import this module by name; it imports nothing heavier than cpkv's runtime)."""

import os
import signal
import time

import torch

from cpkv.runtime.shm import shm_names
from .proc_helpers import semaphores_of


def share(ctx, n):
    """Rank 0 fills a shared tensor; every rank reads it back; returns, per rank,
    whether it saw rank 0's values, which of the run's names were left, its pid,
    and the semaphores it and the launcher have open, mid-run."""
    t = ctx.shared("buf", (n,), torch.int64)
    if ctx.rank == 0:
        t.copy_(torch.arange(n))
    ctx.barrier()
    return ctx.all_gather_object((bool(t.eq(torch.arange(n)).all()), sorted(shm_names(ctx.prefix)), os.getpid(),
                                  sorted(semaphores_of(os.getpid(), os.getppid()))))


def fail_on(ctx, bad_rank, how):
    """Share a segment, then ``bad_rank`` raises (``how="raise"``) or kills
    itself (``how="kill"``) while its peers wait for it in a barrier."""
    ctx.shared("buf", (16,), torch.float32)
    if ctx.rank == bad_rank:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault on rank {ctx.rank}\nsecond line of the message")
    ctx.barrier()
    return "unreachable"


def hang(ctx, marker_dir):
    """Share a segment, write ``<marker_dir>/<rank>`` holding this pid, then loop
    through barriers forever."""
    ctx.shared("buf", (1024,), torch.float32)
    ctx.barrier()
    path = os.path.join(marker_dir, str(ctx.rank))
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        ctx.barrier()
        time.sleep(0.05)


def create_forever(ctx, marker_dir):
    """Write ``<marker_dir>/<rank>`` holding this pid once the first segment
    exists, then create (and close) segments of the run, one new name after
    another, until the rank is stopped; never unlinks one itself."""
    from cpkv.runtime import shm

    i = 0
    while True:
        shm.close(shm.create(f"{ctx.prefix}r{ctx.rank}_{i}", 4096))
        if i == 0:
            path = os.path.join(marker_dir, str(ctx.rank))
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
        i += 1
