"""docs/connectors.md's recipes, each driven the way its connector calls quilld.

Every test takes its configuration from the recipe block in the doc (host and port
swapped for the test's quilld), so the documented config is the tested one.

- LMCache `redis://`, `valkey://` and `resp://`: the calls of `RedisConnector` (redis.asyncio),
  of `ValkeyConnector` (one GLIDE sync client per worker thread, RESP3) and of the native
  RESP2 client, per LMCache 0.5.6 (`lmcache/v1/storage_backend/connector/redis_connector.py`,
  `valkey_connector.py`, `lmcache/v1/storage_backend/valkey/worker_pool.py`, `native_clients/`)
  and `csrc/storage_backends/redis/`. LMCache itself needs torch, so its calls are replayed
  here, with its key and metadata formats; GLIDE itself runs where it is installed.
- SGLang HiCache: in test_sglang_hicache.py.
- vLLM `--kv-events-config`: a publisher doing what vLLM's `ZmqEventPublisher` does
  (msgspec with vLLM's struct declarations, sequence frames, a replay ROUTER).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import struct
import threading
import time
import tomllib
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import zmq
from quillclient import QuillClient

from vllm_schema import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from conftest import ROOT, free_port, wait_until

DOC = ROOT / "docs" / "connectors.md"
IO_TIMEOUT = 20.0

pytestmark = pytest.mark.timeout(60)


def recipe(name: str) -> str:
    """The fenced block right after `<!-- recipe: name -->` in docs/connectors.md."""
    m = re.search(rf"<!-- recipe: {re.escape(name)} -->\s*```\w*\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert m, f"docs/connectors.md has no recipe {name!r}"
    return m.group(1)


def flat_yaml(text: str) -> dict[str, Any]:
    """The YAML subset the LMCache recipes use: `key: scalar` and one level of nested mappings."""
    out: dict[str, Any] = {}
    parent: dict[str, Any] | None = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, raw = line.strip().partition(":")
        raw = raw.strip()
        target = parent if line.startswith(" ") and parent is not None else out
        if not raw:
            parent = out[key] = {}
            continue
        if raw[0] in "\"'":
            value: Any = raw[1:-1]
        elif raw in ("true", "false"):
            value = raw == "true"
        else:
            value = int(raw) if re.fullmatch(r"-?\d+", raw) else float(raw) if re.fullmatch(r"-?[\d.]+", raw) else raw
        target[key] = value
    return out


# ---------------------------------------------------------------------------
# LMCache
# ---------------------------------------------------------------------------

# Qwen2.5-0.5B's KV in LMCache's KV_2LTD format: [2, layers, chunk tokens, kv_heads * head_dim], bfloat16
LAYERS, KV_DIM, CHUNK_TOKENS = 24, 2 * 64, 256
CHUNK = 2 * LAYERS * CHUNK_TOKENS * KV_DIM * 2  # 3 MiB
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
FMT_KV_2LTD, DTYPE_BF16 = 1, 3  # MemoryFormat.KV_2LTD, DTYPE_TO_INT[torch.bfloat16] in lmcache/v1/protocol.py


def engine_key(worker_id: int, chunk_hash: int, world_size: int = 2) -> str:
    """CacheEngineKey.to_string(): model@world_size@worker_id@chunk_hash_hex@dtype."""
    return f"{MODEL}@{world_size}@{worker_id}@{chunk_hash:x}@bfloat16"


def remote_metadata(length: int) -> bytes:
    """RemoteMetadata.serialize() for one KV group: length, fmt, then dtype and the 4-d shape."""
    return struct.pack("i" * 7, length, FMT_KV_2LTD, DTYPE_BF16, 2, LAYERS, CHUNK_TOKENS, KV_DIM)


def chunk_hashes(n: int, salt: str) -> list[int]:
    """A prefix chain of 64-bit chunk hashes, as a token database makes them."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{salt}:{i}".encode()).digest()
        out.append(int.from_bytes(prev[:8], "little"))
    return out


def kv_chunk(seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(CHUNK)


def test_lmcache_redis_recipe(quilld_factory):
    cfg = flat_yaml(recipe("lmcache-redis"))
    assert cfg["remote_serde"] == "naive" and cfg["chunk_size"] == CHUNK_TOKENS
    url = urlsplit(cfg["remote_url"])
    assert url.scheme == "redis" and url.password
    q = quilld_factory("--dram", "256MiB", "--requirepass", url.password)
    live_url = url._replace(netloc=f"{url.username or ''}:{url.password}@127.0.0.1:{q.port}").geturl()
    hashes = chunk_hashes(5, "prompt-a")
    chunks = {(w, h): kv_chunk(w * 100 + i) for w in (0, 1) for i, h in enumerate(hashes)}

    async def scenario() -> None:
        # RedisConnector.__init__: a pool from the URL, 150 connections, a semaphore of 150
        pool = aioredis.ConnectionPool.from_url(live_url, max_connections=150, socket_timeout=IO_TIMEOUT)
        conn = aioredis.Redis.from_pool(pool)
        sem = asyncio.Semaphore(150)

        async def put(key: str, kv: bytes) -> None:  # _put: kv_bytes first, then metadata
            async with sem:
                await conn.set(key + "kv_bytes", kv)
                await conn.set(key + "metadata", remote_metadata(len(kv)))

        async def contains(keys: list[str]) -> int:  # _batched_async_contains
            hits = 0
            for key in keys:
                async with sem:
                    if not await conn.exists(key + "metadata"):
                        return hits
                hits += 1
            return hits

        async def get(key: str) -> bytearray | None:  # _get: metadata, allocate, kv_bytes, copy
            async with sem:
                meta = await conn.get(key + "metadata")
                if meta is None:
                    return None
                length, fmt, dtype, *shape = struct.unpack_from("i" * 7, memoryview(meta))
                assert (fmt, dtype, shape) == (FMT_KV_2LTD, DTYPE_BF16, [2, LAYERS, CHUNK_TOKENS, KV_DIM])
                memory_obj = bytearray(2 * LAYERS * CHUNK_TOKENS * KV_DIM * 2)
                kv = await conn.get(key + "kv_bytes")
            if kv is None:  # evicted under the metadata: drop the metadata too
                async with sem:
                    await conn.delete(key + "metadata")
                return None
            memoryview(memory_obj)[:length] = kv
            return memory_obj

        try:
            for w in (0, 1):  # two TP workers store their own halves of each chunk (batched_put)
                await asyncio.gather(*(put(engine_key(w, h), chunks[w, h]) for h in hashes))
            assert await contains([engine_key(0, h) for h in hashes]) == 5
            assert await contains([engine_key(1, h) for h in hashes + chunk_hashes(2, "other")]) == 5
            got = await asyncio.gather(*(get(engine_key(w, h)) for w in (0, 1) for h in hashes))
            for (w, h), data in zip([(w, h) for w in (0, 1) for h in hashes], got):
                assert data == chunks[w, h], f"worker {w} chunk {h:x}"
            # quilld evicted one chunk's bytes: the read misses and the lookup stops there
            assert await conn.delete(engine_key(0, hashes[2]) + "kv_bytes") == 1
            assert await get(engine_key(0, hashes[2])) is None
            assert await contains([engine_key(0, h) for h in hashes]) == 2
        finally:
            await conn.aclose()
            await pool.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 45))
    assert q.client(password=url.password).dbsize() == 2 * 2 * 5 - 2
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url._replace(netloc=f":wrong@127.0.0.1:{q.port}").geturl()).ping()


class NativeRespConnection:
    """One worker connection of LMCache's RESP client (csrc/storage_backends/redis/connector.cpp)."""

    def __init__(self, port: int, username: str, password: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.send(b"*3\r\n$4\r\nAUTH\r\n", self.bulk(username.encode()), self.bulk(password.encode()))
        line = self.recv_line()
        assert line == b"+OK\r\n", f"AUTH answered {line!r}"

    @staticmethod
    def bulk(b: bytes) -> bytes:
        return b"$%d\r\n%b\r\n" % (len(b), b)

    def send(self, *parts: bytes | memoryview) -> None:  # one writev per command
        views = [memoryview(p) for p in parts]
        while views:
            n = self.sock.sendmsg(views)
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0

    def recv_exactly(self, n: int, into: memoryview | None = None) -> bytes | None:
        buf = into if into is not None else memoryview(bytearray(n))
        got = 0
        while got < n:
            k = self.sock.recv_into(buf[got:n])
            assert k, "connection closed"
            got += k
        return None if into is not None else bytes(buf)

    def recv_line(self) -> bytes:
        line = b""
        while not line.endswith(b"\r\n"):
            line += self.recv_exactly(1)
            assert len(line) < 64, f"reply header too long: {line!r}"
        return line

    def set(self, key: str, data: memoryview) -> None:
        self.send(b"*3\r\n$3\r\nSET\r\n", self.bulk(key.encode()), b"$%d\r\n" % data.nbytes, data, b"\r\n")
        assert self.recv_exactly(5) == b"+OK\r\n"

    def exists(self, key: str) -> bool:
        self.send(b"*2\r\n$6\r\nEXISTS\r\n", self.bulk(key.encode()))
        reply = self.recv_exactly(4)
        assert reply in (b":0\r\n", b":1\r\n"), reply
        return reply == b":1\r\n"

    def get(self, key: str, buf: memoryview) -> bool:
        self.send(b"*2\r\n$3\r\nGET\r\n", self.bulk(key.encode()))
        header = self.recv_line()
        if header == b"$-1\r\n":
            return False
        assert header == b"$%d\r\n" % buf.nbytes, f"size header {header!r}"
        self.recv_exactly(buf.nbytes, buf)
        assert self.recv_exactly(2) == b"\r\n"
        return True

    def delete(self, key: str) -> bool:
        self.send(b"*2\r\n$3\r\nDEL\r\n", self.bulk(key.encode()))
        return self.recv_exactly(4) == b":1\r\n"

    def close(self) -> None:
        self.sock.close()


def tiles(n_items: int, workers: int) -> list[range]:
    """ConnectorBase: min(workers, n) tiles of ceil(n / tiles) consecutive keys, one worker each."""
    count = min(workers, n_items)
    size = -(-n_items // count)
    return [range(i * size, min((i + 1) * size, n_items)) for i in range(count) if i * size < n_items]


def test_lmcache_resp_recipe(quilld_factory):
    cfg = flat_yaml(recipe("lmcache-resp"))
    extra = cfg["extra_config"]
    assert urlsplit(cfg["remote_url"]).scheme == "resp" and cfg["save_unfull_chunk"] is False
    q = quilld_factory("--dram", "256MiB", "--requirepass", extra["password"])
    workers = [NativeRespConnection(q.port, extra["username"], extra["password"])
               for _ in range(extra["resp_num_threads"])]
    hashes = chunk_hashes(12, "resp")
    keys = [engine_key(0, h, world_size=1) for h in hashes]
    data = [memoryview(kv_chunk(1000 + i)) for i in range(len(keys))]

    def batch(op, items: list) -> list:
        """One batch op fanned out over the workers in tiles; per-item results in order."""
        results: list = [None] * len(items)

        def run(w: int, tile: range) -> None:
            for i in tile:
                results[i] = op(workers[w], *items[i])

        with ThreadPoolExecutor(len(workers)) as ex:
            for f in [ex.submit(run, w, t) for w, t in enumerate(tiles(len(items), len(workers)))]:
                f.result(timeout=IO_TIMEOUT)
        return results

    def prefix(found: list[bool]) -> int:  # RESPConnector.batched_contains
        return found.index(False) if False in found else len(found)

    try:
        batch(NativeRespConnection.set, [(k, d) for k, d in zip(keys[:10], data[:10])])
        assert prefix(batch(NativeRespConnection.exists, [(k,) for k in keys])) == 10
        bufs = [memoryview(bytearray(CHUNK)) for _ in keys]
        assert batch(NativeRespConnection.get, list(zip(keys, bufs))) == [True] * 10 + [False] * 2
        assert all(bytes(bufs[i]) == bytes(data[i]) for i in range(10))
        assert batch(NativeRespConnection.delete, [(k,) for k in keys[3:5]]) == [True, True]
        assert prefix(batch(NativeRespConnection.exists, [(k,) for k in keys])) == 3
    finally:
        for w in workers:
            w.close()


# LMCache 0.5.6's valkey:// connector (lmcache/v1/storage_backend/valkey/worker_pool.py): one GLIDE
# sync client per worker thread, single-key fixed-size chunks; what GLIDE 2.x sends on connect,
# as recorded between valkey-glide-sync 2.5 and quilld
GLIDE_HANDSHAKE = [["CLIENT", "SETINFO", "LIB-NAME", "GlidePySync"], ["CLIENT", "SETINFO", "LIB-VER", "0.0.0"],
                   ["INFO", "REPLICATION"]]


class Resp3Connection:
    """A RESP3 connection as GLIDE's: HELLO 3 AUTH, then commands, replies read as RESP3."""

    def __init__(self, port: int, user: str, password: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
        self.file = self.sock.makefile("rb")
        hello = self.call("HELLO", "3", "AUTH", user, password)
        if isinstance(hello, dict):
            assert hello[b"proto"] == 3 and hello[b"role"] == b"master", hello
        self.hello = hello

    def call(self, *args: str | bytes | memoryview):
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a.encode() if isinstance(a, str) else a
            parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
        self.sock.sendmsg([memoryview(p) for p in parts])
        return self.read()

    def read(self):
        line = self.file.readline()
        assert line.endswith(b"\r\n"), f"connection closed: {line!r}"
        kind, rest = line[:1], line[1:-2]
        if kind in b"+":
            return rest
        if kind == b"-":
            return RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"_":
            return None
        if kind in (b"$", b"="):
            data = self.file.read(int(rest) + 2)[:-2]
            return data[4:] if kind == b"=" else data  # a verbatim string starts with its format, "txt:"
        if kind in (b"*", b"~"):
            return [self.read() for _ in range(int(rest))]
        if kind == b"%":
            return {self.read(): self.read() for _ in range(int(rest))}
        raise AssertionError(f"unexpected RESP3 reply {line!r}")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def valkey_credentials(extra: dict) -> tuple[str, str]:
    """(user, password) that GLIDE sends, from LMCache 0.5.6's extra_config: it builds
    ServerCredentials(valkey_username, valkey_password) while GLIDE's signature is
    ServerCredentials(password, username), and an empty user name is `default`."""
    password, user = extra.get("valkey_username", ""), extra.get("valkey_password", "")
    return user or "default", password


def test_lmcache_valkey_recipe(quilld_factory):
    cfg = flat_yaml(recipe("lmcache-valkey"))
    extra = cfg["extra_config"]
    url = urlsplit(cfg["remote_url"])
    assert url.scheme == "valkey" and url.port == 7379 and cfg["save_unfull_chunk"] is False
    assert "save_chunk_meta" not in extra and "valkey_mode" not in extra and "valkey_database" not in extra
    user, password = valkey_credentials(extra)
    q = quilld_factory("--dram", "256MiB", "--requirepass", password)

    # written the natural way round (valkey_username "default", valkey_password the password),
    # LMCache's swap makes GLIDE send AUTH <password> default: refused
    natural = Resp3Connection(q.port, password, "default")
    assert isinstance(natural.hello, RuntimeError) and str(natural.hello).startswith("WRONGPASS"), natural.hello
    natural.close()

    workers = [Resp3Connection(q.port, user, password) for _ in range(extra["valkey_num_workers"])]
    for w in workers:
        assert not isinstance(w.hello, RuntimeError), w.hello
        # CLIENT SETINFO is redis 7.2's; quilld answers as the 7.0.15 it reports, and GLIDE, which
        # sends it to every server, ignores the error (as it does against redis-server 7.0)
        setinfo = [w.call(*c) for c in GLIDE_HANDSHAKE][:2]
        assert all(isinstance(r, RuntimeError) and "unknown subcommand 'SETINFO'" in str(r) for r in setinfo), setinfo
        assert b"role:master" in w.call("INFO", "REPLICATION")
    keys = [engine_key(0, h, world_size=1) for h in chunk_hashes(12, "valkey")]
    data = [kv_chunk(2000 + i) for i in range(len(keys))]

    def fan_out(op, items: list) -> list:
        """The worker pool: item i on thread i % workers, each thread its own connection."""
        results: list = [None] * len(items)

        def run(w: int) -> None:
            for i in range(w, len(items), len(workers)):
                results[i] = op(workers[w], *items[i])

        with ThreadPoolExecutor(len(workers)) as ex:
            for f in [ex.submit(run, w) for w in range(len(workers))]:
                f.result(timeout=IO_TIMEOUT)
        return results

    def get_into(conn: Resp3Connection, key: str, buf: memoryview) -> bool:  # _do_get_into
        value = conn.call("GET", key)
        if value is None or len(value) != len(buf):  # another size is a miss too
            return False
        buf[:] = value
        return True

    def prefix(found: list) -> int:  # _count_consecutive_exists
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    try:
        assert fan_out(lambda c, k, d: c.call("SET", k, d), list(zip(keys[:10], data[:10]))) == [b"OK"] * 10
        assert prefix(fan_out(lambda c, k: c.call("EXISTS", k), [(k,) for k in keys])) == 10
        bufs = [memoryview(bytearray(CHUNK)) for _ in keys]
        assert fan_out(get_into, list(zip(keys, bufs))) == [True] * 10 + [False] * 2
        assert all(bytes(bufs[i]) == data[i] for i in range(10))
        assert workers[0].call("SET", keys[4], b"short") == b"OK"  # not a whole chunk: read as a miss
        assert get_into(workers[1], keys[4], bufs[4]) is False
        assert fan_out(lambda c, k: c.call("DEL", k), [(k,) for k in keys[3:5]]) == [1, 1]
        assert prefix(fan_out(lambda c, k: c.call("EXISTS", k), [(k,) for k in keys])) == 3
        assert workers[0].call("GET", keys[11]) is None  # RESP3 null, as redis-server answers GLIDE
    finally:
        for w in workers:
            w.close()
    assert q.client(password=password).dbsize() == 8


def test_lmcache_valkey_recipe_with_glide(quilld_factory):
    """The same recipe through GLIDE's own sync client, built as LMCache 0.5.6's worker pool builds it."""
    import glide_sync as glide  # the test extra installs valkey-glide-sync: this must run
    cfg = flat_yaml(recipe("lmcache-valkey"))
    extra = cfg["extra_config"]
    user, password = valkey_credentials(extra)
    q = quilld_factory("--dram", "256MiB", "--requirepass", password)
    local = threading.local()

    def client(username: str = extra["valkey_username"], passwd: str = extra["valkey_password"]):
        c = getattr(local, "client", None)
        if c is None:
            config = glide.GlideClientConfiguration(
                addresses=[glide.NodeAddress("127.0.0.1", q.port)], request_timeout=5000, use_tls=False,
                advanced_config=glide.AdvancedGlideClientConfiguration(connection_timeout=10000),
                credentials=glide.ServerCredentials(username, passwd))  # LMCache's argument order
            c = local.client = glide.GlideClient.create(config)
        return c

    with pytest.raises(Exception, match="WRONGPASS"):  # the natural order of the two settings
        glide.GlideClient.create(glide.GlideClientConfiguration(
            addresses=[glide.NodeAddress("127.0.0.1", q.port)], request_timeout=5000,
            advanced_config=glide.AdvancedGlideClientConfiguration(connection_timeout=10000),
            credentials=glide.ServerCredentials(user, password)))
    keys = [engine_key(1, h, world_size=2) for h in chunk_hashes(10, "glide")]
    data = [kv_chunk(3000 + i) for i in range(len(keys))]

    def get_into(key: str) -> bytes | None:
        scratch = getattr(local, "scratch", None) or bytearray(CHUNK)
        local.scratch = scratch
        n = client().get(key.encode(), buffer=memoryview(scratch))
        return None if n is None or int(n) != CHUNK else bytes(scratch)

    with ThreadPoolExecutor(extra["valkey_num_workers"]) as ex:
        list(ex.map(lambda kd: client().set(kd[0].encode(), kd[1]), zip(keys[:8], data[:8]), timeout=IO_TIMEOUT))
        found = list(ex.map(lambda k: bool(client().exists([k.encode()])), keys, timeout=IO_TIMEOUT))
        assert found == [True] * 8 + [False] * 2
        got = list(ex.map(get_into, keys, timeout=IO_TIMEOUT))
        assert got[:8] == data[:8] and got[8:] == [None, None]
        assert sum(ex.map(lambda k: int(client().delete([k.encode()])), keys[:2], timeout=IO_TIMEOUT)) == 2
        for _ in range(extra["valkey_num_workers"]):
            ex.submit(lambda: client().close()).result(timeout=IO_TIMEOUT)
    assert q.client(password=password).dbsize() == 6


def test_lmcache_resp_miss_hangs_on_redis_server_as_on_quilld(quilld_factory, redis_server):
    """LMCache 0.5.6's resp:// client reads a GET reply header as a fixed len(b"$<chunk>\\r\\n") bytes.
    A miss is 5 bytes on both servers: the read waits for bytes that never come, and the
    connection cannot be used again (its stream is out of step)."""
    header = b"$%d\r\n" % CHUNK
    seen = {}
    q = quilld_factory("--dram", "256MiB")
    for name, port in (("quilld", q.port), ("redis-server", redis_server)):
        with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as s:
            chunk = kv_chunk(7)
            s.sendall(b"*3\r\n$3\r\nSET\r\n$3\r\nhit\r\n" + header + chunk + b"\r\n")
            assert s.recv(5) == b"+OK\r\n"
            s.sendall(b"*2\r\n$3\r\nGET\r\n$4\r\nmiss\r\n")
            got = b""
            s.settimeout(1.0)
            with pytest.raises(socket.timeout):  # the fixed-length header read never completes
                while len(got) < len(header):
                    more = s.recv(len(header) - len(got))
                    assert more, f"{name} closed the connection"
                    got += more
            assert got == b"$-1\r\n", (name, got)
            # the next command's reply completes that read: a header no parser can take
            s.settimeout(IO_TIMEOUT)
            s.sendall(b"*2\r\n$3\r\nGET\r\n$3\r\nhit\r\n")
            while len(got) < len(header):
                got += s.recv(len(header) - len(got))
            seen[name] = got
    assert seen["quilld"] == seen["redis-server"] == b"$-1\r\n" + header[:len(header) - 5], seen


# ---------------------------------------------------------------------------
# vLLM --kv-events-config
# ---------------------------------------------------------------------------

class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass
class VllmPublisher:
    """What ZmqEventPublisher does on the wire: PUB (topic, seq, payload), a replay ROUTER, a bounded buffer."""

    pub_port: int
    replay_port: int
    topic: bytes
    buffer_steps: int
    ctx: zmq.Context = field(default_factory=zmq.Context)
    requests: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, *events: KVCacheEvent, drop: bool = False) -> int:
        """One batch; `drop` keeps it out of the PUB socket (as past the HWM) but in the replay buffer."""
        payload = self.encoder.encode(KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0))
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            if not drop:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))
        return seq

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.replay.poll(50):
                continue
            client_id, _, start = self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            with self.lock:
                held = [(s, p) for s, p in self.buffer if s >= first]
            for s, p in held:
                self.replay.send_multipart((client_id, b"", s.to_bytes(8, "big"), p))
            self.replay.send_multipart((client_id, b"", END_SEQ, b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.close()
        self.replay.close()
        self.ctx.term()


def _vllm_engine(quilld_factory, tmp_path, engine_recipe: str):
    """quilld configured with the [[engines]] entry of `engine_recipe`, fed by a vLLM-style publisher."""
    kv = json.loads(recipe("vllm-kv-events"))
    assert kv["enable_kv_cache_events"] and kv["publisher"] == "zmq"
    assert "*" in kv["endpoint"], "vLLM binds its PUB socket only for a wildcard endpoint"
    engine = tomllib.loads(recipe(engine_recipe))["engines"][0]
    pub_port, replay_port = free_port(), free_port()
    for name, port, vllm_side in (("kv_events", pub_port, kv["endpoint"]), ("replay", replay_port,
                                                                          kv["replay_endpoint"])):
        assert engine[name].rsplit(":", 1)[1] == vllm_side.rsplit(":", 1)[1], f"{name} port differs from vLLM's"
        engine[name] = f"tcp://127.0.0.1:{port}"
    lines = ["[[engines]]"] + [f"{k} = {_toml(v)}" for k, v in engine.items()]
    conf = tmp_path / "engines.toml"
    conf.write_text("\n".join(lines) + "\n")
    publisher = VllmPublisher(pub_port, replay_port, kv["topic"].encode(), kv["buffer_steps"])
    try:
        q = quilld_factory("--dram", "64MiB", "--config", str(conf))
        with QuillClient("127.0.0.1", q.port).scope(engine["model"], "") as client:
            yield publisher, client, engine, q
    finally:
        publisher.close()


def _toml(value: Any) -> str:
    """A value of an [[engines]] table written back as TOML (strings, ints, lists of inline tables)."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@pytest.fixture
def vllm_engine(quilld_factory, tmp_path):
    """quilld configured with the recipe's [[engines]] entry, fed by a vLLM-style publisher."""
    yield from _vllm_engine(quilld_factory, tmp_path, "quilld-engines")


@pytest.fixture
def vllm_hybrid_engine(quilld_factory, tmp_path):
    """quilld configured with the hybrid recipe's [[engines]] entry, fed by a vLLM-style publisher."""
    yield from _vllm_engine(quilld_factory, tmp_path, "quilld-hybrid-engine")


def stored(hashes: list, parent=None, block_size: int = 16) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(range(block_size * len(hashes))), block_size=block_size, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")


def join(publisher: VllmPublisher, q, *events: KVCacheEvent) -> None:
    """Beat ZMQ's slow joiner: publish (new sequence numbers each time) until quilld has a batch."""
    r = q.client()
    assert wait_until(lambda: publisher.publish(*events) is not None and r.info("router")["kv_batches"] > 0,
                      timeout=10, interval=0.1), "no KV event batch reached quilld"


def test_vllm_kv_events_route_and_locate(vllm_engine):
    publisher, client, engine, q = vllm_engine
    blocks = [2**64 - 11, 17, 2**63 + 5, 42]  # vLLM's default: 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    hit = f"hit:{engine['id']}:hbm"
    join(publisher, q, stored(blocks[:2]))
    publisher.publish(stored(blocks[2:], parent=blocks[1]))
    assert wait_until(lambda: client.route(blocks=blocks + [99])["plan"][3] == hit, timeout=5)
    d = client.route(blocks=blocks + [99])
    assert d["engine"] == engine["id"] and d["url"] == engine["url"]
    assert d["plan"] == [hit] * 4 + ["recompute"]
    where = client.locate(str(blocks[0]))[0]
    assert any(p["node"] == engine["id"] and p["tier"] == "hbm" for p in where)
    raw = [hashlib.sha256(b"block-%d" % i).digest() for i in range(3)]  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    publisher.publish(stored(raw))
    assert wait_until(lambda: client.route(blocks=raw)["plan"] == [hit] * 3, timeout=5)
    assert client.locate(raw[0])[0][0]["node"] == engine["id"]
    publisher.publish(BlockRemoved(block_hashes=blocks[2:], medium="GPU", group_idx=0))
    assert wait_until(lambda: client.route(blocks=blocks)["plan"] == [hit] * 2 + ["recompute"] * 2, timeout=5)
    publisher.publish(AllBlocksCleared())
    assert wait_until(lambda: client.route(blocks=raw)["plan"] == ["recompute"] * 3, timeout=5)
    assert client.locate(str(blocks[0])) == [[]]


def test_vllm_hybrid_recipe(vllm_hybrid_engine):
    """The hybrid recipe (full attention and a 1024-token sliding window, 16 tokens a block: the
    window reads the last 64 blocks): vLLM 0.33's per-group events, ROUTE over RESP and POST
    /v1/route credit the prefix vLLM would hit, block for block alike."""
    publisher, client, engine, q = vllm_hybrid_engine
    groups = engine["groups"]
    assert [g["kind"] for g in groups] == ["full", "sliding_window"] and engine["block_size"] == 16
    window = -(-(groups[1]["window_tokens"] - 1) // engine["block_size"])
    assert window == 64
    prompt = list(range(1000, 1080))  # 80 blocks
    hit = f"hit:{engine['id']}:hbm"

    def group_stored(hashes: list, g: int) -> BlockStored:
        spec = groups[g]
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
                           block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=g,
                           kv_cache_spec_kind={"full": "full_attention"}.get(spec["kind"], spec["kind"]),
                           kv_cache_spec_sliding_window=spec.get("window_tokens"))

    join(publisher, q, group_stored(prompt, 0), group_stored(prompt, 1))
    # the window group evicts blocks that left its window: 0..15 are not read for a hit at 80
    publisher.publish(BlockRemoved(block_hashes=prompt[:16], medium="GPU", group_idx=1))
    # a prompt of 70 blocks needs the window 6..69: blocks 6..15 are gone, and so is every shorter window.
    # Wait on this, not on the 80-block plan: that one is all hits before the removal lands too.
    assert wait_until(lambda: client.route(blocks=prompt[:70])["plan"] == ["recompute"] * 70, timeout=5)
    assert client.route(blocks=prompt)["plan"] == [hit] * 80
    admin = q.admin_headers() | {"Content-Type": "application/json"}
    for blocks in (prompt, prompt[:70], prompt + [7, 8]):
        resp = client.route(blocks=blocks)
        req = urllib.request.Request(f"http://127.0.0.1:{q.admin_port}/v1/route", method="POST", headers=admin,
                                     data=json.dumps({"model": engine["model"], "blocks": blocks}).encode())
        with urllib.request.urlopen(req, timeout=IO_TIMEOUT) as r:
            body = json.loads(r.read())
        assert [f"{s['action']}:{s['holder']}:{s['tier']}" if s["action"] != "recompute" else "recompute"
                for s in body["plan"]] == resp["plan"]
        assert body["candidates"][0]["overlap_blocks"] == resp["plan"].count(hit)
    # the groups go with the engine through the admin API
    req = urllib.request.Request(f"http://127.0.0.1:{q.admin_port}/v1/engines", headers=admin)
    with urllib.request.urlopen(req, timeout=IO_TIMEOUT) as r:
        listed = json.loads(r.read())["engines"][0]
    assert listed["groups"] == [{"kind": "full", "window_tokens": 0}, groups[1]]
    assert listed["feed"]["groups"] == {"0": "full_attention", "1": "sliding_window(1024)"}


def test_vllm_kv_events_replay_fills_a_gap(vllm_engine):
    publisher, client, engine, q = vllm_engine
    join(publisher, q, stored([1, 2]))
    # quilld also asks the replay socket when it connects and when the feed goes quiet (issue 12):
    # count from here; it asks from the last batch it applied, to check that it is the same one
    requests, replays = len(publisher.requests), q.client().info("router")["kv_zmq_replays"]
    gap_from = publisher.seq - 1
    publisher.publish(stored([3, 4], parent=2), drop=True)  # lost on the PUB socket, still in vLLM's buffer
    publisher.publish(stored([5], parent=4), drop=True)
    publisher.publish(stored([6], parent=5))
    want = [f"hit:{engine['id']}:hbm"] * 6
    assert wait_until(lambda: client.route(blocks=[1, 2, 3, 4, 5, 6])["plan"] == want, timeout=8)
    info = q.client().info("router")
    assert info["kv_zmq_replays"] == replays + 1 and info["kv_gaps"] == 0
    assert publisher.requests[requests] == gap_from
