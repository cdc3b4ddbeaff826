"""The SSD tier: a crash-consistent block store on preallocated segment files.

Files in `directory`:
    seg-NNNNN.dat         segments of `segment_size` bytes, carved into 4 KiB pages by one
                          OffsetAllocator each; a block is an extent of header + payload +
                          identity (formats in ssd_format.py)
    wal-NNNNNN.log        write-ahead logs of PUT, DEL and META records (wal.py)
    checkpoint-NNNNNN     the index as of log NNNNNN (it covers the logs below that number);
                          the newest two are kept
    tier-v4.key           the tier's secret key (the tag of every block header); without it
                          nothing on the tier is trusted: recovery starts empty
    LOCK                  flocked by the owner; its pid and how its run is going (run_state.py)

Publish order is object first: `write_blocks` writes each block's head (header and
identity, not yet COMMITTED) and payload, page-aligned, from the I/O threads (with
`direct_io`, O_DIRECT where the file system allows it: ssd_files.py); `commit` fdatasyncs each segment the
batch touched, appends the batch's PUT records to the WAL as one log record (replayed
all or none), fdatasyncs it once, and then marks the heads COMMITTED (no sync: a
checkpoint syncs them before it drops the records); only then may the loop `publish`
them. `write_batch` is the two in a row. The tiering overlaps the `write_blocks` of one
batch with the `commit` of the batch before (commits stay in order, one at a time).

Expiry. Every block carries when its value expires (unix ms, 0: never): in its header and
its PUT record, as the value had it when it was written. `log_changes` logs a META
record when it changes later (an EXPIRE, PERSIST, GETEX of a value with a copy here),
in the same group commit as deletions: the change is durable when the call returns, and
every later checkpoint holds it. Values that expire on the tier are deleted like any
other (tiering.py).

Deletion order. A version stops being wanted when a DEL record for it is durable
(`log_deletes`) or a newer PUT of its key is. Its extent is then *freed*: not given to
the allocator at once, but queued until `scrub` has zeroed its first page, so no
header of a dead version is left for a scan to find; `reclaim` then gives the space
back. Replay never points at reused bytes, and a segment scan never finds a version
that was deleted, replaced, or never logged (COMMITTED is set only after its log record).
The tiering seals a log only once every deletion logged so far is scrubbed; a version a
reader still pins is scrubbed at its last unpin (only if that outlasted two checkpoints
and then both were damaged could a scan find it).

Checkpoints are merges: `seal` starts a new log, and `checkpoint` syncs the segments
(scrubs and COMMITTED marks become durable), replays the newest checkpoint and the
sealed logs from disk with the recovery code, writes the result as a new file (temp,
fsync, rename, directory fsync) and only then deletes what the two newest checkpoints
no longer need. It does not copy the live index, because the index can lag the WAL
(a batch durable but not yet published, a delete logged but not yet forgotten), and
a copy taken in that window would lose or resurrect blocks.

Recovery (the paths, in ssd_files.py) takes the first way that works and says which
(`RecoveryReport.path`), losing only what is damaged: the newest checkpoint and its
logs; the previous checkpoint and its logs; the logs alone; a segment scan. Versions
the replay retires have their headers scrubbed, so space reused after a crash never
hides a dead header. A failed tier that can no longer log a deletion is fenced
(`fence`: its key removed) before the deletion is acknowledged.

Threads. The event-loop thread owns the index (`entries`), the allocators, the freed
queue and the generation counter; its methods never do I/O and never lock:
    allocate, release_extent, publish, lookup, pin, unpin, forget, take_freed, reclaim,
    needs_checkpoint, stats
The blocking methods touch only files and the items handed to them; run them in an
executor thread:
    recover, write_batch, write_blocks, commit, log_changes (log_deletes), scrub, fence, read_into,
    seal, checkpoint, write_run, close
`write_blocks` spreads a batch over the tier's own I/O threads (`io_threads`). Among themselves, WAL appends and checkpoints are serialized by locks that only
these worker threads take. `recover` runs once, before anything else.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from crc32c import crc32c

from quilld.errors import ConfigError
from quilld.tiers.run_state import RunState
from quilld.tiers.offset_alloc import NO_SPACE, OffsetAllocator
from quilld.tiers.ssd_entries import (Extent, Freed, PendingWrite, SsdEntry, cut_runs, page_aligned,
                                      spare_pages)
from quilld.tiers.ssd_files import (ZERO_PAGE, RecoveryPath, RecoveryReport, TierFiles, pread_all, pwrite_all,
                                    seg_name)
from quilld.tiers.ssd_format import (HEADER_SIZE, PAGE, CorruptBlock, Found, Retired, Scope, SsdFailure,
                                     block_pages, check_block_header, commit_header, pack_block_head, payload_offset)
from quilld.tiers.wal import DelRecord, MetaRecord, PutRecord, WalWriter, check_expire, encode_batch, wal_name

DELETE_RECORD_OPS = 4096  # DEL operations per log record (one sync for all of a call's records)
IOV_MAX = 1024  # buffers one pwritev takes (Linux's UIO_MAXIOV)


class SsdTier:
    """The SSD block store in `directory`: `size // segment_size` segments of
    `segment_size` bytes. `needs_checkpoint` turns true past `checkpoint_wal_bytes` of
    log; `fsync=False` skips every sync (tests and benchmarks only). Nothing touches
    the disk until `recover`."""

    def __init__(self, directory: str, size: int, segment_size: int, *,
                 checkpoint_wal_bytes: int = 64 << 20, fsync: bool = True, direct_io: bool = False,
                 io_threads: int = 4) -> None:
        if segment_size < PAGE or segment_size % PAGE:
            raise ConfigError(f"ssd segment_size must be a positive multiple of {PAGE}")
        if size < segment_size:
            raise ConfigError(f"ssd size {size} is smaller than one segment ({segment_size})")
        self.directory = os.path.abspath(directory)
        self.segment_size = segment_size
        self.segments = size // segment_size
        self.capacity = self.segments * segment_size  # a remainder below one segment is unused
        self.checkpoint_wal_bytes = checkpoint_wal_bytes
        self.fsync = fsync
        self.direct_io = direct_io  # O_DIRECT block writes where the file system allows it
        self.io_threads = max(1, io_threads)
        self._io: ThreadPoolExecutor | None = None  # the I/O threads, started at the first batch
        self.entries: dict[tuple[Scope, bytes], SsdEntry] = {}  # loop thread
        self.failed: str | None = None  # the first fatal error; set by any thread, never cleared
        self.fenced = False  # fence() ran: a restart starts empty
        self.last_checkpoint: float | None = None
        self._allocs: list[OffsetAllocator] = []  # loop thread, one per segment
        self._freed: list[Freed] = []  # loop thread: extents waiting for their scrub
        self._cursor = 0  # segment that last had room
        self._next_gen = 1
        self.files = TierFiles(self.directory, self.segments, segment_size, self._sync, fsync)
        self._wal: WalWriter | None = None
        self._wal_bytes = 0  # bytes in logs not yet merged into a checkpoint
        self._wal_lock = threading.Lock()  # workers only: appends, syncs and rotation
        self._checkpoint_lock = threading.Lock()  # workers only: one checkpoint at a time
        self._stat_lock = threading.Lock()  # workers only
        self._fsyncs = 0
        self._fsync_last = self._fsync_total = self._fsync_max = 0.0
        self._write_total = 0.0  # seconds in write_blocks
        self._dirty = 0

    # -- loop thread -----------------------------------------------------------

    def allocate(self, scope: Scope, key: bytes, length: int) -> Extent | None:
        """Space for `key`'s block of `length` payload bytes, or None when full (or failed)."""
        if self.failed or not self._allocs:
            return None
        pages = block_pages(scope, key, length)
        n = len(self._allocs)
        for i in range(n):
            s = (self._cursor + i) % n
            handle = self._allocs[s].alloc(pages)
            if handle != NO_SPACE:
                self._cursor = s
                gen = self._next_gen
                self._next_gen += 1
                return Extent(s, self._allocs[s].offset(handle) * PAGE, pages, handle, gen)
        return None

    def release_extent(self, extent: Extent) -> None:
        """Give back an extent that will not be published (never written, or its batch failed:
        a header there is not COMMITTED, so nothing needs scrubbing)."""
        self._allocs[extent.seg].free(extent.handle)

    def publish(self, items: Iterable[PendingWrite]) -> list[SsdEntry]:
        """Index the blocks of a batch `write_batch` made durable; returns the new entries.

        An older entry of the same key is retired (freed once unpinned); an item older
        than the entry already indexed is not indexed, and freed.
        """
        out = []
        for it in items:
            if not it.durable:
                raise ValueError("publish() of a write that write_batch() did not make durable")
            ext = it.extent
            k = (it.scope, it.key)
            old = self.entries.get(k)
            if old is not None and old.generation > ext.generation:
                self._freed.append((ext.seg, ext.offset, ext.handle))
                continue
            entry = SsdEntry(it.scope, it.key, ext.seg, ext.offset, it.length, it.crc,
                             ext.generation, ext.handle, it.expire)
            self.entries[k] = entry
            if old is not None:
                self._retire(old)
            out.append(entry)
        return out

    def lookup(self, scope: Scope, key: bytes) -> SsdEntry | None:
        return self.entries.get((scope, key))

    def pin(self, entry: SsdEntry) -> None:
        """Keep `entry`'s space from reuse until `unpin`; hold a pin around `read_into`."""
        entry.pins += 1

    def unpin(self, entry: SsdEntry) -> None:
        entry.pins -= 1
        if entry.retired and not entry.pins:
            self._freed.append((entry.seg, entry.offset, entry.handle))

    def forget(self, entry: SsdEntry) -> None:
        """Unindex `entry` and free it; call after `log_deletes([entry])` returned
        (or failed: a failed tier never writes again, so its space is never reused)."""
        k = (entry.scope, entry.key)
        if self.entries.get(k) is entry:
            del self.entries[k]
        self._retire(entry)

    def _retire(self, entry: SsdEntry) -> None:
        if not entry.retired:
            entry.retired = True
            if not entry.pins:
                self._freed.append((entry.seg, entry.offset, entry.handle))

    @property
    def has_freed(self) -> bool:
        return bool(self._freed)

    def take_freed(self) -> list[Freed]:
        """The freed extents, for `scrub` (then `reclaim`)."""
        freed, self._freed = self._freed, []
        return freed

    def reclaim(self, freed: list[Freed]) -> None:
        """Give scrubbed extents back to the allocators."""
        for seg, _, handle in freed:
            self._allocs[seg].free(handle)

    def needs_checkpoint(self) -> bool:
        return not self.failed and self._wal_bytes > self.checkpoint_wal_bytes

    def stats(self) -> dict[str, int | float | bool | str]:
        n = self._fsyncs
        return {
            "capacity": self.capacity,
            "used": sum(a.used for a in self._allocs) * PAGE,
            "entries": len(self.entries),
            "segments": self.segments,
            "wal_bytes": self._wal_bytes,
            "checkpoints": len(self.files.checkpoints),
            "last_checkpoint": self.last_checkpoint or 0.0,
            "fsyncs": n,
            "fsync_last_ms": round(self._fsync_last * 1e3, 3),
            "fsync_avg_ms": round(self._fsync_total * 1e3 / n, 3) if n else 0.0,
            "fsync_max_ms": round(self._fsync_max * 1e3, 3),
            "fsync_total_ms": round(self._fsync_total * 1e3, 3),
            "write_total_ms": round(self._write_total * 1e3, 3),
            "io_mode": self.files.io_mode,
            "io_threads": self.io_threads,
            "dirty_bytes": self._dirty,
            "failed": self.failed is not None,
            "fenced": self.fenced,
            "error": self.failed or "",
        }

    # -- worker threads: writes ------------------------------------------------

    def write_batch(self, items: list[PendingWrite]) -> None:
        """Make a batch durable: `write_blocks`, then `commit`. Raises SsdFailure on an I/O
        error, after which the tier is failed and none of the batch may be published."""
        self.write_blocks(items)
        self.commit(items)

    def write_blocks(self, items: list[PendingWrite]) -> None:
        """Write a batch's blocks (heads uncommitted, payloads), not synced: from the I/O
        threads, one pwritev per run of adjacent extents (at most WRITE_CHUNK bytes), with
        O_DIRECT where the file system allows it. A payload in page-aligned memory (an arena
        block) goes to the disk from where it lies, but for its last partial page, copied
        into a zeroed page (so no stale bytes of the arena reach the disk); any other payload
        is copied into aligned memory under O_DIRECT. The CRC32C of a payload is computed
        on the I/O thread that writes it, unless the item came with it. Then `commit`."""
        self._check_writable()
        for it in items:  # refused before anything is written (Unstorable), the tier still working
            check_expire(it.expire)
            n = memoryview(it.payload).nbytes
            if block_pages(it.scope, it.key, n) > it.extent.pages:
                raise ValueError(f"{n} bytes do not fit an extent of {it.extent.pages} pages")
        runs = cut_runs(sorted(items, key=lambda it: (it.extent.seg, it.extent.offset)))
        t0 = time.perf_counter()
        try:
            if len(runs) == 1 or self.io_threads == 1:
                for run in runs:
                    self._write_run(run)
            else:
                pool = self._io_pool()
                for f in [pool.submit(self._write_run, run) for run in runs]:
                    f.result()
        except OSError as e:
            raise self._fail(f"write_blocks: {e}") from e
        with self._stat_lock:
            self._write_total += time.perf_counter() - t0

    def _write_run(self, run: list[PendingWrite]) -> None:
        """One pwritev of adjacent blocks (I/O thread)."""
        direct = self.files.direct
        key = self.files.key
        spare = sum(spare_pages(it, direct) for it in run)
        scratch = memoryview(mmap.mmap(-1, spare * PAGE))  # page-aligned and zeroed
        bufs: list = []
        pos = nbytes = 0
        for it in run:
            view = memoryview(it.payload).cast("B")
            it.length = n = len(view)
            if it.crc is None:
                it.crc = crc32c(view)
            head = payload_offset(it.scope, it.key, n)
            it.head = scratch[pos:pos + PAGE]
            header = pack_block_head(it.key, it.scope, it.extent.generation, n, it.crc, it.expire, committed=False,
                                     tier_key=key, into=scratch[pos:pos + (head if head % PAGE == 0 else PAGE)])
            it.header = header
            if head % PAGE:  # packed: the payload inside the head page, one page in all
                scratch[pos + head:pos + head + n] = view
                bufs.append(scratch[pos:pos + PAGE])
                pos += PAGE
                nbytes += PAGE
                continue
            bufs.append(scratch[pos:pos + head])
            pos += head
            full = n - n % PAGE if not direct or page_aligned(view) else 0
            if full:
                bufs.append(view[:full])
            if full < n:
                rest = -(-(n - full) // PAGE) * PAGE
                scratch[pos:pos + n - full] = view[full:]
                bufs.append(scratch[pos:pos + rest])
                pos += rest
            nbytes += head + -(-n // PAGE) * PAGE
        fd, offset = self.files.dfds[run[0].extent.seg], run[0].extent.offset
        self._count_dirty(nbytes)
        for i in range(0, len(bufs), IOV_MAX):  # a very long run of small blocks: several calls
            chunk = bufs[i:i + IOV_MAX]
            pwrite_all(fd, chunk, offset)
            offset += sum(b.nbytes for b in chunk)

    def commit(self, items: list[PendingWrite]) -> None:
        """Make written blocks durable and findable: fdatasync each segment they touched, append
        their PUT records to the WAL as one log record and fdatasync it, then mark their heads
        COMMITTED (whole pages through the page cache, no sync: a checkpoint syncs them before
        it drops the records). Marks the items `durable`."""
        self._check_writable()
        if not items:
            return
        nbytes = sum(it.extent.pages * PAGE for it in items)
        try:
            for seg in sorted({it.extent.seg for it in items}):
                self._sync(self.files.dfds[seg])
            record = encode_batch(PutRecord(it.extent.generation, tuple(it.scope), it.key,
                                            it.extent.seg, it.extent.offset, it.length, it.crc, it.expire)
                                  for it in items)
            with self._wal_lock:
                self._check_writable()
                self._append([record])
            for it in items:  # durable now: a scan may take them
                page = bytearray(it.head)
                page[:HEADER_SIZE] = commit_header(it.header)
                pwrite_all(self.files.fds[it.extent.seg], [page], it.extent.offset)
                it.head = None
        except OSError as e:
            raise self._fail(f"commit: {e}") from e
        finally:
            self._count_dirty(-nbytes)
        for it in items:
            it.durable = True

    def _io_pool(self) -> ThreadPoolExecutor:
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="ssd-io")
        return self._io

    def log_deletes(self, entries: Iterable[SsdEntry]) -> None:
        """Durably record that these block versions are deleted (one WAL sync for all of
        them); then `forget` them."""
        self.log_changes(entries, ())

    def log_changes(self, deleted: Iterable[SsdEntry], retimed: Iterable[SsdEntry]) -> None:
        """Durably record, with one WAL sync for all of them, that the `deleted` block
        versions are deleted (then `forget` them) and that the `retimed` ones now expire at
        their entry's `expire` (a META record each)."""
        self._check_writable()
        ops: list = [MetaRecord(e.generation, tuple(e.scope), e.key, e.expire) for e in retimed]
        ops += [DelRecord(e.generation, tuple(e.scope), e.key) for e in deleted]
        if not ops:
            return
        records = [encode_batch(ops[i:i + DELETE_RECORD_OPS]) for i in range(0, len(ops), DELETE_RECORD_OPS)]
        try:
            with self._wal_lock:
                self._check_writable()
                self._append(records)
        except OSError as e:
            raise self._fail(f"log_changes: {e}") from e

    def scrub(self, freed: list[Freed]) -> None:
        """Zero the first page of each freed extent (no sync: the next sync of its segment,
        at the latest the next checkpoint's, makes it durable); then `reclaim` them."""
        self._check_writable()
        try:
            for seg, offset, _ in freed:
                pwrite_all(self.files.fds[seg], [ZERO_PAGE], offset)
        except OSError as e:
            raise self._fail(f"scrub: {e}") from e

    def fence(self) -> None:
        """Make everything on the tier untrusted for every later start (remove its key):
        what a failed tier does before acknowledging a deletion it can no longer log.
        Raises OSError when even that is impossible."""
        self.files.remove_key()
        self.fenced = True

    def _append(self, records: list[bytes]) -> None:
        """Append log records and sync them once (WAL lock held)."""
        self._wal_bytes += self._wal.append(records)
        self._sync(self._wal.fd)

    def _check_writable(self) -> None:
        if self.failed:
            raise SsdFailure(f"ssd tier failed: {self.failed}")
        if self._wal is None:
            raise RuntimeError("ssd tier is not open (call recover() first)")

    def _fail(self, reason: str) -> SsdFailure:
        if self.failed is None:
            self.failed = reason
        return SsdFailure(reason)

    def _sync(self, fd: int, data_only: bool = True) -> None:
        """fdatasync (or fsync) `fd` and count it; nothing with fsync off."""
        if not self.fsync:
            return
        t = time.perf_counter()
        if data_only:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
        dt = time.perf_counter() - t
        with self._stat_lock:
            self._fsyncs += 1
            self._fsync_last = dt
            self._fsync_total += dt
            self._fsync_max = max(self._fsync_max, dt)

    def _count_dirty(self, n: int) -> None:
        with self._stat_lock:
            self._dirty += n

    # -- worker threads: reads -------------------------------------------------

    def read_into(self, entry: SsdEntry, buf) -> None:
        """Read `entry`'s payload into `buf[:entry.length]` and verify it (header and
        payload CRC); raises CorruptBlock on a mismatch, SsdFailure on an I/O error.
        Pin the entry around the call so its space cannot be reused meanwhile."""
        view = memoryview(buf).cast("B")
        if len(view) < entry.length:
            raise ValueError(f"buffer of {len(view)} bytes for a {entry.length}-byte block")
        head = bytearray(payload_offset(entry.scope, entry.key, entry.length))
        target = view[:entry.length]
        try:
            n = pread_all(self.files.fds[entry.seg], [head, target], entry.offset)
        except OSError as e:
            raise self._fail(f"read of {seg_name(entry.seg)}: {e}") from e
        header = memoryview(head)[:HEADER_SIZE]
        if n < len(head) + entry.length:
            raise CorruptBlock(f"short read ({n} bytes) at {seg_name(entry.seg)}@{entry.offset}")
        check_block_header(header, entry.key, entry.scope, entry.generation, entry.length, entry.crc)
        if crc32c(target) != entry.crc:
            raise CorruptBlock("payload checksum mismatch")

    # -- worker threads: recovery and checkpoints --------------------------------

    def recover(self, progress: Callable[[int, int], None] | None = None, *,
                verify_payloads: bool = False) -> RecoveryReport:
        """Open the tier: create or check segments and the key, rebuild the index by the
        first path that works (see the module docstring), verify every recovered block,
        scrub the headers of versions the replay retired, rebuild the allocators, and
        start a new log.

        Every block's header is checked against its record; with `verify_payloads` its
        payload CRC too (reading the whole tier; otherwise the CRC is checked on every
        read). `progress(done, total)` is called every PROGRESS_EVERY blocks verified.
        Ends with a fresh checkpoint unless nothing was replayed, dropped or damaged.

        Raises ConfigError when the directory cannot be used at all (created, locked, its
        segments or key created or opened): a start that cannot be right; SsdFailure for an
        I/O error after that (the node may serve from DRAM only).
        """
        if self.files.fds or self._allocs:
            raise RuntimeError("recover() runs once per SsdTier")
        start = time.perf_counter()
        report = RecoveryReport(verified_payloads=verify_payloads)
        files = self.files
        try:
            try:
                files.open_segments(self.direct_io)
                fresh = files.open_key(report)
            except OSError as e:  # the directory cannot be used at all: a start that cannot be right
                self.close()
                where = f" ({e.filename})" if e.filename else ""
                raise ConfigError(f"ssd.dir {self.directory} cannot be used: {e.strerror or e}{where}") from e
            retired: Retired = []
            if fresh:
                state, max_gen, base = {}, 0, None
            else:
                state, max_gen, base, _ = files.load_state(report, retired=retired)
            live = files.verify(state, report, progress, verify_payloads)
            report.scrubbed = files.scrub_retired(retired, live)
            self._build_index(live)
            self._next_gen = max_gen + 1
            files.checkpoints = [n for n in files.checkpoint_numbers() if base is not None and n <= base]
            new = max([1, *(n + 1 for n in files.wal_numbers()), *files.checkpoint_numbers()])
            self._open_wal(new)
            if report.wal_records or report.wal_stops or report.dropped_corrupt or report.scrubbed \
                    or report.path not in (RecoveryPath.FRESH, RecoveryPath.CHECKPOINT):
                files.sync_segments()  # the scrubs, before the records that retired them go
                files.write_checkpoint({k: loc for found in live for _, _, k, loc in found}, new, max_gen)
            files.retain()
        except OSError as e:
            self.close()
            raise self._fail(f"recovery: {e}") from e
        except BaseException:
            self.close()
            raise
        report.recovered = len(self.entries)
        report.duration_s = time.perf_counter() - start
        return report

    def seal(self) -> int:
        """Start a new log; returns its number (a checkpoint up to it covers the logs before)."""
        with self._wal_lock:
            self._check_writable()
            new = self._wal.number + 1
            self._wal.close()
            try:
                self._open_wal(new)
            except OSError as e:
                raise self._fail(f"seal: {e}") from e
            return new

    def checkpoint(self, upto: int | None = None) -> int | None:
        """Merge the newest checkpoint and the logs below `upto` (sealing now when None)
        into a new checkpoint, then delete what the two newest no longer need. Returns
        the entries written, or None if one is already running. Writes may continue
        meanwhile (they go to a newer log)."""
        if not self._checkpoint_lock.acquire(blocking=False):
            return None
        try:
            if upto is None:
                upto = self.seal()
            self._check_writable()
            files = self.files
            try:
                files.sync_segments()  # scrubs and COMMITTED marks, before their records go
                report = RecoveryReport()
                state, max_gen, _, _ = files.load_state(report, upto=upto, scan=False)
                if report.wal_stops:
                    raise SsdFailure("unreadable log: " + "; ".join(report.wal_stops))
                files.write_checkpoint(state, upto, max_gen)
                files.retain()
                with self._wal_lock:
                    self._wal_bytes = self._wal.size + sum(
                        os.path.getsize(files.path(wal_name(n))) for n in files.wal_numbers()
                        if upto <= n < self._wal.number)
            except (OSError, SsdFailure) as e:
                raise self._fail(f"checkpoint: {e}") from e
            self.last_checkpoint = time.time()
            return len(state)
        finally:
            self._checkpoint_lock.release()

    def write_run(self, run: RunState, sync: bool = False) -> None:
        """Record how this run is going in LOCK (run_state.py); `sync` makes it durable.
        Raises OSError."""
        self.files.run = run
        self.files.write_run(sync)

    def close(self) -> None:
        """Close the files; call when no other method is running."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        self.files.close()

    def _open_wal(self, number: int) -> None:
        self._wal = WalWriter(self.files.path(wal_name(number)), number)
        self.files.sync_dir()

    def _build_index(self, per_seg: list[list[Found]]) -> None:
        seg_pages = self.segment_size // PAGE
        entries = self.entries
        for seg, found in enumerate(per_seg):
            alloc, handles = OffsetAllocator.from_extents(seg_pages, [(o, p) for o, p, _, _ in found])
            self._allocs.append(alloc)
            for (_, _, (scope, key), (_, offset, length, crc, gen, expire)), handle in zip(found, handles):
                entries[(scope, key)] = SsdEntry(scope, key, seg, offset, length, crc, gen, handle, expire)



__all__ = [
    "CorruptBlock", "Extent", "PendingWrite", "RecoveryPath", "RecoveryReport", "SsdEntry", "SsdFailure",
    "SsdTier", "seg_name",
]
