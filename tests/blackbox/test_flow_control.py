"""Pins and flow control: a block being sent is never freed under its reader, and a
put that needs that space waits for it instead of failing."""

from __future__ import annotations

import os
import socket
import threading
import time

from quillwire.encode import encode_command

from conftest import wait_held

MiB = 1 << 20


def _read_exactly(sock: socket.socket, n: int, timeout: float = 30.0) -> bytes:
    buf = bytearray()
    deadline = time.monotonic() + timeout
    while len(buf) < n and time.monotonic() < deadline:
        chunk = sock.recv(min(4 * MiB, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def test_slow_reader_keeps_its_block_and_a_put_waits_for_the_space(quilld_factory):
    q = quilld_factory("--dram", "64MiB")
    r = q.client(protocol=2)
    old = os.urandom(40 * MiB)
    assert r.set("big", old)

    slow = socket.create_connection(("127.0.0.1", q.port), timeout=30)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    slow.sendall(encode_command("GET", "big"))
    wait_held(r, 40 * MiB)  # the reply is now mostly sitting in quilld's write buffer, pinned
    assert r.delete("big") == 1
    tiers = r.info("tiers")
    assert tiers["dram_pinned_unlinked"] == 1

    new = os.urandom(40 * MiB)
    result: dict[str, object] = {}

    def put() -> None:
        try:
            result["reply"] = q.client(protocol=2).set("other", new)
        except Exception as e:  # reported below
            result["reply"] = e

    writer = threading.Thread(target=put)
    writer.start()
    time.sleep(0.5)
    assert "reply" not in result  # waiting for the pinned space, not refused

    header = b"$%d\r\n" % len(old)
    got = _read_exactly(slow, len(header) + len(old) + 2)
    slow.close()
    assert got == header + old + b"\r\n"  # the reader got the old bytes intact

    writer.join(20)
    assert result.get("reply") is True
    assert r.get("other") == new
    assert r.info("tiers")["dram_pinned_unlinked"] == 0


def test_a_put_that_cannot_fit_after_waiting_gets_oom(quilld_factory):
    q = quilld_factory("--dram", "64MiB", env={"QUILLD_SERVER_SPACE_WAIT_MS": "1500"})
    r = q.client(protocol=2)
    assert r.set("a", os.urandom(40 * MiB))
    slow = socket.create_connection(("127.0.0.1", q.port), timeout=30)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    slow.sendall(encode_command("GET", "a"))
    wait_held(r, 40 * MiB)  # "a" is pinned by its reply: the put below cannot evict it
    started = time.monotonic()
    try:
        r.set("b", os.urandom(40 * MiB))
        raised = None
    except Exception as e:
        raised = e
    waited = time.monotonic() - started
    slow.close()
    assert raised is not None and str(raised).startswith("command not allowed when used memory")
    assert waited >= 1.4  # it waited server.space_wait_ms for the pinned space before giving up
    assert r.ping()
    assert r.exists("b") == 0


def test_other_clients_are_served_while_one_does_not_read(quilld):
    r = quilld.client(protocol=2)
    assert r.set("big", os.urandom(32 * MiB))
    stalled = socket.create_connection(("127.0.0.1", quilld.port), timeout=30)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    stalled.sendall(encode_command("GET", "big") * 4)
    wait_held(r, 32 * MiB)  # its first reply is stuck in quilld's write buffer
    started = time.monotonic()
    for i in range(200):
        assert r.set(f"k{i}", "v")
    assert time.monotonic() - started < 10
    stalled.close()
