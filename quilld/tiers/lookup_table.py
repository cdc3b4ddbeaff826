"""The same-host lookup table: where a mapped client finds a block without asking quilld.

A client that maps the arena (SHM ATTACH TABLE; users in security.map_users only) maps this
table too, read-only, and reads a block with no system call at all: a hash of its key, a
probe of a few entries, a copy out of the arena, and a check that the entry did not change
meanwhile. quilld is asked only when that fails: a miss, a value not in the arena (inline,
SSD only), an entry that changed under the copy.

Layout: a 64-byte header, then `slots` entries of 64 bytes, each 8 little-endian u64, in a
memfd of its own, sealed like the lease table (memfd.py: nobody resizes it, and clients are
handed a read-only descriptor):

    header  a process-shared robust mutex that quilld locks at start and holds for its
            whole life (`alive`), then VERSION and `slots`
    entry   0 seq     even: stable; odd: being written. Bumped on every change of the entry.
            1 h1      the key's digest, first half, its low bit set (0: the entry is empty)
            2 h2      the digest's second half
            3 offset  of the block in the arena
            4 length  of the block
            5 crc     its CRC32C
            6 expire  when the key expires, unix ms (0: never)
            7         0 (reserved)

A key's digest is BLAKE2b-128 of the key, keyed with its identity scope's *salt*: a BLAKE2b of
the scope's tag under a secret drawn when quilld starts. SHM ATTACH hands a connection the salt
of its own scope only, so a client finds its own scope's keys and no other's (the scope is part
of the lookup key). A key lives in one of the PROBE entries from its home (`h1 >> 1` modulo
`slots`, wrapping); when all of them are taken it is not put in the table (its reads ask
quilld, SHM GET, as before). Only blocks are put there (values in the arena, their CRC32C
known), and only those of tenants allowed to map (`tenants`): nobody else can read the table.

The discipline is a seqlock, the lease table's generations (leases.py) applied to each key:

- quilld writes an entry as: seq += 1 (odd), the fields, seq += 1 (even);
- it empties a key's entry (seq odd, h1 = 0, seq even) BEFORE the key's block stops being its
  value: before the key is overwritten, deleted, expired, evicted, demoted, renamed away,
  changed in place or given another TTL (the keyspace calls `drop` at each of those places,
  keyspace.py, tier_moves.py, value_parts.py, ttl_verbs.py), so always before the block's
  space can be freed, let alone reused;
- a reader reads seq (odd: try again), the fields, copies the block, then reads seq again:
  equal, the copy is the key's value as it was at one instant; different, the copy is thrown
  away and the reader tries again or asks quilld. A reader that loses the race (the entry
  emptied, the block freed and written again by its next owner while it copied) finds a seq
  that moved on: it never returns those bytes.

This relies on the x86-64 memory model (TSO), as the lease table does: the reader's loads are
performed in order (the copy's loads before its second seq load), quilld's stores too (the
seq's bump before any later write to the block's memory, by quilld or by a client it answered
after the bump). Where loads may be reordered (ARM, POWER) the client checks each copy's
CRC32C too (quillclient's verify_crc, the default there): the entry carries it.

Liveness: the header's robust mutex is locked by the thread that built the table and never
unlocked while quilld runs. When quilld dies, even by SIGKILL, the kernel marks it
(FUTEX_OWNER_DIED) in the shared memory itself, so a client sees at once, with no system call,
that the table is no longer quilld's word: it stops reading it, and its next call that asks
quilld fails (a connection error) as it did before the table existed. A clean stop unlocks it.

LRU: the table alone would hide reads from the keyspace's LRU (a block read only through it
would look cold). So a client sets its entry's byte in the *read marks*, a second memfd of one
byte per entry, mapped writable by clients (sealed against resizing only); `note_reads`
(housekeeping) moves each marked key to the LRU's end, counts it as a hit and clears the mark.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import secrets
import struct
import time
from typing import Any

from quilld.scopes import TAG_LEN
from quilld.tiers.block import Block
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.memfd import reopened_read_only, seal, sealed_memfd

VERSION = 1  # of the layout above; SHM ATTACH TABLE says it, and a client that knows another ignores the table
HEADER_WORDS = 8  # the header: 64 bytes
ENTRY_WORDS = 8  # an entry: 64 bytes, one cache line
PROBE = 8  # entries a key may live in, from its home
AUTO_PER = 64 * 1024  # an automatic size gives two entries per this many arena bytes...
AUTO_MIN, AUTO_MAX = 4096, 1 << 22  # ... within these (a power of two: 256 KiB to 256 MiB of table)
_MUTEX_BYTES = 40  # glibc's pthread_mutex_t on 64-bit Linux; its first int is the owner's TID
_MISSING = object()


def table_slots(configured: int, arena_bytes: int) -> int:
    """Entries of the table for server.shm_lookup_slots: 0 sizes it from the arena, a negative
    value means no table; a power of two either way."""
    if configured < 0:
        return 0
    n = configured or min(AUTO_MAX, max(AUTO_MIN, 2 * arena_bytes // AUTO_PER))
    return 1 << (n - 1).bit_length()


_TWO_WORDS = struct.Struct("<QQ").unpack


def digest(salt: bytes, key: bytes) -> tuple[int, int]:
    """(h1, h2): BLAKE2b-128 of `key` under `salt`, h1's low bit set (0 marks an empty entry)."""
    h1, h2 = _TWO_WORDS(hashlib.blake2b(key, key=salt, digest_size=16).digest())
    return h1 | 1, h2


def _hold_robust_mutex(address: int) -> bool:
    """Make the memory at `address` a process-shared robust mutex locked by this thread; False
    where the C library offers none (the table is then not handed out)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        attr = ctypes.create_string_buffer(64)
        mutex = ctypes.c_void_p(address)
        return (libc.pthread_mutexattr_init(attr) == 0 and libc.pthread_mutexattr_setpshared(attr, 1) == 0
                and libc.pthread_mutexattr_setrobust(attr, 1) == 0 and libc.pthread_mutex_init(mutex, attr) == 0
                and libc.pthread_mutex_lock(mutex) == 0)
    except (OSError, AttributeError):
        return False


class LookupTable:
    def __init__(self, keyspace: Keyspace, slots: int, tenants: frozenset[str]) -> None:
        if slots & (slots - 1) or slots < PROBE:
            raise ValueError("the lookup table's entries must be a power of two, at least PROBE")
        self.keyspace = keyspace
        self.slots = slots
        self.mask = slots - 1
        self.tenants = tenants
        self._secret = secrets.token_bytes(32)
        self._salts: dict[bytes, Any] = {}  # scope tag -> its salt, or None (its tenant may not map)
        self._hashers: dict[bytes, Any] = {}  # scope tag -> a BLAKE2b keyed with its salt, to copy
        size = (HEADER_WORDS + slots * ENTRY_WORDS) * 8
        self.fd = sealed_memfd("quilld-lookup", size)
        self.marks_fd = -1
        try:
            self._mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            self.words = memoryview(self._mm).cast("Q")
            self._mutex = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
            self.alive = _hold_robust_mutex(self._mutex)
            self.words[HEADER_WORDS - 3] = VERSION
            self.words[HEADER_WORDS - 2] = slots
            self.sealed = seal(self.fd, read_only=True)  # after our mapping: it alone writes
            self.shared_fd = reopened_read_only(self.fd)  # what a client is handed
            self.marks_fd = sealed_memfd("quilld-reads", slots)
            self._marks = mmap.mmap(self.marks_fd, slots, flags=mmap.MAP_SHARED)
            self.sealed = seal(self.marks_fd) and self.sealed  # clients write it: resizing alone is sealed
        except BaseException:
            os.close(self.fd)
            if self.marks_fd >= 0:
                os.close(self.marks_fd)
            raise
        self._entry: dict[bytes, int] = {}  # full key -> its entry
        self._key: list[bytes | None] = [None] * slots  # entry -> full key
        self._block: list[Block | None] = [None] * slots  # entry -> the block it names
        self.added = 0
        self.dropped = 0
        self.full = 0  # blocks not put in the table: every entry they may live in was taken
        self.reads_noted = 0  # keys seen read through the table (note_reads)
        keyspace.scopes.on_release.append(self._forget_scope)

    @property
    def entries(self) -> int:
        return len(self._entry)

    @property
    def usable(self) -> bool:
        """Whether the table may be handed out: sealed, and its liveness mutex held."""
        return self.sealed and self.alive

    def salt(self, tag: bytes) -> bytes | None:
        """The salt of scope `tag`'s digests; None when its tenant may not map (not in the table)."""
        salt = self._salts.get(tag, _MISSING)
        if salt is _MISSING:
            try:
                tenant = self.keyspace.scopes.scope_of(tag).tenant
            except KeyError:
                return None
            salt = hashlib.blake2b(tag, key=self._secret, digest_size=16).digest() if tenant in self.tenants else None
            self._salts[tag] = salt
        return salt

    def _forget_scope(self, tag: bytes, scope: Any) -> None:
        self._salts.pop(tag, None)
        self._hashers.pop(tag, None)

    def _digest(self, fk: bytes) -> tuple[int, int] | None:
        """`digest(salt of fk's scope, its key)`, from a keyed hasher kept per scope; None when the
        scope's tenant may not map."""
        tag = fk[:TAG_LEN]
        hasher = self._hashers.get(tag)
        if hasher is None:
            salt = self.salt(tag)
            if salt is None:
                return None
            hasher = self._hashers[tag] = hashlib.blake2b(key=salt, digest_size=16)
        h = hasher.copy()
        h.update(fk[TAG_LEN:])
        h1, h2 = _TWO_WORDS(h.digest())
        return h1 | 1, h2

    def add(self, fk: bytes, block: Block) -> int:
        """Put `fk`'s block (resident, its CRC32C known) in the table: its entry, or -1 when it is
        not put there (its tenant may not map, or every entry it may live in is taken)."""
        crc = block.crc
        if crc is None:
            return -1
        entry = self._entry.get(fk)
        if entry is not None:
            if self._block[entry] is block:
                return entry
            self.drop(fk)
        hashed = self._digest(fk)
        if hashed is None:
            return -1
        h1, h2 = hashed
        keys, mask = self._key, self.mask
        home = (h1 >> 1) & mask
        for i in range(PROBE):
            entry = (home + i) & mask
            if keys[entry] is None:
                break
        else:
            self.full += 1
            return -1
        ks = self.keyspace
        w, b = self.words, HEADER_WORDS + entry * ENTRY_WORDS
        w[b] += 1  # odd: being written
        w[b + 1] = h1
        w[b + 2] = h2
        w[b + 3] = ks.arena.offset(block.handle)
        w[b + 4] = block.length
        w[b + 5] = crc
        w[b + 6] = ks.expires.get(fk, 0) if ks.expires else 0
        w[b] += 1  # even: stable
        self._entry[fk] = entry
        keys[entry] = fk
        self._block[entry] = block
        self.added += 1
        return entry

    def drop(self, fk: bytes) -> None:
        """Empty `fk`'s entry, if it has one: called before its block stops being its value."""
        entry = self._entry.pop(fk, None)
        if entry is None:
            return
        w, b = self.words, HEADER_WORDS + entry * ENTRY_WORDS
        w[b] += 1  # odd: a reader between the two bumps retries, one before them sees seq move on
        w[b + 1] = 0
        w[b] += 1
        self._key[entry] = None
        self._block[entry] = None
        self.dropped += 1

    def note_reads(self) -> int:
        """Keys read through the table since the last call join the LRU's end (and count as hits,
        for the LFU counters too under an LFU maxmemory policy: one a key, however many reads the
        mark stands for); their marks are cleared. How many."""
        marks = self._marks
        pos = marks.find(b"\x01")
        if pos < 0:
            return 0
        ks, keys, blocks = self.keyspace, self._key, self._block
        data, hits, freq, now, n = ks.data, ks.hits, ks.freq, time.time(), 0
        while pos >= 0:
            marks[pos] = 0
            fk = keys[pos]
            if fk is not None:
                block = blocks[pos]
                if data.get(fk) is block:
                    data.move_to_end(fk)
                    block.last_access = now
                    hits[fk[:TAG_LEN]] += 1
                    if freq is not None:
                        freq.hit(fk)
                    n += 1
            pos = marks.find(b"\x01", pos + 1)
        self.reads_noted += n
        return n

    def close(self) -> None:
        """quilld stops: the mutex is let go (clients stop reading the table), the memory dropped."""
        for fk in list(self._entry):
            self.drop(fk)
        if self.alive:
            ctypes.CDLL(None).pthread_mutex_unlock(ctypes.c_void_p(self._mutex))
            self.alive = False
        self.words.release()
        self._mm.close()
        self._marks.close()
        for fd in (self.fd, self.shared_fd, self.marks_fd):
            os.close(fd)
        self.fd = self.shared_fd = self.marks_fd = -1
