"""The sharded directory at 10, 100 and 1,000 nodes: a deterministic simulation of the real code.

    python bench/directory_sim.py                  # 10, 100 and 1000 nodes (about 15 minutes)
    python bench/directory_sim.py --nodes 100      # one size
    python bench/directory_sim.py --nodes 1000 --seed 7

Each simulated node runs quilld's own membership (`quilld/cluster/swim.py`) and
directory (`directory.py`, `ownership.py`, `dir_entries.py`); only the transport
is in memory, on a virtual clock (`quilld/cluster/simulation.py`). The phases
(`quilld/cluster/sim_scenarios.py`): steady placement from every node, lookups,
5% of the nodes crashing at once, 10% joining, a rolling restart of every node
in waves, and placements plus a crash with 1% of all messages lost. After each,
every entry of every live holder is checked at every one of its owners.

Directory bytes: the simulated nodes hold a few hundred entries each, so their
buckets are nearly empty and per-bucket overhead dominates the measured bytes
per node. The projection to 1M blocks per node uses the bytes per entry of an
owner's store filled as on a large pool (`dense_entry_bytes`), beside today's
design (every node follows every node's log) measured the same way: one node
holding every entry in the `ResidencyIndex` it used.
"""

from __future__ import annotations

import argparse
import time

from quilld.cluster.directory import DirectorySettings
from quilld.cluster.sim_scenarios import Workload, dense_entry_bytes, run

BLOCKS_PER_NODE = 1_000_000  # the target: 1M blocks per node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[10, 100, 1000])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--keys", type=int, default=40, help="pool keys per node")
    args = ap.parse_args()
    settings = DirectorySettings(replicas=args.replicas)
    r = args.replicas
    summary = []
    for n in args.nodes:
        print(f"\n== {n} nodes (seed {args.seed}, R={r}) ==", flush=True)
        t0 = time.time()
        phases = run(n, seed=args.seed, workload=Workload(keys_per_node=args.keys), settings=settings,
                     restart_waves=20, log=lambda line: print(line, flush=True))
        dense = dense_entry_bytes(n, entries=100_000, replicas=r)
        by = {p.name: p.figures for p in phases}
        summary.append((n, by, dense, time.time() - t0))

    print("\n== summary ==")
    print("nodes | owned B/entry (dense) | today B/entry | per node at 1M blocks/node: sharded | today | ratio")
    for n, by, dense, _ in summary:
        mine = min(r, n) * BLOCKS_PER_NODE * dense["bytes_per_entry"]
        today = n * BLOCKS_PER_NODE * dense["today_bytes_per_entry"]
        print(f"{n:5d} | {dense['bytes_per_entry']:8.1f} | {dense['today_bytes_per_entry']:8.1f} | "
              f"{mine / 2**20:10.0f} MiB | {today / 2**30:8.1f} GiB | {today / mine:7.1f}x")
    print("\nnodes | entry msgs/placement (today N-1) | ROUTE32 owner RTs p50/p99 | key RTs p99 | "
          "crash 5%: views / dir after views / lost | join 10%: views / dir / lost | rolling restart max wave | 1% loss")
    for n, by, dense, secs in summary:
        p, lk, c, j = by["placement"], by["lookups"], by["crash 5%"], by["join 10%"]
        rr, loss = by["rolling restart"], by.get("1% loss: placements and a 5% crash", {})
        print(f"{n:5d} | {p['entry_messages_per_placement']} ({n - 1}) | "
              f"{lk['route32_owner_round_trips_p50']}/{lk['route32_owner_round_trips_p99']} | "
              f"{lk['key_owner_round_trips_p99']} | {c['all_views_without_them_s']} s / "
              f"{c['directory_converged_after_views_s']} s / {c['unfindable'][0]} | "
              f"{j['all_views_with_them_s']} s / {j['directory_converged_after_views_s']} s / {j['unfindable'][0]} | "
              f"{rr['converged_per_wave_s_max']} s | converged {loss.get('converged')} lost "
              f"{loss.get('unfindable', ('-',))[0]} | {secs:.0f} s wall")


if __name__ == "__main__":
    main()
