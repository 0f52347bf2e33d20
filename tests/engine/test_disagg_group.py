"""Disaggregation on real process groups: a prefill group and a decode group of
different sizes (and page sizes) in one torch.distributed world, KV moved by
point-to-point messages (gloo), exact against transformers; a group lost in the
middle of a transfer is reported by the other group, which frees the
transfer's pages, and nothing is left in /dev/shm.
[[RFC-0001:C-DISAGG]] [[RFC-0001:C-NO-PLANNER-COLLECTIVE]] [[RFC-0001:C-DIRECT-WRITE]]"""

import os
import time

import pytest

from support import moments
from cpkv.engine.disagg import DisaggConfig, DisaggFailure, run_disagg, run_disagg_sweep
from cpkv.runtime import shm_segments

pytestmark = pytest.mark.multiproc

SWEEP = [  # M, N, prefill page, decode page: one launch of 6 processes runs all four
    (4, 2, 16, 8),
    (2, 4, 4, 16),
    (1, 2, 16, 16),
    (2, 1, 16, 4),
]


def test_four_group_pairs_in_one_world_match_transformers():
    mine = os.getpid()
    cfgs = [DisaggConfig(prefill_size=M, decode_size=N, page_size=Sp, decode_page=Sd, device_pages=12 * 16 // Sp,
                         decode_pages=12 * 16 // Sd, host_pages=0, requests=3, scale=0.06, chunk=40, check=True)
            for M, N, Sp, Sd in SWEEP]
    reports = run_disagg_sweep(cfgs)
    for (M, N, Sp, Sd), r in zip(SWEEP, reports):
        c = r["check"]
        assert c["requests_matched"] == c["requests"] == r["requests"] == r["finished"], (M, N, c["mismatched"])
        assert c["max_abs_diff"] < 1e-4 and c["logits_checked"] == r["computed_tokens"]
        assert r["transfers"] > 0 and r["units"] == ["page" if Sp == Sd else "slot-run"]
        assert r["sent_bytes_per_pair"] == r["bytes_per_pair"] == r["received_bytes_per_pair"]  # as planned
        assert sum(map(sum, r["bytes_per_pair"])) == r["bytes_moved"] > 0
        assert r["messages"] <= r["transfers"] * M * N  # at most one message per rank pair per transfer
        assert len(set(r["plan_digests"])) == 1 and len(r["plan_digests"]) == M + N  # every rank planned alike
    assert not shm_segments(mine)


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_group_lost_mid_transfer_is_reported_by_the_other(victim, tmp_path, monkeypatch):
    """A decode rank (2:1) or the prefill rank (1:2) is killed in the middle of
    the second transfer: the surviving group's ranks report it within 30 s of
    the fault, each having freed the transfer's pages in its allocator; the
    run fails naming the killed rank; no segment is left."""
    from cpkv.engine.disagg import driver

    marker = tmp_path / "fault"
    M, N, kill = (2, 1, 2) if victim == "decode" else (1, 2, 0)
    monkeypatch.setenv(moments.FAULT, f"transfer1:{kill}:kill")  # tests/support/moments.py
    monkeypatch.setenv(moments.FAULT_MARKER, str(marker))
    monkeypatch.setattr(driver, "_disagg_ranks", moments.disagg_ranks)
    with pytest.raises(DisaggFailure) as e:
        run_disagg(DisaggConfig(prefill_size=M, decode_size=N, page_size=16, device_pages=12, host_pages=0, requests=3,
                                scale=0.05, chunk=40, timeout=120))
    fault = float(marker.read_text())
    assert time.time() - fault < 30  # from the fault to the caller's error
    assert e.value.rank == kill
    survivor = "prefill" if victim == "decode" else "decode"
    reports = [a for a in e.value.aborts if a["side"] == survivor]
    assert reports, e.value.aborts  # the surviving group reported it
    for a in reports:
        assert a["transfer"] == 1 and a["requests"] and a["freed_pages"] > 0
        assert a["time"] - fault < 30
    assert f"{survivor} ranks" in str(e.value)
    assert not shm_segments(os.getpid())
