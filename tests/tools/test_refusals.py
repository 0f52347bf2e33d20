"""Bad input is refused in one line, exit 2, before anything is allocated or any process starts: each
refusal of the list a new user hit (a cache of 100 TiB, 10^10 pages, a page table of 10^8 rows, a
scale of 1e308, 10^8 ranks, a cache too small for the trace, a port out of range or busy, another
benchmark's flag, a --cp torchrun disagrees with, a run past --timeout) runs in one interpreter through
``main``, each timed and its peak memory read after it: the refusals together add little to what the
interpreter held once started (``cpkv`` imported, and transformers' Llama code, which the refusals made
after the parse load: seconds on a loaded machine, counted as start-up here). Figures are printed; the
time bound is loose because the machine may be loaded. The sizes refused before anything heavy is
imported are timed one by one in a process of their own by ``tests/tools/test_sizes.py``."""

import json
import socket
import subprocess
import sys
import textwrap

# (argv, the text the one line must hold); {busy} is a port a listening socket holds
CASES = [
    (["run", "--kv-memory", "100TiB"], "--kv-memory 100TiB: the device cache takes"),
    (["run", "--device-pages", "1e10"], "--device-pages 10000000000: the device cache takes"),
    (["run", "--device-pages", "10000000000"], "--device-pages 10000000000: the device cache takes"),
    (["run", "--disagg", "1:1", "--device-pages", "10000000000"], "--device-pages 10000000000: the device cache"),
    (["run", "--host-pages", "1e11"], "--host-pages 100000000000: 4 ranks need about"),
    (["run", "--host-pages", "100000000000"], "--host-pages 100000000000: 4 ranks need about"),
    (["run", "--max-running", "100000000"], "--max-running 100000000: 4 ranks need about"),
    (["run", "--scale", "1e308"], "argument --scale: must be a finite number > 0 and <= 1000"),
    (["run", "--cp", "100000000"], "--cp 100000000: 100000000 ranks, more than this machine schedules"),
    (["run", "--page", "100000"], "--page 100000: more than the longest request's tokens"),
    (["simulate", "--max-running", "1e8"], "--max-running do not apply to built-in traces"),
    (["run", "--disagg", "1000:1000"], "give --disagg 16:16 or smaller"),
    (["run", "--requests", "40", "--scale", "1", "--device-pages", "3"],
     "--device-pages 3: the shared device cache can never hold"),
    (["simulate", "--lane-pages", "1", "--workload", "longdoc"], "--lane-pages 1: longdoc's cache can never hold"),
    (["run", "--kv-events", "tcp://127.0.0.1:99999"], "argument --kv-events: must be a ZMQ endpoint"),
    (["run", "--kv-events", "tcp://127.0.0.1:{busy}"], "--kv-events tcp://127.0.0.1:{busy}: cannot bind it here"),
    (["simulate", "--workload", "longdoc", "--policies", "lane0", "--kv-events", "tcp://127.0.0.1:{busy}"],
     "--kv-events tcp://127.0.0.1:{busy}: cannot bind it here"),
    (["bench", "alloc", "--bs", "3"], "--bs is not a flag of bench alloc; it sets bench splits"),
    (["bench", "scheduler", "--kv-memory", "1MiB"], "--kv-memory is not a flag of bench scheduler"),
    (["run", "--cp", "3", "TORCHRUN"], "--cp 3: torchrun started 2 ranks, one CP group; give --cp 2"),
    (["run", "--workload", "longdoc", "--requests", "20", "--device-pages", "200", "--timeout", "10"],
     "--timeout 10: the run is expected to take about"),
]

SCRIPT = """
import contextlib, io, json, os, resource, sys, time
from cpkv.engine.config import EngineConfig
from cpkv.tools.cli import build_parser, main

EngineConfig(device_pages=8).page_bytes()  # start-up: transformers' Llama code, which sizes a page
build_parser()  # and the parser's own imports

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

torchrun = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29999")
out, base = [], peak()
for argv in json.loads(sys.argv[1]):
    env = "TORCHRUN" in argv
    argv = [a for a in argv if a != "TORCHRUN"]
    if env:
        os.environ.update(torchrun)
    err, t0 = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    dt = time.perf_counter() - t0
    for k in torchrun if env else ():
        del os.environ[k]
    out.append(dict(argv=argv, code=code, lines=err.getvalue().splitlines(), seconds=dt, peak=peak()))
print(json.dumps(dict(base=base, runs=out)))
"""


def test_each_refusal_is_one_line_exit_2_quick_and_allocates_nothing():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [([a.format(busy=port) for a in argv], want.format(busy=port)) for argv, want in CASES]
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), json.dumps([a for a, _ in cases])],
                           capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    worst = 0.0
    for (argv, want), run in zip(cases, got["runs"]):
        line = f"cpkv {argv[0]}: error: "
        assert run["code"] == 2 and len(run["lines"]) == 1, (argv, run)
        assert run["lines"][0].startswith(line) and want in run["lines"][0], (argv, run["lines"])
        assert run["seconds"] < 3.0, (argv, run["seconds"])  # well under a second on an idle machine
        worst = max(worst, run["seconds"])
    grown = got["runs"][-1]["peak"] - got["base"]
    print(f"{len(cases)} refusals: slowest {worst:.2f} s; peak memory {got['base'] / 2**20:.0f} MiB after the "
          f"imports, {grown / 2**20:.1f} MiB more after every refusal")
    assert grown < 64 * 2**20, grown  # nothing of the sizes asked for was allocated


def test_bench_json_is_json_for_every_benchmark_that_prints_rows():
    r = subprocess.run([sys.executable, "-m", "cpkv", "bench", "scheduler", "--batches", "4", "--contexts", "64",
                        "--steps", "2", "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert isinstance(rows, list) and rows and all(isinstance(x, dict) for x in rows)
