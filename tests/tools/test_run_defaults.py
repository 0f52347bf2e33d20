"""``cpkv run`` on a user's own trace with no cache flag: the device cache sized
from memory, every request that can never fit named in one refusal with the
flag to raise, a run stopped early saying what it finished, a long run saying
how long it expects; a configuration a plain value, sized at launch."""

import json

import pytest

import cpkv.engine.engine
import cpkv.runtime.sizing as sizing_mod
import cpkv.tools.commands as commands_mod
from cpkv.engine.config import EngineConfig
from cpkv.engine.engine import build_scheduler, run_engine_threads
from cpkv.engine.trace import CacheTooSmall
from cpkv.runtime.group import RankFailure
from cpkv.runtime.sizing import KV_MEMORY_CAP, MachineCapacity
from cpkv.tools.cli import main

GiB = 2**30


def _trace(tmp_path, *lengths, new=2):
    p = tmp_path / "mine.jsonl"
    p.write_text("".join(json.dumps({"id": f"r{i}", "arrival": 0, "tokens": [(7 * j) % 256 for j in range(n)],
                                     "max_new_tokens": new}) + "\n" for i, n in enumerate(lengths)))
    return str(p)


def _validated(argv, monkeypatch, gib=21):
    """The configuration ``cpkv run argv`` would start (validation only: nothing runs)."""
    seen = {}
    monkeypatch.setattr(sizing_mod, "machine_capacity", lambda: MachineCapacity(gib * GiB, 2, 24 * GiB))
    monkeypatch.setattr(cpkv.engine.engine, "run_engine", lambda cfg: seen.setdefault("cfg", cfg) and {})
    monkeypatch.setattr(commands_mod, "check_exit", lambda r, args: 0)
    monkeypatch.setattr(commands_mod, "cmd_run", lambda args: seen.setdefault("cfg", args.config) and 0)
    import cpkv.tools.cli as cli

    parser = cli.build_parser()
    args = parser.parse_args(["run", *argv])
    args.validate(args, cli._subparser(parser, "run"))
    return args.config


@pytest.mark.parametrize("argv", [["--cp", "1"], ["--page", "1"], ["--model", "deepseek-v3.2", "--cp", "1"]])
def test_the_builtin_trace_is_accepted_with_no_cache_flag(argv, monkeypatch):
    cfg = _validated(argv, monkeypatch)
    assert cfg.kv_memory is None
    assert cfg.device_pages * cfg.page_bytes() == pytest.approx(KV_MEMORY_CAP, rel=1e-3)  # 21 GiB: the cap binds


def test_the_default_budget_follows_the_machine_and_kv_memory_sets_it(monkeypatch, tmp_path):
    small = _validated(["--workload", _trace(tmp_path, 1500)], monkeypatch, gib=2)
    budget = (2 * GiB * 0.9 - 4 * sizing_mod.RANK_BASELINE_BYTES - 96 * 8192) * 0.25 / 4
    assert small.device_pages == int(budget) // 8192 < KV_MEMORY_CAP // 8192
    assert _validated(["--kv-memory", "2MiB"], monkeypatch).device_pages == 256  # 8 KiB a page of 16 tokens
    assert _validated(["--kv-memory", "1GB", "--page", "1"], monkeypatch).device_pages == 10**9 // 512


def test_cache_too_small_names_the_longest_requests_in_one_short_line():
    """A library caller's :class:`CacheTooSmall` names the two longest of the
    requests refused, however many (490 once made a 46,933-character line)."""
    from cpkv.engine.trace import RequestSpec, check_fits

    specs = [RequestSpec(f"r{i}", 0, tuple(range(500 + i)), 2) for i in range(490)]
    with pytest.raises(CacheTooSmall) as e:
        check_fits(specs, [7, 8, 8, 8], 16)
    msg = str(e.value)
    assert len(e.value.requests) == 490 and len(msg) < 600, msg
    assert msg.startswith("490 requests can never fit the device cache: request 'r489' needs 62 pages") and "'r488'" in msg
    assert "'r487'" not in msg and "(the longest 2 of them shown)" in msg


def test_every_request_that_can_never_fit_is_named_with_the_flag_to_raise(tmp_path, capsys):
    path = _trace(tmp_path, 1500, 20, 600)
    with pytest.raises(SystemExit) as e:
        main(["run", "--workload", path, "--device-pages", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["cpkv run: error: --device-pages 8: the shared device cache can never hold 2 of the trace's 3 "
                   "requests (the longest needs 25 pages per rank, it holds 8); give --kv-memory 200.0 KiB or more "
                   "(--device-pages 25) (see cpkv run --help)"]
    # the pages it names are enough, and one fewer is not
    build_scheduler(EngineConfig(device_pages=25, workload=path), EngineConfig(device_pages=25, workload=path).trace())
    with pytest.raises(CacheTooSmall):
        build_scheduler(EngineConfig(device_pages=24, workload=path), EngineConfig(device_pages=24, workload=path).trace())


@pytest.mark.parametrize("lengths", [(1500,), (4000,)])
def test_a_long_prompt_runs_with_no_cache_flag(lengths, tmp_path):
    """The engine itself (ranks as threads), 1,500 and 4,000-token prompts, sized from memory, exact."""
    cfg = EngineConfig(cp_size=2, workload=_trace(tmp_path, *lengths, new=2), chunk=512, host_pages=0, check=True)
    r = run_engine_threads(cfg)
    assert r["finished"] == 1 and r["check"]["max_abs_diff"] < 1e-4 and r["check"]["requests_matched"] == 1


def test_a_configuration_is_a_plain_value_sized_at_launch(tmp_path, monkeypatch, llama):
    """Making a configuration reads nothing of this machine, and two made alike are equal; a scheduler refuses
    one not sized; the launcher sizes it once (from the machine's memory, the device's kernels) and the ranks
    run, and report, the sized copy; a size given stays."""
    def unread():
        raise AssertionError("a configuration read this machine's memory")

    monkeypatch.setattr(sizing_mod, "machine_capacity", unread)
    cfg = EngineConfig(cp_size=1, workload=_trace(tmp_path, 20), host_pages=0)
    assert cfg.device_pages is None and cfg.kernels is None and cfg == EngineConfig(**cfg.run_fields(), cp_size=1)
    with pytest.raises(ValueError, match="sized at launch"):
        build_scheduler(cfg, cfg.trace())
    machine = MachineCapacity(GiB // 2, 2, 24 * GiB)
    monkeypatch.setattr(sizing_mod, "machine_capacity", lambda: machine)
    sized = cfg.sized()
    budget = sizing_mod.default_kv_memory(1, capacity=machine)  # one rank, no host tier: under the cap
    assert 8 < sized.device_pages == budget // 8192 < KV_MEMORY_CAP // 8192
    assert sized.kernels == "torch" and cfg.device_pages is None
    assert sized.sized() == sized and EngineConfig(device_pages=7, kernels="triton").sized().device_pages == 7
    r = run_engine_threads(cfg, llama)
    assert r["config"]["device_pages"] == sized.device_pages and r["config"]["kernels"] == "torch"


@pytest.mark.parametrize("exc,code,last", [(KeyboardInterrupt(), 130, "cpkv run: interrupted"),
                                           (RankFailure(None, "did not finish within 5 s"), 2,
                                            "cpkv run: CP group failed: did not finish within 5 s")])
def test_a_stopped_run_says_what_it_finished(exc, code, last, monkeypatch, capsys):
    def stopped(cfg):
        exc.progress, exc.requests = {"step": 41, "finished": 3, "requests": 24, "generated_tokens": 57,
                                      "computed_tokens": 900}, 24
        raise exc

    monkeypatch.setattr(cpkv.engine.engine, "run_engine", stopped)
    assert main(["run", "--cp", "2", "--device-pages", "8", "--no-progress"]) == code
    said = "cpkv run: stopped at step 41: 3 of 24 requests finished, 57 tokens generated (900 computed)"
    assert capsys.readouterr().err.splitlines() == [said, last]
    # with the progress bar a rank leaves mid-line (here not a terminal), the line starts a line of its own
    assert main(["run", "--cp", "2", "--device-pages", "8"]) == code
    assert capsys.readouterr().err == f"\n{said}\n{last}\n"


def test_a_long_run_says_how_long_it_expects(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sizing_mod, "machine_capacity", lambda: MachineCapacity(21 * GiB, 2, 24 * GiB))
    monkeypatch.setattr(cpkv.engine.engine, "run_engine", lambda cfg: (_ for _ in ()).throw(KeyboardInterrupt()))
    short = _trace(tmp_path, 40, new=8)
    main(["run", "--cp", "2", "--workload", short])
    assert "expect about" not in capsys.readouterr().err
    long = _trace(tmp_path, 40, new=3000)  # 3000 steps at cp 4 on 2 cores: 16 s to start, 3000 x 45.7 ms
    with pytest.raises(SystemExit) as e:  # past --timeout: refused before it starts
        main(["run", "--workload", long, "--timeout", "100"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "cpkv run: error: --timeout 100: the run is expected to take about 3 min (153 s: about 3000 steps on 4 "
        "ranks and 2 cores); give --timeout 230 or more (see cpkv run --help)"]
    main(["run", "--workload", long, "--timeout", "230"])
    err = capsys.readouterr().err
    assert "cpkv run: expect about 3 min: about 3000 steps on 4 ranks and 2 cores" in err


def test_json_and_print_tokens_give_every_requests_generated_tokens(llama, monkeypatch, capsys):
    """``--json``'s ``outputs`` and ``--print-tokens``'s lines: every request, its prompt length and the
    tokens it generated, equal between the two and to the run's own requests."""
    runs = []

    def threads(cfg):
        runs.append(run_engine_threads(cfg, llama))
        return runs[-1]

    monkeypatch.setattr(cpkv.engine.engine, "run_engine", threads)
    argv = ["run", "--cp", "2", "--device-pages", "8", "--requests", "2", "--scale", "0.05", "--no-progress"]
    assert main(argv + ["--json"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert main(argv + ["--print-tokens"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = lines[lines.index("generated tokens (id, prompt tokens: ids):") + 1:]
    assert shown == [f"{o['id']} {o['prompt_tokens']}: {' '.join(map(str, o['generated']))}" for o in outputs]
    assert [o["generated"] for o in outputs] == [o["generated"] for o in runs[1]["outputs"]]
    assert len(outputs) == runs[0]["requests"] and all(len(o["generated"]) >= 1 for o in outputs)
