"""A residency index that outlives its process: the in-memory index, written through to LMDB or RocksDB.

**Reads stay in memory.** `PersistentIndex` is the in-memory `ResidencyIndex` (ROUTE's walk,
LOCATE and the counts read the very same dicts, at the very same cost) plus a journal of what
changed: every update of a *durable* holder (an engine: `keep`) marks the entry it changed.
Holders that are not durable (this node's own DRAM and SSD copies, which its SSD tier brings back
by itself, and peers' copies, which their logs resync) are never written at all.

**Writes are group commits, off the event loop.** Every `index.commit_ms` (housekeeping calls
`flush`) the marks are swapped for an empty set and handed to one writer thread (journal.py), which encodes
them and commits them as one transaction of the store (stores.py); while it writes, new marks
gather and coalesce (a block stored and evicted between two commits is never written). The
commit carries, beside the entries, what the control plane says of each engine (`states`): the
sequence number, payload digest and timestamp of the last KV-event batch applied in full, and its
KV-cache group bookkeeping. Both are taken at the same instant on the event loop, so a commit
always holds the entries of exactly the batches up to its sequence numbers (a big batch applied
in slices may be half in a commit: applying it again on top is harmless, its events set and
clear bits).

**What a kill -9 loses**: the marks not yet handed to a commit (at most `commit_ms` of changes)
and a commit in flight; never a part of a commit (the engines' own atomicity), and never the
agreement between entries and sequence numbers. The next start loads the last commit, answers
ROUTE from it at once, and the KV-event subscriber resumes from the persisted sequence number:
vLLM's replay buffer gives back what was lost, a publisher that restarted meanwhile is detected
(its batch under that number differs, or its sequence went back) and the engine's residencies are
dropped rather than routed on (subscriber.py).

**Records** (one keyspace, each record's kind its first byte):

    e + scope id (4) + entry key      -> entry mask, durable holders' bits only (big-endian)
    g + holder no (4) + scope id (4) + hash key + tier  -> GroupedHoldings' group mask (signed)
    h + holder no (4) + scope id (4) + entry key        -> HybridHoldings' tier-major group bits
    n + holder no (4)                 -> holder name
    s + scope id (4)                  -> scope (tenant, model, tokenizer, adapter) as JSON
    f + holder no (4)                 -> the engine's state (JSON: its event cursor, its groups)
    v                                 -> format version

An entry key is the int hash as 8 big-endian bytes, or raw hash bytes of any other length.
Scope tags are per process (scopes.py), so the scope itself is persisted, under a scope id of its
own; holder numbers are persisted with their names, so a mask's bits mean the same holders after
a restart. Loading a million entries is C loops over the store's cursor (stores.py) and dict
construction: see docs/benchmarks/index-study.md for the figures.
"""

from __future__ import annotations

import json
import logging
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable

from quilld.errors import ConfigError
from quilld.index.journal import ENTRY, Job, Journaled, Writer
from quilld.index.residency import _U64, TIER_SLOTS, TIERS, ResidencyIndex, entry_key
from quilld.index.stores import DamagedStore, Store
from quilld.model import IdentityScope
from quilld.scopes import TAG_LEN, ScopeRegistry

log = logging.getLogger(__name__)

FORMAT = b"1"
_ENTRY, _GROUPED, _HYBRID, _HOLDER, _SCOPE, _STATE, _VERSION = ENTRY, b"g", b"h", b"n", b"s", b"f", b"v"
_ID = 4  # bytes of a scope id and of a holder number in a record key
_INT_KEY = 1 + _ID + 8  # an entry record's key length when its hash is an int


def _no(n: int) -> bytes:
    return n.to_bytes(_ID, "big")


def _key_of(raw: bytes) -> int | bytes:
    return int.from_bytes(raw, "big") if len(raw) == 8 else raw


class PersistentIndex(ResidencyIndex):
    persistent = True

    def __init__(self, scopes: ScopeRegistry, store: Store, commit_ms: int = 100) -> None:
        if scopes is None:
            raise ValueError("a persistent index needs the scope registry: it persists scopes, not their tags")
        super().__init__(scopes)
        self.backend = store.name
        self.store = store
        self.commit_s = commit_ms / 1000
        self._durable: set[str] = set()
        self._durable_bits = 0
        self._sid_of: dict[bytes, bytes] = {}  # scope tag -> scope id (tags are never reused: kept)
        self._sids: dict[IdentityScope, bytes] = {}
        self._next_sid = 0
        self._marks: dict[bytes, dict] = {}  # scope tag -> entry key -> mask when it changed (0: gone)
        self._meta: dict[bytes, bytes | None] = {}  # other records to write (None: delete)
        self._group_logs: dict[tuple, dict] = {}  # (holder, kind[, tag]) -> row key -> value (None: gone)
        self._restored_groups: dict[tuple[str, str], dict] = {}
        self._restored_states: dict[str, dict] = {}
        self._written_states: dict[str, bytes] = {}
        self._writer = Writer(store)
        self._last_commit = time.monotonic()
        self._closed = False
        self._failure_logged = False
        self.loaded = {"entries": 0, "seconds": 0.0}
        try:
            self._load()
        except (ValueError, TypeError, KeyError, IndexError) as e:  # a record that does not decode
            raise DamagedStore(f"a record does not decode: {e!r}") from None

    # -- loading ------------------------------------------------------------------------------
    def _load(self) -> None:
        t0 = time.perf_counter()
        st = self.store
        version = st.get(_VERSION)
        if version is None:
            self._meta[_VERSION] = FORMAT
        elif version != FORMAT:
            raise ConfigError(f"index.path {str(st.path)!r} holds index format {version!r}, this quilld writes "
                              f"{FORMAT!r}: move it away (the engines' residencies come back from their events)")
        keys, values = st.scan(_HOLDER)
        names = {int.from_bytes(k[1:], "big"): v.decode() for k, v in zip(keys, values)}
        for no in range(max(names, default=-1) + 1):  # numbers are given in order: no gaps but a lost tail
            holder = names.get(no, f"?{no}")
            self._holder_no[holder] = no
            self._holders.append(holder)
            self._counts.extend((0,) * TIER_SLOTS)
        keys, values = st.scan(_SCOPE)
        tags = {}
        for k, v in zip(keys, values):
            sid = k[1:]
            scope = IdentityScope(*json.loads(v))
            tag = self.scopes.tag(scope)
            self._sids[scope] = self._sid_of[tag] = sid
            tags[sid] = tag
            self._next_sid = max(self._next_sid, int.from_bytes(sid, "big") + 1)
        durable = self._load_entries(tags)
        for prefix, kind in ((_GROUPED, "grouped"), (_HYBRID, "hybrid")):
            keys, values = st.scan(prefix)
            for k, v in zip(keys, values):
                holder = self._holders[int.from_bytes(k[1:1 + _ID], "big")]
                tag = tags.get(k[1 + _ID:1 + 2 * _ID])
                if tag is None:
                    continue
                value = int.from_bytes(v, "big", signed=True)
                if kind == "grouped":  # as it was: nothing to write again
                    dict.__setitem__(self._restored(holder, kind), tag + k[1 + 2 * _ID:], value)
                else:
                    table = self._restored(holder, kind)
                    inner = table.get(tag)
                    if inner is None:
                        inner = table[tag] = self.group_scope(holder, tag)
                    dict.__setitem__(inner, _key_of(k[1 + 2 * _ID:]), value)
                durable.add(holder)
        keys, values = st.scan(_STATE)
        for k, v in zip(keys, values):
            holder = self._holders[int.from_bytes(k[1:], "big")]
            self._restored_states[holder] = json.loads(v)
            self._written_states[holder] = v
            durable.add(holder)
        for holder in durable:
            self._durable.add(holder)
            self._durable_bits |= self.holder_bits(holder)
        self.loaded = {"entries": len(self), "seconds": time.perf_counter() - t0}

    def _load_entries(self, tags: dict[bytes, bytes]) -> set[str]:
        """The entry records into the mirror, scope by scope; returns the holders that have any."""
        keys, values = self.store.scan(_ENTRY)
        present = 0  # every mask ORed: the holders with entries
        lo, n = 0, len(keys)
        while lo < n:
            sid = keys[lo][1:1 + _ID]
            hi = bisect_left(keys, _ENTRY + _no(int.from_bytes(sid, "big") + 1), lo)
            tag = tags.get(sid)
            if tag is not None:
                ks, vs = keys[lo:hi], values[lo:hi]
                if set(map(len, ks)) == {_INT_KEY}:  # every hash an int: the key's low 64 bits, in C
                    entries = dict(zip(map(_U64.__and__, map(int.from_bytes, ks)), map(int.from_bytes, vs)))
                else:
                    entries = {_key_of(k[1 + _ID:]): int.from_bytes(v, "big") for k, v in zip(ks, vs)}
                self._entries[tag] = entries
                self._entries_added(tag, len(entries))
                counts = self._counts
                for raw, times in Counter(vs).items():  # few distinct masks: count each one's bits once
                    mask = int.from_bytes(raw, "big")
                    present |= mask
                    while mask:
                        low = mask & -mask
                        counts[low.bit_length() - 1] += times
                        mask ^= low
            lo = hi
        out = set()
        for no, holder in enumerate(self._holders):
            if present >> (no * TIER_SLOTS) & ((1 << TIER_SLOTS) - 1):
                out.add(holder)
        return out

    def _restored(self, holder: str, kind: str) -> dict:
        table = self._restored_groups.get((holder, kind))
        if table is None:
            if kind == "grouped":
                table = Journaled(self._group_log((holder, kind)))
            else:
                table = {}
            self._restored_groups[(holder, kind)] = table
        return table

    # -- scope ids, holder numbers ------------------------------------------------------------
    def _sid(self, tag: bytes) -> bytes:
        sid = self._sid_of.get(tag)
        if sid is None:
            scope = self.scopes.scope_of(tag)
            sid = self._sids.get(scope)
            if sid is None:
                sid = self._sids[scope] = _no(self._next_sid)
                self._next_sid += 1
                self._meta[_SCOPE + sid] = json.dumps(list(scope)).encode()
            self._sid_of[tag] = sid
        return sid

    def _numbered(self, holder: str, no: int) -> None:
        self._meta[_HOLDER + _no(no)] = holder.encode()

    def _number(self, holder: str) -> int:
        no = self._holder_no.get(holder)
        if no is None:
            self._slot(holder, TIERS[0])
            no = self._holder_no[holder]
        return no

    def _mark(self, tag: bytes) -> dict:
        marks = self._marks.get(tag)
        if marks is None:
            self._sid(tag)
            marks = self._marks[tag] = {}
        return marks

    # -- updates: the in-memory index's, marking what a durable holder changed ---------------------
    def put(self, tag, block, holder, tier) -> bool:
        if not ResidencyIndex.put(self, tag, block, holder, tier):
            return False
        if holder in self._durable:
            key = entry_key(block)
            self._mark(tag)[key] = self._entries[tag][key]
        return True

    def remove(self, tag, block, holder, tier) -> bool:
        if not ResidencyIndex.remove(self, tag, block, holder, tier):
            return False
        if holder in self._durable:
            key = entry_key(block)
            entries = self._entries.get(tag)
            self._mark(tag)[key] = 0 if entries is None else entries.get(key, 0)
        return True

    def put_many(self, tag, blocks: Iterable, holder, tier) -> int:
        if holder not in self._durable:
            return ResidencyIndex.put_many(self, tag, blocks, holder, tier)
        slot = self._slot(holder, tier)
        bit, entries, added, new = 1 << slot, self._scope(tag), 0, 0
        marks = self._mark(tag)
        get = entries.get
        try:
            for block in blocks:
                key = block & _U64 if block.__class__ is int else entry_key(block)
                mask = get(key, 0)
                if mask & bit:
                    continue
                entries[key] = marks[key] = mask | bit
                added += 1
                if not mask:
                    new += 1
        finally:
            self._counts[slot] += added
            if new:
                self._entries_added(tag, new)
            elif not entries:
                del self._entries[tag]
        return added

    def remove_many(self, tag, blocks: Iterable, holder, tier) -> int:
        if holder not in self._durable or tag not in self._entries:
            return ResidencyIndex.remove_many(self, tag, blocks, holder, tier)
        slot = self._slot(holder, tier)
        entries = self._entries[tag]
        marks = self._mark(tag)
        bit, removed, gone = 1 << slot, 0, 0
        get = entries.get
        try:
            for block in blocks:
                key = block & _U64 if block.__class__ is int else entry_key(block)
                mask = get(key, 0)
                if not mask & bit:
                    continue
                removed += 1
                mask ^= bit
                marks[key] = mask
                if mask:
                    entries[key] = mask
                else:
                    del entries[key]
                    gone += 1
        finally:
            self._counts[slot] -= removed
            if gone:
                self._entries_gone(tag, gone)
        return removed

    def _changes_of(self, holder: str):
        """clear_holder marks what it changes of a holder kept on disk (see ResidencyIndex)."""
        return self._mark if holder in self._durable else None

    # -- durable holders ----------------------------------------------------------------------
    def keep(self, holder: str) -> None:
        if holder in self._durable:
            return
        self._number(holder)
        self._durable.add(holder)
        self._durable_bits |= self.holder_bits(holder)
        for tag, hk, _ in self.holder_entries(holder):  # residencies it had before it was kept
            key = entry_key(hk)
            self._mark(tag)[key] = self._entries[tag][key]

    def release(self, holder: str) -> None:
        self._durable.discard(holder)
        self._durable_bits &= ~self.holder_bits(holder)

    def retain(self, holders: Iterable[str]) -> int:
        wanted = set(holders)
        gone = [h for h in self._durable if h not in wanted]
        for holder in gone:
            self.clear_holder(holder)
            for kind in ("grouped", "hybrid"):
                table = self._restored_groups.pop((holder, kind), None)
                if table is not None:
                    for t in (table.values() if kind == "hybrid" else (table,)):
                        t.clear()
            self._restored_states.pop(holder, None)
            self.release(holder)
        if gone:
            log.info("index: dropped the persisted residencies of %d holder(s) no longer configured: %s",
                     len(gone), ", ".join(sorted(gone)))
        return len(gone)

    def groups_of(self, holder: str, kind: str) -> dict:
        table = self._restored_groups.pop((holder, kind), None)
        if table is not None:
            return table
        return Journaled(self._group_log((holder, kind))) if kind == "grouped" else {}

    def group_scope(self, holder: str, tag: bytes) -> dict:
        self._sid(tag)
        return Journaled(self._group_log((holder, "hybrid", tag)))

    def _group_log(self, key: tuple) -> dict:
        log_ = self._group_logs.get(key)
        if log_ is None:
            log_ = self._group_logs[key] = {}
        return log_

    def engine_state(self, holder: str) -> dict | None:
        return self._restored_states.get(holder)

    def committed_state(self, holder: str) -> dict | None:
        committed = self._writer.committed_states or self._restored_states
        return committed.get(holder, {})

    # -- commits ------------------------------------------------------------------------------
    def flush(self, force: bool = False) -> None:
        if self._closed:
            return
        if self._writer.error is not None:
            if not self._failure_logged:
                self._failure_logged = True
                log.error("index: persistence to %s stopped after a failed commit (%s); ROUTE goes on from memory",
                          self.store.path, self._writer.error)
            return
        now = time.monotonic()
        if not force and (now - self._last_commit < self.commit_s or self._writer.busy()):
            return
        self._last_commit = now
        job = self._take()
        if job is not None:
            self._writer.submit(job)

    def _take(self) -> Job | None:
        """Swap the marks, group rows and records gathered since the last commit for empty ones."""
        marks, self._marks = self._marks, {}
        sid_of = self._sid_of
        entries = [(sid_of[tag], m) for tag, m in marks.items() if m]
        groups = []
        for key, rows in self._group_logs.items():
            if not rows:
                continue
            holder, kind = key[0], key[1]
            hno = _no(self._number(holder))
            if kind == "grouped":
                for tag in {k[:TAG_LEN] for k in rows}:
                    try:
                        self._sid(tag)
                    except KeyError:  # a scope released meanwhile: its rows cannot be named any more
                        pass
                groups.append((_GROUPED + hno, None, rows.copy()))
            else:
                groups.append((_HYBRID + hno, self._sid_of[key[2]], rows.copy()))
            rows.clear()
        current = self.states()
        for engine, state in current.items():
            raw = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
            if self._written_states.get(engine) != raw:
                self._meta[_STATE + _no(self._number(engine))] = raw
                self._written_states[engine] = raw
        for engine in [e for e in self._written_states if e not in current]:
            self._meta[_STATE + _no(self._holder_no[engine])] = None
            del self._written_states[engine]
        meta, self._meta = self._meta, {}
        if not entries and not groups and not meta:
            return None
        return Job(entries, self._durable_bits, dict(sid_of) if groups else {}, groups, meta, current)

    def close(self) -> None:
        if self._closed:
            return
        self.flush(force=True)
        self._closed = True
        self._writer.close()
        self.store.close()

    def describe(self) -> dict:
        w = self._writer
        return {"backend": self.backend, "path": str(self.store.path), "entries": len(self),
                "durable_holders": len(self._durable), "commits": w.commits, "committed_rows": w.rows,
                "committed_bytes": w.bytes, "commit_seconds": round(w.seconds, 6),
                "failed": None if w.error is None else str(w.error), "loaded_entries": self.loaded["entries"],
                "load_seconds": round(self.loaded["seconds"], 6)}
