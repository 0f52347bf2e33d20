"""What a CP runner needs of a decoder model: the adapter interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class ModelAdapter(ABC):
    """What a CP runner needs of a decoder model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype

    @abstractmethod
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` -> hidden states ``[T, hidden]``."""

    @abstractmethod
    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor):
        """Hidden states -> ``(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D])``, rotary applied."""

    @abstractmethod
    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and MLP of ``layer`` given attention output ``[T, H, D]``."""

    @abstractmethod
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head: ``[T, vocab]``."""
