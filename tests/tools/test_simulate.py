"""The workload simulator: the engine's scheduler without a model, policies
side by side on the same trace, no leak, no dropped request.
[[RFC-0001:C-PREFIX-CACHE]]"""

import json

import pytest

from cpkv.tools.cli import main
from cpkv.tools.simulate import compare, longdoc, multiturn, run, shared_prompt


def test_multiturn_under_pressure_balances_lanes_and_reuses_history():
    w = multiturn(n=40, seed=1)
    ours, lane0, obl = compare(w, lane_pages=160, progress=False)  # pages leaked -> AssertionError inside
    o, z, b = ours.summary(), lane0.summary(), obl.summary()
    for s in (o, z, b):
        assert s["finished"] == len(w.requests)  # never a dropped request
    assert o["evictions"] > 0  # the cache ran into the memory limit
    assert o["hit rate"] > 0.2  # follow-up turns found their history
    assert o["max lane gap %"] < z["max lane gap %"]
    assert len(ours.occupancy) > 0 and all(len(x) == 8 for x in ours.occupancy)


def test_shared_prompt_is_mostly_served_from_the_cache():
    ours, obl = compare(shared_prompt(n=160, system=300), policies=("least_full", "oblivious"), lane_pages=64,
                        progress=False)
    assert ours.summary()["hit rate"] > 0.6
    assert ours.summary()["finished"] == 160


def test_stress_mode_refuses_and_preempts_but_finishes_everything_without_leaking():
    w = longdoc(n=3)
    r = run(w, "least_full", lane_pages=300, admission="none", progress=False)
    s = r.summary()
    assert s["refusals"] > 0 and s["preemptions"] > 0 and s["finished"] == len(w.requests)
    assert s["tokens before 1st refusal"] < r.stats.served_tokens


def test_the_host_tier_serves_what_the_device_cache_evicted():
    w = multiturn(n=30, seed=2)
    plain = run(w, "least_full", lane_pages=120, progress=False).summary()
    tiered = run(w, "least_full", lane_pages=120, host_pages=4000, progress=False).summary()
    assert plain["evictions"] > 0 and tiered["host hit rate"] > 0
    assert tiered["hit rate"] + tiered["host hit rate"] > plain["hit rate"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown policy"):
        run(longdoc(n=1), "random", progress=False)
    with pytest.raises(ValueError, match="unknown admission"):
        run(longdoc(n=1), "least_full", admission="maybe", progress=False)


def test_cli_simulate_json_and_plot(capsys, tmp_path):
    png = tmp_path / "occ.png"
    assert main(["simulate", "--workload", "longdoc", "--json", "--plot", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["least_full", "lane0", "oblivious"]
    assert all(r["admitted vs oblivious"] >= 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_figure_is_written_whole_or_not_at_all(tmp_path):
    """An interrupt (or any error) while a figure is written leaves no partial file and no temporary one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cpkv.tools.report import save_figure

    out = tmp_path / "occupancy.png"
    fig, _ = plt.subplots()
    real = fig.savefig

    def interrupted(path, **kw):
        real(path, **kw)  # the bytes are there, the rename is not yet
        raise KeyboardInterrupt

    fig.savefig = interrupted
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, str(out))
    assert list(tmp_path.iterdir()) == []
    fig, _ = plt.subplots()
    save_figure(fig, str(out))
    assert [p.name for p in tmp_path.iterdir()] == ["occupancy.png"] and out.read_bytes()[:4] == b"\x89PNG"
