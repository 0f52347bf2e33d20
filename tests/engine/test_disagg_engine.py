"""The disaggregation driver: one scheduler class on both sides, control state
replicated on every rank of both groups, and thread-rank runs exact against
transformers (the DSA models' latent and indexer pools move together; a
decode-side preemption sends the request back to the prefill group; requests
sharing cached source pages). tests/engine/test_disagg_group.py runs process groups.
[[RFC-0001:C-DISAGG]] [[RFC-0001:C-NO-PLANNER-COLLECTIVE]] [[RFC-0001:C-PREFIX-CACHE]]
[[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""

import pytest
import torch

from cpkv.consumers.hicache import HostTier
from cpkv.consumers.prefix_cache import PrefixCache
from cpkv.contract.allocator import OwnerLaneAllocator
from cpkv.engine.disagg import DisaggConfig, DisaggControl, run_disagg_threads
from cpkv.engine import Scheduler, StepPlan
from cpkv.engine.engine import RankExecutor
from cpkv.engine.trace import RequestSpec, TraceError, dump_jsonl
from cpkv.models import model_config
from support.engine_checks import assert_exact

X = tuple(range(1, 40))
SHARED = [RequestSpec("a", 0, X, 1), RequestSpec("b", 3, X + (50, 51), 3), RequestSpec("c", 3, X + (60,), 2)]


def simulate(cfg, specs=None):
    """Run the control state alone (no model, made-up tokens), checking each
    step: the decode side never prefills, every arrival's slots are the
    decode request's own, and the transfer plan pairs them with the slots the
    prefill side holds for the same positions. Returns the control and the
    number of source slots that fed more than one destination."""
    ctl = DisaggControl(cfg, specs or cfg.trace())
    doubled = 0
    S = cfg.page_size
    while not ctl.done:
        held = {p for r in ctl.prefill.held.values() for p in (r.slots[: r.computed] // S).tolist()}
        st = ctl.plan()
        assert st.decode.forward is None or st.decode.forward.decode  # the decode side never prefills
        given = [b.alloc.new_pages for b in st.prefill.forwards()] + [c.dst // S for c in st.prefill.copies]
        assert not held & set(torch.cat(given).tolist() if given else [])  # held KV is never handed out again
        if st.transfer is not None:
            src = [ctl.prefill.held[ctl.inflight[x.request.index]].slots[x.start : x.start + x.slots.numel()]
                   for x in st.decode.arrivals]
            for x in st.decode.arrivals:
                r, a, s = x.request, x.start, x.slots
                assert torch.equal(r.slots[a : a + s.numel()], s) and a + s.numel() == len(r.seq) - 1
            pairs = torch.cat([st.transfer.entries(x, y) for x, y in st.transfer.pairs()])
            assert torch.equal(torch.sort(pairs).values, torch.arange(sum(s.numel() for s in src)))
            flat = torch.cat(src)
            doubled += flat.numel() - torch.unique(flat).numel()
        tok = [[(st.prefill.step * 7 + i) % 100 for i in range(len(b.requests))] for b in st.prefill.forwards()]
        dtok = [[(st.decode.step * 5 + i) % 100 for i in range(len(b.requests))] for b in st.decode.forwards()]
        ctl.complete(st, tok, dtok)
    assert not ctl.prefill.held and not ctl.inflight
    for s in (ctl.prefill, ctl.decode):
        s.drain()
        assert sum(s.cache.alloc.lane_free_pages()) == s.cache.alloc.num_pages
    return ctl, doubled


@pytest.mark.parametrize("admission,prefill_pages,decode_pages", [("none", 14, 8), ("lanes", 14, 9), ("lanes", 7, 9)])
def test_control_state_under_pressure(admission, prefill_pages, decode_pages):
    """Small caches: evictions on both sides while the prefill side holds KV
    for transfers (never handed out again while held), decode preemptions
    under admission ``none`` (the request goes back to the prefill group,
    prompt = everything it has; ``lanes`` admission reserves what the running
    requests still need, so it need not preempt), both prefix caches hit;
    every request finishes and every page comes back."""
    cfg = DisaggConfig(prefill_size=2, decode_size=3, page_size=16, decode_page=8, device_pages=prefill_pages,
                       decode_pages=decode_pages, host_pages=0, requests=8, scale=0.08, chunk=64, admission=admission)
    ctl, _ = simulate(cfg)
    D, P = ctl.decode.stats, ctl.prefill.stats
    assert D.finished == len(ctl.decode.requests) and D.evicted_pages > 0
    if prefill_pages < 10:
        assert P.evicted_pages > 0
    if admission == "none":  # preempted after their KV arrived: prefilled again
        assert D.preemptions > 0 and len(ctl.prefill.requests) > len(ctl.decode.requests)
    assert P.hit_tokens > 0 and D.hit_tokens > 0
    assert ctl.transfers > 0 and D.arrived_tokens == int(ctl.pair_slots.sum())


def test_two_control_replicas_agree_to_the_byte():
    cfg = DisaggConfig(prefill_size=3, decode_size=2, page_size=4, decode_page=16, device_pages=60, decode_pages=16,
                       host_pages=0, requests=5, scale=0.08, chunk=256)
    a, _ = simulate(cfg)
    b, _ = simulate(cfg)
    assert a.digest == b.digest and a.transfers == b.transfers > 0
    assert [r.generated for r in a.decode.requests] == [r.generated for r in b.decode.requests]


def test_requests_sharing_cached_source_pages_each_receive_them():
    """b and c both continue a's prompt, cached on the prefill side only (a
    finishes with its first token): one transfer sends those source pages to
    both."""
    ctl, doubled = simulate(DisaggConfig(prefill_size=2, decode_size=2, page_size=16, device_pages=10,
                                         host_pages=0, chunk=256), SHARED)
    assert doubled == 32 and ctl.prefill.stats.hit_tokens > 0


def exact(r):
    assert_exact(r)
    assert r["sent_bytes_per_pair"] == r["bytes_per_pair"] == r["received_bytes_per_pair"]
    assert len(set(r["plan_digests"])) == 1 and r["transfers"] > 0


def test_decode_preemption_and_prefill_host_tier_stay_exact(llama):
    r = run_disagg_threads(DisaggConfig(prefill_size=2, decode_size=2, page_size=16, decode_page=8, device_pages=10,
                                        decode_pages=10, host_pages=0, requests=4, scale=0.06, chunk=40, admission="none",
                                        check=True), llama)
    exact(r)
    assert r["preemptions"]["decode"] > 0 and r["prefill_requests"] > r["requests"]
    r = run_disagg_threads(DisaggConfig(prefill_size=2, decode_size=1, page_size=16, device_pages=6, host_pages=48,
                                        decode_pages=30, requests=3, scale=0.08, chunk=40, check=True), llama)
    exact(r)
    assert r["prefill_host_hit_tokens"] > 0 and r["prefill_backup_pages"] > 0 and r["units"] == ["page"]


def test_shared_source_pages_run_exact(llama, tmp_path):
    path = tmp_path / "shared.jsonl"
    dump_jsonl(SHARED, str(path))
    r = run_disagg_threads(DisaggConfig(prefill_size=3, decode_size=2, page_size=16, device_pages=10, host_pages=0,
                                        chunk=256, workload=str(path), check=True), llama)
    exact(r)
    assert r["prefill_hit_rate"] > 0
    # decode_split "auto" (the default) on the decode group of 2 ranks, not the prefill group's 3
    assert r["config"]["decode_costs"].startswith("CostModel(shared-auto, 2 ranks, page 16")
    assert sum(r["decode_splits"].values()) > 0 and set(r["decode_splits"]) <= {"owner", "lse"}
    from cpkv.engine.disagg import format_disagg

    line = ", ".join(f"{k} {v}" for k, v in sorted(r["decode_splits"].items()))
    assert f"decode group's forwards of decodes by split (decode split auto): {line}" in format_disagg(r)


@pytest.mark.parametrize("kind", ["glm-5"])
def test_dsa_latent_and_indexer_pools_move_together(kind):
    """GLM-5 (indexer keys on some layers only), prefill 2 ranks of page 16 to
    decode 3 ranks of page 4: every family and layer in each message, exact.
    [[RFC-0001:C-MLA-LATENT-POOL]] [[RFC-0001:C-INDEXER-POOL]]"""
    from cpkv.models import DsaAdapter

    cfg = DisaggConfig(prefill_size=2, decode_size=3, page_size=16, decode_page=4, device_pages=6, decode_pages=20,
                       host_pages=0, requests=3, scale=0.06, chunk=40, model=model_config(kind), check=True)
    fams = DsaAdapter(cfg.model.build()).families()
    assert {f.name for f in fams} == {"latent", "index_k"} and len(fams[1].layers) < len(fams[0].layers)
    r = run_disagg_threads(cfg)
    exact(r)
    per_slot = sum(f.slot_bytes() for f in fams)
    assert r["bytes_moved"] == r["transferred_tokens"] * per_slot and r["units"] == ["slot-run"]


# -- the scheduler's disaggregation hooks, misused --------------------------------------------------
def _sched(**kw):
    return Scheduler([RequestSpec("a", 0, (1, 2, 3), 2)], PrefixCache(OwnerLaneAllocator(64, 4, 2)), **kw)


def test_hooks_refuse_misuse_and_change_nothing():
    s = _sched()
    with pytest.raises(TraceError, match="has no 'after'"):
        s.submit(RequestSpec("b", 0, (1,), 1, after="a"))
    with pytest.raises(TraceError, match="used twice"):
        s.submit(RequestSpec("a", 0, (1,), 1))
    keep = s.max_len
    with pytest.raises(TraceError, match="needs 25 pages"):
        s.submit(RequestSpec("big", 0, tuple(range(1, 101)), 1))
    assert s.max_len == keep
    with pytest.raises(ValueError, match="remote-prefill"):
        s.arrive(0, 5)
    with pytest.raises(KeyError, match="not held"):
        s.release_finished(0)
    with pytest.raises(ValueError, match="not running"):
        s.cancel(0)
    assert len(s.requests) == 1 and [r.index for r in s.waiting] == [0] and s.requests[0].generated == []
    r = _sched(remote_prefill=True)
    assert [x.index for x in r.awaiting_kv()] == [0]
    with pytest.raises(ValueError, match="not waiting for its KV"):
        r.arrive(3, 5)
    assert r.arrive(0, 7) is False and r.requests[0].ready and r.awaiting_kv() == []
    with pytest.raises(ValueError, match="not waiting for its KV"):
        r.arrive(0, 7)
    assert r.requests[0].generated == [7]
    with pytest.raises(ValueError, match="no host tier"):
        _sched(remote_prefill=True, host=HostTier(4, 4))


def test_configurations_that_cannot_run_are_refused_before_any_rank_starts():
    from cpkv.engine.disagg import run_disagg, run_disagg_sweep

    for bad, match in [(dict(prefill_size=0), "prefill_size"), (dict(decode_page=0), "decode_page"),
                       (dict(device_pages=0), "device_pages"), (dict(transfer_timeout=0), "transfer_timeout")]:
        with pytest.raises(ValueError, match=match):
            run_disagg(DisaggConfig(**bad))
    with pytest.raises(TraceError, match="per lane"):  # the decode group's cache is too small
        run_disagg_threads(DisaggConfig(decode_pages=2, requests=2))
    with pytest.raises(TraceError, match="per lane"):  # the prefill group's
        run_disagg(DisaggConfig(device_pages=2, decode_pages=64, requests=2))
    with pytest.raises(ValueError, match="no configuration"):
        run_disagg_sweep([])


def test_the_cli_helpers_build_the_run_from_the_engine_config():
    from cpkv.engine.disagg import format_disagg, parse_disagg
    from cpkv.engine import EngineConfig

    assert parse_disagg("4:2") == (4, 2) and parse_disagg(" 1:8 ") == (1, 8)
    for bad in ("4", "4:0", "a:2", "2:3:4", ""):
        with pytest.raises(ValueError, match="is not M:N"):
            parse_disagg(bad)
    e = EngineConfig(cp_size=4, page_size=8, device_pages=20, host_pages=16, chunk=32, workload="longdoc", check=True)
    d = DisaggConfig.from_engine(e, 3, 2, decode_page=16)
    assert (d.prefill_size, d.decode_size, d.page_size, d.d_page, d.d_pages) == (3, 2, 8, 16, 10)
    assert (d.host_pages, d.chunk, d.workload, d.check, d.model) == (16, 32, "longdoc", True, e.model)
    cfg = DisaggConfig(prefill_size=2, decode_size=1, page_size=16, decode_page=8, device_pages=8, host_pages=0,
                       requests=2, scale=0.05, chunk=40)
    ctl, _ = simulate(cfg)
    from cpkv.engine.disagg import disagg_report

    report = disagg_report(cfg, ctl, [], 1.0, None)
    import json

    assert json.loads(json.dumps(report))["bytes_per_pair"] == report["bytes_per_pair"]  # --json prints it
    text = format_disagg(report)
    assert "prefill group 2 ranks (page 16) -> decode group 1 ranks (page 8), by slot-run" in text
    assert text.count("\n    p") == 2  # one row per prefill rank


def test_cpkv_run_disagg_prints_the_bytes_per_rank_pair(monkeypatch, capsys):
    """``cpkv run --disagg M:N --decode-page S --check`` end to end (the
    process launch swapped for thread ranks): the table and the transfer time."""
    import cpkv.engine.disagg as drv
    from cpkv.tools.cli import main

    monkeypatch.setattr(drv, "run_disagg", run_disagg_threads)
    code = main(["run", "--disagg", "2:1", "--page", "16", "--decode-page", "8", "--requests", "2", "--scale", "0.05",
                 "--host-pages", "0", "--check", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "prefill group 2 ranks (page 16) -> decode group 1 ranks (page 8), by slot-run" in out
    assert "transfer time" in out and out.count("\n    p") == 2 and "greedy tokens equal transformers'" in out


def test_an_executor_without_receive_refuses_arrivals():
    ex = RankExecutor.__new__(RankExecutor)
    ex.runner, ex.host, ex.check, ex.receive = None, None, False, None
    ex.pool = None
    plan = StepPlan(0, arrivals=[(None, 0, torch.tensor([4]))])
    with pytest.raises(ValueError, match="plans KV arrivals but this executor has no receive"):
        ex.run(plan)
