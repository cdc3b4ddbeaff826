"""Directory reads with owners down (issue 32, reads): a lookup asks every owner before it says a key
is absent, and a miss for want of a reachable owner is counted apart from a true one. The real
Directory and DirectoryLink of five nodes, their requests delivered in memory (the RESP hop left
out), some nodes unreachable as after kill -9."""

from __future__ import annotations

import asyncio
import random

from quilld.cluster.dir_link import DirectoryLink, pack, unpack
from quilld.cluster.directory import Directory, DirectorySettings
from quilld.cluster.peer_client import PeerError
from quilld.scopes import ScopeRegistry

NODES = ("a", "b", "c", "d", "e")
CTAG = b"\x01" * 8


class WiredLink(DirectoryLink):
    """A directory link whose requests reach the other nodes' links in memory; `down` never answer."""

    peers: dict[str, DirectoryLink]
    down: set[str]

    async def call(self, dest, msg, timeout=5.0):
        if dest in self.down:
            raise PeerError(f"connection to {dest} refused")
        self.stats["requests"] += 1
        return unpack(self.peers[dest].handle(self.node_id, pack(msg)))


def cluster() -> dict[str, WiredLink]:
    peers: dict[str, WiredLink] = {}
    for i, name in enumerate(NODES):
        d = Directory(name, DirectorySettings(replicas=3, buckets=256), random.Random(i))
        link = WiredLink(d, ScopeRegistry(), (), {})
        link.peers, link.down = peers, set()
        peers[name] = link
    for link in peers.values():
        link.d.set_members({n: 1.0 for n in NODES}, 0.0)
    return peers


def pump(peers: dict[str, WiredLink], now: float) -> None:
    """Deliver every directory message until none is left."""
    for _ in range(100):
        sent = False
        for name, link in peers.items():
            for dest, msg in link.d.poll(now):
                sent = True
                link.d.on_reply(dest, msg, peers[dest].d.handle(name, msg, now), now)
        if not sent:
            return
    raise AssertionError("the directories never went quiet")


def test_two_of_three_owners_down_the_third_answers_and_no_key_reads_absent():
    peers = cluster()
    keys = [CTAG + b"k%d" % i for i in range(400)]
    for eid in keys:
        peers["e"].d.place_key("e", eid, "dram", 100)
    pump(peers, 100.0)  # past the handoff grace: the view of five is settled
    a = peers["a"]
    # every key whose owners do not include the asker or the holder: b, c, d own it; b and c are down
    asked = [eid for eid in keys if set(a.d.owners_to_ask(b"K" + eid)) == {"b", "c", "d"}]
    first_two_down = [eid for eid in asked if set(a.d.owners_to_ask(b"K" + eid)[:2]) == {"b", "c"}]
    assert len(asked) >= 20 and first_two_down, (len(asked), len(first_two_down))
    a.down = {"b", "c"}
    answers, _ = asyncio.run(a.lookup([Directory.key_item(eid) for eid in asked]))
    absent = [eid for eid, holders in zip(asked, answers) if [h[0] for h in holders] != ["e"]]
    assert absent == [], f"{len(absent)} of {len(asked)} keys read absent while d, their third owner, had them"
    assert a.stats["lookup_misses"] == 0 and a.stats["lookup_misses_unreachable"] == 0


def test_a_key_whose_owners_are_all_unreachable_is_an_unreachable_miss_not_a_true_one():
    peers = cluster()
    keys = [CTAG + b"k%d" % i for i in range(200)]
    for eid in keys:
        peers["e"].d.place_key("e", eid, "dram", 100)
    pump(peers, 100.0)
    a = peers["a"]
    eid = next(eid for eid in keys if set(a.d.owners_to_ask(b"K" + eid)) == {"b", "c", "d"})
    a.down = {"b", "c", "d"}
    (holders,), _ = asyncio.run(a.lookup([Directory.key_item(eid)]))
    assert holders == []
    assert (a.stats["lookup_misses_unreachable"], a.stats["lookup_misses"]) == (1, 0)
    # a key nobody placed, with its owners up: a true miss
    a.down = set()
    (holders,), _ = asyncio.run(a.lookup([Directory.key_item(CTAG + b"never placed")]))
    assert holders == []
    assert (a.stats["lookup_misses_unreachable"], a.stats["lookup_misses"]) == (1, 1)
