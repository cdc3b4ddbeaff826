"""Block commands against a real quilld: PUT2PHASE (BEGIN, DATA from several connections
in any order, COMMIT with CRC32C, ABORT, leases), GETBLK, LOCATE, and whole-value reads
while another client overwrites or deletes the value.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import crc32c
import pytest
import redis

from conftest import raw_exchange, start_quilld, stop_process, wait_until

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One 256 MiB quilld for the module; each test starts from an empty keyspace."""
    q = start_quilld(tmp_path_factory.mktemp("quilld"), "--dram", "256MiB")
    yield q
    stop_process(q.proc)


@pytest.fixture
def r(server):
    c = server.client(single_connection_client=True)
    c.flushall()
    yield c
    assert server.proc.poll() is None, f"quilld exited:\n{server.log()}"
    t = tiers(c)
    assert (t["dram_reserved_blocks"], stats(c)["put2phase_open"]) == (0, 0), "a put was left open"
    c.close()


def p2(c: redis.Redis, *args):
    return c.execute_command("PUT2PHASE", *args)


def stats(c: redis.Redis) -> dict:
    return c.info("stats")


def tiers(c: redis.Redis) -> dict:
    return c.info("tiers")


def put(c: redis.Redis, key: str, data: bytes, chunk: int = MiB) -> None:
    """A whole two-phase put from one connection, in order."""
    h = p2(c, "BEGIN", key, len(data))
    for off in range(0, len(data), chunk):
        assert p2(c, "DATA", h, off, data[off:off + chunk]) == b"OK"
    assert p2(c, "COMMIT", h, "CRC32C", crc32c.crc32c(data)) == b"OK"


# -- PUT2PHASE ------------------------------------------------------------------

def test_32mib_put_from_two_connections_in_parallel_random_order(server, r):
    data = random.Random(1).randbytes(32 * MiB)
    view = memoryview(data)
    st0, t0 = stats(r), tiers(r)
    handle = p2(r, "BEGIN", "blk:32m", len(data))
    assert tiers(r)["dram_reserved_blocks"] == t0["dram_reserved_blocks"] + 1

    order = list(range(32))
    random.Random(2).shuffle(order)
    writers = [server.client(single_connection_client=True) for _ in range(2)]
    start = threading.Barrier(2)

    def send(c: redis.Redis, chunks: list[int]) -> list:
        start.wait(timeout=10)
        return [p2(c, "DATA", handle, i * MiB, view[i * MiB:(i + 1) * MiB]) for i in chunks]

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(send, writers[0], order[0::2]), pool.submit(send, writers[1], order[1::2])]
        replies = [f.result(timeout=60) for f in futures]
    assert replies == [[b"OK"] * 16, [b"OK"] * 16]

    # Every byte is there, and still nothing is visible before COMMIT.
    assert r.get("blk:32m") is None
    assert r.exists("blk:32m") == 0
    assert r.execute_command("LOCATE", "blk:32m") == [[]]

    assert p2(writers[1], "COMMIT", handle, "CRC32C", crc32c.crc32c(data)) == b"OK"
    got = r.get("blk:32m")
    assert len(got) == len(data) and got == data
    assert r.execute_command("GETBLK", "blk:32m") == data
    assert r.strlen("blk:32m") == len(data)
    st, t = stats(r), tiers(r)
    assert st["put2phase_committed"] == st0["put2phase_committed"] + 1
    assert st["put2phase_open"] == st0["put2phase_open"]
    assert t["dram_reserved_blocks"] == t0["dram_reserved_blocks"]
    assert t["dram_blocks"] == t0["dram_blocks"] + 1
    assert t["dram_used_arena"] == t0["dram_used_arena"] + 32 * MiB
    for c in writers:
        c.close()


@pytest.mark.parametrize("size", [1000, 100 * 1024], ids=["inline", "arena"])
def test_wrong_crc_is_refused_and_the_put_stays_open_for_the_right_one(r, size):
    data = random.Random(size).randbytes(size)
    crc = crc32c.crc32c(data)
    open0 = stats(r)["put2phase_open"]
    h = p2(r, "BEGIN", "crc", size)
    p2(r, "DATA", h, 0, data)
    with pytest.raises(redis.ResponseError, match=rf"^CHECKSUM .*crc32c is {crc}, the client said {crc ^ 1}"):
        p2(r, "COMMIT", h, "CRC32C", crc ^ 1)
    with pytest.raises(redis.ResponseError, match=r"^CRC32C must be an unsigned 32-bit integer"):
        p2(r, "COMMIT", h, "CRC32C", 1 << 32)
    with pytest.raises(redis.ResponseError, match=r"^value is not an integer"):
        p2(r, "COMMIT", h, "CRC32C", "0x1234")
    assert r.get("crc") is None and r.exists("crc") == 0
    assert stats(r)["put2phase_open"] == open0 + 1
    assert p2(r, "COMMIT", h, "CRC32C", crc) == b"OK"
    assert r.get("crc") == data
    assert stats(r)["put2phase_open"] == open0


def test_commit_with_bytes_missing_is_incomplete(r):
    rng = random.Random(3)
    part = 64 * 1024
    data = rng.randbytes(3 * part)
    h = p2(r, "BEGIN", "gappy", len(data))
    with pytest.raises(redis.ResponseError, match=rf"^INCOMPLETE .*{len(data)} of {len(data)} bytes"):
        p2(r, "COMMIT", h)
    p2(r, "DATA", h, 2 * part, data[2 * part:])
    p2(r, "DATA", h, 0, data[:part])
    with pytest.raises(redis.ResponseError, match=rf"^INCOMPLETE .*{part} of {len(data)} bytes"):
        p2(r, "COMMIT", h, "CRC32C", crc32c.crc32c(data))
    p2(r, "DATA", h, part, data[part:part + 10])  # a small piece of the gap
    with pytest.raises(redis.ResponseError, match=rf"^INCOMPLETE .*{part - 10} of {len(data)} bytes"):
        p2(r, "COMMIT", h)
    assert r.get("gappy") is None
    # An overlapping rewrite that closes the gap (same bytes) completes it.
    p2(r, "DATA", h, part - 1000, data[part - 1000:2 * part + 1000])
    assert p2(r, "COMMIT", h, "CRC32C", crc32c.crc32c(data)) == b"OK"
    assert r.get("gappy") == data


def test_begin_on_a_complete_key_answers_exists(server, r):
    r.set("present", b"v1")
    reply = raw_exchange(server.port, b"PUT2PHASE BEGIN present 10\r\nPUT2PHASE BEGIN absent 10\r\n")
    lines = reply.split(b"\r\n")
    assert lines[0] == b"+EXISTS"
    assert lines[1] == b"$%d" % len(lines[2]) and len(lines) == 4  # a bulk handle for the absent key
    assert p2(r, "ABORT", lines[2]) == b"OK"
    put(r, "committed", b"x" * 5000)
    assert raw_exchange(server.port, b"PUT2PHASE BEGIN committed 5000\r\n") == b"+EXISTS\r\n"
    assert r.get("present") == b"v1" and r.get("committed") == b"x" * 5000
    # A key that is only being put is not complete: a second BEGIN gets its own handle.
    h1 = p2(r, "BEGIN", "pending", 4)
    h2 = p2(r, "BEGIN", "pending", 4)
    assert h1 != h2 and b"EXISTS" not in (h1, h2)
    for h in (h1, h2):
        assert p2(r, "ABORT", h) == b"OK"


def test_abort_makes_the_handle_unusable_and_frees_its_space(r):
    t0, st0 = tiers(r), stats(r)
    h = p2(r, "BEGIN", "aborted", 8 * MiB)
    p2(r, "DATA", h, 0, b"\x07" * MiB)
    assert tiers(r)["dram_used_arena"] == t0["dram_used_arena"] + 8 * MiB
    assert p2(r, "ABORT", h) == b"OK"
    for args in (("DATA", h, MiB, b"x"), ("COMMIT", h), ("ABORT", h)):
        with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
            p2(r, *args)
    assert r.get("aborted") is None and r.exists("aborted") == 0
    t, st = tiers(r), stats(r)
    assert (t["dram_used_arena"], t["dram_reserved_blocks"]) == (t0["dram_used_arena"], t0["dram_reserved_blocks"])
    assert st["put2phase_aborted"] == st0["put2phase_aborted"] + 1
    assert st["put2phase_open"] == st0["put2phase_open"]
    # The key is free for a new put.
    put(r, "aborted", b"fresh" * 2000)
    assert r.get("aborted") == b"fresh" * 2000


def test_lease_is_honoured(r):
    for bad in (0, -5, 600_001):
        with pytest.raises(redis.ResponseError, match=r"^LEASE must be within 1\.\.600000 ms"):
            p2(r, "BEGIN", "leased", 10, "LEASE", bad)
    with pytest.raises(redis.ResponseError, match=r"^value is not an integer"):
        p2(r, "BEGIN", "leased", 10, "LEASE", "soon")
    assert r.exists("leased") == 0
    with pytest.raises(redis.ResponseError, match=r"^syntax error"):
        p2(r, "BEGIN", "leased", 10, "LEAS", 1000)

    # Within its lease, a slow put still commits (0.6 s of a 5 s lease: a loaded machine has room).
    h = p2(r, "BEGIN", "slow", 10, "LEASE", 5000)
    time.sleep(0.6)
    p2(r, "DATA", h, 0, b"0123456789")
    assert p2(r, "COMMIT", h) == b"OK"
    assert r.get("slow") == b"0123456789"

    # Past it, the handle is gone and nothing was published.
    st0 = stats(r)
    h = p2(r, "BEGIN", "late", 10, "LEASE", 300)
    p2(r, "DATA", h, 0, b"0123456789")
    # the reaper's turn comes when the machine gives it one: wait for the event, not a time
    assert wait_until(lambda: stats(r)["put2phase_expired"] == st0["put2phase_expired"] + 1, timeout=30)
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        p2(r, "COMMIT", h)
    assert stats(r)["put2phase_expired"] == st0["put2phase_expired"] + 1
    assert r.get("late") is None
    # Without LEASE the default (30 s) applies: a 1 s pause is fine.
    h = p2(r, "BEGIN", "default", 3)
    time.sleep(1.0)
    p2(r, "DATA", h, 0, b"abc")
    assert p2(r, "COMMIT", h) == b"OK"


def test_zero_byte_block(server, r):
    h = p2(r, "BEGIN", "empty", 0)
    assert r.exists("empty") == 0
    assert p2(r, "DATA", h, 0, b"") == b"OK"
    with pytest.raises(redis.ResponseError, match=r"^DATA range 0\.\.1 is outside"):
        p2(r, "DATA", h, 0, b"x")
    assert p2(r, "COMMIT", h, "CRC32C", crc32c.crc32c(b"")) == b"OK"
    assert r.get("empty") == b""
    assert r.execute_command("GETBLK", "empty") == b""
    assert r.exists("empty") == 1 and r.strlen("empty") == 0
    assert raw_exchange(server.port, b"GET empty\r\nPUT2PHASE BEGIN empty 0\r\n") == b"$0\r\n\r\n+EXISTS\r\n"
    assert r.execute_command("LOCATE", "empty")[0][0][b"bytes"] == 0


def test_data_outside_the_block_is_refused_and_writes_nothing(r):
    data = random.Random(4).randbytes(50_000)
    h = p2(r, "BEGIN", "bounded", len(data))
    p2(r, "DATA", h, 0, data)
    for offset, payload, text in [
        (len(data) - 1, b"ab", rf"{len(data) - 1}\.\.{len(data) + 1}"),
        (len(data), b"a", rf"{len(data)}\.\.{len(data) + 1}"),
        (-1, b"a", r"-1\.\.0"),
        (10_000, b"\xff" * 40_001, rf"10000\.\.{50_001}"),  # received straight into the block
        (0, b"\xff" * 50_001, r"0\.\.50001"),
    ]:
        with pytest.raises(redis.ResponseError, match=rf"^DATA range {text} is outside the block's 50000 bytes"):
            p2(r, "DATA", h, offset, payload)
    with pytest.raises(redis.ResponseError, match=r"^value is not an integer"):
        p2(r, "DATA", h, "12x", b"a")
    assert r.ping() is True
    # Not one refused byte landed: the original bytes still pass their checksum.
    assert p2(r, "COMMIT", h, "CRC32C", crc32c.crc32c(data)) == b"OK"
    assert r.get("bounded") == data


def test_unknown_handle_is_nohandle(server, r):
    bogus = b"0123456789abcdef01234567"
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        p2(r, "DATA", bogus, 0, b"abc")
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        p2(r, "DATA", bogus, 0, b"\x01" * MiB)  # refused while it arrives, then dropped
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        p2(r, "COMMIT", bogus, "CRC32C", 0)
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        p2(r, "ABORT", bogus)
    # The refused 1 MiB payload was consumed exactly: the next pipelined command is in sync.
    payload = (b"*5\r\n$9\r\nPUT2PHASE\r\n$4\r\nDATA\r\n$24\r\n" + bogus + b"\r\n$1\r\n0\r\n$%d\r\n" % MiB
               + b"\x02" * MiB + b"\r\n*1\r\n$4\r\nPING\r\n")
    reply = raw_exchange(server.port, payload)
    assert reply.startswith(b"-NOHANDLE ") and reply.endswith(b"\r\n+PONG\r\n") and reply.count(b"\r\n") == 2
    # A committed handle is spent.
    h = p2(r, "BEGIN", "spent", 3)
    p2(r, "DATA", h, 0, b"abc")
    p2(r, "COMMIT", h)
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        p2(r, "DATA", h, 0, b"xyz")
    assert r.get("spent") == b"abc"
    with pytest.raises(redis.ResponseError, match=r"^unknown PUT2PHASE phase"):
        p2(r, "FINISH", h)


# -- GETBLK and LOCATE -------------------------------------------------------------

def test_getblk_returns_the_bytes_like_get(r):
    big = random.Random(5).randbytes(3 * MiB + 17)
    put(r, "big", big)
    r.set("small", b"tiny")
    assert r.execute_command("GETBLK", "big") == big
    assert r.execute_command("GETBLK", "big", "LOCAL") == big
    assert r.execute_command("GETBLK", "small", "local") == b"tiny"
    assert r.execute_command("GETBLK", "missing") is None
    with pytest.raises(redis.ResponseError, match=r"^syntax error"):
        r.execute_command("GETBLK", "big", "REMOTE")
    with pytest.raises(redis.ResponseError, match=r"^wrong number of arguments for 'getblk' command"):
        r.execute_command("GETBLK")


def test_locate_lists_residency_in_the_callers_scope(server, r):
    node = r.info("server")["node_id"]
    big = random.Random(6).randbytes(2 * MiB)
    before = int(time.time() * 1000)
    put(r, "big", big)
    r.set("small", b"x" * 100)
    after = int(time.time() * 1000)

    r3 = server.client(protocol=3, single_connection_client=True)
    r2 = server.client(protocol=2, single_connection_client=True)
    res = r3.execute_command("LOCATE", "big", "missing", "small")
    assert len(res) == 3 and res[1] == []
    (b,), (s,) = res[0], res[2]
    assert set(b) == set(s) == {b"node", b"tier", b"bytes", b"last_access_ms"}
    assert b[b"node"] == s[b"node"] == node.encode()
    assert b[b"tier"] == s[b"tier"] == b"dram"
    assert (b[b"bytes"], s[b"bytes"]) == (len(big), 100)
    assert before - 5 <= b[b"last_access_ms"] <= after + 5

    time.sleep(0.05)
    t_get = int(time.time() * 1000)
    assert r.get("big") == big
    (b2,) = r3.execute_command("LOCATE", "big")[0]
    assert b2[b"last_access_ms"] >= t_get - 5 > b[b"last_access_ms"]

    # RESP2: each residency is a flat field/value array.
    (flat,) = r2.execute_command("LOCATE", "big")[0]
    assert flat[0::2] == [b"node", b"tier", b"bytes", b"last_access_ms"]
    assert flat[1::2][:3] == [node.encode(), b"dram", len(big)]

    # Another scope sees nothing, and LOCATE does not change what it finds.
    r3.execute_command("SCOPE", "other-model", "tok")
    assert r3.execute_command("LOCATE", "big", "small") == [[], []]
    with pytest.raises(redis.ResponseError, match=r"^wrong number of arguments for 'locate' command"):
        r.execute_command("LOCATE")
    r3.close()
    r2.close()


# -- whole values under concurrent change -------------------------------------------

def test_reader_sees_whole_old_or_whole_new_value_never_a_mix(server, r):
    size = 32 * MiB
    values = {name: random.Random(name).randbytes(size) for name in ("A", "B", "C")}
    names = {v: k for k, v in values.items()}
    r.set("hot", values["A"])

    stop = threading.Event()
    seen: dict = {}
    reads = [0]  # reads finished so far (the writer waits on it: events, not a time)
    writes = 10  # two rounds of the five steps

    def reader() -> int:
        c = server.client(single_connection_client=True)
        while not stop.is_set():
            v = c.get("hot") if reads[0] % 2 == 0 else c.execute_command("GETBLK", "hot")
            label = "nil" if v is None else names.get(v, "MIXED")
            if label == "MIXED":
                seen["mixed"] = v
            seen[label] = seen.get(label, 0) + 1
            reads[0] += 1
        c.close()
        return reads[0]

    def writer() -> int:
        c = server.client(single_connection_client=True)
        for n in range(writes):
            step = n % 5
            if step == 0:
                c.set("hot", values["B"])
            elif step == 1:
                c.set("hot", values["C"])
            elif step == 2:
                c.delete("hot")
            elif step == 3:
                put(c, "hot", values["A"], chunk=8 * MiB)  # two-phase, over the deleted key
            else:
                c.set("hot", values["B"])
            # the reader catches each value: two whole reads after each write (the second
            # began after it), however long a loaded machine takes to make them
            after = reads[0] + 2
            assert wait_until(lambda: reads[0] >= after or stop.is_set(), timeout=60), "the reader stalled"
        c.close()
        return writes

    with ThreadPoolExecutor(2) as pool:
        fr, fw = pool.submit(reader), pool.submit(writer)
        try:
            done = fw.result(timeout=600)
        finally:
            stop.set()
        total = fr.result(timeout=60)
    mixed = seen.pop("mixed", None)
    assert mixed is None, f"a read returned {len(mixed)} bytes matching no written value: {seen}"
    assert done == writes and total >= 2 * writes, (total, seen)
    assert sum(seen.get(k, 0) for k in ("A", "B", "C")) >= 4, seen
    assert sum(1 for k in ("A", "B", "C") if seen.get(k)) >= 2, seen  # reads overlapped changes

    # Every pinned old value was released once its reader was done.
    assert wait_until(lambda: tiers(r)["dram_pinned_unlinked"] == 0), tiers(r)
    t = tiers(r)
    assert t["dram_reserved_blocks"] == 0
    assert t["dram_used_arena"] == t["dram_blocks"] * size


def test_slow_reader_gets_the_whole_old_value_while_it_is_replaced(server, r):
    """A reply still being sent pins its block: overwrite, delete and new writes
    must not reuse that memory under the reader."""
    size = 32 * MiB
    old, new, other = (random.Random(f"slow-{i}").randbytes(size) for i in range(3))
    r.set("slow", old)
    expected = b"$%d\r\n" % size + old + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET slow\r\n")
        got = bytearray()
        while len(got) < MiB:  # take the first MiB, then stop reading: the rest waits in quilld
            got += s.recv(MiB)
        r.set("slow", new)
        r.delete("slow")
        r.set("slow", new)
        r.set("other", other)
        t = tiers(r)
        assert t["dram_pinned_unlinked"] == 1, t  # the old value, out of the keyspace, still pinned
        assert r.get("slow") == new
        while len(got) < len(expected):
            chunk = s.recv(4 * MiB)
            assert chunk, "connection closed mid-reply"
            got += chunk
    assert got == expected
    assert wait_until(lambda: tiers(r)["dram_pinned_unlinked"] == 0), tiers(r)
    t = tiers(r)
    assert t["dram_used_arena"] == 2 * size and t["dram_blocks"] == 2
    assert r.get("other") == other

    # A reader that goes away mid-reply releases its pin too.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET other\r\n")
        assert s.recv(MiB)
        r.delete("other")
        assert tiers(r)["dram_pinned_unlinked"] == 1
    assert wait_until(lambda: tiers(r)["dram_pinned_unlinked"] == 0), tiers(r)
    t = tiers(r)
    assert t["dram_used_arena"] == size and t["dram_blocks"] == 1
