"""The server shell's command loop (protocol/server.py), driven byte by byte without sockets.

`Transport` stands in for asyncio's transport only (what was written, whether
reading is paused, the write-buffer size the loop asks about); everything
behind it is the real codec, table, handlers and keyspace. The real transport
is covered by the black-box tests.
"""

from __future__ import annotations

import asyncio

from handler_context import make_context
from quilld.model import Pending
from quilld.protocol.commands.blocks import large_target, release_args
from quilld.protocol.server import RespConnection


class Transport:
    def __init__(self):
        self.out = bytearray()
        self.closed = False
        self.paused = False
        self.buffered = 0  # what the loop would see as unsent

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name in ("peername", "sockname") else default

    def write(self, data):
        self.out += data

    def writelines(self, chunks):
        for c in chunks:
            self.out += c

    def get_write_buffer_size(self):
        return self.buffered

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


def connect(ctx=None):
    ctx = ctx or make_context(pages=64)
    conn = RespConnection(ctx, large_target, release_args)
    t = Transport()
    conn.connection_made(t)
    return ctx, conn, t


def feed(conn, data: bytes, chunk: int | None = None):
    """Deliver bytes as the event loop would: get_buffer, copy, buffer_updated."""
    chunk = chunk or len(data) or 1
    for i in range(0, len(data), chunk):
        piece = data[i:i + chunk]
        while piece:
            buf = conn.get_buffer(len(piece))
            n = min(len(buf), len(piece))
            buf[:n] = piece[:n]
            conn.buffer_updated(n)
            piece = piece[n:]


def test_pipelined_commands_answer_in_order_in_one_write():
    ctx, conn, t = connect()
    feed(conn, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\nPING\r\n")
    assert bytes(t.out) == b"+OK\r\n$1\r\nv\r\n+PONG\r\n"
    assert ctx.clients.commands_processed == 3


def test_input_split_at_every_offset_gives_the_same_replies():
    msg = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    for step in range(1, len(msg) + 1):
        _, conn, t = connect()
        feed(conn, msg, chunk=step)
        assert bytes(t.out) == b"+OK\r\n$5\r\nhello\r\n", step


def test_a_large_value_is_received_into_the_arena_and_read_back_pinned_until_drained():
    ctx, conn, t = connect()
    value = bytes(range(256)) * 256  # 64 KiB: a large bulk
    feed(conn, b"*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n$%d\r\n" % len(value) + value + b"\r\n", chunk=7000)
    assert bytes(t.out) == b"+OK\r\n"
    assert ctx.keyspace.block_count == 1 and ctx.keyspace.reserved_blocks == 0
    t.out.clear()
    t.buffered = 1  # the kernel has not taken the reply yet
    feed(conn, b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n")
    assert bytes(t.out) == b"$%d\r\n" % len(value) + value + b"\r\n"
    assert ctx.keyspace.active_pins == 1  # still pinned: the transport holds the view
    t.buffered = 0
    conn.check_drained()
    assert ctx.keyspace.active_pins == 0


def test_a_connection_lost_mid_payload_gives_its_reservation_back():
    ctx, conn, t = connect()
    feed(conn, b"*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n$100000\r\n" + b"x" * 5000)
    assert ctx.keyspace.reserved_blocks == 1
    conn.connection_lost(None)
    assert ctx.keyspace.reserved_blocks == 0 and ctx.keyspace.used == 0
    assert ctx.clients.connections == {}


def test_quit_stops_the_pipeline_and_closes():
    _, conn, t = connect()
    feed(conn, b"PING\r\nQUIT\r\nSET k v\r\n")
    assert bytes(t.out) == b"+PONG\r\n+OK\r\n" and t.closed
    assert conn.ctx.keyspace.keys_in(conn.session.tag) == 0


def test_a_protocol_error_answers_then_closes():
    _, conn, t = connect()
    feed(conn, b"PING\r\n*1\r\nx\r\n")
    assert bytes(t.out) == b"+PONG\r\n-ERR Protocol error: expected '$', got 'x'\r\n" and t.closed


def test_a_pending_reply_holds_back_the_commands_behind_it():
    async def main():
        ctx, conn, t = connect()
        gate = asyncio.Event()

        async def slow():
            await gate.wait()
            return b"late"

        ctx.table.add("slow", 1, "", lambda c, a: Pending(slow()))
        feed(conn, b"SLOW\r\nPING\r\n")
        await asyncio.sleep(0.01)
        assert bytes(t.out) == b"" and t.paused  # PING waits behind SLOW; reading paused
        gate.set()
        for _ in range(100):
            await asyncio.sleep(0.001)
            if t.out:
                break
        assert bytes(t.out) == b"$4\r\nlate\r\n+PONG\r\n" and not t.paused

    asyncio.run(main())


def test_max_clients_refuses_with_redis_text():
    ctx = make_context(max_clients=1)
    connect(ctx)
    _, _, t = connect(ctx)
    assert bytes(t.out) == b"-ERR max number of clients reached\r\n" and t.closed
    assert ctx.clients.stats["rejected_connections"] == 1
