"""A small asyncio RESP client for node-to-node calls, and a pool of them.

Replies are parsed with hiredis. `fetch_into` receives a block's payload
straight into memory the caller provides (an arena slot): no intermediate
`bytes` of the payload is ever built. Any connection error or timeout closes
the connection; the caller decides whether to retry elsewhere.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

import hiredis

from quilld.errors import QuillError

CONNECT_TIMEOUT = 2.0
CALL_TIMEOUT = 10.0
_CHUNK = 256 * 1024
SOCKET_BUFFER = 4 * 1024 * 1024  # a whole block in flight per round trip (capped by net.core.rmem_max)


class PeerError(QuillError):
    """A peer could not be reached or broke off mid-reply."""

    prefix = "PEERFAIL"


def encode_command(args: tuple) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        parts.append(b"$%d\r\n%b\r\n" % (len(a), a))
    return b"".join(parts)


class PeerConnection:
    def __init__(self, host: str, port: int, hello: tuple[tuple, ...] = ()) -> None:
        self.host, self.port = host, port
        self.hello = hello  # commands sent right after connecting (authentication)
        self.sock: socket.socket | None = None
        self.reader = hiredis.Reader()
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

    @property
    def closed(self) -> bool:
        return self.sock is None

    async def call(self, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """Send one command, return its reply (a ReplyError is returned, not raised)."""
        if self.sock is None:
            await self.connect()
        try:
            return await asyncio.wait_for(self._call(encode_command(args)), timeout)
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
            return await asyncio.wait_for(self._fetch(encode_command(args), target), timeout)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            self.close()
            raise PeerError(f"peer {self.host}:{self.port}: fetch failed: {e or 'timeout'}") from None
        except BaseException:
            self.close()
            raise

    async def _fetch(self, data: bytes, target: Callable[[int], memoryview]) -> tuple:
        loop, sock = self.loop, self.sock
        await loop.sock_sendall(sock, data)
        head = bytearray()
        # the header is at most three short lines: read until all of them are in
        while True:
            lines = head.split(b"\r\n")
            if head[:1] in (b"-", b"$") and len(lines) >= 2:
                if head[:1] == b"-":
                    raise QuillError(lines[0][1:].decode(errors="replace"))
                if lines[0] == b"$-1":
                    return None, None
                raise ValueError(f"unexpected reply {bytes(lines[0][:40])!r}")
            if head[:1] == b"*" and len(lines) >= 4:
                break
            if len(head) > 1024 or (head and head[:1] not in b"*-$"):
                raise ValueError("malformed reply header")
            chunk = await loop.sock_recv(sock, 1024 if not head else 256)
            if not chunk:
                raise PeerError("connection closed by peer")
            head += chunk
        if lines[0] != b"*2" or lines[1][:1] != b":" or lines[2][:1] != b"$":
            raise ValueError(f"unexpected reply header {bytes(head[:60])!r}")
        crc, length = int(lines[1][1:]), int(lines[2][1:])
        start = len(lines[0]) + len(lines[1]) + len(lines[2]) + 6
        view = target(length)
        got = head[start:start + length + 2]
        take = min(len(got), length)
        view[:take] = got[:take]
        tail = bytearray(got[take:])
        pos = take
        while pos < length:
            # drain what the kernel already holds without a loop round trip per chunk
            try:
                n = sock.recv_into(view[pos:])
            except BlockingIOError:
                n = await loop.sock_recv_into(sock, view[pos:])
            if n == 0:
                raise PeerError("peer closed the connection mid-transfer")
            pos += n
        while len(tail) < 2:
            chunk = await loop.sock_recv(sock, 2 - len(tail))
            if not chunk:
                raise PeerError("peer closed the connection mid-transfer")
            tail += chunk
        if bytes(tail[:2]) != b"\r\n":
            raise ValueError("payload not followed by CRLF")
        return crc, view


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
