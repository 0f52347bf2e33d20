"""The Mooncake trace reader: equal hash ids give equal tokens, unequal ones no
accidental common prefix, partial last blocks, scaling, slicing, and every
malformed field refused with its line."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cpkv.engine.mooncake import (BlockPrompt, TokenBook, is_mooncake, load_mooncake, mooncake_path,
                                  read_mooncake, scale_lengths, scaled_chunk, take)
from cpkv.engine.trace import TraceError

#: The traces beside the repository (``../shared/data/mooncake`` from its root), as a fresh clone finds them.
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake"
CONVERSATION = DATA / "conversation_trace.jsonl"
needs_data = pytest.mark.skipif(not CONVERSATION.is_file(),
                                reason=f"the Mooncake traces are not at {DATA} (../shared/data/mooncake)")


def line(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


GOOD = [line(0, 1000, 10, [0, 1]),  # 512 + 488
        line(0, 1536, 600, [0, 1, 2]),  # shares two blocks (the second full here)
        line(5, 300, 1, [0]),  # the first block, cut to 300
        line(9, 700, 3, [0, 3])]  # a sibling of block 1


def write(tmp_path, rows, name="m.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def lcp(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def expected_lcp(ids_a, ids_b, len_a, len_b, block) -> int:
    """The common prefix the blocks alone give: every equal leading block, the
    last one cut to the shorter request."""
    k = 0
    while k < min(len(ids_a), len(ids_b)) and ids_a[k] == ids_b[k]:
        k += 1
    shared = k * block
    if k == len(ids_a) or k == len(ids_b):
        return min(len_a, len_b, shared)
    return min(shared, len_a, len_b)


def test_equal_ids_equal_tokens_unequal_ids_no_accidental_prefix(tmp_path):
    t = load_mooncake(write(tmp_path, GOOD))
    toks = [np.asarray(s.tokens) for s in t.specs]
    assert [len(x) for x in toks] == [1000, 1536, 300, 700]
    assert t.accidental_tokens == 0
    for i, a in enumerate(t.records):
        for j, b in enumerate(t.records):
            assert lcp(toks[i], toks[j]) == expected_lcp(a.hash_ids, b.hash_ids, len(toks[i]), len(toks[j]), 512)
    # the partial blocks are prefixes of the full block of the same id
    assert (toks[0][512:1000] == toks[1][512:1000]).all() and (toks[2] == toks[1][:300]).all()


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=12),
       st.sampled_from([None, 2, 3, 256]), st.integers(1, 24))
def test_any_trace_any_vocabulary_prefixes_stop_at_the_blocks(paths, vocab, block):
    """Random prefix trees (each request a path of child choices), any
    vocabulary: tokens share exactly the equal blocks, plus at most
    ``accidental_tokens`` (0 when the vocabulary holds every sibling count)."""
    ids, records = {}, []
    from cpkv.engine.mooncake import MooncakeRecord

    for n, path in enumerate(paths):
        chain, key = [], ()
        for c in path:
            key = key + (c,)
            chain.append(ids.setdefault(key, len(ids)))
        records.append(MooncakeRecord(n, 512 * len(chain) - (n % 7), 1, tuple(chain), n + 1))
    try:
        book = TokenBook(records, block, vocab)
    except ValueError as e:  # siblings a block cannot number
        assert "cannot tell" in str(e) and vocab is not None and block < 4
        return
    inputs, _ = scale_lengths(records, block)
    toks = [book.tokens(r.hash_ids, int(m)) for r, m in zip(records, inputs)]
    siblings = max(sum(1 for k in ids if len(k) == len(p) and k[:-1] == p[:-1]) for p in ids)
    assert book.accidental_tokens == (0 if vocab is None or siblings <= vocab else book.accidental_tokens)
    assert book.accidental_tokens < block
    for i, a in enumerate(records):
        assert toks[i].dtype == np.int32 and (vocab is None or toks[i].max() < vocab)
        for j, b in enumerate(records):
            want = expected_lcp(a.hash_ids, b.hash_ids, len(toks[i]), len(toks[j]), block)
            got = lcp(toks[i], toks[j])
            assert want <= got <= want + book.accidental_tokens
            if a.hash_ids == b.hash_ids:
                assert got == min(len(toks[i]), len(toks[j]))


def test_scaling_keeps_the_blocks_and_scales_lengths(tmp_path):
    recs = read_mooncake(write(tmp_path, GOOD))
    inputs, outputs = scale_lengths(recs, 16)
    assert inputs.tolist() == [16 + 16 * 488 // 512 + 1, 48, 10, 16 + 6]  # ceil(488/32)=16, ceil(300/32)=10, ceil(188/32)=6
    assert outputs.tolist() == [1, 19, 1, 1]  # ceil(10/32), ceil(600/32), at least one token
    assert scale_lengths(recs, 512)[0].tolist() == [1000, 1536, 300, 700]
    assert scale_lengths(recs, 16, max_output=5)[1].tolist() == [1, 5, 1, 1]
    t = load_mooncake(write(tmp_path, GOOD), block=16, vocab=256, max_output=5)
    assert [len(s.tokens) for s in t.specs] == inputs.tolist()
    assert [s.max_new_tokens for s in t.specs] == [1, 5, 1, 1]
    a, b = (np.asarray(s.tokens) for s in t.specs[:2])
    assert lcp(a, b) == 32 and (a < 256).all()  # the two shared blocks, 16 tokens each
    for bad in (0, 513, True, 1.5):
        with pytest.raises(ValueError, match="block_tokens"):
            scale_lengths(recs, bad)
        with pytest.raises(ValueError, match="block_tokens"):
            scaled_chunk(bad)
    assert [scaled_chunk(b) for b in (512, 16, 1)] == [8192, 256, 16]  # the prefill chunk scales with the blocks
    with pytest.raises(ValueError, match="max_output"):
        scale_lengths(recs, 16, max_output=0)


def test_slicing_by_requests_and_window_and_arrival_steps(tmp_path):
    path = write(tmp_path, GOOD)
    recs = read_mooncake(path)
    assert [r.line for r in take(recs, requests=2)] == [1, 2]
    assert [r.line for r in take(recs, window_ms=6)] == [1, 2, 3]
    assert [r.line for r in take(recs, requests=1, window_ms=6)] == [1]
    with pytest.raises(TraceError, match="no request arrives in the first 1 ms"):
        take([r for r in recs if r.timestamp > 0], window_ms=1)
    for bad in (dict(requests=0), dict(window_ms=-3), dict(requests=True)):
        with pytest.raises(ValueError):
            take(recs, **bad)
    t = load_mooncake(path, step_ms=4)
    assert [s.arrival for s in t.specs] == [0, 0, 1, 2] and t.arrival_ms.tolist() == [0, 0, 5, 9]
    assert [s.id for s in t.specs] == ["line1", "line2", "line3", "line4"]
    with pytest.raises(ValueError, match="step_ms"):
        load_mooncake(path, step_ms=0)
    with pytest.raises(TraceError, match="no request arrives in the first 1 ms"):
        load_mooncake(write(tmp_path, GOOD[2:], "late.jsonl"), window_ms=1)


def test_a_slice_reads_only_its_own_lines(tmp_path):
    """A slice stops reading where it ends: a malformed line past it is not seen; one inside it is refused."""
    path = write(tmp_path, GOOD[:3] + ["{broken"])
    assert len(load_mooncake(path, requests=3).specs) == 3 and len(load_mooncake(path, window_ms=5).specs) == 2
    for kw in ({"requests": 4}, {"window_ms": 6}, {}):
        with pytest.raises(TraceError, match=f"{path}:4: not JSON"):
            load_mooncake(path, **kw)


def test_lazy_prompts_equal_the_tuples(tmp_path):
    path = write(tmp_path, GOOD)
    lazy, eager = load_mooncake(path, lazy=True), load_mooncake(path)
    for a, b in zip(lazy.specs, eager.specs):
        assert isinstance(a.tokens, BlockPrompt) and isinstance(b.tokens, tuple)
        assert len(a.tokens) == len(b.tokens) and tuple(a.tokens) == b.tokens
        assert np.array_equal(np.asarray(a.tokens), b.tokens) and a.tokens[3:7].tolist() == list(b.tokens[3:7])
    assert lazy.specs[0].tokens == load_mooncake(path, lazy=True).specs[0].tokens or True  # books differ: no claim
    assert lazy.specs[0].tokens == lazy.specs[0].tokens and lazy.specs[0].tokens != lazy.specs[1].tokens


@pytest.mark.parametrize("bad,reason", [
    ("{oops", "not JSON"),
    ("[1]", "a line must be a JSON object"),
    ({**line(9, 10, 1, [5]), "tokens": [1]}, "unknown keys ['tokens']"),
    ({"timestamp": 9, "input_length": 10, "hash_ids": [5]}, "missing ['output_length']"),
    (line("9", 10, 1, [5]), "'timestamp' must be an int, got str"),
    (line(9.0, 10, 1, [5]), "'timestamp' must be an int, got float"),
    (line(True, 10, 1, [5]), "'timestamp' must be an int, got bool"),
    (line(-1, 10, 1, [5]), "'timestamp' must be >= 0"),
    (line(8, 10, 1, [5]), "timestamp 8 is before the previous line's 9"),
    (line(9, 0, 1, []), "'input_length' must be >= 1"),
    (line(9, [10], 1, [5]), "'input_length' must be an int, got list"),
    (line(9, 10, 0, [5]), "'output_length' must be >= 1"),
    (line(9, 10, None, [5]), "'output_length' must be an int, got NoneType"),
    (line(9, 10, 1, 5), "'hash_ids' must be a list of ints"),
    (line(9, 10, 1, ["5"]), "'hash_ids' must be a list of ints"),
    (line(9, 10, 1, [False]), "'hash_ids' must be a list of ints"),
    (line(9, 10, 1, [-5]), "'hash_ids' must be >= 0, got -5"),
    (line(9, 600, 1, [5]), "'hash_ids' has 1 ids but input_length 600 takes 2 blocks of 512 tokens"),
    (line(9, 10, 1, [7, 8]), "'hash_ids' has 2 ids but input_length 10 takes 1 blocks"),
    (line(9, 600, 1, [7, 1]), "hash id 1 follows id 7 here but follows id 0 on line 1"),
    (line(9, 10, 1, [1]), "hash id 1 starts it here but follows id 0 on line 1"),
    (line(9, 600, 1, [2, 0]), "hash id 0 follows id 2 here but starts a request on line 1"),
])
def test_a_malformed_line_is_refused_with_its_number_and_reason(tmp_path, bad, reason):
    path = write(tmp_path, [line(9, 1000, 10, [0, 1]), "", bad])
    with pytest.raises(TraceError) as e:
        read_mooncake(path)
    assert f"{path}:3: " in str(e.value) and reason in str(e.value), str(e.value)


def test_an_empty_file_is_refused_and_the_format_recognised(tmp_path):
    empty = write(tmp_path, [""], "empty.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        read_mooncake(empty)
    moon, cpkv_trace = write(tmp_path, GOOD), write(tmp_path, [{"id": "a", "arrival": 0, "tokens": [1],
                                                               "max_new_tokens": 1}], "c.jsonl")
    assert is_mooncake(moon) and not is_mooncake(cpkv_trace) and not is_mooncake(empty)
    assert not is_mooncake(str(tmp_path / "missing.jsonl"))
    assert mooncake_path(moon) == moon and mooncake_path(f"mooncake:{moon}") == moon
    assert mooncake_path(cpkv_trace) is None and mooncake_path("multiturn") is None


def test_the_run_configuration_reads_a_mooncake_trace(tmp_path):
    from cpkv.engine.config import EngineConfig

    path = write(tmp_path, GOOD)
    cfg = EngineConfig(device_pages=64, workload=f"mooncake:{path}", requests=3, block_tokens=16, max_output=2,
                       step_ms=5)
    specs = cfg.trace()
    assert [s.id for s in specs] == ["line1", "line2", "line3"] and [s.arrival for s in specs] == [0, 0, 1]
    assert [len(s.tokens) for s in specs] == [32, 48, 10] and max(max(s.tokens) for s in specs) < 256
    assert EngineConfig(device_pages=64, workload=path, requests=8).trace()[3].max_new_tokens == 1  # by its fields


@needs_data
def test_the_released_traces_read_whole():
    conv = read_mooncake(str(CONVERSATION))
    assert len(conv) == 12031 and sum(r.input_length for r in conv) == 144_793_823
    assert max(r.input_length for r in conv) == 126_195
    t = load_mooncake(str(CONVERSATION), block=16, requests=200, vocab=256)
    assert t.accidental_tokens == 0  # block 0's 200-odd children fit a 256-token vocabulary
    assert all(max(s.tokens) < 256 for s in t.specs)
