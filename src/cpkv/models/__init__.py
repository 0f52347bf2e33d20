"""Model adapters: a decoder's own modules around cpkv's attention over the shared cache.

An adapter exposes the per-layer pieces a CP runner needs; attention runs over
the shared paged cache (:mod:`cpkv.models.attention`). One module per family:
:mod:`~cpkv.models.llama` (GQA), :mod:`~cpkv.models.dsa` (DeepSeek-V3.2 and
GLM-5: MLA over a latent pool, sparse attention over an indexer-key pool).
"""

from .attention import (absorb_query, absorbed_output, attend, index_scores, merge_partials, paged_attention,
                        topk_positions)
from .base import CacheAccess, ModelAdapter
from .dsa import DsaAdapter, DsaCacheShape, TinyDsa, glm_indexer_types, real_shape
from .llama import LlamaAdapter, TinyLlama

__all__ = ["CacheAccess", "DsaAdapter", "DsaCacheShape", "LlamaAdapter", "ModelAdapter", "TinyDsa", "TinyLlama",
           "absorb_query", "absorbed_output", "attend", "glm_indexer_types", "index_scores", "merge_partials",
           "paged_attention", "real_shape", "topk_positions"]
