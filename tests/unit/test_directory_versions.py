"""One value per key across the pool (issue 32, items 3 and 4): every write of a key carries a version
from its node's hybrid logical clock, a delete leaves a versioned tombstone, owners answer only the
newest version's holders, and tell the holder of an older copy to drop it. The real Directory and
DirectoryLink of five nodes, their requests delivered in memory (test_directory_reads.py's harness)."""

from __future__ import annotations

import asyncio

from test_directory_reads import CTAG, NODES, pump
from test_directory_reads import cluster as wired

from quilld.cluster.directory import Directory
from quilld.cluster.hlc import Hlc, wall_ms_of

KEY = CTAG + b"session:42"


def cluster():
    """Five wired nodes; each drops a copy an owner calls stale, as the node drops it from its keyspace."""
    peers = wired()
    dropped: dict[str, list[bytes]] = {n: [] for n in NODES}
    for name, link in peers.items():
        d = link.d

        def stale(eid, d=d, name=name):
            dropped[name].append(eid)
            d.remove_key(name, eid)
        d.key_stale = stale
    return peers, dropped


def holders_seen(peers, asker: str, eid: bytes = KEY) -> list[tuple[str, int]]:
    (found,), _ = asyncio.run(peers[asker].lookup([Directory.key_item(eid)]))
    return [(h, version) for h, _code, version in found]


def test_the_clock_never_runs_backwards_and_passes_every_version_it_saw():
    t = [1_800_000_000.0]
    a, b = Hlc("a", lambda: t[0]), Hlc("b", lambda: t[0])
    v1, v2 = a.now(), a.now()
    assert v2 > v1 and wall_ms_of(v1) == 1_800_000_000_000
    t[0] -= 5.0  # the wall clock stepped back: versions still rise
    assert a.now() > v2
    far = b.now() + (10_000 << 22)  # a peer's clock 10 s ahead
    a.observe(far)
    assert a.now() > far


def test_a_key_written_on_two_nodes_is_read_as_the_later_write_everywhere_and_the_older_copy_goes():
    peers, dropped = cluster()
    e, a = peers["e"].d, peers["a"].d
    v1 = e.hlc.now()
    e.place_key("e", KEY, "dram", 10, v1)
    pump(peers, 100.0)
    assert holders_seen(peers, "c") == [("e", v1)]
    a.hlc.observe(v1)  # (within one millisecond their node bits would decide: as if a had read it)
    v2 = a.hlc.now()
    assert v2 > v1
    a.place_key("a", KEY, "dram", 12, v2)
    pump(peers, 100.0)
    assert dropped["e"] == [KEY] and e.version_of("e", KEY) is None  # e was told, and dropped its copy
    for asker in NODES:
        assert holders_seen(peers, asker) == [("a", v2)], asker
    assert sum(p.d.stats["stale_copies_dropped"] for p in peers.values()) == 1


def test_an_older_copy_placed_after_the_newer_one_is_the_one_dropped():
    peers, dropped = cluster()
    a, e = peers["a"].d, peers["e"].d
    old = e.hlc.now()
    a.hlc.observe(old)  # (two clocks in one millisecond: their node bits would decide)
    new = a.hlc.now()
    a.place_key("a", KEY, "dram", 12, new)
    pump(peers, 100.0)
    e.place_key("e", KEY, "dram", 10, old)  # a peer's copy kept at the version it was read at, late
    pump(peers, 100.0)
    assert dropped == {**{n: [] for n in NODES}, "e": [KEY]}
    assert holders_seen(peers, "b") == [("a", new)]


def test_copies_of_one_version_are_all_holders():
    peers, dropped = cluster()
    v = peers["a"].d.hlc.now()
    for n in "ab":
        peers[n].d.place_key(n, KEY, "dram", 10, v)  # b kept a copy of a's value
    pump(peers, 100.0)
    assert sorted(holders_seen(peers, "c")) == [("a", v), ("b", v)]
    assert not any(dropped.values())


def test_a_delete_is_a_tombstone_that_hides_and_drops_every_older_copy_then_expires():
    peers, dropped = cluster()
    for n in "ab":
        peers[n].d.place_key(n, KEY, "dram", 10, 0)  # recovered copies: version unknown (0)
    pump(peers, 100.0)
    c = peers["c"].d
    c.bury_key("c", KEY, c.hlc.now(), until=200.0)
    pump(peers, 100.0)
    assert dropped["a"] == [KEY] and dropped["b"] == [KEY]
    for asker in NODES:
        assert holders_seen(peers, asker) == [], asker
    pump(peers, 201.0)  # the tombstone's time is up: its holder removes it
    assert c.stats["tombstones_expired"] == 1 and c.version_of("c", KEY) is None
    assert all(p.d.owned.entries == 0 for p in peers.values())


def test_a_write_after_a_delete_is_found_again():
    peers, _ = cluster()
    c, d = peers["c"].d, peers["d"].d
    c.bury_key("c", KEY, c.hlc.now(), until=1e9)
    pump(peers, 100.0)
    d.hlc.observe(c.version_of("c", KEY))
    v = d.hlc.now()
    d.place_key("d", KEY, "dram", 10, v)
    pump(peers, 100.0)
    assert holders_seen(peers, "a") == [("d", v)]


def test_a_node_away_during_a_delete_drops_its_copy_when_it_comes_back():
    peers, dropped = cluster()
    e = peers["e"].d
    e.place_key("e", KEY, "dram", 10, e.hlc.now())
    pump(peers, 100.0)
    rest = {n: 1.0 for n in NODES if n != "e"}
    for n in rest:  # e is down: the others drop its entries
        peers[n].d.set_members(rest, 100.0)
    a = peers["a"].d
    a.bury_key("a", KEY, a.hlc.now(), until=1e9)
    peers["e"].down = set(NODES)  # nothing reaches the others from e meanwhile
    pump({n: peers[n] for n in rest}, 101.0)
    peers["e"].down = set()
    # e comes back with its copy (a restarted node's SSD tier: version 0, unknown)
    restarted = Directory("e", peers["e"].d.s)
    restarted.key_stale = lambda eid: (dropped["e"].append(eid), restarted.remove_key("e", eid))
    peers["e"].d = restarted
    restarted.place_key("e", KEY, "ssd", 10, 0)
    everyone = {n: 1.0 for n in NODES}
    for link in peers.values():
        link.d.set_members(everyone, 102.0)
    pump(peers, 102.0)
    assert dropped["e"] == [KEY]
    for asker in NODES:
        assert holders_seen(peers, asker) == [], asker


def test_a_node_cannot_place_or_remove_entries_for_another_node():
    """A peer that holds the secret places what it holds and what its engines hold, never another
    node's entries: the owners refuse them (counted), so no node can be made to seem to hold a key."""
    peers, _ = cluster()
    a, b = peers["a"].d, peers["b"].d
    a.place_key("a", KEY, "dram", 10, a.hlc.now())
    b.place_key("c", CTAG + b"forged", "dram", 10, b.hlc.now())  # b says c holds a key
    b.remove_key("a", KEY)  # and that a no longer holds its own
    b.place_key("engine-1", CTAG + b"engine-held", "hbm", 10)  # an engine homed on b: accepted
    pump(peers, 100.0)
    asker = "d"
    assert holders_seen(peers, asker) == [("a", holders_seen(peers, asker)[0][1])]
    assert holders_seen(peers, asker, CTAG + b"forged") == []
    assert [h for h, _ in holders_seen(peers, asker, CTAG + b"engine-held")] == ["engine-1"]
    assert sum(p.d.stats["placements_refused"] for p in peers.values()) >= 2
