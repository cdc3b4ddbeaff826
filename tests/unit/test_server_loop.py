"""The server shell's command loop (protocol/server.py), driven byte by byte without sockets.

`Transport` stands in for asyncio's transport only (what was written, whether
reading is paused, the write-buffer size the loop asks about); everything
behind it is the real codec, table, handlers and keyspace. The real transport
is covered by the black-box tests.
"""

from __future__ import annotations

import asyncio

import pytest

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
    ctx, conn, t = connect(make_context(pages=1024))  # one tenant may hold a quarter unfilled
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


# -- a handler that raises something other than a QuillError (issue 11, finding 4) ------------
# Each command that takes a large argument (received straight into the arena) fails, either in
# its handler before it runs or inside a storage call it makes; afterwards no reservation, pin
# or open writer may remain, the reply is an error, and the connection goes on answering.

LARGE = 64 * 1024  # over LARGE_BULK (16 KiB): received into the arena as it arrives
_MESSAGE = "-".join(("exception", "message"))  # must never reach the log (nor appear in source lines)


def _cmd(*args) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(a), a))
    return b"".join(out)


def _fail_in_handler(ctx, name: str, when=lambda args: True):
    """Replace `name`'s handler by one that raises (when `when(args)`) before the real one runs."""
    cmd = ctx.table.commands[name.encode()]

    def failing(c, args):
        if when(args):
            raise RuntimeError(_MESSAGE)
        return cmd.handler(c, args)

    ctx.table.add(name, cmd.arity, " ".join(sorted(cmd.flags)), failing)


def _fail_publish(ctx, after: int = 0):
    """The keyspace's publish raises from its (after+1)-th call on (an MSET fails half-way)."""
    real, calls = ctx.keyspace.publish, [0]

    def publish(*a, **kw):
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError(_MESSAGE)
        return real(*a, **kw)

    ctx.keyspace.publish = publish


def _fail_close_writer(ctx):
    """PUT2PHASE DATA's handler fails when it completes the payload it received in place."""
    real = ctx.puts.close_writer

    def close_writer(into, complete):
        if complete:
            raise RuntimeError(_MESSAGE)
        return real(into, complete)

    ctx.puts.close_writer = close_writer


def _is_data(args) -> bool:
    return bytes(args[1]).upper() == b"DATA"


@pytest.mark.parametrize("case", ["set-handler", "set-publish", "mset-handler", "mset-publish-second",
                                  "put2phase-data-handler", "put2phase-data-close-writer"])
@pytest.mark.parametrize("chunk", [None, 5000], ids=["one-read", "in-pieces"])
def test_a_failing_handler_gives_back_its_reservation_and_keeps_the_connection(case, chunk, caplog):
    ctx, conn, t = connect(make_context(pages=1024))  # 4 MiB arena
    ks, puts = ctx.keyspace, ctx.puts
    value = bytes(range(256)) * (LARGE // 256)
    handle = None
    if case.startswith("put2phase"):
        feed(conn, _cmd("PUT2PHASE", "BEGIN", "blk", LARGE))
        handle = bytes(t.out)[bytes(t.out).index(b"\r\n") + 2:-2]
        t.out.clear()
    used = ks.used  # what is legitimately held before the failing command (the open put)
    {"set-handler": lambda: _fail_in_handler(ctx, "set"),
     "set-publish": lambda: _fail_publish(ctx),
     "mset-handler": lambda: _fail_in_handler(ctx, "mset"),
     "mset-publish-second": lambda: _fail_publish(ctx, after=1),
     "put2phase-data-handler": lambda: _fail_in_handler(ctx, "put2phase", _is_data),
     "put2phase-data-close-writer": lambda: _fail_close_writer(ctx)}[case]()
    if case.startswith("set"):
        command = _cmd("SET", "secret-key", value)
    elif case.startswith("mset"):
        command = _cmd("MSET", "k1", value, "secret-key", value)
    else:
        command = _cmd("PUT2PHASE", "DATA", handle, 0, value)
    with caplog.at_level("ERROR", logger="quilld.protocol"):
        feed(conn, command + b"PING\r\n", chunk=chunk)
    name = case.split("-")[0]
    assert bytes(t.out) == (b"-ERR internal error running '%b' (logged by the server)\r\n+PONG\r\n"
                            % name.encode()), case
    assert not t.closed
    assert ks.reserved_blocks == (1 if handle else 0) and ks.active_pins == 0, case
    if case == "mset-publish-second":
        assert ks.keys_in(conn.session.tag) == 1  # k1 was stored before the second publish failed
    else:
        assert ks.used == used, f"{case}: {ks.used - used} arena bytes leaked"
        assert ks.keys_in(conn.session.tag) == 0
    if handle is not None:
        put = puts.open[handle]
        assert put.writers == 0 and put.received() == 0  # the failed DATA counts for nothing
        vars(puts).pop("close_writer", None)  # the injection ends
        t.out.clear()
        feed(conn, _cmd("PUT2PHASE", "ABORT", handle))
        assert bytes(t.out) == b"+OK\r\n"
    t.out.clear()
    feed(conn, b"FLUSHALL\r\n")
    assert ks.used == 0 and ks.reserved_blocks == 0, f"{case}: {ks.used} arena bytes leaked"
    # logged once, with the command's name and a traceback, never its arguments
    records = [r for r in caplog.records if "raised RuntimeError" in r.getMessage()]
    assert len(records) == 1 and records[0].levelname == "ERROR"
    assert f"command '{name}'" in records[0].getMessage() and "Traceback" not in records[0].getMessage()
    assert _MESSAGE not in caplog.text and "secret-key" not in caplog.text
    assert ctx.stats["internal_errors"] == 1
    t.out.clear()
    feed(conn, b"PING\r\n")
    assert bytes(t.out) == b"+PONG\r\n"


def test_the_same_failure_is_logged_with_its_traceback_once(caplog):
    ctx, conn, t = connect()
    _fail_in_handler(ctx, "echo")
    with caplog.at_level("ERROR", logger="quilld.protocol"):
        feed(conn, b"ECHO a\r\n" * 5)
    assert bytes(t.out) == b"-ERR internal error running 'echo' (logged by the server)\r\n" * 5
    assert len(caplog.records) == 1
    assert "in failing" in caplog.records[0].getMessage()  # the frame where it was raised
    assert ctx.stats["internal_errors"] == 5


def test_a_reply_that_cannot_be_encoded_releases_its_pins():
    ctx, conn, t = connect(make_context(pages=1024))
    value = b"v" * LARGE
    feed(conn, _cmd("SET", "big", value))
    ks = ctx.keyspace

    def half_encodable(c, args):
        pinned = ks.get(c.tag, b"big")  # a Pinned view of the block
        return [pinned, object()]  # the second item cannot be encoded

    ctx.table.add("badreply", 1, "", half_encodable)
    t.out.clear()
    t.buffered = 1  # would keep pins until drained, if any were kept
    feed(conn, b"BADREPLY\r\nPING\r\n")
    assert bytes(t.out) == b"-ERR internal error running 'badreply' (logged by the server)\r\n+PONG\r\n"
    assert ks.active_pins == 0 and not conn.has_pins


def test_a_deferred_reply_that_fails_is_answered_and_the_pipeline_goes_on():
    async def main():
        ctx, conn, t = connect()

        async def broken():
            await asyncio.sleep(0)
            raise KeyError("injected")

        ctx.table.add("later", 1, "", lambda c, a: Pending(broken()))
        feed(conn, b"LATER\r\nPING\r\n")
        for _ in range(200):
            await asyncio.sleep(0.001)
            if b"PONG" in t.out:
                break
        assert bytes(t.out) == b"-ERR internal error running 'later' (logged by the server)\r\n+PONG\r\n"
        assert not t.closed and not t.paused

    asyncio.run(main())


# -- memory for an argument grows with the bytes that arrive (issue 11, finding 2) ------------

def test_a_bulk_header_alone_allocates_nothing():
    """`$536870912` with no payload used to allocate (and zero-fill) 512 MiB at once."""
    _, conn, t = connect()
    feed(conn, b"*2\r\n$4\r\nECHO\r\n$536870912\r\n")
    assert conn.parser.query_bytes() < 1024 and len(conn.parser._buf) < 1024
    feed(conn, b"x" * 100_000)
    assert 100_000 <= conn.parser.query_bytes() < 101_000  # what arrived, not what was announced
    assert bytes(t.out) == b"" and not t.closed


def test_a_long_ordinary_argument_arrives_whole_and_the_buffer_shrinks_after():
    _, conn, t = connect()
    payload = bytes(range(256)) * 4096  # 1 MiB: a large bulk that is not a value
    feed(conn, _cmd("ECHO", payload) + b"PING\r\n", chunk=65536)
    assert bytes(t.out) == b"$%d\r\n" % len(payload) + payload + b"\r\n+PONG\r\n"
    assert conn.parser.query_bytes() == 0 and len(conn.parser._buf) < 65536


def test_a_long_command_name_is_an_unknown_command():
    _, conn, t = connect()
    feed(conn, _cmd(b"A" * 20000, b"x") + b"PING\r\n")
    assert bytes(t.out) == (b"-ERR unknown command '" + b"A" * 128 + b"', with args beginning with: 'x' \r\n"
                            b"+PONG\r\n")


def test_a_client_over_the_query_buffer_limit_is_closed_without_a_reply(caplog):
    ctx, conn, t = connect(make_context(client_query_buffer_limit=1 << 20))
    feed(conn, b"PING\r\n*2\r\n$4\r\nECHO\r\n$3000000\r\n")
    with caplog.at_level("WARNING", logger="quilld.protocol"):
        feed(conn, b"x" * (1 << 20), chunk=65536)
    assert bytes(t.out) == b"+PONG\r\n" and t.closed
    assert ctx.clients.stats["client_query_buffer_limit_disconnections"] == 1
    assert "max query buffer length" in caplog.text and "qbuf initial bytes: b'xxxx" in caplog.text
    # arguments already parsed count too: many small ones
    ctx, conn, t = connect(make_context(client_query_buffer_limit=1 << 20))
    feed(conn, b"*100000\r\n" + b"$100\r\n" + b"y" * 100 + b"\r\n" * 1)
    feed(conn, (b"$100\r\n" + b"y" * 100 + b"\r\n") * 10000, chunk=65536)
    assert t.closed and bytes(t.out) == b""
    # values received into the arena do not count: a 2 MiB SET is fine under a 1 MiB limit
    ctx, conn, t = connect(make_context(pages=2048, client_query_buffer_limit=1 << 20))
    feed(conn, _cmd("SET", "k", b"z" * (2 << 20)), chunk=65536)
    assert bytes(t.out) == b"+OK\r\n" and not t.closed
