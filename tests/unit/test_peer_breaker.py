"""Issue 32, item 5: per-peer failure detection in directory lookups (breaker.py, hedged_lookup.py).
The real Directory and DirectoryLink of five nodes, requests delivered in memory; an owner that
hangs (as SIGSTOPped) or refuses. The clock of the breakers is real (the delays are short)."""

from __future__ import annotations

import asyncio
import random
import time

from quilld.cluster.breaker import PeerHealth
from quilld.cluster.dir_link import DirectoryLink, pack, unpack
from quilld.cluster.directory import Directory, DirectorySettings
from quilld.cluster.peer_client import PeerError
from quilld.scopes import ScopeRegistry

NODES = ("a", "b", "c", "d", "e")
CTAG = b"\x02" * 8


class WiredLink(DirectoryLink):
    peers: dict[str, DirectoryLink]
    hung: set[str]
    down: set[str]
    slow: dict[str, float]  # peer: seconds before it answers

    async def call(self, dest, msg, timeout=5.0):
        if dest in self.down:
            raise PeerError(f"connection to {dest} refused")
        if dest in self.hung:
            await asyncio.sleep(timeout)
            raise PeerError(f"peer {dest}: timeout")
        await asyncio.sleep(self.slow.get(dest, 0.0))
        return unpack(self.peers[dest].handle(self.node_id, pack(msg)))


def cluster() -> tuple[dict[str, WiredLink], list[bytes]]:
    peers: dict[str, WiredLink] = {}
    for i, name in enumerate(NODES):
        link = WiredLink(Directory(name, DirectorySettings(replicas=3, buckets=256), random.Random(i)),
                         ScopeRegistry(), (), {})
        link.peers, link.hung, link.down, link.slow = peers, set(), set(), {}
        link.health = PeerHealth(time.monotonic, link.stats, hedge_floor_ms=20, hedge_max_ms=200, open_ms=300)
        link.lookup_timeout = 0.5
        peers[name] = link
    for link in peers.values():
        link.d.set_members({n: 1.0 for n in NODES}, 0.0)
    keys = [CTAG + b"k%d" % i for i in range(300)]
    for eid in keys:
        peers["e"].d.place_key("e", eid, "dram", 100)
    for _ in range(100):
        sent = False
        for name, link in peers.items():
            for dest, msg in link.d.poll(100.0):
                sent = True
                link.d.on_reply(dest, msg, peers[dest].d.handle(name, msg, 100.0), 100.0)
        if not sent:
            break
    return peers, keys


def test_a_hung_first_owner_is_hedged_then_skipped_and_every_key_is_found():
    peers, keys = cluster()
    a = peers["a"]
    first_b = [eid for eid in keys if a.d.owners_to_ask(b"K" + eid)[0] == "b"]
    assert len(first_b) >= 10
    a.hung = {"b"}

    async def reads():
        took = []
        for eid in first_b[:10]:
            t0 = time.monotonic()
            (holders,), _ = await a.lookup([Directory.key_item(eid)])
            took.append(time.monotonic() - t0)
            assert [h[0] for h in holders] == ["e"]
        await asyncio.sleep(0.6)  # the first call times out: b's breaker opens
        t0 = time.monotonic()
        answers, _ = await a.lookup([Directory.key_item(eid) for eid in first_b])
        return took, time.monotonic() - t0, answers

    took, batch, answers = asyncio.run(reads())
    assert max(took) < 0.2, took  # hedged after the floor, never the 0.5 s timeout
    assert batch < 0.1, batch  # b skipped: no hedge delay either
    assert all([h[0] for h in hs] == ["e"] for hs in answers)
    assert a.stats["lookup_hedged"] >= 1 and a.stats["breaker_opens"] == 1
    assert a.stats["lookup_breaker_skips"] >= 1 and a.stats["lookup_misses"] == 0


def test_owners_whose_breakers_are_open_are_still_asked_when_none_is_left():
    peers, keys = cluster()
    a = peers["a"]
    eid = next(e for e in keys if set(a.d.owners_to_ask(b"K" + e)) == {"b", "c", "d"})
    a.down = {"b", "c", "d"}
    (holders,), _ = asyncio.run(a.lookup([Directory.key_item(eid)]))
    assert holders == [] and a.stats["lookup_misses_unreachable"] == 1
    assert a.health.open_peers() == 3
    a.down = set()  # back, breakers still open: asked anyway, as no other owner is left
    (holders,), _ = asyncio.run(a.lookup([Directory.key_item(eid)]))
    assert [h[0] for h in holders] == ["e"] and a.health.open_peers() == 2  # the one asked answered: closed


def test_the_first_owner_to_answer_ends_a_lookup_every_owner_was_hedged_on():
    """All three owners slower than their hedge delay: the lookup waits for whichever answers
    first (the second, 0.1 s), not for the first one asked, which hangs to its timeout (0.5 s)."""
    peers, keys = cluster()
    a = peers["a"]
    eid = next(e for e in keys if a.d.owners_to_ask(b"K" + e) == ["b", "c", "d"])
    a.hung, a.slow = {"b", "d"}, {"c": 0.1}

    async def read():
        t0 = time.monotonic()
        (holders,), _ = await a.lookup([Directory.key_item(eid)])
        return holders, time.monotonic() - t0

    holders, took = asyncio.run(read())
    assert [h[0] for h in holders] == ["e"]
    assert 0.1 <= took < 0.3, took
    assert a.stats["lookup_hedged"] == 3 and a.stats["lookup_hedges_won"] == 2
