"""A small asyncio RESP client for node-to-node calls, and a pool of them.

Commands are encoded by quillwire (the codec quillclient shares). General
replies are parsed with hiredis. `fetch_into` reads its reply with quillwire's
`ReplyReader`, which lands the block's payload straight into memory the caller
provides (an arena slot): no intermediate `bytes` of the payload is ever built.

A connection is an asyncio `BufferedProtocol` on the loop's own transport: the
loop receives straight into the buffer `get_buffer` names (the reader's small
buffer for headers, then the arena slot for the payload), one wake-up per
arrival, with the socket registered with the poller once for the connection's
life. (Awaiting `loop.sock_recv_into` per read registered and unregistered it
every time: on uvloop, five system calls per wait.) While a payload arrives the
socket's SO_RCVLOWAT asks the kernel to wake this process only once `PAYLOAD_LOWAT`
bytes (or the rest of the payload) are there, not for every segment loopback or
the NIC delivers; it is back at 1 byte before the payload's last read.

Any connection error or timeout closes the connection; the caller decides
whether to retry elsewhere.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

import hiredis

from quilld.errors import QuillError
from quillwire.encode import encode_command
from quillwire.reply import NEED_DATA, Bulk, ReplyError, ReplyReader

CONNECT_TIMEOUT = 2.0
CALL_TIMEOUT = 10.0
_CHUNK = 256 * 1024
_HEADER_READ = 1024  # asked for while a reply header is due: little of the payload passes through a copy
SOCKET_BUFFER = 4 * 1024 * 1024  # a whole block in flight per round trip (capped by net.core.rmem_max)
# While a payload arrives the loop is woken once this much of it (or all that is left) is in the
# socket: a 4 MiB block took about 8 reads, each a wake-up and a Python callback (issue 22.5).
PAYLOAD_LOWAT = 1024 * 1024


_DISCARD = memoryview(bytearray(4096))  # where a socket let go of reads what still arrives


class PeerError(QuillError):
    """A peer could not be reached or broke off mid-reply."""

    prefix = "PEERFAIL"


class _Receiver(asyncio.BufferedProtocol):
    """The loop's side of one PeerConnection's socket: received bytes go where the connection
    says, until it lets go of this socket (`live` False); after that nothing it receives is
    written anywhere a caller could see (a closed fetch's arena slot may already be reused)."""

    __slots__ = ("conn", "live")

    def __init__(self, conn: PeerConnection) -> None:
        self.conn = conn
        self.live = True

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn._get_buffer() if self.live else _DISCARD

    def buffer_updated(self, nbytes: int) -> None:
        if self.live:
            self.conn._received(nbytes)

    def eof_received(self) -> bool:
        if self.live:
            self.conn._fail(PeerError("peer closed the connection mid-transfer" if self.conn._receiving()
                                      else "connection closed by peer"))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.live:
            self.conn._fail(PeerError(f"connection lost: {exc}" if exc else "connection closed by peer"))


class PeerConnection:
    def __init__(self, host: str, port: int, hello: tuple[tuple, ...] = ()) -> None:
        self.host, self.port = host, port
        self.hello = hello  # commands sent right after connecting (authentication)
        self.transport: asyncio.Transport | None = None
        self._receiver: _Receiver | None = None
        self.reader = hiredis.Reader()
        self.fetch_reader = ReplyReader(large_bulk=0)  # fetch_into's replies: every bulk announced
        self.loop = asyncio.get_running_loop()
        self._rbuf = memoryview(bytearray(_CHUNK))  # call()'s replies land here, then in hiredis
        self._waiter: asyncio.Future | None = None  # the reply being awaited
        self._fetching = False  # the awaited reply is fetch_into's
        self._target: Callable[[int], memoryview] | None = None
        self._view: memoryview | None = None
        self._sock: Any = None  # the transport's socket, for SO_RCVLOWAT
        self._lowat = 1  # the socket's SO_RCVLOWAT now

    async def connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)  # before connect: window scale
        try:
            await asyncio.wait_for(self.loop.sock_connect(sock, (self.host, self.port)), CONNECT_TIMEOUT)
            receiver = _Receiver(self)
            self.transport, _ = await self.loop.create_connection(lambda: receiver, sock=sock)
            self._receiver = receiver
            self._sock, self._lowat = self.transport.get_extra_info("socket"), 1
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            raise PeerError(f"cannot connect to peer {self.host}:{self.port}: {str(e) or 'timeout'}") from None
        except BaseException:
            sock.close()
            raise
        for cmd in self.hello:
            reply = await self.call(*cmd)
            if isinstance(reply, hiredis.ReplyError):
                self.close()
                raise PeerError(f"peer {self.host}:{self.port} refused {cmd[0]}: {reply}")

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.live = False  # nothing more is read into a caller's memory from here on
            self._receiver = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
        self.reader = hiredis.Reader()
        self.fetch_reader = ReplyReader(large_bulk=0)
        self._fetching, self._target, self._view = False, None, None
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(PeerError("connection closed"))

    @property
    def closed(self) -> bool:
        return self.transport is None

    # -- the receiving side (called by the loop) ------------------------------
    def _receiving(self) -> bool:
        return self._fetching and self.fetch_reader.receiving

    def _get_buffer(self) -> memoryview:
        if self._fetching:  # the header in the reader's buffer, the payload straight in the target
            return self.fetch_reader.get_buffer(_HEADER_READ)
        return self._rbuf

    def _received(self, n: int) -> None:
        if self._fetching:
            reader = self.fetch_reader
            reader.buffer_updated(n)
            if self._lowat > 1:  # a payload is arriving: wake for the next part of it, or its end
                self._wake_after(len(reader.get_buffer()) if reader.receiving else 0)
            self._fetch_events()
            return
        self.reader.feed(self._rbuf, 0, n)
        try:
            reply = self.reader.gets()
        except hiredis.ProtocolError as e:
            self._fail(PeerError(f"protocol error: {e}"))
            return
        waiter = self._waiter
        if reply is False:
            return
        if waiter is None or waiter.done() or self.reader.gets() is not False:
            self._fail(PeerError("unexpected reply from peer"))  # nothing was asked, or more than asked
            return
        self._waiter = None
        waiter.set_result(reply)

    def _fetch_events(self) -> None:
        reader = self.fetch_reader
        try:
            while True:
                event = reader.next_event()
                if event is NEED_DATA:
                    return
                if type(event) is not Bulk:
                    break
                # only the payload of `*2 :crc $len payload` (`*3`: `:pxat` after it) goes anywhere:
                # checked before it arrives
                if not (event.depth == 1 and event.count in (2, 3) and event.index == 1
                        and type(event.items[0]) is int):
                    raise ValueError(f"unexpected reply: {event!r}")
                self._view = self._target(event.length)
                reader.attach(self._view)
                if reader.receiving:  # what is not in yet: wake when a good part of it is
                    self._wake_after(len(reader.get_buffer()))
        except BaseException as e:  # a malformed reply, or the target refused (out of memory)
            self._fail(e)
            return
        view, waiter = self._view, self._waiter
        self._fetching, self._target, self._view, self._waiter = False, None, None, None
        if not reader.idle:  # bytes after the reply: the stream cannot be trusted any more
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result((event, view))

    def _wake_after(self, left: int) -> None:
        """SO_RCVLOWAT for a payload with `left` bytes still to come: PAYLOAD_LOWAT, at most what is
        left (never more than will arrive), 1 once it is all in."""
        lowat = max(1, min(left, PAYLOAD_LOWAT))
        if lowat != self._lowat and self._sock is not None:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            except OSError:
                self._sock = None  # the option is a saving only: reads go on without it
                return
            self._lowat = lowat

    def _fail(self, error: BaseException) -> None:
        waiter = self._waiter
        self._waiter = None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    # -- requests -------------------------------------------------------------
    def _ask(self, data: bytes) -> asyncio.Future:
        if self._waiter is not None:
            raise PeerError("a peer connection runs one request at a time")
        waiter = self._waiter = self.loop.create_future()
        self.transport.write(data)
        return waiter

    async def _answer(self, waiter: asyncio.Future, timeout: float) -> Any:
        """The reply `waiter` gets, or TimeoutError after `timeout` seconds (asyncio.wait_for's
        contract for a future, without the second future and callbacks it adds to every call)."""
        timer = self.loop.call_later(timeout, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    async def call(self, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """Send one command, return its reply (a ReplyError is returned, not raised)."""
        if self.transport is None:
            await self.connect()
        try:
            return await self._answer(self._ask(encode_command(*args)), timeout)
        except (OSError, asyncio.TimeoutError, PeerError) as e:
            self.close()
            raise PeerError(f"peer {self.host}:{self.port}: {str(e) or 'timeout'}") from None
        except asyncio.CancelledError:
            self.close()  # a half-read reply would poison the next call
            raise

    async def fetch_into(self, args: tuple, target: Callable[[int], memoryview],
                         timeout: float = CALL_TIMEOUT) -> tuple[int | None, memoryview | None, int]:
        """Send a command answered with `*2 :crc $len payload`, or `*3 :crc $len payload :pxat`
        (PEERGET ... PXAT), or a nil / an error.

        `target(length)` names the memory the payload is received into.
        Returns (crc, view, pxat: -1 when the reply has none) or (None, None, -1) for a nil
        reply; raises PeerError on a broken connection and QuillError for an error reply.
        """
        if self.transport is None:
            await self.connect()
        self._fetching, self._target = True, target
        try:
            event, view = await self._answer(self._ask(encode_command(*args)), timeout)
        except (OSError, asyncio.TimeoutError, ValueError, PeerError) as e:
            self.close()
            raise PeerError(f"peer {self.host}:{self.port}: fetch failed: {str(e) or 'timeout'}") from None
        except BaseException:
            self.close()
            raise
        if event is None:
            return None, None, -1
        if isinstance(event, ReplyError):
            self.close()
            raise QuillError(event.message)
        if view is None or type(event) is not list or event[1] is not view or (
                len(event) == 3 and type(event[2]) is not int):
            self.close()
            raise PeerError(f"peer {self.host}:{self.port}: fetch failed: unexpected reply {event!r:.60}")
        return event[0], view, event[2] if len(event) == 3 else -1


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class PeerPool:
    """Connections per peer address, reused across calls, at most `per_peer` at once to each peer.

    A caller past the bound waits for a connection to be given back (`waits` counts it), so a
    burst of requests (one MGET of thousands of keys) never opens a socket per request; it waits
    at most its timeout (`busy_timeouts` counts those), so a peer that stopped answering, whose
    connections are all held by calls running to their own timeouts, fails the next call within
    its bound instead of queueing it behind them. Every `acquire` must be paired with a
    `release`, also when the call failed (a closed connection is dropped and its slot freed)."""

    def __init__(self, hello: tuple[tuple, ...] = (), per_peer: int = 8) -> None:
        self.hello = hello
        self.per_peer = per_peer
        self._idle: dict[tuple[str, int], list[PeerConnection]] = {}
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self.waits = 0
        self.busy_timeouts = 0
        self.opened = 0

    async def acquire(self, host: str, port: int, timeout: float = CALL_TIMEOUT) -> PeerConnection:
        """A connection to host:port (opened if none is idle); PeerError when every one of its
        `per_peer` stays busy for `timeout` seconds, or when it cannot be opened."""
        slots = self._slots.get((host, port))
        if slots is None:
            slots = self._slots[(host, port)] = asyncio.Semaphore(self.per_peer)
        if slots.locked():
            self.waits += 1
            try:
                await asyncio.wait_for(slots.acquire(), timeout)
            except asyncio.TimeoutError:
                self.busy_timeouts += 1
                raise PeerError(f"peer {host}:{port}: its {self.per_peer} connections stayed busy for "
                                f"{timeout:g} s") from None
        else:
            await slots.acquire()
        try:
            idle = self._idle.get((host, port))
            while idle:
                conn = idle.pop()
                if not conn.closed:
                    return conn
            conn = PeerConnection(host, port, self.hello)
            await conn.connect()
            self.opened += 1
            return conn
        except BaseException:
            slots.release()
            raise

    async def call(self, host: str, port: int, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """One command to host:port on a pooled connection, within `timeout` seconds in all
        (waiting for a free connection included); its reply (a ReplyError is returned)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self.acquire(host, port, timeout)
        try:
            return await conn.call(*args, timeout=max(deadline - loop.time(), 0.001))
        finally:
            self.release(conn)

    def release(self, conn: PeerConnection) -> None:
        slots = self._slots.get((conn.host, conn.port))
        if slots is not None:
            slots.release()
        if conn.closed:
            return
        idle = self._idle.setdefault((conn.host, conn.port), [])
        if len(idle) < self.per_peer:
            idle.append(conn)
        else:
            conn.close()

    def drop(self, host: str, port: int) -> None:
        """Close the idle connections to a peer that is gone (its slots stay, for those waiting)."""
        for conn in self._idle.pop((host, port), []):
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
