"""Directory entries: what is placed, where it is sharded, and the two stores that keep it.

An entry says that a *holder* (a quilld node, or an engine) has a value in some
tiers. Two kinds:

* a **key** (`KEY`): a value of the keyspace, `eid = ctag + key`; its shard is
  the key itself, so every key lands on its own owners;
* a **block** (`BLOCK`): an engine block hash, `eid = ctag + hash`; its shard is
  its *prefix segment*: the hash of the block at position `G * floor(i / G)` of
  its chain (G = `cluster.directory_group_blocks`). All blocks of one segment
  share owners, so ROUTE's lookup of a prompt's first G blocks is one owner
  round trip, whatever the cluster's size.

`ctag` is the identity scope's cluster-wide digest (8 bytes: nodes number their
scopes locally). A collision of two scopes' digests could only make a lookup
name a holder that then answers "not here": the fetch carries the full scope.

`HeldEntries` is a holder's own, authoritative list (the node's values, an
engine's blocks): per bucket, with a running digest (count and XOR of entry
hashes, one int: count << 64 | xor) so anti-entropy compares a whole bucket in
one number.
`OwnedEntries` (dir_owned.py) is an owner's store: every holder's entries for
the buckets it owns, with the same digests per (holder, bucket).

Pure data structures, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import xxhash

from quilld.index.residency import hash_key
from quilld.model import CacheTier

KEY, BLOCK = 0, 1
CTAG_LEN = 8
TIERS = tuple(CacheTier)
TIER_BIT = {t: 1 << i for i, t in enumerate(TIERS)} | {t.value: 1 << i for i, t in enumerate(TIERS)}
NBYTES_BITS = 40
_NBYTES_MAX = (1 << NBYTES_BITS) - 1
_h3 = xxhash.xxh3_64_intdigest
_ONE = 1 << 64  # a digest is one int: the count above the XOR of entry hashes
_XOR = _ONE - 1
_U64 = (1 << 64) - 1  # an int block hash as 8 bytes, as `hash_key` makes it (inline: once per block)
DROP = False  # a `HeldEntries.change_blocks` op's parent when it removes blocks (a parent is None, int or bytes)
TOMBSTONE = 0  # a key's code when its holder deleted it: in no tier (a value is always in one)


def scope_digest(tenant: str, model: str, tokenizer: str, adapter: str) -> bytes:
    """The cluster-wide 8-byte name of an identity scope."""
    return xxhash.xxh64_digest("\0".join((tenant, model, tokenizer, adapter)).encode())


def code_of(tiers: int, nbytes: int) -> int:
    """An entry's payload as one int: tier bits above the byte count."""
    return tiers << NBYTES_BITS | min(nbytes, _NBYTES_MAX)


def tiers_of(code: int) -> int:
    return code >> NBYTES_BITS


def nbytes_of(code: int) -> int:
    return code & _NBYTES_MAX


def tier_names(tiers: int) -> list[CacheTier]:
    return [t for i, t in enumerate(TIERS) if tiers >> i & 1]


def key_shard(eid: bytes) -> bytes:
    return b"K" + eid


def block_shard(ctag: bytes, group: bytes) -> bytes:
    return b"B" + ctag + group


def entry_hash(kind: int, eid: bytes, code: int, version: int = 0) -> int:
    """What one entry adds to its bucket's digest (XOR): the same on its holder and its owners.
    The kind, code and (a key's) version are the hash's seed, so nothing is concatenated (the
    placement loops below compute a block's inline, the same way: blocks have no version)."""
    return _h3(eid, (code << 1 | kind) ^ version)


class Digest(NamedTuple):
    count: int
    xor: int


class Entry(NamedTuple):
    """One entry as it travels: kind, eid, shard, code (tiers and bytes), and a key's version
    (hlc.py; blocks, immutable by their hash, have none). A key's entry with code TOMBSTONE says
    its holder deleted it at that version."""

    kind: int
    eid: bytes
    shard: bytes
    code: int
    version: int = 0


class Changes(NamedTuple):
    """A run of one holder's changes of one kind, in order, as columns: entry `i` is `eids[i]`
    (sharded at `shards[i]`, in `buckets[i]`) now with `codes[i]`, or removed when that is None.
    What a placement hands its owners: a directory message carries it as one ITEMS item, and an
    owner applies it in one loop (`OwnedEntries.apply`)."""

    kind: int
    eids: list[bytes]
    shards: list[bytes]
    buckets: list[int]
    codes: list[int | None]


class HeldEntries:
    """One holder's own entries, by bucket (the holder side)."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        # bucket -> eid -> (kind, shard, code), and a key's version after them
        self.buckets: dict[int, dict[bytes, tuple]] = {}
        self.where: dict[bytes, int] = {}  # eid -> its bucket
        self.digests: dict[int, int] = {}  # bucket -> count << 64 | xor

    def __len__(self) -> int:
        return len(self.where)

    def put(self, kind: int, eid: bytes, shard: bytes, bucket: int, code: int, version: int = 0) -> bool:
        """Record (or change) an entry; False when it is already exactly so."""
        old_bucket = self.where.get(eid)
        if old_bucket is not None:
            old = self.buckets[old_bucket][eid]
            if old[2] == code and old_bucket == bucket and (old[3] if len(old) > 3 else 0) == version:
                return False
            self._drop(old_bucket, eid, old)
        entries = self.buckets.get(bucket)
        if entries is None:
            entries = self.buckets[bucket] = {}
        entries[eid] = (kind, shard, code, version) if kind == KEY else (kind, shard, code)
        self.where[eid] = bucket
        self.digests[bucket] = self.digests.get(bucket, 0) + _ONE ^ entry_hash(kind, eid, code, version)
        return True

    def remove(self, eid: bytes) -> tuple[int, bytes, int, int] | None:
        """Forget an entry; (kind, shard, code, bucket) it had, or None."""
        bucket = self.where.pop(eid, None)
        if bucket is None:
            return None
        old = self.buckets[bucket][eid]
        self._drop(bucket, eid, old, forget=False)
        return old[0], old[1], old[2], bucket

    def get(self, eid: bytes) -> tuple | None:
        """(kind, shard, code), a key's version after them; None when not held."""
        bucket = self.where.get(eid)
        return None if bucket is None else self.buckets[bucket][eid]

    def version_of(self, eid: bytes) -> int | None:
        """A key's version here (0: unknown, recovered), or None when not held."""
        got = self.get(eid)
        return None if got is None else (got[3] if len(got) > 3 else 0)

    def _drop(self, bucket: int, eid: bytes, old: tuple, forget: bool = True) -> None:
        entries = self.buckets[bucket]
        del entries[eid]
        if forget:
            del self.where[eid]
        if entries:
            self.digests[bucket] = self.digests[bucket] - _ONE ^ entry_hash(
                old[0], eid, old[2], old[3] if len(old) > 3 else 0)
        else:
            del self.buckets[bucket]
            del self.digests[bucket]

    def change_blocks(self, ops: Iterable[tuple], ctags: dict, exact: bool, group_blocks: int,
                      bucket_of: Callable[[bytes], int]) -> tuple[Changes, int]:
        """Apply a holder's block changes, in order, in one loop (no call per block): each op is
        `(tag, tier, hashes, parent)`, its scope's digest `ctags[tag]`, its hashes ints or bytes.

        * A store (`parent` a hash or None): each block is in `tier` now (added to the tiers it
          has, or its only one with `exact`). A new block goes in the segment of the block
          before it (`parent` for the first, then each the one before), when this holder has that
          one and its segment has room; else it starts a segment of its own.
        * A removal (`parent` is DROP): each block is no longer in `tier` (in any tier when None);
          a block left in no tier is forgotten.

        Returns the changes the owners must be told (`Changes`) and how many stores named a
        parent this holder lacks."""
        where, by_bucket, digests = self.where, self.buckets, self.digests
        eids: list[bytes] = []
        shards: list[bytes] = []
        buckets: list[int] = []
        codes: list[int | None] = []
        unanchored = 0
        for tag, tier, hashes, parent in ops:
            ctag = ctags[tag]
            if parent is DROP:
                tier_bit = None if tier is None else TIER_BIT[tier]
                for h in hashes:
                    eid = ctag + ((h & _U64).to_bytes(8, "big") if type(h) is int else hash_key(h))
                    b = where.get(eid)
                    if b is None:
                        continue
                    entries = by_bucket[b]
                    _, shard, old = entries[eid]
                    tiers = 0 if tier_bit is None else old >> NBYTES_BITS & ~tier_bit
                    if tiers:
                        code: int | None = tiers << NBYTES_BITS | old & _NBYTES_MAX
                        if code == old:
                            continue
                        entries[eid] = (BLOCK, shard, code)
                        digests[b] ^= _h3(eid, old << 1 | BLOCK) ^ _h3(eid, code << 1 | BLOCK)  # type: ignore[operator]
                    else:
                        code = None
                        del entries[eid]
                        del where[eid]
                        if entries:
                            digests[b] = digests[b] - _ONE ^ _h3(eid, old << 1 | BLOCK)
                        else:
                            del by_bucket[b]
                            del digests[b]
                    eids.append(eid)
                    shards.append(shard)
                    buckets.append(b)
                    codes.append(code)
                continue
            tier_bit = TIER_BIT[tier]
            prev = None if parent is None else (
                (parent & _U64).to_bytes(8, "big") if type(parent) is int else hash_key(parent))
            for h in hashes:
                part = (h & _U64).to_bytes(8, "big") if type(h) is int else hash_key(h)
                eid = ctag + part
                b = where.get(eid)
                if b is not None:  # known: its tiers change, its segment stays
                    entries = by_bucket[b]
                    _, shard, old = entries[eid]
                    code = (tier_bit if exact else old >> NBYTES_BITS | tier_bit) << NBYTES_BITS | old & _NBYTES_MAX
                    prev = part
                    if code == old:
                        continue
                    entries[eid] = (BLOCK, shard, code)
                    digests[b] ^= _h3(eid, old << 1 | BLOCK) ^ _h3(eid, code << 1 | BLOCK)
                else:
                    shard = b""
                    if prev is not None:
                        pe = ctag + prev
                        pb = where.get(pe)
                        if pb is None:
                            unanchored += 1
                        else:
                            _, pshard, pcode = by_bucket[pb][pe]
                            pos = (pcode & _NBYTES_MAX) + 1  # a block's code carries its place in its segment
                            if pos < group_blocks:
                                shard, b, code = pshard, pb, tier_bit << NBYTES_BITS | pos
                    prev = part
                    if not shard:
                        shard = b"B" + eid  # block_shard(ctag, part): it starts a segment
                        b = bucket_of(shard)
                        code = tier_bit << NBYTES_BITS
                    entries = by_bucket.get(b)
                    if entries is None:
                        entries = by_bucket[b] = {}
                    entries[eid] = (BLOCK, shard, code)
                    where[eid] = b
                    digests[b] = digests.get(b, 0) + _ONE ^ _h3(eid, code << 1 | BLOCK)
                eids.append(eid)
                shards.append(shard)
                buckets.append(b)
                codes.append(code)
        return Changes(BLOCK, eids, shards, buckets, codes), unanchored

    def in_bucket(self, bucket: int) -> list[Entry]:
        return [Entry(e[0], eid, e[1], e[2], *e[3:]) for eid, e in self.buckets.get(bucket, {}).items()]

    def digest(self, bucket: int) -> Digest:
        v = self.digests.get(bucket)
        return Digest(0, 0) if v is None else Digest(v >> 64, v & _XOR)

    def clear(self) -> list[int]:
        """Forget everything; the buckets that had entries."""
        had = list(self.buckets)
        self.buckets.clear()
        self.where.clear()
        self.digests.clear()
        return had
