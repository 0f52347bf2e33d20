"""The prefix cache's error and its pure input checks: each takes a caller's
argument and returns it in the form the cache keeps, or raises
:class:`PrefixCacheMisuse` naming the rule. None reads the cache; the rules
that read its state are :class:`~cpkv.consumers.prefix_cache.PrefixCache`'s
own methods. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]
"""

from __future__ import annotations

import numpy as np

from ..contract.inputs import int_vector
from .kv_events import key_bytes


class PrefixCacheMisuse(ValueError):
    """A call the prefix cache refuses; nothing changed.

    ``rule`` is a short stable name of the broken rule (``match-consumed``,
    ``foreign-match``, ``bad-tokens``, ``slots-do-not-extend-match``, ...), so
    an engine can branch on it. [[RFC-0001:C-PREFIX-CACHE]]
    """

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"[{rule}] {message}")


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


def _as_end(end, what: str) -> int:
    """A token count ``end`` (an int >= 0), or raise ``bad-end``."""
    if isinstance(end, bool) or not isinstance(end, (int, np.integer)) or end < 0:
        raise PrefixCacheMisuse("bad-end", f"{what}: end must be an int >= 0, got {end!r}")
    return int(end)
