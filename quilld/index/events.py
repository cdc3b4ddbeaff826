"""Decoding of engines' KV-cache events, sans-IO: bytes or JSON in, typed batches out.

vLLM's ZMQ publisher (`vllm/distributed/kv_events.py`) sends multipart messages
`(topic, seq, payload)` where `seq` is an 8-byte big-endian counter and `payload` is
a msgspec-msgpack `KVEventBatch`: `[ts, [events], dp_rank]` (`array_like`; older and
newer releases also send it as a map `{ts, events, data_parallel_rank}`). Each event is
a tagged struct with `omit_defaults`: a map whose `type` field names it (vLLM 0.33), or a
positional array whose first element is the tag (older releases). Block hashes are
64-bit ints or raw bytes. The replay socket sends `(seq, payload)` or `(topic, seq,
payload)`.

vLLM 0.33's schema, field for field (later optional fields are ignored):
`BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
locality, ownership, session_id)`, `BlockRemoved(block_hashes, medium, group_idx,
locality, ownership)`, `AllBlocksCleared()`. Media are `GPU`, `CPU` and `STORAGE`; its
offloading connector stores placeholders with `block_size=0, token_ids=[]` and the
offloaded block's `group_idx`.

One bad event never costs the good ones: an event that cannot be decoded (unknown
type, a hash wider than 64 bits, a string where a list belongs, a scalar where an
event belongs, an unknown medium) is skipped and counted in `Batch.malformed`, and the
rest of its batch applies. Only a payload whose envelope is broken (not msgpack, no
event list) decodes to no events at all; `decode_frames` still returns its sequence
number then, so a broken batch is never mistaken for a lost one.

A payload is decoded in C by msgspec, straight into structs that mirror vLLM's (keyed, then
positional), and checked in one pass; only a payload that this strict path refuses (a bad
event, an older or foreign spelling, a broken envelope) goes through the lenient decoder
below, which skips what it cannot read. Both give the same batch for any payload the strict
path accepts (tests/unit/test_events.py checks it on random payloads): the strict path is
about a quarter of the lenient one's time (bench/events_bench.py).

The same events arrive as JSON (`POST /v1/kv-events`, `KVEVENTS`) in the seed's
`KvEventBatch` shape, where hashes are strings (hex here, decoded to bytes). There the
caller is answered at once, so a JSON batch either decodes fully or raises
`MalformedEvent` naming the first bad field. Nothing here opens a socket or touches
asyncio.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

import msgpack
import msgspec

from quilld.config import MAX_KV_GROUPS
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
# vLLM numbers its KV-cache groups from 0 (a hybrid model has a handful); a group index is a
# bit in a mask downstream, so a wild one is refused here rather than grow that mask.
MAX_GROUPS = MAX_KV_GROUPS
# A batch keeps the text of its first few skipped events, for the log.
MAX_PROBLEMS = 3
_HEX = re.compile(r"(?:0x)?((?:[0-9a-fA-F]{2})+)")


class MalformedEvent(CommandError):
    """A KV-event payload that cannot be decoded; the whole batch is rejected."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(f"malformed KV event: {where}: {problem}" if where else f"malformed KV event: {problem}")


# Events are NamedTuples, as the router's candidates are: a batch of 64 is built without
# 64 Python-level __init__ calls. Compare them by type (`type(ev) is Stored`), never as tuples.


class Stored(NamedTuple):
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int  # 0 for vLLM's offload placeholders
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    group_idx: int | None = None  # the KV-cache group; None: the block as a whole (every group)
    kv_cache_spec_kind: str | None = None  # the group's attention kind, e.g. full_attention, sliding_window
    sliding_window: int | None = None  # the group's window in tokens, for sliding-window groups
    # per block, its untagged extra keys ([lora name, salt], [salt], ... or None), or None for none
    # (index/hash_check.py reads them; the index does not)
    extra_keys: tuple | None = None


class Removed(NamedTuple):
    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


class Batch(NamedTuple):
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    seq: int | None
    engine_id: str | None = None  # only the JSON shape names its engine
    malformed: int = 0  # events skipped because they could not be decoded (1 for a broken envelope)
    problems: tuple[str, ...] = ()  # what was wrong with the first few of them


# ---------------------------------------------------------------- entry points


def decode_payload(payload: bytes, seq: int | None = None) -> Batch:
    """One msgpack `KVEventBatch` payload (the last frame of a ZMQ message), numbered `seq`."""
    if payload.__class__ is not bytes and not isinstance(payload, (bytearray, memoryview)):
        raise MalformedEvent(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedEvent(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    batch = _strict(payload, seq)
    if batch is not None:
        return batch
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # msgpack raises ValueError/UnpackException/TypeError subclasses
        raise MalformedEvent(f"payload is not msgpack ({type(e).__name__}: {e})") from None
    return _batch(obj, _msgpack_hash, seq)


def decode_seq(frames: list[bytes]) -> int:
    """The sequence number of a ZMQ multipart message (`(topic, seq, payload)` or `(seq, payload)`)."""
    if frames.__class__ is list and len(frames) == 3:  # the common case, checked in a few steps
        seq_frame = frames[1]
        if seq_frame.__class__ is bytes and len(seq_frame) == SEQ_LEN and frames[0].__class__ is bytes \
                and frames[2].__class__ is bytes:
            return int.from_bytes(seq_frame, "big")
    if not isinstance(frames, (list, tuple)) or len(frames) not in (2, 3):
        n = len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__
        raise MalformedEvent(f"expected (topic, seq, payload) or (seq, payload) frames, got {n}")
    for i, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise MalformedEvent(f"frame {i} must be bytes, got {type(frame).__name__}")
    seq_frame = frames[-2]
    if len(seq_frame) != SEQ_LEN:
        raise MalformedEvent(f"sequence frame must be {SEQ_LEN} bytes, got {len(seq_frame)}")
    return int.from_bytes(seq_frame, "big")


def decode_frames(frames: list[bytes]) -> Batch:
    """A ZMQ multipart message: `(topic, seq, payload)` from PUB or `(seq, payload)` from replay.

    Raises `MalformedEvent` only when the frames or the sequence number are unreadable; a
    payload that cannot be decoded gives a batch of no events with `malformed` 1, so the
    caller still knows that this sequence number arrived.
    """
    seq = decode_seq(frames)
    try:
        return decode_payload(frames[-1], seq)
    except MalformedEvent as e:
        return Batch(0.0, (), None, seq, None, 1, (e.message,))


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
    events, _, _ = _events(doc["events"], _json_hash, strict=True)
    return Batch(ts_ms / 1000.0 if ts_ms is not None else 0.0, events, None, None, engine_id)


def medium_tier(medium: str | None) -> CacheTier:
    """An event's `medium` to the engine's tier: GPU (or absent) -> hbm, CPU -> cpu, STORAGE -> storage.

    vLLM 0.33 names GPU, CPU and STORAGE; DISK (older releases, SGLang) is the engine's own
    storage too, as are SGLang's CPU_PINNED (host memory) and EXTERNAL (a shared pool the
    engine loads from). Never this pool's tiers: an engine's disk is not quilld's SSD.
    """
    if medium is None:
        return CacheTier.HBM
    if not isinstance(medium, str):
        raise MalformedEvent(f"medium must be a string, got {_tname(medium)}")
    tier = _MEDIA.get(medium) or _MEDIA.get(medium.upper())
    if tier is None:
        raise MalformedEvent(f"unknown medium {medium!r} (expected GPU, CPU or STORAGE)")
    return tier


_MEDIA = {"GPU": CacheTier.HBM, "CPU": CacheTier.CPU, "CPU_PINNED": CacheTier.CPU, "STORAGE": CacheTier.STORAGE,
          "DISK": CacheTier.STORAGE, "EXTERNAL": CacheTier.STORAGE}


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


# ---------------------------------------------------------------- the strict path (msgspec)
# vLLM's structs as this decoder reads them, every check done by msgspec in C: the fields used,
# with their defaults where vLLM's omit_defaults may leave them out. Keyed (vLLM 0.33:
# `{"type": "BlockStored", ...}`, unknown fields skipped), declared in `Stored`'s and `Removed`'s
# field order so that a decoded event becomes one by `astuple`; and positional (older releases:
# `["BlockStored", ...]` in vLLM's declaration order, `extra_keys` decoded as they come, for
# index/hash_check.py; trailing fields ignored).

_Hash = int | Annotated[bytes, msgspec.Meta(min_length=1)]  # msgpack ints are at most 64 bits wide
_Medium = Literal[tuple(_MEDIA)]  # type: ignore[valid-type]  # the media spelled exactly as _MEDIA has them
_Group = Annotated[int, msgspec.Meta(ge=0, lt=MAX_KV_GROUPS)]
_Size = Annotated[int, msgspec.Meta(ge=0)]


class _KStored(msgspec.Struct, tag="BlockStored", kw_only=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None = None
    token_ids: tuple = ()
    block_size: _Size
    lora_id: int | None = None
    medium: _Medium | None = None
    lora_name: str | None = None
    group_idx: _Group | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    extra_keys: tuple | None = None


class _KRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: tuple[_Hash, ...]
    medium: _Medium | None = None
    group_idx: _Group | None = None


class _KCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _PStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple
    block_size: _Size
    lora_id: int | None = None
    medium: _Medium | None = None
    lora_name: str | None = None
    extra_keys: tuple | None = None
    group_idx: _Group | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _PRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: tuple[_Hash, ...]
    medium: _Medium | None = None
    group_idx: _Group | None = None


class _PCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _KBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_KStored | _KRemoved | _KCleared]
    dp_rank: _Size | None = None


class _PBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_PStored | _PRemoved | _PCleared]
    dp_rank: _Size | None = None


_STRICT = (msgspec.msgpack.Decoder(_KBatch).decode, msgspec.msgpack.Decoder(_PBatch).decode)
_astuple = msgspec.structs.astuple
_new = tuple.__new__


def _strict(payload: bytes, seq: int | None) -> Batch | None:
    """The batch when every part of `payload` is as vLLM sends it; None otherwise (the lenient
    decoder then reads it, skipping what is bad)."""
    for decode in _STRICT:
        try:
            raw = decode(payload)
        except Exception:  # msgspec.DecodeError/ValidationError, RecursionError on deep nesting
            continue
        break
    else:
        return None
    if not math.isfinite(raw.ts):
        return None
    events: list[Event] = []
    append = events.append
    for e in raw.events:
        kind = e.__class__
        if kind is _KStored:
            append(_new(Stored, _astuple(e)))
        elif kind is _KRemoved or kind is _PRemoved:
            append(_new(Removed, _astuple(e)))
        elif kind is _PStored:
            append(Stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium,
                          e.lora_name, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
                          e.extra_keys))
        else:
            append(_CLEARED_EVENT)
    return Batch(raw.ts, tuple(events), raw.dp_rank, seq)


# ---------------------------------------------------------------- structure

_STORED, _REMOVED, _CLEARED = "stored", "removed", "cleared"  # compared by identity below
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
    _STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
              "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    _REMOVED: ("block_hashes", "medium", "group_idx"),
    _CLEARED: (),
}
_CLEARED_EVENT = Cleared()  # events carry no state: one instance serves every AllBlocksCleared

HashFn = Callable[[Any, str], BlockHash]


def _batch(obj: Any, hash_fn: HashFn, seq: int | None) -> Batch:
    if obj.__class__ is list and len(obj) == 3:  # vLLM's array-like batch, in a few steps
        ts, events, dp_rank = obj
        if ts.__class__ is float and math.isfinite(ts) and events.__class__ is list and (
                dp_rank is None or dp_rank.__class__ is int and dp_rank >= 0):
            decoded, malformed, problems = _events(events, hash_fn, strict=False)
            return Batch(ts, decoded, dp_rank, seq, None, malformed, problems)
    if isinstance(obj, list):
        if len(obj) < 2:
            raise MalformedEvent(f"expected [ts, events, dp_rank?], got an array of {len(obj)}", "batch")
        ts, events, dp_rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        for name in ("ts", "events"):
            if name not in obj:
                raise MalformedEvent("missing field", f"batch.{name}")
        ts, events = obj["ts"], obj["events"]
        dp_rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    else:
        raise MalformedEvent(f"expected an array or map, got {_tname(obj)}", "batch")
    if not _is_number(ts) or not math.isfinite(ts):
        raise MalformedEvent(f"expected a finite number, got {_tname(ts)} {ts!r}", "batch.ts")
    if dp_rank is not None and (not _is_int(dp_rank) or dp_rank < 0):
        raise MalformedEvent(f"expected a non-negative int or nil, got {dp_rank!r}", "batch.dp_rank")
    decoded, malformed, problems = _events(events, hash_fn, strict=False)
    return Batch(float(ts), decoded, dp_rank, seq, None, malformed, problems)


def _events(events: Any, hash_fn: HashFn, strict: bool) -> tuple[tuple[Event, ...], int, tuple[str, ...]]:
    """The decoded events, how many were skipped and why (strict: the first bad one raises)."""
    if not isinstance(events, list):
        raise MalformedEvent(f"expected an array, got {_tname(events)}", "events")
    out: list[Event] = []
    append, malformed, problems = out.append, 0, []
    for i, ev in enumerate(events):
        try:
            append(_event(ev, hash_fn, i))
        except MalformedEvent as e:
            if strict:
                raise
            malformed += 1
            if len(problems) < MAX_PROBLEMS:
                problems.append(e.message)
    return tuple(out), malformed, tuple(problems)


def _event(ev: Any, hash_fn: HashFn, i: int) -> Event:
    if isinstance(ev, dict):
        tag = ev.get("type")
        if tag is None:
            tag = ev.get("kind")
            if tag is None:
                raise MalformedEvent("missing field 'type'", f"events[{i}]")
        kind = _kind(tag, i)
        fields: Mapping[str, Any] = ev
    elif isinstance(ev, list):
        if not ev:
            raise MalformedEvent("empty array, expected a tag first", f"events[{i}]")
        kind = _kind(ev[0], i)
        fields = dict(zip(_FIELDS[kind], ev[1:]))
    else:
        raise MalformedEvent(f"expected an array or map, got {_tname(ev)}", f"events[{i}]")

    if kind is _CLEARED:
        return _CLEARED_EVENT
    hashes = _hashes(fields, hash_fn, i)
    get = fields.get
    medium = get("medium")
    if medium is not None and (medium.__class__ is not str or medium not in _MEDIA):
        _check_medium(medium, f"events[{i}]")
    group = get("group_idx")
    if group is not None and (group.__class__ is not int or not 0 <= group < MAX_GROUPS):
        raise MalformedEvent(f"expected an int in 0..{MAX_GROUPS - 1} or nil, got {group!r}", f"events[{i}].group_idx")
    if kind is _REMOVED:
        return Removed(hashes, medium, group)

    parent = get("parent_block_hash")
    if parent is not None:
        parent = hash_fn(parent, f"events[{i}].parent_block_hash")
    token_ids = get("token_ids", ())
    if token_ids.__class__ is not list and token_ids != ():
        raise MalformedEvent(f"expected an array, got {_tname(token_ids)}", f"events[{i}].token_ids")
    # The token ids are not used here (hashes are); their values are not checked one by one.
    block_size = get("block_size", _MISSING)
    if block_size.__class__ is not int or block_size < 0:  # 0: vLLM's offload placeholders
        if block_size is _MISSING:
            raise MalformedEvent("missing field", f"events[{i}].block_size")
        raise MalformedEvent(f"expected a non-negative int, got {block_size!r}", f"events[{i}].block_size")
    lora_id, lora_name = get("lora_id"), get("lora_name")
    spec_kind, window = get("kv_cache_spec_kind"), get("kv_cache_spec_sliding_window")
    if ((lora_id is not None and lora_id.__class__ is not int) or (lora_name is not None and lora_name.__class__ is not str)
            or (spec_kind is not None and spec_kind.__class__ is not str)
            or (window is not None and window.__class__ is not int)):
        where = f"events[{i}]"
        _opt(fields, "lora_id", int, where)
        _opt(fields, "lora_name", str, where)
        _opt(fields, "kv_cache_spec_kind", str, where)
        _opt(fields, "kv_cache_spec_sliding_window", int, where)
    extra = get("extra_keys")  # only the hash check reads them: anything but an array is none
    extra = tuple(extra) if extra.__class__ is list else None
    return Stored(hashes, parent, tuple(token_ids), block_size, lora_id, medium, lora_name, group, spec_kind, window,
                  extra)


def _kind(tag: Any, i: int) -> str:
    kind = _TAGS.get(tag) if tag.__class__ is str else None
    if kind is None:
        if not isinstance(tag, str):
            raise MalformedEvent(f"event tag must be a string, got {_tname(tag)}", f"events[{i}]")
        raise MalformedEvent(f"unknown event tag {tag!r}", f"events[{i}]")
    return kind


def _check_medium(medium: Any, where: str) -> None:
    if not isinstance(medium, str):
        raise MalformedEvent(f"expected a string or nil, got {_tname(medium)}", f"{where}.medium")
    try:
        medium_tier(medium)
    except MalformedEvent as e:
        raise MalformedEvent(e.message.removeprefix("malformed KV event: "), f"{where}.medium") from None


def _hashes(fields: Mapping[str, Any], hash_fn: HashFn, i: int) -> tuple[BlockHash, ...]:
    value = fields.get("block_hashes", _MISSING)
    if value.__class__ is not list:
        where = f"events[{i}]"
        if value is _MISSING:
            raise MalformedEvent("missing field", f"{where}.block_hashes")
        raise MalformedEvent(f"expected an array, got {_tname(value)}", f"{where}.block_hashes")
    if hash_fn is _msgpack_hash:  # the hot path: every hash an in-range int, checked inline
        for h in value:
            if h.__class__ is not int or not _HASH_MIN <= h < _HASH_END:
                break
        else:
            return tuple(value)
    return tuple(hash_fn(h, f"events[{i}].block_hashes[{j}]") for j, h in enumerate(value))


_MISSING = object()


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
