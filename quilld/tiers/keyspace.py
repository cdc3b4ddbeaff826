"""The keyspace, storage's one front door: scoped keys -> values, with LRU, TTLs and pins.

Protocol, cluster and http read and write blocks only through `Keyspace`:
`get` returns plain values (`bytes`, a `Pinned` arena view to release, a
`Pending` read of a lower tier, or None), never wire objects; `publish`,
`delete`, `reserve`/`write_view`/`discard`, `pin`/`unpin`, TTLs, `places`
(for LOCATE) and `peer_copy`/`lease_extent` (for peers) are the rest.

A value is either `bytes` kept in the entry itself (at most `dram.inline_max`
bytes: a 4 KiB page each would waste most of it) or a `Block` (block.py, which
owns a block's life cycle), an extent of the DRAM arena. Keys are
`scope tag + key` (see scopes.py). The dict's order is the LRU order: a hit
moves the key to the end, eviction pops from the front, skipping pinned blocks.

With a tier below DRAM (tier.py; the SSD tier, through tiering.py) a key may
instead live only there: its value is then that tier's entry in `lower`, a
second dict in the lower tier's LRU order. A key is in exactly one of the
two dicts. A Block whose bytes are also in the lower tier (written by
demotion but still pinned, or promoted back by a read) keeps that entry in
`block.lower`: evicting it from DRAM then loses nothing.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from typing import Any

import crc32c

from quilld.config import DramConfig
from quilld.errors import OutOfMemory
from quilld.model import CacheTier, Pending, Pinned
from quilld.scopes import TAG_LEN, ScopeRegistry
from quilld.tiers.arena import NO_SPACE, DramArena
from quilld.tiers.block import Block, BlockState, page_extent
from quilld.tiers.tier import LowerTier

LOSSLESS_SCAN = 2000  # DRAM entries looked at for a block already in the lower tier before waiting for it


def now_ms() -> int:
    return int(time.time() * 1000)


class Keyspace:
    def __init__(self, cfg: DramConfig, scopes: ScopeRegistry) -> None:
        self.cfg = cfg
        self.scopes = scopes
        self.arena = DramArena(cfg.size)
        self.capacity = self.arena.capacity
        self.high_bytes = int(self.capacity * cfg.high_watermark)
        self.low_bytes = int(self.capacity * cfg.low_watermark)
        self.inline_max = cfg.inline_max
        self.data: OrderedDict[bytes, bytes | Block] = OrderedDict()
        self.lower: OrderedDict[bytes, Any] = OrderedDict()  # keys only in the lower tier -> its entry
        self.lower_tier: LowerTier | None = None  # the tier below DRAM (tiering.py installs the SSD tier)
        self.on_free: Any = None  # called when arena space is given back (wakes writers waiting for it)
        self.expires: dict[bytes, int] = {}
        self._expiry_heap: list[tuple[int, bytes]] = []
        self.per_scope: Counter[bytes] = Counter()
        self.used = 0  # arena bytes held (whole pages) plus inline value bytes
        self.inline_bytes = 0
        self.block_count = 0  # published blocks in the keyspace
        self.reserved_blocks = 0  # blocks reserved but not yet published
        self.unlinked_pinned = 0  # blocks out of the keyspace, waiting for their readers
        self.active_pins = 0  # readers holding blocks right now
        self.held_bytes = 0  # arena bytes no eviction can free now: pinned or reserved blocks
        self.stats = Counter()  # cold counters: expired, evictions
        # Arena blocks, and values published with an engine block hash (PUT2PHASE ... HASH),
        # are "tracked": the listener hears where each one is placed and when it goes, so the
        # node can mirror them into the residency index (ROUTE credit) and the cluster's log.
        self.tracked: dict[bytes, int | bytes | None] = {}  # full key -> its block hash or None
        self.listener: Any = None  # placed(fk, tier, nbytes, bhash) / removed(fk, bhash)
        self.hits = self.misses = self.writes = 0

    # -- accounting --------------------------------------------------------
    def keys_in(self, tag: bytes) -> int:
        return self.per_scope.get(tag, 0)

    # -- reads -------------------------------------------------------------
    def lookup(self, tag: bytes, key: bytes) -> bytes | Block | None:
        """The live value of `key` in scope `tag` (a hit refreshes its LRU place)."""
        fk = tag + key
        value = self.data.get(fk)
        if value is None and self.lower:
            value = self.lower.get(fk)
            if value is not None:
                self.lower.move_to_end(fk)
                self.hits += 1
                return value
        if value is None:
            self.misses += 1
            self.scopes.audit_miss(tag, key, self._has)
            return None
        if self.expires and fk in self.expires and self.expires[fk] <= now_ms():
            self._unlink(fk)
            self.stats["expired"] += 1
            self.misses += 1
            return None
        self.data.move_to_end(fk)
        self.hits += 1
        if type(value) is Block:
            value.last_access = time.time()
        return value

    def _has(self, fk: bytes) -> bool:
        return fk in self.data or fk in self.lower

    def contains(self, tag: bytes, key: bytes) -> bool:
        fk = tag + key
        if fk not in self.data:
            if fk in self.lower:
                return True
            self.scopes.audit_miss(tag, key, self._has)
            return False
        if self.expires and fk in self.expires and self.expires[fk] <= now_ms():
            self._unlink(fk)
            self.stats["expired"] += 1
            return False
        return True

    def view(self, block: Block) -> memoryview:
        return self.arena.view(block.handle, block.length)

    # -- the front door's reads: plain values --------------------------------
    def get(self, tag: bytes, key: bytes) -> bytes | Pinned | Pending | None:
        """The value of `key`: bytes, a pinned arena view (release it when sent), a pending
        read of the lower tier, or None."""
        value = self.lookup(tag, key)
        t = value.__class__
        if t is bytes or value is None:
            return value
        if t is Block:
            return self.pinned(value)
        return Pending(self.lower_tier.read(value))

    def pinned(self, block: Block) -> Pinned:
        """`block`'s bytes, pinned until the returned value is released."""
        self.pin(block)
        return Pinned(self.arena.view(block.handle, block.length), lambda: self.unpin(block))

    def places(self, tag: bytes, key: bytes) -> list[tuple[CacheTier, int, int | None]]:
        """Where this node holds `key`: (tier, bytes, last access in ms or None) per copy."""
        out: list[tuple[CacheTier, int, int | None]] = []
        value = self.data.get(tag + key) if self.contains(tag, key) else None
        if value is not None:
            last = int(value.last_access * 1000) if value.__class__ is Block else None
            out.append((CacheTier.DRAM, len(value), last))
        if value is None:
            below = self.lower.get(tag + key)
        else:
            below = value.lower if value.__class__ is Block else None
        if below is not None:
            out.append((self.lower_tier.tier, below.length, None))
        return out

    def peer_copy(self, tag: bytes, key: bytes) -> list | Pending | None:
        """`[crc32c, bytes | Pinned]` of this node's copy, for a peer; None when there is none."""
        value = self.lookup(tag, key)
        if value is None:
            return None
        if value.__class__ is Block:
            pinned = self.pinned(value)
            if value.crc is None:  # published blocks never change: compute once, serve many
                value.crc = crc32c.crc32c(pinned.view)
            return [value.crc, pinned]
        if value.__class__ is bytes:
            return [crc32c.crc32c(value), value]
        return Pending(self._lower_copy(value))

    async def _lower_copy(self, entry: Any) -> list:
        data = await self.lower_tier.read_bytes(entry)  # verified against entry.crc
        return [entry.crc, data]

    def lease_extent(self, tag: bytes, key: bytes, min_bytes: int) -> tuple[int, int, int, Pinned] | None:
        """(crc32c, arena offset, length, pin) of an arena block of at least `min_bytes`, for a
        reader of the arena's memory (RDMA); None when the value is not such a block."""
        value = self.data.get(tag + key)  # a peek: only a block this large is counted as a read
        if value.__class__ is not Block or value.length < min_bytes:
            return None
        value = self.lookup(tag, key)  # expiry and LRU, as any read
        if value.__class__ is not Block:
            return None
        pinned = self.pinned(value)
        try:
            crc = value.crc if value.crc is not None else crc32c.crc32c(pinned.view)
        except BaseException:
            pinned.release()
            raise
        return crc, self.arena.offset(value.handle), value.length, pinned

    def pin(self, block: Block) -> None:
        if not block.pins:
            self.held_bytes += page_extent(block.length)
        block.pins += 1
        self.active_pins += 1

    def unpin(self, block: Block) -> None:
        block.pins -= 1
        self.active_pins -= 1
        if block.pins == 0:
            self.held_bytes -= page_extent(block.length)
            if block.state is BlockState.EVICTING:
                self.unlinked_pinned -= 1
                self._free(block)

    # -- writes ------------------------------------------------------------
    def reserve(self, nbytes: int) -> Block:
        """Space for a block of `nbytes`, invisible until published.

        Evicts least-recently-used unpinned values as needed; raises
        OutOfMemory when the value cannot fit even after that.
        """
        if nbytes > self.capacity:
            raise OutOfMemory(f"value of {nbytes} bytes is larger than the DRAM arena ({self.capacity} bytes)")
        need = page_extent(nbytes)
        if need > self.capacity - self.held_bytes:  # evicting everything would not be enough
            raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")
        self._make_room(need)
        handle = self.arena.reserve(nbytes)
        while handle == NO_SPACE:
            if not self._evict_one():
                raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")
            handle = self.arena.reserve(nbytes)
        self.reserved_blocks += 1
        self.used += need
        self.held_bytes += need
        return Block(handle, nbytes)

    def space_may_free(self) -> bool:
        """Whether space is held only for now: by readers' pins, puts in progress, or
        blocks the lower tier is about to take."""
        return self.active_pins > 0 or self.reserved_blocks > 0 or (
            self.lower_tier is not None and self.lower_tier.active and self.block_count > 0)

    def discard(self, block: Block) -> None:
        """Give back a reservation that will never be published."""
        if block.unpublished:
            self.reserved_blocks -= 1
            self.held_bytes -= page_extent(block.length)
            self._free(block)

    def materialize(self, value: bytes | bytearray | memoryview) -> bytes | Block:
        """A storable value: small ones as bytes, larger ones copied into the arena."""
        n = len(value)
        if n <= self.inline_max:
            return bytes(value)
        block = self.reserve(n)
        self.write_view(block)[:] = value
        return block

    def write_view(self, block: Block) -> memoryview:
        """The memory of a reserved block, for its bytes to be written into (it is now WRITING)."""
        if block.state is BlockState.RESERVED:
            block.to(BlockState.WRITING)
        return self.arena.view(block.handle, block.length)

    def publish(self, tag: bytes, key: bytes, value: bytes | Block, keep_ttl: bool = False,
                bhash: int | bytes | None = None) -> None:
        """Make `value` the visible value of `key`, replacing (and releasing) any old one.

        `bhash` names the engine block the value holds; ROUTE then credits it.
        """
        fk = tag + key
        data = self.data
        if self.tracked:
            self._forget(fk)
        listener = self.listener
        if listener is not None and (bhash is not None or value.__class__ is Block):
            self.tracked[fk] = bhash
            listener.placed(fk, CacheTier.DRAM, len(value), bhash)
        old = data.pop(fk, None)
        if old is None and self.lower:
            old = self.lower.pop(fk, None)
        if old is None:
            self.per_scope[tag] += 1
        else:
            if old.__class__ is bytes:
                self.inline_bytes -= len(old)
                self.used -= len(old)
            else:
                self._release_value(old)
            if self.expires and not keep_ttl:
                self.expires.pop(fk, None)
        if value.__class__ is bytes:
            n = len(value)
            self.inline_bytes += n
            self.used += n
            if self.used > self.high_bytes:
                self._make_room(0)
        else:
            self.reserved_blocks -= 1
            self.held_bytes -= page_extent(value.length)
            value.to(BlockState.RESIDENT)
            value.last_access = time.time()
            self.block_count += 1
        data[fk] = value
        self.writes += 1

    def delete(self, tag: bytes, key: bytes) -> bool:
        fk = tag + key
        if fk not in self.data:
            if fk in self.lower:
                self._unlink(fk)
                return True
            return False
        expired = self.expires and fk in self.expires and self.expires[fk] <= now_ms()
        self._unlink(fk)
        return not expired

    def flush_scope(self, tag: bytes) -> int:
        doomed = [fk for fk in self.data if fk[:TAG_LEN] == tag]
        doomed += [fk for fk in self.lower if fk[:TAG_LEN] == tag]
        for fk in doomed:
            self._unlink(fk)
        return len(doomed)

    def tracked_values(self):
        """(full key, tier, bytes, block hash) of every tracked value, for replication snapshots."""
        for fk, bhash in list(self.tracked.items()):
            value = self.data.get(fk)
            if value is not None:
                yield fk, CacheTier.DRAM, len(value), bhash
            elif fk in self.lower:
                yield fk, self.lower_tier.tier, self.lower[fk].length, bhash

    # -- moves between tiers (driven by the lower tier's policy, e.g. tiering.py) -------
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
        self.per_scope[fk[:TAG_LEN]] += 1
        if self.listener is not None:
            self.tracked[fk] = None
            self.listener.placed(fk, self.lower_tier.tier, entry.length, None)

    # -- expiry ------------------------------------------------------------
    def set_expire(self, tag: bytes, key: bytes, at_ms: int) -> None:
        fk = tag + key
        self.expires[fk] = at_ms
        heapq.heappush(self._expiry_heap, (at_ms, fk))
        if len(self._expiry_heap) > 64 and len(self._expiry_heap) > 2 * len(self.expires):
            self._expiry_heap = [(at, k) for k, at in self.expires.items()]
            heapq.heapify(self._expiry_heap)

    def ttl_ms(self, tag: bytes, key: bytes) -> int:
        """-2 when missing, -1 when it never expires, else the milliseconds left."""
        if not self.contains(tag, key):
            return -2
        at = self.expires.get(tag + key)
        return -1 if at is None else max(0, at - now_ms())

    def sweep_expired(self, limit: int = 1000) -> int:
        """Remove up to `limit` keys whose time has come (called periodically)."""
        heap, now, n = self._expiry_heap, now_ms(), 0
        while heap and heap[0][0] <= now and n < limit:
            at, fk = heapq.heappop(heap)
            if self.expires.get(fk) == at:
                self._unlink(fk)
                self.stats["expired"] += 1
                n += 1
        return n

    # -- internals ---------------------------------------------------------
    def _forget(self, fk: bytes) -> None:
        if fk in self.tracked:
            self.listener.removed(fk, self.tracked.pop(fk))

    def _unlink(self, fk: bytes) -> None:
        if self.tracked:
            self._forget(fk)
        value = self.data.pop(fk, None)
        if value is None:
            value = self.lower.pop(fk)
        self.per_scope[fk[:TAG_LEN]] -= 1
        if self.expires:
            self.expires.pop(fk, None)
        self._release_value(value)

    def _release_value(self, value: Any) -> None:
        t = type(value)
        if t is bytes:
            self.inline_bytes -= len(value)
            self.used -= len(value)
            return
        if t is not Block:  # a lower tier's entry: its space goes once its deletion is durable
            self.lower_tier.drop(value)
            return
        if value.lower is not None:
            self.lower_tier.drop(value.lower)
            value.lower = None
        self.block_count -= 1
        if value.pins:
            value.to(BlockState.EVICTING)
            self.unlinked_pinned += 1
        else:
            self._free(value)

    def _free(self, block: Block) -> None:
        self.arena.release(block.handle)
        self.used -= page_extent(block.length)
        block.to(BlockState.GONE)
        if self.on_free is not None:
            self.on_free()

    def _make_room(self, need: int) -> None:
        if self.lower_tier is not None and self.lower_tier.active:
            # the demoter keeps use between the watermarks in the background; here only
            # make room when the arena is really full
            while self.used + need > self.capacity:
                if not self._evict_one():
                    return
            return
        if self.used + need <= self.high_bytes:
            return
        while self.used + need > self.low_bytes:
            if not self._evict_one():
                return

    def _evict_one(self) -> bool:
        """Evict the least-recently-used unpinned value; False when none can go.

        With a working lower tier nothing is lost: only blocks whose bytes are
        already there leave DRAM here (its demoter writes the others), and
        when there is none the caller waits for the demoter.
        """
        data = self.data
        if self.lower_tier is not None and self.lower_tier.active:
            for i, (fk, value) in enumerate(data.items()):
                if i >= LOSSLESS_SCAN:
                    break
                if type(value) is Block and value.lower is not None and not value.pins:
                    self.demoted(fk, value, value.lower)
                    self.stats["evictions_to_ssd"] += 1
                    return True
            self.lower_tier.wake()
            return False
        for _ in range(len(data)):
            fk, value = data.popitem(last=False)
            if type(value) is Block:
                if value.pins:
                    data[fk] = value  # in use: it is the most recent anyway
                    continue
                if value.lower is not None:  # its bytes are safe below (a failed tier still reads)
                    self.demoted(fk, value, value.lower)
                    self.stats["evictions_to_ssd"] += 1
                    return True
            self.per_scope[fk[:TAG_LEN]] -= 1
            if self.expires:
                self.expires.pop(fk, None)
            if self.tracked:
                self._forget(fk)
            self._release_value(value)
            self.stats["evictions"] += 1
            return True
        return False

    def close(self) -> None:
        self.data.clear()
        try:
            self.arena.close()
        except BufferError:  # a view is still exported somewhere; the OS reclaims it at exit
            pass
