"""``cpkv bench capacity`` in a small configuration: both modes at the same memory,
every figure from a checked run; the shared group holds N times the longest request."""

import pytest

from cpkv.engine import EngineConfig
from cpkv.tools.bench.capacity import bench_capacity, fits, longest_prompt
from cpkv.tools.cli import main


def test_capacity_small():
    rows, m = bench_capacity(EngineConfig(cp_size=2, page_size=16, kv_memory=128 * 2**10), documents=3,
                             trace_scale=0.005, rounds=2, ranks="threads", check=True)
    s, r = m["shared"], m["replicated"]
    assert s["longest"] >= 0.95 * 2 * r["longest"]
    for mode in (s, r):
        assert mode["longest_run"]["check"]["requests_matched"] == 1 == mode["longest_run"]["finished"]
        assert mode["trace"]["finished"] == mode["trace"]["requests"]
        assert len(mode["traces"]) == 2 and all(t["check"]["requests_matched"] == t["requests"] for t in mode["traces"])
    assert r["trace"]["evicted_pages"] + r["trace"]["preemptions"] > 0
    assert rows[0]["figure"].startswith("longest request") and rows[0]["shared / replicated"] == "2.00"
    assert any(x["figure"] == "trace: TPOT p99 (ms, median of 2)" for x in rows)


def test_every_run_is_checked_only_with_check(monkeypatch):
    """The default: no run asks for transformers' reference forward (most of a Mooncake slice's time outside the
    engine); ``check=True``: every run does, the longest-request runs and every round of the trace alike."""
    from cpkv.tools.bench import capacity

    asked = []

    def run(cfg, specs, ranks):  # a report with the fields the rounds compare, its check as the engine's
        asked.append(cfg.check)
        return {"config": {"kv": cfg.kv}, "requests": 1, "finished": 1, "steps": 1, "preemptions": 0,
                "evicted_pages": 0, "device_hit_rate": 0.0, "latency": {"requests": []},
                "check": {"requests": 1, "requests_matched": 1, "max_abs_diff": 0.0, "values_compared": 1}
                if cfg.check else None}

    monkeypatch.setattr(capacity, "_run_specs", run)
    base = EngineConfig(cp_size=2, page_size=16, kv_memory=128 * 2**10)
    for check in (False, True):
        asked.clear()
        m = capacity.measure_capacity(base, documents=2, trace_scale=0.004, rounds=2, check=check)
        assert asked == [check] * 6  # two longest-request runs, two rounds of each mode
        assert (m["shared"]["trace"]["check"] is None) == (not check)


def test_longest_prompt_is_the_refusal_edge():
    cfg = EngineConfig(cp_size=2, page_size=16, kv_memory=64 * 2**10, kv="replicated").sized()
    n = longest_prompt(cfg, 4)
    assert fits(cfg, n, 4) and not fits(cfg, n + 1, 4)
    assert n + 3 == 7 * 16  # 8 pages of memory, page 0 reserved


def test_bench_capacity_refuses_a_memory_without_a_page(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "capacity", "--kv-memory", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "capacity", "--cp", "2", "--kv-memory", "100"])
    assert e.value.code == 2 and "holds no page" in capsys.readouterr().err


def test_a_group_the_machine_cannot_hold_is_refused_before_any_rank_starts(monkeypatch, capsys):
    """As ``cpkv run`` refuses: too many ranks for the cores, or a cache the
    memory cannot hold (a 500 GiB ``--kv-memory`` no longer ends in a traceback
    while the scheduler's page table is allocated). Exit 2, one line."""
    from cpkv.runtime import sizing
    from cpkv.tools.bench import capacity

    def started(*a, **k):
        raise AssertionError("the bench started before refusing")

    monkeypatch.setattr(capacity, "longest_prompt", started)  # the first thing a run does
    for gib, argv, why in ((64, ["--cp", "64"], "--cp 64: more ranks than this machine schedules (16 per core on 2 "
                                                "cores"),
                           (8, ["--cp", "2", "--kv-memory", "500GiB"], "--kv-memory 500GiB: the shared longest "
                                                                       "request's run: 2 ranks need about")):
        monkeypatch.setattr(sizing, "machine_capacity", lambda gib=gib: sizing.MachineCapacity(gib * 2**30, 2))
        with pytest.raises(SystemExit) as e:
            main(["bench", "capacity", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("cpkv bench: error: ") and why in err[0], err


def test_repeats_sets_the_trace_rounds(monkeypatch, capsys):
    """``--repeats R``: each mode's trace runs R rounds (default 5), the ranks started as ``--ranks-as`` says,
    every run checked against transformers only with ``--check``."""
    from cpkv.tools.bench import capacity

    seen = []
    row = {"figure": "f", "shared": "1", "replicated": "1", "shared / replicated": "1.00", "better": "higher"}
    monkeypatch.setattr(capacity, "bench_capacity", lambda base, **kw: seen.append(kw) or ([row], {}))
    for argv in ([], ["--repeats", "2", "--ranks-as", "threads"]):
        assert main(["bench", "capacity", "--cp", "2", *argv]) == 0
    assert seen == [{"ranks": "processes", "rounds": 5, "check": False}, {"ranks": "threads", "rounds": 2,
                                                                          "check": False}]
    assert main(["bench", "capacity", "--cp", "2", "--check"]) == 0
    assert seen[-1]["check"] is True and "every run checked against transformers" in capsys.readouterr().out


def test_a_memory_too_small_for_the_trace_is_one_short_line_naming_the_memory_to_give(monkeypatch, capsys):
    """Before any rank starts: which cache refuses, how many requests, and a
    ``--kv-memory`` that the refusing mode takes (it then refuses no request)."""
    from cpkv.tools.bench import capacity

    def started(*a, **k):
        raise AssertionError("a run started before the refusal")

    monkeypatch.setattr(capacity, "_run_specs", started)
    assert main(["bench", "capacity", "--cp", "2", "--kv-memory", "20KiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cpkv bench capacity: 20.0 KiB per rank: the shared cache can never hold 15 of the trace's")
    assert "\n" not in err and len(err) < 250 and "give --kv-memory 120.0 KiB or more" in err
    assert main(["bench", "capacity", "--cp", "2", "--kv-memory", "120KiB"]) == 2  # the shared cache's need
    assert "the replicated cache can never hold" in capsys.readouterr().err


def test_a_mooncake_slice_is_the_trace_both_modes_run(monkeypatch, capsys, tmp_path):
    """``--workload`` (a Mooncake trace): its slice, scaled, is what each mode's rounds run, in prefill chunks
    scaled as its blocks are; a memory too small for it is refused before any rank starts, naming the memory to
    give."""
    import json

    from cpkv.tools.bench import capacity

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 40 * i, "input_length": 1000, "output_length": 64,
                                        "hash_ids": [0, i + 1]}) + "\n" for i in range(6)))
    seen = []
    monkeypatch.setattr(capacity, "_run_specs", lambda cfg, specs, ranks: seen.append((cfg.kv, specs, cfg.chunk)) or {})
    monkeypatch.setattr(capacity, "_checked", lambda r, tol: r)
    monkeypatch.setattr(capacity, "_same_schedule", lambda mode, traces: None)
    monkeypatch.setattr(capacity, "capacity_rows", lambda m: [{"figure": "f"}])
    argv = ["bench", "capacity", "--cp", "2", "--workload", f"mooncake:{path}", "--requests", "4", "--max-output", "2",
            "--repeats", "1"]
    assert main(argv + ["--kv-memory", "128KiB"]) == 0
    traces = [specs for _, specs, _ in seen if len(specs) > 1]
    assert len(traces) == 2 and traces[0] == traces[1]  # both modes, the same slice
    assert {chunk for *_, chunk in seen} == {256}  # the simulator's 8192 at 512 tokens a block, scaled to 16
    assert [(s.id, len(s.tokens), s.max_new_tokens, s.arrival) for s in traces[0]] == \
        [("line1", 32, 2, 0), ("line2", 32, 2, 0), ("line3", 32, 2, 0), ("line4", 32, 2, 0)]
    assert "m.jsonl, its first 4 requests at 16 tokens a block" in capsys.readouterr().out
    seen.clear()
    assert main(argv + ["--kv-memory", "16KiB"]) == 2 and not seen
    assert "can never hold 4 of the trace's 4 requests" in capsys.readouterr().err
