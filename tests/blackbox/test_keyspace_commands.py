"""The generic keyspace commands (issue 13, part 2) through a real quilld.

- Byte for byte against a real redis-server 7: every command's replies and errors, in
  RESP2 and RESP3 (KEYS and SCAN replies compared as sets: redis's order is its hash order).
- Identity scopes: KEYS, SCAN, RANDOMKEY, RENAME, COPY, FLUSHDB and DBSIZE never cross them.
- SCAN's guarantee under concurrent writes, deletes and reads; active expiry of keys
  nobody reads; EXPIRE/RENAME/COPY of values that live only on SSD.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import redis

from conftest import same_reply, spill_to_ssd, ssd_node, stop_process, tiers_of, wait_until
from test_compat import run_script, split_replies

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module


# -- byte for byte ---------------------------------------------------------------------------
EXPIRES = [
    ("SET", "k", "v"), ("EXPIRE", "k", "100"), ("TTL", "k"), ("EXPIRE", "k", "100", "NX"),
    ("EXPIRE", "k", "200", "XX"), ("TTL", "k"), ("EXPIRE", "k", "50", "GT"), ("EXPIRE", "k", "300", "gt"),
    ("TTL", "k"), ("EXPIRE", "k", "400", "LT"), ("EXPIRE", "k", "100", "LT"), ("TTL", "k"),
    ("EXPIRE", "k", "100", "NX", "XX"), ("EXPIRE", "k", "100", "GT", "LT"), ("EXPIRE", "k", "100", "NX", "GT"),
    ("EXPIRE", "k", "100", "NX", "LT"), ("EXPIRE", "k", "100", "FOO"), ("EXPIRE", "k", "abc", "FOO"),
    ("EXPIRE", "k", "abc"), ("EXPIRE", "k", ""), ("EXPIRE", "k", "1.5"), ("EXPIRE", "k", "9223372036854775807"),
    ("EXPIRE", "k", "-9223372036854775808"), ("EXPIRE", "k", "9223372036854776"),
    ("EXPIRE", "k", "9223372036854775"), ("TTL", "k"), ("PEXPIRE", "k", "9223372036854775807"),
    ("PEXPIREAT", "k", "9223372036854775807"), ("PEXPIRETIME", "k"), ("EXPIREAT", "k", "9223372036854775808"),
    ("EXPIREAT", "k", "9223372036854775"), ("EXPIRETIME", "k"), ("PEXPIRETIME", "k"),
    ("EXPIREAT", "k", "4102444800"), ("EXPIRETIME", "k"), ("PEXPIRETIME", "k"),
    ("PEXPIREAT", "k", "4102444800499"), ("EXPIRETIME", "k"), ("PEXPIREAT", "k", "4102444800500"),
    ("EXPIRETIME", "k"), ("PERSIST", "k"), ("TTL", "k"), ("PERSIST", "k"), ("PERSIST", "missing"),
    ("EXPIRE", "k", "100", "XX"), ("EXPIRE", "k", "100", "GT"), ("EXPIRE", "k", "100", "LT"), ("TTL", "k"),
    ("EXPIRE", "k", "-1"), ("EXISTS", "k"), ("EXPIRE", "missing", "10"), ("EXPIRE", "missing", "x"),
    ("EXPIRE", "missing", "10", "NX", "XX"), ("EXPIREAT", "k2", "1"), ("SET", "k2", "v"),
    ("PEXPIREAT", "k2", "1"), ("EXISTS", "k2"), ("SET", "k3", "v"), ("PEXPIRE", "k3", "0"), ("GET", "k3"),
    ("EXPIRETIME", "missing"), ("PEXPIRETIME", "missing"), ("SET", "k4", "v"), ("EXPIRETIME", "k4"),
    ("PEXPIRETIME", "k4"), ("EXPIRE", "k4", "100", "nx"), ("EXPIRE", "k4", "50", "NX"), ("TTL", "k4"),
    ("TOUCH", "k4", "missing", "k4"), ("TOUCH", "missing"), ("EXPIRE", "k"), ("EXPIRE",), ("PERSIST",),
    ("PERSIST", "a", "b"), ("EXPIRETIME",), ("PEXPIRETIME", "a", "b"), ("TOUCH",), ("PEXPIREAT", "k"),
    ("EXPIRE", "k4", "1\x00", "NX"), ("EXPIRE", "k4", "100", "N\x00X"),
]

NAMES = [
    ("SET", "a", "1"), ("RENAME", "a", "b"), ("GET", "b"), ("EXISTS", "a"), ("RENAME", "a", "b"),
    ("RENAME", "b", "b"), ("RENAMENX", "b", "b"), ("RENAME", "zz", "zz"), ("RENAMENX", "zz", "zz"),
    ("SET", "c", "2"), ("RENAMENX", "b", "c"), ("RENAMENX", "b", "d"), ("GET", "d"), ("GET", "c"),
    ("SET", "t", "v", "EX", "100"), ("RENAME", "t", "t2"), ("TTL", "t2"), ("TTL", "t"),
    ("SET", "u", "v", "EX", "200"), ("RENAME", "d", "u"), ("TTL", "u"), ("GET", "u"), ("RENAME", "a"),
    ("RENAMENX", "a", "b", "c"), ("RENAME", "missing", "u"), ("RENAMENX", "missing", "nothere"),
    ("SET", "s", "v"), ("COPY", "s", "s"), ("COPY", "s", "d2"), ("GET", "d2"), ("COPY", "s", "d2"),
    ("SET", "s", "w"), ("COPY", "s", "d2", "REPLACE"), ("GET", "d2"), ("COPY", "s", "d3", "DB", "0"),
    ("COPY", "s", "d3", "replace", "db", "0"), ("COPY", "s", "d4", "DB", "1"), ("COPY", "s", "d4", "DB", "x"),
    ("COPY", "s", "d4", "DB"), ("COPY", "s", "d4", "FOO"), ("COPY", "s", "d4", "DB", "99999999999"),
    ("COPY", "s", "s", "DB", "x"), ("COPY", "s", "s", "REPLACE"), ("COPY", "missing", "d5"), ("EXISTS", "d5"),
    ("SET", "e", "v", "EX", "100"), ("COPY", "e", "e2"), ("TTL", "e2"), ("COPY", "s", "e2", "REPLACE"),
    ("TTL", "e2"), ("COPY", "s"), ("COPY",), ("DBSIZE",), ("RANDOMKEY", "x"), ("FLUSHDB", "ASYNC"),
    ("DBSIZE",), ("RANDOMKEY",), ("SET", "only", "v"), ("RANDOMKEY",), ("FLUSHDB", "SYNC"), ("FLUSHDB", "foo"),
    ("FLUSHDB", "ASYNC", "SYNC"), ("FLUSHDB", "sync"), ("FLUSHDB",), ("SCAN", "0"), ("KEYS", "*"),
]

OBJECTS = [
    ("SET", "i", "12345"), ("OBJECT", "ENCODING", "i"), ("SET", "e", "hello"), ("OBJECT", "ENCODING", "e"),
    ("SET", "r", "x" * 44), ("OBJECT", "ENCODING", "r"), ("SET", "r", "x" * 45), ("OBJECT", "ENCODING", "r"),
    ("SET", "big", "y" * 5000), ("OBJECT", "encoding", "big"), ("SET", "n", "-0"), ("OBJECT", "ENCODING", "n"),
    ("SET", "n", "12345678901234567890"), ("OBJECT", "ENCODING", "n"), ("SET", "n", "007"),
    ("OBJECT", "ENCODING", "n"), ("SET", "n", "-9223372036854775808"), ("OBJECT", "ENCODING", "n"),
    ("SET", "n", "9223372036854775808"), ("OBJECT", "ENCODING", "n"), ("SET", "n", " 1"),
    ("OBJECT", "ENCODING", "n"), ("SET", "n", ""), ("OBJECT", "ENCODING", "n"),
    ("OBJECT", "ENCODING", "missing"), ("OBJECT", "ENCODING"), ("OBJECT", "ENCODING", "a", "b"),
    ("OBJECT", "FOO", "k"), ("OBJECT",), ("OBJECT", "HELP"), ("OBJECT", "help", "x"), ("object", "help"),
    ("OBJECT", "FREQ", "e"), ("OBJECT", "FREQ", "missing"), ("OBJECT", "REFCOUNT", "e"),
    ("OBJECT", "REFCOUNT", "big"), ("OBJECT", "REFCOUNT", "missing"), ("OBJECT", "IDLETIME", "missing"),
    ("OBJECT", "IDLETIME", "e"), ("OBJECT", "IDLETIME", "big"), ("MEMORY", "USAGE", "missing"),
    ("MEMORY", "USAGE", "e", "SAMPLES", "x"), ("MEMORY", "USAGE", "e", "SAMPLES", "-1"),
    ("MEMORY", "USAGE", "e", "FOO"), ("MEMORY", "USAGE", "e", "SAMPLES"), ("MEMORY", "USAGE", "missing", "SAMPLES", "0"),
    ("MEMORY", "HELP"), ("MEMORY", "USAGE"), ("MEMORY", "FOO"), ("MEMORY",), ("MEMORY", "PURGE"),
    ("MEMORY", "HELP", "x"), ("TIME", "x"),
]

# OBJECT ENCODING after in-place edits (issue 29.11): redis holds a string it changed in place as a
# raw one whatever its bytes, INCRBYFLOAT's result as a string, and a SET anew as its bytes say
_ENC = ("OBJECT", "ENCODING")
EDITS = [
    ("SET", "e", "12345"), ("APPEND", "e", "6"), (*_ENC, "e"), ("SET", "e", "12345"), ("SETRANGE", "e", "0", "9"),
    (*_ENC, "e"), ("SET", "e", "12345"), ("SETRANGE", "e", "0", ""), (*_ENC, "e"), ("SET", "e", "12345"),
    ("APPEND", "e", ""), (*_ENC, "e"), ("SET", "f", "10"), ("INCRBYFLOAT", "f", "1"), (*_ENC, "f"),
    ("INCRBYFLOAT", "f", "1.5"), (*_ENC, "f"), ("INCRBYFLOAT", "new", "2"), (*_ENC, "new"),
    ("SETBIT", "b", "0", "1"), (*_ENC, "b"), ("SET", "b", "5"), ("SETBIT", "b", "0", "0"), (*_ENC, "b"),
    ("APPEND", "n", "123"), (*_ENC, "n"), ("APPEND", "n2", ""), (*_ENC, "n2"), ("SETRANGE", "r", "0", "12"),
    (*_ENC, "r"), ("SET", "bf", "1"), ("BITFIELD", "bf", "SET", "u8", "0", "49"), (*_ENC, "bf"),
    ("SET", "bg", "1"), ("BITFIELD", "bg", "GET", "u8", "0"), (*_ENC, "bg"), ("SET", "s1", "1"),
    ("BITOP", "NOT", "d", "s1"), (*_ENC, "d"), ("SET", "h", "hello"), ("APPEND", "h", "x"), (*_ENC, "h"),
    ("SET", "x", "12345"), ("APPEND", "x", "6"), ("RENAME", "x", "y"), (*_ENC, "y"), ("COPY", "y", "z"),
    (*_ENC, "z"), ("INCR", "y"), (*_ENC, "y"), ("SET", "z", "7"), (*_ENC, "z"), ("SET", "w", "1"),
    ("SETBIT", "w", "3", "0"), ("GETSET", "w", "8"), (*_ENC, "w"), ("APPEND", "w", "1"), ("MSET", "w", "9"),
    (*_ENC, "w"), ("APPEND", "w", "1"), ("DEL", "w"), ("SET", "w", "3"), (*_ENC, "w"),
]

KEY_NAMES = [b"foo", b"foobar", b"fab", b"f[x", b"f*", b"a\\b", b"hello", b"hallo", b"hxllo", b"hllo",
             b"heeeello", b"\xff\x80", b"a-b", b"]", b"^x", b"x" * 300, b"", b"a" * 50, b"A]b", b"f\x00o"]
PATTERNS = [b"*", b"**", b"", b"f*", b"fo?", b"f??", b"f[ao]*", b"f[^o]*", b"f[a-o]*", b"f[o-a]*", b"f\\*",
            b"f\\[x", b"f[[]x", b"[", b"[^", b"f[", b"*b*a*", b"a\\\\b", b"?", b"[]", b"[]]", b"[a-]",
            b"\\", b"h[^e]llo", b"h[a-b]llo", b"h*llo", b"*llo", b"h?llo", b"[a-\xff]*", b"[\x80-\xff]*",
            b"[\\]]", b"*]", b"x*", b"*x", b"[a\\-b]-b", b"a[--.]b", b"[!a]*", b"[^]*", b"h[", b"foo[",
            b"f\x00*", b"a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*b", b"*a*", b"[A-Z]]b",
            b"foo\\", b"*\\"]
ENUMERATION = [("SET", k, "v") for k in KEY_NAMES] + [("DBSIZE",)] + [
    c for p in PATTERNS for c in (("KEYS", p), ("SCAN", "0", "COUNT", "1000", "MATCH", p))
] + [
    ("SCAN", "0", "COUNT", "1000"), ("SCAN", "", "COUNT", "1000"), ("SCAN", "+0", "count", "1000"),
    ("SCAN", "-0", "COUNT", "1000"), ("SCAN", "0", "COUNT", "1000", "TYPE", "string"),
    ("SCAN", "0", "COUNT", "1000", "type", "STRING"), ("SCAN", "0", "COUNT", "1000", "TYPE", "list"),
    ("SCAN", "0", "COUNT", "1000", "TYPE", "nosuch"), ("SCAN", "0", "COUNT", "1000", "MATCH", "f*", "MATCH", "*"),
    ("SCAN", "0", "MATCH", "zzz*", "COUNT", "1000", "TYPE", "string"), ("SCAN", "abc"), ("SCAN", " 1"),
    ("SCAN", "1 "), ("SCAN", "0x10"), ("SCAN", "18446744073709551616"), ("SCAN", "+"), ("SCAN", "-"),
    ("SCAN", "0", "COUNT", "0"), ("SCAN", "0", "COUNT", "-1"), ("SCAN", "0", "COUNT", "x"),
    ("SCAN", "0", "COUNT"), ("SCAN", "0", "MATCH"), ("SCAN", "0", "TYPE"), ("SCAN", "0", "FOO", "bar"),
    ("SCAN", "x", "COUNT", "0"), ("SCAN", "0", "COUNT", "0", "FOO"), ("SCAN",), ("KEYS",), ("KEYS", "a", "b"),
    ("RANDOMKEY", "x"),
]


def _elements(array: bytes) -> list[bytes]:
    return split_replies(array[array.index(b"\r\n") + 2:])


def normalized(cmd, reply: bytes) -> bytes:
    """KEYS and SCAN replies with their keys sorted (redis returns them in its hash order)."""
    name = cmd[0].upper() if isinstance(cmd[0], str) else cmd[0].decode().upper()
    if name == "KEYS" and reply[:1] in (b"*", b"~"):
        return reply[:reply.index(b"\r\n") + 2] + b"".join(sorted(_elements(reply)))
    if name == "SCAN" and reply[:1] == b"*":
        cursor, keys = _elements(reply)
        return cursor + keys[:keys.index(b"\r\n") + 2] + b"".join(sorted(_elements(keys)))
    return reply


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
@pytest.mark.parametrize("script", [EXPIRES, NAMES, OBJECTS, EDITS, ENUMERATION],
                         ids=["expires", "rename-copy-flush", "object-memory", "encodings-after-edits", "keys-scan"])
def test_replies_match_redis_byte_for_byte(quilld, redis_server, script, resp3):
    theirs = run_script(redis_server, [("FLUSHALL",)] + script, resp3)[1:]
    ours = run_script(quilld.port, [("FLUSHALL",)] + script, resp3)[1:]
    assert len(theirs) == len(script), theirs
    for cmd, t, o in zip(script, theirs, ours):
        assert same_reply(cmd, normalized(cmd, o), normalized(cmd, t)), f"{cmd}: redis answered {t!r}, quilld {o!r}"
    assert len(ours) == len(theirs)


def test_time_memory_usage_and_idletime_tell_the_truth(quilld, redis_server):
    ours = quilld.client()
    theirs = redis.Redis(port=redis_server)
    sec, usec = ours.execute_command("TIME")  # redis-py gives (seconds, microseconds)
    assert abs(sec + usec / 1e6 - time.time()) < 2 and 0 <= usec < 1_000_000
    for r in (ours, theirs):
        r.set("big", b"z" * 100_000)
        r.set("small", "hello")
    big, their_big = ours.memory_usage("big"), theirs.memory_usage("big")
    assert 100_000 < big and abs(big - their_big) < 0.2 * their_big  # the value's pages, plus a little (redis: jemalloc classes)
    assert len("small") + len("hello") < ours.memory_usage("small") < 512
    time.sleep(2.1)
    assert ours.object("idletime", "big") >= 2  # an arena block keeps its last read
    ours.get("big")
    assert ours.object("idletime", "big") == 0


# -- identity scopes ---------------------------------------------------------------------------
def _scoped(q, model: str):
    r = q.client(single_connection_client=True)
    r.execute_command("SCOPE", model, "tok")
    return r


def test_keyspace_commands_never_cross_identity_scopes(quilld):
    a, b = _scoped(quilld, "model-a"), _scoped(quilld, "model-b")
    for i in range(30):
        a.set(f"a{i}", "A")
        b.set(f"b{i}", "B")
    a.set("shared", "A")
    b.set("shared", "B")
    mine_a = {f"a{i}".encode() for i in range(30)} | {b"shared"}
    mine_b = {f"b{i}".encode() for i in range(30)} | {b"shared"}
    assert set(a.keys("*")) == mine_a and set(b.keys("*")) == mine_b
    assert set(a.keys("b*")) == set()
    assert set(a.scan_iter(count=7)) == mine_a and set(b.scan_iter(match="a*", count=100)) == set()
    assert {a.randomkey() for _ in range(200)} <= mine_a
    assert a.dbsize() == b.dbsize() == 31
    # RENAME and COPY stay inside the caller's scope: the other scope's key is neither read nor written
    with pytest.raises(redis.ResponseError, match="no such key"):
        a.rename("b0", "x")
    assert a.copy("b0", "x") == 0 and a.exists("x") == 0
    assert a.rename("a0", "shared") and b.get("shared") == b"B"
    assert a.renamenx("a1", "b1") and b.get("b1") == b"B" and a.get("b1") == b"A"
    assert a.copy("a2", "b2", replace=True) and b.get("b2") == b"B"
    assert a.expire("b3", 100) == 0 and b.ttl("b3") == -1
    assert a.persist("shared") == 0 and a.touch("b4", "b5") == 0
    assert a.object("encoding", "b6") is None and a.memory_usage("b6") is None
    assert a.flushdb() and a.dbsize() == 0 and a.randomkey() is None
    assert b.dbsize() == 31 and set(b.keys("*")) == mine_b
    assert b.get("shared") == b"B"


# -- SCAN's guarantee --------------------------------------------------------------------------
def test_scan_returns_every_key_present_for_the_whole_scan_under_concurrent_load(quilld):
    r = quilld.client()
    stable = [f"stable:{i}" for i in range(3000)]
    churn = [f"churn:{i}" for i in range(3000)]
    names = stable + churn[:1500]
    random.Random(1).shuffle(names)  # stable keys in every slot, the last ones included
    pipe = r.pipeline(transaction=False)
    for k in names:
        pipe.set(k, "v")
    pipe.execute()
    stop = threading.Event()

    def writer(seed):
        w, rng = quilld.client(), random.Random(seed)
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            p = w.pipeline(transaction=False)
            for _ in range(50):
                op = rng.random()
                if op < 0.3:
                    p.set(rng.choice(churn), "v")
                elif op < 0.6:
                    p.delete(rng.choice(churn))
                elif op < 0.7:
                    p.rename(rng.choice(churn[:1500]), rng.choice(churn[1500:]))
                elif op < 0.8:
                    p.set(rng.choice(churn), "v", px=1)
                else:
                    p.get(rng.choice(stable))  # LRU moves
            p.execute(raise_on_error=False)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    try:
        seen, cursor, calls = set(), 0, 0
        while True:
            cursor, keys = r.scan(cursor, count=25)
            seen.update(keys)
            calls += 1
            assert calls < 10_000
            if cursor == 0:
                break
            time.sleep(0.001)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert calls > 100  # the scan really did interleave with the writers
    missing = {k.encode() for k in stable} - seen
    assert not missing, f"{len(missing)} keys present for the whole scan were not returned"


# -- active expiry -----------------------------------------------------------------------------
def test_keys_nobody_reads_expire_in_the_background_and_are_counted(quilld):
    r = quilld.client()
    before = r.info("stats")["expired_keys"]
    pipe = r.pipeline(transaction=False)
    for i in range(500):
        pipe.set(f"ttl:{i}", "v", px=100)
    pipe.set("keeper", "v")
    pipe.execute()
    assert r.dbsize() == 501
    # DBSIZE counts keys whether or not their time has passed (as redis's does): only the
    # background sweep can bring it to 1. How soon is the machine's business, not the test's.
    assert wait_until(lambda: r.dbsize() == 1, timeout=15, interval=0.02), r.dbsize()
    assert r.info("stats")["expired_keys"] - before == 500
    assert r.keys("*") == [b"keeper"]


# -- values that live only on SSD ----------------------------------------------------------------
KiB = 1024


def _value(name: str) -> bytes:
    return random.Random(name).randbytes(256 * KiB)


def test_expire_rename_copy_of_ssd_only_values_and_no_crash_undoes_them(tmp_path):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir)
    try:
        r = redis.Redis(port=q.port, socket_timeout=20)
        keys = [f"v{i}" for i in range(48)]
        spill_to_ssd(r, {k: _value(k) for k in keys}, keys[:8])
        # EXPIRE: the value stays on SSD, which keeps its TTL (logged before the reply)
        assert r.expire("v0", 1000) == 1
        assert tiers_of(r, "v0") == {"ssd"} and 990 <= r.ttl("v0") <= 1000
        assert r.pexpire("v1", 150) == 1 and tiers_of(r, "v1") == {"ssd"}
        assert wait_until(lambda: r.exists("v1") == 0, timeout=2)  # expired on SSD
        # RENAME: under the new name only, in DRAM
        assert r.rename("v2", "renamed") and r.get("renamed") == _value("v2") and r.exists("v2") == 0
        assert tiers_of(r, "renamed") == {"dram"}
        assert r.renamenx("v3", "renamed") == 0 and r.exists("v3") == 1
        # COPY: an independent copy; the source keeps its SSD copy
        assert r.copy("v4", "copied") and r.get("copied") == _value("v4") and r.get("v4") == _value("v4")
        assert r.object("encoding", "v5") == b"raw" and r.memory_usage("v5") < 4096  # only its entry in DRAM
        os.kill(q.proc.pid, signal.SIGKILL)  # no flush: what the SSD holds is what recovery finds
        q.proc.wait(10)
        q = ssd_node(tmp_path, ssd_dir)
        r = redis.Redis(port=q.port, socket_timeout=20)
        assert r.exists("v2") == 0, "a renamed key came back under its old name"
        assert r.get("v0") == _value("v0") and 900 <= r.ttl("v0") <= 1000, "a key given a TTL lost it"
        assert r.exists("v1") == 0, "a key that expired on SSD came back"
        assert r.get("v6") == _value("v6")  # other SSD values survive
    finally:
        stop_process(q.proc)
