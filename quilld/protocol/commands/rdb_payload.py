"""DUMP's payload: one string value in redis's RDB serialization (version 10, redis 7.0).

Pure functions on bytes (no keyspace, no wire), so a DUMP from redis-server restores
into quilld and a DUMP from quilld into redis-server:

    payload = type (0: string) | the string | RDB version (2 bytes LE) | CRC64 (8 bytes LE)

The CRC is redis's CRC-64/Jones (reflected, polynomial 0xad93d23594c935a9, no final xor)
over everything before it. A string is stored as redis stores it (rdb.c
rdbSaveRawString, rdbSaveLongLongAsStringObject): a canonical integer that fits 32 bits
as an 8, 16 or 32-bit integer; otherwise its length (6, 14, 32 or 64-bit encoding) and
its bytes. redis also compresses strings longer than 20 bytes with LZF when that saves
4 bytes or more (`rdbcompression yes`); quilld writes them uncompressed, as redis does
with `rdbcompression no`, and reads both: LZF is decoded in C (quilld/_lzf.c, the GIL
released, so RESTORE runs a large one in a worker thread). An LZF string declares its size
before its data: `held` refuses one beyond the caller's limit before anything is decoded
(a 300 KiB payload may declare 26 MB, or 2^64 bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import anycrc

from quilld.errors import CommandError

try:
    from quilld._lzf import expand as _expand  # built by setup.py wherever a C compiler works
except ImportError:  # no compiler at install: `held` refuses an LZF payload, the rest loads
    _expand = None

RDB_VERSION = 10  # redis 7.0's
TYPE_STRING = 0
TYPE_NAMES = {1: "list", 2: "set", 3: "zset", 4: "hash", 5: "zset", 6: "module", 7: "module", 9: "hash",
              10: "list", 11: "set", 12: "zset", 13: "hash", 14: "list", 15: "stream", 16: "hash", 17: "zset",
              18: "list", 19: "stream", 20: "hash", 21: "stream"}  # rdb.h's RDB_TYPE_* (what quilld cannot hold)
_ENC_INT8, _ENC_INT16, _ENC_INT32, _ENC_LZF = 0xC0, 0xC1, 0xC2, 0xC3
_CRC = anycrc.Model("CRC64-REDIS")
VERSION_OR_CHECKSUM = "DUMP payload version or checksum are wrong"
BAD_FORMAT = "Bad data format"


class BadPayload(CommandError):
    """A payload that is not a string value quilld can load (redis's texts)."""


def crc64(data, crc: int = 0) -> int:
    return _CRC.calc(data, crc)


def _length(n: int) -> bytes:
    if n < 1 << 6:
        return bytes((n,))
    if n < 1 << 14:
        return bytes((0x40 | n >> 8, n & 0xFF))
    if n <= 0xFFFFFFFF:
        return b"\x80" + n.to_bytes(4, "big")
    return b"\x81" + n.to_bytes(8, "big")


def _as_int(value) -> int | None:
    """The integer redis would store `value` as (string2ll, then ll2string gives it back), or None."""
    if not 0 < len(value) <= 20:
        return None
    raw = bytes(value)
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not digits.isdigit() or (digits[:1] == b"0" and (len(digits) > 1 or raw[:1] == b"-")):
        return None
    n = int(raw)
    return n if -(1 << 63) <= n < 1 << 63 else None


def _string(value) -> list:
    """The string's encoding, as a list of pieces (the value itself is one of them, uncopied)."""
    n = _as_int(value)
    if n is not None and -(1 << 31) <= n < 1 << 31:
        if -128 <= n <= 127:
            return [struct.pack("<Bb", _ENC_INT8, n)]
        if -(1 << 15) <= n < 1 << 15:
            return [struct.pack("<Bh", _ENC_INT16, n)]
        return [struct.pack("<Bi", _ENC_INT32, n)]
    return [_length(len(value)), value]


def dump(value) -> bytes:
    """The DUMP payload of a string value (bytes or a memoryview of the arena)."""
    body = [bytes((TYPE_STRING,)), *_string(value), struct.pack("<H", RDB_VERSION)]
    crc = 0
    for piece in body:
        crc = crc64(piece, crc)
    return b"".join(body) + struct.pack("<Q", crc)


def check(payload: bytes) -> None:
    """redis's verifyDumpPayload: a version it knows and the right checksum, or BadPayload."""
    if len(payload) < 10:
        raise BadPayload(VERSION_OR_CHECKSUM)
    version = int.from_bytes(payload[-10:-8], "little")
    if version > RDB_VERSION or crc64(memoryview(payload)[:-8]) != int.from_bytes(payload[-8:], "little"):
        raise BadPayload(VERSION_OR_CHECKSUM)


NO_LZF = ("this quilld was installed without a C compiler, so it cannot read LZF-compressed payloads "
          "(quilld/_lzf.c; redis-server writes uncompressed ones with rdbcompression no)")


@dataclass(frozen=True)
class Compressed:
    """An LZF string of a payload, not decoded yet: its stream and the size it declares."""

    data: memoryview
    size: int


def held(payload, limit: int) -> bytes | memoryview | Compressed:
    """What a checked payload holds, undecoded: an integer's digits (bytes), a raw string (a
    view of the payload) or an LZF string (`Compressed`). BadPayload when it holds anything
    else, or a string longer than `limit` bytes (the value limit: checked before any work)."""
    view = memoryview(payload)[:-10]
    if not view:
        raise BadPayload(BAD_FORMAT)
    kind = view[0]
    if kind != TYPE_STRING:
        name = TYPE_NAMES.get(kind)
        if name is None:
            raise BadPayload(BAD_FORMAT)
        raise BadPayload(f"the DUMP payload holds a {name}: quilld stores strings only")
    n, encoded, pos = _load_length(view, 1)
    if encoded:
        if n in (0, 1, 2):  # INT8, INT16, INT32: the integer's decimal digits
            size = 1 << n
            if pos + size > len(view):
                raise BadPayload(BAD_FORMAT)
            return b"%d" % int.from_bytes(view[pos:pos + size], "little", signed=True)
        if n != 3:
            raise BadPayload(BAD_FORMAT)
        clen, enc1, pos = _load_length(view, pos)  # LZF: compressed length, then the string's
        n, enc2, pos = _load_length(view, pos)
        if enc1 or enc2 or pos + clen > len(view):
            raise BadPayload(BAD_FORMAT)
        _within(n, limit)
        if _expand is None:
            raise BadPayload(NO_LZF)
        return Compressed(view[pos:pos + clen], n)
    if pos + n > len(view):
        raise BadPayload(BAD_FORMAT)
    _within(n, limit)
    return view[pos:pos + n]


def _within(n: int, limit: int) -> None:
    if n > limit:
        raise BadPayload(f"the DUMP payload holds a string of {n} bytes, more than proto-max-bulk-len ({limit})")


def expand_into(c: Compressed, out) -> None:
    """Decode `c` into `out` (a writable buffer of exactly `c.size` bytes: a bytearray, or a
    reserved block's view), in C with the GIL released; BadPayload unless it yields exactly
    that. Safe to call from a worker thread while the loop runs."""
    assert _expand is not None  # `held` refused it otherwise
    try:
        written = _expand(c.data, out)
    except ValueError:
        raise BadPayload(BAD_FORMAT) from None
    if written != c.size:
        raise BadPayload(BAD_FORMAT)


def lzf_decompress(data, size: int) -> bytes:
    """The `size` bytes an LZF stream decodes to (redis's lzf_d.c format); BadPayload unless it
    yields exactly that."""
    out = bytearray(size)
    expand_into(Compressed(memoryview(data), size), out)
    return bytes(out)


def load(payload, limit: int = 1 << 64) -> bytes:
    """The string a checked payload holds, decoded here; BadPayload when it holds anything
    else (or a string beyond `limit` bytes)."""
    value = held(payload, limit)
    if value.__class__ is Compressed:
        return lzf_decompress(value.data, value.size)
    return bytes(value)


def _load_length(view: memoryview, pos: int) -> tuple[int, bool, int]:
    """(length or special encoding, whether it is an encoding, next position)."""
    if pos >= len(view):
        raise BadPayload(BAD_FORMAT)
    first = view[pos]
    kind = first >> 6
    if kind == 0:
        return first & 0x3F, False, pos + 1
    if kind == 1:
        if pos + 2 > len(view):
            raise BadPayload(BAD_FORMAT)
        return (first & 0x3F) << 8 | view[pos + 1], False, pos + 2
    if kind == 3:
        return first & 0x3F, True, pos + 1
    size = 4 if first == 0x80 else 8 if first == 0x81 else 0
    if not size or pos + 1 + size > len(view):
        raise BadPayload(BAD_FORMAT)
    return int.from_bytes(view[pos + 1:pos + 1 + size], "big"), False, pos + 1 + size
