"""Batched block commands (issue 22, item 2): many blocks in one command, one dispatch.

- `MPUTBLK key crc32c bytes [...]`: every block received into its own arena block, checked and
  published; per block OK, EXISTS or its error. quillclient's put_blocks over TCP sends one per round.
- `MGET`: quillclient's get_many_into over TCP reads a window of keys with one command.
- `SHM RESERVE` / `SHM COMMIT`: the in-place form, two commands for a whole round over shared memory;
  and reads over shared memory find their blocks in the lookup table without asking quilld at all.

What is counted is what quilld dispatched (INFO commandstats), and what the blocks read back as.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import crc32c
import numpy as np
import pytest
import redis
from quillclient import OutOfMemory, QuillClient

from conftest import start_quilld, wait_until

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="qb", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _node(tmp_path, sock_dir, nodes, *extra):
    path = os.path.join(sock_dir, "q.sock")
    q = start_quilld(tmp_path, "--unixsocket", path, "--map-users", "default", *extra, admin=False,
                     env={"QUILLD_SERVER_SPACE_WAIT_MS": "0"})  # a write short of room fails at once
    nodes.append(q)
    assert wait_until(lambda: os.path.exists(path), timeout=10)
    return q, path


def calls(r: redis.Redis) -> dict[str, int]:
    """Commands quilld dispatched so far, by name (INFO commandstats)."""
    return {k[len("cmdstat_"):]: v["calls"] for k, v in r.info("commandstats").items()}


def _mput(r, *blocks, crcs=None):
    args = []
    for i, (key, data) in enumerate(blocks):
        args += [key, crc32c.crc32c(data) if crcs is None or crcs[i] is None else crcs[i], data]
    return r.execute_command("MPUTBLK", *args)


def test_mputblk_stores_each_block_whole_and_answers_per_block(tmp_path, sock_dir, nodes):
    q, _ = _node(tmp_path, sock_dir, nodes, "--dram", "64MiB")
    r = redis.Redis(port=q.port)
    blocks = [(f"b{n}", os.urandom(n)) for n in (0, 10, 5000, 20_000, 300_000)]  # empty, inline, large bulks
    r.set("old", b"kept")
    got = _mput(r, *blocks, ("old", b"other"), ("bad", os.urandom(70_000)), crcs=[None] * 6 + [1])
    assert got[:6] == [b"OK"] * 5 + [b"EXISTS"]
    assert isinstance(got[6], redis.ResponseError) and "CHECKSUM" in str(got[6])
    assert all(r.get(k) == v for k, v in blocks) and r.get("old") == b"kept" and not r.exists("bad")
    assert r.info().get("dram_reserved_blocks", 0) == 0, "the refused block's space was given back"
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        r.execute_command("MPUTBLK", "k", 1)
    with pytest.raises(redis.ResponseError, match="unsigned 32-bit"):
        _mput(r, ("k", b"x"), crcs=[-1])
    assert not r.exists("k"), "a malformed command stores nothing"


def test_mputblk_whose_block_cannot_be_reserved_stores_nothing_of_the_command(tmp_path, sock_dir, nodes):
    q, _ = _node(tmp_path, sock_dir, nodes, "--dram", "16MiB")
    r = redis.Redis(port=q.port)
    # the third is refused: a tenant's blocks still awaited may hold a quarter of the arena (4 MiB)
    blocks = [(f"b{i}", os.urandom(3 * MiB // 2)) for i in range(3)]
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        _mput(r, *blocks)
    assert r.exists("b0", "b1", "b2") == 0 and r.info().get("dram_reserved_blocks", 0) == 0
    assert _mput(r, *blocks[:2]) == [b"OK", b"OK"]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_batch_of_16_blocks_is_one_command_each_way(tmp_path, sock_dir, nodes, transport):
    """put_blocks of 16 x 64 KiB is one MPUTBLK over TCP and one SHM RESERVE and one SHM COMMIT over
    shared memory; get_many_into of them is one MGET over TCP, and over shared memory no command
    at all (every block found in the lookup table)."""
    q, _ = _node(tmp_path, sock_dir, nodes, "--dram", "64MiB")
    r = redis.Redis(port=q.port)
    rng = np.random.default_rng(3)
    blocks = {f"k{i}": rng.integers(0, 256, 64 * KiB, dtype=np.uint8) for i in range(16)}
    mode = {"tcp": "off", "shm": "require"}[transport]
    with QuillClient("127.0.0.1", q.port, shared_memory=mode) as c:
        assert c.transport == transport
        before = calls(r)
        assert c.put_blocks(blocks) == [True] * 16
        bufs = [np.zeros(64 * KiB, np.uint8) for _ in blocks]
        assert c.get_many_into(list(blocks) + ["missing"], bufs + [np.zeros(1, np.uint8)]) == [64 * KiB] * 16 + [-1]
        assert all(np.array_equal(a, b) for a, b in zip(bufs, blocks.values()))
        assert c.get_into("k3", bufs[0]) == 64 * KiB and np.array_equal(bufs[0], blocks["k3"])
        after = calls(r)
    ran = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    ran.pop("info", None)
    if transport == "tcp":
        assert ran == {"mputblk": 1, "mget": 1, "getblk": 1}
    else:  # the miss alone asks quilld (one SHM GET); the 17 reads of blocks asked nothing
        assert ran == {"shm|reserve": 1, "shm|commit": 1, "shm|get": 1}
        assert c.shm_direct_reads == 17


def test_shm_reserve_and_commit_answer_per_block(tmp_path, sock_dir, nodes):
    q, path = _node(tmp_path, sock_dir, nodes, "--dram", "64MiB")
    r = redis.Redis(unix_socket_path=path)
    r.set("old", b"kept")
    got = r.execute_command("SHM", "RESERVE", 0, "a", 10_000, "old", 5, "b", 0)
    (ha, oa), exists, (hb, _ob) = got
    assert exists == b"EXISTS" and oa % 4096 == 0
    with pytest.raises(redis.ResponseError, match="unix socket"):
        redis.Redis(port=q.port).execute_command("SHM", "RESERVE", 0, "c", 10)
    # a's bytes are written through a mapping in real use; here a's region holds zeros: its CRC says so
    committed = r.execute_command("SHM", "COMMIT", ha, crc32c.crc32c(b"\0" * 10_000) ^ 1, hb, crc32c.crc32c(b""))
    assert isinstance(committed[0], redis.ResponseError) and "CHECKSUM" in str(committed[0])
    assert committed[1] == b"OK" and r.get("b") == b"" and not r.exists("a")
    assert r.execute_command("SHM", "COMMIT", ha, crc32c.crc32c(b"\0" * 10_000)) == [b"OK"], "still open"
    assert r.get("a") == b"\0" * 10_000 and r.get("old") == b"kept"
    handle = r.execute_command("PUT2PHASE", "BEGIN", "c", 10)
    refused = r.execute_command("SHM", "COMMIT", handle, 0)[0]
    assert isinstance(refused, redis.ResponseError) and "in place" in str(refused)
    nohandle = r.execute_command("SHM", "COMMIT", "0123456789abcdef01234567", 0)[0]
    assert "NOHANDLE" in str(nohandle)


def test_put_blocks_errors_over_batches_are_typed_and_leave_nothing_open(tmp_path, sock_dir, nodes):
    q, _ = _node(tmp_path, sock_dir, nodes, "--dram", "2MiB")
    r = redis.Redis(port=q.port)
    for mode in ("off", "require"):
        with QuillClient("127.0.0.1", q.port, shared_memory=mode) as c:
            with pytest.raises(OutOfMemory):
                c.put_blocks({f"{mode}-fits": os.urandom(10_000), f"{mode}-big": os.urandom(3 * MiB)})
            assert not c.exists(f"{mode}-big")
    info = r.info()
    assert info["put2phase_open"] == 0 and info.get("dram_reserved_blocks", 0) == 0
