"""The policy between DRAM and the SSD tier: demote, promote, delete, retime, recover.

One design for every value: arena blocks and inline values (at most `dram.inline_max`
bytes), with or without a TTL, take the same paths down and back, so a clean stop
keeps all of them and `maxmemory` bounds DRAM with an SSD tier as it does without one.

- Demotion (demotion.py): while DRAM use is above the high watermark (of maxmemory), a
  background task writes the coldest values to SSD in group commits and only then frees
  their DRAM. A small value is one page on SSD; a TTL goes with its value (header, PUT
  record) and stays in the keyspace.
- Reads: a GET of an SSD-only key is a pending read: the entry is pinned, read by a
  worker thread (into a fresh DRAM block, or bytes for a small value), verified (header
  and CRC32C), then promoted (or, with `promote_on_read` off, sent and dropped). A value
  that fails verification is dropped and counted, and the read is a miss: bytes that
  fail their checksum are never served.
- Deletions and TTL changes of SSD copies are acknowledged only once durable
  (ssd_changes.py): a DEL, UNLINK, FLUSHALL, overwrite or expiry that releases an SSD
  copy, and an EXPIRE, PERSIST, GETEX ... of a value that has one (or is getting one:
  its demotion write is in flight), leave the keyspace with a durable step pending
  (`Keyspace.take_unsynced` -> `synced()`); the handler answers only when it resolves.
  They are group committed: one WAL sync for everything that arrived meanwhile.

  Why not tombstones with generations instead: a deletion that no crash can undo
  needs *some* durable write before the reply, whatever it records; a DEL record
  under group commit is that write, already replayed by generation (a DEL of
  generation g never removes a newer version), and costs one shared WAL sync per
  group. A value only in DRAM involves no SSD copy, so its DEL, overwrite or EXPIRE
  waits for nothing (`take_unsynced` is None: no awaitable, no allocation).
- Expiry: a value that expires while on SSD is deleted like any other (the keyspace's
  sweep, or the read that finds it expired); one found expired at start is not adopted,
  and its copy is deleted.
- A failed tier can no longer log deletions: before it acknowledges one it fences
  itself (removes its key, so a restart trusts nothing on it); if even that fails,
  the command answers with the error.
- When the SSD is full its own LRU (the front of `keyspace.lower`) is evicted.
- Faults: the first I/O error fails the tier (ssd.py); from then on nothing more is
  written to it, DRAM eviction drops values as it would without an SSD, and the error
  is in INFO, the log and /healthz. A directory that cannot be used at all (it cannot
  be created, written or locked) refuses the start instead (ConfigError).
- The run marker (run_state.py, in the directory's LOCK file): `running` from the
  start, a census of the keys held only in DRAM every CENSUS_INTERVAL seconds, and
  `stopped` (with what a clean stop could not keep) at the end of a clean stop. The
  next start says, once, whether the previous run stopped cleanly and, if not, about
  how many DRAM-only keys it lost.

What survives what: a value is on SSD once the group commit of its batch returned
(segments and WAL fdatasynced): from then on a kill -9 or a power loss keeps it (and
every TTL change or deletion acknowledged since). A value still only in DRAM (written
or changed since its last demotion, or never demoted because DRAM was below the high
watermark) survives a clean stop, which writes every DRAM value to SSD, but not a
kill -9: that is what the census counts.

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
from quilld.tiers.block import Block
from quilld.tiers.demotion import Demotion, _mib
from quilld.tiers.expiry import now_ms
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.run_state import RUNNING, STOPPED, RunState
from quilld.tiers.ssd import SsdEntry, SsdTier
from quilld.tiers.ssd_changes import DurableChanges
from quilld.tiers.ssd_files import size_text
from quilld.tiers.ssd_format import CorruptBlock, SsdFailure

log = logging.getLogger("quilld.ssd")

_PATHS = {"fresh": "a new tier", "checkpoint": "its checkpoint and log",
          "previous-checkpoint": "the PREVIOUS checkpoint and the log (the newest checkpoint is damaged)",
          "log": "replaying the log", "segment-scan": "a SEGMENT SCAN and the log",
          "fenced": "starting EMPTY (no tier key: fenced after a failure, or an older format)"}
RESERVE_WAIT = 5.0  # seconds a read from SSD waits for DRAM to be freed by the demoter
STOP_WAIT = 30.0  # seconds shutdown waits for a demotion batch in flight
CENSUS_INTERVAL = 2.0  # seconds between counts of the keys held only in DRAM (written into LOCK)


def size_line(cfg: SsdConfig, capacity: int) -> str:
    """What the tier takes on disk, said at start: every segment is preallocated in full, so
    a node given only ssd.dir takes ssd.size's default at once."""
    default = " (ssd.size's default: --ssd-size or ssd.size sets it)" if cfg.size == SsdConfig.size else ""
    return f"{size_text(capacity)} preallocated on disk{default}"


def _ignore(seconds: float) -> None:
    """No observer (the default; node.py gives the node's metrics)."""


class Tiering(Demotion, DurableChanges):
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
        self.previous_run: RunState | None = None  # how the run before this one ended (run_state.py)
        self.not_kept = 0  # keys held only in DRAM when the last stop ended (none flushed: all of them)
        self._doomed: list[SsdEntry] = []  # SSD copies for the next group of DEL records
        self._retimed: dict[SsdEntry, None] = {}  # SSD copies whose new TTL goes into the next group
        self._logging = 0  # deletions of the group being logged right now
        self._group: asyncio.Future | None = None  # resolves when `_doomed` and `_retimed` are durable
        self._last_group: asyncio.Future | None = None  # the group the latest change joined
        self._flush_lock = asyncio.Lock()  # one group (log, forget, scrub, reclaim) at a time, in order
        # values of the demotion batches in flight (blocks by object, inline values by full key): their batch
        self._writing: dict[Block | bytes, asyncio.Future] = {}
        self._waits_batch: asyncio.Future | None = None  # the latest such batch a change touched
        self._committing: asyncio.Task | None = None  # the commit (and settle) of the batch written last
        self._inflight = 0  # DRAM bytes of the values in flight (written, not yet settled)
        self._busy_since: float | None = None  # when the demoter last went from idle to a batch in flight
        self._census_at = 0.0  # monotonic time of the last census
        self._scope_tuples: dict[bytes, tuple] = {}  # scope tag -> its scope as the SSD tier keys it
        self._unstorable: dict[bytes, tuple[int, int]] = {}  # full key -> (id, expiry) of a value refused (demotion.py)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._deleting: asyncio.Task | None = None
        self._pressure = False  # a write is waiting for space
        self._stopping = False
        self.space_freed = space_freed
        self.observe_read: Callable[[float], None] = _ignore  # seconds of each verified read into DRAM
        self.observe_demotion: Callable[[float], None] = _ignore  # seconds of each demotion batch written
        store.lower_tier = self
        store.scopes.on_release.append(lambda tag, scope: self._scope_tuples.pop(tag, None))

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

    def _failed(self, e: Exception) -> None:
        self.stats["failures"] += 1
        log.error("ssd tier failed, serving from DRAM only from now on: %s", e)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self, scopes: Any) -> None:
        """Recover the SSD tier (before serving), put its values in the keyspace, start demoting.

        Raises ConfigError when the directory cannot be used at all (it cannot be created,
        written or locked): a start that cannot be right is refused."""
        t0 = time.monotonic()

        def progress(done: int, total: int) -> None:
            log.info("ssd recovery: verified %d of %d blocks (%.0f%%)", done, total, 100 * done / max(total, 1))

        log.info("ssd tier: recovering %s; %s", self.cfg.dir, size_line(self.cfg, self.ssd.capacity))
        try:
            self.report = await self._run(lambda: self.ssd.recover(progress))
        except SsdFailure as e:  # e.g. a segment became unreadable: serve from DRAM only
            self.ssd.failed = self.ssd.failed or str(e)
            self._failed(e)
            return
        finally:
            self.previous_run = self.ssd.files.previous_run
        r = self.report
        now, expired = now_ms(), []
        for (scope, key), entry in self.ssd.entries.items():
            if entry.expire and entry.expire <= now:
                expired.append(entry)  # expired while the node was down: deleted, never served
                continue
            self.store.adopt(scopes.tag(IdentityScope(*scope)) + key, entry)
        for entry in expired:
            self.drop(entry)
        self.stats["ssd_expired_at_start"] = len(expired)
        damaged = r.dropped_corrupt or r.wal_stops or r.checkpoint_error or r.key_error \
            or r.path not in ("fresh", "checkpoint", "log")
        log.log(logging.WARNING if damaged else logging.INFO,
                "ssd tier: recovered %d values in %.2f s by %s (dropped %d corrupt, %d damaged logs%s%s%s%s)",
                r.recovered - len(expired), time.monotonic() - t0, _PATHS.get(r.path, r.path), r.dropped_corrupt,
                r.dropped_torn_wal_records,
                f", {len(expired)} expired" if expired else "",
                f", checkpoint errors: {r.checkpoint_error}" if r.checkpoint_error else "",
                f", {r.scanned_blocks} blocks found by the scan, {r.scan_refused} refused; scanned because: "
                f"{r.scan_reason}" if r.path == "segment-scan" else "",
                f", {r.key_error}" if r.key_error else "")
        for stop in r.wal_stops:
            log.warning("ssd tier: WAL damaged at %s (the records after it were still replayed)", stop)
        log.info("ssd tier: block writes %s, %d I/O threads", self.ssd.files.io_mode, self.ssd.io_threads)
        if self.previous_run is not None:
            warn, text = self.previous_run.report()
            log.log(logging.WARNING if warn else logging.INFO, "ssd tier: %s", text)
        self._task = asyncio.create_task(self._demoter(), name="ssd-demoter")

    async def stop(self) -> None:
        """Finish the batch in flight, write every DRAM value to SSD (a clean restart loses
        nothing that fits), log pending deletions, checkpoint, mark the run stopped, close
        the files. `not_kept` says how many keys could not be written."""
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
                log.info("ssd tier: checkpoint of %s values written at shutdown", n)
        except SsdFailure as e:
            self._failed(e)
        except Exception:  # noqa: BLE001 - the run is still recorded and the files closed
            log.exception("ssd tier: the flush at stop failed")
        self.not_kept = self.unflushed()[0]
        if self.not_kept:
            unstorable = self.unstorable_held()
            why = "the SSD tier failed" if not self.active else "the SSD tier is full, or they were in use" + (
                f"; {unstorable} of them it cannot hold (ssd_unstorable)" if unstorable else "")
            log.warning("ssd tier: %d keys held only in DRAM could not be written to SSD (%s): the next start "
                        "will not have them", self.not_kept, why)
        elif started:
            log.info("ssd tier: every key is on SSD: the next start has them all")
        if started:
            run = self.ssd.files.run
            await self._record_run(RunState(run.pid, STOPPED, run.started, time.time(), 0, time.time(),
                                            self.not_kept), sync=True)
        self.executor.shutdown(wait=True)  # reads still in flight finish before the files close
        self.ssd.close()

    def unflushed(self) -> tuple[int, int, int, int]:
        """What a stop now would lose: (keys, bytes) of the values in DRAM only (a clean stop
        writes them to SSD; values already expired are not counted), and of those the
        (keys, bytes) of the group commit in flight, which may or may not have reached the disk."""
        keys = nbytes = 0
        store = self.store
        expires, now, copies = store.expires, now_ms(), store.small_copies
        for fk, value in store.data.items():
            if (value.lower if type(value) is Block else (copies and copies.get(fk))) is not None:
                continue
            if expires and fk in expires and expires[fk] <= now:
                continue
            keys += 1
            nbytes += len(value)
        writing = [(k, v) for k, v in self._writing.items() if type(k) is not Block or k.lower is None]
        return keys, nbytes, len(writing), sum(len(k) if type(k) is Block else len(store.data.get(k) or b"")
                                               for k, _ in writing)

    def dram_only(self) -> int:
        """About how many keys hold a value only in DRAM (what a kill -9 now would lose), in
        O(1): keys in DRAM less the SSD entries that are copies of DRAM values (entries of
        SSD-only keys and entries whose deletion is queued are not)."""
        store = self.store
        copies = len(self.ssd.entries) - len(store.lower) - len(self._doomed) - self._logging
        return max(0, len(store.data) - max(0, copies))

    async def _take_census(self) -> None:
        """Every CENSUS_INTERVAL seconds, write the count of DRAM-only keys into LOCK, so that
        the next start can say about how many a crash lost."""
        t = time.monotonic()
        if t - self._census_at < CENSUS_INTERVAL:
            return
        self._census_at = t
        run = self.ssd.files.run
        n = self.dram_only()
        await self._record_run(RunState(run.pid, run.state, run.started, time.time(), n))

    async def _record_run(self, run: RunState, sync: bool = False) -> None:
        try:
            await self._run(self.ssd.write_run, run, sync)
        except OSError as e:
            log.warning("ssd tier: cannot write the run marker in %s: %s", self.cfg.dir, e)

    async def _flush_all(self) -> None:
        """Write every DRAM value to SSD at a clean stop, logging progress every ssd.flush_progress_s."""
        keys, nbytes, _, _ = self.unflushed()
        if not keys:
            log.info("ssd tier: no DRAM value to flush")
        else:
            log.info("ssd tier: flushing %d DRAM values (%s) to SSD; a second Ctrl-C (SIGINT) stops at once "
                     "without them", keys, _mib(nbytes))
        t0, n0, b0 = time.monotonic(), self.stats["demotions"], self.stats["demoted_bytes"]

        def done() -> tuple[int, int, float]:
            return self.stats["demotions"] - n0, self.stats["demoted_bytes"] - b0, time.monotonic() - t0

        async def report() -> None:
            while True:
                await asyncio.sleep(self.cfg.flush_progress_s)
                n, b, dt = done()
                rate = b / dt
                log.info("ssd tier: flushed %s of %s (%.0f%%), %d of %d values, %.0f MB/s, %s",
                         _mib(b), _mib(nbytes), 100 * b / max(nbytes, 1), n, keys, rate / 1e6,
                         f"about {(nbytes - b) / rate:.0f} s left" if b else "nothing written yet")

        reporter = asyncio.create_task(report(), name="ssd-flush-progress") if keys else None
        try:
            while self.active and await self._start_batch(everything=True):
                pass
            await self._drain()
        finally:
            if reporter is not None:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
        n, b, dt = done()
        log.info("ssd tier: flushed %d values (%s) of DRAM in %.2f s, %.0f MB/s",
                 n, _mib(b), dt, b / max(dt, 1e-9) / 1e6)

    # -- reads -------------------------------------------------------------------------
    def read(self, entry: SsdEntry):
        """The entry's verified bytes in DRAM, later (tier.py's LowerTier.read); pins it now."""
        self.ssd.pin(entry)
        return self._read(entry)

    async def _read(self, entry: SsdEntry) -> Pinned | bytes | None:
        store = self.store
        if entry.length <= store.inline_max:
            return await self._read_small(entry)
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

    async def _read_small(self, entry: SsdEntry) -> bytes | None:
        """A small value's verified bytes, promoted as an inline value (its SSD copy kept)."""
        store = self.store
        try:
            data = await self.read_bytes(entry)
        except (CorruptBlock, SsdFailure):
            return None  # dropped and counted by read_bytes
        finally:
            self._unpin(entry)  # the pin `read` took
        self.stats["ssd_reads"] += 1
        self.stats["ssd_read_bytes"] += entry.length
        fk = store.scopes.tag(IdentityScope(*entry.scope)) + entry.key
        if self.cfg.promote_on_read and store.lower.get(fk) is entry:
            try:
                store.make_room_inline(len(data))
            except OutOfMemory:
                return data  # DRAM is full of what cannot go yet: served, not promoted
            store.promoted(fk, data, entry)
            self.stats["promotions"] += 1
        return data

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
                    ("recovery_scan_reason", _info_text(r.scan_reason)),
                    ("recovery_ms", int(r.duration_s * 1000))]
        prev = self.previous_run
        unclean = prev is not None and prev.state == RUNNING  # 0 too for a new directory, or one of an older quilld
        lost = 0 if prev is None else prev.dram_only if unclean else prev.not_kept
        out += [("last_run_unclean", int(unclean)), ("last_run_lost_keys", lost), ("dram_only_keys", self.dram_only()),
                ("unstorable_held", self.unstorable_held())]
        stats = {"demote_usec": 0, "demoted_bytes": 0, **self.stats}
        if self._busy_since is not None:  # a batch in flight: its time so far counts too
            stats["demote_usec"] = stats.get("demote_usec", 0) + int((time.perf_counter() - self._busy_since) * 1e6)
        stats["demote_inflight_bytes"] = self._inflight
        out += [(k, v) for k, v in sorted(stats.items())]
        return out


def _info_text(text: str) -> str:
    """A message as an INFO value: one line, no commas (clients split INFO values on them)."""
    return " ".join(text.replace(",", ";").split())
