"""The CP group on a GPU (``--device cuda``): buffers, host tier, collectives, fence.

UNTESTED ON HARDWARE: written and unit-tested on a machine without CUDA (the
parts that need a GPU are marked ``gpu`` in the tests and skip there);
``make gpu-check`` runs them on a machine with one.

* **The group's KV buffers: CUDA IPC** (:func:`share_device_buffer`). The
  creator rank allocates each family's whole rank-major buffer with the
  caching allocator; every other rank opens the same allocation through
  PyTorch's CUDA IPC tensor sharing (``torch.multiprocessing.reductions.
  reduce_tensor``: a ``cudaIpcMemHandle`` plus offset, rebuilt with
  ``rebuild_cuda_tensor``). Every rank then holds one tensor over one address
  range, so the rank-major view is a plain tensor and the Triton kernels index
  it unchanged (logical slot -> rank-major row in the kernel). Why not
  PyTorch's symmetric memory (``torch.distributed._symmetric_memory``): it
  gives each rank its own buffer plus mappings of its peers' — N address
  ranges, so every read kernel would need a table of N base pointers — and it
  is a private API. The price of IPC of one allocation: the cache lives in the
  creator GPU's memory (peers reach it over NVLink/P2P; on a one-GPU machine
  every rank shares it). Per-GPU segments mapped into one range need CUDA VMM
  (``cuMemCreate`` on each GPU, ``cuMemMap`` into one reserved range:
  SGLang's route), which PyTorch does not expose; that is the next step.
* **The host tier: pinned** (:func:`pin_shared`): the POSIX shared-memory
  segments the ranks already map are page-locked in place with
  ``cudaHostRegister``, so device <-> host copies are DMA, and still one
  memory for every rank.
* **Collectives: NCCL** (:func:`process_group_backend`), one GPU per rank
  (``cuda:local_rank``); NCCL refuses two ranks on one GPU, so a group larger
  than the GPU count is refused before it starts (:func:`check_devices`).
* **The fence on the device** (:class:`~cpkv.runtime.comm.DistComm` with a
  CUDA ``device``): a one-element all-reduce on the NCCL group after the
  owners' writes, as SGLang does: it is ordered on each rank's stream after
  its writes and before its reads, with no host wait.
"""

from __future__ import annotations

import pickle

import torch

DEVICES = ("cpu", "cuda")


def process_group_backend(device: str) -> str:
    """``"nccl"`` for ``cuda``, ``"gloo"`` for ``cpu``; ``ValueError`` otherwise."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return "nccl" if device == "cuda" else "gloo"


def check_devices(device: str, world_size: int) -> None:
    """Refuse, before any process starts, a group that cannot run on ``device``:
    ``cuda`` without a CUDA device, or with fewer GPUs than ranks (NCCL needs
    one GPU per rank). Raises ``RuntimeError`` saying which."""
    process_group_backend(device)
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda needs a CUDA GPU, and torch sees none here (torch {torch.__version__}, "
                           f"CUDA build {torch.version.cuda or 'none'})")
    n = torch.cuda.device_count()
    if world_size > n:
        raise RuntimeError(f"--device cuda runs one rank per GPU (NCCL); {world_size} ranks, {n} GPU(s) here")


def rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:local_rank`` (made current) or the CPU."""
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def share_device_buffer(ctx, tag: str, shape: tuple, dtype: torch.dtype, device: torch.device, *,
                        creator: int = 0) -> torch.Tensor:
    """A zeroed CUDA tensor that every rank of ``ctx``'s group maps (CUDA IPC,
    see the module docstring): rank ``creator`` allocates it on ``device``,
    the others open its IPC handle. Collective (one all-gather of the
    handle). ``tag`` names it in errors only. Raises ``RuntimeError`` on a
    non-CUDA device."""
    if device.type != "cuda":
        raise RuntimeError(f"share_device_buffer({tag!r}) needs a CUDA device, got {device}")
    from torch.multiprocessing.reductions import reduce_tensor

    made = torch.zeros(shape, dtype=dtype, device=device) if ctx.rank == creator else None
    handle = pickle.dumps(reduce_tensor(made)) if made is not None else None
    handles = ctx.all_gather_object(handle)
    if made is not None:
        return made
    rebuild, args = pickle.loads(handles[creator])
    return rebuild(*args)


def pin_shared(t: torch.Tensor) -> torch.Tensor:
    """Page-lock the host tensor ``t`` in place (``cudaHostRegister``), so
    copies between it and a GPU are DMA; returns ``t``. A no-op without CUDA.
    Raises ``RuntimeError`` if CUDA refuses."""
    if not torch.cuda.is_available() or t.numel() == 0 or t.is_pinned():
        return t
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed: {err}")
    return t
