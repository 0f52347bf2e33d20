"""The engine on a real process group: shared memory for the device and host
pools, gloo collectives, exact against transformers; a killed rank ends the
group, is named, and leaves no device or host segment.
[[RFC-0001:C-HICACHE]] [[RFC-0001:C-NO-PLANNER-COLLECTIVE]] [[RFC-0001:C-DIRECT-WRITE]]"""

import os
import time

import pytest

from cpkv.engine import EngineConfig, run_engine
from cpkv.runtime import RankFailure, shm_segments

pytestmark = pytest.mark.multiproc


def test_engine_on_a_process_group_with_the_host_tier():
    mine = os.getpid()
    r = run_engine(EngineConfig(cp_size=2, page_size=16, device_pages=8, host_pages=48, requests=4, scale=0.08,
                                chunk=40, check=True))
    c = r["check"]
    assert c["requests_matched"] == c["requests"] == r["finished"] and c["max_abs_diff"] < 1e-4
    assert r["load_pages"] > 0 and r["backup_pages"] > 0
    backed = [x["backed_up"] for x in r["ranks"]]
    assert backed[0] == r["backup_pages"] * 16 and backed[1] == 0  # only the IO rank copies to the host
    loaded = [x["loaded"] for x in r["ranks"]]
    assert sum(loaded) == r["load_pages"] * 16  # every rank loads its own share
    assert not shm_segments(mine)


@pytest.mark.parametrize("fault", ["kill_rank", "fail_rank"])
def test_a_rank_lost_mid_trace_ends_the_group_and_leaves_nothing(fault, tmp_path, monkeypatch):
    marker = tmp_path / "fault"
    monkeypatch.setenv("CPKV_FAULT_MARKER", str(marker))
    with pytest.raises(RankFailure) as e:
        run_engine(EngineConfig(cp_size=2, page_size=16, device_pages=8, host_pages=16, requests=3, scale=0.05,
                                fail_step=4, timeout=120, **{fault: 1}))
    assert time.time() - float(marker.read_text()) < 30  # from the fault to the launcher's report
    assert e.value.rank == 1
    assert not shm_segments(os.getpid())
