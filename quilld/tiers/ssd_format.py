"""The SSD tier's on-disk formats and replay rules, without file handling.

Block (format 4): a 4 KiB-aligned extent in a segment file. Its *head* (one page,
more only for a key longer than about 4 KiB) holds a 64-byte header and then the
block's identity (the msgpack of its scope's four strings followed by the raw key:
`meta_len` bytes), zero-padded to whole pages, so a scan of the segments can name
every block without any index. The payload follows on the next page boundary
(`payload_offset`), zero-padded to whole pages: every write of a large block is
page-aligned in file offset, length and (from the arena, whose blocks own whole pages)
memory, as O_DIRECT wants, and the payload's full pages go to the disk straight from
DRAM. A *packed* block is one whose header, identity and payload fit one page
(`packed`: 64 + meta_len + length <= 4096; every small value, and the 28-byte metadata
keys of LMCache's redis connector): its payload follows the identity inside the head
page, so it costs one page, not two. Whether a block is packed follows from its
header's fields, so neither the index nor a record needs to say so.

Header (little-endian, 64 bytes): magic "QSB1", version u16 (4), flags u16
(COMMITTED), xxh64 of the identity u64, generation u64, payload length u64, CRC32C
of the payload u32, meta_len u32, expiry i64 (unix ms when the value expires, 0:
never), an 8-byte tag, 4 zero bytes, CRC32C of the preceding 60 header bytes u32.

- COMMITTED is set by rewriting the header once the block's PUT record is durable:
  a block whose batch never reached the log is never taken by a scan.
- The expiry is the one the value had when the block was written. A later change
  (EXPIRE, PERSIST, GETEX ...) is a META record in the log (and the row of every
  later checkpoint), not a rewrite of the header: the normal paths take a block's
  expiry from its record, a segment scan from its header and then every record it
  can still read (see ssd_files.py).
- The tag is a keyed BLAKE2b of the header's fields (expiry included) and the
  identity, under the tier's secret key (`tier-v4.key`): a tenant's payload that
  imitates a header is never taken by a scan for someone else's block, and a
  fenced tier (its key replaced) has nothing a scan would take.
- The CRC catches accidental damage; records name a block's place, so the normal
  paths check the fields and the CRC (not the expiry, which records may change),
  not the tag.

Format 3 had no expiry, a digest of the key and one of the scope where format 4 has
one of the identity, and no packed blocks (its smallest block took two pages). A
format 3 directory is not read: it starts empty and says so (ssd_files.py). Reading
it would have needed the format of every block in every index entry, checkpoint row
and log record (the place of a payload depends on it) and a second header parser on
the read path, for a tier that is a cache and held no small value and no TTL.

Checkpoint (format 4): a 64-byte header (magic "QSCK", version, first WAL number not
covered, highest generation seen, entry count, body length, body CRC32C,
creation time, header CRC32C) and a msgpack body: the list of scopes, then arrays
of up to 4096 `[scope index, key, seg, offset, length, crc, generation, expiry]` rows.

Replay rules (the same for recovery, scans and checkpoint merges, and the ones the
live index follows): a PUT installs its block unless the key already holds an
equal or newer generation; a DEL of generation g removes the key's block if that
block's generation is <= g; a META of generation g sets the expiry of the key's
block if that block is generation g (of any other version it changes nothing).
Replaying a record twice changes nothing. A version that loses (replaced, deleted,
or older than what is installed) is *retired*; replay can list retired versions so
recovery scrubs their headers.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import struct
import time
from collections.abc import Iterable, Iterator
from hmac import compare_digest as hmac_equal
from typing import NamedTuple

import msgpack
import xxhash
from crc32c import crc32c

from quilld.errors import QuillError
from quilld.model import IdentityScope
from quilld.tiers.wal import (BadRecord, DelRecord, MetaRecord, PutRecord, Scope, WalReader, check_expire,
                              decode_batch)

PAGE = 4096
HEADER_SIZE = 64
FORMAT_VERSION = 4  # 3: no expiry, no packed blocks (ssd_files.py: such a tier starts empty)
BLOCK_MAGIC = b"QSB1"
CHECKPOINT_MAGIC = b"QSCK"
COMMITTED = 1  # header flag: the block's PUT record is durable
TAG_SIZE = 8
KEY_SIZE = 32  # bytes of the tier's secret key

_BLOCK = struct.Struct("<4sHHQQQIIq8s4x")  # 60 bytes, then the header CRC
_FIELDS = struct.Struct("<QQQII")  # identity digest .. meta_len: what a record names (header bytes 8..40)
_TAGGED = struct.Struct("<QQQIIq")  # what the tag covers, before the identity: the fields and the expiry
_EXPIRY = struct.Struct("<q")
_EXPIRY_AT = 40
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
def scope_meta(scope: Scope) -> bytes:
    """How a block's identity starts: its scope's four strings, msgpack-encoded."""
    return msgpack.packb(list(scope))


def block_meta(scope: Scope, key: bytes) -> bytes:
    """A block's identity as stored after its header."""
    return scope_meta(tuple(scope)) + bytes(key)


def identity_digest(scope: Scope, key: bytes) -> int:
    """The header's digest of a block's identity (xxh64 of `block_meta`)."""
    h = xxhash.xxh64(scope_meta(tuple(scope)))
    h.update(key)
    return h.intdigest()


def meta_len(scope: Scope, key: bytes) -> int:
    return len(scope_meta(tuple(scope))) + len(key)


def packed(mlen: int, length: int) -> bool:
    """Whether a block of `length` payload bytes and an identity of `mlen` bytes is packed:
    header, identity and payload in one page."""
    return HEADER_SIZE + mlen + length <= PAGE


def _head_pages(mlen: int) -> int:
    return -(-(HEADER_SIZE + mlen) // PAGE)


def _extent_pages(mlen: int, length: int) -> int:
    if packed(mlen, length):
        return 1
    return _head_pages(mlen) + -(-length // PAGE)


def head_pages(scope: Scope, key: bytes) -> int:
    """Pages before an unpacked block's payload: the header and the identity."""
    return _head_pages(meta_len(scope, key))


def payload_offset(scope: Scope, key: bytes, length: int) -> int:
    """Where a block's payload starts, in bytes from the start of its extent: right after
    the identity in a packed block, else on the page after the head."""
    mlen = meta_len(scope, key)
    return HEADER_SIZE + mlen if packed(mlen, length) else _head_pages(mlen) * PAGE


def block_pages(scope: Scope, key: bytes, length: int) -> int:
    """Pages of a block: one when packed, else its head (header and identity), then
    `length` payload bytes."""
    return _extent_pages(meta_len(scope, key), length)


def pack_block_head(key: bytes, scope: Scope, generation: int, length: int, crc: int, expire: int, *,
                    committed: bool, tier_key: bytes, into) -> bytes:
    """Fill `into` (a writable buffer, zeroed, of at least the head's pages) with a block's
    head: its header, then its identity (a packed block's payload goes right after it).
    Returns the header."""
    header = pack_block_header(key, scope, generation, length, crc, expire, committed=committed, tier_key=tier_key)
    meta = block_meta(scope, key)
    into[:HEADER_SIZE] = header
    into[HEADER_SIZE:HEADER_SIZE + len(meta)] = meta
    return header


# -- block header -------------------------------------------------------------


def block_tag(tier_key: bytes, md: int, generation: int, length: int, crc: int, expire: int, meta: bytes) -> bytes:
    """The keyed tag of a block's fields, expiry and identity (see the module docstring)."""
    fields = _TAGGED.pack(md, generation, length, crc, len(meta), expire)
    return hashlib.blake2b(fields + meta, digest_size=TAG_SIZE, key=tier_key).digest()


def pack_block_header(key: bytes, scope: Scope, generation: int, length: int, crc: int, expire: int = 0, *,
                      committed: bool, tier_key: bytes) -> bytes:
    """A block's header; Unstorable for an expiry its i64 cannot hold."""
    check_expire(expire)
    meta = block_meta(scope, key)
    md = xxhash.xxh64_intdigest(meta)
    tag = block_tag(tier_key, md, generation, length, crc, expire, meta)
    head = _BLOCK.pack(BLOCK_MAGIC, FORMAT_VERSION, COMMITTED if committed else 0, md, generation, length, crc,
                       len(meta), expire, tag)
    return head + _CRC.pack(crc32c(head))


def commit_header(header: bytes) -> bytes:
    """The same header with COMMITTED set (and its CRC redone)."""
    head = bytearray(header[:_BLOCK.size])
    struct.pack_into("<H", head, 6, COMMITTED)
    return bytes(head) + _CRC.pack(crc32c(head))


def header_expiry(header) -> int:
    """The expiry (unix ms, 0: never) a block header was written with."""
    return _EXPIRY.unpack_from(header, _EXPIRY_AT)[0]


_PREFIX = BLOCK_MAGIC + struct.pack("<H", FORMAT_VERSION)


def header_matches(header, key: bytes, scope: Scope, generation: int, length: int, crc: int) -> bool:
    """Whether `header` (64 bytes) is intact and describes exactly this block, committed or
    not, whatever expiry it was written with."""
    return (header[:6] == _PREFIX
            and header[8:40] == _FIELDS.pack(identity_digest(scope, key), generation, length, crc,
                                             meta_len(scope, key))
            and crc32c(header[:_BLOCK.size]) == _CRC.unpack_from(header, _BLOCK.size)[0])


def check_block_header(
    header: bytes | bytearray | memoryview, key: bytes, scope: Scope, generation: int, length: int, crc: int
) -> None:
    """Raise CorruptBlock unless `header` is intact and describes exactly this block
    (committed or not: the record that names it is the proof that it was)."""
    if len(header) >= HEADER_SIZE and header_matches(header, key, scope, generation, length, crc):
        return  # the common case; otherwise say what differs
    if len(header) < HEADER_SIZE:
        raise CorruptBlock(f"short header ({len(header)} bytes)")
    (stored_crc,) = _CRC.unpack_from(header, _BLOCK.size)
    if crc32c(memoryview(header)[:_BLOCK.size]) != stored_crc:
        raise CorruptBlock("block header checksum mismatch")
    magic, version, _, md, gen, n, pcrc, mlen, _, _ = _BLOCK.unpack_from(header)
    if magic != BLOCK_MAGIC or version != FORMAT_VERSION:
        raise CorruptBlock(f"not a block header (magic {magic!r}, version {version})")
    if md != identity_digest(scope, key) or mlen != meta_len(scope, key):
        raise CorruptBlock("block header belongs to another key")
    raise CorruptBlock(
        f"block header is generation {gen}, {n} bytes, crc {pcrc:#x}; "
        f"expected {generation}, {length}, {crc:#x}"
    )


def scan_segment(buf, seg: int, tier_key: bytes) -> tuple[list[Found], int]:
    """The committed blocks in one segment's bytes whose header, identity and tag check
    out, sorted by page; and how many block-like headers were refused.

    Every page boundary is looked at (a block found does not hide a newer one written
    inside a stale extent); `drop_overlaps` settles overlaps by generation afterwards.
    """
    found: list[Found] = []
    refused = 0
    size = len(buf)
    pos = 0
    while True:
        i = buf.find(_PREFIX, pos)
        if i < 0:
            return found, refused
        if i % PAGE:
            pos = i - i % PAGE + PAGE
            continue
        pos = i + PAGE
        hit = _scanned_block(buf, i, size, tier_key)
        if hit is None:
            refused += 1
            continue
        key, flags, gen, length, crc, expire, pages = hit
        if flags & COMMITTED:
            found.append((i // PAGE, pages, key, Loc(seg, i, length, crc, gen, expire)))
        else:
            refused += 1  # written, but its batch never reached the log


def _scanned_block(buf, at: int, size: int, tier_key: bytes):
    header = bytes(buf[at:at + HEADER_SIZE])
    if len(header) < HEADER_SIZE or crc32c(header[:_BLOCK.size]) != _CRC.unpack_from(header, _BLOCK.size)[0]:
        return None
    _, _, flags, md, gen, length, crc, mlen, expire, tag = _BLOCK.unpack_from(header)
    pages = _extent_pages(mlen, length)
    if mlen > 1 << 20 or at + pages * PAGE > size:
        return None
    meta = bytes(buf[at + HEADER_SIZE:at + HEADER_SIZE + mlen])
    if not hmac_equal(block_tag(tier_key, md, gen, length, crc, expire, meta), tag):
        return None
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(meta)
    try:
        scope = tuple(unpacker.unpack())
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    key = meta[unpacker.tell():]
    if len(scope) != 4 or not all(type(x) is str for x in scope) or xxhash.xxh64_intdigest(meta) != md:
        return None
    return (scope, key), flags, gen, length, crc, expire, pages


# -- replay -------------------------------------------------------------------


class Loc(NamedTuple):
    """Where one block version lives, as the log and checkpoints record it, and when its
    value expires (unix ms, 0: never)."""

    seg: int
    offset: int
    length: int
    crc: int
    generation: int
    expire: int = 0


State = dict[tuple[Scope, bytes], Loc]


Retired = list[tuple[tuple[Scope, bytes], Loc]]  # versions that lost, for recovery to scrub


def apply_record(state: State, rec: PutRecord | DelRecord | MetaRecord, scope: Scope,
                 retired: Retired | None = None) -> None:
    """Apply one log record to `state` by the replay rules; `scope` is rec.scope, interned.
    Versions that lose are appended to `retired` when given."""
    k = (scope, rec.key)
    cur = state.get(k)
    t = type(rec)
    if t is PutRecord:
        loc = Loc(rec.seg, rec.offset, rec.length, rec.crc, rec.generation, rec.expire)
        if cur is None or cur.generation < rec.generation:
            state[k] = loc
            if cur is not None and retired is not None:
                retired.append((k, cur))
        elif retired is not None and cur.generation > rec.generation:
            retired.append((k, loc))
    elif t is MetaRecord:
        if cur is not None and cur.generation == rec.generation and cur.expire != rec.expire:
            state[k] = cur._replace(expire=rec.expire)
    elif cur is not None and cur.generation <= rec.generation:
        del state[k]
        if retired is not None:
            retired.append((k, cur))


def replay_log(data: bytes, state: State, scopes: dict[Scope, Scope],
               retired: Retired | None = None) -> tuple[int, int, list[str]]:
    """Apply every readable record of one log's bytes to `state`: past a damaged stretch
    the reader resynchronizes at the next 32 KiB block (wal.py), so what follows a flipped
    byte or a hole is still applied.

    `scopes` interns scopes: each distinct one becomes one IdentityScope used in keys.
    Returns (operations applied, highest generation, ["offset: what" per damaged stretch,
    a torn tail included]). A log with any problem lost records: the caller does not trust
    the replay alone (ssd_files.py falls back to a segment scan).
    """
    reader = WalReader(data, resync=True)
    applied = max_gen = 0
    problems: list[str] = []
    for offset, raw in reader:
        try:
            batch = decode_batch(raw)
        except BadRecord as e:
            problems.append(f"{offset}: {e}")
            continue
        for rec in batch:
            scope = scopes.get(rec.scope)
            if scope is None:
                scope = scopes[rec.scope] = IdentityScope(*rec.scope)
            apply_record(state, rec, scope, retired)
            max_gen = max(max_gen, rec.generation)
        applied += len(batch)
    problems += [f"{offset}: {why.value} ({detail})" for offset, why, detail in reader.skipped]
    problems.sort(key=lambda p: int(p.split(":", 1)[0]))
    return applied, max_gen, problems


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
                for si, key, seg, off, length, pcrc, gen, expire in obj:
                    yield scopes[si], key, Loc(seg, off, length, pcrc, gen, expire)
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
        raise BadCheckpoint(f"undecodable body: {e}") from e
    if size != header.body_len or crc != header.body_crc or count != header.count:
        raise BadCheckpoint(
            f"body is {size} bytes, crc {crc:#x}, {count} entries; header says "
            f"{header.body_len}, {header.body_crc:#x}, {header.count}"
        )
