"""The shared KV pool benchmark: write and read paths against an unshared buffer."""

from __future__ import annotations

import torch

from ...contract.allocator import OwnerLaneAllocator
from .timing import median_seconds


def bench_kv(tokens: int = 65536, page: int = 64, cp: int = 4, kv_heads: int = 2, head_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, repeats: int = 21, device: str = "cpu",
             kernels: str = "torch") -> list[dict]:
    """Write and read paths of one layer against plain ``index_copy_`` /
    ``index_select`` on an unshared buffer of the same size.

    Write: rank 0 writes the tokens it owns under the page split (owner check,
    write translation, copy into its segment). Read: every token of the batch
    through the rank-major view, with and without the once-per-batch
    translation. ``device``: where the buffers live (``cuda``: every timed
    call ends with a device synchronisation); ``kernels="triton"``: the write
    is :func:`cpkv.kernels.store` (translation and owner check in the kernel).
    Each row carries the bytes moved and bytes per second of both sides.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    from ...consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
    from ...contract.layout import SharedKVLayout

    bs = 64
    ppr = -(-(tokens // page + 1 + bs) // cp) + 1  # a partly filled last page per request
    layout = SharedKVLayout(cp, page, ppr)
    alloc = OwnerLaneAllocator.for_layout(layout)
    a = alloc.allocate_extend([0] * bs, [tokens // bs] * bs, torch.full((bs,), -1))
    fams = kv_families(1, kv_heads, head_dim, dtype)
    shared = allocate_buffers(layout, fams, lambda tag, shape, dt: torch.zeros(shape, dtype=dt, device=dev))
    pool = SharedKVPool(layout, 0, fams, shared)
    plain = torch.zeros((2, *shared["k"].shape), dtype=dtype, device=dev)  # same size, unshared, logical order
    mine = a.rank_token_indices(0)
    slots_w = a.out_cache_loc[mine].to(dev)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(slots_w.numel(), kv_heads, head_dim, generator=g).to(dtype).to(dev)
    v = torch.randn_like(k)
    slots_r = a.out_cache_loc.to(dev)
    read = pool.read_index(slots_r)
    local, _ = pool.write_index(slots_w)
    if kernels == "triton":
        from ... import kernels as K

        def write():
            K.store(pool.segment("k", 0), k, slots_w, layout, 0, check=False, backend="triton")
            K.store(pool.segment("v", 0), v, slots_w, layout, 0, check=False, backend="triton")
    else:
        def write():
            pool.write_at(0, local, k=k, v=v)

    def timed(fn):
        def run():
            out = fn()
            sync()
            return out
        return run

    def plain_write():
        plain[0, 0].index_copy_(0, slots_w, k)
        plain[1, 0].index_copy_(0, slots_w, v)

    def plain_read():
        return plain[0, 0].index_select(0, slots_r), plain[1, 0].index_select(0, slots_r)

    t = median_seconds({name: (timed(fn), None) for name, fn in {
        "write": lambda: pool.write(0, slots_w, k=k, v=v),
        "write, planned once per batch": write,
        "plain write": plain_write,
        "read": lambda: pool.gather(0, pool.read_index(slots_r)),
        "read, translated once per batch": lambda: pool.gather(0, read),
        "plain read": plain_read,
    }.items()}, repeats)
    row_bytes = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()  # K and V

    def row(path, name, plain, n):
        b = n * row_bytes
        return {"path": path, "device": dev.type, "kernels": kernels if name.startswith("write, planned") else "torch",
                "tokens": n, "ms": t[name] * 1e3, "plain ms": t[plain] * 1e3, "ratio": t[name] / t[plain],
                "GB/s": b / t[name] / 1e9, "plain GB/s": b / t[plain] / 1e9}

    return [row("write (rank 0's tokens)", "write", "plain write", slots_w.numel()),
            row("write, planned once per batch", "write, planned once per batch", "plain write", slots_w.numel()),
            row("read incl. translation", "read", "plain read", tokens),
            row("read, translated once per batch", "read, translated once per batch", "plain read", tokens)]
