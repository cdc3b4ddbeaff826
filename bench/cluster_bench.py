"""Cluster figures, measured side by side in one run on loopback.

0. Peer fetch by CPU: the CPU seconds (utime + stime from /proc/PID/stat) that every process of
   a fetch burns per GB moved (node A holding the blocks; node B fetching them, one key per
   PEERPULL, into its arena, CRC32C-checked, the space given back as keep_fetched is off; this
   process asking B over a plain socket), against a plain Python socket copy of the same bytes
   between two processes (a sender's `sendall` of as many distinct blocks as the holder serves,
   in turn, a receiver's `recv_into` a preallocated buffer, one request per block; each counts
   its copy loop only). On two shared cores the wall clock mostly measures the scheduler;
   the CPU does not. The wall-clock ratio is printed beside it.
1. Peer fetch: GETBLK on node B of blocks held only by node A (cluster.keep_fetched off, so
   every read crosses A -> B), against a plain Python socket copy of the same bytes
   (a thread sending, `recv_into` a preallocated buffer) and against GETBLK LOCAL on A;
   then again with both nodes busy (a `redis-benchmark` SET/GET load against each node,
   running through the whole measurement, the socket copy included).
2. Replication convergence: time from a SET on one node until LOCATE on every other node
   lists it, at 3 and 10 nodes.
3. Failure detection: time from SIGKILL of one node until every other node reports it dead.

    python bench/cluster_bench.py [--rounds 3] [--sizes 1,4] [--nodes 3,10] [--no-busy] [--plot PATH]
    python bench/cluster_bench.py --cpu-only [--rounds 5] [--mib-per-round 512] [--peer-sendfile]   # part 0 alone
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from procs import free_port, start_quilld, stop_process  # noqa: E402
from plot import COLORS, Panel, add_flag, ratio, save  # noqa: E402

MiB = 1024 * 1024
FAST = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
        "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "2000", "QUILLD_CLUSTER_KEEP_FETCHED": "false"}


def start_cluster(tmp: Path, n: int, tree: Path = ROOT, env: dict | None = None) -> list:
    nodes, gports = [], []
    for i in range(n):
        gport = free_port()
        extra = ["--node-id", f"n{i}", "--gossip-port", str(gport), "--dram", "1GiB"]
        if gports:
            extra += ["--seeds", f"127.0.0.1:{gports[0]}"]
        gports.append(gport)
        nodes.append(start_quilld(tmp, *extra, env={**FAST, **(env or {})}, admin=False, tree=tree))
    deadline = time.monotonic() + 60
    for q in nodes:
        r = redis.Redis(port=q.port)
        while r.info("cluster").get("cluster_members_alive") != n:
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not form")
            time.sleep(0.05)
    return nodes


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a process so far, every thread of it (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The plain socket copy, in two processes of their own: each prints the CPU seconds its copy loop
# took (the receiver its wall-clock seconds too), not Python's start and exit nor the sender's
# making of its payloads. The sender sends `distinct` payloads in turn: the peer fetch's holder
# serves that many distinct blocks, out of any cache when they are large; one payload sent again
# and again stays in the CPU's caches (its figure is printed too).
_SENDER = """
import os, socket, sys
n, count, distinct = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
payloads = [os.urandom(n) for _ in range(distinct)]
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
def cpu():
    f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c0 = cpu()
for i in range(count):
    conn.recv(1)
    conn.sendall(payloads[i % distinct])
c1 = cpu()
conn.close()
print(c1 - c0, flush=True)
"""
_RECEIVER = """
import os, socket, sys, time
n, count, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = memoryview(bytearray(n))
c = socket.create_connection(("127.0.0.1", port))
def cpu():
    f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c0, t0 = cpu(), time.perf_counter()
for _ in range(count):
    c.sendall(b"g")
    got = 0
    while got < n:
        got += c.recv_into(buf[got:])
wall, used = time.perf_counter() - t0, cpu() - c0
print(wall, used, flush=True)
"""


def wait_local_lookups(r: redis.Redis, timeout: float = 60.0) -> None:
    """Until a lookup on this node is answered from its own part of the directory: a bucket it
    just gained answers only with another owner's word during the directory's handoff grace
    (10 s after the view changed), which would add a round trip to every read measured."""
    deadline = time.monotonic() + timeout
    while True:
        before = r.info("cluster").get("cluster_lookups_local", 0)
        r.execute_command("LOCATE", "no-such-key")
        if r.info("cluster").get("cluster_lookups_local", 0) > before:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("lookups still cross to another owner")
        time.sleep(0.5)



def socket_copy_cpu(nbytes: int, count: int, distinct: int = 1) -> tuple[float, float]:
    """(CPU seconds of sender and receiver together in their copy loops, wall seconds of the
    copies) for `count` payloads of `nbytes` (`distinct` different ones, in turn), one request
    each, between two processes of their own."""
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(nbytes), str(count), str(distinct)],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(sender.stdout.readline())
        out = subprocess.run([sys.executable, "-c", _RECEIVER, str(nbytes), str(count), str(port)],
                             capture_output=True, text=True, timeout=600, check=True).stdout.split()
        sender_cpu = float(sender.stdout.readline())
    finally:
        stop_process(sender)
    wall, receiver_cpu = float(out[0]), float(out[1])
    return sender_cpu + receiver_cpu, wall


def fetch_cpu(tmp: Path, sizes: list[int], rounds: int, mib_per_round: int,
              tree: Path = ROOT, env: dict | None = None) -> list[tuple[int, float, float, float, float]]:
    """Per size: (MiB, socket copy CPU-s/GB, peer fetch CPU-s/GB, socket copy GB/s, peer fetch GB/s),
    medians of `rounds` rounds, each moving about `mib_per_round` MiB each way, alternating."""
    from quilld.cluster.local_secret import local_secret

    a, b = start_cluster(tmp, 2, tree, env)
    ra, rb = redis.Redis(port=a.port), redis.Redis(port=b.port, socket_timeout=60)
    rows = []
    try:
        rb.execute_command("PEERAUTH", local_secret())  # the bench asks B as a peer would: PEERPULL
        wait_local_lookups(rb)
        client = socket.create_connection(("127.0.0.1", b.port), timeout=60)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        secret = local_secret().encode()
        client.sendall(b"*2\r\n$8\r\nPEERAUTH\r\n$%d\r\n%b\r\n" % (len(secret), secret))
        if client.recv(16) != b"+OK\r\n":
            raise RuntimeError("PEERAUTH refused")
        idle_t0, idle0 = time.perf_counter(), cpu_seconds(a.proc.pid) + cpu_seconds(b.proc.pid)
        time.sleep(2.0)
        idle = (cpu_seconds(a.proc.pid) + cpu_seconds(b.proc.pid) - idle0) / (time.perf_counter() - idle_t0)
        print(f"peer fetch by CPU: every process's utime + stime (/proc/PID/stat) per GB moved; the two idle "
              f"nodes burn {idle:.3f} CPU-s/s between them (gossip every 200 ms), subtracted. The socket copy "
              f"sends the same number of distinct blocks as the holder serves (up to 64), in turn; 'one buffer' "
              f"is its CPU when it sends one payload again and again (held in the CPU's caches)")
        print(f"{'size':>6} {'socket copy':>20} {'peer fetch':>20} {'CPU ratio':>10} {'wall ratio':>11} "
              f"{'one buffer':>11}")
        print(f"{'':>6} {'CPU-s/GB   GB/s':>20} {'CPU-s/GB   GB/s':>20} {'':>22} {'CPU-s/GB':>11}")
        for mib in sizes:
            n = mib * MiB
            count = max(8, mib_per_round // mib)
            keys = [f"cpu{mib}:{i}" for i in range(min(count, 64))]
            payload = os.urandom(n)
            for k in keys:
                ra.set(k, payload)
            deadline = time.monotonic() + 30
            while not all(rb.execute_command("LOCATE", *keys)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the directory did not name every key on b")
                time.sleep(0.05)
            for k in keys[:4]:  # connections opened, CRCs of the holder's blocks computed
                assert rb.execute_command("PEERPULL", "default", "", "", "", k) == 0
            # the client asks over a plain socket, as the socket copy's receiver does (redis-py would
            # add about 50 us of its own per request here): one PEERPULL per block, pre-encoded
            pulls = [b"*6\r\n$8\r\nPEERPULL\r\n$7\r\ndefault\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n$%d\r\n%b\r\n"
                     % (len(k), k.encode()) for k in keys]
            sock_cpu, sock_wall, fetch_cpu_, fetch_wall, split, hot_cpu = [], [], [], [], [], []
            for _ in range(rounds):
                cpu, wall = socket_copy_cpu(n, count, len(keys))
                sock_cpu.append(cpu / (n * count / 1e9))
                sock_wall.append(n * count / wall / 1e9)
                hot_cpu.append(socket_copy_cpu(n, count)[0] / (n * count / 1e9))
                before = rb.info("cluster")
                c0 = [cpu_seconds(a.proc.pid), cpu_seconds(b.proc.pid), cpu_seconds()]
                t0 = time.perf_counter()
                for i in range(count):
                    client.sendall(pulls[i % len(pulls)])
                    if client.recv(64) != b":0\r\n":  # B keeps nothing (keep_fetched off): it holds 0
                        raise RuntimeError("PEERPULL failed")
                wall = time.perf_counter() - t0
                c1 = [cpu_seconds(a.proc.pid), cpu_seconds(b.proc.pid), cpu_seconds()]
                cpu = sum(c1) - sum(c0) - idle * wall
                split.append([y - x for x, y in zip(c0, c1)])
                after = rb.info("cluster")
                moved = after["cluster_peer_fetch_bytes"] - before.get("cluster_peer_fetch_bytes", 0)
                if moved != n * count:
                    raise RuntimeError(f"b fetched {moved} bytes, {n * count} expected")
                fetch_cpu_.append(cpu / (moved / 1e9))
                fetch_wall.append(moved / wall / 1e9)
            sc, fc, sw, fw = (statistics.median(x) for x in (sock_cpu, fetch_cpu_, sock_wall, fetch_wall))
            gb = n * count / 1e9
            parts = [statistics.median(x[j] for x in split) / gb for j in range(3)]
            print(f"{mib:>4}Mi {sc:>9.3f} {sw:>9.2f}  {fc:>9.3f} {fw:>9.2f}  {fc / sc:>9.2f}x {fw / sw:>10.2f}x "
                  f"{statistics.median(hot_cpu):>11.3f}   (holder {parts[0]:.3f}, fetching node {parts[1]:.3f}, client {parts[2]:.3f} CPU-s/GB)")
            rows.append((mib, sc, fc, sw, fw))
    finally:
        for q in (a, b):
            stop_process(q.proc)
    return rows


def socket_copy(nbytes: int, count: int) -> float:
    """Seconds to move `count` payloads of `nbytes` over one loopback TCP connection."""
    payload = os.urandom(nbytes)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():
        conn, _ = srv.accept()
        with conn:
            for _ in range(count):
                conn.recv(1)
                conn.sendall(payload)

    t = threading.Thread(target=serve)
    t.start()
    buf = memoryview(bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for _ in range(count):
            c.sendall(b"g")
            got = 0
            while got < nbytes:
                got += c.recv_into(buf[got:])
        dt = time.perf_counter() - t0
    t.join()
    srv.close()
    return dt


BUSY_SECONDS = 600  # a load generator outlives no measurement: it is stopped after its part, or by then


def busy_load(ports: list[int]) -> list[subprocess.Popen]:
    """A redis-benchmark against each port (SET and GET of 1 KiB values over 4 connections, random
    keys), running until stopped (bounded: 10M requests each, and BUSY_SECONDS at most)."""
    tool = shutil.which("redis-benchmark")
    if tool is None:
        raise RuntimeError("redis-benchmark is not installed (Debian's redis-tools): no busy case")
    return [subprocess.Popen(["timeout", str(BUSY_SECONDS), tool, "-p", str(port), "-c", "4", "-n", "10000000",
                              "-t", "set,get", "-d", "1024", "-r", "100000", "-q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]


def peer_fetch(tmp: Path, sizes: list[int], rounds: int,
               busy: bool = False) -> list[tuple[int, float, float, float, float]]:
    """Per size: (MiB, socket copy, GETBLK LOCAL on A, fetch hop, GETBLK via B), GB/s medians."""
    a, b = start_cluster(tmp, 2)
    rows = []
    ra, rb = redis.Redis(port=a.port), redis.Redis(port=b.port)
    load: list[subprocess.Popen] = []
    try:
        if busy:
            load = busy_load([a.port, b.port])
            print("\nboth nodes busy: a redis-benchmark (SET/GET 1 KiB, 4 connections) on each, all along")
        print("peer fetch (GB/s, median of rounds; ratio = peer fetch / socket copy)")
        print("  fetch hop = A -> B inside quilld (request to verified copy, from INFO cluster on B);")
        print("  via B = a redis-py client's GETBLK on B, which adds the B -> client hop")
        print(f"{'size':>6} {'socket copy':>12} {'GETBLK LOCAL on A':>18} {'fetch hop':>10} {'ratio':>6} "
              f"{'GETBLK via B':>13} {'ratio':>6}")
        for mib in sizes:
            n = mib * MiB
            count = max(8, 256 // mib)
            keys = [f"b{mib}:{i}" for i in range(count)]
            payload = os.urandom(n)
            for k in keys:
                ra.set(k, payload)
            deadline = time.monotonic() + 30  # a write is answered once its directory owners have it
            while not all(rb.execute_command("LOCATE", *keys)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the directory did not name every key on b")
                time.sleep(0.05)
            sock, local, fetch, hop = [], [], [], []
            for _ in range(rounds):
                sock.append(n * count / socket_copy(n, count) / 1e9)
                t0 = time.perf_counter()
                for k in keys:
                    ra.execute_command("GETBLK", k, "LOCAL")
                local.append(n * count / (time.perf_counter() - t0) / 1e9)
                before = rb.info("cluster")
                t0 = time.perf_counter()
                for k in keys:
                    assert len(rb.execute_command("GETBLK", k)) == n
                fetch.append(n * count / (time.perf_counter() - t0) / 1e9)
                after = rb.info("cluster")
                usec = after["cluster_peer_fetch_usec"] - before.get("cluster_peer_fetch_usec", 0)
                moved = after["cluster_peer_fetch_bytes"] - before.get("cluster_peer_fetch_bytes", 0)
                hop.append(moved / usec / 1e3)
            s, l, f, h = (statistics.median(x) for x in (sock, local, fetch, hop))
            print(f"{mib:>4}Mi {s:>12.2f} {l:>18.2f} {h:>10.2f} {h / s:>6.2f} {f:>13.2f} {f / s:>6.2f}")
            rows.append((mib, s, l, h, f))
    finally:
        for proc in load:
            stop_process(proc)
        for q in (a, b):
            stop_process(q.proc)
    return rows


def convergence_and_detection(tmp: Path, n: int, rounds: int) -> tuple[int, float, float, float]:
    """(nodes, replication p50 ms, max ms, detection s)."""
    nodes = start_cluster(tmp, n)
    clients = [redis.Redis(port=q.port) for q in nodes]
    try:
        delays = []
        for i in range(rounds * 5):
            key = f"conv:{i}"
            clients[0].set(key, b"x" * 10000)
            t0 = time.perf_counter()
            pending = set(range(1, n))
            while pending:
                for j in list(pending):
                    places = clients[j].execute_command("LOCATE", key)[0]
                    if places:
                        pending.discard(j)
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError("replication did not converge in 10 s")
            delays.append(time.perf_counter() - t0)
        victim = nodes[-1]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        t0 = time.perf_counter()
        pending = set(range(n - 1))
        while pending:
            for j in list(pending):
                if f"n{n - 1} dead" in clients[j].execute_command("NODES").decode():
                    pending.discard(j)
            if time.perf_counter() - t0 > 30:
                raise RuntimeError("failure not detected in 30 s")
            time.sleep(0.01)
        detect = time.perf_counter() - t0
        print(f"{n:>3} nodes: replication visible everywhere p50 {statistics.median(delays) * 1000:.1f} ms, "
              f"max {max(delays) * 1000:.1f} ms; SIGKILLed node dead everywhere after {detect:.2f} s "
              f"(probe interval 200 ms, suspicion_mult 4)")
    finally:
        for q in nodes:
            stop_process(q.proc)
    return n, statistics.median(delays) * 1000, max(delays) * 1000, detect


def plot(path: str, fetch: list[tuple[int, float, float, float, float]],
         clusters: list[tuple[int, float, float, float]], rounds: int, busy: int = 0) -> None:
    """`busy`: how many of the last rows of `fetch` were measured with both nodes busy."""
    sizes = [f"{mib} MiB" + (" busy" if i >= len(fetch) - busy else "") for i, (mib, *_) in enumerate(fetch)]
    panels = [Panel("peer fetch vs a socket copy (fetch hop / socket copy)", sizes,
                    {"Python socket copy": [r[1] for r in fetch], "GETBLK LOCAL on A": [r[2] for r in fetch],
                     "fetch hop A -> B": [r[3] for r in fetch], "GETBLK via B": [r[4] for r in fetch]},
                    "GB/s (median)", [ratio(r[3], r[1]) for r in fetch])]
    if clusters:
        names = [f"{n} nodes" for n, *_ in clusters]
        panels += [Panel("a SET listed by LOCATE on every node", names,
                         {"p50": [c[1] for c in clusters], "max": [c[2] for c in clusters]}, "ms",
                         bar_colors=[COLORS[1], COLORS[3]]),
                   Panel("a SIGKILLed node dead on every node (probe 200 ms)", names,
                         {"detection": [c[3] for c in clusters]}, "seconds")]
    save(path, panels, "quilld cluster on loopback (bench/cluster_bench.py)",
         f"{os.cpu_count()} cores shared by every node and other work (noisy); medians of {rounds} round(s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="1,4")
    p.add_argument("--nodes", default="3,10")
    p.add_argument("--no-busy", action="store_true", help="skip the peer fetch with both nodes busy")
    p.add_argument("--cpu-only", action="store_true", help="only the peer fetch by CPU (part 0)")
    p.add_argument("--mib-per-round", type=int, default=1024, help="MiB each side moves per round of part 0")
    p.add_argument("--peer-sendfile", action="store_true", help="part 0 with cluster.peer_sendfile on (the holder "
                   "sends blocks by sendfile from the arena's memory file)")
    p.add_argument("--tree", type=Path, default=ROOT, help="run part 0 on the quilld of this source tree (default: "
                   "this one), for old-against-new runs")
    add_flag(p)
    a = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} on "
          f"{os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sizes = [int(x) for x in a.sizes.split(",")]
        cpu = fetch_cpu(tmp, sizes, a.rounds, a.mib_per_round, a.tree.resolve(),
                        {"QUILLD_CLUSTER_PEER_SENDFILE": "true"} if a.peer_sendfile else None)
        if a.cpu_only:
            return
        fetch = peer_fetch(tmp, sizes, a.rounds)
        busy = [] if a.no_busy else peer_fetch(tmp, sizes, a.rounds, busy=True)
        clusters = [convergence_and_detection(tmp, n, a.rounds) for n in (int(x) for x in a.nodes.split(","))]
    if a.plot:
        plot(a.plot, fetch + busy, clusters, a.rounds, len(busy))


if __name__ == "__main__":
    main()
