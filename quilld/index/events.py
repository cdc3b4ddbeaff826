"""Decoding of engines' KV-cache events, sans-IO: bytes or JSON in, typed batches out.

vLLM's ZMQ publisher (`vllm/distributed/kv_events.py`) sends multipart messages
`(topic, seq, payload)` where `seq` is an 8-byte big-endian counter and `payload` is
a msgspec-msgpack `KVEventBatch`: `[ts, [events], dp_rank]` (or, in newer releases,
a map `{ts, events, data_parallel_rank}`). Each event is a tagged struct, encoded as a
positional array whose first element is the tag (`array_like=True`) or as a map with
a `type` field. Block hashes are 64-bit ints or raw bytes. The replay socket sends
`(seq, payload)`.

The same events arrive as JSON (`POST /v1/kv-events`, `KVEVENTS`) in the seed's
`KvEventBatch` shape, where hashes are strings (hex here, decoded to bytes).

A batch either decodes fully or raises `MalformedEvent`: the index never sees half a
batch. Nothing here opens a socket or touches asyncio.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from quilld.errors import CommandError
from quilld.model import CacheTier

BlockHash = int | bytes

# vLLM's publisher has no cap; one scheduler step stores at most max_num_batched_tokens
# tokens (a few bytes each in msgpack), so a real batch is well under a megabyte.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
SEQ_LEN = 8  # vLLM: seq.to_bytes(8, "big")
# vLLM's replay socket ends a replay with (-1 as 8 signed bytes, b"").
REPLAY_END_SEQ = b"\xff" * SEQ_LEN
# A hash int is a signed or unsigned 64-bit value; anything wider is not vLLM's.
_HASH_MIN = -(1 << 63)
_HASH_END = 1 << 64
_HEX = re.compile(r"(?:0x)?((?:[0-9a-fA-F]{2})+)")


class MalformedEvent(CommandError):
    """A KV-event payload that cannot be decoded; the whole batch is rejected."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(f"malformed KV event: {where}: {problem}" if where else f"malformed KV event: {problem}")


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    seq: int | None
    engine_id: str | None = None  # only the JSON shape names its engine


# ---------------------------------------------------------------- entry points


def decode_payload(payload: bytes) -> Batch:
    """One msgpack `KVEventBatch` payload (the last frame of a ZMQ message)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MalformedEvent(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedEvent(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # msgpack raises ValueError/UnpackException/TypeError subclasses
        raise MalformedEvent(f"payload is not msgpack ({type(e).__name__}: {e})") from None
    return _batch(obj, _msgpack_hash, seq=None)


def decode_frames(frames: list[bytes]) -> Batch:
    """A ZMQ multipart message: `(topic, seq, payload)` from PUB or `(seq, payload)` from replay."""
    if not isinstance(frames, (list, tuple)) or len(frames) not in (2, 3):
        n = len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__
        raise MalformedEvent(f"expected (topic, seq, payload) or (seq, payload) frames, got {n}")
    for i, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise MalformedEvent(f"frame {i} must be bytes, got {type(frame).__name__}")
    seq_frame, payload = frames[-2], frames[-1]
    if len(seq_frame) != SEQ_LEN:
        raise MalformedEvent(f"sequence frame must be {SEQ_LEN} bytes, got {len(seq_frame)}")
    seq = int.from_bytes(seq_frame, "big")
    batch = decode_payload(payload)
    return Batch(batch.ts, batch.events, batch.dp_rank, seq)


def is_replay_end(frames: list[bytes]) -> bool:
    """True for the marker vLLM's replay socket sends after the last replayed batch."""
    return len(frames) == 2 and bytes(frames[0]) == REPLAY_END_SEQ and len(frames[1]) == 0


def decode_json(doc: Mapping[str, Any] | str | bytes) -> Batch:
    """The seed's `KvEventBatch` JSON: `{engine_id, ts_ms?, ..., events: [{type, ...}]}`."""
    if isinstance(doc, (str, bytes, bytearray)):
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError) as e:
            raise MalformedEvent(f"body is not JSON ({e})") from None
    if not isinstance(doc, Mapping):
        raise MalformedEvent(f"expected a JSON object, got {_tname(doc)}", "batch")
    engine_id = _opt(doc, "engine_id", str, "batch")
    ts_ms = _opt(doc, "ts_ms", int, "batch")
    if ts_ms is not None and ts_ms < 0:
        raise MalformedEvent(f"must be >= 0, got {ts_ms}", "batch.ts_ms")
    for name in ("model_id", "tokenizer_id", "adapter_id", "tenant_id"):
        _opt(doc, name, str, "batch")
    _opt(doc, "bytes_per_block", int, "batch")
    if "events" not in doc:
        raise MalformedEvent("missing field", "batch.events")
    events = _events(doc["events"], _json_hash)
    return Batch(ts_ms / 1000.0 if ts_ms is not None else 0.0, events, None, None, engine_id)


def medium_tier(medium: str | None) -> CacheTier:
    """vLLM's `medium` to a tier: GPU (or absent) -> hbm, CPU -> cpu, DISK -> ssd."""
    if medium is None:
        return CacheTier.HBM
    if not isinstance(medium, str):
        raise MalformedEvent(f"medium must be a string, got {_tname(medium)}")
    tier = _MEDIA.get(medium.upper())
    if tier is None:
        raise MalformedEvent(f"unknown medium {medium!r} (expected GPU, CPU or DISK)")
    return tier


_MEDIA = {"GPU": CacheTier.HBM, "CPU": CacheTier.CPU, "DISK": CacheTier.SSD}


class SequenceTracker:
    """Follows one publisher's sequence numbers.

    `observe(seq)` returns how many numbers were skipped (0 in order and on the first
    observation), or -1 for a duplicate or older seq, which the caller should drop.
    `reset()` forgets the position (after a replay failed or the engine restarted:
    vLLM restarts its counter at 0).
    """

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: int | None = None

    def observe(self, seq: int) -> int:
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < _HASH_END:
            raise MalformedEvent(f"sequence number must be an unsigned 64-bit int, got {seq!r}")
        last = self.last
        if last is not None and seq <= last:
            return -1
        self.last = seq
        return 0 if last is None else seq - last - 1

    def reset(self) -> None:
        self.last = None


# ---------------------------------------------------------------- structure

_STORED, _REMOVED, _CLEARED = "stored", "removed", "cleared"
_TAGS = {
    "BlockStored": _STORED,
    "BlockRemoved": _REMOVED,
    "AllBlocksCleared": _CLEARED,
    # the seed's JSON spelling (serde rename_all = "snake_case")
    "block_stored": _STORED,
    "block_removed": _REMOVED,
    "all_blocks_cleared": _CLEARED,
}
# Positional order after the tag, as vLLM declares the struct fields; later ones ignored.
_FIELDS = {
    _STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    _REMOVED: ("block_hashes", "medium"),
    _CLEARED: (),
}

HashFn = Callable[[Any, str], BlockHash]


def _batch(obj: Any, hash_fn: HashFn, seq: int | None) -> Batch:
    if isinstance(obj, list):
        if len(obj) < 2:
            raise MalformedEvent(f"expected [ts, events, dp_rank?], got an array of {len(obj)}", "batch")
        ts, events, dp_rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        for name in ("ts", "events"):
            if name not in obj:
                raise MalformedEvent("missing field", f"batch.{name}")
        ts, events, dp_rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise MalformedEvent(f"expected an array or map, got {_tname(obj)}", "batch")
    if not _is_number(ts) or not math.isfinite(ts):
        raise MalformedEvent(f"expected a finite number, got {_tname(ts)} {ts!r}", "batch.ts")
    if dp_rank is not None and (not _is_int(dp_rank) or dp_rank < 0):
        raise MalformedEvent(f"expected a non-negative int or nil, got {dp_rank!r}", "batch.dp_rank")
    return Batch(float(ts), _events(events, hash_fn), dp_rank, seq)


def _events(events: Any, hash_fn: HashFn) -> tuple[Event, ...]:
    if not isinstance(events, list):
        raise MalformedEvent(f"expected an array, got {_tname(events)}", "events")
    return tuple(_event(ev, hash_fn, f"events[{i}]") for i, ev in enumerate(events))


def _event(ev: Any, hash_fn: HashFn, where: str) -> Event:
    if isinstance(ev, list):
        if not ev:
            raise MalformedEvent("empty array, expected a tag first", where)
        tag = ev[0]
        kind = _kind(tag, where)
        fields = dict(zip(_FIELDS[kind], ev[1:]))
    elif isinstance(ev, Mapping):
        key = "type" if "type" in ev else "kind" if "kind" in ev else None
        if key is None:
            raise MalformedEvent("missing field 'type'", where)
        kind = _kind(ev[key], where)
        fields = ev
    else:
        raise MalformedEvent(f"expected an array or map, got {_tname(ev)}", where)

    if kind == _CLEARED:
        return Cleared()
    hashes = _hashes(fields, "block_hashes", hash_fn, where)
    medium = _opt(fields, "medium", str, where)
    if medium is not None:
        _check_medium(medium, where)
    if kind == _REMOVED:
        return Removed(hashes, medium)

    parent = fields.get("parent_block_hash")
    if parent is not None:
        parent = hash_fn(parent, f"{where}.parent_block_hash")
    token_ids = fields.get("token_ids", [])
    if not isinstance(token_ids, list):
        raise MalformedEvent(f"expected an array, got {_tname(token_ids)}", f"{where}.token_ids")
    for i, t in enumerate(token_ids):
        if not _is_int(t) or t < 0:
            raise MalformedEvent(f"expected a non-negative int, got {t!r}", f"{where}.token_ids[{i}]")
    if "block_size" not in fields:
        raise MalformedEvent("missing field", f"{where}.block_size")
    block_size = fields["block_size"]
    if not _is_int(block_size) or block_size <= 0:
        raise MalformedEvent(f"expected a positive int, got {block_size!r}", f"{where}.block_size")
    lora_id = _opt(fields, "lora_id", int, where)
    lora_name = _opt(fields, "lora_name", str, where)
    return Stored(hashes, parent, tuple(token_ids), block_size, lora_id, medium, lora_name)


def _kind(tag: Any, where: str) -> str:
    if not isinstance(tag, str):
        raise MalformedEvent(f"event tag must be a string, got {_tname(tag)}", where)
    kind = _TAGS.get(tag)
    if kind is None:
        raise MalformedEvent(f"unknown event tag {tag!r}", where)
    return kind


def _check_medium(medium: str, where: str) -> None:
    try:
        medium_tier(medium)
    except MalformedEvent:
        raise MalformedEvent(f"unknown medium {medium!r} (expected GPU, CPU or DISK)", f"{where}.medium") from None


def _hashes(fields: Mapping[str, Any], name: str, hash_fn: HashFn, where: str) -> tuple[BlockHash, ...]:
    if name not in fields:
        raise MalformedEvent("missing field", f"{where}.{name}")
    value = fields[name]
    if not isinstance(value, list):
        raise MalformedEvent(f"expected an array, got {_tname(value)}", f"{where}.{name}")
    return tuple(hash_fn(h, f"{where}.{name}[{i}]") for i, h in enumerate(value))


def _int_hash(h: int, where: str) -> int:
    if not _HASH_MIN <= h < _HASH_END:
        raise MalformedEvent(f"hash {h} does not fit in 64 bits", where)
    return h


def _msgpack_hash(h: Any, where: str) -> BlockHash:
    if _is_int(h):
        return _int_hash(h, where)
    if isinstance(h, bytes):
        if not h:
            raise MalformedEvent("empty hash", where)
        return h
    raise MalformedEvent(f"bad hash type: expected int or bytes, got {_tname(h)}", where)


def _json_hash(h: Any, where: str) -> BlockHash:
    if _is_int(h):
        return _int_hash(h, where)
    if isinstance(h, str):
        m = _HEX.fullmatch(h)
        if m is None:
            raise MalformedEvent(f"bad hash: expected an int or an even-length hex string, got {h!r}", where)
        return bytes.fromhex(m.group(1))
    raise MalformedEvent(f"bad hash type: expected int or hex string, got {_tname(h)}", where)


def _opt(fields: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    """An optional field: absent or nil gives None; otherwise it must be of `kind`."""
    value = fields.get(name)
    if value is None:
        return None
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise MalformedEvent(f"expected {_KIND_NAMES[kind]} or nil, got {_tname(value)}", f"{where}.{name}")
    return value


_KIND_NAMES = {int: "an int", str: "a string"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tname(v: Any) -> str:
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, list):
        return "array"
    if isinstance(v, Mapping):
        return "map"
    if isinstance(v, str):
        return "string"
    return type(v).__name__
