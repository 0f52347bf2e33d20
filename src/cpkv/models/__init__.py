"""Model adapters: a decoder's own modules around cpkv's attention over the shared cache.

An adapter exposes the per-layer pieces a CP runner needs; attention runs over
the shared paged cache through the data plane (:mod:`cpkv.kernels`); the
models' own attention math is :mod:`cpkv.models.attention`. One module per family:
:mod:`~cpkv.models.llama` (GQA), :mod:`~cpkv.models.dsa` (DeepSeek-V3.2 and
GLM-5: MLA over a latent pool, sparse attention over an indexer-key pool).

Only this package imports ``transformers`` (which imports triton), and it
imports :mod:`cpkv.kernels` first: on a machine without CUDA that sets
``TRITON_INTERPRET=1`` before triton is imported, so the triton backend runs in
Triton's interpreter.
"""

from .. import kernels as _kernels  # noqa: F401 - first: TRITON_INTERPRET before transformers imports triton
from .attention import absorb_query, absorbed_output, index_scores, topk_positions
from .base import KV_DTYPES, MODELS, CacheAccess, ModelAdapter, ModelConfig
from .llama import LlamaAdapter, TinyLlama  # first: MODELS lists llama first, the default
from .dsa import DsaAdapter, DsaCacheShape, TinyDsa, glm_indexer_types, real_shape


def model_config(name: str, **overrides) -> ModelConfig:
    """The small seeded configuration of the model family ``name`` (one of
    :data:`MODELS`), its fields overridden by ``overrides``; ``ValueError``
    for an unknown name."""
    return MODELS.get(name)(**overrides)


def build_adapter(config: ModelConfig) -> ModelAdapter:
    """The adapter over the ``transformers`` model a configuration builds
    (its own :meth:`~cpkv.models.base.ModelConfig.adapter`); ``TypeError`` for
    anything that is not a model configuration."""
    if not callable(getattr(config, "adapter", None)):
        raise TypeError(f"no adapter for a {type(config).__name__}; a model is a configuration of one of "
                        f"{', '.join(MODELS)} (cpkv.models.model_config)")
    return config.adapter()


__all__ = ["KV_DTYPES", "MODELS", "build_adapter", "model_config", "CacheAccess", "DsaAdapter", "DsaCacheShape",
           "LlamaAdapter", "ModelAdapter", "ModelConfig", "TinyDsa", "TinyLlama", "absorb_query", "absorbed_output",
           "glm_indexer_types", "index_scores", "real_shape", "topk_positions"]
