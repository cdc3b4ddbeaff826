"""The storage engines under a persistent residency index: LMDB and RocksDB, behind one small seam.

`Store` is what `persistent.py` needs of an engine: read every record under a one-byte prefix
(at start, to load the mirror), look one record up, write a set of puts and deletes atomically,
say how big it is on disk, and close. Each engine is a real one from PyPI, never a file format
of quilld's own; its crash consistency is its own:

- **LMDB** (`lmdb`): a copy-on-write B+tree in one memory-mapped file. A commit writes the new
  pages, then the meta page that points at them; a process killed at any point leaves the last
  committed tree. Opening is mapping the file: nothing is replayed. With `fsync`, each commit is
  synced (`sync`, `metasync`), so a power loss keeps every commit that returned.
- **RocksDB** (`rocksdict`): an LSM tree. A write batch goes to the write-ahead log, then to the
  memtable; flushes and compactions rewrite it into sorted files in the background. Opening
  replays the log's tail. With `fsync`, each batch's log record is synced before the write returns.

A process killed with kill -9 loses nothing either engine has committed: the data is in the
kernel's page cache and reaches the disk without the process. Only what quilld had not yet
handed to a commit is lost (persistent.py says how little that is and how it comes back).

A store whose files are damaged raises `DamagedStore` (an LMDB file shorter than its last
commit, which mapping would turn into SIGBUS, is checked at open; a damaged page when it is
read); `backend.open_index` then sets it aside and starts an empty one.

Each store takes a lock file in its directory (`flock`), so two quilld processes never write one
index (RocksDB has its own lock as well; LMDB allows many processes by design).

The engines' packages are optional (`pip install -e '.[index]'`): each is imported where its
store is opened, and a missing one is a configuration error that names the package.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from bisect import bisect_left
from itertools import islice
from pathlib import Path
from typing import Protocol

from quilld.errors import ConfigError

LOCK_FILE = "quilld-index.lock"
YIELD_ROWS = 1024  # a commit lets the event loop's thread run after this many rows
SCAN_CHUNK = 1 << 16
ROCKSDB_MEMTABLE = 16 << 20  # keys an LMDB scan takes at once (it reads at most this far past its prefix)
LMDB_INITIAL_MAP = 1 << 30  # the map grows by doubling when it fills (a sparse file: disk is used as written)


class DamagedStore(Exception):
    """A store's files are damaged (truncated, a bad page, a record that does not decode)."""


# LMDB keeps no checksums: a damaged page's offsets can send a read past the end of the file
# through the map (SIGBUS) or out of it (SIGSEGV), killing the process before it can say why.
# So every record is read once first in a child process (C loops over one cursor; the pages
# are left in the page cache for the load that follows): about 1.8 s per million entries here.
_WALK = """import sys, lmdb
try:
    env = lmdb.open(sys.argv[1], readonly=True, lock=False, subdir=True, max_dbs=0, readahead=False)
    with env.begin(buffers=False) as txn:  # copied out: every byte a load reads is read here first
        for _ in txn.cursor().iternext(keys=True, values=True):
            pass
except lmdb.Error as e:
    print(e, file=sys.stderr)
    sys.exit(3)
"""
WALK_TIMEOUT = 600.0  # seconds the child may take to read every record (about 1 s per million here)


def _lmdb_walk_fails(path: Path) -> str | None:
    """Why reading every record of the LMDB store in `path` fails (in a child process), or None."""
    try:
        proc = subprocess.run([sys.executable, "-c", _WALK, str(path)], capture_output=True, text=True,
                              timeout=WALK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None  # slow, not damaged: the load reads it as before
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        return f"reading data.mdb's records crashed ({signal.Signals(-proc.returncode).name}): a damaged page"
    said = proc.stderr.strip().splitlines()
    return f"LMDB cannot read data.mdb: {said[-1] if said else f'exit status {proc.returncode}'}"


class Store(Protocol):
    name: str
    path: Path

    def scan(self, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
        """Every record whose key starts with `prefix`: keys and values, in key order."""

    def get(self, key: bytes) -> bytes | None: ...

    def write(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        """Apply every put and delete as one atomic commit (synced when the store was opened with fsync)."""

    def disk_bytes(self) -> int:
        """Bytes the store's files take on disk."""

    def engine_stats(self) -> dict[str, int]:
        """The engine's own write figures, where it keeps any (RocksDB's statistics)."""

    def close(self) -> None: ...


def _lock(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    f = open(path / LOCK_FILE, "a+b")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(f"index.path {str(path)!r} is in use by another quilld process (it holds "
                          f"{LOCK_FILE}); give each node its own index.path") from None
    return f


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk under `path` (sparse files count what they hold, not their length)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # a file RocksDB deleted meanwhile
                pass
    return total


class LmdbStore:
    name = "lmdb"

    def __init__(self, path: str | Path, fsync: bool = True) -> None:
        try:
            import lmdb  # optional: only a node whose index.backend is "lmdb" needs it
        except ImportError:
            raise ConfigError("index.backend = \"lmdb\" needs the lmdb package: pip install -e '.[index]'") from None
        self._lmdb = lmdb
        self.path = Path(path)
        self._lockf = _lock(self.path)
        try:
            # readahead off: the mirror's load reads the file once in order, everything else is random
            self.env = lmdb.open(str(self.path), map_size=LMDB_INITIAL_MAP, subdir=True, sync=fsync,
                                 metasync=fsync, readahead=False, max_dbs=0, lock=True)
            info = self.env.info()
            used = os.path.getsize(self.path / "data.mdb")
            need = (info["last_pgno"] + 1) * self.env.stat()["psize"]
            if used < need:  # reading the pages past its end through the map would be SIGBUS
                self.env.close()
                raise DamagedStore(f"data.mdb is truncated: {used} bytes, its last commit needs {need}")
            why = _lmdb_walk_fails(self.path) if info["last_pgno"] > 1 else None
            if why is not None:
                self.env.close()
                raise DamagedStore(why)
            size = info["map_size"]
            while size < used * 2:  # a file grown beyond the initial map in an earlier run
                size *= 2
            if size != info["map_size"]:
                self.env.set_mapsize(size)
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError) as e:
            self._lockf.close()
            raise DamagedStore(f"LMDB cannot read data.mdb: {e}") from None
        except DamagedStore:
            self._lockf.close()
            raise
        except lmdb.Error as e:
            self._lockf.close()
            raise ConfigError(f"index.path {str(self.path)!r}: LMDB cannot open it: {e}") from None

    def scan(self, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
        try:
            return self._scan(prefix)
        except self._lmdb.Error as e:  # a damaged page
            raise DamagedStore(f"LMDB cannot read data.mdb: {e}") from None

    def _scan(self, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
        end = _after(prefix)
        with self.env.begin(buffers=False) as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix):
                return [], []
            # keys, then values, each gathered by the cursor in C, a chunk at a time until the prefix ends
            keys: list[bytes] = []
            it = cur.iternext(keys=True, values=False)
            while True:
                chunk = list(islice(it, SCAN_CHUNK))
                keys += chunk
                if len(chunk) < SCAN_CHUNK or chunk[-1] >= end:
                    break
            del keys[bisect_left(keys, end):]
            cur.set_range(prefix)
            values = list(islice(cur.iternext(keys=False, values=True), len(keys)))
            return keys, values

    def get(self, key: bytes) -> bytes | None:
        try:
            with self.env.begin(buffers=False) as txn:
                return txn.get(key)
        except self._lmdb.Error as e:  # a damaged page
            raise DamagedStore(f"LMDB cannot read data.mdb: {e}") from None

    def reader(self):
        """A read transaction's `get`, kept open (the study's read-through walk); close it with `.abort`."""
        return self.env.begin(buffers=False)

    def write(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        puts.sort()  # neighbouring keys share leaf pages: fewer pages copied per commit
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    cur = txn.cursor()
                    for i in range(0, len(puts), YIELD_ROWS):
                        cur.putmulti(puts[i:i + YIELD_ROWS])
                        time.sleep(0)  # let the event loop's thread run (putmulti holds the GIL)
                    delete = txn.delete
                    for i, k in enumerate(deletes, 1):
                        delete(k)
                        if not i % YIELD_ROWS:
                            time.sleep(0)
                return
            except self._lmdb.MapFullError:  # the transaction was aborted: grow the map and write it again
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def disk_bytes(self) -> int:
        return disk_usage(self.path)

    def engine_stats(self) -> dict[str, int]:
        st = self.env.stat()
        return {"pages": st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"], "depth": st["depth"],
                "page_size": st["psize"]}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
            self._lockf.close()


class RocksStore:
    name = "rocksdb"

    def __init__(self, path: str | Path, fsync: bool = True, statistics: bool = True) -> None:
        try:
            import rocksdict  # optional: only a node whose index.backend is "rocksdb" needs it
        except ImportError:
            raise ConfigError("index.backend = \"rocksdb\" needs the rocksdict package: "
                              "pip install -e '.[index]'") from None
        self._r = rocksdict
        self.path = Path(path)
        self._lockf = _lock(self.path)
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        # a smaller memtable than RocksDB's 64 MiB: its log, replayed when RocksDB opens after a kill -9,
        # stays short (the study: 3.2 s to open 1M entries after a kill with 64 MiB)
        opts.set_write_buffer_size(ROCKSDB_MEMTABLE)
        if statistics:  # the study reads the bytes RocksDB wrote (WAL, flushes, compactions) from them
            opts.enable_statistics()
        self._opts = opts
        try:
            self.db = rocksdict.Rdict(str(self.path / "db"), opts)
        except Exception as e:  # rocksdict raises plain exceptions with RocksDB's message
            self._lockf.close()
            raise ConfigError(f"index.path {str(self.path)!r}: RocksDB cannot open it: {e}") from None
        self._wo = rocksdict.WriteOptions()
        self._wo.sync = fsync

    def scan(self, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
        out = []
        for what in (self.db.keys, self.db.values):  # two passes, each gathered by the iterator in C
            ro = self._r.ReadOptions()
            ro.set_iterate_upper_bound(_after(prefix))
            out.append(list(what(from_key=prefix, read_opt=ro)))
        return out[0], out[1]

    def get(self, key: bytes) -> bytes | None:
        return self.db.get(key)

    def write(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        wb = self._r.WriteBatch(raw_mode=True)
        put, delete = wb.put, wb.delete
        for i, (k, v) in enumerate(puts, 1):
            put(k, v)
            if not i % YIELD_ROWS:
                time.sleep(0)
        for i, k in enumerate(deletes, 1):
            delete(k)
            if not i % YIELD_ROWS:
                time.sleep(0)
        # one batch, so one commit stays atomic; rocksdict holds the GIL while RocksDB writes it (about
        # 0.1 us a row here: docs/benchmarks/index-study.md)
        self.db.write(wb, self._wo)

    def disk_bytes(self) -> int:
        return disk_usage(self.path)

    def engine_stats(self) -> dict[str, int]:
        """RocksDB's own counters: user bytes written, WAL bytes, flush and compaction writes."""
        out: dict[str, int] = {}
        text = self._opts.get_statistics() or ""
        for line in text.splitlines():
            name, _, rest = line.partition(" COUNT : ")
            if name in ("rocksdb.bytes.written", "rocksdb.wal.bytes", "rocksdb.flush.write.bytes",
                        "rocksdb.compact.write.bytes", "rocksdb.compact.read.bytes"):
                out[name.removeprefix("rocksdb.").replace(".", "_")] = int(rest.split()[0])
        return out

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
            self._lockf.close()


def _after(prefix: bytes) -> bytes:
    """The first key past every key that starts with `prefix` (prefixes here never end in 0xff)."""
    return prefix[:-1] + bytes((prefix[-1] + 1,))


STORES = {"lmdb": LmdbStore, "rocksdb": RocksStore}


def open_store(backend: str, path: str | Path, fsync: bool = True) -> Store:
    """The store of `backend` ("lmdb" or "rocksdb") in `path` (its own subdirectory of index.path)."""
    return STORES[backend](Path(path) / backend, fsync)
