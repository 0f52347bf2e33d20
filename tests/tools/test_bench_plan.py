"""``cpkv bench plan``: host synchronisations per layer and step time, batch
planned once against re-planned every layer, measured in the same run."""

from cpkv.tools.bench import bench_plan
from cpkv.tools.cli import main


def test_bench_plan_rows_measure_both_modes():
    rows = bench_plan(repeats=1, layers=2, prefill_bs=2, prefill_len=12, decode_bs=2, context=9, page=4)
    by = {(r["phase"], r["plan"].split()[0]): r for r in rows}
    assert set(by) == {(p, m) for p in ("prefill", "decode") for m in ("every", "once")}
    for phase in ("prefill", "decode"):
        assert by[(phase, "once")]["syncs per layer"] == 0
        assert by[(phase, "every")]["syncs per layer"] > 0  # the counter sees re-planning
        assert by[(phase, "every")]["vs before"] == 1.0 and by[(phase, "once")]["step ms"] > 0


def test_bench_plan_command_prints_its_table(monkeypatch, capsys):
    import cpkv.tools.bench as bench

    monkeypatch.setattr(bench, "bench_plan", lambda repeats: bench_plan(repeats=repeats, layers=1, prefill_bs=1,
                                                                       prefill_len=5, decode_bs=1, context=5, page=4))
    assert main(["bench", "plan", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "syncs per layer" in out and "once per batch" in out
