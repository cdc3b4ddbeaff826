"""The policy between the DRAM arena and the SSD tier: demote, promote, delete, recover.

- Demotion: while DRAM use is above the high watermark, a background task takes
  the coldest unpinned blocks (least recently used first), up to
  `ssd.group_commit_bytes` per batch, pins them, writes them to SSD in one
  group commit (payloads written by the SSD tier's I/O threads and synced, then
  one WAL sync) and only then frees their DRAM — so a block is never in neither
  place. Batches are pipelined: the next batch's blocks are written while the
  previous one's fdatasyncs run (`_start_batch`, `_commit_and_settle`), at most one
  commit in flight, commits (and so WAL records and settles) in batch order. A
  block read or overwritten meanwhile is handled: a pinned one keeps its SSD copy
  as `block.lower`, an overwritten one's stale copy is deleted.
- Reads: a GET of an SSD-only key is a pending read: the entry is pinned,
  read by a worker thread into a fresh DRAM block, verified (header and
  CRC32C), then promoted (or, with `promote_on_read` off, sent and dropped).
  A block that fails verification is dropped and counted, and the read is a
  miss: bytes that fail their checksum are never served.
- Deletions of SSD copies are acknowledged only once durable. A DEL, UNLINK,
  FLUSHALL or overwrite that releases an SSD copy (an SSD-only value, the copy a
  promoted block keeps as `block.lower`, or a block whose demotion write is in
  flight) leaves the keyspace with a durable step pending (`Keyspace.take_unsynced`
  -> `synced()` here); the handler answers only when it resolves. Deletions are group
  committed: every copy dropped while one WAL sync runs goes into the next record,
  one sync for all the clients waiting on it. Then the freed extents are scrubbed
  (header page zeroed) and only then reused (ssd.py).

  Why not tombstones with generations instead: a deletion that no crash can undo
  needs *some* durable write before the reply, whatever it records; a DEL record
  under group commit is that write, already replayed by generation (a DEL of
  generation g never removes a newer version), and costs one shared WAL sync per
  group. Acknowledging first and making stale versions unrecoverable later would
  still leave the window this closes. A value only in DRAM involves no SSD copy, so
  its DEL or overwrite waits for nothing (`take_unsynced` is None: no awaitable, no
  allocation).
- A failed tier can no longer log deletions: before it acknowledges one it fences
  itself (removes its key, so a restart trusts nothing on it); if even that fails,
  the command answers with the error.
- When the SSD is full its own LRU (the front of `keyspace.lower`) is evicted.
- Faults: the first I/O error fails the tier (ssd.py); from then on nothing
  more is written to it, DRAM eviction drops blocks as it would without an
  SSD, and the error is in INFO, the log and /healthz.

This is the SSD tier as the keyspace sees it (tier.py's LowerTier) plus its
policy. All bookkeeping runs on the event loop; only ssd.py's blocking
methods run in the executor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from quilld.config import SsdConfig
from quilld.errors import OutOfMemory
from quilld.model import CacheTier, IdentityScope, Pinned
from quilld.scopes import TAG_LEN
from quilld.tiers.block import Block, BlockState, page_extent
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.ssd import PendingWrite, SsdEntry, SsdTier
from quilld.tiers.ssd_format import CorruptBlock, SsdFailure

log = logging.getLogger("quilld.ssd")

DEMOTE_INTERVAL = 0.02  # seconds between checks of the DRAM watermark
SCAN_LIMIT = 20_000  # DRAM entries looked at per demotion batch (bounds one loop turn)
DELETE_BATCH = 4096  # SSD-only keys evicted per pass when the SSD is full
_PATHS = {"fresh": "a new tier", "checkpoint": "its checkpoint and log",
          "previous-checkpoint": "the PREVIOUS checkpoint and the log (the newest checkpoint is damaged)",
          "log": "replaying the log", "segment-scan": "a SEGMENT SCAN and the log (every checkpoint is damaged)",
          "fenced": "starting EMPTY (no tier key: fenced after a failure, or an older format)"}
RESERVE_WAIT = 5.0  # seconds a read from SSD waits for DRAM to be freed by the demoter
STOP_WAIT = 30.0  # seconds shutdown waits for a demotion batch in flight


def _ignore(seconds: float) -> None:
    """No observer (the default; node.py gives the node's metrics)."""


class Tiering:
    tier = CacheTier.SSD

    def __init__(self, store: Keyspace, cfg: SsdConfig, space_freed: Callable[[float], Awaitable[None]],
                 workers: int = 4) -> None:
        """`space_freed(timeout)` returns when arena space is next freed (or the timeout passes)."""
        self.store = store
        self.cfg = cfg
        segment = min(cfg.segment_size, cfg.size // 4096 * 4096)  # a small tier is one segment
        self.ssd = SsdTier(cfg.dir, cfg.size, segment, checkpoint_wal_bytes=cfg.checkpoint_wal_bytes,
                           direct_io=cfg.direct_io, io_threads=cfg.io_threads)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ssd")
        self.stats: Counter[str] = Counter()
        self.report: Any = None  # the RecoveryReport of the last start
        self._doomed: list[SsdEntry] = []  # SSD copies for the next group of DEL records
        self._group: asyncio.Future | None = None  # resolves when `_doomed` is durable
        self._last_group: asyncio.Future | None = None  # the group the latest drop joined
        self._flush_lock = asyncio.Lock()  # one group (log, forget, scrub, reclaim) at a time, in order
        self._writing: dict[Block, asyncio.Future] = {}  # blocks of the demotion batches in flight: their batch
        self._waits_batch: asyncio.Future | None = None  # the latest such batch a released block belongs to
        self._committing: asyncio.Task | None = None  # the commit (and settle) of the batch written last
        self._inflight = 0  # DRAM bytes of the blocks in flight (written, not yet settled)
        self._busy_since: float | None = None  # when the demoter last went from idle to a batch in flight
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._deleting: asyncio.Task | None = None
        self._pressure = False  # a write is waiting for space
        self._stopping = False
        self.space_freed = space_freed
        self.observe_read: Callable[[float], None] = _ignore  # seconds of each verified read into DRAM
        self.observe_demotion: Callable[[float], None] = _ignore  # seconds of each demotion batch written
        store.lower_tier = self

    # -- state -------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether demotion can happen: the SSD tier exists and has not failed."""
        return self.ssd.failed is None

    @property
    def capacity(self) -> int:
        return self.ssd.capacity

    @property
    def used(self) -> int:
        return int(self.ssd.stats()["used"])

    def wake(self) -> None:
        """DRAM is short of space for a write: demote now, even below the high watermark."""
        self._pressure = True
        self._wake.set()

    def _run(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self, scopes: Any) -> None:
        """Recover the SSD tier (before serving), put its blocks in the keyspace, start demoting."""
        t0 = time.monotonic()

        def progress(done: int, total: int) -> None:
            log.info("ssd recovery: verified %d of %d blocks (%.0f%%)", done, total, 100 * done / max(total, 1))

        log.info("ssd tier: recovering %s", self.cfg.dir)
        try:
            self.report = await self._run(lambda: self.ssd.recover(progress))
        except SsdFailure as e:  # e.g. the disk is full or unreadable: serve from DRAM only
            self.ssd.failed = self.ssd.failed or str(e)
            self._failed(e)
            return
        r = self.report
        for (scope, key), entry in self.ssd.entries.items():
            self.store.adopt(scopes.tag(IdentityScope(*scope)) + key, entry)
        damaged = r.dropped_corrupt or r.wal_stops or r.checkpoint_error or r.key_error \
            or r.path not in ("fresh", "checkpoint", "log")
        log.log(logging.WARNING if damaged else logging.INFO,
                "ssd tier: recovered %d blocks in %.2f s by %s (dropped %d corrupt, %d torn WAL stops%s%s%s)",
                r.recovered, time.monotonic() - t0, _PATHS.get(r.path, r.path), r.dropped_corrupt,
                r.dropped_torn_wal_records,
                f", checkpoint errors: {r.checkpoint_error}" if r.checkpoint_error else "",
                f", {r.scanned_blocks} blocks found by the scan, {r.scan_refused} refused" if r.path == "segment-scan"
                else "", f", {r.key_error}" if r.key_error else "")
        for stop in r.wal_stops:
            log.warning("ssd tier: WAL replay stopped at %s", stop)
        log.info("ssd tier: block writes %s, %d I/O threads", self.ssd.files.io_mode, self.ssd.io_threads)
        self._task = asyncio.create_task(self._demoter(), name="ssd-demoter")

    async def stop(self) -> None:
        """Finish the batch in flight, write every DRAM block to SSD (a clean restart loses
        nothing that fits), log pending deletions, close the files."""
        if self._task is not None:
            # let the batch in flight finish: cancelling it would leave its blocks pinned and
            # its write running in a worker while the files close
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STOP_WAIT)
            except asyncio.TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        started = self._task is not None  # else recovery failed: nothing to flush
        try:
            if started and self.active:
                await self._flush_all()
            if self._deleting is not None:
                await asyncio.gather(self._deleting, return_exceptions=True)
            await self._flush_deletes()
            if started and self.active:  # the next start loads a checkpoint instead of replaying the WAL
                n = await self._checkpoint()
                log.info("ssd tier: checkpoint of %s blocks written at shutdown", n)
        except SsdFailure as e:
            self._failed(e)
        self.executor.shutdown(wait=True)  # reads still in flight finish before the files close
        self.ssd.close()

    def unflushed(self) -> tuple[int, int, int, int]:
        """What a stop now would lose: (blocks, bytes) in DRAM only that a clean stop writes to
        SSD, and of those the (blocks, bytes) of the group commit in flight, which may or may
        not have reached the disk. Values with a TTL stay in DRAM only and are not counted."""
        blocks = nbytes = 0
        expires = self.store.expires
        for fk, value in self.store.data.items():
            if type(value) is Block and value.lower is None and not (expires and fk in expires):
                blocks += 1
                nbytes += value.length
        writing = [b for b in self._writing if b.lower is None]
        return blocks, nbytes, len(writing), sum(b.length for b in writing)

    async def _flush_all(self) -> None:
        """Write every DRAM block to SSD at a clean stop, logging progress every ssd.flush_progress_s."""
        blocks, nbytes, _, _ = self.unflushed()
        if not blocks:
            log.info("ssd tier: no DRAM block to flush")
        else:
            log.info("ssd tier: flushing %d DRAM blocks (%s) to SSD; a second Ctrl-C (SIGINT) stops at once "
                     "without them", blocks, _mib(nbytes))
        t0, n0, b0 = time.monotonic(), self.stats["demotions"], self.stats["demoted_bytes"]

        def done() -> tuple[int, int, float]:
            return self.stats["demotions"] - n0, self.stats["demoted_bytes"] - b0, time.monotonic() - t0

        async def report() -> None:
            while True:
                await asyncio.sleep(self.cfg.flush_progress_s)
                n, b, dt = done()
                rate = b / dt
                log.info("ssd tier: flushed %s of %s (%.0f%%), %d of %d blocks, %.0f MB/s, %s",
                         _mib(b), _mib(nbytes), 100 * b / max(nbytes, 1), n, blocks, rate / 1e6,
                         f"about {(nbytes - b) / rate:.0f} s left" if b else "no block written yet")

        reporter = asyncio.create_task(report(), name="ssd-flush-progress") if blocks else None
        try:
            while self.active and await self._start_batch(everything=True):
                pass
            await self._drain()
        finally:
            if reporter is not None:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
        n, b, dt = done()
        log.info("ssd tier: flushed %d blocks (%s) of DRAM in %.2f s, %.0f MB/s",
                 n, _mib(b), dt, b / max(dt, 1e-9) / 1e6)
        left, left_bytes, _, _ = self.unflushed()
        if left:
            why = "the SSD tier failed" if not self.active else "the SSD tier is full, or they were in use"
            log.warning("ssd tier: %d DRAM blocks (%s) could not be flushed (%s): the next start will not "
                        "have them", left, _mib(left_bytes), why)

    # -- demotion ------------------------------------------------------------------
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

    def _failed(self, e: Exception) -> None:
        self.stats["failures"] += 1
        log.error("ssd tier failed, serving from DRAM only from now on: %s", e)

    async def _checkpoint(self) -> int | None:
        """Seal the log once every deletion logged so far is scrubbed, then merge: a
        checkpoint drops records only after the scrubs they made due are synced."""
        async with self._flush_lock:
            await self._flush_locked()
            upto = await self._run(self.ssd.seal)
        return await self._run(self.ssd.checkpoint, upto)

    def _pick(self, everything: bool = False) -> list[tuple[bytes, Block]]:
        """The coldest unpinned blocks, enough to get under the low watermark (or all of them)."""
        store = self.store
        # at least a quarter of the arena per group commit, so a small arena does not pay an
        # fsync pair for every few blocks (fsyncs dominate demotion time)
        used = store.used - self._inflight  # what the batches in flight will free is taken
        want = used if everything else max(used - store.low_bytes, store.capacity // 4)
        budget = min(want, self.cfg.group_commit_bytes)
        picked, total = [], 0
        expires = store.expires
        for i, (fk, value) in enumerate(store.data.items()):
            if i >= SCAN_LIMIT or total >= budget:
                break
            if type(value) is not Block or value.pins or value.state is not BlockState.RESIDENT:
                continue
            if expires and fk in expires:
                continue  # values with a TTL stay in DRAM (the SSD tier keeps no TTLs)
            picked.append((fk, value))
            total += page_extent(value.length)  # pages, as DRAM use is counted
        return picked

    async def _demote_batch(self, everything: bool = False) -> bool:
        """Write one group of cold blocks to SSD and free their DRAM, settled on return; False
        when nothing moved."""
        started = await self._start_batch(everything)
        return await self._drain() or started

    async def _start_batch(self, everything: bool = False) -> bool:
        """Pick and write one group of cold blocks, then leave its commit and settling to a
        task (`_committing`) that runs while the next batch is written; False when nothing
        moved or could be started. The commit of the batch before is waited for first: one
        commit in flight at most, in order.

        While a batch is in flight its blocks are `_writing`: one released meanwhile
        (deleted, overwritten) makes its releaser wait for the batch to settle, since the
        settling drops the stale copy the write just made durable."""
        picked = self._pick(everything)
        if not picked:
            return await self._drain()
        clean = self._free_clean(picked)
        batch = asyncio.get_running_loop().create_future()
        items = await self._stage(picked, batch)
        if not items:
            batch.set_result(None)
            return bool(clean)
        inflight = sum(page_extent(b.length) for _, b, _ in items)
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
        """Wait for the commit in flight, if any; whether it moved blocks."""
        task, self._committing = self._committing, None
        if task is None:
            return False
        return await asyncio.shield(task)

    async def _commit_and_settle(self, items: list[tuple[bytes, Block, PendingWrite]], batch: asyncio.Future,
                                 inflight: int, t0: float) -> bool:
        try:
            try:
                await self._run(self.ssd.commit, [it for _, _, it in items])
            except SsdFailure as e:
                self._give_back(items, e)
                return False
            moved = self._settle(items)
        finally:
            self._end_batch(items, batch, inflight)
        elapsed = time.perf_counter() - t0
        log.debug("ssd demotion: %d blocks (%s) written and committed in %.1f ms", len(items), _mib(moved),
                  elapsed * 1e3)
        self.stats["demotions"] += len(items)
        self.stats["demoted_bytes"] += moved
        self.stats["demote_batches"] += 1
        self.observe_demotion(elapsed)
        return True

    def _end_batch(self, items: list[tuple[bytes, Block, PendingWrite]], batch: asyncio.Future,
                   inflight: int) -> None:
        """A batch settled (or failed): its blocks are no longer in flight; its waiters go on.
        demote_usec counts the time with at least one batch in flight (overlaps once)."""
        for _, block, _ in items:
            if self._writing.get(block) is batch:
                del self._writing[block]
        self._inflight -= inflight
        if not batch.done():
            batch.set_result(None)
        if not self._writing and self._busy_since is not None:
            self.stats["demote_usec"] += int((time.perf_counter() - self._busy_since) * 1e6)
            self._busy_since = None

    def _free_clean(self, picked: list[tuple[bytes, Block]]) -> int:
        """Blocks whose bytes are already on SSD (promoted earlier): just free their DRAM."""
        clean = [(fk, b) for fk, b in picked if b.lower is not None]
        for fk, block in clean:
            self.store.demoted(fk, block, block.lower)
            self.stats["demoted_clean"] += 1
        return len(clean)

    async def _stage(self, picked: list[tuple[bytes, Block]],
                     batch: asyncio.Future) -> list[tuple[bytes, Block, PendingWrite]]:
        """Pin each block still to be written and give it an SSD extent (making room if need be)."""
        store, ssd = self.store, self.ssd
        items = []
        for fk, block in picked:
            if block.lower is not None or block.state is not BlockState.RESIDENT:
                continue
            scope, key = tuple(store.scopes.scope_of(fk[:TAG_LEN])), fk[TAG_LEN:]
            extent = ssd.allocate(scope, key, block.length)
            if extent is None:
                await self._make_ssd_room(block.length)
                if store.data.get(fk) is not block or block.state is not BlockState.RESIDENT:
                    continue  # deleted or overwritten while room was made: nothing to write
                extent = ssd.allocate(scope, key, block.length)
                if extent is None:
                    break
            store.pin(block)
            self._writing[block] = batch
            items.append((fk, block, PendingWrite(scope, key, store.view(block), extent, crc=block.crc)))
        return items

    async def _write(self, items: list[tuple[bytes, Block, PendingWrite]]) -> bool:
        """A batch's block writes (not synced: `_commit_and_settle` does that) from a worker
        thread and the SSD tier's I/O threads; on failure everything staged is given back."""
        try:
            await self._run(self.ssd.write_blocks, [it for _, _, it in items])
        except SsdFailure as e:
            self._give_back(items, e)
            return False
        return True

    def _give_back(self, items: list[tuple[bytes, Block, PendingWrite]], e: SsdFailure) -> None:
        """A batch failed to write or commit: its SSD extents are freed, its DRAM blocks unpinned
        (they stay in DRAM), and the tier is marked failed."""
        for _, block, it in items:
            self.ssd.release_extent(it.extent)
            self.store.unpin(block)
        self._failed(e)

    def _settle(self, items: list[tuple[bytes, Block, PendingWrite]]) -> int:
        """Publish the written blocks on SSD and free their DRAM; returns the bytes moved.

        A block read meanwhile keeps its SSD copy as `block.lower` (freed on a later pass);
        one overwritten or deleted meanwhile has a stale copy, dropped at once.
        """
        store = self.store
        entries = self.ssd.publish([it for _, _, it in items])
        self._reap()  # older versions the new ones replaced
        by_key = {(e.scope, e.key): e for e in entries}
        moved = 0
        for fk, block, it in items:
            store.unpin(block)
            entry = by_key.get((it.scope, it.key))
            if entry is None:
                continue
            if store.data.get(fk) is block and block.state is BlockState.RESIDENT:
                if block.pins:
                    block.lower = entry
                else:
                    store.demoted(fk, block, entry)
                moved += block.length
            else:
                self.drop(entry)
        return moved

    async def _make_ssd_room(self, nbytes: int) -> None:
        """Free SSD space for `nbytes`: first the SSD copies of blocks that are also in DRAM
        (nothing is lost), then the least recently used SSD-only keys."""
        store, freed = self.store, 0
        for i, block in enumerate(reversed(store.data.values())):
            if freed >= nbytes * 2 or i >= SCAN_LIMIT:
                break
            if type(block) is Block and block.lower is not None and not block.lower.pins:
                freed += block.lower.length
                self.drop(block.lower)
                block.lower = None
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

    # -- deletions -------------------------------------------------------------------
    def drop(self, entry: SsdEntry) -> None:
        """An SSD copy is no longer wanted: its DEL record joins the next group commit, then
        its space is scrubbed and freed. `synced()` says when that is durable."""
        self._doomed.append(entry)
        if self._group is None:
            self._group = self._last_group = asyncio.get_running_loop().create_future()
        self._kick()

    def writing(self, block: Block) -> bool:
        """Whether `block` is being written to SSD right now (it is being released: the copy
        the write makes is dropped when the batch settles, and `synced()` waits for that)."""
        batch = self._writing.get(block)
        if batch is None:
            return False
        # batches settle in order: waiting for the latest one a released block is in waits for all
        if self._waits_batch is None or self._waits_batch.done() or self._later(batch, self._waits_batch):
            self._waits_batch = batch
        return True

    def _later(self, a: asyncio.Future, b: asyncio.Future) -> bool:
        """Whether batch `a` was started after batch `b` (both in flight)."""
        order = list(dict.fromkeys(self._writing.values()))
        return b not in order or (a in order and order.index(a) > order.index(b))

    def synced(self) -> Awaitable[None] | None:
        """What makes every deletion requested so far durable; None when nothing is left to
        wait for. Raises (when awaited) if a deletion could not be made durable."""
        batch, self._waits_batch = self._waits_batch, None
        group = self._last_group
        if batch is None and (group is None or (group.done() and not group.cancelled()
                                                and group.exception() is None)):
            return None
        return self._wait_synced(batch, group)

    async def _wait_synced(self, batch: asyncio.Future | None, group: asyncio.Future | None) -> None:
        if batch is not None:
            await asyncio.shield(batch)
            group = self._last_group  # the group the batch's stale copies joined (groups resolve in order)
        if group is not None:
            await asyncio.shield(group)

    def _kick(self) -> None:
        if self._deleting is None or self._deleting.done():
            self._deleting = asyncio.ensure_future(self._delete_soon())

    def _reap(self) -> None:
        """Scrub and reclaim what the SSD tier freed (replaced or unpinned versions), soon."""
        if self.ssd.has_freed:
            self._kick()

    async def _delete_soon(self) -> None:
        await asyncio.sleep(0)  # gather a burst of deletions into one WAL sync
        await self._flush_deletes()

    async def _flush_deletes(self) -> None:
        async with self._flush_lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        """Log every queued deletion (one group, one WAL sync), answer its waiters, then
        scrub and reclaim the freed extents; repeat while more arrived meanwhile."""
        while self._doomed or self.ssd.has_freed:
            batch, self._doomed = self._doomed[:], []
            group, self._group = self._group, None
            if batch:
                error = await self._log(batch)
                for entry in batch:
                    self.ssd.forget(entry)
                self.stats["ssd_deletes"] += len(batch)
                self.stats["delete_syncs"] += 1
                if group is not None and not group.done():
                    if error is None:
                        group.set_result(None)
                    else:
                        group.set_exception(error)
                        group.exception()  # retrieved here: a group nobody awaits logs nothing
            freed = self.ssd.take_freed()
            if freed and self.active:
                try:
                    await self._run(self.ssd.scrub, freed)
                except SsdFailure as e:
                    self._failed(e)
                    continue  # a failed tier is never written again: its space stays taken
                self.ssd.reclaim(freed)
                self.stats["ssd_scrubbed"] += len(freed)

    async def _log(self, batch: list[SsdEntry]) -> SsdFailure | None:
        """Make the deletion of `batch` durable: DEL records, or on a failed tier its fence.
        Returns the error when neither is possible."""
        if self.active:
            try:
                await self._run(self.ssd.log_deletes, batch)
                return None
            except SsdFailure as e:
                self._failed(e)
        if self.ssd.fenced:
            return None
        try:
            await self._run(self.ssd.fence)
        except OSError as e:
            log.error("ssd tier: cannot fence the failed tier, deletions of SSD copies are not durable: %s", e)
            return SsdFailure(f"ssd tier failed ({self.ssd.failed}); the deletion of its copy is not durable")
        log.warning("ssd tier: fenced (failed, and deletions can no longer be logged): a restart starts it empty")
        return None

    # -- reads -------------------------------------------------------------------------
    def read(self, entry: SsdEntry):
        """The entry's verified bytes in DRAM, later (tier.py's LowerTier.read); pins it now."""
        self.ssd.pin(entry)
        return self._read(entry)

    async def _read(self, entry: SsdEntry) -> Pinned | None:
        store = self.store
        try:
            block = await self._reserve(entry.length)
        except BaseException:
            self._unpin(entry)
            raise
        t0 = time.perf_counter()
        try:
            await self._run(self.ssd.read_into, entry, store.write_view(block))
        except (CorruptBlock, SsdFailure) as e:
            store.discard(block)
            self._unpin(entry)
            self._corrupt(entry, e)
            return None
        except BaseException:
            store.discard(block)
            self._unpin(entry)
            raise
        self.observe_read(time.perf_counter() - t0)
        self._unpin(entry)
        self.stats["ssd_reads"] += 1
        self.stats["ssd_read_bytes"] += entry.length
        fk = store.scopes.tag(IdentityScope(*entry.scope)) + entry.key
        if self.cfg.promote_on_read and store.lower.get(fk) is entry:
            store.promoted(fk, block, entry)
            self.stats["promotions"] += 1
            return store.pinned(block)
        return Pinned(store.view(block), lambda: store.discard(block))

    async def _reserve(self, nbytes: int) -> Block:
        """DRAM for a block read back from SSD, waiting (up to 5 s) for the demoter if need be."""
        store = self.store
        deadline = time.monotonic() + RESERVE_WAIT
        while True:
            try:
                return store.reserve(nbytes)
            except OutOfMemory:
                if time.monotonic() > deadline or not store.space_may_free():
                    raise
                self.wake()
                await self.space_freed(0.01)

    async def read_bytes(self, entry: SsdEntry) -> bytes:
        """An SSD-only block's verified bytes (for a peer), without promoting it."""
        self.ssd.pin(entry)
        buf = bytearray(entry.length)
        try:
            await self._run(self.ssd.read_into, entry, buf)
        except (CorruptBlock, SsdFailure) as e:
            self._corrupt(entry, e)
            raise
        finally:
            self._unpin(entry)
        return bytes(buf)

    def _unpin(self, entry: SsdEntry) -> None:
        self.ssd.unpin(entry)
        if entry.retired and not entry.pins:
            self._reap()

    def _corrupt(self, entry: SsdEntry, e: Exception) -> None:
        """A block failed verification on read: never serve it, forget it, count it."""
        store = self.store
        self.stats["ssd_read_corrupt" if isinstance(e, CorruptBlock) else "ssd_read_errors"] += 1
        log.error("ssd tier: dropping block %r: %s", entry.key[:64], e)
        tag = store.scopes.tag(IdentityScope(*entry.scope))
        if store.lower.get(tag + entry.key) is entry:
            store.delete(tag, entry.key)  # releases it, which drops the SSD copy
        else:
            self.drop(entry)

    # -- reporting -------------------------------------------------------------------
    def info(self) -> list[tuple[str, Any]]:
        s = self.ssd.stats()
        r = self.report
        out: list[tuple[str, Any]] = [
            ("ssd_enabled", 1), ("ssd_dir", self.cfg.dir), ("ssd_capacity", s["capacity"]),
            ("ssd_used", s["used"]), ("ssd_keys", len(self.store.lower)),
            ("ssd_failed", int(bool(s["failed"]))), ("ssd_error", _info_text(str(s["error"]))),
            ("ssd_dirty_bytes", s["dirty_bytes"]), ("ssd_wal_bytes", s["wal_bytes"]),
            ("ssd_last_checkpoint", int(s["last_checkpoint"])),
            ("ssd_fsyncs", s["fsyncs"]), ("ssd_fsync_last_ms", s["fsync_last_ms"]),
            ("ssd_fsync_avg_ms", s["fsync_avg_ms"]), ("ssd_fsync_max_ms", s["fsync_max_ms"]),
            ("ssd_fsync_total_ms", s["fsync_total_ms"]), ("ssd_write_total_ms", s["write_total_ms"]),
            ("ssd_io_mode", _info_text(str(s["io_mode"]))), ("ssd_io_threads", s["io_threads"]),
        ]
        if r is not None:
            out += [("recovery_path", r.path), ("recovery_blocks", r.recovered),
                    ("recovery_dropped_corrupt", r.dropped_corrupt),
                    ("recovery_wal_stops", r.dropped_torn_wal_records),
                    ("recovery_wal_records", r.wal_records),
                    ("recovery_checkpoint_errors", len(r.checkpoint_errors)),
                    ("recovery_checkpoint_error", _info_text(r.checkpoint_error or "")),
                    ("recovery_scanned_blocks", r.scanned_blocks), ("recovery_scrubbed", r.scrubbed),
                    ("recovery_ms", int(r.duration_s * 1000))]
        stats = {"demote_usec": 0, "demoted_bytes": 0, **self.stats}
        if self._busy_since is not None:  # a batch in flight: its time so far counts too
            stats["demote_usec"] = stats.get("demote_usec", 0) + int((time.perf_counter() - self._busy_since) * 1e6)
        stats["demote_inflight_bytes"] = self._inflight
        out += [(k, v) for k, v in sorted(stats.items())]
        return out


def _info_text(text: str) -> str:
    """A message as an INFO value: one line, no commas (clients split INFO values on them)."""
    return " ".join(text.replace(",", ";").split())


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
