"""The shared-memory path: blocks copied straight between the caller's buffer and quilld's arena.

When quilld runs on the same host (same boot id), has a unix socket
(server.unixsocket) and lets this user map its arena (security.map_users), the
client opens unix-socket connections (the same AUTH and SCOPE as TCP) and sends
`SHM ATTACH` on each: quilld answers with two descriptors attached (SCM_RIGHTS),
the DRAM arena and its lease table, which the client maps.

Reads with no round trip: attached with `SHM ATTACH TABLE` (when SHM HELLO offers
`lookup_slots`), the client also maps quilld's lookup table and finds its blocks there by
itself (quillclient/lookup.py): a hash, a probe, a copy and a check, no system call. Only
what the table cannot serve (a miss, a small value kept inline, a value only on SSD, an
entry that changed under the copy) asks quilld:

`SHM GET key ...` answers, per key, nil, the bytes themselves (small values kept inline), the
key's entry in the lookup table (an int: quilld put the block there; read as above), or
`[offset, length, crc32c, slot, generation]`, a lease (a table full there, or none). The client
copies `length` bytes at `offset` of its mapping into the caller's buffer, then reads the slot's
generation in the lease table again: equal, the lease was alive while it copied and the bytes are
the block's; different, the lease ended meanwhile (expired, or quilld restarted) and the block may
have been reused, so the client reads the key again over TCP and counts it (`stale_reads`). A stale
copy is never returned as good data. This relies on x86-64's ordering of loads (TSO: the copy's
loads are not performed after the generation's load); see quilld's tiers/leases.py. With
`verify_crc` the CRC32C of each copy is checked as well (a mismatch also reads again over TCP,
counted in `crc_rereads`); it is on by default on any other CPU, where the generation check alone
is not enough.

When quilld can grant no lease (`-BUSY`: this user's share of the lease table, or the
whole table, is taken), the batch's keys are read over TCP instead and counted
(`busy_rereads`): a busy table slows a read down, it never fails it.

Leases are released after the copy with `SHM RELEASE slot ...`, which never costs a message of
its own: it goes out in front of the connection's next command, in the same send (its reply is
read in front of that command's). An idle connection's leases end at its next command, or after
server.shm_lease_ms.

Writes: `SHM RESERVE lease-ms key nbytes [key nbytes ...]` reserves a round's regions in one
command ([handle, offset] per key), its reply is read before any byte is copied (a refusal stores
nothing of the round); then the client copies each block into its mapping at its offset and
commits them with `SHM COMMIT handle crc32c [handle crc32c ...]`, one command per COMMIT_WINDOW
of bytes sent as soon as it is copied, so quilld checks one window's CRC32Cs while the client
copies the next; their replies are read at the end. A round is two round trips and two commands
for quilld to dispatch, however many blocks it has.

Every unix connection attaches itself, and the mapping it uses is the one its own
ATTACH handed over (a quilld that restarted hands a new arena: it is mapped anew,
never confused with the old one).
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Callable

import crc32c
from quillwire.encode import pack_command
from quillwire.reply import NEED_DATA, ReplyError, ReplyReader, Status
from quillwire.reply import ProtocolError as WireProtocolError

from quillclient.config import ClientConfig
from quillclient.lookup import NOT_HERE, Lookup
from quillclient.lookup import VERSION as LOOKUP_VERSION
from quillclient.segments import Segments, crc_of, land, store
from quillclient.errors import (BufferTooSmall, NoHandle, OutOfMemory, ProtocolError, QuillConnectionError, QuillError,
                                from_wire)
from quillclient.zerocopy import MISS, RawPool, _kernel_timeouts, setting_up

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
RECV = 64 * 1024
GET_BATCH = 64  # keys per SHM GET (leases held at once by one connection's read)
BUSY = "BUSY"  # SHM GET's refusal when no lease can be had (the user's share of the table, or the table, is full)
COMMIT_WINDOW = 4 << 20  # bytes of blocks copied before their COMMITs go (a put round's replies are read at its end)


def local_boot_id() -> bytes:
    try:
        with open(BOOT_ID_FILE, "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


class Mapping:
    """quilld's arena and lease table, mapped into this process; and its lookup table, when
    ATTACH handed it over (`lookup`, else None)."""

    __slots__ = ("key", "arena_mm", "arena", "leases_mm", "gens", "lookup")

    def __init__(self, arena_fd: int, lease_fd: int) -> None:
        st = os.fstat(arena_fd)
        self.key = (st.st_dev, st.st_ino)
        self.arena_mm = mmap.mmap(arena_fd, st.st_size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.arena = memoryview(self.arena_mm)
        size = os.fstat(lease_fd).st_size
        self.leases_mm = mmap.mmap(lease_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.gens = memoryview(self.leases_mm).cast("Q")
        self.lookup: Lookup | None = None


def _reply(value: Any) -> Any:
    """A reply value; a server error raised as its quillclient type."""
    if isinstance(value, ReplyError):
        raise from_wire(value.message)
    return value


def _as_map(value: Any) -> dict:
    """A RESP3 map, or RESP2's flat list of its keys and values, as a dict."""
    return value if isinstance(value, dict) else dict(zip(value[::2], value[1::2]))


class ShmConnection:
    """One unix-socket connection, set up (AUTH, SCOPE) and attached (SHM ATTACH [TABLE])."""

    __slots__ = ("sock", "reader", "mapping", "broken", "owed", "generation", "deferred")

    def __init__(self, cfg: ClientConfig, path: str, mappings: "Mappings", generation: int,
                 table: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.mapping: Mapping | None = None
        self.reader = ReplyReader(None)  # every reply parsed whole (blocks never come over this socket)
        self.broken = False
        self.owed = 0  # replies to SHM RELEASE sent without waiting: read before the next reply
        self.deferred: list[int] = []  # leases to release with the next command (see release)
        self.generation = generation
        with setting_up(self, f"no reply from {path} within the timeout", f"connecting to {path}"):
            self.sock.settimeout(cfg.connect_timeout)
            self.sock.connect(path)
            _kernel_timeouts(self.sock, cfg.socket_timeout)
            for cmd in cfg.handshake():
                self.send(pack_command(*cmd))
                if type(_reply(self.next_reply())) is not Status:
                    raise ProtocolError("unexpected reply while setting the connection up")
            self.send(pack_command("SHM", "ATTACH", *(("TABLE",) if table else ())))
            reply, fds = self._reply_with_fds()
            try:
                info = _as_map(_reply(reply))
                if len(fds) not in (2, 4):
                    raise ProtocolError(f"SHM ATTACH brought {len(fds)} descriptors, expected 2 or 4")
                self.mapping = mappings.of(fds, info)
            finally:
                for fd in fds:
                    os.close(fd)

    def _reply_with_fds(self) -> tuple[Any, list[int]]:
        fds: list[int] = []
        reader = self.reader
        space = socket.CMSG_SPACE(8 * array.array("i").itemsize)
        while True:
            event = reader.next_event()
            if event is not NEED_DATA:
                return event, fds
            data, anc, _flags, _addr = self.sock.recvmsg(RECV, space)
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(raw[:len(raw) - len(raw) % got.itemsize])
                    fds.extend(got)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            reader.feed(data)

    def close(self) -> None:
        self.broken = True
        self.mapping = None  # this connection no longer keeps the arena mapped
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        if len(pieces) == 1:
            self.sock.sendall(pieces[0])
        else:
            self.sock.sendall(b"".join(pieces))  # commands here are small: one syscall

    def next_reply(self) -> Any:
        reader = self.reader
        try:
            event = reader.next_event()
            while event is NEED_DATA:
                data = self.sock.recv(RECV)
                if not data:
                    raise ConnectionResetError("the server closed the connection")
                reader.feed(data)
                event = reader.next_event()
        except WireProtocolError as e:
            raise ProtocolError(str(e)) from None
        return event

    def with_deferred(self, pieces: list) -> list:
        """`pieces`, behind a RELEASE of the leases deferred to this command (one send, one wakeup)."""
        if not self.deferred:
            return pieces
        slots, self.deferred = self.deferred, []
        self.owed += 1
        return pack_command("SHM", "RELEASE", *slots) + list(pieces)

    def command(self, pieces: list) -> Any:
        """Send one command (after the RELEASEs owed) and return its reply."""
        self.submit(pieces)
        return self.result()

    def submit(self, pieces: list) -> None:
        """Send one command (behind the deferred RELEASEs) without waiting for its reply. Until
        `result()` has read that reply, no other command may be sent (no `release` either)."""
        self.send(self.with_deferred(pieces))

    def result(self) -> Any:
        """The reply of the command `submit` sent, after the owed RELEASE replies in front of it."""
        while self.owed:
            self.owed -= 1
            self.next_reply()  # a RELEASE's count (or its error): nothing depends on it
        return self.next_reply()

    def release(self, slots: list[int]) -> None:
        """End leases with this connection's next command (the RELEASE goes in the same send, in
        front of it: no message, no server wakeup of its own)."""
        self.deferred.extend(slots)


class Mappings:
    """The mapping of the arena quilld currently hands out: one per arena (memfd identity)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: Mapping | None = None

    def of(self, fds: list[int], info: dict) -> Mapping:
        """The mapping of ATTACH's descriptors (arena, lease table[, lookup table, read marks])."""
        st = os.fstat(fds[0])
        with self._lock:
            if self.current is None or self.current.key != (st.st_dev, st.st_ino):
                self.current = Mapping(fds[0], fds[1])  # a new arena (quilld restarted): the old one unused
            mapping = self.current
            salt = info.get(b"lookup_salt")
            if len(fds) == 4 and salt and info.get(b"lookup_version") == LOOKUP_VERSION:
                if mapping.lookup is None:
                    mapping.lookup = Lookup(fds[2], fds[3], int(info[b"lookup_slots"]), int(info[b"lookup_probe"]),
                                            bytes(salt), mapping.arena)
                else:  # this scope's salt, as quilld says it now (a scope let go and taken again: a new one)
                    mapping.lookup.set_salt(bytes(salt))
            return mapping


class ShmPool(RawPool):
    """Idle unix-socket connections (LIFO), thread-safe: zerocopy.RawPool over ShmConnection.
    `table`: attach with the lookup table (SHM HELLO offered one)."""

    def __init__(self, cfg: ClientConfig, path: str, table: bool = False) -> None:
        super().__init__(cfg)
        self.path = path
        self.table = table
        self.mappings = Mappings()
        self.direct_reads = 0  # blocks read from the lookup table, quilld not asked
        self.stale_reads = 0  # copies whose lease ended while copying: read again over TCP
        self.crc_rereads = 0  # copies whose CRC32C did not match (verify_crc): read again over TCP
        self.busy_rereads = 0  # keys read over TCP because quilld had no lease for them (-BUSY)

    def _connect(self, generation: int) -> ShmConnection:
        return ShmConnection(self.cfg, self.path, self.mappings, generation, self.table)

    def _where(self) -> str:
        return self.path

    def reset(self) -> None:
        """Close every idle connection (one broke: the server is likely gone) and forget the
        mapping: a dead quilld's arena is unmapped once no connection in use still reads it, so
        its memory is not kept alive by this client."""
        super().reset()
        self.mappings.current = None

    def lookup(self) -> Lookup | None:
        """The lookup table to read, while the quilld that hands it out is alive."""
        mapping = self.mappings.current
        if mapping is None:
            return None
        lookup = mapping.lookup
        return lookup if lookup is not None and lookup.alive() else None

    @property
    def direct_retries(self) -> int:
        """Copies out of the lookup table thrown away because their entry changed meanwhile."""
        mapping = self.mappings.current
        return mapping.lookup.retries if mapping is not None and mapping.lookup is not None else 0


# -- reads ---------------------------------------------------------------------

def get_one(pool: ShmPool, key: Any, view: memoryview | Segments, verify: bool,
            reread: Callable[[int], int], lookup_tried: bool = False) -> int:
    """One key into `view`: its length or MISS; BufferTooSmall (nothing written) when it does not
    fit. From the lookup table when it has the key (no round trip), else as get_many.
    `lookup_tried`: the caller looked in the table already."""
    lookup = None if lookup_tried else pool.lookup()
    if lookup is not None:
        n = lookup.read_key(key, view, verify)
        if n >= 0:
            pool.direct_reads += 1
            return n
    try:
        return get_many(pool, [key], [view], verify, reread, lookup_tried=True)[0]
    except BufferTooSmall as e:
        raise BufferTooSmall(e.needed, e.size) from None


def _copy(conn: ShmConnection, key: Any, item: Any, view: memoryview | Segments,
          verify: bool) -> tuple[int, int | None]:
    """Land one SHM GET item in `view` (a buffer, or Segments to scatter it over): (length, MISS, or
    NOT_HERE when a table entry changed before it could be read; the lease's slot or None).
    Raises BufferTooSmall with nothing written."""
    if item is None:
        return MISS, None
    if item.__class__ is int:  # quilld put the block in the lookup table: read it there
        lookup = conn.mapping.lookup
        return (lookup.read_entry(item, key, view, verify) if lookup is not None else NOT_HERE), None
    if isinstance(item, bytes):
        n = len(item)
        if n > len(view):
            raise BufferTooSmall(n, len(view))
        land(view, item)
        return n, None
    if isinstance(item, ReplyError):
        raise from_wire(item.message)
    offset, n, _crc, slot, _gen = item
    if n > len(view):
        raise BufferTooSmall(n, len(view))
    land(view, conn.mapping.arena[offset:offset + n])
    return n, slot


def _intact(conn: ShmConnection, item: Any, view: memoryview | Segments, verify: bool) -> str:
    """After copying a leased block: "" when the copy is good, else why not ("stale", "crc")."""
    _offset, n, crc, slot, gen = item
    if conn.mapping.gens[slot] != gen:  # read after the copy: x86 TSO keeps the copy's loads before it
        return "stale"
    if verify and (view.crc32c(n) if isinstance(view, Segments) else crc32c.crc32c(view[:n])) != crc:
        return "crc"
    return ""


def get_many(pool: ShmPool, keys: Sequence, views: Sequence[memoryview | Segments], verify: bool,
             reread: Callable[[int], int], lookup_tried: bool = False) -> list[int | None]:
    """Per key its length, MISS, or None (too large for its view: nothing written; BufferTooSmall
    is raised at the end with every result). `reread(i)` reads key i again another way (TCP).
    Keys the lookup table has are read there; quilld is asked for the others only, in SHM GET
    batches (none at all when the table had every key)."""
    results: list[int | None] = [MISS] * len(keys)
    again: list[int] = []
    busy: list[int] = []
    too_small: BufferTooSmall | None = None
    ask = range(len(keys))
    lookup = None if lookup_tried else pool.lookup()
    if lookup is not None:
        ask = []
        read_key, direct = lookup.read_key, 0
        for i, key in enumerate(keys):
            try:
                n = read_key(key, views[i], verify)
            except BufferTooSmall as e:
                results[i] = None
                too_small = too_small or BufferTooSmall(e.needed, e.size, index=i)
                continue
            if n >= 0:
                results[i] = n
                direct += 1
            else:
                ask.append(i)
        pool.direct_reads += direct

    def request(conn: ShmConnection) -> None:
        nonlocal too_small
        def items_of(raw: Any, batch: Sequence[int]) -> list:
            try:
                return _reply(raw)
            except QuillError as e:
                if e.prefix != BUSY:
                    raise
                busy.extend(batch)  # no lease to be had (this user's share is taken): over TCP
                return []

        batches = [ask[lo:lo + GET_BATCH] for lo in range(0, len(ask), GET_BATCH)]
        conn.submit(pack_command("SHM", "GET", *(keys[i] for i in batches[0])))
        items = items_of(conn.result(), batches[0])
        for b, batch in enumerate(batches):
            # The next batch's SHM GET goes out before this one is copied: its reply is on the way
            # (the server answering on the other core) while we copy, so a batch waits once.
            ahead = b + 1 < len(batches)
            if ahead:
                conn.submit(pack_command("SHM", "GET", *(keys[i] for i in batches[b + 1])))
            in_flight = ahead
            slots: list[int] = []
            try:
                for i, item in zip(batch, items):
                    if type(item) is list:
                        slots.append(item[3])
                    try:
                        n, slot = _copy(conn, keys[i], item, views[i], verify)
                    except BufferTooSmall as e:
                        results[i] = None
                        too_small = too_small or BufferTooSmall(e.needed, e.size, index=i)
                        continue
                    if n == NOT_HERE:  # its table entry changed before we could read it
                        again.append(i)
                        pool.stale_reads += 1
                        continue
                    results[i] = n
                    if slot is not None:
                        why = _intact(conn, item, views[i], verify)
                        if why:
                            again.append(i)
                            if why == "stale":
                                pool.stale_reads += 1
                            else:
                                pool.crc_rereads += 1
                if ahead:
                    reply = conn.result()
                    in_flight = False
                    items = items_of(reply, batches[b + 1])
            except BaseException:
                if in_flight:  # a reply left unread: the connection goes, and its leases with it
                    conn.close()
                raise
            finally:
                # released with the next command (after the next batch's reply was read: a RELEASE
                # must not come between a command and the reply `result` reads for it)
                if not conn.broken:
                    conn.release(slots)

    if ask:
        pool.run(request)
    if busy:
        pool.busy_rereads += len(busy)
    for i in busy:
        try:
            results[i] = reread(i)
        except BufferTooSmall as e:
            results[i] = None
            too_small = too_small or BufferTooSmall(e.needed, e.size, index=i)
    for i in again:
        results[i] = reread(i)
    if too_small is not None:
        too_small.results = results
        raise too_small
    return results


# -- writes --------------------------------------------------------------------

def put_blocks(pool: ShmPool, blocks: list[tuple[Any, memoryview | Segments]], lease_ms: int | None,
               round_bytes: int, hashes: list[tuple[Any, Any]] | None = None) -> list[bool]:
    """Store each (key, data) in place: SHM RESERVE for a round, copy (Segments: each piece in
    turn), SHM COMMIT with the CRC32Cs. `hashes`: per block (engine hash, parent or None), sent
    with SHM RESERVE CHAINED.
    Per block True if stored, False if the key was already complete."""
    stored = [False] * len(blocks)
    todo = list(range(len(blocks)))
    while todo:
        n, total = 0, 0
        while n < len(todo) and (n == 0 or total + blocks[todo[n]][1].nbytes <= round_bytes):
            total += blocks[todo[n]][1].nbytes
            n += 1
        # what the server could not reserve yet (its cap on a tenant's unfilled puts) goes in the next round
        todo = _put_round(pool, blocks, todo[:n], stored, lease_ms or 0, hashes) + todo[n:]
    return stored


def _put_round(pool: ShmPool, blocks: list, order: list[int], stored: list[bool], lease_ms: int,
               hashes: list[tuple[Any, Any]] | None = None) -> list[int]:
    """RESERVE, copy and COMMIT `order`'s blocks; the ones to try again in another round."""
    conn = pool.acquire()  # not retried on a fresh connection: a RESERVE is not idempotent
    later: list[int] = []
    try:
        if hashes is None:
            reserve = [arg for i in order for arg in (blocks[i][0], blocks[i][1].nbytes)]
        else:
            reserve = ["CHAINED", *(arg for i in order for arg in (
                blocks[i][0], blocks[i][1].nbytes, hashes[i][0], "" if hashes[i][1] is None else hashes[i][1]))]
        reserved = conn.command(pack_command("SHM", "RESERVE", lease_ms, *reserve))
        handles: dict[int, bytes] = {}
        offsets: dict[int, int] = {}
        error: QuillError | None = None
        if isinstance(reserved, ReplyError):  # refused whole (the first block's space, say): nothing reserved
            error, reserved = from_wire(reserved.message), []
        elif type(reserved) is not list or len(reserved) != len(order):
            raise ProtocolError(f"unexpected reply to SHM RESERVE: {reserved!r:.60}")
        for i, reply in zip(order, reserved):
            if isinstance(reply, ReplyError):
                err = from_wire(reply.message)
                if isinstance(err, OutOfMemory) and i != order[0]:
                    later.append(i)  # held by this round's own reservations: after they commit
                else:
                    error = error or err
            elif type(reply) is list:
                handles[i], offsets[i] = reply[0], reply[1]
        if error is None and handles:
            # Blocks copied, then one SHM COMMIT for each COMMIT_WINDOW bytes of them sent before the
            # next are copied: quilld checks one window's CRC32Cs on the other core meanwhile.
            window: list = []
            window_bytes, sent = 0, []
            for i in handles:
                data = blocks[i][1]
                store(conn.mapping.arena[offsets[i]:offsets[i] + data.nbytes], data)
                window += (handles[i], crc_of(data))
                window_bytes += data.nbytes
                if window_bytes >= COMMIT_WINDOW:
                    conn.send(pack_command("SHM", "COMMIT", *window))
                    sent.append(len(window) // 2)
                    window, window_bytes = [], 0
            if window:
                conn.send(pack_command("SHM", "COMMIT", *window))
                sent.append(len(window) // 2)
            committed: list = []
            for count in sent:
                reply = conn.next_reply()
                if isinstance(reply, ReplyError):  # the whole command refused: none of its puts committed
                    reply = [reply] * count
                elif type(reply) is not list or len(reply) != count:
                    raise ProtocolError(f"unexpected reply to SHM COMMIT: {reply!r:.60}")
                committed += reply
            still_open = []
            for i, reply in zip(handles, committed):
                if isinstance(reply, ReplyError):
                    err = from_wire(reply.message)
                    error = error or err
                    if not isinstance(err, NoHandle):
                        still_open.append(handles[i])
                else:
                    stored[i] = True
            _abort(conn, still_open)
        elif handles:
            _abort(conn, list(handles.values()))
    except OSError as e:
        conn.close()
        pool.reset()
        raise QuillConnectionError(f"connection to {pool.path} lost during a put: {e}") from e
    except BaseException:
        conn.close()
        raise
    pool.release(conn)
    if error is not None:
        raise error
    return later


def _abort(conn: ShmConnection, handles: list[bytes]) -> None:
    """Abort open puts, with no wait: their replies are read in front of the next command's."""
    for h in handles:
        conn.send(pack_command("PUT2PHASE", "ABORT", h))
        conn.owed += 1
