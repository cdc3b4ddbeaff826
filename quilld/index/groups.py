"""One engine's residencies per KV-cache group, and the rule that turns them into the index's.

A model that mixes attention kinds (full and sliding-window layers, or attention and
mamba) keeps one KV-cache group per kind, and vLLM's events name the group
(`group_idx`). The same block hash is stored in every group; a group may drop it while
another still holds it (a sliding-window group frees the blocks that left its window).

The reuse rule: **a block counts for ROUTE in a tier only while every KV-cache group the
engine has named holds it in that tier.** vLLM reuses a prefix of L blocks when every
full-attention group holds all L blocks and every sliding-window group holds the blocks
of its window before L; a prefix whose blocks every group holds is therefore always
reusable, so ROUTE never credits a block the engine would have to recompute. It may
under-credit: a prefix whose early blocks a sliding-window group has already dropped is
still reusable by vLLM when the window before its end is intact, and counts here only up
to the first dropped block. A block held in different tiers by different groups counts
in none of them. An event without `group_idx` (older vLLM, the offloading connector)
speaks for the block as a whole, every group at once.

Engines whose events only ever name group 0 (or none) never come here: their events go
straight to the index. This module takes over an engine when a second group appears,
carrying its residencies along, and costs one dict entry per (block, tier) held.
"""

from __future__ import annotations

from collections.abc import Iterable

from quilld.index.residency import TIERS, ResidencyIndex, hash_key
from quilld.scopes import TAG_LEN

EVERY_GROUP = -1  # the mask of an event without group_idx: every group, known or not
_TIER_NO = {t: i for i, t in enumerate(TIERS)}


class GroupedHoldings:
    """Which KV-cache groups of one engine hold each (block, tier), and the index entries that follow."""

    __slots__ = ("engine", "index", "known", "held")

    def __init__(self, engine: str, index: ResidencyIndex) -> None:
        self.engine = engine
        self.index = index
        self.known = 0  # bit g: the engine has named group g
        self.held: dict[bytes, int] = {}  # tag + hash key + tier number -> mask of groups holding it

    def complete(self, mask: int) -> bool:
        known = self.known
        return mask & known == known

    # -- taking over ------------------------------------------------------------
    def adopt(self, entries: Iterable[tuple[bytes, bytes, int]], whole_tiers: set) -> int:
        """Carry over what the index already records for the engine, as group 0's (or, for a tier
        whose events never named a group, the whole block's); returns how many."""
        n = 0
        for tag, hk, tier_no in entries:
            self.held[tag + hk + bytes((tier_no,))] = EVERY_GROUP if TIERS[tier_no] in whole_tiers else 1
            n += 1
        self.known |= 1
        return n

    def learn(self, group: int) -> bool:
        """Note that the engine has group `group`; a block it lacks stops counting. True if new."""
        bit = 1 << group
        if self.known & bit:
            return False
        before = self.known
        self.known |= bit
        for key, mask in list(self.held.items()):
            if not mask & bit and mask & before == before:
                self._unindex(key)
        return True

    # -- events -----------------------------------------------------------------
    def stored(self, tag: bytes, hashes: Iterable, tier, mask: int) -> None:
        held, known, tb = self.held, self.known, bytes((_TIER_NO[tier],))
        put, engine = self.index.put, self.engine
        for h in hashes:
            hk = hash_key(h)
            key = tag + hk + tb
            old = held.get(key, 0)
            new = old | mask
            if new == old:
                continue
            held[key] = new
            if new & known == known and old & known != known:
                put(tag, hk, engine, tier)

    def removed(self, tag: bytes, hashes: Iterable, tier, mask: int) -> None:
        held, known, tb = self.held, self.known, bytes((_TIER_NO[tier],))
        remove, engine = self.index.remove, self.engine
        for h in hashes:
            hk = hash_key(h)
            key = tag + hk + tb
            old = held.get(key)
            if old is None:
                continue
            new = old & ~mask
            if new & known:
                held[key] = new
            else:
                del held[key]
            if old & known == known and new & known != known:
                remove(tag, hk, engine, tier)

    def clear(self) -> None:
        """The engine cleared its cache (the caller clears its index entries)."""
        self.held.clear()

    def _unindex(self, key: bytes) -> None:
        self.index.remove(key[:TAG_LEN], key[TAG_LEN:-1], self.engine, TIERS[key[-1]])

    def __len__(self) -> int:
        return len(self.held)
