"""The group's buffer of one cache family, as one rank reads it: N segments, one rank-major view.

Rank r's segment holds the ``slots_per_rank`` slots it owns, for every layer
of the family: ``[L, slots_per_rank, *row]``. A reader addresses the group's
slots rank-major: row ``r * slots_per_rank + local`` is local slot ``local``
of rank r ([[RFC-0001:C-READ-PATH]]). Two ways to lay the segments out:

* **one buffer** (the CPU: one POSIX shared-memory tensor ``[L, N *
  slots_per_rank, *row]`` every rank maps; a group of one): the segments are
  slices of it and a layer's view is a plain tensor (:attr:`KVView.whole`);
* **separate allocations** (the GPU: each rank allocates its own segment on
  its own device, the others open it over CUDA IPC; see
  :mod:`cpkv.runtime.device`): a layer's view is a :class:`SegmentTable`, a
  table of N segment bases. Kernels load the owner's base and add the local
  row; the torch reference gathers owner by owner.

Either way the owner writes only its own segment ([[RFC-0001:C-DIRECT-WRITE]]).
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import placement

#: Every segment of a :class:`SegmentTable` starts a multiple of this many bytes from segment 0 (torch's CPU
#: allocator and shared-memory mappings align 64 bytes or more, CUDA's caching allocator 512): 16 elements of up
#: to 4 bytes, so a kernel may take every table entry as a multiple of 16 elements of the type it reads
#: (float32 rows of a byte format included).
OFFSET_ALIGN_BYTES = 64


class SegmentTable:
    """One layer of a family over separately allocated segments: the rank-major
    rows ``[N * slots_per_rank, *row]`` as a table of N segment bases.

    ``segments[r] [slots_per_rank, *row]`` is rank r's segment of this layer
    (rows contiguous, every segment alike); ``base`` is ``segments[0]``;
    ``offsets`` (int64 ``[N]``, on the base's device) the element offset of
    rank r's row 0 from the base's row 0, each starting a multiple of
    :data:`OFFSET_ALIGN_BYTES` from it. Row ``r * slots_per_rank + local`` of
    the view is element ``offsets[r] + local * base.stride(0)`` from the base:
    what a kernel reads. ``table[rows]`` (any int shape) gathers the rows in
    torch, owner by owner (the reference read). Built by :meth:`KVView.layer`;
    ``offsets`` may be given (the same for every layer of one family: layer
    l of each segment lies the same distance into it), else it is measured.
    """

    def __init__(self, segments: Sequence[torch.Tensor], offsets: torch.Tensor | None = None):
        self.segments = tuple(segments)
        self.base = self.segments[0]
        if offsets is None:
            offsets = segment_offsets(self.segments)
        self.offsets = offsets
        self.slots_per_rank = self.base.shape[0]
        self._as: dict[int, torch.Tensor] = {self.base.element_size(): offsets}

    def offsets_in(self, element_size: int) -> torch.Tensor:
        """:attr:`offsets` in elements of ``element_size`` bytes (a kernel that
        reads the segments' bytes as another type, e.g. float32 rows of a byte
        format), computed once."""
        if element_size not in self._as:
            self._as[element_size] = self.offsets * self.base.element_size() // element_size
        return self._as[element_size]

    @property
    def num_ranks(self) -> int:
        """Segments in the view (the CP group's size)."""
        return len(self.segments)

    @property
    def shape(self) -> torch.Size:
        """``[N * slots_per_rank, *row]``, as the rank-major tensor would be."""
        return torch.Size((self.num_ranks * self.slots_per_rank, *self.base.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        """The segments' dtype."""
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        """Where the reader reads (every segment is addressable from it)."""
        return self.base.device

    def dim(self) -> int:
        """Axes of :attr:`shape`."""
        return self.base.dim()

    def stride(self, dim: int | None = None):
        """The segments' strides (rows of every segment are alike)."""
        return self.base.stride() if dim is None else self.base.stride(dim)

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[*rows.shape, *row]`` at rank-major ``rows`` (int, any shape, inside the view)."""
        return gather_rows(self.segments, rows)


def segment_offsets(segments: Sequence[torch.Tensor]) -> torch.Tensor:
    """The element offsets ``[N]`` (int64, on ``segments[0]``'s device) of each
    segment's first element from ``segments[0]``'s. ``ValueError`` when one is
    not a multiple of :data:`OFFSET_ALIGN_BYTES` bytes (the kernels' table
    needs it). One host-to-device copy: make it once per family."""
    base = segments[0]
    gaps = [s.data_ptr() - base.data_ptr() for s in segments]
    if any(g % OFFSET_ALIGN_BYTES for g in gaps):
        raise ValueError(f"segments start {gaps} bytes from segment 0: not multiples of {OFFSET_ALIGN_BYTES} bytes, "
                         "which the kernels' base table needs")
    esize = base.element_size()
    return torch.tensor([g // esize for g in gaps], dtype=torch.int64).to(base.device)


def gather_rows(segments: Sequence[torch.Tensor], rows: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Rank-major ``rows`` of segments ``[..., slots_per_rank, ...]`` (the slot
    axis ``axis``), gathered owner by owner: one sort of the rows by owner,
    one read of the counts (a sync), one ``index_select`` per segment. Output
    on ``segments[0]``'s device, slot axis ``axis`` of length ``rows.numel()``
    (reshaped to ``rows.shape`` when ``axis`` is 0)."""
    seg0 = segments[0]
    spr = seg0.shape[axis]
    flat = placement.place(rows.reshape(-1).to(torch.int64), seg0)
    owner = torch.div(flat, spr, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=len(segments)).tolist()
    local = (flat - owner * spr)[order]
    out_shape = list(seg0.shape)
    out_shape[axis] = flat.numel()
    out = seg0.new_empty(out_shape)
    parts = []
    at = 0
    for r, n in enumerate(counts):
        if n:
            parts.append(segments[r].index_select(axis, placement.place(local[at: at + n], segments[r])))
        at += n
    if parts:
        out.index_copy_(axis, order, torch.cat(parts, axis))
    return out.reshape(*rows.shape, *seg0.shape[1:]) if axis == 0 else out


class KVView:
    """The group's buffer of one family: every rank's segment ``[L, slots_per_rank, *row]``.

    Build it with :meth:`of_buffer` (one rank-major buffer ``[L, N *
    slots_per_rank, *row]``, :attr:`whole` then set) or :meth:`of_segments`
    (separate allocations, one per rank, :attr:`whole` ``None``). Segments
    must agree in shape, strides, dtype and device and keep their rows
    contiguous; ``ValueError`` otherwise.
    """

    def __init__(self, segments: Sequence[torch.Tensor], whole: torch.Tensor | None = None):
        segments = tuple(segments)
        if not segments:
            raise ValueError("a view needs at least one segment")
        s0 = segments[0]
        for r, s in enumerate(segments):
            if not isinstance(s, torch.Tensor) or s.dim() < 3:
                raise ValueError(f"segment {r} must be a tensor [layers, slots_per_rank, *row]")
            if s.shape != s0.shape or s.dtype != s0.dtype or s.device != s0.device:
                raise ValueError(f"segment {r} is {tuple(s.shape)} {s.dtype} on {s.device}; segment 0 is "
                                 f"{tuple(s0.shape)} {s0.dtype} on {s0.device}")
            if s.stride(-1) != 1 or not s[0, 0].is_contiguous():
                raise ValueError(f"segment {r}'s rows must be contiguous, got strides {s.stride()}")
            if s.stride() != s0.stride():  # so layer l lies equally far into every segment: one offset table
                raise ValueError(f"segment {r} has strides {s.stride()}; segment 0 has {s0.stride()}")
        self.segments, self.whole = segments, whole
        self._layers: dict[int, SegmentTable] = {}
        self._offsets: torch.Tensor | None = None

    @classmethod
    def of_buffer(cls, buffer: torch.Tensor, cp_size: int) -> "KVView":
        """The view of one rank-major buffer ``[L, cp_size * slots_per_rank, *row]``."""
        if buffer.dim() < 3 or buffer.shape[1] % cp_size:
            raise ValueError(f"buffer {tuple(buffer.shape)} is not [layers, {cp_size} * slots_per_rank, *row]")
        spr = buffer.shape[1] // cp_size
        return cls([buffer[:, r * spr: (r + 1) * spr] for r in range(cp_size)], whole=buffer)

    @classmethod
    def of_segments(cls, segments: Sequence[torch.Tensor]) -> "KVView":
        """The view of separately allocated segments, rank order."""
        return cls(segments)

    @property
    def num_ranks(self) -> int:
        """Segments (the CP group's size)."""
        return len(self.segments)

    @property
    def shape(self) -> tuple[int, ...]:
        """``[L, N * slots_per_rank, *row]``: the rank-major buffer's shape."""
        s = self.segments[0].shape
        return (s[0], self.num_ranks * s[1], *s[2:])

    @property
    def dtype(self) -> torch.dtype:
        """The segments' dtype."""
        return self.segments[0].dtype

    @property
    def device(self) -> torch.device:
        """The reader's device."""
        return self.segments[0].device

    def segment(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s segment ``[L, slots_per_rank, *row]``: what that rank writes."""
        return self.segments[rank]

    def layer(self, layer: int) -> torch.Tensor | SegmentTable:
        """Row ``layer`` of the view, ``[N * slots_per_rank, *row]``: a tensor over
        one buffer, else a :class:`SegmentTable` (made once, then kept; every
        layer shares one offset table, measured on the first)."""
        if self.whole is not None:
            return self.whole[layer]
        if layer not in self._layers:
            segs = [s[layer] for s in self.segments]
            if self._offsets is None:
                self._offsets = segment_offsets(segs)
            self._layers[layer] = SegmentTable(segs, self._offsets)
        return self._layers[layer]

    def read(self, rows: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Rank-major ``rows [M]`` (int, inside the view): at one ``layer``,
        ``[M, *row]``; every layer (``None``), ``[L, M, *row]``. One
        ``index_select`` over one buffer; owner by owner over separate
        segments. [[RFC-0001:C-READ-PATH]]"""
        if self.whole is not None:
            src = self.whole if layer is None else self.whole[layer]
            return src.index_select(0 if layer is not None else 1, placement.place(rows, src))
        if layer is not None:
            return gather_rows([s[layer] for s in self.segments], rows)
        return gather_rows(self.segments, rows.reshape(-1), axis=1)
