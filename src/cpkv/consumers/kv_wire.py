"""vLLM's KV event schema on the wire, as vLLM 0.33 sends it ([[RFC-0001:C-KV-EVENTS]]; extra ``events``).

The payload of one message is one msgpack :class:`KVEventBatch`:

* the batch is a positional array ``[ts, events, data_parallel_rank]`` (the rank
  left out when ``None``), as in every vLLM release;
* each event is a tagged map: key ``"type"`` holds the class name
  (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``), the other keys
  are field names, and a field equal to its default is left out (msgspec's
  ``omit_defaults``). Fields without a default are always sent, ``None`` included:
  ``BlockStored`` ``block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name``; ``BlockRemoved`` ``block_hashes, medium``.
  vLLM's optional fields up to 0.33 (``extra_keys``, ``group_idx``,
  ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ``locality``,
  ``ownership``, ``session_id``, ``lookahead_token_ids``; ``group_idx``,
  ``locality`` and ``ownership`` on ``BlockRemoved``) are declared here so a
  batch from vLLM decodes whole; cpkv sends ``group_idx`` 0 (one page table
  for every cache family, one group) and leaves the others unset: it has no
  multimodal or salted extra keys beyond its namespace key (hashed into the block
  hash itself), no sliding window, no secondary storage tier, no session on a page
  and no lookahead hashing.

This is the wire since vLLM #42892 (events were positional arrays
``["BlockStored", block_hashes, ...]`` before it). :func:`decode_batch` reads
both, so cpkv's subscriber follows a publisher of either age; :func:`encode_batch`
writes the current one. The block hash, the sink a cache calls and the mediums are
in :mod:`cpkv.consumers.kv_events`; the ZMQ transport in
:mod:`cpkv.consumers.kv_events_zmq`.
"""

from __future__ import annotations

from typing import Any

try:
    import msgspec
except ImportError as e:  # the one line a bare install says
    raise ImportError("cpkv's KV events need msgspec and pyzmq: pip install 'cpkv[events]'") from e

VLLM_VERSION = "0.33"
"""The vLLM release whose KV event schema this module follows."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch, encoded as ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; each encodes as a map tagged ``{"type": ClassName, ...}``."""


class BlockStored(KVCacheEvent):
    """``len(block_hashes)`` consecutive full blocks of one chain entered ``medium``.

    ``block_hashes[j]`` names the prefix through block j; ``parent_block_hash``
    is the hash of the block before the first (``None`` for the chain's first
    page); ``token_ids`` holds ``len(block_hashes) * block_size`` tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """The blocks named by ``block_hashes`` left ``medium``."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the worker left every medium."""


class KVEventBatch(EventBatch):
    """The message body: one batch of events, in the order they happened."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- the events before vLLM #42892: positional arrays ["ClassName", field, ...] --------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(EventBatch):
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]


_CURRENT = {_ArrayBlockStored: BlockStored, _ArrayBlockRemoved: BlockRemoved,
            _ArrayAllBlocksCleared: AllBlocksCleared}
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_ArrayBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """``batch`` as the msgpack payload vLLM 0.33 sends (see the module doc)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload of either wire (tagged maps, or the positional events of vLLM
    before #42892) as a :class:`KVEventBatch`; ``ValueError`` when it is
    neither, naming why the current form refused it."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        try:
            old = _array_decoder.decode(payload)
        except msgspec.DecodeError:
            raise ValueError(str(e)) from None
    events = [_CURRENT[type(ev)](**msgspec.structs.asdict(ev)) for ev in old.events]
    return KVEventBatch(ts=old.ts, events=events, data_parallel_rank=old.data_parallel_rank)


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVCacheEvent", "KVEventBatch",
           "VLLM_VERSION", "decode_batch", "encode_batch"]
