"""The SSD tier against its own disk, side by side in one run, printed as ratios.

1. Raw sequential write bandwidth of the disk under `--dir`: `dd bs=1M oflag=direct
   conv=fdatasync` (without oflag=direct where the filesystem refuses O_DIRECT), and a
   plain Python loop in the tier's group-commit pattern: 1 MiB pwrites into a
   preallocated file, one fdatasync per group, then a small WAL append and its
   fdatasync; per group of the demoter's own batch (a quarter of --dram, as the
   demoter takes at least that), and per 64 MiB. The loop's share of time in fdatasync
   is measured too.
2. Demotion: quilld with a small DRAM arena and its SSD tier on that disk; one client
   SETs `--blocks` 1 MiB blocks as fast as it can (backpressure when DRAM is full),
   then waits until DRAM is back under its high watermark. Reported: the demoter's own
   rate (INFO persistence demoted_bytes / demote_usec: group commits incl. fsyncs) and
   the end-to-end ingest rate (all bytes / first SET until settled), as ratios of the
   best raw peer of the same round (dd, or the loop with the demoter's group size), and
   the share of demote_usec spent in fdatasync (ssd_fsync_total_ms), with the I/O mode
   (ssd_io_mode: direct or buffered) and `--io-threads` I/O threads.
3. SSD GET: random-order GETs of the SSD-only blocks from one client, with
   promote_on_read off (cold page cache, then warm) and on (after a clean restart of
   the same tier: cold, then a second pass), against random-order 1 MiB preads of a
   file on the same disk and GETs of the DRAM-resident blocks.
4. Recovery of `--recovery-blocks` small arena blocks (4 KiB + 1 byte): start time
   after SIGKILL (WAL replay) and after a clean stop (checkpoint), against 2 s.
5. Deletes and overwrites of SSD-resident blocks (`--delete-blocks` 64 KiB blocks through
   the same arena): latency of DEL and of an overwriting SET from one client (each reply
   waits for the deletion's WAL record to be synced), DEL throughput from 8 clients at
   once (one WAL sync per group of them), and DEL of DRAM-only blocks as the reference.

Rounds 1-3 alternate within each round (dd, Python loop, quilld) and medians are
printed; recovery restarts are repeated `--rounds` times. The page cache is dropped
before every "cold" figure when /proc/sys/vm/drop_caches is writable (root).

    python bench/ssd_bench.py [--rounds 3] [--quick] [--blocks 512] [--recovery-blocks 100000] [--dir DIR]
                              [--delete-blocks 2000] [--skip-deletes] [--skip-recovery] [--plot PATH]
                              [--direct-io true|false] [--io-threads 4]

--quick: 256 blocks, no recovery or delete tests (demotion and GETs only).
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from plot import COLORS, QUILLD, RAW, Panel, add_flag, ratio, save

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from procs import start_quilld, stop_process  # noqa: E402

MiB = 1024 * 1024
DRAM = "64MiB"
DRAM_BYTES = 64 * MiB
RECOVERY_DRAM = "32MiB"
RECOVERY_DRAM_BYTES = 32 * MiB
SSD_SIZE = "2GiB"
GROUP = 64 * MiB
SMALL_VALUE = 4096 + 1  # just over dram.inline_max: an arena block, not an inline value
SSD_ENV = {"QUILLD_SSD_SEGMENT_SIZE": "256MiB", "QUILLD_SSD_GROUP_COMMIT_BYTES": "64MiB"}


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def drop_caches() -> bool:
    """Write back and drop the page cache; False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def describe_fs(path: Path) -> str:
    out = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True).stdout.splitlines()
    if len(out) < 2:
        return f"{path} (df printed nothing)"
    dev, fstype, size, _, avail, *_ = out[-1].split()
    return f"{path} on {dev} ({fstype}, {size}, {avail} free)"


# -- 1. raw ---------------------------------------------------------------------------

def raw_dd(path: Path, mib: int) -> tuple[float, bool]:
    """MB/s of dd writing `mib` MiB; and whether O_DIRECT was used."""
    for direct in (True, False):
        cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"]
        if direct:
            cmd.insert(4, "oflag=direct")
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        path.unlink(missing_ok=True)
        if res.returncode == 0:
            m = re.search(r"^(\d+) bytes.*copied, ([\d.]+) s", res.stderr, re.M)
            nbytes, secs = (int(m.group(1)), float(m.group(2))) if m else (mib * MiB, wall)
            return nbytes / secs / 1e6, direct
        if not direct:
            raise RuntimeError(f"dd failed: {res.stderr.strip()}")
        progress(f"dd with oflag=direct failed ({res.stderr.strip()}); again without it")
    raise AssertionError("unreachable")


def raw_group_commit(directory: Path, mib: int, group: int, read_seed: int | None = None,
                     can_drop: bool = False) -> tuple[float, float, float]:
    """MB/s of the tier's write pattern done by hand: 1 MiB pwrites into a preallocated
    file, fdatasync per `group` bytes, then a small WAL record appended and synced; and
    the share of that time spent in the two fdatasyncs.
    With `read_seed`, also GB/s of reading the blocks back with 1 MiB preads in random
    order (page cache dropped first if `can_drop`): what a cold SSD GET reads."""
    data_path, wal_path = directory / "raw-seg.bin", directory / "raw-wal.bin"
    block = os.urandom(MiB)
    record = os.urandom(64 * max(1, group // MiB))  # about a PUT record per block
    fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    wal = os.open(wal_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, mib * MiB)  # as the tier preallocates its segments
        except OSError:
            os.ftruncate(fd, mib * MiB)
        os.fsync(fd)
        per_group = max(1, group // MiB)
        synced = 0.0
        t0 = time.perf_counter()
        for first in range(0, mib, per_group):
            for i in range(first, min(mib, first + per_group)):
                os.pwrite(fd, block, i * MiB)
            t1 = time.perf_counter()
            os.fdatasync(fd)
            os.write(wal, record)
            os.fdatasync(wal)
            synced += time.perf_counter() - t1
        dt = time.perf_counter() - t0
        read = 0.0
        if read_seed is not None:
            order = list(range(mib))
            random.Random(read_seed).shuffle(order)
            buf = bytearray(MiB)
            if can_drop:
                drop_caches()
            t0 = time.perf_counter()
            for i in order:
                os.preadv(fd, [buf], i * MiB)
            read = mib * MiB / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.close(wal)
        data_path.unlink(missing_ok=True)
        wal_path.unlink(missing_ok=True)
    return mib * MiB / dt / 1e6, read, synced / dt


LEVERS = {  # name: (SsdTier options, pipelined: the next batch written while this one's fdatasyncs run,
    #                written: the segments zero-filled first, as after a first pass over a new tier)
    "buffered, 1 thread, serial (format 2's pattern)": (dict(direct_io=False, io_threads=1), False, False),
    "O_DIRECT, 1 thread, serial": (dict(direct_io=True, io_threads=1), False, False),
    "O_DIRECT, 4 threads, serial": (dict(direct_io=True, io_threads=4), False, False),
    "buffered, 4 threads, pipelined (quilld's default)": (dict(direct_io=False, io_threads=4), True, False),
    "O_DIRECT, 4 threads, pipelined": (dict(direct_io=True, io_threads=4), True, False),
    "O_DIRECT, 4 threads, pipelined, second pass (extents written before)": (dict(direct_io=True, io_threads=4),
                                                                             True, True),
    "buffered, 4 threads, pipelined, second pass": (dict(direct_io=False, io_threads=4), True, True),
}


def tier_levers(directory: Path, mib: int, group: int) -> dict[str, tuple[float, float]]:
    """The SSD tier alone, in this process (no daemon, no client): `mib` 1 MiB blocks from
    page-aligned memory (as the arena's) in batches of `group` bytes, through write_blocks and
    commit, per LEVERS entry; MB/s and the share of the time in fdatasync, each."""
    sys.path.insert(0, str(ROOT))
    from concurrent.futures import ThreadPoolExecutor
    import mmap

    from quilld.model import IdentityScope
    from quilld.tiers.ssd import PendingWrite, SsdTier
    scope = IdentityScope("bench", "m", "t", "")
    per = max(1, group // MiB)
    mem = mmap.mmap(-1, per * MiB)
    mem[:] = os.urandom(per * MiB)
    view = memoryview(mem)
    out = {}
    for name, (opts, pipelined, written) in LEVERS.items():
        d = directory / "levers"
        shutil.rmtree(d, ignore_errors=True)
        tier = SsdTier(str(d), mib * MiB * 2, 256 * MiB, **opts)
        if written:  # what a first pass leaves: extents the file system counts as written
            d.mkdir()
            zeros = bytes(64 * MiB)
            for seg in range(tier.segments):
                with open(d / f"seg-{seg:05d}.dat", "wb") as f:
                    for _ in range(256 * MiB // len(zeros)):
                        f.write(zeros)
                    f.flush()
                    os.fsync(f.fileno())
        tier.recover()
        committer = ThreadPoolExecutor(1)
        pending = None
        t0 = time.perf_counter()
        f0 = tier.stats()["fsync_total_ms"]
        for first in range(0, mib, per):
            items = []
            for i in range(first, min(mib, first + per)):
                key = b"b%08d" % i
                items.append(PendingWrite(scope, key, view[(i - first) * MiB:(i - first + 1) * MiB],
                                          tier.allocate(scope, key, MiB)))
            tier.write_blocks(items)
            if pending is not None:
                pending.result()
            pending = committer.submit(tier.commit, items)
            if not pipelined:
                pending.result()
        pending.result()
        dt = time.perf_counter() - t0
        out[name] = (mib * MiB / dt / 1e6, (tier.stats()["fsync_total_ms"] - f0) / 1e3 / dt)
        committer.shutdown()
        tier.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


# -- 2 and 3. demotion and SSD GET ------------------------------------------------------

class RawClient:
    """A minimal RESP client for the 1 MiB SETs and GETs: redis-py tops out near 150 MB/s
    for 1 MiB values on this class of machine, below what is measured here. SETs are
    sent as header, payload and CRLF (no copy of the payload); GETs land in one reused
    buffer with recv_into."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rbuf = bytearray()
        self.out = bytearray(MiB + 2)

    def close(self) -> None:
        self.sock.close()

    def _readline(self) -> bytes:
        while True:
            i = self.rbuf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.rbuf[:i])
                del self.rbuf[:i + 2]
                return line
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("quilld closed the connection")
            self.rbuf += chunk

    def _read_into(self, view: memoryview) -> None:
        got = min(len(self.rbuf), len(view))
        view[:got] = self.rbuf[:got]
        del self.rbuf[:got]
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("quilld closed the connection")
            got += n

    def set_blocks(self, keys: list[bytes], body: bytes, depth: int = 4, report=None) -> int:
        """SET keys[i] to `body` with its first 8 bytes replaced by i; returns error replies."""
        tail, errors, pending = memoryview(body)[8:], 0, 0
        for i, key in enumerate(keys):
            self.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%08d" % (len(key), key, len(body), i))
            self.sock.sendall(tail)
            self.sock.sendall(b"\r\n")
            pending += 1
            while pending >= depth or (i == len(keys) - 1 and pending):
                errors += self._readline()[:1] != b"+"
                pending -= 1
            if report is not None:
                report(i + 1)
        return errors

    def get(self, key: bytes) -> memoryview | None:
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key))
        line = self._readline()
        if line == b"$-1":
            return None
        if line[:1] != b"$":
            raise RuntimeError(f"GET {key!r}: {line!r}")
        n = int(line[1:])
        if n + 2 > len(self.out):
            self.out = bytearray(n + 2)
        view = memoryview(self.out)[:n + 2]
        self._read_into(view)
        return view[:n]


def block_keys(n: int) -> list[bytes]:
    return [b"blk:%06d" % i for i in range(n)]


def tiers(r: redis.Redis) -> dict:
    return r.info("tiers")


def persistence(r: redis.Redis) -> dict:
    return r.info("persistence")


def ingest(q, n: int, body: bytes, settle: bool = True) -> tuple[float, float, int]:
    """SET n 1 MiB blocks from one client; returns (seconds of SETs, seconds until DRAM
    is back under its high watermark with every block in DRAM or on SSD, errors)."""
    r, c = q.client(), RawClient(q.port)
    t0 = time.perf_counter()

    def report(done: int) -> None:
        if done % 128 == 0:
            progress(f"SET {done}/{n} ({done * MiB / (time.perf_counter() - t0) / 1e6:.0f} MB/s)")

    try:
        errors = c.set_blocks(block_keys(n), body, report=report)
    finally:
        c.close()
    t_set = time.perf_counter() - t0
    deadline = time.monotonic() + 120
    while settle:
        t = tiers(r)
        if (t["dram_used"] <= t["dram_high_watermark"] * t["dram_capacity"] and t["dram_reserved_blocks"] == 0
                and t["ssd_keys"] + t["dram_blocks"] >= n - errors
                and not persistence(r).get("demote_inflight_bytes")):  # no batch still in flight
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"demotion did not settle in 120 s: {t}")
        time.sleep(0.005)
    return t_set, time.perf_counter() - t0, errors


def classify(r: redis.Redis, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(SSD-only keys, DRAM-resident keys) per LOCATE."""
    ssd_only, dram = [], []
    for first in range(0, len(keys), 256):
        chunk = keys[first:first + 256]
        for key, places in zip(chunk, r.execute_command("LOCATE", *chunk)):
            where = {p[b"tier"] for p in places}
            if where == {b"ssd"}:
                ssd_only.append(key)
            elif b"dram" in where:
                dram.append(key)
    return ssd_only, dram


def get_pass(port: int, keys: list[bytes], seed: int) -> float:
    """GB/s of GETting `keys` once in random order from one connection, each checked."""
    order = list(keys)
    random.Random(seed).shuffle(order)
    c = RawClient(port)
    try:
        t0 = time.perf_counter()
        nbytes = 0
        for k in order:
            v = c.get(k)
            if v is None or len(v) != MiB or bytes(v[:8]) != b"%08d" % int(k[4:]):
                raise RuntimeError(f"GET {k!r}: wrong value ({None if v is None else len(v)} bytes)")
            nbytes += len(v)
        return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        c.close()


def demotion_round(base: Path, n: int, body: bytes, rnd: int, can_drop: bool, io_env: dict) -> dict:
    ssd_dir = base / f"ssd-{rnd}"
    keys = block_keys(n)
    out: dict = {}
    q = start_quilld(base, "--dram", DRAM, admin=False)  # reference: the same SETs, LRU eviction instead of SSD
    try:
        t_set, _, _ = ingest(q, n, body, settle=False)
        out["set_nossd_MBps"] = n * MiB / t_set / 1e6
    finally:
        stop_process(q.proc)
    env = dict(SSD_ENV, QUILLD_SSD_PROMOTE_ON_READ="false", **io_env)
    q = start_quilld(base, "--dram", DRAM, "--ssd-dir", str(ssd_dir), "--ssd-size", SSD_SIZE, env=env, admin=False)
    try:
        r = q.client(socket_timeout=60)
        p0 = persistence(r)  # fsyncs of the start (segments created, key, log) are not demotion's
        t_set, t_all, errors = ingest(q, n, body)
        p = persistence(r)
        out["set_errors"] = errors
        out["set_MBps"] = n * MiB / t_set / 1e6
        out["ingest_MBps"] = n * MiB / t_all / 1e6
        out["demote_MBps"] = p["demoted_bytes"] / (p["demote_usec"] / 1e6) / 1e6 if p["demote_usec"] else 0.0
        out["batch_MiB"] = p["demoted_bytes"] / max(p["demote_batches"], 1) / MiB
        out["batches"] = p["demote_batches"]
        out["fsyncs"] = p["ssd_fsyncs"] - p0["ssd_fsyncs"]
        # a quilld from before ssd_fsync_total_ms and ssd_io_mode existed (to measure it with this bench)
        fsync_s = (p.get("ssd_fsync_total_ms", p["ssd_fsyncs"] * p["ssd_fsync_avg_ms"])
                   - p0.get("ssd_fsync_total_ms", p0["ssd_fsyncs"] * p0["ssd_fsync_avg_ms"])) / 1e3
        out["fsync_share"] = fsync_s / (p["demote_usec"] / 1e6) if p["demote_usec"] else 0.0
        out["fsync_avg_ms"] = fsync_avg = fsync_s * 1e3 / max(out["fsyncs"], 1)
        out["io_mode"] = p.get("ssd_io_mode", "buffered")
        out["demoted_MiB"] = p["demoted_bytes"] / MiB
        out["busy"] = p["demote_usec"] / 1e6 / t_all
        progress(f"round {rnd}: SET {out['set_MBps']:.0f} MB/s (no SSD: {out['set_nossd_MBps']:.0f}), settled at "
                 f"{out['ingest_MBps']:.0f} MB/s, demoter {out['demote_MBps']:.0f} MB/s in {p['demote_batches']} "
                 f"batches (avg {out['batch_MiB']:.1f} MiB), {out['fsyncs']} fsyncs avg {fsync_avg:.1f} ms "
                 f"({out['fsync_share'] * 100:.0f}% of demote_usec), {out['io_mode']}")
        ssd_only, dram = classify(r, keys)
        out["ssd_only"], out["dram_resident"] = len(ssd_only), len(dram)
        out["get_dram"] = statistics.median(get_pass(q.port, dram, rnd + 200 + j) for j in range(3)) if dram else 0.0
        if can_drop:
            drop_caches()
        out["get_off_cold"] = get_pass(q.port, ssd_only, rnd)
        out["get_off_warm"] = get_pass(q.port, ssd_only, rnd + 100)
        p2 = persistence(r)
        out["promotions_off"] = p2.get("promotions", 0)
        out["ssd_reads"] = p2.get("ssd_reads", 0)
        progress(f"round {rnd}: GET {len(ssd_only)} SSD-only blocks, promote off: cold {out['get_off_cold']:.2f}"
                 f" GB/s, warm {out['get_off_warm']:.2f} GB/s; {len(dram)} DRAM blocks {out['get_dram']:.2f} GB/s")
    finally:
        t0 = time.perf_counter()
        stop_process(q.proc)
        out["stop_s"] = time.perf_counter() - t0
    # the same blocks again, promote_on_read on (the default): a clean restart of the same tier
    q = start_quilld(base, "--dram", DRAM, "--ssd-dir", str(ssd_dir), "--ssd-size", SSD_SIZE, env=SSD_ENV,
                     admin=False)
    try:
        r = q.client(socket_timeout=60)
        ssd_only, _ = classify(r, keys)
        if can_drop:
            drop_caches()
        out["get_on_cold"] = get_pass(q.port, ssd_only, rnd + 300)
        out["get_on_warm"] = get_pass(q.port, ssd_only, rnd + 400)
        out["promotions_on"] = persistence(r).get("promotions", 0)
        progress(f"round {rnd}: GET {len(ssd_only)} SSD-only blocks, promote on: cold {out['get_on_cold']:.2f} GB/s,"
                 f" warm {out['get_on_warm']:.2f} GB/s ({out['promotions_on']} promotions)")
    finally:
        stop_process(q.proc)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return out


# -- 4. recovery ------------------------------------------------------------------------

def timed_start(base: Path, ssd_dir: Path | None, env: dict) -> tuple[object, float]:
    extra = ["--dram", RECOVERY_DRAM] + (["--ssd-dir", str(ssd_dir), "--ssd-size", SSD_SIZE] if ssd_dir else [])
    t0 = time.perf_counter()
    q = start_quilld(base, *extra, env=env, admin=False)
    return q, time.perf_counter() - t0


def kill(q) -> None:
    os.kill(q.proc.pid, signal.SIGKILL)
    q.proc.wait()


def fill_small(r: redis.Redis, n: int) -> None:
    value = b"v" * SMALL_VALUE
    pipe = r.pipeline(transaction=False)
    t0 = time.perf_counter()
    for i in range(n):
        pipe.set(f"rec:{i:08d}", value)
        if len(pipe) >= 1000:
            pipe.execute()
        if i % 20000 == 19999:
            progress(f"recovery fill: {i + 1}/{n} SETs ({(i + 1) / (time.perf_counter() - t0):,.0f}/s)")
    pipe.execute()
    # push the last of them out of DRAM with fillers (LRU order: the oldest go first)
    high = 0.95 * RECOVERY_DRAM_BYTES
    for i in range(int(high // 8192) + 200):
        pipe.set(f"fill:{i:08d}", value)
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    deadline = time.monotonic() + 300
    while persistence(r)["ssd_keys"] < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {persistence(r)['ssd_keys']} of {n} blocks demoted after 300 s")
        time.sleep(0.05)
    progress(f"recovery fill: {n} blocks on SSD after {time.perf_counter() - t0:.1f} s")


def recovery(base: Path, n: int, rounds: int, can_drop: bool) -> dict:
    ssd_dir, saved = base / "ssd-recovery", base / "wal-saved"
    out: dict = {"empty_wall": [], "empty_ms": [], "wal_wall": [], "wal_ms": [], "ckpt_wall": [], "ckpt_ms": []}
    for i in range(rounds):  # interpreter, imports and an empty tier: the floor under any restart
        shutil.rmtree(base / "ssd-empty", ignore_errors=True)
        q, wall = timed_start(base, base / "ssd-empty", SSD_ENV)
        out["empty_wall"].append(wall)
        out["empty_ms"].append(persistence(q.client())["recovery_ms"])
        stop_process(q.proc)
    shutil.rmtree(base / "ssd-empty", ignore_errors=True)
    q, _ = timed_start(base, ssd_dir, SSD_ENV)
    r = q.client(socket_timeout=120)
    fill_small(r, n)
    p = persistence(r)
    out["filled_keys"], out["fill_checkpoints"] = p["ssd_keys"], p.get("checkpoints", 0)
    kill(q)
    saved.mkdir()
    for f in glob.glob(str(ssd_dir / "wal-*")) + glob.glob(str(ssd_dir / "checkpoint*")):
        shutil.copy2(f, saved)
    out["saved_files"] = sorted(os.listdir(saved))
    for i in range(rounds):  # SIGKILL: replay the WAL (the saved one, restored each time)
        for f in glob.glob(str(ssd_dir / "wal-*")) + glob.glob(str(ssd_dir / "checkpoint*")):
            os.unlink(f)
        for f in os.listdir(saved):
            shutil.copy2(saved / f, ssd_dir / f)
        if can_drop:
            drop_caches()
        q, wall = timed_start(base, ssd_dir, SSD_ENV)
        p = persistence(q.client())
        out["wal_wall"].append(wall)
        out["wal_ms"].append(p["recovery_ms"])
        out["wal_blocks"], out["wal_records"] = p["recovery_blocks"], p["recovery_wal_records"]
        progress(f"recovery after SIGKILL, round {i + 1}: {p['recovery_blocks']} blocks, "
                 f"{p['recovery_wal_records']} WAL records, recovery_ms {p['recovery_ms']}, start-to-port {wall:.2f} s")
        kill(q)
    # the last of those wrote a checkpoint; from here on, clean stops (SIGTERM)
    q, _ = timed_start(base, ssd_dir, SSD_ENV)
    stop_process(q.proc)
    out["after_clean_stop"] = sorted(os.listdir(ssd_dir))
    for i in range(rounds):
        if can_drop:
            drop_caches()
        q, wall = timed_start(base, ssd_dir, SSD_ENV)
        p = persistence(q.client())
        out["ckpt_wall"].append(wall)
        out["ckpt_ms"].append(p["recovery_ms"])
        out["ckpt_blocks"], out["ckpt_records"] = p["recovery_blocks"], p["recovery_wal_records"]
        progress(f"recovery after clean stop, round {i + 1}: {p['recovery_blocks']} blocks, "
                 f"{p['recovery_wal_records']} WAL records, recovery_ms {p['recovery_ms']}, start-to-port {wall:.2f} s")
        stop_process(q.proc)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    shutil.rmtree(saved, ignore_errors=True)
    return out


# -- 5. deletes and overwrites of SSD-resident blocks ------------------------------------------

DELETE_VALUE = 64 * 1024
DELETE_CLIENTS = 8


def fill_for_deletes(r: redis.Redis, n: int) -> list[str]:
    """SET n 64 KiB blocks (about twice the arena), then wait until DRAM has settled."""
    keys = [f"del:{i:06d}" for i in range(n)]
    body = os.urandom(DELETE_VALUE)
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.set(k, body)
        if len(pipe) >= 64:
            pipe.execute()
    pipe.execute()
    deadline = time.monotonic() + 120
    while True:
        t = tiers(r)
        if t["dram_used"] <= t["dram_high_watermark"] * t["dram_capacity"] and t["dram_reserved_blocks"] == 0:
            return keys
        if time.monotonic() > deadline:
            raise RuntimeError(f"demotion did not settle in 120 s: {t}")
        time.sleep(0.01)


def tiers_of_key(r: redis.Redis, key: str) -> set[bytes]:
    return {p[b"tier"] for p in r.execute_command("LOCATE", key)[0]}


def timed_ops(r: redis.Redis, keys: list[str], op) -> list[float]:
    """Seconds per call of op(r, key), one after another on one connection."""
    out = []
    for k in keys:
        t0 = time.perf_counter()
        op(r, k)
        out.append(time.perf_counter() - t0)
    return out


def parallel_dels(port: int, keys: list[str], clients: int) -> float:
    """DEL/s of `clients` connections deleting their share of `keys` at once."""
    shares = [keys[i::clients] for i in range(clients)]
    conns = [redis.Redis(port=port, socket_timeout=60) for _ in shares]
    for c in conns:
        c.ping()
    errors: list[BaseException] = []

    def run(c, share):
        try:
            for k in share:
                if c.delete(k) != 1:
                    raise RuntimeError(f"DEL {k}: not deleted")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c, share)) for c, share in zip(conns, shares)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return len(keys) / dt


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def deletes_round(base: Path, n: int, rnd: int) -> dict:
    ssd_dir = base / f"ssd-del-{rnd}"
    q = start_quilld(base, "--dram", DRAM, "--ssd-dir", str(ssd_dir), "--ssd-size", SSD_SIZE, env=SSD_ENV,
                     admin=False)
    out: dict = {}
    try:
        r = q.client(socket_timeout=60)
        keys = fill_for_deletes(r, n)
        ssd_only, dram = classify(r, [k.encode() for k in keys])
        ssd_only = [k.decode() for k in ssd_only]
        dram = [k for k in keys if tiers_of_key(r, k) == {b"dram"}]  # no SSD copy at all
        random.Random(rnd).shuffle(ssd_only)
        third = len(ssd_only) // 3
        seq, par, over = ssd_only[:third], ssd_only[third:2 * third], ssd_only[2 * third:]
        small = b"o" * (SMALL_VALUE)
        lat_del = timed_ops(r, seq, lambda c, k: c.delete(k))
        lat_set = timed_ops(r, over, lambda c, k: c.set(k, small))
        out["del_ops"] = parallel_dels(q.port, par, DELETE_CLIENTS)
        lat_dram = timed_ops(r, dram, lambda c, k: c.delete(k))
        p = persistence(r)
        out["ssd_only"], out["dram"] = len(ssd_only), len(dram)
        out["del_p50_ms"], out["del_p99_ms"] = pct(lat_del, 0.5) * 1e3, pct(lat_del, 0.99) * 1e3
        out["set_p50_ms"], out["set_p99_ms"] = pct(lat_set, 0.5) * 1e3, pct(lat_set, 0.99) * 1e3
        out["dram_p50_ms"], out["dram_p99_ms"] = pct(lat_dram, 0.5) * 1e3, pct(lat_dram, 0.99) * 1e3
        out["del_seq_ops"] = len(lat_del) / sum(lat_del) if lat_del else 0.0
        out["fsyncs"], out["fsync_avg_ms"] = p["ssd_fsyncs"], p["ssd_fsync_avg_ms"]
        out["ssd_deletes"] = p.get("ssd_deletes", 0)
        out["delete_syncs"] = p.get("delete_syncs", 0)
        progress(f"deletes round {rnd}: {len(ssd_only)} SSD-only blocks; DEL p50 {out['del_p50_ms']:.2f} ms "
                 f"p99 {out['del_p99_ms']:.2f} ms; overwrite p50 {out['set_p50_ms']:.2f} ms; "
                 f"{DELETE_CLIENTS} clients {out['del_ops']:,.0f} DEL/s; DRAM DEL p50 {out['dram_p50_ms']:.3f} ms")
    finally:
        stop_process(q.proc)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return out


# -- main ---------------------------------------------------------------------------------

def med(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def plot(path: str, dd: list[float], raw: list[float], raw_small: list[float], raw_read: list[float],
         rows: list[dict], rec: dict | None, can_drop: bool, fs: str, rounds: int) -> None:
    """Writes against dd, reads against raw preads and DRAM GETs, and recovery times, as bars."""
    d, cold = statistics.median(dd), "cold" if can_drop else "cache kept"
    writes = [("dd\noflag=direct", d, RAW), ("Python, 64\nMiB groups", statistics.median(raw), RAW),
              ("Python,\nsmall groups", statistics.median(raw_small), RAW),
              ("quilld\ndemotion", med(rows, "demote_MBps"), QUILLD),
              ("quilld ingest\nend to end", med(rows, "ingest_MBps"), QUILLD),
              ("SETs, no\nSSD tier", med(rows, "set_nossd_MBps"), QUILLD)]
    rr, dg = statistics.median(raw_read), med(rows, "get_dram")
    reads = [(f"raw preads\n{cold}", rr, RAW), ("DRAM GET", dg, QUILLD),
             (f"SSD GET\n{cold}", med(rows, "get_off_cold"), QUILLD),
             ("SSD GET\nwarm", med(rows, "get_off_warm"), QUILLD),
             (f"SSD GET +\npromote, {cold}", med(rows, "get_on_cold"), QUILLD)]
    panels = [Panel("writes: 1 MiB blocks to the SSD tier vs the raw disk", [w[0] for w in writes],
                    {"MB/s": [w[1] for w in writes]}, "MB/s (median)", [ratio(w[1], d) for w in writes],
                    bar_colors=[w[2] for w in writes]),
              Panel("reads: 1 MiB GETs from SSD (ratios: vs raw preads)", [r[0] for r in reads],
                    {"GB/s": [r[1] for r in reads]}, "GB/s (median)",
                    [""] + [ratio(r[1], rr) for r in reads[1:]], bar_colors=[r[2] for r in reads])]
    if rec is not None:
        starts = [("empty tier", statistics.median(rec["empty_ms"]) / 1000, statistics.median(rec["empty_wall"])),
                  ("after kill -9\n(WAL replay)", statistics.median(rec["wal_ms"]) / 1000,
                   statistics.median(rec["wal_wall"])),
                  ("after clean stop\n(checkpoint)", statistics.median(rec["ckpt_ms"]) / 1000,
                   statistics.median(rec["ckpt_wall"]))]
        panels.append(Panel(f"restart with {rec['wal_blocks']:,} blocks on SSD", [x[0] for x in starts],
                            {"recovery": [x[1] for x in starts], "start to open port": [x[2] for x in starts]},
                            "seconds (median)", bar_colors=[COLORS[2], COLORS[4]]))
    save(path, panels, "quilld's SSD tier against the raw disk under it (bench/ssd_bench.py)",
         f"{fs}; {os.cpu_count()} cores shared with other work: a noisy disk and CPU; medians of {rounds} round(s). "
         "In the first two, orange: the raw disk, blue: quilld.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where to write (default: a new temporary directory under "
                                  f"{tempfile.gettempdir()}); the SSD tier goes on this disk")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (medians are printed)")
    ap.add_argument("--blocks", type=int, default=512, help="1 MiB blocks SET in the demotion test (and MiB of raw writes)")
    ap.add_argument("--recovery-blocks", type=int, default=100_000, help="4 KiB+1 blocks for the recovery test")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--delete-blocks", type=int, default=2000,
                    help="64 KiB blocks written (about twice the arena) for the delete/overwrite test")
    ap.add_argument("--skip-deletes", action="store_true")
    ap.add_argument("--quick", action="store_true", help="256 blocks, no recovery or delete tests")
    ap.add_argument("--levers", action="store_true", help="also the SSD tier alone in this process, per lever "
                    "(O_DIRECT or not, I/O threads, pipelining, a second pass), each round")
    ap.add_argument("--direct-io", choices=("true", "false"), help="quilld's ssd.direct_io (default: its own)")
    ap.add_argument("--io-threads", type=int, help="quilld's ssd.io_threads (default: its own)")
    ap.add_argument("--keep", action="store_true", help="keep the directory (and quilld's logs) afterwards")
    add_flag(ap)
    a = ap.parse_args()
    if a.quick:
        a.blocks, a.skip_recovery, a.skip_deletes = min(a.blocks, 256), True, True
    io_env = {}
    if a.direct_io:
        io_env["QUILLD_SSD_DIRECT_IO"] = a.direct_io
    if a.io_threads:
        io_env["QUILLD_SSD_IO_THREADS"] = str(a.io_threads)
    if a.dir:
        base = Path(tempfile.mkdtemp(prefix="quilld-ssd-bench-", dir=a.dir))
    else:
        base = Path(tempfile.mkdtemp(prefix="quilld-ssd-bench-"))
    sys.stdout.reconfigure(line_buffering=True)
    can_drop = drop_caches()
    t_start = time.perf_counter()
    print(f"SSD tier benchmark: {describe_fs(base)}; {os.cpu_count()} cores; {a.rounds} round(s), medians")
    print(f"page cache: {'dropped before each cold figure' if can_drop else 'NOT droppable here (not root?): cold = warm-ish'}")
    body = os.urandom(MiB)
    try:
        raw, raw_small, raw_read, dd, direct_ok = [], [], [], [], True
        raw_share, small_share, best = [], [], []
        levers: dict[str, list[tuple[float, float, float]]] = {}
        rows = []
        # the demoter's batch in practice: at least a quarter of the arena per group commit (tiering._pick)
        small_group = DRAM_BYTES // 4 // MiB * MiB
        for rnd in range(1, a.rounds + 1):
            mbps, direct = raw_dd(base / "raw.bin", a.blocks)
            dd.append(mbps)
            direct_ok = direct_ok and direct
            w, rd, sh = raw_group_commit(base, a.blocks, GROUP, read_seed=rnd, can_drop=can_drop)
            raw.append(w)
            raw_read.append(rd)
            raw_share.append(sh)
            w, _, sh = raw_group_commit(base, a.blocks, small_group)
            raw_small.append(w)
            small_share.append(sh)
            best.append(max(dd[-1], raw_small[-1]))
            progress(f"round {rnd}: dd {dd[-1]:.0f} MB/s{'' if direct else ' (no O_DIRECT)'}, "
                     f"pwrite+fdatasync per 64 MiB {raw[-1]:.0f} MB/s, per {small_group // MiB} MiB "
                     f"{raw_small[-1]:.0f} MB/s ({small_share[-1] * 100:.0f}% in fdatasync); "
                     f"random 1 MiB preads {raw_read[-1]:.2f} GB/s")
            if a.levers:
                for name, v in tier_levers(base, a.blocks, small_group).items():
                    levers.setdefault(name, []).append((v[0], v[1], v[0] / best[-1]))
                progress(f"round {rnd}: levers " + "; ".join(f"{k}: {v[-1][0]:.0f} MB/s" for k, v in levers.items()))
            rows.append(demotion_round(base, a.blocks, body, rnd, can_drop, io_env))
            rows[-1]["paired"] = rows[-1]["demote_MBps"] / best[-1]
        rec = None if a.skip_recovery else recovery(base, a.recovery_blocks, a.rounds, can_drop)
        dels = [] if a.skip_deletes else [deletes_round(base, a.delete_blocks, rnd) for rnd in range(1, a.rounds + 1)]

        d = statistics.median(dd)
        cold = "cold" if can_drop else "cache not dropped"
        dd_label = "dd bs=1M oflag=direct conv=fdatasync" if direct_ok else \
            "dd bs=1M conv=fdatasync (O_DIRECT refused by this filesystem)"
        print(f"\n{a.blocks} x 1 MiB blocks; quilld --dram {DRAM} --ssd-size {SSD_SIZE}, segments 256MiB, "
              f"group commit 64MiB; write ratios against dd, GET ratios against the line named\n")
        print("| figure | median | ratio | target |")
        print("|---|---:|---:|---:|")
        print(f"| raw: {dd_label} | {d:,.0f} MB/s | 1.00x | |")
        for label, vals, shares in (
                ("Python 1 MiB pwrites, fdatasync per 64 MiB + WAL fdatasync", raw, raw_share),
                (f"same, per {small_group // MiB} MiB (the demoter's batch at --dram {DRAM})", raw_small, small_share)):
            v = statistics.median(vals)
            print(f"| raw: {label}; {statistics.median(shares) * 100:.0f}% in fdatasync | {v:,.0f} MB/s | "
                  f"{v / d:.2f}x | |")
        bm = statistics.median(best)
        print(f"| raw: best of dd and the loop per {small_group // MiB} MiB, per round (C) | {bm:,.0f} MB/s | "
              f"{bm / d:.2f}x | |")
        dm = med(rows, "demote_MBps")
        paired_med = med(rows, "paired")
        print(f"| quilld demotion: demoted_bytes / demote_usec; {med(rows, 'fsync_share') * 100:.0f}% in fdatasync, "
              f"{rows[-1]['io_mode']} | {dm:,.0f} MB/s | {dm / d:.2f}x; {paired_med:.2f}x C | >= 0.80x C "
              f"{'ok' if paired_med >= 0.8 else 'MISSED'} |")
        for key, label in (("ingest_MBps", "quilld ingest end-to-end: first SET until DRAM settled"),
                           ("set_MBps", "quilld SETs alone (one client, 4-deep pipeline)"),
                           ("set_nossd_MBps", "same SETs, no SSD tier (LRU eviction instead)")):
            v = med(rows, key)
            print(f"| {label} | {v:,.0f} MB/s | {v / d:.2f}x | |")
        rr, dg = statistics.median(raw_read), med(rows, "get_dram")
        print(f"| raw: 1 MiB preads of the Python file, random order, {cold} (A) | {rr:.2f} GB/s | | |")
        print(f"| DRAM GET of the DRAM-resident blocks, same client (B) | {dg:.2f} GB/s | | |")
        for key, label, ref, name in (("get_off_cold", f"SSD GET, promote_on_read off, {cold}", rr, "A"),
                                      ("get_off_warm", "SSD GET, promote_on_read off, warm page cache", dg, "B"),
                                      ("get_on_cold", f"SSD GET, promote_on_read on, {cold}", rr, "A"),
                                      ("get_on_warm", "SSD GET, promote_on_read on, second pass", dg, "B")):
            v = med(rows, key)
            print(f"| {label} | {v:.2f} GB/s | {v / ref:.2f}x {name} | |")
        if levers:
            print(f"\nthe SSD tier alone, in the bench's process: {a.blocks} x 1 MiB from page-aligned memory, "
                  f"batches of {small_group // MiB} MiB, write_blocks + commit (ratios: per round against C)\n")
            print("| lever | median | fdatasync share | ratio to C |")
            print("|---|---:|---:|---:|")
            for name, vals in levers.items():
                print(f"| {name} | {statistics.median(v[0] for v in vals):,.0f} MB/s | "
                      f"{statistics.median(v[1] for v in vals) * 100:.0f}% | {statistics.median(v[2] for v in vals):.2f}x |")
        paired = ", ".join(f"{row['paired']:.2f}" for row in rows)  # against C, the best raw peer
        print(f"\ndemoter: avg batch {med(rows, 'batch_MiB'):.1f} MiB, {med(rows, 'fsyncs'):.0f} fsyncs averaging "
              f"{med(rows, 'fsync_avg_ms'):.1f} ms = {med(rows, 'fsync_share') * 100:.0f}% of demote_usec; busy "
              f"{med(rows, 'busy') * 100:.0f}% of the ingest wall time; demotion / best raw peer (C) per round: {paired}")
        print(f"blocks: {med(rows, 'demoted_MiB'):.0f} MiB demoted, {med(rows, 'ssd_only'):.0f} SSD-only + "
              f"{med(rows, 'dram_resident'):.0f} DRAM-resident at the end; SET errors "
              f"{sum(row['set_errors'] for row in rows)}; promotions with promote_on_read off: "
              f"{max(row['promotions_off'] for row in rows)}; clean stop (flushes DRAM) {med(rows, 'stop_s'):.2f} s")
        if rec is not None:
            print(f"\nrecovery of {a.recovery_blocks:,} blocks of {SMALL_VALUE} B (quilld --dram {RECOVERY_DRAM} "
                  f"--ssd-size {SSD_SIZE}; {'page cache dropped before each start' if can_drop else 'warm page cache'})\n")
            print("| start | blocks | WAL records | recovery_ms | start to port open | target < 2 s |")
            print("|---|---:|---:|---:|---:|---:|")
            e_ms, e_wall = statistics.median(rec["empty_ms"]), statistics.median(rec["empty_wall"])
            print(f"| empty SSD tier (interpreter and imports) | 0 | 0 | {e_ms:.0f} | {e_wall:.2f} s | |")
            for key, label, blocks, records in (("wal", "after SIGKILL: WAL replay", rec["wal_blocks"], rec["wal_records"]),
                                                ("ckpt", "after clean stop: checkpoint", rec["ckpt_blocks"],
                                                 rec["ckpt_records"])):
                ms, wall = statistics.median(rec[f"{key}_ms"]), statistics.median(rec[f"{key}_wall"])
                verdict = "ok" if wall < 2 else ("MISSED (recovery alone ok)" if ms < 2000 else "MISSED")
                print(f"| {label} | {blocks:,} | {records:,} | {ms:.0f} | {wall:.2f} s | {verdict} |")
            print(f"\nfiles saved after SIGKILL: {', '.join(rec['saved_files'])}; "
                  f"after a clean stop: {', '.join(rec['after_clean_stop'])}")
        if dels:
            print(f"\ndeletes and overwrites of SSD-only blocks ({a.delete_blocks} x 64 KiB written through "
                  f"--dram {DRAM}; about {med(dels, 'ssd_only'):.0f} SSD-only, split in three)\n")
            print("| figure | median |")
            print("|---|---:|")
            print(f"| DEL of an SSD-only key, one client: p50 / p99 | {med(dels, 'del_p50_ms'):.2f} / "
                  f"{med(dels, 'del_p99_ms'):.2f} ms ({med(dels, 'del_seq_ops'):,.0f} DEL/s) |")
            print(f"| SET over an SSD-only key (4 KiB+1 value), one client: p50 / p99 | "
                  f"{med(dels, 'set_p50_ms'):.2f} / {med(dels, 'set_p99_ms'):.2f} ms |")
            print(f"| DEL of SSD-only keys, {DELETE_CLIENTS} clients at once | {med(dels, 'del_ops'):,.0f} DEL/s |")
            print(f"| DEL of a DRAM-only key, one client (reference): p50 / p99 | {med(dels, 'dram_p50_ms'):.3f} / "
                  f"{med(dels, 'dram_p99_ms'):.3f} ms |")
            print(f"\nfsyncs in the whole run {med(dels, 'fsyncs'):.0f} (avg {med(dels, 'fsync_avg_ms'):.2f} ms); "
                  f"SSD deletions {med(dels, 'ssd_deletes'):.0f} in {med(dels, 'delete_syncs'):.0f} WAL syncs")
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
        if a.plot:
            plot(a.plot, dd, raw, raw_small, raw_read, rows, rec, can_drop, describe_fs(base).split(" on ", 1)[-1],
                 a.rounds)
    finally:
        if a.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
