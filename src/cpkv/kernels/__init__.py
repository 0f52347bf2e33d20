"""Data-plane kernels over the shared owner-lane cache: store, paged GQA
attention, DSA's indexer scores and sparse MLA attention, and the log-sum-exp
merge, each in two backends that must agree.

* ``backend="torch"``: the vectorised references of :mod:`cpkv.kernels.reference`,
  on any device torch runs on;
* ``backend="triton"``: Triton kernels that take the layout's numbers
  (``cp_size``, page size, ``pages_per_rank``) and translate logical slots
  themselves, as SGLang's shared-KV kernels do: local slot
  ``(p // N) * S + s % S`` for a write, rank-major slot
  ``((p % N) * pages_per_rank + p // N) * S + s % S`` for a read
  ([[RFC-0001:C-DIRECT-WRITE]], [[RFC-0001:C-READ-PATH]]); the padding slot
  passes through (writes nothing, reads masked, [[RFC-0001:C-PADDING]]);
* ``backend="auto"`` (default): ``triton`` for CUDA tensors when triton
  imports, else ``torch``.

Triton on the CPU: importing this package on a machine without CUDA sets
``TRITON_INTERPRET=1`` (``os.environ.setdefault``, so an explicit setting
wins) before triton is imported, so the ``triton`` backend runs its kernels on
CPU tensors in Triton's interpreter (slowly, one program after another; no
bfloat16 there: bfloat16 is GPU-only for this backend). Set the variable
yourself if triton may be imported before this package. Without triton
installed, ``backend="triton"`` raises ``RuntimeError`` and ``torch`` works.

The group's view of a layer (``k_view``, ``v_view``, ``latent_view``) is a
rank-major tensor ``[N * slots_per_rank, *row]`` over one buffer, or a
:class:`~cpkv.consumers.kv_view.LayerView` over per-rank segments (each rank's
its own allocation, on GPUs): the torch backend gathers it owner by owner, a
Triton kernel adds the owner's base from the view's table
(``triton_common.view_offset``; the interface is in :mod:`cpkv.runtime.device`).

Dtypes: float32 and float16 inputs (bfloat16 on GPUs), math and accumulation
in float32; outputs in the input's dtype, log-sum-exps float32. Index tensors
int32 or int64. Every call checks its arguments first (same errors on both
backends, nothing written on a refusal); ``check=False`` skips only the
slot-range read (a device sync) for a table validated once per batch.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # before any triton import: kernels then run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ..contract.errors import ContractViolation  # noqa: E402
from . import reference  # noqa: E402
from .checks import (check_dim, check_float, check_index, check_layout, check_rank, check_same_device,  # noqa: E402
                     check_slots, check_view)

BACKENDS = ("torch", "triton", "auto")


def _triton():
    """The Triton implementations, imported on first use."""
    try:
        from . import triton_attention, triton_dsa, triton_store
    except ImportError as e:
        raise RuntimeError(f"backend 'triton' needs the triton package, which does not import here ({e}); "
                           "use backend='torch'") from e
    fns = dict(store=triton_store.store, paged_attention=triton_attention.paged_attention,
               merge_lse=triton_attention.merge_lse, index_scores=triton_dsa.index_scores,
               sparse_mla_attention=triton_dsa.sparse_mla_attention)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's state is global: one launch at a time
        fns = {n: _one_at_a_time(f) for n, f in fns.items()}
    return SimpleNamespace(**fns)


_INTERPRETER_LOCK = threading.Lock()


def _one_at_a_time(fn):
    """``fn`` serialised across threads: Triton's interpreter patches module
    state while a kernel runs, so ranks that are threads (tests) must not run
    kernels at the same time. Compiled kernels (a GPU) need no lock."""

    def locked(*args, **kwargs):
        with _INTERPRETER_LOCK:
            return fn(*args, **kwargs)

    locked.__name__ = fn.__name__
    return locked


def _impl(backend: str, device: torch.device):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return reference
        try:
            return _triton()
        except RuntimeError:
            return reference
    return reference if backend == "torch" else _triton()


# -- store ----------------------------------------------------------------------------------
def store(buffer: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, layout, rank: int, *,
          check: bool = True, backend: str = "auto") -> torch.Tensor:
    """Write one family's new entries into rank ``rank``'s own segment.

    ``buffer [slots_per_rank, *shape]`` (float, trailing axes contiguous: the
    rank's segment of one layer), ``values [T, *shape]`` (float, cast to the
    buffer's dtype), logical ``slots [T]`` (int32/int64), all on one device.
    Entry t goes to local slot ``(p // N) * S + s % S``; padding is skipped; a
    slot ``rank`` does not own (or outside the layout) is not written (the
    entries it does own are). Returns the report ``int32 [2]`` on the
    buffer's device: the number of refused slots and the index of the first
    (``T`` when none), so a caller may check once per batch with
    :func:`raise_refused`; ``check=True`` (default) does so now and raises
    :class:`~cpkv.contract.errors.ContractViolation`, or ``IndexError`` for a
    slot outside the layout. Raises ``TypeError``/``ValueError`` on a wrong
    dtype or shape before writing anything. [[RFC-0001:C-DIRECT-WRITE]]
    """
    check_layout(layout)
    rank = check_rank("rank", rank, layout)
    check_float("buffer", buffer)
    check_float("values", values)
    check_index("slots", slots, 1)
    check_same_device(buffer=buffer, values=values, slots=slots)
    check_dim("buffer", buffer.shape[0], layout.slots_per_rank, "rows (slots_per_rank)")
    if tuple(values.shape) != (slots.numel(), *buffer.shape[1:]):
        raise ValueError(f"values of shape {tuple(values.shape)} for {slots.numel()} slots of a buffer "
                         f"{tuple(buffer.shape)}: expected {(slots.numel(), *buffer.shape[1:])}")
    if buffer.dim() > 1 and not buffer[0].is_contiguous():
        raise ValueError(f"buffer's trailing axes must be contiguous, got strides {buffer.stride()}")
    report = _impl(backend, buffer.device).store(buffer, values, slots, layout, rank)
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
                    only_rank: int | None = None, check: bool = True,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention of queries over the shared paged cache, with log-sum-exp.

    ``q [T, H, D]``; ``k_view [N * slots_per_rank, Hkv, D]`` and ``v_view
    [N * slots_per_rank, Hkv, Dv]``: one layer of the rank-major view (a
    tensor or a ``LayerView``), in q's dtype (``H`` a multiple of ``Hkv``); ``table [B, L]`` logical slots of
    each request by position (``-1``: padding, masked); ``q_req [T]`` the
    table row of query t, ``q_pos [T]`` its position: it sees positions
    ``0 .. q_pos[t]`` (prefill after a prefix of any length, or decode; a
    negative position sees nothing). ``only_rank``: see only slots that rank
    owns (the log-sum-exp decode split; merge with :func:`merge_lse`).
    Returns ``out [T, H, Dv]`` (q's dtype) and ``lse [T, H]`` (float32, on the
    scaled scores); a query that sees nothing gets ``out = 0``, ``lse = -inf``,
    as :func:`cpkv.models.attention.attend`. ``check``: validate table slots
    and ``q_req`` (a sync). [[RFC-0001:C-READ-PATH]]"""
    check_layout(layout)
    only = check_rank("only_rank", only_rank, layout, optional=True)
    check_float("q", q, 3)
    check_float("k_view", k_view, 3)
    check_float("v_view", v_view, 3)
    dev = check_same_device(q=q, k_view=k_view, v_view=v_view)
    if not q.dtype == k_view.dtype == v_view.dtype:
        raise TypeError(f"q, k_view, v_view must share a dtype, got {q.dtype}, {k_view.dtype}, {v_view.dtype}")
    check_view("k_view", k_view, layout)
    check_view("v_view", v_view, layout)
    check_dim("k_view", k_view.shape[2], q.shape[2], "head dim (q's D)")
    check_dim("v_view", v_view.shape[1], k_view.shape[1], "kv heads (k_view's Hkv)")
    if q.shape[1] % k_view.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k_view's {k_view.shape[1]} kv heads")
    _check_table(table, q_req, q_pos, q, layout, check)
    return _impl(backend, dev).paged_attention(q, k_view, v_view, table, q_req, q_pos, layout, scaling, only)


def merge_lse(outs: torch.Tensor, lses: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of R partial attentions over disjoint key sets.

    ``outs [R, T, H, D]`` (float), ``lses [R, T, H]`` (float32) on one device.
    Returns ``out [T, H, D]`` (outs' dtype) ``= sum_r exp(lse_r - lse) * out_r``
    and ``lse [T, H]`` (float32) ``= logsumexp_r lse_r``; partials with
    ``lse = -inf`` drop out, and a row every partial missed stays ``0, -inf``,
    as :func:`cpkv.models.attention.merge_partials`."""
    check_float("outs", outs, 4)
    check_float("lses", lses, 3)
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32, got {lses.dtype}")
    if tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(f"lses of shape {tuple(lses.shape)} for outs {tuple(outs.shape)}: "
                         f"expected {tuple(outs.shape[:3])}")
    dev = check_same_device(outs=outs, lses=lses)
    return _impl(backend, dev).merge_lse(outs, lses)


# -- DSA --------------------------------------------------------------------------------------
def index_scores(q: torch.Tensor, weights: torch.Tensor, k_view: torch.Tensor, table: torch.Tensor,
                 q_req: torch.Tensor, q_pos: torch.Tensor, layout, scale: float, *, check: bool = True,
                 backend: str = "auto") -> torch.Tensor:
    """Lightning-indexer scores of each query over its visible context, through the shared view.

    ``q [T, Hi, Di]``, ``weights [T, Hi]`` (signed, already scaled by the
    model), ``k_view [N * slots_per_rank, Di]`` (one layer of the indexer-key
    family, q's dtype), ``table``, ``q_req``, ``q_pos`` as in
    :func:`paged_attention`. Returns ``[T, L]`` float32:
    ``sum_h weights[t, h] * relu(scale * q[t, h] . key(table[q_req[t], l]))``,
    the formula of :func:`cpkv.models.attention.index_scores`, and ``-inf``
    where position l is not visible (past ``q_pos[t]`` or padding), so
    ``topk`` may run on it directly. [[RFC-0001:C-INDEXER-POOL]]"""
    check_layout(layout)
    check_float("q", q, 3)
    check_float("weights", weights, 2)
    check_float("k_view", k_view, 2)
    dev = check_same_device(q=q, weights=weights, k_view=k_view)
    if q.dtype != k_view.dtype:
        raise TypeError(f"q and k_view must share a dtype, got {q.dtype} and {k_view.dtype}")
    check_view("k_view", k_view, layout)
    check_dim("k_view", k_view.shape[1], q.shape[2], "key dim (q's Di)")
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights of shape {tuple(weights.shape)} for q {tuple(q.shape)}: "
                         f"expected {tuple(q.shape[:2])}")
    _check_table(table, q_req, q_pos, q, layout, check)
    return _impl(backend, dev).index_scores(q, weights, k_view, table, q_req, q_pos, layout, scale)


def sparse_mla_attention(q: torch.Tensor, latent_view: torch.Tensor, slots: torch.Tensor, layout,
                         scaling: float, value_dims: int, *, only_rank: int | None = None, check: bool = True,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each query over its selected logical slots.

    ``q [T, H, r + dr]`` (``[q_nope W_UK | q_rope]``), ``latent_view
    [N * slots_per_rank, r + dr]`` (one layer of the latent family: latent
    ``c`` then rope key, q's dtype), ``slots [T, K]`` logical slots each query
    selected (``-1``: padding), ``value_dims = r``: keys are the whole row,
    values its first r entries. ``only_rank``: only slots that rank owns.
    Returns ``out [T, H, r]`` (q's dtype) and ``lse [T, H]`` (float32); a
    query with nothing selected gets ``0, -inf``. [[RFC-0001:C-MLA-LATENT-POOL]]"""
    check_layout(layout)
    only = check_rank("only_rank", only_rank, layout, optional=True)
    check_float("q", q, 3)
    check_float("latent_view", latent_view, 2)
    check_index("slots", slots, 2)
    dev = check_same_device(q=q, latent_view=latent_view, slots=slots)
    if q.dtype != latent_view.dtype:
        raise TypeError(f"q and latent_view must share a dtype, got {q.dtype} and {latent_view.dtype}")
    check_view("latent_view", latent_view, layout)
    check_dim("latent_view", latent_view.shape[1], q.shape[2], "row width (q's r + dr)")
    check_dim("slots", slots.shape[0], q.shape[0], "rows (queries T)")
    if not isinstance(value_dims, int) or not 1 <= value_dims <= q.shape[2]:
        raise ValueError(f"value_dims must be an int in [1, {q.shape[2]}], got {value_dims!r}")
    if check:
        check_slots("slots", slots, layout)
    return _impl(backend, dev).sparse_mla_attention(q, latent_view, slots, layout, scaling, value_dims, only)


def get(backend: str) -> SimpleNamespace:
    """The five kernels bound to one backend (``"torch"``, ``"triton"`` or
    ``"auto"``): ``get("triton").paged_attention(...)`` is
    ``paged_attention(..., backend="triton")``. Raises ``ValueError`` for an
    unknown backend, ``RuntimeError`` for triton without triton."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        _triton()
    fns = (store, paged_attention, merge_lse, index_scores, sparse_mla_attention)
    return SimpleNamespace(backend=backend, **{f.__name__: (lambda f: lambda *a, **k: f(*a, backend=backend, **k))(f)
                                               for f in fns}, raise_refused=raise_refused)


__all__ = ["BACKENDS", "get", "store", "raise_refused", "paged_attention", "merge_lse", "index_scores",
           "sparse_mla_attention"]
