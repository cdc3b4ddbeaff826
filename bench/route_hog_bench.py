"""Another client's PING latency while one client sends a huge ROUTE (issue 19.7).

Starts its own quilld (engines configured, nothing else running on it), then for each
request below: a pinger on its own connection sends PING after PING (one in flight at a
time) while a second connection sends the request and waits for its answer; prints the
request's own time and the PINGs' p50 / p99 / max round trip meanwhile.

- `32 MiB JSON`: `ROUTE {"blocks": [...]}` of 32 MiB of hex hashes, far over every limit
  (the issue's request: it used to be read whole, decoded and walked before "at most 65536
  blocks").
- `2 MiB tokens`: the largest JSON ROUTE takes, token ids (decoded, checked and hashed).
- `65536 hashes`: `ROUTE {"blocks": [...]}` of MAX_BLOCKS decimal hashes.

    python bench/route_hog_bench.py --rounds 3
    python bench/route_hog_bench.py --rounds 5 --baseline /work/main   # and a quilld of another tree, interleaved
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from plot import Panel, add_flag, save  # noqa: E402
from procs import start_quilld  # noqa: E402

ENGINES = "".join(f'[[engines]]\nid = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodel = "m"\n\n' for i in range(4))


def command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


def read_reply(s: socket.socket) -> bytes:
    """One reply's first line and, for a bulk or an error, enough to tell what it was."""
    buf = b""
    while b"\r\n" not in buf:
        chunk = s.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def requests(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    hog = json.dumps({"blocks": ["%016x" % rng.randrange(1 << 64) for _ in range(1_800_000)]}).encode()[:32 << 20]
    hog = hog[:hog.rfind(b",")] + b"]}"  # 32 MiB less a few bytes
    tokens = []
    size = 12
    while size < (2 << 20) - 16:
        t = rng.randrange(1 << 32)
        tokens.append(t)
        size += len(str(t)) + 2
    return {
        "32 MiB JSON": hog,
        "2 MiB tokens": json.dumps({"tokens": tokens}).encode(),
        "65536 hashes": json.dumps({"blocks": [rng.randrange(1 << 63) for _ in range(1 << 16)]}).encode(),
    }


def measure(port: int, body: bytes) -> tuple[float, list[float], bytes]:
    stop = threading.Event()
    rtts: list[float] = []

    def pinger() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            while not stop.is_set():
                t = time.perf_counter()
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                read_reply(s)
                rtts.append(time.perf_counter() - t)

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(command(b"SCOPE", b"m", b""))
        read_reply(s)
        thread = threading.Thread(target=pinger)
        thread.start()
        while not rtts:
            time.sleep(0.001)
        t = time.perf_counter()
        try:
            s.sendall(command(b"ROUTE", body))
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_reply(s)
        took = time.perf_counter() - t
        stop.set()
        thread.join(30)
    return took, rtts, reply[:80]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", metavar="DIR", help="also run the quilld of this source tree, round by round")
    add_flag(ap)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="quilld-route-hog-"))
    conf = tmp / "engines.toml"
    conf.write_text(ENGINES)
    trees = {"this tree": ROOT}
    if args.baseline:
        trees = {"baseline": Path(args.baseline).resolve(), **trees}
    nodes = {name: start_quilld(tmp, "--config", str(conf), "--log-level", "warning", admin=False, tree=tree)
             for name, tree in trees.items()}
    try:
        bodies = requests(1)
        results: dict = {}
        for _ in range(args.rounds):  # each round measures every node in turn: both see the same load
            for body_name, body in bodies.items():
                for node_name, q in nodes.items():
                    results.setdefault((body_name, node_name), []).append(measure(q.port, body))
        med = statistics.median
        worst_by: dict[str, list[float]] = {}
        print(f"{'request':<14} {'node':<10} {'its time':>9} {'PINGs':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
              f"  reply")
        for (body_name, node_name), runs in results.items():
            stats = []
            for took, rtts, _ in runs:
                rtts.sort()
                stats.append((took, len(rtts), rtts[len(rtts) // 2] * 1e3,
                              rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] * 1e3, rtts[-1] * 1e3))
            took, n, p50, p99, worst = (med(col) for col in zip(*stats))
            worst_by.setdefault(node_name, []).append(worst)
            first = runs[-1][2].split(b"\r\n")[0][:50].decode(errors="replace")
            print(f"{body_name:<14} {node_name:<10} {took:>8.2f}s {int(n):>6} {p50:>8.2f} {p99:>8.2f} {worst:>8.1f}"
                  f"  {first}")
        if args.plot:
            panel = Panel("another client's slowest PING while the request arrives (median of rounds)",
                          list(bodies), worst_by, "ms (log)", logy=True)
            save(args.plot, [panel], "A huge ROUTE and everyone else (bench/route_hog_bench.py)",
                 f"{args.rounds} rounds, each node in turn; a shared 2-core machine: compare bars, not runs")
    finally:
        for q in nodes.values():
            q.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
