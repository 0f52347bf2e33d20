"""Llama family (GQA, causal): ``transformers``' own modules around cpkv's paged attention."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..consumers.kv_format import gqa_fp8
from ..consumers.kv_pool import kv_families
from .base import MODELS, ModelAdapter


class LlamaAdapter(ModelAdapter):
    """Adapter over a ``transformers`` ``LlamaForCausalLM`` (and its relatives
    with the same module names): K and V families, dense causal GQA."""

    def __init__(self, model):
        self.model = model.eval()
        cfg = model.config
        self.layers = model.model.layers
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.layers[0].self_attn.scaling
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb

    def families(self, dtype=torch.float32):
        """K and V, ``[kv_heads, head_dim]`` per slot on every layer."""
        return kv_families(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    def fp8_families(self):
        """K and V in FP8 with a float32 scale per token and head
        (:func:`~cpkv.consumers.kv_format.gqa_fp8`). [[RFC-0001:C-KV-FORMAT]]"""
        return kv_families(self.num_layers, self.num_kv_heads, self.head_dim,
                           format=gqa_fp8(self.num_kv_heads, self.head_dim))

    def embed(self, ids):
        """Token embeddings."""
        return self.model.model.embed_tokens(ids)

    def qkv(self, layer, h, positions):
        """Input norm, q/k/v projections and Llama's rotary embedding:
        ``q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]`` (queries and keys both
        rotated at ``positions``)."""
        blk = self.layers[layer]
        x = blk.input_layernorm(h)
        T = x.shape[0]
        q = blk.self_attn.q_proj(x).view(1, T, self.num_heads, self.head_dim)
        k = blk.self_attn.k_proj(x).view(1, T, self.num_kv_heads, self.head_dim)
        v = blk.self_attn.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        cos, sin = self.model.model.rotary_emb(x[None], positions[None])
        q, k = self._rope(q, k, cos, sin, unsqueeze_dim=2)
        return q[0], k[0], v

    def layer(self, layer, h, cache):
        """Attention block (cache K/V; causal GQA of the rotated queries the
        cache gives, ``cache.queries``, over the context) and MLP block."""
        q, k, v = self.qkv(layer, h, cache.positions)
        cache.store(layer, k=k, v=v)
        (q,) = cache.queries(layer, q)
        attn = cache.attend_dense(layer, q, self.scaling, "k", "v")
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

    def adapter(self) -> LlamaAdapter:
        """The :class:`LlamaAdapter` over :meth:`build`'s model."""
        return LlamaAdapter(self.build())

    def with_released_cache(self) -> TinyLlama:
        """Llama's per-token cache: K and V of head dim 128 (2 KV heads: hidden 256 over 2 heads)."""
        return replace(self, hidden=256, heads=2, kv_heads=2, intermediate=256)


MODELS.add("llama", TinyLlama, "GQA, causal (transformers' LlamaForCausalLM): K and V families")
