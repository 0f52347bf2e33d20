"""Arithmetic on a request's KV row, for SGLang's row-level allocator calls.

A request's KV row (SGLang's ``req_to_token[req, :]``) holds the slot of each
of its positions. On an owner-lane chain position ``t`` sits at page offset
``t % S`` of a page in lane ``(b + t // S) % N`` ([[RFC-0001:C-OWNER-LANE]]),
``b`` the request's lane base. The functions here are pure and vectorised;
they check rows and segments of rows without any allocator state:

* :func:`new_pages` -- SGLang's ``get_num_new_pages``;
* :func:`segments_to_slots` -- the slots ``free_segments`` frees, a page
  shared with the previous segment dropped from a segment's head;
* :func:`row_lane_base` -- the lane base of a whole row, refused unless the
  row is one owner-lane chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidFree, UnsupportedPagePlan
from .inputs import int_scalar, int_vector
from .layout import lane_base_from_prefix, owner_of, page_of


def new_pages(seq: np.ndarray, prefix: np.ndarray, page_size: int) -> int:
    """Pages a batch adds: ``sum(ceil(seq / S) - ceil(prefix / S))`` over its
    requests (SGLang's ``get_num_new_pages``). ``seq``, ``prefix`` are int64
    ``[bs]``; raises ``UnsupportedPagePlan`` (``mismatched-lengths``,
    ``negative-prefix``, ``prefix-longer-than-sequence``) for a batch no
    allocation could take."""
    if seq.size != prefix.size:
        raise UnsupportedPagePlan("mismatched-lengths", f"{prefix.size} prefix_lens, {seq.size} seq_lens")
    if (prefix < 0).any():
        r = int((prefix < 0).nonzero()[0][0])
        raise UnsupportedPagePlan("negative-prefix", f"prefix_len {prefix[r]} < 0", r)
    if (prefix > seq).any():
        r = int((prefix > seq).nonzero()[0][0])
        raise UnsupportedPagePlan("prefix-longer-than-sequence", f"prefix_len {prefix[r]} > seq_len {seq[r]}", r)
    return int((-(-seq // page_size) - -(-prefix // page_size)).sum())


def segments_to_slots(segments, page_size: int) -> np.ndarray:
    """The slots ``free_segments`` frees, as one int64 host array.

    ``segments`` is an iterable of ``(slots, start_pos)``: ``slots [n]`` hold
    positions ``start_pos .. start_pos + n - 1`` of one request's row, the
    segments in ascending order. A segment whose start shares a page with
    the end of the segment before it loses its head up to the next page
    boundary (that page is the earlier segment's, freed once); every other
    segment starts on a page boundary (and a trimmed head must lie on the
    previous segment's last page). Empty segments are skipped. Raises
    :class:`InvalidFree` ``unaligned-segment`` (a start inside a page no
    earlier segment holds, or a slot whose page offset is not its position's)
    and ``overlapping-segments`` (a start before the previous segment's end),
    ``TypeError`` for a malformed segment. One Python step per segment (a
    request frees a handful), vectorised within each."""
    S, prev_end, prev_page, parts = page_size, None, -1, []
    for i, seg in enumerate(segments):
        if not isinstance(seg, tuple) or len(seg) != 2:
            raise TypeError(f"segment {i} must be a (slots, start_pos) pair, got {type(seg).__name__}")
        s, start = int_vector(seg[0], "slots"), int_scalar(seg[1], "start_pos")
        if s.size == 0:
            continue
        if start < 0:
            raise InvalidFree("overlapping-segments", f"segment {i} starts at negative position {start}")
        if prev_end is not None and start < prev_end:
            raise InvalidFree("overlapping-segments",
                              f"segment {i} starts at position {start}, before the previous one's end {prev_end}")
        end, cut = start + s.size, 0
        if start % S:
            if prev_end is None or page_of(start, S) != page_of(prev_end - 1, S):
                raise InvalidFree("unaligned-segment", f"segment {i} starts at position {start}, inside page "
                                  f"position {start // S} that no earlier segment holds")
            cut = -start % S  # positions on the page the previous segment frees
            if (page_of(s[:cut], S) != prev_page).any():
                raise InvalidFree("unaligned-segment", f"segment {i}'s head is not on page {prev_page}, "
                                  "where the previous segment ends")
        prev_page = page_of(int(s[-1]), S)
        s, start, prev_end = s[cut:], start + cut, end
        check_row_offsets(s, start, S, i)
        parts.append(s)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def check_row_offsets(slots: np.ndarray, start_pos: int, page_size: int, segment: int = 0) -> None:
    """Raise ``InvalidFree("unaligned-segment")`` unless every slot sits at its
    position's page offset: ``slots[i] % S == (start_pos + i) % S``."""
    if slots.size and ((slots - np.arange(start_pos, start_pos + slots.size)) % page_size).any():
        raise InvalidFree("unaligned-segment", f"segment {segment}: its slots do not sit at the page offsets of "
                          f"positions {start_pos}..{start_pos + slots.size - 1} (is start_pos right?)")


@dataclass(frozen=True)
class RowPlacement:
    """Where a KV row lies across the CP group: ``length`` positions on an
    owner-lane chain of lane base ``lane_base`` (position t in lane
    ``(lane_base + t // page_size) % cp_size``). What
    :meth:`~cpkv.contract.allocator.OwnerLaneAllocator.get_cpu_copy` returns."""

    lane_base: int
    length: int
    page_size: int
    cp_size: int


def row_lane_base(slots: np.ndarray, page_size: int, cp_size: int) -> int:
    """Lane base of the row ``slots [n]`` (positions ``0 .. n-1``), refused
    with ``UnsupportedPagePlan("not-one-chain")`` unless each slot sits at its
    position's page offset in lane ``(b + t // S) % N``. An empty row has
    base 0. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    if slots.size == 0:
        return 0
    S, N = page_size, cp_size
    t = np.arange(slots.size)
    base = lane_base_from_prefix(owner_of(page_of(slots, S), N), t + 1, S, N)
    bad = ((slots - t) % S != 0) | (base != base[0]) | (slots < S)
    if bad.any():
        r = int(bad.nonzero()[0][0])
        raise UnsupportedPagePlan("not-one-chain", f"position {r} sits at slot {slots[r]}, which is not on the "
                                  f"owner-lane chain of lane base {base[0]} that position 0 starts")
    return int(base[0])
