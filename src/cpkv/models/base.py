"""What a CP runner needs of a decoder model, and what the model may ask of the cache.

A model is written once against :class:`CacheAccess`; the runtime implements
it for every way of dividing a batch among ranks (the page split, token splits
with an all-gather, the log-sum-exp decode split). The model never sees ranks,
slots or lanes: it stores the per-token entries of its cache families and asks
for attention over what is cached.

A model family is named once, in :data:`MODELS` (name -> a factory of its
:class:`ModelConfig`), by the module that defines it; ``cpkv run --model``,
:func:`cpkv.models.model_config` and the benchmarks ask the registry, and
:func:`cpkv.models.build_adapter` asks the configuration for its adapter, so a
new family is one module and one ``MODELS.add``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Protocol

import torch

from ..consumers.kv_format import TorchFormat
from ..consumers.kv_pool import Family
from ..contract.registry import Registry

#: The KV dtypes a run stores its caches in (``--kv-dtype``): plain float32,
#: bfloat16 bytes, or the model's FP8 formats. [[RFC-0001:C-KV-FORMAT]]
KV_DTYPES = ("float32", "bfloat16", "fp8")


class CacheAccess(Protocol):
    """The cache as one layer of a model sees it, for the tokens this rank computes.

    ``positions [T]`` are the sequence positions of those tokens and
    ``num_tokens`` is T (it may be 0: a rank with nothing to compute still runs
    every layer, because the collectives are). ``query_positions [Tq]`` are
    those of the queries this rank attends: its own tokens, or, under the
    log-sum-exp decode split (decode context parallelism), every token of
    the batch (each rank attends every query over its own pages, and the
    partial outputs meet at the token's rank). A model makes its queries from
    what :meth:`queries` gives it and gets back its own tokens' outputs.
    ``scratch`` is a dict that lives for one forward (a model keeps
    per-forward state there, such as the top-k of the last layer that
    computed one).
    """

    positions: torch.Tensor
    query_positions: torch.Tensor
    num_tokens: int
    scratch: dict

    def store(self, layer: int, **values: torch.Tensor) -> None:
        """Cache ``values[family] [T, *shape]`` of this rank's tokens at ``layer``."""

    def queries(self, layer: int, *x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-token tensors ``x [T, ...]`` of this rank's tokens as the
        queries' rows ``[Tq, ...]`` (the tokens of :attr:`query_positions`, in
        that order). A model hands over the smallest tensors its queries
        follow from (they may be all-gathered)."""

    def attend_dense(self, layer: int, q: torch.Tensor, scaling: float, key: str, value: str,
                     value_dims: int | None = None,
                     project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Causal attention of ``q [Tq, H, D]`` over each query's whole context
        (positions ``0 .. position``) in families ``key`` / ``value`` (the first
        ``value_dims`` values of ``value`` when given), ``project`` (a map of
        each head's output alone, ``[*, H, Dv] -> [*, H, Dv']``) applied to
        the output. Returns this rank's tokens' ``[T, H, Dv']``."""

    def context(self, layer: int, family: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query's whole context in ``family``: ``(values [Tq, L, *shape],
        visible [Tq, L])``, where ``visible`` marks positions ``0 .. position``."""

    def select(self, layer: int, family: str, k: int, score: Callable[..., torch.Tensor],
               *queries: torch.Tensor) -> torch.Tensor:
        """Each query's best ``min(k, visible)`` context positions in ``family``,
        as ``topk_positions`` picks them (ties to the lower position) from
        ``score(*queries, keys) -> [T', L]``: ``queries`` are per-query
        tensors ``[Tq, ...]`` (for DSA's indexer: its queries and head weights)
        and ``score`` gets the rows of the queries it scores, ``[T', ...]``,
        with contexts ``keys [T', L, *shape]``; it must score each key from
        its own row and key only. Returns ``[Tq, K]`` int64 (``K <= k``;
        ``-1``: none), for :meth:`attend_selected` of the same queries: under
        the log-sum-exp decode split, this rank's share of each query's
        selection (the keys on its own pages; :meth:`selection` gives the
        whole)."""

    def attend_selected(self, layer: int, q: torch.Tensor, positions: torch.Tensor, scaling: float, key: str,
                        value: str, value_dims: int | None = None,
                        project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of ``q [Tq, H, D]`` over the context positions ``positions
        [Tq, K]`` of each query only (``-1``: none; as :meth:`select` returned
        them), gathered, not masked densely, ``project`` as in
        :meth:`attend_dense`. Returns this rank's tokens' ``[T, H, Dv']``."""

    def selection(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """The whole selection of this rank's tokens, ``[T, K]`` int32 (``-1``
        after), from what :meth:`select` returned at ``layer`` (collective
        under the log-sum-exp decode split: every rank asks alike)."""


class ModelAdapter(ABC):
    """A decoder model as a CP runner drives it: embed, layers, head.

    ``model`` is the ``transformers`` model whose weights it uses (the
    reference for exactness checks).
    """

    model: torch.nn.Module
    num_layers: int

    @abstractmethod
    def families(self, dtype: torch.dtype = torch.float32) -> tuple[Family, ...]:
        """The per-slot caches this model keeps, over the same logical slots."""

    def fp8_families(self) -> tuple[Family, ...]:
        """The same caches in the model's FP8 cache formats (uint8 rows the pool
        encodes on write and decodes on read); raises ``NotImplementedError``
        for an adapter without one. [[RFC-0001:C-KV-FORMAT]]"""
        raise NotImplementedError(f"{type(self).__name__} has no FP8 cache format")

    def kv_families(self, kv_dtype: str = "float32") -> tuple[Family, ...]:
        """The caches as a run with ``kv_dtype`` (one of :data:`KV_DTYPES`)
        stores them: ``"float32"`` the plain float32 families of
        :meth:`families`; ``"bfloat16"`` the same families with a bf16
        :class:`~cpkv.consumers.kv_format.TorchFormat` (uint8 rows of 2 bytes
        a value, decoded to float32 on read); ``"fp8"`` :meth:`fp8_families`.
        Raises ``ValueError`` for another name (``NotImplementedError`` for
        fp8 on an adapter without an FP8 format). [[RFC-0001:C-KV-FORMAT]]"""
        if kv_dtype == "float32":
            return self.families()
        if kv_dtype == "bfloat16":
            return tuple(Family(f.name, f.shape, f.layers, format=TorchFormat(f.shape, torch.bfloat16))
                         for f in self.families())
        if kv_dtype == "fp8":
            return self.fp8_families()
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")

    @abstractmethod
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` -> hidden states ``[T, hidden]``."""

    @abstractmethod
    def layer(self, layer: int, h: torch.Tensor, cache: CacheAccess) -> torch.Tensor:
        """Decoder layer ``layer`` on ``h [T, hidden]``; caches its entries and attends through ``cache``."""

    @abstractmethod
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head: ``[T, vocab]``."""

    def selection(self, cache: CacheAccess) -> torch.Tensor | None:
        """The sparse selection of the forward that ran through ``cache``:
        ``[T, selecting layers, k]`` int32 context positions per token (``-1``:
        none), for a model whose attention reads a selection; ``None`` (the
        default) for a dense model. Every rank asks alike (it may be
        collective: :meth:`CacheAccess.selection`). ``--check`` gives it to
        the reference (:mod:`cpkv.engine.check`)."""
        return None


class ModelConfig(Protocol):
    """A small seeded configuration of a model family (random weights, fp32),
    a frozen dataclass: what a run's configuration holds as its ``model``.

    ``vocab`` tokens, positions up to ``max_positions``, weights from
    ``seed`` (the same in every process)."""

    vocab: int
    max_positions: int
    seed: int

    def build(self) -> torch.nn.Module:
        """The ``transformers`` model of this configuration."""

    def adapter(self) -> ModelAdapter:
        """The adapter over the model :meth:`build` makes."""

    def with_released_cache(self) -> "ModelConfig":
        """This configuration with the released model's per-token cache shape
        (its stored bytes per token and layer), the hidden sizes kept small:
        what the kv dtype benchmark compares."""


#: The model families by name: each entry makes a :class:`ModelConfig` from keyword overrides of its fields.
MODELS: Registry[Callable[..., ModelConfig]] = Registry("model")
