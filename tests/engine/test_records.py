"""A request's record: its token ids in one buffer, appended in batches and
read in runs, equal to the one-by-one forms."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.engine.records import Request, append_tokens, id_runs
from cpkv.engine.trace import RequestSpec


def _requests(lengths, new):
    return [Request(RequestSpec(f"r{i}", 0, tuple(range(1, n + 1)), new), i, prompt=tuple(range(1, n + 1)))
            for i, n in enumerate(lengths)]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), new=st.integers(1, 4),
       steps=st.integers(1, 7), read_first=st.booleans(), read_every=st.integers(1, 3), data=st.data())
def test_batched_appends_and_runs_equal_one_by_one(lengths, new, steps, read_first, read_every, data):
    """``append_tokens`` appends what ``Request.append`` would (the id buffer
    grows past ``max_new_tokens`` too, and holds every token appended so far
    at every read between appends) and names the requests that reached
    ``max_new_tokens`` in that call; ``id_runs`` is the concatenation of the
    requests' ``ids(start, end)``."""
    batch, single = _requests(lengths, new), _requests(lengths, new)
    if read_first:  # the buffer exists before the appends (as for an admitted request), or is built after
        for r in batch + single:
            r.ids()
    for step in range(steps):
        toks = [step * 10 + i for i in range(len(batch))]
        done = append_tokens(batch, toks)
        for r, t in zip(single, toks):
            r.append(t)
        assert [r.index for r in done] == [r.index for r in batch if len(r.generated) == new]
        if step % read_every == 0:  # a read between appends: every token so far, none stale
            assert all(r.ids().tolist() == list(r.prompt) + r.generated for r in batch)
    for a, b in zip(batch, single):
        assert a.generated == b.generated and a.ids().tolist() == b.ids().tolist() == list(a.prompt) + a.generated
    starts = [data.draw(st.integers(0, r.length)) for r in batch]
    ends = [data.draw(st.integers(s, r.length)) for s, r in zip(starts, batch)]
    want = np.concatenate([r.ids(s, e) for r, s, e in zip(single, starts, ends)])
    assert id_runs(batch, starts, ends).tolist() == want.tolist()


def test_wrong_calls_raise_and_change_nothing():
    """A token that is not an int >= 0, or counts that differ, append nothing to any
    request; a run outside a request's known tokens is refused."""
    reqs = _requests([3, 4], 2)
    for r in reqs:
        r.ids()
    for toks in ([5], [5, "x"], [5, -1], [5, 6, 7]):
        try:
            append_tokens(reqs, toks)
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"{toks} was taken")
        assert [r.generated for r in reqs] == [[], []] and [r.ids().tolist() for r in reqs] == [[1, 2, 3], [1, 2, 3, 4]]
    for starts, ends in (([0, 0], [4, 4]), ([2, 0], [1, 4]), ([0], [3])):
        try:
            id_runs(reqs, starts, ends)
        except ValueError:
            continue
        raise AssertionError(f"runs {starts}..{ends} were read")
