"""Serving traces: JSONL files refused line by line with the reason, built-in
workloads seeded, and a trace that could never fit the cache refused up front."""

import json

import pytest

from cpkv.consumers.prefix_cache import PrefixCache
from cpkv.contract.allocator import OwnerLaneAllocator
from cpkv.engine.scheduler import Scheduler
from cpkv.engine.trace import WORKLOADS, RequestSpec, TraceError, dump_jsonl, load_jsonl

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
    ({"id": "c", "arrival": 0, "tokens": [300], "max_new_tokens": 1}, "tokens must lie in [0, 256)"),
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


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_builtin_workloads_are_seeded_and_valid(name):
    a = WORKLOADS[name](6, seed=3, vocab=256, scale=0.05)
    assert a == WORKLOADS[name](6, seed=3, vocab=256, scale=0.05)
    assert a != WORKLOADS[name](6, seed=4, vocab=256, scale=0.05)
    ids = {s.id for s in a}
    assert len(ids) == len(a) and all(s.after in ids for s in a if s.after)
    assert all(0 <= t < 256 for s in a for t in s.tokens)


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
        def acquire(self, tokens, max_length=None, key=None):
            m = super().acquire(tokens, max_length, key)
            matched.append((key, len(tokens), m.length))
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
