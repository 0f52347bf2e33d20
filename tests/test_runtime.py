"""Multi-process CP group: exact logits against transformers, per-rank memory,
shared-memory cleanup (the launcher's faults: test_launch.py; the command: test_cli.py).
[[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]] [[RFC-0001:C-DOWNSTREAM-CONTRACT]]
[[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

import os

import pytest

from cpkv.runtime import RunConfig, run_scenario, shm_segments

pytestmark = pytest.mark.multiproc
REQUESTS = [(37, 61), (0, 50), (32, 45), (0, 9), (0, 83)]  # mid-page and page-aligned continuations


@pytest.mark.parametrize("cp,page", [(1, 16), (2, 1), (2, 16), (4, 1), (4, 16)])
def test_group_matches_transformers_and_holds_a_share(cp, page):
    mine = os.getpid()  # other test workers may run groups at the same time
    assert not shm_segments(mine)
    r = run_scenario(RunConfig(cp_size=cp, page_size=page, requests=REQUESTS, decode_steps=8, check_plans=cp == 2))
    assert r["max_abs_diff"]["prefill"] < 1e-4
    assert r["max_abs_diff"]["decode"] < 1e-4
    # per rank: exactly the pages of its lane the allocator handed out; all
    # ranks together hold one copy; each at most a page per request over 1/N
    rep, pb, bs = r["replicated_kv_bytes"], r["page_bytes"], r["batch_size"]
    held = [x["kv_bytes_held"] for x in r["ranks"]]
    assert held == [x["kv_bytes_by_allocation"] for x in r["ranks"]]
    assert sum(held) == rep
    assert all(h <= rep / cp + bs * pb for h in held)
    # the page split computes every token exactly once
    total = sum(n for _, n in REQUESTS)
    assert sum(x["prefill_tokens"] for x in r["ranks"]) == total
    assert sum(x["decode_tokens"] for x in r["ranks"]) == 8 * len(REQUESTS)
    assert not shm_segments(mine)


def test_decode_crosses_page_boundaries():
    """Prompts ending 3 slots before a page end decode across it. [[RFC-0001:C-OWNER-LANE]]"""
    r = run_scenario(RunConfig(cp_size=2, page_size=4, requests=[(5, 9), (0, 13)], decode_steps=6))
    assert max(r["max_abs_diff"].values()) < 1e-4
