"""The replication log and the directory that follows it (no network)."""

from __future__ import annotations

import pytest

from quilld.cluster.directory import Directory
from quilld.cluster.replog import PLACED, REMOVED, Behind, ReplicationLog, from_wire
from quilld.scopes import ScopeRegistry
from quilld.index.residency import ResidencyIndex
from quilld.model import CacheTier, IdentityScope

S = IdentityScope("t", "m", "", "")


def make_log(live=(), retain=100):
    return ReplicationLog(lambda: iter(live), retain=retain)


def test_since_returns_entries_in_order_and_respects_count():
    log = make_log()
    for i in range(10):
        log.placed(S, b"k%d" % i, CacheTier.DRAM, 100 + i, i if i % 2 else None)
    got = log.since(log.epoch, 3, 4)
    assert [e.seq for e in got] == [4, 5, 6, 7]
    assert got[0].key == b"k3" and got[0].nbytes == 103 and got[0].bhash == (3).to_bytes(8, "big")
    assert got[1].bhash == b""
    assert log.since(log.epoch, 10, 5) == []


def test_a_follower_behind_the_kept_window_or_of_another_epoch_must_resync():
    log = make_log(retain=5)
    for i in range(12):
        log.placed(S, b"k", CacheTier.DRAM, 1, None)
    with pytest.raises(Behind):
        log.since(log.epoch, 2, 10)  # entries 3..7 were dropped
    assert [e.seq for e in log.since(log.epoch, 7, 10)] == [8, 9, 10, 11, 12]
    with pytest.raises(Behind):
        log.since("another-epoch", 12, 10)
    with pytest.raises(Behind):
        log.since(log.epoch, 13, 10)  # a position the log never reached: the node restarted


def test_entries_survive_the_wire_and_malformed_ones_are_refused():
    log = make_log()
    log.placed(IdentityScope("t", "m", "tok", "lora"), b"\x00key", CacheTier.SSD, 5, b"\x01\x02")
    log.removed(S, b"x", None)
    for e in log.since(log.epoch, 0, 10):
        wire = [v if not isinstance(v, str) else v.encode() for v in e.wire()]
        assert from_wire(wire) == e
    with pytest.raises(ValueError):
        from_wire([1, b"X", b"t", b"m", b"", b"", b"k", b"dram", 1, b""])
    with pytest.raises(ValueError):
        from_wire([1, PLACED, b"t", b"m", b"", b"", b"k", b"hbm", 1, b""])
    with pytest.raises(ValueError):
        from_wire([1, PLACED])


def test_snapshot_then_follow_equals_following_everything():
    live: dict = {}
    log = ReplicationLog(lambda: [(S, k, t, n, h) for k, (t, n, h) in live.items()], retain=1000)

    def place(k, tier, h=None):
        live[k] = (tier, 10, h)
        log.placed(S, k, tier, 10, h)

    def remove(k):
        _, _, h = live.pop(k)
        log.removed(S, k, h)

    scopes = ScopeRegistry()
    full = Directory(scopes, ResidencyIndex())
    for i in range(20):
        place(b"k%d" % i, CacheTier.DRAM, i)
    remove(b"k3")
    place(b"k4", CacheTier.SSD, 4)
    seq, snap = log.snapshot()
    late = Directory(scopes, ResidencyIndex())
    late.apply("a", snap)
    remove(b"k5")
    place(b"k30", CacheTier.DRAM)
    late.apply("a", log.since(log.epoch, seq, 1000))
    full.apply("a", log.since(log.epoch, 0, 1000))
    tag = scopes.tag(S)
    for i in list(range(20)) + [30]:
        k = b"k%d" % i
        assert full.holders(tag, k) == late.holders(tag, k), k
    assert full.holders(tag, b"k3") == [] and full.holders(tag, b"k5") == []
    assert full.holders(tag, b"k4") == [("a", CacheTier.SSD)]
    assert full.holders(tag, b"k1") == [("a", CacheTier.DRAM)]
    # block hashes reach the routing index; forgetting the peer drops both views
    assert full.blocks.locate(tag, [1])[0] == [("a", CacheTier.DRAM)]
    assert full.forget("a") > 0
    assert full.holders(tag, b"k1") == [] and full.blocks.locate(tag, [1])[0] == []
    assert REMOVED != PLACED
