"""PUT2PHASE BEGIN ... HANDLE h: a handle the client chose, so BEGIN, DATA and COMMIT can go in
one pipeline (for clients that want it; quillclient's put_blocks now sends PUT2PHASE PUT per
block instead, see test_put_whole.py)."""

from __future__ import annotations

import os

import crc32c
import pytest
import redis


H1, H2 = "0123456789abcdef0123456789abcdef", "fedcba9876543210"


pytestmark = pytest.mark.shared_node  # one quilld for the module, emptied before each test


def test_begin_data_commit_in_one_pipeline(quilld):
    r = redis.Redis(port=quilld.port)
    data = os.urandom(200_000)
    p = r.pipeline(transaction=False)
    p.execute_command("PUT2PHASE", "BEGIN", "h:a", len(data), "HANDLE", H1)
    p.execute_command("PUT2PHASE", "DATA", H1, 0, data)
    p.execute_command("PUT2PHASE", "COMMIT", H1, "CRC32C", crc32c.crc32c(data))
    assert p.execute() == [H1.encode(), b"OK", b"OK"]
    assert r.get("h:a") == data


def test_a_complete_key_answers_exists_and_its_data_finds_no_handle(quilld):
    r = redis.Redis(port=quilld.port)
    r.set("h:b", b"kept")
    p = r.pipeline(transaction=False)
    p.execute_command("PUT2PHASE", "BEGIN", "h:b", 70_000, "HANDLE", H2)
    p.execute_command("PUT2PHASE", "DATA", H2, 0, b"x" * 70_000)  # read and dropped
    p.execute_command("PUT2PHASE", "COMMIT", H2)
    begun, data, committed = p.execute(raise_on_error=False)
    assert begun == b"EXISTS"
    assert str(data).startswith("NOHANDLE") and str(committed).startswith("NOHANDLE")
    assert r.get("h:b") == b"kept"
    assert r.info().get("dram_reserved_blocks", 0) == 0


def test_a_handle_in_use_or_malformed_is_refused(quilld):
    r = redis.Redis(port=quilld.port)
    assert r.execute_command("PUT2PHASE", "BEGIN", "h:c", 10, "HANDLE", H2) == H2.encode()
    with pytest.raises(redis.ResponseError, match="in use"):
        r.execute_command("PUT2PHASE", "BEGIN", "h:d", 10, "HANDLE", H2)
    for bad in ("short", "0123456789ABCDEF", "g" * 16, "a" * 65):
        with pytest.raises(redis.ResponseError, match="HANDLE must be"):
            r.execute_command("PUT2PHASE", "BEGIN", "h:e", 10, "HANDLE", bad)
    assert r.execute_command("PUT2PHASE", "ABORT", H2) in (b"OK", 1)


def test_put_blocks_skips_complete_keys_in_its_one_round_trip(quilld):
    from quillclient import QuillClient

    with QuillClient("127.0.0.1", quilld.port, shared_memory="off") as qc:
        qc.put("h:old", b"old value")
        new = os.urandom(300_000)
        assert qc.put_blocks({"h:old": os.urandom(1000), "h:new": new, "h:empty": b""}) == [False, True, True]
        assert qc.get("h:old") == b"old value" and qc.get("h:new") == new and qc.get("h:empty") == b""
        info = qc.execute("INFO")
        assert info.get("put2phase_open", 0) == 0
