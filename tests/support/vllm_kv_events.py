"""vLLM's KV event schema, written here from vLLM 0.33's ``vllm/distributed/kv_events.py``
(msgspec structs: the batch positional, each event a map tagged ``"type"`` with
``omit_defaults``, since vLLM #42892), never cpkv's classes; the schema before
#42892 (events as positional arrays) to write old-form batches; the documented
block hash recomputed with ``struct`` and ``hashlib``; and a router's view
rebuilt from the events. Shared by the KV event tests of the consumers, the
engine and the command line."""

import hashlib
import struct
from typing import Any

import msgspec


# -- vLLM 0.33's schema (tagged maps inside a positional batch) ----------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent, forbid_unknown_fields=True):
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


class BlockRemoved(KVCacheEvent, forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, forbid_unknown_fields=True):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM = msgspec.msgpack.Decoder(KVEventBatch)


# -- the events before vLLM #42892: tagged positional arrays --------------------------------
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


def as_old(batch: KVEventBatch) -> bytes:
    """``batch`` (vLLM 0.33's classes above) encoded as vLLM before #42892 sent it."""
    old = {BlockStored: lambda e: OldBlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                                                 e.lora_id, e.medium, e.lora_name),
           BlockRemoved: lambda e: OldBlockRemoved(e.block_hashes, e.medium),
           AllBlocksCleared: lambda e: OldAllBlocksCleared()}
    return msgspec.msgpack.encode(OldKVEventBatch(batch.ts, [old[type(e)](e) for e in batch.events],
                                                  batch.data_parallel_rank))


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


def doc_block_hash(parent: int | None, page, key: bytes = b"") -> int:
    """One block's hash by the documented definition: its parent's hash (``None``: the chain's first
    page, hashed with 0), its page's tokens and the namespace key."""
    msg = struct.pack(">I", len(key)) + key + struct.pack(">Q", parent or 0) + struct.pack(f">{len(page)}Q", *page)
    return int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") & (2**63 - 1)


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
