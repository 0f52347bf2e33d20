"""The engine and its disaggregation under torchrun (cpkv.engine.joined), started as a user starts them (``torchrun
... -m cpkv run``): one node of N ranks, and a prefill node and a decode node on loopback, each exact against
transformers (``--check``), the report printed by one rank only; refusals before anything joins."""

import json

import pytest

from support.torchrun_helpers import finish, log_tail, start_torchrun, two_nodes
from cpkv.engine import DisaggConfig
from cpkv.engine.engine import EngineConfig
from cpkv.engine.joined import run_disagg_joined, run_engine_joined

ENV = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": "29500"}


def _report(out) -> dict:
    """The one report the ranks printed (exactly one rank prints it)."""
    printed = sorted(out.glob("report.*.json"))
    assert len(printed) == 1, f"{len(printed)} ranks printed a report"
    return json.loads(printed[0].read_text())


def _exact(report: dict) -> None:
    c = report["check"]
    assert c["requests_matched"] == c["requests"] == report["finished"] == report["requests"], c["mismatched"]
    assert c["max_abs_diff"] < 1e-4 and c["logits_checked"] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_engine_under_torchrun_on_one_node_is_exact(tmp_path, n):
    """[[RFC-0001:C-DIRECT-WRITE]]: the CP group's cache in the node's segments, every rank writing its own."""
    p = start_torchrun(tmp_path, ["--standalone", "--nproc-per-node", str(n)], "support.torchrun_engine", "engine",
                       str(tmp_path), str(n))
    assert finish(p, tmp_path, 240) == 0, log_tail(tmp_path)
    report = _report(tmp_path)
    assert report["rank"] == 0
    _exact(report)


@pytest.mark.multiproc
@pytest.mark.parametrize("prefill, decode", [(2, 1), (1, 2)])
def test_disaggregation_across_two_torchrun_nodes_is_exact(tmp_path, prefill, decode):
    """[[RFC-0001:C-DISAGG]]: the KV moves point to point from the prefill node to the decode node."""
    procs = two_nodes(tmp_path, "support.torchrun_engine", "disagg", str(tmp_path), str(prefill), str(decode),
                      prefill=prefill, decode=decode)
    for p, role in zip(procs, ["prefill", "decode"]):
        assert finish(p, tmp_path, 300, log=role) == 0, log_tail(tmp_path, role)
    report = _report(tmp_path)
    assert (report["prefill_ranks"], report["decode_ranks"]) == (prefill, decode)
    assert report["transfers"] > 0 and report["bytes_moved"] > 0
    _exact(report)


def test_joined_runs_refuse_before_joining():
    with pytest.raises(RuntimeError, match="not started by torchrun"):
        run_engine_joined(EngineConfig(cp_size=3), environ={})
    with pytest.raises(ValueError, match="--nnodes 1 --nproc-per-node 2"):
        run_engine_joined(EngineConfig(cp_size=2), environ=ENV)
    with pytest.raises(ValueError, match="--role prefill or --role decode"):
        run_disagg_joined(DisaggConfig(prefill_size=2, decode_size=1), environ=ENV)
    with pytest.raises(ValueError, match="needs a world of 4 ranks"):
        run_disagg_joined(DisaggConfig(prefill_size=2, decode_size=2), environ={**ENV, "ROLE_NAME": "decode"})
    with pytest.raises(RuntimeError, match="not started by torchrun"):
        run_disagg_joined(DisaggConfig(), environ={})
