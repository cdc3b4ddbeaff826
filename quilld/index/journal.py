"""What a persistent index commits, and the thread that commits it (persistent.py says when and why).

`Journaled` notes every write to the KV-cache group holdings it keeps (groups.py); a `Job` is one
commit's worth of changes, swapped out on the event loop's thread; `encode` turns it into the
store's puts and deletes and `Writer` commits jobs in order on a thread of its own, so a commit
(encoding, the engine's write, its fsync) never runs on the event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

from quilld.index.stores import Store
from quilld.scopes import TAG_LEN

log = logging.getLogger("quilld.index.persistent")

ENTRY = b"e"  # an entry record's kind (persistent.py lists every kind)
YIELD_ROWS = 1024  # the writer thread gives the interpreter back this often (stores.py does the same)


def key_bytes(key: int | bytes) -> bytes:
    """An entry key as a record's bytes: an int hash as 8 big-endian bytes, raw bytes as they are."""
    return key.to_bytes(8, "big") if key.__class__ is int else key


class Journaled(dict):
    """A dict that notes every key set or deleted in `log` (key -> value, None when deleted).

    Reads are a dict's; only writes pay a Python call. Used for the KV-cache group holdings
    (groups.py) of a persistent index."""

    __slots__ = ("log",)

    def __init__(self, log: dict, *args) -> None:
        super().__init__(*args)
        self.log = log

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        self.log[key] = value

    def __delitem__(self, key) -> None:
        dict.__delitem__(self, key)
        self.log[key] = None

    def clear(self) -> None:
        log = self.log
        for key in self:
            log[key] = None
        dict.clear(self)


class Job(NamedTuple):
    """One commit: the marks, the durable bits to keep of each mask, group rows and other records."""

    entries: list[tuple[bytes, dict]]  # (scope id, entry key -> mask)
    durable: int
    sids: dict[bytes, bytes]  # scope tag -> scope id (grouped rows carry the tag in their keys)
    groups: list[tuple[bytes, bytes | None, dict]]  # (record prefix, scope id or None, key -> value or None)
    meta: dict[bytes, bytes | None]
    states: dict[str, dict]  # every engine's state as committed


def encode(job: Job) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The puts and deletes of a commit (the writer thread's work). Every YIELD_ROWS rows it lets the
    event loop's thread have the interpreter (sleep(0) releases the GIL), so ROUTE never waits for a
    whole commit's encoding."""
    puts: list[tuple[bytes, bytes]] = []
    dels: list[bytes] = []
    put, delete, durable = puts.append, dels.append, job.durable
    for sid, marks in job.entries:
        prefix = ENTRY + sid
        for n, (key, mask) in enumerate(marks.items(), 1):
            k = prefix + (key.to_bytes(8, "big") if key.__class__ is int else key)
            m = mask & durable
            if m:
                put((k, m.to_bytes((m.bit_length() + 7) >> 3, "big")))
            else:
                delete(k)
            if not n % YIELD_ROWS:
                time.sleep(0)
    for prefix, sid, rows in job.groups:
        for key, value in rows.items():
            if sid is None:  # a grouped row: tag + hash key + tier
                tag_sid = job.sids.get(key[:TAG_LEN])
                if tag_sid is None:
                    continue
                k = prefix + tag_sid + key[TAG_LEN:]
            else:
                k = prefix + sid + key_bytes(key)
            if value is None:
                delete(k)
            else:
                put((k, value.to_bytes((value.bit_length() + 8) >> 3, "big", signed=True)))
    for k, v in job.meta.items():
        if v is None:
            delete(k)
        else:
            put((k, v))
    return puts, dels


class Writer:
    """One thread that commits jobs in order. After a failed commit it commits nothing more: a later
    commit without the failed one's changes would persist a state that never was."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.submitted = 0  # written by the event loop's thread only
        self.done = 0  # written by the writer thread only
        self.error: BaseException | None = None
        self.commits = 0
        self.rows = 0  # puts and deletes committed
        self.bytes = 0  # bytes of the keys and values committed (what write amplification divides by)
        self.seconds = 0.0  # time spent encoding and committing
        self.committed_states: dict[str, dict] = {}  # the engines' states in the last commit that succeeded

    def busy(self) -> bool:
        return self.done != self.submitted

    def submit(self, job: Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="index-writer", daemon=True)
            self._thread.start()
        self.submitted += 1
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self.error is None:
                    t0 = time.perf_counter()
                    puts, dels = encode(job)
                    self.store.write(puts, dels)
                    self.seconds += time.perf_counter() - t0
                    self.commits += 1
                    self.rows += len(puts) + len(dels)
                    self.bytes += sum(len(k) + len(v) for k, v in puts) + sum(map(len, dels))
                    self.committed_states = job.states
            except Exception as e:  # the store failed (disk full, I/O error): stop persisting, say why
                self.error = e
                log.exception("index: a commit to %s failed; nothing more is persisted until quilld restarts "
                              "(the next start loads the last commit)", self.store.path)
            finally:
                self.done += 1

    def close(self) -> None:
        """Wait for every job submitted, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
