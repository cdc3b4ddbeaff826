"""How soon failure and join news reach every view while every node's meta keeps changing.

The deterministic simulation (quilld/cluster/simulation.py: the real `Swim` and `Directory`
of every node in one process, an in-memory transport, a virtual clock) with meta of a busy
node's real size (about 250 bytes encoded) that every node changes every second, as its load
and tier figures do. From the fault to the last live view that has it: a 5 % crash (every live
node lists every crashed node dead) and a 10 % join (every live node lists every new node
alive). Each size runs three times from the same seed, side by side: with meta that never
changes (the floor), and with busy meta under broadcast.py's ranking of membership news ahead of
meta refreshes and without it (the ranking before, least sent first).

    python bench/gossip_news_sim.py [--nodes 100 300] [--seed 1] [--meta-bytes 250] [--rankings ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plot import Panel, add_flag, save  # noqa: E402
from quilld.cluster import broadcast  # noqa: E402
from quilld.cluster.simulation import Simulation  # noqa: E402
from quilld.cluster.wire import State  # noqa: E402

LIMIT = 300.0  # simulated seconds a phase may take


def busy_meta(tick: int, size: int) -> dict:
    """Meta of about `size` encoded bytes whose figures change every tick."""
    return {"rdma": None, "load": tick % 97, "dram_free": 1_000_000 + tick * 7 % 10_007, "ssd_free": tick * 13,
            "pad": ("x" * max(0, size - 90)), "v": tick}


# the runs per size: name -> (label, membership news ranked first, busy meta)
RANKINGS = {"idle meta": ("idle meta (the floor)", True, False),
            "before": ("least sent first (before)", False, True),
            "news first": ("membership news first", True, True)}
STEP = 0.25  # simulated seconds between two looks at the views (meta changes every 4 steps)


def phase(sim: Simulation, done, meta_bytes: int, tick: list[int]) -> float | None:
    start = sim.now
    while not done():
        if sim.now - start >= LIMIT:
            return None
        tick[0] += 1
        if meta_bytes and tick[0] % 4 == 0:
            for node in sim.live():
                sim.set_meta(node, busy_meta(tick[0], meta_bytes))
        sim.run(STEP)
    return sim.now - start


def run(n: int, seed: int, meta_bytes: int, prioritize: bool) -> tuple[float | None, float | None]:
    broadcast.BroadcastQueue.prioritize = prioritize
    sim = Simulation(seed=seed)
    nodes = sim.start(n, bootstrap=True)
    tick = [0]
    phase(sim, lambda: sim.now >= 20, meta_bytes, tick)  # meta churning for a while first (0: never)
    crashed = {nd.node_id for nd in nodes[1: 1 + max(1, n // 20)]}
    sim.crash(crashed)

    def all_dead() -> bool:
        return all(all((m := nd.swim.member(c)) is None or m.state in (State.DEAD, State.LEFT)
                       for c in crashed) for nd in sim.live())

    crash_s = phase(sim, all_dead, meta_bytes, tick)
    joined = [sim.add(f"j{i:04d}", [nodes[0].node_id]).node_id for i in range(max(1, n // 10))]

    def all_joined() -> bool:
        return all(all((m := nd.swim.member(j)) is not None and m.state is State.ALIVE for j in joined)
                   for nd in sim.live())

    join_s = phase(sim, all_joined, meta_bytes, tick)
    return crash_s, join_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[100, 300])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--meta-bytes", type=int, default=250)
    ap.add_argument("--rankings", nargs="*", choices=RANKINGS, default=list(RANKINGS),
                    help="which of the three runs per size (a 1,000-node run takes the better part of an hour)")
    add_flag(ap)
    args = ap.parse_args()
    table: dict[int, dict[str, tuple[float | None, float | None]]] = {}
    print(f"{'nodes':>6} {'ranking':<28} {'5% crash in every view':>24} {'10% join in every view':>24}")
    try:
        for n in args.nodes:
            table[n] = {}
            for name, (label, prioritize, busy) in RANKINGS.items():
                if name not in args.rankings:
                    continue
                table[n][name] = run(n, args.seed, args.meta_bytes if busy else 0, prioritize)
                crash_s, join_s = table[n][name]
                print(f"{n:6d} {label:<28} {_s(crash_s):>24} {_s(join_s):>24}", flush=True)
            if "before" in table[n] and "news first" in table[n]:
                (c0, j0), (c1, j1) = table[n]["before"], table[n]["news first"]
                if c0 and c1 and j0 and j1:
                    print(f"{'':6} {'ratio (before / after)':<28} {c0 / c1:23.2f}x {j0 / j1:23.2f}x")
    finally:
        broadcast.BroadcastQueue.prioritize = True
    if args.plot:
        plot(args.plot, table)


def plot(path: str, table: dict[int, dict[str, tuple[float | None, float | None]]]) -> None:
    """Two panels, the crash and the join: seconds to every view per size, per ranking (a run
    past the limit drawn at the limit)."""
    sizes = [f"{n} nodes" for n in table]
    rankings = list(next(iter(table.values())))

    def series(i: int) -> dict[str, list[float]]:
        return {r: [LIMIT if table[n][r][i] is None else table[n][r][i] for n in table] for r in rankings}

    save(path, [Panel("5% crash in every view", sizes, series(0), "simulated s"),
                Panel("10% join in every view", sizes, series(1), "simulated s")],
         "Gossip with busy meta: membership news first, against before",
         "deterministic simulation (quilld/cluster/simulation.py), meta changing every second on every node")


def _s(t: float | None) -> str:
    return f"> {LIMIT:.0f} s" if t is None else f"{t:.1f} s"


if __name__ == "__main__":
    main()
