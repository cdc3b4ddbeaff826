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
owner's store filled as on a large pool (`dense_entry_bytes`), plus the holder side (the node's
own list of its 1M entries, `HeldEntries`, which it resends to new owners), beside today's
design (every node follows every node's log) measured the same way: one node
holding every entry in the `ResidencyIndex` it used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # this tree's quilld, not an installed one
from plot import Panel, add_flag, ratio, save  # noqa: E402

from quilld.cluster.directory import DirectorySettings  # noqa: E402
from quilld.cluster.sim_scenarios import Workload, dense_entry_bytes, run  # noqa: E402

BLOCKS_PER_NODE = 1_000_000  # the target: 1M blocks per node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[10, 100, 1000])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--keys", type=int, default=40, help="pool keys per node")
    add_flag(ap)
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
    print("nodes | owned B/entry (dense) | held B/entry | today B/entry | per node at 1M blocks/node: "
          "sharded (owned + held) | today | ratio")
    for n, by, dense, _ in summary:
        mine = sharded_bytes(n, r, dense)
        today = n * BLOCKS_PER_NODE * dense["today_bytes_per_entry"]
        print(f"{n:5d} | {dense['bytes_per_entry']:8.1f} | {dense['held_bytes_per_entry']:8.1f} | "
              f"{dense['today_bytes_per_entry']:8.1f} | {mine / 2**20:10.0f} MiB | {today / 2**30:8.1f} GiB | "
              f"{today / mine:7.1f}x")
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


    if args.plot:
        plot(args.plot, [(n, dense, by) for n, by, dense, _ in summary], r)


def sharded_bytes(n: int, replicas: int, dense: dict) -> float:
    """A node's directory bytes at BLOCKS_PER_NODE blocks per node: the owner side (its share of
    every node's entries, `replicas` copies in all) and the holder side (its own entries' list)."""
    return BLOCKS_PER_NODE * (min(replicas, n) * dense["bytes_per_entry"] + dense["held_bytes_per_entry"])


def plot(path: str, rows: list[tuple[int, dict, dict]], replicas: int) -> None:
    """Per simulated size: directory bytes per node at 1M blocks per node (sharded against full
    replication), messages per placement (against N - 1), and the convergence times."""
    sizes = [f"{n} nodes" for n, _, _ in rows]
    mine = [sharded_bytes(n, replicas, d) / 2**30 for n, d, _ in rows]
    today = [n * BLOCKS_PER_NODE * d["today_bytes_per_entry"] / 2**30 for n, d, _ in rows]
    msgs = [by["placement"]["entry_messages_per_placement"] for _, _, by in rows]
    crash = [by["crash 5%"]["all_views_without_them_s"] for _, _, by in rows]
    crash_dir = [by["crash 5%"]["directory_converged_after_views_s"] or 0.0 for _, _, by in rows]
    join = [by["join 10%"]["all_views_with_them_s"] or 0.0 for _, _, by in rows]
    join_dir = [by["join 10%"]["directory_converged_after_views_s"] or 0.0 for _, _, by in rows]
    panels = [
        Panel("directory per node, 1M blocks per node", sizes, {"full replication": today, "sharded": mine},
              "GiB", [ratio(t, m) for t, m in zip(today, mine)], logy=True),
        Panel("entry messages per placement", sizes,
              {"full replication (N-1)": [n - 1 for n, _, _ in rows], "sharded": msgs}, "messages", logy=True),
        Panel("5% crash: membership, then directory", sizes, {"views agree": crash, "directory after": crash_dir},
              "virtual seconds"),
        Panel("10% join: membership, then directory", sizes, {"views agree": join, "directory after": join_dir},
              "virtual seconds"),
    ]
    save(path, panels, f"The sharded directory, simulated (R={replicas})",
         "real SWIM and directory code on a virtual clock (quilld/cluster/simulation.py); bytes per entry from "
         "an owner's store filled as on a large pool; 'views agree': SWIM's detection with the default config")


if __name__ == "__main__":
    main()
