"""Byte-for-byte replies: the same commands sent to redis-server 7 and to quilld.

Each script runs on one raw connection to each server; the reply streams are
split into replies and compared one by one, in RESP2 and in RESP3.
"""

from __future__ import annotations

import socket
import time

import pytest

from conftest import same_reply
from quillwire.encode import encode_command

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module


# Replies that differ by nature (ids, versions, timings) are kept out of the scripts.
STRINGS = [
    ("PING",), ("PING", "hello"), ("ECHO", "x\r\ny"), ("SET", "k", "v"), ("GET", "k"), ("GET", "missing"),
    ("SET", "k", "v2", "NX"), ("SET", "k", "v3", "XX"), ("SET", "k", "v4", "XX", "GET"), ("SET", "n", "v", "XX"),
    ("SET", "n", "v", "NX", "GET"), ("SET", "n", "v", "NX", "XX"), ("SET", "k", "v", "EX", "0"),
    ("SET", "k", "v", "EX", "abc"), ("SET", "k", "v", "EX", "10", "PX", "10"), ("SET", "k", "v", "FOO"),
    ("SET", "k", "v", "KEEPTTL", "EX", "5"), ("SET", "k", "v", "PX", "-1"), ("SET", "k", "v", "EX", "007"),
    ("SET", "t", "v", "EX", "100"), ("TTL", "t"), ("TTL", "k"), ("TTL", "missing"), ("PTTL", "missing"),
    ("PTTL", "k"), ("SET", "t", "w", "KEEPTTL"), ("TTL", "t"), ("SET", "t", "w"), ("TTL", "t"),
    ("MSET", "a", "1", "b", "2"), ("MSET", "a"), ("MSET", "a", "1", "b"), ("MGET", "a", "b", "c"),
    ("EXISTS", "a", "b", "c", "a"), ("STRLEN", "k"), ("STRLEN", "missing"), ("TYPE", "k"), ("TYPE", "missing"),
    ("DEL", "a", "b", "c"), ("UNLINK", "k"), ("EXISTS", "k"), ("DBSIZE",), ("FLUSHALL",), ("DBSIZE",),
    ("FLUSHALL", "SYNC"), ("FLUSHALL", "NOW"),
]
CONNECTION = [
    ("SELECT", "0"), ("SELECT", "1"), ("SELECT", "x"), ("GET",), ("GET", "a", "b"), ("SET", "a"),
    ("FOO", "bar", "baz"), ("foo",), ("CLIENT", "SETNAME", "n1"), ("CLIENT", "GETNAME"),
    ("CLIENT", "SETNAME", "a b"), ("CLIENT", "FOO"), ("CLIENT",), ("CLIENT", "GETNAME", "x"),
    ("AUTH", "pw"), ("AUTH", "default", "anything"), ("AUTH", "nobody", "x"), ("AUTH", "a", "b", "c"),
    ("HELLO", "4"), ("HELLO", "x"), ("HELLO", "2", "FOO"), ("CONFIG", "GET", "save"),
    ("CONFIG", "GET", "appendonly"), ("CONFIG", "GET", "nosuchparam"), ("CONFIG",), ("PING", "a", "b"),
    ("ECHO",), ("QUIT",),
]


def _line_end(buf: bytes, pos: int) -> int:
    end = buf.index(b"\r\n", pos)
    return end


def split_replies(buf: bytes) -> list[bytes]:
    """Cut a stream of RESP2/RESP3 replies into one byte string per reply."""

    def skip(pos: int) -> int:
        kind = buf[pos:pos + 1]
        end = _line_end(buf, pos)
        if kind in (b"$", b"=", b"!"):
            n = int(buf[pos + 1:end])
            return end + 2 if n < 0 else end + 2 + n + 2
        if kind in (b"*", b"~", b">", b"%", b"|"):
            n = int(buf[pos + 1:end])
            pos = end + 2
            for _ in range(max(n, 0) * (2 if kind in (b"%", b"|") else 1)):
                pos = skip(pos)
            return pos
        return end + 2

    out, pos = [], 0
    while pos < len(buf):
        nxt = skip(pos)
        out.append(buf[pos:nxt])
        pos = nxt
    return out


def run_script(port: int, commands, resp3: bool) -> list[bytes]:
    payload = b"".join(encode_command(*c) for c in commands)
    if resp3:
        payload = encode_command("HELLO", "3") + payload
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        s.settimeout(0.5)
        chunks, deadline = [], time.monotonic() + 10
        expected = len(commands) + (1 if resp3 else 0)
        while time.monotonic() < deadline:
            try:
                data = s.recv(65536)
            except socket.timeout:
                data = None
            if data:
                chunks.append(data)
            try:
                if len(split_replies(b"".join(chunks))) >= expected:
                    break
            except (ValueError, IndexError):
                pass  # a reply cut in the middle: read on
            if data == b"":
                break
    replies = split_replies(b"".join(chunks))
    return replies[1:] if resp3 else replies


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
@pytest.mark.parametrize("script", [STRINGS, CONNECTION], ids=["strings", "connection"])
def test_replies_match_redis_byte_for_byte(quilld, redis_server, script, resp3):
    theirs = run_script(redis_server, script, resp3)
    ours = run_script(quilld.port, script, resp3)
    assert len(theirs) == len(script), theirs
    for cmd, t, o in zip(script, theirs, ours):
        assert same_reply(cmd, o, t), f"{cmd}: redis answered {t!r}, quilld {o!r}"
    assert len(ours) == len(theirs)


INLINE = b'PING\r\nSET a "b c"\r\nGET a\r\nECHO \'x y\'\r\n\r\nEXISTS a nope\r\nDEL a\r\n'


def test_inline_commands_match_redis(quilld, redis_server):
    from conftest import raw_exchange

    assert raw_exchange(quilld.port, INLINE) == raw_exchange(redis_server, INLINE)


@pytest.mark.parametrize("payload", [
    b"*1\r\n$-1\r\n",
    b"*abc\r\n",
    b"*2\r\n$3\r\nGET\r\n+OK\r\n",
    b'SET a "unbalanced\r\n',
    b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$600000000\r\n",
    b"x" * (70 * 1024),
])
def test_protocol_errors_match_redis_and_close(quilld, redis_server, payload):
    from conftest import raw_exchange

    theirs = raw_exchange(redis_server, payload, expect_close=True)
    ours = raw_exchange(quilld.port, payload, expect_close=True)
    assert ours == theirs
    assert quilld.client().ping()
