"""What issue 32's checks cost on the common path: GET and SET latency on three quilld nodes on
loopback whose owners are all alive, this tree against another revision, side by side in one run.

For each round, for each tree in turn (alternating, so both see the same machine): three nodes
(a, b, c) with `cluster.keep_fetched` off, 300 small keys SET on a; then, paced every 2 ms, GETs
of random keys on a (local), GETs on b (a directory lookup and a fetch from a: every read
crosses), and SETs of new keys on b (a write's reply waits for its owners' acknowledgement).
Medians over rounds of each p50 and p99; the ratio is this tree's time over the other's (below
1: faster). Both trees run on the pure-Python build (QUILLD_PURE_PYTHON=1: the revision's
worktree has no compiled modules), so the comparison is of the cluster code alone.

    python bench/consistency_cost_bench.py --vs 45ad464 [--rounds 3] [--ops 1500] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from plot import Panel, add_flag, ratio, save  # noqa: E402
from procs import free_gossip_port, start_quilld, stop_process  # noqa: E402

FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000", "QUILLD_CLUSTER_KEEP_FETCHED": "false",
               "QUILLD_PURE_PYTHON": "1"}
KEYS = 300
PACE_S = 0.002


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one_round(tree: Path, tmp: Path, ops: int, rng: random.Random) -> dict[str, tuple[float, float]]:
    """(p50, p99) in ms of each kind of operation, on three fresh nodes of `tree`."""
    ports = {n: free_gossip_port() for n in "abc"}
    nodes = {}
    try:
        for n in "abc":
            seeds = [] if n == "a" else ["--seeds", f"127.0.0.1:{ports['a']}"]
            nodes[n] = start_quilld(tmp, "--node-id", n, "--gossip-port", str(ports[n]), "--dram", "128MiB", *seeds,
                                    env=FAST_GOSSIP, tree=tree)
        clients = {n: redis.Redis(port=q.port, socket_timeout=20) for n, q in nodes.items()}
        deadline = time.monotonic() + 30
        while not all(len([ln for ln in c.execute_command("NODES").decode().splitlines() if " alive" in ln]) == 3
                      for c in clients.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("three nodes did not see one another alive in 30 s")
            time.sleep(0.1)
        a, b = clients["a"], clients["b"]
        keys = [f"user:{i}" for i in range(KEYS)]
        a.mset({k: os.urandom(64) for k in keys})
        deadline = time.monotonic() + 20
        while b.exists(*keys) != KEYS:  # every owner has a's placements
            if time.monotonic() > deadline:
                raise RuntimeError("b does not find a's keys")
            time.sleep(0.1)
        out = {}
        for what, run in (("GET on the holder", lambda i: a.get(rng.choice(keys))),
                          ("GET on another node", lambda i: b.get(rng.choice(keys))),
                          ("SET on another node", lambda i: b.set(f"new:{i}:{rng.random()}", b"v" * 64))):
            lat = []
            for i in range(ops):
                t0 = time.perf_counter()
                run(i)
                lat.append((time.perf_counter() - t0) * 1000)
                time.sleep(PACE_S)
            out[what] = (pct(lat, 0.5), pct(lat, 0.99))
        for c in clients.values():
            c.close()
        return out
    finally:
        for q in nodes.values():
            stop_process(q.proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vs", required=True, help="the revision to compare with (a commit, tag or branch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", type=int, default=1500, help="operations of each kind per round")
    add_flag(ap)
    args = ap.parse_args()
    rng = random.Random(32)
    with tempfile.TemporaryDirectory(prefix="quill-cost-") as tmp:
        other = Path(tmp) / "other"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(other), args.vs], check=True)
        try:
            results: dict[str, list[dict]] = {"this tree": [], args.vs: []}
            for r in range(args.rounds):
                for name, tree in (("this tree", ROOT), (args.vs, other)):
                    work = Path(tmp) / f"{name.replace(' ', '-')}-{r}"
                    work.mkdir()
                    results[name].append(one_round(tree, work, args.ops, rng))
                    print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    rows = {what: [tuple(statistics.median(r[what][i] for r in results[name]) for i in (0, 1))
                   for name in ("this tree", args.vs)] for what in results["this tree"][0]}
    print(f"{'operation':22} {'':10} {'this tree':>10} {args.vs:>10} {'ratio':>6}   (ms, medians of {args.rounds} rounds)")
    for what, (ours, theirs) in rows.items():
        for i, label in ((0, "p50"), (1, "p99")):
            print(f"{what:22} {label:10} {ours[i]:10.3f} {theirs[i]:10.3f} {ours[i] / theirs[i]:6.2f}")
    if args.plot:
        plot(args.plot, rows, args.vs, args.rounds)


def plot(path: str, rows: dict[str, list[tuple[float, float]]], other: str, rounds: int) -> None:
    """p50 and p99 of each operation, this tree beside `other` (labels: this tree's time over its)."""
    ops = list(rows)
    panels = [Panel(f"{label} latency", ops, {"this tree": [rows[o][0][i] for o in ops],
                                               other: [rows[o][1][i] for o in ops]}, "ms",
                    [ratio(rows[o][0][i], rows[o][1][i]) for o in ops]) for i, label in ((0, "p50"), (1, "p99"))]
    save(path, panels, f"issue 32's checks on the common path: this tree against {other}",
         f"three nodes on loopback, pure-Python build, medians of {rounds} rounds")


if __name__ == "__main__":
    main()
