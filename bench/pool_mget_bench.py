"""One MGET of thousands of keys across the pool, against one node and redis-server (issue 19.3).

    python bench/pool_mget_bench.py                 # 8,000 keys, 3 rounds
    python bench/pool_mget_bench.py --keys 20000 --plot /tmp/mget.png

Three quilld nodes on loopback (a cluster: gossip, the sharded directory), one quilld
alone and one redis-server, all started here. For each, MGET of `--keys` keys nobody
holds, then of `--keys` keys held by another node (written on node a, read on node c, so
every value comes from the pool; small values, 100 bytes, as LMCache's metadata keys),
timed from a redis-py client; then the RSS of the node that answered, and how many peer
sockets it opened (INFO cluster). Before the sharded directory and the bounded peer
pool, the first MGET on three nodes asked every peer for every key at once: 16,029
sockets, 6.3 GB of RSS and 95 s. Medians of `--rounds`; one machine, two shared cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from plot import Panel, add_flag, ratio, save  # noqa: E402
from procs import free_port, start_quilld, start_redis, stop_process  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def timed_mget(r: redis.Redis, keys: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    got = r.mget(keys)
    return time.perf_counter() - t0, sum(v is not None for v in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    add_flag(ap)
    args = ap.parse_args()
    n = args.keys
    with tempfile.TemporaryDirectory() as work:
        w = Path(work)
        for sub in ("a", "b", "c", "alone", "redis"):
            (w / sub).mkdir()
        gossip = [free_port() for _ in range(3)]
        nodes = []
        for i, name in enumerate("abc"):
            flags = ["--node-id", name, "--gossip-port", str(gossip[i]), "--dram", "256MiB"]
            if i:
                flags += ["--seeds", f"127.0.0.1:{gossip[0]}"]
            nodes.append(start_quilld(w / name, *flags, admin=False))
        alone = start_quilld(w / "alone", "--dram", "256MiB", admin=False)
        rport, rproc = start_redis(w / "redis")
        try:
            ra, rc = (redis.Redis(port=q.port, socket_timeout=300) for q in (nodes[0], nodes[2]))
            deadline = time.monotonic() + 30
            while rc.execute_command("NODES").decode().count(" alive") < 3:
                if time.monotonic() > deadline:
                    raise SystemExit("the three nodes did not converge")
                time.sleep(0.1)
            # past the directory's handoff grace (10 s): until then a node that just gained a
            # bucket asks its other owners too, in case a writer still placed with the old ones
            time.sleep(11.0)
            single = redis.Redis(port=alone.port, socket_timeout=300)
            rs = redis.Redis(port=rport, socket_timeout=300)
            value = b"m" * 100
            held = [f"held:{i}" for i in range(n)]
            with ra.pipeline(transaction=False) as p:
                for k in held:
                    p.set(k, value)
                p.execute()
            for r in (single, rs):
                with r.pipeline(transaction=False) as p:
                    for k in held:
                        p.set(k, value)
                    p.execute()
            rows = []
            for label, r, proc, keys in (
                    ("missing, 3 nodes", rc, nodes[2].proc, [f"missing:{i}" for i in range(n)]),
                    ("missing, 1 node", single, alone.proc, [f"missing:{i}" for i in range(n)]),
                    ("missing, redis", rs, rproc, [f"missing:{i}" for i in range(n)]),
                    ("held on a, 3 nodes", rc, nodes[2].proc, held),
                    ("held, 1 node", single, alone.proc, held),
                    ("held, redis", rs, rproc, held)):
                times, hits = [], 0
                for k in range(args.rounds):
                    if label.startswith("held on a") and k:  # c kept copies: read fresh keys from the pool again
                        r.execute_command("FLUSHALL")
                    dt, hits = timed_mget(r, keys)
                    times.append(dt)
                info = r.info("cluster") if "3 nodes" in label else {}
                rows.append((label, statistics.median(times) * 1e3, hits, rss_mb(proc.pid),
                             info.get("cluster_peer_connection_waits", "-"), info.get("cluster_pool_read_batches", "-")))
                print(f"{label:>20}: MGET of {n} keys {rows[-1][1]:8.1f} ms (median of {args.rounds}), {hits} found, "
                      f"RSS {rows[-1][3]:.0f} MiB, peer-pool waits {rows[-1][4]}, PEERMGET batches {rows[-1][5]}",
                      flush=True)
        finally:
            for q in (*nodes, alone):
                stop_process(q.proc)
            stop_process(rproc)
    if args.plot:
        plot(args.plot, rows, n)


def plot(path: str, rows: list[tuple], keys: int) -> None:
    by = {r[0]: r for r in rows}
    cats = ["missing", "held"]
    series = {"3 nodes": [by["missing, 3 nodes"][1], by["held on a, 3 nodes"][1]],
              "1 node": [by["missing, 1 node"][1], by["held, 1 node"][1]],
              "redis-server": [by["missing, redis"][1], by["held, redis"][1]]}
    panels = [Panel(f"MGET of {keys} keys", cats, series, "ms (median)",
                    [ratio(series["3 nodes"][i], series["redis-server"][i]) for i in range(2)])]
    save(path, panels, "MGET across the pool (3 nodes) against one node and redis-server",
         "held: written on node a, read on node c (every value from the pool); one machine, two shared cores")


if __name__ == "__main__":
    main()
