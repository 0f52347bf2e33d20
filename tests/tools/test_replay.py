"""Mooncake traces end to end: a scaled slice through the engine (exact against
transformers) agrees with the simulator's modes on the same slice, and the
full-scale replay on a modelled H200 group (its clock, its queue, its
refusals, its report and plots). [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine.mooncake import load_mooncake
from cpkv.tools.cli import main
from cpkv.engine.cost_model import CostModel
from cpkv.tools.replay import ReplayConfig, replay
from cpkv.tools.replay_report import equal_batch_rows, goal_rows, markdown_table, run_replays

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake"
CONVERSATION = str(DATA / "conversation_trace.jsonl")
needs_data = pytest.mark.skipif(not Path(CONVERSATION).is_file(),
                                reason=f"the Mooncake traces are not at {DATA} (../shared/data/mooncake)")

#: A scaled slice for the CPU: 16-token blocks, outputs capped, two ranks, a cache that evicts.
SLICE = dict(requests=5, block_tokens=16, max_output=2, step_ms=3000)
GROUP = dict(cp_size=2, page_size=16, device_pages=18, host_pages=0, chunk=512, max_running=4)


def replay_config_of(cfg: EngineConfig) -> tuple[ReplayConfig, float]:
    """The simulator's group with the engine run's pages (its memory given in DeepSeek-V3.2 bf16 bytes)."""
    token = CostModel.for_dtype("replicated", cfg.cp_size, "bfloat16").kv_token_bytes
    page = cfg.page_size * token
    return ReplayConfig(cp_size=cfg.cp_size, page_size=cfg.page_size, kv_memory=int(cfg.device_pages * page),
                        host_memory=int(cfg.host_pages * page), chunk=cfg.chunk, max_running=cfg.max_running), token


@needs_data
@pytest.mark.parametrize("kv", ["shared", "replicated"])
def test_a_scaled_slice_runs_exactly_and_the_simulator_schedules_it_alike(llama, kv):
    """The engine on a slice of the conversation trace (shared prefixes intact) matches transformers (the
    shared cache; the replicated one's exactness is tests/engine/test_replicated.py's), and the simulator's
    mode of the same name admits, hits, evicts and finishes every request in the same steps."""
    cfg = EngineConfig(workload=f"mooncake:{CONVERSATION}", kv=kv, check=kv == "shared", **SLICE, **GROUP)
    r = run_engine_threads(cfg, llama)
    c = r["check"]
    if kv == "shared":
        assert c["max_abs_diff"] < 1e-4 and c["requests_matched"] == c["requests"] == SLICE["requests"]
    assert r["evicted_pages"] > 0 and r["device_hit_rate"] > 0  # the slice shares prefixes and fills the cache
    rc, _ = replay_config_of(cfg)
    trace = load_mooncake(CONVERSATION, block=16, requests=SLICE["requests"], max_output=SLICE["max_output"],
                          step_ms=SLICE["step_ms"], vocab=cfg.model.vocab)
    sim = replay(trace, kv, rc, clock="steps")
    assert sim.capacity_tokens == (cfg.device_pages * (1 if kv == "replicated" else 2) - 1) * 16  # page 0 reserved
    engine_steps = {x["id"]: (x["first_token_step"], x["finished_step"]) for x in r["latency"]["requests"]}
    assert {rid: (int(f), int(e)) for rid, f, e in sim.per_request} == engine_steps
    assert (sim.steps, sim.hit_tokens / sim.prompt_tokens, sim.evicted_pages, sim.preemptions, sim.finished) == \
        (r["steps"], r["device_hit_rate"], r["evicted_pages"], r["preemptions"], r["finished"])


@needs_data
def test_the_replay_at_scale_shared_against_replicated():
    """A slice at full scale on a small memory: the shared group holds N times the tokens, the replicated one
    evicts more and queues; the clock follows the trace; every request finishes or is refused."""
    trace = load_mooncake(CONVERSATION, requests=40, max_output=24, lazy=True)
    cfg = ReplayConfig(kv_memory=6 * 2**30, max_running=64)
    shared, rep = (replay(trace, kv, cfg, name="conv") for kv in ("shared", "replicated"))
    assert shared.capacity_tokens == pytest.approx(8 * rep.capacity_tokens, rel=1e-3)
    assert shared.finished + shared.refused == rep.finished + rep.refused == 40
    assert rep.refused > shared.refused == 0  # a request longer than one copy's cache is refused, not run
    assert rep.evicted_pages > shared.evicted_pages and rep.max_waiting > 0 and rep.max_wait_ms > 0
    for x in (shared, rep):
        t = x.series["time_ms"]
        assert (np.diff(t) > 0).all() and x.makespan_ms == t[-1] >= trace.arrival_ms[-1]
        assert (x.ttft_ms > 0).all() and (x.tpot_ms > 0).all() and x.ttft_ms.size == x.finished
        assert x.peak_resident_tokens <= x.capacity_tokens
        assert x.series["hit_tokens"][-1] == x.hit_tokens
    # a second run of the same mode is the same run
    again = replay(trace, "shared", cfg, name="conv")
    assert again.per_request == shared.per_request and again.makespan_ms == shared.makespan_ms
    g = goal_rows([shared, rep])[0]
    assert g["KV tokens shared / replicated"] == pytest.approx(8.0, rel=1e-3) and g["goal >= 7.6"] == "met"
    table = markdown_table([shared, rep])
    assert table.count("\n") == 3 and "| conv | bfloat16 | no | shared (auto) |" in table


def test_the_queue_and_the_host_tier_on_a_synthetic_trace(tmp_path):
    """Requests arriving faster than a tiny group serves them queue; the host tier serves what was evicted."""
    rows = []
    for i in range(40):  # 20 conversations of two turns, 10 first turns then their 10 second turns, twice:
        conv, second = 10 * (i // 20) + i % 10, i % 20 >= 10  # a second turn repeats its first's blocks, adds one
        ids = list(range(10 * conv, 10 * conv + 4)) + ([10 * conv + 5] if second else [])
        rows.append({"timestamp": 2 * i, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids})
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_mooncake(str(path), lazy=True)
    token = CostModel.for_dtype("replicated", 8, "bfloat16").kv_token_bytes
    base = ReplayConfig(kv_memory=int(48 * 64 * token), max_running=8)  # 48 pages a rank: one request at a time
    tiered = dataclasses.replace(base, host_memory=int(400 * 64 * token))
    plain, host = (replay(trace, "replicated", c) for c in (base, tiered))
    assert plain.max_waiting > 0 and plain.behind_ms > 0 and plain.refused == 0
    assert host.host_hit_tokens > 0 and plain.host_hit_tokens == 0
    assert host.hit_tokens + host.host_hit_tokens > plain.hit_tokens
    fast = replay(trace, "replicated", dataclasses.replace(base, rate=4))  # the same trace, four times the rate
    assert fast.last_arrival_ms == plain.last_arrival_ms / 4 and fast.finished == plain.finished
    assert fast.max_wait_ms > plain.max_wait_ms and fast.makespan_ms < plain.makespan_ms + plain.last_arrival_ms
    with pytest.raises(ValueError, match="unknown clock"):
        replay(trace, "shared", base, clock="hours")
    with pytest.raises(ValueError, match="unknown kv mode"):
        replay(trace, "sharded", base)
    with pytest.raises(ValueError, match="hold 0 pages"):
        replay(trace, "shared", ReplayConfig(kv_memory=1000))
    with pytest.raises(ValueError, match="decode_split"):
        ReplayConfig(decode_split="zigzag")
    with pytest.raises(ValueError, match="rate"):
        ReplayConfig(rate=0)


def test_equal_batch_rows_judge_tpot_at_the_same_batch():
    rows = equal_batch_rows(ReplayConfig(), 12000, batches=(1, 64))
    assert [r["batch"] for r in rows] == [1, 64]
    for r in rows:
        assert r["shared (owner) / replicated"] == pytest.approx(r["shared (owner) ms"] / r["replicated ms"], rel=1e-2)
        assert r["replicated ms"] > 0
        # auto (the default) runs the cheaper split: never dearer than either
        assert r["shared (auto) ms"] == min(r["shared (owner) ms"], r["shared (lse) ms"])


@needs_data
def test_the_simulate_command_replays_prints_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "m.png"
    args = ["simulate", "--workload", f"mooncake:{CONVERSATION}", "--requests", "5", "--max-output", "4",
            "--kv-dtype", "fp8", "--host-memory", "0", "--no-progress"]
    assert main(args + ["--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "shared (owner)" in out and "replicated" in out and "goal >= 7.6" in out and "decode step at equal batch" in out
    for name in ("resident", "hits", "ttft", "tpot"):
        f = tmp_path / f"m-{name}.png"
        assert f.stat().st_size > 1000 and f"plot: {f}" in out
    assert main(args + ["--json", "--kv", "replicated"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["kv"] for r in got["runs"]] == ["replicated"] and not got["goals"] and got["equal_batch"]
    assert main(args + ["--markdown", "--kv", "shared"]) == 0
    assert capsys.readouterr().out.startswith("| trace | KV | host tier | mode |")


@pytest.mark.parametrize("argv,message", [
    (["--workload", "multiturn", "--kv-memory", "1GiB"], "--kv-memory do not apply to built-in traces"),
    (["--workload", "multiturn", "--block-tokens", "16"], "--block-tokens do not apply to built-in traces"),
    (["--workload", "README.md"], "is neither a built-in workload"),
    (["--workload", "mooncake:/no/such/file"], "no such file"),
    (["--workload", "multiturn", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["--workload", "longdoc", "--block-tokens", "600"], "at most 512"),
])
def test_the_simulate_command_refuses_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["simulate", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@needs_data
def test_mixed_kinds_and_wrong_flags_with_a_mooncake_trace_are_refused(capsys):
    for argv, message in ((["--workload", "multiturn", CONVERSATION], "give one kind"),
                          (["--workload", CONVERSATION, "--policies", "lane0"], "--policies do not apply to Mooncake"),
                          (["--workload", CONVERSATION, "--gpu-results", "/no/such.json"], "no such file")):
        with pytest.raises(SystemExit) as e:
            main(["simulate", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_run_replays_covers_every_combination(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 2,
                                        "hash_ids": [0, i + 1]}) + "\n" for i in range(4)))
    t = load_mooncake(str(path), lazy=True)
    res = run_replays([("t", t)], dtypes=("bfloat16", "fp8"), hosts=(0, 2**40), splits=("owner", "lse"))
    assert len(res) == 2 * 2 * (2 + 1)  # dtypes x hosts x (shared owner, shared lse, replicated)
    assert {(r.kv, r.config.decode_split) for r in res} == {("shared", "owner"), ("shared", "lse"),
                                                             ("replicated", "owner")}
    assert all(r.finished == 4 for r in res)
