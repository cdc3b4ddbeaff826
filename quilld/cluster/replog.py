"""This node's residency changes as a sequence-numbered log that peers follow.

Each node is the authority for its own values. Every placement or removal of
a tracked value appends one entry; a follower asks for the entries after the
last sequence number it applied. The log keeps the newest `retain` entries;
a follower that fell further behind (or is new, or saw the log restart) loads
a snapshot of what is live now and follows on from the snapshot's sequence.

An epoch, random per process, names the log: after a restart the sequence
starts again from 0, and a follower holding the old epoch resyncs.

Pure bookkeeping, no I/O: the RESP command `REPLOG` serves it and
`follower.py` consumes it.
"""

from __future__ import annotations

import secrets
from collections import deque
from typing import Callable, Iterable, NamedTuple

from quilld.model import CacheTier, IdentityScope

PLACED = b"P"
REMOVED = b"R"
RETAIN = 200_000  # entries kept for followers that fall behind; older ones need a snapshot


class Entry(NamedTuple):
    seq: int
    op: bytes  # PLACED or REMOVED
    scope: IdentityScope
    key: bytes
    tier: str  # "dram" or "ssd" ("" for a removal)
    nbytes: int
    bhash: bytes  # the engine block hash in its stored 8-byte (or raw) form, b"" when none

    def wire(self) -> list:
        """The entry as a RESP array (see `from_wire`)."""
        s = self.scope
        return [self.seq, self.op, s.tenant.encode(), s.model.encode(), s.tokenizer.encode(),
                s.adapter.encode(), self.key, self.tier.encode(), self.nbytes, self.bhash]


def from_wire(item: list) -> Entry:
    """Parse one entry of a REPLOG reply; ValueError on anything malformed."""
    if not isinstance(item, list) or len(item) != 10:
        raise ValueError("a log entry is an array of 10 items")
    seq, op, tenant, model, tokenizer, adapter, key, tier, nbytes, bhash = item
    if not isinstance(seq, int) or op not in (PLACED, REMOVED) or not isinstance(nbytes, int):
        raise ValueError("bad log entry")
    tier_s = tier.decode()
    if op == PLACED and tier_s not in (CacheTier.DRAM.value, CacheTier.SSD.value):
        raise ValueError(f"bad tier {tier_s!r}")
    scope = IdentityScope(tenant.decode(), model.decode(), tokenizer.decode(), adapter.decode())
    return Entry(seq, op, scope, bytes(key), tier_s, nbytes, bytes(bhash))


def stored_hash(bhash: int | bytes | None) -> bytes:
    if bhash is None:
        return b""
    if type(bhash) is int:
        return (bhash & ((1 << 64) - 1)).to_bytes(8, "big")
    return bytes(bhash)


class Behind(Exception):
    """The follower's position is older than the log keeps (or names another epoch)."""


class ReplicationLog:
    def __init__(self, snapshot_source: Callable[[], Iterable[tuple]], retain: int = RETAIN) -> None:
        """`snapshot_source()` yields (scope, key, tier, nbytes, bhash) for every live value."""
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self.entries: deque[Entry] = deque(maxlen=retain)
        self._source = snapshot_source
        self.on_append: Callable[[], None] | None = None  # wakes long-polling followers
        self.snapshots = 0

    def placed(self, scope: IdentityScope, key: bytes, tier: CacheTier, nbytes: int,
               bhash: int | bytes | None) -> None:
        self._append(PLACED, scope, key, tier.value, nbytes, stored_hash(bhash))

    def removed(self, scope: IdentityScope, key: bytes, bhash: int | bytes | None) -> None:
        self._append(REMOVED, scope, key, "", 0, stored_hash(bhash))

    def _append(self, op: bytes, scope: IdentityScope, key: bytes, tier: str, nbytes: int, bhash: bytes) -> None:
        self.seq += 1
        self.entries.append(Entry(self.seq, op, scope, key, tier, nbytes, bhash))
        if self.on_append is not None:
            self.on_append()

    def since(self, epoch: str, after: int, limit: int) -> list[Entry]:
        """Entries with seq > `after`, oldest first, at most `limit`; Behind if they are gone."""
        if epoch != self.epoch or after > self.seq:
            raise Behind("unknown epoch or position")
        if after == self.seq:
            return []
        entries = self.entries
        first = entries[0].seq if entries else self.seq + 1
        if after + 1 < first:
            raise Behind(f"position {after} is older than the oldest kept entry {first}")
        start = after + 1 - first
        return [entries[i] for i in range(start, min(len(entries), start + limit))]

    def snapshot(self) -> tuple[int, list[Entry]]:
        """(sequence it is current at, every live value as a PLACED entry)."""
        self.snapshots += 1
        seq = self.seq
        return seq, [Entry(seq, PLACED, scope, key, tier.value, nbytes, stored_hash(bhash))
                     for scope, key, tier, nbytes, bhash in self._source()]
