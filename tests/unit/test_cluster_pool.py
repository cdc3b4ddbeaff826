"""`Cluster.pool_read` / `pool_read_many` / `pool_has_many` (GET, MGET, EXISTS across the pool)
and the membership log lines.

Real keyspace, scopes, control plane, feed and directory; gossip is never started and the
network is replaced by `Peers`, which stands in for `Transfers.fetch_into` and
`fetch_many` only: each peer answers after a delay with a payload, nil, or an error,
writing into the memory `target` names as the real transfers do. What must hold: only the
holders the directory names are asked (nobody when it names none), DRAM copies first, the
next holder when one fails, every reservation given back, small values read many to a
request, and a failure is a miss, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import time

import crc32c
import pytest

from quilld.cluster.cluster import Cluster
from quilld.cluster.dir_entries import KEY as KEY_ENTRY, TIER_BIT, code_of, key_shard
from quilld.cluster.peer_client import PeerError
from quilld.cluster.swim import Event, EventKind, Member
from quilld.cluster.wire import State
from quilld.config import ClusterConfig, Config, DramConfig
from quilld.index.control import ControlPlane
from quilld.index.residency_feed import ResidencyFeed
from quilld.model import CacheTier, IdentityScope, Pinned
from quilld.scopes import ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.block import page_extent
from quilld.tiers.keyspace import Keyspace

SCOPE = IdentityScope("acme", "llama", "tok", "")
INLINE_MAX = 512
KEY = b"chunk-7"
TIMEOUT = 5.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


class Peers:
    """`answers[peer] = (delay_s, what)`: what is bytes (sent with its CRC32C), None (nil) or an
    exception instance (raised before any byte); the same answer for every key asked."""

    def __init__(self, answers: dict, keyspace: Keyspace) -> None:
        self.answers = answers
        self.keyspace = keyspace
        self.expires = -1  # the holder's expiry sent with each value (PXAT: unix ms, or -1)
        self.calls: list[str] = []
        self.batches: list[tuple[str, int]] = []  # (peer, keys) of each fetch_many

    async def fetch_into(self, peer, addr, meta, scope, key, target):
        assert scope == SCOPE
        self.calls.append(peer)
        delay, what = self.answers[peer]
        await asyncio.sleep(delay)
        if what is None:
            return None, None, -1
        if isinstance(what, Exception):
            raise what
        view = target(len(what))
        view[:] = what
        return crc32c.crc32c(what), view, self.expires

    async def fetch_many(self, peer, addr, scope, keys, timeout):
        assert scope == SCOPE
        self.batches.append((peer, len(keys)))
        delay, what = self.answers[peer]
        await asyncio.sleep(delay)
        if isinstance(what, Exception):
            raise what
        return [None if what is None else [crc32c.crc32c(what), what, self.expires] for _ in keys]

    def peer_gone(self, peer) -> None:
        pass


def make(answers: dict, holders: dict[str, CacheTier] | None = None, pages: int = 32, keys=(KEY,)):
    """A cluster node whose directory says `holders` hold `keys` (every node owns every bucket
    in a cluster this small, so lookups are this node's own)."""
    cfg = Config(dram=DramConfig(size=pages * PAGE, inline_max=INLINE_MAX), cluster=ClusterConfig(transfer="tcp"))
    scopes = ScopeRegistry()
    keyspace = Keyspace(cfg.dram, scopes)
    control = ControlPlane(cfg, scopes)
    feed = ResidencyFeed(control.index, "n1", scopes)
    keyspace.listener = feed
    cluster = Cluster(cfg, "n1", keyspace, scopes, control, feed, lambda: {"port": 7379, "admin_port": 0})
    tag = scopes.tag(SCOPE)
    d = cluster.directory
    d.set_members({"n1": 1.0, **{p: 1.0 for p in answers}}, 0.0)
    for port, peer in enumerate(answers, 17000):
        cluster.addresses[peer] = ("127.0.0.1", port)
    for peer, tier in (holders or {}).items():
        what = answers.get(peer, (0, b""))[1]  # the size the directory says: its value's, or the others'
        size = len(what) if isinstance(what, bytes) else max(
            (len(w) for _, w in answers.values() if isinstance(w, bytes)), default=1)
        for key in keys:
            eid = cluster.link.ctag(tag) + key
            d.owned.put(peer, KEY_ENTRY, eid, key_shard(eid), d.bucket_of(key_shard(eid)),
                        code_of(TIER_BIT[tier], size))
    cluster.transfers = cluster.reads.transfers = Peers(answers, keyspace)
    return cluster, keyspace, tag


def nothing_held(ks: Keyspace) -> bool:
    return (ks.reserved_blocks, ks.held_bytes, ks.active_pins) == (0, 0, 0)


def test_a_key_the_directory_does_not_name_is_a_miss_and_nobody_is_asked():
    cluster, ks, tag = make({"n2": (0.0, b"v"), "n3": (0.0, b"v")})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None
    assert cluster.transfers.calls == [] and cluster.transfers.batches == []
    s = cluster.stats
    assert (s["pool_reads"], s["pool_read_hits"], s["pool_read_errors"]) == (1, 0, 0)


def test_a_small_value_is_read_from_its_holder_and_kept():
    small = b"metadata" * 4
    cluster, ks, tag = make({"n2": (0.0, None), "n3": (0.0, small)}, holders={"n3": CacheTier.DRAM})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) == small
    assert cluster.transfers.batches == [("n3", 1)]  # only the holder, and in a batch (PEERMGET)
    assert ks.get(tag, KEY) == small  # kept: the next GET is local
    assert cluster.stats["pool_read_hits"] == 1


LARGE = 80 * 1024  # more than pool_reads.BATCH_VALUE_BYTES: read on its own, into the arena


@pytest.mark.parametrize("size", [32, LARGE])
def test_a_peers_expiry_is_range_checked_before_the_copy_is_kept(size):
    """Issue 29.14: a holder's PXAT past a signed 64-bit unix time (or below -1) is never stored
    (the SSD tier packs deadlines as i64): the value is answered, not kept; one in range is kept."""
    value = bytes(range(256)) * (size // 256) if size > 256 else b"v" * size
    for expires in ((1 << 63), (1 << 70), -5, int(time.time() * 1000) - 1000):
        cluster, ks, tag = make({"n3": (0.0, value)}, holders={"n3": CacheTier.DRAM}, pages=64)
        cluster.transfers.expires = expires
        got = run(cluster.pool_read(SCOPE, tag, KEY))
        assert bytes(got.view if isinstance(got, Pinned) else got) == value, expires
        if isinstance(got, Pinned):
            got.release()
        assert ks.get(tag, KEY) is None and ks.expire_time(tag, KEY) == -2, expires  # not kept
        assert nothing_held(ks)
    cluster, ks, tag = make({"n3": (0.0, value)}, holders={"n3": CacheTier.DRAM}, pages=64)
    cluster.transfers.expires = at = (1 << 63) - 1
    got = run(cluster.pool_read(SCOPE, tag, KEY))
    if isinstance(got, Pinned):
        got.release()
    assert ks.expire_time(tag, KEY) == at  # in range: kept, expiring with the holder's


def test_a_large_value_comes_from_a_dram_holder_first_pinned_and_kept():
    big = bytes(range(256)) * (LARGE // 256)
    cluster, ks, tag = make({"n2": (0.0, big), "n3": (0.0, big)}, holders={"n2": CacheTier.SSD, "n3": CacheTier.DRAM},
                            pages=64)
    got = run(cluster.pool_read(SCOPE, tag, KEY))
    assert type(got) is Pinned and bytes(got.view) == big
    got.release()
    assert cluster.transfers.calls == ["n3"]
    assert ks.arena.used == page_extent(len(big)) and nothing_held(ks)


def test_a_stale_or_failed_holder_is_followed_by_the_next_and_counted():
    big = b"y" * LARGE
    cluster, ks, tag = make({"n2": (0.0, PeerError("refused")), "n3": (0.0, big)},
                            holders={"n2": CacheTier.DRAM, "n3": CacheTier.SSD}, pages=64)
    got = run(cluster.pool_read(SCOPE, tag, KEY))
    assert bytes(got.view) == big
    got.release()
    assert cluster.transfers.calls == ["n2", "n3"]
    assert cluster.stats["pool_read_ask_failures"] == 1 and nothing_held(ks)
    # a small value's batch failing: the next holder, one key at a time
    cluster, ks, tag = make({"n2": (0.0, PeerError("refused")), "n3": (0.0, b"v")},
                            holders={"n2": CacheTier.DRAM, "n3": CacheTier.DRAM})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) == b"v"
    assert cluster.stats["pool_read_ask_failures"] == 1
    assert cluster.transfers.batches == [("n2", 1)] and cluster.transfers.calls == ["n3"]


def test_failures_are_a_miss_never_an_error():
    big = b"z" * (2 * PAGE)
    cluster, ks, tag = make({"n2": (0.0, PeerError("connection refused"))}, holders={"n2": CacheTier.DRAM})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None
    assert cluster.stats["pool_read_errors"] >= 1 and nothing_held(ks)
    cluster, ks, tag = make({"n2": (0.0, PeerError("broken")), "n3": (0.0, PeerError("broken"))},
                            holders={"n2": CacheTier.DRAM, "n3": CacheTier.DRAM})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None  # both named, both failed
    assert nothing_held(ks)
    cluster, ks, tag = make({"n2": (0.0, PeerError("broken"))}, holders={"n2": CacheTier.DRAM})
    cluster.directory.owned.put("n2", KEY_ENTRY, cluster.link.ctag(tag) + KEY,
                                key_shard(cluster.link.ctag(tag) + KEY),
                                cluster.directory.bucket_of(key_shard(cluster.link.ctag(tag) + KEY)),
                                code_of(TIER_BIT[CacheTier.DRAM], len(big)))
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None and nothing_held(ks)


def test_a_bug_in_a_peer_read_is_raised_once_memory_is_given_back():
    big = b"x" * (2 * PAGE)
    cluster, ks, tag = make({"n2": (0.0, ZeroDivisionError("bug"))}, holders={"n2": CacheTier.DRAM})
    cluster.directory.owned.put("n2", KEY_ENTRY, cluster.link.ctag(tag) + KEY,
                                key_shard(cluster.link.ctag(tag) + KEY),
                                cluster.directory.bucket_of(key_shard(cluster.link.ctag(tag) + KEY)),
                                code_of(TIER_BIT[CacheTier.DRAM], len(big)))
    with pytest.raises(ZeroDivisionError):
        run(cluster.pool_read(SCOPE, tag, KEY))
    assert nothing_held(ks) and ks.arena.used == 0


def test_exists_takes_the_directorys_word_without_a_transfer():
    cluster, ks, tag = make({"n2": (0.0, b"v")}, holders={"n2": CacheTier.SSD})
    assert run(cluster.pool_has_many(tag, [KEY, b"other"])) == [True, False]
    assert cluster.transfers.calls == [] and cluster.transfers.batches == []


def test_many_small_keys_are_one_request_per_holder():
    keys = [b"k%d" % i for i in range(600)]
    cluster, ks, tag = make({"n2": (0.05, b"v"), "n3": (0.05, b"w")}, holders={"n2": CacheTier.DRAM}, keys=keys)
    got = run(cluster.pool_read_many(SCOPE, tag, keys + [b"nobody-has-it"]))
    assert got == [b"v"] * 600 + [None]
    assert sorted(cluster.transfers.batches) == [("n2", 88), ("n2", 256), ("n2", 256)]  # 256 keys a batch
    assert cluster.transfers.calls == [] and cluster.stats["pool_read_hits"] == 600


# -- membership, said in the log ----------------------------------------------------------

def member(node_id: str, state: State, port: int = 7479) -> Member:
    return Member(node_id, ("127.0.0.1", 8000), 3, state, {"resp": ["127.0.0.1", port]}, 0.0)


def test_each_membership_change_is_one_log_line(caplog):
    cluster, _, _ = make({})
    cluster.addresses.clear()
    events = [
        (EventKind.JOINED, State.ALIVE, None, logging.INFO, "cluster: b joined: gossip 127.0.0.1:8000, RESP 127.0.0.1:7479"),
        (EventKind.UPDATED, State.ALIVE, State.ALIVE, None, None),  # meta refreshed every second: quiet
        (EventKind.SUSPECT, State.SUSPECT, State.ALIVE, logging.INFO, "cluster: b is suspect"),
        (EventKind.ALIVE, State.ALIVE, State.SUSPECT, logging.INFO, "cluster: b is alive again"),
        (EventKind.SUSPECT, State.SUSPECT, State.ALIVE, logging.INFO, "cluster: b is suspect"),
        (EventKind.DEAD, State.DEAD, State.SUSPECT, logging.WARNING, "cluster: b is dead; dropped the 0 directory entries"),
        (EventKind.JOINED, State.ALIVE, State.DEAD, logging.INFO, "cluster: b joined (back after dead): gossip"),
        (EventKind.LEFT, State.LEFT, State.ALIVE, logging.INFO, "cluster: b left; dropped the 0 directory entries"),
    ]

    async def scenario():
        for kind, state, previous, level, text in events:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="quilld.cluster"):
                cluster._on_event(Event(kind, member("b", state), previous))
            lines = [r for r in caplog.records if r.name == "quilld.cluster"]
            if text is None:
                assert lines == [], [r.getMessage() for r in lines]
                continue
            assert len(lines) == 1, [r.getMessage() for r in lines]
            assert lines[0].levelno == level and lines[0].getMessage().startswith(text), lines[0].getMessage()
            assert ("b" in cluster.suspects) is (kind is EventKind.SUSPECT)

    asyncio.run(scenario())
    # a member whose RESP address moved is reached there, and that is said once
    caplog.clear()

    async def moved():
        with caplog.at_level(logging.INFO, logger="quilld.cluster"):
            cluster._on_event(Event(EventKind.JOINED, member("c", State.ALIVE, 7579), None))
            cluster._on_event(Event(EventKind.UPDATED, member("c", State.ALIVE, 7679), State.ALIVE))

    asyncio.run(moved())
    said = [r.getMessage() for r in caplog.records if r.name == "quilld.cluster"]
    assert said[-1] == "cluster: c now serves RESP at 127.0.0.1:7679" and len(said) == 2, said


def test_a_restarted_member_is_a_warning_as_the_readme_says(caplog):
    """Issue 29, item 5: a member back under its name as a new process (a new directory epoch in its
    meta, before anyone declared it dead) was said at INFO; README says WARNING."""
    cluster, _, _ = make({})
    first, again = member("b", State.ALIVE), member("b", State.ALIVE)
    first.meta["dir_epoch"], again.meta["dir_epoch"] = 1, 2

    async def restart():
        with caplog.at_level(logging.INFO, logger="quilld.cluster"):
            cluster._on_event(Event(EventKind.JOINED, first, None))
            caplog.clear()
            cluster._on_event(Event(EventKind.UPDATED, again, State.ALIVE))

    asyncio.run(restart())
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "quilld.cluster"]
    assert lines == [(logging.WARNING, "cluster: b restarted (a new process); its entries are placed anew")], lines
