"""The shared KV pool of one rank: direct write, fence, read.

A model keeps one or more per-slot caches over the same logical slots and the
same owner lanes: K and V for GQA; the MLA latent and the indexer keys for DSA
models. Each is a :class:`Family`. The buffer of a family is rank-major: rank
k's segment holds the ``pages_per_rank`` pages that rank k owns, for every
layer that keeps the family. Each rank writes only into its own segment
([[RFC-0001:C-DIRECT-WRITE]]) and reads the whole buffer through the rank-major
view after a fence that separates a layer's writes from its reads
([[RFC-0001:C-READ-PATH]]). Slot arithmetic is :class:`SharedKVLayout`'s.

A family with a :class:`~cpkv.consumers.kv_format.KVFormat` (FP8, or a plain
dtype as raw bytes) stores ``uint8`` rows of ``format.bytes_per_slot``: the
data plane's store encodes and its reads decode (:mod:`cpkv.kernels`), and
every copy (:meth:`~SharedKVPool.copy_slots`, the ``*_all_layers`` calls a
host tier and a transfer move data through) moves the stored rows as they are
([[RFC-0001:C-KV-FORMAT]]).

One write path per job: a forward's new entries (:meth:`SharedKVPool.write_index`
once per batch, ownership checked, then the data plane's store into
:meth:`~SharedKVPool.segment` every layer); a mid-page copy
(:meth:`~SharedKVPool.copy_slots`); a host-tier load or a transfer's receipt
(:meth:`~SharedKVPool.write_all_layers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..contract.errors import ContractViolation
from ..contract.layout import SharedKVLayout
from . import placement
from .kv_format import KVFormat
from .kv_view import KVView, SegmentTable


@dataclass(frozen=True)
class Family:
    """One per-slot cache of a model.

    Every layer in ``layers`` keeps ``shape`` values per slot; a layer not in
    ``layers`` keeps none (GLM-5's layers that reuse another layer's indexer
    top-k keep no indexer keys). Without a ``format`` the values are stored in
    ``dtype`` (default float32). With one, ``format.shape`` must be ``shape``
    and each slot is stored as ``format.bytes_per_slot`` raw bytes: ``dtype``
    is then ``torch.uint8`` (left out, or given as such; any other raises
    ``ValueError``). [[RFC-0001:C-KV-FORMAT]]
    """

    name: str
    shape: tuple[int, ...]
    layers: tuple[int, ...]
    dtype: torch.dtype | None = None
    format: KVFormat | None = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"family name {self.name!r} must be an identifier")
        if not self.shape or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"family {self.name}: shape {self.shape} must be positive ints")
        if len(set(self.layers)) != len(self.layers) or any(x < 0 for x in self.layers):
            raise ValueError(f"family {self.name}: layers {self.layers} must be distinct and >= 0")
        if self.format is None:
            object.__setattr__(self, "dtype", torch.float32 if self.dtype is None else self.dtype)
            return
        if not isinstance(self.format, KVFormat) or tuple(self.format.shape) != tuple(self.shape):
            raise ValueError(f"family {self.name}: format {self.format} must be a KVFormat of shape {self.shape}")
        if self.dtype not in (None, torch.uint8):
            raise ValueError(f"family {self.name}: a formatted family stores uint8 rows, not {self.dtype}")
        object.__setattr__(self, "dtype", torch.uint8)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """What one slot of one layer is stored as: ``(format.bytes_per_slot,)``
        with a format, else ``shape``."""
        return self.shape if self.format is None else (self.format.bytes_per_slot,)

    def buffer_shape(self, layout: SharedKVLayout) -> tuple[int, ...]:
        """``[len(layers), cp_size * slots_per_rank, *row_shape]``: the group's buffer, rank-major."""
        return (len(self.layers), layout.cp_size * layout.slots_per_rank, *self.row_shape)

    def slot_bytes(self) -> int:
        """Bytes of one slot over all its layers."""
        return len(self.layers) * math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()


def kv_families(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | None = None,
                format: KVFormat | None = None) -> tuple[Family, ...]:
    """The K and V families of a GQA model: ``[kv_heads, head_dim]`` per slot on
    every layer, in ``dtype`` (default float32) or, both, in ``format`` (e.g.
    :func:`~cpkv.consumers.kv_format.gqa_fp8`)."""
    layers = tuple(range(num_layers))
    return (Family("k", (kv_heads, head_dim), layers, dtype, format),
            Family("v", (kv_heads, head_dim), layers, dtype, format))


def allocate_buffers(layout: SharedKVLayout, families: Sequence[Family],
                     make: Callable[[str, tuple, torch.dtype], torch.Tensor | KVView] | None = None
                     ) -> dict[str, torch.Tensor | KVView]:
    """One zeroed buffer per family; ``make(tag, shape, dtype)`` allocates it
    (default ``torch.zeros``; a CP group passes a shared-memory allocator,
    which returns the rank-major buffer, or a GPU group one that returns a
    :class:`~cpkv.consumers.kv_view.KVView` of per-rank segments)."""
    make = make or (lambda tag, shape, dtype: torch.zeros(shape, dtype=dtype))
    return {f.name: make(f"kv_{f.name}", f.buffer_shape(layout), f.dtype) for f in families}


class SharedKVPool:
    """One rank's handle on the group's shared KV buffers, one per :class:`Family`.

    ``buffers[name]`` is the group's buffer of that family, the same memory in
    every rank: a rank-major tensor of shape ``family.buffer_shape(layout)``
    and dtype ``family.dtype`` (``uint8`` rows for a formatted family), or a
    :class:`~cpkv.consumers.kv_view.KVView` of the same shape over one segment
    per rank (the GPU: each rank's segment in its own device memory).
    ``views[name]`` is the :class:`KVView` either way. ``fence`` is called
    between a layer's writes and its reads (a barrier on the CP group; a
    no-op for a single rank). Every index into a buffer goes through
    :func:`cpkv.consumers.placement.place` first.

    The verbs, by job: a forward plans its writes (:meth:`write_index`) and
    its layers store into :meth:`segment` and read :meth:`view`, with a
    :meth:`fence` between; copies move whole slots (:meth:`copy_slots`, a
    :meth:`tier_fence` around them and around tier moves),
    tiers and transfers move every layer at once (:meth:`write_all_layers`,
    :meth:`read_all_layers`, :meth:`read_owned_all_layers`); the pages a rank
    wrote are forgotten with :meth:`release` and counted by :meth:`bytes_held`
    and :meth:`written_pages` (``page_bytes``, ``device``: its questions).
    """

    def __init__(self, layout: SharedKVLayout, rank: int, families: Sequence[Family],
                 buffers: Mapping[str, torch.Tensor | KVView], fence: Callable[[], None] | None = None):
        if not 0 <= rank < layout.cp_size:
            raise ValueError(f"rank {rank} is not in a CP group of {layout.cp_size}")
        names = [f.name for f in families]
        if len(set(names)) != len(names) or set(names) != set(buffers):
            raise ValueError(f"families {names} and buffers {sorted(buffers)} must name the same caches once")
        for f in families:
            b = buffers[f.name]
            if tuple(b.shape) != f.buffer_shape(layout) or b.dtype != f.dtype:
                raise ValueError(f"buffer {f.name} of shape {tuple(b.shape)} {b.dtype} does not match "
                                 f"{f.buffer_shape(layout)} {f.dtype} for {layout}")
            if isinstance(b, KVView) and b.num_ranks != layout.cp_size:
                raise ValueError(f"buffer {f.name} has {b.num_ranks} segments for a group of {layout.cp_size}")
        self.layout, self.rank = layout, rank
        self.families = {f.name: f for f in families}
        self.views = {n: b if isinstance(b, KVView) else KVView.of_buffer(b, layout.cp_size)
                      for n, b in buffers.items()}
        self.buffers = dict(buffers)
        self._row = {f.name: {layer: i for i, layer in enumerate(f.layers)} for f in families}
        self._own = {n: v.segment(rank) for n, v in self.views.items()}  # write views
        self._fence = fence or (lambda: None)
        self._written = torch.zeros(layout.pages_per_rank, dtype=torch.bool)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every family and layer, measured from the buffers."""
        return self.layout.slots_per_page * sum(s.element_size() * s[:, 0].numel() for s in self._own.values())

    def bytes_held(self) -> int:
        """Bytes this rank holds: pages of its segment it has written and not released."""
        return int(self._written.sum()) * self.page_bytes

    def written_pages(self, pages) -> int:
        """How many of the logical ``pages`` (all owned by this rank) this rank
        has written into its segment since they were last released."""
        pages = torch.as_tensor(pages, dtype=torch.int64)
        return int(self._written[placement.place(pages // self.layout.cp_size, self._written)].sum())

    def release(self, slots: torch.Tensor) -> None:
        """Forget the pages of ``slots`` that this rank owns (after the allocator freed them)."""
        mine = slots[self.layout.owned_slot_mask(slots, owner_rank=self.rank)]
        local_page = self.layout.translate_write_slots(mine) // self.layout.slots_per_page
        self._written[placement.place(local_page, self._written)] = False

    def _row_of(self, name: str, layer: int) -> int:
        """Row of model ``layer`` in family ``name``'s buffer; raises if the layer keeps none."""
        try:
            return self._row[name][layer]
        except KeyError:
            if name not in self._row:
                raise KeyError(f"no family {name!r}; the pool has {list(self._row)}") from None
            raise KeyError(f"layer {layer} keeps no {name!r} cache") from None

    # -- direct write -------------------------------------------------------------
    def _owned_local(self, slots: torch.Tensor, what: str = "write") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Local slots and pages of ``slots`` and the mask of non-padding entries
        (``None`` when all are), refusing any slot another rank owns."""
        loc, local_page, owned = self.layout.local_pages_and_mask(slots, self.rank)
        if bool(owned.all()):
            return loc, local_page, None
        valid = slots != self.layout.padding_value
        if not bool((owned | ~valid).all()):
            bad = int(slots[valid & ~owned][0])
            owner = int(self.layout.owner_of_slots(torch.tensor([bad]))[0])
            raise ContractViolation(
                f"rank {self.rank} asked to {what} slot {bad}, which rank {owner} owns; only the owner of a page "
                f"{what}s it in its own segment"
            )
        return loc[valid], local_page[valid], valid

    def write_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan this rank's writes of one batch, once before its first layer:
        for logical ``slots [W]`` (``-1``: an entry this rank does not write),
        returns ``(local [W'], rows [W'])`` (int64, on the pool's device): the
        slot in this rank's own segment of each written entry and the entry's
        index in ``slots``, for :meth:`write_at`. Marks their pages written.
        A slot another rank owns raises :class:`ContractViolation` (naming the
        slot and its owner), one outside the layout ``IndexError``; nothing is
        marked then. Synchronises (the check reads the slots).
        [[RFC-0001:C-DIRECT-WRITE]]"""
        slots = slots.cpu()
        loc, local_page, keep = self._owned_local(slots)
        rows = torch.arange(slots.numel()) if keep is None else torch.nonzero(keep).flatten()
        self._mark_written(local_page)
        return placement.place(loc.to(torch.int64), self.device), placement.place(rows, self.device)

    def segment(self, name: str, layer: int) -> torch.Tensor:
        """This rank's own segment of family ``name`` at model ``layer``:
        ``[slots_per_rank, *row_shape]``, a view (what the store kernel writes)."""
        return self._own[name][self._row_of(name, layer)]

    def view(self, name: str, layer: int) -> torch.Tensor | SegmentTable:
        """The whole group's buffer of family ``name`` at model ``layer``,
        rank-major: ``[cp_size * slots_per_rank, *row_shape]`` (what the
        attention kernels read): a tensor view over one buffer, a
        :class:`~cpkv.consumers.kv_view.SegmentTable` (a table of the ranks'
        segment bases) over per-rank segments. [[RFC-0001:C-READ-PATH]]"""
        return self.views[name].layer(self._row_of(name, layer))

    @property
    def device(self) -> torch.device:
        """The device of this rank's segments (every family's is the same; the CPU for a pool of none)."""
        return next(iter(self.views.values())).device if self.views else torch.device("cpu")

    def _mark_written(self, local_page: torch.Tensor) -> None:
        """Mark this rank's local pages ``local_page`` written (control state on the CPU)."""
        self._written[placement.place(local_page, self._written)] = True

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """Copy every family, every layer, from logical ``src`` to ``dst`` slots
        where this rank owns ``dst``: read the source through the shared view,
        write this rank's segment, the stored rows as they are. Returns the slots this rank copied. The
        caller fences before anyone reads ``dst``. [[RFC-0001:C-DIRECT-WRITE]]"""
        if src.shape != dst.shape:
            raise ValueError(f"copy of {src.numel()} source slots to {dst.numel()} destinations")
        mine = self.layout.owned_slot_mask(dst, owner_rank=self.rank)
        read = self.layout.translate_read_slots(src[mine])
        loc, local_page, _ = self._owned_local(dst[mine])
        for n, v in self.views.items():
            own = self._own[n]
            own.index_copy_(1, placement.place(loc, own), v.read(placement.place(read, own)))
        self._mark_written(local_page)
        return int(mine.sum())

    def write_all_layers(self, slots: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        """Write stored rows ``values[name] [len(layers), T, *row_shape]`` (every
        layer of each family at once, as :meth:`read_all_layers` returns them:
        ``uint8`` rows of a formatted family, written as they are) of logical
        ``slots [T]`` into this rank's own segment, refusing, before any write,
        a slot another rank owns (:class:`ContractViolation`) or rows of
        another shape or, for a formatted family, dtype (``ValueError``). A
        host-tier load and a transfer write through here.
        [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-KV-FORMAT]]"""
        for n, x in values.items():
            f = self.families[n]
            if tuple(x.shape) != (len(f.layers), slots.numel(), *f.row_shape):
                raise ValueError(f"{n}: rows of shape {tuple(x.shape)} for {slots.numel()} slots of "
                                 f"{len(f.layers)} layers x {f.row_shape}")
            if f.format is not None and x.dtype != torch.uint8:
                raise ValueError(f"{n}: stored rows of format {f.format} are uint8, not {x.dtype}")
        loc, local_page, keep = self._owned_local(slots)
        for n, x in values.items():
            own = self._own[n]
            rows = x if keep is None else x[:, placement.place(keep, x)]
            own.index_copy_(1, placement.place(loc, own), placement.to_device(rows, own.device).to(own.dtype))
        self._mark_written(local_page)

    def read_owned_all_layers(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every family, every layer, at logical ``slots [T]`` read from this
        rank's OWN segment only, as stored: ``{name: [len(layers), T', *row_shape]}`` with
        padding skipped (``T'`` the non-padding slots). A slot another rank
        owns raises :class:`ContractViolation` before anything is read. A
        disaggregation source sends through here: only the owner of a page
        sends it. [[RFC-0001:C-DISAGG]]"""
        loc, _, _ = self._owned_local(slots, "read")
        return {n: v.index_select(1, placement.place(loc, v)) for n, v in self._own.items()}

    def read_all_layers(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every family, every layer, at logical ``slots [T]`` (no padding),
        read through the shared view, as stored: ``{name: [len(layers), T,
        *row_shape]}`` (raw ``uint8`` rows of a formatted family).
        [[RFC-0001:C-READ-PATH]]"""
        read = self.layout.translate_read_slots(slots)
        return {n: v.read(placement.place(read, self._own[n])) for n, v in self.views.items()}

    def fence(self) -> None:
        """Separate this layer's writes from its reads on every rank."""
        self._fence()

    def tier_fence(self) -> None:
        """Separate moves between tiers and copies (backups, loads, mid-page
        copies) from what reads them, on every rank: :meth:`fence` here (a
        replicated copy's differs: :class:`~cpkv.consumers.replicated.ReplicatedKVPool`)."""
        self._fence()
