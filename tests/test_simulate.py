"""The workload simulator and the CLI around it."""

import json

from cpkv.cli import main
from cpkv.simulate import compare, multiturn_trace


def test_least_full_bases_balance_lanes_better_than_lane0():
    trace = multiturn_trace(n=40, seed=1)
    ours, lane0 = compare(trace, cp_size=8, page_size=16, lane_pages=160, progress=False)
    o, z = ours.summary(), lane0.summary()
    # each request's pages differ by at most one between lanes, whatever the policy
    assert o["max request skew"] <= 1 and z["max request skew"] <= 1
    assert o["max lane gap %"] < z["max lane gap %"]
    assert o["finished"] + o["aborted"] == 40
    assert len(ours.occupancy) > 0 and all(len(x) == 8 for x in ours.occupancy)


def test_cli_simulate_json(capsys):
    assert main(["simulate", "--conversations", "12", "--lane-pages", "96", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["least_full", "lane0"]
    assert all(r["finished"] + r["aborted"] == 12 for r in rows)
