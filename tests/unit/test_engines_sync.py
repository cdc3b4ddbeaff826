"""Engines across the cluster (issue 20.5): the engine table's last-writer-wins merge, its
tombstones and digest, the home rule, re-homing on a membership change (with a real
directory and control plane: the new home adopts the engine's entries, the old one steps
down), and the load every node's leases put on an engine."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from quilld.cluster.dir_link import DirectoryLink
from quilld.cluster.directory import Directory, DirectorySettings
from quilld.cluster.engine_table import EngineTable, home_of, worth_pulling
from quilld.cluster.engines_sync import EngineSync
from quilld.config import Config, EngineConfig
from quilld.index.control import ControlPlane
from quilld.index.engines import EngineRegistry, Load
from quilld.index.events import Batch, Removed, Stored
from quilld.model import IdentityScope
from quilld.scopes import ScopeRegistry

X = EngineConfig(id="vllm-x", url="http://10.0.0.1:8000", model="m")
Y = EngineConfig(id="vllm-y", url="http://10.0.0.2:8000", model="m")
SCOPE = IdentityScope("default", "m", "", "")


# -- the table ---------------------------------------------------------------------------------

def test_the_last_writer_wins_whatever_order_the_rows_arrive_in():
    a, b, c = EngineTable(), EngineTable(), EngineTable()
    a.put(X, "a", 1000)
    b.put(dataclasses.replace(X, url="http://10.0.0.9:8000"), "b", 2000)
    c.put(Y, "c", 1500)
    assert len({a.digest(), b.digest(), c.digest()}) == 3
    for first, second in ((b, c), (c, b)):  # a hears b then c, a copy of a hears c then b
        t = EngineTable()
        t.merge(a.rows(), 3000)
        t.merge(first.rows(), 3000)
        t.merge(second.rows(), 3000)
        assert t.get("vllm-x").config.url == "http://10.0.0.9:8000" and t.get("vllm-x").origin == "b"
        assert t.get("vllm-y").origin == "c"
    ab, ba = EngineTable(), EngineTable()
    for rows in (a.rows(), b.rows(), c.rows()):
        ab.merge(rows, 3000)
    for rows in (c.rows(), b.rows(), a.rows()):
        ba.merge(rows, 3000)
    assert ab.digest() == ba.digest()
    assert sorted(map(str, ab.rows())) == sorted(map(str, ba.rows()))
    changed, bad = ab.merge(a.rows(), 3000)  # an older write changes nothing
    assert changed == [] and bad == 0


def test_a_write_on_a_node_whose_clock_is_behind_still_replaces_what_it_saw():
    a, b = EngineTable(), EngineTable()
    a.put(X, "a", 5000)
    b.merge(a.rows(), 100)
    b.put(dataclasses.replace(X, url="http://new"), "b", 100)  # b's clock says 100 ms
    assert b.get("vllm-x").version[0] == 5001
    changed, _ = a.merge(b.rows(), 5000)
    assert [new.config.url for _, new in changed] == ["http://new"]


def test_a_removal_wins_over_the_registration_it_saw_and_is_forgotten_after_its_time():
    a, c = EngineTable(tombstone_s=60), EngineTable(tombstone_s=60)
    a.put(X, "a", 1000)
    c.merge(a.rows(), 1000)
    stone = c.remove("vllm-x", "c", 2000)
    assert stone is not None and stone.removed and stone.origin == "a"
    assert c.remove("vllm-x", "c", 2001) is None  # already removed
    changed, _ = a.merge(c.rows(), 2000)
    assert [(old.removed, new.removed) for old, new in changed] == [(False, True)]
    assert a.live() == {} and a.digest() == c.digest()
    late = EngineTable()
    late.put(X, "a", 1000)  # a node that still has the registration offers it: refused
    assert a.merge(late.rows(), 2500) == ([], 0) and a.live() == {}
    assert a.expire(61_000) == 0  # kept 60 s after its write
    assert a.expire(62_001) == 1 and a.get("vllm-x") is None
    assert a.merge(c.rows(), 62_001) == ([], 0) and a.get("vllm-x") is None  # a slower peer's old removal


def test_config_engines_agree_without_a_pull_and_any_api_write_replaces_them():
    a, b = EngineTable([X, Y]), EngineTable([Y, X])
    assert a.digest() == b.digest()
    other = EngineTable([dataclasses.replace(X, url="http://elsewhere")])
    a.merge(other.rows(), 0)
    other.merge(a.rows(), 0)
    assert a.digest() == other.digest()  # differing config files still converge (content hash order)
    b.put(dataclasses.replace(X, url="http://api"), "b", 10)
    a.merge(b.rows(), 10)
    assert a.get("vllm-x").config.url == "http://api" and a.get("vllm-x").origin == "b"


def test_malformed_rows_are_refused_and_the_rest_applies():
    good = EngineTable()
    good.put(X, "a", 1000)
    rows = [["vllm-z", "a", 1, "a", 0, {"id": "vllm-other", "model": "m"}],  # id and config disagree
            ["vllm-z", "a", "soon", "a", 0, None], "garbage", ["vllm-z", "a", 1, "a", 0, {"bogus": 1}],
            *good.rows()]
    t = EngineTable()
    changed, bad = t.merge(rows, 1000)
    assert bad == 4 and [new.engine_id for _, new in changed] == ["vllm-x"]


def gossip_rounds(tables: dict[str, EngineTable], now: int, limit: int = 10) -> tuple[int, list[tuple[str, str]]]:
    """Pull as the nodes do, in rounds (each node looks at every peer's summary, pulls when
    `worth_pulling` says so and the digest is not the one it last pulled of that peer) until no
    node pulls; (rounds, every (puller, peer) pull)."""
    pulled: dict[tuple[str, str], str] = {}
    pulls = []
    for rnd in range(limit):
        summaries = {n: t.summary() for n, t in tables.items()}
        this_round = 0
        for me, table in tables.items():
            for peer, theirs in summaries.items():
                if peer != me and worth_pulling(table.summary(), theirs) and pulled.get((me, peer)) != theirs[0]:
                    table.merge(tables[peer].rows(), now)
                    pulled[(me, peer)] = theirs[0]
                    pulls.append((me, peer))
                    this_round += 1
        if not this_round:
            return rnd, pulls
    raise AssertionError(f"still pulling after {limit} rounds")


def test_nodes_pull_only_from_peers_that_may_know_more_and_always_converge():
    rng = random.Random(5)
    for trial in range(50):
        tables = {n: EngineTable([Y]) for n in "abcde"}
        for i in range(rng.randint(1, 12)):  # writes on random nodes, each seeing a random part
            node = rng.choice("abcde")
            t = tables[node]
            if rng.random() < 0.2 and t.live():
                t.remove(rng.choice(sorted(t.live())), node, 1000 + rng.randint(0, 50))
            else:
                cfg = dataclasses.replace(X, id=f"e{rng.randint(0, 5)}", url=f"http://{i}")
                t.put(cfg, node, 1000 + rng.randint(0, 50))
            if rng.random() < 0.3:
                other = rng.choice("abcde")
                tables[other].merge(t.rows(), 2000)
        gossip_rounds(tables, 2000)
        assert len({t.digest() for t in tables.values()}) == 1, trial
    # a node that joins with the config file's engines pulls the others; none of them pulls it
    tables = {n: EngineTable([Y]) for n in "abc"}
    tables["a"].put(X, "a", 1000)
    gossip_rounds(tables, 2000)
    tables["new"] = EngineTable([Y])
    _, pulls = gossip_rounds(tables, 2000)
    assert not [p for p in pulls if p[1] == "new"] and [p for p in pulls if p[0] == "new"]
    assert len({t.digest() for t in tables.values()}) == 1


# -- the home rule ---------------------------------------------------------------------------

def test_the_home_is_the_origin_while_it_lives_then_one_rendezvous_choice_everywhere():
    members = ["a", "b", "c", "d"]
    assert home_of("vllm-x", "b", members) == "b"
    after = home_of("vllm-x", "b", ["a", "c", "d"])
    assert after in ("a", "c", "d")
    assert home_of("vllm-x", "b", ["d", "c", "a"]) == after  # the order of the view does not matter
    # a member that is not the home leaving moves nothing; engines spread over the members
    for other in set(members) - {after, "b"}:
        assert home_of("vllm-x", "b", [m for m in ("a", "c", "d") if m != other]) == after
    homes = {home_of(f"e{i}", "", members) for i in range(64)}
    assert homes == set(members)
    assert home_of("vllm-x", "", []) is None


# -- load ---------------------------------------------------------------------------------------

def test_an_engines_load_is_its_own_leases_plus_what_the_peers_advertise():
    reg = EngineRegistry((X, Y))
    lease = reg.acquire("vllm-x", "request", 64)
    reg.acquire("vllm-y", "decode")
    assert reg.own_loads() == {"vllm-x": Load(1, 1, 64, 1), "vllm-y": Load(1, 0, 0, 1)}
    reg.set_remote({"vllm-x": Load(3, 2, 100, 1), "unknown": Load(5, 0, 0, 5)})
    assert reg.load("vllm-x") == Load(4, 3, 164, 2) and reg.in_flight["vllm-x"] == 4
    assert reg.own_loads()["vllm-x"] == Load(1, 1, 64, 1)  # only this node's go in its meta
    reg.set_remote({"vllm-x": Load(1, 0, 0, 1)})  # replaced, not added
    assert reg.load("vllm-x") == Load(2, 1, 64, 2)
    reg.release(lease)
    assert reg.load("vllm-x") == Load(1, 0, 0, 1) and "vllm-x" not in reg.own_loads()
    reg.set_remote({})
    assert reg.in_flight["vllm-x"] == 0


# -- re-homing with a real directory and control plane ------------------------------------------

def pump(dirs: dict[str, Directory], now: float) -> None:
    """Deliver every message between the directories until none is left (an in-memory network)."""
    for _ in range(100):
        sent = False
        for name, d in dirs.items():
            for dest, msg in d.poll(now):
                sent = True
                if dest in dirs:
                    d.on_reply(dest, msg, dirs[dest].handle(name, msg, now), now)
                else:
                    d.on_failure(dest, msg, now)
        if not sent:
            return
    raise AssertionError("the directories never went quiet")


def node(name: str, *engines: EngineConfig) -> tuple[EngineSync, Directory, ControlPlane]:
    scopes = ScopeRegistry()
    control = ControlPlane(Config(engines=engines), scopes)
    control.node_id = name
    directory = Directory(name, DirectorySettings(buckets=64), random.Random(1))
    link = DirectoryLink(directory, scopes, (), {})
    control.placements = link
    members = {name: 1.0}
    sync = EngineSync(name, control, directory, link, None, {}, members, lambda: None)
    return sync, directory, control


def engine_homed_on(second: str, members: list[str]) -> EngineConfig:
    """A config engine (with a KV-event endpoint) whose rendezvous home among `members` is `second`."""
    for i in range(1000):
        e = EngineConfig(id=f"vllm-{i}", model="m", kv_events="tcp://127.0.0.1:1")
        if home_of(e.id, "", members) == second:
            return e
    raise AssertionError("no such engine id")


def test_a_new_home_adopts_the_engines_entries_and_the_old_home_steps_down():
    async def main():
        e = engine_homed_on("b", ["a", "b"])
        a, da, ca = node("a", e)
        db = Directory("b", DirectorySettings(buckets=64), random.Random(2))
        await a._settle()
        assert a.homes[e.id] == "a" and ca.follows(e.id)  # alone: its home
        # a consumes its events: blocks 1..4 placed with the engine as holder
        tag = ca.engine_tag(e.id, None)
        ca.apply(e.id, Batch(0.0, (Stored((1, 2, 3, 4), None, (), 16, None, "GPU"),), None, None))
        assert len(da.authorities[e.id]) == 4
        # b joins: the engine's home is b now; a stops consuming and is no longer its authority
        for d in (da, db):
            d.set_members({"a": 1.0, "b": 1.0}, 0.0)
        pump({"a": da, "b": db}, 0.0)
        assert len(db.owned.entries_of(e.id)) == 4  # b owns every bucket too (2 nodes, 3 replicas)
        a.members["b"] = 1.0
        await a._settle()
        assert a.homes[e.id] == "b" and not ca.follows(e.id) and e.id not in da.authorities
        assert a.stats["engine_homes_left"] == 1
        # b's removal of a block (it is the authority there) reaches a as an owner
        db.adopt(e.id, da.owned.entries_of(e.id))
        db.unplace_block(e.id, link_ctag(ca, tag), block(4), None)
        pump({"a": da, "b": db}, 0.0)
        assert len(da.owned.entries_of(e.id)) == 3
        # b dies: a is the home again, adopts the 3 entries its owners (itself) have, subscribes
        da.holder_gone("b", 1.0)
        da.set_members({"a": 1.0}, 1.0)
        del a.members["b"]
        await a._settle()
        assert a.homes[e.id] == "a" and ca.follows(e.id)
        assert len(da.authorities[e.id]) == 3 and a.stats["engine_rehomes"] == 1
        assert a.stats["engine_entries_adopted"] == 3
        # as their authority, a's removal of block 1 leaves the owners (before adoption it would not have)
        ca.apply(e.id, Batch(0.0, (Removed((1,), "GPU"),), None, None))
        assert len(da.owned.entries_of(e.id)) == 2
        await ca.stop()

    asyncio.run(main())


def link_ctag(control: ControlPlane, tag: bytes) -> bytes:
    return control.placements.ctag(tag)


def block(h: int) -> bytes:
    from quilld.index.residency import hash_key
    return hash_key(h)


def test_a_registration_here_is_homed_here_with_nothing_adopted_and_a_removal_leaves_no_trace():
    async def main():
        a, da, ca = node("a")
        a.members["b"] = 1.0  # b is a member; a's registration stays a's
        e = dataclasses.replace(X, kv_events="tcp://127.0.0.1:1")
        assert await a.register(e) is True
        assert a.homes[e.id] == "a" and ca.follows(e.id) and a.stats["engine_entries_adopted"] == 0
        assert ca.engines.get(e.id).locality == "a"  # stores its KV through the node it was registered on
        assert await a.register(e) is False  # a replacement
        ca.apply(e.id, Batch(0.0, (Stored((7, 8), None, (), 16, None, "GPU"),), None, None))
        assert len(da.authorities[e.id]) == 2
        assert await a.remove(e.id) == 2
        assert not ca.follows(e.id) and e.id not in ca.engines.engines and e.id not in da.authorities
        assert a.table.get(e.id).removed
        with pytest.raises(Exception, match="no engine"):
            await a.remove(e.id)

    asyncio.run(main())


def test_a_merged_table_registers_every_engine_in_the_same_candidate_order_on_every_node():
    async def main():
        b, _, cb = node("b")
        c, _, cc = node("c")
        for s in (b, c):
            s.members.update({"b": 1.0, "c": 1.0})
        await b.register(X)
        await c.register(Y)
        # each merges the other's table (what PEERENGINES carries)
        for me, other in ((b, c), (c, b)):
            changed, _ = me.table.merge(other.table.rows(), 0)
            assert changed
            await me._settle()
        assert b.table.digest() == c.table.digest()
        assert cb.engines.ids_for_model("m") == cc.engines.ids_for_model("m")
        assert b.home("vllm-x") == "b" and c.home("vllm-x") == "b" and b.home("vllm-y") == "c"
        assert not cb.follows("vllm-y") and cb.engines.get("vllm-y").locality == "c"

    asyncio.run(main())


class WiredLink(DirectoryLink):
    """A directory link whose requests reach the other nodes' links in memory (the RESP hop left out)."""

    peers: dict[str, DirectoryLink]

    async def call(self, dest, msg):
        from quilld.cluster.dir_link import pack, unpack
        return unpack(self.peers[dest].handle(self.node_id, pack(msg)))


def test_what_a_node_places_for_an_engine_homed_elsewhere_goes_to_the_home_its_one_authority():
    async def main():
        peers: dict[str, DirectoryLink] = {}
        nodes = {}
        for name in ("a", "b"):
            scopes = ScopeRegistry()
            control = ControlPlane(Config(), scopes)
            directory = Directory(name, DirectorySettings(buckets=64), random.Random(1))
            link = WiredLink(directory, scopes, (), {})
            link.peers = peers
            peers[name] = link
            sync = EngineSync(name, control, directory, link, None, {}, {"a": 1.0, "b": 1.0}, lambda: None)
            control.placements = sync.placements
            nodes[name] = (sync, directory, control)
        (a, da, ca), (b, db, _) = nodes["a"], nodes["b"]
        await b.register(X)  # homed on b
        a.table.merge(b.table.rows(), 0)
        await a._settle()
        assert a.home(X.id) == "b" and X.id in ca.engines.engines
        # a's gateway records a prompt it sent vllm-x: b places it, a holds no authority for it
        tag = ca.scopes.tag(SCOPE)
        ca.record(X.id, tag, [11, 12, 13])
        ca.unrecord(X.id, tag, 13)
        for _ in range(100):
            if not a._outbox and not a._tasks:
                break
            await asyncio.sleep(0.01)
        assert X.id not in da.authorities
        assert len(db.authorities[X.id]) == 2 and a.stats["engine_placements_handed_over"] == 2
        # a clear made on a (its own forgetting, as when it replaces the engine) does not reach b
        ca.placements.engine_cleared(X.id)
        assert len(db.authorities[X.id]) == 2

    asyncio.run(main())


def wired(*names: str) -> dict[str, tuple[EngineSync, Directory, ControlPlane]]:
    """Nodes whose directories agree on the membership and whose links reach each other in memory."""
    peers: dict[str, DirectoryLink] = {}
    nodes = {}
    for name in names:
        scopes = ScopeRegistry()
        control = ControlPlane(Config(), scopes)
        control.node_id = name
        directory = Directory(name, DirectorySettings(buckets=64), random.Random(1))
        directory.set_members(dict.fromkeys(names, 1.0), 0.0)
        link = WiredLink(directory, scopes, (), {})
        link.peers = peers
        peers[name] = link
        sync = EngineSync(name, control, directory, link, None, {}, dict.fromkeys(names, 1.0), lambda: None)
        control.placements = sync.placements
        nodes[name] = (sync, directory, control)
    return nodes


def test_an_engine_registered_again_elsewhere_moves_home_and_its_old_entries_are_cleared():
    async def main():
        nodes = wired("a", "b")
        (a, da, ca), (b, db, cb) = nodes["a"], nodes["b"]
        dirs = {"a": da, "b": db}
        await b.register(X)
        a.table.merge(b.table.rows(), 0)
        await a._settle()
        cb.apply(X.id, Batch(0.0, (Stored((1, 2), None, (), 16, None, "GPU"),), None, None))
        pump(dirs, 0.0)
        assert len(da.owned.entries_of(X.id)) == 2 == len(db.owned.entries_of(X.id))
        # registered again on a, with another URL: a is its origin and home now
        await a.register(dataclasses.replace(X, url="http://moved"))
        b.table.merge(a.table.rows(), 0)
        await b._settle()
        pump(dirs, 0.0)
        assert a.home(X.id) == b.home(X.id) == "a"
        assert cb.engines.get(X.id).url == "http://moved"
        assert da.owned.entries_of(X.id) == [] == db.owned.entries_of(X.id)  # b, its authority, cleared them
        assert X.id not in db.authorities and b.stats["engine_homes_left"] == 1
        # the new home's own entries are not touched by the old home: b has no say any more
        ca.apply(X.id, Batch(0.0, (Stored((5,), None, (), 16, None, "GPU"),), None, None))
        pump(dirs, 0.0)
        assert len(db.owned.entries_of(X.id)) == 1 and len(da.authorities[X.id]) == 1

    asyncio.run(main())


def test_the_gossiped_loads_fit_the_meta_busiest_first_and_the_rest_are_counted():
    from quilld.cluster.cluster import Cluster
    from quilld.cluster.wire import MAX_META_BYTES, check_meta
    from quilld.config import ClusterConfig, DramConfig
    from quilld.index.residency_feed import ResidencyFeed
    from quilld.tiers.keyspace import Keyspace

    engines = tuple(dataclasses.replace(X, id=f"vllm-{i:03d}") for i in range(60))
    cfg = Config(dram=DramConfig(size=64 * 4096), cluster=ClusterConfig(transfer="tcp"), engines=engines)
    scopes = ScopeRegistry()
    control = ControlPlane(cfg, scopes)
    keyspace = Keyspace(cfg.dram, scopes)
    cluster = Cluster(cfg, "n1", keyspace, scopes, control, ResidencyFeed(control.index, "n1", scopes),
                      lambda: {"port": 7379, "admin_port": 7380})
    for i, e in enumerate(engines):
        for _ in range(i % 7 + 1):
            control.engines.acquire(e.id)
    meta = cluster.meta()
    check_meta(meta)  # travels as gossip meta (raises over MAX_META_BYTES)
    loads = meta["load"]
    assert 5 < len(loads) < len(engines)
    left_out = [load.requests for e, load in control.engines.own_loads().items() if e not in loads]
    assert min(v[0] for v in loads.values()) >= max(left_out)  # the busiest first
    assert cluster.engines.stats["engine_loads_unadvertised"] == 1
    control.engines.set_remote({})  # a node with few leases advertises them all
    for e in engines[5:]:
        control.engines.remove(e.id)
    meta = cluster.meta()
    assert len(meta["load"]) == 5 and len(msgpack_size(meta)) <= MAX_META_BYTES


def msgpack_size(meta: dict) -> bytes:
    import msgpack
    return msgpack.packb(meta, use_bin_type=True)
