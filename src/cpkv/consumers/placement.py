"""Where an index meets a buffer: the one placement rule of every copy between caches.

A CPU index into a CUDA buffer (or the reverse) raises in ``index_select`` /
``index_copy_``, and a copy between a device and pageable host memory
synchronises. Every pool, host-tier, transfer and check path that indexes a
KV or host buffer therefore puts its index where the buffer is through
:func:`place`, and moves rows between a device and the host through
:func:`to_host` / :func:`to_device` (one non-blocking copy through pinned
memory). A test patches :func:`place` and sees every such path call it.
"""

from __future__ import annotations

import torch


def place(index: torch.Tensor, where: torch.Tensor | torch.device | str) -> torch.Tensor:
    """``index`` on the device of ``where`` (a tensor, whose device counts, or
    a device): itself when it is there already, else a copy. Every index into
    a KV, host or control buffer passes here first."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return index if index.device == device else index.to(device)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU: a CUDA tensor through ONE non-blocking copy into
    pinned memory (DMA), then a wait on that copy's stream so the host may
    read it; a CPU tensor as it is."""
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return out


def pinned_like(shape: tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An empty host tensor to gather rows into before they go to ``device``:
    pinned when ``device`` is a GPU (so :func:`to_device` is one DMA copy),
    plain on the CPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host rows ``x`` on ``device``: ONE non-blocking copy (DMA from pinned
    memory, e.g. :func:`pinned_like`; torch's pinned allocator keeps the
    memory until the copy has run). ``x`` itself when it is there already."""
    device = torch.device(device)
    return x if x.device == device else x.to(device, non_blocking=x.is_pinned())
