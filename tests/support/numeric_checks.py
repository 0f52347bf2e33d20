"""The engine's numeric checks in one process, for a run under another CPU
capability (``ATEN_CPU_CAPABILITY``): ``python numeric_checks.py`` prints one
JSON line: the capability torch runs under, and per check its name, the
failures of :func:`cpkv.engine.exactness.failures` (``[]``: exact), its max
logit difference, flips and near-ties. The checks are those whose numbers
follow the CPU's kernels: DeepSeek-V3.2 in every kv dtype (the page split
and the log-sum-exp decode), GLM-5's shared layers in FP8, Llama in FP8, and
the kv dtype benchmark's DSA row at DeepSeek's cache shapes (its originally
failing configuration, issue 29)."""

import json
import time

import torch


def main() -> None:
    from cpkv.engine import EngineConfig, run_engine_threads
    from cpkv.engine.exactness import failures
    from cpkv.models import build_adapter, model_config
    from cpkv.tools.bench.kvdtype import bench_model

    torch.set_num_threads(1)
    t0 = time.process_time()
    common = dict(cp_size=2, page_size=16, device_pages=10, host_pages=32, requests=3, scale=0.08, chunk=40,
                  check=True)
    runs = [("deepseek-v3.2", dt, "page", "lse", {}) for dt in ("float32", "bfloat16", "fp8")]
    runs += [("glm-5", "fp8", "zigzag", "owner", {}), ("llama", "fp8", "page", "owner", {}),
             ("deepseek-v3.2/bench", "fp8", "page", "owner",
              dict(model=bench_model("deepseek-v3.2"), device_pages=16, host_pages=48, scale=0.05, chunk=64,
                   workload="multiturn"))]
    adapters, out = {}, []
    for name, dt, prefill, decode, kw in runs:
        cfg = EngineConfig(**{**common, "model": model_config(name.split("/")[0]), "kv_dtype": dt,
                              "prefill_split": prefill, "decode_split": decode, **kw})
        ad = adapters.get(name) or adapters.setdefault(name, build_adapter(cfg.model))
        t = time.process_time()
        c = run_engine_threads(cfg, ad)["check"]
        a = c["agreement"]
        out.append({"check": f"{name} {dt} {prefill}/{decode}", "failures": failures(c),
                    "max_abs_diff": c["max_abs_diff"], "flips": a["flips"], "values": a["values"],
                    "near_ties": a["near_ties"], "selections": a["rows"], "cpu_s": round(time.process_time() - t, 2)})
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "checks": out,
                      "cpu_s": round(time.process_time() - t0, 2)}))


if __name__ == "__main__":
    main()
