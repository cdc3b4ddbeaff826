"""The SSD tier's write-ahead log: LevelDB-style record framing, PUT/DEL/META records,
and a small file appender.

A log file is a sequence of 32 KiB blocks. A record is stored as one or more
fragments, each with a 7-byte header: masked CRC32C (u32, over the type byte and
the fragment), fragment length (u16) and type (u8: FULL, or FIRST, MIDDLE...,
LAST when the record does not fit in the rest of the block). A fragment never
crosses a block boundary; a block tail too short for a header is zero-filled.
Because every block starts on a fragment boundary, a reader can always tell
where the good prefix of a damaged log ends.

A log record is a batch of PUT, DEL and META operations (`encode_batch`), so a
batch is replayed whole or not at all. `frame`, `WalReader` and the batch codec are
pure (bytes in, bytes out); `WalWriter` is the only part that touches a file,
and it never syncs: the SSD tier decides when to fdatasync (group commit).
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import msgpack
from crc32c import crc32c

FILE_MODE = 0o600  # every file of the SSD tier, logs included: its owner's alone (ssd_files.py)
BLOCK_SIZE = 32 * 1024  # as LevelDB's log::kBlockSize
HEADER_SIZE = 7  # crc u32 + length u16 + type u8
_HEADER = struct.Struct("<IHB")

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {t: crc32c(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}
_MASK_DELTA = 0xA282EAD8  # LevelDB's crc32c::Mask constant


def mask_crc(crc: int) -> int:
    """Rotate and offset a CRC so that a CRC of data containing CRCs stays strong."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _fragment_crc(typ: int, fragment) -> int:
    return mask_crc(crc32c(fragment, _TYPE_CRC[typ]))


def frame(records: Iterable[bytes], offset: int) -> bytes:
    """The bytes that append `records` to a log whose current length is `offset`."""
    out = bytearray()
    pos = offset
    for record in records:
        rest = memoryview(record)
        first = True
        while True:
            room = BLOCK_SIZE - pos % BLOCK_SIZE
            if room < HEADER_SIZE:
                out += bytes(room)
                pos += room
                room = BLOCK_SIZE
            n = min(room - HEADER_SIZE, len(rest))
            last = n == len(rest)
            typ = (FULL if last else FIRST) if first else (LAST if last else MIDDLE)
            out += _HEADER.pack(_fragment_crc(typ, rest[:n]), n, typ)
            out += rest[:n]
            pos += HEADER_SIZE + n
            rest = rest[n:]
            first = False
            if last:
                break
    return bytes(out)


class Stop(str, enum.Enum):
    """Why a reader stopped."""

    END = "end"  # the data ended on a record boundary
    TORN = "torn"  # the data ended inside a record (a crash mid-append)
    ZEROS = "zeros"  # a zero-filled header where a fragment should be
    CORRUPT = "corrupt"  # a bad checksum, type, length or fragment sequence


class WalReader:
    """Iterates the complete records of a log held in memory.

    Iteration yields `(offset, record)`. Without `resync` it ends at the first problem;
    afterwards `stop` says why, `stop_offset` where (the fragment at fault, or the end of
    the data), `detail` says what in words, and `end` is the offset just past the last
    complete record: everything before it is good.

    With `resync` (what recovery uses), a problem does not end it: as LevelDB's reader
    does, it drops the record under way, skips to the next 32 KiB block (every block
    starts on a fragment boundary) and goes on with the first record that starts there,
    so one flipped byte costs the records of one block, not the rest of the log.
    `skipped` lists each damaged stretch as (offset, Stop, detail), a torn tail
    included; `stop` and the rest describe the first of them (END when there is none).
    """

    def __init__(self, data: bytes | bytearray | memoryview, resync: bool = False) -> None:
        self._data = memoryview(data).cast("B")
        self._resync = resync
        self.stop: Stop | None = None
        self.stop_offset = 0
        self.end = 0
        self.detail = ""
        self.skipped: list[tuple[int, Stop, str]] = []

    def _halt(self, why: Stop, offset: int, detail: str) -> None:
        if self.stop is None or self.stop is Stop.END:
            self.stop, self.stop_offset, self.detail = why, offset, detail
        if why is not Stop.END:
            self.skipped.append((offset, why, detail))

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        data = self._data
        size = len(data)
        unpack_header = _HEADER.unpack_from
        pos = 0
        parts: list[memoryview] | None = None  # fragments of the record being joined
        start = 0
        damaged = False  # skipping ahead after a problem (resync): later problems are the same stretch
        while True:
            room = BLOCK_SIZE - pos % BLOCK_SIZE
            if room < HEADER_SIZE:  # zero-filled block tail
                pos += room
            problem = None
            if pos >= size:
                if parts is not None and not damaged:
                    self._halt(Stop.TORN, size, f"record at {start} is missing its last fragment")
                elif not self.skipped:
                    self._halt(Stop.END, size, "")
                return
            if size - pos < HEADER_SIZE:
                problem = Stop.TORN, "partial fragment header"
            else:
                crc, length, typ = unpack_header(data, pos)
                body_end = pos + HEADER_SIZE + length
                if not (crc or length or typ):
                    problem = Stop.ZEROS, "zero-filled fragment header"
                elif typ not in _TYPE_CRC:
                    problem = Stop.CORRUPT, f"unknown fragment type {typ}"
                elif HEADER_SIZE + length > BLOCK_SIZE - pos % BLOCK_SIZE:
                    problem = Stop.CORRUPT, f"fragment length {length} crosses a block boundary"
                elif body_end > size:
                    problem = Stop.TORN, "partial fragment"
                elif _fragment_crc(typ, data[pos + HEADER_SIZE:body_end]) != crc:
                    problem = Stop.CORRUPT, "fragment checksum mismatch"
                elif (typ in (FULL, FIRST)) != (parts is None):
                    if damaged and parts is None:  # the tail of a record whose start was skipped
                        pos = body_end
                        continue
                    what = "starts inside" if parts is not None else "continues without"
                    problem = Stop.CORRUPT, f"fragment type {typ} {what} a record"
            if problem is not None:
                if not damaged:
                    self._halt(problem[0], pos, problem[1])
                if not self._resync:
                    return
                damaged = True
                parts = None
                pos = (pos // BLOCK_SIZE + 1) * BLOCK_SIZE
                continue
            damaged = False
            fragment = data[pos + HEADER_SIZE:body_end]
            if typ == FULL:
                self.end = body_end
                yield pos, bytes(fragment)
            elif typ == FIRST:
                parts, start = [fragment], pos
            else:
                parts.append(fragment)
                if typ == LAST:
                    record = b"".join(parts)
                    parts = None
                    self.end = body_end
                    yield start, record
            pos = body_end


# -- records ------------------------------------------------------------------

Scope = tuple[str, str, str, str]  # tenant, model, tokenizer, adapter

_PUT, _DEL, _META = 1, 2, 3


class PutRecord(NamedTuple):
    """A block became durable at `seg`/`offset` (its extent starts there)."""

    generation: int
    scope: Scope
    key: bytes
    seg: int
    offset: int  # bytes from the start of the segment file
    length: int  # payload bytes
    crc: int  # CRC32C of the payload
    expire: int = 0  # when the value expires (unix ms), 0: never


class DelRecord(NamedTuple):
    """(scope, key)'s block is deleted if its generation is <= `generation` (the
    version that was deleted); a newer version of the key is not."""

    generation: int
    scope: Scope
    key: bytes


class MetaRecord(NamedTuple):
    """(scope, key)'s block of generation `generation` now expires at `expire` (unix ms,
    0: never): an EXPIRE, PERSIST, GETEX ... of a value with a copy on the tier. A
    version of any other generation is not changed."""

    generation: int
    scope: Scope
    key: bytes
    expire: int


class BadRecord(ValueError):
    """A framed record that is not a batch of PUT and DEL operations of this format."""


EXPIRE_MAX = (1 << 63) - 1  # the latest expiry the tier can hold (unix ms): the block header's i64


class Unstorable(ValueError):
    """What the SSD tier's formats cannot hold (an expiry outside 0..EXPIRE_MAX). Raised before
    anything of it is written, so it fails its own value or change only, never the tier."""


def check_expire(expire: int) -> int:
    """`expire` (unix ms, 0: never) if the tier can hold it; else Unstorable."""
    if not 0 <= expire <= EXPIRE_MAX:
        raise Unstorable(f"expiry {expire} is outside what the SSD tier holds (0..{EXPIRE_MAX} unix ms)")
    return expire


Record = PutRecord | DelRecord | MetaRecord


def encode_batch(ops: Iterable[Record]) -> bytes:
    """One log record holding a batch of operations, applied in order, all or none.

    msgpack: an array of [1, generation, tenant, model, tokenizer, adapter, key, seg,
    offset, length, crc, expire] (PUT), [2, generation, tenant, model, tokenizer, adapter,
    key] (DEL) and [3, generation, tenant, model, tokenizer, adapter, key, expire] (META)
    arrays. One record per batch keeps replay cost per batch, not per op. An expiry the
    tier cannot hold raises Unstorable (nothing is encoded).
    """
    out = []
    for op in ops:
        t = type(op)
        if t is PutRecord:
            out.append((_PUT, op.generation, *op.scope, op.key, op.seg, op.offset, op.length, op.crc,
                        check_expire(op.expire)))
        elif t is MetaRecord:
            out.append((_META, op.generation, *op.scope, op.key, check_expire(op.expire)))
        else:
            out.append((_DEL, op.generation, *op.scope, op.key))
    return msgpack.packb(out)


def decode_batch(data: bytes) -> list[Record]:
    ops: list[Record] = []
    try:
        for f in msgpack.unpackb(data, use_list=False):
            if f[0] == _PUT and len(f) == 12:
                ops.append(PutRecord(f[1], f[2:6], f[6], f[7], f[8], f[9], f[10], f[11]))
            elif f[0] == _DEL and len(f) == 7:
                ops.append(DelRecord(f[1], f[2:6], f[6]))
            elif f[0] == _META and len(f) == 8:
                ops.append(MetaRecord(f[1], f[2:6], f[6], f[7]))
            else:
                raise BadRecord(f"unknown operation {f[:2]!r}")
    except BadRecord:
        raise
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
        raise BadRecord(f"undecodable record: {e}") from e
    return ops


# -- files --------------------------------------------------------------------


def wal_name(number: int) -> str:
    return f"wal-{number:06d}.log"


def parse_wal_name(name: str) -> int | None:
    """The number of a log file name, or None for any other name."""
    if name.startswith("wal-") and name.endswith(".log") and name[4:-4].isdigit():
        return int(name[4:-4])
    return None


class WalWriter:
    """Appends framed records to one log file. Not thread-safe: the tier serializes it.

    The file is opened for appending at its current length, so a writer must only
    be opened on a log that ends cleanly (the tier always starts a new file after
    a restart). `append` raises OSError as the OS reports it; the caller treats
    any error as fatal for the log.
    """

    def __init__(self, path: str, number: int) -> None:
        self.path = path
        self.number = number
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)
        self.size = os.fstat(self.fd).st_size

    def append(self, records: Iterable[bytes]) -> int:
        """Write `records` (encoded); returns the bytes written. Does not sync."""
        data = frame(records, self.size)
        rest = memoryview(data)
        while rest:
            n = os.write(self.fd, rest)
            self.size += n
            rest = rest[n:]
        return len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
