"""`Cluster.pool_read` / `pool_has` (GET, MGET, EXISTS across the pool) and the membership log lines.

Real keyspace, scopes, control plane, feed and directory; gossip is never started and the
network is replaced by `Peers`, which stands in for `Transfers.fetch_into` only: each peer
answers after a delay with a payload, nil, or an error, writing into the memory `target`
names as the real transfers do. What must hold: the first verified copy wins, every other
reservation is given back (a peer cancelled mid-transfer included), suspects are not asked,
and a failure is a miss, never an error.
"""

from __future__ import annotations

import asyncio
import logging

import crc32c
import pytest

from quilld.cluster import cluster as cluster_mod
from quilld.cluster.cluster import Cluster
from quilld.cluster.peer_client import PeerError
from quilld.cluster.replog import ReplicationLog
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
    exception instance (raised before any byte)."""

    def __init__(self, answers: dict, keyspace: Keyspace) -> None:
        self.answers = answers
        self.keyspace = keyspace
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    async def fetch_into(self, peer, addr, meta, scope, key, target):
        assert scope == SCOPE
        self.calls.append(peer)
        delay, what = self.answers[peer]
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(peer)
            raise
        if what is None:
            return None, None, -1
        if isinstance(what, Exception):
            raise what
        view = target(len(what))
        view[:] = what
        return crc32c.crc32c(what), view, -1

    def peer_gone(self, peer) -> None:
        pass


def make(answers: dict, holders: dict[str, CacheTier] | None = None, pages: int = 32):
    cfg = Config(dram=DramConfig(size=pages * PAGE, inline_max=INLINE_MAX), cluster=ClusterConfig(transfer="tcp"))
    scopes = ScopeRegistry()
    keyspace = Keyspace(cfg.dram, scopes)
    control = ControlPlane(cfg, scopes)
    feed = ResidencyFeed(control.index, "n1", scopes)
    keyspace.listener = feed
    cluster = Cluster(cfg, "n1", keyspace, scopes, control, feed, lambda: {"port": 7379, "admin_port": 0})
    for port, peer in enumerate(answers, 17000):
        cluster.addresses[peer] = ("127.0.0.1", port)
    for peer, tier in (holders or {}).items():
        log = ReplicationLog(lambda: [])
        log.placed(SCOPE, KEY, tier, 1, None)
        cluster.directory.apply(peer, log.since(log.epoch, 0, 100))
    cluster.transfers = Peers(answers, keyspace)
    return cluster, keyspace, scopes.tag(SCOPE)


def nothing_held(ks: Keyspace) -> bool:
    return (ks.reserved_blocks, ks.held_bytes, ks.active_pins) == (0, 0, 0)


def test_a_key_no_log_names_is_asked_of_every_peer_and_kept():
    small = b"metadata" * 4
    cluster, ks, tag = make({"n2": (0.0, None), "n3": (0.01, small)})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) == small
    assert sorted(cluster.transfers.calls) == ["n2", "n3"]
    assert ks.get(tag, KEY) == small  # kept: the next GET is local
    s = cluster.stats
    assert (s["pool_reads"], s["pool_read_hits"], s["pool_read_asks"], s["pool_read_errors"]) == (1, 1, 1, 0)


def test_the_first_copy_wins_and_the_slower_ones_are_given_back():
    big = bytes(range(256)) * (3 * PAGE // 256)
    cluster, ks, tag = make({"n2": (0.0, big), "n3": (0.0, big), "n4": (0.3, big)})
    got = run(cluster.pool_read(SCOPE, tag, KEY))
    assert type(got) is Pinned and bytes(got.view) == big
    got.release()
    assert cluster.transfers.cancelled == ["n4"]  # still sleeping when the winner came: cancelled
    assert ks.arena.used == page_extent(len(big))  # one copy kept, the other finished one discarded
    assert nothing_held(ks)


def test_a_peer_too_slow_is_cut_off(monkeypatch):
    monkeypatch.setattr(cluster_mod, "ASK_TIMEOUT", 0.05)
    cluster, ks, tag = make({"n2": (1.0, b"late"), "n3": (0.0, None)})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None
    assert cluster.stats["pool_read_ask_timeouts"] == 1 and nothing_held(ks)


def test_suspects_are_not_asked_and_a_node_without_peers_asks_nobody():
    cluster, _, tag = make({"n2": (0.0, b"v"), "n3": (0.0, b"v")})
    cluster.suspects.add("n2")
    assert run(cluster.pool_read(SCOPE, tag, KEY)) == b"v"
    assert cluster.transfers.calls == ["n3"]
    alone, _, tag2 = make({})
    assert run(alone.pool_read(SCOPE, tag2, KEY)) is None
    assert alone.stats["pool_read_asks"] == 0


def test_a_stale_directory_entry_falls_back_to_asking_the_others():
    cluster, _, tag = make({"n2": (0.0, None), "n3": (0.0, b"here")}, holders={"n2": CacheTier.DRAM})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) == b"here"
    assert cluster.transfers.calls == ["n2", "n3"]  # the holder first, then the rest (not n2 again)
    assert cluster.stats["peer_fetch_stale"] == 1


def test_failures_are_a_miss_never_an_error():
    cluster, ks, tag = make({"n2": (0.0, PeerError("connection refused"))}, holders={"n2": CacheTier.DRAM})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None
    assert cluster.stats["pool_read_errors"] == 1 and nothing_held(ks)
    cluster, ks, tag = make({"n2": (0.0, PeerError("broken")), "n3": (0.0, PeerError("broken"))})
    assert run(cluster.pool_read(SCOPE, tag, KEY)) is None  # asked: both failed, nobody has it
    assert nothing_held(ks)


def test_a_bug_in_a_peer_read_is_raised_once_memory_is_given_back():
    big = b"x" * (2 * PAGE)
    cluster, ks, tag = make({"n2": (0.0, big), "n3": (0.0, ZeroDivisionError("bug"))})
    with pytest.raises(ZeroDivisionError):
        run(cluster.pool_read(SCOPE, tag, KEY))
    assert nothing_held(ks) and ks.arena.used == 0


def test_exists_takes_the_directorys_word_without_a_transfer():
    cluster, ks, tag = make({"n2": (0.0, b"v")}, holders={"n2": CacheTier.SSD})
    assert run(cluster.pool_has(SCOPE, tag, KEY)) is True
    assert cluster.transfers.calls == []
    cluster, ks, tag = make({"n2": (0.0, b"x" * (2 * PAGE)), "n3": (0.0, None)})
    assert run(cluster.pool_has(SCOPE, tag, KEY)) is True  # asked, read, kept, its pin released
    assert nothing_held(ks)
    cluster, ks, tag = make({"n2": (0.0, None)})
    assert run(cluster.pool_has(SCOPE, tag, KEY)) is False


def test_many_keys_are_read_at_once():
    cluster, ks, tag = make({"n2": (0.2, b"v")})

    async def timed():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await cluster.pool_read_many(SCOPE, tag, [b"a", b"b", b"c", b"d"])
        return got, loop.time() - t0

    got, took = run(timed())
    assert got == [b"v"] * 4 and took < 0.6  # four 0.2 s asks side by side, not one after another


# -- membership, said in the log ----------------------------------------------------------

class _Follower:
    def __init__(self, *args) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def member(node_id: str, state: State, port: int = 7479) -> Member:
    return Member(node_id, ("127.0.0.1", 8000), 3, state, {"resp": ["127.0.0.1", port]}, 0.0)


def test_each_membership_change_is_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(cluster_mod, "Follower", _Follower)
    cluster, _, _ = make({})
    cluster.addresses.clear()
    events = [
        (EventKind.JOINED, State.ALIVE, None, logging.INFO, "cluster: b joined: gossip 127.0.0.1:8000, RESP 127.0.0.1:7479"),
        (EventKind.UPDATED, State.ALIVE, State.ALIVE, None, None),  # meta refreshed every second: quiet
        (EventKind.SUSPECT, State.SUSPECT, State.ALIVE, logging.INFO, "cluster: b is suspect"),
        (EventKind.ALIVE, State.ALIVE, State.SUSPECT, logging.INFO, "cluster: b is alive again"),
        (EventKind.SUSPECT, State.SUSPECT, State.ALIVE, logging.INFO, "cluster: b is suspect"),
        (EventKind.DEAD, State.DEAD, State.SUSPECT, logging.WARNING, "cluster: b is dead; dropped its 0 residencies"),
        (EventKind.JOINED, State.ALIVE, State.DEAD, logging.INFO, "cluster: b joined (back after dead): gossip"),
        (EventKind.LEFT, State.LEFT, State.ALIVE, logging.INFO, "cluster: b left; dropped its 0 residencies"),
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
    # a member whose RESP address moved is followed there, and that is said once
    caplog.clear()

    async def moved():
        with caplog.at_level(logging.INFO, logger="quilld.cluster"):
            cluster._on_event(Event(EventKind.JOINED, member("c", State.ALIVE, 7579), None))
            cluster._on_event(Event(EventKind.UPDATED, member("c", State.ALIVE, 7679), State.ALIVE))

    asyncio.run(moved())
    said = [r.getMessage() for r in caplog.records if r.name == "quilld.cluster"]
    assert said[-1] == "cluster: c now serves RESP at 127.0.0.1:7679" and len(said) == 2, said
