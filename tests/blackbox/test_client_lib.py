"""The Python client library (clients/python, `quillclient`) against real quilld processes.

Values are written or checked with plain redis-py where that keeps the client
under test from vouching for itself. Covered: get_into at page and size edges
into bytearray / numpy / mmap, buffers larger and smaller than the block,
misses; pipelined get_many_into; put_blocks (chunked parallel DATA, EXISTS,
the server's CRC32C check); typed errors (auth, NOHANDLE, INCOMPLETE, CHECKSUM,
OOM); timeouts; reconnection to a quilld restarted on the same port; scope
isolation across pooled connections.
"""

from __future__ import annotations

import mmap
import os
import random
import socket
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np
import pytest
import redis

from conftest import ROOT, free_port, start_quilld, stop_process, wait_port

try:
    import quillclient  # noqa: F401  (installed: pip install -e clients/python)
except ImportError:  # not installed: test the source tree; its dependencies are quilld's own
    sys.path.insert(0, str(ROOT / "clients" / "python"))
from quillclient import (AuthError, BufferTooSmall, ChecksumMismatch, CommandError, Incomplete,  # noqa: E402
                         NoAuth, NoHandle, NotFound, OutOfMemory, QuillClient, QuillConnectionError, QuillTimeout,
                         WrongPass)

MiB = 1024 * 1024
SENTINEL = 0xA5


def pattern(size: int, seed: int = 0) -> bytes:
    return random.Random(size * 7919 + seed).randbytes(size)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    q = start_quilld(tmp_path_factory.mktemp("quilld"), "--dram", "512MiB", admin=False)
    yield q
    stop_process(q.proc)


@pytest.fixture
def ref(server):
    """Plain redis-py: the reference writer and reader. Starts each test from an empty keyspace."""
    r = server.client(single_connection_client=True)
    r.flushall()
    yield r
    assert server.proc.poll() is None, f"quilld exited:\n{server.log()}"
    info = r.info()
    assert (info["put2phase_open"], info["dram_reserved_blocks"]) == (0, 0), "a put was left open"
    r.close()


@pytest.fixture
def qc(server):
    c = QuillClient("127.0.0.1", server.port, socket_timeout=30)
    yield c
    c.close()


def make_buffer(kind: str, size: int):
    """A writable buffer of `size` bytes, filled with SENTINEL; (buffer, read-back function)."""
    if kind == "bytearray":
        buf = bytearray([SENTINEL]) * size
        return buf, lambda: bytes(buf)
    if kind == "numpy":
        arr = np.full(size, SENTINEL, dtype=np.uint8)
        return arr, arr.tobytes
    if kind == "mmap":
        m = mmap.mmap(-1, size)
        m.write(bytes([SENTINEL]) * size)
        return m, lambda: m[:]
    raise AssertionError(kind)


def test_a_host_port_or_option_given_beside_a_config_is_not_ignored(ref, server):
    from quillclient import ClientConfig
    cfg = ClientConfig(shared_memory="off", socket_timeout=7)
    c = QuillClient("127.0.0.1", server.port, config=cfg)  # the config's port (7379) was used, silently
    try:
        assert (c.config.port, c.config.shared_memory, c.config.socket_timeout) == (server.port, "off", 7)
        c.put_blocks({"beside": b"v" * 100})
        assert ref.get("beside") == b"v" * 100
    finally:
        c.close()
    assert QuillClient(config=cfg, socket_timeout=3).config.socket_timeout == 3
    assert QuillClient().config.port == 7379
    with pytest.raises(TypeError, match="bogus"):
        QuillClient(config=cfg, bogus=1)


# -- get_into -----------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, MiB, 16 * MiB + 3, 64 * MiB])
def test_get_into_exact_and_larger_buffers(ref, qc, size):
    data = pattern(size)
    ref.set("blk", data)
    for kind in ("bytearray", "numpy", "mmap"):
        if size > 0 or kind != "mmap":  # an anonymous mmap cannot be empty
            buf, read = make_buffer(kind, size)
            assert qc.get_into("blk", buf) == size, kind
            assert read() == data, kind
        spare = 4099
        buf, read = make_buffer(kind, size + spare)
        assert qc.get_into(b"blk", buf) == size, kind
        got = read()
        assert got[:size] == data, kind
        assert got[size:] == bytes([SENTINEL]) * spare, f"{kind}: bytes past the block were written"
    assert qc.raw_sockets_opened == 1, "every read should have reused one pooled socket"


def test_get_into_typed_numpy_view_and_memoryview_slice(ref, qc):
    data = pattern(8192, 1)
    ref.set("blk", data)
    halves = np.zeros(4096, dtype=np.float16)  # 8192 bytes, not uint8: taken as raw bytes
    assert qc.get_into("blk", halves) == 8192
    assert halves.tobytes() == data
    backing = bytearray(3 * 8192)
    assert qc.get_into("blk", memoryview(backing)[8192:16384]) == 8192
    assert backing[8192:16384] == data and backing[:8192] == bytes(8192) and backing[16384:] == bytes(8192)
    with pytest.raises(TypeError, match="read-only"):
        qc.get_into("blk", bytes(8192))


def test_get_into_miss_raises_not_found_and_empty_value_is_not_a_miss(ref, qc):
    buf = bytearray(b"x" * 16)
    with pytest.raises(NotFound) as e:
        qc.get_into("absent", buf)
    assert e.value.key == "absent" and buf == b"x" * 16
    assert qc.get("absent") is None
    ref.set("empty", b"")
    assert qc.get_into("empty", buf) == 0
    assert qc.get("empty") == b""


@pytest.mark.parametrize("size,drained", [(MiB, True), (16 * MiB + 3, False)])
def test_get_into_buffer_too_small_leaves_the_client_usable(ref, qc, size, drained):
    """Up to drain_max (8 MiB) the payload is read and dropped on the same socket; above, the socket goes."""
    data = pattern(size, 2)
    ref.set("big", data)
    ref.set("after", b"next value")
    small, read = make_buffer("numpy", size - 1)
    with pytest.raises(BufferTooSmall) as e:
        qc.get_into("big", small)
    assert (e.value.needed, e.value.size) == (size, size - 1)
    assert read() == bytes([SENTINEL]) * (size - 1), "a refused read must not write into the buffer"
    buf = bytearray(64)
    assert qc.get_into("after", buf) == 10 and buf[:10] == b"next value"
    assert qc.raw_sockets_opened == (1 if drained else 2)
    full = bytearray(size)
    assert qc.get_into("big", full) == size and full == data


def test_get_many_into_pipelined_with_misses_and_small_windows(ref, server):
    rng = random.Random(5)
    keys, values = [], {}
    for i in range(300):
        key = f"k{i}"
        keys.append(key)
        if i % 7 == 3:
            continue  # a miss
        values[key] = pattern(rng.choice([0, 1, 100, 4096, 20000, 70000, 300000]), i)
    ref.mset(values)
    with QuillClient("127.0.0.1", server.port, pipeline_window=16) as qc:
        bufs = [np.full(len(values.get(k, b"")) + 3, SENTINEL, np.uint8) for k in keys]
        got = qc.get_many_into(keys, bufs)
        assert got == [len(values[k]) if k in values else -1 for k in keys]
        for k, b in zip(keys, bufs):
            n = len(values.get(k, b""))
            assert b[:n].tobytes() == values.get(k, b"") and b[n:].tobytes() == bytes([SENTINEL]) * 3, k
        assert qc.raw_sockets_opened == 1


def test_get_many_into_reads_every_reply_when_one_buffer_is_too_small(ref, qc):
    vals = [pattern(50000, i) for i in range(5)]
    ref.mset({f"k{i}": v for i, v in enumerate(vals)})
    bufs = [bytearray(50000) for _ in range(5)]
    bufs[2] = bytearray(10)
    with pytest.raises(BufferTooSmall) as e:
        qc.get_many_into([f"k{i}" for i in range(5)], bufs)
    assert (e.value.index, e.value.needed) == (2, 50000)
    assert e.value.results == [50000, 50000, None, 50000, 50000]
    assert [bytes(b) for i, b in enumerate(bufs) if i != 2] == [v for i, v in enumerate(vals) if i != 2]
    assert qc.get_many_into(["k4", "nope"], [bytearray(50000), bytearray(1)]) == [50000, -1]
    assert qc.raw_sockets_opened == 1


# -- put ----------------------------------------------------------------------

def test_put_from_numpy_and_ttl(ref, qc):
    arr = np.frombuffer(pattern(3 * MiB, 3), dtype=np.uint8).reshape(3, MiB)
    qc.put("arr", arr)
    assert ref.get("arr") == arr.tobytes()
    qc.put("short", b"v", ttl=30)
    assert 0 < ref.pttl("short") <= 30000
    assert qc.exists("arr") and not qc.exists("nope")
    assert qc.delete("arr", "short", "nope") == 2
    assert not qc.exists("arr")


def test_put_blocks_64mib_and_many_small_in_parallel_chunks(ref, server):
    rng = random.Random(9)
    items = {"huge": pattern(64 * MiB, 4)}
    for i in range(200):
        items[f"small:{i}"] = pattern(rng.randrange(0, 70000), i)
    with QuillClient("127.0.0.1", server.port, chunk_size=MiB, parallelism=4) as qc:
        assert qc.put_blocks(items) == [True] * len(items)
        put_conns = [line for line in qc.execute("CLIENT", "LIST").decode().splitlines() if "cmd=put2phase" in line]
        assert len(put_conns) >= 2, "DATA chunks were not spread over several connections"
    for key, value in items.items():
        assert ref.execute_command("GETBLK", key) == value, key
    assert ref.info()["put2phase_committed"] >= len(items)


def test_put_blocks_skips_complete_keys(ref, qc):
    first = {"a": pattern(100000, 1), "b": pattern(10, 2)}
    assert qc.put_blocks(first) == [True, True]
    second = [("a", pattern(100000, 3)), ("b", b"other"), ("c", pattern(5 * MiB, 4))]
    assert qc.put_blocks(second, chunk_size=MiB) == [False, False, True]
    assert ref.get("a") == first["a"] and ref.get("b") == first["b"]
    assert ref.get("c") == second[2][1]


@pytest.mark.parametrize("chunk_size", [MiB, 4 * MiB])  # parallel lanes; one pipeline for a small round
def test_put_blocks_checksum_is_checked_by_the_server(ref, qc, monkeypatch, chunk_size):
    wrong = types.SimpleNamespace(crc32c=lambda data: (crc32c.crc32c(data) + 1) & 0xFFFFFFFF)
    monkeypatch.setattr("quillclient.blocks.crc32c", wrong)
    with pytest.raises(ChecksumMismatch):
        qc.put_blocks({"x": pattern(2 * MiB, 5), "y": b"tiny"}, chunk_size=chunk_size)
    assert ref.exists("x", "y") == 0
    assert ref.info()["put2phase_open"] == 0, "the refused puts must be aborted"


def test_raw_put2phase_errors_are_typed(ref, qc):
    data = pattern(100000, 6)
    handle = qc.execute("PUT2PHASE", "BEGIN", "raw", len(data))
    qc.execute("PUT2PHASE", "DATA", handle, 0, data[:50000])
    with pytest.raises(Incomplete):
        qc.execute("PUT2PHASE", "COMMIT", handle, "CRC32C", crc32c.crc32c(data))
    qc.execute("PUT2PHASE", "DATA", handle, 50000, data[50000:])
    with pytest.raises(ChecksumMismatch):
        qc.execute("PUT2PHASE", "COMMIT", handle, "CRC32C", crc32c.crc32c(data) ^ 1)
    assert qc.execute("PUT2PHASE", "COMMIT", handle, "CRC32C", crc32c.crc32c(data)) == b"OK"
    assert ref.get("raw") == data
    with pytest.raises(NoHandle):
        qc.execute("PUT2PHASE", "DATA", "0123456789abcdef01234567", 0, b"x")
    with pytest.raises(NoHandle):
        qc.execute("PUT2PHASE", "COMMIT", handle)  # already committed
    with pytest.raises(CommandError, match="unknown command"):
        qc.execute("NOSUCHCOMMAND")


# -- typed errors from other servers -----------------------------------------------

def test_auth_errors(quilld_factory):
    q = quilld_factory("--requirepass", "s3cret", admin=False)
    bad = QuillClient("127.0.0.1", q.port, password="wrong")
    none = QuillClient("127.0.0.1", q.port)
    good = QuillClient("127.0.0.1", q.port, password="s3cret")
    admin = redis.Redis(port=q.port, password="s3cret")
    try:
        failures = admin.info()["auth_failures"]
        with pytest.raises(WrongPass):
            bad.put("k", b"v")
        with pytest.raises(AuthError):
            bad.get_into("k", bytearray(8))
        assert admin.info()["auth_failures"] == failures + 2, "a refused password must not be retried"
        with pytest.raises(NoAuth):
            none.get("k")
        with pytest.raises(NoAuth):
            none.get_into("k", bytearray(8))
        good.put("k", b"v")
        assert good.get_into("k", buf := bytearray(8)) == 1 and buf[:1] == b"v"
        assert good.put_blocks({"b": pattern(40000)}) == [True]
    finally:
        for c in (bad, none, good, admin):
            c.close()


def test_out_of_memory_on_a_tiny_arena(quilld_factory):
    q = quilld_factory("--dram", "1MiB", admin=False)
    with QuillClient("127.0.0.1", q.port) as qc:
        with pytest.raises(OutOfMemory):
            qc.put("big", pattern(4 * MiB))
        with pytest.raises(OutOfMemory):
            qc.put_blocks({"fits": pattern(1000), "big": pattern(4 * MiB)})
        assert not qc.exists("fits") and not qc.exists("big")
        assert qc.put_blocks({"fits": pattern(1000)}) == [True]
        assert redis.Redis(port=q.port).info()["put2phase_open"] == 0


class ScriptedPeer:
    """A loopback TCP peer that answers each connection's requests as told: connection i gets
    `script[i]` (the last entry repeats) after every request it sends; None closes it instead."""

    def __init__(self, script: list[bytes | None]) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            answer = self.script[min(self.connections, len(self.script) - 1)]
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn, answer), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, answer: bytes | None) -> None:
        conn.settimeout(0.1)
        with conn:
            while not self._stop.is_set():
                try:
                    if not conn.recv(65536):
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
                if answer is None:
                    return
                conn.sendall(answer)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self.listener.close()


def test_get_into_retries_once_on_a_fresh_socket():
    peer = ScriptedPeer([None, b"$5\r\nhello\r\n"])  # the first connection drops mid-request
    try:  # the scripted peer speaks GETBLK only: no shared-memory discovery (SHM HELLO) on it
        with QuillClient("127.0.0.1", peer.port, shared_memory="off") as qc:
            buf = bytearray(8)
            assert qc.get_into("k", buf) == 5 and buf[:5] == b"hello"
            assert (qc.raw_sockets_opened, peer.connections) == (2, 2)
    finally:
        peer.close()
    peer = ScriptedPeer([None])  # every connection drops: one retry, then the error
    try:
        with QuillClient("127.0.0.1", peer.port, shared_memory="off") as qc:
            with pytest.raises(QuillConnectionError):
                qc.get_into("k", bytearray(8))
            assert peer.connections == 2
            with pytest.raises(QuillConnectionError):
                qc.get_many_into(["a", "b"], [bytearray(8), bytearray(8)])
            assert peer.connections == 4
    finally:
        peer.close()


def test_timeouts_are_typed():
    peer = ScriptedPeer([b""])  # accepts, reads, never answers
    try:
        with QuillClient("127.0.0.1", peer.port, socket_timeout=0.3, retries=0) as qc:
            for call in (lambda: qc.get_into("k", bytearray(4)), lambda: qc.get("k")):
                t0 = time.monotonic()
                with pytest.raises(QuillTimeout):
                    call()
                assert 0.25 < time.monotonic() - t0 < 3
    finally:
        peer.close()


# -- reconnection -------------------------------------------------------------------

def spawn_quilld(port: int, log_path) -> subprocess.Popen:
    """quilld on a given port (conftest's start_quilld picks its own), as conftest starts it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = str(ROOT)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(port),
                                 "--admin-port", "0", "--dram", "256MiB"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_port(port, proc)
    except Exception:
        stop_process(proc)
        raise
    return proc


def test_same_client_works_after_quilld_restarts_on_the_same_port(tmp_path):
    port = free_port()
    proc = spawn_quilld(port, tmp_path / "quilld.log")
    qc = QuillClient("127.0.0.1", port, retries=2, backoff_base=0.01, backoff_cap=0.05)
    scoped = qc.scope("llama-3-8b", "llama3-tok")
    try:
        for c in (qc, scoped):
            c.put("before", b"1")
            assert c.get_into("before", bytearray(4)) == 1
        assert scoped.put_blocks({"blk": pattern(3 * MiB)}, chunk_size=MiB) == [True]

        stop_process(proc)
        with pytest.raises(QuillConnectionError):
            qc.get_into("before", bytearray(4))
        with pytest.raises(QuillConnectionError):
            qc.get("before")

        proc = spawn_quilld(port, tmp_path / "quilld.log")
        assert qc.get("before") is None  # a new process: the DRAM tier starts empty
        with pytest.raises(NotFound):
            qc.get_into("before", bytearray(4))
        data = pattern(5 * MiB, 1)
        qc.put("after", data)
        buf = np.empty(5 * MiB, np.uint8)
        assert qc.get_into("after", buf) == len(data) and buf.tobytes() == data
        assert qc.get_many_into(["after", "x"], [buf, bytearray(1)]) == [len(data), -1]
        # the scoped client's new connections carry its scope again, in both pools
        assert scoped.put_blocks({"blk": pattern(3 * MiB, 2)}, chunk_size=MiB) == [True]
        assert not qc.exists("blk") and scoped.get("after") is None
        assert scoped.get_into("blk", bytearray(3 * MiB)) == 3 * MiB
        with pytest.raises(NotFound):
            scoped.get_into("after", buf)
    finally:
        qc.close()
        scoped.close()
        stop_process(proc)


# -- scopes -------------------------------------------------------------------------

def test_scopes_are_isolated_across_pooled_connections(ref, server):
    base = QuillClient("127.0.0.1", server.port, max_connections=8, parallelism=2)
    a = base.scope("llama-3-8b", "llama3-tok")
    b = base.scope("qwen-2", "qwen-tok", adapter="lora-7")
    try:
        a.put("shared", b"from a")
        b.put("shared", b"from b")
        assert base.get("shared") is None and ref.get("shared") is None
        assert a.put_blocks({"blk": pattern(2 * MiB, 1)}, chunk_size=256 * 1024) == [True]
        assert b.put_blocks({"blk": pattern(2 * MiB, 2)}, chunk_size=256 * 1024) == [True], \
            "b saw a's block as EXISTS"
        assert not base.exists("blk")

        def check(i: int) -> None:
            c, want = (a, b"from a") if i % 2 else (b, b"from b")
            buf = bytearray(16)
            for _ in range(20):
                assert c.get("shared") == want
                assert buf[:c.get_into("shared", buf)] == want
            assert c.get_many_into(["blk"], [bytearray(2 * MiB)]) == [2 * MiB]

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(check, range(16)))
        got = bytearray(2 * MiB)
        a.get_into("blk", got)
        assert got == pattern(2 * MiB, 1)
        b.get_into("blk", got)
        assert got == pattern(2 * MiB, 2)
        assert [r[0]["bytes"] for r in a.locate("blk", "shared")] == [2 * MiB, 6]
        assert base.locate("blk") == [[]]
    finally:
        for c in (a, b):
            c.delete("shared", "blk")
            c.close()
        base.close()
