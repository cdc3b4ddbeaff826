"""ROUTE on a dozen real hosts against ROUTE on one node, in the same run.

    sudo python bench/cluster_route_bench.py                # 12 hosts, 2,000 ROUTEs each way
    sudo python bench/cluster_route_bench.py --hosts 6 --routes 500 --plot /tmp/route.png

Twelve quilld hosts, each in its own network namespace on one bridge (tests/netns.py, root
needed), and a thirteenth quilld alone in the same kind of namespace, with the same
engines. One engine's KV events (chained blocks, so each prompt's first 32 blocks share
owners) are pushed to the first host; the same to the single node. Then, from a client in
the bench's own namespace, ROUTE (`ROUTE PACKED`, 32 blocks of prompts the engine holds)
is timed round trip on every host in turn and on the single node, interleaved. In the
cluster each ROUTE asks the prompt's segment owner (none when the host asked is one of
its three owners): the difference to the single node is that round trip, and what the
printed INFO counts (owner round trips per ROUTE) says how often it was paid. Same
machine, two shared cores: a ratio, not an absolute figure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from netns import Topology, require_netns  # noqa: E402
from netns_cluster import NetnsCluster  # noqa: E402
from plot import Panel, add_flag, ratio, save  # noqa: E402

MODEL, TOKENIZER = "bench-model", "bench-tok"
STEADY_S = 11.0  # directory.handoff_grace_s (10 s) and a little: buckets gained at the joins answer fully
ENGINES = f"""
[[engines]]
id = "vllm-0"
url = "http://127.0.0.1:9001"
model = "{MODEL}"
tokenizer = "{TOKENIZER}"
[[engines]]
id = "vllm-1"
url = "http://127.0.0.1:9002"
model = "{MODEL}"
tokenizer = "{TOKENIZER}"
"""


def prompts(count: int, blocks: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(count)]


def push_events(node, engine: str, chains: list[list[int]]) -> None:
    events = [{"type": "block_stored", "block_hashes": c, "parent_block_hash": None, "token_ids": [],
               "block_size": 16, "lora_id": None, "lora_name": None, "medium": "GPU"} for c in chains]
    for i in range(0, len(events), 64):
        status, body = node.admin("POST", "/v1/kv-events", {"engine_id": engine, "events": events[i:i + 64]})
        if status != 200:
            raise SystemExit(f"KV events refused by {node.node_id}: {status} {body}")


def route_args(blocks: list[int]) -> list:
    return ["ROUTE", "PACKED", struct.pack(f"<{len(blocks)}Q", *blocks), "COMPACT"]


def timed(r, blocks: list[int]) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    got = r.execute_command(*route_args(blocks))
    return time.perf_counter() - t0, got[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=12)
    ap.add_argument("--routes", type=int, default=2000, help="ROUTEs on each side")
    ap.add_argument("--prompts", type=int, default=200)
    add_flag(ap)
    args = ap.parse_args()
    require_netns()
    chains = prompts(args.prompts, 32, 1)
    with Topology() as topo, tempfile.TemporaryDirectory() as work:
        cluster = NetnsCluster(topo, Path(work) / "cluster", config=ENGINES)
        nodes = cluster.start(args.hosts)
        cluster.wait_converged()
        alone = NetnsCluster(topo, Path(work) / "alone", config=ENGINES, gossip=False)
        (single,) = alone.start(1)
        push_events(nodes[0], "vllm-1", chains)
        push_events(single, "vllm-1", chains)
        time.sleep(STEADY_S)  # past the handoff grace after the joins: the cluster's steady state
        scope = (MODEL, TOKENIZER)
        clients = [n.client(scope) for n in nodes]
        one = single.client(scope)
        for c in (*clients, one):  # warm: connections, scope tags, every host's first lookups
            for blocks in chains[:20]:
                assert timed(c, blocks)[1] == b"vllm-1"
        rng = random.Random(2)
        lat_cluster, lat_single = [], []
        for i in range(args.routes):
            blocks = rng.choice(chains)
            dt, engine = timed(clients[i % len(clients)], blocks)
            assert engine == b"vllm-1"
            lat_cluster.append(dt)
            dt, engine = timed(one, blocks)
            assert engine == b"vllm-1"
            lat_single.append(dt)
        trips = routes = 0
        for c in clients:
            info = c.info("cluster")
            trips += info.get("cluster_route_owner_round_trips", 0)
            routes += info.get("cluster_route_lookups", 0)
        alone.stop_all()
        cluster.stop_all()

    def pct(values: list[float], q: float) -> float:
        s = sorted(values)
        return s[min(len(s) - 1, int(q * len(s)))] * 1e3

    rows = [(name, pct(v, 0.5), pct(v, 0.99)) for name, v in (("single node", lat_single),
                                                                ((f"{args.hosts} hosts"), lat_cluster))]
    print(f"ROUTE of 32 blocks (PACKED, COMPACT), {args.routes} each way, interleaved; round trip from a client")
    for name, p50, p99 in rows:
        print(f"  {name:>12}: p50 {p50:.3f} ms  p99 {p99:.3f} ms")
    print(f"  ratio cluster / single: p50 {rows[1][1] / rows[0][1]:.2f}x  p99 {rows[1][2] / rows[0][2]:.2f}x")
    print(f"  owner round trips per ROUTE in the cluster: {trips / max(1, routes):.2f} "
          f"({trips} over {routes} lookups; 0 when the host asked owns the prompt's segment)")
    print(f"  median of all: single {statistics.median(lat_single) * 1e3:.3f} ms, "
          f"cluster {statistics.median(lat_cluster) * 1e3:.3f} ms")
    if args.plot:
        plot(args.plot, rows, args.hosts, trips / max(1, routes))


def plot(path: str, rows: list[tuple[str, float, float]], hosts: int, trips: float) -> None:
    names = [r[0] for r in rows]
    panels = [Panel("ROUTE of 32 blocks, round trip", names, {"p50": [r[1] for r in rows], "p99": [r[2] for r in rows]},
                    "ms", [ratio(r[1], rows[0][1]) for r in rows])]
    save(path, panels, f"ROUTE on {hosts} hosts (network namespaces) and on one node",
         f"{trips:.2f} owner round trips per ROUTE in the cluster; one machine, two shared cores")


if __name__ == "__main__":
    main()
