"""The SSD tier on real files: what is published survives a restart byte for byte,
what was never logged or was deleted does not, damage is detected and counted,
and I/O failures fail the tier instead of publishing."""

import errno
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from crc32c import crc32c

from quilld.errors import ConfigError
from quilld.model import IdentityScope
from quilld.tiers.ssd import CorruptBlock, PendingWrite, SsdFailure, SsdTier, seg_name
from quilld.tiers.ssd_files import checkpoint_name, parse_checkpoint_name
from quilld.tiers.ssd_format import (HEADER_SIZE, PAGE, Loc, block_meta, block_pages, drop_overlaps, payload_offset,
                                     pack_block_header)
from quilld.tiers.wal import parse_wal_name

SEG = 64 * PAGE  # 256 KiB segments keep the files small
SMALL = PAGE  # what a small block takes: header, identity and payload packed in one page (format 4)
A = IdentityScope("alice", "llama-3-8b", "tok-v1", "")
B = IdentityScope("bob", "llama-3-8b", "tok-v1", "lora-7")


class Crash(Exception):
    """Stands in for the process dying at a chosen point."""


def crash(*args, **kwargs):
    raise Crash()


def open_tier(path, segments=4, fsync=False, verify_payloads=False, **kw):
    tier = SsdTier(str(path), segments * SEG, SEG, fsync=fsync, **kw)
    report = tier.recover(verify_payloads=verify_payloads)
    return tier, report


def put(tier, items):
    """Write and publish [(scope, key, payload)] as one batch; returns the entries."""
    pending = []
    for scope, key, payload in items:
        ext = tier.allocate(scope, key, len(payload))
        assert ext is not None, "tier full"
        pending.append(PendingWrite(scope, key, payload, ext))
    tier.write_batch(pending)
    entries = tier.publish(pending)
    reap(tier)
    return entries


def reap(tier):
    """What the tiering does after a publish, a forget or an unpin: scrub, then reclaim."""
    freed = tier.take_freed()
    tier.scrub(freed)
    tier.reclaim(freed)
    return freed


def delete(tier, keys):
    entries = [tier.lookup(scope, key) for scope, key in keys]
    tier.log_deletes(entries)
    for e in entries:
        tier.forget(e)
    reap(tier)


def checkpoints(path):
    return sorted(n for n in map(parse_checkpoint_name, os.listdir(path)) if n is not None)


def pages_of(items):
    """Pages the blocks [(scope, key, payload)] take on the tier."""
    return sum(block_pages(scope, key, len(data)) for scope, key, data in items)


def read(tier, entry):
    buf = bytearray(entry.length)
    tier.read_into(entry, buf)
    return bytes(buf)


def contents(tier):
    return {k: read(tier, e) for k, e in tier.entries.items()}


def index(tier):
    return {k: (e.seg, e.offset, e.length, e.crc, e.generation) for k, e in tier.entries.items()}


def payload(rng, n=None):
    return rng.randbytes(rng.randrange(1, 3 * PAGE) if n is None else n)


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def wal_files(path):
    return sorted(n for n in map(parse_wal_name, os.listdir(path)) if n is not None)


def test_write_publish_read_is_byte_identical(tmp_path):
    tier, report = open_tier(tmp_path, fsync=True)
    assert report.recovered == 0 and report.path == "fresh" and sorted(os.listdir(tmp_path)) == [
        "LOCK", "seg-00000.dat", "seg-00001.dat", "seg-00002.dat", "seg-00003.dat", "tier-v4.key", "wal-000001.log"]
    rng = random.Random(1)
    sizes = [0, 1, PAGE, PAGE + 1, 100_000]  # packed in the head page, or a head page and whole payload pages
    items = [(A, b"k%d" % i, rng.randbytes(n)) for i, n in enumerate(sizes)]
    items.append((B, b"k0", memoryview(bytearray(b"shared key, other scope"))))
    entries = put(tier, items)
    assert len(entries) == len(items) == len(tier.entries)
    for (scope, key, data), e in zip(items, entries):
        assert tier.lookup(scope, key) is e
        assert read(tier, e) == bytes(data)
    big = tier.lookup(A, b"k4")
    out = np.zeros(big.length + 10, dtype=np.uint8)  # any writable buffer, longer is fine
    tier.read_into(big, out)
    assert out[:big.length].tobytes() == items[4][2] and not out[big.length:].any()
    with pytest.raises(ValueError):
        tier.read_into(big, bytearray(big.length - 1))
    st = tier.stats()
    assert st["entries"] == 6 and st["fsyncs"] >= 2 and st["dirty_bytes"] == 0
    assert st["used"] == pages_of(items) * PAGE
    assert [block_pages(s, k, len(d)) for s, k, d in items[:5]] == [1, 1, 2, 3, 26]
    assert st["capacity"] == 4 * SEG and not st["failed"]
    tier.close()


def test_reopen_recovers_everything(tmp_path):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(2)
    model = {}
    for batch in range(5):
        items = [(rng.choice([A, B]), b"b%d-%d" % (batch, i), payload(rng)) for i in range(8)]
        put(tier, items)
        model.update({(s, k): d for s, k, d in items})
    before = index(tier)
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.recovered == len(model) == 40
    assert report.dropped_corrupt == report.dropped_torn_wal_records == 0
    assert report.wal_records == 40 and report.checkpoint_error is None and report.path == "log"
    assert index(tier) == before
    assert contents(tier) == model
    # recovery ended with a checkpoint and a fresh log; a third open reads only the checkpoint
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.checkpoint_entries == 40 and report.wal_records == 0 and report.path == "checkpoint"
    assert contents(tier) == model
    tier.close()


def random_ops(tier, rng, model, steps, checkpoint_every=None):
    keys = [(s, b"key-%d" % i) for s in (A, B) for i in range(12)]
    for step in range(steps):
        live = [k for k in keys if k in model]
        if live and rng.random() < 0.3:
            gone = rng.sample(live, rng.randint(1, min(3, len(live))))
            delete(tier, gone)
            for k in gone:
                del model[k]
        else:
            chosen = {k: payload(rng) for k in rng.sample(keys, rng.randint(1, 4))}
            put(tier, [(s, k, d) for (s, k), d in chosen.items()])
            model.update(chosen)
        if checkpoint_every and step % checkpoint_every == checkpoint_every - 1:
            assert tier.checkpoint() is not None


def test_checkpoint_then_log_equals_log_alone(tmp_path):
    model_a, model_b = {}, {}
    a, _ = open_tier(tmp_path / "a")
    b, _ = open_tier(tmp_path / "b")
    random_ops(a, random.Random(3), model_a, 60, checkpoint_every=17)
    random_ops(b, random.Random(3), model_b, 60)
    assert model_a == model_b
    assert index(a) == index(b)
    live_a = index(a)
    # three checkpoints were written; the newest two are kept, with the logs the older one needs
    assert len(checkpoints(tmp_path / "a")) == 2
    assert wal_files(tmp_path / "a")[0] == checkpoints(tmp_path / "a")[0]
    a.close()
    b.close()
    a, ra = open_tier(tmp_path / "a")
    b, rb = open_tier(tmp_path / "b")
    assert ra.checkpoint_entries > 0 and rb.checkpoint_entries == 0
    assert rb.wal_records > ra.wal_records > 0
    assert index(a) == index(b) == live_a
    assert contents(a) == contents(b) == model_a
    a.close()
    b.close()


def test_allocations_after_recovery_never_overlap_live_blocks(tmp_path):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(4)
    model = {}
    for i in range(40):
        k = (A, b"x%d" % i)
        put(tier, [(*k, payload(rng))])
        model[k] = read(tier, tier.lookup(*k))
    holes = rng.sample(sorted(model), 15)
    delete(tier, holes)
    for k in holes:
        del model[k]
    used = tier.stats()["used"]
    tier.close()
    tier, _ = open_tier(tmp_path)
    assert tier.stats()["used"] == used
    i = 0
    while True:  # fill every gap and the rest of the tier
        k = (B, b"fill%d" % i)
        data = payload(rng, rng.choice([1, PAGE, 2 * PAGE]))
        ext = tier.allocate(*k, len(data)) or tier.allocate(*k, 0)
        if ext is None:
            break
        tier.release_extent(ext)
        data = data if ext.pages >= block_pages(*k, len(data)) else b""
        put(tier, [(*k, data)])
        model[k] = data
        i += 1
    assert tier.stats()["used"] == tier.capacity
    assert contents(tier) == model
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.dropped_corrupt == 0 and contents(tier) == model
    tier.close()


def test_deletes_survive_restart(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"keep", b"1"), (A, b"drop", b"2"), (B, b"drop", b"3")])
    delete(tier, [(A, b"drop")])
    tier.close()
    tier, _ = open_tier(tmp_path)
    assert contents(tier) == {(A, b"keep"): b"1", (B, b"drop"): b"3"}
    delete(tier, [(B, b"drop")])
    tier.checkpoint()
    tier.close()
    tier, _ = open_tier(tmp_path)
    assert contents(tier) == {(A, b"keep"): b"1"}
    assert tier.stats()["used"] == SMALL
    tier.close()


def test_newer_put_of_a_key_wins_after_restart(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"k", b"old" * 3000)])
    put(tier, [(A, b"k", b"new")])
    assert tier.stats()["used"] == SMALL  # the old extent was freed (scrubbed) once the new PUT was durable
    # two versions in flight, made durable and published newest first
    first, second = tier.allocate(B, b"k", 5), tier.allocate(B, b"k", 5)
    w1, w2 = PendingWrite(B, b"k", b"v-one", first), PendingWrite(B, b"k", b"v-two", second)
    tier.write_batch([w2])
    tier.write_batch([w1])
    tier.publish([w2])
    assert tier.publish([w1]) == []  # older than what is indexed: not indexed, freed
    assert [f[:2] for f in reap(tier)] == [(first.seg, first.offset)]
    assert read(tier, tier.lookup(B, b"k")) == b"v-two"
    assert tier.stats()["used"] == 2 * SMALL
    tier.close()
    tier, _ = open_tier(tmp_path)
    assert contents(tier) == {(A, b"k"): b"new", (B, b"k"): b"v-two"}
    assert tier.stats()["used"] == 2 * SMALL
    tier.close()


def test_pinned_entry_keeps_its_space_until_unpinned(tmp_path):
    tier, _ = open_tier(tmp_path, segments=1)
    (old,) = put(tier, [(A, b"k", b"a" * 100)])
    tier.pin(old)
    put(tier, [(A, b"k", b"b" * 100)])
    assert tier.stats()["used"] == 2 * SMALL and not tier.has_freed
    assert read(tier, old) == b"a" * 100  # still readable: nothing can reuse the space
    tier.unpin(old)
    assert tier.stats()["used"] == 2 * SMALL and tier.has_freed  # freed, but not reusable before its scrub
    reap(tier)
    assert tier.stats()["used"] == SMALL
    tier.close()


def test_corrupt_payload_is_dropped_at_recovery_and_counted(tmp_path):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(5)
    model = {(A, b"p%d" % i): payload(rng, 3000) for i in range(10)}
    put(tier, [(s, k, d) for (s, k), d in model.items()])
    victim = tier.lookup(A, b"p3")
    tier.close()
    flip_byte(tmp_path / seg_name(victim.seg), victim.offset + payload_offset(A, b"p3", 3000) + 1234)
    # header-only verification keeps it, and the read catches it
    tier, report = open_tier(tmp_path)
    assert report.recovered == 10 and report.dropped_corrupt == 0
    with pytest.raises(CorruptBlock):
        read(tier, tier.lookup(A, b"p3"))
    tier.close()
    tier, report = open_tier(tmp_path, verify_payloads=True)
    assert report.recovered == 9 and report.dropped_corrupt == 1
    del model[(A, b"p3")]
    assert contents(tier) == model
    tier.close()
    tier, report = open_tier(tmp_path)  # the drop was made durable by recovery's checkpoint
    assert report.recovered == 9 and contents(tier) == model
    tier.close()


def test_corrupt_block_header_is_dropped_without_payload_verification(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"a", b"x" * 10), (A, b"b", b"y" * 10)])
    victim = tier.lookup(A, b"b")
    tier.close()
    flip_byte(tmp_path / seg_name(victim.seg), victim.offset + 20)
    tier, report = open_tier(tmp_path)
    assert report.dropped_corrupt == 1 and contents(tier) == {(A, b"a"): b"x" * 10}
    assert tier.stats()["used"] == SMALL
    tier.close()


def test_lost_delete_record_cannot_let_two_blocks_share_pages(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path)
    (old,) = put(tier, [(A, b"old", b"o" * (3 * PAGE))])
    assert (old.seg, old.offset) == (0, 0)
    tier.checkpoint()  # "old" now lives in the checkpoint; wal-000002 is current
    wal2 = tmp_path / "wal-000002.log"
    tier.log_deletes([old])  # the DEL goes to wal-000002
    tier.forget(old)
    tier.reclaim(tier.take_freed())  # the space is free again, its scrub skipped: "old"'s header survives
    monkeypatch.setattr(tier.files, "load_state", crash)
    with pytest.raises(Crash):
        tier.checkpoint()  # sealed wal-000002; later records go to wal-000003
    monkeypatch.undo()
    spacer = tier.allocate(A, b"s", 1)  # keeps page 0
    (new,) = put(tier, [(A, b"new", b"n" * 100)])
    tier.release_extent(spacer)
    assert (new.seg, new.offset) == (0, PAGE)  # inside "old"'s former extent (pages 0-3)
    tier.close()
    flip_byte(wal2, 12)  # lose the DEL
    tier, report = open_tier(tmp_path)
    assert report.dropped_torn_wal_records == 1 and report.dropped_corrupt == 1
    assert contents(tier) == {(A, b"new"): b"n" * 100}
    assert tier.stats()["used"] == SMALL
    tier.close()


def test_drop_overlaps_keeps_the_newest_of_each_cluster():
    def found(page, pages, gen):
        return (page, pages, (A, b"g%d" % gen), Loc(0, page * PAGE, pages * PAGE - HEADER_SIZE, 0, gen))

    clean = [found(0, 2, 1), found(2, 1, 2), found(5, 3, 3)]
    assert drop_overlaps(clean) == clean
    # 10..20 (gen 4) holds 12..13 (gen 9) and 15..18 (gen 5); 19..22 (gen 6) chains on; 30 is apart
    items = sorted([found(10, 10, 4), found(12, 1, 9), found(15, 3, 5), found(19, 3, 6),
                    found(30, 1, 1)])
    kept = drop_overlaps(items)
    assert [f[3].generation for f in kept] == [9, 5, 6, 1]


def test_read_into_with_crc_mismatch_raises_corrupt_block(tmp_path):
    tier, _ = open_tier(tmp_path)
    (e, f) = put(tier, [(A, b"a", b"payload" * 100), (A, b"b", b"other" * 100)])
    flip_byte(tmp_path / seg_name(e.seg), e.offset + payload_offset(A, b"a", 700) + 5)
    with pytest.raises(CorruptBlock, match="payload checksum"):
        read(tier, e)
    flip_byte(tmp_path / seg_name(f.seg), f.offset + 8)  # the key digest
    with pytest.raises(CorruptBlock, match="header"):
        read(tier, f)
    assert not tier.failed
    tier.log_deletes([e])  # what the caller does next
    tier.forget(e)
    assert tier.lookup(A, b"a") is None
    tier.close()


def test_corrupt_wal_byte_falls_back_to_a_scan_that_loses_no_committed_block(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"one", b"1")])
    wal = tmp_path / "wal-000001.log"
    cut = os.path.getsize(wal)
    put(tier, [(A, b"two", b"2")])
    put(tier, [(A, b"three", b"3")])
    tier.close()
    flip_byte(wal, cut + 10)
    tier, report = open_tier(tmp_path)
    # before issue 19.18 the replay stopped there and "two" and "three" were lost
    assert contents(tier) == {(A, b"one"): b"1", (A, b"two"): b"2", (A, b"three"): b"3"}
    assert report.path == "segment-scan" and "damaged log" in report.scan_reason
    # "two" and "three" were in the damaged 32 KiB block of the log: the scan found them
    assert report.dropped_torn_wal_records == 1 and report.wal_records == 1 and report.scanned_blocks == 3
    assert report.wal_stops == [f"wal-000001.log@{cut}: corrupt (fragment checksum mismatch)"]
    assert tier.stats()["used"] == 3 * SMALL
    put(tier, [(A, b"four", b"4")])
    tier.close()
    tier, report = open_tier(tmp_path)  # the scan's result was checkpointed: the next restart is clean
    assert report.path == "checkpoint" and report.dropped_torn_wal_records == 0
    assert contents(tier) == {(A, b"one"): b"1", (A, b"two"): b"2", (A, b"three"): b"3", (A, b"four"): b"4"}
    tier.close()


def test_torn_wal_tail_falls_back_to_a_scan(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"one", b"1")])
    put(tier, [(A, b"two", b"2")])
    tier.close()
    wal = tmp_path / "wal-000001.log"
    os.truncate(wal, os.path.getsize(wal) - 3)
    tier, report = open_tier(tmp_path)
    # "two" is COMMITTED on disk, so its record was durable before the log lost it: it comes back
    assert contents(tier) == {(A, b"one"): b"1", (A, b"two"): b"2"}
    assert report.path == "segment-scan" and report.dropped_torn_wal_records == 1 and "torn" in report.wal_stops[0]
    tier.close()


def test_crash_between_payload_write_and_wal_append(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path, fsync=True)
    put(tier, [(A, b"before", b"b")])
    monkeypatch.setattr(SsdTier, "_append", crash)
    ext = tier.allocate(A, b"lost", 11)
    with pytest.raises(Crash):
        tier.write_batch([PendingWrite(A, b"lost", b"unlogged!!!", ext)])
    with open(tmp_path / seg_name(ext.seg), "rb") as f:  # the payload did reach the segment
        f.seek(ext.offset + payload_offset(A, b"lost", 11))
        assert f.read(11) == b"unlogged!!!"
    tier.close()
    monkeypatch.undo()
    tier, report = open_tier(tmp_path)
    assert contents(tier) == {(A, b"before"): b"b"}
    assert report.dropped_corrupt == 0 and tier.stats()["used"] == SMALL
    tier.close()


@pytest.mark.parametrize("point", ["seal", "tmp-written", "renamed", "old-logs-kept"])
def test_crash_during_checkpoint_recovers(tmp_path, monkeypatch, point):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(6)
    model = {}
    random_ops(tier, rng, model, 10, checkpoint_every=5)
    random_ops(tier, rng, model, 10)
    live = index(tier)
    assert checkpoints(tmp_path) == [2, 3] and wal_files(tmp_path) == [2, 3]
    real_replace = os.replace
    half = tmp_path / (checkpoint_name(4) + ".tmp")
    if point == "seal":  # new log open, nothing written yet
        monkeypatch.setattr(tier.files, "load_state", crash)
    elif point == "tmp-written":  # checkpoint-000004.tmp complete but not renamed
        monkeypatch.setattr(os, "replace", crash)
    elif point == "renamed":  # new checkpoint in place, the old one and old logs not yet deleted
        monkeypatch.setattr(tier.files, "retain", crash)
    else:  # as "renamed", and a temp file left half written by an earlier crash
        monkeypatch.setattr(tier.files, "retain", crash)
        (tmp_path / (checkpoint_name(9) + ".tmp")).write_bytes(b"half a checkpoint")
    with pytest.raises(Crash):
        tier.checkpoint()
    monkeypatch.setattr(os, "replace", real_replace)
    tier.close()
    monkeypatch.undo()
    assert half.exists() == (point == "tmp-written")
    assert checkpoints(tmp_path) == ([2, 3] if point in ("seal", "tmp-written") else [2, 3, 4])
    assert wal_files(tmp_path) == [2, 3, 4]
    tier, report = open_tier(tmp_path)
    assert report.checkpoint_error is None and report.dropped_torn_wal_records == 0
    assert report.path == "checkpoint"
    assert index(tier) == live and contents(tier) == model
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert_retention(tmp_path)
    tier.close()


def assert_retention(path):
    """At most two checkpoints; with two, the logs start at the older one's number."""
    ckpts = checkpoints(path)
    assert 1 <= len(ckpts) <= 2
    if len(ckpts) == 2:
        assert wal_files(path)[0] == ckpts[0]


def test_full_tier_allocate_returns_none(tmp_path):
    tier = SsdTier(str(tmp_path), 2 * 4 * PAGE, 4 * PAGE, fsync=False)
    tier.recover()
    assert tier.allocate(A, b"k", 4 * PAGE) is None  # with its head page, larger than a segment
    extents = [tier.allocate(A, b"k", PAGE) for _ in range(4)]  # a head page and a payload page each
    assert all(extents) and {e.seg for e in extents} == {0, 1}
    assert len({(e.seg, e.offset) for e in extents}) == 4
    assert tier.allocate(A, b"k", 1) is None
    tier.release_extent(extents[3])
    assert tier.allocate(A, b"k", PAGE + 1) is None and tier.allocate(A, b"k", 1) is not None
    tier.close()


def test_failing_fsync_fails_the_tier_and_publishes_nothing(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path, fsync=True)
    (good,) = put(tier, [(A, b"good", b"g" * 50)])
    calls = []

    def eio(fd):
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    items = [PendingWrite(A, b"k%d" % i, b"v" * 100, tier.allocate(A, b"k%d" % i, 100)) for i in range(3)]
    with pytest.raises(SsdFailure, match="Input/output error"):
        tier.write_batch(items)
    assert len(calls) == 1  # not retried
    assert tier.failed and tier.stats()["failed"] and "Input/output" in tier.stats()["error"]
    assert not any(it.durable for it in items)
    with pytest.raises(ValueError):
        tier.publish(items)
    monkeypatch.undo()  # a later fsync that would succeed does not make the tier whole
    with pytest.raises(SsdFailure):
        tier.write_batch([PendingWrite(A, b"again", b"x", items[0].extent)])
    with pytest.raises(SsdFailure):
        tier.log_deletes([good])
    with pytest.raises(SsdFailure):
        tier.checkpoint()
    assert tier.allocate(A, b"k", 10) is None and not tier.needs_checkpoint()
    assert tier.lookup(A, b"k0") is None
    assert read(tier, good) == b"g" * 50  # published blocks stay readable
    tier.close()
    tier, report = open_tier(tmp_path)
    assert contents(tier) == {(A, b"good"): b"g" * 50}
    tier.close()


def test_failing_wal_fsync_fails_the_tier(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path, fsync=True)
    wal_fd = tier._wal.fd
    real = os.fdatasync

    def fail_wal(fd):
        if fd == wal_fd:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fail_wal)
    item = PendingWrite(A, b"k", b"v", tier.allocate(A, b"k", 1))
    with pytest.raises(SsdFailure):
        tier.write_batch([item])
    assert tier.failed and not item.durable
    tier.close()


def test_enospc_creating_segments(tmp_path, monkeypatch):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    tier = SsdTier(str(tmp_path), 2 * SEG, SEG)
    # a directory the tier cannot be created in refuses the start (issue 18.3), as redis an unusable dir
    with pytest.raises(ConfigError, match="cannot be used: No space left"):
        tier.recover()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("seg-")]


def test_fallocate_unsupported_falls_back_to_ftruncate(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    tier, _ = open_tier(tmp_path, segments=2)
    assert os.path.getsize(tmp_path / seg_name(1)) == SEG
    put(tier, [(A, b"k", b"v")])
    tier.close()


def test_unreadable_segment_fails_the_tier(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path)
    (e,) = put(tier, [(A, b"k", b"v")])

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(SsdFailure):
        read(tier, e)
    assert tier.failed
    tier.close()


def test_segment_layout_must_match_the_config(tmp_path):
    tier, _ = open_tier(tmp_path, segments=2)
    tier.close()
    with pytest.raises(ConfigError, match="segment_size"):
        SsdTier(str(tmp_path), 4 * SEG, SEG // 2).recover()
    with pytest.raises(ConfigError, match="beyond"):
        SsdTier(str(tmp_path), SEG, SEG).recover()
    tier, _ = open_tier(tmp_path, segments=3)  # growing adds a segment
    assert tier.capacity == 3 * SEG and os.path.exists(tmp_path / seg_name(2))
    tier.close()


def test_needs_checkpoint_and_log_rotation(tmp_path):
    tier, _ = open_tier(tmp_path, checkpoint_wal_bytes=2000)
    while not tier.needs_checkpoint():
        put(tier, [(A, os.urandom(8), b"x")])
    n = len(tier.entries)
    assert tier.checkpoint() == n
    assert not tier.needs_checkpoint() and tier.stats()["wal_bytes"] == 0
    assert tier.stats()["last_checkpoint"] > 0
    assert checkpoints(tmp_path) == [2] and wal_files(tmp_path) == [1, 2]  # one checkpoint: every log kept
    put(tier, [(A, b"more", b"x")])
    assert tier.checkpoint() == n + 1
    assert checkpoints(tmp_path) == [2, 3] and wal_files(tmp_path) == [2, 3]
    tier.close()


def test_writes_continue_while_a_checkpoint_runs(tmp_path):
    tier, _ = open_tier(tmp_path, segments=8)
    rng = random.Random(7)
    model = {}
    with ThreadPoolExecutor(max_workers=3) as pool:  # the loop thread is this one
        checkpoints = []
        for round_ in range(12):
            if round_ % 3 == 0:
                checkpoints.append(pool.submit(tier.checkpoint))
            batches = []
            for b in range(2):
                chosen = {(A, b"r%d-%d-%d" % (round_, b, i)): payload(rng, 500) for i in range(5)}
                pending = [PendingWrite(s, k, d, tier.allocate(s, k, len(d))) for (s, k), d in chosen.items()]
                batches.append((pool.submit(tier.write_batch, pending), pending, chosen))
            for future, pending, chosen in batches:
                future.result()
                tier.publish(pending)
                model.update(chosen)
        assert sum(f.result() is not None for f in checkpoints) >= 1
    live = index(tier)
    tier.close()
    tier, report = open_tier(tmp_path, segments=8)
    assert report.dropped_corrupt == report.dropped_torn_wal_records == 0
    assert index(tier) == live and contents(tier) == model
    tier.close()


def test_recovery_of_100k_blocks_is_fast(tmp_path):
    n = 100_000
    seg = 16 << 20
    path = tmp_path / "big"
    try:
        tier = SsdTier(str(path), 52 * seg, seg, fsync=False)
        tier.recover()
        data = b"kv-block" * 4
        for start in range(0, n, 10_000):
            put(tier, [(A, b"block-%08d" % i, data) for i in range(start, start + 10_000)])
        tier.close()
        calls = []
        tier = SsdTier(str(path), 52 * seg, seg, fsync=False)
        wall, cpu = time.perf_counter(), time.process_time()
        report = tier.recover(progress=lambda done, total: calls.append((done, total)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"\nrecovery of {n} blocks from the log (replay, verify headers, rebuild, "
              f"checkpoint): {wall:.2f} s wall, {cpu:.2f} s cpu")
        assert report.recovered == n and report.dropped_corrupt == 0 and report.wal_records == n
        assert calls[0] == (10_000, n) and calls[-1] == (n, n)
        assert len(calls) == len(set(calls)) == n // 10_000  # each step reported once
        assert read(tier, tier.lookup(A, b"block-00054321")) == data
        assert wall < 30  # a guard against a pathological (say quadratic) recovery, not a speed target
        tier.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- a damaged checkpoint never loses the tier (issue 11, finding 9) -----------------------

def body_byte(path, n):
    """Flip one byte of checkpoint `n`'s body (its header is 64 bytes)."""
    flip_byte(path / checkpoint_name(n), HEADER_SIZE + 7)


def history(tmp_path, checkpoints_written):
    """A tier with a history of puts, overwrites and deletes and `checkpoints_written`
    checkpoints among them; returns (tier, model)."""
    tier, _ = open_tier(tmp_path)
    rng = random.Random(11)
    model = {}
    for _ in range(checkpoints_written):
        random_ops(tier, rng, model, 8)
        assert tier.checkpoint() is not None
    random_ops(tier, rng, model, 8)  # and some after the last checkpoint
    return tier, model


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_its_logs(tmp_path):
    tier, model = history(tmp_path, 3)
    live = index(tier)
    tier.close()
    older, newest = checkpoints(tmp_path)
    assert wal_files(tmp_path)[0] == older  # the logs the previous checkpoint needs are kept
    body_byte(tmp_path, newest)
    tier, report = open_tier(tmp_path)
    assert report.path == "previous-checkpoint"
    assert report.checkpoint_errors and checkpoint_name(newest) in report.checkpoint_errors[0]
    assert index(tier) == live and contents(tier) == model  # nothing lost
    assert report.dropped_corrupt == 0
    # recovery wrote a new checkpoint; the damaged one is gone, the one it used is kept
    assert checkpoints(tmp_path) == [older, checkpoints(tmp_path)[-1]] and checkpoints(tmp_path)[-1] > newest
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.path == "checkpoint" and not report.checkpoint_errors
    assert index(tier) == live and contents(tier) == model
    tier.close()


def test_the_only_checkpoint_damaged_replays_the_logs_from_the_first(tmp_path):
    tier, model = history(tmp_path, 1)
    live = index(tier)
    tier.close()
    assert checkpoints(tmp_path) == [2] and wal_files(tmp_path)[0] == 1  # every log kept
    body_byte(tmp_path, 2)
    tier, report = open_tier(tmp_path)
    assert report.path == "log" and report.checkpoint_errors
    assert index(tier) == live and contents(tier) == model
    tier.close()


def test_every_checkpoint_damaged_falls_back_to_a_segment_scan(tmp_path):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(12)
    model = {}
    # early history, whose records no kept log holds after the checkpoints below: a version
    # deleted, and a key overwritten and then deleted (its older version must not return either)
    put(tier, [(A, b"gone", b"g" * 5000), (A, b"twice", b"first" * 900), (B, b"kept", b"K" * 3000)])
    put(tier, [(A, b"twice", b"second" * 700)])
    delete(tier, [(A, b"gone"), (A, b"twice")])
    model[(B, b"kept")] = b"K" * 3000
    for _ in range(3):
        random_ops(tier, rng, model, 8)
        assert tier.checkpoint() is not None
    random_ops(tier, rng, model, 10)
    live = index(tier)
    tier.close()
    older, newest = checkpoints(tmp_path)
    assert wal_files(tmp_path)[0] == older > 1  # the early records are gone with their logs
    body_byte(tmp_path, older)
    body_byte(tmp_path, newest)
    tier, report = open_tier(tmp_path)
    assert report.path == "segment-scan" and len(report.checkpoint_errors) == 2
    assert report.scanned_blocks >= len(model) and report.dropped_corrupt == 0
    assert index(tier) == live and contents(tier) == model  # every live block, no dead or older one
    assert tier.lookup(A, b"gone") is None and tier.lookup(A, b"twice") is None
    tier.close()
    tier, report = open_tier(tmp_path)  # the scan's result was checkpointed
    assert report.path == "checkpoint" and contents(tier) == model
    assert_retention(tmp_path)
    tier.close()


def damage_every_checkpoint(tmp_path):
    for n in checkpoints(tmp_path):
        body_byte(tmp_path, n)


def test_a_scan_takes_no_uncommitted_or_forged_block(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path)
    # a tenant's payload that imitates a committed header (and identity) for another
    # tenant's key at a page boundary; the imitation cannot know the tier key
    forged_payload = b"forged!" * 100
    forged = pack_block_header(b"victim", A, 10 ** 9, len(forged_payload), crc32c(forged_payload),
                               committed=True, tier_key=os.urandom(32))
    inner = (forged + block_meta(A, b"victim")).ljust(PAGE, b"\0") + forged_payload
    carrier = b"c" * PAGE + inner + b"c" * 100  # `inner` starts on a page boundary of the payload
    put(tier, [(B, b"carrier", carrier), (B, b"also-dead", carrier), (A, b"real", b"r" * 100)])
    # a block written but never logged (the process died before its WAL record)
    monkeypatch.setattr(SsdTier, "_append", crash)
    with pytest.raises(Crash):
        tier.write_batch([PendingWrite(A, b"unlogged", b"u" * 100, tier.allocate(A, b"unlogged", 100))])
    monkeypatch.undo()
    delete(tier, [(B, b"also-dead")])  # its first page scrubbed, the imitation left in place
    tier.close()
    tier, _ = open_tier(tmp_path)  # (writes checkpoint #1, keeps log 1)
    tier.checkpoint()
    tier.checkpoint()  # two more: log 1 goes, the scan has only the segments
    tier.close()
    assert wal_files(tmp_path)[0] > 1
    damage_every_checkpoint(tmp_path)
    tier, report = open_tier(tmp_path)
    assert report.path == "segment-scan"
    assert contents(tier) == {(B, b"carrier"): carrier, (A, b"real"): b"r" * 100}
    assert report.scan_refused >= 3  # two imitations (tag) and the unlogged block (not committed)
    tier.close()


def test_a_crash_before_a_scrub_is_scrubbed_at_recovery(tmp_path):
    tier, _ = open_tier(tmp_path)
    (dead,) = put(tier, [(A, b"dead", b"d" * 200)])
    put(tier, [(A, b"live", b"l" * 200)])
    tier.checkpoint()
    tier.log_deletes([dead])  # the DEL is durable, then the process dies before the scrub
    tier.forget(dead)
    tier.close()
    with open(tmp_path / seg_name(dead.seg), "rb") as f:
        f.seek(dead.offset)
        assert f.read(4) == b"QSB1"
    tier, report = open_tier(tmp_path)
    assert report.scrubbed == 1 and contents(tier) == {(A, b"live"): b"l" * 200}
    with open(tmp_path / seg_name(dead.seg), "rb") as f:
        f.seek(dead.offset)
        assert f.read(PAGE) == bytes(PAGE)
    tier.checkpoint()
    tier.close()
    damage_every_checkpoint(tmp_path)
    tier, report = open_tier(tmp_path)
    assert report.path in ("log", "segment-scan") and contents(tier) == {(A, b"live"): b"l" * 200}
    tier.close()


def test_recovery_marks_committed_the_blocks_a_crash_left_unmarked(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path)
    monkeypatch.setattr("quilld.tiers.ssd.commit_header", lambda header: header)  # died before the marks
    put(tier, [(A, b"k", b"v" * 300)])
    monkeypatch.undo()
    tier.close()
    tier, _ = open_tier(tmp_path)  # the log proves the block: recovery marks it
    tier.checkpoint()
    tier.checkpoint()
    tier.close()
    damage_every_checkpoint(tmp_path)
    tier, report = open_tier(tmp_path)
    assert report.path == "segment-scan" and contents(tier) == {(A, b"k"): b"v" * 300}
    tier.close()


def test_a_fenced_tier_starts_empty_and_no_scan_finds_its_blocks(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"old", b"o" * 500), (B, b"old", b"p" * 500)])
    tier.checkpoint()
    tier.failed = "simulated EIO"  # a failed tier cannot log deletions any more: it fences itself
    with pytest.raises(SsdFailure):
        tier.log_deletes([tier.lookup(A, b"old")])
    tier.fence()
    assert tier.stats()["fenced"]
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.path == "fenced" and contents(tier) == {} and tier.stats()["used"] == 0
    assert checkpoints(tmp_path) == [] or report.recovered == 0
    put(tier, [(A, b"new", b"n" * 500)])
    tier.checkpoint()
    tier.checkpoint()
    tier.checkpoint()
    tier.close()
    damage_every_checkpoint(tmp_path)
    tier, report = open_tier(tmp_path)
    assert report.path == "segment-scan" and contents(tier) == {(A, b"new"): b"n" * 500}
    assert report.scan_refused >= 1  # a fenced block ("new" took the other's place): its tag is the old key's
    tier.close()


def test_a_tier_of_the_older_format_starts_empty(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"k", b"v")])
    tier.close()
    os.unlink(tmp_path / "tier-v4.key")  # format 1 had no key, and one checkpoint file
    (tmp_path / "checkpoint").write_bytes(b"QSCK format 1")
    tier, report = open_tier(tmp_path)
    assert report.path == "fenced" and contents(tier) == {}
    assert not (tmp_path / "checkpoint").exists()
    tier.close()


# -- deletions are durable when log_deletes returns (issue 11, finding 8) ---------------------

def test_log_deletes_is_durable_on_return_with_one_sync_for_a_group(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path, segments=160, fsync=True)
    entries = put(tier, [(A, b"d%d" % i, b"x") for i in range(5000)])
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    wal_fd = tier._wal.fd
    tier.log_deletes(entries)  # more than one record's worth: still one sync
    assert synced == [wal_fd]
    monkeypatch.undo()
    # durable before forget: a crash right here (no forget, no scrub) loses no deletion
    tier.close()
    tier, report = open_tier(tmp_path, segments=160)
    assert contents(tier) == {} and report.wal_records == 10_000
    assert report.scrubbed == 5000  # recovery did the scrubs the crash prevented
    tier.close()


def test_freed_space_is_reused_only_after_its_scrub(tmp_path):
    tier, _ = open_tier(tmp_path, segments=1)
    fits = PAGE  # a head page and a payload page
    put(tier, [(A, b"k%02d" % i, b"x" * fits) for i in range(32)])  # the whole segment
    entry = tier.lookup(A, b"k05")
    tier.log_deletes([entry])
    tier.forget(entry)
    assert tier.allocate(A, b"k", 1) is None  # freed but not scrubbed: not reusable yet
    freed = tier.take_freed()
    tier.scrub(freed)
    with open(tmp_path / seg_name(0), "rb") as f:
        f.seek(entry.offset)
        assert f.read(PAGE) == bytes(PAGE)
    tier.reclaim(freed)
    ext = tier.allocate(A, b"k", 1)
    assert (ext.seg, ext.offset) == (entry.seg, entry.offset)
    tier.close()
