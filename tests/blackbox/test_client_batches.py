"""The client's batch calls SGLang's backend rests on, end to end against a real quilld: a block
stored from a list of buffers and read into one (`quillclient.segments`), over shared memory and
over TCP, and `get_many_into` over shared memory pipelining its SHM GET batches."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from quillclient import BufferTooSmall, QuillClient, shm

from conftest import wait_until

PASSWORD = "batch-secret"


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="qb", dir="/tmp")  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_node(quilld_factory, sock_dir: str):
    """A quilld with a password, on a unix socket that lets `default` map its arena."""
    path = os.path.join(sock_dir, "q.sock")
    q = quilld_factory("--dram", "256MiB", "--requirepass", PASSWORD, "--unixsocket", path, "--map-users", "default")
    assert wait_until(lambda: os.path.exists(path), timeout=10)
    return q


@pytest.fixture(params=["shm", "tcp"])
def transport(request) -> str:
    return request.param


def test_put_blocks_gathers_and_get_many_into_scatters(quilld_factory, sock_dir, transport):
    """The client calls the v1 path rests on: a list of buffers stored as one block (their
    concatenation), and a block read into a list of buffers, over shared memory and over TCP."""
    q, password = start_node(quilld_factory, sock_dir), PASSWORD
    mode = {"shm": "require", "tcp": "off"}[transport]
    with QuillClient("127.0.0.1", q.port, password=password, shared_memory=mode, verify_crc=True) as c:
        assert c.transport == transport
        rng = np.random.default_rng(7)
        parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4095, 70_000, 1 << 20)]
        whole = np.concatenate(parts)
        assert c.put_blocks([("gathered", parts), ("whole", whole)]) == [True, True]
        assert c.get("gathered") == whole.tobytes()
        outs, plain, tiny = [np.zeros_like(p) for p in parts], np.zeros_like(whole), np.zeros(3, np.uint8)
        assert c.get_many_into(["whole", "missing", "gathered"], [outs, tiny, plain]) == [whole.nbytes, -1,
                                                                                         whole.nbytes]
        assert all(np.array_equal(o, p) for o, p in zip(outs, parts)) and np.array_equal(plain, whole)
        # a shorter block fills the buffers from the first; a longer one writes nothing
        c.put("short", whole[:5000])
        outs = [np.zeros_like(p) for p in parts]
        assert c.get_many_into(["short"], [outs]) == [5000]
        got = np.concatenate(outs)
        assert np.array_equal(got[:5000], whole[:5000]) and not got[5000:].any()
        small = (np.zeros(10, np.uint8), np.zeros(10, np.uint8))
        with pytest.raises(BufferTooSmall):
            c.get_many_into(["gathered"], [small])
        assert not small[0].any() and not small[1].any()
        assert c.put_blocks([("gathered", parts[3:])]) == [False]  # complete already: kept
        assert c.get("gathered") == whole.tobytes()


def test_get_many_into_over_shared_memory_pipelines_batches_and_releases_every_lease(quilld_factory, sock_dir):
    """get_many_into sends a batch's SHM GET before copying the one before it (an SGLang batch of
    128 pages is two): every page lands, a miss or a too-small buffer in either batch is reported
    as before, every lease is released, and the connection stays usable."""
    q, password = start_node(quilld_factory, sock_dir), PASSWORD
    n = 2 * shm.GET_BATCH + 5
    rng = np.random.default_rng(9)
    blocks = [rng.integers(0, 256, 20_000 + 97 * i, dtype=np.uint8) for i in range(n)]
    with QuillClient("127.0.0.1", q.port, password=password, shared_memory="require") as c:
        c.put_blocks([(f"p{i}", b) for i, b in enumerate(blocks) if i % 50 != 7])  # 7, 57, 107: misses
        outs = [np.zeros(b.nbytes, np.uint8) for b in blocks]
        got = c.get_many_into([f"p{i}" for i in range(n)], outs)
        assert got == [-1 if i % 50 == 7 else b.nbytes for i, b in enumerate(blocks)]
        assert all(np.array_equal(o, b) for i, (o, b) in enumerate(zip(outs, blocks)) if i % 50 != 7)
        outs = [np.zeros(b.nbytes, np.uint8) for b in blocks]
        outs[shm.GET_BATCH + 3] = np.zeros(10, np.uint8)  # too small, in the second batch
        with pytest.raises(BufferTooSmall) as e:
            c.get_many_into([f"p{i}" for i in range(n)], outs)
        assert e.value.results[shm.GET_BATCH + 3] is None and e.value.results[-1] == blocks[-1].nbytes
        assert np.array_equal(outs[-1], blocks[-1]) and not outs[shm.GET_BATCH + 3].any()
        assert c.get_many_into(["p0"], [np.zeros(blocks[0].nbytes, np.uint8)]) == [blocks[0].nbytes]
        with QuillClient("127.0.0.1", q.port, password=password, shared_memory="off") as tcp:
            assert wait_until(lambda: tcp.execute("INFO", "shm").get("shm_leases_live") == 0, timeout=10)
