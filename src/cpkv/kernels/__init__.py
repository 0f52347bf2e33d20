"""The data plane over the shared owner-lane cache: store, paged GQA attention,
DSA's indexer scores and sparse MLA attention, and the log-sum-exp merge, in
two backends that must agree (:mod:`cpkv.kernels.backend` is the interface).

* ``"torch"``: :class:`~cpkv.kernels.reference.TorchBackend`, the vectorised
  definition, on any device torch runs on;
* ``"triton"``: :class:`~cpkv.kernels.triton_backend.TritonBackend`, kernels
  that take the layout's numbers (``cp_size``, page size, ``slots_per_rank``)
  and translate logical slots themselves, as SGLang's shared-KV kernels do:
  local slot ``(p // N) * S + s % S`` for a write, rank-major slot
  ``((p % N) * pages_per_rank + p // N) * S + s % S`` for a read
  ([[RFC-0001:C-DIRECT-WRITE]], [[RFC-0001:C-READ-PATH]]); the padding slot
  passes through (writes nothing, reads masked, [[RFC-0001:C-PADDING]]);
  decode split over the context (flash-decoding), prefill tiled by query
  blocks, byte formats (bfloat16 bytes, scaled FP8) decoded and encoded in
  the kernels ([[RFC-0001:C-KV-FORMAT]]);
* ``"auto"`` (default): ``triton`` for CUDA tensors when triton imports, else ``torch``.

The backends are named once, in :data:`BACKENDS` (``cpkv run --kernels`` and
the runtime ask it); a new backend is a
:class:`~cpkv.kernels.backend.Backend` and one ``BACKENDS.add``.

A forward takes a backend once (:func:`get`: one instance per name, bound
once) and calls its ``plan`` once per batch, its run methods per layer. The
functions below are the same kernels for one call each, with every argument
checked first (same errors on both backends, nothing written on a refusal);
``check=False`` skips only the slot-range read (a device sync) for a table
validated once per batch.

Triton on the CPU: importing this package on a machine without CUDA sets
``TRITON_INTERPRET=1`` (``os.environ.setdefault``, so an explicit setting
wins), the one place cpkv sets it, before triton is imported (Triton reads it
when ``triton.language`` is imported and when a kernel is decorated), so the
``triton`` backend runs its kernels on CPU tensors in Triton's interpreter
(slowly, one program after another; no bfloat16 there: bfloat16 is GPU-only
for this backend). :mod:`cpkv.models`, the one importer of ``transformers``
(which imports triton), imports this package first; ``import cpkv`` sets
nothing. Set the variable yourself if triton may be imported before this
package. Without triton
installed, ``backend="triton"`` raises ``RuntimeError`` and ``torch`` works.

The group's view of a layer (``k_view``, ``v_view``, ``latent_view``) is a
rank-major tensor ``[N * slots_per_rank, *row]`` when one buffer holds the
group's memory, or a :class:`~cpkv.consumers.kv_view.SegmentTable` when it is
N segments (each rank's its own allocation, on GPUs): the torch backend then
gathers owner by owner, a Triton kernel loads the owner's base from the table
and adds the local row (:func:`~cpkv.kernels.triton_common.row_offset`; the
contract is in :mod:`cpkv.runtime.device`). Both read the same values, to the
bit.

Dtypes: float32 and float16 inputs (bfloat16 on GPUs); float32 math is exact
(IEEE products), 16-bit operands use tensor cores with float32 accumulation.
Outputs in the query's dtype, log-sum-exps float32. Index tensors int32 or
int64. A cache in a byte format is a ``uint8`` view with its ``fmt``.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

if not torch.cuda.is_available():  # before any triton import: kernels then run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ..consumers.kv_format import KVFormat  # noqa: E402
from ..contract.errors import ContractViolation  # noqa: E402
from ..consumers.kv_view import SegmentTable  # noqa: E402
from .backend import Backend, CacheView, WriteIndex  # noqa: E402
from .checks import (check_dim, check_float, check_index, check_layout, check_rank, check_same_device,  # noqa: E402
                     check_slots, check_view)
from .reference import TorchBackend  # noqa: E402
from ..contract.registry import Registry  # noqa: E402



def _triton() -> Backend:
    """The Triton backend (imported on first use: triton is an extra)."""
    try:
        from .triton_backend import TritonBackend
    except ImportError as e:
        raise RuntimeError(f"backend 'triton' needs the triton package, which does not import here ({e}); "
                           "use backend='torch'") from e
    return TritonBackend()


#: The kernel backends by name, each entry the maker of its one instance (:func:`get` binds it on first use).
BACKENDS: Registry[Callable[[], Backend]] = Registry("kernel backend")
BACKENDS.add("torch", TorchBackend, "the reference, vectorised torch on any device")
BACKENDS.add("triton", _triton, "Triton kernels that translate logical slots themselves (on the CPU in Triton's "
             "interpreter, slow)")
_BOUND: dict[str, Backend] = {}


def get(backend: str, device: torch.device | str | None = None) -> Backend:
    """The :class:`~cpkv.kernels.backend.Backend` named ``backend`` (one of
    :data:`BACKENDS`), or for ``"auto"`` triton on a CUDA ``device`` when it
    imports, else torch; one instance per name. Raises ``ValueError`` for an
    unknown name, ``RuntimeError`` for triton without triton."""
    if backend == "auto":
        if device is None or torch.device(device).type != "cuda":
            return get("torch")
        try:
            return get("triton")
        except RuntimeError:
            return get("torch")
    bound = _BOUND.get(backend) if isinstance(backend, str) else None
    if bound is None:
        bound = _BOUND[backend] = BACKENDS.get(backend)()
    return bound


def _cache(name: str, view: torch.Tensor | SegmentTable, fmt: KVFormat | None, layout, axes: int) -> CacheView:
    """Check one cache view (``axes`` value axes per slot) and wrap it."""
    if not isinstance(view, (torch.Tensor, SegmentTable)):
        raise TypeError(f"{name} must be a torch.Tensor or a SegmentTable, got {type(view).__name__}")
    check_view(name, view, layout)
    if fmt is None:
        check_float(name, view.base if isinstance(view, SegmentTable) else view, 1 + axes)
        return CacheView(view, None, tuple(view.shape[1:]))
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a KVFormat, got {type(fmt).__name__}")
    if view.dtype != torch.uint8 or view.dim() != 2 or view.shape[1] != fmt.bytes_per_slot:
        raise ValueError(f"{name} in format {fmt} must be uint8 rows of {fmt.bytes_per_slot} bytes, got "
                         f"{view.dtype} {tuple(view.shape)}")
    if len(fmt.shape) != axes:
        raise ValueError(f"{name}: format {fmt} has {len(fmt.shape)} value axes, expected {axes}")
    return CacheView(view, fmt, tuple(fmt.shape))


def _same_dtype(q: torch.Tensor, **views: CacheView) -> None:
    """A float view shares q's dtype (a byte format is decoded to q's dtype in the kernel)."""
    for n, v in views.items():
        if v.fmt is None and v.data.dtype != q.dtype:
            raise TypeError(f"q and {n} must share a dtype, got {q.dtype} and {v.data.dtype}")


def _splits(splits: int | None) -> None:
    if splits is not None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
        raise ValueError(f"splits must be a positive int or None, got {splits!r}")


# -- store ----------------------------------------------------------------------------------
def store(buffer: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, layout, rank: int, *,
          fmt: KVFormat | None = None, check: bool = True, backend: str = "auto") -> torch.Tensor:
    """Write one family's new entries into rank ``rank``'s own segment.

    ``buffer [slots_per_rank, *shape]`` (float, trailing axes contiguous: the
    rank's segment of one layer; with ``fmt``, ``uint8 [slots_per_rank,
    fmt.bytes_per_slot]``, the values encoded into it), ``values [T, *shape]``
    (float, cast to the buffer's dtype), logical ``slots [T]`` (int32/int64),
    all on one device. Entry t goes to local slot ``(p // N) * S + s % S``;
    padding is skipped; a slot ``rank`` does not own (or outside the layout)
    is not written (the entries it does own are). Returns the report ``int32
    [2]`` on the buffer's device: the number of refused slots and the index of
    the first (``T`` when none), so a caller may check once per batch with
    :func:`raise_refused`; ``check=True`` (default) does so now and raises
    :class:`~cpkv.contract.errors.ContractViolation`, or ``IndexError`` for a
    slot outside the layout. Raises ``TypeError``/``ValueError`` on a wrong
    dtype or shape before writing anything. [[RFC-0001:C-DIRECT-WRITE]]
    """
    check_layout(layout)
    rank = check_rank("rank", rank, layout)
    check_float("values", values)
    check_index("slots", slots, 1)
    check_same_device(buffer=buffer, values=values, slots=slots)
    if fmt is None:
        check_float("buffer", buffer)
        shape = tuple(buffer.shape[1:])
    else:
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != fmt.bytes_per_slot:
            raise ValueError(f"buffer in format {fmt} must be uint8 rows of {fmt.bytes_per_slot} bytes, got "
                             f"{buffer.dtype} {tuple(buffer.shape)}")
        shape = tuple(fmt.shape)
    check_dim("buffer", buffer.shape[0], layout.slots_per_rank, "rows (slots_per_rank)")
    if tuple(values.shape) != (slots.numel(), *shape):
        raise ValueError(f"values of shape {tuple(values.shape)} for {slots.numel()} slots of a buffer "
                         f"{tuple(buffer.shape)}: expected {(slots.numel(), *shape)}")
    if buffer.dim() > 1 and not buffer[0].is_contiguous():
        raise ValueError(f"buffer's trailing axes must be contiguous, got strides {buffer.stride()}")
    report = torch.zeros(2, dtype=torch.int32, device=buffer.device)
    report[1] = slots.numel()  # a fill on the device, not a host-to-device copy
    get(backend, buffer.device).store(CacheView(buffer, fmt, shape), values, WriteIndex(slots), layout, rank,
                                      report)
    if check:
        raise_refused(report, slots, layout, rank)
    return report


def raise_refused(report: torch.Tensor, slots: torch.Tensor, layout, rank: int) -> None:
    """Raise for the first slot a :func:`store` refused (reads the ``int32 [2]``
    report: a device sync): ``IndexError`` for a slot outside the layout,
    :class:`~cpkv.contract.errors.ContractViolation` naming the slot and its
    owner otherwise. Returns ``None`` when nothing was refused."""
    count, first = (int(x) for x in report.tolist())
    if count == 0:
        return
    bad = int(slots[first])
    if not 0 <= bad < layout.capacity:
        raise IndexError(f"slots[{first}] = {bad} is outside the layout [0, {layout.capacity}) "
                         f"(padding {layout.padding_value} excepted); {count} slot(s) refused")
    owner = int(layout.owner_of_slots(torch.tensor([bad]))[0])
    raise ContractViolation(f"rank {rank} asked to write slot {bad} (slots[{first}]), which rank {owner} owns; "
                            f"{count} slot(s) refused, not written: only the owner of a page writes it")


# -- attention ------------------------------------------------------------------------------
def _check_table(table, q_req, q_pos, q, layout, check):
    T = q.shape[0]
    check_index("table", table, 2)
    check_index("q_req", q_req, 1)
    check_index("q_pos", q_pos, 1)
    check_dim("q_req", q_req.shape[0], T, "length (queries T)")
    check_dim("q_pos", q_pos.shape[0], T, "length (queries T)")
    check_same_device(q=q, table=table, q_req=q_req, q_pos=q_pos)
    if check and q_req.numel() and (int(q_req.min()) < 0 or int(q_req.max()) >= table.shape[0]):
        raise IndexError(f"q_req must index the {table.shape[0]} rows of table, got values in "
                         f"[{int(q_req.min())}, {int(q_req.max())}]")
    if check:
        check_slots("table", table, layout)


def paged_attention(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor, table: torch.Tensor,
                    q_req: torch.Tensor, q_pos: torch.Tensor, layout, scaling: float, *,
                    only_rank: int | None = None, fmt: KVFormat | None = None, splits: int | None = None,
                    check: bool = True, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention of queries over the shared paged cache, with log-sum-exp.

    ``q [T, H, D]``; ``k_view [N * slots_per_rank, Hkv, D]`` and ``v_view
    [N * slots_per_rank, Hkv, Dv]``: one layer of the rank-major view (a
    tensor, or a :class:`~cpkv.consumers.kv_view.SegmentTable` over per-rank
    segments; see the module docstring), in q's dtype (``H`` a multiple of ``Hkv``), or with ``fmt`` (a
    :class:`~cpkv.consumers.kv_format.KVFormat` of shape ``(Hkv, D)``, both
    views) ``uint8`` rows of that format; ``table [B, L]`` logical slots of
    each request by position (``-1``: padding, masked); ``q_req [T]`` the
    table row of query t, ``q_pos [T]`` its position: it sees positions
    ``0 .. q_pos[t]`` (prefill after a prefix of any length, or decode; a
    negative position sees nothing). ``only_rank``: see only slots that rank
    owns (the log-sum-exp decode split; merge with :func:`merge_lse`).
    ``splits``: context chunks of each decode (default: enough to fill the
    GPU). Returns ``out [T, H, Dv]`` (q's dtype) and ``lse [T, H]`` (float32,
    on the scaled scores); a query that sees nothing gets ``out = 0``, ``lse
    = -inf``. ``check``: validate table slots and ``q_req`` (a sync).
    [[RFC-0001:C-READ-PATH]]"""
    check_layout(layout)
    only = check_rank("only_rank", only_rank, layout, optional=True)
    check_float("q", q, 3)
    _splits(splits)
    k = _cache("k_view", k_view, fmt, layout, 2)
    v = _cache("v_view", v_view, fmt, layout, 2)
    dev = check_same_device(q=q, k_view=k_view, v_view=v_view)
    _same_dtype(q, k_view=k, v_view=v)
    if fmt is None and k_view.dtype != v_view.dtype:
        raise TypeError(f"q, k_view, v_view must share a dtype, got {q.dtype}, {k_view.dtype}, {v_view.dtype}")
    check_dim("k_view", k.shape[1], q.shape[2], "head dim (q's D)")
    check_dim("v_view", v.shape[0], k.shape[0], "kv heads (k_view's Hkv)")
    if q.shape[1] % k.shape[0]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k_view's {k.shape[0]} kv heads")
    _check_table(table, q_req, q_pos, q, layout, check)
    b = get(backend, dev)
    plan = b.plan(table, q_req, q_pos, layout, own_rank=None if only < 0 else only)
    return b.dense(plan, q, k, v, scaling, splits=splits)


def merge_lse(outs: torch.Tensor, lses: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of R partial attentions over disjoint key sets.

    ``outs [R, T, H, D]`` (float), ``lses [R, T, H]`` (float32) on one device.
    Returns ``out [T, H, D]`` (outs' dtype) ``= sum_r exp(lse_r - lse) * out_r``
    and ``lse [T, H]`` (float32) ``= logsumexp_r lse_r``; partials with
    ``lse = -inf`` drop out, and a row every partial missed stays ``0, -inf``."""
    check_float("outs", outs, 4)
    check_float("lses", lses, 3)
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32, got {lses.dtype}")
    if tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(f"lses of shape {tuple(lses.shape)} for outs {tuple(outs.shape)}: "
                         f"expected {tuple(outs.shape[:3])}")
    dev = check_same_device(outs=outs, lses=lses)
    return get(backend, dev).merge(outs, lses)


# -- DSA --------------------------------------------------------------------------------------
def index_scores(q: torch.Tensor, weights: torch.Tensor, k_view: torch.Tensor, table: torch.Tensor,
                 q_req: torch.Tensor, q_pos: torch.Tensor, layout, scale: float, *, fmt: KVFormat | None = None,
                 splits: int | None = None, check: bool = True, backend: str = "auto") -> torch.Tensor:
    """Lightning-indexer scores of each query over its visible context, through the shared view.

    ``q [T, Hi, Di]``, ``weights [T, Hi]`` (signed, already scaled by the
    model), ``k_view [N * slots_per_rank, Di]`` (one layer of the indexer-key
    family, a tensor or a segment table, q's dtype; or uint8 rows of ``fmt``), ``table``, ``q_req``,
    ``q_pos`` as in :func:`paged_attention`. Returns ``[T, L]`` float32:
    ``sum_h weights[t, h] * relu(scale * q[t, h] . key(table[q_req[t], l]))``
    (:func:`cpkv.kernels.reference.indexer_scores`), and ``-inf`` where
    position l is not visible (past ``q_pos[t]`` or padding), so ``topk`` may
    run on it directly. ``splits``: context chunks per query (default: enough
    to fill the GPU). [[RFC-0001:C-INDEXER-POOL]]"""
    check_layout(layout)
    check_float("q", q, 3)
    check_float("weights", weights, 2)
    _splits(splits)
    k = _cache("k_view", k_view, fmt, layout, 1)
    dev = check_same_device(q=q, weights=weights, k_view=k_view)
    _same_dtype(q, k_view=k)
    check_dim("k_view", k.shape[0], q.shape[2], "key dim (q's Di)")
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights of shape {tuple(weights.shape)} for q {tuple(q.shape)}: "
                         f"expected {tuple(q.shape[:2])}")
    _check_table(table, q_req, q_pos, q, layout, check)
    b = get(backend, dev)
    return b.index_scores(b.plan(table, q_req, q_pos, layout), q, weights, k, scale, splits=splits)


def sparse_mla_attention(q: torch.Tensor, latent_view: torch.Tensor, slots: torch.Tensor, layout,
                         scaling: float, value_dims: int, *, only_rank: int | None = None,
                         fmt: KVFormat | None = None, splits: int | None = None, check: bool = True,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each query over its selected logical slots.

    ``q [T, H, r + dr]`` (``[q_nope W_UK | q_rope]``), ``latent_view
    [N * slots_per_rank, r + dr]`` (one layer of the latent family, a tensor or
    a segment table: latent ``c`` then rope key, q's dtype; or uint8 rows of ``fmt``, e.g.
    :func:`~cpkv.consumers.kv_format.mla_latent_fp8`), ``slots [T, K]``
    logical slots each query selected (``-1``: padding), ``value_dims = r``:
    keys are the whole row, values its first r entries. ``only_rank``: only
    slots that rank owns. ``splits``: chunks of each selection (default:
    enough to fill the GPU). Returns ``out [T, H, r]`` (q's dtype) and ``lse
    [T, H]`` (float32); a query with nothing selected gets ``0, -inf``.
    [[RFC-0001:C-MLA-LATENT-POOL]]"""
    check_layout(layout)
    only = check_rank("only_rank", only_rank, layout, optional=True)
    check_float("q", q, 3)
    check_index("slots", slots, 2)
    _splits(splits)
    lat = _cache("latent_view", latent_view, fmt, layout, 1)
    dev = check_same_device(q=q, latent_view=latent_view, slots=slots)
    _same_dtype(q, latent_view=lat)
    check_dim("latent_view", lat.shape[0], q.shape[2], "row width (q's r + dr)")
    check_dim("slots", slots.shape[0], q.shape[0], "rows (queries T)")
    if not isinstance(value_dims, int) or not 1 <= value_dims <= q.shape[2]:
        raise ValueError(f"value_dims must be an int in [1, {q.shape[2]}], got {value_dims!r}")
    if check:
        check_slots("slots", slots, layout)
    b = get(backend, dev)
    T = q.shape[0]  # a selection reads no table: plan T queries that see no context of one
    plan = b.plan(torch.zeros((1, 0), dtype=torch.int64, device=dev), torch.zeros(T, dtype=torch.int64, device=dev),
                  torch.full((T,), -1, dtype=torch.int64, device=dev), layout, own_rank=None if only < 0 else only)
    return b.selected(plan, q, lat, slots, scaling, value_dims, splits=splits)


__all__ = ["BACKENDS", "Backend", "CacheView", "get", "store", "raise_refused", "paged_attention", "merge_lse",
           "index_scores", "sparse_mla_attention"]
