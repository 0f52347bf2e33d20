#!/usr/bin/env python3
"""The one prepared device run: everything that needs a GPU, on the machine it is meant for, in under 8 minutes.

    python3 tools/gpu_check.py OUT            # on a machine with a CUDA GPU (make gpu-check GPU_OUT=...)
    python3 tools/gpu_check.py --dry-run OUT  # every step on the CPU at tiny sizes (Triton's interpreter)

Without a CUDA GPU (and without ``--dry-run``) it prints one line and exits 2
before writing anything.

Runs with the interpreter that runs it (the machine's own ``python3`` and its
packages) and cpkv from this checkout's ``src/`` (no install, no network). A
package cpkv needs that does not import is named, with the wheel that would
carry it. Writes exactly two files into OUT: ``results.json`` (one section per
step, rewritten after every step) and ``log.txt`` (every step's output);
prints each step's result the moment it ends (with the tail of its output when
it failed), then the summary, last (what comes back of a long output is its
end); exits 1 if any step failed (2 for a misuse of this script). A failed
``versions`` step (a package missing, ``transformers`` outside the range the
``--check`` reference is tested with, no GPU) ends the run there. Every wait is
bounded: a step past its deadline is killed with its process group and
reaped for at most :data:`REAP_S` seconds, an engine run's process group
the same.

Steps, in order, each in a process of its own with a deadline (a hung CUDA call
or a CUDA error cannot stall or poison the rest; one at a time on a GPU, two at
a time in the dry run: :data:`LANES`), the whole run within
:data:`TOTAL_S` seconds, every later step keeping its reserve of it:

1. ``versions``: Python, torch (its CUDA), triton, transformers (refused outside
   :data:`~cpkv.models.round_trip.TRANSFORMERS_TESTED`, >=5.17,<6), the GPU(s);
2. ``kernels``: every Triton kernel compiled on CUDA against the torch
   reference, float32/float16/bfloat16, small and real shapes (GQA Hkv 8 D 128,
   MLA latent 512 + 64, indexer 64 x 128, page 64), the FP8 caches at the real
   shapes, and the read through a segment table (the group's memory as N
   segments) against the same bytes in one buffer (several processes at once:
   compiling is what takes the time);
3. the kernels' speed (:mod:`cpkv.tools.bench.kernels`, issue #28's figures,
   each against a baseline timed in the same step): ``decode`` (bytes per
   second at batch 1, 8, 64 x 32K, 128K as a fraction of a device-to-device
   copy, from one buffer and through the segment table of 8 ranks' pages,
   the goal judged on the table), ``sparse_mla`` and ``indexer`` (DeepSeek-V3.2's shapes, the same
   fraction), ``store`` (the same fraction), ``prefill`` (32K tokens against
   torch's SDPA, flash), ``lse_split`` (each rank's decode under the
   log-sum-exp split at N 1, 2, 4 on one GPU);
4. ``engine``: ``cpkv run --device cuda --check`` for Llama and DeepSeek-V3.2 at
   N 1, 2 and 4 on one GPU (every split among them), float32, bfloat16 and
   FP8 caches each at N 1, 2 and 4, one of each model with a device cache
   small enough to evict to the host tier and load back (whether the host
   tier was page-locked, ``host_pinned``), and ``--kv replicated``; each run
   exact (:func:`cpkv.engine.exactness.failures`: stored values compared,
   more than none). The dry run runs every one of them on the CPU, the same
   flags, its ranks as threads;
5. ``ipc``: N = 2, 3, 4 ranks on one GPU: own segments, CUDA IPC, the fence,
   reads through the view round after round, and the read path alone (the
   batch planned once, the run step in a CUDA graph) through the view timed
   against a local read of the same bytes.

The budget, first run (cold Triton compiles) on one H200, estimated (no GPU
has run it yet): versions ~10 s; kernels ~40 s (about 90 compiled kernels of
1-5 s, 8 processes); the six timed steps ~15 s each (a process and its CUDA
context, 1-5 kernels compiled, the timing itself under a second: CUDA-graph
replays, a few milliseconds a round); engine ~130 s (9 runs, 4 at a time,
each its rank processes importing transformers and compiling their kernels);
ipc ~50 s. About 320 s expected against :data:`TOTAL_S` = 330; deadlines and
reserves bound a slow step. With the device tool: one call with a
``timeout_s`` of 420 (the script's 330 s, Python and CUDA start-up, the
copy of the results), which leaves, of a session's 15 minutes, the machine's
start and a second call with ``--only`` the steps that failed.

A step is one function ``step_NAME(dry) -> dict`` (its results section, with
``ok``) and one :class:`Step` entry in :data:`STEPS`: adding a benchmark is
writing that function and that line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
#: The whole run's budget (seconds), inside the 8 minutes it must end in on one H200; the dry run's (a CPU
#: shared with other work may be slow: these only bound a broken dry run).
TOTAL_S, DRY_TOTAL_S = 330.0, 900.0
#: Seconds a killed process (a step's, an engine run's) is waited for after SIGKILL before the run goes on
#: without it (a process stuck in the driver may never be reaped).
REAP_S = 10.0
#: The environment variable that tells a step's process its deadline (seconds since the epoch).
DEADLINE_ENV = "GPU_CHECK_DEADLINE"
#: Lines of a failed step's output printed when it ends.
TAIL_LINES = 40
#: What cpkv imports on this path, and the wheel that would carry each when it is missing.
REQUIRED = {"torch": "torch (the CUDA build of the machine)", "numpy": "numpy-*-cp312-*manylinux*.whl",
            "triton": "triton-*-cp312-*manylinux*.whl", "transformers": "transformers-*-py3-none-any.whl",
            "tqdm": "tqdm-*-py3-none-any.whl"}


def _env() -> dict:
    """The steps' environment: cpkv from ``src/``, unbuffered output, and the
    caching allocator's ``expandable_segments`` off (cpkv refuses it: its KV
    segments are shared over CUDA IPC)."""
    env = dict(os.environ)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if var in env:
            env[var] = re.sub(r"expandable_segments\s*:\s*(true|1)", "expandable_segments:False", env[var],
                              flags=re.IGNORECASE)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# -- the steps ------------------------------------------------------------------------------------------
def step_versions(dry: bool) -> dict:
    """The interpreter, the packages cpkv needs (a missing one named with its wheel) and the device."""
    out = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
           "packages": {}, "missing": []}
    for name, wheel in REQUIRED.items():
        try:
            out["packages"][name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - reported: what is missing and what would carry it
            out["missing"].append(f"{name} does not import ({type(e).__name__}: {e}); carry its wheel ({wheel}) "
                                  "and install it with pip --no-index")
    import torch

    out["alloc_conf"] = {v: os.environ[v] for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                         if v in os.environ}
    out["cuda_build"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    out["devices"] = [{"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
                       "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                      for i in range(torch.cuda.device_count())] if out["cuda_available"] else []
    import cpkv

    out["cpkv"] = str(Path(cpkv.__file__).parent)
    problems = list(out["missing"])
    if "transformers" in out["packages"]:
        from cpkv.models.round_trip import TRANSFORMERS_TESTED, transformers_refusal

        (lo, hi) = TRANSFORMERS_TESTED
        out["transformers_tested"] = f">={lo[0]}.{lo[1]},<{hi[0]}"
        why = transformers_refusal(out["packages"]["transformers"])
        if why:
            problems.append(why)
    if not dry and not out["cuda_available"]:
        problems.append(f"needs a CUDA GPU; torch {torch.__version__} sees none here (use --dry-run on the CPU)")
    out["ok"] = not problems
    if problems:
        out["error"] = "; ".join(problems)
    return out


def step_kernels(dry: bool) -> dict:
    """Every kernel against the torch reference (:func:`cpkv.tools.gpu_probe.kernels_section`)."""
    from cpkv.tools.gpu_probe import kernels_section

    return kernels_section("cpu" if dry else "cuda", dry)


def _bench(fn, dry: bool, goal: str | None = None, met=None, **sizes) -> dict:
    """A timed kernel section of :mod:`cpkv.tools.bench.kernels` as a step's
    section: on the GPU at ``sizes``, dry at its own tiny sizes; ``ok`` when
    every figure is a positive finite number; ``goal`` (issue #28's) and
    whether ``met(section)`` meets it, recorded, not judged."""
    section = fn(dry_run=True) if dry else fn(device="cuda", **sizes)
    figures = [v for row in section["rows"] for k, v in row.items()
               if k.endswith(("seconds", "per_second", "fraction_of_copy", "ratio", "vs_one_rank", "vs_buffer"))]
    bad = [v for v in figures if not (isinstance(v, (int, float)) and 0 < v < float("inf"))]
    section["ok"] = bool(figures) and not bad
    if bad:
        section["error"] = f"figures that are not positive and finite: {bad[:5]}"
    if goal:
        section["goal"], section["goal_met"] = goal, (None if dry else bool(met(section)))
    return section


def _fractions(section: dict) -> list[float]:
    return [r["fraction_of_copy"] for r in section["rows"]]


def step_decode(dry: bool) -> dict:
    """Paged GQA decode (bfloat16, Hkv 8 x D 128, 32 heads, page 64, 8 ranks' pages) at batch 1, 8, 64 x
    contexts 32K, 128K: K/V bytes per second as a fraction of a device-to-device copy timed in the same step,
    from one buffer and through the segment table (what a group runs: the goal is judged there)."""
    from cpkv.tools.bench.kernels import bench_decode

    return _bench(bench_decode, dry, "at least 0.7 of the copy at every size, through the segment table",
                  lambda s: min(r["table_fraction_of_copy"] for r in s["rows"]) >= 0.7, repeats=10)


def step_sparse_mla(dry: bool) -> dict:
    """DeepSeek-V3.2's sparse MLA decode (latent 512 + 64, top-k 2048, 16 and 128 heads) at batch 1, 8, 64."""
    from cpkv.tools.bench.kernels import bench_sparse_mla

    return _bench(bench_sparse_mla, dry, "at least 0.7 of the copy at batch 64",
                  lambda s: min(r["fraction_of_copy"] for r in s["rows"] if r["batch"] == 64) >= 0.7, repeats=10)


def step_indexer(dry: bool) -> dict:
    """DeepSeek-V3.2's lightning indexer (64 heads x 128) at batch 1, 8, 64 x contexts 32K, 128K."""
    from cpkv.tools.bench.kernels import bench_indexer

    return _bench(bench_indexer, dry, "at least 0.7 of the copy at every size",
                  lambda s: min(_fractions(s)) >= 0.7, repeats=10)


def step_store(dry: bool) -> dict:
    """The store of 64 (a decode batch) and 32,768 (a prefill chunk) entries of K or V: bytes read and written."""
    from cpkv.tools.bench.kernels import bench_store

    return _bench(bench_store, dry, "at least 0.5 of the copy at 32K tokens",
                  lambda s: s["rows"][-1]["fraction_of_copy"] >= 0.5, repeats=10)


def step_prefill(dry: bool) -> dict:
    """A 32K-token causal prefill: the Triton extend kernel over the paged cache against torch's flash SDPA."""
    from cpkv.tools.bench.kernels import bench_prefill

    return _bench(bench_prefill, dry, "within 1.5x of SDPA (flash)", lambda s: s["rows"][0]["ratio"] <= 1.5,
                  repeats=5)


def step_lse_split(dry: bool) -> dict:
    """Decode under the log-sum-exp split at N 1, 2, 4 on one GPU (batch 8 x 128K): the slowest rank's time."""
    from cpkv.tools.bench.kernels import bench_lse_split

    return _bench(bench_lse_split, dry, "the slowest rank's time falls with N",
                  lambda s: all(a["slowest_rank_seconds"] > b["slowest_rank_seconds"]
                                for a, b in zip(s["rows"], s["rows"][1:])), repeats=10)


@dataclass(frozen=True)
class Run:
    """One ``cpkv run --check``: its name, flags, and whether it must evict to the host tier and load back."""

    name: str
    flags: tuple[str, ...]
    evicts: bool = False


def engine_runs(dry: bool) -> list[Run]:
    """The engine runs: Llama and DeepSeek-V3.2 at N 1, 2, 4 on one device
    with every split among them; float32, bfloat16 and FP8 caches each at
    N 1, 2 and 4; one evicting run per model; the replicated cache. The dry
    run runs every one on the CPU with the same flags (:func:`step_engine`)."""
    common = ("--scale", "0.06", "--chunk", "40", "--page", "16")
    llama, dsa = ("--model", "llama", "--requests", "4"), ("--model", "deepseek-v3.2", "--requests", "3")
    evict = ("--device-pages", "5", "--host-pages", "48")  # 5 pages a lane: backups and host loads (measured)
    pages = ("--device-pages", "64")
    bf16, fp8 = ("--kv-dtype", "bfloat16"), ("--kv-dtype", "fp8")
    return [
        Run("llama-n1", (*llama, *common, "--cp", "1", *pages)),
        Run("llama-n1-fp8", (*llama, *common, "--cp", "1", *pages, *fp8)),
        Run("dsa-n1-bf16", (*dsa, *common, "--cp", "1", *pages, *bf16)),
        Run("llama-n2-evict-lse-bf16", (*llama, *common, "--cp", "2", *evict, "--decode-split", "lse", *bf16),
            evicts=True),
        Run("dsa-n2-evict-zigzag-lse-fp8", (*dsa, *common, "--cp", "2", *evict, "--prefill-split", "zigzag",
                                            "--decode-split", "lse", *fp8), evicts=True),
        Run("llama-n2-replicated", (*llama, *common, "--cp", "2", *pages, "--kv", "replicated")),
        Run("llama-n4-interleave-bf16", (*llama, *common, "--cp", "4", *pages, "--prefill-split", "interleave",
                                         *bf16)),
        Run("dsa-n4", (*dsa, *common, "--cp", "4", *pages)),
        Run("dsa-n4-fp8", (*dsa, *common, "--cp", "4", *pages, *fp8)),
    ]


def _argv(run: Run, dry: bool, timeout: float) -> list[str]:
    """``cpkv run``'s command line of ``run``."""
    return ["run", *run.flags, "--device", "cpu" if dry else "cuda", "--check", "--json", "--no-progress",
            "--timeout", str(int(timeout))]


def time_left(margin: float = 10.0) -> float:
    """Seconds this step may still use, ``margin`` kept for writing its section
    (from the deadline its parent set in :data:`DEADLINE_ENV`; an hour without one)."""
    at = os.environ.get(DEADLINE_ENV)
    return (float(at) - time.time() - margin) if at else 3600.0


def run_bounded(cmd: list[str], timeout: float, **kw) -> tuple[int | None, str, str]:
    """``cmd`` in a process group of its own, its output captured: ``(exit
    code, stdout, stderr)``; past ``timeout`` seconds the whole group (the
    processes it started with it) is killed and the code is ``None``. No
    wait is unbounded: after the kill, the output is read for at most
    :data:`REAP_S` seconds (a process stuck in a driver call may never
    close its pipes)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **kw)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = p.communicate(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            out, err = "", f"(its output not readable within {REAP_S:.0f} s of the kill)"
        return None, out or "", err or ""


def _engine_run(run: Run, dry: bool, timeout: float) -> dict:
    """``python -m cpkv run`` of ``run`` in a process group of its own, judged (:func:`_judge`)."""
    timeout = min(timeout, time_left() - 20)
    if timeout < 10:
        return {"ok": False, "command": " ".join(run.flags), "error": "not run: the step's deadline is too close"}
    cmd = [sys.executable, "-m", "cpkv", *_argv(run, dry, timeout)]
    t0 = time.perf_counter()
    rc, stdout, stderr = run_bounded(cmd, timeout + 20, env=_env(), cwd=ROOT)
    out = {"command": " ".join(cmd[1:]), "rc": rc, "seconds": time.perf_counter() - t0, "output": stderr[-4000:]}
    if rc is None:
        out.update(ok=False, error=f"no answer within {timeout + 20:.0f} s: its process group killed")
        return out
    try:
        r = json.loads(stdout)
    except ValueError:
        out.update(ok=False, error=f"exit {rc}, no JSON report")
        return out
    return _judge(run, r, out, dry)


def _engine_here(run: Run, timeout: float) -> dict:
    """The dry run's engine run: ``cpkv run``'s command line of ``run`` through
    the command's own parser and checks (the configuration it would run), then
    that configuration with its ranks as threads of this process (no process
    that imports transformers again), the report as the command prints it
    (JSON), judged (:func:`_judge`). A run that raises is a failed run (its
    error recorded); the others still run."""
    from cpkv.engine import run_engine_threads
    from cpkv.tools.cli import parse_command

    t0 = time.perf_counter()
    out = {"command": "cpkv " + " ".join(_argv(run, True, timeout)) + "  (ranks as threads)", "rc": 0, "output": ""}
    try:
        cfg = parse_command(_argv(run, True, timeout)).config
        r = json.loads(json.dumps({k: v for k, v in run_engine_threads(cfg).items()
                                   if k not in ("occupancy", "host_occupancy", "sequences")}, default=str))
    except BaseException as e:  # noqa: BLE001 - SystemExit (a refused command line) too: the run's failure
        out.update(ok=False, rc=getattr(e, "code", 1), seconds=time.perf_counter() - t0,
                   error=f"{type(e).__name__}: {e}")
        return out
    out["seconds"] = time.perf_counter() - t0
    return _judge(run, r, out, True)


def _judge(run: Run, r: dict, out: dict, dry: bool) -> dict:
    """``out`` (the run's command, exit code, seconds, output) with ``r``'s
    figures (the report ``cpkv run --json`` prints) and ``ok``: exit 0, exact
    against transformers (:func:`cpkv.engine.exactness.failures`: logits,
    greedy tokens, stored values compared and each a rounding the format
    allows), every request finished, the eviction round trip where ``run``
    evicts, the triton kernels on a GPU."""
    from cpkv.engine.exactness import failures

    c = r.get("check")
    out.update(kernels=r["config"].get("kernels"), device=r["config"].get("device"),
               kv_dtype=r["config"].get("kv_dtype"), requests=r["requests"],
               max_abs_diff=(c or {}).get("max_abs_diff"), requests_matched=(c or {}).get("requests_matched"),
               logits_checked=(c or {}).get("logits_checked"), values_compared=(c or {}).get("values_compared"),
               backup_pages=r["backup_pages"], load_pages=r["load_pages"], evicted_pages=r["evicted_pages"],
               engine_seconds=r["seconds"], host_pinned=[x.get("host_pinned") for x in r.get("ranks", [])])
    problems = []
    if out["rc"] != 0:
        problems.append(f"exit {out['rc']}")
    problems += failures(c)
    if r["requests"] != r["finished"]:
        problems.append(f"{r['finished']} of {r['requests']} requests finished")
    if run.evicts and not (r["backup_pages"] > 0 and r["load_pages"] > 0):
        problems.append(f"no eviction round trip (backup_pages {r['backup_pages']}, load_pages {r['load_pages']})")
    if not dry and out["kernels"] != "triton":
        problems.append(f"ran the {out['kernels']} kernels, not triton")
    out["ok"] = not problems
    if problems:
        out["error"] = "; ".join(problems)
    return out


def step_engine(dry: bool) -> dict:
    """``cpkv run --device cuda --check`` for every :func:`engine_runs` run,
    four at a time, each in a process group of its own (:func:`run_bounded`).
    The dry run: every run on the CPU, the same flags, one after another
    (:func:`_engine_here`; the command's own process and its rank processes
    are what ``tests/tools`` and ``tests/engine`` run)."""
    runs = engine_runs(dry)
    if dry:
        results = {r.name: _engine_here(r, 300.0) for r in runs}
    else:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = dict(zip([r.name for r in runs], pool.map(lambda r: _engine_run(r, dry, 150.0), runs)))
    for name, r in results.items():  # the runs' own output, into the log
        print(f"--- {name}: {'ok' if r['ok'] else 'FAILED: ' + r.get('error', '')}: {r.get('command')}\n"
              f"{r.get('output', '')}")
    return {"ok": all(r["ok"] for r in results.values()), "host_tier": host_tier(results.values(), dry),
            "runs": {n: {k: v for k, v in r.items() if k != "output"} for n, r in results.items()}}


def host_tier(runs, dry: bool) -> str:
    """Whether the host tier's shared memory was page-locked for CUDA
    (``cudaHostRegister``, portable) in the runs that had one: a refusal only
    warns and leaves it pageable (copies then stage through pinned memory),
    so the run passes either way and this line tells which it was."""
    pins = [p for r in runs for p in (r.get("host_pinned") or []) if p is not None]
    if not pins:
        return "no host tier ran"
    if dry:
        return "not page-locked: no CUDA in the dry run"
    if all(pins):
        return f"page-locked (cudaHostRegister took) on all {len(pins)} rank(s) that had one"
    return (f"pageable on {pins.count(False)} of {len(pins)} rank(s): cudaHostRegister was refused (see the runs' "
            "output for its error); copies staged through pinned memory")


def step_ipc(dry: bool) -> dict:
    """N ranks on one device: segments, IPC, the fence (:func:`cpkv.tools.gpu_probe.ipc_section`)."""
    from cpkv.tools.gpu_probe import ipc_section

    sizes = (2,) if dry else (2, 3, 4)
    return ipc_section("cpu" if dry else "cuda", dry, sizes=sizes,
                       timeout=max(10.0, min(150.0 if dry else 60.0, time_left() / len(sizes))))


@dataclass(frozen=True)
class Step:
    """One step: ``fn(dry) -> section`` run in its own process within
    ``deadline_s`` seconds on a GPU, ``dry_deadline_s`` in the dry run, and
    never into the ``reserve_s`` seconds every later step keeps of the total."""

    name: str
    fn: Callable[[bool], dict]
    deadline_s: float
    dry_deadline_s: float
    reserve_s: float = 0.0

    def deadline(self, dry: bool) -> float:
        """This step's deadline in seconds."""
        return self.dry_deadline_s if dry else self.deadline_s


STEPS = [
    Step("versions", step_versions, 30, 90, reserve_s=10),
    Step("kernels", step_kernels, 90, 180, reserve_s=40),
    Step("decode", step_decode, 35, 90, reserve_s=15),
    Step("sparse_mla", step_sparse_mla, 35, 90, reserve_s=15),
    Step("indexer", step_indexer, 30, 90, reserve_s=12),
    Step("store", step_store, 25, 90, reserve_s=10),
    Step("prefill", step_prefill, 30, 90, reserve_s=12),
    Step("lse_split", step_lse_split, 30, 90, reserve_s=12),
    Step("engine", step_engine, 190, 420, reserve_s=130),
    Step("ipc", step_ipc, 80, 180, reserve_s=50),
]


# -- running the steps -------------------------------------------------------------------------------------
def _child(name: str, dry: bool, result: str) -> int:
    """Inside a step's process: run it and write its section to ``result``."""
    sys.path.insert(0, str(SRC))
    step = next(s for s in STEPS if s.name == name)
    try:
        section = step.fn(dry)
    except BaseException as e:  # noqa: BLE001 - the parent records it as the step's failure
        import traceback

        traceback.print_exc()
        section = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(f"{name}: {json.dumps(section, indent=1, default=str)}")  # the whole section, into the log too
    Path(result).write_text(json.dumps(section, default=str))
    return 0


#: Steps run at once: one on a GPU (each step's figures are taken alone on it), two in the dry run (the CPU
#: steps are independent; two cores halve its wall time).
LANES, DRY_LANES = 1, 2


@dataclass
class _Running:
    """A step's process while it runs: its pid, start, deadline (monotonic), files."""

    step: Step
    pid: int
    limit: float
    started: float
    end: float
    result: Path
    log: Path


def _start_step(step: Step, dry: bool, limit: float, tmp: Path) -> _Running:
    """Start ``step`` in a process of its own (a fork of this one, which has
    imported torch once: a step's process starts warm, and CUDA starts in it,
    never here), its own process group (its children with it), its output
    into a log, to be killed with its group at ``limit`` seconds
    (:func:`_poll_step`)."""
    result, log = tmp / f"{step.name}.json", tmp / f"{step.name}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid == 0:  # the step's process
        rc = 1
        try:
            os.setsid()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.chdir(ROOT)
            os.environ[DEADLINE_ENV] = str(time.time() + limit)
            sys.stdout.reconfigure(line_buffering=True)
            sys.stderr.reconfigure(line_buffering=True)
            rc = _child(step.name, dry, str(result))
        except BaseException:  # noqa: BLE001 - into the log; the parent sees no result
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    os.close(fd)
    now = time.monotonic()
    return _Running(step, pid, limit, now, now + limit, result, log)


def _poll_step(run: _Running, origin: float) -> tuple[dict, str] | None:
    """``None`` while ``run``'s process runs within its deadline; else its
    record (``ok``, when it started and ended in seconds after ``origin``
    (monotonic), seconds, deadline, CPU seconds of the step and the processes it waited
    for, its section or its error) and its output, the process group killed
    when the deadline passed."""
    done, status, usage = os.wait4(run.pid, os.WNOHANG)
    reaped = True
    if done:
        rc = os.waitstatus_to_exitcode(status)
    elif time.monotonic() > run.end:
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        until = time.monotonic() + REAP_S  # bounded: a process stuck in the driver may never be reaped
        while not (done := os.wait4(run.pid, os.WNOHANG))[0] and time.monotonic() < until:
            time.sleep(0.05)
        reaped, usage, rc = bool(done[0]), done[2], None
    else:
        return None
    text = run.log.read_text(errors="replace")
    ended = time.monotonic()
    record = {"ok": False, "started_s": round(run.started - origin, 2), "ended_s": round(ended - origin, 2),
              "seconds": round(ended - run.started, 2), "deadline_s": round(run.limit, 1),
              "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2)}
    if rc is None:
        record["error"] = f"past its deadline of {run.limit:.0f} s: stopped" + (
            "" if reaped else f" (killed, not reaped within {REAP_S:.0f} s: left behind)")
    elif not run.result.exists():
        record["error"] = f"its process exited {rc} without a result"
    else:
        section = json.loads(run.result.read_text())
        record.update(ok=bool(section.get("ok")) and rc == 0, section=section)
        if "error" in section:
            record["error"] = section["error"]
    return record, text


def _failures(section: dict, path: str = "") -> list[str]:
    """Where inside a section something failed (entries whose ``ok`` is false), for the summary."""
    out = []
    for k, v in section.items() if isinstance(section, dict) else ():
        if isinstance(v, dict):
            if v.get("ok") is False:
                out.append(f"{path}{k}: {v.get('error', 'failed')}")
            out += _failures(v, f"{path}{k}.")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, dict) and x.get("ok") is False:
                    name = x.get("shape", i), x.get("dtype", "")
                    out.append(f"{path}{k}[{' '.join(map(str, name))}]: {x.get('error', x.get('checks'))}")
    return out


def _write(results: dict, done: dict[str, tuple[dict, str]], todo: list[Step], start: float, out: Path) -> list[str]:
    """``results.json`` and ``log.txt`` in ``out`` with the steps ``done`` so
    far (name -> record, output), in the steps' order; the log's sections."""
    results["steps"] = {s.name: done[s.name][0] for s in todo if s.name in done}
    logs = [f"===== {n}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s\n{done[n][1]}"
            for n, r in results["steps"].items()]
    results["seconds"] = round(time.monotonic() - start, 2)
    results["ok"] = bool(results["steps"]) and all(r["ok"] for r in results["steps"].values())
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "log.txt").write_text("\n".join(logs))
    return logs


def _has_cuda() -> bool:
    """Whether torch sees a CUDA GPU, asked in a forked child (this process
    must not start CUDA: every step's process is a fork of it)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            code = 0 if torch.cuda.is_available() else 1
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _step_line(name: str, r: dict) -> str:
    """One step's result: name, ok or FAILED, seconds, its error; the host tier; where inside it failed."""
    lines = [f"  {name:10s} {'ok    ' if r['ok'] else 'FAILED'} {r['seconds']:7.1f} s"
             + (f"  {r['error']}" if r.get("error") else "")]
    if "host_tier" in r.get("section", {}):
        lines.append(f"      host tier: {r['section']['host_tier']}")
    lines += [f"      {where}" for where in _failures(r.get("section", {}))[:10]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every step into ``OUT`` (see the module docstring); the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="output folder: results.json and log.txt are written there")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny sizes")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all, in order)")
    args = ap.parse_args(argv)
    if not args.out:
        ap.error("give the output folder")
    names = [s.name for s in STEPS]
    only = names if args.only is None else args.only.split(",")
    if any(n not in names for n in only):
        ap.error(f"--only takes step names from {names}, got {args.only}")
    os.environ.update(_env())  # what every step's process and the processes it starts run with
    try:  # once, here: every step's process is a fork of this one and starts with torch imported (CUDA never here)
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001 - the versions step names what does not import
        pass
    if not args.dry_run and not _has_cuda():
        print("gpu_check: no CUDA GPU here (torch sees none): nothing run, nothing written; on the CPU: "
              "python3 tools/gpu_check.py --dry-run OUT", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"tool": "tools/gpu_check.py", "dry_run": args.dry_run,
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "total_budget_s": DRY_TOTAL_S if args.dry_run else TOTAL_S, "ok": False, "steps": {}}
    start = time.monotonic()
    todo = [s for s in STEPS if s.name in only]
    print(f"gpu_check{' (dry run)' if args.dry_run else ''}: {len(todo)} step(s) into {out}, within "
          f"{results['total_budget_s']:.0f} s", flush=True)
    done: dict[str, tuple[dict, str]] = {}
    lanes, waiting, running = DRY_LANES if args.dry_run else LANES, list(todo), []
    with tempfile.TemporaryDirectory(prefix="cpkv_gpu_check_") as tmp:
        while waiting or running:
            # start the next step in order; none beside the versions step (its failure ends the run)
            while waiting and len(running) < lanes and not any(r.step.name == "versions" for r in running):
                if "versions" in done and not done["versions"][0]["ok"]:  # nothing else can run: end here
                    for step in waiting:
                        done[step.name] = {"ok": False, "error": "not run: the versions step failed",
                                           "seconds": 0.0}, ""
                    waiting = []
                    break
                step = waiting.pop(0)
                later = 0.0 if args.dry_run else sum(s.reserve_s for s in waiting)
                left = results["total_budget_s"] - (time.monotonic() - start) - later
                if left < 5:
                    done[step.name] = {"ok": False, "error": "not run: the total budget is spent", "seconds": 0.0}, ""
                else:
                    running.append(_start_step(step, args.dry_run, min(step.deadline(args.dry_run), left), Path(tmp)))
            ended = {r.step.name: got for r in running if (got := _poll_step(r, start)) is not None}
            if running and not ended:
                time.sleep(0.05)
                continue
            running = [r for r in running if r.step.name not in ended]
            done.update(ended)
            _write(results, done, todo, start, out)  # after every step, in the steps' order
            for name, (r, text) in ended.items():  # each step's result as it ends, a failure with its output's tail
                print(_step_line(name, r), flush=True)
                if not r["ok"] and text:
                    tail = text.splitlines()[-TAIL_LINES:]
                    print(f"--- the last {len(tail)} lines of {name}'s output:\n" + "\n".join(tail), flush=True)
        _write(results, done, todo, start, out)
    print(f"\ngpu_check{' (dry run)' if args.dry_run else ''}: {'ok' if results['ok'] else 'FAILED'} in "
          f"{results['seconds']} s; {out / 'results.json'}, {out / 'log.txt'}")
    for name, r in results["steps"].items():  # the summary, last
        print(_step_line(name, r))
    sys.stdout.flush()
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
