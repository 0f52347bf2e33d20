"""``transformers``' forward as the reference for a cache stored in a format
(bf16 bytes, FP8): the same quantize/dequantize round trip applied where its
model produces the cached values ([[RFC-0001:C-KV-FORMAT]]).

:class:`RoundTripCache` is a ``DynamicCache`` whose writes pass every new
entry through ``format.decode(format.encode(.))`` before it is stored and
attended to, exactly where ``transformers`` caches it:

* Llama: ``update(key_states, value_states, layer)``, ``[B, Hkv, S, D]``
  after the rotary, through the ``k`` and ``v`` formats (per token and head);
* DeepSeek-V3.2 / GLM-5: ``update(k_pass, k_rot, layer)`` (``[B, 1, S, r]``
  the normed latent, ``[B, 1, S, dr]`` the rotated rope key) through the
  ``latent`` format over their concatenation, the layout cpkv's latent
  family stores; ``update_indexer(k, layer)`` (``[B, S, Di]``) through the
  ``index_k`` format.

A forward of a whole sequence with this cache (``use_cache=True``) is the
quantized model cpkv's engine computes: every query attends to stored (rounded)
keys and values, its own included, as a pool write before the read makes it.
"""

from __future__ import annotations

from typing import Mapping

import torch
from transformers import DynamicCache

from ..consumers import placement
from ..consumers.kv_format import KVFormat


def round_trip(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """``fmt.decode(fmt.encode(x))`` in ``x``'s dtype and shape (``x [...,
    *fmt.shape]``)."""
    return fmt.decode(fmt.encode(x)).to(x.dtype)


class RoundTripCache(DynamicCache):
    """A ``DynamicCache`` that stores ``decode(encode(x))`` of every new
    entry, by the formats of cpkv's cache families (``formats`` by family
    name: ``k``/``v`` for GQA, ``latent``/``index_k`` for DSA; a family
    without a format is stored as given), for a model of ``config``. Raises
    ``ValueError`` for formats of neither model kind. [[RFC-0001:C-KV-FORMAT]]"""

    def __init__(self, config, formats: Mapping[str, KVFormat]):
        if not set(formats) <= {"k", "v"} and not set(formats) <= {"latent", "index_k"}:
            raise ValueError(f"formats {sorted(formats)} are neither GQA's (k, v) nor DSA's (latent, index_k)")
        super().__init__(config=config)
        self.formats = dict(formats)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Round-trip the new entries (see the module doc), then store them as ``DynamicCache`` does."""
        f = self.formats
        if "latent" in f:  # DSA: k_pass [B, 1, S, r], k_rot [B, 1, S, dr]
            r = key_states.shape[-1]
            lat = round_trip(f["latent"], torch.cat([key_states, value_states], -1))
            key_states, value_states = lat[..., :r], lat[..., r:]
        else:  # GQA: [B, Hkv, S, D]; the formats are per [Hkv, D] slot
            if "k" in f:
                key_states = round_trip(f["k"], key_states.transpose(1, 2)).transpose(1, 2)
            if "v" in f:
                value_states = round_trip(f["v"], value_states.transpose(1, 2)).transpose(1, 2)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_key_states, layer_idx):
        """Round-trip the new indexer keys ``[B, S, Di]``, then store them."""
        if "index_k" in self.formats:
            indexer_key_states = round_trip(self.formats["index_k"], indexer_key_states)
        return super().update_indexer(indexer_key_states, layer_idx)


def reference_logits(model, seq: torch.Tensor, formats: Mapping[str, KVFormat] | None = None) -> torch.Tensor:
    """``transformers``' logits ``[S, vocab]`` of ``seq [S]`` (int64): with
    ``formats`` (cache family name -> format, non-empty), one forward with a
    :class:`RoundTripCache` (``use_cache=True``), the quantized reference;
    without, the plain forward (no cache). The forward runs on the model's
    device (the ids are placed there); the logits come back on the CPU,
    where ``--check`` compares them."""
    if seq.dim() != 1:
        raise ValueError(f"seq must be 1-D token ids, got shape {tuple(seq.shape)}")
    ids = placement.place(seq, next(model.parameters()))[None]
    with torch.no_grad():
        if not formats:
            return model(ids).logits[0].cpu()
        cache = RoundTripCache(model.config, formats)
        return model(ids, cache=cache, use_cache=True).logits[0].cpu()
