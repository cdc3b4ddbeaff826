"""The SSD tier through a real quilld: kill -9 at random moments, corruption while down,
tiering under a working set larger than DRAM, pinned blocks under pressure, a full disk."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from conftest import http, run_quilld, spill_to_ssd, ssd_node, stop_process, tiers_of, wait_held, wait_until

KiB, MiB = 1024, 1024 * 1024


def value(name: str, size: int) -> bytes:
    """The value of key `name`: distinct per key, so a wrong or mixed read shows."""
    return random.Random(name).randbytes(size)


def until(predicate, timeout, what):
    assert wait_until(predicate, timeout=timeout), f"timed out after {timeout} s waiting for {what}"


def test_blocks_seen_on_ssd_survive_sigkill_at_random_moments(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    rng = random.Random(2026)
    seen_on_ssd: dict[str, int] = {}  # key -> size, published on SSD before the kill
    written: dict[str, int] = {}
    for rnd in range(4):
        # the SSD holds everything written in all rounds: nothing leaves it by its own LRU
        q = ssd_node(tmp_path, ssd_dir, ssd_size="512MiB")
        nodes.append(q)
        r = redis.Redis(port=q.port, socket_timeout=20)
        # everything acknowledged on SSD in earlier rounds is back, byte-identical
        for key, size in seen_on_ssd.items():
            assert r.get(key) == value(key, size), f"round {rnd}: {key} lost or damaged"
        # nothing is listed that cannot be read: every key is one we wrote and reads back whole
        assert r.dbsize() <= len(written)
        present = [k for k in written if r.exists(k)]
        assert len(present) == r.dbsize()
        for k in present:
            assert r.get(k) == value(k, written[k])
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer(rnd=rnd):
            w = redis.Redis(port=q.port, socket_timeout=20)
            try:
                for i in range(150):
                    if stop.is_set():
                        return
                    key, size = f"r{rnd}:k{i}", rng.choice([64 * KiB, 256 * KiB, 700 * KiB])
                    written[key] = size
                    w.set(key, value(key, size))
            except redis.ConnectionError:
                pass  # the node was killed under us
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=writer)
        t.start()
        # the kill lands at a random moment once this round has put blocks on SSD (at least 5,
        # waited for up to 60 s however slow the machine), so every round proves something
        kill_after = rng.uniform(0.0, 1.5)
        kill_at, deadline = None, time.monotonic() + 60
        watcher = redis.Redis(port=q.port, socket_timeout=5)
        while kill_at is None or time.monotonic() < kill_at:
            if kill_at is None and (sum(k.startswith(f"r{rnd}:") for k in seen_on_ssd) >= 5
                                    or time.monotonic() > deadline or not t.is_alive()):
                kill_at = time.monotonic() + kill_after
            for key in [k for k in list(written) if k.startswith(f"r{rnd}:") and k not in seen_on_ssd]:
                try:
                    if "ssd" in tiers_of(watcher, key):
                        seen_on_ssd[key] = written[key]
                except redis.ConnectionError:
                    break
            time.sleep(0.02)
        os.kill(q.proc.pid, signal.SIGKILL)
        q.proc.wait(10)
        stop.set()
        t.join(30)
        assert not errors, errors
    assert len(seen_on_ssd) >= 20, f"only {len(seen_on_ssd)} blocks reached SSD: the test proved little"
    q = ssd_node(tmp_path, ssd_dir, ssd_size="512MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    for key, size in seen_on_ssd.items():
        assert r.get(key) == value(key, size), f"{key} lost or damaged after the last kill"
    info = r.info("persistence")
    assert info["recovery_blocks"] >= len(seen_on_ssd)
    assert info.get("ssd_read_corrupt", 0) == 0  # every block read back was whole, none caught corrupt


def test_flipped_bytes_in_a_segment_are_never_served(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir)
    r = redis.Redis(port=q.port, socket_timeout=20)
    keys = [f"c{i}" for i in range(80)]
    spill_to_ssd(r, {k: value(k, 256 * KiB) for k in keys}, keys[:len(keys) // 2])  # the older half
    stop_process(q.proc)
    segs = sorted(ssd_dir.glob("seg-*.dat"))
    damaged_payload, damaged_header = keys[3], keys[7]
    for key, where in ((damaged_payload, "payload"), (damaged_header, "header")):
        needle = value(key, 256 * KiB)[:64]
        for seg in segs:
            data = seg.read_bytes()
            pos = data.find(needle)
            if pos >= 0:
                # the header starts the head page just before the payload (block format 3)
                at = pos + 1000 if where == "payload" else pos - 4096 + 20
                with open(seg, "r+b") as f:
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0xFF]))
                break
        else:
            pytest.fail(f"{key} not found in any segment")
    q = ssd_node(tmp_path, ssd_dir)
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    info = r.info("persistence")
    assert info["recovery_dropped_corrupt"] == 1  # the bad header is caught at recovery
    assert not r.exists(damaged_header)
    assert r.get(damaged_payload) is None  # the bad payload is caught on read: a miss, never data
    info = r.info("persistence")
    assert info["ssd_read_corrupt"] == 1
    assert not r.exists(damaged_payload)
    for k in keys:
        if k not in (damaged_payload, damaged_header):
            assert r.get(k) == value(k, 256 * KiB), k
    assert r.dbsize() == len(keys) - 2


def test_a_damaged_wal_stops_replay_and_only_complete_blocks_come_back(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir)
    r = redis.Redis(port=q.port, socket_timeout=20)
    keys = [f"w{i}" for i in range(120)]
    spill_to_ssd(r, {k: value(k, 128 * KiB) for k in keys}, keys[:len(keys) // 2])  # the older half
    os.kill(q.proc.pid, signal.SIGKILL)  # no clean shutdown: the WAL is all there is
    q.proc.wait(10)
    wals = sorted(ssd_dir.glob("wal-*.log"))
    wal = max(wals, key=lambda p: p.stat().st_size)
    size = wal.stat().st_size
    assert size > 200
    with open(wal, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x55]))
    q = ssd_node(tmp_path, ssd_dir)
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    info = r.info("persistence")
    assert info["recovery_wal_stops"] >= 1
    back = [k for k in keys if r.exists(k)]
    assert 0 < len(back) < len(keys)
    for k in back:
        assert r.get(k) == value(k, 128 * KiB)
    assert r.dbsize() == len(back)


def test_a_working_set_larger_than_dram_keeps_hitting(tmp_path, nodes):
    q = ssd_node(tmp_path, tmp_path / "ssd", dram="16MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    keys = [f"h{i}" for i in range(48)]  # 48 MiB through a 16 MiB arena
    for k in keys:
        r.set(k, value(k, MiB))
    rng = random.Random(5)
    for _ in range(3):
        order = keys[:]
        rng.shuffle(order)
        for k in order:
            assert r.get(k) == value(k, MiB), k
    stats = r.info("stats")
    assert stats["keyspace_misses"] == 0 and stats["keyspace_hits"] >= 3 * len(keys)
    info = r.info("persistence")
    assert info["demotions"] > 0 and info["promotions"] > 0 and info["ssd_failed"] == 0
    assert r.info("tiers")["dram_used"] <= 16 * MiB
    # MGET across both tiers answers in order
    assert r.mget(keys[:6]) == [value(k, MiB) for k in keys[:6]]


def test_a_block_being_read_is_not_freed_under_its_reader(tmp_path, nodes):
    # one 28 MiB value in flight is more than the default per-tenant share of unfilled payloads
    q = ssd_node(tmp_path, tmp_path / "ssd", dram="48MiB", ssd_size="256MiB",
                 QUILLD_SECURITY_MAX_UNFILLED_BYTES_PER_TENANT=str(32 * MiB))
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    big = value("pinned", 28 * MiB)  # more than loopback's socket buffers can absorb
    r.set("pinned", big)
    # a reader that asks and then does not read: the reply stays pinned in quilld's buffer
    s = socket.create_connection(("127.0.0.1", q.port))
    s.sendall(b"*2\r\n$3\r\nGET\r\n$6\r\npinned\r\n")
    wait_held(r, len(big))  # the reply is being sent: its block is pinned (an event, not a pause)
    for i in range(100):  # pressure: far more than the arena holds
        r.set(f"p{i}", value(f"p{i}", MiB))
    assert r.info("tiers")["dram_held_bytes"] >= len(big)  # still pinned by the unread reply
    assert r.info("persistence")["demotions"] > 0
    got = bytearray()
    header = f"${len(big)}\r\n".encode()
    s.settimeout(20)
    while len(got) < len(header) + len(big) + 2:
        chunk = s.recv(1 << 20)
        assert chunk, "connection closed"
        got += chunk
    s.close()
    assert bytes(got) == header + big + b"\r\n"
    for i in range(100):
        assert r.get(f"p{i}") == value(f"p{i}", MiB)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 24 MiB tmpfs: the SSD tier's 16 MiB segment fits, then the disk is filled up."""
    mnt = tmp_path / "tinyfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the disk-full test (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_an_ssd_size_larger_than_the_free_disk_is_refused_and_fills_nothing(tmp_path, tiny_fs):
    # issue 29.1: preallocating segment after segment filled the disk, then refused with ENOSPC
    # and left the segments behind
    ssd_dir = tiny_fs / "ssd"
    free = os.statvfs(tiny_fs).f_bavail * os.statvfs(tiny_fs).f_frsize
    r = run_quilld("--port", "0", "--admin-port", "0", "--dram", "8MiB", "--ssd-dir", str(ssd_dir),
                   "--ssd-size", "64MiB", env={"QUILLD_SSD_SEGMENT_SIZE": "8MiB"})
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if "does not fit" in line]
    assert len(lines) == 1 and "ssd.size 64.0 MiB (--ssd-size)" in lines[0] and "24.0 MiB free" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not ssd_dir.exists(), sorted(os.listdir(ssd_dir))
    assert os.statvfs(tiny_fs).f_bavail * os.statvfs(tiny_fs).f_frsize == free
    q = ssd_node(tmp_path, ssd_dir, ssd_size="16MiB", QUILLD_SSD_SEGMENT_SIZE="8MiB")  # one that fits starts
    try:
        assert "ssd tier: recovering %s; 16.0 MiB preallocated on disk" % ssd_dir in q.log()
    finally:
        assert stop_process(q.proc) == 0, q.log()


def test_a_full_disk_fails_the_tier_and_the_node_keeps_serving_from_dram(tmp_path, tiny_fs, nodes):
    ssd_dir = tiny_fs / "ssd"
    q = ssd_node(tmp_path, ssd_dir, dram="8MiB", ssd_size="16MiB", QUILLD_SSD_SEGMENT_SIZE="16MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    # fill what is left of the disk, so the WAL cannot grow
    with open(tiny_fs / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        try:
            while True:
                f.write(b"\0" * MiB)
        except OSError:
            pass
    written = []
    for i in range(30):
        k = f"f{i}"
        r.set(k, value(k, 512 * KiB))
        written.append(k)
    until(lambda: r.info("persistence")["ssd_failed"] == 1, 20, "the SSD tier to report its failure")
    info = r.info("persistence")
    assert "No space left" in info["ssd_error"] or "ENOSPC" in info["ssd_error"] or "28" in info["ssd_error"]
    status, _, body = http(q.admin_port, "GET", "/healthz")
    health = json.loads(body)
    assert status == 503 and health["status"] == "degraded" and health["ssd_error"]  # not ready: see test_health
    # still serving: writes succeed (DRAM evicts as it would without an SSD), reads are right or misses
    for i in range(30, 60):
        k = f"f{i}"
        assert r.set(k, value(k, 512 * KiB))
        written.append(k)
    for k in written:
        got = r.get(k)
        assert got is None or got == value(k, 512 * KiB), k
    assert r.get(written[-1]) == value(written[-1], 512 * KiB)
    assert "ssd tier failed" in Path(q.log_path).read_text()


def test_a_clean_stop_in_the_middle_of_demotion_loses_nothing(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    acked: list[str] = []
    for rnd in range(2):
        q = ssd_node(tmp_path, ssd_dir, ssd_size="256MiB")
        nodes.append(q)
        r = redis.Redis(port=q.port, socket_timeout=20)
        for k in acked:  # everything acknowledged before each clean stop is back
            assert r.get(k) == value(k, 300 * KiB), k

        def writer(rnd=rnd):
            w = redis.Redis(port=q.port, socket_timeout=20)
            try:
                for i in range(200):
                    k = f"s{rnd}:{i}"
                    w.set(k, value(k, 300 * KiB))
                    acked.append(k)
            except redis.ConnectionError:
                pass  # the node stopped under us: that SET was not acknowledged

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(random.Random(rnd).uniform(0.3, 1.0))
        assert stop_process(q.proc) == 0  # SIGTERM while the writer and the demoter are busy
        t.join(30)
    assert len(acked) > 20
    q = ssd_node(tmp_path, ssd_dir, ssd_size="256MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    assert r.dbsize() == len(acked)
    for k in acked:
        assert r.get(k) == value(k, 300 * KiB), k
    assert r.info("persistence")["recovery_wal_records"] == 0  # the stop wrote a checkpoint


def test_a_client_gone_before_its_ssd_reads_finish_leaves_nothing_pinned(tmp_path, nodes):
    q = ssd_node(tmp_path, tmp_path / "ssd", dram="64MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    keys = [f"g{i}" for i in range(100)]
    for k in keys:
        r.set(k, value(k, MiB))
    cold = [k for k in keys if tiers_of(r, k) == {"ssd"}][:20]
    assert len(cold) == 20
    # MGET of SSD-only blocks is answered later (one read after another); the client leaves first
    s = socket.create_connection(("127.0.0.1", q.port))
    s.sendall(("*%d\r\n$4\r\nMGET\r\n" % (len(cold) + 1)).encode()
              + b"".join(b"$%d\r\n%b\r\n" % (len(k), k.encode()) for k in cold))
    s.close()
    until(lambda: r.info("persistence").get("promotions", 0) >= len(cold), 10, "the reads to finish")
    until(lambda: r.info("tiers")["dram_held_bytes"] == 0, 5, "the promoted blocks to be unpinned")


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_damaged_checkpoint_byte_loses_nothing_and_recovery_says_which_path_it_took(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    keys = [f"d{i}" for i in range(60)]
    for half in (keys[:30], keys[30:]):  # two clean stops: two checkpoints, and the logs the older needs
        q = ssd_node(tmp_path, ssd_dir)
        nodes.append(q)
        r = redis.Redis(port=q.port, socket_timeout=20)
        for k in half:
            r.set(k, value(k, 128 * KiB))
        assert stop_process(q.proc) == 0  # a clean stop writes every DRAM block to SSD
    checkpoints = sorted(ssd_dir.glob("checkpoint-*"))
    assert len(checkpoints) == 2
    _flip(checkpoints[-1], 64 + 100)  # one byte of the newest checkpoint's body
    for damaged, path, said in ((1, "previous-checkpoint", "PREVIOUS checkpoint"),
                                (2, "segment-scan", "SEGMENT SCAN")):
        q = ssd_node(tmp_path, ssd_dir)
        nodes.append(q)
        r = redis.Redis(port=q.port, socket_timeout=20)
        info = r.info("persistence")
        assert info["recovery_path"] == path
        assert info["recovery_checkpoint_errors"] == damaged and "checkpoint-" in info["recovery_checkpoint_error"]
        assert r.dbsize() == len(keys)
        for k in keys:
            assert r.get(k) == value(k, 128 * KiB), k
        assert said in q.log()
        assert stop_process(q.proc) == 0
        for checkpoint in sorted(ssd_dir.glob("checkpoint-*")):  # next: every checkpoint damaged
            _flip(checkpoint, 64 + 100)


def test_a_restore_with_an_absurd_ttl_never_wedges_the_ssd_tier(tmp_path, nodes):
    """Issue 29.14: `RESTORE k 9223372036854775807 <payload>` answered OK, then every demotion
    batch failed packing its expiry: DRAM filled, other writes got OOM, the clean stop exited 1
    and DRAM values were lost. The door may refuse such a TTL (as redis does); whatever it
    answers, no other value is held back and the stop keeps everything it can."""
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir, dram="8MiB", ssd_size="128MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    r.set("src", b"v" * 1000)
    payload = r.dump("src")
    r.delete("src")
    try:
        restored = r.execute_command("RESTORE", "absurd", "9223372036854775807", payload)
    except redis.ResponseError:
        restored = None
    # 24 MiB of other values into 8 MiB of DRAM: they can only fit if demotion goes on
    keys = [f"other{i}" for i in range(96)]
    for k in keys:
        assert r.set(k, value(k, 256 * KiB))
    until(lambda: any(tiers_of(r, k) == {"ssd"} for k in keys[:8]), 30, "demotion to go on")
    info = r.info("persistence")
    assert info["ssd_failed"] == 0
    status, _, body = http(q.admin_port, "GET", "/healthz")
    health = json.loads(body)
    if restored is not None and r.exists("absurd"):  # the door let it in: the tier refuses it alone, and says so
        assert r.exists("absurd") and r.get("absurd") == b"v" * 1000
        assert info["ssd_unstorable"] >= 1 and info["unstorable_held"] == 1, info
        assert status == 503 and health["status"] == "degraded", health
        assert any("cannot hold" in why for why in health["reasons"]), health
        assert "the SSD tier cannot hold it" in q.log()
    else:
        assert not r.exists("absurd")
        assert status == 200 and health["status"] == "ok", health
    for k in keys:
        assert r.get(k) == value(k, 256 * KiB), k
    assert stop_process(q.proc) == 0, q.log()
    q = ssd_node(tmp_path, ssd_dir, dram="8MiB", ssd_size="128MiB")
    nodes.append(q)
    r = redis.Redis(port=q.port, socket_timeout=20)
    for k in keys:
        assert r.get(k) == value(k, 256 * KiB), k
