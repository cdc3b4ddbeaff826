"""The SSD tier's aligned writes (block format 4): O_DIRECT where the file system allows it,
a clean and reported fallback where it does not (tmpfs before Linux 6.6; ssd.direct_io
off), on /dev/shm and on the test's own disk, and payloads of any
length, in page-aligned memory (as the arena hands them) or not, byte-identical after a
restart. Also: no stale bytes of the memory past a payload's end reach the disk."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest
from conftest import takes_o_direct

from quilld.model import IdentityScope
from quilld.tiers.ssd import PendingWrite, SsdTier, seg_name
from quilld.tiers.ssd_format import PAGE, block_pages, payload_offset

A = IdentityScope("alice", "llama-3-8b", "tok-v1", "")
SEG = 1024 * PAGE  # 4 MiB segments
MiB = 1 << 20
LENGTHS = [1, 4095, 4096, 4097, MiB + 1, 0, 3 * PAGE]


def aligned(data: bytes, tail: bytes = b"") -> memoryview:
    """`data` in page-aligned memory of whole pages (as an arena block), `tail` filling the
    rest of its last page: bytes that must never reach the disk."""
    m = mmap.mmap(-1, max(PAGE, -(-len(data) // PAGE) * PAGE))
    m[:len(data)] = data
    rest = len(m) - len(data)
    m[len(data):] = (tail * (rest // max(len(tail), 1) + 1))[:rest] if tail else bytes(rest)
    return memoryview(m)[:len(data)]


def write(tier: SsdTier, items: list[tuple[bytes, object]]) -> None:
    pending = [PendingWrite(A, key, payload, tier.allocate(A, key, memoryview(payload).nbytes))
               for key, payload in items]
    tier.write_batch(pending)
    tier.publish(pending)


def read(tier: SsdTier, key: bytes) -> bytes:
    e = tier.lookup(A, key)
    buf = bytearray(e.length)
    tier.read_into(e, buf)
    return bytes(buf)


def round_trip(path: Path, **kw) -> tuple[str, dict]:
    """Writes every length from aligned and unaligned memory, reopens, checks every byte;
    returns the tier's I/O mode and the values."""
    rng = random.Random(7)
    values = {}
    kw.setdefault("direct_io", True)
    tier = SsdTier(str(path), 4 * SEG, SEG, fsync=True, **kw)
    tier.recover()
    mode = tier.stats()["io_mode"]
    items = []
    for n in LENGTHS:
        data = rng.randbytes(n)
        values[b"a%d" % n] = values[b"u%d" % n] = data
        items.append((b"a%d" % n, aligned(data, tail=b"STALE!")))
        items.append((b"u%d" % n, data))  # bytes: not page-aligned, copied under O_DIRECT
    write(tier, items[:4])
    write(tier, items[4:])  # a second batch: runs of adjacent blocks, several segments' worth
    for key, data in values.items():
        assert read(tier, key) == data, key
    entries = {key: tier.lookup(A, key) for key in values}
    tier.close()
    for key, e in entries.items():  # the rest of each block's last page is zeros, never the arena's tail
        with open(path / seg_name(e.seg), "rb") as f:
            end = payload_offset(A, key, e.length) + e.length  # a small one packed in its head page
            f.seek(e.offset + end)
            pad = f.read(-end % PAGE)
        assert pad == bytes(len(pad)), key
    tier = SsdTier(str(path), 4 * SEG, SEG, fsync=True, **kw)
    report = tier.recover(verify_payloads=True)
    assert report.recovered == len(values) and report.dropped_corrupt == 0
    for key, data in values.items():
        assert read(tier, key) == data, key
    assert tier.stats()["io_mode"] == mode
    tier.close()
    return mode, values


def test_unaligned_lengths_round_trip_on_this_disk(tmp_path):
    mode, _ = round_trip(tmp_path)
    if takes_o_direct(tmp_path):
        assert mode == "direct"
    else:
        assert mode.startswith("buffered (O_DIRECT refused")


def test_tmpfs_writes_direct_or_falls_back_and_says_why(shm_dir):
    """tmpfs takes O_DIRECT since Linux 6.6 (this machine's 6.18 does); older kernels refuse it
    at open, and the tier then writes buffered and says why. Either way every byte survives."""
    mode, _ = round_trip(shm_dir)
    if takes_o_direct(shm_dir):
        assert mode == "direct"
    else:
        assert mode == "buffered (O_DIRECT refused at open: Invalid argument)"
    assert not (shm_dir / "direct-io.probe").exists()


def test_direct_io_off_is_buffered(tmp_path):
    mode, _ = round_trip(tmp_path, direct_io=False)
    assert mode == "buffered (ssd.direct_io is off)"


@pytest.mark.parametrize("threads", [1, 3])
def test_io_threads_write_the_same_bytes(tmp_path, threads):
    """Many adjacent blocks in one batch are cut into runs written by the I/O threads."""
    rng = random.Random(threads)
    tier = SsdTier(str(tmp_path), 4 * SEG, SEG, fsync=True, io_threads=threads, direct_io=threads > 1)
    tier.recover()
    values = {b"k%03d" % i: rng.randbytes(rng.choice([1, PAGE - 1, PAGE + 1, 200_000])) for i in range(60)}
    write(tier, [(k, aligned(v) if i % 2 else v) for i, (k, v) in enumerate(values.items())])
    assert {k: read(tier, k) for k in values} == values
    used = tier.stats()["used"]
    assert used == sum(block_pages(A, k, len(v)) for k, v in values.items()) * PAGE
    assert tier.stats()["dirty_bytes"] == 0
    tier.close()


@pytest.mark.parametrize("fmt, key_file", [(2, "tier.key"), (3, "tier-v3.key")])
def test_a_tier_of_an_older_format_starts_empty_and_says_so(tmp_path, fmt, key_file):
    tier = SsdTier(str(tmp_path), 4 * SEG, SEG)
    tier.recover()
    write(tier, [(b"k", b"v" * 5000)])
    tier.close()
    os.rename(tmp_path / "tier-v4.key", tmp_path / key_file)  # as that format named its key
    tier = SsdTier(str(tmp_path), 4 * SEG, SEG)
    report = tier.recover()
    assert report.path == "fenced" and report.recovered == 0 and tier.lookup(A, b"k") is None
    assert f"format {fmt}" in report.key_error
    assert not (tmp_path / key_file).exists() and (tmp_path / "tier-v4.key").exists()
    tier.close()
