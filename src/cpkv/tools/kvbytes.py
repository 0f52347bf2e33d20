"""KV bytes per token per rank of the real DSA models: replicated against shared.

Every figure comes from the pool's own families (:meth:`Family.slot_bytes`
over the layers that keep each family), built by the same
:class:`~cpkv.models.dsa.DsaCacheShape` the adapter uses, in bf16 and in
DeepSeek's FP8 byte formats. Three ways of holding a CP group's cache:

* ``replicated``: every rank holds every token's latent and indexer key;
* ``indexer replicated``: the latent is shared (each rank holds 1/N of it), the
  indexer keys are on every rank;
* ``shared``: both families shared, as cpkv does ([[RFC-0001:C-INDEXER-POOL]]).

"Per token per rank" is the steady state over long contexts; the shared cache
adds at most one partial page per request and lane.
"""

from __future__ import annotations

import torch

from ..models.dsa import real_shape

GIB = 2**30


def kv_bytes_rows(kind: str, cp_size: int, index_topk_freq: int = 1, index_skip_topk_offset: int = 2) -> list[dict]:
    """One row per cache format (bf16, fp8) for ``kind`` on a CP group of
    ``cp_size``: bytes per token over all layers of each family, bytes per
    token per rank each way, and tokens of context per GiB of KV per rank.
    Raises ``ValueError`` for an unknown model, ``cp_size < 1`` or an indexer
    pattern with a shared layer 0."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    shape = real_shape(kind, index_topk_freq, index_skip_topk_offset)
    rows = []
    for fmt, fams in (("bf16", shape.families(torch.bfloat16)), ("fp8", shape.fp8_families())):
        latent, index = (f.slot_bytes() for f in fams)
        per_rank = {"replicated": latent + index, "indexer replicated": latent / cp_size + index,
                    "shared": (latent + index) / cp_size}
        rows.append({
            "format": fmt,
            "latent B/layer": fams[0].slot_bytes() // max(len(fams[0].layers), 1),
            "indexer B/layer": fams[1].slot_bytes() // max(len(fams[1].layers), 1),
            "latent B/token": latent,
            "indexer B/token": index,
            **{f"{k} B/token/rank": int(v) if v == int(v) else v for k, v in per_rank.items()},
            **{f"{k} tokens/GiB/rank": int(GIB // v) for k, v in per_rank.items()},
        })
    return rows
