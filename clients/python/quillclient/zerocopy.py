"""Reading blocks straight into the caller's memory, on a pool of raw sockets.

redis-py cannot do this: its parsers (hiredis or the Python one) read ahead
into their own buffer and hand back a new bytes object, so a block would be
copied at least twice. These sockets are ours alone. Each keeps one small
scratch buffer for what is not payload (reply headers, CRLFs, error lines,
and at most `HEADER_READ` bytes that arrive with a header); everything else
goes from the kernel into the caller's buffer with `recv_into`.

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
from typing import Callable, Sequence, TypeVar

from quillclient.config import ClientConfig
from quillclient.errors import (BufferTooSmall, ProtocolError, QuillConnectionError, QuillError,
                                QuillTimeout, from_wire)
from quillclient.wire import pack_command

SCRATCH = 64 * 1024  # per socket; also the longest reply line accepted
HEADER_READ = 4096  # asked for when a header is needed: a reply this small comes in one recv
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


class RawConnection:
    """One socket speaking RESP2, set up with the client's AUTH and SCOPE."""

    __slots__ = ("sock", "buf", "mv", "start", "end", "broken", "generation")

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
        self.buf = bytearray(SCRATCH)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0  # buffered, not yet consumed: buf[start:end]
        self.broken = False
        self.generation = generation
        try:
            self._handshake(cfg.handshake())
        except (BlockingIOError, TimeoutError) as e:
            self.close()
            raise QuillTimeout(f"no reply to AUTH/SCOPE within socket_timeout={cfg.socket_timeout}s") from e
        except OSError as e:
            self.close()
            raise QuillConnectionError(f"setting up a connection to {cfg.host}:{cfg.port}: {e}") from e
        except BaseException:
            self.close()
            raise

    def _handshake(self, commands: list[tuple]) -> None:
        if not commands:
            return
        self.send([piece for cmd in commands for piece in pack_command(*cmd)])
        first_error = None
        for _ in commands:  # read every reply, so an error leaves nothing unread
            line = self.read_line()
            if line[:1] == b"-" and first_error is None:
                first_error = from_wire(line[1:].decode("utf-8", "replace"))
            elif line[:1] not in (b"+", b"-"):
                raise ProtocolError(f"unexpected reply {bytes(line[:40])!r} while setting the connection up")
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
        sendall = self.sock.sendall
        for piece in pieces:
            sendall(piece)

    def _fill(self, want: int) -> None:
        """Receive up to `want` more bytes into the scratch buffer (at least one)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end + want > SCRATCH:
            n = self.end - self.start
            self.buf[:n] = self.mv[self.start:self.end]
            self.start, self.end = 0, n
        room = min(want, SCRATCH - self.end)
        if room <= 0:
            raise ProtocolError(f"reply line longer than {SCRATCH} bytes")
        got = self.sock.recv_into(self.mv[self.end:self.end + room])
        if not got:
            raise ConnectionResetError("the server closed the connection")
        self.end += got

    def read_line(self) -> bytes:
        """The next CRLF-terminated line, without its CRLF."""
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.mv[self.start:i])
                self.start = i + 2
                return line
            self._fill(HEADER_READ)

    def read_into(self, target: memoryview) -> None:
        """Fill `target` exactly: first from what is buffered, then straight from the socket."""
        size = len(target)
        pos = min(self.end - self.start, size)
        if pos:
            target[:pos] = self.mv[self.start:self.start + pos]
            self.start += pos
        recv_into = self.sock.recv_into
        while pos < size:
            got = recv_into(target[pos:])
            if not got:
                raise ConnectionResetError("the server closed the connection mid-reply")
            pos += got

    def skip(self, n: int) -> None:
        """Read and drop `n` bytes (a payload that did not fit its buffer)."""
        have = min(self.end - self.start, n)
        self.start += have
        n -= have
        if n:  # the scratch buffer is empty now: use all of it
            self.start = self.end = 0
        while n:
            got = self.sock.recv_into(self.mv[:min(n, SCRATCH)])
            if not got:
                raise ConnectionResetError("the server closed the connection mid-reply")
            n -= got

    def expect_crlf(self) -> None:
        while self.end - self.start < 2:
            self._fill(HEADER_READ)
        if self.buf[self.start:self.start + 2] != b"\r\n":
            raise ProtocolError("bulk reply not followed by CRLF")
        self.start += 2

    def read_bulk_header(self) -> int:
        """A bulk reply's length, MISS for nil; raises the error a `-` reply carries."""
        line = self.read_line()
        kind = line[:1]
        if kind == b"$":
            try:
                n = int(line[1:])
            except ValueError:
                n = -2
            if n < -1:
                raise ProtocolError(f"bad bulk length {line[:40]!r}")
            return n
        if kind == b"_":  # RESP3 null
            return MISS
        if kind == b"-":
            raise from_wire(line[1:].decode("utf-8", "replace"))
        raise ProtocolError(f"expected a bulk reply, got {line[:40]!r}")

    def read_bulk_header_safe(self) -> int | QuillError:
        """read_bulk_header, with a server error returned instead of raised (pipelines go on)."""
        try:
            return self.read_bulk_header()
        except ProtocolError:
            raise
        except QuillError as e:
            return e

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
                self.skip(n)
                self.expect_crlf()
            else:
                self.broken = True
            raise BufferTooSmall(n, len(view))
        self.read_into(view[:n])
        self.expect_crlf()
        return n


class RawPool:
    """Idle raw sockets (LIFO), thread-safe; each is used by one thread at a time."""

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
        conn = RawConnection(self.cfg, generation)
        with self._lock:
            self.created += 1
        return conn

    def release(self, conn: RawConnection) -> None:
        if conn.broken or conn.start != conn.end:
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
                    raise QuillConnectionError(f"connection to {self.cfg.host}:{self.cfg.port} lost: {e}") from e
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


def get_many_into(pool: RawPool, keys: Sequence, views: Sequence[memoryview]) -> list[int | None]:
    """Pipelined GETBLKs, `pipeline_window` commands in flight, each reply into its own view.

    Every reply is read even after a failure, so the socket stays in step: a
    block too large for its view is dropped (None in the results), a server
    error is raised once all replies are in.
    """
    if len(keys) != len(views):
        raise ValueError(f"{len(keys)} keys but {len(views)} buffers")
    if not keys:
        return []
    commands = [getblk_command(k) for k in keys]
    window = pool.cfg.pipeline_window

    def request(conn: RawConnection) -> list[int | None]:
        results: list[int | None] = [MISS] * len(keys)
        too_small: BufferTooSmall | None = None
        error: QuillError | None = None
        for lo in range(0, len(keys), window):
            hi = min(lo + window, len(keys))
            conn.send([piece for cmd in commands[lo:hi] for piece in cmd])
            for i in range(lo, hi):
                view = views[i]
                n = conn.read_bulk_header_safe()
                if isinstance(n, QuillError):
                    error = error or n
                    results[i] = None
                    continue
                if n == MISS:
                    continue
                if n > len(view):
                    conn.skip(n)
                    conn.expect_crlf()
                    results[i] = None
                    if too_small is None:
                        too_small = BufferTooSmall(n, len(view), index=i)
                    continue
                conn.read_into(view[:n])
                conn.expect_crlf()
                results[i] = n
        if error is not None:
            raise error
        if too_small is not None:
            too_small.results = results
            raise too_small
        return results

    return pool.run(request)

