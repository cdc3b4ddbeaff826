"""Reads of values this node lacks, from the peers the directory names (GETBLK, GET, MGET, EXISTS).

The directory (dir_link.py) says who holds a key; nothing is ever asked of every peer.
A block is read from a holder straight into this node's arena (`fetch`), its CRC32C
checked, and kept (`cluster.keep_fetched`), expiring when the holder's copy does.
Small values (at most `BATCH_VALUE_BYTES` by the directory's word) are read many at a
time: one `PEERMGET` per holder for up to `BATCH_KEYS` keys. Every transfer to one peer
goes through the pool's connections to it (at most its `per_peer` at once), and at most
`FETCHES_AT_ONCE` large transfers run at once for one read, so a read of thousands of keys
costs a few requests per holder, not a socket per key. (The transfers own the wire:
`Transfers.fetch_into` and `fetch_many`.)

A holder that fails (or is too slow) is not the end of a held key: the next holder the
directory names is tried, and each failed ask is counted (`pool_read_ask_failures`); a key
every holder failed is a miss counted in `pool_read_errors`, never an error reply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import crc32c

from quilld.cluster.dir_link import DirectoryLink
from quilld.cluster.peer_client import PeerError
from quilld.cluster.transfer import Transfers
from quilld.config import ClusterConfig
from quilld.errors import OutOfMemory, QuillError
from quilld.model import CacheTier, IdentityScope, Pinned
from quilld.tiers.expiry import MAX_DEADLINE_MS, now_ms
from quilld.tiers.keyspace import Keyspace

log = logging.getLogger("quilld.cluster")

BATCH_VALUE_BYTES = 64 * 1024  # values up to this size are read many to a request (PEERMGET)
BATCH_KEYS = 256  # keys per PEERMGET
FETCHES_AT_ONCE = 16  # large values of one read transferred at once (each also bounded per peer)
ASK_TIMEOUT = 5.0  # seconds a holder has to answer a batch


class PoolReads:
    def __init__(self, cfg: ClusterConfig, node_id: str, keyspace: Keyspace, link: DirectoryLink,
                 transfers: Transfers, addresses: dict[str, tuple[str, int]],
                 peer_meta: dict[str, dict], stats: Counter) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.keyspace = keyspace
        self.link = link
        self.transfers = transfers
        self.addresses = addresses
        self.peer_meta = peer_meta
        self.stats = stats
        self.observe_fetch: Callable[[float], None] = lambda seconds: None

    # -- whom to ask --------------------------------------------------------------------
    def _holders(self, places: list[tuple[str, list[CacheTier], int, int]]) -> list[tuple[str, int, int]]:
        """Peers to read from, DRAM copies first: (peer, bytes, version)."""
        out = [(h, nbytes, version, CacheTier.DRAM in tiers) for h, tiers, nbytes, version in places
               if h != self.node_id and h in self.addresses]
        out.sort(key=lambda p: not p[3])
        return [(h, n, v) for h, n, v, _ in out]

    # -- one key ------------------------------------------------------------------------
    async def fetch(self, scope: IdentityScope, tag: bytes, key: bytes) -> Any:
        """GETBLK: a key held only by peers, read into this node and verified; None if nobody has it.
        Raises PeerError when holders exist and none could serve it."""
        (places,) = await self.link.key_holders(tag, [key])
        return await self._from_holders(scope, tag, key, self._holders(places), strict=True)

    async def _from_holders(self, scope: IdentityScope, tag: bytes, key: bytes, holders: list[tuple[str, int, int]],
                            strict: bool) -> Any:
        last: QuillError | None = None
        for peer, _nbytes, version in holders:
            try:
                got = await self._fetch_from(peer, scope, key)
            except QuillError as e:
                last = e
                self.stats["pool_read_ask_failures"] += 1
                continue
            if got is not None:
                return self._deliver(tag, key, *got, version)
        if last is not None and strict:
            raise PeerError(f"no peer could serve the block: {last.message}")
        if last is not None:
            self.stats["pool_read_errors"] += 1
        return None

    async def _fetch_from(self, peer: str, scope: IdentityScope, key: bytes) -> tuple[Any, bytearray | None, int] | None:
        """`key` from `peer`, verified: (arena block, None, expiry) or (None, buffer of an inline-sized
        value, expiry); None when the peer does not have it. Raises QuillError when it failed;
        whatever it reserved is given back on every way out but success, cancellation included."""
        store = self.keyspace
        block = None
        buf: bytearray | None = None

        def target(length: int) -> memoryview:
            nonlocal block, buf
            if block is not None:  # called again (a fallback to TCP): the first reservation goes
                store.discard(block)
                block = None
            if length > store.inline_max:
                block = self._room(length)
                if block is not None:
                    return store.write_view(block)
            buf = bytearray(length)
            return memoryview(buf)

        addr = self.addresses.get(peer)
        if addr is None:
            raise PeerError(f"{peer} has no address")
        t0 = time.perf_counter()
        try:
            crc, view, expires = await self.transfers.fetch_into(peer, addr, self.peer_meta.get(peer), scope, key,
                                                                  target)
        except QuillError as e:
            if block is not None:
                store.discard(block)
            self.stats["peer_fetch_errors"] += 1
            log.warning("cluster: fetching from %s failed: %s", peer, e.message)
            raise
        except BaseException:  # cancelled mid-transfer (shutdown, a reply no longer wanted)
            if block is not None:
                store.discard(block)
            raise
        if view is None:  # the peer does not have it (the directory was behind)
            if block is not None:
                store.discard(block)
            self.stats["peer_fetch_stale"] += 1
            return None
        if crc32c.crc32c(view) != crc:
            if block is not None:
                store.discard(block)
            self.stats["peer_fetch_checksum_failures"] += 1
            raise PeerError(f"block from {peer} failed its checksum")
        if block is not None:
            block.crc = crc  # verified: a later peer reading it from here needs no recompute
        self.stats["peer_fetches"] += 1
        self.stats["peer_fetch_bytes"] += len(view)
        elapsed = time.perf_counter() - t0
        self.stats["peer_fetch_usec"] += int(elapsed * 1e6)
        self.observe_fetch(elapsed)
        return block, buf, expires

    def _room(self, length: int) -> Any:
        """An arena block for a fetched value of `length` bytes, or None when DRAM has no room
        free or evictable now: the value is then read into plain memory, answered and not kept
        (a copy for later never costs the read that asked for it, nor waits for the demoter)."""
        try:
            return self.keyspace.reserve(length)
        except OutOfMemory:
            if self.cfg.keep_fetched:
                self.stats["pool_keep_skipped"] += 1
            return None

    def _deliver(self, tag: bytes, key: bytes, block: Any, buf: bytearray | bytes | None, expires: int,
                 version: int) -> bytes | Pinned:
        """Answer with what was fetched; with keep_fetched, keep it too, expiring when the holder's does
        (a peer's expiry is range-checked here, the one way it enters this node's keyspace), at the
        version the directory named it with (the holder's value may be newer by now: then an owner
        finds the kept copy older than the newest and it is dropped, never the reverse)."""
        store = self.keyspace
        value = bytes(buf or b"") if block is None else block
        if expires > MAX_DEADLINE_MS or expires < -1:  # not a 64-bit unix time: answered, never kept
            log.warning("cluster: a peer's copy of a key came with an expiry out of range (%d): not kept", expires)
        in_time = expires == -1 or now_ms() < expires <= MAX_DEADLINE_MS  # (or expired on the way)
        if not (self.cfg.keep_fetched and in_time):
            return value if block is None else Pinned(store.view(block), lambda: store.discard(block))
        if block is None and len(value) > store.inline_max:  # no room was free for it: answered only
            return value
        self.link.keep_as(tag + key, version)
        try:
            store.publish(tag, key, value)
        except OutOfMemory:  # an inline value DRAM has no room for now: answered, not kept
            self.link.keep_as(tag + key, None)  # nothing was placed
            self.stats["pool_keep_skipped"] += 1
            return value
        self.stats["pool_kept"] += 1
        if expires != -1:
            store.set_expire(tag, key, expires)
        return value if block is None else store.pinned(block)

    # -- pool reads (GET, MGET, EXISTS) ---------------------------------------------------
    async def pool_read(self, scope: IdentityScope, tag: bytes, key: bytes) -> Any:
        """A key this node lacks, from the pool: bytes, a Pinned view, or None (nobody has it, or
        nobody could serve it: a miss, counted in pool_read_errors, never an error reply)."""
        return (await self.pool_read_many(scope, tag, [key]))[0]

    async def pool_read_many(self, scope: IdentityScope, tag: bytes, keys: list[bytes]) -> list:
        """Each key from the pool, as pool_read: one directory lookup for them all, then small
        values in batches per holder and large ones a few at a time."""
        self.stats["pool_reads"] += len(keys)
        try:
            places = await self.link.key_holders(tag, keys)
        except QuillError:
            self.stats["pool_read_errors"] += len(keys)
            return [None] * len(keys)
        out: list[Any] = [None] * len(keys)
        small: dict[str, list[int]] = {}
        large: list[int] = []
        holders = [self._holders(p) for p in places]
        for i, hs in enumerate(holders):
            if not hs:
                continue
            peer, nbytes, _version = hs[0]
            if nbytes <= BATCH_VALUE_BYTES:
                small.setdefault(peer, []).append(i)
            else:
                large.append(i)
        if not small and len(large) <= 1:  # one large value (a GET, a prefetch of one block): no tasks
            if large:
                i = large[0]
                out[i] = await self._from_holders(scope, tag, keys[i], holders[i], strict=False)
            hits = sum(v is not None for v in out)
            self.stats["pool_read_hits"] += hits
            return out
        retry: list[int] = []
        batches = [(peer, idx[j:j + BATCH_KEYS]) for peer, idx in small.items() for j in range(0, len(idx), BATCH_KEYS)]
        results = await asyncio.gather(*(self._batch(scope, tag, peer, [keys[i] for i in idx],
                                                     [holders[i][0][2] for i in idx]) for peer, idx in batches),
                                       return_exceptions=True)
        for (peer, idx), got in zip(batches, results):
            if isinstance(got, BaseException):
                if not isinstance(got, (QuillError, asyncio.TimeoutError)):
                    raise got
                self.stats["pool_read_ask_failures"] += 1
                retry += idx  # the next holder, one key at a time
                continue
            for i, value in zip(idx, got):
                out[i] = value
        gate = asyncio.Semaphore(FETCHES_AT_ONCE)

        async def one(i: int, skip_first: bool) -> None:
            async with gate:
                hs = holders[i][1:] if skip_first else holders[i]
                out[i] = await self._from_holders(scope, tag, keys[i], hs, strict=False)
                if out[i] is None and skip_first and not hs:  # its only holder failed: a miss, counted
                    self.stats["pool_read_errors"] += 1

        await asyncio.gather(*(one(i, False) for i in large), *(one(i, True) for i in retry))
        hits = sum(v is not None for v in out)
        self.stats["pool_read_hits"] += hits
        return out

    async def _batch(self, scope: IdentityScope, tag: bytes, peer: str, keys: list[bytes], versions: list[int]) -> list:
        """Small values of `keys` (named by the directory at `versions`) from `peer` in one PEERMGET,
        verified; a key it lacks is None."""
        addr = self.addresses.get(peer)
        if addr is None:
            raise PeerError(f"{peer} has no address")
        reply = await self.transfers.fetch_many(peer, addr, scope, keys, ASK_TIMEOUT)
        self.stats["pool_read_batches"] += 1
        out = []
        for key, version, item in zip(keys, versions, reply):
            if item is None:
                self.stats["peer_fetch_stale"] += 1
                out.append(None)
                continue
            crc, value, expires = item
            if crc32c.crc32c(value) != crc:
                self.stats["peer_fetch_checksum_failures"] += 1
                out.append(None)
                continue
            self.stats["peer_fetches"] += 1
            self.stats["peer_fetch_bytes"] += len(value)
            block = self._room(len(value)) if len(value) > self.keyspace.inline_max else None
            if block is not None:  # larger than the directory said: into the arena, if there is room
                self.keyspace.write_view(block)[:] = value
                block.crc = crc
                out.append(self._deliver(tag, key, block, None, expires, version))
            else:
                out.append(self._deliver(tag, key, None, value, expires, version))
        return out

    async def pool_has_many(self, tag: bytes, keys: list[bytes]) -> list[bool]:
        """EXISTS of keys this node lacks: the directory's word (no transfer)."""
        try:
            places = await self.link.key_holders(tag, keys)
        except QuillError:
            self.stats["pool_read_errors"] += len(keys)
            return [False] * len(keys)
        return [bool(self._holders(p)) for p in places]

    async def locate(self, tag: bytes, keys: list[bytes]) -> list[list[tuple[str, CacheTier, int]]]:
        """LOCATE: every other node holding each key, with its tier and bytes."""
        places = await self.link.key_holders(tag, keys)
        live = self.addresses  # peers alive now (a dead one's entries may still be on their way out)
        return [[(h, t, n) for h, tiers, n, _v in p if h in live for t in tiers] for p in places]
