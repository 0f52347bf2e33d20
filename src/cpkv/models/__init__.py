"""Model adapters: a decoder's own modules around cpkv's attention over the shared cache.

An adapter exposes the per-layer pieces a CP runner needs; attention runs over
the shared paged cache (:mod:`cpkv.models.attention`). One module per family:
:mod:`~cpkv.models.llama` (GQA).
"""

from .attention import attend, merge_partials, paged_attention
from .base import CacheAccess, ModelAdapter
from .llama import LlamaAdapter, TinyLlama

__all__ = ["CacheAccess", "LlamaAdapter", "ModelAdapter", "TinyLlama", "attend", "merge_partials", "paged_attention"]
