"""The SSD tier: a crash-consistent block store on preallocated segment files.

Files in `directory`:
    seg-NNNNN.dat    segments of `segment_size` bytes, carved into 4 KiB pages by one
                     OffsetAllocator each; a block is an extent of header + payload
    wal-NNNNNN.log   write-ahead logs of PUT and DEL records (wal.py)
    checkpoint       the index as of a WAL number; recovery replays logs from there
(formats in ssd_format.py).

Publish order is object first: `write_batch` writes headers and payloads, fdatasyncs
each segment it touched, appends the batch's PUT records to the WAL as one log record
(replayed all or none) and fdatasyncs it once; only then may the loop `publish` them.
Space is reused only after a record that retires it (a DEL, or a newer PUT of the key)
is durable, so replay never points at overwritten bytes; recovery still checks each
block's header against its record.

Checkpoints are merges: `checkpoint` seals the current WAL (appends move to a new
one), then replays the previous checkpoint and the sealed logs from disk with the
recovery code, and writes the result. It does not copy the live index, because the
index can lag the WAL (a batch durable but not yet published, a delete logged but
not yet forgotten), and a copy taken in that window would lose or resurrect blocks.

Threads. The event-loop thread owns the index (`entries`), the allocators and the
generation counter; its methods never do I/O and never lock:
    allocate, release_extent, publish, lookup, pin, unpin, forget,
    needs_checkpoint, stats
The blocking methods touch only files and the items handed to them; run them in an
executor thread:
    recover, write_batch, log_deletes, read_into, checkpoint, close
Among themselves, WAL appends and checkpoints are serialized by locks that only
these worker threads take. `recover` runs once, before anything else.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from crc32c import crc32c

from quilld.errors import ConfigError
from quilld.model import IdentityScope
from quilld.tiers.offset_alloc import NO_SPACE, OffsetAllocator
from quilld.tiers.ssd_format import (HEADER_SIZE, PAGE, BadCheckpoint, CheckpointEncoder, CorruptBlock, Found, Scope,
                                     SsdFailure, State, check_block_header, decode_checkpoint_body,
                                     decode_checkpoint_header, drop_overlaps, extent_pages, pack_block_header,
                                     replay_log)
from quilld.tiers.wal import DelRecord, PutRecord, WalWriter, encode_batch, parse_wal_name, wal_name

CHECKPOINT = "checkpoint"
CHECKPOINT_TMP = "checkpoint.tmp"
PROGRESS_EVERY = 10_000  # blocks verified between progress callbacks
_READ_CHUNK = 1 << 20


def seg_name(index: int) -> str:
    return f"seg-{index:05d}.dat"


class Extent:
    """Space for one block, from `allocate`: `pages` pages at byte `offset` of segment `seg`."""

    __slots__ = ("seg", "offset", "pages", "handle", "generation")

    def __init__(self, seg: int, offset: int, pages: int, handle: int, generation: int) -> None:
        self.seg, self.offset, self.pages = seg, offset, pages
        self.handle, self.generation = handle, generation


class PendingWrite:
    """A block on its way to disk. `write_batch` fills `length` and `crc` and sets
    `durable` once the batch is in the WAL; only durable writes can be published."""

    __slots__ = ("scope", "key", "payload", "extent", "length", "crc", "durable")

    def __init__(self, scope: Scope, key: bytes, payload, extent: Extent) -> None:
        self.scope, self.key, self.payload, self.extent = scope, key, payload, extent
        self.length = self.crc = 0
        self.durable = False


class SsdEntry:
    """A published block. `pins` > 0 keeps its space while reads are in flight; a
    `retired` entry (replaced or forgotten) frees its space at the last unpin."""

    __slots__ = ("scope", "key", "seg", "offset", "length", "crc", "generation", "handle",
                 "pins", "retired")

    def __init__(self, scope: Scope, key: bytes, seg: int, offset: int, length: int, crc: int,
                 generation: int, handle: int) -> None:
        self.scope, self.key, self.seg, self.offset = scope, key, seg, offset
        self.length, self.crc, self.generation, self.handle = length, crc, generation, handle
        self.pins = 0
        self.retired = False

    def __len__(self) -> int:
        return self.length


@dataclass
class RecoveryReport:
    recovered: int = 0  # blocks in the index after recovery
    dropped_corrupt: int = 0  # blocks whose header (or payload) failed, or that overlapped a newer one
    dropped_torn_wal_records: int = 0  # logs whose replay stopped at a torn or corrupt record
    checkpoint_entries: int = 0
    checkpoint_error: str | None = None  # a corrupt checkpoint: its blocks are lost
    wal_files: int = 0
    wal_records: int = 0  # PUT and DEL operations replayed
    wal_bytes: int = 0
    wal_stops: list[str] = field(default_factory=list)  # "file@offset: why" per early stop
    verified_payloads: bool = False
    duration_s: float = 0.0


class SsdTier:
    """The SSD block store in `directory`: `size // segment_size` segments of
    `segment_size` bytes. `needs_checkpoint` turns true past `checkpoint_wal_bytes` of
    log; `fsync=False` skips every sync (tests and benchmarks only). Nothing touches
    the disk until `recover`."""

    def __init__(self, directory: str, size: int, segment_size: int, *,
                 checkpoint_wal_bytes: int = 64 << 20, fsync: bool = True) -> None:
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
        self.entries: dict[tuple[Scope, bytes], SsdEntry] = {}  # loop thread
        self.failed: str | None = None  # the first fatal error; set by any thread, never cleared
        self.last_checkpoint: float | None = None
        self._allocs: list[OffsetAllocator] = []  # loop thread, one per segment
        self._cursor = 0  # segment that last had room
        self._next_gen = 1
        self._fds: list[int] = []
        self._wal: WalWriter | None = None
        self._wal_bytes = 0  # bytes in logs not yet merged into a checkpoint
        self._wal_lock = threading.Lock()  # workers only: appends, syncs and rotation
        self._checkpoint_lock = threading.Lock()  # workers only: one checkpoint at a time
        self._stat_lock = threading.Lock()  # workers only
        self._fsyncs = 0
        self._fsync_last = self._fsync_total = self._fsync_max = 0.0
        self._dirty = 0

    # -- loop thread -----------------------------------------------------------

    def allocate(self, length: int) -> Extent | None:
        """Space for a block of `length` payload bytes, or None when full (or failed)."""
        if self.failed or not self._allocs:
            return None
        pages = extent_pages(length)
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
        """Give back an extent that will not be published (never written, or its batch failed)."""
        self._allocs[extent.seg].free(extent.handle)

    def publish(self, items: Iterable[PendingWrite]) -> list[SsdEntry]:
        """Index the blocks of a batch `write_batch` made durable; returns the new entries.

        An older entry of the same key is retired (its space freed once unpinned);
        an item older than the entry already indexed is dropped and its space freed.
        """
        out = []
        for it in items:
            if not it.durable:
                raise ValueError("publish() of a write that write_batch() did not make durable")
            ext = it.extent
            k = (it.scope, it.key)
            old = self.entries.get(k)
            if old is not None and old.generation > ext.generation:
                self._allocs[ext.seg].free(ext.handle)
                continue
            entry = SsdEntry(it.scope, it.key, ext.seg, ext.offset, it.length, it.crc,
                             ext.generation, ext.handle)
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
            self._allocs[entry.seg].free(entry.handle)

    def forget(self, entry: SsdEntry) -> None:
        """Unindex `entry` and free its space; call after `log_deletes([entry])` returned
        (or failed: a failed tier never writes again, so its space is never reused)."""
        k = (entry.scope, entry.key)
        if self.entries.get(k) is entry:
            del self.entries[k]
        self._retire(entry)

    def _retire(self, entry: SsdEntry) -> None:
        if not entry.retired:
            entry.retired = True
            if not entry.pins:
                self._allocs[entry.seg].free(entry.handle)

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
            "last_checkpoint": self.last_checkpoint or 0.0,
            "fsyncs": n,
            "fsync_last_ms": round(self._fsync_last * 1e3, 3),
            "fsync_avg_ms": round(self._fsync_total * 1e3 / n, 3) if n else 0.0,
            "fsync_max_ms": round(self._fsync_max * 1e3, 3),
            "dirty_bytes": self._dirty,
            "failed": self.failed is not None,
            "error": self.failed or "",
        }

    # -- worker threads: writes ------------------------------------------------

    def write_batch(self, items: list[PendingWrite]) -> None:
        """Make a batch durable (payloads, then the WAL); raises SsdFailure on an I/O error,
        after which the tier is failed and none of the batch may be published."""
        self._check_writable()
        if not items:
            return
        views = []
        for it in items:
            view = memoryview(it.payload).cast("B")
            if HEADER_SIZE + len(view) > it.extent.pages * PAGE:
                raise ValueError(f"{len(view)} bytes do not fit an extent of {it.extent.pages} pages")
            views.append(view)
        touched: dict[int, int] = {}
        nbytes = 0
        try:
            for it, view in zip(items, views):
                ext = it.extent
                it.length, it.crc = len(view), crc32c(view)
                header = pack_block_header(it.key, it.scope, ext.generation, it.length, it.crc)
                fd = self._fds[ext.seg]
                _pwrite_all(fd, [header, view], ext.offset)
                touched[ext.seg] = fd
                nbytes += HEADER_SIZE + it.length
                self._count_dirty(HEADER_SIZE + it.length)
            for fd in touched.values():
                self._sync(fd)
            record = encode_batch(PutRecord(it.extent.generation, tuple(it.scope), it.key,
                                            it.extent.seg, it.extent.offset, it.length, it.crc)
                                  for it in items)
            with self._wal_lock:
                self._check_writable()
                self._append(record)
        except OSError as e:
            raise self._fail(f"write_batch: {e}") from e
        finally:
            self._count_dirty(-nbytes)
        for it in items:
            it.durable = True

    def log_deletes(self, entries: Iterable[SsdEntry]) -> None:
        """Durably record that these block versions are deleted; then `forget` them."""
        self._check_writable()
        ops = [DelRecord(e.generation, tuple(e.scope), e.key) for e in entries]
        if not ops:
            return
        record = encode_batch(ops)
        try:
            with self._wal_lock:
                self._check_writable()
                self._append(record)
        except OSError as e:
            raise self._fail(f"log_deletes: {e}") from e

    def _append(self, record: bytes) -> None:
        """Append one batch record and sync it (WAL lock held)."""
        self._wal_bytes += self._wal.append([record])
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

    def _sync_dir(self) -> None:
        if not self.fsync:
            return
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._sync(fd, data_only=False)
        finally:
            os.close(fd)

    # -- worker threads: reads -------------------------------------------------

    def read_into(self, entry: SsdEntry, buf) -> None:
        """Read `entry`'s payload into `buf[:entry.length]` and verify it (header and
        payload CRC); raises CorruptBlock on a mismatch, SsdFailure on an I/O error.
        Pin the entry around the call so its space cannot be reused meanwhile."""
        view = memoryview(buf).cast("B")
        if len(view) < entry.length:
            raise ValueError(f"buffer of {len(view)} bytes for a {entry.length}-byte block")
        header = bytearray(HEADER_SIZE)
        target = view[:entry.length]
        try:
            n = _pread_all(self._fds[entry.seg], [header, target], entry.offset)
        except OSError as e:
            raise self._fail(f"read of {seg_name(entry.seg)}: {e}") from e
        if n < HEADER_SIZE + entry.length:
            raise CorruptBlock(f"short read ({n} bytes) at {seg_name(entry.seg)}@{entry.offset}")
        check_block_header(header, entry.key, entry.scope, entry.generation, entry.length, entry.crc)
        if crc32c(target) != entry.crc:
            raise CorruptBlock("payload checksum mismatch")

    # -- worker threads: recovery and checkpoints --------------------------------

    def recover(self, progress: Callable[[int, int], None] | None = None, *,
                verify_payloads: bool = False) -> RecoveryReport:
        """Open the tier: create or check segments, load the checkpoint, replay the logs,
        verify every recovered block, rebuild the allocators, and start a new log.

        Every block's header is checked against its record; with `verify_payloads` its
        payload CRC too (reading the whole tier; otherwise the CRC is checked on every
        read). `progress(done, total)` is called every PROGRESS_EVERY blocks verified.
        Ends with a fresh checkpoint unless nothing was replayed or dropped.
        """
        if self._fds or self._allocs:
            raise RuntimeError("recover() runs once per SsdTier")
        start = time.perf_counter()
        report = RecoveryReport(verified_payloads=verify_payloads)
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._open_segments()
            state, max_gen, wal_start, numbers = self._read_state(report)
            live = self._verify(state, report, progress, verify_payloads)
            self._build_index(live)
            self._next_gen = max_gen + 1
            new = max([wal_start, 1, *(n + 1 for n in numbers)])
            self._open_wal(new)
            if report.wal_records or report.wal_stops or report.dropped_corrupt \
                    or report.checkpoint_error:
                self._write_checkpoint({k: loc for found in live for _, _, k, loc in found},
                                       new, max_gen)
            self._remove_wals_below(new)
        except OSError as e:
            self.close()
            raise self._fail(f"recovery: {e}") from e
        except BaseException:
            self.close()
            raise
        report.recovered = len(self.entries)
        report.duration_s = time.perf_counter() - start
        return report

    def checkpoint(self) -> int | None:
        """Merge the checkpoint and the logs written so far into a new checkpoint, then
        delete those logs. Returns the entries written, or None if one is already running.
        Writes may continue meanwhile (they go to a new log)."""
        if not self._checkpoint_lock.acquire(blocking=False):
            return None
        try:
            self._check_writable()
            try:
                with self._wal_lock:
                    self._check_writable()
                    sealed_bytes = self._wal_bytes
                    new = self._wal.number + 1
                    self._wal.close()
                    self._open_wal(new)
                report = RecoveryReport()
                state, max_gen, _, _ = self._read_state(report, upto=new)
                if report.checkpoint_error or report.wal_stops:
                    problems = [report.checkpoint_error or "", *report.wal_stops]
                    raise self._fail("checkpoint: unreadable: " + "; ".join(p for p in problems if p))
                self._write_checkpoint(state, new, max_gen)
                self._remove_wals_below(new)
            except OSError as e:
                raise self._fail(f"checkpoint: {e}") from e
            with self._wal_lock:
                self._wal_bytes -= sealed_bytes
            self.last_checkpoint = time.time()
            return len(state)
        finally:
            self._checkpoint_lock.release()

    def close(self) -> None:
        """Close the files; call when no other method is running."""
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _open_segments(self) -> None:
        names = os.listdir(self.directory)
        for name in names:
            if name == CHECKPOINT_TMP or name.startswith("seg-") and name.endswith(".tmp"):
                os.unlink(self._path(name))  # a checkpoint or segment creation cut short
        extra = sorted(n for n in names if n.startswith("seg-") and n.endswith(".dat")
                       and n[4:-4].isdigit() and int(n[4:-4]) >= self.segments)
        if extra:
            raise ConfigError(f"{self.directory} has segments beyond ssd.size ({extra[0]}, ...);"
                              " shrinking the SSD tier would lose them")
        created = False
        for i in range(self.segments):
            path = self._path(seg_name(i))
            if os.path.exists(path):
                fd = os.open(path, os.O_RDWR)
                size = os.fstat(fd).st_size
                if size != self.segment_size:
                    os.close(fd)
                    raise ConfigError(f"{path} is {size} bytes but ssd.segment_size is "
                                      f"{self.segment_size}")
            else:
                fd = self._create_segment(path)
                created = True
            self._fds.append(fd)
        if created:
            self._sync_dir()

    def _create_segment(self, path: str) -> int:
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, self.segment_size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, self.segment_size)  # no preallocation on this filesystem
            self._sync(fd, data_only=False)
            os.replace(tmp, path)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def _open_wal(self, number: int) -> None:
        self._wal = WalWriter(self._path(wal_name(number)), number)
        self._sync_dir()

    def _wal_numbers(self) -> list[int]:
        return sorted(n for n in map(parse_wal_name, os.listdir(self.directory)) if n is not None)

    def _remove_wals_below(self, number: int) -> None:
        for n in self._wal_numbers():
            if n < number:
                os.unlink(self._path(wal_name(n)))

    def _read_state(self, report: RecoveryReport, upto: int | None = None,
                    ) -> tuple[State, int, int, list[int]]:
        """Replay the checkpoint and the logs numbered below `upto` (all if None).

        Returns (state, highest generation, the checkpoint's first uncovered log,
        the numbers of the logs replayed). Problems are written into `report`.
        """
        scopes: dict[Scope, IdentityScope] = {}
        state: State = {}
        max_gen = wal_start = 0
        try:
            with open(self._path(CHECKPOINT), "rb") as f:
                header = decode_checkpoint_header(f.read(HEADER_SIZE))
                chunks = iter(lambda: f.read(_READ_CHUNK), b"")
                for scope, key, loc in decode_checkpoint_body(header, chunks):
                    s = scopes.get(scope)
                    if s is None:
                        s = scopes[scope] = IdentityScope(*scope)
                    state[(s, key)] = loc
            wal_start, max_gen = header.wal_start, header.max_generation
            report.checkpoint_entries = len(state)
        except FileNotFoundError:
            pass
        except BadCheckpoint as e:
            state = {}
            report.checkpoint_error = f"{CHECKPOINT}: {e}"
            wal_start = 0  # replay whatever logs are left
        numbers = [n for n in self._wal_numbers()
                   if n >= wal_start and (upto is None or n < upto)]
        for n in numbers:
            with open(self._path(wal_name(n)), "rb") as f:
                data = f.read()
            report.wal_files += 1
            report.wal_bytes += len(data)
            replayed, gen, stop = replay_log(data, state, scopes)
            report.wal_records += replayed
            max_gen = max(max_gen, gen)
            if stop is not None:
                report.wal_stops.append(f"{wal_name(n)}@{stop}")
                report.dropped_torn_wal_records += 1
        return state, max_gen, wal_start, numbers

    def _verify(self, state: State, report: RecoveryReport,
                progress: Callable[[int, int], None] | None, payloads: bool,
                ) -> list[list[Found]]:
        """Per segment, sorted by offset: the blocks of `state` whose on-disk header (and
        payload) match their record, minus any that overlap a newer one. Counts the rest."""
        total = len(state)
        per_seg: list[list[Found]] = [[] for _ in range(self.segments)]
        fds, seg_size = self._fds, self.segment_size
        # headers are read through a read-only mapping: a slice per block, not a syscall
        maps = [mmap.mmap(fd, seg_size, prot=mmap.PROT_READ) for fd in fds]
        try:
            dropped = self._verify_mapped(state, maps, per_seg, progress, payloads)
        finally:
            for m in maps:
                m.close()
        if progress is not None and (total == 0 or total % PROGRESS_EVERY):
            progress(total, total)  # the last report, unless the loop just made it
        for i, found in enumerate(per_seg):
            found.sort()
            kept = drop_overlaps(found)
            dropped += len(found) - len(kept)
            per_seg[i] = kept
        report.dropped_corrupt += dropped
        return per_seg

    def _verify_mapped(self, state: State, maps: list, per_seg: list[list[Found]],
                       progress: Callable[[int, int], None] | None, payloads: bool) -> int:
        total, seg_size, dropped = len(state), self.segment_size, 0
        for done, (k, loc) in enumerate(state.items(), 1):
            if progress is not None and done % PROGRESS_EVERY == 0:
                progress(done, total)
            seg, offset, length, crc, gen = loc
            pages = extent_pages(length)
            if not 0 <= seg < len(maps) or offset % PAGE or not 0 <= offset <= seg_size - pages * PAGE:
                dropped += 1
                continue
            m = maps[seg]
            if m[offset:offset + HEADER_SIZE] != pack_block_header(k[1], k[0], gen, length, crc):
                dropped += 1
                continue
            if payloads:
                with memoryview(m) as view:
                    ok = crc32c(view[offset + HEADER_SIZE:offset + HEADER_SIZE + length]) == crc
                if not ok:
                    dropped += 1
                    continue
            per_seg[seg].append((offset // PAGE, pages, k, loc))
        return dropped

    def _build_index(self, per_seg: list[list[Found]]) -> None:
        seg_pages = self.segment_size // PAGE
        entries = self.entries
        for seg, found in enumerate(per_seg):
            alloc, handles = OffsetAllocator.from_extents(seg_pages, [(o, p) for o, p, _, _ in found])
            self._allocs.append(alloc)
            for (_, _, (scope, key), (_, offset, length, crc, gen)), handle in zip(found, handles):
                entries[(scope, key)] = SsdEntry(scope, key, seg, offset, length, crc, gen, handle)

    def _write_checkpoint(self, state: State, wal_start: int, max_gen: int) -> None:
        """Write `state` to checkpoint.tmp, sync it, rename it over the checkpoint, sync the
        directory. A crash at any point leaves the old or the new checkpoint, whole."""
        enc = CheckpointEncoder(state, wal_start, max_gen)
        tmp = self._path(CHECKPOINT_TMP)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = HEADER_SIZE
            for chunk in enc.body():
                _pwrite_all(fd, [chunk], pos)
                pos += len(chunk)
            _pwrite_all(fd, [enc.header()], 0)
            self._sync(fd, data_only=False)
        finally:
            os.close(fd)
        os.replace(tmp, self._path(CHECKPOINT))
        self._sync_dir()


def _rest(bufs: list, skip: int) -> list[memoryview]:
    """The buffers after their first `skip` bytes."""
    out = []
    for b in bufs:
        v = memoryview(b).cast("B")
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


def _pwrite_all(fd: int, bufs: list, offset: int) -> None:
    total = sum(memoryview(b).nbytes for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    while done < total:
        done += os.pwritev(fd, _rest(bufs, done), offset + done)


def _pread_all(fd: int, bufs: list, offset: int) -> int:
    """Bytes read into `bufs`; fewer than their total only at the end of the file."""
    total = sum(memoryview(b).nbytes for b in bufs)
    done = n = os.preadv(fd, bufs, offset)
    while n and done < total:
        n = os.preadv(fd, _rest(bufs, done), offset + done)
        done += n
    return done


__all__ = [
    "CorruptBlock", "Extent", "PendingWrite", "RecoveryReport", "SsdEntry", "SsdFailure",
    "SsdTier",
]
