"""Moves between tiers: a value leaving DRAM for the tier below, or coming back.

`TierMoves` is mixed into `Keyspace` (keyspace.py) and holds no state of its own. The lower
tier's policy (tiering.py) calls `demoted` once a value's bytes are safe below, `promoted`
once a read brought them back, and `adopt` for each value found below at start; the
keyspace's own eviction calls `demoted` too. Each keeps the keyspace's books: which of its
two dicts (`data`, `lower`) holds the key, the DRAM counts, the copy a DRAM value keeps
below (`block.lower`, or `small_copies` for an inline value), and the placements reported
to the listener. Blocks and inline values take the same moves; an inline value comes back
as bytes (`dram.inline_max`), never as an arena block. `below_only` and `bring_back` serve
the commands that need a value in DRAM (RENAME, COPY, writes in place, SHM GET's leases).
"""

from __future__ import annotations

import time
from typing import Any

from quilld.errors import OutOfMemory
from quilld.model import CacheTier
from quilld.tiers.block import Block, BlockState, page_extent

INLINE_SLACK_SHARE = 64  # a client's inline writes may take used_memory this share of maxmemory past it (1/64)


class TierMoves:
    """Keyspace methods for moves between DRAM and the tier below (mixed into `Keyspace`)."""

    def demoted(self, fk: bytes, value: bytes | Block, entry: Any) -> None:
        """`value` (an unpinned resident block, or inline bytes) now lives only in the lower
        tier as `entry`: free its DRAM. The key leaves the DRAM LRU and joins the lower tier's
        LRU; its TTL stays in `expires` (the entry carries it too)."""
        if self.lookup_table is not None:  # before its DRAM is freed
            self.lookup_table.drop(fk)
        self.data.pop(fk, None)  # eviction has already popped it
        self.lower[fk] = entry
        if value.__class__ is bytes:
            if self.small_copies:
                self.small_copies.pop(fk, None)
            self.inline_bytes -= len(value)
            self.used -= len(value)
            if self.on_free is not None:
                self.on_free()
            if self.listener is not None and fk in self.tracked:
                self.listener.moved(fk, self.lower_tier.tier, entry.length, self.tracked[fk])
            return
        value.lower = None
        self.block_count -= 1
        self._free(value)
        if self.listener is not None:
            if fk not in self.tracked:
                self.tracked[fk] = None
            self.listener.moved(fk, self.lower_tier.tier, entry.length, self.tracked[fk])

    def promoted(self, fk: bytes, value: bytes | Block, entry: Any) -> None:
        """A read brought `entry` back into DRAM as `value` (a reserved block holding its bytes,
        or the bytes themselves when it is small), keeping the lower copy."""
        del self.lower[fk]
        if value.__class__ is bytes:
            n = len(value)
            self.inline_bytes += n
            self.used += n
            self.small_copies[fk] = entry
            self.data[fk] = value
        else:
            self.reserved_blocks -= 1
            self.held_bytes -= page_extent(value.length)
            value.to(BlockState.RESIDENT)
            value.last_access = time.time()
            value.lower = entry
            value.crc = entry.crc  # verified by the read
            self.block_count += 1
            self.data[fk] = value
            if self.lookup_table is not None:
                self.lookup_table.add(fk, value)
        if self.listener is not None and fk in self.tracked:
            self.listener.moved(fk, CacheTier.DRAM, len(value), self.tracked[fk])

    def adopt(self, fk: bytes, entry: Any) -> None:
        """A value found in the lower tier at start (recovery) joins the keyspace, with its TTL.
        Blocks larger than `inline_max` are tracked (ROUTE credits them), small values not."""
        self.lower[fk] = entry
        self._added(fk)
        if entry.expire:
            self.ttls.set(fk, entry.expire)
        if self.listener is not None and entry.length > self.inline_max:
            self.tracked[fk] = None
            self.listener.moved(fk, self.lower_tier.tier, entry.length, None)

    def below_only(self, tag: bytes, key: bytes) -> bool:
        """Whether `key`'s only copy is in the tier below DRAM (see `bring_back`)."""
        return tag + key in self.lower

    async def bring_back(self, tag: bytes, key: bytes, space_freed: Any = None, wait_s: float = 5.0) -> None:
        """Read a value kept only below DRAM back into DRAM (an arena block, or bytes when it is
        small), keeping the lower copy (as a promoting read does): its copies are stored
        under their key, so RENAME, COPY and writes in place work on the DRAM copy.

        While DRAM is full of values the lower tier is about to take, waits up to `wait_s`
        for room (`space_freed(timeout)` returns when some is freed), then raises
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
                if len(data) <= self.inline_max:
                    self.make_room_inline(len(data))
                    self.promoted(fk, data, entry)
                    return
                block = self.reserve(len(data))
                break
            except OutOfMemory:
                if space_freed is None or time.monotonic() > deadline or not self.space_may_free():
                    raise
                self.lower_tier.wake()
                await space_freed(0.01)
        self.write_view(block)[:] = data
        self.promoted(fk, block, entry)

    def make_room_inline(self, n: int, slack: int = 0) -> None:
        """Room within `limit` (plus `slack`) for `n` more inline bytes; raises OutOfMemory, as
        `reserve` does for a block. While a lower tier works, copies already below leave DRAM
        first and past `limit` the demoter is woken (by `_evict_one`); without one, values go
        as the maxmemory policy says (eviction.py). Nothing goes for a value that could never fit."""
        if n > self.limit + slack:
            raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")
        while self.used + n > self.limit:
            if not self._evict_one():
                if self.used + n <= self.limit + slack:
                    return
                raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")

    def _small_below(self, fk: bytes) -> bool:
        """`fk`'s inline value leaves DRAM (deleted, overwritten, renamed): its copy in the lower
        tier is dropped, or the write of one in flight will be; True when either is so (the
        deletion below is durable only once `lower_tier.synced()` says so)."""
        entry = self.small_copies.pop(fk, None) if self.small_copies else None
        if entry is not None:
            self.lower_tier.drop(entry)
            return True
        return self.lower_tier.writing_inline(fk)

    def copy_below(self, fk: bytes, value: bytes | Block) -> Any:
        """The lower tier's entry holding the same bytes as `fk`'s DRAM `value`, or None."""
        if value.__class__ is Block:
            return value.lower
        return self.small_copies.get(fk) if self.small_copies else None

    def _admit(self, fk: bytes, n: int) -> None:
        """Room for a client's inline value of `n` bytes replacing `fk`'s (`make_room_inline`:
        with a lower tier copies already below leave DRAM first, the demoter is woken past
        `limit`; without one the policy's values go), and past
        `limit` + INLINE_SLACK_SHARE of it the write gets OutOfMemory (the server retries it
        while the demoter frees DRAM). The slack lets one command finish what it started: a
        command with a large argument (MSET big small ...) cannot be run again once its
        payload was taken, so its small values must not be refused right after the large one
        took the last room; a flood of small writes is held at the slack."""
        old = self.data.get(fk)
        self.make_room_inline(n - (len(old) if old.__class__ is bytes else 0), self.limit // INLINE_SLACK_SHARE)
