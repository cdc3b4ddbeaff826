"""Reading blocks straight into the caller's memory, on a pool of raw sockets.

redis-py cannot do this: its parsers (hiredis or the Python one) read ahead
into their own buffer and hand back a new bytes object, so a block would be
copied at least twice. These sockets are ours alone. Each reads its replies
with quillwire's `ReplyReader` (the codec quilld's peer transfer shares): what
is not payload (reply headers, CRLFs, error lines, and at most `HEADER_READ`
bytes that arrive with a header) goes through the reader's small buffer;
everything else goes from the kernel into the caller's buffer with
`recv_into`, the reader naming the spot (`get_buffer`).

Nothing on a pooled socket is ever left half read: a reply too large for its
buffer is read and dropped (up to `drain_max` bytes) or its socket is closed,
and any failure mid-reply closes the socket. A request whose connection breaks
(e.g. a pooled socket to a quilld that has since restarted) closes every idle
socket and is retried once on a fresh one.
"""

from __future__ import annotations

import socket
import struct
import threading
from contextlib import contextmanager
from typing import Any, Callable, Sequence, TypeVar

from quillwire.encode import pack_command
from quillwire.reply import NEED_DATA, Bulk, ReplyError, ReplyReader, Status
from quillwire.reply import ProtocolError as WireProtocolError

from quillclient.config import ClientConfig
from quillclient.segments import Segments
from quillclient.errors import (BufferTooSmall, ProtocolError, QuillConnectionError, QuillError,
                                QuillTimeout, from_wire)

HEADER_READ = 4096  # asked for when a header is needed: a reply this small comes in one recv
_IOV_MAX = 1024  # pieces per sendmsg (Linux's UIO_MAXIOV)
MISS = -1

T = TypeVar("T")


def _kernel_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """Blocking socket with SO_RCVTIMEO/SO_SNDTIMEO: one syscall per recv, not poll + recv.

    (A Python socket with settimeout() polls before every call.) Falls back to
    settimeout() where the options are not available.
    """
    if seconds is None:
        sock.settimeout(None)
        return
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1_000_000) or (0 if whole else 1))
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    except (OSError, AttributeError, struct.error):
        sock.settimeout(seconds)


@contextmanager
def setting_up(conn: Any, timed_out: str, failed: str):
    """Around a new connection's setup: on any failure `conn` is closed, a timeout raises
    QuillTimeout(`timed_out`) and another socket error QuillConnectionError(`failed: error`)."""
    try:
        yield
    except (BlockingIOError, TimeoutError) as e:
        conn.close()
        raise QuillTimeout(timed_out) from e
    except OSError as e:
        conn.close()
        raise QuillConnectionError(f"{failed}: {e}") from e
    except BaseException:
        conn.close()
        raise


class RawConnection:
    """One socket speaking RESP2, set up with the client's AUTH and SCOPE."""

    __slots__ = ("sock", "reader", "broken", "generation")

    def __init__(self, cfg: ClientConfig, generation: int) -> None:
        try:
            sock = socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout)
        except TimeoutError as e:
            raise QuillTimeout(f"connecting to {cfg.host}:{cfg.port}: {e}") from e
        except OSError as e:
            raise QuillConnectionError(f"connecting to {cfg.host}:{cfg.port}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _kernel_timeouts(sock, cfg.socket_timeout)
        self.sock = sock
        self.reader = ReplyReader(large_bulk=0)  # every bulk announced: its payload goes where we say
        self.broken = False
        self.generation = generation
        with setting_up(self, f"no reply to AUTH/SCOPE within socket_timeout={cfg.socket_timeout}s",
                        f"setting up a connection to {cfg.host}:{cfg.port}"):
            self._handshake(cfg.handshake())

    def _handshake(self, commands: list[tuple]) -> None:
        if not commands:
            return
        self.send([piece for cmd in commands for piece in pack_command(*cmd)])
        first_error = None
        for _ in commands:  # read every reply, so an error leaves nothing unread
            reply = self.next_event()
            if isinstance(reply, ReplyError):
                if first_error is None:
                    first_error = from_wire(reply.message)
            elif type(reply) is not Status:
                raise ProtocolError(f"unexpected reply {reply!r:.60} while setting the connection up")
        if first_error is not None:
            raise first_error

    # -- state -------------------------------------------------------------

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass

    # -- I/O ---------------------------------------------------------------

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Send every piece, in order, gathered into as few `sendmsg` calls as the kernel allows
        (one for a command and its block: no copy to join them, no extra system call)."""
        if len(pieces) == 1:
            self.sock.sendall(pieces[0])
            return
        sendmsg = self.sock.sendmsg
        pending = list(pieces)
        i = 0
        while i < len(pending):
            sent = sendmsg(pending[i:i + _IOV_MAX])
            while i < len(pending) and sent >= len(pending[i]):
                sent -= len(pending[i])
                i += 1
            if sent:  # a piece went out in part: the rest of it leads the next call
                pending[i] = memoryview(pending[i])[sent:]

    def next_event(self) -> Any:
        """The reader's next reply or bulk announcement, receiving as much as it needs.

        While a payload is arriving, the reader's buffer is the caller's view:
        `recv_into` writes the payload straight into it.
        """
        reader = self.reader
        try:
            event = reader.next_event()
            if event is NEED_DATA:
                recv_into, get_buffer, updated, next_event = (
                    self.sock.recv_into, reader.get_buffer, reader.buffer_updated, reader.next_event)
                while event is NEED_DATA:
                    got = recv_into(get_buffer(HEADER_READ))
                    if not got:
                        raise ConnectionResetError("the server closed the connection mid-reply"
                                                   if reader.receiving else "the server closed the connection")
                    updated(got)
                    event = next_event()
        except WireProtocolError as e:
            raise ProtocolError(str(e)) from None
        return event

    def read_bulk_header(self) -> int:
        """A bulk reply's length, MISS for nil; raises the error a `-` reply carries.

        A length is announced: `read_payload` or `skip_payload` must follow.
        """
        event = self.next_event()
        if type(event) is Bulk:
            if event.depth:
                raise ProtocolError(f"expected a bulk reply, got an array ({event!r})")
            return event.length
        if event is None:  # `$-1`, or RESP3's `_`
            return MISS
        if isinstance(event, ReplyError):
            raise from_wire(event.message)
        raise ProtocolError(f"expected a bulk reply, got {event!r:.60}")

    def read_bulk_header_safe(self) -> int | QuillError:
        """read_bulk_header, with a server error returned instead of raised (pipelines go on)."""
        try:
            return self.read_bulk_header()
        except ProtocolError:
            raise
        except QuillError as e:
            return e

    def read_payload(self, view: memoryview | Segments) -> None:
        """Receive the announced payload into the front of `view` (first what is buffered,
        then straight from the socket; Segments: scattered over its buffers), then its CRLF."""
        self.reader.attach(view.views if isinstance(view, Segments) else view)
        self.next_event()

    def skip_payload(self) -> None:
        """Read and drop the announced payload (one that did not fit its buffer)."""
        self.reader.drop()
        self.next_event()

    def read_bulk_into(self, view: memoryview, drain_max: int) -> int:
        """Read one GETBLK reply into `view`; its length, or MISS.

        A block larger than `view` raises BufferTooSmall with nothing written;
        the payload is dropped if it is at most `drain_max` bytes, else the
        socket is marked broken (closed by the pool).
        """
        n = self.read_bulk_header()
        if n == MISS:
            return MISS
        if n > len(view):
            if n <= drain_max:
                self.skip_payload()
            else:
                self.broken = True
            raise BufferTooSmall(n, len(view))
        self.read_payload(view)
        return n


class RawPool:
    """Idle raw sockets (LIFO), thread-safe; each is used by one thread at a time.
    shm.ShmPool is the same pool over unix-socket connections (`_connect`, `_where`)."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self._idle: list[RawConnection] = []
        self._lock = threading.Lock()
        self._generation = 0
        self._closed = False
        self.created = 0  # sockets opened over the pool's life (tests and stats read it)

    def acquire(self) -> RawConnection:
        with self._lock:
            if self._closed:
                raise QuillError("the client is closed")
            if self._idle:
                return self._idle.pop()
            generation = self._generation
        conn = self._connect(generation)
        with self._lock:
            self.created += 1
        return conn

    def _connect(self, generation: int) -> Any:
        return RawConnection(self.cfg, generation)

    def _where(self) -> str:
        return f"{self.cfg.host}:{self.cfg.port}"

    def release(self, conn: RawConnection) -> None:
        if conn.broken or not conn.reader.idle:
            conn.close()
            return
        with self._lock:
            if not self._closed and conn.generation == self._generation and len(self._idle) < self.cfg.max_idle_raw:
                self._idle.append(conn)
                return
        conn.close()

    def reset(self) -> None:
        """Close every idle socket: after one broke, the others likely point at a dead server."""
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.reset()

    def run(self, request: Callable[[RawConnection], T]) -> T:
        """Run `request` on a pooled socket; once more on a fresh one if the connection breaks.

        `request` must be idempotent (reads are). Errors the server sent leave
        the socket in the pool; timeouts and protocol errors close it.
        """
        for attempt in (0, 1):
            conn = self.acquire()
            try:
                result = request(conn)
            except ProtocolError:
                conn.close()
                raise
            except QuillError:
                self.release(conn)  # a server error or BufferTooSmall: the reply was consumed
                raise
            except (BlockingIOError, TimeoutError) as e:  # SO_RCVTIMEO gives EAGAIN
                conn.close()
                raise QuillTimeout(f"no reply within socket_timeout={self.cfg.socket_timeout}s") from e
            except OSError as e:
                conn.close()
                self.reset()
                if attempt:
                    raise QuillConnectionError(f"connection to {self._where()} lost: {e}") from e
                continue
            except BaseException:
                conn.close()  # e.g. KeyboardInterrupt mid-reply: the socket's state is unknown
                raise
            self.release(conn)
            return result
        raise AssertionError("unreachable")


def getblk_command(key) -> list[bytes | memoryview]:
    return pack_command("GETBLK", key)


def get_into(pool: RawPool, key, view: memoryview) -> int:
    """One GETBLK into `view`: the block's length, or MISS."""
    cmd = getblk_command(key)
    drain_max = pool.cfg.drain_max

    def request(conn: RawConnection) -> int:
        conn.send(cmd)
        return conn.read_bulk_into(view, drain_max)

    return pool.run(request)


def put(pool: RawPool, key, data, ttl_ms: int | None = None) -> None:
    """One SET of `data` under `key`: the command and the caller's bytes in one sendmsg, the
    `+OK` read back on the same socket (redis-py would add its pool, packer and parser)."""
    cmd = pack_command("SET", key, data) if ttl_ms is None else pack_command("SET", key, data, "PX", ttl_ms)

    def request(conn: RawConnection) -> None:
        conn.send(cmd)
        reply = conn.next_event()
        if isinstance(reply, ReplyError):
            raise from_wire(reply.message)
        if type(reply) is not Status:
            raise ProtocolError(f"unexpected reply to SET: {reply!r:.60}")

    pool.run(request)


def get_many_into(pool: RawPool, keys: Sequence, views: Sequence) -> list[int | None]:
    """MGETs of `pipeline_window` keys each (one command, one server dispatch, one reply per
    window), every block received straight into its own view (or scattered over its Segments).

    The whole reply is read even after a failure, so the socket stays in step: a block too large
    for its view is dropped (None in the results, BufferTooSmall raised at the end with every
    result); a server error (for the whole command) is raised once the reply is in.
    """
    if len(keys) != len(views):
        raise ValueError(f"{len(keys)} keys but {len(views)} buffers")
    if not keys:
        return []
    window = pool.cfg.pipeline_window

    def request(conn: RawConnection) -> list[int | None]:
        results: list[int | None] = [MISS] * len(keys)
        too_small: BufferTooSmall | None = None
        reader, next_event = conn.reader, conn.next_event
        for lo in range(0, len(keys), window):
            hi = min(lo + window, len(keys))
            conn.send(pack_command("MGET", *keys[lo:hi]))
            while True:
                event = next_event()
                if type(event) is not Bulk:
                    break
                if event.depth != 1:
                    raise ProtocolError(f"unexpected bulk in an MGET reply: {event!r}")
                i = lo + event.index
                view, n = views[i], event.length
                if n > len(view):
                    reader.drop(None)
                    results[i] = None
                    too_small = too_small or BufferTooSmall(n, len(view), index=i)
                    continue
                reader.attach(view.views if isinstance(view, Segments) else view)
                results[i] = n
            if isinstance(event, ReplyError):
                raise from_wire(event.message)
            if type(event) is not list or len(event) != hi - lo:
                raise ProtocolError(f"unexpected reply to MGET: {event!r:.60}")
        if too_small is not None:
            too_small.results = results
            raise too_small
        return results

    return pool.run(request)
