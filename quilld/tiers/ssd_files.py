"""The SSD tier's directory, as its worker threads see it: segment files, the tier key,
checkpoint files and logs by number, and rebuilding an index from them (recovery).

Recovery takes the first path that works and says which (`RecoveryPath`), losing
only what is damaged:
1. the newest checkpoint, then the logs from its number;
2. the checkpoint before it (kept until a newer one is durable), then its logs;
3. the logs alone, when they go back to the first (no checkpoint was ever written,
   or every one is damaged and nothing was deleted yet);
4. a scan of every segment for committed blocks whose tag checks out under the
   tier key (ssd_format.scan_segment), merged into the best checkpoint that still
   reads (newest generation per key), then every log that checkpoint needs (every
   log when none reads).
Paths 1-3 hold only while every log they replay reads to its end and none is missing:
a log with any damage (a flipped byte at its start, middle or end, a torn tail, a
zero-filled stretch: `WalReader` names each one) or a gap in the numbers lost
records whose blocks may be on the disk, so recovery takes path 4 instead, and the
replay there still applies every record the damage spared (the reader resynchronizes
at the next 32 KiB block). A block that is COMMITTED and whose tag checks out comes
back even if the record that named it is lost; a deleted one does not, because its
head page was zeroed before its DEL record could ever leave the logs (ssd.py), and
an imitated one does not, because its tag does not check out. What damage can still
cost: a change whose only durable trace was the damaged record (a deletion whose
scrub a crash also lost, an expiry a META record changed since the block's write).

Each step is replayed by the same rules (ssd_format.apply_record), so a version
that a later record deleted or replaced never comes back by any path; the versions
the replay retires are listed so their headers can be scrubbed.

No tier key means nothing on the tier is trusted: a fenced tier (ssd.py `fence`)
or one written by an older format. Its checkpoints and logs are removed and it
starts empty with a new key, so no scan can ever find its blocks again. Each format
names its key file: format 1 had none, format 2 kept `tier.key`, format 3
`tier-v3.key`, format 4 keeps `tier-v4.key`, so a directory of an older format starts
empty under format 4 (and says so: RecoveryReport.key_error), and one of format 4
starts empty under an older one.

With ssd.direct_io on, block writes go through a second descriptor per segment opened with
O_DIRECT where the file system allows it (`open_segments` probes it with one aligned page
in a scratch file; tmpfs before Linux 6.6 refuses O_DIRECT at open): the payload moves from
DRAM to the device without the page cache. Otherwise both descriptors are the plain ones
(`io_mode` says which, and why).
The tier's files are its owner's alone: the directory is created 0700 and every file
in it 0600 (FILE_MODE), and a key file others can read refuses the start, as ssh refuses
a private key others can read (a reader of the key could forge blocks a scan takes).
Segments are preallocated in full: `open_segments` first checks that the file system has
room for the ones still to create (refusing with the size asked and the space free), and
a start that fails while creating them removes what it created, so no partial tier is
left behind.
One process at a time owns the directory: `open_segments` takes an exclusive flock on
LOCK_FILE (released when the files close or the process ends), so a second quilld
pointed at the same directory is refused instead of writing over the first's blocks.
LOCK also says how the run that owns it is going (run_state.py): `previous_run` is what
the last owner left there (did it stop cleanly; if not, about how many keys it held only
in DRAM), read before this run writes its own.
Reads, scrubs and COMMITTED marks use the plain descriptor: a scrub or mark is a whole
page, so the page cache never reads before it writes, and the kernel writes such a
cached page back (and drops it) before a later O_DIRECT write to the same range.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import errno
import fcntl
import mmap
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from crc32c import crc32c

from quilld.errors import ConfigError
from quilld.model import IdentityScope
from quilld.tiers.run_state import RUNNING, RunState
from quilld.tiers.ssd_format import (COMMITTED, HEADER_SIZE, KEY_SIZE, PAGE, BadCheckpoint, CheckpointEncoder, Found,
                                     Retired, Scope, SsdFailure, State, apply_record, block_pages, commit_header,
                                     decode_checkpoint_body, decode_checkpoint_header, drop_overlaps, header_matches,
                                     payload_offset, replay_log, scan_segment)
from quilld.tiers.wal import FILE_MODE, PutRecord, parse_wal_name, wal_name

CHECKPOINT_PREFIX = "checkpoint-"
LEGACY_CHECKPOINT = "checkpoint"  # format 1 kept one file of this name
KEY_FILE = "tier-v4.key"  # the key of a format 4 tier
OLDER_KEY_FILES = {"tier.key": 2, "tier-v3.key": 3}  # such a tier starts empty (see the module docstring)
PROBE_FILE = "direct-io.probe"
LOCK_FILE = "LOCK"  # flocked by the process that owns the directory; holds its pid
DIR_MODE = 0o700  # the tier's directory, when quilld creates it
KEEP_CHECKPOINTS = 2
PROGRESS_EVERY = 10_000  # blocks verified between progress callbacks
ZERO_PAGE = bytes(PAGE)
_READ_CHUNK = 1 << 20


def size_text(n: int) -> str:
    """A size for a person: GiB from one GiB up, else MiB."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def seg_name(index: int) -> str:
    return f"seg-{index:05d}.dat"


def checkpoint_name(number: int) -> str:
    return f"{CHECKPOINT_PREFIX}{number:06d}"


def parse_checkpoint_name(name: str) -> int | None:
    """The log number a checkpoint file name covers up to, or None for any other name."""
    rest = name[len(CHECKPOINT_PREFIX):]
    if name.startswith(CHECKPOINT_PREFIX) and rest.isdigit():
        return int(rest)
    return None


class RecoveryPath(str, enum.Enum):
    """How recovery rebuilt the index (best first)."""

    FRESH = "fresh"  # nothing on the tier yet
    CHECKPOINT = "checkpoint"  # the newest checkpoint and the logs after it
    PREVIOUS = "previous-checkpoint"  # the newest checkpoint was damaged: the one before it, and its logs
    LOG = "log"  # no usable checkpoint, but the logs go back to the first: the logs alone
    SCAN = "segment-scan"  # a damaged log, or no usable checkpoint: the segments' committed blocks, then the logs
    FENCED = "fenced"  # no tier key (fenced after a failure, or an older format): started empty


@dataclass
class RecoveryReport:
    path: str = RecoveryPath.FRESH.value  # how the index was rebuilt (RecoveryPath)
    recovered: int = 0  # blocks in the index after recovery
    dropped_corrupt: int = 0  # blocks whose header (or payload) failed, or that overlapped a newer one
    dropped_torn_wal_records: int = 0  # logs whose replay stopped at a torn or corrupt record
    checkpoint_entries: int = 0  # entries of the checkpoint recovery started from
    checkpoint_errors: list[str] = field(default_factory=list)  # damaged checkpoints, newest first
    key_error: str | None = None  # a damaged tier.key (replaced: a later scan cannot take older blocks)
    scanned_blocks: int = 0  # committed blocks found by a segment scan
    scan_refused: int = 0  # block-like headers a scan did not take (uncommitted, bad tag or identity)
    scrubbed: int = 0  # headers of dead versions zeroed
    wal_files: int = 0
    wal_records: int = 0  # PUT and DEL operations replayed
    wal_bytes: int = 0
    wal_stops: list[str] = field(default_factory=list)  # "file@offset: why" per damaged stretch of a log
    scan_reason: str = ""  # why recovery scanned the segments (path segment-scan)
    verified_payloads: bool = False
    duration_s: float = 0.0

    @property
    def checkpoint_error(self) -> str | None:
        return "; ".join(self.checkpoint_errors) or None


class TierFiles:
    """The files of one SSD tier. `sync(fd, data_only)` syncs (and counts) or does nothing;
    errors are raised as OSError (or SsdFailure when no recovery path is left)."""

    def __init__(self, directory: str, segments: int, segment_size: int, sync: Callable[[int, bool], None],
                 fsync: bool) -> None:
        self.directory = directory
        self.segments = segments
        self.segment_size = segment_size
        self.fsync = fsync
        self.fds: list[int] = []  # plain descriptors: reads, scrubs, COMMITTED marks, recovery
        self.dfds: list[int] = []  # block writes: O_DIRECT descriptors, or `fds` where refused
        self.io_mode = "buffered"  # "direct" (O_DIRECT), or "buffered (why)"
        self.key = b""  # the tier's secret key (KEY_FILE)
        self.checkpoints: list[int] = []  # checkpoints known good, oldest first
        self._sync = sync
        self._lock_fd = -1
        self.previous_run: RunState | None = None  # what the last owner left in LOCK (None: nothing)
        self.run = RunState()  # this run's, as written in LOCK

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def close(self) -> None:
        for fd in {*self.fds, *self.dfds}:
            os.close(fd)
        self.fds = []
        self.dfds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def _lock(self) -> None:
        """Own the directory, or raise ConfigError naming the process that does."""
        fd = os.open(self.path(LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").split("\n")[0].strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"ssd.dir {self.directory} is in use by another quilld (pid {owner}); "
                              "two processes on one SSD tier would overwrite each other's blocks") from None
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)  # written by an older quilld, readable by others
        self._lock_fd = fd
        self.previous_run = RunState.parse(os.pread(fd, 4096, 0))
        self.run = RunState(os.getpid(), RUNNING, time.time())
        self.write_run(sync=True)

    def write_run(self, sync: bool = False) -> None:
        """Write `run` into LOCK (one pwrite, then the file cut to it); `sync` makes it durable."""
        if self._lock_fd < 0:
            return
        data = self.run.encode()
        os.pwrite(self._lock_fd, data, 0)
        os.ftruncate(self._lock_fd, len(data))
        if sync:
            self._sync(self._lock_fd, False)

    @property
    def direct(self) -> bool:
        return self.io_mode == "direct"

    def sync_dir(self) -> None:
        if not self.fsync:
            return
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._sync(fd, False)
        finally:
            os.close(fd)

    def sync_segments(self) -> None:
        for fd in self.fds:
            self._sync(fd, True)

    def wal_numbers(self) -> list[int]:
        return sorted(n for n in map(parse_wal_name, os.listdir(self.directory)) if n is not None)

    def checkpoint_numbers(self) -> list[int]:
        return sorted(n for n in map(parse_checkpoint_name, os.listdir(self.directory)) if n is not None)

    # -- segments and the key ------------------------------------------------------

    def open_segments(self, direct: bool = True) -> None:
        """Open (or create) every segment; with `direct`, also with O_DIRECT for block
        writes where the file system allows it (`io_mode` says whether it did). Refuses
        (ConfigError) segments the file system has no room for, before creating any; if
        creating them fails anyway, what this call created is removed."""
        made_dir = not os.path.isdir(self.directory)
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        self._lock()
        names = os.listdir(self.directory)
        for name in names:
            if name == PROBE_FILE or name.endswith(".tmp") and name.startswith(("seg-", CHECKPOINT_PREFIX, KEY_FILE)):
                os.unlink(self.path(name))  # a checkpoint, key or segment creation or a probe cut short
        extra = sorted(n for n in names if n.startswith("seg-") and n.endswith(".dat")
                       and n[4:-4].isdigit() and int(n[4:-4]) >= self.segments)
        if extra:
            raise ConfigError(f"{self.directory} has segments beyond ssd.size ({extra[0]}, ...);"
                              " shrinking the SSD tier would lose them")
        missing = {i for i in range(self.segments) if not os.path.exists(self.path(seg_name(i)))}
        self._check_room(len(missing), made_dir)
        created: list[str] = []
        try:
            for i in range(self.segments):
                path = self.path(seg_name(i))
                if i in missing:
                    self.fds.append(self._create_segment(path))
                    created.append(path)
                    continue
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                self.fds.append(fd)
                st = os.fstat(fd)
                if st.st_mode & 0o077:
                    os.fchmod(fd, FILE_MODE)  # written by an older quilld, readable by others
                if st.st_size != self.segment_size:
                    raise ConfigError(f"{path} is {st.st_size} bytes but ssd.segment_size is {self.segment_size}")
        except BaseException:
            self._undo_create(created, made_dir)
            raise
        if created:
            self.sync_dir()
        why = self._probe_direct() if direct else "ssd.direct_io is off"
        if why is None:
            flags = os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC
            for i in range(self.segments):
                self.dfds.append(os.open(self.path(seg_name(i)), flags))
            self.io_mode = "direct"
        else:
            self.dfds = list(self.fds)
            self.io_mode = f"buffered ({why})"

    def _check_room(self, missing: int, made_dir: bool) -> None:
        """Refuse (ConfigError) `missing` segments the file system has no room for: preallocating
        them would fill the disk and fail anyway. Removes the directory first if it was just made."""
        need = missing * self.segment_size
        if not need:
            return
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if need <= free:
            return
        self._undo_create([], made_dir)
        raise ConfigError(f"ssd.size {size_text(self.segments * self.segment_size)} (--ssd-size) does not fit in "
                          f"{self.directory}: {missing} segment{'s' if missing != 1 else ''} of "
                          f"{size_text(self.segment_size)} to preallocate need {size_text(need)}, the file "
                          f"system has {size_text(free)} free. Give a smaller --ssd-size or free some space")

    def _undo_create(self, created: list[str], made_dir: bool) -> None:
        """Remove the segments this start created (and the directory, with its LOCK, if it made
        it): a start that failed leaves no partial tier behind."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for path in created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if made_dir:
            with contextlib.suppress(OSError):
                os.unlink(self.path(LOCK_FILE))
                os.rmdir(self.directory)

    def _probe_direct(self) -> str | None:
        """None if an aligned O_DIRECT write works in this directory; else why not. Some
        file systems (tmpfs) refuse O_DIRECT at open, others only at the first write."""
        if not hasattr(os, "O_DIRECT"):
            return "no O_DIRECT on this platform"
        path = self.path(PROBE_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            return f"O_DIRECT refused at open: {e.strerror}"
        try:
            with mmap.mmap(-1, PAGE) as page:  # page-aligned memory
                page[:16] = uuid.uuid4().bytes
                if os.pwritev(fd, [page], 0) != PAGE:
                    return "O_DIRECT wrote a short page"
        except OSError as e:
            return f"O_DIRECT refused at write: {e.strerror}"
        finally:
            os.close(fd)
            os.unlink(path)
        return None

    def _create_segment(self, path: str) -> int:
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            try:
                os.posix_fallocate(fd, 0, self.segment_size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, self.segment_size)  # no preallocation on this filesystem
            self._sync(fd, False)
            os.replace(tmp, path)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def open_key(self, report: RecoveryReport) -> bool:
        """Load tier.key; True when the tier starts empty (new, or fenced: then every
        checkpoint and log is removed first and the key replaced)."""
        try:
            with open(self.path(KEY_FILE), "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if mode & 0o077:  # as ssh refuses a private key others can read
                    raise ConfigError(f"{self.path(KEY_FILE)} is readable by other users (mode "
                                      f"{mode & 0o777:04o}): whoever reads it can forge blocks this tier "
                                      f"would take back. Make it the owner's alone: chmod 600 {self.path(KEY_FILE)}")
                data = f.read()
        except FileNotFoundError:
            names = os.listdir(self.directory)
            older = [n for n in names if n in OLDER_KEY_FILES]
            index_files = [n for n in names
                           if n == LEGACY_CHECKPOINT or parse_checkpoint_name(n) is not None
                           or parse_wal_name(n) is not None]
            for name in index_files + older:
                os.unlink(self.path(name))
            report.path = (RecoveryPath.FENCED if index_files or older else RecoveryPath.FRESH).value
            if older or LEGACY_CHECKPOINT in index_files:
                fmt = max((OLDER_KEY_FILES[n] for n in older), default=1)
                report.key_error = (f"an older format's tier (format {fmt}): started empty in "
                                    "format 4, its blocks are never read")
            self._write_key()
            return True
        if len(data) == KEY_SIZE + 4 and crc32c(data[:KEY_SIZE]) == int.from_bytes(data[KEY_SIZE:], "little"):
            self.key = data[:KEY_SIZE]
            return False
        report.key_error = f"{KEY_FILE} is damaged: replaced (a later segment scan cannot take older blocks)"
        self._write_key()
        return False

    def _write_key(self) -> None:
        key = os.urandom(KEY_SIZE)
        tmp = self.path(KEY_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            pwrite_all(fd, [key + crc32c(key).to_bytes(4, "little")], 0)
            self._sync(fd, False)
        finally:
            os.close(fd)
        os.replace(tmp, self.path(KEY_FILE))
        self.sync_dir()
        self.key = key

    def remove_key(self) -> None:
        """Fence the tier: without its key, no later start trusts anything on it."""
        try:
            os.unlink(self.path(KEY_FILE))
        except FileNotFoundError:
            pass
        self.sync_dir()

    # -- checkpoints -------------------------------------------------------------------

    def write_checkpoint(self, state: State, wal_start: int, max_gen: int) -> None:
        """Write `state` as checkpoint-`wal_start`: to a temp file, synced, renamed, the
        directory synced. A crash at any point leaves the older checkpoints as they were."""
        enc = CheckpointEncoder(state, wal_start, max_gen)
        name = checkpoint_name(wal_start)
        tmp = self.path(name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            pos = HEADER_SIZE
            for chunk in enc.body():
                pwrite_all(fd, [chunk], pos)
                pos += len(chunk)
            pwrite_all(fd, [enc.header()], 0)
            self._sync(fd, False)
        finally:
            os.close(fd)
        os.replace(tmp, self.path(name))
        self.sync_dir()
        self.checkpoints = [n for n in self.checkpoints if n < wal_start] + [wal_start]

    def retain(self) -> None:
        """Keep the newest KEEP_CHECKPOINTS good checkpoints and the logs the oldest of
        them needs (every log while there is only one); delete the rest."""
        keep = self.checkpoints[-KEEP_CHECKPOINTS:]
        self.checkpoints = keep
        for n in self.checkpoint_numbers():
            if n not in keep:
                os.unlink(self.path(checkpoint_name(n)))
        if len(keep) == KEEP_CHECKPOINTS:
            for n in self.wal_numbers():
                if n < keep[0]:
                    os.unlink(self.path(wal_name(n)))

    def _read_checkpoint(self, number: int, scopes: dict) -> tuple[State, int]:
        state: State = {}
        with open(self.path(checkpoint_name(number)), "rb") as f:
            header = decode_checkpoint_header(f.read(HEADER_SIZE))
            if header.wal_start != number:
                raise BadCheckpoint(f"covers the logs below {header.wal_start}, its name says {number}")
            chunks = iter(lambda: f.read(_READ_CHUNK), b"")
            for scope, key, loc in decode_checkpoint_body(header, chunks):
                s = scopes.get(scope)
                if s is None:
                    s = scopes[scope] = IdentityScope(*scope)
                state[(s, key)] = loc
        return state, header.max_generation

    # -- rebuilding an index -------------------------------------------------------------

    def load_state(self, report: RecoveryReport, upto: int | None = None, scan: bool = True,
                   retired: Retired | None = None) -> tuple[State, int, int | None, list[int]]:
        """Rebuild the index from disk by the first path that works (see the module
        docstring), recording the path and every problem in `report`; only logs below
        `upto` when given, and a segment scan only with `scan`. Versions the replay retires
        are appended to `retired`. Returns (state, highest generation, the checkpoint used
        or None, the numbers of the logs replayed); raises SsdFailure when no path is left."""
        scopes: dict[Scope, IdentityScope] = {}
        logs = [n for n in self.wal_numbers() if upto is None or n < upto]
        checkpoints = [n for n in self.checkpoint_numbers() if upto is None or n <= upto]
        state, max_gen, base, first = self._best_checkpoint(checkpoints, report, scopes)
        if base is not None:
            logs = [n for n in logs if n >= base]
            report.path = (RecoveryPath.CHECKPOINT if first else RecoveryPath.PREVIOUS).value
            why = _gap(logs, base)
        elif not checkpoints and not logs:
            return state, max_gen, base, logs  # nothing written yet
        elif logs and logs[0] == 1:
            report.path = RecoveryPath.LOG.value
            why = _gap(logs, 1)
        else:
            why = "no readable checkpoint, and the logs do not go back to the first: " + (
                "; ".join(report.checkpoint_errors) or "checkpoints missing")
        if why is None:
            ok: Retired = []
            gen = self._replay(logs, state, scopes, report, ok)
            if not report.wal_stops:
                if retired is not None:
                    retired += ok
                return state, max(max_gen, gen), base, logs
            why = "damaged log: " + "; ".join(report.wal_stops)
        if not scan:
            raise SsdFailure(why)
        # path 4: the segments' committed blocks over the best checkpoint, then the logs it needs
        report.path, report.scan_reason = RecoveryPath.SCAN.value, why
        report.wal_files = report.wal_records = report.wal_bytes = report.dropped_torn_wal_records = 0
        report.wal_stops = []
        state = {} if base is None else self._read_checkpoint(base, scopes)[0]
        max_gen = max(max_gen, self._scan(state, scopes, report, retired))
        gen = self._replay(logs, state, scopes, report, retired)
        return state, max(max_gen, gen), base, logs

    def _best_checkpoint(self, checkpoints: list[int], report: RecoveryReport,
                         scopes: dict) -> tuple[State, int, int | None, bool]:
        """(state, highest generation, number, whether it is the newest) of the newest
        checkpoint that reads; ({}, 0, None, False) when none does."""
        for i, n in enumerate(reversed(checkpoints)):
            try:
                state, max_gen = self._read_checkpoint(n, scopes)
            except BadCheckpoint as e:
                report.checkpoint_errors.append(f"{checkpoint_name(n)}: {e}")
                if n in self.checkpoints:
                    self.checkpoints.remove(n)  # never kept in place of a good one
                continue
            report.checkpoint_entries = len(state)
            return state, max_gen, n, i == 0
        return {}, 0, None, False

    def _replay(self, logs: list[int], state: State, scopes: dict, report: RecoveryReport,
                retired: Retired | None) -> int:
        """Apply every readable record of `logs` to `state`; each damaged stretch is named in
        `report.wal_stops`. Returns the highest generation met."""
        max_gen = 0
        for n in logs:
            with open(self.path(wal_name(n)), "rb") as f:
                data = f.read()
            report.wal_files += 1
            report.wal_bytes += len(data)
            replayed, gen, problems = replay_log(data, state, scopes, retired)
            report.wal_records += replayed
            max_gen = max(max_gen, gen)
            if problems:
                report.wal_stops += [f"{wal_name(n)}@{p}" for p in problems]
                report.dropped_torn_wal_records += 1
        return max_gen

    def _scan(self, state: State, scopes: dict, report: RecoveryReport, retired: Retired | None) -> int:
        """Add to `state` the committed blocks of every segment (newest generation per key
        wins); returns the highest generation found."""
        max_gen = 0
        for seg, fd in enumerate(self.fds):
            with mmap.mmap(fd, self.segment_size, prot=mmap.PROT_READ) as m:
                found, refused = scan_segment(m, seg, self.key)
            report.scan_refused += refused
            report.scanned_blocks += len(found)
            for _, _, (scope, key), loc in found:
                s = scopes.get(scope)
                if s is None:
                    s = scopes[scope] = IdentityScope(*scope)
                put = PutRecord(loc.generation, scope, key, loc.seg, loc.offset, loc.length, loc.crc, loc.expire)
                apply_record(state, put, s, retired)
                max_gen = max(max_gen, loc.generation)
        return max_gen

    def verify(self, state: State, report: RecoveryReport, progress: Callable[[int, int], None] | None,
               payloads: bool) -> list[list[Found]]:
        """Per segment, sorted by offset: the blocks of `state` whose on-disk header (and
        payload) match their record, minus any that overlap a newer one. Counts the rest,
        and marks COMMITTED the kept ones a crash left unmarked (their record proves them)."""
        total = len(state)
        per_seg: list[list[Found]] = [[] for _ in range(self.segments)]
        unmarked: dict[tuple[int, int], bytes] = {}
        # headers are read through a read-only mapping: a slice per block, not a syscall
        maps = [mmap.mmap(fd, self.segment_size, prot=mmap.PROT_READ) for fd in self.fds]
        try:
            dropped = self._verify_mapped(state, maps, per_seg, progress, payloads, unmarked)
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
            for f in kept if unmarked else ():
                header = unmarked.get((i, f[3].offset))
                if header is not None:
                    pwrite_all(self.fds[i], [commit_header(header)], f[3].offset)
        report.dropped_corrupt += dropped
        return per_seg

    def _verify_mapped(self, state: State, maps: list, per_seg: list[list[Found]],
                       progress: Callable[[int, int], None] | None, payloads: bool,
                       unmarked: dict[tuple[int, int], bytes]) -> int:
        total, seg_size, dropped = len(state), self.segment_size, 0
        for done, (k, loc) in enumerate(state.items(), 1):
            if progress is not None and done % PROGRESS_EVERY == 0:
                progress(done, total)
            seg, offset, length, crc, gen, _ = loc
            pages = block_pages(k[0], k[1], length)
            if not 0 <= seg < len(maps) or offset % PAGE or not 0 <= offset <= seg_size - pages * PAGE:
                dropped += 1
                continue
            m = maps[seg]
            header = m[offset:offset + HEADER_SIZE]
            start = offset + payload_offset(k[0], k[1], length)
            if not header_matches(header, k[1], k[0], gen, length, crc):
                dropped += 1
                continue
            if not header[6] & COMMITTED:
                unmarked[(seg, offset)] = header
            if payloads:
                with memoryview(m) as view:
                    ok = crc32c(view[start:start + length]) == crc
                if not ok:
                    dropped += 1
                    continue
            per_seg[seg].append((offset // PAGE, pages, k, loc))
        return dropped

    def scrub_retired(self, retired: Retired, live: list[list[Found]]) -> int:
        """Zero the header page of each retired version still on disk (a crash came before
        its scrub), unless that page is inside a live block; returns how many."""
        starts = [[f[0] for f in found] for found in live]
        n = 0
        for (scope, key), loc in retired:
            page = loc.offset // PAGE
            if not 0 <= loc.seg < self.segments or loc.offset % PAGE \
                    or not 0 <= loc.offset <= self.segment_size - PAGE:
                continue
            i = bisect.bisect_right(starts[loc.seg], page) - 1
            if i >= 0 and page < live[loc.seg][i][0] + live[loc.seg][i][1]:
                continue  # reused by a live block
            header = os.pread(self.fds[loc.seg], HEADER_SIZE, loc.offset)
            if header_matches(header, key, scope, loc.generation, loc.length, loc.crc):
                pwrite_all(self.fds[loc.seg], [ZERO_PAGE], loc.offset)
                n += 1
        return n


def _gap(logs: list[int], first: int) -> str | None:
    """Why `logs` are not every log from `first` on (a log file is missing), or None."""
    for want, n in enumerate(logs, first):
        if n != want:
            return f"{wal_name(want)} is missing"
    return None


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


def pwrite_all(fd: int, bufs: list, offset: int) -> None:
    total = sum(memoryview(b).nbytes for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    while done < total:
        done += os.pwritev(fd, _rest(bufs, done), offset + done)


def pread_all(fd: int, bufs: list, offset: int) -> int:
    """Bytes read into `bufs`; fewer than their total only at the end of the file."""
    total = sum(memoryview(b).nbytes for b in bufs)
    done = n = os.preadv(fd, bufs, offset)
    while n and done < total:
        n = os.preadv(fd, _rest(bufs, done), offset + done)
        done += n
    return done
