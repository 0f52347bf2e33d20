"""Point-to-point messages between ranks, for KV transfers between CP groups.

A transport has one call, ``post(sends, recvs) -> pending``: ``sends`` and
``recvs`` are lists of ``(peer, tensor)`` (peers are ranks of the world both
groups are in); ``pending.wait()`` returns once every send has gone (its
tensor may be reused) and every receive has filled its tensor, and raises if a
peer went away or ``timeout`` seconds passed. Messages between one pair of
ranks arrive in the order they were posted.

* :class:`DistP2P` - ``torch.distributed.batch_isend_irecv`` (gloo on the CPU,
  NCCL on the GPU; across machines as well as within one);
* :func:`thread_p2p` - the same between thread ranks of one process (tests).
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist


class DistPending:
    """Posted ``torch.distributed`` point-to-point operations."""

    def __init__(self, works: list, timeout: float | None):
        self.works, self.timeout = works, timeout

    def wait(self) -> None:
        """Wait for every operation; raises the backend's error if a peer failed or the timeout passed."""
        for w in self.works:
            if self.timeout is None:
                w.wait()
            else:
                w.wait(timeout=timedelta(seconds=self.timeout))
        self.works = []


class DistP2P:
    """Point-to-point messages on a ``torch.distributed`` group (default: the world).

    ``timeout`` (seconds) bounds each wait; ``None`` uses the group's own.
    Peers are global ranks.
    """

    def __init__(self, group=None, timeout: float | None = None):
        self.group, self.timeout = group, timeout
        self.rank = dist.get_rank()

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> DistPending:
        """Post every send and receive at once (``batch_isend_irecv``)."""
        for peer, _ in list(sends) + list(recvs):
            if peer == self.rank:
                raise ValueError(f"rank {self.rank} cannot send a message to itself")
        ops = [dist.P2POp(dist.isend, t, peer, self.group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for peer, t in recvs]
        return DistPending(dist.batch_isend_irecv(ops) if ops else [], self.timeout)


class _Mailbox:
    def __init__(self, n: int, timeout: float, abort: threading.Event):
        self.n, self.timeout, self.abort = n, timeout, abort
        self.boxes = {(a, b): queue.Queue() for a in range(n) for b in range(n) if a != b}


class ThreadPending:
    """Posted receives of a thread rank (its sends were delivered when posted)."""

    def __init__(self, box: _Mailbox, rank: int, recvs: list):
        self.box, self.rank, self.recvs = box, rank, recvs

    def wait(self) -> None:
        """Fill every receive; raises ``TimeoutError`` after the timeout, or
        ``RuntimeError`` once the group is aborted (a rank failed)."""
        deadline = time.monotonic() + self.box.timeout
        for peer, buf in self.recvs:
            q = self.box.boxes[(peer, self.rank)]
            while True:
                try:
                    msg = q.get(timeout=0.05)
                    break
                except queue.Empty:
                    if self.box.abort.is_set():
                        raise RuntimeError(f"thread rank {self.rank}: the group was aborted while receiving from {peer}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"thread rank {self.rank}: no message from {peer} within "
                                           f"{self.box.timeout} s") from None
            if msg.shape != buf.shape or msg.dtype != buf.dtype:
                raise RuntimeError(f"thread rank {self.rank}: message from {peer} is {tuple(msg.shape)} {msg.dtype}, "
                                   f"the receive expects {tuple(buf.shape)} {buf.dtype}")
            buf.copy_(msg)
        self.recvs = []


class ThreadP2P:
    """One thread rank's point-to-point messages (see :func:`thread_p2p`)."""

    def __init__(self, rank: int, box: _Mailbox):
        self.rank, self._box = rank, box

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> ThreadPending:
        """Deliver copies of the sends now; the receives fill on ``wait``."""
        for peer, _ in list(sends) + list(recvs):
            if not 0 <= peer < self._box.n or peer == self.rank:
                raise ValueError(f"thread rank {self.rank} cannot exchange a message with {peer}")
        for peer, t in sends:
            self._box.boxes[(self.rank, peer)].put(t.clone())
        return ThreadPending(self._box, self.rank, list(recvs))

    def abort(self) -> None:
        """Release every rank waiting on a receive (a rank failed)."""
        self._box.abort.set()


def thread_p2p(n: int, timeout: float = 60.0) -> list[ThreadP2P]:
    """Transports for ``n`` thread ranks of one process."""
    if n < 1:
        raise ValueError(f"a group needs at least one rank, got {n}")
    box = _Mailbox(n, timeout, threading.Event())
    return [ThreadP2P(r, box) for r in range(n)]
