"""Every size of every command, refused right, fast and in one line before anything heavy is imported
(:mod:`cpkv.tools.sizes`).

* The table: every size flag of :data:`~cpkv.tools.sizes.FLAGS`, on every command and benchmark that takes it,
  at 0, negative, 1e12, 100TiB and ``abc``: each refused (exit 2) in one line naming the flag (0 is a value of
  the flags where it means "none"). All cases run in one interpreter, each timed, its peak memory read at the
  end, torch never imported; then the real command of each subcommand runs once as a process of its own, its
  CPU time and peak RSS read from ``RUSAGE_CHILDREN`` in a wrapper that starts nothing else.
* Every advice followed: each refusal that says ``give FLAG VALUE`` is given VALUE back, on a machine of fixed
  size, through the size check and the command's own validation: that flag is not refused again.
* The check and the parser agree (option strings, types); the built-in models' figures the check reads are the
  models' own (built on the meta device).
* Combinations that do nothing are refused; trace files of random bytes, truncated lines or binary are refused
  with ``path:line`` and never a traceback (hypothesis).
"""

import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cpkv.runtime.sizing as sizing_mod
from cpkv.runtime.sizing import MachineCapacity
from cpkv.tools import sizes
from cpkv.tools.flags import BENCH_FLAGS
from cpkv.tools.sizes import FLAGS, MOONCAKE_ONLY, Refused, check_sizes, size_flags

GiB = 2**30
BAD = ("0", "-1", "1e12", "100TiB", "abc", "1e400")
#: Flags whose 0 means none (a host tier of no pages, the first layer).
ZERO_IS_A_VALUE = {"host_pages", "host_memory", "index_skip_topk_offset"}
VALUES = {"disagg": ("0:1", "-1:1", "1e12:1", "1000000000000:1", "100TiB", "abc", "1e400:1")}
#: Values of the table that are right: a modelled host tier of 1e12 bytes (the default is 1 TiB, half a DGX H200's);
#: ``cpkv bytes`` of a group of 1e12 ranks (arithmetic on a deployment's shapes: nothing is sized by it).
RIGHT = {("simulate", "host_memory", "1e12"), ("bytes", "cp", "1e12")}
#: The promises: one refusal within this much of the process's CPU, and the process's peak RSS under this.
CPU_S, RSS_BYTES = 1.0, 200 * 2**20


def mooncake_trace(path: Path) -> str:
    """A small Mooncake trace: three requests, two sharing a prefix block."""
    lines = [{"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]},
             {"timestamp": 5, "input_length": 700, "output_length": 9, "hash_ids": [0, 2]},
             {"timestamp": 9, "input_length": 300, "output_length": 4, "hash_ids": [3]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def bases(command: str, dest: str, mc: str) -> list[list[str]]:
    """The command lines a size flag applies to (its benchmarks, its kind of simulated trace)."""
    if command == "run":
        return [["run", "--disagg", "1:1"]] if dest == "decode_page" else [["run"]]
    if command == "simulate":
        return [["simulate", "--workload", f"mooncake:{mc}"]] if dest in MOONCAKE_ONLY else [
            ["simulate", "--workload", "longdoc"]]
    if command == "bytes":
        return [["bytes", "--model", "glm-5"]] if dest.startswith("index") else [["bytes"]]
    out = []
    for what in sorted(BENCH_FLAGS):
        if dest in BENCH_FLAGS[what]:
            extra = ["--workload", f"mooncake:{mc}"] if what == "capacity" and dest == "requests" else []
            out.append(["bench", what, *extra])
    return out


def table(mc: str) -> list[tuple[list[str], str, bool]]:
    """``(argv, flag, refused?)`` for every size flag, command line and bad value."""
    rows = []
    for command in ("run", "simulate", "bench", "bytes"):
        for f in size_flags(command):
            for base in bases(command, f.dest, mc):
                for v in VALUES.get(f.dest, BAD):
                    right = (v == "0" and f.dest in ZERO_IS_A_VALUE) or (command, f.dest, v) in RIGHT
                    rows.append((base + [f.names[0], v], f.names[0], not right))
    return rows


DRIVER = r"""
import contextlib, io, json, sys, time
t0 = time.process_time()
from cpkv.tools.sizes import refuse_sizes
out = []
for argv in json.loads(sys.argv[1]):
    err, t = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err):
        try:
            refuse_sizes(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out.append(dict(code=code, lines=err.getvalue().splitlines(), seconds=time.perf_counter() - t))
heavy = sorted(m for m in ("torch", "transformers", "triton", "matplotlib") if m in sys.modules)
# this process's own peak (VmHWM: its memory since exec; ru_maxrss would carry the forking pytest's)
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps(dict(runs=out, peak=peak, heavy=heavy, cpu=time.process_time() - t0)))
"""


def test_every_size_flag_at_every_bad_value_is_refused_in_one_line_fast_and_light(tmp_path):
    mc = mooncake_trace(tmp_path / "mc.jsonl")
    rows = table(mc)
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([a for a, _, _ in rows])], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["heavy"] == [], f"the size check imported {got['heavy']}"
    for (argv, flag, refused), run in zip(rows, got["runs"]):
        if not refused:
            assert run["code"] == 0 and run["lines"] == [], (argv, run)
            continue
        assert run["code"] == 2 and len(run["lines"]) == 1, (argv, run)
        line = run["lines"][0]
        assert line.startswith(f"cpkv {argv[0]}: error: ") and flag in line, (argv, line)
        assert "Traceback" not in line
    slowest = max(x["seconds"] for x in got["runs"])
    print(f"{len(rows)} cases in one interpreter: slowest {slowest:.3f} s, {got['cpu']:.2f} s CPU in all, peak RSS "
          f"{got['peak'] / 2**20:.0f} MiB")
    assert got["peak"] < RSS_BYTES and slowest < CPU_S, got["peak"]


# the wrapper starts nothing else: RUSAGE_CHILDREN is the command's alone (forked from the small wrapper, not from
# pytest, whose peak a child's ru_maxrss would carry)
WRAPPER = r"""
import json, resource, subprocess, sys, time
t = time.monotonic()
r = subprocess.run([sys.executable, "-m", "cpkv", *sys.argv[1:]], capture_output=True, text=True)
wall = time.monotonic() - t
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps(dict(code=r.returncode, err=r.stderr, out=r.stdout, wall=wall, cpu=u.ru_utime + u.ru_stime,
                      peak=u.ru_maxrss * 1024)))
"""

#: One absurd size of each subcommand, run as the real command.
COMMANDS = [["run", "--kv-memory", "100TiB"], ["run", "--max-running", "1e12"],
            ["simulate", "--workload", "longdoc", "--host-pages", "1e12"],
            ["bench", "scheduler", "--batches", "100000000"], ["bench", "kv", "--tokens", "1e12"],
            ["bytes", "--model", "glm-5", "--index-topk-freq", "1e12"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_the_real_command_refuses_within_a_second_of_cpu_and_200_mb(argv):
    r = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True, timeout=120)
    got = json.loads(r.stdout)
    lines = got["err"].splitlines()
    print(f"cpkv {' '.join(argv)}: {got['cpu']:.2f} s CPU ({got['wall']:.2f} s wall), peak RSS "
          f"{got['peak'] / 2**20:.0f} MiB: {lines}")
    assert got["code"] == 2 and got["out"] == "" and len(lines) == 1 and lines[0].startswith(f"cpkv {argv[0]}: error: ")
    assert argv[-2] in lines[0]
    # CPU, not wall clock: the machine is shared, and the process's own cost is what the promise is about
    assert got["cpu"] < CPU_S and got["peak"] < RSS_BYTES, got


# -- every advice, followed -------------------------------------------------------------------------------
MACHINE = MachineCapacity(16 * GiB, 2, 8 * GiB)
ADVICE = re.compile(r"give (--[\w-]+) (\S+?)(?:,)? or (less|fewer|more|smaller)")

#: Refusals besides the table's, whose advice is followed too.
MORE = [["run", "--page", "100000"], ["run", "--disagg", "1000:1000"], ["run", "--cp", "64"],
        ["run", "--requests", "20", "--scale", "1", "--workload", "longdoc", "--timeout", "10"],
        ["run", "--host-pages", "100000000"], ["run", "--disagg", "1:1", "--device-pages", "10000000000"],
        ["run", "--kv", "replicated", "--kv-memory", "16GiB"], ["run", "--check", "--max-running", "3000000"],
        ["simulate", "--workload", "longdoc", "--lane-pages", "1000000000"],
        ["simulate", "--workload", "longdoc", "--cp", "100000000"], ["simulate", "--workload", "longdoc", "--page", "99999"],
        ["bench", "scheduler", "--contexts", "100000000"], ["bench", "splits", "--context", "10000000"],
        ["bench", "splits", "--bs", "20000"], ["bench", "capacity", "--kv-memory", "1GiB"],
        ["bench", "capacity", "--page", "100000"]]


def _refusal(argv) -> str | None:
    try:
        check_sizes(argv, MACHINE)
    except Refused as e:
        return str(e)
    except SystemExit:
        return "argparse"
    return None


def _followed(argv, flag, value) -> list[str]:
    out, i = list(argv), None
    for k, a in enumerate(argv):
        if a == flag or any(a == n for f in FLAGS if flag in f.names for n in f.names):
            i = k
    if i is None:
        return out + [flag, value]
    out[i + 1] = value
    return out


def test_each_advice_given_back_is_not_refused_again(tmp_path, monkeypatch, capsys):
    from cpkv.tools.cli import parse_command

    monkeypatch.setattr(sizing_mod, "machine_capacity", lambda: MACHINE)
    mc = mooncake_trace(tmp_path / "mc.jsonl")
    followed = 0
    for argv in [a for a, _, refused in table(mc) if refused] + MORE:
        why = _refusal(argv)
        m = ADVICE.search(why or "")
        if m is None:
            continue
        flag, value = m.group(1), m.group(2)
        again = _followed(argv, flag, value)
        second = _refusal(again)
        assert second is None or not second.startswith(flag), (argv, why, again, second)
        if second is None:  # through the command's own validation too (nothing runs)
            try:
                parse_command(again)
            except SystemExit:
                err = capsys.readouterr().err
                assert f"error: {flag}" not in err and f"argument {flag}" not in err, (again, err)
        followed += 1
    print(f"{followed} advices followed")
    assert followed >= 60


def test_goodput_jobs_count_each_sweep_held_at_once(tmp_path):
    """``--goodput --jobs J`` runs J sweeps at once, each holding its mode's caches: what fits one at a time is
    refused two at a time, with the --jobs that fits."""
    mc = mooncake_trace(tmp_path / "mc.jsonl")
    longest = 1000 + 20 - 1  # the longest request: its prompt and its replies but the last
    running = int(0.6 * sizes.usable_bytes(MACHINE)) // (8 * (longest + 1))  # its page table: 60 % of the machine
    base = ["simulate", "--workload", f"mooncake:{mc}", "--goodput", "--kv", "shared,replicated", "--kv-dtype",
            "fp8", "--host-memory", "0", "--kv-memory", "1GiB", "--max-running", str(running)]
    assert _refusal(base) is None and _refusal(base + ["--jobs", "1"]) is None
    why = _refusal(base + ["--jobs", "2"])
    assert why is not None and "in each of 2 sweeps at once" in why and "give --jobs 1 or fewer" in why, why
    assert _refusal(base + ["--kv", "shared", "--jobs", "2"]) is None  # one sweep: never two at once
    why = _refusal(base + ["--jobs", str(MACHINE.cores + 1)])
    assert why == f"--jobs {MACHINE.cores + 1}: this machine has {MACHINE.cores} cores; give --jobs {MACHINE.cores} or fewer"


# -- the check and the command agree ----------------------------------------------------------------------
def test_the_check_reads_each_flag_as_the_command_parses_it():
    import argparse

    from cpkv.tools.cli import _subparser, build_parser

    parser = build_parser()
    for command in ("run", "simulate", "bench", "bytes"):
        actions = {a.dest: a for a in _subparser(parser, command)._actions if a.option_strings}
        for f in sizes.command_flags(command):
            a = actions.get(f.dest)
            assert a is not None, f"cpkv {command} has no {f.names[0]}"
            assert tuple(a.option_strings) == f.names, (command, a.option_strings, f.names)
            assert (a.nargs == 0) == (f.type is None) and a.nargs == (f.nargs if f.type is not None else 0), f.names
            if f.type not in (None, str):  # the same checker: a bad value gets the same line from both
                assert a.type is f.type, (command, f.names, a.type, f.type)
        if command == "bench":  # its benchmark's name is found only when every flag with a value is known
            valued = {d for d, a in actions.items() if a.nargs != 0 and not isinstance(a, argparse._HelpAction)}
            assert valued <= {f.dest for f in sizes.command_flags(command)}, valued


def test_the_built_in_models_figures_are_the_models_own():
    import torch

    from cpkv.engine.config import EngineConfig
    from cpkv.models import build_adapter, model_config
    from cpkv.tools.bench.splits import splits_model
    from cpkv.engine.cost_model import CostModel, H200, kv_memory_beside, kv_memory_per_rank
    from cpkv.models.dsa import real_shape

    for name, fig in sizes.MODELS.items():
        cfg = model_config(name, seed=3)
        with torch.device("meta"):
            model = build_adapter(cfg).model
        assert fig.model_bytes == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert fig.vocab == model.config.vocab_size == cfg.vocab
        for dtype, b in fig.token_bytes.items():
            assert b == EngineConfig(model=cfg, kv_dtype=dtype, page_size=1).page_bytes(), (name, dtype)
    for name, layers in sizes.REAL_LAYERS.items():
        assert real_shape(name).num_layers == layers
    for name, (token_bytes, heads, _) in sizes.SPLIT_FIGURES.items():
        m = splits_model(name, 64)
        assert token_bytes == EngineConfig(model=m, page_size=1).page_bytes() and heads == m.heads, name
    for dtype, b in sizes.DEEPSEEK_V32_TOKEN_BYTES.items():
        assert b == CostModel.for_dtype("shared-owner", 8, dtype).kv_token_bytes
    for cp in (6, 8, 16):
        assert kv_memory_per_rank(H200, cp_size=cp) == kv_memory_beside(H200, sizes.DEEPSEEK_V32_CHECKPOINT_BYTES, cp)


# -- combinations that do nothing ------------------------------------------------------------------------
COMBINATIONS = [
    (["run", "--block-tokens", "8"], "--block-tokens shape a Mooncake trace"),
    (["run", "--window", "100"], "--window shape a Mooncake trace"),
    (["run", "--kv-events-buffer", "5"], "--kv-events-buffer sizes --kv-events-replay's buffer"),
    (["run", "--tolerance", "1e-3"], "--tolerance bounds --check's logits"),
    (["run", "--json", "--print-tokens"], "--print-tokens prints after the text report"),
    (["run", "--kv", "replicated", "--decode-split", "lse"], "--decode-split choose the shared cache's splits"),
    (["run", "--decode-page", "8"], "--decode-page sets the decode group's page size"),
    (["simulate", "--workload", "longdoc", "--kv-events-buffer", "5"], "--kv-events-buffer sizes --kv-events-replay"),
    (["simulate", "--workload", "MC", "--kv-events-buffer", "5"], "--kv-events-buffer do not apply to Mooncake"),
    (["simulate", "--workload", "longdoc", "--block-tokens", "16"], "--block-tokens do not apply to built-in"),
    (["simulate", "--workload", "MC", "--seed", "3"], "--seed do not apply to Mooncake"),
    (["simulate", "--workload", "MC", "--json", "--markdown"], "--markdown and --json each print the table"),
    (["bench", "capacity", "--requests", "5"], "--requests shape a Mooncake --workload"),
    (["bench", "alloc", "--bs", "3"], "--bs is not a flag of bench alloc; it sets bench splits"),
    (["bytes", "--index-topk-freq", "4"], "--index-topk-freq set GLM-5's indexer pattern"),
]


@pytest.mark.parametrize("argv,want", COMBINATIONS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_flag_that_does_nothing_with_the_others_is_refused(argv, want, tmp_path):
    mc = mooncake_trace(tmp_path / "mc.jsonl")
    argv = [f"mooncake:{mc}" if a == "MC" else a for a in argv]
    with pytest.raises(Refused, match=re.escape(want)):
        check_sizes(argv, MACHINE)


def test_the_mooncake_docs_commands_and_the_defaults_pass(tmp_path):
    mc = mooncake_trace(tmp_path / "mc.jsonl")
    for argv in (["run"], ["simulate"], ["bench", "all"], ["bytes"], ["run", "--workload", f"mooncake:{mc}"],
                 ["simulate", "--workload", f"mooncake:{mc}"], ["run", "--disagg", "4:2", "--device-pages", "8"]):
        check_sizes(argv, MACHINE)


# -- trace files ----------------------------------------------------------------------------------------
LINE = st.fixed_dictionaries({"id": st.text(max_size=3), "arrival": st.integers(-2, 3),
                              "tokens": st.lists(st.integers(-1, 300), max_size=4),
                              "max_new_tokens": st.integers(0, 3)})
MC_LINE = st.fixed_dictionaries({"timestamp": st.integers(-1, 9), "input_length": st.integers(0, 2000),
                                 "output_length": st.integers(-1, 9),
                                 "hash_ids": st.lists(st.integers(-1, 5), max_size=5)})


@st.composite
def trace_bytes(draw) -> bytes:
    """A trace file as a user might hand one over: random bytes, JSON lines cut anywhere, a binary blob after
    good lines, bytes flipped in good lines."""
    kind = draw(st.sampled_from(["random", "cut", "binary tail", "flipped", "good"]))
    lines = [json.dumps(x).encode() for x in draw(st.lists(st.one_of(LINE, MC_LINE), min_size=1, max_size=4))]
    text = b"\n".join(lines) + b"\n"
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "cut":
        return text[: draw(st.integers(0, len(text)))]
    if kind == "binary tail":
        return text + draw(st.binary(min_size=1, max_size=60))
    if kind == "flipped":
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1:]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=trace_bytes())
def test_any_trace_file_is_run_or_refused_with_its_path_and_line_never_a_traceback(data, tmp_path_factory):
    from cpkv.engine.mooncake import read_mooncake
    from cpkv.engine.trace import TraceError, load_jsonl

    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    path.write_bytes(data)
    for read in (load_jsonl, read_mooncake):
        try:
            read(str(path))
        except TraceError as e:
            assert str(e).startswith(f"{path}:") or str(e) == f"{path}: no requests", str(e)
    for argv in (["run", "--workload", str(path)], ["run", "--workload", f"mooncake:{path}"],
                 ["simulate", "--workload", f"mooncake:{path}"], ["bench", "capacity", "--workload", f"mooncake:{path}"]):
        try:
            check_sizes(argv, MACHINE)
        except Refused as e:
            msg = str(e)
            assert str(path) in msg or "--page" in msg or "--kv-memory" in msg, (argv, data, msg)
            if "not UTF-8" in msg or "not JSON" in msg:
                assert re.search(re.escape(str(path)) + r":\d+: ", msg), msg


def test_a_binary_trace_is_refused_by_the_command_with_its_line(tmp_path, capsys):
    from cpkv.tools.cli import main

    jsonl, mc = tmp_path / "blob.jsonl", tmp_path / "mc.jsonl"
    jsonl.write_bytes(b'{"id": "a", "arrival": 0, "tokens": [1], "max_new_tokens": 2}\n\x89PNG\r\n\x1a\n\x00\xff')
    mc.write_bytes(b'{"timestamp": 0, "input_length": 9, "output_length": 2, "hash_ids": [0]}\n\x89PNG\r\n')
    for argv, path in ((["run", "--workload", str(jsonl)], jsonl), (["simulate", "--workload", str(mc)], mc)):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"{path}:2: not UTF-8 text" in err[0], err


def test_the_search_behind_every_advice_finds_the_edge():
    for edge in (0, 1, 7, 1000, 2**40):
        assert sizes.largest_where(lambda v: v <= edge, 0, 2**50) == edge
        assert sizes.smallest_where(lambda v: v >= edge, 0, 2**50) == edge
    assert sizes.largest_where(lambda v: v < 0, 0, 10) is None and sizes.smallest_where(lambda v: v > 10, 0, 10) is None
    for n in (1, 1023, 2**30 + 5, 3 * 2**40 + 1):
        assert sizing_mod.parse_size(sizes._size_arg(n)) <= n and math.isclose(
            sizing_mod.parse_size(sizes._size_arg(n)), n, rel_tol=0.05, abs_tol=1)


def test_the_size_check_imports_nothing_heavy():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import cpkv.tools.cli
        from cpkv.tools.sizes import check_sizes
        for argv in (["run"], ["simulate"], ["bench", "scheduler"], ["bytes"]):
            check_sizes(argv)
        print(sorted(m for m in ("torch", "transformers", "triton", "matplotlib", "zmq") if m in sys.modules))
        """)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
