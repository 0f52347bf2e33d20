"""One CP group of thread ranks running a few requests through :class:`~cpkv.runtime.runner.CPRunner`: cached
prefixes prefilled first, then the batch, then greedy decode steps (the split and DSA tests share it)."""

import torch

from cpkv import SharedKVLayout
from cpkv.engine.rank import thread_buffers
from cpkv.runtime.comm import run_threads
from cpkv.runtime.parts import build_parts


def run_group(adapter, N, S, prefill, decode, *, steps, requests, pages_per_rank, seed=0, on_rows=None,
              decode_counters_only=False, on_selected=None, prompt_ids=None, **runner_options):
    """``requests`` are ``(cached prefix, prompt length)``: the prefixes are prefilled first, then every request's
    rest in one batch, then ``steps`` greedy decode steps, on N thread ranks over one shared buffer of
    ``pages_per_rank`` pages a rank. ``on_rows(rows)`` is called before each forward (a rank thread's batch);
    ``on_selected(rows, alloc, idx, selected)`` after each (the runner records its selection then);
    ``decode_counters_only`` zeroes the runners' work counters after the prefill; ``prompt_ids`` replaces the
    seeded prompts (one tensor per request). Returns the prompts and every rank's ``(logits per request,
    generated tokens, runner)``."""
    layout, shared = SharedKVLayout(N, S, pages_per_rank), thread_buffers()
    g = torch.Generator().manual_seed(seed)
    prompts = prompt_ids or [torch.randint(0, adapter.model.config.vocab_size, (n,), generator=g) for _, n in requests]

    def rank(comm):
        own = build_parts(adapter, layout, comm, shared=shared, max_requests=len(requests), max_len=128,
                          prefill_split=prefill, decode_split=decode, record_selection=on_selected is not None,
                          **runner_options)
        run, batches = own.runner, own.rows
        out = {r: [] for r in range(len(requests))}

        def step(rows, parts, dec=False):
            if on_rows is not None:
                on_rows(rows)
            a = batches.allocate(rows, [t.numel() for t in parts], dec)
            idx, lg = run.forward(rows, a, torch.cat(parts), dec, table=batches.table)
            if on_selected is not None:
                on_selected(rows, a, idx, run.selected)
            full = run.collect(a.out_cache_loc.numel(), idx, lg)
            for i, r in enumerate(rows):
                s, n = int(a.extend_start_loc[i]), int(a.extend_lens[i])
                out[r].append(full[s : s + n])

        warm = [r for r, (c, _) in enumerate(requests) if c]
        if warm:
            step(warm, [prompts[r][: requests[r][0]] for r in warm])
        rows = list(range(len(requests)))
        step(rows, [prompts[r][requests[r][0] :] for r in rows])
        gen = {r: [] for r in rows}
        if decode_counters_only:
            run.kv_read = run.tokens_computed = 0  # from here on: decode work only
            run.traffic.clear()
        for _ in range(steps):
            nxt = [out[r][-1][-1].argmax().view(1) for r in rows]
            for r, t in zip(rows, nxt):
                gen[r].append(int(t))
            step(rows, nxt, dec=True)
        return {r: torch.cat(out[r]) for r in rows}, gen, run

    return prompts, run_threads(N, rank)
