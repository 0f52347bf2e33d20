"""The CP group on GPUs (``--device cuda``): devices, KV segments and the group's view, host tier, fence.

Written and tested on machines without CUDA: every decision below is a pure
function tested on the CPU (:func:`plan_devices`, :func:`group_segments` with
its handle exchange, :func:`pin_host`'s registration and release); what only a
GPU can prove is marked ``gpu`` in the tests and runs in ``tools/gpu_check.py``.

**Each rank's KV on its own GPU, one view across the ranks: a base table over
CUDA IPC.** Rank r allocates its own segment of each cache family,
``[layers, slots_per_rank, *row]``, with PyTorch's caching allocator on its
own GPU (:func:`group_segments`); its pages sit in that GPU's memory, which
is where context parallelism's capacity comes from. Every other rank opens
that allocation with ``cudaIpcOpenMemHandle`` under its OWN device
(PyTorch's CUDA IPC reduction, rebuilt for the reader's device: the mapping
enables peer access lazily, as vLLM's custom all-reduce does), so every
segment is addressable from every rank's kernels. The group's rank-major view
of one layer is then a :class:`~cpkv.consumers.kv_view.SegmentTable`: the N
segments and a table ``offsets [N]`` (int64 elements from segment 0's base,
each a multiple of 64 bytes). The owner writes only its own segment
([[RFC-0001:C-DIRECT-WRITE]]).

Why a base table and not CUDA VMM (one reserved range with every rank's
physical pages mapped rank-major, SGLang #35309): VMM maps in granules of
2 MiB, so within one layer rank r's part must start at a granule boundary:
``slots_per_rank x row bytes`` a multiple of 2 MiB for every family (at a
192-byte latent row, 32,768 slots per rank), which rules out the small caches
that make eviction and host-tier loads happen in a check; and it needs the
driver API (``cuMemCreate``/``cuMemExportToShareableHandle``/``cuMemMap``)
through ctypes plus file descriptors passed between processes, none of which
PyTorch exposes. The table costs a kernel one load of an N-entry table per
block of keys and keeps every layout. Opening a handle is a one-off per
segment; ``tools/gpu_check.py`` measures a read through the table against a
local read of the same bytes.

**The kernels' interface** (:mod:`cpkv.kernels` reads the view; this is the
whole contract between the two):

* ``pool.view(family, layer)`` is a ``torch.Tensor`` ``[N * slots_per_rank,
  *row]`` over one buffer (the CPU; a group of one), or a ``SegmentTable``;
  a forward hands it to its backend as a
  :class:`~cpkv.kernels.backend.CacheView` (``data``, the family's format
  and row shape), the one path both backends take;
* a ``SegmentTable`` has ``base`` (``[slots_per_rank, *row]``, rank 0's
  segment: the tensor a kernel is launched with), ``offsets`` (int64 ``[N]``
  on ``base.device``, each ``OFFSET_ALIGN_BYTES`` = 64-byte aligned, so a
  multiple of 16 elements of up to 4 bytes; ``offsets_in(element_size)`` for
  a kernel that reads the bytes as another type), one table shared by every
  layer of the family, ``shape``/``dtype``/``device``/``dim()``/``stride()``
  as the rank-major tensor would have them, and ``table[rows]`` (torch's
  reference read, owner by owner);
* a kernel reads rank-major row ``owner * slots_per_rank + local`` at element
  ``offsets[owner] + local * base.stride(0)`` from ``base``, and at ``(owner *
  slots_per_rank + local) * stride(0)`` from a plain tensor
  (``cpkv.kernels.triton_common.row_offset``: one constexpr, ``SEG``, tells
  the two apart; ``kernel_view`` gives the launched tensor and the table).

**N ranks on one GPU** (more ranks than GPUs): the same processes, segments and
IPC view (a process may open another process's allocation on the same GPU),
on a gloo group, since NCCL refuses two ranks on one device. The fence then
synchronises the rank's stream before the host barrier, so every write a
peer issued has landed before anyone reads (:class:`~cpkv.runtime.comm.DistComm`).
With one GPU per rank the group runs ``cpu:gloo,cuda:nccl`` and the fence is a
one-element all-reduce on the device, ordered on the stream after the writes.
:func:`plan_devices` chooses, and refuses before any rank starts every
combination that cannot work, with the reason.

**No IPC for a group of one**: its segment is a plain allocation.

**Allocator settings**: ``expandable_segments`` makes the caching allocator
map memory with VMM, whose blocks PyTorch shares another way (file
descriptors of the physical allocation, not ``cudaIpcGetMemHandle``, which a
sandbox may not pass between processes); the KV segments need
plain ``cudaMalloc`` blocks, so a run with ``expandable_segments:True`` in
``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) is refused, naming it.

**The host tier: pinned in place** (:func:`pin_host`): the group's POSIX
shared-memory segments are page-locked with ``cudaHostRegister`` (flag
``cudaHostRegisterPortable``: pinned for every CUDA context of the process)
and unregistered before their mapping goes (:meth:`RankContext.at_close`).
Copies between a GPU and the host go through one non-blocking copy into
pinned memory (:mod:`cpkv.consumers.placement`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..consumers.kv_view import KVView

DEVICES = ("cpu", "cuda")
#: ``cudaHostRegisterPortable``: the registration counts for every CUDA context, not just the current one.
CUDA_HOST_REGISTER_PORTABLE = 1
#: The environment variables that carry PyTorch's CUDA allocator settings (the second is the newer name).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class DevicePlan:
    """How a group of ``world_size`` ranks runs on ``device``.

    ``gpus``: the GPUs it uses (0 on the CPU); ``backend``: the
    ``torch.distributed`` backend (``gloo``; ``cpu:gloo,cuda:nccl`` with one
    GPU per rank); ``shared_gpu``: several ranks on one GPU (gloo, the stream
    fence). Rank r runs on ``cuda:(r % gpus)``."""

    device: str
    world_size: int
    gpus: int
    backend: str
    shared_gpu: bool

    def rank_device(self, local_rank: int) -> torch.device:
        """Rank ``local_rank``'s device: ``cuda:(local_rank % gpus)``, made current; the CPU on the CPU."""
        if self.device != "cuda":
            return torch.device("cpu")
        dev = torch.device("cuda", local_rank % self.gpus)
        torch.cuda.set_device(dev)
        return dev

    def describe(self) -> str:
        """One line: ranks, GPUs, backend."""
        if self.device != "cuda":
            return f"{self.world_size} rank(s) on the CPU, {self.backend}"
        how = f"{self.world_size // self.gpus}+ ranks per GPU, gloo, stream fence" if self.shared_gpu \
            else "one GPU per rank, NCCL fence"
        return f"{self.world_size} rank(s) on {self.gpus} GPU(s): {how}"


def expandable_segments(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``NAME=value`` that turns the caching allocator's
    ``expandable_segments`` on in ``environ`` (default ``os.environ``), or ``None``."""
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARS:
        for part in env.get(name, "").split(","):
            key, _, value = part.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                return f"{name}={env[name]}"
    return None


def plan_devices(device: str, world_size: int, *, cuda: bool | None = None, device_count: int | None = None,
                 environ: Mapping[str, str] | None = None,
                 peer_access: Callable[[int, int], bool] | None = None) -> DevicePlan:
    """The :class:`DevicePlan` of ``world_size`` ranks on ``device``, or a
    refusal before any rank starts: ``ValueError`` for an unknown device or
    group size; ``RuntimeError`` naming the reason for ``cuda`` without a
    CUDA device, with ``expandable_segments`` on (the KV segments are shared
    over CUDA IPC, which needs plain ``cudaMalloc`` blocks), or across GPUs
    one of which cannot read another's memory (no peer access: a rank could
    not read its peers' KV). ``cuda``, ``device_count``, ``environ`` and
    ``peer_access`` default to what torch and this process see (tests pass
    their own)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if device == "cpu":
        return DevicePlan("cpu", world_size, 0, "gloo", False)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        raise RuntimeError(f"--device cuda needs a CUDA GPU, and torch sees none here (torch {torch.__version__}, "
                           f"CUDA build {torch.version.cuda or 'none'})")
    on = expandable_segments(environ)
    if on is not None:
        raise RuntimeError(f"--device cuda shares each rank's KV segment over CUDA IPC, which needs the caching "
                           f"allocator's expandable_segments off; {on} turns it on: unset it or give "
                           f"expandable_segments:False")
    count = torch.cuda.device_count() if device_count is None else device_count
    gpus = min(count, world_size)
    peer = peer_access or torch.cuda.can_device_access_peer
    for i in range(gpus):
        for j in range(gpus):
            if i != j and not peer(i, j):
                raise RuntimeError(f"GPU {i} cannot access GPU {j}'s memory (no peer access): a rank could not read "
                                   f"its peers' KV segments; run the group on one GPU (CUDA_VISIBLE_DEVICES=0) or "
                                   f"on GPUs with peer access")
    shared = world_size > count
    return DevicePlan("cuda", world_size, gpus, "gloo" if shared else "cpu:gloo,cuda:nccl", shared)


# -- the KV segments and the group's view -------------------------------------------------------------
def export_segment(t: torch.Tensor) -> tuple:
    """What another process needs to open CUDA tensor ``t``: PyTorch's CUDA IPC
    reduction of it (a ``cudaIpcMemHandle`` of its block, offsets, the
    producer's event and reference counter), picklable."""
    from torch.multiprocessing.reductions import reduce_tensor

    return tuple(reduce_tensor(t)[1])


#: Position of the storage's device index in :func:`export_segment`'s tuple (``rebuild_cuda_tensor``'s order).
_DEVICE_ARG = 6


def open_segment(handle: tuple, device: torch.device) -> torch.Tensor:
    """A peer's segment from its :func:`export_segment` ``handle``, opened under
    THIS rank's ``device`` (``cudaIpcOpenMemHandle`` with lazy peer access
    when the segment lives on another GPU), so the reader's kernels address
    it. Never call it on a handle this process exported: CUDA opens a handle
    only in another process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle)
    device = torch.device(device)
    args[_DEVICE_ARG] = torch.cuda.current_device() if device.index is None else device.index
    return rebuild_cuda_tensor(*args)


def allocate_segment(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's own zeroed segment, a tensor of its own (not a view into a
    larger one, so a peer opening it sees this storage alone); refuses
    ``expandable_segments`` (see the module docstring)."""
    if torch.device(device).type == "cuda":
        on = expandable_segments()
        if on is not None:
            raise RuntimeError(f"KV segments need expandable_segments off for CUDA IPC; {on} turns it on")
    return torch.zeros(shape, dtype=dtype, device=device)


def group_segments(comm, tag: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> KVView:
    """The group's buffer of one family, ``shape = [L, N * slots_per_rank, *row]``
    rank-major, as :class:`~cpkv.consumers.kv_view.KVView` of one segment per
    rank: this rank allocates its own ``[L, slots_per_rank, *row]`` on
    ``device`` and opens every peer's from the handle it exports (one
    all-gather of the handles on ``comm``, a :class:`~cpkv.runtime.comm.Comm`).
    A group of one exports nothing (its view is its own buffer). ``tag`` names
    the buffer in errors.
    Collective."""
    N = comm.size
    if len(shape) < 3 or shape[1] % N:
        raise ValueError(f"{tag}: shape {shape} is not [layers, {N} * slots_per_rank, *row]")
    own = allocate_segment((shape[0], shape[1] // N, *shape[2:]), dtype, device)
    if N == 1:  # its own buffer is the whole view: no table
        return KVView.of_buffer(own, 1)
    handles = comm.all_gather_object(export_segment(own))
    return KVView.of_segments([own if r == comm.rank else open_segment(h, device) for r, h in enumerate(handles)])


def host_segments(ctx, tag: str, shape: tuple, dtype: torch.dtype) -> KVView:
    """The CPU's counterpart of :func:`group_segments`, for checks without a
    GPU: the view of one POSIX shared-memory segment per rank of ``ctx``'s
    world (a :class:`~cpkv.runtime.group.RankContext`), each created by its
    owner and mapped by the others (``ctx.shared(..., creator=r)``), so the
    group's view is N separate mappings read through the base table, as on
    GPUs. ``shape`` is rank-major, as :func:`group_segments` takes it.
    Collective."""
    N = ctx.world_size
    if len(shape) < 3 or shape[1] % N:
        raise ValueError(f"{tag}: shape {shape} is not [layers, {N} * slots_per_rank, *row]")
    seg = (shape[0], shape[1] // N, *shape[2:])
    return KVView.of_segments([ctx.shared(f"{tag}_r{r}", seg, dtype, creator=r) for r in range(N)])


# -- the host tier ------------------------------------------------------------------------------------------
def _cudart():
    return torch.cuda.cudart()


def pin_host(t: torch.Tensor, at_close: Callable[[Callable[[], None]], None]) -> torch.Tensor:
    """Page-lock the host tensor ``t`` in place (``cudaHostRegister`` with
    ``cudaHostRegisterPortable``) and hand ``at_close`` the release
    (``cudaHostUnregister``), to run before ``t``'s mapping goes (a
    :meth:`~cpkv.runtime.group.RankContext.at_close`). Returns ``t``; a no-op
    without CUDA or for an empty tensor. Where CUDA refuses (a sandbox that
    cannot lock shared mappings), a ``RuntimeWarning`` names the error and
    ``t`` stays pageable: the host tier's copies go through pinned staging
    memory either way (:mod:`cpkv.consumers.placement`), so only the lock is
    lost."""
    if t.numel() == 0 or not torch.cuda.is_available():
        return t
    rt, ptr, size = _cudart(), t.data_ptr(), t.numel() * t.element_size()
    err = rt.cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        warnings.warn(f"cudaHostRegister of {size} bytes (portable) failed: error {int(err)}; the host tier stays "
                      "pageable", RuntimeWarning, stacklevel=2)
        return t

    def release() -> None:
        rt.cudaHostUnregister(ptr)

    at_close(release)
    return t
