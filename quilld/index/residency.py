"""The residency index: (scope, block hash) -> every holder and tier that has the block.

A holder is this pool's node (tiers dram, ssd) or an engine (tiers hbm, cpu).
Each (holder, tier) pair is interned as a *slot*: slot = holder number *
TIER_SLOTS + tier number (the tiers are CacheTier's members, in order; a new
tier widens every holder's group of bits by one), and an entry is one int
whose bit `slot` is set when that holder has the block in that tier. So an entry costs one dict slot, its key (scope
tag + 8-byte or raw hash) and one small int, however many holders share it.

Block hashes arrive as 64-bit ints (vLLM's default; may be negative or above
2**63) or as raw bytes; ints are stored as 8 bytes, two's complement.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from quilld.model import CacheTier
from quilld.scopes import TAG_LEN, ScopeRegistry

TIERS = tuple(CacheTier)
TIER_SLOTS = len(TIERS)  # bits per holder
TIER_MASK = (1 << TIER_SLOTS) - 1  # one holder's bits, shifted down to bit 0
_TIER_NO = {t: i for i, t in enumerate(TIERS)} | {t.value: i for i, t in enumerate(TIERS)}
_U64 = (1 << 64) - 1
_PACK = struct.Struct(">Q").pack  # an int hash's stored form, as hash_key() makes it

BlockHash = int | bytes


def hash_key(block: BlockHash) -> bytes:
    """The stored form of a block hash."""
    if type(block) is int:
        return (block & _U64).to_bytes(8, "big")
    if isinstance(block, (bytes, bytearray)):
        return bytes(block)
    raise TypeError(f"a block hash is an int or bytes, not {type(block).__name__}")


class ResidencyIndex:
    def __init__(self, scopes: ScopeRegistry | None = None) -> None:
        """With `scopes`, the index holds each scope tag while it has entries under it."""
        self.scopes = scopes
        self.tag_entries: dict[bytes, int] = {}  # scope tag -> entries under it
        self._entries: dict[bytes, int] = {}
        self._holders: list[str] = []  # holder number -> name
        self._holder_no: dict[str, int] = {}
        self._counts: list[int] = []  # slot -> number of blocks with that bit set

    # -- holders ------------------------------------------------------------
    def _slot(self, holder: str, tier: CacheTier | str) -> int:
        no = self._holder_no.get(holder)
        if no is None:
            no = self._holder_no[holder] = len(self._holders)
            self._holders.append(holder)
            self._counts.extend((0,) * TIER_SLOTS)
        try:
            return no * TIER_SLOTS + _TIER_NO[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r} (expected one of "
                             f"{', '.join(t.value for t in TIERS)})") from None

    def holder_bits(self, holder: str) -> int:
        """The mask of `holder`'s slots, one per tier (0 when the holder is unknown)."""
        no = self._holder_no.get(holder)
        return 0 if no is None else TIER_MASK << (TIER_SLOTS * no)

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
    def put(self, tag: bytes, block: BlockHash, holder: str, tier: CacheTier | str) -> bool:
        """Record that `holder` has the block in `tier`; False if it already did."""
        slot = self._slot(holder, tier)
        key = tag + hash_key(block)
        mask = self._entries.get(key, 0)
        bit = 1 << slot
        if mask & bit:
            return False
        self._entries[key] = mask | bit
        self._counts[slot] += 1
        if not mask:
            self._entry_added(tag)
        return True

    def put_many(self, tag: bytes, blocks: Iterable[BlockHash], holder: str, tier: CacheTier | str) -> int:
        """`put` for several blocks of one holder and tier (one event's); returns how many were new."""
        slot = self._slot(holder, tier)
        bit, entries, pack, added = 1 << slot, self._entries, _PACK, 0
        get = entries.get
        for block in blocks:
            key = tag + (pack(block & _U64) if block.__class__ is int else hash_key(block))
            mask = get(key, 0)
            if mask & bit:
                continue
            entries[key] = mask | bit
            added += 1
            if not mask:
                self._entry_added(tag)
        self._counts[slot] += added
        return added

    def remove_many(self, tag: bytes, blocks: Iterable[BlockHash], holder: str, tier: CacheTier | str) -> int:
        """`remove` for several blocks of one holder and tier; returns how many were recorded."""
        if holder not in self._holder_no:
            return 0
        slot = self._slot(holder, tier)
        bit, entries, pack, removed = 1 << slot, self._entries, _PACK, 0
        get = entries.get
        for block in blocks:
            key = tag + (pack(block & _U64) if block.__class__ is int else hash_key(block))
            mask = get(key, 0)
            if not mask & bit:
                continue
            removed += 1
            mask ^= bit
            if mask:
                entries[key] = mask
            else:
                del entries[key]
                self._entry_gone(tag)
        self._counts[slot] -= removed
        return removed

    def _entry_added(self, tag: bytes) -> None:
        n = self.tag_entries.get(tag, 0)
        self.tag_entries[tag] = n + 1
        if not n and self.scopes is not None:
            self.scopes.hold(tag)

    def _entry_gone(self, tag: bytes) -> None:
        n = self.tag_entries[tag] - 1
        if n:
            self.tag_entries[tag] = n
        else:
            del self.tag_entries[tag]
            if self.scopes is not None:
                self.scopes.drop(tag)

    def remove(self, tag: bytes, block: BlockHash, holder: str, tier: CacheTier | str) -> bool:
        """Forget one residency; False if it was not recorded."""
        if holder not in self._holder_no:
            return False
        slot = self._slot(holder, tier)
        key = tag + hash_key(block)
        mask = self._entries.get(key, 0)
        bit = 1 << slot
        if not mask & bit:
            return False
        mask ^= bit
        if mask:
            self._entries[key] = mask
        else:
            del self._entries[key]
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
        entries = self._entries
        for key, mask in list(entries.items()):
            if mask & bits:
                dropped += (mask & bits).bit_count()
                mask &= keep
                if mask:
                    entries[key] = mask
                else:
                    del entries[key]
                    self._entry_gone(key[:TAG_LEN])
        base = self._holder_no[holder] * TIER_SLOTS
        for slot in range(base, base + TIER_SLOTS):
            if bits >> slot & 1:
                self._counts[slot] = 0
        return dropped

    def holder_entries(self, holder: str) -> list[tuple[bytes, bytes, int]]:
        """Every (scope tag, hash key, tier number) `holder` has: a full scan, for rare hand-overs."""
        no = self._holder_no.get(holder)
        if no is None:
            return []
        shift = TIER_SLOTS * no
        out = []
        for key, mask in self._entries.items():
            own = (mask >> shift) & TIER_MASK
            while own:
                low = own & -own
                out.append((key[:TAG_LEN], key[TAG_LEN:], low.bit_length() - 1))
                own ^= low
        return out

    # -- queries --------------------------------------------------------------
    def masks(self, tag: bytes, blocks: Iterable[BlockHash]) -> list[int]:
        """The entry mask of each block, in order (0 where nobody holds it)."""
        get, pack = self._entries.get, _PACK
        return [get(tag + (pack(b & _U64) if b.__class__ is int else hash_key(b)), 0) for b in blocks]

    def has(self, key: bytes) -> bool:
        """Whether a stored key (scope tag + hash key) has any residency."""
        return key in self._entries

    def held_elsewhere(self, tag: bytes, block: BlockHash) -> bytes | None:
        """A scope tag other than `tag` with a residency of `block`, or None.

        Looks only at scopes that have entries (engines' and pools' scopes), never at
        every scope clients have named.
        """
        hk = hash_key(block)
        entries = self._entries
        for other in self.tag_entries:
            if other != tag and other + hk in entries:
                return other
        return None

    def locate(self, tag: bytes, blocks: Iterable[BlockHash]) -> list[list[tuple[str, CacheTier]]]:
        """For each block, every (holder, tier) that has it."""
        return [self.slots(m) for m in self.masks(tag, blocks)]

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
        return len(self._entries)

    def count(self, holder: str, tier: CacheTier | str) -> int:
        """How many blocks `holder` has in `tier`."""
        if holder not in self._holder_no:
            return 0
        return self._counts[self._slot(holder, tier)]

    def holders(self) -> list[str]:
        return list(self._holders)
