"""An engine's KV events in the sharded directory, as its home places them: a batch is one
placement call and one ITEMS item per owner, in order, and every owner ends with exactly what
the home holds (the real ControlPlane, DirectoryLink and Directory on a simulated cluster)."""

from __future__ import annotations

import gc
import random

import pytest

from quilld.cluster.dir_entries import BLOCK, CTAG_LEN, block_shard, code_of
from quilld.cluster.dir_link import DirectoryLink
from quilld.cluster.dir_owned import OwnedEntries
from quilld.cluster.directory import ITEMS, Directory, DirectorySettings
from quilld.cluster.simulation import Simulation
from quilld.config import Config, EngineConfig
from quilld.index.control import ControlPlane
from quilld.index.events import Removed, Stored
from quilld.index.residency import hash_key
from quilld.scopes import ScopeRegistry

SETTINGS = DirectorySettings(buckets=1024, anti_entropy_s=5.0, handoff_grace_s=3.0)
ENGINE = "vllm-0"


def home_and_control(nodes: int) -> tuple[Simulation, object, ControlPlane, DirectoryLink]:
    sim = Simulation(seed=nodes, settings=SETTINGS)
    members = sim.start(nodes)
    assert sim.run_until(sim.settled, 60) is not None, "membership never settled"
    home = members[0]
    scopes = ScopeRegistry()
    control = ControlPlane(Config(engines=(EngineConfig(id=ENGINE, url="http://127.0.0.1:9", model="m"),)), scopes)
    link = DirectoryLink(home.directory, scopes, (), {})
    control.placements = link
    return sim, home, control, link


def vllm_batch(rng: random.Random, stored: list[int], chains: list, n: int = 64) -> list:
    """n events as vLLM sends them while decoding: three stores (one block, chained to its
    request's last) for each removal of a block stored earlier."""
    events = []
    for i in range(n):
        if i % 4 == 3 and stored:
            events.append(Removed((stored.pop(rng.randrange(len(stored))),), "GPU"))
        else:
            h, r = rng.getrandbits(64), rng.randrange(len(chains))
            stored.append(h)
            events.append(Stored((h,), chains[r], (), 16, None, "GPU"))
            chains[r] = h
    return events


@pytest.mark.parametrize("nodes", [3, 6])  # every node owns everything; owners differ by segment
def test_a_batch_of_kv_events_is_one_item_per_owner_and_every_owner_ends_with_what_the_home_holds(nodes: int):
    sim, home, control, link = home_and_control(nodes)
    d = home.directory
    rng, stored, chains = random.Random(5), [], [None] * 8
    control.apply_events(ENGINE, vllm_batch(rng, stored, chains))  # the first goes in each owner's full sync
    sim._pump(home.node_id)
    assert sim.run_until(sim.converged, 30) is not None
    for _round in range(4):
        before = dict(d.stats)
        batch = vllm_batch(rng, stored, chains)
        assert control.apply_events(ENGINE, batch) == len(batch)
        changes = d.stats["placements"] - before.get("placements", 0)
        assert changes == len(batch)  # 48 stores and 16 removals of blocks stored before
        queued = {o: list(ch.queue) for o, ch in d.channels.items() if ch.queue}
        assert queued, "nothing queued for the other owners"
        for owner, items in queued.items():
            assert len(items) == 1 and items[0][0] == ITEMS, f"{owner}: {[it[0] for it in items]}"
        if nodes <= SETTINGS.replicas:  # each owner gets the whole batch, in the home's order
            assert all(len(items[0][3]) == changes for items in queued.values())
        sim._pump(home.node_id)
        assert sim.run_until(sim.converged, 30) is not None, "the batch never reached its owners"
    held = home.directory.authorities[ENGINE]
    tag = control.engine_tag(ENGINE, None)
    assert sorted(e[CTAG_LEN:] for e in held.where) == sorted(hash_key(h) for h in stored)
    # and a ROUTE from any other node finds them, chained in their segments
    asker = sim.live()[-1]
    for h in stored[:20]:
        eid = link.ctag(tag) + hash_key(h)
        shard = held.get(eid)[1]
        answers, _, _ = sim.lookup(asker, [(BLOCK, shard, [hash_key(h)])])
        assert [holder for holder, _ in answers[0][0]] == [ENGINE]


def test_a_block_stored_removed_and_stored_again_in_one_batch_ends_as_its_last_event_says():
    sim, home, control, _link = home_and_control(3)
    a, b, c = 11, 12, 13
    control.apply_events(ENGINE, [Stored((a, b), None, (), 16, None, "GPU")])
    sim._pump(home.node_id)
    assert sim.run_until(sim.converged, 30) is not None
    # in one batch: b goes, comes back as the head of a chain of its own (another segment, so
    # another shard), c follows it, and a leaves the host memory it never had
    control.apply_events(ENGINE, [Removed((b,), "GPU"), Stored((b,), None, (), 16, None, "GPU"),
                                  Stored((c,), b, (), 16, None, "GPU"), Removed((a,), "CPU"),
                                  Stored((a,), None, (), 16, None, "CPU"), Removed((a,), "GPU")])
    ch = next(iter(home.directory.channels.values()))
    assert [it[0] for it in ch.queue] == [ITEMS]
    sim._pump(home.node_id)
    assert sim.run_until(sim.converged, 30) is not None  # no owner keeps anything stale, none misses one
    held = home.directory.authorities[ENGINE]
    ctag = next(iter(held.where))[:CTAG_LEN]
    assert held.get(ctag + hash_key(b))[1] == block_shard(ctag, hash_key(b))
    assert held.get(ctag + hash_key(c))[1] == block_shard(ctag, hash_key(b))
    assert held.get(ctag + hash_key(a))[2] >> 40 == 0b10  # in host memory only


def test_an_owners_segments_and_digests_are_nothing_the_cyclic_collector_walks():
    """An owner keeps hundreds of thousands of segments during ingest: none of them, nor any
    digest, may be a container the collector tracks, or each full collection walks them all."""
    owned = OwnedEntries()
    rng = random.Random(3)
    ctag = b"c" * CTAG_LEN
    for s in range(500):
        head = rng.getrandbits(64).to_bytes(8, "big")
        shard = block_shard(ctag, head)
        for pos in range(rng.randint(1, 32)):
            part = head if pos == 0 else rng.getrandbits(64).to_bytes(8, "big")
            owned.put(f"e{s % 3}", BLOCK, ctag + part, shard, s % 64, code_of(1, pos))
    owned.put("e0", BLOCK, ctag + b"w" * 32, block_shard(ctag, b"w" * 32), 7, code_of(1, 0))  # a raw hash
    gc.collect()
    runs = [r for segs in owned.segs.values() for sh, r in segs.items() if sh != block_shard(ctag, b"w" * 32)]
    assert len(runs) == 500
    assert not any(gc.is_tracked(r) for r in runs)
    assert not any(gc.is_tracked(run) for r in runs for run in r.values())
    assert not any(gc.is_tracked(per) for per in owned.digests.values())


def test_the_holders_digest_and_the_owners_agree_after_stores_retiers_and_removals():
    d = Directory("solo", DirectorySettings(buckets=64))
    d.set_members({"solo": 1.0}, 0.0)
    ctag = b"c" * CTAG_LEN
    rng = random.Random(8)
    hashes = [rng.getrandbits(64) for _ in range(300)]
    d.change_blocks("e", [(ctag, "hbm", hashes[:200], None), (ctag, "cpu", hashes[100:300], hashes[99])], {ctag: ctag})
    d.change_blocks("e", [(ctag, "hbm", hashes[50:150], False), (ctag, None, hashes[250:], False)], {ctag: ctag})
    held = d.authorities["e"]
    assert len(held) == 200  # 50-99 were in HBM only, 250-299 left every tier
    for b in held.buckets:
        assert d.owned.digest("e", b) == held.digest(b)
    assert d.owned.entries == 200
