"""A small asyncio RESP client for node-to-node calls, and a pool of them.

Commands are encoded by quillwire (the codec quillclient shares). General
replies are parsed with hiredis. `fetch_into` reads its reply with quillwire's
`ReplyReader`, which lands the block's payload straight into memory the caller
provides (an arena slot): no intermediate `bytes` of the payload is ever built.
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


class PeerError(QuillError):
    """A peer could not be reached or broke off mid-reply."""

    prefix = "PEERFAIL"


class PeerConnection:
    def __init__(self, host: str, port: int, hello: tuple[tuple, ...] = ()) -> None:
        self.host, self.port = host, port
        self.hello = hello  # commands sent right after connecting (authentication)
        self.sock: socket.socket | None = None
        self.reader = hiredis.Reader()
        self.fetch_reader = ReplyReader(large_bulk=0)  # fetch_into's replies: every bulk announced
        self.loop = asyncio.get_running_loop()

    async def connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)  # before connect: window scale
        try:
            await asyncio.wait_for(self.loop.sock_connect(sock, (self.host, self.port)), CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            raise PeerError(f"cannot connect to peer {self.host}:{self.port}: {e or 'timeout'}") from None
        self.sock = sock
        for cmd in self.hello:
            reply = await self.call(*cmd)
            if isinstance(reply, hiredis.ReplyError):
                self.close()
                raise PeerError(f"peer {self.host}:{self.port} refused {cmd[0]}: {reply}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.reader = hiredis.Reader()
        self.fetch_reader = ReplyReader(large_bulk=0)

    @property
    def closed(self) -> bool:
        return self.sock is None

    async def call(self, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """Send one command, return its reply (a ReplyError is returned, not raised)."""
        if self.sock is None:
            await self.connect()
        try:
            return await asyncio.wait_for(self._call(encode_command(*args)), timeout)
        except (OSError, asyncio.TimeoutError, hiredis.ProtocolError, PeerError) as e:
            self.close()
            raise PeerError(f"peer {self.host}:{self.port}: {e or 'timeout'}") from None
        except asyncio.CancelledError:
            self.close()  # a half-read reply would poison the next call
            raise

    async def _call(self, data: bytes) -> Any:
        await self.loop.sock_sendall(self.sock, data)
        buf = bytearray(_CHUNK)
        while True:
            reply = self.reader.gets()
            if reply is not False:
                return reply
            n = await self.loop.sock_recv_into(self.sock, buf)
            if n == 0:
                raise PeerError("connection closed by peer")
            self.reader.feed(buf, 0, n)

    async def fetch_into(self, args: tuple, target: Callable[[int], memoryview],
                         timeout: float = CALL_TIMEOUT) -> tuple[int | None, memoryview | None]:
        """Send a command answered with `*2 :crc $len payload` (or a nil / an error).

        `target(length)` names the memory the payload is received into.
        Returns (crc, view) or (None, None) for a nil reply; raises PeerError on
        a broken connection and QuillError for an error reply.
        """
        if self.sock is None:
            await self.connect()
        try:
            return await asyncio.wait_for(self._fetch(encode_command(*args), target), timeout)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            self.close()
            raise PeerError(f"peer {self.host}:{self.port}: fetch failed: {e or 'timeout'}") from None
        except BaseException:
            self.close()
            raise

    async def _fetch(self, data: bytes, target: Callable[[int], memoryview]) -> tuple:
        loop, sock, reader = self.loop, self.sock, self.fetch_reader
        await loop.sock_sendall(sock, data)
        view = None
        while True:
            event = reader.next_event()
            if event is NEED_DATA:
                # the header lands in the reader's buffer, the payload straight in the target
                buf = reader.get_buffer(_HEADER_READ)
                try:  # drain what the kernel already holds without a loop round trip per chunk
                    n = sock.recv_into(buf)
                except BlockingIOError:
                    n = await loop.sock_recv_into(sock, buf)
                if n == 0:
                    raise PeerError("peer closed the connection mid-transfer" if reader.receiving
                                    else "connection closed by peer")
                reader.buffer_updated(n)
            elif type(event) is Bulk:
                # only the payload of `*2 :crc $len payload` goes anywhere: checked before it arrives
                if not (event.depth == 1 and event.count == 2 and event.index == 1
                        and type(event.items[0]) is int):
                    raise ValueError(f"unexpected reply: {event!r}")
                view = target(event.length)
                reader.attach(view)
            else:
                break
        if not reader.idle:  # bytes after the reply: the stream cannot be trusted any more
            self.close()
        if event is None:
            return None, None
        if isinstance(event, ReplyError):
            raise QuillError(event.message)
        if view is None or type(event) is not list or event[1] is not view:
            raise ValueError(f"unexpected reply {event!r:.60}")
        return event[0], view


class PeerPool:
    """Idle connections per peer address, reused across calls."""

    def __init__(self, hello: tuple[tuple, ...] = (), per_peer: int = 8) -> None:
        self.hello = hello
        self.per_peer = per_peer
        self._idle: dict[tuple[str, int], list[PeerConnection]] = {}

    async def acquire(self, host: str, port: int) -> PeerConnection:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        conn = PeerConnection(host, port, self.hello)
        await conn.connect()
        return conn

    def release(self, conn: PeerConnection) -> None:
        if conn.closed:
            return
        idle = self._idle.setdefault((conn.host, conn.port), [])
        if len(idle) < self.per_peer:
            idle.append(conn)
        else:
            conn.close()

    def drop(self, host: str, port: int) -> None:
        for conn in self._idle.pop((host, port), []):
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
