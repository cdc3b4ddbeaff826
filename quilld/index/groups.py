"""One engine's residencies per KV-cache group, and the rules that turn them into ROUTE's credit.

A model that mixes attention kinds (full and sliding-window layers, or attention and
mamba) keeps one KV-cache group per kind, and vLLM's events name the group
(`group_idx`). The same block hash is stored in every group; a group may drop it while
another still holds it (a sliding-window group frees the blocks that left its window, a
Mamba group keeps its state only at some blocks).

**Kinds declared** (`groups = [{kind = "full"}, {kind = "sliding_window", window_tokens =
4096}, {kind = "mamba"}]` in the engine's config, in vLLM's group order): a prefix is
credited as vLLM's hybrid KV-cache manager decides a hit
(`vllm/v1/core/kv_cache_coordinator.py`, `HybridKVCacheCoordinator.find_longest_cache_hit`,
and each kind's `find_longest_cache_hit` in `single_type_kv_cache_manager.py`, 0.33). A
prefix of L blocks is reusable when every group accepts it:

- full: the group holds blocks 0..L-1 (FullAttentionManager);
- sliding_window (W tokens, B tokens a block): the group holds the last
  c = max(1, ceil((W - 1) / B)) blocks before L, or all of 0..L-1 when L <= c
  (SlidingWindowManager's contiguous run);
- mamba: the group holds block L-1, its state at the prefix's end (MambaManager).

The hit is the longest L every group accepts: as vLLM, `longest_hit` lets the groups cut the
candidate length in turn, each to the longest it accepts, until none does. A group
"holds" a block when it has it in any of the engine's tiers, or when a pool node has the
block (a pool copy is the block as a whole). Each block of the hit is then credited by
where the groups that need it have it: the slowest of their best tiers (HBM, then the
engine's CPU, then its storage), or the pool copy when that credits more. A block no group
needs (before a window, or before a Mamba state, with no full-attention group) is skipped
by the engine because of the block that ends the prefix, and is credited and planned as
that block. `HybridHoldings` keeps these engines' residencies, and puts a block in the index
(for LOCATE and the counts) while any group holds it in a tier. What is not modelled: the
last prompt token vLLM always recomputes, EAGLE's dropped block, fine-grained (sub-block)
hits, groups of different block sizes, and that vLLM finds the GPU hit first and lets its
offloading connector extend it (here the tiers of a block are pooled, as for any engine).

**No kinds declared**: a block counts for ROUTE in a tier only while every KV-cache group
the engine has named holds it in that tier (`GroupedHoldings`). A prefix whose blocks
every group holds is always reusable, so ROUTE never over-credits; it under-credits
whenever a group keeps only some blocks: a sliding-window group that dropped the early
blocks of a prefix, or a Mamba group that holds its state at a few blocks (then often
nothing at all counts). A block held in different tiers by different groups counts in
none of them. Engines whose events only ever name group 0 (or none) never come here:
their events go straight to the index; `GroupedHoldings` takes over an engine when a
second group appears, carrying its residencies along.

Either way, an event without `group_idx` (older vLLM) speaks for the block as a whole,
every group at once; each costs one dict entry per (block, tier) or per block held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from quilld.config import GroupConfig
from quilld.index.residency import TIERS, ResidencyIndex, entry_key, hash_key
from quilld.model import CacheTier
from quilld.scopes import TAG_LEN

EVERY_GROUP = -1  # the mask of an event without group_idx: every group, known or not
_TIER_NO = {t: i for i, t in enumerate(TIERS)}


class GroupedHoldings:
    """Which KV-cache groups of one engine hold each (block, tier), and the index entries that follow."""

    __slots__ = ("engine", "index", "known", "held")

    def __init__(self, engine: str, index: ResidencyIndex, held: dict[bytes, int] | None = None) -> None:
        self.engine = engine
        self.index = index
        self.known = 0  # bit g: the engine has named group g
        # tag + hash key + tier number -> mask of groups holding it (kept by the index: a persistent
        # one persists it; `held` is what it gave back of the engine after a restart)
        self.held: dict[bytes, int] = index.groups_of(engine, "grouped") if held is None else held

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


# ---------------------------------------------------------------- kinds declared


@dataclass(frozen=True, slots=True)
class HitRule:
    """An engine's declared groups, as `longest_hit` reads them (group g is bit 1 << g)."""

    count: int  # groups
    full: int  # mask of the full-attention groups
    windows: tuple[tuple[int, int], ...]  # (bit, blocks its window needs) per sliding-window group
    states: int  # mask of the Mamba groups

    @classmethod
    def of(cls, groups: tuple[GroupConfig, ...], block_size: int) -> HitRule:
        full = states = 0
        windows = []
        for g, group in enumerate(groups):
            if group.kind == "full":
                full |= 1 << g
            elif group.kind == "mamba":
                states |= 1 << g
            else:  # vLLM: cdiv(sliding_window - 1, block_size) contiguous blocks, at least 1 found
                windows.append((1 << g, max(1, -(-(group.window_tokens - 1) // block_size))))
        return cls(len(groups), full, tuple(windows), states)

    @property
    def every(self) -> int:
        return (1 << self.count) - 1

    @property
    def reach(self) -> int:
        """How many blocks at a hit's end more groups than the full-attention ones read."""
        return max([blocks for _, blocks in self.windows] + [1 if self.states else 0])

    def needs(self, block: int, length: int) -> int:
        """The groups whose copy of `block` a hit of `length` blocks reads."""
        need = self.full
        for bit, blocks in self.windows:
            if block >= length - blocks:
                need |= bit
        if block == length - 1:
            need |= self.states
        return need


def longest_hit(rule: HitRule, holds: list[int]) -> int:
    """The longest prefix every group accepts, given `holds[i]`, the mask of the groups that hold
    block i; the caller has cut `holds` at the first block a full-attention group lacks.

    As vLLM's coordinator: each group in turn cuts the candidate length to the longest it accepts
    at or below it, until none cuts; each looks back from the candidate, so a hit near the end of
    the prompt costs about a window's worth of steps."""
    length, windows, states = len(holds), rule.windows, rule.states
    if not windows and not states:
        return length
    while True:
        candidate = length
        if states:  # the state at the last block
            while length and holds[length - 1] & states != states:
                length -= 1
        for bit, blocks in windows:  # the last `blocks` blocks in a row, or every block from the first
            run, i = 0, length - 1
            while i >= 0:
                if holds[i] & bit:
                    run += 1
                    if run >= blocks:
                        break
                else:
                    run = 0
                i -= 1
            length = i + run if i >= 0 else run
        if length == candidate:
            return length


_ENGINE_TIERS = tuple(_TIER_NO[t] for t in (CacheTier.HBM, CacheTier.CPU, CacheTier.STORAGE))


class HybridHoldings:
    """Which declared groups of one engine hold each block, in which of its tiers.

    Per scope tag, an entry key (as the index's) maps to one int: bit tier * count + g is set
    while group g holds the block in that tier. The index gets the block in a tier while any
    group holds it there.
    """

    __slots__ = ("engine", "index", "rule", "held")

    def __init__(self, engine: str, index: ResidencyIndex, rule: HitRule) -> None:
        self.engine = engine
        self.index = index
        self.rule = rule
        # tag -> entry key -> tier-major group bits (kept by the index, as GroupedHoldings.held)
        self.held: dict[bytes, dict[int | bytes, int]] = index.groups_of(engine, "hybrid")

    def stored(self, tag: bytes, hashes: Iterable, tier: CacheTier, mask: int) -> int:
        """Groups `mask` hold these blocks in `tier`; returns how many the index did not have there."""
        n = self.rule.count
        shift = _TIER_NO[tier] * n
        bits, every = (mask & self.rule.every) << shift, self.rule.every << shift
        held = self.held.get(tag)
        if held is None:
            held = self.held[tag] = self.index.group_scope(self.engine, tag)
        put, engine, added = self.index.put, self.engine, 0
        for h in hashes:
            key = entry_key(h)
            old = held.get(key, 0)
            new = old | bits
            if new != old:
                held[key] = new
                if not old & every:
                    added += put(tag, h, engine, tier)
        return added

    def removed(self, tag: bytes, hashes: Iterable, tier: CacheTier, mask: int) -> None:
        """Groups `mask` no longer hold these blocks in `tier`."""
        held = self.held.get(tag)
        if held is None:
            return
        n = self.rule.count
        shift = _TIER_NO[tier] * n
        bits, every = (mask & self.rule.every) << shift, self.rule.every << shift
        remove, engine = self.index.remove, self.engine
        for h in hashes:
            key = entry_key(h)
            old = held.get(key)
            if old is None or not old & bits:
                continue
            new = old & ~bits
            if new:
                held[key] = new
            else:
                del held[key]
            if not new & every:
                remove(tag, h, engine, tier)
        if not held:
            del self.held[tag]

    def entries(self, tag: bytes) -> dict[int | bytes, int]:
        """The tag's entries (read them, never change them); empty when the engine holds nothing there."""
        return self.held.get(tag, _EMPTY)

    def clear(self) -> None:
        """The engine cleared its cache (the caller clears its index entries)."""
        for table in self.held.values():
            table.clear()
        self.held.clear()

    def __len__(self) -> int:
        return sum(map(len, self.held.values()))


_EMPTY: dict = {}
