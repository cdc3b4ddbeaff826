"""Moves between tiers: a value leaving DRAM for the tier below, or coming back.

`TierMoves` is mixed into `Keyspace` (keyspace.py) and holds no state of its own. The lower
tier's policy (tiering.py) calls `demoted` once a block's bytes are safe below, `promoted`
once a read brought them back, and `adopt` for each value found below at start; the
keyspace's own eviction calls `demoted` too. Each keeps the keyspace's books: which of its
two dicts (`data`, `lower`) holds the key, the block counts, and the placements reported
to the listener. `below_only` and `bring_back` serve the commands that need a value in
DRAM (EXPIRE, RENAME, COPY, writes in place, SHM GET's leases).
"""

from __future__ import annotations

import time
from typing import Any

from quilld.errors import OutOfMemory
from quilld.model import CacheTier
from quilld.tiers.block import Block, BlockState, page_extent


class TierMoves:
    """Keyspace methods for moves between DRAM and the tier below (mixed into `Keyspace`)."""

    def demoted(self, fk: bytes, block: Block, entry: Any) -> None:
        """`block` (unpinned, resident) now lives only in the lower tier as `entry`: free its DRAM.

        The key leaves the DRAM LRU (keeping its TTL-free life) and joins the lower tier's LRU.
        """
        self.data.pop(fk, None)  # eviction has already popped it
        self.lower[fk] = entry
        block.lower = None
        self.block_count -= 1
        self._free(block)
        if self.listener is not None:
            if fk not in self.tracked:
                self.tracked[fk] = None
            self.listener.placed(fk, self.lower_tier.tier, entry.length, self.tracked[fk])

    def promoted(self, fk: bytes, block: Block, entry: Any) -> None:
        """A read brought `entry` back into DRAM as `block` (keeping the lower copy)."""
        del self.lower[fk]
        self.reserved_blocks -= 1
        self.held_bytes -= page_extent(block.length)
        block.to(BlockState.RESIDENT)
        block.last_access = time.time()
        block.lower = entry
        block.crc = entry.crc  # verified by the read
        self.block_count += 1
        self.data[fk] = block
        if self.listener is not None and fk in self.tracked:
            self.listener.placed(fk, CacheTier.DRAM, block.length, self.tracked[fk])

    def adopt(self, fk: bytes, entry: Any) -> None:
        """A value found in the lower tier at start (recovery) joins the keyspace."""
        self.lower[fk] = entry
        self._added(fk)
        if self.listener is not None:
            self.tracked[fk] = None
            self.listener.placed(fk, self.lower_tier.tier, entry.length, None)

    def below_only(self, tag: bytes, key: bytes) -> bool:
        """Whether `key`'s only copy is in the tier below DRAM (see `bring_back`)."""
        return tag + key in self.lower

    async def bring_back(self, tag: bytes, key: bytes, space_freed: Any = None, wait_s: float = 5.0) -> None:
        """Read a value kept only below DRAM back into the arena, keeping the lower copy as
        `block.lower` (as a promoting read does). The lower tier keeps no TTLs and its copies
        are stored under their key, so EXPIRE, RENAME and COPY work on the DRAM copy.

        While the arena is full of blocks the lower tier is about to take, waits up to
        `wait_s` for room (`space_freed(timeout)` returns when some is freed), then raises
        OutOfMemory."""
        fk = tag + key
        entry = self.lower.get(fk)
        if entry is None:
            return
        data = await self.lower_tier.read_bytes(entry)  # verified against entry.crc
        deadline = time.monotonic() + wait_s
        while True:
            if self.lower.get(fk) is not entry:
                return  # deleted, overwritten or promoted meanwhile: the caller looks again
            try:
                block = self.reserve(len(data))
                break
            except OutOfMemory:
                if space_freed is None or time.monotonic() > deadline or not self.space_may_free():
                    raise
                self.lower_tier.wake()
                await space_freed(0.01)
        self.write_view(block)[:] = data
        self.promoted(fk, block, entry)
