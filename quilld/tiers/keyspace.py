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
two dicts. Inline values and blocks, with or without a TTL, all move down
and back the same way. A DRAM value whose bytes are also in the lower tier
(written by demotion but still pinned, or promoted back by a read) keeps that
entry: a Block in `block.lower`, an inline value in `small_copies[key]` (bytes
carry no attribute); evicting it from DRAM then loses nothing. A key's TTL
lives in `expires` wherever its value is; the lower tier keeps a copy's own
(tiering.py makes every change of it durable before it is acknowledged).

`used` (INFO's used_memory: arena pages plus inline bytes) is bounded by
`limit` (maxmemory, else the arena): without a working lower tier by eviction
(from the high watermark down to the low one; which values go is the maxmemory
policy's, eviction.py), a write that still cannot fit getting OutOfMemory; with one, the lower tier
demotes from the high watermark in the background, and a write that would take
`used` past `limit` gets OutOfMemory (the server retries it while the demoter
frees DRAM, up to server.space_wait_ms) instead of growing DRAM without bound;
a client's inline value may go 1/64 of `limit` past it (tier_moves.py `_admit`).

This module keeps what every GET and SET goes through (`lookup`, `get`, `reserve`,
`write_view`, `publish`, delete, eviction and the accounting behind them), so that path
makes no call it did not make before. The rest lives beside it, each on its own seam:

- expiry.py: `Expiry`, the TTL deadlines (`expires` here is its dict) and the heap the
  periodic sweep reads; ttl_verbs.py (mixin `TtlVerbs`): the TTL verbs built on it
  (`set_expire`, `ttl_ms`, `expire_time`, `set_ttl`, `persist`, `sweep_expired`).
- scope_keys.py: `ScopeKeys`, each enumerated scope's key array and SCAN's cursor rules;
  listing.py (mixin `Listing`): `keys_matching`, `scan`, `random_key` read it, and
  `facts` (OBJECT, MEMORY USAGE); `_added`/`_removed` below keep it.
- value_parts.py (mixin `ValueParts`): `size`, `read_slice`, `write_range`.
- renames.py (mixin `Renames`): `rename`, `copy`.
- tier_moves.py (mixin `TierMoves`): `demoted`, `promoted`, `adopt`, `below_only`,
  `bring_back`, and the books of a DRAM value's copy below (`copy_below`).

The mixins hold no state: they are methods of `Keyspace` kept in their own files, built on
its primitives and fields, and callers reach them as `keyspace.write_range(...)` as before.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any, Callable

import crc32c

from quilld.config import DramConfig
from quilld.errors import OutOfMemory, UnfilledLimit
from quilld.model import CacheTier, Pending, Pinned
from quilld.scopes import TAG_LEN, ScopeRegistry
from quilld.tiers.arena import NO_SPACE, DramArena
from quilld.tiers.block import Block, BlockState, page_extent
from quilld.tiers.chains import Chains
from quilld.tiers.eviction import Frequencies, victim
from quilld.tiers.expiry import Expiry, now_ms
from quilld.tiers.listing import Listing
from quilld.tiers.renames import Renames
from quilld.tiers.scope_keys import ScopeKeys
from quilld.tiers.tier import LowerTier
from quilld.tiers.tier_moves import TierMoves
from quilld.tiers.ttl_verbs import TtlVerbs
from quilld.tiers.value_parts import ValueParts

LOSSLESS_SCAN = 2000  # DRAM entries looked at for a block already in the lower tier before waiting for it


class Keyspace(ValueParts, Renames, TierMoves, TtlVerbs, Listing):
    def __init__(self, cfg: DramConfig, scopes: ScopeRegistry, max_unfilled: int = 0) -> None:
        """`max_unfilled`: bytes one tenant's unfilled reservations may hold (0: a quarter of the arena)."""
        self.cfg = cfg
        self.scopes = scopes
        self.arena = DramArena(cfg.size, cfg.memory_file)
        self.capacity = self.arena.capacity
        self.limit = min(cfg.maxmemory or self.capacity, self.capacity)  # maxmemory: `used` stays below it
        self.high_bytes = int(self.limit * cfg.high_watermark)
        self.low_bytes = int(self.limit * cfg.low_watermark)
        self.inline_max = cfg.inline_max
        self.policy = ""  # maxmemory-policy (eviction.py), set by set_policy
        self.lfu = Frequencies()  # the LFU counters and their tuning (lfu-log-factor, lfu-decay-time)
        self.freq: Frequencies | None = None  # `lfu` under an LFU policy, else None: no counting
        self.set_policy(cfg.maxmemory_policy)
        # reservations awaiting clients' bytes (see reserve): by tenant, and in all
        self.unfilled: dict[str, int] = {}
        self.unfilled_bytes = 0
        self.max_unfilled_all = int(self.capacity * cfg.max_unfilled_share)
        self.max_unfilled = max_unfilled or self.capacity // 4
        self.data: OrderedDict[bytes, bytes | Block] = OrderedDict()
        self.lower: OrderedDict[bytes, Any] = OrderedDict()  # keys only in the lower tier -> its entry
        self.small_copies: dict[bytes, Any] = {}  # inline values in DRAM whose bytes the lower tier also holds
        self.lower_tier: LowerTier | None = None  # the tier below DRAM (tiering.py installs the SSD tier)
        self.on_free: Any = None  # called when arena space is given back (wakes writers waiting for it)
        self.ttls = Expiry()  # TTLs and their heap (expiry.py)
        self.expires = self.ttls.at  # full key -> when it expires: read here with no call in between
        self.active_expire = True  # False: the sweep reclaims nothing, only reads do (DEBUG SET-ACTIVE-EXPIRE 0)
        self.per_scope: Counter[bytes] = Counter()
        # the keys of each scope that was ever enumerated (KEYS, SCAN, RANDOMKEY), in arrays laid
        # out by scope_keys.py; `_added`/`_removed` keep them up to date through these two names
        # for its dicts, inline: a node nobody enumerates pays one truth test per new or gone key,
        # and one that does pays no call
        self.enumerated = ScopeKeys()
        self._scope_keys = self.enumerated.arrays
        self._slot = self.enumerated.slot
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
        self.chains = Chains()  # which blocks follow which: LRU eviction takes a chain's tail first
        # placed(fk, tier, nbytes, bhash): written; moved(...): the same value now in another tier
        # (or recovered at start); removed(fk, bhash): gone from this node, for whatever reason
        self.listener: Any = None
        # called with a key's full name once a client deleted it (DEL, UNLINK, GETDEL, a flush,
        # renamed away): not for an expiry or an eviction. The cluster records the delete
        self.deleted: Callable[[bytes], None] | None = None
        self.track_all = False  # in a cluster every value is tracked: the directory places them all
        # called with a key's full name once it has changed: written, deleted, expired, evicted, its
        # TTL set or removed (never for a move between tiers); WATCH and CLIENT TRACKING set it while in use
        self.touched: Callable[[bytes], None] | None = None
        # full key -> the label (OBJECT ENCODING's) a caller gave its inline value, when its bytes
        # alone do not say it (a string redis edited in place is "raw"); replaced values lose it
        self.labels: dict[bytes, bytes] = {}
        # the same-host lookup table (lookup_table.py), when clients may map the arena: told (`drop`)
        # before a key's block stops being its value, so that a reader's copy of it is never trusted
        self.lookup_table: Any = None
        # a delete/publish/flush_scope released a copy in the lower tier whose deletion is not
        # durable yet: whoever acknowledges it waits for `take_unsynced()` first
        self.unsynced = False
        self.hits: Counter[bytes] = Counter()  # scope tag -> lookups that found a value
        self.misses: Counter[bytes] = Counter()
        self.writes = 0
        # plain key -> the tag (or set of tags) holding it, kept from the first miss once there are
        # two scopes: a miss then tells in O(1) whether another identity holds the same key
        self._owners: dict[bytes, Any] | None = None
        self._retired: Counter[tuple[str, str]] = Counter()  # (tenant, hits|misses) of released scopes
        scopes.on_release.append(self._fold)

    # -- accounting --------------------------------------------------------
    def lookups_of(self, tenant: str | None = None) -> tuple[int, int]:
        """(hits, misses) of one tenant's lookups, or (None) of everyone's."""
        if tenant is None:
            return (sum(self.hits.values()) + sum(n for (_, k), n in self._retired.items() if k == "hits"),
                    sum(self.misses.values()) + sum(n for (_, k), n in self._retired.items() if k == "misses"))
        scope_of = self.scopes.scope_of
        hits = sum(n for tag, n in self.hits.items() if scope_of(tag).tenant == tenant)
        misses = sum(n for tag, n in self.misses.items() if scope_of(tag).tenant == tenant)
        return hits + self._retired[(tenant, "hits")], misses + self._retired[(tenant, "misses")]

    def reset_lookups(self) -> None:
        self.hits.clear()
        self.misses.clear()
        self._retired.clear()
        self.writes = 0

    def _fold(self, tag: bytes, scope: Any) -> None:
        """A scope is released: its lookup counts stay, under its tenant."""
        self._retired[(scope.tenant, "hits")] += self.hits.pop(tag, 0)
        self._retired[(scope.tenant, "misses")] += self.misses.pop(tag, 0)

    def set_policy(self, name: str) -> None:
        """Which value goes when DRAM is full (redis's maxmemory-policy, see eviction.py); switching
        to an LFU policy starts every key's counter afresh, as a new key's."""
        self.policy = name
        if "lfu" not in name:
            self.freq = None
            self.lfu.at.clear()
        else:
            self.freq = self.lfu

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
                if self.expires and fk in self.expires and self.expires[fk] <= now_ms():
                    self._unlink(fk)
                    self.stats["expired"] += 1
                    self.misses[tag] += 1
                    return None
                self.lower.move_to_end(fk)
                self.hits[tag] += 1
                if self.freq is not None:
                    self.freq.hit(fk)
                return value
        if value is None:
            self.misses[tag] += 1
            self._audit(tag, key)
            return None
        if self.expires and fk in self.expires and self.expires[fk] <= now_ms():
            self._unlink(fk)
            self.stats["expired"] += 1
            self.misses[tag] += 1
            return None
        self.data.move_to_end(fk)
        self.hits[tag] += 1
        if type(value) is Block:
            value.last_access = time.time()
        if self.freq is not None:
            self.freq.hit(fk)
        return value

    def _audit(self, tag: bytes, key: bytes) -> None:
        """After a miss in `tag`: if another scope holds the same key, count a refused reuse."""
        if self._owners is None:
            if len(self.scopes) < 2:
                return  # one identity only: a miss is a miss
            self._track_owners()
        owner = self._owners.get(bytes(key))
        if owner is not None and owner != tag:
            self.scopes.refused(tag, owner)  # one tag, or the set of them: the closest one is counted

    def contains(self, tag: bytes, key: bytes) -> bool:
        fk = tag + key
        if fk not in self.data:
            if fk in self.lower:
                if self.expires and fk in self.expires and self.expires[fk] <= now_ms():
                    self._unlink(fk)
                    self.stats["expired"] += 1
                    return False
                return True
            self._audit(tag, key)
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
            below = self.copy_below(tag + key, value)
        if below is not None:
            out.append((self.lower_tier.tier, below.length, None))
        return out

    def peer_copy(self, tag: bytes, key: bytes, with_expiry: bool = False) -> list | Pending | None:
        """`[crc32c, bytes | Pinned]` of this node's copy, for a peer; None when there is none.
        `with_expiry` adds when it expires (unix ms), or -1."""
        value = self.lookup(tag, key)
        if value is None:
            return None
        tail = [self.expires.get(tag + key, -1)] if with_expiry else []
        if value.__class__ is Block:
            pinned = self.pinned(value)
            if value.crc is None:  # published blocks never change: compute once, serve many
                value.crc = crc32c.crc32c(pinned.view)
            return [value.crc, pinned, *tail]
        if value.__class__ is bytes:
            return [crc32c.crc32c(value), value, *tail]
        return Pending(self._lower_copy(value, tail))  # only on the lower tier

    async def _lower_copy(self, entry: Any, tail: list) -> list:
        data = await self.lower_tier.read_bytes(entry)  # verified against entry.crc
        return [entry.crc, data, *tail]

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
    def reserve(self, nbytes: int, owner: str | None = None, extra: int = 0) -> Block:
        """Space for a block of `nbytes`, invisible until published.

        Evicts least-recently-used unpinned values as needed; raises
        OutOfMemory when the value cannot fit even after that.

        `owner` is the tenant whose bytes will fill it (a client's payload or put, as
        opposed to the node's own reads from SSD or peers): until published, what all
        clients reserve may hold at most `dram.max_unfilled_share` of the arena (only
        within it does a reservation evict other values before its bytes arrive), and
        one tenant at most `max_unfilled` bytes. `extra`: bytes besides the block checked with it
        in one go and counted until `release_unfilled` (an open put's key and bookkeeping).
        """
        if nbytes > self.capacity:
            raise OutOfMemory(f"value of {nbytes} bytes is larger than the DRAM arena ({self.capacity} bytes)")
        need = page_extent(nbytes)
        if need > min(self.capacity, self.limit) - self.held_bytes:  # evicting everything would not be enough
            raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")
        if owner is not None:
            self._check_unfilled(owner, need + extra)
        self._make_room(need)
        if self.used + need > self.limit:  # nothing more may go now (the policy, pins, the demoter's pace)
            tier = self.lower_tier
            if tier is not None and tier.active:
                tier.wake()  # the demoter frees DRAM; the server retries the write meanwhile
            raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")
        handle = self.arena.reserve(nbytes)
        while handle == NO_SPACE:
            if not self._evict_one():
                raise OutOfMemory("command not allowed when used memory > 'maxmemory'.")
            handle = self.arena.reserve(nbytes)
        self.reserved_blocks += 1
        self.used += need
        self.held_bytes += need
        block = Block(handle, nbytes)
        if owner is not None:
            block.owner = owner
            self._count_unfilled(owner, need + extra)
        return block

    def hold_unfilled(self, owner: str, n: int) -> None:
        """Count `n` bytes that are not the arena's (an open put's key and bookkeeping) with the
        tenant's unfilled reservations, refused as a reservation would be; `release_unfilled`
        gives them back."""
        self._check_unfilled(owner, n)
        self._count_unfilled(owner, n)

    def _count_unfilled(self, owner: str, n: int) -> None:
        self.unfilled[owner] = self.unfilled.get(owner, 0) + n
        self.unfilled_bytes += n

    def release_unfilled(self, owner: str, n: int) -> None:
        left = self.unfilled[owner] - n
        if left:
            self.unfilled[owner] = left
        else:
            del self.unfilled[owner]
        self.unfilled_bytes -= n

    def _check_unfilled(self, owner: str, need: int) -> None:
        """Refuse a reservation that would take unfilled ones past their caps. A tenant's first
        is always allowed, as any value that fits the arena was before: so a tenant whose
        payloads stall (until server.payload_timeout_ms cuts them off) never holds up another
        tenant's write, and the caps bound what one tenant's second and later ones may hold."""
        mine = self.unfilled.get(owner, 0)
        if not mine:
            return
        if mine + need > self.max_unfilled:
            self.stats["unfilled_refused"] += 1
            raise UnfilledLimit(f"tenant '{owner}' already waits for {mine} bytes of payloads and open puts "
                                f"(limit {self.max_unfilled}, security.max_unfilled_bytes_per_tenant)")
        if self.unfilled_bytes + need > self.max_unfilled_all:
            self.stats["unfilled_refused"] += 1
            raise UnfilledLimit(f"payloads and open puts already hold {self.unfilled_bytes} bytes of the arena "
                                f"(limit {self.max_unfilled_all}, dram.max_unfilled_share)")

    def _filled(self, block: Block) -> None:
        """A client's reservation is published or given back: it no longer counts as awaited."""
        owner = block.owner
        block.owner = None
        self.release_unfilled(owner, page_extent(block.length))

    def space_may_free(self) -> bool:
        """Whether space is held only for now: by readers' pins, puts in progress, or
        blocks the lower tier is about to take."""
        return self.active_pins > 0 or self.reserved_blocks > 0 or (
            self.lower_tier is not None and self.lower_tier.active and (self.block_count > 0 or self.inline_bytes > 0))

    def discard(self, block: Block) -> None:
        """Give back a reservation that will never be published."""
        if block.unpublished:
            self.reserved_blocks -= 1
            self.held_bytes -= page_extent(block.length)
            if block.owner is not None:
                self._filled(block)
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
                bhash: int | bytes | None = None, parent: int | bytes | None = None) -> None:
        """Make `value` the visible value of `key`, replacing (and releasing) any old one.

        `bhash` names the engine block the value holds; ROUTE then credits it. `parent` names
        the block before it in its chain (chains.py: eviction keeps the chain's head).
        """
        fk = tag + key
        data = self.data
        if value.__class__ is bytes and self.used + len(value) > self.limit:
            self._admit(fk, len(value))  # before anything changes: may raise OutOfMemory
        table = self.lookup_table
        if table is not None:
            table.drop(fk)  # before the old value is released
        if self.tracked:
            self._forget(fk)
        listener = self.listener
        if listener is not None and (bhash is not None or value.__class__ is Block or self.track_all):
            self.tracked[fk] = bhash
            listener.placed(fk, CacheTier.DRAM, len(value), bhash)
        old = data.pop(fk, None)
        if old is None and self.lower:
            old = self.lower.pop(fk, None)
        if self.freq is not None:  # an overwrite keeps the key's counter, as redis's dbOverwrite
            self.freq.created(fk) if old is None else self.freq.hit(fk)
        if self.labels:
            self.labels.pop(fk, None)
        if old is None:
            self._added(fk)
        else:
            if old.__class__ is bytes:
                self.inline_bytes -= len(old)
                self.used -= len(old)
                if self.lower_tier is not None and self._small_below(fk):
                    self.unsynced = True
            elif self._release_value(old, fk):
                self.unsynced = True
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
            if value.owner is not None:
                self._filled(value)
            value.to(BlockState.RESIDENT)
            value.last_access = time.time()
            self.block_count += 1
        data[fk] = value
        self.writes += 1
        chains = self.chains
        if chains.block_of and fk in chains.block_of:
            chains.removed(fk)  # an overwrite: the old block's links go
        if bhash is not None:
            chains.added(fk, tag, bhash, parent)
        if table is not None and value.__class__ is Block:
            table.add(fk, value)
        if self.touched is not None:
            self.touched(fk)

    def delete(self, tag: bytes, key: bytes) -> bool:
        fk = tag + key
        if fk not in self.data:
            if fk in self.lower:
                self._unlink(fk)
                self.unsynced = True
                if self.deleted is not None:
                    self.deleted(fk)
                return True
            return False
        expired = self.expires and fk in self.expires and self.expires[fk] <= now_ms()
        if self._unlink(fk):
            self.unsynced = True
        if self.deleted is not None and not expired:
            self.deleted(fk)
        return not expired

    def flush_scope(self, tag: bytes) -> int:
        doomed = [fk for fk in self.data if fk[:TAG_LEN] == tag]
        doomed += [fk for fk in self.lower if fk[:TAG_LEN] == tag]
        for fk in doomed:
            if self._unlink(fk):
                self.unsynced = True
            if self.deleted is not None:
                self.deleted(fk)
        return len(doomed)

    def take_unsynced(self):
        """After delete/publish/flush_scope: None when they released no copy in the lower tier
        (no awaitable, no allocation); else an awaitable that resolves once the deletion of
        every such copy is durable (raising if it cannot be made so). A caller acknowledging
        the change to a client answers only then, so no crash brings the old bytes back."""
        if not self.unsynced:
            return None
        self.unsynced = False
        return self.lower_tier.synced()

    def track_everything(self) -> None:
        """Track every value from now on, and every value already here (small ones recovered from
        the lower tier at start among them): a node joining a cluster places them all."""
        self.track_all = True
        tracked = self.tracked
        for fk in (*self.data, *self.lower):
            if fk not in tracked:
                tracked[fk] = None

    def tracked_values(self):
        """(full key, tier, bytes, block hash) of every tracked value, for replication snapshots."""
        for fk, bhash in list(self.tracked.items()):
            value = self.data.get(fk)
            if value is not None:
                yield fk, CacheTier.DRAM, len(value), bhash
            elif fk in self.lower:
                yield fk, self.lower_tier.tier, self.lower[fk].length, bhash

    # -- internals ---------------------------------------------------------
    def _added(self, fk: bytes) -> None:
        """A key joined the keyspace: its scope is held while it has keys, and owners are kept."""
        tag = fk[:TAG_LEN]
        per_scope = self.per_scope
        n = per_scope[tag]
        per_scope[tag] = n + 1
        if not n:
            self.scopes.hold(tag)
        if self._scope_keys:  # some scope was enumerated: keep its array (scope_keys.py) up to date
            keys = self._scope_keys.get(tag)
            if keys is not None:
                self._slot[fk] = len(keys)
                keys.append(fk)
        if self._owners is not None:
            key = fk[TAG_LEN:]
            owner = self._owners.get(key)
            if owner is None:
                self._owners[key] = tag
            elif owner.__class__ is bytes:
                self._owners[key] = {owner, tag}
            else:
                owner.add(tag)

    def _removed(self, fk: bytes) -> None:
        if self.lookup_table is not None:  # before its value is released
            self.lookup_table.drop(fk)
        if self.chains.block_of:
            self.chains.removed(fk)
        tag = fk[:TAG_LEN]
        if self._scope_keys:
            keys = self._scope_keys.get(tag)
            if keys is not None:  # swap-remove: the scope's last key takes the freed slot
                i = self._slot.pop(fk)
                last = keys.pop()
                if i < len(keys):
                    keys[i] = last
                    self._slot[last] = i
                elif not keys:
                    del self._scope_keys[tag]
        n = self.per_scope[tag] - 1
        if n:
            self.per_scope[tag] = n
        else:
            del self.per_scope[tag]
            self.scopes.drop(tag)
        if self._owners is not None:
            key = fk[TAG_LEN:]
            owner = self._owners.get(key)
            if owner.__class__ is bytes:
                del self._owners[key]
            elif owner is not None:
                owner.discard(tag)
                if len(owner) == 1:
                    self._owners[key] = owner.pop()
        if self.freq is not None:
            self.freq.forget(fk)
        if self.labels:
            self.labels.pop(fk, None)
        if self.touched is not None:  # deleted, expired, evicted or renamed away
            self.touched(fk)

    def _track_owners(self) -> None:
        """Start keeping key -> scope tag(s), so a miss finds another scope's copy in O(1)."""
        owners: dict[bytes, Any] = {}
        for fk in list(self.data) + list(self.lower):
            key, tag = fk[TAG_LEN:], fk[:TAG_LEN]
            owner = owners.get(key)
            if owner is None:
                owners[key] = tag
            elif owner.__class__ is bytes:
                owners[key] = {owner, tag}
            else:
                owner.add(tag)
        self._owners = owners

    def _forget(self, fk: bytes) -> None:
        if fk in self.tracked:
            self.listener.removed(fk, self.tracked.pop(fk))

    def _unlink(self, fk: bytes) -> bool:
        """Remove `fk`; True when a copy in the lower tier is being deleted (see _release_value)."""
        if self.tracked:
            self._forget(fk)
        value = self.data.pop(fk, None)
        if value is None:
            value = self.lower.pop(fk)
        self._removed(fk)
        if self.expires:
            self.expires.pop(fk, None)
        return self._release_value(value, fk)

    def _release_value(self, value: Any, fk: bytes) -> bool:
        """Release `fk`'s value leaving the keyspace. True when that deletes a copy in the lower
        tier (its own entry, a DRAM value's copy, or the copy a write in flight is making):
        the deletion is durable only once `lower_tier.synced()` says so."""
        t = type(value)
        if t is bytes:
            self.inline_bytes -= len(value)
            self.used -= len(value)
            return self.lower_tier is not None and self._small_below(fk)
        if t is not Block:  # a lower tier's entry: its space goes once its deletion is durable
            self.lower_tier.drop(value)
            return True
        below = False
        if value.lower is not None:
            self.lower_tier.drop(value.lower)
            value.lower = None
            below = True
        self.block_count -= 1
        if value.pins:
            value.to(BlockState.EVICTING)
            self.unlinked_pinned += 1
            if self.lower_tier is not None and self.lower_tier.writing(value):
                below = True
        else:
            self._free(value)
        return below

    def _free(self, block: Block) -> None:
        self.arena.release(block.handle)
        self.used -= page_extent(block.length)
        block.to(BlockState.GONE)
        if self.on_free is not None:
            self.on_free()

    def fit(self) -> None:
        """`limit` or the watermarks just moved (CONFIG SET maxmemory): make room now, as redis
        evicts at once, rather than at the next write; with a lower tier the demoter is woken."""
        self._make_room(0)
        if self.lower_tier is not None and self.lower_tier.active and self.used > self.high_bytes:
            self.lower_tier.wake()

    def _make_room(self, need: int) -> None:
        if self.lower_tier is not None and self.lower_tier.active:
            # the demoter keeps use between the watermarks in the background; here only
            # make room when DRAM is really full (maxmemory, or the arena)
            while self.used + need > self.limit:
                if not self._evict_one():
                    return
            return
        if self.used + need <= self.high_bytes:
            return
        while self.used + need > self.low_bytes:
            if not self._evict_one():
                return

    def _evict_one(self) -> bool:
        """Evict the least-recently-used unpinned value (or the one the maxmemory policy
        chooses, eviction.py); False when none can go.

        With a working lower tier nothing is lost: only blocks whose bytes are
        already there leave DRAM here (its demoter writes the others), and
        when there is none the caller waits for the demoter.
        """
        data = self.data
        copies = self.small_copies
        if self.lower_tier is not None and self.lower_tier.active:
            for i, (fk, value) in enumerate(data.items()):
                if i >= LOSSLESS_SCAN:
                    break
                if type(value) is Block:
                    if value.lower is not None and not value.pins:
                        self.demoted(fk, value, value.lower)
                        self.stats["evictions_to_ssd"] += 1
                        return True
                elif copies and fk in copies:
                    self.demoted(fk, value, copies[fk])
                    self.stats["evictions_to_ssd"] += 1
                    return True
            self.lower_tier.wake()
            return False
        if self.policy != "allkeys-lru":
            fk = victim(self.policy, data, self.expires, self.freq, _evictable)
            if fk is None:
                return False
            self._evict(fk, data.pop(fk))
            return True
        chains = self.chains
        if chains.parent or chains.orphans:  # blocks in chains: a chain's tail before its head
            front = next(iter(data), None)
            if front is not None:
                fk = chains.victim(front, lambda k: k in data and _evictable(data[k]))
                if fk != front:
                    self._evict(fk, data.pop(fk))
                    self.stats["evictions_chain_tail"] += 1
                    return True
        for _ in range(len(data)):
            fk, value = data.popitem(last=False)
            if type(value) is Block and value.pins:
                data[fk] = value  # in use: it is the most recent anyway
                continue
            self._evict(fk, value)
            return True
        return False

    def _evict(self, fk: bytes, value: bytes | Block) -> None:
        """`fk`'s `value` (unpinned, just popped from DRAM) leaves it: for its copy below when it
        has one (a failed tier still reads), else out of the keyspace."""
        copies = self.small_copies
        if type(value) is Block:
            if value.lower is not None:
                self.demoted(fk, value, value.lower)
                self.stats["evictions_to_ssd"] += 1
                return
        elif copies and fk in copies:
            self.demoted(fk, value, copies[fk])
            self.stats["evictions_to_ssd"] += 1
            return
        self._removed(fk)
        if self.expires:
            self.expires.pop(fk, None)
        if self.tracked:
            self._forget(fk)
        self._release_value(value, fk)
        self.stats["evictions"] += 1

    def close(self) -> None:
        self.data.clear()
        self.small_copies.clear()
        try:
            self.arena.close()
        except BufferError:  # a view is still exported somewhere; the OS reclaims it at exit
            pass


def _evictable(value: bytes | Block) -> bool:
    return type(value) is not Block or not value.pins
