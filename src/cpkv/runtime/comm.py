"""The collectives a CP group uses, behind one small interface.

A rank's forward needs four things from its peers: a barrier (the write
fence), an all-gather of tensors whose first dimension may differ by rank (new
K/V under a token split; the decode queries and the top-k scores under the
log-sum-exp decode split), an all-to-all of row blocks (the partial attention
outputs of each request sent to its rank under that split), and an all-gather
of small Python objects (sampled tokens, reports).

* :class:`DistComm` runs them on a ``torch.distributed`` group (gloo on the CPU);
* :class:`LocalComm` is a group of one;
* :func:`thread_group` makes N :class:`ThreadComm` that run N ranks as threads
  of one process (tensors are shared memory between threads), so cross-rank
  logic is tested without spawning processes. The process group is tested too.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


class Comm:
    """Collectives of one rank of a group of ``size`` ranks; ``rank`` is its index."""

    rank: int
    size: int

    def barrier(self) -> None:
        """Every rank arrives before any leaves."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """``x`` of every rank, in rank order; first dimensions may differ, the rest must agree.
        ``sizes``: every rank's first dimension, when the caller already knows them
        (it saves a collective); ``ValueError`` if this rank's disagrees with ``x``."""
        raise NotImplementedError

    def all_to_all(self, chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Send ``chunks[r]`` to rank ``r`` (first dimensions may differ, the
        rest and the dtype must agree); returns what every rank sent this one,
        in rank order, ``recv_sizes[r]`` rows from rank ``r`` (the caller knows
        them: no collective for the sizes). ``ValueError`` for ``chunks`` or
        ``recv_sizes`` not of the group's size, or this rank's own chunk not of
        ``recv_sizes[rank]`` rows."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> list:
        """``obj`` of every rank, in rank order."""
        raise NotImplementedError


class LocalComm(Comm):
    """A group of one rank: every collective is the identity."""

    def __init__(self):
        self.rank, self.size = 0, 1

    def barrier(self) -> None:
        """Nothing to wait for."""

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """``[x]``."""
        _check_sizes(self, x, sizes)
        return [x]

    def all_to_all(self, chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """``[chunks[0]]``."""
        _check_chunks(self, chunks, recv_sizes)
        return [chunks[0]]

    def all_gather_object(self, obj: Any) -> list:
        """``[obj]``."""
        return [obj]


class DistComm(Comm):
    """Collectives on a ``torch.distributed`` process group (default: the world).

    ``ranks`` lists the global ranks of ``group`` in group order (default
    ``0 .. world_size - 1``); ``rank`` is this process's index among them.
    ``device``: this rank's device. On a CUDA device whose group runs NCCL
    (one GPU per rank), :meth:`barrier` is a fence on the device; on a gloo
    group (ranks sharing a GPU, :func:`~cpkv.runtime.device.plan_devices`)
    it synchronises the rank's stream before the host barrier, and CUDA
    tensors are all-gathered through the host.
    """

    def __init__(self, group=None, ranks: Sequence[int] | None = None, device: torch.device | None = None):
        self.group = group
        self.ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        self.rank, self.size = self.ranks.index(dist.get_rank()), len(self.ranks)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        cuda = self.device.type == "cuda"
        self.on_device = cuda and "nccl" in str(dist.get_backend(group)).lower()  # collectives of CUDA tensors
        self._one = torch.zeros(1, device=self.device) if self.on_device else None
        self._staged = cuda and not self.on_device

    def barrier(self) -> None:
        """The write fence. ``dist.barrier`` on the group; with NCCL on a CUDA
        device, a one-element all-reduce instead, ordered on the stream after
        the owners' writes (no host wait), as SGLang's shared-KV path does;
        on a CUDA device with a gloo group (ranks sharing a GPU), the rank's
        stream is synchronised first, so its writes have landed before any
        peer passes the barrier."""
        if self.size == 1:
            return
        if self._one is not None:
            dist.all_reduce(self._one, group=self.group)
            return
        if self._staged:
            torch.cuda.current_stream(self.device).synchronize()
        dist.barrier(group=self.group)

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Pads every rank's ``x`` to the longest first dimension, gathers, trims
        (one collective with ``sizes``, two without). A CUDA tensor on a gloo
        group goes through the host and comes back on its device."""
        _check_sizes(self, x, sizes)
        if self.size == 1:
            return [x]
        if self._staged and x.device.type == "cuda":
            return [o.to(x.device) for o in self._gather(x.cpu(), sizes)]
        return self._gather(x, sizes)

    def _gather(self, x: torch.Tensor, sizes: Sequence[int] | None) -> list[torch.Tensor]:
        if sizes is None:
            n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
            got = [torch.zeros_like(n) for _ in range(self.size)]
            dist.all_gather(got, n, group=self.group)
            sizes = got
        sizes = [int(s) for s in sizes]
        m = max(sizes)
        if x.shape[0] == m and x.is_contiguous():
            out = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(out, x, group=self.group)
            return [o[:s] for o, s in zip(out, sizes)]
        pad = x.new_empty((m, *x.shape[1:]))  # rows past x are trimmed away
        pad[: x.shape[0]] = x
        out = [torch.empty_like(pad) for _ in range(self.size)]
        dist.all_gather(out, pad.contiguous(), group=self.group)
        return [o[:s] for o, s in zip(out, sizes)]

    def all_to_all(self, chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """One ``dist.all_to_all_single`` of the chunks' rows (a CUDA tensor on
        a gloo group goes through the host and comes back on its device)."""
        _check_chunks(self, chunks, recv_sizes)
        if self.size == 1:
            return [chunks[0]]
        dev = chunks[0].device
        staged = self._staged and dev.type == "cuda"
        send = torch.cat([c.cpu() if staged else c for c in chunks]).contiguous()
        recv = send.new_empty((sum(int(n) for n in recv_sizes), *send.shape[1:]))
        dist.all_to_all_single(recv, send, output_split_sizes=[int(n) for n in recv_sizes],
                               input_split_sizes=[c.shape[0] for c in chunks], group=self.group)
        out = list(recv.split([int(n) for n in recv_sizes]))
        return [o.to(dev) for o in out] if staged else out

    def all_gather_object(self, obj: Any) -> list:
        """``dist.all_gather_object`` on the group."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _check_sizes(comm: Comm, x: torch.Tensor, sizes: Sequence[int] | None) -> None:
    if sizes is not None and (len(sizes) != comm.size or int(sizes[comm.rank]) != x.shape[0]):
        raise ValueError(f"rank {comm.rank} of {comm.size}: all_gather sizes {list(sizes)} do not match its "
                         f"{x.shape[0]} rows")


def _check_chunks(comm: Comm, chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> None:
    if len(chunks) != comm.size or len(recv_sizes) != comm.size:
        raise ValueError(f"rank {comm.rank} of {comm.size}: all_to_all takes one chunk and one receive size per "
                         f"rank, got {len(chunks)} chunks and {len(recv_sizes)} sizes")
    if chunks[comm.rank].shape[0] != int(recv_sizes[comm.rank]):
        raise ValueError(f"rank {comm.rank} of {comm.size}: its own chunk has {chunks[comm.rank].shape[0]} rows, "
                         f"recv_sizes says {int(recv_sizes[comm.rank])}")


class _Rendezvous:
    def __init__(self, n: int, timeout: float):
        self.n, self.timeout = n, timeout
        self.barrier = threading.Barrier(n, timeout=timeout)
        self.slots: list = [None] * n


class ThreadComm(Comm):
    """One rank of a group of threads in one process (see :func:`thread_group`)."""

    def __init__(self, rank: int, rv: _Rendezvous):
        self.rank, self.size, self._rv = rank, rv.n, rv

    def barrier(self) -> None:
        """``threading.Barrier`` of the group (raises ``BrokenBarrierError`` if a rank failed)."""
        self._rv.barrier.wait()

    def abort(self) -> None:
        """Break the group's barrier, so that every rank of the group waiting in
        a collective, or entering one later, raises ``threading.BrokenBarrierError``
        (how a failing thread rank releases its peers instead of leaving them to
        time out). Cannot be undone: the group is finished."""
        self._rv.barrier.abort()

    def _exchange(self, value) -> list:
        rv = self._rv
        rv.barrier.wait()  # the previous exchange has been read by everyone
        rv.slots[self.rank] = value
        rv.barrier.wait()
        return list(rv.slots)

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Every rank's ``x`` (cloned, so later in-place changes do not leak across ranks)."""
        _check_sizes(self, x, sizes)
        return [t.clone() for t in self._exchange(x)]

    def all_to_all(self, chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
        """What every rank's ``chunks`` hold for this one (cloned)."""
        _check_chunks(self, chunks, recv_sizes)
        got = [sent[self.rank].clone() for sent in self._exchange(list(chunks))]
        if [g.shape[0] for g in got] != [int(n) for n in recv_sizes]:
            raise ValueError(f"rank {self.rank}: received {[g.shape[0] for g in got]} rows, expected "
                             f"{[int(n) for n in recv_sizes]}")
        return got

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``."""
        return self._exchange(obj)


def thread_group(n: int, timeout: float = 60.0) -> list[ThreadComm]:
    """``n`` communicators whose ranks run as threads of this process."""
    if n < 1:
        raise ValueError(f"a group needs at least one rank, got {n}")
    rv = _Rendezvous(n, timeout)
    return [ThreadComm(r, rv) for r in range(n)]


def run_threads(n: int, target: Callable[[Comm], Any], timeout: float = 120.0) -> list:
    """Run ``target(comm)`` on ``n`` thread ranks; return every rank's result.

    The first exception any rank raises is re-raised here (the others are
    released by breaking the group's barrier).
    """
    comms = thread_group(n, timeout)
    results: list = [None] * n
    errors: list = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = target(comms[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e
            comms[r].abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"thread group of {n} did not finish within {timeout} s")
    return results
