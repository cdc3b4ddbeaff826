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

from quilld.errors import ConfigError
from quilld.model import IdentityScope
from quilld.tiers.ssd import (
    CHECKPOINT,
    CHECKPOINT_TMP,
    CorruptBlock,
    PendingWrite,
    SsdFailure,
    SsdTier,
    seg_name,
)
from quilld.tiers.ssd_format import HEADER_SIZE, PAGE, Loc, drop_overlaps
from quilld.tiers.wal import parse_wal_name

SEG = 64 * PAGE  # 256 KiB segments keep the files small
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
        ext = tier.allocate(len(payload))
        assert ext is not None, "tier full"
        pending.append(PendingWrite(scope, key, payload, ext))
    tier.write_batch(pending)
    return tier.publish(pending)


def delete(tier, keys):
    entries = [tier.lookup(scope, key) for scope, key in keys]
    tier.log_deletes(entries)
    for e in entries:
        tier.forget(e)


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
    assert report.recovered == 0 and sorted(os.listdir(tmp_path)) == [
        "seg-00000.dat", "seg-00001.dat", "seg-00002.dat", "seg-00003.dat", "wal-000001.log"]
    rng = random.Random(1)
    sizes = [0, 1, PAGE - HEADER_SIZE, PAGE - HEADER_SIZE + 1, 100_000]
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
    assert st["used"] == sum(-(-(HEADER_SIZE + len(d)) // PAGE) for *_, d in items) * PAGE
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
    assert report.wal_records == 40 and report.checkpoint_error is None
    assert index(tier) == before
    assert contents(tier) == model
    # recovery ended with a checkpoint and a fresh log; a third open reads only the checkpoint
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.checkpoint_entries == 40 and report.wal_records == 0
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
    assert len(wal_files(tmp_path / "a")) == 1 and os.path.exists(tmp_path / "a" / CHECKPOINT)
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
        data = payload(rng, rng.choice([1, PAGE, 2 * PAGE]))
        if tier.allocate(len(data)) is None and tier.allocate(1) is None:
            break
        ext = tier.allocate(len(data)) or tier.allocate(1)
        tier.release_extent(ext)
        data = data if ext.pages * PAGE >= HEADER_SIZE + len(data) else data[:1]
        k = (B, b"fill%d" % i)
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
    assert tier.stats()["used"] == PAGE
    tier.close()


def test_newer_put_of_a_key_wins_after_restart(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"k", b"old" * 3000)])
    put(tier, [(A, b"k", b"new")])
    assert tier.stats()["used"] == PAGE  # the old extent was freed when the new PUT was durable
    # two versions in flight, made durable and published newest first
    first, second = tier.allocate(5), tier.allocate(5)
    w1, w2 = PendingWrite(B, b"k", b"v-one", first), PendingWrite(B, b"k", b"v-two", second)
    tier.write_batch([w2])
    tier.write_batch([w1])
    tier.publish([w2])
    assert tier.publish([w1]) == []  # older than what is indexed: dropped, space freed
    assert read(tier, tier.lookup(B, b"k")) == b"v-two"
    assert tier.stats()["used"] == 2 * PAGE
    tier.close()
    tier, _ = open_tier(tmp_path)
    assert contents(tier) == {(A, b"k"): b"new", (B, b"k"): b"v-two"}
    assert tier.stats()["used"] == 2 * PAGE
    tier.close()


def test_pinned_entry_keeps_its_space_until_unpinned(tmp_path):
    tier, _ = open_tier(tmp_path, segments=1)
    (old,) = put(tier, [(A, b"k", b"a" * 100)])
    tier.pin(old)
    put(tier, [(A, b"k", b"b" * 100)])
    assert tier.stats()["used"] == 2 * PAGE
    assert read(tier, old) == b"a" * 100  # still readable: nothing can reuse the space
    tier.unpin(old)
    assert tier.stats()["used"] == PAGE
    tier.close()


def test_corrupt_payload_is_dropped_at_recovery_and_counted(tmp_path):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(5)
    model = {(A, b"p%d" % i): payload(rng, 3000) for i in range(10)}
    put(tier, [(s, k, d) for (s, k), d in model.items()])
    victim = tier.lookup(A, b"p3")
    tier.close()
    flip_byte(tmp_path / seg_name(victim.seg), victim.offset + HEADER_SIZE + 1234)
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
    assert tier.stats()["used"] == PAGE
    tier.close()


def test_lost_delete_record_cannot_let_two_blocks_share_pages(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path)
    (old,) = put(tier, [(A, b"old", b"o" * (3 * PAGE))])
    assert (old.seg, old.offset) == (0, 0)
    tier.checkpoint()  # "old" now lives in the checkpoint; wal-000002 is current
    wal2 = tmp_path / "wal-000002.log"
    delete(tier, [(A, b"old")])  # the DEL goes to wal-000002, the space is free again
    monkeypatch.setattr(SsdTier, "_read_state", crash)
    with pytest.raises(Crash):
        tier.checkpoint()  # sealed wal-000002; later records go to wal-000003
    monkeypatch.undo()
    spacer = tier.allocate(1)  # keeps page 0, so "old"'s header survives
    (new,) = put(tier, [(A, b"new", b"n" * 100)])
    tier.release_extent(spacer)
    assert (new.seg, new.offset) == (0, PAGE)  # inside "old"'s former extent
    tier.close()
    flip_byte(wal2, 12)  # lose the DEL
    tier, report = open_tier(tmp_path)
    assert report.dropped_torn_wal_records == 1 and report.dropped_corrupt == 1
    assert contents(tier) == {(A, b"new"): b"n" * 100}
    assert tier.stats()["used"] == PAGE
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
    flip_byte(tmp_path / seg_name(e.seg), e.offset + HEADER_SIZE + 5)
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


def test_corrupt_wal_byte_stops_replay_there(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"one", b"1")])
    wal = tmp_path / "wal-000001.log"
    cut = os.path.getsize(wal)
    put(tier, [(A, b"two", b"2")])
    put(tier, [(A, b"three", b"3")])
    tier.close()
    flip_byte(wal, cut + 10)
    tier, report = open_tier(tmp_path)
    assert contents(tier) == {(A, b"one"): b"1"}
    assert report.dropped_torn_wal_records == 1 and report.wal_records == 1
    assert report.wal_stops == [f"wal-000001.log@{cut}: corrupt (fragment checksum mismatch)"]
    # the lost blocks' space is free again, and the next restart is clean
    assert tier.stats()["used"] == PAGE
    put(tier, [(A, b"four", b"4")])
    tier.close()
    tier, report = open_tier(tmp_path)
    assert report.dropped_torn_wal_records == 0
    assert contents(tier) == {(A, b"one"): b"1", (A, b"four"): b"4"}
    tier.close()


def test_torn_wal_tail_is_dropped(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"one", b"1")])
    put(tier, [(A, b"two", b"2")])
    tier.close()
    wal = tmp_path / "wal-000001.log"
    os.truncate(wal, os.path.getsize(wal) - 3)
    tier, report = open_tier(tmp_path)
    assert contents(tier) == {(A, b"one"): b"1"}
    assert report.dropped_torn_wal_records == 1 and "torn" in report.wal_stops[0]
    tier.close()


def test_crash_between_payload_write_and_wal_append(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path, fsync=True)
    put(tier, [(A, b"before", b"b")])
    monkeypatch.setattr(SsdTier, "_append", crash)
    ext = tier.allocate(11)
    with pytest.raises(Crash):
        tier.write_batch([PendingWrite(A, b"lost", b"unlogged!!!", ext)])
    with open(tmp_path / seg_name(ext.seg), "rb") as f:  # the payload did reach the segment
        f.seek(ext.offset + HEADER_SIZE)
        assert f.read(11) == b"unlogged!!!"
    tier.close()
    monkeypatch.undo()
    tier, report = open_tier(tmp_path)
    assert contents(tier) == {(A, b"before"): b"b"}
    assert report.dropped_corrupt == 0 and tier.stats()["used"] == PAGE
    tier.close()


@pytest.mark.parametrize("point", ["seal", "tmp-written", "renamed", "old-logs-kept"])
def test_crash_during_checkpoint_recovers(tmp_path, monkeypatch, point):
    tier, _ = open_tier(tmp_path)
    rng = random.Random(6)
    model = {}
    random_ops(tier, rng, model, 10, checkpoint_every=5)
    random_ops(tier, rng, model, 10)
    live = index(tier)
    real_replace = os.replace
    if point == "seal":  # new log open, nothing written yet
        monkeypatch.setattr(SsdTier, "_read_state", crash)
    elif point == "tmp-written":  # checkpoint.tmp complete but not renamed
        monkeypatch.setattr(os, "replace", crash)
    elif point == "renamed":  # new checkpoint in place, old logs not yet deleted
        monkeypatch.setattr(SsdTier, "_remove_wals_below", crash)
    else:  # as "renamed", and checkpoint.tmp left half written by an earlier crash
        monkeypatch.setattr(SsdTier, "_remove_wals_below", crash)
        (tmp_path / CHECKPOINT_TMP).write_bytes(b"half a checkpoint")
    with pytest.raises(Crash):
        tier.checkpoint()
    monkeypatch.setattr(os, "replace", real_replace)
    tier.close()
    monkeypatch.undo()
    if point == "tmp-written":
        assert (tmp_path / CHECKPOINT_TMP).exists()
    if point != "seal":
        assert len(wal_files(tmp_path)) == 2
    tier, report = open_tier(tmp_path)
    assert report.checkpoint_error is None and report.dropped_torn_wal_records == 0
    assert index(tier) == live and contents(tier) == model
    assert not (tmp_path / CHECKPOINT_TMP).exists() and len(wal_files(tmp_path)) == 1
    tier.close()


def test_corrupt_checkpoint_is_reported(tmp_path):
    tier, _ = open_tier(tmp_path)
    put(tier, [(A, b"in-checkpoint", b"1")])
    tier.checkpoint()
    put(tier, [(A, b"in-log", b"2")])
    tier.close()
    flip_byte(tmp_path / CHECKPOINT, 70)
    tier, report = open_tier(tmp_path)
    assert report.checkpoint_error and "checkpoint" in report.checkpoint_error
    assert contents(tier) == {(A, b"in-log"): b"2"}  # what the surviving log still has
    tier.close()
    tier, report = open_tier(tmp_path)  # recovery replaced the bad checkpoint
    assert report.checkpoint_error is None and contents(tier) == {(A, b"in-log"): b"2"}
    tier.close()


def test_full_tier_allocate_returns_none(tmp_path):
    tier = SsdTier(str(tmp_path), 2 * 4 * PAGE, 4 * PAGE, fsync=False)
    tier.recover()
    assert tier.allocate(5 * PAGE) is None  # larger than a segment
    extents = [tier.allocate(PAGE - HEADER_SIZE) for _ in range(8)]
    assert all(extents) and {e.seg for e in extents} == {0, 1}
    assert len({(e.seg, e.offset) for e in extents}) == 8
    assert tier.allocate(1) is None
    tier.release_extent(extents[3])
    assert tier.allocate(PAGE - HEADER_SIZE + 1) is None and tier.allocate(1) is not None
    tier.close()


def test_failing_fsync_fails_the_tier_and_publishes_nothing(tmp_path, monkeypatch):
    tier, _ = open_tier(tmp_path, fsync=True)
    (good,) = put(tier, [(A, b"good", b"g" * 50)])
    calls = []

    def eio(fd):
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    items = [PendingWrite(A, b"k%d" % i, b"v" * 100, tier.allocate(100)) for i in range(3)]
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
    assert tier.allocate(10) is None and not tier.needs_checkpoint()
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
    item = PendingWrite(A, b"k", b"v", tier.allocate(1))
    with pytest.raises(SsdFailure):
        tier.write_batch([item])
    assert tier.failed and not item.durable
    tier.close()


def test_enospc_creating_segments(tmp_path, monkeypatch):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    tier = SsdTier(str(tmp_path), 2 * SEG, SEG)
    with pytest.raises(SsdFailure, match="No space left"):
        tier.recover()
    assert tier.failed
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
    assert wal_files(tmp_path) == [2]
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
                pending = [PendingWrite(s, k, d, tier.allocate(len(d))) for (s, k), d in chosen.items()]
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
        tier = SsdTier(str(path), 26 * seg, seg, fsync=False)
        tier.recover()
        data = b"kv-block" * 4
        for start in range(0, n, 10_000):
            put(tier, [(A, b"block-%08d" % i, data) for i in range(start, start + 10_000)])
        tier.close()
        calls = []
        tier = SsdTier(str(path), 26 * seg, seg, fsync=False)
        wall, cpu = time.perf_counter(), time.process_time()
        report = tier.recover(progress=lambda done, total: calls.append((done, total)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"\nrecovery of {n} blocks from the log (replay, verify headers, rebuild, "
              f"checkpoint): {wall:.2f} s wall, {cpu:.2f} s cpu")
        assert report.recovered == n and report.dropped_corrupt == 0 and report.wal_records == n
        assert calls[0] == (10_000, n) and calls[-1] == (n, n)
        assert len(calls) == len(set(calls)) == n // 10_000  # each step reported once
        assert read(tier, tier.lookup(A, b"block-00054321")) == data
        assert wall < 10
        tier.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
