"""The lookup table's discipline under a real race: a writer that overwrites, deletes and evicts
while readers copy blocks out of the arena with no round trip (issue 22, item 4).

One quilld (a small arena, so that writes evict), one writer process and two reader processes,
all real, on loopback and the unix socket. Every value names its key and version in its first
bytes and fills the rest with a byte derived from both, so a torn copy (parts of two values, or
of another key's value written where the block was) shows. The writer publishes, in a small
shared file, each key's last acknowledged event: 2v once version v is stored, 2v + 1 once it is
deleted after that. A reader notes a key's event before it reads; what it returns must be a
whole value of that key, and no older than that event (a miss is always allowed: a cache
evicts). The run ends once the readers saw enough copies thrown away (their entry changed under
them: the race happened) or after a bound on time; correctness is checked on every read.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from conftest import ROOT, start_quilld, wait_until

KEYS = 6
RACES_WANTED = 20  # copies thrown away (entry changed under them) the readers should see
READS_BOUND = 200_000  # reads per reader at most
CLIENT_ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'clients' / 'python'}:{ROOT / 'wire'}"}

COMMON = textwrap.dedent("""
    import json, mmap, os, sys, time
    import numpy as np
    from quillclient import NotFound, QuillClient
    KEYS = %d
    SIZES = (256 * 1024, 768 * 1024, 1024 * 1024)
    board_fd = os.open(sys.argv[2], os.O_RDWR)
    board = memoryview(mmap.mmap(board_fd, 4096)).cast("Q")  # [0..KEYS): acked events; 100: stop; 101+: races

    def fill(k, v):
        return (k * 37 + v * 11) %% 251 + 1

    def value(k, v):
        a = np.full(SIZES[(k + v) %% len(SIZES)], fill(k, v), np.uint8)
        a[:16] = np.frombuffer(np.array([k, v], "<u8").tobytes(), np.uint8)
        return a
""") % KEYS

WRITER = COMMON + textwrap.dedent("""
    c = QuillClient("127.0.0.1", int(sys.argv[1]), shared_memory="off")  # over TCP: quilld does every change
    version = [0] * KEYS
    ops = 0
    while not board[100] and ops < 100_000:
        k = ops % KEYS
        step = (ops // KEYS) % 5
        if step in (0, 3):  # overwrite in place of the old block: SET (no CRC: in the table once read)
            version[k] += 1
            c.put(f"k{k}", value(k, version[k]))
            board[k] = 2 * version[k]
        elif step == 1:  # delete, then write again with its CRC32C (in the table at once)
            c.delete(f"k{k}")
            board[k] = 2 * version[k] + 1
            version[k] += 1
            c.put_blocks({f"k{k}": value(k, version[k])})
            board[k] = 2 * version[k]
        else:  # a filler: the arena overflows, least recently used values are evicted
            c.put(f"filler{ops % 40}", np.full(1024 * 1024, 255, np.uint8))
        ops += 1
    print(json.dumps({"ops": ops}), flush=True)
""")

READER = COMMON + textwrap.dedent("""
    me = int(sys.argv[3])
    c = QuillClient("127.0.0.1", int(sys.argv[1]), shared_memory="require")
    buf = np.empty(1024 * 1024, np.uint8)
    reads = found = 0
    bad = []
    while not board[100] and reads < %d:
        k = reads %% KEYS
        before = board[k]
        try:
            n = c.get_into(f"k{k}", buf)
        except NotFound:
            n = 0
        reads += 1
        board[101 + me] = c.shm_direct_retries + c.shm_stale_reads
        if not n:
            continue
        found += 1
        key, v = (int(x) for x in np.frombuffer(buf[:16].tobytes(), "<u8"))
        whole = key == k and n == value(k, v).nbytes and bool((buf[16:n] == fill(k, v)).all())
        if not whole:
            bad.append(f"k{k}: a torn or foreign copy (header k{key} v{v}, {n} bytes)")
        elif 2 * v < before:
            bad.append(f"k{k}: version {v} read after event {before} was acknowledged (stale)")
        if len(bad) > 20:
            break
    print(json.dumps({"reads": reads, "found": found, "bad": bad, "direct": c.shm_direct_reads,
                      "retries": c.shm_direct_retries, "stale": c.shm_stale_reads}), flush=True)
""") % READS_BOUND


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="qr", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(240)
def test_readers_copying_while_a_writer_overwrites_deletes_and_evicts_never_get_a_torn_or_stale_value(
        tmp_path, sock_dir, nodes):
    path = os.path.join(sock_dir, "q.sock")
    q = start_quilld(tmp_path, "--unixsocket", path, "--dram", "24MiB", "--map-users", "default", admin=False)
    nodes.append(q)
    assert wait_until(lambda: os.path.exists(path), timeout=10)
    board_path = tmp_path / "board"
    board_path.write_bytes(bytes(4096))
    board = memoryview(mmap.mmap(os.open(board_path, os.O_RDWR), 4096)).cast("Q")
    run = [sys.executable, "-c"]
    writer = subprocess.Popen(run + [WRITER, str(q.port), str(board_path)], stdout=subprocess.PIPE, env=CLIENT_ENV)
    readers = [subprocess.Popen(run + [READER, str(q.port), str(board_path), str(i)], stdout=subprocess.PIPE,
                                env=CLIENT_ENV) for i in range(2)]
    try:
        raced = wait_until(lambda: board[101] + board[102] >= RACES_WANTED or any(
            p.poll() is not None for p in [writer, *readers]), timeout=120)
        board[100] = 1  # stop
        out = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in [writer, *readers]]
    finally:
        for p in [writer, *readers]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    w, results = out[0], out[1:]
    print(f"\nwriter: {w['ops']} changes; readers: " + "; ".join(
        f"{r['reads']} reads, {r['found']} found, {r['direct']} from the table, {r['retries']} copies thrown away "
        f"(entry changed), {r['stale']} read again over TCP" for r in results))
    assert [b for r in results for b in r["bad"]] == [], "a torn or stale value was returned as good"
    assert sum(r["direct"] for r in results) > 100, "the readers read through the lookup table"
    assert raced and sum(r["retries"] + r["stale"] for r in results) >= 1, "the race must have happened"
