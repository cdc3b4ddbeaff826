"""PUT2PHASE PUT key CRC32C crc bytes: BEGIN, DATA and COMMIT of a whole block in one command
(quillclient's put_blocks sends one per block over TCP, pipelined on one socket)."""

from __future__ import annotations

import os
import socket

import crc32c
import pytest
import redis
from conftest import wait_until


pytestmark = pytest.mark.shared_node  # one quilld for the module, emptied before each test


def _put(r, key, data, crc=None):
    return r.execute_command("PUT2PHASE", "PUT", key, "CRC32C", crc32c.crc32c(data) if crc is None else crc, data)


def _reserved(r) -> int:
    return r.info().get("dram_reserved_blocks", 0)


@pytest.mark.parametrize("size", [0, 10, 20_000, 300_000])  # empty, inline, a received large bulk, an arena block
def test_put_stores_the_block_whole(quilld, size):
    r = redis.Redis(port=quilld.port)
    data = os.urandom(size)
    assert _put(r, f"w:{size}", data) == b"OK"
    assert r.get(f"w:{size}") == data
    assert _reserved(r) == 0


@pytest.mark.parametrize("size", [10, 300_000])
def test_a_wrong_crc_stores_nothing(quilld, size):
    r = redis.Redis(port=quilld.port)
    data = os.urandom(size)
    with pytest.raises(redis.ResponseError, match="CHECKSUM"):
        _put(r, f"bad:{size}", data, crc=crc32c.crc32c(data) ^ 1)
    assert r.exists(f"bad:{size}") == 0
    assert _reserved(r) == 0


@pytest.mark.parametrize("size", [10, 300_000])
def test_a_complete_key_answers_exists_and_keeps_its_value(quilld, size):
    r = redis.Redis(port=quilld.port)
    r.set(f"kept:{size}", b"kept")
    assert _put(r, f"kept:{size}", os.urandom(size)) == b"EXISTS"
    assert r.get(f"kept:{size}") == b"kept"
    assert _reserved(r) == 0


def test_malformed_puts_are_refused(quilld):
    r = redis.Redis(port=quilld.port)
    with pytest.raises(redis.ResponseError, match="syntax"):
        r.execute_command("PUT2PHASE", "PUT", "m:a", "CRC", 1, b"x")
    with pytest.raises(redis.ResponseError, match="wrong number"):
        r.execute_command("PUT2PHASE", "PUT", "m:a", "CRC32C", 1)
    with pytest.raises(redis.ResponseError, match="unsigned 32-bit"):
        r.execute_command("PUT2PHASE", "PUT", "m:a", "CRC32C", 1 << 32, b"x" * 100_000)
    assert r.exists("m:a") == 0
    assert _reserved(r) == 0


def test_a_connection_lost_mid_payload_publishes_nothing_and_frees_the_block(quilld):
    r = redis.Redis(port=quilld.port)
    s = socket.create_connection(("127.0.0.1", quilld.port))
    s.sendall(b"*6\r\n$9\r\nPUT2PHASE\r\n$3\r\nPUT\r\n$6\r\ncut:me\r\n$6\r\nCRC32C\r\n$1\r\n0\r\n$500000\r\n"
              + b"x" * 100_000)
    s.close()
    wait_until(lambda: _reserved(r) == 0, timeout=10)
    assert r.exists("cut:me") == 0
    assert _reserved(r) == 0


def test_put_blocks_over_tcp_stores_skips_and_refuses_as_before(quilld):
    from quillclient import QuillClient

    with QuillClient("127.0.0.1", quilld.port, shared_memory="off") as qc:
        qc.put("pb:old", b"old value")
        blocks = {f"pb:{i}": os.urandom(n) for i, n in enumerate([0, 5, 70_000, 1 << 20, 3_000])}
        assert qc.put_blocks({"pb:old": os.urandom(1000), **blocks}) == [False] + [True] * len(blocks)
        assert qc.get("pb:old") == b"old value"
        assert all(qc.get(k) == v for k, v in blocks.items())
        # more puts than one send window (128): every reply read in order
        many = {f"pbm:{i}": os.urandom(100 + i) for i in range(300)}
        assert qc.put_blocks(many) == [True] * 300
        assert all(qc.get(k) == v for k, v in many.items())
        info = qc.execute("INFO")
        assert info.get("put2phase_open", 0) == 0 and info.get("dram_reserved_blocks", 0) == 0


def test_data_with_a_crc_commits_the_put(quilld):
    r = redis.Redis(port=quilld.port)
    for size in (10, 300_000):
        data = os.urandom(size)
        h = r.execute_command("PUT2PHASE", "BEGIN", f"dc:{size}", size)
        assert r.execute_command("PUT2PHASE", "DATA", h, 0, data, "CRC32C", crc32c.crc32c(data)) == b"OK"
        assert r.get(f"dc:{size}") == data
        with pytest.raises(redis.ResponseError, match="NOHANDLE"):  # committed: the handle is gone
            r.execute_command("PUT2PHASE", "COMMIT", h)


def test_data_with_a_wrong_crc_leaves_the_put_open_and_unpublished(quilld):
    r = redis.Redis(port=quilld.port)
    data = os.urandom(300_000)
    h = r.execute_command("PUT2PHASE", "BEGIN", "dc:bad", len(data))
    with pytest.raises(redis.ResponseError, match="CHECKSUM"):
        r.execute_command("PUT2PHASE", "DATA", h, 0, data, "CRC32C", crc32c.crc32c(data) ^ 1)
    assert r.exists("dc:bad") == 0
    with pytest.raises(redis.ResponseError, match="INCOMPLETE"):  # half the bytes, then a commit
        h2 = r.execute_command("PUT2PHASE", "BEGIN", "dc:half", 20)
        r.execute_command("PUT2PHASE", "DATA", h2, 0, b"x" * 10, "CRC32C", 0)
    with pytest.raises(redis.ResponseError, match="syntax"):
        r.execute_command("PUT2PHASE", "DATA", h, 0, data, "CRC", 1)
    assert r.execute_command("PUT2PHASE", "COMMIT", h, "CRC32C", crc32c.crc32c(data)) == b"OK"  # still open
    assert r.get("dc:bad") == data
    assert r.execute_command("PUT2PHASE", "ABORT", h2) == b"OK"
    assert _reserved(r) == 0


def test_put_blocks_of_a_round_over_chunk_size_stores_every_block(quilld):
    from quillclient import QuillClient

    with QuillClient("127.0.0.1", quilld.port, shared_memory="off", chunk_size=100_000) as qc:
        qc.put("big:old", b"old")
        blocks = {f"big:{i}": os.urandom(n) for i, n in enumerate([0, 90_000, 100_000, 250_000, 7])}
        assert qc.put_blocks({"big:old": os.urandom(5), **blocks}) == [False] + [True] * len(blocks)
        assert qc.get("big:old") == b"old" and all(qc.get(k) == v for k, v in blocks.items())
        info = qc.execute("INFO")
        assert info.get("put2phase_open", 0) == 0 and info.get("dram_reserved_blocks", 0) == 0
