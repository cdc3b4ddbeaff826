"""DUMP and RESTORE against redis-server 7.0.15 (issue 18.12): the same payloads byte for
byte, and a DUMP of either server restores into the other."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import redis

from quilld.protocol.commands.rdb_payload import BadPayload, check, crc64, load, lzf_decompress
from conftest import spill_to_ssd, ssd_node, stop_process, tiers_of, wait_until
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
    # a relative TTL whose deadline passes 2^63 - 1 ms: redis's sum wraps, the key is never made (issue 29.14)
    ("RESTORE", "w", "9223372036854775807", "PAYLOAD"), ("EXISTS", "w"),
    ("RESTORE", "u", "9223372036854775807", "PAYLOAD", "REPLACE"), ("EXISTS", "u"),
    ("RESTORE", "w", "9223372036854000000", "PAYLOAD"), ("EXISTS", "w"),
    ("RESTORE", "a", "9223372036854775807", "PAYLOAD", "ABSTTL"), ("PEXPIRETIME", "a"),
    ("RESTORE", "w", "9223372036854775808", "PAYLOAD"), ("EXISTS", "w"),
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


def lzf_payload(byte: int, n: int) -> bytes:
    """The DUMP payload of `n` copies of `byte` as redis compresses it: one literal, then
    LZF back references of 264 bytes at distance 1, 3 bytes each (26.4 MB in 293 KiB)."""
    body = bytearray((0, byte))
    left = n - 1
    body += b"\xe0\xff\x00" * (left // 264)  # length 7 + 255 + 2, distance 1
    left %= 264
    if left >= 9:
        body += bytes((0xE0, left - 9, 0))
    elif left >= 3:
        body += bytes(((left - 2) << 5, 0))
    elif left:
        body += bytes((left - 1,)) + bytes((byte,)) * left
    raw = bytes((0, 0xC3, 0x80)) + len(body).to_bytes(4, "big") + b"\x80" + n.to_bytes(4, "big") + body
    raw += (10).to_bytes(2, "little")
    return raw + crc64(raw).to_bytes(8, "little")


def test_a_large_lzf_restore_does_not_stop_other_clients(quilld):
    """Issue 29.13: a 293 KiB payload expanding to 26.4 MB stopped every client for 8-14 s
    (LZF decoded in Python on the loop); redis-server takes 0.1-0.4 s."""
    payload = lzf_payload(ord("a"), 26_400_000)
    assert len(payload) < 300 * 1024
    a, b = quilld.client(socket_timeout=60), quilld.client(socket_timeout=60)
    b.set("probe", "x")
    done, took = threading.Event(), []

    def restore():
        start = time.monotonic()
        try:
            took.append(a.restore("big", 0, payload))
        finally:
            took.append(time.monotonic() - start)
            done.set()

    t = threading.Thread(target=restore)
    t.start()
    worst = 0.0
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        start = time.monotonic()
        assert b.get("probe") == b"x"
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.002)
    t.join(60)
    assert took[0] == b"OK" and took[1] < 3, took  # the restore itself: 40-90 ms here, 7-19 s before
    assert worst < 0.5, f"another client's GET waited {worst:.2f} s during the RESTORE"
    assert a.strlen("big") == 26_400_000
    assert a.getrange("big", 0, 9) == b"a" * 10 and a.getrange("big", 26_399_990, -1) == b"a" * 10
    assert set(a.dump("big")[6:20_000]) == {ord("a")}  # the bytes themselves: DUMP writes them raw


def test_an_lzf_restore_decodes_every_shape_of_stream(quilld, redis_server):
    """Literal runs, short and long references, overlapping ones, at every length around the
    inline limit and the worker-thread threshold, as redis-server compresses them."""
    r, q = redis.Redis(port=redis_server), quilld.client()
    rng = random.Random(29)
    for n in (21, 100, 4095, 4096, 4097, 70_000, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20):
        value = bytes(rng.choice(b"abcd") for _ in range(min(n, 5000))) * (n // 5000 + 1)
        value = b"ab" * (n // 2) + b"c" * (n % 2) if n < 1000 else value[:n - 40] + rng.randbytes(40)
        r.set("v", value)
        payload = r.dump("v")
        assert payload[1] == 0xC3, n
        assert q.restore("v", 0, payload, replace=True) and q.get("v") == value, n
    assert lzf_payload(ord("z"), 1000) != lzf_payload(ord("z"), 999)
    for n in (1, 2, 3, 9, 264, 265, 266, 273, 1000):
        assert q.restore("z", 0, lzf_payload(ord("z"), n), replace=True) and q.get("z") == b"z" * n, n


def test_a_size_beyond_the_value_limit_is_refused_before_any_work(quilld):
    """A payload declares its string's size before its data: beyond proto-max-bulk-len it is
    refused at once, whatever the data (issue 29.13), and no key is made."""
    q = quilld.client(socket_timeout=10)
    q.config_set("proto-max-bulk-len", str(1 << 20))
    try:
        big = lzf_payload(ord("a"), (1 << 20) + 1)
        with pytest.raises(redis.ResponseError, match=r"holds a string of 1048577 bytes, more than "
                                                      r"proto-max-bulk-len \(1048576\)"):
            q.restore("k", 0, big)
        start = time.monotonic()
        stream = lzf_payload(ord("a"), 1 << 20)[:-8]  # the same stream, declaring 2^40 - 1 bytes
        huge = stream[:7] + b"\x81" + ((1 << 40) - 1).to_bytes(8, "big") + stream[12:]
        huge += crc64(huge).to_bytes(8, "little")
        with pytest.raises(redis.ResponseError, match="more than proto-max-bulk-len"):
            q.restore("k", 0, huge)
        assert time.monotonic() - start < 2
        assert q.exists("k") == 0
        assert q.restore("k", 0, lzf_payload(ord("a"), 1 << 20)) and q.strlen("k") == 1 << 20  # at the limit
    finally:
        q.config_set("proto-max-bulk-len", str(512 << 20))


def test_an_absurd_restore_ttl_leaves_the_ssd_tier_demoting(tmp_path):
    """Issue 29.14: `RESTORE k 9223372036854775807 <payload>` made a key whose deadline (now +
    2^63 - 1 ms) no SSD record can hold: every demotion batch failed after it, DRAM filled and
    the clean stop exited 1. redis makes no key for it; nor does quilld now, and the tier demotes."""
    q = ssd_node(tmp_path, tmp_path / "ssd")
    try:
        r = q.client(socket_timeout=30)
        r.set("src", b"v" * 5000)
        payload = r.dump("src")
        assert r.restore("k", 9223372036854775807, payload) and r.exists("k") == 0
        assert r.restore("src", 9223372036854775807, payload, replace=True) and r.exists("src") == 0
        assert r.restore("far", 9223372036854775807, payload, absttl=True)  # the largest deadline there is
        assert r.pexpiretime("far") == 9223372036854775807
        values = {f"v{i}": os.urandom(256 * 1024) for i in range(48)}  # 12 MiB over an 8 MiB arena
        spill_to_ssd(r, values, ["v0", "v1", "v2"])
        assert wait_until(lambda: tiers_of(r, "far") == {"ssd"}, timeout=30)
        assert r.get("far") == b"v" * 5000 and r.pexpiretime("far") == 9223372036854775807
        assert r.get("v0") == values["v0"]
    finally:
        assert stop_process(q.proc) == 0, q.log()[-3000:]


def test_a_key_made_while_a_large_payload_decodes_is_busy_and_nothing_is_left_reserved(quilld):
    """The BUSYKEY check is made again once a large payload is decoded (off the loop, meanwhile
    other clients run): a key another client made in between is not replaced, and the decoded
    block is given back, as is one whose TTL passed meanwhile or that came in a bad stream."""
    q, other = quilld.client(socket_timeout=60), quilld.client(socket_timeout=60)
    payload = lzf_payload(ord("a"), 26_400_000)
    done = []
    t = threading.Thread(target=lambda: done.append(_reply(q, "RESTORE", "k", 0, payload)))
    t.start()
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        other.set("k", "theirs")  # made before the restore's value is ready, or after it (then replaced)
        time.sleep(0.001)
    t.join(60)
    assert done and (isinstance(done[0], redis.ResponseError) and "BUSYKEY" in str(done[0]) or done[0] == b"OK")
    if done[0] == b"OK":  # the restore won the race: the other client's SETs came after it
        assert other.get("k") == b"theirs"
    bad = bytearray(payload[:-8])
    bad[-100] = 0x3F  # one byte of the stream changed: it no longer decodes to the size it declares
    bad = bytes(bad) + crc64(bytes(bad)).to_bytes(8, "little")
    with pytest.raises(redis.ResponseError, match="Bad data format"):
        q.restore("bad", 0, bad)
    assert q.restore("gone", 1, payload, absttl=True) and q.exists("gone", "bad") == 0
    assert wait_until(lambda: q.info("tiers")["dram_held_bytes"] == 0)
    assert q.info()["dram_reserved_blocks"] == 0


def _reply(client, *args):
    try:
        return client.execute_command(*args)
    except redis.ResponseError as e:
        return e
