"""What every Triton kernel of :mod:`cpkv.kernels` shares: the layout's slot
arithmetic in Triton, block sizes, and the interpreter's limits.

Imported only when the ``triton`` backend is asked for, after
:mod:`cpkv.kernels` has set ``TRITON_INTERPRET=1`` on a machine without CUDA
(the interpreter runs kernels on CPU tensors, one program after another).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def owner_and_local(s, N, S):
    """Owner rank ``p % N`` and local slot ``(p // N) * S + s % S`` of logical
    slots ``s >= 0`` (``p = s // S``): :class:`~cpkv.contract.layout.SharedKVLayout`'s
    formulas, in Triton. The rank-major row is ``owner * slots_per_rank + local``.
    [[RFC-0001:C-LAYOUT-OWNER]]"""
    p = s // S
    return p % N, (p // N) * S + (s - p * S)


@triton.jit
def view_offset(off_ptr, owner, local, SPR, stride, HAS_OFF: tl.constexpr):
    """Element offset of rank-major row ``owner * SPR + local`` from the view's
    base: with a base table (``HAS_OFF``: the group's segments are separate
    allocations, :class:`~cpkv.consumers.kv_view.LayerView`) the owner's
    segment base ``off_ptr[owner]`` (a multiple of 16 elements) plus the local
    row, else the row of one rank-major buffer. ``stride``: elements per row.
    [[RFC-0001:C-READ-PATH]]"""
    if HAS_OFF:
        return tl.multiple_of(tl.load(off_ptr + owner), 16) + local * stride
    return (owner * SPR + local) * stride


def view_args(view):
    """``(tensor, offsets, has_offsets)`` to launch a kernel on the group's view
    of one layer: a rank-major tensor as it is (its own storage stands in for
    the unused table), a :class:`~cpkv.consumers.kv_view.LayerView` as its
    base segment and its table of segment offsets."""
    if isinstance(view, torch.Tensor):
        return view, view, False
    return view.base, view.offsets, True


@triton.jit
def usable(s, PAD, CAP):
    """Entries of ``s`` that name a slot: not padding and inside ``[0, CAP)``."""
    return (s != PAD) & (s >= 0) & (s < CAP)


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def block(n: int, least: int = 16) -> int:
    """Power-of-two block covering ``n``, at least ``least`` (``tl.dot`` needs 16)."""
    return max(least, triton.next_power_of_2(max(int(n), 1)))


def launchable(*tensors: torch.Tensor) -> None:
    """Refuse what the active Triton cannot run: CPU tensors without the
    interpreter, and bfloat16 in the interpreter (it has no bfloat16
    arithmetic; bfloat16 is GPU-only)."""
    if interpreting():
        if any(t.dtype == torch.bfloat16 for t in tensors):
            raise TypeError("bfloat16 is GPU-only for the triton backend: the Triton interpreter "
                            "(TRITON_INTERPRET=1) has no bfloat16 arithmetic; use float32/float16 or backend='torch'")
    elif any(t.device.type != "cuda" for t in tensors):
        raise RuntimeError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           "imported to run on CPU tensors")


def dot_precision(*tensors: torch.Tensor) -> str:
    """``"ieee"`` when any input is float32 (exact fp32 products, no TF32), else ``"tf32"`` (ignored for 16-bit)."""
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


__all__ = ["owner_and_local", "view_offset", "view_args", "usable", "interpreting", "block", "launchable",
           "dot_precision", "tl"]
