"""The keyspace: scoped keys -> values in DRAM, with LRU eviction, TTLs and pins.

A value is either `bytes` kept in the entry itself (at most `dram.inline_max`
bytes: a 4 KiB page each would waste most of it) or a `Block`, an extent of
the DRAM arena. Keys are `scope tag + key` (see scopes.py). The dict's
order is the LRU order: a hit moves the key to the end, eviction pops from
the front, skipping pinned blocks.

A Block's life is owned here: reserve() -> WRITING (invisible) -> publish()
-> RESIDENT -> unlinked by delete/overwrite/eviction -> EVICTING while pinned
-> GONE when its space is back in the allocator. Pins protect readers: a
block being sent to a client is never freed under it.

With an SSD tier (tiers/tiering.py) a key may instead live only on SSD: its
value is then an `SsdEntry` in `ssd_data`, a second dict in SSD LRU order.
A key is in exactly one of the two dicts. A Block whose bytes are also on
SSD (written by demotion but still pinned, or promoted back by a read) keeps
that copy in `block.ssd`: evicting it from DRAM then loses nothing.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from typing import Any

from quilld.config import DramConfig
from quilld.errors import OutOfMemory
from quilld.scopes import TAG_LEN, ScopeRegistry
from quilld.model import BlockState, CacheTier
from quilld.tiers.arena import NO_SPACE, PAGE, DramArena

_RESERVED_STATES = (BlockState.RESERVED, BlockState.WRITING)
LOSSLESS_SCAN = 2000  # DRAM entries looked at for a block already on SSD before waiting for the demoter


class Block:
    """An arena-resident value: the one per-block object beyond its dict entry."""

    __slots__ = ("handle", "length", "pins", "state", "last_access", "ssd", "crc")

    def __init__(self, handle: int, length: int) -> None:
        self.handle = handle
        self.length = length
        self.pins = 0
        self.state = BlockState.WRITING
        self.last_access = 0.0
        self.ssd: Any = None  # an SsdEntry holding the same bytes, when there is one
        self.crc: int | None = None  # CRC32C of the published bytes, once someone computed it

    def __len__(self) -> int:
        return self.length


def page_extent(nbytes: int) -> int:
    """Arena bytes a value of `nbytes` occupies: whole pages, at least one."""
    return max(1, -(-nbytes // PAGE)) * PAGE


def now_ms() -> int:
    return int(time.time() * 1000)


class Store:
    def __init__(self, cfg: DramConfig, scopes: ScopeRegistry) -> None:
        self.cfg = cfg
        self.scopes = scopes
        self.arena = DramArena(cfg.size)
        self.capacity = self.arena.capacity
        self.high_bytes = int(self.capacity * cfg.high_watermark)
        self.low_bytes = int(self.capacity * cfg.low_watermark)
        self.inline_max = cfg.inline_max
        self.data: OrderedDict[bytes, bytes | Block] = OrderedDict()
        self.ssd_data: OrderedDict[bytes, Any] = OrderedDict()  # keys only on SSD -> SsdEntry
        self.tiering: Any = None  # tiers/tiering.py Tiering when there is an SSD tier
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
        if value is None and self.ssd_data:
            value = self.ssd_data.get(fk)
            if value is not None:
                self.ssd_data.move_to_end(fk)
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
        return fk in self.data or fk in self.ssd_data

    def contains(self, tag: bytes, key: bytes) -> bool:
        fk = tag + key
        if fk not in self.data:
            if fk in self.ssd_data:
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
            if block.state == BlockState.EVICTING:
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
        blocks the SSD demoter is about to move out."""
        return self.active_pins > 0 or self.reserved_blocks > 0 or (
            self.tiering is not None and self.tiering.active and self.block_count > 0)

    def discard(self, block: Block) -> None:
        """Give back a reservation that will never be published."""
        if block.state in _RESERVED_STATES:
            self.reserved_blocks -= 1
            self.held_bytes -= page_extent(block.length)
            self._free(block)

    def materialize(self, value: bytes | bytearray | memoryview) -> bytes | Block:
        """A storable value: small ones as bytes, larger ones copied into the arena."""
        n = len(value)
        if n <= self.inline_max:
            return bytes(value)
        block = self.reserve(n)
        self.view(block)[:] = value
        return block

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
        if old is None and self.ssd_data:
            old = self.ssd_data.pop(fk, None)
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
            value.state = BlockState.RESIDENT
            value.last_access = time.time()
            self.block_count += 1
        data[fk] = value
        self.writes += 1

    def delete(self, tag: bytes, key: bytes) -> bool:
        fk = tag + key
        if fk not in self.data:
            if fk in self.ssd_data:
                self._unlink(fk)
                return True
            return False
        expired = self.expires and fk in self.expires and self.expires[fk] <= now_ms()
        self._unlink(fk)
        return not expired

    def flush_scope(self, tag: bytes) -> int:
        doomed = [fk for fk in self.data if fk[:TAG_LEN] == tag]
        doomed += [fk for fk in self.ssd_data if fk[:TAG_LEN] == tag]
        for fk in doomed:
            self._unlink(fk)
        return len(doomed)

    def tracked_values(self):
        """(full key, tier, bytes, block hash) of every tracked value, for replication snapshots."""
        for fk, bhash in list(self.tracked.items()):
            value = self.data.get(fk)
            if value is not None:
                yield fk, CacheTier.DRAM, len(value), bhash
            elif fk in self.ssd_data:
                yield fk, CacheTier.SSD, self.ssd_data[fk].length, bhash

    # -- moves between tiers (driven by tiers/tiering.py) -----------------------
    def to_ssd(self, fk: bytes, block: Block, entry: Any) -> None:
        """`block` (unpinned, resident) now lives only on SSD as `entry`: free its DRAM.

        The key leaves the DRAM LRU (keeping its TTL-free life) and joins the SSD LRU.
        """
        self.data.pop(fk, None)  # eviction has already popped it
        self.ssd_data[fk] = entry
        block.ssd = None
        self.block_count -= 1
        self._free(block)
        if self.listener is not None:
            if fk not in self.tracked:
                self.tracked[fk] = None
            self.listener.placed(fk, CacheTier.SSD, entry.length, self.tracked[fk])

    def from_ssd(self, fk: bytes, block: Block, entry: Any) -> None:
        """A read brought `entry` back into DRAM as `block` (keeping the SSD copy)."""
        del self.ssd_data[fk]
        self.reserved_blocks -= 1
        self.held_bytes -= page_extent(block.length)
        block.state = BlockState.RESIDENT
        block.last_access = time.time()
        block.ssd = entry
        block.crc = entry.crc  # verified by the read
        self.block_count += 1
        self.data[fk] = block
        if self.listener is not None and fk in self.tracked:
            self.listener.placed(fk, CacheTier.DRAM, block.length, self.tracked[fk])

    def adopt_ssd(self, fk: bytes, entry: Any) -> None:
        """A block found on SSD at start (recovery) joins the keyspace."""
        self.ssd_data[fk] = entry
        self.per_scope[fk[:TAG_LEN]] += 1
        if self.listener is not None:
            self.tracked[fk] = None
            self.listener.placed(fk, CacheTier.SSD, entry.length, None)

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
            value = self.ssd_data.pop(fk)
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
        if t is not Block:  # an SsdEntry: its space goes once its deletion is logged
            self.tiering.drop(value)
            return
        if value.ssd is not None:
            self.tiering.drop(value.ssd)
            value.ssd = None
        self.block_count -= 1
        if value.pins:
            value.state = BlockState.EVICTING
            self.unlinked_pinned += 1
        else:
            self._free(value)

    def _free(self, block: Block) -> None:
        self.arena.release(block.handle)
        self.used -= page_extent(block.length)
        block.state = BlockState.GONE
        if self.on_free is not None:
            self.on_free()

    def _make_room(self, need: int) -> None:
        if self.tiering is not None and self.tiering.active:
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

        With a working SSD tier nothing is lost: only blocks whose bytes are
        already on SSD leave DRAM here (the demoter writes the others), and
        when there is none the caller waits for the demoter.
        """
        data = self.data
        if self.tiering is not None and self.tiering.active:
            for i, (fk, value) in enumerate(data.items()):
                if i >= LOSSLESS_SCAN:
                    break
                if type(value) is Block and value.ssd is not None and not value.pins:
                    self.to_ssd(fk, value, value.ssd)
                    self.stats["evictions_to_ssd"] += 1
                    return True
            self.tiering.wake()
            return False
        for _ in range(len(data)):
            fk, value = data.popitem(last=False)
            if type(value) is Block:
                if value.pins:
                    data[fk] = value  # in use: it is the most recent anyway
                    continue
                if value.ssd is not None:  # its bytes are safe on SSD (a failed tier still reads)
                    self.to_ssd(fk, value, value.ssd)
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
