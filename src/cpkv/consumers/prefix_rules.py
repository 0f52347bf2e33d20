"""The misuse rules of the prefix cache, beside it as :mod:`cpkv.contract.rules`
stands beside the allocator: checks that read the cache and change nothing.

Every refusal raises :class:`PrefixCacheMisuse` (or, for a chain the
allocator would take but the cache must not give, ``UnsupportedPagePlan``)
before anything changes. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..contract import rules
from ..contract.errors import UnsupportedPagePlan
from ..contract.inputs import int_vector
from ..contract.layout import page_of, ranges

from .kv_events import key_bytes
from .prefix_match import PrefixMatch

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache


class PrefixCacheMisuse(ValueError):
    """A call the prefix cache refuses; nothing changed.

    ``rule`` is a short stable name of the broken rule (``match-consumed``,
    ``foreign-match``, ``bad-tokens``, ``slots-do-not-extend-match``, ...), so
    an engine can branch on it. [[RFC-0001:C-PREFIX-CACHE]]
    """

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"[{rule}] {message}")


# -- input checks (pure) ---------------------------------------------------------
def _int_vector(x, what: str, rule: str) -> np.ndarray:
    """:func:`cpkv.contract.inputs.int_vector` (the one rule for index vectors:
    do not write to the result), its refusals raised as ``PrefixCacheMisuse(rule)``."""
    try:
        return int_vector(x, what)
    except (TypeError, ValueError) as e:
        raise PrefixCacheMisuse(rule, str(e)) from None


def _as_tokens(tokens) -> np.ndarray:
    """Token ids as a flat int64 array of ids >= 0 (the tree's keys), or raise.
    Not copied when already int64: the cache copies what it keeps."""
    a = _int_vector(tokens, "tokens", "bad-tokens")
    if a.size and a.min() < 0:
        raise PrefixCacheMisuse("bad-tokens", f"token ids must be >= 0, got {int(a.min())}")
    return a


def _as_key(key) -> bytes:
    """A request's namespace key as the bytes the tree partitions by
    (:func:`~cpkv.consumers.kv_events.key_bytes`), or raise ``bad-key``."""
    try:
        return key_bytes(key)
    except TypeError as e:
        raise PrefixCacheMisuse("bad-key", str(e)) from None


def _as_limit(max_length, n: int) -> int:
    """Most tokens a match may cover: ``n - 1`` by default, so at least one is computed."""
    if max_length is None:
        return n - 1
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 0:
        raise PrefixCacheMisuse("bad-max-length", f"max_length must be an int >= 0 or None, got {max_length!r}")
    return min(int(max_length), n)


def check_end(cache: "PrefixCache", match: PrefixMatch, slots: np.ndarray, what: str) -> None:
    """Every rule :meth:`PrefixCache.insert` and :meth:`PrefixCache.release`
    share, checked before anything changes (reads ``cache``, changes nothing)."""
    _check_match(cache, match, what)
    n, L = slots.size, match.length
    if n < L or not np.array_equal(slots[:L], match.slots.numpy()):
        raise PrefixCacheMisuse("slots-do-not-extend-match",
                                f"{what}: the first {L} slots must be the match's own slots")
    _check_private(cache, slots, match.shared, what)


def _check_match(cache: "PrefixCache", match: PrefixMatch, what: str) -> None:
    """``match`` is a live match of ``cache``, or raise."""
    if not isinstance(match, PrefixMatch):
        raise PrefixCacheMisuse("not-a-match", f"{what} takes the PrefixMatch of acquire(), got {type(match).__name__}")
    if match._owner is not cache:
        raise PrefixCacheMisuse("foreign-match", f"{what}: the match was not acquired from this cache")
    if match.consumed:
        raise PrefixCacheMisuse("match-consumed", f"{what}: the match was already {match._ended}; a match ends once")


def check_tails(cache: "PrefixCache", matches: list, tokens: np.ndarray, slots: np.ndarray, counts: np.ndarray,
                what: str, whole_pages: bool) -> None:
    """The rules of :meth:`PrefixCache.cache_pages` / :meth:`PrefixCache.insert_tail`
    and their batched forms, for a batch of runs: run ``i`` is the next
    ``counts[i]`` entries of ``tokens`` and ``slots``, request ``matches[i]``'s
    positions from ``match.shared`` on, equally many (whole pages, at least
    one, for ``cache_pages``, whose match must be live), starting with the
    match's private copy if it has one, on the request's own allocated,
    uncached pages, a page chain, no page in two runs, no match twice.
    Vectorised over the batch: O(total slots + len(matches)); nothing before
    a match's ``shared`` is read."""
    if len(matches) != counts.size:
        raise PrefixCacheMisuse("length-mismatch", f"{what}: {len(matches)} matches but {counts.size} counts")
    if not all(type(m) is PrefixMatch and m._owner is cache and m._ended is None and (m.live or not whole_pages)
               for m in matches):  # the common case in one pass; else find the bad one
        for m in matches:
            _check_match(cache, m, what)
            if whole_pages and not m.live:
                raise PrefixCacheMisuse("match-not-live", f"{what}: the match stopped caching pages; it ends with "
                                        "insert_tail")
    if len({id(m) for m in matches}) != len(matches):
        raise PrefixCacheMisuse("match-twice", f"{what}: a match appears twice in one batch")
    if counts.size and counts.min() < 0:
        raise PrefixCacheMisuse("bad-counts", f"{what}: counts must be >= 0, got {int(counts.min())}")
    total = int(counts.sum())
    if not tokens.size == slots.size == total:
        raise PrefixCacheMisuse("length-mismatch", f"{what}: {tokens.size} tokens but {slots.size} slots "
                                f"({total} counted)")
    if whole_pages and (counts.size and (counts.min() == 0 or (counts % cache.S).any())):
        bad = int(counts[(counts == 0) | (counts % cache.S != 0)][0])
        raise PrefixCacheMisuse("not-whole-pages", f"{what}: {bad} slots are not whole pages (>= 1)")
    starts = np.cumsum(counts) - counts
    for i, m in enumerate(matches):
        if m.shared >= m.length:  # no private copy waiting to be cached
            continue
        copied = m._dst  # the private copy's slots, while not cached yet
        if copied.size and (counts[i] < copied.size or not np.array_equal(
                slots[starts[i] : starts[i] + copied.size], copied)):
            raise PrefixCacheMisuse("slots-do-not-extend-match", f"{what}: the slots must start with the match's copy")
    run_pos = ranges(np.zeros_like(counts), counts)
    _check_chains(cache, slots, run_pos, np.ones(total, dtype=bool), what)


def _check_private(cache: "PrefixCache", slots: np.ndarray, shared: int, what: str) -> None:
    """``slots`` (positions from a page boundary) are a page chain, and its
    pages past ``shared`` are allocated and not the cache's, or raise."""
    pos = np.arange(slots.size)
    _check_chains(cache, slots, pos, pos >= shared, what)


def _check_chains(cache: "PrefixCache", slots: np.ndarray, run_pos: np.ndarray, private: np.ndarray,
                  what: str) -> None:
    """Runs of slots, ``run_pos`` each slot's position in its run (a run
    starts on a page boundary), are page chains (slot j at offset j % S of
    the run's page j // S, every page a usable one, no page in two places),
    and the pages of the slots marked ``private`` are allocated and not the
    cache's, or raise. Vectorised."""
    S, n = cache.S, slots.size
    if not n:
        return
    pages = page_of(slots, S)
    heads = np.flatnonzero(run_pos % S == 0)  # each page's first position
    first = np.repeat(pages[heads], np.diff(np.append(heads, n)))
    if (pages.min() < 1 or pages.max() > cache.alloc.num_pages or (slots % S != run_pos % S).any()
            or (pages != first).any() or np.unique(pages[heads]).size != heads.size):
        raise PrefixCacheMisuse("not-a-page-chain", f"{what}: slot j must sit at offset j % {S} of the request's "
                                f"own page j // {S}, every page a usable one, none twice")
    own = np.sort(pages[heads[private[heads]]])  # distinct (checked above); private runs are whole pages
    if own.size and not (ok := cache.alloc.is_allocated(own)).all():
        raise PrefixCacheMisuse("private-page-not-allocated", f"{what}: page {int(own[~ok][0])} of the request is free")
    if own.size and cache.tree.page_cached[own].any():
        bad = int(own[cache.tree.page_cached[own]][0])
        raise PrefixCacheMisuse("private-page-cached", f"{what}: page {bad} past the shared prefix is the cache's")


def refuse_cached_growth(cache: "PrefixCache", prefix_lens, seq_lens, last_loc) -> None:
        """Raise ``UnsupportedPagePlan("extends-cached-page")``, nothing
        changed, if a request would grow its chain inside a partly filled page
        that the cache holds: ``last_loc`` is the last written slot of a cached
        page that is not full (a partial leaf, say) and the request adds tokens
        after it. The allocator alone would accept that (the slot ends its
        page's writes) and hand out the rest of the cache's page, so a second
        request matching that prefix would read another request's KV. A request
        that matched a prefix ending mid-page continues in its private copy
        (``PrefixMatch.last_loc``), never in the page the copy read.
        [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]

        Only chains the allocator would otherwise take are checked here; a
        malformed batch is left to the allocator's own rules."""
        S = cache.S
        prefix, seq = int_vector(prefix_lens, "prefix_lens"), int_vector(seq_lens, "seq_lens")
        last = int_vector(last_loc, "last_loc")
        if not prefix.size == seq.size == last.size:
            return
        grows = (prefix > 0) & (seq > prefix) & (prefix % S != 0)  # the next token lands on last_loc's page
        if not grows.any():
            return
        page = page_of(last, S)
        grows &= (page >= 1) & (page <= cache.alloc.num_pages)
        page = np.where(grows, page, 0)
        grows &= cache.tree.page_cached[page] & rules.continues_chain(last, prefix, cache.alloc.page_fill(page), S)
        if grows.any():
            r = int(grows.nonzero()[0][0])
            raise UnsupportedPagePlan(
                "extends-cached-page",
                f"last_loc {last[r]} ends the written part of page {page[r]}, a partly filled page the prefix cache "
                "holds; a request that matched it continues in its own copy (the match's last_loc)", r)
