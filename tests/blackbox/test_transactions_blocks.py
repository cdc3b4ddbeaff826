"""Transactions and what only quilld has (issue 25): the block commands inside MULTI, identity
scopes, the SSD tier under a watched key and under an EXEC, a node that requires a scope.

What is decided (README, "Transactions"): PUT2PHASE PUT, GETBLK, LOCATE and ROUTE are queued and
run by EXEC like any command; PUT2PHASE BEGIN, DATA, COMMIT and ABORT, SHM and the cluster's peer
commands are refused while queueing (the EXEC then aborts). SCOPE inside MULTI is queued and
applies from the next command, as SELECT does in redis. A demotion to SSD (or a promotion back)
changes no value: WATCH does not count it. An EXEC whose command reads the SSD holds the node.
"""

from __future__ import annotations

import random

import crc32c
import pytest
import redis

from conftest import spill_to_ssd, ssd_node, stop_process, tiers_of

KiB = 1024


def _refused_while_queueing(r, *cmd) -> str:
    with pytest.raises(redis.ResponseError) as e:
        r.execute_command(*cmd)
    with pytest.raises(redis.ResponseError, match="EXECABORT|discarded because of previous errors"):
        r.execute_command("EXEC")
    return str(e.value)


def test_block_commands_inside_a_transaction(quilld):
    r = quilld.client()
    small, big = b"s" * 100, random.Random(7).randbytes(300 * KiB)
    with r.pipeline() as p:  # PUT2PHASE PUT (a whole block, the large one received into the arena), reads
        p.execute_command("PUT2PHASE", "PUT", "blk", "CRC32C", crc32c.crc32c(big), big)
        p.execute_command("PUT2PHASE", "PUT", "small", "CRC32C", crc32c.crc32c(small), small)
        p.execute_command("GETBLK", "blk", "LOCAL")
        p.execute_command("LOCATE", "blk", "nokey")
        p.execute_command("GETBLK", "nokey")
        put, put_small, got, places, missing = p.execute()
    assert (put, put_small, got, missing) == (b"OK", b"OK", big, None)
    assert [[place[b"tier"] if isinstance(place, dict) else dict(zip(place[::2], place[1::2]))[b"tier"]
             for place in key] for key in places] == [[b"dram"], []]
    route_alone = r.execute_command("ROUTE", "HASHES", "1", "2")
    with r.pipeline() as p:
        p.execute_command("ROUTE", "HASHES", "1", "2")
        assert p.execute() == [route_alone]

    r.execute_command("MULTI")
    text = _refused_while_queueing(r, "PUT2PHASE", "BEGIN", "k", "10")
    assert text.startswith("Command not allowed inside a transaction: PUT2PHASE BEGIN, DATA, COMMIT and ABORT")
    for cmd in (("SHM", "HELLO"), ("SHM", "GET", "blk"), ("PEERGET", "t", "m", "k", "a", "blk"),
                ("DIR", "x", "")):
        r.execute_command("MULTI")
        assert _refused_while_queueing(r, *cmd) == "Command not allowed inside a transaction"
    assert r.exists("k") == 0


def test_a_scope_watched_in_and_scope_inside_multi(quilld):
    a, b = quilld.client(), quilld.client()
    a.execute_command("SCOPE", "llama", "tok")
    with a.pipeline() as p:
        p.watch("k")
        b.set("k", "default scope")  # the same name in another scope: another key
        p.multi()
        p.set("k", "llama")
        assert p.execute() == [True]
    with a.pipeline() as p:  # SCOPE inside MULTI applies from the next command, as SELECT does
        p.execute_command("SCOPE", "mistral", "tok")
        p.set("k", "mistral")
        p.get("k")
        assert p.execute() == [b"OK", True, b"mistral"]
    assert a.get("k") == b"mistral"
    a.execute_command("SCOPE", "llama", "tok")
    assert (a.get("k"), b.get("k")) == (b"llama", b"default scope")


def test_a_node_that_requires_a_scope(quilld_factory):
    q = quilld_factory("--dram", "64MiB", env={"QUILLD_SECURITY_REQUIRE_SCOPE": "true"})
    r = q.client()
    with pytest.raises(redis.ResponseError, match="no identity scope"):
        r.execute_command("WATCH", "k")  # NOSCOPE: watching is reading
    with r.pipeline() as p:  # queued, then refused when the EXEC runs it (a runtime error)
        p.set("k", "v")
        p.get("k")
        replies = p.execute(raise_on_error=False)
    assert all(isinstance(x, redis.ResponseError) and "no identity scope" in str(x) for x in replies)
    with r.pipeline() as p:
        p.execute_command("SCOPE", "m", "t")
        p.set("k", "v")
        p.get("k")
        assert p.execute() == [b"OK", True, b"v"]


def test_info_counts_watching_clients_and_their_keys(quilld):
    a, b = quilld.client(), quilld.client()
    a.execute_command("WATCH", "x", "y", "z")
    b.execute_command("WATCH", "x")
    info = b.info("clients")
    assert (info["watching_clients"], info["total_watched_keys"]) == (2, 3)  # distinct keys, as redis 7.4
    a.set("x", 1)  # touches both: each watches nothing more
    info = b.info("clients")
    assert (info["watching_clients"], info["total_watched_keys"]) == (0, 0)


def test_a_demotion_to_ssd_is_no_change_and_an_exec_reading_the_ssd_holds_the_node(tmp_path):
    q = ssd_node(tmp_path, tmp_path / "ssd")
    try:
        a, b = redis.Redis(port=q.port, socket_timeout=30), redis.Redis(port=q.port, socket_timeout=30)
        value = {f"c{i}": random.Random(i).randbytes(256 * KiB) for i in range(120)}
        first, later = list(value)[:40], list(value)[40:]
        spill_to_ssd(b, {k: value[k] for k in first}, [])
        assert "dram" in tiers_of(b, "c39")
        with a.pipeline() as p:
            p.watch("c39")  # in DRAM now; the writes below push it down to SSD, its value unchanged
            spill_to_ssd(b, {k: value[k] for k in later}, ["c39"])
            p.multi()
            p.get("c39")  # on SSD only: the EXEC waits for the disk, holding the node meanwhile
            p.get("c119")
            p.strlen("c39")
            assert p.execute() == [value["c39"], value["c119"], 256 * KiB]  # not a WatchError
        assert b.info("stats")["exec_holds"] >= 1
        with a.pipeline() as p:  # a read that brings a value back from SSD is no change either
            p.watch("c0")
            assert tiers_of(b, "c0") == {"ssd"}
            assert b.get("c0") == value["c0"]
            p.multi()
            p.ping()
            assert p.execute() == [True]
    finally:
        stop_process(q.proc)


def test_a_queue_holds_at_most_client_query_buffer_limit_bytes(quilld):
    r = quilld.client()
    r.config_set("client-query-buffer-limit", "1mb")
    r.execute_command("MULTI")
    arg = b"e" * 15_000  # under LARGE_BULK: held by the queue itself, not received into the arena
    refused = None
    for i in range(100):
        try:
            assert r.execute_command("ECHO", arg) == b"QUEUED"
        except redis.ResponseError as e:
            refused = (i, str(e))
            break
    assert refused is not None and 60 <= refused[0] <= 70, refused
    assert "would hold more than 1048576 bytes (client-query-buffer-limit)" in refused[1]
    with pytest.raises(redis.ResponseError, match="discarded because of previous errors"):
        r.execute_command("EXEC")
    assert r.ping()
