"""The shared KV pool benchmark: write and read paths against an unshared buffer."""

from __future__ import annotations

import torch

from ...contract.allocator import OwnerLaneAllocator
from .timing import median_seconds


def bench_kv(tokens: int = 65536, page: int = 64, cp: int = 4, kv_heads: int = 2, head_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, repeats: int = 21, device: str = "cpu",
             kernels: str = "torch") -> list[dict]:
    """Write and read paths of one layer against plain ``index_copy_`` /
    ``index_select`` on an unshared buffer of the same size, each the path
    the engine takes.

    Write: rank 0 writes the tokens it owns under the page split as a forward
    does, the pool's :meth:`~cpkv.consumers.kv_pool.SharedKVPool.write_index`
    (owner check, write translation, once per batch) then the data plane's
    store of K and V into its segment (every layer); timed with and without
    the once-per-batch part. Read: every token of the batch through the
    rank-major view, with the translation
    (:meth:`~cpkv.consumers.kv_pool.SharedKVPool.read_all_layers`) and with
    an index translated once per batch. ``device``: where the buffers live
    (``cuda``: every timed call ends with a device synchronisation);
    ``kernels``: the data plane whose store writes (``triton``: the store
    kernel). Each row carries the bytes moved and bytes per second of both
    sides.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    from ...consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
    from ...contract.layout import SharedKVLayout
    from ...kernels import get as get_backend
    from ...kernels.backend import CacheView, WriteIndex

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
    read = layout.translate_read_slots(slots_r)
    backend = get_backend(kernels)
    shape = (kv_heads, head_dim)
    segments = [CacheView(pool.segment(n, 0), None, shape) for n in ("k", "v")]
    report = torch.zeros(2, dtype=torch.int32, device=dev)

    def store(index: WriteIndex):  # one layer's store, as ForwardBatch.store runs it
        for seg, x in zip(segments, (k, v)):
            backend.store(seg, x, index, layout, 0, report)

    def write_planning():
        store(WriteIndex(slots_w, *pool.write_index(slots_w)))

    planned = WriteIndex(slots_w, *pool.write_index(slots_w))

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
        "write": write_planning,
        "write, planned once per batch": lambda: store(planned),
        "plain write": plain_write,
        "read": lambda: pool.read_all_layers(slots_r),
        "read, translated once per batch": lambda: (pool.views["k"].read(read, 0), pool.views["v"].read(read, 0)),
        "plain read": plain_read,
    }.items()}, repeats)
    row_bytes = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()  # K and V

    def row(path, name, plain, n):
        b = n * row_bytes
        return {"path": path, "device": dev.type, "kernels": kernels if name.startswith("write") else "torch",
                "tokens": n, "ms": t[name] * 1e3, "plain ms": t[plain] * 1e3, "ratio": t[name] / t[plain],
                "GB/s": b / t[name] / 1e9, "plain GB/s": b / t[plain] / 1e9}

    return [row("write incl. planning (rank 0's tokens)", "write", "plain write", slots_w.numel()),
            row("write, planned once per batch", "write, planned once per batch", "plain write", slots_w.numel()),
            row("read incl. translation", "read", "plain read", tokens),
            row("read, translated once per batch", "read, translated once per batch", "plain read", tokens)]
