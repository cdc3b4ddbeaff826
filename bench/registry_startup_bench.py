"""A node's start-up in each membership mode, side by side in one run: three quilld nodes on
127.0.0.1 by gossip (SWIM, the test suite's fast probe settings) and three through a real etcd
(one member, started here); then one more node started, timed from its spawn until every node's
NODES lists it alive (the join a node pays at start), and until it serves (its RESP port answers).

    python bench/registry_startup_bench.py [--rounds 5] [--plot PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from etcd_cluster import EtcdCluster  # noqa: E402
from plot import Panel, add_flag, ratio, save  # noqa: E402
from procs import free_gossip_port, start_quilld, stop_process  # noqa: E402

FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}


def alive(port: int) -> set[str]:
    lines = redis.Redis(port=port).execute_command("NODES").decode().splitlines()
    return {ln.split()[0] for ln in lines if ln.split()[1] == "alive"}


def one_round(mode: str, tmp: Path, etcd: EtcdCluster) -> tuple[float, float]:
    """(seconds until the fourth node serves, until every node lists it alive)."""
    gossip: dict[str, int] = {}
    nodes = {}
    prefix = f"/bench-{time.monotonic_ns()}"

    def start(name: str):
        extra = ["--node-id", name, "--dram", "64MiB"]
        if mode == "etcd":
            extra += ["--registry", "etcd", "--etcd-endpoints", etcd.endpoints, "--etcd-prefix", prefix]
        else:
            gossip[name] = free_gossip_port()
            extra += ["--gossip-port", str(gossip[name])]
            if name != "a":
                extra += ["--seeds", f"127.0.0.1:{gossip['a']}"]
        nodes[name] = start_quilld(tmp, *extra, env=FAST_GOSSIP)

    try:
        for n in "abc":
            start(n)
        deadline = time.monotonic() + 30
        while not all(alive(q.port) >= set("abc") for q in nodes.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: three nodes never saw each other")
            time.sleep(0.02)
        t0 = time.monotonic()
        start("d")  # returns once it serves
        served = time.monotonic() - t0
        while not all("d" in alive(q.port) for q in nodes.values()):
            if time.monotonic() - t0 > 30:
                raise RuntimeError(f"{mode}: d never reached every view")
            time.sleep(0.01)
        return served, time.monotonic() - t0
    finally:
        for q in nodes.values():
            stop_process(q.proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    add_flag(ap)
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {"gossip": [], "etcd": []}
    with tempfile.TemporaryDirectory(prefix="quill-start-") as tmp, EtcdCluster(Path(tmp), members=1) as etcd:
        for r in range(args.rounds):
            for mode in ("gossip", "etcd"):
                work = Path(tmp) / f"{mode}-{r}"
                work.mkdir()
                got[mode].append(one_round(mode, work, etcd))
    medians = {mode: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
               for mode, rows in got.items()}
    print(f"mode   | serves after (median of {args.rounds}) | in every view after")
    for mode, (served, seen) in medians.items():
        print(f"{mode:6} | {served:8.2f} s | {seen:8.2f} s")
    if args.plot:
        plot(args.plot, medians, args.rounds)


def plot(path: str, medians: dict[str, tuple[float, float]], rounds: int) -> None:
    """A fourth node's start in each mode: serving, and in every view (labels: etcd over gossip)."""
    what = ["serves", "in every view"]
    panel = Panel("a node's start-up", what, {mode: list(m) for mode, m in medians.items()}, "s",
                  [ratio(medians["etcd"][i], medians["gossip"][i]) for i in (0, 1)])
    save(path, [panel], "gossip against etcd: a node joining three", f"medians of {rounds} rounds; labels etcd / gossip")


if __name__ == "__main__":
    main()
