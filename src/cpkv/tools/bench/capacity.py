"""``cpkv bench capacity``: the shared cache against the replicated one, at equal memory per rank.

Both modes run in the same engine (ranks as threads of this process) with the
same ``kv_memory`` bytes per rank (:func:`~cpkv.runtime.sizing.pages_for_memory`),
and every figure comes from a run that passed ``check`` (every logit against
``transformers`` within ``tolerance``, every request its greedy tokens):

* the longest single request each mode holds: the scheduler's up-front
  refusal (the allocator's lanes, ``TraceError``) marks the limit, found by
  binary search on the prompt length; a request of that length then runs to
  the end. Goal: shared at least ``0.95 x N x`` replicated;
* a long-context trace (``longdoc``: long documents with follow-up questions)
  sized so that the replicated group must evict or preempt: requests
  finished, generated tokens per second, TTFT and TPOT p50/p99 (steps and
  milliseconds), preemptions, evicted pages, prefix hit rate.

Each row gives both figures and their ratio (shared / replicated).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

from ...engine.config import EngineConfig
from ...engine.trace import RequestSpec, TraceError, dump_jsonl

MODES = ("shared", "replicated")


class CheckFailed(RuntimeError):
    """A run of the benchmark did not match ``transformers``: no figure of it is reported."""


def _checked(r: dict, tolerance: float) -> dict:
    c = r["check"]
    if c is None or c["requests_matched"] != c["requests"] or c["max_abs_diff"] > tolerance:
        raise CheckFailed(f"{r['config']['kv']} run failed its check: {c}")
    return r


def fits(cfg: EngineConfig, prompt: int, new_tokens: int) -> bool:
    """Whether the scheduler of ``cfg`` takes one request of ``prompt`` tokens
    and ``new_tokens`` generated ones (it refuses up front one its cache could
    never hold)."""
    from ...engine.engine import build_scheduler

    try:
        build_scheduler(cfg, [RequestSpec("long", 0, (1,) * prompt, new_tokens)])
    except TraceError:
        return False
    return True


def longest_prompt(cfg: EngineConfig, new_tokens: int) -> int:
    """The longest prompt :func:`fits` takes (0 for none): binary search
    between 0 and the group's whole cache."""
    lo, hi = 0, cfg.page_size * cfg.device_pages * cfg.cp_size + 1  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(cfg, mid, new_tokens) else (lo, mid)
    return lo


def _run_specs(cfg: EngineConfig, specs: list[RequestSpec]) -> dict:
    from ...engine.engine import run_engine_threads

    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    try:
        dump_jsonl(specs, path)
        return run_engine_threads(dataclasses.replace(cfg, workload=path))
    finally:
        os.unlink(path)


def measure_capacity(base: EngineConfig, *, new_tokens: int = 4, trace_scale: float = 0.012, documents: int = 6,
                     tolerance: float = 1e-4) -> dict:
    """Both modes of ``base`` (its ``kv_memory``, ``cp_size``, model, pages):
    ``{mode: {"longest": tokens, "longest_run": report, "trace": report}}``.
    Raises :class:`CheckFailed` when a run does not match ``transformers``,
    ``ValueError`` when ``base`` has no ``kv_memory``."""
    if base.kv_memory is None:
        raise ValueError("the capacity benchmark compares the modes at equal memory: give kv_memory")
    out = {}
    rng = np.random.default_rng(base.seed)
    for mode in MODES:
        cfg = dataclasses.replace(base, kv=mode, check=True, host_pages=0)
        n = longest_prompt(cfg, new_tokens)
        if n < 1:
            raise ValueError(f"{base.kv_memory} bytes per rank hold no request in the {mode} cache")
        tokens = tuple(rng.integers(0, cfg.model.vocab, n).tolist())
        run = _checked(_run_specs(cfg, [RequestSpec("long", 0, tokens, new_tokens)]), tolerance)
        trace = _checked(_run_specs(cfg, _trace(base, documents, trace_scale)), tolerance)
        out[mode] = {"longest": n + new_tokens - 1, "longest_run": run, "trace": trace}
    return out


def _trace(base: EngineConfig, documents: int, scale: float, replies: tuple[int, int] = (8, 24)) -> list[RequestSpec]:
    """``longdoc`` at ``scale``, each reply ``replies`` tokens long (drawn
    seeded; ``longdoc``'s own replies shrink with ``scale`` to a token)."""
    from ...engine.trace import longdoc

    rng = np.random.default_rng(base.seed + 1)
    specs = longdoc(documents, seed=base.seed, vocab=base.model.vocab, scale=scale)
    lens = rng.integers(replies[0], replies[1] + 1, len(specs)).tolist()
    return [dataclasses.replace(x, max_new_tokens=n) for x, n in zip(specs, lens)]


def capacity_rows(m: dict) -> list[dict]:
    """The benchmark's table: one row per figure, both modes and shared / replicated."""
    s, r = m["shared"], m["replicated"]
    lat = lambda x, k, q, f=1.0: (x["trace"]["latency"][k][q] or 0.0) * f  # noqa: E731
    figures = [
        ("longest request (KV tokens), ran to the end", s["longest"], r["longest"], "higher"),
        ("trace: requests finished", s["trace"]["finished"], r["trace"]["finished"], "higher"),
        ("trace: generated tokens per second", s["trace"]["tokens_per_second"], r["trace"]["tokens_per_second"],
         "higher"),
    ]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        for q in ("p50", "p99"):
            figures.append((f"trace: {name} {q} (steps)", lat(s, f"{key}_steps", q), lat(r, f"{key}_steps", q),
                            "lower"))
            figures.append((f"trace: {name} {q} (ms)", lat(s, f"{key}_s", q, 1e3), lat(r, f"{key}_s", q, 1e3),
                            "lower"))
    figures += [
        ("trace: preemptions", s["trace"]["preemptions"], r["trace"]["preemptions"], "lower"),
        ("trace: evicted pages", s["trace"]["evicted_pages"], r["trace"]["evicted_pages"], "lower"),
        ("trace: prefix hit rate", s["trace"]["device_hit_rate"], r["trace"]["device_hit_rate"], "higher"),
    ]
    return [{"figure": name, "shared": _fmt(a), "replicated": _fmt(b),
             "shared / replicated": f"{a / b:.2f}" if b else ("=" if a == b else "inf"), "better": better}
            for name, a, b, better in figures]


def _fmt(x) -> str:
    return str(x) if isinstance(x, (int, np.integer)) else f"{x:.3f}"


def bench_capacity(base: EngineConfig, **kw) -> tuple[list[dict], dict]:
    """The table rows and the raw figures of :func:`measure_capacity`."""
    m = measure_capacity(base, **kw)
    return capacity_rows(m), m
