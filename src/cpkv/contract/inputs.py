"""Boundary checks for what callers hand the contract: index vectors and devices.

Inputs are refused, never coerced ([[RFC-0001:C-FAIL-FAST]]): a length or
slot vector is a 1-D int32 or int64 torch tensor (any device), a 1-D int32 or
int64 numpy array, or a flat list or tuple of Python (or numpy) ints. A float,
bool, complex or narrower integer dtype raises ``TypeError``; a 0-D or
multi-dimensional one raises ``ValueError``. Nothing is truncated or
flattened. Every other module of the contract (and its consumers) may use these.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

INT_TORCH = (torch.int32, torch.int64)
INT_NUMPY = (np.dtype(np.int32), np.dtype(np.int64))
_INT_ELEMENTS = (int, np.int32, np.int64)


def int_vector(x, name: str) -> np.ndarray:
    """``x`` as a 1-D int64 host array (no copy when ``x`` already is one, or
    is a CPU int64 tensor: do not write to the result).

    Raises ``TypeError`` for anything that is not an int32/int64 tensor or
    array or a flat list/tuple of ints (bools included), ``ValueError`` for a
    wrong rank or an int that does not fit int64. ``name`` goes in the message.
    """
    if isinstance(x, torch.Tensor):
        dtype = x.dtype
        if dtype is not torch.int64 and dtype is not torch.int32:
            raise TypeError(f"{name} must be int32 or int64, got a {x.dtype} tensor")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got a tensor of shape {tuple(x.shape)}")
        a = (x if x.is_cpu else x.cpu()).numpy()  # an int tensor never requires grad
        return a if dtype is torch.int64 else a.astype(np.int64)
    if isinstance(x, np.ndarray):
        if x.dtype not in INT_NUMPY:
            raise TypeError(f"{name} must be int32 or int64, got a {x.dtype} array")
        if x.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got an array of shape {x.shape}")
        return x if x.dtype == np.int64 else x.astype(np.int64)
    if isinstance(x, (list, tuple)):
        if not x:
            return np.zeros(0, dtype=np.int64)
        kinds = set(map(type, x))
        if not kinds <= set(_INT_ELEMENTS):
            odd = next(k for k in kinds if k not in _INT_ELEMENTS)
            raise TypeError(f"{name} must hold ints only, got an element of type {odd.__name__}")
        try:
            return np.array(x, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name} holds an int that does not fit int64") from None
    raise TypeError(
        f"{name} must be a 1-D int32/int64 tensor or array, or a list of ints; got {type(x).__name__}"
    )


def check_int_tensor(x, name: str) -> None:
    """Type and rank of a device-side copy (SGLang passes lengths twice, on the
    device and on the host) without moving it: a torch tensor is checked in
    place, anything else through :func:`int_vector`."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in INT_TORCH:
            raise TypeError(f"{name} must be int32 or int64, got a {x.dtype} tensor")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got a tensor of shape {tuple(x.shape)}")
    else:
        int_vector(x, name)


def int_scalar(x, name: str) -> int:
    """A Python int from an int (not a bool), a numpy integer or a 0-D
    int32/int64 tensor; ``TypeError`` otherwise."""
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype in INT_TORCH:
        return int(x)
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)):
        return int(x)
    raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")


def usable_device(device) -> torch.device:
    """``device`` as a ``torch.device`` this process can put tensors on and read
    back; ``ValueError`` otherwise (``"cuda"`` on a machine without CUDA, a
    CUDA index past the last GPU, ``"meta"``)."""
    try:
        dev = torch.device(device)
        torch.zeros(1, dtype=torch.int64, device=dev).cpu()
    except Exception as e:  # noqa: BLE001 - every way a device can be unusable
        raise ValueError(f"device {device!r} is not usable on this machine: {e}") from None
    return dev
