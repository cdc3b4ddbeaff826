"""The SSD tier's on-disk formats and replay rules, without file handling.

Block: a 4 KiB-aligned extent in a segment file holding a 64-byte header and
then the payload. Header (little-endian): magic "QSB1", version u16, flags u16,
xxh64 of the key, xxh64 of the encoded scope, generation u64, payload length
u64, CRC32C of the payload u32, 16 reserved zero bytes, CRC32C of the preceding
60 header bytes u32.

Checkpoint: a 64-byte header (magic "QSCK", version, first WAL number not
covered, highest generation seen, entry count, body length, body CRC32C,
creation time, header CRC32C) and a msgpack body: the list of scopes, then arrays
of up to 4096 `[scope index, key, seg, offset, length, crc, generation]` rows.

Replay rules (the same for recovery and checkpoint merges, and the ones the live
index follows): a PUT installs its block unless the key already holds an equal
or newer generation; a DEL of generation g removes the key's block if that
block's generation is <= g. Replaying a record twice changes nothing.
"""

from __future__ import annotations

import functools
import itertools
import struct
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import msgpack
import xxhash
from crc32c import crc32c

from quilld.errors import QuillError
from quilld.model import IdentityScope
from quilld.tiers.wal import BadRecord, DelRecord, PutRecord, Scope, Stop, WalReader, decode_batch

PAGE = 4096
HEADER_SIZE = 64
FORMAT_VERSION = 1
BLOCK_MAGIC = b"QSB1"
CHECKPOINT_MAGIC = b"QSCK"

_BLOCK = struct.Struct("<4sHHQQQQI16x")  # 60 bytes, then the header CRC
_CRC = struct.Struct("<I")
_CKPT = struct.Struct("<4sHHQQQQId8x")  # 60 bytes, then the header CRC
assert _BLOCK.size + 4 == HEADER_SIZE and _CKPT.size + 4 == HEADER_SIZE

_ROWS = 4096  # checkpoint entries per msgpack array


class SsdFailure(QuillError):
    """The SSD tier hit an I/O error (ENOSPC, EIO, a failed fsync, an unreadable
    segment). The tier is marked failed and refuses further writes."""


class CorruptBlock(QuillError):
    """A stored block failed verification; the caller drops its entry and counts it."""


class BadCheckpoint(ValueError):
    """A checkpoint file that fails its checksums or does not parse."""


@functools.lru_cache(maxsize=4096)
def scope_digest(scope: Scope) -> int:
    return xxhash.xxh64_intdigest(msgpack.packb(tuple(scope)))


def key_digest(key: bytes) -> int:
    return xxhash.xxh64_intdigest(key)


def extent_pages(length: int) -> int:
    """Pages needed for the header and `length` payload bytes."""
    return -(-(HEADER_SIZE + length) // PAGE)


# -- block header -------------------------------------------------------------


def pack_block_header(key: bytes, scope: Scope, generation: int, length: int, crc: int) -> bytes:
    head = _BLOCK.pack(
        BLOCK_MAGIC, FORMAT_VERSION, 0, key_digest(key), scope_digest(scope), generation, length, crc
    )
    return head + _CRC.pack(crc32c(head))


def check_block_header(
    header: bytes | bytearray, key: bytes, scope: Scope, generation: int, length: int, crc: int
) -> None:
    """Raise CorruptBlock unless `header` is intact and describes exactly this block."""
    if header[:HEADER_SIZE] == pack_block_header(key, scope, generation, length, crc):
        return  # the common case in one comparison; otherwise find what differs
    if len(header) < HEADER_SIZE:
        raise CorruptBlock(f"short header ({len(header)} bytes)")
    (stored_crc,) = _CRC.unpack_from(header, _BLOCK.size)
    if crc32c(memoryview(header)[:_BLOCK.size]) != stored_crc:
        raise CorruptBlock("block header checksum mismatch")
    magic, version, _, kd, sd, gen, n, pcrc = _BLOCK.unpack_from(header)
    if magic != BLOCK_MAGIC or version != FORMAT_VERSION:
        raise CorruptBlock(f"not a block header (magic {magic!r}, version {version})")
    if kd != key_digest(key) or sd != scope_digest(scope):
        raise CorruptBlock("block header belongs to another key")
    if gen != generation or n != length or pcrc != crc:
        raise CorruptBlock(
            f"block header is generation {gen}, {n} bytes, crc {pcrc:#x}; "
            f"expected {generation}, {length}, {crc:#x}"
        )
    raise CorruptBlock("block header has nonzero reserved bytes")


# -- replay -------------------------------------------------------------------


class Loc(NamedTuple):
    """Where one block version lives, as the log and checkpoints record it."""

    seg: int
    offset: int
    length: int
    crc: int
    generation: int


State = dict[tuple[Scope, bytes], Loc]


def apply_record(state: State, rec: PutRecord | DelRecord, scope: Scope) -> None:
    """Apply one log record to `state` by the replay rules; `scope` is rec.scope, interned."""
    k = (scope, rec.key)
    cur = state.get(k)
    if type(rec) is PutRecord:
        if cur is None or cur.generation < rec.generation:
            state[k] = Loc(rec.seg, rec.offset, rec.length, rec.crc, rec.generation)
    elif cur is not None and cur.generation <= rec.generation:
        del state[k]


def replay_log(data: bytes, state: State, scopes: dict[Scope, Scope]) -> tuple[int, int, str | None]:
    """Apply the records of one log's bytes to `state`, up to the first bad one.

    `scopes` interns scopes: each distinct one becomes one IdentityScope used in keys.
    Returns (operations applied, highest generation, None or "offset: why stopped").
    """
    reader = WalReader(data)
    applied = max_gen = 0
    for offset, raw in reader:
        try:
            batch = decode_batch(raw)
        except BadRecord as e:
            return applied, max_gen, f"{offset}: {e}"
        for rec in batch:
            scope = scopes.get(rec.scope)
            if scope is None:
                scope = scopes[rec.scope] = IdentityScope(*rec.scope)
            apply_record(state, rec, scope)
            if rec.generation > max_gen:
                max_gen = rec.generation
        applied += len(batch)
    if reader.stop is not Stop.END:
        return applied, max_gen, f"{reader.stop_offset}: {reader.stop.value} ({reader.detail})"
    return applied, max_gen, None


Found = tuple[int, int, tuple[Scope, bytes], Loc]  # first page, pages, key, record


def drop_overlaps(found: list[Found]) -> list[Found]:
    """`found` (one segment's blocks, sorted by page) without those that overlap a newer
    block. Overlaps need lost log records that let space be reused; the newer
    generation wrote those bytes last."""
    end = 0
    for page, pages, _, _ in found:
        if page < end:
            break
        end = page + pages
    else:
        return found  # the usual case: no overlap at all
    kept: list[Found] = []
    cluster: list[Found] = []
    end = 0
    for item in [*found, None]:
        if item is not None and item[0] < end:
            cluster.append(item)
            end = max(end, item[0] + item[1])
            continue
        taken: list[Found] = []
        for c in sorted(cluster, key=lambda c: c[3].generation, reverse=True):
            if all(c[0] + c[1] <= t[0] or c[0] >= t[0] + t[1] for t in taken):
                taken.append(c)
        kept.extend(sorted(taken))
        if item is not None:
            cluster, end = [item], item[0] + item[1]
    return kept


# -- checkpoint ---------------------------------------------------------------


class CheckpointHeader(NamedTuple):
    wal_start: int  # first WAL number NOT covered: replay logs >= this one
    max_generation: int
    count: int
    body_len: int
    body_crc: int
    created: float


class CheckpointEncoder:
    """Encodes a state as checkpoint bytes: iterate `body()` first, then take `header()`."""

    def __init__(self, state: State, wal_start: int, max_generation: int) -> None:
        self._state = state
        self._wal_start = wal_start
        self._max_generation = max_generation
        self._len = 0
        self._crc = 0

    def body(self) -> Iterator[bytes]:
        index: dict[Scope, int] = {}
        for scope, _ in self._state:
            index.setdefault(scope, len(index))
        yield self._account(msgpack.packb([list(s) for s in index]))
        items = iter(self._state.items())
        while rows := [(index[s], key, *loc) for (s, key), loc in itertools.islice(items, _ROWS)]:
            yield self._account(msgpack.packb(rows))

    def _account(self, chunk: bytes) -> bytes:
        self._len += len(chunk)
        self._crc = crc32c(chunk, self._crc)
        return chunk

    def header(self) -> bytes:
        head = _CKPT.pack(
            CHECKPOINT_MAGIC, FORMAT_VERSION, 0, self._wal_start, self._max_generation,
            len(self._state), self._len, self._crc, time.time(),
        )
        return head + _CRC.pack(crc32c(head))


def decode_checkpoint_header(data: bytes) -> CheckpointHeader:
    if len(data) < HEADER_SIZE:
        raise BadCheckpoint(f"short header ({len(data)} bytes)")
    (stored_crc,) = _CRC.unpack_from(data, _CKPT.size)
    if crc32c(data[:_CKPT.size]) != stored_crc:
        raise BadCheckpoint("header checksum mismatch")
    magic, version, _, wal_start, max_gen, count, body_len, body_crc, created = _CKPT.unpack_from(data)
    if magic != CHECKPOINT_MAGIC or version != FORMAT_VERSION:
        raise BadCheckpoint(f"not a checkpoint (magic {magic!r}, version {version})")
    return CheckpointHeader(wal_start, max_gen, count, body_len, body_crc, created)


def decode_checkpoint_body(
    header: CheckpointHeader, chunks: Iterable[bytes]
) -> Iterator[tuple[Scope, bytes, Loc]]:
    """Yields (scope, key, loc) per block. Raises BadCheckpoint (possibly after some
    entries were yielded: discard them) when the body does not match the header."""
    unpacker = msgpack.Unpacker(use_list=False, raw=False)
    crc = size = count = 0
    scopes: tuple[Scope, ...] | None = None
    try:
        for chunk in chunks:
            crc = crc32c(chunk, crc)
            size += len(chunk)
            unpacker.feed(chunk)
            for obj in unpacker:
                if scopes is None:
                    scopes = tuple(tuple(s) for s in obj)
                    continue
                count += len(obj)
                for si, key, seg, off, length, pcrc, gen in obj:
                    yield scopes[si], key, Loc(seg, off, length, pcrc, gen)
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
        raise BadCheckpoint(f"undecodable body: {e}") from e
    if size != header.body_len or crc != header.body_crc or count != header.count:
        raise BadCheckpoint(
            f"body is {size} bytes, crc {crc:#x}, {count} entries; header says "
            f"{header.body_len}, {header.body_crc:#x}, {header.count}"
        )
