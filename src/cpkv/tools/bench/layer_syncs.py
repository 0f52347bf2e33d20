"""The forward plan benchmark: host synchronisations per layer and the torch
path's step time, with the batch planned once (now) against re-planned in
every layer (cpkv before :class:`~cpkv.runtime.forward_plan.ForwardPlan`:
translation, ownership check and attention metadata per layer), same run.
The "before" lives here only: each layer after the first builds the batch's
plan again before it runs, as the runner once did."""

from __future__ import annotations

import torch

from .timing import median_seconds


def bench_plan(repeats: int = 7, layers: int = 4, prefill_bs: int = 4, prefill_len: int = 256, decode_bs: int = 32,
               context: int = 512, page: int = 16) -> list[dict]:
    """Prefill (``prefill_bs`` x ``prefill_len`` new tokens) and decode
    (``decode_bs`` requests at ``context`` tokens) forwards of a small Llama
    (``layers`` layers, fp32) on one rank, torch path: per phase and mode,
    host synchronisations per layer (:class:`~cpkv.runtime.syncs.SyncCounter`
    around each layer; the per-batch plan is outside the layers), the median
    step time over ``repeats`` interleaved rounds, and the ratio to the
    per-layer plan. Every row carries its layer count."""
    from ...contract.layout import SharedKVLayout
    from ...models import LlamaAdapter, TinyLlama
    from ...runtime.forward_plan import ForwardPlan
    from ...runtime.parts import build_parts
    from ...runtime.syncs import SyncCounter

    adapter = LlamaAdapter(TinyLlama(layers=layers, max_positions=context + prefill_len + 8).build())
    rows_total = prefill_bs + decode_bs
    pages = -(-(prefill_bs * prefill_len + decode_bs * (context + 1)) // page) + rows_total + 2
    parts = build_parts(adapter, SharedKVLayout(1, page, pages), max_requests=rows_total,
                        max_len=context + prefill_len + 2, kernels="torch")
    pool, batches, run = parts.pool, parts.rows, parts.runner
    g = torch.Generator().manual_seed(0)
    pre_rows = list(range(prefill_bs))
    pre = batches.allocate(pre_rows, [prefill_len] * prefill_bs)
    pre_ids = torch.randint(0, 256, (prefill_bs * prefill_len,), generator=g)
    dec_rows = list(range(prefill_bs, rows_total))
    batches.allocate(dec_rows, [context] * decode_bs)
    dec = batches.allocate(dec_rows, [1] * decode_bs, decode=True)
    dec_ids = torch.randint(0, 256, (decode_bs,), generator=g)
    cases = {"prefill": (pre_rows, pre, pre_ids, False), "decode": (dec_rows, dec, dec_ids, True)}

    syncs, layer = {}, adapter.layer

    def forward(phase, per_layer, count=False):
        rows, alloc, ids, decode = cases[phase]
        rows_t = torch.tensor(rows)

        def one(i, h, cache):
            if per_layer and i:  # the "before": the batch planned again in every layer but the first
                cache.plan = ForwardPlan.build(pool, 0, alloc, batches.table.req_to_token, cache.plan.mode,
                                               rows=rows_t)
            return layer(i, h, cache)

        def counted(i, h, cache):
            with SyncCounter() as c:
                out = one(i, h, cache)
            syncs.setdefault((phase, per_layer), []).append(c.total)
            return out

        adapter.layer = counted if count else one
        try:
            return run.forward(rows, alloc, ids, decode, table=batches.table)
        finally:
            adapter.layer = layer

    for phase in cases:
        for per_layer in (True, False):
            forward(phase, per_layer, count=True)
    t = median_seconds({(ph, pl): ((lambda ph=ph, pl=pl: forward(ph, pl)), None)
                        for ph in cases for pl in (True, False)}, repeats)
    out = []
    for phase in cases:
        for per_layer in (True, False):
            c = syncs[(phase, per_layer)]
            out.append({"phase": phase, "plan": "every layer (before)" if per_layer else "once per batch",
                        "layers": layers, "syncs per layer": round(sum(c) / len(c), 2),
                        "step ms": t[(phase, per_layer)] * 1e3,
                        "vs before": t[(phase, per_layer)] / t[(phase, True)]})
    return out
