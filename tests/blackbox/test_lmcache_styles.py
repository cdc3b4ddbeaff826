"""LMCache's three remote connectors, as they call a Redis server, against quilld.

Each section reproduces one connector's calling pattern with 32 MiB KV chunks:

- `redis://`  (lmcache/v1/storage_backend/connector/redis_connector.py): redis-py
  (`redis.asyncio`, a pool from the URL); a chunk is two keys, `K + "kv_bytes"`
  written first, then `K + "metadata"`; `EXISTS K + "metadata"` is the lookup;
  a get reads metadata then kv_bytes, and deletes a metadata key whose kv_bytes
  is gone.
- `valkey://` (valkey_connector.py, the GLIDE client): a RESP3 connection, one key
  per chunk, optional `SET ... EX ttl`, many keys in flight at once.
- `resp://`   (csrc/storage_backends/redis/connector.cpp): a hand-written RESP2
  client that only sends GET/SET/EXISTS/DEL/AUTH, writes a SET as one scatter
  write, and compares every reply byte for byte (`+OK\\r\\n`, `:1\\r\\n`,
  `$33554432\\r\\n` + payload + `\\r\\n`, `$-1\\r\\n`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis


CHUNK = 32 * 1024 * 1024  # one LMCache KV chunk, as `$33554432`
IO_TIMEOUT = 20.0  # bound on any single socket wait
TEST_DEADLINE = 45.0  # bound on any hand-written receive loop

pytestmark = [pytest.mark.timeout(90), pytest.mark.shared_node]  # one quilld and one redis-server for the module


def chunk_key(i: int, model: str = "meta-llama/Llama-3.1-8B-Instruct") -> str:
    """A CacheEngineKey.to_string()-shaped key: fmt@model@world_size@worker_id@chunk_hash@dtype."""
    digest = hashlib.sha256(f"{model}:{i}".encode()).hexdigest()
    return f"vllm@{model}@1@0@{digest}@bfloat16"


@functools.cache
def _noise() -> bytes:
    return np.random.default_rng(20240601).bytes(CHUNK)


def payload(seed: int, size: int = CHUNK) -> bytes:
    """Deterministic, incompressible, distinct per seed: the same noise, rotated and tagged."""
    noise = _noise()
    cut = (seed * 1_000_003) % CHUNK
    data = b"%08d" % seed + noise[cut:] + noise[:cut]
    return data[:size]


def metadata(length: int) -> bytes:
    """A RemoteMetadata-like header: length, a 4-d shape, dtype and format codes."""
    return struct.pack("<7i", length, 2, 32, 256, 1024, 7, 1)


def assert_same(got, want: bytes, what: str) -> None:
    """Byte-exact comparison that reports the first differing offset, not a 32 MiB diff."""
    if got is None:
        pytest.fail(f"{what}: got None, expected {len(want)} bytes")
    if len(got) != len(want):
        pytest.fail(f"{what}: got {len(got)} bytes, expected {len(want)}")
    if bytes(got) != want:
        diff = np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8))
        pytest.fail(f"{what}: {diff.size} bytes differ, first at offset {int(diff[0])}")


# ---------------------------------------------------------------------------
# redis:// -- RedisConnector on redis-py
# ---------------------------------------------------------------------------

def test_redis_style_put_exists_get(quilld):
    r = quilld.client()
    chunks = {chunk_key(i): payload(i) for i in range(3)}
    for k, kv in chunks.items():
        # kv_bytes first, metadata second: metadata visible implies kv_bytes visible
        assert r.set(k + "kv_bytes", kv) is True
        assert r.set(k + "metadata", metadata(len(kv))) is True
    for k, kv in chunks.items():
        assert r.exists(k + "metadata") == 1
        meta = r.get(k + "metadata")
        assert meta == metadata(CHUNK)
        (length,) = struct.unpack_from("<i", meta)
        got = r.get(k + "kv_bytes")
        assert_same(got[:length], kv, f"GET {k}kv_bytes")
        assert len(got) == length
    assert r.strlen(chunk_key(0) + "kv_bytes") == CHUNK
    assert r.dbsize() == 2 * len(chunks)


def test_redis_style_missing_chunk(quilld):
    r = quilld.client()
    k = chunk_key(99)
    assert r.exists(k + "metadata") == 0
    assert r.get(k + "metadata") is None
    assert r.get(k + "kv_bytes") is None
    # the connector's consistency path: metadata present, kv_bytes gone -> DEL metadata
    r.set(k + "metadata", metadata(CHUNK))
    assert r.get(k + "kv_bytes") is None
    assert r.delete(k + "metadata") == 1
    assert r.exists(k + "metadata") == 0
    assert r.delete(k + "metadata") == 0


def test_redis_style_overwrite_same_chunk(quilld):
    """A chunk stored again (another request produced it) replaces the old bytes whole."""
    r = quilld.client()
    k = chunk_key(5)
    first, second = payload(50), payload(51)
    r.set(k + "kv_bytes", first)
    r.set(k + "kv_bytes", second)
    assert_same(r.get(k + "kv_bytes"), second, "GET after overwrite")
    assert r.dbsize() == 1


def test_redis_style_pipelined(quilld):
    r = quilld.client()
    keys = [chunk_key(i) for i in range(10, 14)]
    kvs = [payload(i) for i in range(10, 14)]
    with r.pipeline(transaction=False) as p:
        for k, kv in zip(keys, kvs):
            p.set(k + "kv_bytes", kv)
            p.set(k + "metadata", metadata(len(kv)))
        assert p.execute() == [True] * (2 * len(keys))
    missing = chunk_key(999)
    with r.pipeline(transaction=False) as p:
        for k in keys + [missing]:
            p.exists(k + "metadata")
        assert p.execute() == [1] * len(keys) + [0]
    with r.pipeline(transaction=False) as p:
        for k in keys + [missing]:
            p.get(k + "metadata")
            p.get(k + "kv_bytes")
        replies = p.execute()
    for i, kv in enumerate(kvs):
        assert replies[2 * i] == metadata(CHUNK)
        assert_same(replies[2 * i + 1], kv, f"pipelined GET #{i}")
    assert replies[-2:] == [None, None]


def test_redis_style_async_pool_batched(quilld):
    """The connector's real shape: redis.asyncio, a pool from the URL, puts gathered."""
    keys = [chunk_key(i) for i in range(20, 24)]
    kvs = [payload(i) for i in range(20, 24)]

    async def scenario():
        pool = aioredis.ConnectionPool.from_url(f"redis://127.0.0.1:{quilld.port}", max_connections=150,
                                                socket_timeout=IO_TIMEOUT)
        conn = aioredis.Redis.from_pool(pool)
        sem = asyncio.Semaphore(150)
        try:
            async def put(k, kv):
                async with sem:
                    await conn.set(k + "kv_bytes", kv)
                    await conn.set(k + "metadata", metadata(len(kv)))

            async def get(k):
                async with sem:
                    meta = await conn.get(k + "metadata")
                    if meta is None:
                        return None
                    (length,) = struct.unpack_from("<i", meta)
                    buf = bytearray(length)  # the connector's allocated memory object
                    kv = await conn.get(k + "kv_bytes")
                if kv is None:
                    async with sem:
                        await conn.delete(k + "metadata")
                    return None
                memoryview(buf)[:length] = kv
                return buf

            async def contains_prefix(ks):
                hits = 0
                for k in ks:
                    async with sem:
                        if not await conn.exists(k + "metadata"):
                            return hits
                    hits += 1
                return hits

            await asyncio.gather(*(put(k, kv) for k, kv in zip(keys, kvs)))
            assert await contains_prefix(keys) == len(keys)
            assert await contains_prefix(keys[:2] + [chunk_key(777)] + keys[2:]) == 2
            got = await asyncio.gather(*(get(k) for k in keys + [chunk_key(778)]))
            # checked here: a coroutine result of 32 MiB values costs seconds in asyncio's task repr
            for i, kv in enumerate(kvs):
                assert_same(got[i], kv, f"async GET #{i}")
            assert got[-1] is None
        finally:
            await conn.aclose()
            await pool.aclose()

    asyncio.run(asyncio.wait_for(scenario(), TEST_DEADLINE))
    assert quilld.client().dbsize() == 2 * len(keys)


# ---------------------------------------------------------------------------
# valkey:// -- one key per chunk over RESP3
# ---------------------------------------------------------------------------

def test_valkey_style_resp3_handshake(quilld):
    r = quilld.client(protocol=3)
    hello = r.execute_command("HELLO", 3)
    assert hello[b"proto"] == 3
    assert hello[b"role"] == b"master"
    assert str(r.client_info()["resp"]) == "3"
    repl = r.info("replication")
    assert repl["role"] == "master"
    assert r.get("vk:missing") is None
    assert r.exists("vk:missing") == 0


def test_valkey_style_pipelined_set_get_with_ttl(quilld):
    r = quilld.client(protocol=3)
    keys = [chunk_key(i, "Qwen/Qwen2.5-7B") for i in range(3)]
    kvs = [payload(100 + i) for i in range(3)]
    with r.pipeline(transaction=False) as p:
        for k, kv in zip(keys, kvs):
            p.set(k, kv, ex=86400)  # valkey_ttl_sec: keys carry an expiry
        assert p.execute() == [True] * len(keys)
    with r.pipeline(transaction=False) as p:
        for k in keys:
            p.exists(k)
        for k in keys:
            p.ttl(k)
        assert p.execute()[:len(keys)] == [1] * len(keys)
    assert all(86390 <= r.ttl(k) <= 86400 for k in keys)
    with r.pipeline(transaction=False) as p:
        for k in keys:
            p.get(k)
        p.get(chunk_key(9, "Qwen/Qwen2.5-7B"))
        replies = p.execute()
    for i, kv in enumerate(kvs):
        assert_same(replies[i], kv, f"RESP3 pipelined GET #{i}")
    assert replies[-1] is None


def test_valkey_style_mget_many_chunks(quilld):
    r = quilld.client(protocol=3)
    keys = [chunk_key(i, "mistralai/Mistral-7B") for i in range(4)]
    kvs = [payload(200 + i) for i in range(4)]
    for k, kv in zip(keys, kvs):
        assert r.set(k, kv) is True
    missing = chunk_key(50, "mistralai/Mistral-7B")
    got = r.mget(keys[:2] + [missing] + keys[2:])
    assert len(got) == 5
    assert got[2] is None
    for want, have in zip(kvs, got[:2] + got[3:]):
        assert_same(have, want, "MGET element")
    # the same keys in parallel from several connections, as GLIDE's worker threads do
    pool = redis.ConnectionPool(host="127.0.0.1", port=quilld.port, protocol=3, socket_timeout=IO_TIMEOUT)
    shared = redis.Redis(connection_pool=pool)
    try:
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(shared.get, keys, timeout=TEST_DEADLINE))
    finally:
        pool.disconnect()
    for want, have in zip(kvs, results):
        assert_same(have, want, "parallel RESP3 GET")


def test_valkey_style_raw_resp3_replies(quilld):
    """GLIDE speaks RESP3: a nil is `_`, integers and bulks as in RESP2."""
    with RespWire(quilld.port) as w:
        w.send(resp_command(b"HELLO", b"3"))
        # a map of 7 pairs: 7 keys and 4 string values of 2 lines each, 3 one-line values
        hello = b"".join(w.recv_line() for _ in range(1 + 7 * 2 + 4 * 2 + 3))
        assert re.fullmatch(rb"%7\r\n\$6\r\nserver\r\n\$5\r\nredis\r\n\$7\r\nversion\r\n\$\d+\r\n[\d.]+\r\n"
                            rb"\$5\r\nproto\r\n:3\r\n\$2\r\nid\r\n:\d+\r\n\$4\r\nmode\r\n\$10\r\nstandalone\r\n"
                            rb"\$4\r\nrole\r\n\$6\r\nmaster\r\n\$7\r\nmodules\r\n\*0\r\n", hello), hello
        w.send(resp_command(b"GET", b"vk:none"))
        assert w.recv_line() == b"_\r\n"
        w.send(resp_command(b"EXISTS", b"vk:none"))
        assert w.recv_line() == b":0\r\n"
        data = payload(300, 1 << 20)
        w.send(resp_command(b"SET", b"vk:one", data))
        assert w.recv_line() == b"+OK\r\n"
        w.send(resp_command(b"GET", b"vk:one"))
        assert w.recv_line() == b"$1048576\r\n"
        assert_same(w.recv_exactly(len(data)), data, "RESP3 GET payload")
        assert w.recv_exactly(2) == b"\r\n"
        w.assert_quiet()


# ---------------------------------------------------------------------------
# resp:// -- the native RESP2 client
# ---------------------------------------------------------------------------

def resp_command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%b\r\n" % (len(p), p))
    return b"".join(out)


class RespWire:
    """A blocking RESP client that reads exactly what it expects, with a deadline."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.deadline = time.monotonic() + TEST_DEADLINE

    def __enter__(self) -> "RespWire":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def _check_time(self) -> None:
        if time.monotonic() > self.deadline:
            pytest.fail("raw RESP exchange exceeded its deadline")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_multipart(self, parts: list) -> None:
        """The connector's writev: every part in one scatter write, resumed after partial writes."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            self._check_time()
            n = self.sock.sendmsg(views)
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0

    def recv_exactly(self, n: int, into: bytearray | None = None) -> bytearray:
        buf = into if into is not None else bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            self._check_time()
            k = self.sock.recv_into(view[got:n])
            if k == 0:
                pytest.fail(f"connection closed after {got} of {n} bytes")
            got += k
        return buf

    def recv_line(self, limit: int = 64) -> bytes:
        """A reply header, byte by byte up to LF, as the connector reads it."""
        line = bytearray()
        while not line.endswith(b"\r\n"):
            self._check_time()
            c = self.sock.recv(1)
            if not c:
                pytest.fail(f"connection closed mid-line after {bytes(line)!r}")
            line += c
            if len(line) > limit:
                pytest.fail(f"reply header too long: {bytes(line[:80])!r}")
        return bytes(line)

    def assert_quiet(self, wait: float = 0.2) -> None:
        """Nothing more than what was read: no stray or duplicated reply bytes."""
        self.sock.settimeout(wait)
        try:
            extra = self.sock.recv(64)
        except socket.timeout:
            extra = b""
        finally:
            self.sock.settimeout(IO_TIMEOUT)
        assert extra == b"", f"unexpected bytes after the last reply: {extra!r}"

    # -- the connector's four operations ------------------------------------
    def set(self, key: bytes, data: bytes) -> bytes:
        self.send_multipart([b"*3\r\n$3\r\nSET\r\n", b"$%d\r\n%b\r\n" % (len(key), key),
                             b"$%d\r\n" % len(data), data, b"\r\n"])
        return bytes(self.recv_exactly(5))

    def exists(self, key: bytes) -> bytes:
        self.send_multipart([b"*2\r\n$6\r\nEXISTS\r\n", b"$%d\r\n%b\r\n" % (len(key), key)])
        return bytes(self.recv_exactly(4))

    def delete(self, key: bytes) -> bytes:
        self.send_multipart([b"*2\r\n$3\r\nDEL\r\n", b"$%d\r\n%b\r\n" % (len(key), key)])
        return bytes(self.recv_exactly(4))

    def get_into(self, key: bytes, buf: bytearray) -> bytes:
        """GET into a preallocated buffer: header line, payload straight into `buf`, trailer."""
        self.send_multipart([b"*2\r\n$3\r\nGET\r\n", b"$%d\r\n%b\r\n" % (len(key), key)])
        header = self.recv_line()
        if header == b"$-1\r\n":
            return header
        assert header == b"$%d\r\n" % len(buf), f"size header {header!r}"
        self.recv_exactly(len(buf), buf)
        assert bytes(self.recv_exactly(2)) == b"\r\n", "trailer"
        return header

    def auth(self, *creds: bytes) -> bytes:
        self.send(resp_command(b"AUTH", *creds))
        return self.recv_line(256)


def test_resp_style_exact_replies(quilld):
    key = chunk_key(0, "resp").encode()
    data = payload(400)
    with RespWire(quilld.port) as w:
        assert w.exists(key) == b":0\r\n"
        buf = bytearray(CHUNK)
        assert w.get_into(key, buf) == b"$-1\r\n"
        assert w.set(key, data) == b"+OK\r\n"
        assert w.exists(key) == b":1\r\n"
        assert w.get_into(key, buf) == b"$33554432\r\n"
        assert_same(buf, data, "raw GET payload")
        assert w.delete(key) == b":1\r\n"
        assert w.delete(key) == b":0\r\n"
        assert w.exists(key) == b":0\r\n"
        assert w.get_into(key, buf) == b"$-1\r\n"
        w.assert_quiet()


def test_resp_style_whole_reply_bytes(quilld):
    """The complete GET reply, read with a bounded loop: header + 32 MiB + CRLF, nothing else."""
    key = b"resp:whole"
    data = payload(401)
    with RespWire(quilld.port) as w:
        assert w.set(key, data) == b"+OK\r\n"
        w.send(b"*2\r\n$3\r\nGET\r\n$10\r\nresp:whole\r\n")
        expected = b"$33554432\r\n" + data + b"\r\n"
        reply = w.recv_exactly(len(expected))
        if bytes(reply[:11]) != b"$33554432\r\n":
            pytest.fail(f"header {bytes(reply[:16])!r}")
        assert_same(reply, expected, "whole GET reply")
        w.assert_quiet()


def test_resp_style_set_arrives_in_pieces(quilld):
    """A SET whose header and payload reach the server in separate, odd-sized segments."""
    key = b"resp:pieces"
    data = payload(402)
    with RespWire(quilld.port) as w:
        w.send(b"*3\r\n$3\r\nSET\r\n$11\r\nresp:")
        time.sleep(0.05)
        w.send(b"pieces\r\n$33554")
        time.sleep(0.05)
        w.send(b"432\r\n")
        time.sleep(0.05)
        step = 3 * 1024 * 1024 + 17
        for off in range(0, len(data), step):
            w.send(data[off:off + step])
        w.send(b"\r")
        time.sleep(0.05)
        w.send(b"\n")
        assert w.recv_exactly(5) == b"+OK\r\n"
        buf = bytearray(CHUNK)
        assert w.get_into(key, buf) == b"$33554432\r\n"
        assert_same(buf, data, "GET after split SET")
        w.assert_quiet()


def test_resp_style_parallel_workers(quilld):
    """num_workers connections, each doing its own SET then GET of every chunk."""
    keys = [chunk_key(i, "resp-workers").encode() for i in range(4)]
    datas = [payload(500 + i) for i in range(4)]

    def put(i: int) -> bytes:
        with RespWire(quilld.port) as w:
            return w.set(keys[i], datas[i])

    def get_all(i: int) -> list:
        out = []
        with RespWire(quilld.port) as w:
            for j in range(len(keys)):
                k = (i + j) % len(keys)
                buf = bytearray(CHUNK)
                header = w.get_into(keys[k], buf)
                out.append((k, header, buf))
            w.assert_quiet()
        return out

    with ThreadPoolExecutor(len(keys)) as ex:
        assert list(ex.map(put, range(len(keys)), timeout=TEST_DEADLINE)) == [b"+OK\r\n"] * len(keys)
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(get_all, range(2), timeout=TEST_DEADLINE))
    for worker in results:
        for k, header, buf in worker:
            assert header == b"$33554432\r\n"
            assert_same(buf, datas[k], f"worker GET of chunk {k}")


def test_resp_style_pipelined_in_one_write(quilld):
    """SET, EXISTS, GET and DEL in one write; the replies come back in order, exact."""
    key = b"resp:pipe"
    data = payload(600)
    with RespWire(quilld.port) as w:
        w.send_multipart([resp_command(b"SET", key, data), resp_command(b"EXISTS", key),
                          resp_command(b"GET", key), resp_command(b"DEL", key),
                          resp_command(b"GET", key)])
        assert w.recv_exactly(5) == b"+OK\r\n"
        assert w.recv_exactly(4) == b":1\r\n"
        assert w.recv_line() == b"$33554432\r\n"
        assert_same(w.recv_exactly(CHUNK), data, "pipelined GET")
        assert w.recv_exactly(2) == b"\r\n"
        assert w.recv_exactly(4) == b":1\r\n"
        assert w.recv_exactly(5) == b"$-1\r\n"
        w.assert_quiet()


def test_resp_style_auth(quilld_factory):
    q = quilld_factory("--dram", "256MiB", "--requirepass", "pw")
    key = b"resp:auth"
    data = payload(700)
    with RespWire(q.port) as w:
        w.send(resp_command(b"GET", key))
        assert w.recv_line(256) == b"-NOAUTH Authentication required.\r\n"
        assert w.auth(b"wrong") == b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
        assert w.auth(b"pw") == b"+OK\r\n"
        assert w.set(key, data) == b"+OK\r\n"
        assert w.exists(key) == b":1\r\n"
        buf = bytearray(CHUNK)
        assert w.get_into(key, buf) == b"$33554432\r\n"
        assert_same(buf, data, "GET after AUTH")
        w.assert_quiet()
    with RespWire(q.port) as w:  # the username form: AUTH default pw
        assert w.auth(b"default", b"pw") == b"+OK\r\n"
        assert w.exists(key) == b":1\r\n"
        assert w.delete(key) == b":1\r\n"
        w.assert_quiet()
    with RespWire(q.port) as w:  # before AUTH a 32 MiB bulk is refused as redis 7 does, and never stored
        w.send(b"*3\r\n$3\r\nSET\r\n$9\r\nresp:nope\r\n$%d\r\n" % CHUNK)
        assert w.recv_line(256) == b"-ERR Protocol error: unauthenticated bulk length\r\n"
        assert w.sock.recv(64) == b"", "the connection is closed after a protocol error"
    with RespWire(q.port) as w:
        assert w.auth(b"pw") == b"+OK\r\n"
        assert w.exists(b"resp:nope") == b":0\r\n"
        w.assert_quiet()
