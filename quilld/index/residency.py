"""The residency index: (scope, block hash) -> every holder and tier that has the block.

A holder is this pool's node (tiers dram, ssd) or an engine (tiers hbm, cpu).
Each (holder, tier) pair is interned as a *slot*: slot = holder number *
TIER_SLOTS + tier number (the tiers are CacheTier's members, in order; a new
tier widens every holder's group of bits by one), and an entry is one int
whose bit `slot` is set when that holder has the block in that tier. Entries are kept
per scope tag, `{tag: {hash: mask}}`, so an entry costs one dict slot, its key (the
hash) and one small int, however many holders share it.

Block hashes arrive as 64-bit ints (vLLM's default; may be negative or above
2**63) or as raw bytes. An int is kept as its unsigned 64-bit value (two's
complement), and 8 raw bytes as the big-endian int they spell, so -1, 2**64 - 1
and b"\xff" * 8 are one block, as `hash_key` renders them; other raw hashes stay
bytes. An int key is looked up without building a key object: ROUTE's 32
lookups in a million-entry index cost the dict probes alone.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from functools import reduce
from itertools import repeat
from operator import or_

from quilld.model import CacheTier
from quilld.scopes import TAG_LEN, ScopeRegistry

TIERS = tuple(CacheTier)
TIER_SLOTS = len(TIERS)  # bits per holder
TIER_MASK = (1 << TIER_SLOTS) - 1  # one holder's bits, shifted down to bit 0
_TIER_NO = {t: i for i, t in enumerate(TIERS)} | {t.value: i for i, t in enumerate(TIERS)}
_U64 = (1 << 64) - 1
_PACK = struct.Struct(">Q").pack  # an int hash's bytes form, as hash_key() makes it

BlockHash = int | bytes
_NONE: dict = {}  # the entries of a scope that has none (shared, never changed)


def hash_key(block: BlockHash) -> bytes:
    """A block hash as bytes: 8 big-endian bytes for an int, raw bytes as they are."""
    if type(block) is int:
        return (block & _U64).to_bytes(8, "big")
    if isinstance(block, (bytes, bytearray)):
        return bytes(block)
    raise TypeError(f"a block hash is an int or bytes, not {type(block).__name__}")


def entry_key(block: BlockHash) -> int | bytes:
    """The key a block hash is kept under in its scope: an unsigned 64-bit int, or raw bytes
    of any length but 8."""
    if type(block) is int:
        return block & _U64
    if isinstance(block, (bytes, bytearray)):
        return int.from_bytes(block, "big") if len(block) == 8 else bytes(block)
    raise TypeError(f"a block hash is an int or bytes, not {type(block).__name__}")


def _stored(key: int | bytes) -> bytes:
    return _PACK(key) if key.__class__ is int else key


def entry_keys(blocks: list) -> list:
    """`entry_key` of each block; `blocks` itself when every one is already an unsigned 64-bit
    int (the common case, checked in C)."""
    try:
        if blocks and min(blocks) >= 0 and max(blocks) <= _U64:
            return blocks
    except TypeError:  # bytes among the ints
        pass
    return [entry_key(b) for b in blocks]


def _no_states() -> dict[str, dict]:
    return {}


class ResidencyIndex:
    """The in-memory backend, and the reference every backend is tested against (backend.py)."""

    backend = "memory"
    persistent = False

    def __init__(self, scopes: ScopeRegistry | None = None) -> None:
        """With `scopes`, the index holds each scope tag while it has entries under it."""
        self.scopes = scopes
        self.tag_entries: dict[bytes, int] = {}  # scope tag -> entries under it
        self._entries: dict[bytes, dict[int | bytes, int]] = {}  # scope tag -> entry key -> mask
        self._holders: list[str] = []  # holder number -> name
        self._holder_no: dict[str, int] = {}
        self._counts: list[int] = []  # slot -> number of blocks with that bit set
        # the router's scratch for this index (router._idle): built from holder numbers, which
        # are this index's own and never change
        self.router_memo: dict = {}
        # what the control plane persists of each engine beside its residencies (persistent backends)
        self.states: Callable[[], dict[str, dict]] = _no_states

    # -- holders ------------------------------------------------------------
    def _slot(self, holder: str, tier: CacheTier | str) -> int:
        no = self._holder_no.get(holder)
        if no is None:
            no = self._holder_no[holder] = len(self._holders)
            self._holders.append(holder)
            self._counts.extend((0,) * TIER_SLOTS)
            self._numbered(holder, no)
        try:
            return no * TIER_SLOTS + _TIER_NO[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r} (expected one of "
                             f"{', '.join(t.value for t in TIERS)})") from None

    def _numbered(self, holder: str, no: int) -> None:
        """A holder was given its number (a persistent backend records it)."""

    def holder_bits(self, holder: str) -> int:
        """The mask of `holder`'s slots, one per tier (0 when the holder is unknown)."""
        no = self._holder_no.get(holder)
        return 0 if no is None else TIER_MASK << (TIER_SLOTS * no)

    def holder_count(self) -> int:
        """How many holders have been numbered (numbers are never reused)."""
        return len(self._holders)

    def holder_no(self, holder: str) -> int | None:
        """`holder`'s number: its slots are TIER_SLOTS * number and up (None when unknown)."""
        return self._holder_no.get(holder)

    def slots(self, mask: int) -> list[tuple[str, CacheTier]]:
        """Decode an entry mask into (holder, tier) pairs."""
        out = []
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            no, tier = divmod(slot, TIER_SLOTS)
            out.append((self._holders[no], TIERS[tier]))
            mask ^= low
        return out

    # -- updates --------------------------------------------------------------
    def _scope(self, tag: bytes) -> dict[int | bytes, int]:
        entries = self._entries.get(tag)
        if entries is None:
            entries = self._entries[tag] = {}
        return entries

    def put(self, tag: bytes, block: BlockHash, holder: str, tier: CacheTier | str) -> bool:
        """Record that `holder` has the block in `tier`; False if it already did."""
        slot = self._slot(holder, tier)
        key = entry_key(block)
        entries = self._scope(tag)
        mask = entries.get(key, 0)
        bit = 1 << slot
        if mask & bit:
            return False
        entries[key] = mask | bit
        self._counts[slot] += 1
        if not mask:
            self._entry_added(tag)
        return True

    def put_many(self, tag: bytes, blocks: Iterable[BlockHash], holder: str, tier: CacheTier | str) -> int:
        """`put` for several blocks of one holder and tier (one event's); returns how many were new."""
        slot = self._slot(holder, tier)
        bit, entries, added, new = 1 << slot, self._scope(tag), 0, 0
        get = entries.get
        try:
            for block in blocks:
                key = block & _U64 if block.__class__ is int else entry_key(block)
                mask = get(key, 0)
                if mask & bit:
                    continue
                entries[key] = mask | bit
                added += 1
                if not mask:
                    new += 1
        finally:  # a bad hash midway: what went in before it is counted
            self._counts[slot] += added
            if new:
                self._entries_added(tag, new)
            elif not entries:
                del self._entries[tag]
        return added

    def remove_many(self, tag: bytes, blocks: Iterable[BlockHash], holder: str, tier: CacheTier | str) -> int:
        """`remove` for several blocks of one holder and tier; returns how many were recorded."""
        if holder not in self._holder_no:
            return 0
        slot = self._slot(holder, tier)
        entries = self._entries.get(tag)
        if entries is None:
            for block in blocks:
                entry_key(block)  # a bad hash is refused whether or not the scope has entries
            return 0
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

    def _entry_added(self, tag: bytes) -> None:
        self._entries_added(tag, 1)

    def _entries_added(self, tag: bytes, n: int) -> None:
        had = self.tag_entries.get(tag, 0)
        self.tag_entries[tag] = had + n
        if not had and self.scopes is not None:
            self.scopes.hold(tag)

    def _entry_gone(self, tag: bytes) -> None:
        self._entries_gone(tag, 1)

    def _entries_gone(self, tag: bytes, n: int) -> None:
        left = self.tag_entries[tag] - n
        if left:
            self.tag_entries[tag] = left
        else:
            del self.tag_entries[tag]
            del self._entries[tag]
            if self.scopes is not None:
                self.scopes.drop(tag)

    def remove(self, tag: bytes, block: BlockHash, holder: str, tier: CacheTier | str) -> bool:
        """Forget one residency; False if it was not recorded."""
        if holder not in self._holder_no:
            return False
        slot = self._slot(holder, tier)
        key = entry_key(block)
        entries = self._entries.get(tag)
        mask = entries.get(key, 0) if entries is not None else 0
        bit = 1 << slot
        if not mask & bit:
            return False
        mask ^= bit
        if mask:
            entries[key] = mask
        else:
            del entries[key]
            self._entry_gone(tag)
        self._counts[slot] -= 1
        return True

    def clear_holder(self, holder: str, tier: CacheTier | str | None = None) -> int:
        """Drop every residency of `holder` (in one tier, or all); returns how many went.

        A full scan: used when an engine clears its cache or a member dies.
        """
        if holder not in self._holder_no:
            return 0
        bits = (1 << self._slot(holder, tier)) if tier is not None else self.holder_bits(holder)
        keep = ~bits
        dropped = 0
        changes_of = self._changes_of(holder)
        for tag, entries in list(self._entries.items()):
            gone = 0
            changes = None
            for key, mask in list(entries.items()):
                if mask & bits:
                    dropped += (mask & bits).bit_count()
                    mask &= keep
                    if changes_of is not None:
                        if changes is None:
                            changes = changes_of(tag)
                        changes[key] = mask
                    if mask:
                        entries[key] = mask
                    else:
                        del entries[key]
                        gone += 1
            if gone:
                self._entries_gone(tag, gone)
        base = self._holder_no[holder] * TIER_SLOTS
        for slot in range(base, base + TIER_SLOTS):
            if bits >> slot & 1:
                self._counts[slot] = 0
        return dropped

    def _changes_of(self, holder: str) -> Callable[[bytes], dict] | None:
        """Where `clear_holder` records each entry it changes: None here; a persistent backend
        returns, for a holder it keeps, scope tag -> its dict of changed keys (key -> new mask)."""
        return None

    def holder_entries(self, holder: str) -> list[tuple[bytes, bytes, int]]:
        """Every (scope tag, hash key, tier number) `holder` has: a full scan, for rare hand-overs.

        The hash key is `hash_key`'s bytes form."""
        no = self._holder_no.get(holder)
        if no is None:
            return []
        shift = TIER_SLOTS * no
        out = []
        for tag, entries in self._entries.items():
            for key, mask in entries.items():
                own = (mask >> shift) & TIER_MASK
                while own:
                    low = own & -own
                    out.append((tag, _stored(key), low.bit_length() - 1))
                    own ^= low
        return out

    # -- queries --------------------------------------------------------------
    def masks(self, tag: bytes, blocks: list[BlockHash]) -> list[int]:
        """The entry mask of each block, in order (0 where nobody holds it)."""
        entries = self._entries.get(tag)
        if entries is None:
            return [0] * len(blocks)
        return list(map(entries.get, entry_keys(blocks), repeat(0)))

    def leading_masks(self, tag: bytes, blocks: list[BlockHash]) -> list[int]:
        """The masks of the leading blocks up to the first one nobody holds in this scope (left out,
        with every block after it).

        A reusable prefix is contiguous from the first block, so nothing after that gap can
        credit anyone: ROUTE looks up no further (each lookup in a large index is a few cache
        misses, most of ROUTE's time)."""
        entries = self._entries.get(tag)
        if entries is None:
            return []
        get, out = entries.get, []
        add = out.append
        for block in blocks:  # looked up as given first: an unsigned int is its own key
            mask = get(block)
            if mask is None:
                mask = get(entry_key(block))  # a signed int or 8 raw bytes is kept under another key
                if mask is None:
                    break
            add(mask)
        return out

    def entries(self, tag: bytes) -> dict[int | bytes, int]:
        """The scope's entries, entry key -> mask (read them, never change them); empty when none."""
        return self._entries.get(tag, _NONE)

    def has(self, key: bytes) -> bool:
        """Whether a stored key (scope tag + `hash_key` bytes) has any residency."""
        entries = self._entries.get(key[:TAG_LEN])
        return entries is not None and entry_key(key[TAG_LEN:]) in entries

    def held_elsewhere(self, tag: bytes, block: BlockHash) -> list[bytes]:
        """Every scope tag other than `tag` with a residency of `block` (the guard counts the
        closest of them: scopes.refused).

        Looks only at scopes that have entries (engines' and pools' scopes), never at
        every scope clients have named.
        """
        key = entry_key(block)
        return [other for other, entries in self._entries.items() if other != tag and key in entries]

    def locate(self, tag: bytes, blocks: Iterable[BlockHash]) -> list[list[tuple[str, CacheTier]]]:
        """For each block, every (holder, tier) that has it."""
        return [self.slots(m) for m in self.masks(tag, list(blocks))]

    def prefix_lengths(self, tag: bytes, blocks: list[BlockHash]) -> dict[str, int]:
        """For every holder with at least the first block: how many leading blocks it holds
        consecutively, in any of its tiers."""
        lowest = 0  # the lowest bit of every holder's group
        for no in range(len(self._holders)):
            lowest |= 1 << (TIER_SLOTS * no)
        running = -1
        lengths: dict[str, int] = {}
        prev = 0
        for i, mask in enumerate(self.masks(tag, blocks)):
            folded = mask
            for t in range(1, TIER_SLOTS):
                folded |= mask >> t
            present = folded & lowest  # a holder's lowest bit: it has the block in some tier
            now = (running & present) if i else present
            for slot in self._bits(prev & ~now):
                lengths[self._holders[slot // TIER_SLOTS]] = i
            running, prev = now, now
            if not now:
                break
        else:
            for slot in self._bits(prev):
                lengths[self._holders[slot // TIER_SLOTS]] = len(blocks)
        return lengths

    @staticmethod
    def _bits(mask: int) -> Iterable[int]:
        while mask > 0:
            low = mask & -mask
            yield low.bit_length() - 1
            mask ^= low

    # -- sizes ----------------------------------------------------------------
    def __len__(self) -> int:
        """Number of (scope, block) entries."""
        return sum(self.tag_entries.values())

    def count(self, holder: str, tier: CacheTier | str) -> int:
        """How many blocks `holder` has in `tier`."""
        if holder not in self._holder_no:
            return 0
        return self._counts[self._slot(holder, tier)]

    def holders(self) -> list[str]:
        return list(self._holders)

    def holder_tags(self) -> dict[str, set[bytes]]:
        """Each holder -> the scope tags under which it has any residency (one pass, in C mostly)."""
        out: dict[str, set[bytes]] = {}
        holders = self._holders
        for tag, entries in self._entries.items():
            for slot in self._bits(reduce(or_, entries.values(), 0)):
                out.setdefault(holders[slot // TIER_SLOTS], set()).add(tag)
        return out

    def snapshot(self) -> dict[tuple[bytes, bytes], list[tuple[str, CacheTier]]]:
        """Every entry: (scope tag, `hash_key` bytes) -> its (holder, tier) pairs, in slot order."""
        return {(tag, _stored(key)): self.slots(mask) for tag, entries in self._entries.items()
                for key, mask in entries.items()}

    # -- persistence: the memory backend keeps nothing, so these do nothing ---------------------
    def keep(self, holder: str) -> None:
        """Persist `holder`'s residencies from now on (an engine's: they outlive a restart)."""

    def release(self, holder: str) -> None:
        """Stop persisting `holder` (its residencies were cleared first)."""

    def retain(self, holders: Iterable[str]) -> int:
        """Forget every persisted holder not in `holders` (engines no longer configured); how many went."""
        return 0

    def groups_of(self, holder: str, kind: str) -> dict:
        """The KV-cache group holdings (groups.py) persisted for `holder`'s `kind` ("grouped" or "hybrid"),
        as the dict they keep them in; empty when none."""
        return {}

    def group_scope(self, holder: str, tag: bytes) -> dict:
        """A new table of `holder`'s hybrid group holdings under `tag`."""
        return {}

    def engine_state(self, holder: str) -> dict | None:
        """What the control plane persisted of engine `holder` (its event cursor, groups), if anything."""
        return None

    def committed_state(self, holder: str) -> dict | None:
        """What the last finished commit holds of engine `holder`; None when nothing is persisted."""
        return None

    def flush(self, force: bool = False) -> None:
        """Commit what changed since the last commit, when `index.commit_ms` has passed (or `force`)."""

    def close(self) -> None:
        """Commit what is left and close the store."""

    def describe(self) -> dict:
        """The backend's figures (INFO, the study)."""
        return {"backend": self.backend, "entries": len(self)}
