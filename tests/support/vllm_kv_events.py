"""vLLM's KV event schema, copied as vLLM declares it (array-like tagged
msgspec structs, ``vllm/distributed/kv_events.py``; its example subscriber
``examples/online_serving/kv_events_subscriber.py`` copies them the same
way), never cpkv's classes; the documented block hash recomputed with
``struct`` and ``hashlib``; and a router's view rebuilt from the events.
Shared by the KV event tests of the consumers and of the engine."""

import hashlib
import struct
from typing import Any

import msgspec


# -- vLLM's schema, copied (array-like tagged structs, as vLLM declares them) ------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM = msgspec.msgpack.Decoder(KVEventBatch)


def legacy_decoder():
    """The older schema of vLLM's example subscriber: no lora_name, no rank."""

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    class LegacyBatch(Batch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Decoder(LegacyBatch)


# -- the documented hash, recomputed -----------------------------------------------------
def doc_hashes(tokens, page_size, key=None):
    k = b"" if key is None else key.encode() if isinstance(key, str) else str(key).encode() \
        if isinstance(key, int) else key
    out, parent = [], 0
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        msg = struct.pack(">I", len(k)) + k + struct.pack(">Q", parent) + struct.pack(f">{page_size}Q", *page)
        parent = int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") & (2**63 - 1)
        out.append(parent)
    return out


# -- a router's view, rebuilt from events --------------------------------------------------
def apply(state: dict, batch) -> None:
    """(medium, hash) -> (parent hash, tokens of the block)."""
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
            parent = ev.parent_block_hash
            for j, h in enumerate(ev.block_hashes):
                state[(ev.medium, h)] = (parent, tuple(ev.token_ids[j * ev.block_size:(j + 1) * ev.block_size]))
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                state.pop((ev.medium, h), None)
        else:
            assert isinstance(ev, AllBlocksCleared)
            state.clear()
