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
hashes) so anti-entropy compares a whole bucket in one number.
`OwnedEntries` is an owner's store: every holder's entries for the buckets it
owns, with the same digests per (holder, bucket).

Pure data structures, no I/O.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import xxhash

from quilld.index.residency import hash_key
from quilld.model import CacheTier

KEY, BLOCK = 0, 1
CTAG_LEN = 8
TIERS = tuple(CacheTier)
TIER_BIT = {t: 1 << i for i, t in enumerate(TIERS)} | {t.value: 1 << i for i, t in enumerate(TIERS)}
_NBYTES_BITS = 40
_NBYTES_MAX = (1 << _NBYTES_BITS) - 1
_HOLDER_SHIFT = 48  # an owner's stored value: holder number above the code
_CODE_MASK = (1 << _HOLDER_SHIFT) - 1
_h3 = xxhash.xxh3_64_intdigest
_U64 = (1 << 64) - 1  # an int block hash as 8 bytes, as `hash_key` makes it (inline: once per block)
DROP = False  # a `HeldEntries.change_blocks` op's parent when it removes blocks (a parent is None, int or bytes)


def scope_digest(tenant: str, model: str, tokenizer: str, adapter: str) -> bytes:
    """The cluster-wide 8-byte name of an identity scope."""
    return xxhash.xxh64_digest("\0".join((tenant, model, tokenizer, adapter)).encode())


def code_of(tiers: int, nbytes: int) -> int:
    """An entry's payload as one int: tier bits above the byte count."""
    return tiers << _NBYTES_BITS | min(nbytes, _NBYTES_MAX)


def tiers_of(code: int) -> int:
    return code >> _NBYTES_BITS


def nbytes_of(code: int) -> int:
    return code & _NBYTES_MAX


def tier_names(tiers: int) -> list[CacheTier]:
    return [t for i, t in enumerate(TIERS) if tiers >> i & 1]


def key_shard(eid: bytes) -> bytes:
    return b"K" + eid


def block_shard(ctag: bytes, group: bytes) -> bytes:
    return b"B" + ctag + group


def entry_hash(kind: int, eid: bytes, code: int) -> int:
    """What one entry adds to its bucket's digest (XOR): the same on its holder and its owners.
    The kind and code are the hash's seed, so nothing is concatenated (the placement loops below
    compute it inline, the same way)."""
    return _h3(eid, code << 1 | kind)


class Digest(NamedTuple):
    count: int
    xor: int


class Entry(NamedTuple):
    """One entry as it travels: kind, eid, shard, code (tiers and bytes)."""

    kind: int
    eid: bytes
    shard: bytes
    code: int


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
        self.buckets: dict[int, dict[bytes, tuple[int, bytes, int]]] = {}  # bucket -> eid -> (kind, shard, code)
        self.where: dict[bytes, int] = {}  # eid -> its bucket
        self.digests: dict[int, list[int]] = {}  # bucket -> [count, xor]

    def __len__(self) -> int:
        return len(self.where)

    def put(self, kind: int, eid: bytes, shard: bytes, bucket: int, code: int) -> bool:
        """Record (or change) an entry; False when it is already exactly so."""
        old_bucket = self.where.get(eid)
        if old_bucket is not None:
            old = self.buckets[old_bucket][eid]
            if old[2] == code and old_bucket == bucket:
                return False
            self._drop(old_bucket, eid, old)
        entries = self.buckets.get(bucket)
        if entries is None:
            entries = self.buckets[bucket] = {}
            self.digests[bucket] = [0, 0]
        entries[eid] = (kind, shard, code)
        self.where[eid] = bucket
        d = self.digests[bucket]
        d[0] += 1
        d[1] ^= entry_hash(kind, eid, code)
        return True

    def remove(self, eid: bytes) -> tuple[int, bytes, int, int] | None:
        """Forget an entry; (kind, shard, code, bucket) it had, or None."""
        bucket = self.where.pop(eid, None)
        if bucket is None:
            return None
        old = self.buckets[bucket][eid]
        self._drop(bucket, eid, old, forget=False)
        return old[0], old[1], old[2], bucket

    def get(self, eid: bytes) -> tuple[int, bytes, int] | None:
        bucket = self.where.get(eid)
        return None if bucket is None else self.buckets[bucket][eid]

    def _drop(self, bucket: int, eid: bytes, old: tuple[int, bytes, int], forget: bool = True) -> None:
        entries = self.buckets[bucket]
        del entries[eid]
        if forget:
            del self.where[eid]
        d = self.digests[bucket]
        d[0] -= 1
        d[1] ^= entry_hash(old[0], eid, old[2])
        if not entries:
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
                    tiers = 0 if tier_bit is None else old >> _NBYTES_BITS & ~tier_bit
                    d = digests[b]
                    if tiers:
                        code: int | None = tiers << _NBYTES_BITS | old & _NBYTES_MAX
                        if code == old:
                            continue
                        entries[eid] = (BLOCK, shard, code)
                        d[1] ^= _h3(eid, old << 1 | BLOCK) ^ _h3(eid, code << 1 | BLOCK)  # type: ignore[operator]
                    else:
                        code = None
                        del entries[eid]
                        del where[eid]
                        d[0] -= 1
                        d[1] ^= _h3(eid, old << 1 | BLOCK)
                        if not entries:
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
                    code = (tier_bit if exact else old >> _NBYTES_BITS | tier_bit) << _NBYTES_BITS | old & _NBYTES_MAX
                    prev = part
                    if code == old:
                        continue
                    entries[eid] = (BLOCK, shard, code)
                    digests[b][1] ^= _h3(eid, old << 1 | BLOCK) ^ _h3(eid, code << 1 | BLOCK)
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
                                shard, b, code = pshard, pb, tier_bit << _NBYTES_BITS | pos
                    prev = part
                    if not shard:
                        shard = b"B" + eid  # block_shard(ctag, part): it starts a segment
                        b = bucket_of(shard)
                        code = tier_bit << _NBYTES_BITS
                    entries = by_bucket.get(b)
                    if entries is None:
                        entries = by_bucket[b] = {}
                        d = digests[b] = [0, 0]
                    else:
                        d = digests[b]
                    entries[eid] = (BLOCK, shard, code)
                    where[eid] = b
                    d[0] += 1
                    d[1] ^= _h3(eid, code << 1 | BLOCK)
                eids.append(eid)
                shards.append(shard)
                buckets.append(b)
                codes.append(code)
        return Changes(BLOCK, eids, shards, buckets, codes), unanchored

    def in_bucket(self, bucket: int) -> list[Entry]:
        return [Entry(k, eid, shard, code) for eid, (k, shard, code) in self.buckets.get(bucket, {}).items()]

    def digest(self, bucket: int) -> Digest:
        d = self.digests.get(bucket)
        return Digest(0, 0) if d is None else Digest(d[0], d[1])

    def clear(self) -> list[int]:
        """Forget everything; the buckets that had entries."""
        had = list(self.buckets)
        self.buckets.clear()
        self.where.clear()
        self.digests.clear()
        return had


class _Run:
    """One holder's blocks of one segment, packed: their 8-byte hashes back to back and a 16-bit
    code each (tier bits above the position). A segment holds at most `group_blocks` blocks, so
    a lookup scans a few hundred bytes; an entry costs its hash and two bytes, instead of a dict
    slot, a bytes object and an int. Hashes of any other length (raw hashes: vLLM without int
    block hashes) are kept in a small dict beside them."""

    __slots__ = ("parts", "codes", "other")

    def __init__(self) -> None:
        self.parts = bytearray()
        self.codes = array("H")
        self.other: dict[bytes, int] | None = None

    def find(self, part: bytes) -> int:
        parts = self.parts
        i = parts.find(part)
        while i >= 0 and i & 7:
            i = parts.find(part, i + 1)
        return -1 if i < 0 else i >> 3

    def get(self, part: bytes) -> int | None:
        """The short code of `part`, or None."""
        if len(part) != 8:
            return None if self.other is None else self.other.get(part)
        i = self.find(part)
        return None if i < 0 else self.codes[i]

    def set(self, part: bytes, short: int) -> int | None:
        """Record `part`; its short code before, or None."""
        if len(part) != 8:
            if self.other is None:
                self.other = {}
            old = self.other.get(part)
            self.other[part] = short
            return old
        i = self.find(part)
        if i < 0:
            self.parts += part
            self.codes.append(short)
            return None
        old = self.codes[i]
        self.codes[i] = short
        return old

    def pop(self, part: bytes) -> int | None:
        if len(part) != 8:
            return None if self.other is None else self.other.pop(part, None)
        i = self.find(part)
        if i < 0:
            return None
        old = self.codes[i]
        del self.parts[i * 8:(i + 1) * 8]
        del self.codes[i]
        return old

    def items(self) -> Iterator[tuple[bytes, int]]:
        parts = self.parts
        for i, c in enumerate(self.codes):
            yield bytes(parts[i * 8:(i + 1) * 8]), c
        if self.other:
            yield from list(self.other.items())

    def __len__(self) -> int:
        return len(self.codes) + (len(self.other) if self.other else 0)


def _short(code: int) -> int:
    """A block's code in 16 bits: tiers (5) above its position in its segment (8)."""
    return tiers_of(code) << 8 | nbytes_of(code) & 0xFF


def _long(short: int) -> int:
    return code_of(short >> 8, short & 0xFF)


class OwnedEntries:
    """Every holder's entries for the buckets this node owns (the owner side).

    Per bucket: keys (eid -> value, a value being one int, holder number above the code, when
    one holder has the key, or a tuple of them) and block segments (shard -> holder number ->
    `_Run`). Holders are numbered locally.
    """

    def __init__(self) -> None:
        self.keys: dict[int, dict[bytes, int | tuple]] = {}
        self.segs: dict[int, dict[bytes, dict[int, _Run]]] = {}
        self.digests: dict[int, dict[int, list[int]]] = {}  # bucket -> holder no -> [count, xor]
        self.buckets_of: dict[int, set[int]] = {}  # holder no -> buckets it has entries in
        self.holders: list[str] = []
        self.holder_no: dict[str, int] = {}
        self.entries = 0  # (entry, holder) pairs held

    def _no(self, holder: str) -> int:
        no = self.holder_no.get(holder)
        if no is None:
            no = self.holder_no[holder] = len(self.holders)
            self.holders.append(holder)
        return no

    # -- updates ---------------------------------------------------------------------
    def put(self, holder: str, kind: int, eid: bytes, shard: bytes, bucket: int, code: int) -> None:
        no = self._no(holder)
        old = self._put_key(no, bucket, eid, code) if kind == KEY else self._put_block(no, bucket, eid, shard, code)
        if old == code:
            return
        digest = self._digest(bucket, no)
        if old is not None:
            digest[0] -= 1
            digest[1] ^= entry_hash(kind, eid, old)
        else:
            self.entries += 1
        digest[0] += 1
        digest[1] ^= entry_hash(kind, eid, code)

    def _put_key(self, no: int, bucket: int, eid: bytes, code: int) -> int | None:
        d = self.keys.get(bucket)
        if d is None:
            d = self.keys[bucket] = {}
        new = no << _HOLDER_SHIFT | code
        value = d.get(eid)
        if value is None:
            d[eid] = new
            return None
        if value.__class__ is int:
            if value >> _HOLDER_SHIFT == no:
                d[eid] = new
                return value & _CODE_MASK
            d[eid] = (value, new)
            return None
        mine = [v for v in value if v >> _HOLDER_SHIFT == no]
        d[eid] = (*(v for v in value if v >> _HOLDER_SHIFT != no), new)
        return mine[0] & _CODE_MASK if mine else None

    def _put_block(self, no: int, bucket: int, eid: bytes, shard: bytes, code: int) -> int | None:
        segs = self.segs.get(bucket)
        if segs is None:
            segs = self.segs[bucket] = {}
        runs = segs.get(shard)
        if runs is None:
            runs = segs[shard] = {}
        run = runs.get(no)
        if run is None:
            run = runs[no] = _Run()
        old = run.set(eid[CTAG_LEN:], _short(code))
        return None if old is None else _long(old)

    def apply(self, holder: str, kind: int, eids: list[bytes], shards: list[bytes], buckets: list[int],
              codes: list[int | None]) -> None:
        """A run of `holder`'s changes of one kind, in order (the columns of `Changes`): each entry
        put with its code, or removed when the code is None. Blocks in one loop, no call per entry
        but the segment's own search; keys entry by entry."""
        if kind != BLOCK:
            for eid, shard, b, code in zip(eids, shards, buckets, codes):
                if code is None:
                    self.remove(holder, kind, eid, shard, b)
                else:
                    self.put(holder, kind, eid, shard, b, code)
            return
        no = self._no(holder)
        all_segs, digests = self.segs, self.digests
        added = 0
        for eid, shard, b, code in zip(eids, shards, buckets, codes):
            segs = all_segs.get(b)
            if code is None:
                runs = segs.get(shard) if segs is not None else None
                run = runs.get(no) if runs is not None else None
                short = run.pop(eid[CTAG_LEN:]) if run is not None else None
                if short is None:
                    continue
                if not run:
                    del runs[no]  # type: ignore[union-attr]
                    if not runs:
                        del segs[shard]  # type: ignore[union-attr]
                        if not segs:
                            del all_segs[b]
                d = digests[b][no]
                d[0] -= 1
                d[1] ^= _h3(eid, (short >> 8 << _NBYTES_BITS | short & 0xFF) << 1 | BLOCK)
                added -= 1
                if not d[0]:
                    self._forget_digest(b, no)
                continue
            if segs is None:
                segs = all_segs[b] = {}
            runs = segs.get(shard)
            if runs is None:
                runs = segs[shard] = {}
            run = runs.get(no)
            if run is None:
                run = runs[no] = _Run()
            short = run.set(eid[CTAG_LEN:], code >> _NBYTES_BITS << 8 | code & 0xFF)
            per = digests.get(b)
            d = per.get(no) if per is not None else None
            if d is None:
                d = self._digest(b, no)
            if short is None:
                added += 1
            else:
                old = short >> 8 << _NBYTES_BITS | short & 0xFF
                if old == code:
                    continue
                d[0] -= 1
                d[1] ^= _h3(eid, old << 1 | BLOCK)
            d[0] += 1
            d[1] ^= _h3(eid, code << 1 | BLOCK)
        self.entries += added

    def remove(self, holder: str, kind: int, eid: bytes, shard: bytes, bucket: int) -> bool:
        no = self.holder_no.get(holder)
        if no is None:
            return False
        old = self._remove_key(no, bucket, eid) if kind == KEY else self._remove_block(no, bucket, eid, shard)
        if old is None:
            return False
        digest = self._digest(bucket, no)
        digest[0] -= 1
        digest[1] ^= entry_hash(kind, eid, old)
        self.entries -= 1
        if not digest[0]:
            self._forget_digest(bucket, no)
        return True

    def _remove_key(self, no: int, bucket: int, eid: bytes) -> int | None:
        d = self.keys.get(bucket)
        value = d.get(eid) if d is not None else None
        if value is None:
            return None
        if value.__class__ is int:
            if value >> _HOLDER_SHIFT != no:
                return None
            del d[eid]
            if not d:
                del self.keys[bucket]
            return value & _CODE_MASK
        mine = [v for v in value if v >> _HOLDER_SHIFT == no]
        if not mine:
            return None
        rest = tuple(v for v in value if v >> _HOLDER_SHIFT != no)
        d[eid] = rest[0] if len(rest) == 1 else rest
        return mine[0] & _CODE_MASK

    def _remove_block(self, no: int, bucket: int, eid: bytes, shard: bytes) -> int | None:
        segs = self.segs.get(bucket)
        runs = segs.get(shard) if segs is not None else None
        run = runs.get(no) if runs is not None else None
        old = run.pop(eid[CTAG_LEN:]) if run is not None else None
        if old is None:
            return None
        if not run:
            del runs[no]
            if not runs:
                del segs[shard]
                if not segs:
                    del self.segs[bucket]
        return _long(old)

    def _digest(self, bucket: int, no: int) -> list[int]:
        per = self.digests.get(bucket)
        if per is None:
            per = self.digests[bucket] = {}
        d = per.get(no)
        if d is None:
            d = per[no] = [0, 0]
            self.buckets_of.setdefault(no, set()).add(bucket)
        return d

    def _forget_digest(self, bucket: int, no: int) -> None:
        per = self.digests.get(bucket)
        if per is not None and per.pop(no, None) is not None:
            self._unlist(no, bucket)
            if not per:
                del self.digests[bucket]

    def _unlist(self, no: int, bucket: int) -> None:
        got = self.buckets_of.get(no)
        if got is not None:
            got.discard(bucket)
            if not got:
                del self.buckets_of[no]

    def holder_buckets(self, holder: str) -> set[int]:
        """The buckets `holder` has entries in here."""
        no = self.holder_no.get(holder)
        return self.buckets_of.get(no, set()) if no is not None else set()

    def replace(self, holder: str, bucket: int, entries: Iterable[Entry]) -> None:
        """`holder`'s entries in `bucket` are exactly `entries` from now on."""
        self.drop_holder_in(holder, bucket)
        for e in entries:
            self.put(holder, e.kind, e.eid, e.shard, bucket, e.code)

    def drop_holder_in(self, holder: str, bucket: int) -> int:
        no = self.holder_no.get(holder)
        if no is None or no not in self.digests.get(bucket, {}):
            return 0
        n = self.digests[bucket][no][0]
        d = self.keys.get(bucket)
        if d is not None:
            for eid, value in list(d.items()):
                if value.__class__ is int:
                    if value >> _HOLDER_SHIFT == no:
                        del d[eid]
                elif any(v >> _HOLDER_SHIFT == no for v in value):
                    rest = tuple(v for v in value if v >> _HOLDER_SHIFT != no)
                    d[eid] = rest[0] if len(rest) == 1 else rest
            if not d:
                del self.keys[bucket]
        segs = self.segs.get(bucket)
        if segs is not None:
            for shard in [sh for sh, runs in segs.items() if no in runs]:
                runs = segs[shard]
                del runs[no]
                if not runs:
                    del segs[shard]
            if not segs:
                del self.segs[bucket]
        self._forget_digest(bucket, no)
        self.entries -= n
        return n

    def drop_holders(self, holders: set[str]) -> int:
        """Forget every entry of these holders (dead nodes), in every bucket."""
        dropped = 0
        for h in holders:
            for bucket in list(self.holder_buckets(h)):
                dropped += self.drop_holder_in(h, bucket)
        return dropped

    def drop_bucket(self, bucket: int) -> int:
        per = self.digests.pop(bucket, {})
        for no in per:
            self._unlist(no, bucket)
        n = sum(d[0] for d in per.values())
        self.keys.pop(bucket, None)
        self.segs.pop(bucket, None)
        self.entries -= n
        return n

    # -- reads ---------------------------------------------------------------------
    def _decode(self, value: int | tuple) -> list[tuple[str, int]]:
        holders = self.holders
        if value.__class__ is int:
            return [(holders[value >> _HOLDER_SHIFT], value & _CODE_MASK)]
        return [(holders[v >> _HOLDER_SHIFT], v & _CODE_MASK) for v in value]

    def key_holders(self, bucket: int, eid: bytes) -> list[tuple[str, int]]:
        """(holder, code) of each holder of a key."""
        d = self.keys.get(bucket)
        value = d.get(eid) if d is not None else None
        return [] if value is None else self._decode(value)

    def segment(self, bucket: int, shard: bytes, parts: list[bytes]) -> list[list[tuple[str, int]]]:
        """(holder, code) of each block of one segment, for each hash part asked."""
        segs = self.segs.get(bucket)
        runs = segs.get(shard) if segs is not None else None
        out: list[list[tuple[str, int]]] = [[] for _ in parts]
        if runs is None:
            return out
        holders = self.holders
        for no, run in runs.items():
            name = holders[no]
            for j, p in enumerate(parts):
                c = run.get(p)
                if c is not None:
                    out[j].append((name, _long(c)))
        return out

    def digest(self, holder: str, bucket: int) -> Digest:
        no = self.holder_no.get(holder)
        d = self.digests.get(bucket, {}).get(no) if no is not None else None
        return Digest(0, 0) if d is None else Digest(d[0], d[1])

    def holders_in(self, bucket: int) -> list[str]:
        return [self.holders[no] for no in self.digests.get(bucket, {})]

    def _bucket_entries(self, bucket: int, only: int | None = None) -> Iterator[tuple[str, int, bytes, bytes, int]]:
        """(holder, kind, eid, shard, code) of every entry in `bucket` (of holder number `only`)."""
        for eid, value in list(self.keys.get(bucket, {}).items()):
            for holder, code in self._decode(value):
                if only is None or self.holder_no[holder] == only:
                    yield holder, KEY, eid, key_shard(eid), code
        for shard, runs in list(self.segs.get(bucket, {}).items()):
            ctag = shard[1:1 + CTAG_LEN]
            for no, run in list(runs.items()):
                if only is not None and no != only:
                    continue
                holder = self.holders[no]
                for part, c in run.items():
                    yield holder, BLOCK, ctag + part, shard, _long(c)

    def bucket_entries(self, bucket: int) -> list[tuple[str, Entry]]:
        return [(h, Entry(k, eid, shard, code)) for h, k, eid, shard, code in self._bucket_entries(bucket)]

    def entries_of(self, holder: str) -> list[tuple[int, Entry]]:
        """Every (bucket, entry) of `holder` (an engine moving home): a scan of its buckets."""
        no = self.holder_no.get(holder)
        if no is None:
            return []
        return [(bucket, Entry(k, eid, shard, code)) for bucket in self.holder_buckets(holder)
                for h, k, eid, shard, code in self._bucket_entries(bucket, no)]

    def buckets(self) -> set[int]:
        return set(self.digests)
