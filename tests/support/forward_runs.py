"""A small batch run on thread ranks: one prefill, one decode step, every token's logits.

Shared by the forward-plan tests (tests/runtime) and the kernel-path engine
checks: tiny shapes, so that Triton's interpreter runs a case in seconds.
"""

import torch

from cpkv import SharedKVLayout
from cpkv.engine.rank import thread_buffers
from cpkv.runtime.comm import run_threads
from cpkv.runtime.parts import build_parts

PROMPTS = (21, 9)  # the first ends mid-page, longer than TinyDsa's top-k (16): a sparse selection


def prompts(vocab: int) -> list[torch.Tensor]:
    """Seeded prompts of :data:`PROMPTS` lengths."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPTS]


def run_small(adapter, vocab: int, N: int, prefill: str, decode: str, kernels: str = "torch", page: int = 4,
              kv_dtype: str = "float32"):
    """Prefill every prompt but its last token, then decode that token, on N
    thread ranks, the caches stored as ``kv_dtype``. Returns rank 0's
    ``(prefill logits [E, V], decode logits [B, V])`` in flattened batch order
    and every rank's runner."""
    layout, shared = SharedKVLayout(N, page, 16), thread_buffers()
    fams = adapter.kv_families(kv_dtype)
    ps = prompts(vocab)

    def rank(comm):
        own = build_parts(adapter, layout, comm, shared=shared, families=fams, max_requests=len(ps), max_len=64,
                          prefill_split=prefill, decode_split=decode, kernels=kernels)
        run, batches = own.runner, own.rows
        rows = list(range(len(ps)))
        outs = []
        for parts, dec in (([p[:-1] for p in ps], False), ([p[-1:] for p in ps], True)):
            a = batches.allocate(rows, [t.numel() for t in parts], dec)
            idx, lg = run.forward(rows, a, torch.cat(parts), dec, table=batches.table)
            outs.append(run.collect(a.out_cache_loc.numel(), idx, lg))
        return outs, run

    results = run_threads(N, rank)
    return results[0][0], [r for _, r in results]


def reference(adapter, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits for the same tokens: ``(prefill [E, V], decode [B, V])``."""
    pre, dec = [], []
    with torch.no_grad():
        for p in prompts(vocab):
            lg = adapter.model(p[None]).logits[0]
            pre.append(lg[:-1])
            dec.append(lg[-1])
    return torch.cat(pre), torch.stack(dec)
