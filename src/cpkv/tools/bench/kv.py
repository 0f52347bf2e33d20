"""The shared KV pool benchmark: write and read paths against an unshared buffer."""

from __future__ import annotations

import torch

from ...contract.allocator import OwnerLaneAllocator
from .timing import median_seconds


def bench_kv(tokens: int = 65536, page: int = 64, cp: int = 4, kv_heads: int = 2, head_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, repeats: int = 21) -> list[dict]:
    """Write and read paths of one layer against plain ``index_copy_`` /
    ``index_select`` on an unshared buffer of the same size.

    Write: rank 0 writes the tokens it owns under the page split (owner check,
    write translation, copy into its segment). Read: every token of the batch
    through the rank-major view, with and without the once-per-batch
    translation.
    """
    from ...consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
    from ...contract.layout import SharedKVLayout

    ppr = -(-(tokens // page + 1) // cp) + 1
    layout = SharedKVLayout(cp, page, ppr)
    alloc = OwnerLaneAllocator((layout.num_pages - 1) * page, page, cp, layout=layout)
    bs = 64
    a = alloc.allocate_extend([0] * bs, [tokens // bs] * bs, torch.full((bs,), -1))
    fams = kv_families(1, kv_heads, head_dim, dtype)
    shared = allocate_buffers(layout, fams)
    pool = SharedKVPool(layout, 0, fams, shared)
    plain = torch.zeros((2, *shared["k"].shape), dtype=dtype)  # same size, unshared, logical slot order
    mine = a.rank_token_indices(0)
    slots_w = a.out_cache_loc[mine]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(slots_w.numel(), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn_like(k)
    slots_r = a.out_cache_loc
    read = pool.read_index(slots_r)

    def plain_write():
        plain[0, 0].index_copy_(0, slots_w, k)
        plain[1, 0].index_copy_(0, slots_w, v)

    def plain_read():
        return plain[0, 0].index_select(0, slots_r), plain[1, 0].index_select(0, slots_r)

    t = median_seconds({
        "write": (lambda: pool.write(0, slots_w, k=k, v=v), None),
        "plain write": (plain_write, None),
        "read": (lambda: pool.gather(0, pool.read_index(slots_r)), None),
        "read, translated once per batch": (lambda: pool.gather(0, read), None),
        "plain read": (plain_read, None),
    }, repeats)
    return [
        {"path": "write (rank 0's tokens)", "tokens": slots_w.numel(), "ms": t["write"] * 1e3,
         "plain ms": t["plain write"] * 1e3, "ratio": t["write"] / t["plain write"]},
        {"path": "read incl. translation", "tokens": tokens, "ms": t["read"] * 1e3,
         "plain ms": t["plain read"] * 1e3, "ratio": t["read"] / t["plain read"]},
        {"path": "read, translated once per batch", "tokens": tokens,
         "ms": t["read, translated once per batch"] * 1e3, "plain ms": t["plain read"] * 1e3,
         "ratio": t["read, translated once per batch"] / t["plain read"]},
    ]
