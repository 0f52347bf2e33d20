"""Serving traces: JSONL files refused line by line with the reason, built-in
workloads seeded, and a trace that could never fit the cache refused up front."""

import json

import pytest

from cpkv.consumers.prefix_cache import PrefixCache
from cpkv.contract.allocator import OwnerLaneAllocator
from hypothesis import given, strategies as st

from cpkv.contract.layout import SharedKVLayout
from cpkv.engine.scheduler import Scheduler
from cpkv.engine.trace import (WORKLOADS, CacheTooSmall, RequestSpec, TraceError, dump_jsonl, expected_steps,
                               lane_split, load_jsonl)

GOOD = [{"id": "a", "arrival": 0, "tokens": [5, 17, 3], "max_new_tokens": 4},
        {"id": "b", "arrival": 2, "tokens": [9], "max_new_tokens": 2, "after": "a", "delay": 1}]


def write(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_a_good_file_round_trips(tmp_path):
    specs = load_jsonl(write(tmp_path, GOOD), vocab=256)
    assert specs == [RequestSpec("a", 0, (5, 17, 3), 4), RequestSpec("b", 2, (9,), 2, "a", 1)]
    out = tmp_path / "again.jsonl"
    dump_jsonl(specs, str(out))
    assert load_jsonl(str(out)) == specs


@pytest.mark.parametrize("bad,reason", [
    ("{not json", "not JSON"),
    ('[1, 2]', "a line must be a JSON object"),
    ({"id": "c", "arrival": 0, "tokens": [1]}, "missing ['max_new_tokens']"),
    ({"id": "c", "arrival": 0, "tokens": [1], "max_new_tokens": 2, "colour": 1}, "unknown keys ['colour']"),
    ({"id": "c", "arrival": "0", "tokens": [1], "max_new_tokens": 2}, "'arrival' must be int"),
    ({"id": "c", "arrival": 0, "tokens": [1.5], "max_new_tokens": 2}, "'tokens' must be a list of ints"),
    ({"id": "c", "arrival": 0, "tokens": [True], "max_new_tokens": 2}, "'tokens' must be a list of ints"),
    ({"id": "c", "arrival": 0, "tokens": [1], "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"id": "c", "arrival": -1, "tokens": [1], "max_new_tokens": 1}, "arrival and delay must be >= 0"),
    ({"id": "c", "arrival": 0, "tokens": [], "max_new_tokens": 1}, "needs at least one token"),
    ({"id": "c", "arrival": 0, "tokens": [300], "max_new_tokens": 1}, "tokens must lie in [0, 256), the model's "
                                                                        "vocabulary; token 300 does not"),
    ({"id": "c", "arrival": 0, "tokens": [1], "max_new_tokens": 1, "delay": 2}, "'delay' counts steps after the "
                                                                                "line named by 'after'"),
    ({"id": "c", "arrival": 0, "tokens": [1], "max_new_tokens": 1, "delay": 0}, "this line has no 'after'"),
    ({"id": "c", "arrival": 0, "tokens": [1], "max_new_tokens": 1, "after": "c"}, "'after' names 'c'"),
    ({"id": "a", "arrival": 0, "tokens": [1], "max_new_tokens": 1}, "id 'a' is used twice"),
    ({"id": "c", "arrival": 0, "tokens": [1], "max_new_tokens": 1, "after": "zz"}, "'after' names 'zz'"),
])
def test_a_bad_line_is_refused_with_its_number_and_reason(tmp_path, bad, reason):
    path = write(tmp_path, GOOD + [bad])
    with pytest.raises(TraceError) as e:
        load_jsonl(path, vocab=256)
    assert f"{path}:3: " in str(e.value) and reason in str(e.value)


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_jsonl(write(tmp_path, ["", " "]))


def test_a_request_that_can_never_fit_is_refused_before_anything_runs():
    alloc = OwnerLaneAllocator(4 * 2 * 16, 16, 2)  # 4 pages per lane, 128 tokens in all
    specs = [RequestSpec("a", 0, tuple(range(100)), 8), RequestSpec("b", 0, (1,), 40, "a")]
    with pytest.raises(TraceError, match="request 'b' needs 10 pages"):
        Scheduler(specs, PrefixCache(alloc))
    assert alloc.lane_free_pages() == alloc.lane_pages.tolist()


def test_every_request_that_can_never_fit_is_listed_with_what_the_lanes_hold():
    layout = SharedKVLayout(4, 16, 8)  # 8 pages per rank: lanes of 7, 8, 8, 8 (page 0 reserved)
    alloc = OwnerLaneAllocator.for_layout(layout)
    specs = [RequestSpec("ok", 0, tuple(range(100)), 8), RequestSpec("long", 0, (1,) * 1500, 21),
             RequestSpec("next", 0, (2,) * 10, 4, "ok"), RequestSpec("also", 3, (3,) * 449, 1)]
    with pytest.raises(CacheTooSmall) as e:
        Scheduler(specs, PrefixCache(alloc))
    assert [rid for rid, _ in e.value.requests] == ["long", "also"]  # 'ok' and its follow-up fit
    assert e.value.requests[0] == ("long", 1520) and e.value.capacity_tokens == 448
    assert e.value.pages_per_rank_needed == 25  # 95 pages: 24 per lane, + page 0 on lane 0
    msg = str(e.value)
    assert msg.startswith("2 requests can never fit the device cache: request 'long' needs 95 pages of 16 tokens "
                          "for 1520 tokens of KV (24, 24, 24 and 23 per lane); request 'also' needs 29 pages")
    assert "its 4 lanes hold 7, 8, 8 and 8 pages (page 0, on lane 0, is reserved)" in msg
    assert alloc.lane_free_pages() == alloc.lane_pages.tolist()  # nothing taken
    # the capacity is what it says: 448 tokens of KV fit, 449 do not
    Scheduler([RequestSpec("x", 0, (1,) * 448, 1)], PrefixCache(alloc))
    with pytest.raises(CacheTooSmall, match="'x' needs 29 pages"):
        Scheduler([RequestSpec("x", 0, (1,) * 449, 1)], PrefixCache(alloc))


@given(pages=st.integers(0, 10_000), lanes=st.integers(1, 64))
def test_lane_split_is_round_robin(pages, lanes):
    split = lane_split(pages, lanes)
    assert sum(split) == pages and max(split) - min(split) <= 1 and split == sorted(split, reverse=True)


def test_expected_steps_counts_the_longest_conversation_or_the_work():
    specs = [RequestSpec("a", 0, (1,) * 100, 10), RequestSpec("b", 0, (1,) * 5, 20, "a", 3)]
    assert expected_steps(specs, chunk=64, max_running=16) == (2 + 9) + (1 + 19 + 3)
    many = [RequestSpec(f"q{i}", 0, (1,) * 64, 4) for i in range(64)]
    assert expected_steps(many, chunk=64, max_running=16) == 64 + 16
    with pytest.raises(ValueError):
        expected_steps(specs, chunk=0, max_running=1)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_builtin_workloads_are_seeded_and_valid(name):
    a = WORKLOADS[name](6, seed=3, vocab=256, scale=0.05)
    assert a == WORKLOADS[name](6, seed=3, vocab=256, scale=0.05)
    assert a != WORKLOADS[name](6, seed=4, vocab=256, scale=0.05)
    ids = {s.id for s in a}
    assert len(ids) == len(a) and all(s.after in ids for s in a if s.after)
    assert all(0 <= t < 256 for s in a for t in s.tokens)


def test_a_request_arriving_late_costs_no_idle_steps():
    """Nothing runs and nothing is due: the step counter jumps to the next arrival."""
    import time

    from cpkv.engine.engine import build_scheduler
    from cpkv.engine.config import EngineConfig

    specs = [RequestSpec("a", 0, (1, 2, 3), 2), RequestSpec("b", 1_000_000, (4, 5), 2),
             RequestSpec("c", 0, (6,), 1, "a", 5)]
    sched = build_scheduler(EngineConfig(cp_size=2, device_pages=8, host_pages=0), specs)
    t0, planned = time.perf_counter(), 0
    while not sched.done:
        skipped = sched.skip_idle()
        assert skipped == 0 or not (sched.running or any(r.due < sched.step for r in sched.waiting))
        plan = sched.plan()
        planned += 1
        sched.complete(plan, [[7] * len(b.requests) for b in plan.forwards()])
    assert time.perf_counter() - t0 < 2.0 and planned < 20
    fin = {r.spec.id: r.finished_at for r in sched.requests}
    assert fin["a"] == 1 and fin["c"] == 1 + 1 + 5  # a follow-up still waits its delay
    assert fin["b"] == 1_000_001  # arrives at its step, prefill then one decode
    assert sched.skip_idle() == 0


def test_a_key_partitions_the_cache_and_a_follow_up_keeps_its_parents(tmp_path):
    """``key`` in a JSONL line (str or int) is the request's namespace: equal
    prompts under different keys share nothing; a follow-up keeps its parent's
    key. [[RFC-0001:C-PREFIX-CACHE]]"""
    from cpkv.engine.trace import parse_line
    from cpkv.tools.simulate import null_execute

    assert parse_line('{"id": "a", "arrival": 0, "tokens": [1], "max_new_tokens": 1, "key": 7}').key == 7
    for bad in ('true', '1.5', '[1]'):
        with pytest.raises(TraceError, match="'key'"):
            parse_line('{"id": "a", "arrival": 0, "tokens": [1], "max_new_tokens": 1, "key": %s}' % bad)
    prompt = list(range(1, 40))
    lines = [{"id": "a", "arrival": 0, "tokens": prompt, "max_new_tokens": 2, "key": "t1"},
             {"id": "b", "arrival": 3, "tokens": [5], "max_new_tokens": 2, "after": "a"},
             {"id": "c", "arrival": 9, "tokens": prompt, "max_new_tokens": 2, "key": "t2"},
             {"id": "d", "arrival": 12, "tokens": prompt, "max_new_tokens": 2, "key": "t1"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    specs = load_jsonl(str(path))
    dump_jsonl(specs, str(tmp_path / "u.jsonl"))
    assert load_jsonl(str(tmp_path / "u.jsonl")) == specs
    matched = []

    class Spy(PrefixCache):
        def allocate(self, what):
            m = super().allocate(what)
            matched.append((what.hit.ns, len(what.tokens), m.length))
            return m

    sched = Scheduler(specs, Spy(OwnerLaneAllocator(4 * 64 * 4, 4, 4)), chunk=64)
    while not sched.done:
        sched.complete(p := sched.plan(), null_execute(p))
    assert [r.key for r in sched.requests] == ["t1", "t1", "t2", "t1"]
    (ka, _, la), (kb, nb, lb), (kc, _, lc), (kd, _, ld) = matched
    assert (ka, la) == (b"t1", 0)  # the cache passes the key on as the bytes it partitions by
    assert kb == b"t1" and lb > len(prompt) - 4, "the follow-up hits its parent's pages"
    assert (kc, lc) == (b"t2", 0), "another key shares nothing"
    assert kd == b"t1" and ld > 0
