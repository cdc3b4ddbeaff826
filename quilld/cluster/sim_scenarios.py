"""The directory's scenarios at size, on the simulation: what `bench/directory_sim.py` prints.

One seeded run of `n` simulated nodes goes through: steady placement from every
node (pool keys and engines' chained blocks); lookups from random nodes (keys,
and ROUTE-shaped prompts from their first block); 5% of the nodes crashing at
once; 10% joining; a rolling restart of every node, in waves; and the same
crash with 1% of all messages lost. Each phase reports what the issue asks:
directory bytes per node, messages per placement, owner round trips per lookup,
the time to converge, and live entries that cannot be found afterwards (0).

"Converged" is checked against the truth, not a model: every live holder's own
list compared with every one of its entries' owners (`Simulation.unfindable`),
and no owner keeping an entry its holder does not have (`Simulation.stale`).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from quilld.cluster import ownership
from quilld.cluster.directory import Directory, DirectorySettings
from quilld.cluster.simulation import CTAG, Simulation, chain, held_bytes, owned_bytes
from quilld.index.residency import ResidencyIndex
from quilld.scopes import ScopeRegistry


@dataclass
class Workload:
    keys_per_node: int = 40  # pool keys (LMCache's chunks and metadata) each node holds
    engine_chains: int = 2  # chains (prompts) each node's engine holds
    chain_blocks: int = 64  # blocks per chain (two segments of 32)
    prompts: int = 300  # ROUTE-shaped lookups measured
    key_lookups: int = 300


@dataclass
class Phase:
    name: str
    figures: dict[str, Any] = field(default_factory=dict)


def _secs(t: float | None) -> float | None:
    """A virtual-clock duration as printed: to the hundredth (None: it never happened)."""
    return None if t is None else round(t, 2)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def directory_bytes(sim: Simulation) -> tuple[float, int]:
    sizes = [owned_bytes(n.directory.owned) for n in sim.live()]
    return statistics.fmean(sizes), max(sizes)


def full_replication_bytes(sim: Simulation) -> tuple[int, int]:
    """What one node of today's design (every node follows every log) keeps for the same
    entries, built with the structure it used (`ResidencyIndex`, holders numbered per node):
    (bytes, entries). The structure is measured the same way as the owners' stores."""
    index = ResidencyIndex(ScopeRegistry())
    tag = b"\0\0\0\1"
    n = 0
    for node in sim.live():
        for holder, held in node.directory.authorities.items():
            for entries in held.buckets.values():
                for eid in entries:
                    index.put(tag, eid[8:], holder, "dram" if holder == node.node_id else "hbm")
                    n += 1
    return _index_bytes(index), n


def _index_bytes(index: ResidencyIndex) -> int:
    import sys
    size = sys.getsizeof
    total = size(index._entries)
    for entries in index._entries.values():
        total += size(entries) + sum(size(k) + size(v) for k, v in entries.items())
    return total


def converge(sim: Simulation, limit: float) -> float | None:
    return sim.run_until(sim.converged, limit, step=0.25)


def run(n: int, seed: int = 1, workload: Workload = Workload(), settings: DirectorySettings | None = None,
        loss_phase: bool = True, restart_waves: int = 20, log=print) -> list[Phase]:
    ownership.COLUMN_CACHE_BYTES = max(ownership.COLUMN_CACHE_BYTES, (n + n // 5) * 16384 * 8)
    settings = settings or DirectorySettings()
    rng = random.Random(seed)
    phases: list[Phase] = []
    cpu0 = time.process_time()

    def note(phase: Phase) -> None:
        phase.figures["cpu_s"] = round(time.process_time() - cpu0, 1)
        phases.append(phase)
        log(f"  {phase.name}: " + ", ".join(f"{k} {v}" for k, v in phase.figures.items()))

    sim = Simulation(seed=seed, settings=settings)
    nodes = sim.start(n, bootstrap=True)
    took = sim.run_until(sim.settled, 120, step=0.25)
    note(Phase("start", {"nodes": n, "settled_s": took}))

    # -- steady placement from every node ---------------------------------------------------
    chains_of: dict[str, list[list[bytes]]] = {}
    for node in nodes:
        sim.place_keys(node, workload.keys_per_node)
        chains = [chain(rng.getrandbits(64), workload.chain_blocks) for _ in range(workload.engine_chains)]
        chains_of[f"e-{node.node_id}"] = chains
        sim.place_engine(node, f"e-{node.node_id}", chains)
    took = converge(sim, 120)
    placements = sum(nd.directory.stats["placements"] for nd in sim.live())
    items = sum(nd.directory.stats["placement_items"] for nd in sim.live())
    batches = sim.stats["dir_requests_b"]
    mean_b, max_b = directory_bytes(sim)
    entries = [nd.directory.owned.entries for nd in sim.live()]
    old_bytes, old_entries = full_replication_bytes(sim)
    note(Phase("placement", {
        "converged_s": took, "unfindable": sim.unfindable(), "stale": sim.stale(),
        "placements": placements, "entry_messages_per_placement": round(items / placements, 2),
        "batches_per_placement": round(batches / placements, 4),
        "entries_per_node_mean": round(statistics.fmean(entries), 1), "entries_per_node_max": max(entries),
        "dir_bytes_per_node_mean": int(mean_b), "dir_bytes_per_node_max": max_b,
        "bytes_per_owned_entry": round(sum(owned_bytes(x.directory.owned) for x in sim.live()) / max(1, sum(entries)), 1),
        "full_replication_bytes_per_node": old_bytes,
        "full_replication_bytes_per_entry": round(old_bytes / max(1, old_entries), 1),
    }))

    # -- lookups (in steady state: past the grace during which a bucket just gained asks another owner too)
    sim.run(settings.handoff_grace_s + 0.5)
    live = sim.live()
    trips, rounds = [], []
    engines = sorted(chains_of)
    for _ in range(workload.prompts):
        asker = rng.choice(live)
        c = rng.choice(chains_of[rng.choice(engines)])
        prompt = c[:32]
        items = [item for item, _ in asker.directory.block_items(CTAG, prompt)]
        answers, t, r = sim.lookup(asker, items)
        assert answers[0] and all(answers[0]), "a held prompt was not found"
        trips.append(t)
        rounds.append(r)
    key_trips = []
    holders = [nd for nd in live if nd.keys]
    for _ in range(workload.key_lookups):
        asker, holder = rng.choice(live), rng.choice(holders)
        eid = rng.choice(sorted(holder.keys))
        answers, t, _ = sim.lookup(asker, [Directory.key_item(eid)])
        assert any(h == holder.node_id for h, _ in answers[0]), "a held key was not found"
        key_trips.append(t)
    note(Phase("lookups", {
        "route32_owner_round_trips_p50": percentile(trips, 50), "route32_owner_round_trips_p99": percentile(trips, 99),
        "route32_rounds_max": max(rounds), "key_owner_round_trips_p50": percentile(key_trips, 50),
        "key_owner_round_trips_p99": percentile(key_trips, 99),
    }))

    # -- 5% crash ------------------------------------------------------------------------------
    victims = [nd.node_id for nd in rng.sample(sim.live()[1:], max(1, n // 20))]
    t0 = sim.now
    sim.crash(victims)
    gone = set(victims)
    detected = sim.run_until(lambda: any(not gone <= nd.directory.members.keys() for nd in sim.live()), 120, step=0.1)
    all_views = sim.run_until(sim.views_agree, 120, step=0.1)
    dir_converged = converge(sim, 120)
    note(Phase("crash 5%", {
        "crashed": len(victims), "first_view_without_them_s": round(detected or 0, 2),
        "all_views_without_them_s": round((detected or 0) + (all_views or 0), 2),
        "directory_converged_after_views_s": _secs(dir_converged), "total_s": round(sim.now - t0, 2),
        "unfindable": sim.unfindable(), "stale": sim.stale(),
    }))

    # -- 10% join --------------------------------------------------------------------------------
    t0 = sim.now
    seed_ids = [nd.node_id for nd in sim.live()[:3]]
    newcomers = [sim.add(f"j{i:04d}", seed_ids) for i in range(max(1, n // 10))]
    for nd in newcomers:
        sim.place_keys(nd, workload.keys_per_node)
    all_views = sim.run_until(sim.views_agree, 120, step=0.1)
    dir_converged = converge(sim, 120)
    note(Phase("join 10%", {
        "joined": len(newcomers), "all_views_with_them_s": _secs(all_views),
        "directory_converged_after_views_s": _secs(dir_converged), "total_s": round(sim.now - t0, 2),
        "unfindable": sim.unfindable(), "stale": sim.stale(),
    }))

    # -- rolling restart of every node, in waves -------------------------------------------------------
    t0 = sim.now
    order = [nd.node_id for nd in sim.live()]
    wave = max(1, len(order) // restart_waves)
    per_wave = []
    for i in range(0, len(order), wave):
        w0 = sim.now
        for nid in order[i:i + wave]:
            sim.restart(nid)
        took = converge(sim, 120)
        per_wave.append(took if took is not None else float("inf"))
    note(Phase("rolling restart", {
        "waves": len(per_wave), "nodes_per_wave": wave,
        "converged_per_wave_s_max": round(max(per_wave), 2), "total_s": round(sim.now - t0, 2),
        "unfindable": sim.unfindable(), "stale": sim.stale(),
    }))

    # -- 1% loss ------------------------------------------------------------------------------------
    if loss_phase:
        sim.loss = 0.01
        t0 = sim.now
        for nd in rng.sample(sim.live(), max(1, n // 10)):
            sim.place_keys(nd, 10)
        victims = [nd.node_id for nd in rng.sample(sim.live()[1:], max(1, n // 20))]
        sim.crash(victims)
        took = converge(sim, 240)
        retries = sum(nd.directory.stats["retries"] for nd in sim.live())
        note(Phase("1% loss: placements and a 5% crash", {
            "total_s": round(sim.now - t0, 2), "converged": took is not None, "retries": retries,
            "unfindable": sim.unfindable(), "stale": sim.stale(),
        }))
        sim.loss = 0.0
    return phases


def dense_entry_bytes(nodes: int, entries: int = 200_000, replicas: int = 3, buckets: int = 16384,
                      block_share: float = 0.9, seed: int = 1) -> dict[str, float]:
    """Bytes per entry when buckets are full, as on a node of a large pool: one owner's store
    filled with `entries` entries of the buckets it owns in a cluster of `nodes` (90% engine or
    pool blocks in chained segments of 1 to 32 blocks, 10% keys, from `nodes` holders), against one node
    of today's full replication holding the same entries in its `ResidencyIndex` (holders
    numbered up to `nodes`)."""
    import sys

    from quilld.cluster.dir_entries import BLOCK, KEY, block_shard, code_of, key_shard
    from quilld.cluster.dir_owned import OwnedEntries

    rng = random.Random(seed)
    own = ownership.Ownership(buckets, replicas)
    names = [f"n{i:04d}" for i in range(nodes)]
    own.update({n: 1.0 for n in names})
    mine = sorted(own.owned_by(names[0]).tolist())
    store = OwnedEntries()
    today = ResidencyIndex(ScopeRegistry())
    tag = b"\0\0\0\1"
    n = 0
    while n < entries:
        holder = rng.choice(names)
        if rng.random() < block_share:
            group = rng.getrandbits(64).to_bytes(8, "big")
            shard = block_shard(CTAG, group)
            b = own.bucket_of(shard)
            if b not in mine and len(mine) < buckets:  # draw again until it lands in our buckets
                continue
            for pos in range(rng.randint(1, 32)):  # segments filled anywhere from 1 block to 32
                h = group if pos == 0 else rng.getrandbits(64).to_bytes(8, "big")
                store.put(holder, BLOCK, CTAG + h, shard, b, code_of(1, pos))
                today.put(tag, h, holder, "hbm")
                n += 1
        else:
            eid = CTAG + b"model@1@0@%016x" % rng.getrandbits(64)
            b = own.bucket_of(key_shard(eid))
            if b not in mine:
                continue
            store.put(holder, KEY, eid, key_shard(eid), b, code_of(4, 1 << 20))
            today.put(tag, eid[8:], holder, "dram")
            n += 1
    return {"entries": n, "buckets_owned": len(mine), "bytes_per_entry": owned_bytes(store) / n,
            "today_bytes_per_entry": _index_bytes(today) / n,
            "held_bytes_per_entry": _held_entry_bytes(own, entries, block_share, rng)}


def _held_entry_bytes(own: ownership.Ownership, entries: int, block_share: float, rng: random.Random) -> float:
    """Bytes per entry of a holder's own list (HeldEntries), filled as the directory fills it:
    `entries` of one node's blocks in chains of 1 to 32 (one batch of stores per chain, each
    block's parent the one before) and keys, every bucket of the cluster."""
    from quilld.cluster.dir_entries import KEY, HeldEntries, code_of, key_shard

    held = HeldEntries("n0000")
    n = 0
    while n < entries:
        if rng.random() < block_share:
            length = rng.randint(1, 32)
            hashes = tuple(rng.getrandbits(64).to_bytes(8, "big") for _ in range(length))
            held.change_blocks([(CTAG, "dram", hashes, None)], {CTAG: CTAG}, True, 32, own.bucket_of)
            n += length
        else:
            eid = CTAG + b"model@1@0@%016x" % rng.getrandbits(64)
            held.put(KEY, eid, key_shard(eid), own.bucket_of(key_shard(eid)), code_of(4, 1 << 20),
                     rng.getrandbits(63))
            n += 1
    return held_bytes(held) / len(held)
