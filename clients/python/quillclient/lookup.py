"""Reading a block with no round trip: quilld's lookup table, mapped read-only.

quilld keeps, beside its arena, a table of where its blocks lie (quilld/tiers/lookup_table.py
says how and why; this is its reader). A client attached with `SHM ATTACH TABLE` maps it and
reads a block by itself: the key's digest (BLAKE2b-128 under its scope's salt, handed over by
ATTACH), a probe of at most `probe` entries from its home, a copy of the block out of the
arena, and a check that the entry did not change meanwhile. No system call, no message.

The seqlock, as a reader: read the entry's `seq` (odd: being written, try again), then its
key digest and fields, copy, then read `seq` again: equal, the copy is the key's value as it
was at one instant, good; different, quilld changed the entry while we copied (the key was
overwritten, deleted, evicted...: its block may already hold another value's bytes), so the
copy is thrown away and read again (TRIES times at most), then left to quilld (SHM GET). On
x86-64 the loads are performed in program order (TSO), which is what makes the second `seq`
a check of the copy; elsewhere `verify` (ClientConfig.verify_crc, the default there) checks
the copy's CRC32C against the entry's too.

The table is trusted only while quilld is alive: its header holds a robust mutex quilld locks
at start and never lets go; the kernel marks it when quilld dies (even by SIGKILL), and a clean
stop unlocks it, so `alive()` is a load, not a system call. A dead quilld's table is never read.

A successful read marks its entry (one byte in the read marks quilld maps too), so quilld
counts the key as used in its LRU: a block read only through the table is not taken for cold.
A key with a TTL carries its deadline: once it has passed, the table is not believed (quilld
expires the key when asked).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import time
from typing import Any

import crc32c
from quillwire.encode import encode_arg

from quillclient.errors import BufferTooSmall
from quillclient.segments import Segments, land

VERSION = 1  # the layout this reader knows (SHM ATTACH TABLE's lookup_version)
HEADER_WORDS = 8
ENTRY_WORDS = 8
TRIES = 3  # reads of an entry that keeps changing under the copy before quilld is asked
DIGESTS_KEPT = 1 << 16  # keys whose digests are remembered (then forgotten all at once)
NOT_HERE = -2  # read_key's answer when the table cannot serve the key: ask quilld
_OWNER_DIED = 0x40000000  # FUTEX_OWNER_DIED: the kernel's mark on a robust mutex whose owner died
_TID = 0x3FFFFFFF
_TWO_WORDS = struct.Struct("<QQ").unpack


def key_bytes(key: Any) -> bytes:
    """The key as quilld receives it (quillwire's encoding of a command argument)."""
    return key if key.__class__ is bytes else bytes(encode_arg(key))


class Lookup:
    """quilld's lookup table and read marks, mapped; the salt of this client's identity scope."""

    __slots__ = ("table_mm", "words", "owner", "marks_mm", "mask", "probe", "salt", "arena", "arena_bytes",
                 "retries", "_digests")

    def __init__(self, table_fd: int, marks_fd: int, slots: int, probe: int, salt: bytes,
                 arena: memoryview) -> None:
        size = (HEADER_WORDS + slots * ENTRY_WORDS) * 8
        self.table_mm = mmap.mmap(table_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.words = memoryview(self.table_mm).cast("Q")
        self.owner = memoryview(self.table_mm)[:4].cast("I")  # the robust mutex's owner word
        self.marks_mm = mmap.mmap(marks_fd, slots, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.mask = slots - 1
        self.probe = probe
        self.salt = salt
        self.arena = arena
        self.arena_bytes = arena.nbytes
        self.retries = 0  # entries that changed under a copy (each copy thrown away and read again)
        self._digests: dict = {}  # key -> (h1, h2, its home's first word): a key read again costs no hash

    def set_salt(self, salt: bytes) -> None:
        if salt != self.salt:
            self.salt = salt
            self._digests = {}

    def alive(self) -> bool:
        """Whether quilld still holds the table (a load of its mutex's owner word)."""
        word = self.owner[0]
        return bool(word & _TID) and not word & _OWNER_DIED

    def digest(self, key: Any) -> tuple[int, int, int]:
        """(h1, h2, the first word of the key's home entry), remembered for keys that can be."""
        h1, h2 = _TWO_WORDS(hashlib.blake2b(key_bytes(key), key=self.salt, digest_size=16).digest())
        h1 |= 1
        out = (h1, h2, HEADER_WORDS + ((h1 >> 1) & self.mask) * ENTRY_WORDS)
        if key.__class__ in (str, bytes):
            digests = self._digests
            if len(digests) >= DIGESTS_KEPT:
                digests.clear()
            digests[key] = out
        return out

    def read_key(self, key: Any, view: memoryview | Segments, verify: bool) -> int:
        """Copy `key`'s block into `view`: its length, or NOT_HERE (not in the table, or it kept
        changing: ask quilld). Raises BufferTooSmall, with nothing written, when it does not fit."""
        word = self.owner[0]
        if not word & _TID or word & _OWNER_DIED:  # quilld is gone (or stopped): its table says nothing
            return NOT_HERE
        d = self._digests.get(key) if key.__class__ in (str, bytes) else None
        h1, h2, b = d if d is not None else self.digest(key)
        w = self.words
        seq = w[b]  # the key's home entry, the common case, inline: what a hit costs
        if w[b + 1] == h1 and w[b + 2] == h2:
            offset, n, expire = w[b + 3], w[b + 4], w[b + 6]
            if not (seq & 1 or verify or expire or n > len(view) or offset + n > self.arena_bytes
                    or view.__class__ is not memoryview):
                view[:n] = self.arena[offset:offset + n]
                if w[b] == seq:  # after the copy: TSO keeps the copy's loads (and the fields') before it
                    self.marks_mm[(b - HEADER_WORDS) >> 3] = 1
                    return n
                self.retries += 1
            return self.read_at(b, h1, h2, view, verify)  # the careful way: it tries again, or says why not
        home, mask = (b - HEADER_WORDS) // ENTRY_WORDS, self.mask
        for i in range(1, self.probe):  # not at its home: the next entries, wrapping
            b = HEADER_WORDS + ((home + i) & mask) * ENTRY_WORDS
            if w[b + 1] == h1 and w[b + 2] == h2:
                return self.read_at(b, h1, h2, view, verify)
        return NOT_HERE

    def read_entry(self, entry: int, key: Any, view: memoryview | Segments, verify: bool) -> int:
        """Copy the block SHM GET said `key` is at (`entry` of the table): as read_key."""
        if not 0 <= entry <= self.mask:
            return NOT_HERE
        h1, h2, _ = self.digest(key)
        return self.read_at(HEADER_WORDS + entry * ENTRY_WORDS, h1, h2, view, verify)

    def read_at(self, b: int, h1: int, h2: int, view: memoryview | Segments, verify: bool) -> int:
        w = self.words
        for _ in range(TRIES):
            seq = w[b]
            if seq & 1:  # being written right now
                self.retries += 1
                continue
            if w[b + 1] != h1 or w[b + 2] != h2:  # another key's entry, or emptied, since we looked
                return NOT_HERE
            offset, n, expire = w[b + 3], w[b + 4], w[b + 6]
            crc = w[b + 5] if verify else 0
            if n > len(view):
                if w[b] == seq:
                    raise BufferTooSmall(n, len(view))
                self.retries += 1
                continue
            end = offset + n
            if end > self.arena_bytes:  # fields read mid-change (seq moved on): try again
                self.retries += 1
                continue
            if expire and expire <= time.time() * 1000:
                return NOT_HERE  # quilld expires it when asked
            if view.__class__ is memoryview:
                view[:n] = self.arena[offset:end]
            else:
                land(view, self.arena[offset:end])
            if w[b] != seq:  # after the copy: TSO keeps the copy's loads before this one
                self.retries += 1
                continue
            if verify and (view.crc32c(n) if isinstance(view, Segments) else crc32c.crc32c(view[:n])) != crc:
                self.retries += 1
                continue
            self.marks_mm[(b - HEADER_WORDS) >> 3] = 1
            return n
        return NOT_HERE

    def close(self) -> None:
        self.words.release()
        self.owner.release()
        self.table_mm.close()
        self.marks_mm.close()
