"""Replies held while a client streams pipelined commands are never held past the input.

quilld holds the small replies of a pipelined stream while reads keep filling its receive
buffer (protocol/server.py), and writes them together once the input runs dry or the loop
is about to wait for I/O. A stream that stops exactly at a buffer boundary, in the middle
of a command, must still get every reply it is owed before it sends the rest: a client may
wait for them before it goes on (with the replies held, it would wait forever).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from conftest import cmd, wait_until

# quilld's receive buffer, and what it reads right after a large payload
from quilld.protocol.server import AFTER_LARGE_READ, RECV_BUFFER

pytestmark = pytest.mark.timeout(60)



def read_replies(s: socket.socket, count: int, timeout: float = 20.0) -> bytes:
    """Read until `count` simple replies (CRLF-terminated lines) have come, within `timeout`."""
    got = bytearray()
    deadline = time.monotonic() + timeout
    while got.count(b"\r\n") < count:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = s.recv(1 << 20)
        except socket.timeout:
            lines = got.count(b"\r\n")
            raise AssertionError(f"{lines} of {count} replies within {timeout} s") from None
        assert chunk, "closed by the server"
        got += chunk
    return bytes(got)


def small_commands_then_a_cut(size: int) -> tuple[bytes, bytes, int]:
    """(SETs then the head of one more SET, exactly `size` bytes; that SET's rest; the complete
    commands in the first part)."""
    tail = cmd("SET", "last", "x" * 1000)
    cut = tail[:40]
    body, n = bytearray(), 0
    while len(body) + len(cut) < size - 200:
        body += cmd("SET", f"k{n:06d}", "v" * 90)
        n += 1
    pad = size - len(body) - len(cut) - len(cmd("SET", "pad", ""))
    body += cmd("SET", "pad", "p" * (pad - (len(str(pad)) - 1)))
    n += 1
    assert len(body) + len(cut) == size, (len(body) + len(cut), size)
    return bytes(body) + cut, tail[40:], n


def test_a_stream_stopping_mid_command_right_after_a_large_payload_gets_its_replies(quilld, redis_server):
    """After a large payload quilld reads 8 KiB (AFTER_LARGE_READ); a read that fills it exactly
    holds the replies, and here nothing more comes until they are answered."""
    payload = os.urandom(256 * 1024)
    header = b"*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n$%d\r\n" % len(payload)
    after, rest, n = small_commands_then_a_cut(AFTER_LARGE_READ - 2)  # the payload's CRLF comes first
    seen = {}
    for name, port in (("quilld", quilld.port), ("redis", redis_server)):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(header)
            if name == "quilld":  # the payload then goes straight into the arena, read by read
                r = quilld.client()
                assert wait_until(lambda: r.info("tiers")["dram_unfilled_bytes"] >= len(payload), timeout=10)
            s.sendall(payload + b"\r\n" + after)
            first = read_replies(s, n + 1)  # owed before the rest is sent
            s.sendall(rest)
            seen[name] = first + read_replies(s, 1)
    assert seen["quilld"] == seen["redis"] == b"+OK\r\n" * (n + 2)


@pytest.mark.parametrize("buffers", [1, 3])
def test_a_stream_stopping_mid_command_at_a_buffer_boundary_gets_its_replies(quilld, redis_server, buffers):
    head, rest, n = small_commands_then_a_cut(buffers * RECV_BUFFER)
    seen = {}
    for name, port in (("quilld", quilld.port), ("redis", redis_server)):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(head)
            first = read_replies(s, n)  # owed before the rest is sent
            s.sendall(rest)
            seen[name] = first + read_replies(s, 1)
    assert seen["quilld"] == seen["redis"] == b"+OK\r\n" * (n + 1)


def test_pipelined_large_puts_are_all_answered_in_order(quilld):
    blocks = [os.urandom(64 * 1024) for _ in range(16)]
    stream = b"".join(cmd("SET", f"b{i}", b) for i, b in enumerate(blocks)) + cmd("GET", "b15")
    with socket.create_connection(("127.0.0.1", quilld.port), timeout=20) as s:
        s.sendall(stream)
        want = b"+OK\r\n" * 16 + b"$%d\r\n%b\r\n" % (len(blocks[15]), blocks[15])
        got = bytearray()
        deadline = time.monotonic() + 20
        while len(got) < len(want) and time.monotonic() < deadline:
            chunk = s.recv(1 << 20)
            assert chunk, "closed by the server"
            got += chunk
    assert bytes(got) == want
