"""vLLM 0.33's KV-event schema, mirrored field for field from `vllm/distributed/kv_events.py`.

msgspec structs as vLLM declares them: the batch is `array_like` (`[ts, events, dp_rank]`),
events are tagged maps (`{"type": "BlockStored", ...}`) with `omit_defaults`, so a field
left at its default is not sent at all. `encode` gives the payload vLLM's publisher sends;
`legacy=True` gives the older all-positional encoding (batch and events as arrays).
Used by the unit tests of the decoder and the subscriber and by the black-box tests.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The pre-0.33 declarations: everything positional.
class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class _LegacyRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class _LegacyCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def encode(events: list[KVCacheEvent], ts: float = 0.0, dp_rank: int | None = 0, legacy: bool = False) -> bytes:
    """The msgpack payload of one batch, as vLLM's ZmqEventPublisher encodes it."""
    if legacy:
        events = [_legacy(e) for e in events]
        return _ENCODER.encode(EventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))
    return _ENCODER.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))


def _legacy(e: KVCacheEvent) -> _LegacyEvent:
    if isinstance(e, BlockStored):
        return _LegacyStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium,
                             e.lora_name)
    if isinstance(e, BlockRemoved):
        return _LegacyRemoved(e.block_hashes, e.medium)
    return _LegacyCleared()


def gpu(hashes: list, parent=None, block_size: int = 16, group: int | None = 0, kind: str | None = "full_attention",
        window: int | None = None, lora: str | None = None) -> BlockStored:
    """A BlockStored as vLLM's block pool sends it for GPU blocks."""
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=list(range(block_size * len(hashes))), block_size=block_size, lora_id=None,
                       medium=MEDIUM_GPU, lora_name=lora, group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)


def offloaded(hashes: list, medium: str = MEDIUM_CPU, group: int | None = None) -> BlockStored:
    """A BlockStored as vLLM's offloading connector sends it: a placeholder, no tokens. vLLM 0.33's
    placeholders carry the offloaded block's `group_idx` (`OffloadingEventsTracker._placeholder_stored`);
    `group=None` is one with no group (an older release, or the block as a whole)."""
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def removed(hashes: list, medium: str | None = MEDIUM_GPU, group: int | None = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)
