"""The kv dtype benchmark (``cpkv bench kvdtype``): what each ``--kv-dtype``
stores and what it costs in accuracy, every figure measured in the same run
([[RFC-0001:C-KV-FORMAT]]).

* bytes: per model, the same trace through the engine (CP group of threads,
  a host tier) and through disaggregation, at each kv dtype: peak KV bytes per
  rank (pages held times the pool's bytes per page, measured from its
  buffers), host-tier bytes (backups and loads) and transfer bytes, with their
  ratios to float32 and, for fp8, to bfloat16. The models have small hidden
  sizes but the released models' per-token cache shapes (DeepSeek-V3.2 and
  GLM-5: latent 512 + 64 rope, indexer key 128; Llama: 2 KV heads of 128), so
  the ratios are the real ones (DSA fp8 against bf16: (656 + 132) / (1152 + 256)
  = 0.56 where every layer has an indexer);
* accuracy: per model and built-in trace, the run with ``--check``: whether
  it is exact by :mod:`cpkv.engine.exactness` (every stored value a rounding
  of ``transformers``' value that the format allows, every DSA selection its
  top-k up to near-ties, every logit within 1e-4 of ``transformers`` at the
  run's stored values and selection, greedy tokens equal), with the figures:
  the max logit difference, the flips (values stored one rounding step from
  the reference's own rounding, at a boundary) and near-ties (selections that
  differ within float32's noise) it counted; and the divergence from the
  unquantized float model with the greedy agreement (requests whose tokens
  equal the float model's greedy decoding).
"""

from __future__ import annotations

import torch

TRACES = ("multiturn", "shared-prompt", "longdoc")  # the built-in workloads
SCALES = {"longdoc": 0.02}  # built-in lengths times this (default 0.05): a few hundred tokens a request
BASES = {("float32", "bfloat16"), ("float32", "fp8"), ("bfloat16", "fp8")}  # (baseline, kv dtype) ratios shown


def bench_model(name: str):
    """The benchmark's configuration of model ``name`` (one of
    :data:`cpkv.models.MODELS`): small hidden sizes, the released model's
    per-token cache shape (its ``with_released_cache``; see the module doc)."""
    from ...models import model_config

    return model_config(name).with_released_cache()


def _bytes_rows(name: str, adapter, dtypes, cp: int) -> list[dict]:
    from ...engine.config import DisaggConfig, EngineConfig
    from ...engine.disagg import run_disagg_threads
    from ...engine.engine import run_engine_threads

    common = dict(page_size=16, host_pages=48, requests=4, scale=0.08, chunk=64, model=bench_model(name))
    got = {}
    for dt in dtypes:
        e = run_engine_threads(EngineConfig(cp_size=cp, device_pages=6, kv_dtype=dt, **common), adapter)
        d = run_disagg_threads(DisaggConfig(prefill_size=max(cp // 2, 1), decode_size=max(cp // 2, 1), device_pages=12,
                                            decode_page=8, kv_dtype=dt, **common), adapter)
        got[dt] = {"bytes/token": e["kv_bytes_per_token"], "peak KV/rank": max(e["peak_kv_bytes_per_rank"]),
                   "host bytes": e["backup_bytes"] + e["load_bytes"], "transfer bytes": d["bytes_moved"]}
    keys = ("peak KV/rank", "host bytes", "transfer bytes")
    rows = []
    for dt, g in got.items():
        row = {"model": name, "kv dtype": dt, **g}
        for base in ("float32", "bfloat16"):
            row[f"vs {base}"] = (" / ".join(f"{g[k] / max(got[base][k], 1):.3f}" for k in keys)
                                 if base in got and (base, dt) in BASES else "")
        rows.append(row)
    return rows


def _accuracy_rows(name: str, adapter, dtypes, cp: int, traces) -> list[dict]:
    from ...engine.config import EngineConfig
    from ...engine.engine import run_engine_threads
    from ...engine.exactness import failures

    rows = []
    for trace in traces:
        for dt in dtypes:
            r = run_engine_threads(EngineConfig(cp_size=cp, page_size=16, device_pages=16, host_pages=48, requests=3,
                                                scale=SCALES.get(trace, 0.05), chunk=64, workload=trace, kv_dtype=dt,
                                                model=bench_model(name), check=True), adapter)
            c, u, a = r["check"], r["check"]["unquantized"], r["check"]["agreement"]
            rows.append({"model": name, "trace": trace, "kv dtype": dt, "requests": c["requests"],
                         "exact": "; ".join(failures(c)) or "yes",
                         "max |dlogit| vs ref": f"{c['max_abs_diff']:.2e}",
                         "greedy = ref": c["requests_matched"],
                         "flips / values": f"{a['flips']} / {a['values']}",
                         "near-ties / selections": f"{a['near_ties']} / {a['rows']}" if a["rows"] else "",
                         "max |dlogit| vs float32": f"{u['max_abs_diff']:.2e}",
                         "greedy = float32": u["greedy_agreement"]})
    return rows


def bench_kvdtype(dtypes=("float32", "bfloat16", "fp8"), cp: int = 4, models=None, traces=TRACES) -> dict:
    """``{"bytes": rows, "accuracy": rows, "dsa_fp8_vs_bf16": ratio}``: the two
    tables of the module doc for ``dtypes`` on a CP group of ``cp`` thread
    ranks (disaggregation: ``cp // 2`` prefill and ``cp // 2`` decode ranks)
    for ``models`` (default every one of :data:`cpkv.models.MODELS`), and
    DeepSeek-V3.2's peak KV per rank at fp8 over bf16 when both ran."""
    from ...models import MODELS, build_adapter

    torch.set_num_threads(1)
    out = {"bytes": [], "accuracy": []}
    for name in MODELS if models is None else models:
        adapter = build_adapter(bench_model(name))
        out["bytes"] += _bytes_rows(name, adapter, dtypes, cp)
        out["accuracy"] += _accuracy_rows(name, adapter, dtypes, cp, traces)
    peak = {(r["model"], r["kv dtype"]): r["peak KV/rank"] for r in out["bytes"]}
    if ("deepseek-v3.2", "fp8") in peak and ("deepseek-v3.2", "bfloat16") in peak:
        out["dsa_fp8_vs_bf16"] = peak["deepseek-v3.2", "fp8"] / peak["deepseek-v3.2", "bfloat16"]
    return out


def format_kvdtype(report: dict) -> str:
    """The two tables, titled, and the DSA goal line."""
    from ..table import format_rows

    parts = [format_rows(report["bytes"], "kv dtype: bytes on the same trace (multiturn, 4 requests; engine: "
                                          "page 16, host tier; disaggregation: page 16 -> 8); vs = peak KV/rank / "
                                          "host / transfer, measured in this run"),
             format_rows(report["accuracy"], "kv dtype: accuracy per model and built-in trace (3 requests each)")]
    if "dsa_fp8_vs_bf16" in report:
        x = report["dsa_fp8_vs_bf16"]
        parts.append(f"DeepSeek-V3.2 peak KV per rank, fp8 / bf16: {x:.4f} (goal <= 0.57: "
                     f"{'met' if x <= 0.57 else 'NOT met'})")
    return "\n\n".join(parts)
