"""The sharded directory on a simulated cluster: real SWIM and directory code, virtual clock.

Every scenario ends by checking, against every live holder's own list, that each
entry is at every one of its owners (`unfindable() == (0, 0)`) and that no owner
keeps an entry its holder does not have (`stale() == 0`).
"""

from __future__ import annotations

import random

import pytest

from quilld.cluster.dir_entries import BLOCK, KEY, block_shard, key_shard, scope_digest
from quilld.cluster.directory import BATCH, DEL, Directory, DirectorySettings
from quilld.cluster.simulation import CTAG, Simulation, chain

SETTINGS = DirectorySettings(buckets=1024, anti_entropy_s=5.0, handoff_grace_s=3.0)


def cluster(n: int, seed: int = 1, loss: float = 0.0, settings: DirectorySettings = SETTINGS,
            keys: int = 40, chains: int = 2) -> Simulation:
    sim = Simulation(seed=seed, settings=settings, loss=loss)
    nodes = sim.start(n)
    assert sim.run_until(sim.settled, 60) is not None, "membership never settled"
    rng = random.Random(seed)
    for node in nodes:
        sim.place_keys(node, keys)
        sim.place_engine(node, f"e-{node.node_id}", [chain(rng.random(), 40) for _ in range(chains)])
    assert sim.run_until(sim.converged, 60) is not None, "placements never reached their owners"
    return sim


def test_each_placement_goes_to_its_owners_only() -> None:
    sim = cluster(12)
    total_placements = sum(n.directory.stats["placements"] for n in sim.live())
    items = sum(n.directory.stats["placement_items"] for n in sim.live())
    # at most R = 3 owners per entry, one of them possibly the holder itself (no message)
    assert items <= 3 * total_placements
    assert items >= 2 * total_placements * 0.9  # and not fewer than the owners that are elsewhere
    owned = [n.directory.owned.entries for n in sim.live()]
    held = sum(len(h) for n in sim.live() for h in n.directory.authorities.values())
    assert sum(owned) == 3 * held  # every entry on exactly its three owners, nowhere else
    assert sim.unfindable() == (0, 0) and sim.stale() == 0


def test_with_no_more_nodes_than_replicas_every_node_owns_everything() -> None:
    sim = cluster(3)
    sim.run(SETTINGS.handoff_grace_s + 0.5)  # steady state: buckets gained long enough ago
    held = sum(len(h) for n in sim.live() for h in n.directory.authorities.values())
    assert all(n.directory.owned.entries == held for n in sim.live())
    node = sim.live()[0]
    other = next(n for n in sim.live() if n is not node)
    eid = next(iter(other.keys))
    answers, trips, _ = sim.lookup(node, [Directory.key_item(eid)])
    assert trips == 0 and [h[0] for h in answers[0]] == [other.node_id]


def test_removals_reach_the_owners_and_nothing_stale_is_left() -> None:
    sim = cluster(10)
    for node in sim.live()[:5]:
        for eid in list(node.keys)[:20]:
            node.keys.discard(eid)
            node.directory.remove_key(node.node_id, eid)
        sim._pump(node.node_id)
    assert sim.run_until(sim.converged, 30) is not None
    assert sim.stale() == 0


def test_a_key_lookup_costs_one_owner_round_trip_and_a_prompt_of_32_blocks_one() -> None:
    settings = DirectorySettings(buckets=1024, group_blocks=32, anti_entropy_s=5.0)
    sim = Simulation(seed=4, settings=settings)
    nodes = sim.start(20)
    assert sim.run_until(sim.settled, 60) is not None
    prompt = chain(99, 64)
    sim.place_engine(nodes[3], "vllm-a", [prompt[:40]])
    sim.place_keys(nodes[5], 10)
    assert sim.run_until(sim.converged, 30) is not None
    sim.run(settings.handoff_grace_s + 0.5)  # steady state: buckets gained long enough ago
    asker = next(n for n in nodes if n.node_id not in ("n0003", "n0005"))
    d = asker.directory
    items = [item for item, _ in d.block_items(CTAG, prompt[:32])]
    answers, trips, rounds = sim.lookup(asker, items)
    assert len(items) == 1 and trips <= 1 and rounds <= 1
    assert all(any(h == "vllm-a" for h, _ in per) for per in answers[0])
    items = [item for item, _ in d.block_items(CTAG, prompt)]  # 64 blocks: two segments
    answers, trips, _ = sim.lookup(asker, items)
    assert len(items) == 2 and trips <= 2
    held = [any(h == "vllm-a" for h, _ in per) for seg in answers for per in seg]
    assert held == [True] * 40 + [False] * 24
    eid = next(iter(nodes[5].keys))
    answers, trips, _ = sim.lookup(asker, [Directory.key_item(eid)])
    assert trips <= 1 and [h[0] for h in answers[0]] == ["n0005"]


def test_a_block_whose_parent_is_unknown_starts_a_chain_and_is_counted() -> None:
    d = Directory("solo", DirectorySettings(buckets=64, group_blocks=4))
    d.set_members({"solo": 1.0}, 0.0)
    c = chain(7, 6)
    for i, h in enumerate(c):
        d.place_block("e", CTAG, h, c[i - 1] if i else None, "hbm")
    d.place_block("e", CTAG, b"orphan00", b"nobody!!", "hbm")
    held = d.authorities["e"]
    shards = [held.get(CTAG + h)[1] for h in c]
    assert shards[:4] == [block_shard(CTAG, c[0])] * 4 and shards[4:] == [block_shard(CTAG, c[4])] * 2
    assert held.get(CTAG + b"orphan00")[1] == block_shard(CTAG, b"orphan00")
    assert d.stats["blocks_unanchored"] == 1


def test_tiers_of_a_block_add_up_and_it_goes_when_the_last_one_does() -> None:
    d = Directory("solo", DirectorySettings(buckets=64))
    d.set_members({"solo": 1.0}, 0.0)
    h = chain(1, 1)[0]
    d.place_block("e", CTAG, h, None, "hbm")
    d.place_block("e", CTAG, h, None, "cpu")
    shard = block_shard(CTAG, h)
    b = d.bucket_of(shard)
    ((holder, code),) = d.owned.segment(b, shard, [h])[0]
    assert holder == "e" and code >> 40 == 0b11
    d.unplace_block("e", CTAG, h, "hbm")
    assert d.owned.segment(b, shard, [h])[0][0][1] >> 40 == 0b10
    d.unplace_block("e", CTAG, h, "cpu")
    assert d.owned.segment(b, shard, [h]) == [[]] and len(d.authorities["e"]) == 0


@pytest.mark.parametrize("victims", [1, 4])
def test_a_crash_loses_only_the_dead_holders_entries(victims: int) -> None:
    sim = cluster(16, seed=victims)
    dead = [n.node_id for n in sim.live()[2:2 + victims]]
    sim.crash(dead)
    assert sim.run_until(sim.converged, 60) is not None
    for node in sim.live():
        for h in node.directory.owned.holders:
            if h in dead:
                assert not node.directory.owned.holder_buckets(h)
    assert sim.unfindable() == (0, 0) and sim.stale() == 0


def test_joins_hand_over_every_moved_bucket() -> None:
    sim = cluster(12, seed=5)
    first = sim.live()[0].node_id
    for i in range(4):
        node = sim.add(f"x{i}", [first])
        sim.place_keys(node, 10)
    assert sim.run_until(sim.converged, 60) is not None
    gained = sum(n.directory.stats["buckets_gained"] for n in sim.live() if n.node_id.startswith("x"))
    assert gained > 0
    sim.run(SETTINGS.handoff_grace_s + 1)  # old owners release what moved
    owned = sum(n.directory.owned.entries for n in sim.live())
    held = sum(len(h) for n in sim.live() for h in n.directory.authorities.values())
    assert owned == 3 * held


def test_a_rolling_restart_keeps_every_entry_findable() -> None:
    sim = cluster(10, seed=6)
    for node in list(sim.live()):
        sim.restart(node.node_id)
        assert sim.run_until(sim.converged, 60) is not None, f"not converged after restarting {node.node_id}"
    assert sum(n.directory.stats["peer_restarts"] for n in sim.live()) > 0


def test_with_one_percent_loss_retries_and_anti_entropy_converge() -> None:
    sim = cluster(12, seed=7, loss=0.01)
    sim.crash([sim.live()[4].node_id])
    sim.add("late", [sim.live()[0].node_id])
    assert sim.run_until(sim.converged, 120) is not None
    assert sum(n.directory.stats["retries"] for n in sim.live()) > 0


def test_a_lost_removal_is_repaired_by_anti_entropy() -> None:
    sim = cluster(8, seed=8)
    holder = sim.live()[1]
    eid = next(iter(holder.keys))
    holder.keys.discard(eid)
    holder.directory.remove_key(holder.node_id, eid)
    for ch in holder.directory.channels.values():  # the removal's messages never leave
        ch.queue = type(ch.queue)(item for item in ch.queue if item[0] != DEL)
    sim._pump(holder.node_id)
    sim.run(1.0)
    assert sim.stale() > 0
    assert sim.run_until(lambda: sim.stale() == 0, 3 * SETTINGS.anti_entropy_s) is not None
    assert sum(n.directory.stats["ae_mismatches"] for n in sim.live()) > 0


def test_a_batch_sent_again_is_applied_once_and_a_gap_asks_for_a_resync() -> None:
    owner = Directory("o", DirectorySettings(buckets=64))
    owner.set_members({"o": 1.0, "h": 1.0}, 0.0)
    eid = CTAG + b"k"
    shard = b"K" + eid
    put = ("P", "h", KEY, eid, shard, (1 << 42) | 5)
    first = (BATCH, "ep", 1, [("S",), put])
    assert owner.handle("h", first, 0.0) == ("ok", [])
    assert owner.handle("h", first, 0.0) == ("ok", [])  # a retransmission: nothing twice
    assert owner.owned.entries == 1
    assert owner.handle("h", (BATCH, "ep", 3, [put]), 0.0) == ("resync",)  # 2 never came
    assert owner.handle("h", (BATCH, "other-epoch", 2, [put]), 0.0) == ("resync",)


def test_right_after_a_join_the_new_owner_also_asks_an_old_one() -> None:
    """A holder that has not seen the new member yet places its writes with the old owners: the new
    owner answers from a bucket it gained so recently as partial, and the asker asks the next owner."""
    sim = cluster(3, seed=9, keys=0, chains=0)
    sim.run(SETTINGS.handoff_grace_s + 0.5)
    a = sim.live()[0]
    late = sim.add("late", [a.node_id])
    assert sim.run_until(lambda: len(late.directory.members) == 4, 10) is not None
    # a writer whose view lacks `late`: with four members and three owners, find a key it places
    # with owners that do not include `late` but `late` owns in its own view
    writer = a
    writer.directory.set_members({n: 1.0 for n in writer.directory.members if n != "late"}, sim.now)
    eid = next(CTAG + b"k%d" % i for i in range(10000)
               if "late" in late.directory.ownership.owners_of(key_shard(CTAG + b"k%d" % i))
               and "late" not in writer.directory.ownership.owners_of(key_shard(CTAG + b"k%d" % i)))
    writer.keys.add(eid)
    writer.directory.place_key(writer.node_id, eid, "dram", 10)
    sim._pump(writer.node_id)
    sim.run(0.05)
    answers, trips, rounds = sim.lookup(late, [Directory.key_item(eid)])
    assert [h[0] for h in answers[0]] == [writer.node_id] and rounds >= 1


def test_a_scope_digest_is_the_same_on_every_node_and_differs_per_scope() -> None:
    assert scope_digest("alice", "m", "t", "") == scope_digest("alice", "m", "t", "")
    assert len({scope_digest(*s) for s in [("a", "m", "t", ""), ("b", "m", "t", ""), ("a", "m2", "t", ""),
                                           ("a", "m", "t2", ""), ("a", "m", "t", "lora")]}) == 5
    assert BLOCK != KEY


def test_an_owner_packs_blocks_of_any_hash_width_and_gives_them_back() -> None:
    from quilld.cluster.dir_entries import code_of
    from quilld.cluster.dir_owned import OwnedEntries
    owned = OwnedEntries()
    shard = block_shard(CTAG, b"g" * 8)
    blocks = [b"a" * 8, b"b" * 32, b"c" * 8, b"d" * 16]  # vLLM's ints, and raw hashes of other sizes
    for pos, h in enumerate(blocks):
        owned.put("e1", BLOCK, CTAG + h, shard, 5, code_of(1, pos))
    owned.put("e2", BLOCK, CTAG + blocks[2], shard, 5, code_of(2, 2))
    got = owned.segment(5, shard, blocks + [b"z" * 8])
    assert got == [[("e1", code_of(1, 0))], [("e1", code_of(1, 1))], [("e1", code_of(1, 2)), ("e2", code_of(2, 2))],
                   [("e1", code_of(1, 3))], []]
    assert sorted(e.eid for _, e in owned.entries_of("e1")) == sorted(CTAG + h for h in blocks)
    assert owned.remove("e1", BLOCK, CTAG + blocks[1], shard, 5) and owned.entries == 4
    assert owned.segment(5, shard, [blocks[1]]) == [[]]
    assert owned.drop_holder_in("e1", 5) == 3 and owned.segment(5, shard, blocks) == [[], [], [("e2", code_of(2, 2))], []]


def test_an_owned_entry_costs_far_less_than_a_fully_replicated_one_at_a_thousand_nodes() -> None:
    from quilld.cluster.sim_scenarios import dense_entry_bytes
    got = dense_entry_bytes(1000, entries=30_000)
    assert got["bytes_per_entry"] < 100  # the budget per entry and owner
    assert got["today_bytes_per_entry"] > 3 * got["bytes_per_entry"]
    assert 0 < got["held_bytes_per_entry"] < 300  # the holder side's own list, counted in the figure too
