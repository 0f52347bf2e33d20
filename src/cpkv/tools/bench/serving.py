"""The engine benchmark: generation against ``transformers``' ``generate()``, a host-tier restore against a recompute."""

from __future__ import annotations

import torch

from .timing import median_rounds, median_seconds


def bench_engine(repeats: int = 3, requests: int = 24, scale: float = 0.1, prefix: int = 2048) -> list[dict]:
    """The engine against ``transformers``, medians of interleaved rounds, one thread, one process.

    * throughput: generated tokens per second of the engine (N 1, continuous
      batching, paged cache) on a multiturn trace, against ``generate()``
      with its dynamic cache, one request at a time, on the same requests
      (the engine's resolved prompts) and the same number of new tokens;
    * restore: making a ``prefix``-token prefix usable again from the host
      tier (device allocation plus the host -> device load of every layer)
      against recomputing it (allocation plus a prefill forward).
    """
    from ...consumers.hicache import HostPool
    from ...contract.layout import SharedKVLayout
    from ...engine.config import EngineConfig
    from ...engine.engine import run_engine_threads
    from ...models import LlamaAdapter, TinyLlama
    from ...runtime.parts import build_parts

    torch.set_num_threads(1)
    model = TinyLlama(max_positions=8192)
    adapter = LlamaAdapter(model.build())
    cfg = EngineConfig(cp_size=1, page_size=16, device_pages=4096, host_pages=0, requests=requests, scale=scale,
                       chunk=4096,
                       max_running=64, model=model)
    report = run_engine_threads(cfg, adapter)  # warm-up, and the requests' resolved prompts
    seqs = report["sequences"]

    def hf():
        with torch.no_grad():
            for prompt, new in seqs:
                ids = torch.tensor([prompt])
                adapter.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       pad_token_id=0)

    gen = sum(n for _, n in seqs)
    t = median_rounds({"engine": lambda: run_engine_threads(cfg, adapter), "transformers": hf}, repeats)
    rows = [{"case": f"generate: {len(seqs)} requests, {gen} new tokens (N 1)", "cpkv s": t["engine"],
             "baseline s": t["transformers"], "cpkv tok/s": gen / t["engine"],
             "baseline tok/s": gen / t["transformers"], "speed-up": t["transformers"] / t["engine"]}]

    # restore a prefix from the host tier vs recompute it
    S = 16
    parts = build_parts(adapter, SharedKVLayout(1, S, prefix // S + 2), max_requests=1, max_len=prefix)
    pool, batches, runner = parts.pool, parts.rows, parts.runner
    alloc = batches.allocator
    host = HostPool(parts.families, HostPool.allocate(parts.families, prefix // S, S))
    ids = torch.randint(0, model.vocab, (prefix,), generator=torch.Generator().manual_seed(0))
    host_slots = torch.arange(S, S + prefix)

    def recompute():
        a = batches.allocate([0], [prefix])
        runner.forward([0], a, ids, table=batches.table)
        pool.release(batches.free(0))

    def restore():
        a = alloc.allocate_extend([0], [prefix], torch.tensor([-1]))
        host.load(pool, host_slots, a.out_cache_loc)
        alloc.free(a.out_cache_loc)

    t = median_seconds({"recompute": (recompute, None), "restore": (restore, None)}, max(repeats, 5))
    rows.append({"case": f"restore a {prefix}-token prefix from the host tier vs recompute it", "cpkv s": t["restore"],
                 "baseline s": t["recompute"], "cpkv tok/s": prefix / t["restore"],
                 "baseline tok/s": prefix / t["recompute"], "speed-up": t["recompute"] / t["restore"]})
    return rows
