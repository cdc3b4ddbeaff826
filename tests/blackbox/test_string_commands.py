"""The string family (issue 13, part 1) through a real quilld.

- Byte for byte against a real redis-server 7: every command's replies and errors, in RESP2
  and RESP3, from fixed scripts and from seeded random sequences of range, bit and float
  operations run on both servers.
- GETRANGE and SETRANGE on a multi-MiB arena block are served in place: no copy of the
  block is made (the arena and RSS do not grow by its size), even while another client
  holds the block pinned by a large GET being sent.
- Values crossing the inline/arena boundary both ways (APPEND, SETRANGE, INCR, GETSET).
- Values that live only on SSD: read back first, and no acknowledged change comes back
  after kill -9.
- `redis-benchmark`'s default test list completes.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time

import pytest
import redis
from conftest import require_tool, same_reply, spill_to_ssd, ssd_node, stop_process, wait_held, wait_until
from test_compat import run_script

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module


KiB, MiB = 1024, 1024 * 1024
I64_MIN, I64_MAX = str(-(1 << 63)), str((1 << 63) - 1)


def compare(redis_port: int, quilld_port: int, script, resp3: bool) -> None:
    script = [("FLUSHALL",)] + list(script)
    theirs = run_script(redis_port, script, resp3)
    ours = run_script(quilld_port, script, resp3)
    assert len(theirs) == len(script), theirs[-3:]
    for cmd, t, o in zip(script, theirs, ours):
        assert same_reply(cmd, o, t), f"{cmd}: redis answered {t!r}, quilld {o!r}"
    assert len(ours) == len(theirs)


# -- fixed scripts -----------------------------------------------------------------------------
COUNTERS = [
    ("INCR", "n"), ("INCR", "n"), ("GET", "n"), ("INCRBY", "n", "10"), ("INCRBY", "n", "-25"), ("DECR", "n"),
    ("DECRBY", "n", "7"), ("DECRBY", "n", "-7"), ("DECR", "fresh"), ("DECRBY", "fresh2", "5"),
    ("SET", "n", I64_MAX), ("INCR", "n"), ("INCRBY", "n", "0"), ("SET", "n", I64_MIN), ("DECR", "n"),
    ("INCRBY", "n", I64_MIN), ("DECRBY", "n", I64_MIN), ("DECRBY", "n", "1"), ("GET", "n"),
    ("INCRBY", "n", "x"), ("INCRBY", "n", "1.5"), ("INCRBY", "n", "9223372036854775808"), ("INCRBY", "n", ""),
    ("SET", "s", " 1"), ("INCR", "s"), ("SET", "s", "1 "), ("INCR", "s"), ("SET", "s", "01"), ("INCR", "s"),
    ("SET", "s", "-0"), ("INCR", "s"), ("SET", "s", "+1"), ("INCR", "s"), ("SET", "s", ""), ("INCR", "s"),
    ("SET", "s", "1" * 30), ("INCR", "s"), ("SET", "s", "-1"), ("INCR", "s"), ("GET", "s"),
    ("SET", "t", "5", "EX", "100"), ("INCR", "t"), ("TTL", "t"),  # INCR keeps the TTL
    ("INCR",), ("INCR", "a", "b"), ("INCRBY", "a"), ("DECRBY", "a", "1", "2"),
    ("INCRBYFLOAT", "f", "1"), ("INCRBYFLOAT", "f", "0.25"), ("INCRBYFLOAT", "f", "-1.25"), ("GET", "f"),
    ("SET", "f", "10.5"), ("INCRBYFLOAT", "f", "0.1"), ("INCRBYFLOAT", "f", "-1.1"), ("INCRBYFLOAT", "f", "3.0e3"),
    ("INCRBYFLOAT", "f", "1e-20"), ("INCRBYFLOAT", "f", "0x1p3"), ("INCRBYFLOAT", "f", ".5"),
    ("INCRBYFLOAT", "f", "5."), ("INCRBYFLOAT", "f", "-.5e1"), ("INCRBYFLOAT", "f", "+inf"),
    ("INCRBYFLOAT", "f", "-inf"), ("INCRBYFLOAT", "f", "nan"), ("INCRBYFLOAT", "f", "abc"),
    ("INCRBYFLOAT", "f", " 1"), ("INCRBYFLOAT", "f", "1 "), ("INCRBYFLOAT", "f", ""), ("INCRBYFLOAT", "f", "1e5000"),
    ("INCRBYFLOAT", "f", "1e-5000"), ("INCRBYFLOAT", "f", "1e4000"), ("INCRBYFLOAT", "f", "-1e4000"),
    ("INCRBYFLOAT", "f", "1" * 5200), ("GET", "f"), ("SET", "f", "1.7976931348623157e308"),
    ("INCRBYFLOAT", "f", "1.7976931348623157e308"), ("SET", "f", "1.18973149535723176502e+4932"),
    ("INCRBYFLOAT", "f", "1e4932"), ("SET", "f", "inf"), ("INCRBYFLOAT", "f", "1"), ("SET", "f", " 2"),
    ("INCRBYFLOAT", "f", "1"), ("SET", "f", "5.0e3"), ("INCRBYFLOAT", "f", "2.0e2"), ("SET", "f", "-0.0"),
    ("INCRBYFLOAT", "f", "0"), ("INCRBYFLOAT", "f", "-1e-30"), ("GET", "f"),
    ("SET", "f", "1.5", "PX", "100000"), ("INCRBYFLOAT", "f", "1"), ("TTL", "f"),
]
RANGES = [
    ("APPEND", "a", "hello"), ("APPEND", "a", " world"), ("GET", "a"), ("STRLEN", "a"), ("APPEND", "e", ""),
    ("EXISTS", "e"), ("GET", "e"), ("APPEND", "a", ""),
    ("GETRANGE", "a", "0", "4"), ("GETRANGE", "a", "-5", "-1"), ("GETRANGE", "a", "0", "-1"),
    ("GETRANGE", "a", "5", "1"), ("GETRANGE", "a", "-1", "-5"), ("GETRANGE", "a", "-100", "2"),
    ("GETRANGE", "a", "3", "100"), ("GETRANGE", "a", "100", "200"), ("GETRANGE", "a", I64_MIN, I64_MAX),
    ("GETRANGE", "a", "-1", "-1"), ("GETRANGE", "a", "0", "0"), ("GETRANGE", "missing", "0", "-1"),
    ("GETRANGE", "a", "x", "1"), ("GETRANGE", "a", "0", "1.5"), ("GETRANGE", "a", "0"),
    ("SUBSTR", "a", "0", "4"), ("SUBSTR", "a", "-3", "-1"), ("SUBSTR", "missing", "0", "1"),
    ("SETRANGE", "a", "6", "W"), ("GET", "a"), ("SETRANGE", "a", "15", "!"), ("GET", "a"),
    ("SETRANGE", "a", "0", ""), ("SETRANGE", "n", "0", ""), ("EXISTS", "n"), ("SETRANGE", "n", "3", "x"),
    ("GET", "n"), ("SETRANGE", "n", "-1", "x"), ("SETRANGE", "n", "x", "x"), ("SETRANGE", "n", "1.5", "x"),
    ("SETRANGE", "n", I64_MAX, "x"), ("SETRANGE", "n", "536870911", "xy"), ("SETRANGE", "n", "536870912", ""),
    ("SETRANGE", "missing2", "536870912", ""), ("SETRANGE", "n", "1"), ("GETRANGE", "n", "0", "-1"),
    ("SET", "t", "abc", "EX", "100"), ("SETRANGE", "t", "1", "X"), ("APPEND", "t", "d"), ("TTL", "t"),
    ("GET", "t"), ("STRLEN", "t"), ("APPEND",), ("APPEND", "a"),
]
SETS = [
    ("GETSET", "g", "1"), ("GETSET", "g", "2"), ("GET", "g"), ("SET", "g", "v", "EX", "100"),
    ("GETSET", "g", "w"), ("TTL", "g"), ("GETSET", "g"), ("GETDEL", "g"), ("GETDEL", "g"), ("EXISTS", "g"),
    ("GETDEL", "g", "x"), ("SETNX", "s", "1"), ("SETNX", "s", "2"), ("GET", "s"), ("SETNX", "s"),
    ("SETEX", "e", "10", "v"), ("TTL", "e"), ("GET", "e"), ("SETEX", "e", "0", "v"), ("SETEX", "e", "-1", "v"),
    ("SETEX", "e", "x", "v"), ("SETEX", "e", "9223372036854775807", "v"), ("SETEX", "e", "9223372036854775", "v"),
    ("SETEX", "e", "10"), ("PSETEX", "p", "100000", "v"), ("PTTL", "missing"), ("GET", "p"),
    ("PSETEX", "p", "0", "v"), ("PSETEX", "p", "x", "v"), ("PSETEX", "p", "9223372036854775807", "v"),
    ("MSETNX", "m1", "a", "m2", "b"), ("MGET", "m1", "m2"), ("MSETNX", "m2", "x", "m3", "y"), ("EXISTS", "m3"),
    ("MSETNX", "m4", "1", "m4", "2"), ("GET", "m4"), ("MSETNX", "m5"), ("MSETNX", "m5", "1", "m6"), ("MSETNX",),
    ("SET", "x", "v", "EX", "100"), ("GETEX", "x"), ("TTL", "x"), ("GETEX", "x", "PERSIST"), ("TTL", "x"),
    ("GETEX", "x", "EX", "50"), ("TTL", "x"), ("GETEX", "x", "PX", "70000"), ("TTL", "x"),
    ("GETEX", "x", "EXAT", "4102444800"), ("TTL", "x"), ("GETEX", "x", "PXAT", "4102444800000"), ("PERSIST", "x"),
    ("GETEX", "x", "EX", "0"), ("GETEX", "x", "EX", "-1"), ("GETEX", "x", "EX", "x"), ("GETEX", "x", "PX", "1.5"),
    ("GETEX", "x", "EX", "9223372036854775807"), ("GETEX", "x", "PX", "9223372036854775807"),
    ("GETEX", "x", "EX", "10", "PX", "10"), ("GETEX", "x", "EX", "10", "EX", "20"), ("TTL", "x"),
    ("GETEX", "x", "PERSIST", "EX", "10"), ("GETEX", "x", "EX", "10", "PERSIST"), ("GETEX", "x", "PERSIST", "PERSIST"),
    ("GETEX", "x", "KEEPTTL"), ("GETEX", "x", "EX"), ("GETEX", "x", "FOO"), ("GETEX", "missing", "EX", "x"),
    ("GETEX", "missing", "FOO"), ("GETEX", "missing", "PERSIST"), ("GETEX", "x", "PXAT", "1"), ("EXISTS", "x"),
    ("SET", "y", "v"), ("GETEX", "y", "EXAT", "1"), ("EXISTS", "y"), ("GETEX",),
]
LCS = [
    ("SET", "r1", "ohmytext"), ("SET", "r2", "mynewtext"), ("LCS", "r1", "r2"), ("LCS", "r1", "r2", "LEN"),
    ("LCS", "r1", "r2", "IDX"), ("LCS", "r1", "r2", "IDX", "WITHMATCHLEN"),
    ("LCS", "r1", "r2", "IDX", "MINMATCHLEN", "4"), ("LCS", "r1", "r2", "IDX", "MINMATCHLEN", "-4", "WITHMATCHLEN"),
    ("LCS", "r1", "r2", "idx", "len"), ("LCS", "r1", "r2", "MINMATCHLEN"), ("LCS", "r1", "r2", "MINMATCHLEN", "x"),
    ("LCS", "r1", "r2", "FOO"), ("LCS", "r1", "missing"), ("LCS", "missing", "r2", "IDX"),
    ("LCS", "missing", "missing2", "LEN"), ("LCS", "r1"),
    ("SET", "d1", "ACCGGTCGAGTGCGCGGAAGCCGGCCGAA" * 3), ("SET", "d2", "GTCGTTCGGAATGCCGTTGCTCTGTAAA" * 3),
    ("LCS", "d1", "d2"), ("LCS", "d1", "d2", "IDX", "WITHMATCHLEN"), ("LCS", "d1", "d2", "IDX", "MINMATCHLEN", "3"),
]
BITS = [
    ("SETBIT", "b", "7", "1"), ("SETBIT", "b", "7", "1"), ("SETBIT", "b", "100", "1"), ("GET", "b"),
    ("GETBIT", "b", "7"), ("GETBIT", "b", "6"), ("GETBIT", "b", "100000"), ("GETBIT", "missing", "0"),
    ("SETBIT", "b", "7", "0"), ("SETBIT", "b", "-1", "1"), ("SETBIT", "b", "x", "1"), ("SETBIT", "b", "1", "2"),
    ("SETBIT", "b", "1", "-1"), ("SETBIT", "b", "1", "x"), ("SETBIT", "b", "4294967296", "1"),
    ("SETBIT", "b", "4294967295", "x"), ("GETBIT", "b", "-1"), ("GETBIT", "b", "4294967296"), ("SETBIT", "b", "1"),
    ("SET", "c", "foobar"), ("BITCOUNT", "c"), ("BITCOUNT", "c", "0", "0"), ("BITCOUNT", "c", "1", "1"),
    ("BITCOUNT", "c", "1", "1", "BYTE"), ("BITCOUNT", "c", "5", "30", "BIT"), ("BITCOUNT", "c", "-5", "-1", "bit"),
    ("BITCOUNT", "c", "-1", "-5"), ("BITCOUNT", "c", "-1", "-5", "FOO"), ("BITCOUNT", "c", "0", "-1", "FOO"),
    ("BITCOUNT", "c", "0"), ("BITCOUNT", "c", "0", "1", "BIT", "x"), ("BITCOUNT", "c", "x", "1"),
    ("BITCOUNT", "missing"), ("BITCOUNT", "missing", "0"), ("BITCOUNT", "missing", "x", "y", "z", "w"),
    ("BITCOUNT", "c", "100", "200"), ("BITCOUNT", "c", "-100", "-50"),
    ("SET", "p", "\xff\xf0\x00"), ("BITPOS", "p", "0"), ("BITPOS", "p", "1"), ("BITPOS", "p", "1", "1"),
    ("BITPOS", "p", "0", "0", "0"), ("BITPOS", "p", "0", "3", "-1"), ("BITPOS", "p", "1", "2", "-1"),
    ("BITPOS", "p", "0", "5", "20", "BIT"), ("BITPOS", "p", "1", "9", "9", "BIT"), ("BITPOS", "p", "1", "12", "-1", "bit"),
    ("BITPOS", "p", "0", "1", "7", "BIT"), ("BITPOS", "p", "0", "0", "-1", "BYTE"), ("BITPOS", "p", "0", "-1"),
    ("BITPOS", "p", "2"), ("BITPOS", "p", "x"), ("BITPOS", "p", "1", "x"), ("BITPOS", "p", "1", "0", "x"),
    ("BITPOS", "p", "1", "0", "1", "FOO"), ("BITPOS", "p", "1", "0", "1", "BIT", "x"), ("BITPOS", "missing", "0"),
    ("BITPOS", "missing", "1"), ("BITPOS", "missing", "2"), ("SET", "ones", "\xff\xff"), ("BITPOS", "ones", "0"),
    ("BITPOS", "ones", "0", "0"), ("BITPOS", "ones", "0", "0", "-1"), ("BITPOS", "ones", "0", "3", "14", "BIT"),
    ("SET", "zero", ""), ("BITPOS", "zero", "0"), ("BITPOS", "zero", "1"), ("BITCOUNT", "zero"),
    ("SET", "k1", "foobar"), ("SET", "k2", "abcdef"), ("BITOP", "AND", "d", "k1", "k2"), ("GET", "d"),
    ("BITOP", "OR", "d", "k1", "k2", "missing"), ("GET", "d"), ("BITOP", "XOR", "d", "k1", "p"), ("GET", "d"),
    ("BITOP", "NOT", "d", "k1"), ("GET", "d"), ("BITOP", "not", "d", "k1", "k2"), ("BITOP", "FOO", "d", "k1"),
    ("SET", "d", "x", "EX", "100"), ("BITOP", "AND", "d", "k1"), ("TTL", "d"), ("BITOP", "OR", "d", "missing"),
    ("EXISTS", "d"), ("BITOP", "AND", "d"),
    ("BITFIELD", "f", "SET", "i8", "0", "100", "GET", "u4", "0", "INCRBY", "i5", "100", "1", "GET", "u8", "#1"),
    ("BITFIELD", "f", "OVERFLOW", "SAT", "INCRBY", "i8", "0", "100", "INCRBY", "u2", "0", "5", "OVERFLOW", "FAIL",
     "INCRBY", "i8", "0", "100", "OVERFLOW", "WRAP", "INCRBY", "u3", "#2", "-9", "SET", "i64", "8", I64_MIN),
    ("BITFIELD", "f", "SET", "i8", "0", I64_MIN, "SET", "u8", "0", "-1", "OVERFLOW", "SAT", "SET", "i8", "0", I64_MIN,
     "SET", "u8", "0", "-1", "INCRBY", "i64", "0", I64_MAX, "INCRBY", "i64", "0", I64_MAX, "GET", "i64", "0"),
    ("BITFIELD", "f", "GET", "u63", "3", "GET", "i64", "#3", "GET", "i1", "1000000", "GET", "u64", "0"),
    ("BITFIELD", "f", "GET", "u0", "0"), ("BITFIELD", "f", "GET", "x8", "0"), ("BITFIELD", "f", "GET", "I8", "0"),
    ("BITFIELD", "f", "GET", "i65", "0"), ("BITFIELD", "f", "GET", "i8", "-1"), ("BITFIELD", "f", "GET", "i8", "#-1"),
    ("BITFIELD", "f", "GET", "i8", "4294967296"), ("BITFIELD", "f", "GET", "i8", "#x"), ("BITFIELD", "f", "GET", "i8"),
    ("BITFIELD", "f", "SET", "i8", "0", "x"), ("BITFIELD", "f", "OVERFLOW", "XX"), ("BITFIELD", "f", "OVERFLOW"),
    ("BITFIELD", "f", "FOO"), ("BITFIELD", "f"), ("BITFIELD", "missing", "GET", "u8", "0"), ("EXISTS", "missing"),
    ("BITFIELD_RO", "f", "GET", "i8", "0", "GET", "u16", "#1"), ("BITFIELD_RO", "f", "SET", "i8", "0", "1"),
    ("BITFIELD_RO", "f", "INCRBY", "i8", "0", "1"), ("BITFIELD_RO", "f", "OVERFLOW", "SAT"), ("BITFIELD_RO", "missing"),
    ("GET", "f"), ("BITFIELD", "g", "SET", "u8", "100", "255"), ("STRLEN", "g"),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
@pytest.mark.parametrize("script", [COUNTERS, RANGES, SETS, LCS, BITS], ids=["counters", "ranges", "sets", "lcs", "bits"])
def test_replies_match_redis_byte_for_byte(quilld, redis_server, script, resp3):
    compare(redis_server, quilld.port, script, resp3)


# -- seeded random sequences on both servers -----------------------------------------------------
def _random_script(seed: int, n: int = 400) -> list[tuple]:
    rnd = random.Random(seed)
    keys = ["a", "b", "c"]

    def num(lo, hi):
        return str(rnd.randint(lo, hi))

    script = []
    for _ in range(n):
        k = rnd.choice(keys)
        op = rnd.randrange(13)
        if op == 0:
            script.append(("SETRANGE", k, num(0, 300), rnd.randbytes(rnd.randint(0, 40))))
        elif op == 1:
            script.append(("APPEND", k, rnd.randbytes(rnd.randint(0, 60))))
        elif op == 2:
            script.append(("GETRANGE", k, num(-400, 400), num(-400, 400)))
        elif op == 3:
            script.append(("SETBIT", k, num(0, 3000), num(0, 1)))
        elif op == 4:
            script.append(("BITCOUNT", k, num(-300, 300), num(-300, 300), rnd.choice(["BIT", "BYTE"])))
        elif op == 5:
            args = [num(0, 1), num(-300, 300)]
            if rnd.random() < 0.6:
                args.append(num(-300, 300))
                if rnd.random() < 0.6:
                    args.append(rnd.choice(["BIT", "BYTE"]))
            script.append(("BITPOS", k, *args))
        elif op == 6:
            sub = []
            for _ in range(rnd.randint(1, 4)):
                signed = rnd.random() < 0.5
                t = f"i{rnd.randint(1, 64)}" if signed else f"u{rnd.randint(1, 63)}"
                what = rnd.randrange(4)
                if what == 0:
                    sub += ["GET", t, num(0, 2000)]
                elif what == 1:
                    sub += ["SET", t, num(0, 2000), num(-(1 << 63), (1 << 63) - 1)]
                elif what == 2:
                    sub += ["INCRBY", t, num(0, 2000), num(-(1 << 20), 1 << 20)]
                else:
                    sub += ["OVERFLOW", rnd.choice(["WRAP", "SAT", "FAIL"])]
            script.append(("BITFIELD", k, *sub))
        elif op == 7:
            script.append(("BITOP", rnd.choice(["AND", "OR", "XOR"]), rnd.choice(keys), *rnd.sample(keys, 2)))
        elif op == 8:
            script.append(("GETBIT", k, num(0, 3000)))
        elif op == 9:
            script.append(("INCRBYFLOAT", "fl", rnd.choice([f"{rnd.uniform(-1e6, 1e6):.{rnd.randint(0, 20)}f}",
                                                            f"{rnd.uniform(-1e20, 1e20):.6e}", str(rnd.random())])))
        elif op == 10:
            script.append(("LCS", *rnd.sample(keys, 2), *rnd.choice([(), ("LEN",), ("IDX", "WITHMATCHLEN")])))
        elif op == 11:
            script.append(("STRLEN", k))
        else:
            script.append(("GET", k))
    return script


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_range_bit_and_float_sequences_match_redis(quilld, redis_server, seed):
    compare(redis_server, quilld.port, _random_script(seed), resp3=seed == 2)


# -- arena blocks: in place --------------------------------------------------------------------
def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_getrange_setrange_on_a_multi_mib_block_work_in_place(quilld):
    r = quilld.client()
    size = 24 * MiB
    data = bytearray(random.Random(7).randbytes(size))
    r.set("kv", bytes(data))
    arena = r.info("tiers")["dram_used_arena"]
    rss = _rss(quilld.proc.pid)
    layer = 1536 * KiB
    for i in range(16):  # one layer's slice read and written, sixteen times
        start = i * layer
        assert r.getrange("kv", start, start + layer - 1) == bytes(data[start:start + layer])
        piece = bytes([i]) * 4096
        assert r.setrange("kv", start + 100, piece) == size
        data[start + 100:start + 100 + len(piece)] = piece
    assert r.getrange("kv", size - 10, -1) == bytes(data[-10:])
    assert r.info("tiers")["dram_used_arena"] == arena  # the same block: no copy was published
    grown = _rss(quilld.proc.pid) - rss
    assert grown < size // 2, f"RSS grew by {grown} bytes: the {size}-byte block was materialised"
    assert r.strlen("kv") == size and r.get("kv") == bytes(data)


def test_setrange_on_a_block_being_sent_leaves_the_reply_intact(quilld):
    """A GET of a large block is pinned until sent; a SETRANGE meanwhile must not change the bytes
    under it (copy-on-write): the reader gets the old value whole, later readers the new one."""
    size = 16 * MiB
    old = random.Random(3).randbytes(size)
    r = quilld.client()
    r.set("kv", old)
    slow = socket.socket()
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * KiB)  # most of the reply stays with quilld
        slow.settimeout(10)
        slow.connect(("127.0.0.1", quilld.port))
        slow.sendall(b"*2\r\n$3\r\nGET\r\n$2\r\nkv\r\n")
        wait_held(r, size)  # the reply is in flight: the block is pinned while it is sent
        assert r.setrange("kv", 0, b"NEW!") == size
        # copy-on-write: the reader's block left the keyspace and waits for it, a copy took its place
        assert r.info("tiers")["dram_pinned_unlinked"] == 1 and r.info("tiers")["dram_blocks"] == 1
        assert r.append("kv", b"tail") == size + 4
        head = b"$%d\r\n" % size
        got, deadline = bytearray(), time.monotonic() + 30
        while len(got) < len(head) + size + 2 and time.monotonic() < deadline:
            chunk = slow.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        assert bytes(got) == head + old + b"\r\n"
    finally:
        slow.close()
    assert r.get("kv") == b"NEW!" + old[4:] + b"tail"
    assert wait_until(lambda: r.info("tiers")["dram_pinned_unlinked"] == 0, timeout=5)


def test_values_cross_the_inline_arena_boundary_both_ways(quilld):
    r = quilld.client()
    inline_max = r.info("tiers")["dram_inline_max"]
    r.set("v", b"x" * (inline_max - 10))
    before = r.info("tiers")
    assert r.append("v", b"y" * 20) == inline_max + 10  # inline -> arena
    after = r.info("tiers")
    assert after["dram_blocks"] == before["dram_blocks"] + 1
    assert after["dram_used_inline"] == before["dram_used_inline"] - (inline_max - 10)
    assert r.get("v") == b"x" * (inline_max - 10) + b"y" * 20
    assert r.setrange("w", inline_max * 3, b"z") == inline_max * 3 + 1  # created straight in the arena
    assert r.getrange("w", 0, -1) == bytes(inline_max * 3) + b"z"
    assert r.info("tiers")["dram_blocks"] == after["dram_blocks"] + 1
    assert r.getset("v", "small") == b"x" * (inline_max - 10) + b"y" * 20  # arena -> inline
    r.set("w", "41")
    assert r.incr("w") == 42 and r.info("tiers")["dram_blocks"] == before["dram_blocks"]
    assert r.get("v") == b"small" and r.get("w") == b"42"
    r.set("b", b"\x00" * (inline_max + 100))
    assert r.setbit("b", 8, 1) == 0 and r.getbit("b", 8) == 1 and r.bitcount("b") == 1
    assert r.info("tiers")["dram_used_inline"] == len(b"small") + 2


def test_proto_max_bulk_len_limits_growth(quilld):
    r = quilld.client()
    r.set("k", "abc")
    with pytest.raises(redis.ResponseError, match=r"^string exceeds maximum allowed size \(proto-max-bulk-len\)$"):
        r.setrange("k", 512 * MiB - 1, "xy")
    with pytest.raises(redis.ResponseError, match="bit offset is not an integer or out of range"):
        r.setbit("k", 512 * MiB * 8, 1)
    assert r.get("k") == b"abc"


def test_commands_stay_in_the_callers_identity_scope(quilld):
    a = quilld.client(single_connection_client=True)
    b = quilld.client(single_connection_client=True)
    a.execute_command("SCOPE", "model-a", "tok")
    b.execute_command("SCOPE", "model-b", "tok")
    a.set("k", "A-value")
    b.set("k", "B")
    a.set("other", "xyz")
    assert a.append("k", "!") == 8 and b.get("k") == b"B"
    assert b.incr("k2") == 1 and a.get("k2") is None
    assert a.bitop("OR", "dest", "k", "other") == 8 and b.get("dest") is None
    assert b.execute_command("LCS", "k", "other") == b"" and a.execute_command("LCS", "k", "other") == b""
    assert a.execute_command("LCS", "k", "k2") == b"" and b.msetnx({"k": "x", "z": "y"}) is False
    assert a.msetnx({"z": "1"}) is True and b.exists("z") == 0
    assert b.getdel("other") is None and a.get("other") == b"xyz"


# -- values only on SSD --------------------------------------------------------------------------
def _value(name: str) -> bytes:
    return random.Random(name).randbytes(256 * KiB)


def test_ssd_only_values_are_read_back_and_no_acknowledged_change_is_undone_by_a_crash(tmp_path):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir)
    try:
        r = redis.Redis(port=q.port, socket_timeout=20)
        keys = [f"v{i}" for i in range(48)]
        spill_to_ssd(r, {k: _value(k) for k in keys}, keys[:10])
        assert r.getrange("v0", 1000, 1999) == _value("v0")[1000:2000]
        assert r.strlen("v1") == 256 * KiB and r.getbit("v1", 8) == (_value("v1")[1] >> 7) & 1
        assert r.bitcount("v1", 0, 99) == sum(b.bit_count() for b in _value("v1")[:100])
        assert r.setrange("v2", 10, b"CHANGED") == 256 * KiB
        assert r.append("v3", b"+tail") == 256 * KiB + 5
        assert r.setbit("v4", 0, 1 - (_value("v4")[0] >> 7)) == _value("v4")[0] >> 7
        assert r.getdel("v5") == _value("v5") and r.exists("v5") == 0
        assert r.getset("v6", "short") == _value("v6")
        assert r.getex("v7", ex=1000) == _value("v7") and 990 <= r.ttl("v7") <= 1000
        with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
            r.incr("v8")
        assert r.execute_command("BITFIELD", "v9", "SET", "u8", "0", "7") == [_value("v9")[0]]
        expect2 = bytearray(_value("v2"))
        expect2[10:17] = b"CHANGED"
        assert r.get("v2") == bytes(expect2) and r.get("v3") == _value("v3") + b"+tail"
        os.kill(q.proc.pid, signal.SIGKILL)  # no flush: what the SSD holds is what recovery finds
        q.proc.wait(10)
        q = ssd_node(tmp_path, ssd_dir)
        r = redis.Redis(port=q.port, socket_timeout=20)
        for k in ("v2", "v3", "v4", "v5", "v6", "v9"):  # changed in DRAM: lost, never the old bytes
            assert r.get(k) != _value(k), f"{k}: an acknowledged change was undone by the crash"
        assert r.get("v0") == _value("v0") and r.get("v1") == _value("v1")  # values only read keep their SSD copy
        assert r.get("v7") == _value("v7") and 900 <= r.ttl("v7") <= 1000  # GETEX's TTL was logged on SSD
    finally:
        stop_process(q.proc)


# -- redis-benchmark ----------------------------------------------------------------------------
def test_redis_benchmark_default_tests_complete(quilld):
    bench = require_tool("redis-benchmark")
    proc = subprocess.Popen([bench, "-h", "127.0.0.1", "-p", str(quilld.port), "-t",
                             "set,get,incr,mset,ping_inline,ping_mbulk", "-n", "2000", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate(timeout=10)
        pytest.fail(f"redis-benchmark did not finish: {output[-1500:]!r}\nquilld's log: {quilld.log()[-3000:]}")
    assert proc.returncode == 0, output
    text = output.replace("\r", "\n")
    for name in ("PING_INLINE", "PING_MBULK", "SET", "GET", "INCR", "MSET (10 keys)"):
        assert f"\n{name}: " in "\n" + text and "requests per second" in text, text[-2000:]
    assert "ERR" not in text
    assert quilld.client().get("counter:__rand_int__") == b"2000"  # every INCR was applied
