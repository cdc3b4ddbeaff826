"""The cluster's engine table, sans-IO: every engine any node knows, merged last-writer-wins.

An engine enters the table from the config file (every node reads its own: `origin` ""),
from `POST /v1/engines` on some node (`origin`: that node) or from a peer's table. Each
entry carries a version `(unix ms, node, content hash)`: a registration or a removal on a
node writes a version above the one it replaces (its clock, or the old version's ms + 1
when the clock is behind), and a merge keeps, per engine, the entry with the highest
version, so every node that has seen the same writes holds the same table whatever the
order they came in. A config engine's version is `(0, "", hash)`: any write through the API
replaces it; two nodes whose config files say different things of one engine still agree
(the higher content hash wins) rather than pull from each other forever.

A removal (`DELETE /v1/engines/{id}` on any node) is a *tombstone*: an entry with no config,
kept `tombstone_s` after its write so that a node that has not heard of it yet cannot bring
the engine back; past that it is forgotten (and ignored when a slower peer still offers it).
A node cut off for longer than that may bring a removed engine back: the bound is the
price of a table that does not grow forever.

`summary()` is what nodes gossip: a short hash of (id, version) over the table (equal
digests, equal tables), the number of entries and the newest version's ms. A node pulls a
peer's `rows()` when the digests differ and the peer may have something it lacks
(`worth_pulling`: more entries, a newer write, or the same of both): a node that just joined,
with the config file's engines only, pulls the others' tables, and they do not pull its.
Whatever one lacks, the two converge: the side with less pulls first, then (with more
entries, or the same of both) the other pulls it back.

`home_of` is the home rule: the node that consumes an engine's KV events.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Collection, Iterable

import xxhash

from quilld.config import EngineConfig, engine_from
from quilld.errors import QuillError

TOMBSTONE_S = 600.0  # seconds a removal is remembered
Version = tuple[int, str, int]  # (unix ms, node that wrote it, hash of the config; 0 for a removal)


def config_hash(cfg: EngineConfig) -> int:
    return xxhash.xxh64_intdigest(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())


@dataclass(frozen=True)
class EngineEntry:
    engine_id: str
    config: EngineConfig | None  # None: removed (a tombstone)
    origin: str  # the node it was registered on through the API; "" for the config file's
    version: Version

    @property
    def removed(self) -> bool:
        return self.config is None

    def row(self) -> list:
        """The entry as it travels (msgpack): [id, origin, ms, node, hash, config or nil]."""
        ms, node, h = self.version
        return [self.engine_id, self.origin, ms, node, h,
                None if self.config is None else dataclasses.asdict(self.config)]


def entry_of(row: Any) -> EngineEntry:
    """A row a peer sent, checked (ValueError when it is not one)."""
    if not isinstance(row, (list, tuple)) or len(row) != 6:
        raise ValueError("an engine row is [id, origin, ms, node, hash, config]")
    engine_id, origin, ms, node, h, data = row
    if not (isinstance(engine_id, str) and engine_id and isinstance(origin, str) and isinstance(ms, int)
            and isinstance(node, str) and isinstance(h, int)):
        raise ValueError(f"malformed engine row for {engine_id!r}")
    config = None
    if data is not None:
        try:
            config = engine_from(data, f"engine {engine_id}")
        except QuillError as e:
            raise ValueError(e.message) from None
        if config.id != engine_id:
            raise ValueError(f"engine row {engine_id!r} carries the config of {config.id!r}")
    return EngineEntry(engine_id, config, origin, (ms, node, h))


class EngineTable:
    def __init__(self, configured: Iterable[EngineConfig] = (), tombstone_s: float = TOMBSTONE_S) -> None:
        self.tombstone_ms = int(tombstone_s * 1000)
        self.entries: dict[str, EngineEntry] = {
            e.id: EngineEntry(e.id, e, "", (0, "", config_hash(e))) for e in configured}
        self._digest: str | None = None
        self._summary: list | None = None

    def get(self, engine_id: str) -> EngineEntry | None:
        return self.entries.get(engine_id)

    def live(self) -> dict[str, EngineEntry]:
        """The engines not removed."""
        return {k: e for k, e in self.entries.items() if not e.removed}

    def _next(self, engine_id: str, node: str, now_ms: int, h: int) -> Version:
        old = self.entries.get(engine_id)
        ms = now_ms if old is None else max(now_ms, old.version[0] + 1)
        return (ms, node, h)

    def put(self, cfg: EngineConfig, node: str, now_ms: int) -> EngineEntry:
        """`node` registers (or replaces) `cfg` through its API now."""
        entry = EngineEntry(cfg.id, cfg, node, self._next(cfg.id, node, now_ms, config_hash(cfg)))
        self._set(entry)
        return entry

    def remove(self, engine_id: str, node: str, now_ms: int) -> EngineEntry | None:
        """`node` removes the engine now: its tombstone, or None when no such engine is known."""
        old = self.entries.get(engine_id)
        if old is None or old.removed:
            return None
        entry = EngineEntry(engine_id, None, old.origin, self._next(engine_id, node, now_ms, 0))
        self._set(entry)
        return entry

    def merge(self, rows: Iterable[Any], now_ms: int) -> tuple[list[tuple[EngineEntry | None, EngineEntry]], int]:
        """A peer's rows, last writer wins: ([(old entry or None, new entry)] for each engine that
        changed here, rows refused as malformed)."""
        changed, bad = [], 0
        for row in rows:
            try:
                entry = entry_of(row)
            except ValueError:
                bad += 1
                continue
            if entry.removed and entry.version[0] + self.tombstone_ms < now_ms:
                continue  # a removal forgotten here already (or about to be)
            old = self.entries.get(entry.engine_id)
            if old is None or entry.version > old.version:
                self._set(entry)
                changed.append((old, entry))
        return changed, bad

    def expire(self, now_ms: int) -> int:
        """Forget tombstones older than tombstone_s; how many."""
        old = [k for k, e in self.entries.items() if e.removed and e.version[0] + self.tombstone_ms < now_ms]
        for k in old:
            del self.entries[k]
        if old:
            self._digest = None
        return len(old)

    def _set(self, entry: EngineEntry) -> None:
        self.entries[entry.engine_id] = entry
        self._digest = None

    def rows(self) -> list[list]:
        return [e.row() for e in self.entries.values()]

    def digest(self) -> str:
        """16 hex digits over every (id, version, removed): what nodes gossip to tell they agree."""
        if self._digest is None:
            h = xxhash.xxh64()
            for k in sorted(self.entries):
                e = self.entries[k]
                h.update(repr((k, e.version, e.removed)).encode())
            self._digest = h.hexdigest()
        return self._digest

    def summary(self) -> list:
        """[digest, entries, newest write's ms]: what a node gossips of its table."""
        if self._summary is None or self._summary[0] != self.digest():
            newest = max((e.version[0] for e in self.entries.values()), default=0)
            self._summary = [self.digest(), len(self.entries), newest]
        return self._summary


def worth_pulling(mine: list, theirs: Any) -> bool:
    """Whether a peer whose table's summary is `theirs` may hold a write ours lacks."""
    if not (isinstance(theirs, list) and len(theirs) == 3 and isinstance(theirs[0], str)
            and isinstance(theirs[1], int) and isinstance(theirs[2], int)):
        return False
    if theirs[0] == mine[0]:
        return False
    return theirs[1] > mine[1] or theirs[2] > mine[2] or (theirs[1] == mine[1] and theirs[2] == mine[2])


def home_of(engine_id: str, origin: str, members: Collection[str]) -> str | None:
    """The node that consumes an engine's KV events: the node it was registered on while that
    node is a live member; otherwise (and for the config file's engines) the live member with
    the highest rendezvous hash of (engine, member). None with no member."""
    if origin and origin in members:
        return origin
    if not members:
        return None
    key = engine_id.encode() + b"\0"
    return max(members, key=lambda m: (xxhash.xxh64_intdigest(key + m.encode()), m))
