"""The engine on a real process group: shared memory for the device and host
pools, gloo collectives, exact against transformers, every rank holding its
lane's share; a lost rank ends the group, is named, and leaves nothing behind.
[[RFC-0001:C-HICACHE]] [[RFC-0001:C-NO-PLANNER-COLLECTIVE]] [[RFC-0001:C-DIRECT-WRITE]]
[[RFC-0001:C-READ-PATH]] [[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""

import os
import time

import pytest

from support import moments
from cpkv.engine import EngineConfig, run_engine
from cpkv.models import model_config
from cpkv.runtime import RankFailure, shm_segments

pytestmark = pytest.mark.multiproc


def holds_its_share(r):
    """At the end of the trace each rank holds the pages of its lane that the
    allocator handed out, and it wrote every one of them into its own segment;
    together the ranks hold one copy (what a replicated cache holds per rank)."""
    alloc = [x["pages_allocated"] for x in r["ranks"]]
    assert [x["pages_written"] for x in r["ranks"]] == alloc and sum(alloc) > 0
    last = r["occupancy"][-1]
    assert alloc == last  # the allocator's count per lane is what each rank holds
    peak, rep = r["peak_kv_bytes_per_rank"], r["peak_replicated_kv_bytes"]
    assert sum(peak) >= rep and max(peak) < rep  # each rank holds a part, never the whole


@pytest.mark.parametrize("model,cp,page,split", [("llama", 4, 16, ("page", "owner")),
                                                 ("glm-5", 3, 5, ("zigzag", "lse"))])
def test_engine_on_a_process_group_with_the_host_tier(model, cp, page, split):
    mine = os.getpid()  # 4 pages per lane (5 no longer evicts enough: running requests share their pages)
    r = run_engine(EngineConfig(cp_size=cp, page_size=page, device_pages=4 * 16 // page, host_pages=48 * 16 // page,
                                requests=3, scale=0.08, chunk=40, prefill_split=split[0], decode_split=split[1],
                                model=model_config(model), check=True, check_plans=True))
    c = r["check"]
    assert c["requests_matched"] == c["requests"] == r["finished"] and c["max_abs_diff"] < 1e-4
    assert r["load_pages"] > 0 and r["backup_pages"] > 0 and r["evicted_pages"] > 0
    assert [x["host_pinned"] for x in r["ranks"]] == [False] * cp  # on the CPU: not page-locked, not asked
    backed = [x["backed_up"] for x in r["ranks"]]
    assert backed[0] == r["backup_pages"] * page and not any(backed[1:])  # only the IO rank copies to the host
    loaded = [x["loaded"] for x in r["ranks"]]
    assert sum(loaded) == r["load_pages"] * page and sum(x > 0 for x in loaded) > 1  # every owner its own share
    holds_its_share(r)
    assert not shm_segments(mine)


def test_a_rank_killed_mid_trace_ends_the_group_and_leaves_nothing(tmp_path, monkeypatch):
    """Rank 1 dies by SIGKILL at the start of its fourth step (tests/support/moments.py). (A rank that raises
    instead is tests/runtime/test_launch.py's, on a tiny target.)"""
    from cpkv.engine import engine

    marker = tmp_path / "fault"
    monkeypatch.setenv(moments.FAULT, "step4:1:kill")
    monkeypatch.setenv(moments.FAULT_MARKER, str(marker))
    monkeypatch.setattr(engine, "_engine_rank", moments.engine_rank)
    with pytest.raises(RankFailure) as e:
        run_engine(EngineConfig(cp_size=2, page_size=16, device_pages=8, host_pages=16, requests=3, scale=0.05,
                                chunk=256, timeout=120))
    assert time.time() - float(marker.read_text()) < 30  # from the fault to the launcher's report
    assert e.value.rank == 1
    assert not shm_segments(os.getpid())


def test_triton_kernels_on_a_process_group_read_what_the_other_ranks_wrote():
    """``--kernels triton`` on two processes (Triton's interpreter on the CPU):
    each rank's store kernel writes its own segment, its attention kernel reads
    the whole context through the rank-major view, the other rank's pages
    included (under the page split each rank computes only the tokens on its
    own pages, so every context read crosses segments). Exact against
    transformers. [[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]]"""
    r = run_engine(EngineConfig(cp_size=2, device_pages=8, host_pages=0, requests=2, scale=0.05, kernels="triton",
                                check=True))
    c = r["check"]
    assert r["config"]["kernels"] == "triton"
    assert c["requests_matched"] == c["requests"] == r["finished"] and c["max_abs_diff"] < 1e-4
    assert all(x["tokens_computed"] > 0 for x in r["ranks"])  # both ranks computed (and wrote) tokens
    holds_its_share(r)
