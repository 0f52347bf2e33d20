"""The Triton backend's host-side planning, pure functions: how a context is
split among programs, how queries become decodes and extend blocks, which
FP8 columns a kernel may read with one scale per row or tile."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.kernels.triton_backend import chunks, query_runs
from cpkv.kernels.triton_common import ViewFormat, fp8_part, split_chunks


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 600), st.integers(0, 300_000), st.sampled_from([16, 32, 64]), st.sampled_from([8, 264]))
def test_split_chunks_fill_the_gpu_without_an_empty_split(work, length, tile, programs):
    splits, chunk = split_chunks(work, length, tile, programs)
    tiles = max(1, -(-length // tile))
    assert chunk % tile == 0 and splits >= 1
    assert splits * chunk >= length  # the chunks cover the longest context
    assert (splits - 1) * chunk < max(length, 1)  # and none of its splits is empty
    assert splits <= tiles
    if 0 < work < programs:
        assert work * splits >= programs or splits == tiles  # enough programs, or one split per key tile
        assert work * splits <= 2 * programs + 2 * work  # and not many more
    else:
        assert splits == 1


@given(st.integers(1, 12), st.integers(1, 500), st.sampled_from([16, 64]))
def test_chosen_split_counts_cover_the_context(splits, length, tile):
    """A split count given (a test's) keeps the chunks covering the context; the last may be empty."""
    n, chunk = chunks(1, length, tile, 264, splits)
    assert n == splits and chunk % tile == 0 and n * chunk >= length


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 150), min_size=0, max_size=8), st.sampled_from([4, 64]))
def test_query_runs_split_requests_into_decodes_and_blocks(runs, block_m):
    """Consecutive queries of one request form a run: a run of one decodes, a
    longer run is cut into blocks of at most block_m that never cross its end;
    together they cover every query once, in order."""
    req = np.repeat(np.arange(len(runs)) % 3, runs)  # neighbouring runs differ; a request may come back
    qidx, blocks = query_runs(req, block_m)
    starts = np.cumsum([0] + runs[:-1])
    assert qidx.tolist() == [int(s) for s, n in zip(starts, runs) if n == 1]
    covered = sorted(qidx.tolist() + [int(q) for _, f, c in blocks for q in range(f, f + c)])
    assert covered == list(range(len(req)))
    for r, f, c in blocks.tolist():
        assert 1 <= c <= block_m and (req[f : f + c] == r).all()
        end = next(int(s + n) for s, n in zip(starts, runs) if s <= f < s + n)
        assert f + c <= end


def test_fp8_part_reads_the_fewest_values():
    kv = ViewFormat(2, 8 * 128, 128, 0)  # gqa_fp8(8, 128): a scale per head
    assert fp8_part(kv, 0, 128, 8, 128, 128) == 1
    lat = ViewFormat(2, 512, 128, 64)  # DeepSeek's latent: 4 tiles, then the bf16 rope
    assert fp8_part(lat, 0, 0, 1, 512, 512) == 2 and fp8_part(lat, 512, 0, 1, 64, 64) == 3
    assert fp8_part(lat, 0, 0, 1, 576, 1024) == 0  # body and tail in one block: per value
    small = ViewFormat(2, 2 * 16, 16, 0)  # heads of 16 with a tile of 16
    assert fp8_part(small, 0, 16, 2, 16, 16) == 1
    odd = ViewFormat(2, 3 * 24, 32, 0)  # heads of 24 in tiles of 32: a head crosses a tile
    assert fp8_part(odd, 0, 24, 3, 24, 32) == 0
    assert fp8_part(ViewFormat(0), 0, 16, 2, 16, 16) == 0 and fp8_part(ViewFormat(1), 0, 16, 2, 16, 16) == 0
