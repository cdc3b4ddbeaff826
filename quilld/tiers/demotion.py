"""Demotion: DRAM values written to the SSD tier in group commits, then freed from DRAM.

`Demotion` is mixed into `Tiering` (tiering.py) and keeps its state there. While DRAM
use is above the high watermark (of maxmemory), a background task takes the coldest
values (least recently used first) that are not pinned, up to `ssd.group_commit_bytes`
per batch: arena blocks and inline values alike, with or without a TTL (the TTL goes
into the block's header and PUT record, and stays in the keyspace's `expires`). It
pins the blocks, writes the batch to SSD in one group commit (payloads written by the
SSD tier's I/O threads and synced, then one WAL sync) and only then frees their DRAM,
so a value is never in neither place. A small value is one page on SSD (ssd_format.py:
packed), so a small value costs no more than a block's head.

Batches are pipelined: the next batch's values are written while the previous one's
fdatasyncs run (`_start_batch`, `_commit_and_settle`), at most one commit in flight,
commits (and so WAL records and settles) in batch order. A value read, overwritten,
deleted, renamed or given a new TTL meanwhile is handled when its batch settles
(`_settle`): a pinned block keeps its SSD copy as `block.lower`; a changed value's stale
copy is dropped; a value whose only change is its TTL gets a META record with the new
one. Whoever acknowledged such a change waits for that (ssd_changes.py).

A value the SSD format cannot hold (an expiry past its i64, wal.Unstorable) is refused
alone, before its batch is written: it stays in DRAM, is logged and counted
(`ssd_unstorable`), and is not picked again while it is the key's value
(`unstorable_held` is what /healthz reports). Any other error staging or writing a batch
gives every value of that batch back (its extents freed, its blocks unpinned) and leaves
the tier working: no error leaves a value pinned or a batch half taken.
"""

from __future__ import annotations

import asyncio
import logging
import time

from quilld.scopes import TAG_LEN
from quilld.tiers.block import Block, BlockState, page_extent
from quilld.tiers.expiry import now_ms
from quilld.tiers.ssd import PendingWrite
from quilld.tiers.ssd_format import SsdFailure
from quilld.tiers.wal import Unstorable, check_expire

log = logging.getLogger("quilld.ssd")

DEMOTE_INTERVAL = 0.02  # seconds between checks of the DRAM watermark
SCAN_LIMIT = 20_000  # DRAM entries looked at per demotion batch (bounds one loop turn)
DELETE_BATCH = 4096  # SSD-only keys evicted per pass when the SSD is full
UNSTORABLE_KEPT = 1024  # refused values remembered (not picked again); past it, those gone are forgotten

Item = tuple[bytes, "bytes | Block", PendingWrite]  # full key, DRAM value, its write


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Demotion:
    """Tiering methods that move DRAM values to SSD (mixed into `Tiering`)."""

    async def _demoter(self) -> None:
        store = self.store
        while not self._stopping:
            await self._wait_for_work()
            self._wake.clear()
            try:
                if self._committing is not None and self._committing.done():
                    await self._drain()  # its outcome (and any error) is taken here
                while self.active and not self._stopping and (
                        store.used - self._inflight > store.high_bytes or self._pressure):
                    self._pressure = False
                    if not await self._start_batch():
                        break
                # the last batch's commit may still run: the next wake-up starts the next batch
                # at once (overlapping it), or collects the commit
                if self.active and self.ssd.needs_checkpoint():
                    await self._drain()
                    n = await self._checkpoint()
                    if n is not None:
                        self.stats["checkpoints"] += 1
                        log.info("ssd tier: checkpoint of %d blocks", n)
                await self._take_census()
            except SsdFailure as e:
                self._failed(e)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("ssd demotion failed")
                await asyncio.sleep(0.5)
        await self._drain()

    async def _wait_for_work(self) -> None:
        """Until a wake-up, the commit in flight ends, or DEMOTE_INTERVAL passes."""
        wake = asyncio.ensure_future(self._wake.wait())
        waits = {wake} if self._committing is None else {wake, self._committing}
        try:
            await asyncio.wait(waits, timeout=DEMOTE_INTERVAL, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()

    async def _checkpoint(self) -> int | None:
        """Seal the log once every deletion logged so far is scrubbed, then merge: a
        checkpoint drops records only after the scrubs they made due are synced."""
        async with self._flush_lock:
            await self._flush_locked()
            upto = await self._run(self.ssd.seal)
        return await self._run(self.ssd.checkpoint, upto)

    def _pick(self, everything: bool = False) -> list[tuple[bytes, bytes | Block]]:
        """The coldest values that can be written now (unpinned resident blocks, inline values
        not already in flight; none that has expired), enough to get under the low watermark
        (or all of them)."""
        store = self.store
        # at least a quarter of DRAM (maxmemory) per group commit, so a small one does not pay
        # an fsync pair for every few blocks (fsyncs dominate demotion time)
        used = store.used - self._inflight  # what the batches in flight will free is taken
        want = used if everything else max(used - store.low_bytes, store.limit // 4)
        budget = min(want, self.cfg.group_commit_bytes)
        picked, total = [], 0
        expires, now, writing, refused = store.expires, now_ms(), self._writing, self._unstorable
        for i, (fk, value) in enumerate(store.data.items()):
            if i >= SCAN_LIMIT or total >= budget:
                break
            if type(value) is Block:
                if value.pins or value.state is not BlockState.RESIDENT:
                    continue
                cost = page_extent(value.length)  # pages, as DRAM use is counted
            else:
                if writing and fk in writing:
                    continue  # one write of a key's inline value at a time
                cost = len(value)
            if expires and fk in expires and expires[fk] <= now:
                continue  # expired: the sweep reclaims it
            if refused and fk in refused and refused[fk] == (id(value), expires.get(fk, 0)):
                continue  # the SSD tier cannot hold it (refused once, said then)
            picked.append((fk, value))
            total += cost
        return picked

    async def _demote_batch(self, everything: bool = False) -> bool:
        """Write one group of cold values to SSD and free their DRAM, settled on return; False
        when nothing moved."""
        started = await self._start_batch(everything)
        return await self._drain() or started

    async def _start_batch(self, everything: bool = False) -> bool:
        """Pick and write one group of cold values, then leave its commit and settling to a
        task (`_committing`) that runs while the next batch is written; False when nothing
        moved or could be started. The commit of the batch before is waited for first: one
        commit in flight at most, in order.

        While a batch is in flight its values are `_writing` (blocks by object, inline values
        by key): one changed meanwhile (deleted, overwritten, renamed, a new TTL) makes whoever
        acknowledges the change wait for the batch to settle, since the settling drops or
        retimes the copy the write just made durable."""
        picked = self._pick(everything)
        if not picked:
            return await self._drain()
        clean = self._free_clean(picked)
        batch = asyncio.get_running_loop().create_future()
        items = await self._stage(picked, batch)
        if not items:
            batch.set_result(None)
            return bool(clean)
        inflight = sum(_dram_cost(v) for _, v, _ in items)
        self._inflight += inflight
        if self._busy_since is None:
            self._busy_since = time.perf_counter()
        t0 = time.perf_counter()
        ok = False
        try:
            ok = await self._write(items)
        finally:
            if not ok:
                self._end_batch(items, batch, inflight)
        if not ok:
            return False
        await self._drain()
        self._committing = asyncio.ensure_future(self._commit_and_settle(items, batch, inflight, t0))
        return True

    async def _drain(self) -> bool:
        """Wait for the commit in flight, if any; whether it moved values."""
        task, self._committing = self._committing, None
        if task is None:
            return False
        return await asyncio.shield(task)

    async def _commit_and_settle(self, items: list[Item], batch: asyncio.Future, inflight: int, t0: float) -> bool:
        try:
            try:
                await self._run(self.ssd.commit, [it for _, _, it in items])
            except Exception as e:  # noqa: BLE001 - whatever it was, the batch is given back
                self._give_back(items, e)
                return False
            moved = self._settle(items)
        finally:
            self._end_batch(items, batch, inflight)
        elapsed = time.perf_counter() - t0
        log.debug("ssd demotion: %d values (%s) written and committed in %.1f ms", len(items), _mib(moved),
                  elapsed * 1e3)
        self.stats["demotions"] += len(items)
        self.stats["demoted_bytes"] += moved
        self.stats["demote_batches"] += 1
        self.observe_demotion(elapsed)
        return True

    def _end_batch(self, items: list[Item], batch: asyncio.Future, inflight: int) -> None:
        """A batch settled (or failed): its values are no longer in flight; its waiters go on.
        demote_usec counts the time with at least one batch in flight (overlaps once)."""
        for fk, value, _ in items:
            k = value if type(value) is Block else fk
            if self._writing.get(k) is batch:
                del self._writing[k]
        self._inflight -= inflight
        if not batch.done():
            batch.set_result(None)
        if not self._writing and self._busy_since is not None:
            self.stats["demote_usec"] += int((time.perf_counter() - self._busy_since) * 1e6)
            self._busy_since = None

    def _free_clean(self, picked: list[tuple[bytes, bytes | Block]]) -> int:
        """Values whose bytes are already on SSD (promoted earlier): just free their DRAM."""
        store = self.store
        clean = [(fk, v, store.copy_below(fk, v)) for fk, v in picked]
        clean = [c for c in clean if c[2] is not None]
        for fk, value, entry in clean:
            store.demoted(fk, value, entry)
            self.stats["demoted_clean"] += 1
        return len(clean)

    async def _stage(self, picked: list[tuple[bytes, bytes | Block]], batch: asyncio.Future) -> list[Item]:
        """Pin each block still to be written, note each value in flight, and give each an SSD
        extent (making room if need be), with its TTL as it is now."""
        store, ssd = self.store, self.ssd
        items: list[Item] = []
        for fk, value in picked:
            block = type(value) is Block
            if store.data.get(fk) is not value or (block and (value.lower is not None
                                                              or value.state is not BlockState.RESIDENT)):
                continue  # demoted clean, deleted or overwritten since it was picked
            tag, key = fk[:TAG_LEN], fk[TAG_LEN:]
            scope = self._scope_tuples.get(tag)
            if scope is None:  # one tuple per scope, shared by its SSD entries (not one per value)
                scope = self._scope_tuples[tag] = tuple(store.scopes.scope_of(tag))
            expire = store.expires.get(fk, 0)
            try:
                check_expire(expire)
            except Unstorable as e:
                self._refuse(fk, value, e)
                continue
            n = len(value)
            extent = ssd.allocate(scope, key, n)
            if extent is None:
                await self._make_ssd_room(n)
                if store.data.get(fk) is not value or (block and value.state is not BlockState.RESIDENT):
                    continue  # deleted or overwritten while room was made: nothing to write
                extent = ssd.allocate(scope, key, n)
                if extent is None:
                    break
            if block:
                store.pin(value)
                self._writing[value] = batch
                payload, crc = store.view(value), value.crc
            else:
                self._writing[fk] = batch
                payload, crc = value, None
            items.append((fk, value, PendingWrite(scope, key, payload, extent, crc=crc, expire=expire)))
        return items

    def _refuse(self, fk: bytes, value: bytes | Block, e: Unstorable) -> None:
        """`value` cannot go to SSD: it stays in DRAM and is not picked again while it is the
        key's value; said once, counted."""
        refused = self._unstorable
        if len(refused) >= UNSTORABLE_KEPT:
            for k in [k for k in refused if not self._still_refused(k)]:
                del refused[k]
        refused[fk] = (id(value), self.store.expires.get(fk, 0))
        self.stats["ssd_unstorable"] += 1
        log.error("ssd tier: key %r stays in DRAM, the SSD tier cannot hold it: %s (it is lost at a stop; "
                  "the rest of its batch goes on)", fk[TAG_LEN:TAG_LEN + 64], e)

    def _still_refused(self, fk: bytes) -> bool:
        """Whether key `fk` still holds the value, with the TTL, that the SSD tier refused (the
        value is named by its id: while it is the key's value it is alive, so its id is its own)."""
        store = self.store
        value = store.data.get(fk)
        return value is not None and self._unstorable.get(fk) == (id(value), store.expires.get(fk, 0))

    def unstorable_held(self) -> int:
        """Values held in DRAM that the SSD tier refused (a stop cannot keep them)."""
        return sum(map(self._still_refused, self._unstorable))

    async def _write(self, items: list[Item]) -> bool:
        """A batch's writes (not synced: `_commit_and_settle` does that) from a worker thread
        and the SSD tier's I/O threads; on failure everything staged is given back."""
        try:
            await self._run(self.ssd.write_blocks, [it for _, _, it in items])
        except Exception as e:  # noqa: BLE001 - whatever it was, the batch is given back
            self._give_back(items, e)
            return False
        return True

    def _give_back(self, items: list[Item], e: Exception) -> None:
        """A batch failed to write or commit: its SSD extents are freed, its DRAM blocks unpinned
        (they stay in DRAM). An I/O error (SsdFailure) marks the tier failed; any other error
        fails this batch only, loudly (`demote_errors`), and the next batch is tried."""
        for _, value, it in items:
            self.ssd.release_extent(it.extent)
            if type(value) is Block:
                self.store.unpin(value)
        if isinstance(e, SsdFailure):
            self._failed(e)
        else:
            self.stats["demote_errors"] += 1
            log.error("ssd demotion: a batch of %d values failed and stays in DRAM: %r", len(items), e,
                      exc_info=e)

    def _settle(self, items: list[Item]) -> int:
        """Publish the written values on SSD and free their DRAM; returns the bytes moved.

        A block read meanwhile keeps its SSD copy as `block.lower` (freed on a later pass);
        a value overwritten, deleted or renamed meanwhile has a stale copy, dropped at once;
        one whose TTL changed meanwhile gets the new TTL logged (`retime`).
        """
        store = self.store
        entries = self.ssd.publish([it for _, _, it in items])
        self._reap()  # older versions the new ones replaced
        by_key = {(e.scope, e.key): e for e in entries}
        moved = 0
        for fk, value, it in items:
            block = type(value) is Block
            if block:
                store.unpin(value)
            entry = by_key.get((it.scope, it.key))
            if entry is None:
                continue
            cur = store.data.get(fk)
            if block:
                same = cur is value and value.state is BlockState.RESIDENT
            else:  # equal bytes are the same value (CPython shares some small bytes objects)
                same = cur is value or (type(cur) is bytes and cur == value and store.copy_below(fk, cur) is None)
            if not same:
                self.drop(entry)
                continue
            expire = store.expires.get(fk, 0)
            if expire != it.expire:
                self.retime(entry, expire)
            if block and value.pins:
                value.lower = entry
            else:
                store.demoted(fk, cur, entry)
            moved += len(value)
        return moved

    async def _make_ssd_room(self, nbytes: int) -> None:
        """Free SSD space for `nbytes`: first the SSD copies of values that are also in DRAM
        (nothing is lost), then the least recently used SSD-only keys."""
        store, freed = self.store, 0
        for i, (fk, value) in enumerate(reversed(store.data.items())):
            if freed >= nbytes * 2 or i >= SCAN_LIMIT:
                break
            entry = store.copy_below(fk, value)
            if entry is not None and not entry.pins:
                freed += entry.length
                self.drop(entry)
                if type(value) is Block:
                    value.lower = None
                else:
                    del store.small_copies[fk]
                self.stats["ssd_copies_dropped"] += 1
        for fk in list(store.lower)[:DELETE_BATCH]:
            if freed >= nbytes * 2:
                break
            entry = store.lower[fk]
            if entry.pins:
                continue
            freed += entry.length
            store.delete(fk[:TAG_LEN], fk[TAG_LEN:])  # its SSD copy joins the deletions flushed below
            self.stats["ssd_evictions"] += 1
        await self._flush_deletes()


def _dram_cost(value: bytes | Block) -> int:
    """DRAM a value holds: whole pages for a block, its bytes inline."""
    return page_extent(value.length) if type(value) is Block else len(value)
