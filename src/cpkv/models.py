"""Model adapters: a decoder's own modules around cpkv's paged attention.

An adapter exposes the per-layer pieces a CP runner needs (embed, q/k/v with
rotary, the rest of the layer, the head); attention itself runs over the shared
paged cache (:func:`paged_attention`). :class:`LlamaAdapter` wraps a
``transformers`` Llama model (GQA, causal). Further adapters (DeepSeek-V3.2 with
MLA and its indexer) implement the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


class LlamaAdapter(ModelAdapter):
    """Adapter over a ``transformers`` ``LlamaForCausalLM`` (and its relatives
    with the same module names)."""

    def __init__(self, model):
        self.model = model.eval()
        cfg = model.config
        self.layers = model.model.layers
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.layers[0].self_attn.scaling
        self.dtype = next(model.parameters()).dtype
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb

    def embed(self, ids):
        """Token embeddings."""
        return self.model.model.embed_tokens(ids)

    def qkv(self, layer, h, positions):
        """Input norm, q/k/v projections and Llama's rotary embedding."""
        blk = self.layers[layer]
        x = blk.input_layernorm(h)
        T = x.shape[0]
        q = blk.self_attn.q_proj(x).view(1, T, self.num_heads, self.head_dim)
        k = blk.self_attn.k_proj(x).view(1, T, self.num_kv_heads, self.head_dim)
        v = blk.self_attn.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        cos, sin = self.model.model.rotary_emb(x[None], positions[None])
        q, k = self._rope(q, k, cos, sin, unsqueeze_dim=2)
        return q[0], k[0], v

    def finish_layer(self, layer, h, attn):
        """Output projection and residual, then post-attention norm, MLP and residual."""
        blk = self.layers[layer]
        h = h + blk.self_attn.o_proj(attn.reshape(attn.shape[0], self.num_heads * self.head_dim))
        return h + blk.mlp(blk.post_attention_layernorm(h))

    def logits(self, h):
        """Final norm and LM head."""
        return self.model.lm_head(self.model.model.norm(h))


@dataclass(frozen=True)
class TinyLlama:
    """A small seeded Llama configuration (random weights, fp32)."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_positions: int = 4096
    seed: int = 0

    def config(self):
        """The ``transformers`` config; raises ``ValueError`` on an impossible shape."""
        from transformers import LlamaConfig

        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads}: hidden must be "
                             "a multiple of heads and heads a multiple of kv_heads")
        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions, attn_implementation="eager",
        )

    def build(self):
        """The ``transformers`` model; the same seed gives the same weights in every process."""
        from transformers import LlamaForCausalLM

        cfg = self.config()
        torch.manual_seed(self.seed)
        return LlamaForCausalLM(cfg).to(torch.float32).eval()


def paged_attention(q: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal GQA attention of queries over their requests' gathered context.

    ``q [T, H, D]`` are the queries this rank computes, in request order;
    ``q_req[i]`` indexes the row of ``k_ctx, v_ctx [B, L, Hkv, D]`` holding
    token i's request context in position order, and ``q_pos[i]`` is its
    position: it attends to context positions ``0 .. q_pos[i]``. Queries are
    grouped per request into one padded batch (no loop per token or request).
    """
    T = q.shape[0]
    if T == 0:
        return q.new_zeros(q.shape)
    B, L = k_ctx.shape[:2]
    counts = torch.bincount(q_req, minlength=B)
    j = torch.arange(T, device=q.device) - (torch.cumsum(counts, 0) - counts)[q_req]
    qmax = int(counts.max())
    qp = q.new_zeros(B, qmax, *q.shape[1:])
    qp[q_req, j] = q
    pos = torch.full((B, qmax), -1, dtype=torch.int64, device=q.device)
    pos[q_req, j] = q_pos
    mask = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]
    mask[:, :, 0] |= pos < 0  # padded query rows see one key, so no row is empty; discarded below
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
        attn_mask=mask[:, None], scale=scaling, enable_gqa=True,
    )
    return out.transpose(1, 2)[q_req, j]
