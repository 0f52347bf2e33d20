"""KV cache events for prefix-aware routers: the block hash and the sink a cache calls.

A router that places requests by prefix (Dynamo's KV router, llm-d, SGLang's
router) learns which blocks each worker caches from the events the worker
publishes. This module holds the block hash a router recomputes for a new
request (:func:`block_hashes`), the namespace key (:func:`key_bytes`), the
mediums, and :class:`KVEventSink`, the object a prefix cache calls when pages
enter or leave a tier ([[RFC-0001:C-KV-EVENTS]]). It needs nothing beyond numpy:
a cache imports it on a bare install. The events themselves, in vLLM's schema,
are in :mod:`cpkv.consumers.kv_wire`, and the transport (a ZMQ PUB socket plus a
replay socket) in :mod:`cpkv.consumers.kv_events_zmq`; both need the ``events``
extra, and a sink imports the schema when it is made.

Block hash (language neutral, stable across processes, CP groups, runs and
versions of cpkv): only FULL pages are blocks (vLLM announces only full blocks),
and a block is one page of ``page_size`` tokens, whatever the CP group's size (a
logical page lives whole on its owner rank, so a group advertises
``block_size = page_size``). For a chain of tokens cut into pages, with
``parent_0 = 0`` and a namespace key ``k`` (bytes; UTF-8 of a str; the decimal
digits of an int; empty for ``None``, see :func:`key_bytes`)::

    msg_i  = u32be(len(k)) || k || u64be(parent_i) || u64be(t) for each token t of page i
    hash_i = int.from_bytes(sha256(msg_i)[:8], "big") & (2**63 - 1)
    parent_{i+1} = hash_i

so every hash fits a signed and an unsigned 64-bit integer alike, and is a pure
function of (parent hash, the page's tokens, the key): equal content has equal
hashes on every worker. Block i's hash names the whole prefix through page i, as
vLLM's chained hashes do.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from ..contract.inputs import int_scalar, int_vector

MEDIUM_DEVICE = "GPU"
"""vLLM's medium string for the accelerator tier (cpkv's device pool, on any device)."""
MEDIUM_HOST = "CPU"
"""vLLM's medium string for the host tier (cpkv's :mod:`hicache` host pool)."""
ROOT_PARENT = 0
"""The parent hash that page 0 of every chain is hashed with (events carry ``None`` there)."""
_HASH_MASK = (1 << 63) - 1


def key_bytes(key) -> bytes:
    """A namespace key (a LoRA id, a cache salt: SGLang's ``extra_key``,
    vLLM's ``cache_salt``) as the bytes the prefix cache partitions by and
    :func:`block_hashes` hashes: ``None`` -> ``b""`` (the default namespace,
    as are ``""`` and ``b""``), a str -> its UTF-8, an int -> its decimal
    digits in ASCII (so ``7`` and ``"7"`` are one namespace), bytes as they
    are. Raises ``TypeError`` for anything else (a bool included).
    [[RFC-0001:C-KV-EVENTS]]"""
    if key is None:
        return b""
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return str(int(key)).encode("ascii")
    raise TypeError(f"key must be None, a str, an int or bytes; got {type(key).__name__}")



def _tokens(tokens, name: str = "tokens") -> np.ndarray:
    """Tokens as a 1-D int64 host array, each >= 0 (TypeError/ValueError otherwise)."""
    t = int_vector(tokens, name)
    if t.size and int(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(t.min())}")
    return t


def _page_size(page_size) -> int:
    s = int_scalar(page_size, "page_size")
    if s < 1:
        raise ValueError(f"page_size must be >= 1, got {s}")
    return s


def _chain_hashes(t: np.ndarray, page_size: int, key, n_pages: int) -> list[int]:
    """Hashes of the first ``n_pages`` pages of validated tokens ``t`` (see the module doc)."""
    k = key_bytes(key)
    base = hashlib.sha256(len(k).to_bytes(4, "big") + k)
    body = memoryview(t[: n_pages * page_size].astype(">u8").tobytes())
    step = 8 * page_size
    out, parent = [], ROOT_PARENT
    for i in range(n_pages):  # a chain: each hash needs the one before
        h = base.copy()
        h.update(parent.to_bytes(8, "big"))
        h.update(body[i * step:(i + 1) * step])
        parent = int.from_bytes(h.digest()[:8], "big") & _HASH_MASK
        out.append(parent)
    return out


def block_hashes(tokens, page_size: int, key=None) -> list[int]:
    """The block hash of every full page of ``tokens`` (a router's call).

    ``tokens``: a 1-D int tensor/array or list of token ids (each >= 0);
    ``page_size``: tokens per page (the events' ``block_size``); ``key``:
    ``None``, a str, an int or bytes namespace (a model, adapter or tenant) hashed into
    every block. Returns ``len(tokens) // page_size`` ints in ``[0, 2**63)``,
    defined in the module doc; a trailing partial page has no hash. Raises
    ``TypeError``/``ValueError`` for a bad argument ([[RFC-0001:C-KV-EVENTS]])."""
    s = _page_size(page_size)
    t = _tokens(tokens)
    return _chain_hashes(t, s, key, t.size // s)


class KVEventSink:
    """What a prefix cache calls as pages enter and leave its tiers.

    Each call turns into one vLLM event, appended to a pending batch;
    :meth:`flush` (once per engine step, as vLLM does) hands the batch to
    ``publisher.publish``. With ``auto_flush`` each call is its own batch.
    ``page_size`` is the cache's page size (the events' ``block_size``); ``key``
    the default namespace of :func:`block_hashes`. Events are
    :mod:`cpkv.consumers.kv_wire`'s (``BlockStored`` with ``group_idx`` 0);
    making a sink without the ``events`` extra raises ``ImportError`` in one
    line naming it. A refused call (bad arguments) raises and queues nothing
    ([[RFC-0001:C-KV-EVENTS]])."""

    def __init__(self, publisher, page_size: int, key=None, auto_flush: bool = False):
        if not callable(getattr(publisher, "publish", None)):
            raise TypeError(f"publisher must have a publish(batch) method, got {type(publisher).__name__}")
        key_bytes(key)
        from . import kv_wire

        self._wire = kv_wire
        self.publisher = publisher
        self.page_size = _page_size(page_size)
        self.key = key
        self.auto_flush = bool(auto_flush)
        self.pending: list = []
        self.last_seq = None
        """What ``publisher.publish`` returned for the last batch (a sequence number), ``None`` before."""

    def _span(self, tokens, first_page_index, n_pages, medium, key):
        if not isinstance(medium, str) or not medium:
            raise TypeError(f"medium must be a non-empty str such as {MEDIUM_DEVICE!r} or {MEDIUM_HOST!r}, got {medium!r}")
        t = _tokens(tokens, "tokens_of_chain")
        s = self.page_size
        first = int_scalar(first_page_index, "first_page_index")
        full = t.size // s
        n = full - first if n_pages is None else int_scalar(n_pages, "n_pages")
        if first < 0 or n < 0 or first + n > full:
            raise ValueError(
                f"pages [{first}, {first + n}) are not full pages of a {t.size}-token chain "
                f"with page_size {s} ({full} full pages)")
        key = self.key if key is None else key
        hashes = _chain_hashes(t, s, key, first + n)
        return t, first, n, hashes

    def stored(self, tokens_of_chain, first_page_index: int, n_pages: int | None = None,
               medium: str = MEDIUM_DEVICE, key=None) -> list[int]:
        """Pages ``[first_page_index, first_page_index + n_pages)`` of the chain
        ``tokens_of_chain`` (every token from the chain's root; ``n_pages=None``:
        every full page from ``first_page_index`` on) now sit in ``medium``.

        Queues one ``BlockStored`` and returns the pages' block hashes (none and
        no event for zero pages). Only full pages may be named: a page past the
        last full one raises ``ValueError``; bad types raise ``TypeError``."""
        t, first, n, hashes = self._span(tokens_of_chain, first_page_index, n_pages, medium, key)
        if n == 0:
            return []
        s = self.page_size
        ev = self._wire.BlockStored(block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
                         token_ids=t[first * s:(first + n) * s].tolist(), block_size=s,
                         lora_id=None, medium=medium, lora_name=None, group_idx=0)
        self._queue(ev)
        return ev.block_hashes

    def removed(self, tokens_of_chain, first_page_index: int, n_pages: int | None = None,
                medium: str = MEDIUM_DEVICE, key=None) -> list[int]:
        """Those pages (same arguments as :meth:`stored`) left ``medium``.
        Queues one ``BlockRemoved`` and returns the removed block hashes."""
        _, first, n, hashes = self._span(tokens_of_chain, first_page_index, n_pages, medium, key)
        if n == 0:
            return []
        ev = self._wire.BlockRemoved(block_hashes=hashes[first:], medium=medium, group_idx=0)
        self._queue(ev)
        return ev.block_hashes

    def cleared(self) -> None:
        """Every block of this worker left every medium: queues ``AllBlocksCleared``."""
        self._queue(self._wire.AllBlocksCleared())

    def _queue(self, ev) -> None:
        self.pending.append(ev)
        if self.auto_flush:
            self.flush()

    def flush(self) -> int:
        """Hand the pending events, in call order, to the publisher as one
        :class:`~cpkv.consumers.kv_wire.KVEventBatch` stamped with ``time.time()``; returns how many
        (0: nothing pending, nothing published)."""
        if not self.pending:
            return 0
        events, self.pending = self.pending, []
        self.last_seq = self.publisher.publish(self._wire.KVEventBatch(ts=time.time(), events=events))
        return len(events)
