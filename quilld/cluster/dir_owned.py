"""An owner's store of directory entries: every holder's entries for the buckets it owns.

Per bucket: keys (eid -> value, a value being one int, holder number above the code, when one
holder has the key, or a tuple of them) and block segments (shard -> runs). A segment's *run*
for one holder is its blocks packed in a `bytearray`, a record each: the 8-byte hash, then a
16-bit short code (tier bits above the block's position in its segment). A segment holds at most
`group_blocks` blocks, so a lookup scans a few hundred bytes, and an entry costs ten bytes
instead of a dict slot, a bytes object and an int. Hashes of any other length (raw hashes: vLLM
without int block hashes) are kept in a small dict beside the run, under the holder's number
inverted (`~no`). Holders are numbered locally.

Each (bucket, holder) has a digest, the count and XOR of its entry hashes (`entry_hash`), kept
as one int (count << 64 | xor), so anti-entropy compares a whole bucket in one number.

Nothing here is a container the cyclic garbage collector tracks, past one set per holder: runs
are bytearrays, digests ints, and a dict holding only those is left untracked by CPython. An
owner keeps hundreds of thousands of segments during ingest; were each an object (as it once
was), every full collection would walk them all while ROUTE waits.

Pure data structures, no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

import xxhash

from quilld.cluster.dir_entries import (BLOCK, CTAG_LEN, KEY, NBYTES_BITS, TOMBSTONE, Digest, Entry, entry_hash,
                                        key_shard)

_REC = 10  # a run's record: an 8-byte hash, its 16-bit short code (little-endian)
_ONE = 1 << 64  # a digest: the count above the XOR of entry hashes
_XOR = _ONE - 1
_HOLDER_SHIFT = 48  # a key's stored value: its version above the holder number above the code
_VERSION_SHIFT = 72
_NO_MASK = (1 << (_VERSION_SHIFT - _HOLDER_SHIFT)) - 1
_CODE_MASK = (1 << _HOLDER_SHIFT) - 1
_record = struct.Struct("<8sH").pack
_h3 = xxhash.xxh3_64_intdigest  # entry_hash, inline


def _code_version(value: int) -> int:
    """A stored key value's version and code, as one int (version << 48 | code)."""
    return value >> _VERSION_SHIFT << _HOLDER_SHIFT | value & _CODE_MASK


def _short(code: int) -> int:
    """A block's code in 16 bits: tiers (5) above its position in its segment (8)."""
    return code >> NBYTES_BITS << 8 | code & 0xFF


def _long(short: int) -> int:
    return short >> 8 << NBYTES_BITS | short & 0xFF


def _find(run: bytearray, part: bytes) -> int:
    """The offset of the record of `part` (8 bytes) in a run, or -1."""
    i = run.find(part)
    while i >= 0 and i % _REC:
        i = run.find(part, i + 1)
    return i


def run_items(run: bytearray | dict) -> Iterator[tuple[bytes, int]]:
    """(hash, short code) of each block of a run (or of its dict of other widths)."""
    if run.__class__ is dict:
        yield from list(run.items())  # type: ignore[union-attr]
        return
    for i in range(0, len(run), _REC):
        yield bytes(run[i:i + 8]), run[i + 8] | run[i + 9] << 8  # type: ignore[operator]


class OwnedEntries:
    """Every holder's entries for the buckets this node owns (the owner side)."""

    def __init__(self) -> None:
        self.keys: dict[int, dict[bytes, int | tuple]] = {}
        # bucket -> shard -> holder no -> packed run; ~no -> {hash: short code} (other widths)
        self.segs: dict[int, dict[bytes, dict[int, bytearray | dict[bytes, int]]]] = {}
        self.digests: dict[int, dict[int, int]] = {}  # bucket -> holder no -> count << 64 | xor
        self.buckets_of: dict[int, set[int]] = {}  # holder no -> buckets it has entries in
        self.holders: list[str] = []
        self.holder_no: dict[str, int] = {}
        self.entries = 0  # (entry, holder) pairs held
        # (holder, eid, newest version) of each key entry found older than its key's newest
        # version (another holder wrote or deleted it since): the directory tells the holder
        self.stale: list[tuple[str, bytes, int]] = []

    def _no(self, holder: str) -> int:
        no = self.holder_no.get(holder)
        if no is None:
            no = self.holder_no[holder] = len(self.holders)
            self.holders.append(holder)
        return no

    # -- updates ---------------------------------------------------------------------
    def put(self, holder: str, kind: int, eid: bytes, shard: bytes, bucket: int, code: int,
            version: int = 0) -> None:
        no = self._no(holder)
        if kind == KEY:
            new = version << _HOLDER_SHIFT | code  # a key's code and version, as _put_key compares them
            old = self._put_key(no, bucket, eid, code, version)
            if old != new:
                self._rehash(bucket, no, None if old is None else
                             entry_hash(KEY, eid, old & _CODE_MASK, old >> _HOLDER_SHIFT),
                             entry_hash(KEY, eid, code, version))
            return
        old = self._put_block(no, bucket, eid, shard, code)
        if old != code:
            self._rehash(bucket, no, None if old is None else entry_hash(kind, eid, old), entry_hash(kind, eid, code))

    def _rehash(self, bucket: int, no: int, old: int | None, new: int) -> None:
        """One holder's bucket summary after an entry's hash went from `old` (None: a new entry) to `new`."""
        per = self._per(bucket, no)
        v = per[no]
        if old is not None:
            v = v - _ONE ^ old
        else:
            self.entries += 1
        per[no] = v + _ONE ^ new

    def _put_key(self, no: int, bucket: int, eid: bytes, code: int, version: int) -> int | None:
        """Store holder `no`'s entry of a key; its old (version << 48 | code), or None. Holders of
        an older version than the key's newest (not deletes) are listed in `stale`."""
        d = self.keys.get(bucket)
        if d is None:
            d = self.keys[bucket] = {}
        new = version << _VERSION_SHIFT | no << _HOLDER_SHIFT | code
        value = d.get(eid)
        if value is None:
            d[eid] = new
            return None
        if value.__class__ is int:
            if value >> _HOLDER_SHIFT & _NO_MASK == no:  # type: ignore[operator]
                d[eid] = new
                return _code_version(value)  # type: ignore[arg-type]
            rest: tuple = (value,)
            mine = None
        else:
            rest = tuple(v for v in value if v >> _HOLDER_SHIFT & _NO_MASK != no)  # type: ignore[union-attr]
            mine = next((v for v in value if v >> _HOLDER_SHIFT & _NO_MASK == no), None)  # type: ignore[union-attr]
        d[eid] = all_of = (*rest, new)
        top = max(v >> _VERSION_SHIFT for v in all_of)
        for v in all_of:
            if v >> _VERSION_SHIFT < top and v & _CODE_MASK != TOMBSTONE:
                self.stale.append((self.holders[v >> _HOLDER_SHIFT & _NO_MASK], eid, top))
        return None if mine is None else _code_version(mine)

    def _put_block(self, no: int, bucket: int, eid: bytes, shard: bytes, code: int) -> int | None:
        segs = self.segs.get(bucket)
        if segs is None:
            segs = self.segs[bucket] = {}
        runs = segs.get(shard)
        if runs is None:
            runs = segs[shard] = {}
        part, short = eid[CTAG_LEN:], _short(code)
        if len(part) != 8:
            other = runs.get(~no)
            if other is None:
                other = runs[~no] = {}
            old = other.get(part)  # type: ignore[union-attr]
            other[part] = short  # type: ignore[index]
            return None if old is None else _long(old)
        run = runs.get(no)
        if run is None:
            runs[no] = bytearray(_record(part, short))
            return None
        i = _find(run, part)  # type: ignore[arg-type]
        if i < 0:
            run += _record(part, short)  # type: ignore[operator]
            return None
        old = run[i + 8] | run[i + 9] << 8  # type: ignore[index]
        run[i + 8], run[i + 9] = short & 0xFF, short >> 8  # type: ignore[index]
        return _long(old)

    def _change(self, holder: str, kind: int, eid: bytes, shard: bytes, b: int, code: int | None) -> None:
        """One change entry by entry: put with its code, or removed when the code is None (blocks:
        keys, which have versions, travel as PUT items)."""
        if code is None:
            self.remove(holder, kind, eid, shard, b)
        else:
            self.put(holder, kind, eid, shard, b, code)

    def apply(self, holder: str, kind: int, eids: list[bytes], shards: list[bytes], buckets: list[int],
              codes: list[int | None]) -> None:
        """A run of `holder`'s changes of one kind, in order (the columns of `dir_entries.Changes`):
        each entry put with its code, or removed when the code is None. Blocks of 8-byte hashes in
        one loop, with no call per entry; keys and other blocks entry by entry."""
        if kind != BLOCK:
            for eid, shard, b, code in zip(eids, shards, buckets, codes):
                self._change(holder, kind, eid, shard, b, code)
            return
        no = self._no(holder)
        all_segs, digests = self.segs, self.digests
        added = 0
        for eid, shard, b, code in zip(eids, shards, buckets, codes):
            part = eid[CTAG_LEN:]
            if len(part) != 8:
                self._change(holder, BLOCK, eid, shard, b, code)
                continue
            segs = all_segs.get(b)
            if code is None:
                runs = segs.get(shard) if segs is not None else None
                run = runs.get(no) if runs is not None else None
                i = -1 if run is None else _find(run, part)  # type: ignore[arg-type]
                if i < 0:
                    continue
                short = run[i + 8] | run[i + 9] << 8  # type: ignore[index]
                del run[i:i + _REC]  # type: ignore[union-attr]
                if not run:
                    del runs[no]  # type: ignore[union-attr]
                    if not runs:
                        del segs[shard]  # type: ignore[union-attr]
                        if not segs:
                            del all_segs[b]
                per = digests[b]
                v = per[no] - _ONE ^ _h3(eid, _long(short) << 1 | BLOCK)
                added -= 1
                if v >> 64:
                    per[no] = v
                else:
                    self._forget_digest(b, no)
                continue
            if segs is None:
                segs = all_segs[b] = {}
            runs = segs.get(shard)
            if runs is None:
                runs = segs[shard] = {}
            short = code >> NBYTES_BITS << 8 | code & 0xFF
            run = runs.get(no)
            per = digests.get(b)
            if per is None or no not in per:
                per = self._per(b, no)
            if run is None:
                runs[no] = bytearray(_record(part, short))
                i = -1
            else:
                i = _find(run, part)  # type: ignore[arg-type]
                if i < 0:
                    run += _record(part, short)  # type: ignore[operator]
            if i < 0:
                added += 1
                per[no] = per[no] + _ONE ^ _h3(eid, code << 1 | BLOCK)
                continue
            old = _long(run[i + 8] | run[i + 9] << 8)  # type: ignore[index]
            if old == code:
                continue
            run[i + 8], run[i + 9] = short & 0xFF, short >> 8  # type: ignore[index]
            per[no] ^= _h3(eid, old << 1 | BLOCK) ^ _h3(eid, code << 1 | BLOCK)
        self.entries += added

    def remove(self, holder: str, kind: int, eid: bytes, shard: bytes, bucket: int) -> bool:
        no = self.holder_no.get(holder)
        if no is None:
            return False
        old = self._remove_key(no, bucket, eid) if kind == KEY else self._remove_block(no, bucket, eid, shard)
        if old is None:
            return False
        per = self.digests[bucket]
        v = per[no] - _ONE ^ (entry_hash(KEY, eid, old & _CODE_MASK, old >> _HOLDER_SHIFT) if kind == KEY else
                              entry_hash(kind, eid, old))
        self.entries -= 1
        if v >> 64:
            per[no] = v
        else:
            self._forget_digest(bucket, no)
        return True

    def _remove_key(self, no: int, bucket: int, eid: bytes) -> int | None:
        """Forget holder `no`'s entry of a key; its (version << 48 | code), or None."""
        d = self.keys.get(bucket)
        value = d.get(eid) if d is not None else None
        if value is None:
            return None
        if value.__class__ is int:
            if value >> _HOLDER_SHIFT & _NO_MASK != no:  # type: ignore[operator]
                return None
            del d[eid]  # type: ignore[union-attr]
            if not d:
                del self.keys[bucket]
            return _code_version(value)  # type: ignore[arg-type]
        mine = [v for v in value if v >> _HOLDER_SHIFT & _NO_MASK == no]  # type: ignore[union-attr]
        if not mine:
            return None
        rest = tuple(v for v in value if v >> _HOLDER_SHIFT & _NO_MASK != no)  # type: ignore[union-attr]
        d[eid] = rest[0] if len(rest) == 1 else rest  # type: ignore[index]
        return _code_version(mine[0])

    def _remove_block(self, no: int, bucket: int, eid: bytes, shard: bytes) -> int | None:
        segs = self.segs.get(bucket)
        runs = segs.get(shard) if segs is not None else None
        if runs is None:
            return None
        part = eid[CTAG_LEN:]
        key = no if len(part) == 8 else ~no
        run = runs.get(key)
        if run is None:
            return None
        if key < 0:
            short = run.pop(part, None)  # type: ignore[union-attr]
            if short is None:
                return None
        else:
            i = _find(run, part)  # type: ignore[arg-type]
            if i < 0:
                return None
            short = run[i + 8] | run[i + 9] << 8  # type: ignore[index]
            del run[i:i + _REC]  # type: ignore[union-attr]
        if not run:
            del runs[key]
            if not runs:
                del segs[shard]  # type: ignore[union-attr]
                if not segs:
                    del self.segs[bucket]
        return _long(short)

    def _per(self, bucket: int, no: int) -> dict[int, int]:
        """The bucket's digests, with one for `no` (0 when new, and the bucket listed as its)."""
        per = self.digests.get(bucket)
        if per is None:
            per = self.digests[bucket] = {}
        if no not in per:
            per[no] = 0
            self.buckets_of.setdefault(no, set()).add(bucket)
        return per

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
            self.put(holder, e.kind, e.eid, e.shard, bucket, e.code, e.version)

    def drop_holder_in(self, holder: str, bucket: int) -> int:
        no = self.holder_no.get(holder)
        if no is None or no not in self.digests.get(bucket, {}):
            return 0
        n = self.digests[bucket][no] >> 64
        d = self.keys.get(bucket)
        if d is not None:
            for eid, value in list(d.items()):
                if value.__class__ is int:
                    if value >> _HOLDER_SHIFT & _NO_MASK == no:  # type: ignore[operator]
                        del d[eid]
                elif any(v >> _HOLDER_SHIFT & _NO_MASK == no for v in value):  # type: ignore[union-attr]
                    rest = tuple(v for v in value if v >> _HOLDER_SHIFT & _NO_MASK != no)  # type: ignore[union-attr]
                    d[eid] = rest[0] if len(rest) == 1 else rest
            if not d:
                del self.keys[bucket]
        segs = self.segs.get(bucket)
        if segs is not None:
            for shard in [sh for sh, runs in segs.items() if no in runs or ~no in runs]:
                runs = segs[shard]
                runs.pop(no, None)
                runs.pop(~no, None)
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
        n = sum(v >> 64 for v in per.values())
        self.keys.pop(bucket, None)
        self.segs.pop(bucket, None)
        self.entries -= n
        return n

    # -- reads ---------------------------------------------------------------------
    def _decode(self, value: int | tuple) -> list[tuple[str, int, int]]:
        holders = self.holders
        if value.__class__ is int:
            return [(holders[value >> _HOLDER_SHIFT & _NO_MASK], value & _CODE_MASK,  # type: ignore[operator]
                     value >> _VERSION_SHIFT)]  # type: ignore[operator]
        return [(holders[v >> _HOLDER_SHIFT & _NO_MASK], v & _CODE_MASK, v >> _VERSION_SHIFT)
                for v in value]  # type: ignore[union-attr]

    def key_holders(self, bucket: int, eid: bytes) -> list[tuple[str, int, int]]:
        """(holder, code, version) of each holder of a key, deletes (code TOMBSTONE) among them:
        the asker keeps the newest (`dir_lookup.newest`)."""
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
        for key, run in runs.items():
            if key < 0:
                name = holders[~key]
                for j, p in enumerate(parts):
                    c = run.get(p)  # type: ignore[union-attr]
                    if c is not None:
                        out[j].append((name, _long(c)))
                continue
            name = holders[key]
            for j, p in enumerate(parts):
                if len(p) == 8:
                    i = _find(run, p)  # type: ignore[arg-type]
                    if i >= 0:
                        out[j].append((name, _long(run[i + 8] | run[i + 9] << 8)))  # type: ignore[index]
        return out

    def digest(self, holder: str, bucket: int) -> Digest:
        no = self.holder_no.get(holder)
        v = self.digests.get(bucket, {}).get(no) if no is not None else None
        return Digest(0, 0) if v is None else Digest(v >> 64, v & _XOR)

    def holders_in(self, bucket: int) -> list[str]:
        return [self.holders[no] for no in self.digests.get(bucket, {})]

    def _bucket_entries(self, bucket: int, only: int | None = None) -> Iterator[tuple]:
        """(holder, kind, eid, shard, code), a key's version after them, of every entry in
        `bucket` (of holder number `only`)."""
        for eid, value in list(self.keys.get(bucket, {}).items()):
            for holder, code, version in self._decode(value):
                if only is None or self.holder_no[holder] == only:
                    yield holder, KEY, eid, key_shard(eid), code, version
        for shard, runs in list(self.segs.get(bucket, {}).items()):
            ctag = shard[1:1 + CTAG_LEN]
            for key, run in list(runs.items()):
                no = key if key >= 0 else ~key
                if only is not None and no != only:
                    continue
                holder = self.holders[no]
                for part, c in run_items(run):
                    yield holder, BLOCK, ctag + part, shard, _long(c)

    def bucket_entries(self, bucket: int) -> list[tuple[str, Entry]]:
        return [(e[0], Entry(*e[1:])) for e in self._bucket_entries(bucket)]

    def entries_of(self, holder: str) -> list[tuple[int, Entry]]:
        """Every (bucket, entry) of `holder` (an engine moving home): a scan of its buckets."""
        no = self.holder_no.get(holder)
        if no is None:
            return []
        return [(bucket, Entry(*e[1:])) for bucket in self.holder_buckets(holder)
                for e in self._bucket_entries(bucket, no)]

    def buckets(self) -> set[int]:
        return set(self.digests)
