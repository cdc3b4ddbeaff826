"""Damage anywhere in the WAL or in a checkpoint loses no committed block (issue 19.18).

Before: four flipped bytes in the first WAL record lost the whole tier (0 blocks recovered
against 126-147 from an undamaged copy): replay stopped at the first bad record and took
nothing after it. Now any damage to a log the recovery needs (flipped bytes, a zeroed
stretch, a torn tail, a missing file) sends it to the segment scan, merged into the best
checkpoint that still reads, and every record the damage spared is still replayed.

One history per test: puts, overwrites, deletes, TTLs set at write time and changed later
(META records), a payload that imitates another tenant's block header, three checkpoints
(the newest two kept) and three logs after the newest. Then one kind of damage at the
start, middle or end of the WAL (the logs after the newest checkpoint, end to end) or of
a checkpoint. What must come back is exactly the live state: every committed block whose
tag checks out, byte for byte; never a deleted, replaced or imitated one.
"""

from __future__ import annotations

import os
import random

import pytest
from crc32c import crc32c

from test_ssd import A, B, checkpoints, contents, delete, flip_byte, open_tier, payload, put, reap, wal_files
from quilld.tiers.ssd import PendingWrite
from quilld.tiers.ssd_files import checkpoint_name
from quilld.tiers.ssd_format import PAGE, block_meta, pack_block_header
from quilld.tiers.wal import wal_name

SEGMENTS = 24


def put_ttl(tier, items):
    """[(scope, key, payload, expire)] as one batch."""
    pending = [PendingWrite(s, k, d, tier.allocate(s, k, len(d)), expire=x) for s, k, d, x in items]
    tier.write_batch(pending)
    tier.publish(pending)
    reap(tier)


def retime(tier, changes):
    """[(scope, key, expire)]: META records, as the tiering logs a TTL change."""
    entries = []
    for s, k, x in changes:
        e = tier.lookup(s, k)
        e.expire = x
        entries.append(e)
    tier.log_changes([], entries)


def history(path):
    """(model of values, model of TTLs, the TTL each block was written with); the tier closed."""
    tier, _ = open_tier(path, segments=SEGMENTS)
    rng = random.Random(1918)
    model, ttl, written = {}, {}, {}

    def remember(s, k, d, x):
        model[(s, k)], ttl[(s, k)], written[(s, k)] = d, x, x

    # a tenant's payload imitating a committed header of another tenant's key, at a page boundary
    forged_payload = b"forged!" * 100
    forged = pack_block_header(b"victim", A, 10 ** 9, len(forged_payload), crc32c(forged_payload), 0,
                               committed=True, tier_key=os.urandom(32))
    carrier = b"c" * PAGE + (forged + block_meta(A, b"victim")).ljust(PAGE, b"\0") + forged_payload
    put(tier, [(B, b"carrier", carrier)])
    remember(B, b"carrier", carrier, 0)
    keys = [(s, b"key-%d" % i) for s in (A, B) for i in range(16)]
    for round_ in range(3):  # history covered by checkpoints
        for _ in range(10):
            live = [k for k in keys if k in model]
            if live and rng.random() < 0.3:
                gone = rng.sample(live, rng.randint(1, min(3, len(live))))
                delete(tier, gone)
                for k in gone:
                    del model[k], ttl[k], written[k]
            else:
                items = [(s, k, payload(rng), rng.choice([0, 0, 1_900_000_000_000 + rng.randrange(10 ** 6)]))
                         for s, k in rng.sample(keys, rng.randint(1, 4))]
                put_ttl(tier, items)
                for item in items:
                    remember(*item)
            live = [k for k in keys if k in model]
            changes = [(s, k, rng.choice([0, 1_950_000_000_000 + rng.randrange(10 ** 6)]))
                       for s, k in rng.sample(live, min(2, len(live)))]
            retime(tier, changes)
            ttl.update({(s, k): x for s, k, x in changes})
        assert tier.checkpoint() is not None
    small = [(A, b"s-%04d" % i) for i in range(600)]
    for log_ in range(3):  # after the newest checkpoint: three logs of several 32 KiB blocks each
        for batch in range(4):
            items = [(s, k, b"%d-%d-" % (log_, batch) + k, 1_990_000_000_000 + i if i % 3 == 0 else 0)
                     for i, (s, k) in enumerate(small[batch * 150:(batch + 1) * 150])]
            put_ttl(tier, items)
            for item in items:
                remember(*item)
            gone = small[batch * 150 + log_:batch * 150 + 150:37]
            delete(tier, [k for k in gone if k in model])
            for k in gone:
                model.pop(k, None), ttl.pop(k, None), written.pop(k, None)
            changes = [(s, k, 0) for s, k in small[batch * 150 + 1:batch * 150 + 150:11] if (s, k) in model]
            retime(tier, changes)
            ttl.update({(s, k): x for s, k, x in changes})
        if log_ < 2:
            tier.seal()
    tier.close()
    return model, ttl, written


def live_logs(path):
    newest = checkpoints(path)[-1]
    return [n for n in wal_files(path) if n >= newest]


def damage(path, target, kind, where):
    """One kind of damage at the start, middle or end of the WAL or of a checkpoint."""
    if target == "wal":
        logs = live_logs(path)
        n = {"start": logs[0], "middle": logs[len(logs) // 2], "end": logs[-1]}[where]
        name = wal_name(n)
    else:
        ckpts = checkpoints(path)
        name = checkpoint_name(ckpts[-1] if target == "newest-checkpoint" else ckpts[0])
    file = path / name
    size = os.path.getsize(file)
    if kind == "missing":
        os.unlink(file)
        return
    at = {"start": 10, "middle": size // 2, "end": size - 6}[where]
    if kind == "flip":
        for i in range(4):
            flip_byte(file, at + i)
    elif kind == "zeros":
        with open(file, "r+b") as f:
            f.seek(at)
            f.write(bytes(min(PAGE, size - at)))
    else:  # torn: the file ends there
        os.truncate(file, at)


def check(tier, report, model, ttl, written, exact_ttls):
    assert contents(tier) == model  # every live block, byte for byte; no deleted, replaced or imitated one
    assert tier.lookup(A, b"victim") is None
    assert report.recovered == len(model)
    for k, e in tier.entries.items():
        if exact_ttls:
            assert e.expire == ttl[k], k
        else:  # a TTL change whose record was damaged falls back to the one the block was written with
            assert e.expire in (ttl[k], written[k]), k


CASES = [("wal", kind, where) for kind in ("flip", "zeros", "torn") for where in ("start", "middle", "end")]
CASES += [("wal", "missing", "middle")]
CASES += [(t, kind, where) for t in ("newest-checkpoint", "older-checkpoint")
          for kind in ("flip", "torn") for where in ("start", "middle", "end")]
CASES += [(t, "missing", "") for t in ("newest-checkpoint", "older-checkpoint")]


@pytest.mark.parametrize("target, kind, where", CASES, ids=["-".join(filter(None, c)) for c in CASES])
def test_damage_loses_no_committed_block(tmp_path, target, kind, where):
    model, ttl, written = history(tmp_path)
    damage(tmp_path, target, kind, where)
    tier, report = open_tier(tmp_path, segments=SEGMENTS)
    if target == "wal":
        assert report.path == "segment-scan", report
        assert report.scan_reason and report.dropped_torn_wal_records >= (kind != "missing")
        assert report.checkpoint_entries > 0  # merged into the newest checkpoint
    else:
        assert report.path in ("checkpoint", "previous-checkpoint"), report
        assert report.dropped_torn_wal_records == 0
    check(tier, report, model, ttl, written, exact_ttls=target != "wal")
    tier.close()
    tier, report = open_tier(tmp_path, segments=SEGMENTS)  # what the recovery wrote reads cleanly
    assert report.path == "checkpoint" and report.dropped_torn_wal_records == 0
    check(tier, report, model, ttl, written, exact_ttls=target != "wal")
    tier.close()


def test_every_checkpoint_and_the_wal_damaged_still_loses_no_block(tmp_path):
    model, ttl, written = history(tmp_path)
    damage(tmp_path, "newest-checkpoint", "flip", "middle")
    damage(tmp_path, "older-checkpoint", "flip", "start")
    damage(tmp_path, "wal", "flip", "start")
    tier, report = open_tier(tmp_path, segments=SEGMENTS)
    assert report.path == "segment-scan" and len(report.checkpoint_errors) == 2
    assert report.scan_refused >= 1  # the imitation
    assert contents(tier) == model and tier.lookup(A, b"victim") is None
    tier.close()


def test_an_undamaged_history_replays_exactly(tmp_path):
    model, ttl, written = history(tmp_path)
    tier, report = open_tier(tmp_path, segments=SEGMENTS)
    assert report.path == "checkpoint" and not report.wal_stops and not report.scan_reason
    check(tier, report, model, ttl, written, exact_ttls=True)
    tier.close()
