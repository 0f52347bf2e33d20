"""DSA models (DeepSeek-V3.2, GLM-5): MLA over a latent pool, sparse attention
chosen by a lightning indexer over an indexer-key pool, both in the shared
owner-lane cache.

Two per-slot cache families, over the same logical slots and owner lanes
([[RFC-0001:C-MLA-LATENT-POOL]], [[RFC-0001:C-INDEXER-POOL]]):

* ``latent`` on every layer: ``kv_lora_rank + qk_rope_head_dim`` values, the
  RMS-normed KV latent then the rotated rope key, in the order ``transformers``
  caches them (its interleaved rotary writes the rotated pairs evens first,
  odds after; queries get the same order, so dot products are unchanged);
* ``index_k`` on layers that compute their own top-k: ``index_head_dim``
  values, the indexer key after its LayerNorm and rotary. GLM-5's ``shared``
  layers reuse the top-k of the most recent ``full`` layer and keep none.

A query's top-k is asked of the cache (``CacheAccess.select``): the indexer
scores the request's whole visible context, and the query attends over the
selected latents only (a gather), in absorbed form. The cache decides where:
the rank that computes the token reads its context through the shared view;
under the log-sum-exp decode split every rank scores every query over its own
pages and the ranks agree on the global top-k from their own best scores
(:func:`cpkv.runtime.lse.global_topk`), each then attending over its own
selected latents. The queries come from the cache (``CacheAccess.queries``):
the model hands it the ``q_lora`` latent and the indexer's head weights, the
smallest inputs the queries follow from, and makes the queries (``q_b_proj``,
``W_UK``, the indexer's ``wq_b``, rotary) for whatever rows come back; the
output goes through ``W_UV`` inside the cache's attention (``project``), so
under that split a rank moves ``v_head_dim`` values a head, not
``kv_lora_rank``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import partial

import torch

from ..consumers.kv_format import indexer_key_fp8, mla_latent_fp8
from ..consumers.kv_pool import Family
from .attention import IndexerScore, absorb_query, absorbed_output
from .base import MODELS, ModelAdapter

#: The DSA models by name (``TinyDsa.kind``), each registered in :data:`~cpkv.models.base.MODELS` below.
KINDS = {
    "deepseek-v3.2": "DeepSeek-V3.2 (DSA): MLA latent and an indexer key on every layer, yarn rotary",
    "glm-5": "GLM-5 (DSA): MLA latent; indexer keys on its 'full' layers, 'shared' layers reuse their top-k",
}
_MODEL_TYPES = {"deepseek_v32": "deepseek-v3.2", "glm_moe_dsa": "glm-5"}


def glm_indexer_types(num_layers: int, index_topk_freq: int = 1, index_skip_topk_offset: int = 2) -> tuple[str, ...]:
    """GLM-5's per-layer indexer kinds from the config's ``index_topk_freq`` and
    ``index_skip_topk_offset``, by the rule of ``transformers``'
    ``GlmMoeDsaConfig``: layer i is ``"full"`` when
    ``max(i - offset + 1, 0) % max(freq, 1) == 0``, else ``"shared"``.
    The defaults (freq 1) make every layer full."""
    freq = max(index_topk_freq, 1)
    return tuple("full" if max(i - index_skip_topk_offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


@dataclass(frozen=True)
class DsaCacheShape:
    """What a DSA model caches per slot: the latent on every layer, the indexer
    key on ``index_layers``. Builds the pool's families, in a torch dtype or in
    DeepSeek's FP8 byte formats."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    index_layers: tuple[int, ...]

    def __post_init__(self):
        if any(not 0 <= i < self.num_layers for i in self.index_layers):
            raise ValueError(f"indexer layers {self.index_layers} outside 0 .. {self.num_layers - 1}")

    def families(self, dtype: torch.dtype = torch.float32) -> tuple[Family, Family]:
        """``latent [kv_lora_rank + rope_dim]`` on every layer and ``index_k
        [index_head_dim]`` on the indexer layers, both of ``dtype``."""
        return (Family("latent", (self.kv_lora_rank + self.rope_dim,), tuple(range(self.num_layers)), dtype),
                Family("index_k", (self.index_head_dim,), self.index_layers, dtype))

    def fp8_families(self) -> tuple[Family, Family]:
        """The same families in DeepSeek's FP8 cache formats, stored as packed
        byte rows (:mod:`cpkv.consumers.kv_format`): a latent is
        ``kv_lora_rank`` fp8 values, one fp32 scale per 128 of them and
        ``rope_dim`` bf16 values (656 bytes at 512 + 64); an indexer key is
        ``index_head_dim`` fp8 values and one fp32 scale per 128 (132 bytes at
        128). A pool of these families encodes on write and decodes to float32
        on read. [[RFC-0001:C-KV-FORMAT]]"""
        return (Family("latent", (self.kv_lora_rank + self.rope_dim,), tuple(range(self.num_layers)),
                       format=mla_latent_fp8(self.kv_lora_rank, self.rope_dim)),
                Family("index_k", (self.index_head_dim,), self.index_layers,
                       format=indexer_key_fp8(self.index_head_dim)))


def released_config(kind: str = "deepseek-v3.2"):
    """The released model's ``transformers`` configuration (its defaults:
    ``DeepseekV32Config()`` or ``GlmMoeDsaConfig()``), for tools that need its
    sizes; imported here, where cpkv imports ``transformers`` (after
    :mod:`cpkv.kernels` set the interpreter on a machine without CUDA)."""
    if kind == "deepseek-v3.2":
        from transformers import DeepseekV32Config

        return DeepseekV32Config()
    if kind == "glm-5":
        from transformers import GlmMoeDsaConfig

        return GlmMoeDsaConfig()
    raise ValueError(f"kind must be 'deepseek-v3.2' or 'glm-5', got {kind!r}")


def real_shape(kind: str, index_topk_freq: int = 1, index_skip_topk_offset: int = 2) -> DsaCacheShape:
    """The cache shape of the released models, from ``transformers`` 5.24's
    config defaults (``DeepseekV32Config()``: 61 layers, kv_lora_rank 512, rope
    64, index_head_dim 128, an indexer on every layer; ``GlmMoeDsaConfig()``: 78
    layers, the same sizes). GLM-5's indexer layers follow
    :func:`glm_indexer_types` (default: all full, as ``GlmMoeDsaConfig``
    derives it; third-party GLM-5.2 configs carry freq 4, offset 3)."""
    if kind == "deepseek-v3.2":
        if (index_topk_freq, index_skip_topk_offset) != (1, 2):
            raise ValueError("DeepSeek-V3.2 has an indexer on every layer; the indexer pattern is GLM-5's")
        return DsaCacheShape(61, 512, 64, 128, tuple(range(61)))
    if kind == "glm-5":
        types = glm_indexer_types(78, index_topk_freq, index_skip_topk_offset)
        if types[0] != "full":
            raise ValueError(f"layer 0 must compute its own top-k; freq {index_topk_freq}, offset "
                             f"{index_skip_topk_offset} make it shared")
        return DsaCacheShape(78, 512, 64, 128, tuple(i for i, t in enumerate(types) if t == "full"))
    raise ValueError(f"unknown DSA model {kind!r}; choose from {', '.join(KINDS)}")


class DsaAdapter(ModelAdapter):
    """Adapter over ``transformers``' ``DeepseekV32ForCausalLM`` or
    ``GlmMoeDsaForCausalLM``: MLA in absorbed form over the shared latent pool,
    sparse over the top-k its indexer picks from the shared indexer-key pool.

    Per token and layer at the real shapes (kv_lora_rank 512, rope 64,
    index_head_dim 128), the latent is 1152 bytes in bf16 (656 in DeepSeek's
    FP8 format) and the indexer key 256 (132). DeepSeek-V3.2 has 61 layers, all
    with an indexer: 85888 bytes per token in bf16. On a CP group of N ranks,
    sharing both families costs each rank 85888 / N bytes per token (10736 at
    N = 8); sharing only the latent and replicating the indexer keys on every
    rank costs 70272 / N + 15616 (24400 at N = 8, 2.3x), and the replicated
    keys alone would be 64% of a rank's cache. So the indexer keys are shared
    like the latent, as SGLang's shared-KV path does for its main and indexer
    caches: scoring reads them through the shared view (same machine, no
    collective), and only owners write them. ``cpkv bytes`` prints the table.

    Selection ([[RFC-0001:C-INDEXER-POOL]]): the query at position p scores
    positions ``0 .. p`` of its request and keeps the best
    ``min(index_topk, p + 1)``, the set ``transformers`` selects (its top-k
    runs over a row of every key, masked future keys filled with the dtype's
    minimum, so its picks beyond position p are masked out again; with no tie
    at the k-th score the visible sets agree). Attention
    ([[RFC-0001:C-MLA-LATENT-POOL]]): ``[q_nope W_UK | q_rope]`` against the
    selected ``[latent | k_rope]``, values the latent, output through
    ``W_UV`` and ``o_proj``, at ``transformers``' softmax scale (mscale² for
    yarn with ``mscale_all_dim``).
    """

    def __init__(self, model):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in _MODEL_TYPES:
            raise ValueError(f"DsaAdapter takes DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM, not "
                             f"{type(model).__name__} ({getattr(cfg, 'model_type', None)!r})")
        self.model = model.eval()
        self.kind = _MODEL_TYPES[cfg.model_type]
        self.layers = model.model.layers
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.index_heads, self.index_dim, self.index_topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.index_layers = tuple(i for i, blk in enumerate(self.layers) if blk.self_attn.indexer is not None)
        if 0 not in self.index_layers:
            raise ValueError("layer 0 must compute its own top-k: a shared layer reuses an earlier layer's")
        self.scaling = [blk.self_attn.scaling for blk in self.layers]
        mod = sys.modules[type(self.layers[0].self_attn).__module__]
        self._rope = mod.apply_rotary_pos_emb_interleave  # MLA: interleaved in both models
        # the indexer: NeoX halves in DeepSeek-V3.2, interleaved in GLM-5
        self._index_rope = mod.apply_rotary_pos_emb if self.kind == "deepseek-v3.2" else mod.apply_rotary_pos_emb_interleave
        self.shape = DsaCacheShape(self.num_layers, self.kv_lora_rank, self.rope, self.index_dim, self.index_layers)

    def families(self, dtype=torch.float32):
        """``latent`` on every layer, ``index_k`` on the layers with their own indexer."""
        return self.shape.families(dtype)

    def fp8_families(self):
        """The same families in DeepSeek's FP8 cache formats (:meth:`DsaCacheShape.fp8_families`)."""
        return self.shape.fp8_families()

    def embed(self, ids):
        """Token embeddings."""
        return self.model.model.embed_tokens(ids)

    def _index_key(self, layer, x, cos, sin):
        """The indexer's key ``[T, Di]`` (rotary on the first ``rope`` dims) and
        per-head weights ``[T, Hi]`` of this rank's tokens, from transformers' modules."""
        ind = self.layers[layer].self_attn.indexer
        T, dr, Hi, Di = x.shape[0], self.rope, self.index_heads, self.index_dim
        k = ind.k_norm(ind.wk(x)).view(1, T, 1, Di)
        k_rot = _rotate(self._index_rope, k[..., :dr], cos, sin)
        k = torch.cat([k_rot, k[..., dr:]], -1)[0, :, 0]
        w = ind.weights_proj(x.to(ind.weights_proj.weight.dtype)).float() * Hi**-0.5
        return k, w

    def _index_query(self, layer, q_lat, cos, sin):
        """The indexer's queries ``[Tq, Hi, Di]`` (rotary on the first ``rope`` dims) from the ``q_lora`` latent."""
        ind = self.layers[layer].self_attn.indexer
        Tq, dr, Hi, Di = q_lat.shape[0], self.rope, self.index_heads, self.index_dim
        q = ind.wq_b(q_lat).view(1, Tq, Hi, Di)
        return torch.cat([_rotate(self._index_rope, q[..., :dr], cos, sin), q[..., dr:]], -1)[0]

    def select(self, layer: int, q: torch.Tensor, w: torch.Tensor, cache) -> torch.Tensor:
        """This layer's top-k context positions per query, ``[Tq, K]`` (``-1``:
        none), from the indexer keys of each query's visible context,
        through ``cache.select`` (which rank scores which key is the
        cache's choice). [[RFC-0001:C-INDEXER-POOL]]"""
        scale = self.layers[layer].self_attn.indexer.softmax_scale
        return cache.select(layer, "index_k", self.index_topk, IndexerScore(scale), q, w)

    def layer(self, layer, h, cache):
        """Attention block (cache the latent and, on indexer layers, the indexer
        key; pick the top-k; absorbed MLA over the selected latents) and the
        MLP/MoE block. A ``shared`` layer reuses ``cache.scratch["topk"]``, the
        selection of the most recent indexer layer of this forward; it raises
        ``RuntimeError`` if there is none."""
        blk = self.layers[layer]
        attn = blk.self_attn
        T, H, dn, dr, r = h.shape[0], self.num_heads, self.nope, self.rope, self.kv_lora_rank
        x = blk.input_layernorm(h)
        rotary = self.model.model.rotary_emb
        cos, sin = rotary(x[None], cache.positions[None])  # [1, T, dr]: this rank's tokens (the keys)
        q_lat = attn.q_a_layernorm(attn.q_a_proj(x))
        kv = attn.kv_a_proj_with_mqa(x)
        c = attn.kv_a_layernorm(kv[:, :r])
        k_rot = _rotate(self._rope, kv[:, r:].view(1, T, 1, dr), cos, sin)
        latent = torch.cat([c, k_rot[0, :, 0]], -1)  # [T, r + dr]
        indexer = attn.indexer is not None
        if indexer:
            ik, iw = self._index_key(layer, x, cos, sin)
            cache.store(layer, latent=latent, index_k=ik)
            q_lat, iw = cache.queries(layer, q_lat, iw)
        else:
            cache.store(layer, latent=latent)
            if "topk" not in cache.scratch:
                raise RuntimeError(f"layer {layer} reuses the top-k of an earlier indexer layer, and none ran "
                                   "in this forward")
            (q_lat,) = cache.queries(layer, q_lat)
        qpos = cache.query_positions
        if qpos is not cache.positions:  # the queries are other tokens than the keys (decode context parallelism)
            cos, sin = rotary(x[None], qpos[None])
        Tq = q_lat.shape[0]
        q = attn.q_b_proj(q_lat).view(1, Tq, H, dn + dr)
        q_rot = _rotate(self._rope, q[..., dn:], cos, sin)
        if indexer:
            cache.scratch["topk"] = self.select(layer, self._index_query(layer, q_lat, cos, sin), iw, cache)
            cache.scratch.setdefault("selected", {})[layer] = cache.scratch["topk"]
        W = attn.kv_b_proj.weight.view(H, dn + self.v_dim, r)
        qq = torch.cat([absorb_query(q[0, :, :, :dn], W[:, :dn]), q_rot[0]], -1)  # [Tq, H, r + dr]
        o = cache.attend_selected(layer, qq, cache.scratch["topk"], self.scaling[layer], "latent", "latent",
                                  value_dims=r, project=lambda o: absorbed_output(o, W[:, dn:]))  # [T, H, dv]
        h = h + attn.o_proj(o.reshape(T, H * self.v_dim))
        if T == 0:  # no token on this rank: the collectives ran, nothing to compute
            return h
        return h + blk.mlp(blk.post_attention_layernorm(h))

    def logits(self, h):
        """Final norm and LM head."""
        return self.model.lm_head(self.model.model.norm(h))

    def selection(self, cache) -> torch.Tensor:
        """The top-k of each indexer layer of the forward that ran through
        ``cache``, ``[T, len(index_layers), index_topk]`` int32 positions,
        ``-1`` padding (a ``shared`` GLM-5 layer reuses its indexer layer's),
        through ``cache.selection`` (collective: every rank asks alike)."""
        got = cache.scratch.get("selected", {})
        out = torch.full((cache.num_tokens, len(self.index_layers), self.index_topk), -1, dtype=torch.int32,
                         device=cache.positions.device)
        for i, layer in enumerate(self.index_layers):
            if layer in got:
                sel = cache.selection(layer, got[layer])
                out[:, i, : sel.shape[1]] = sel
        return out


def _rotate(rope, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [1, T, heads, d]`` rotated by transformers' ``rope(q, k, cos, sin)`` (which rotates two
    tensors alike; here one, so queries and keys may be of other tokens)."""
    return rope(x, x, cos, sin, unsqueeze_dim=2)[0]


@dataclass(frozen=True)
class TinyDsa:
    """A small seeded DeepSeek-V3.2 or GLM-5 configuration (random weights, fp32).

    ``kind`` is ``"deepseek-v3.2"`` or ``"glm-5"``. ``indexer_types`` (GLM-5
    only; default full, shared, full, ... alternating from a full layer 0) says
    which layers compute their own top-k. ``yarn`` (default: on for
    DeepSeek-V3.2, as its checkpoint, off for GLM-5) uses yarn rotary with
    ``mscale_all_dim``, so the softmax scale carries mscale². 16 indexer heads:
    with few heads the ReLU makes exact zero scores common, and top-k ties at
    zero make even ``transformers`` disagree with itself.
    """

    kind: str = "deepseek-v3.2"
    vocab: int = 256
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    q_lora_rank: int = 48
    kv_lora_rank: int = 32
    rope_dim: int = 8
    nope_dim: int = 16
    v_dim: int = 16
    intermediate: int = 128
    moe_intermediate: int = 32
    experts: int = 8
    experts_per_token: int = 2
    expert_groups: int = 4
    topk_groups: int = 2
    dense_layers: int = 1
    index_heads: int = 16
    index_dim: int = 32
    index_topk: int = 16
    indexer_types: tuple[str, ...] | None = None
    yarn: bool | None = None
    max_positions: int = 512
    seed: int = 0

    def resolved_indexer_types(self) -> tuple[str, ...] | None:
        """GLM-5's per-layer indexer kinds (``None`` for DeepSeek-V3.2)."""
        if self.kind != "glm-5":
            return None
        return self.indexer_types or tuple("full" if i % 2 == 0 else "shared" for i in range(self.layers))

    def config(self):
        """The ``transformers`` config; raises ``ValueError`` on an impossible shape."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown DSA model {self.kind!r}; choose from {', '.join(KINDS)}")
        if self.experts % self.expert_groups or self.experts // self.expert_groups < 2:
            raise ValueError(f"{self.experts} experts in {self.expert_groups} groups: need at least 2 per group")
        if self.experts_per_token > self.topk_groups * (self.experts // self.expert_groups):
            raise ValueError(f"{self.experts_per_token} experts per token exceed the {self.topk_groups} groups' experts")
        if self.index_dim < self.rope_dim or self.rope_dim % 2:
            raise ValueError(f"index_dim {self.index_dim} must be >= rope_dim {self.rope_dim}, which must be even")
        if self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")
        types = self.resolved_indexer_types()
        if self.kind != "glm-5" and self.indexer_types is not None:
            raise ValueError("indexer_types is GLM-5's; DeepSeek-V3.2 has an indexer on every layer")
        if types is not None:
            if len(types) != self.layers or set(types) - {"full", "shared"} or types[0] != "full":
                raise ValueError(f"indexer_types {types}: one of 'full'/'shared' per layer ({self.layers}), "
                                 "layer 0 full")
        yarn = self.kind == "deepseek-v3.2" if self.yarn is None else self.yarn
        rope = (dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                     original_max_position_embeddings=128, beta_fast=32, beta_slow=1)
                if yarn else dict(rope_type="default", rope_theta=10000.0))
        common = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            moe_intermediate_size=self.moe_intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.heads,  # transformers needs them equal
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.rope_dim,
            qk_nope_head_dim=self.nope_dim, v_head_dim=self.v_dim, n_routed_experts=self.experts,
            num_experts_per_tok=self.experts_per_token, n_shared_experts=1, first_k_dense_replace=self.dense_layers,
            n_group=self.expert_groups, topk_group=self.topk_groups, index_n_heads=self.index_heads,
            index_head_dim=self.index_dim, index_topk=self.index_topk, max_position_embeddings=self.max_positions,
            # no padding token: its embedding row would be zero, so its indexer weights are zero, every
            # score in its row ties at 0, and transformers' top-k then depends on the row's length
            rope_parameters=rope, attn_implementation="eager", pad_token_id=None,
        )
        if self.kind == "deepseek-v3.2":
            from transformers import DeepseekV32Config

            return DeepseekV32Config(**common)
        from transformers import GlmMoeDsaConfig

        return GlmMoeDsaConfig(**common, indexer_types=list(types))

    def build(self):
        """The ``transformers`` model; the same seed gives the same weights in every process."""
        cfg = self.config()
        torch.manual_seed(self.seed)
        if self.kind == "deepseek-v3.2":
            from transformers import DeepseekV32ForCausalLM as cls
        else:
            from transformers import GlmMoeDsaForCausalLM as cls
        return cls(cfg).to(torch.float32).eval()

    def adapter(self) -> DsaAdapter:
        """The :class:`DsaAdapter` over :meth:`build`'s model."""
        return DsaAdapter(self.build())

    def with_released_cache(self) -> TinyDsa:
        """The released per-token cache: latent 512 + rope 64, indexer key 128."""
        return replace(self, kv_lora_rank=512, rope_dim=64, index_dim=128)


for _kind, _summary in KINDS.items():
    MODELS.add(_kind, partial(TinyDsa, kind=_kind), _summary)
del _kind, _summary
