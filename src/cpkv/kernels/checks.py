"""Argument checks shared by both backends of :mod:`cpkv.kernels`.

Every public kernel call runs these before it dispatches, so a wrong call
raises the same clear error whatever the backend, and before anything is
written. Shape and dtype checks read only metadata (no device sync); the slot
range check (:func:`check_slots`) reads the slots once, so a caller that
validated a batch's table at plan time may skip it per layer (``check=False``).
"""

from __future__ import annotations

import torch

from ..consumers.kv_view import SegmentTable
from ..contract.layout import SharedKVLayout

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INDEXES = (torch.int32, torch.int64)


def check_layout(layout) -> SharedKVLayout:
    """``layout`` must be a :class:`SharedKVLayout`; returns it."""
    if not isinstance(layout, SharedKVLayout):
        raise TypeError(f"layout must be a SharedKVLayout, got {type(layout).__name__}")
    return layout


def check_float(name: str, x: torch.Tensor, dim: int | None = None) -> None:
    """``x`` is a float32/float16/bfloat16 tensor with ``dim`` axes (any if None)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOATS:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must have {dim} axes, got shape {tuple(x.shape)}")


def check_index(name: str, x: torch.Tensor, dim: int) -> None:
    """``x`` is an int32/int64 tensor with ``dim`` axes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INDEXES:
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} axes, got shape {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    devices = {n: t.device for n, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"tensors must share one device, got {', '.join(f'{n} on {d}' for n, d in devices.items())}")
    return first


def check_dim(name: str, got: int, want: int, what: str) -> None:
    """``got == want`` for one axis, named in the error."""
    if got != want:
        raise ValueError(f"{name}: {what} is {got}, expected {want}")


def check_view(name: str, view: torch.Tensor | SegmentTable, layout: SharedKVLayout) -> None:
    """``view`` is the rank-major view of all segments: ``cp_size * slots_per_rank``
    rows, unit stride on its last axis (kernels read rows in place); a
    :class:`~cpkv.consumers.kv_view.SegmentTable` has one segment per rank."""
    if isinstance(view, SegmentTable):
        check_dim(name, view.num_ranks, layout.cp_size, "segments (cp_size)")
    check_dim(name, view.shape[0], layout.cp_size * layout.slots_per_rank, "rows (cp_size * slots_per_rank)")
    if view.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride on its last axis, got strides {view.stride()}")


def check_slots(name: str, slots: torch.Tensor, layout: SharedKVLayout) -> None:
    """Every entry of ``slots`` is the layout's padding value or inside
    ``[0, capacity)``; else ``IndexError`` naming the argument and the slot.
    Reads the slots once (a device sync on a GPU). [[RFC-0001:C-PADDING]]"""
    try:
        layout.owner_of_slots(slots.reshape(-1))
    except IndexError as e:
        raise IndexError(f"{name}: {e}") from None


def check_rank(name: str, rank: int | None, layout: SharedKVLayout, optional: bool = False) -> int:
    """A rank of the layout's CP group (``None`` allowed when ``optional``);
    returns it, or -1 for ``None``."""
    if rank is None and optional:
        return -1
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < layout.cp_size:
        raise ValueError(f"{name}={rank!r} is not a rank of a CP group of {layout.cp_size}")
    return rank
