"""DUMP and RESTORE against redis-server 7.0.15 (issue 18.12): the same payloads byte for
byte, and a DUMP of either server restores into the other."""

from __future__ import annotations

import os
import random

import pytest
import redis

from quilld.protocol.commands.rdb_payload import BadPayload, check, crc64, load, lzf_decompress
from conftest import wait_until
from test_compat import run_script

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module

rng = random.Random(18)
VALUES = [b"", b"0", b"1", b"-1", b"127", b"128", b"-128", b"-129", b"32767", b"32768", b"-32768", b"-32769",
          b"2147483647", b"2147483648", b"-2147483648", b"-2147483649", b"9223372036854775807",
          b"9223372036854775808", b"-9223372036854775808", b"007", b"-0", b"+1", b" 1", b"1 ", b"12345678901",
          b"hello", b"x" * 20, b"\x00\xff" * 10, rng.randbytes(21), rng.randbytes(63), rng.randbytes(64),
          rng.randbytes(16383), rng.randbytes(16384), rng.randbytes(70_000)]  # random bytes: LZF cannot shrink them


def test_crc64_is_redis_crc64_jones():
    assert crc64(b"123456789") == 0xe9c6d914c4b8d9ca  # redis's crc64.c test vector


def test_dump_payloads_are_redis_payloads_byte_for_byte(quilld, redis_server):
    script = [("SET", f"k{i}", v) for i, v in enumerate(VALUES)] + [("DUMP", f"k{i}") for i in range(len(VALUES))]
    script += [("DUMP", "missing"), ("DUMP",), ("DUMP", "a", "b")]
    for resp3 in (False, True):
        theirs, ours = run_script(redis_server, script, resp3), run_script(quilld.port, script, resp3)
        assert len(theirs) == len(script)
        for cmd, t, o in zip(script, theirs, ours):
            assert o == t, f"{cmd[:2]}: redis answered {t[:80]!r}, quilld {o[:80]!r}"


def test_compressible_values_match_redis_without_rdbcompression(quilld, redis_server):
    """redis LZF-compresses strings over 20 bytes when it saves 4 bytes; quilld writes them as
    redis does with rdbcompression no (and reads both: see the next test)."""
    r = redis.Redis(port=redis_server)
    q = quilld.client()
    r.config_set("rdbcompression", "no")
    try:
        for v in (b"a" * 21, b"abc" * 1000, b"x" * (1 << 20)):
            r.set("c", v)
            q.set("c", v)
            assert q.dump("c") == r.dump("c")
    finally:
        r.config_set("rdbcompression", "yes")


@pytest.mark.parametrize("value", [b"a" * 21, b"abcdefgh" * 5000, bytes(range(256)) * 4096, b"42", b"hello"])
def test_a_dump_of_either_server_restores_into_the_other(quilld, redis_server, value):
    r, q = redis.Redis(port=redis_server), quilld.client()
    r.set("src", value)
    q.set("src", value)
    from_redis, from_quilld = r.dump("src"), q.dump("src")
    assert q.restore("copy", 0, from_redis) and q.get("copy") == value
    assert r.restore("copy", 0, from_quilld) and r.get("copy") == value
    assert q.restore("copy", 5000, from_quilld, replace=True) and 4000 < q.pttl("copy") <= 5000


def test_lzf_decompression_of_redis_payloads(redis_server):
    r = redis.Redis(port=redis_server)
    value = b"the quick brown fox " * 500 + os.urandom(100) + b"jumps " * 300
    r.set("z", value)
    payload = r.dump("z")
    assert payload[1] == 0xC3  # redis compressed it
    check(payload)
    assert load(payload) == value
    assert lzf_decompress(memoryview(b"\x02abc\x20\x02"), 6) == b"abcabc"  # a back reference over its own output
    with pytest.raises(BadPayload, match="Bad data format"):
        load(payload[:40] + payload[-10:])  # cut short


RESTORE_ERRORS = [
    ("SET", "k", "v"), ("DUMP", "k"),  # (the payload is pasted below)
    ("RESTORE", "k", "0", "PAYLOAD"), ("RESTORE", "new", "-1", "PAYLOAD"), ("RESTORE", "new", "x", "PAYLOAD"),
    ("RESTORE", "new", "0", "short"), ("RESTORE", "new", "0", "BADCRC"), ("RESTORE", "new", "0", "PAYLOAD", "FOO"),
    ("RESTORE", "new", "0", "PAYLOAD", "IDLETIME", "-1"), ("RESTORE", "new", "0", "PAYLOAD", "FREQ", "256"),
    ("RESTORE", "new", "0", "PAYLOAD", "IDLETIME", "1", "FREQ", "2"), ("RESTORE", "new", "0", "PAYLOAD", "IDLETIME"),
    ("RESTORE", "new", "0", "PAYLOAD", "FREQ", "x"), ("RESTORE", "new", "0", "NEWER"),
    ("RESTORE", "k", "0", "PAYLOAD", "REPLACE", "IDLETIME", "10"), ("GET", "k"),
    ("RESTORE", "k", "1", "PAYLOAD", "REPLACE", "ABSTTL"), ("EXISTS", "k"),  # expired long ago: deleted
    ("RESTORE", "gone", "1", "PAYLOAD", "ABSTTL"), ("EXISTS", "gone"),
    ("RESTORE", "t", "100000", "PAYLOAD", "FREQ", "5"), ("TTL", "t"),
    ("RESTORE", "u", "4102444800000", "PAYLOAD", "ABSTTL"), ("EXPIRETIME", "u"), ("RESTORE",), ("DUMP", "u"),
]


def _payloads(port: int) -> dict[str, bytes]:
    c = redis.Redis(port=port)
    c.set("k", "v")
    good = c.dump("k")
    newer = good[:-10] + b"\x0b\x00" + good[-8:]
    newer = newer[:-8] + crc64(newer[:-8]).to_bytes(8, "little")
    return {"PAYLOAD": good, "BADCRC": good[:-1] + bytes([good[-1] ^ 1]), "NEWER": newer}


@pytest.mark.parametrize("resp3", [False, True])
def test_restore_answers_as_redis(quilld, redis_server, resp3):
    payloads = _payloads(redis_server)
    script = [tuple(payloads.get(a, a) if isinstance(a, str) else a for a in cmd) for cmd in RESTORE_ERRORS]
    theirs, ours = run_script(redis_server, script, resp3), run_script(quilld.port, script, resp3)
    assert len(theirs) == len(script)
    for cmd, t, o in zip(RESTORE_ERRORS, theirs, ours):
        assert o == t or (cmd[0] == "TTL" and abs(int(o[1:-2]) - int(t[1:-2])) <= 1), \
            f"{cmd}: redis answered {t!r}, quilld {o!r}"


def test_a_payload_of_another_type_is_refused_with_its_type(quilld, redis_server):
    r, q = redis.Redis(port=redis_server), quilld.client()
    r.rpush("l", "a", "b")
    r.hset("h", "f", "v")
    for key, kind in (("l", "list"), ("h", "hash")):
        with pytest.raises(redis.ResponseError, match=f"the DUMP payload holds a {kind}: quilld stores strings only"):
            q.restore("x", 0, r.dump(key))
    assert q.exists("x") == 0


def test_a_large_value_dumps_from_the_arena(quilld, redis_server):
    value = os.urandom(8 << 20)
    r, q = redis.Redis(port=redis_server), quilld.client()
    q.set("big", value)
    r.set("big", value)
    payload = q.dump("big")
    assert payload == r.dump("big")
    assert q.restore("big2", 0, payload) and q.get("big2") == value
    assert wait_until(lambda: q.info("tiers")["dram_held_bytes"] == 0)  # the DUMP's pin was given back
