"""The split benchmark: prefill and decode splits of one model on a process group."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .timing import median_seconds

#: The models the split benchmark runs (names of :data:`cpkv.models.MODELS`) and their shapes there, larger than
#: the test configurations so that compute, not Python, dominates a forward on the CPU (see :func:`splits_model`).
SPLIT_SHAPES = {
    "llama": dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=896),
    "deepseek-v3.2": dict(hidden=256, layers=3, heads=8, q_lora_rank=192, kv_lora_rank=128, rope_dim=32, nope_dim=32,
                          v_dim=32, intermediate=896, moe_intermediate=224, index_heads=16, index_dim=64,
                          index_topk=256),
}
SPLIT_MODELS = tuple(SPLIT_SHAPES)


def splits_model(name: str, max_positions: int):
    """The model configuration the split benchmark runs for ``name`` (one of
    :data:`SPLIT_MODELS`; its shape :data:`SPLIT_SHAPES`), fp32, seeded:

    * ``llama``: hidden 256, 8 heads of 32, 2 KV heads (GQA 4:1 as Llama-3-8B),
      MLP 896 (3.5x, as Llama-3-8B), 4 layers: K+V are 512 bytes per token per layer;
    * ``deepseek-v3.2``: hidden 256, 8 heads, MLA latent 128 + rope 32 on every
      layer, an indexer of 16 heads x 64 picking the top 256 positions per
      query, 3 layers (one dense, two MoE of 8 experts): latent + indexer key
      are 896 bytes per token per layer.
    """
    from ...models import model_config

    if name not in SPLIT_SHAPES:
        raise ValueError(f"unknown model {name!r} for the split benchmark; choose from {', '.join(SPLIT_MODELS)}")
    return model_config(name, **SPLIT_SHAPES[name], max_positions=max_positions)


@dataclass(frozen=True)
class SplitsSpec:
    """One model's split matrix on a CP group of ``cp`` ranks.

    Prefill: ``tokens`` new tokens over ``bs`` requests of equal length (no
    cached prefix), under every prefill split. Decode: one new token for each
    of ``decode_bs`` requests whose context (cached entries plus the new one)
    is ``context`` positions, under every decode split; with ``ragged`` a
    second decode batch has contexts drawn from ``[context/2, 3context/2)``.
    Decode contexts are filled with seeded random entries, written by their
    owners, instead of being prefilled (the timing does not depend on them).
    ``repeats`` timed rounds for prefill, ``decode_repeats`` (default ``4 *
    repeats``) for decode, each after two warm-up rounds. ``device`` and
    ``kernels`` as ``cpkv run``'s (``--device``, ``--kernels``).
    """

    model: object
    cp: int = 4
    tokens: int = 16384
    bs: int = 4
    decode_bs: int = 64
    context: int = 4096
    page: int = 16
    repeats: int = 5
    ragged: bool = True
    seed: int = 0
    decode_repeats: int | None = None
    device: str = "cpu"  # cuda: each rank's KV segment on its GPU, read over CUDA IPC (runtime.device)
    kernels: str = "torch"

    def decode_rounds(self) -> int:
        """Timed decode rounds."""
        return 4 * self.repeats if self.decode_repeats is None else self.decode_repeats

    def prefill_lens(self) -> list[int]:
        """Prefill lengths: ``tokens`` split as evenly as possible over ``bs``."""
        per, extra = divmod(self.tokens, self.bs)
        return [per + (i < extra) for i in range(self.bs)]

    def decode_contexts(self) -> list[list[int]]:
        """Context lengths of each decode batch: uniform, then (``ragged``) spread."""
        out = [[self.context] * self.decode_bs]
        if self.ragged:
            g = torch.Generator().manual_seed(self.seed + 1)
            lo = max(self.context // 2, 2)
            out.append(torch.randint(lo, lo + self.context, (self.decode_bs,), generator=g).tolist())
        return out

    def check(self) -> None:
        """Refuse an impossible matrix (``ValueError``) before any rank starts."""
        sizes = dict(cp=self.cp, tokens=self.tokens, bs=self.bs, decode_bs=self.decode_bs, context=self.context,
                     page=self.page, repeats=self.repeats, decode_repeats=self.decode_rounds())
        for name, v in sizes.items():
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.context < 2:
            raise ValueError(f"a decode context holds a cached entry and the new token: context >= 2, "
                             f"got {self.context}")
        if self.tokens < self.bs:
            raise ValueError(f"{self.tokens} prefill tokens cannot fill {self.bs} requests")
        if self.tokens < self.cp:
            raise ValueError(f"the interleave split needs at least cp={self.cp} prefill tokens, got {self.tokens}")
        longest = max(max(self.prefill_lens()), *(max(c) for c in self.decode_contexts()))
        if longest > self.model.max_positions:
            raise ValueError(f"a sequence of {longest} exceeds the model's {self.model.max_positions} positions")
        self.model.config()

    def pages_per_rank(self) -> int:
        """Room for the larger phase (phases run one after the other), with a
        page per request per lane of slack."""
        S, N = self.page, self.cp
        need = [sum(-(-n // S) for n in self.prefill_lens())] + [sum(-(-n // S) for n in c)
                                                                 for c in self.decode_contexts()]
        return -(-max(need) // N) + max(self.bs, self.decode_bs) + 2


def _split_counters(runner) -> dict:
    return {"tokens": runner.tokens_computed, "reads": dict(runner.reads), "moved": runner.moved_bytes,
            "traffic": dict(runner.traffic)}


def _time_splits(runner, comm, cases: dict, repeats: int) -> dict:
    """Median seconds of each case (a whole forward of every rank: a barrier
    before, untimed, and one after, timed) and this rank's work counters of one
    forward of it (they are the same every time)."""
    counts, busy = {}, {name: [] for name in cases}

    def timed(name, fn):
        def run():
            before = _split_counters(runner)
            cpu = time.process_time()
            fn()
            busy[name].append(time.process_time() - cpu)
            comm.barrier()
            after = _split_counters(runner)
            counts[name] = {"tokens": after["tokens"] - before["tokens"], "moved": after["moved"] - before["moved"],
                            "reads": {k: v - before["reads"].get(k, 0) for k, v in after["reads"].items()},
                            "traffic": {k: v - before["traffic"].get(k, 0) for k, v in after["traffic"].items()
                                        if v != before["traffic"].get(k, 0)}}
        return run

    t = median_seconds({name: (timed(name, fn), comm.barrier) for name, fn in cases.items()}, repeats)
    for name in cases:  # CPU seconds of this rank's forward, median of the timed rounds
        counts[name]["cpu"] = statistics.median(busy[name][2:] or busy[name])
    return {name: {"seconds": t[name], "counts": counts[name]} for name in cases}


def _fill_random(runner, slots: torch.Tensor, seed: int) -> None:
    """Seeded random entries of every family and layer at the slots of
    ``slots`` this rank owns, written by it (the owner) into its own segment."""
    pool = runner.pool
    mine = slots[pool.layout.owned_slot_mask(slots, owner_rank=pool.rank)]
    g = torch.Generator().manual_seed(seed * 1009 + pool.rank)
    values = {n: torch.randn((len(f.layers), mine.numel(), *f.shape), generator=g).to(f.dtype)
              for n, f in pool.families.items()}
    pool.write_all_layers(mine, values)


def _splits_matrix(ctx, comm, spec: SplitsSpec) -> dict | None:
    """One model's matrix on this rank: prefill, then each decode batch, every
    split of each interleaved in rounds; rank 0 returns every rank's counters."""
    from ...contract.layout import SharedKVLayout
    from ...models import build_adapter
    from ...runtime.batch import PREFILL_SPLITS
    from ...runtime.forward_plan import CHOSEN_DECODE_SPLITS
    from ...runtime.parts import build_parts

    adapter = build_adapter(spec.model)
    tag = f"{type(spec.model).__name__}_"  # one pool per model in the one group
    if spec.device == "cuda":
        from ...runtime.device import group_segments

        adapter.model.to(ctx.device)
        shared = lambda name, shape, dtype: group_segments(comm, tag + name, shape, dtype, ctx.device)  # noqa: E731
    else:
        shared = lambda name, shape, dtype: ctx.shared(tag + name, shape, dtype)  # noqa: E731
    contexts = spec.decode_contexts()
    parts = build_parts(adapter, SharedKVLayout(spec.cp, spec.page, spec.pages_per_rank()), comm, shared=shared,
                        max_requests=max(spec.bs, spec.decode_bs),
                        max_len=max(max(spec.prefill_lens()), *(max(c) for c in contexts)), kernels=spec.kernels)
    runner, fams, pool, batches = parts.runner, parts.families, parts.pool, parts.rows
    g = torch.Generator().manual_seed(spec.seed)
    vocab = spec.model.vocab
    out = {}

    rows = list(range(spec.bs))
    a = batches.allocate(rows, spec.prefill_lens())
    ids = torch.randint(0, vocab, (spec.tokens,), generator=g)

    def prefill(split):
        def fn():
            runner.prefill_split = split
            runner.forward(rows, a, ids, table=batches.table)
        return fn

    out["prefill"] = _time_splits(runner, comm, {s: prefill(s) for s in PREFILL_SPLITS}, spec.repeats)
    for r in rows:
        pool.release(batches.free(r))

    for i, ctx_lens in enumerate(contexts):
        rows = list(range(spec.decode_bs))
        cached = batches.allocate(rows, [n - 1 for n in ctx_lens])
        _fill_random(runner, cached.out_cache_loc, spec.seed + i)
        comm.barrier()  # every owner's entries are in before anyone reads them
        d = batches.allocate(rows, [1] * spec.decode_bs, decode=True)
        ids = torch.randint(0, vocab, (spec.decode_bs,), generator=g)

        def decode(split, d=d, ids=ids, rows=rows):
            def fn():
                runner.decode_split = split
                runner.forward(rows, d, ids, decode=True, table=batches.table)
            return fn

        out[f"decode{i}"] = _time_splits(runner, comm, {s: decode(s) for s in CHOSEN_DECODE_SPLITS},
                                         spec.decode_rounds())
        for r in rows:
            pool.release(batches.free(r))

    everyone = comm.all_gather_object({k: {s: c["counts"] for s, c in v.items()} for k, v in out.items()})
    if comm.rank != 0:
        return None
    for phase, cases in out.items():
        for s, c in cases.items():
            c["ranks"] = [e[phase][s] for e in everyone]
            del c["counts"]
    return {"phases": out, "layers": adapter.num_layers, "contexts": contexts, "attention_family": fams[0].name,
            "family_layers": {f.name: len(f.layers) for f in fams}}


def _splits_rank(ctx, specs: list[SplitsSpec]) -> list[dict] | None:
    """One rank of the split benchmark: every model's matrix, one after the other, in this one group."""
    from ...runtime.comm import DistComm, LocalComm

    comm = DistComm(device=ctx.device) if ctx.distributed else LocalComm()
    results = [_splits_matrix(ctx, comm, spec) for spec in specs]
    return results if comm.rank == 0 else None


def measure_splits(*specs: SplitsSpec, timeout: float = 3600.0) -> list[dict]:
    """Run each spec's split matrix, one after the other, on one group of
    ``cp`` processes (every case of a matrix interleaved in rounds inside it),
    and return rank 0's raw result per spec: per phase (``prefill``,
    ``decode0`` the same-length contexts, ``decode1`` the ragged ones) and
    split, the median ``seconds`` of a forward and every rank's counters of one
    forward (``tokens`` computed, context entries ``reads`` per family, cache
    bytes ``moved`` to it from other ranks, median ``cpu`` seconds). Raises
    ``ValueError`` on an impossible spec, or specs of different group sizes,
    before any process starts."""
    from ...runtime.group import launch

    if not specs:
        raise ValueError("measure_splits needs at least one spec")
    if len({s.cp for s in specs}) != 1:
        raise ValueError(f"one group runs every spec: cp must agree, got {[s.cp for s in specs]}")
    if len({type(s.model) for s in specs}) != len(specs):
        raise ValueError("one spec per model family: their pools share the group")
    for s in specs:
        s.check()
    return launch(_splits_rank, specs[0].cp, list(specs), timeout=timeout, device=specs[0].device)


def _ratio(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def default_split_tokens(model: str) -> int:
    """Prefill tokens of the split benchmark: 16384 for Llama; 4096 for DSA,
    whose indexer copies each query's whole context (``[T, L, index_dim]``),
    more than 4 ranks of this benchmark hold at 16K (:data:`cpkv.tools.sizes.SPLIT_FIGURES`)."""
    from ..sizes import SPLIT_FIGURES

    return SPLIT_FIGURES[model][2]


def bench_splits(models=SPLIT_MODELS, cp: int = 4, tokens: int | None = None, bs: int = 4, decode_bs: int = 64,
                 context: int = 4096, page: int = 16, repeats: int = 5, ragged: bool = True, device: str = "cpu",
                 kernels: str = "torch") -> dict[str, dict]:
    """Prefill and decode splits of each of ``models`` (:func:`splits_model`;
    a name or a sequence of names), medians of interleaved rounds, on one
    process group of ``cp`` ranks (:class:`SplitsSpec`, :func:`measure_splits`);
    ``tokens`` defaults to :func:`default_split_tokens`.

    Returns ``{model: {"rows": rows, "raw": raw}}``. One row per phase and
    split: time of a forward and per layer; against the baseline (prefill: the
    fastest all-gather split; decode: ``owner``); cache bytes moved between
    ranks per layer (all ranks together); per-rank tokens computed and
    attention reads (context entries of the attention family: K for Llama,
    the latent for DSA), max and max / mean; per-rank CPU time, max and sum;
    for DSA also the indexer's reads (``index_k``): each query's whole
    context, read once, by the rank that computes it (under ``lse``, by the
    one rank that selects for it).
    Raises ``ValueError`` on impossible sizes before any process starts.
    """
    models = [models] if isinstance(models, str) else list(models)
    specs = []
    for model in models:
        n = tokens or default_split_tokens(model)
        longest = max(-(-n // max(bs, 1)), context + context // 2 + 1 if ragged else context)
        specs.append(SplitsSpec(splits_model(model, max(longest, 512)), cp, n, bs, decode_bs, context, page,
                                repeats, ragged, device=device, kernels=kernels))
    raws = measure_splits(*specs)
    return {model: {"rows": _split_rows(model, spec, raw), "raw": raw} for model, spec, raw in zip(models, specs, raws)}


def _split_rows(model: str, spec: SplitsSpec, raw: dict) -> list[dict]:
    L, fam, per = raw["layers"], raw["attention_family"], raw["family_layers"]
    rows = []
    for phase, cases in raw["phases"].items():
        if phase == "prefill":
            label = f"prefill {spec.tokens} tok, bs {spec.bs}"
            base = min(c["seconds"] for s, c in cases.items() if s != "page")
        else:
            ctx = raw["contexts"][int(phase[-1])]
            label = (f"decode bs {spec.decode_bs}, ctx {spec.context}" if len(set(ctx)) == 1 else
                     f"decode bs {spec.decode_bs}, ctx {min(ctx)}-{max(ctx)} (mean {sum(ctx) // len(ctx)})")
            base = cases["owner"]["seconds"]
        for split, c in cases.items():
            ranks = c["ranks"]
            tok = [r["tokens"] for r in ranks]
            att = [r["reads"].get(fam, 0) // per[fam] for r in ranks]
            row = {"case": label, "split": split, "ms/fwd": c["seconds"] * 1e3, "ms/layer": c["seconds"] * 1e3 / L,
                   "vs base": c["seconds"] / base, "moved KB/layer": sum(r["moved"] for r in ranks) / L / 1024,
                   "tokens max": max(tok), "tok max/mean": _ratio(tok),
                   "reads/layer max": max(att), "reads max/mean": _ratio(att),
                   "cpu ms max": max(r["cpu"] for r in ranks) * 1e3, "cpu ms sum": sum(r["cpu"] for r in ranks) * 1e3}
            if "index_k" in per:
                idx = [r["reads"].get("index_k", 0) // per["index_k"] for r in ranks]
                row["index reads/layer max"] = max(idx)
                row["index max/mean"] = _ratio(idx)
            rows.append(row)
    return rows


def splits_title(model: str, cp: int, tokens: int, bs: int, decode_bs: int, context: int, page: int,
                 repeats: int) -> str:
    """The heading of a :func:`bench_splits` table: model, sizes, machine and its load."""
    import os

    m = splits_model(model, 8192)
    shape = (f"Llama {m.layers} layers, hidden {m.hidden}, {m.heads} heads / {m.kv_heads} KV heads, MLP "
             f"{m.intermediate}" if model == "llama" else
             f"DeepSeek-V3.2 {m.layers} layers, hidden {m.hidden}, {m.heads} heads, latent {m.kv_lora_rank} + rope "
             f"{m.rope_dim}, indexer {m.index_heads} x {m.index_dim}, top-{m.index_topk}")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"splits: {shape}, fp32; CP {cp} processes in one group (gloo, 1 torch thread each), page {page}; "
            f"prefill {tokens} tokens over bs {bs}, median of {repeats} rounds; decode bs {decode_bs}, context "
            f"{context} (and a ragged batch), median of {4 * repeats} rounds; vs base: prefill / fastest all-gather "
            f"split, decode / owner; moved: bytes received from other ranks, all ranks; reads: context entries of "
            f"the attention family per rank; cpu: per-rank CPU time of a forward. Machine: {os.cpu_count()} CPU "
            f"cores, load average (1/5/15 min) {load} at the end")
