"""Count host synchronisations: the calls that make the host wait for the device.

On a GPU, a tensor read into a Python value (``item``, ``tolist``, ``bool``,
``int``, ``float``, ``cpu``, ``numpy``), an op whose output size depends on the
data (``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing,
``bincount``, ``repeat_interleave`` without ``output_size``) or one that returns
a Python answer about values (``equal``) waits for every queued kernel. On the
CPU nothing waits, but the same calls are made, so counting them here tells
how the code will behave on a device.

Host-to-device copies are counted too (``h2d``): a tensor made from Python
data (``torch.tensor``, ``torch.as_tensor`` of a list or a number) is a copy
from pageable host memory whenever its device is a GPU, so it is counted
whatever the device (on the CPU it is the same call); a CPU tensor moved to a
device (``to``, ``cuda``, ``copy_`` into a device tensor) is counted where a
device exists. A pageable copy waits for the host and cannot be captured in a
CUDA graph. A device tensor read back (``to("cpu")``) counts as ``cpu``.
:class:`SyncCounter` is a
``torch.overrides.TorchFunctionMode`` that counts them while it is active
(tests, ``cpkv bench plan``); nothing of cpkv's own runs under it otherwise.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
#: Methods and functions that read device values on the host, by name.
SYNC_CALLS = {
    _T.item: "item", _T.tolist: "tolist", _T.__bool__: "bool", _T.__int__: "int", _T.__float__: "float",
    _T.__index__: "index", _T.cpu: "cpu", _T.numpy: "numpy", _T.nonzero: "nonzero", torch.nonzero: "nonzero",
    torch.unique: "unique", _T.unique: "unique", torch.equal: "equal", _T.equal: "equal",
    torch.masked_select: "masked_select", _T.masked_select: "masked_select", torch.bincount: "bincount",
    _T.bincount: "bincount", torch.argwhere: "nonzero", torch.where: "where",
}


def _device_of(x) -> torch.device | None:
    """The device a ``to``/``cuda`` call's arguments name, or ``None``."""
    if isinstance(x, torch.Tensor):
        return x.device
    if isinstance(x, (str, torch.device)):
        return torch.device(x)
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.device("cuda", x)
    return None


def _copy_kind(func, args, kwargs) -> str | None:
    """``h2d``/``cpu`` for a call that copies between the host and a device, else ``None``."""
    if func in (torch.tensor, torch.as_tensor):
        data = args[0] if args else kwargs.get("data")
        return None if isinstance(data, torch.Tensor) else "h2d"
    if func in (_T.to, _T.cuda, _T.copy_) and args and isinstance(args[0], torch.Tensor):
        src = args[0]
        if func is _T.copy_:
            src, dst = (args[1] if len(args) > 1 else kwargs.get("src")), args[0].device
        elif func is _T.cuda:
            dst = torch.device("cuda")
        else:
            dst = next((d for d in map(_device_of, [*args[1:], kwargs.get("device")]) if d is not None), None)
        if not isinstance(src, torch.Tensor) or dst is None:
            return None
        if src.device.type == "cpu" and dst.type != "cpu":
            return "h2d"
        if src.device.type != "cpu" and dst.type == "cpu" and func is _T.to:
            return "cpu"
    return None


def _bool_index(index) -> bool:
    """Whether ``index`` (of ``__getitem__``/``__setitem__``) holds a boolean tensor."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class SyncCounter(TorchFunctionMode):
    """While active (``with SyncCounter() as c:``), count every call in
    :data:`SYNC_CALLS` (``torch.where`` only in its one-argument form, which is
    ``nonzero``; ``repeat_interleave`` only without ``output_size``), every
    indexing with a boolean tensor and every host-to-device copy (``h2d``,
    see the module docstring). ``total`` is the count, ``by_name`` a
    :class:`collections.Counter` by call. Nested calls a counted op makes
    itself are not counted again. Counting only: every call runs unchanged."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter = Counter()
        self._depth = 0

    @property
    def total(self) -> int:
        """Host synchronisations counted so far."""
        return sum(self.by_name.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = SYNC_CALLS.get(func)
        if name == "where" and (len(args) + len(kwargs)) != 1:
            name = None
        if func in (_T.__getitem__, _T.__setitem__) and len(args) > 1 and _bool_index(args[1]):
            name = "bool-index"
        if func in (torch.repeat_interleave, _T.repeat_interleave) and kwargs.get("output_size") is None \
                and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
            name = "repeat_interleave"
        if name is None:
            name = _copy_kind(func, args, kwargs)
        if name is not None and self._depth == 0:
            self.by_name[name] += 1
        self._depth += name is not None
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= name is not None
