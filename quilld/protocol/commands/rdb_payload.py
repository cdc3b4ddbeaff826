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
with `rdbcompression no`, and reads both.
"""

from __future__ import annotations

import struct

import anycrc

from quilld.errors import CommandError

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


def load(payload: bytes) -> bytes:
    """The string a checked payload holds; BadPayload when it holds anything else."""
    view = memoryview(payload)[:-10]
    if not view:
        raise BadPayload(BAD_FORMAT)
    kind = view[0]
    if kind != TYPE_STRING:
        name = TYPE_NAMES.get(kind)
        if name is None:
            raise BadPayload(BAD_FORMAT)
        raise BadPayload(f"the DUMP payload holds a {name}: quilld stores strings only")
    value, _ = _load_string(view, 1)
    return value


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


def _load_string(view: memoryview, pos: int) -> tuple[bytes, int]:
    n, encoded, pos = _load_length(view, pos)
    if encoded:
        if n in (0, 1, 2):  # INT8, INT16, INT32: the integer's decimal digits
            size = 1 << n
            if pos + size > len(view):
                raise BadPayload(BAD_FORMAT)
            return b"%d" % int.from_bytes(view[pos:pos + size], "little", signed=True), pos + size
        if n == 3:  # LZF
            clen, enc1, pos = _load_length(view, pos)
            ulen, enc2, pos = _load_length(view, pos)
            if enc1 or enc2 or pos + clen > len(view):
                raise BadPayload(BAD_FORMAT)
            return lzf_decompress(view[pos:pos + clen], ulen), pos + clen
        raise BadPayload(BAD_FORMAT)
    if pos + n > len(view):
        raise BadPayload(BAD_FORMAT)
    return bytes(view[pos:pos + n]), pos + n


def lzf_decompress(data: memoryview, size: int) -> bytes:
    """liblzf's lzf_decompress (redis's lzf_d.c): literal runs and back references; BadPayload
    unless it yields exactly `size` bytes."""
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        ctrl = data[i]
        i += 1
        if ctrl < 32:  # a literal run of ctrl + 1 bytes
            run = ctrl + 1
            if i + run > n:
                raise BadPayload(BAD_FORMAT)
            out += data[i:i + run]
            i += run
            continue
        length = ctrl >> 5
        if length == 7:
            if i >= n:
                raise BadPayload(BAD_FORMAT)
            length += data[i]
            i += 1
        if i >= n:
            raise BadPayload(BAD_FORMAT)
        start = len(out) - ((ctrl & 0x1F) << 8) - data[i] - 1
        i += 1
        length += 2
        if start < 0:
            raise BadPayload(BAD_FORMAT)
        while length:  # the reference may overlap what it produces
            piece = out[start:start + length]
            out += piece
            start += len(piece)
            length -= len(piece)
        if len(out) > size:
            raise BadPayload(BAD_FORMAT)
    if len(out) != size:
        raise BadPayload(BAD_FORMAT)
    return bytes(out)
