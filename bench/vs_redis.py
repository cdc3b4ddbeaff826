"""quilld against redis-server, side by side in one run, printed as ratios.

Starts redis-server and quilld on free loopback ports, then for each workload
runs redis-benchmark against both, alternating, `--rounds` times, and prints
the median requests/s of each and the ratio quilld/redis. Also measures
resident memory per small key (100k keys) in both servers.

    python bench/vs_redis.py                 # full table (a few minutes)
    python bench/vs_redis.py --quick         # fewer requests, one round
    python bench/vs_redis.py --plot docs/img/vs_redis.png   # also the figure (the `bench` extra)
    python bench/vs_redis.py --pure --small  # issue 22's line: SET/GET -n 200000 -c 50, and -P 16

`--pure` also starts a quilld running the plain Python build (QUILLD_PURE_PYTHON=1) beside the
one this tree runs (compiled, after `pip install -e .`), and gives both ratios. Beside the
requests/s, each server's CPU time per request (user + system, from /proc, in microseconds) is
printed: on a shared machine it is steadier than a rate.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plot import Panel, add_flag, ratio, save

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from procs import free_port, wait_port  # noqa: E402


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(port: int, test: str, n: int, clients: int, pipeline: int, size: int,
          pid: int | None = None) -> float | tuple[float, float]:
    """requests/s; with `pid`, (requests/s, that process's CPU microseconds per request)."""
    cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", test, "-n", str(n), "-c", str(clients),
           "-P", str(pipeline), "-d", str(size), "-q", "--csv"]
    before = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    m = re.search(r'"%s","([\d.]+)"' % test.upper(), out)
    if not m:
        raise RuntimeError(f"redis-benchmark printed no figure for {test}: {out!r}")
    if pid:
        return float(m.group(1)), (cpu_seconds(pid) - before) * 1e6 / n
    return float(m.group(1))


def fill_small_keys(port: int, count: int) -> None:
    import redis

    r = redis.Redis(port=port, protocol=2)
    pipe = r.pipeline(transaction=False)
    for i in range(count):
        pipe.set(f"key:{i:012d}", b"x" * 64)
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def plot(path: str, rows: list[tuple[str, float, float]], rounds: int, redis_key: float, quilld_key: float) -> None:
    """rows: (workload, redis req/s, quilld req/s); small values and large values in two panels."""
    small = [r for r in rows if "MiB" not in r[0]]
    large = [r for r in rows if "MiB" in r[0]]
    panels = [Panel(title, [r[0] for r in part], {"redis-server": [r[1] for r in part],
                                                   "quilld": [r[2] for r in part]},
                    "requests/s (median)", [ratio(r[2], r[1]) for r in part])
              for title, part in (("small values (3 B)", small), ("large values", large)) if part]
    save(path, panels, "quilld vs redis-server 7 (redis-benchmark, loopback): quilld/redis over each pair",
         f"{os.cpu_count()} cores shared with other work (noisy), medians of {rounds} alternating round(s); "
         f"RSS per resident 64-byte key: redis {redis_key:.0f} B, quilld {quilld_key:.0f} B")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per workload (median taken)")
    ap.add_argument("--quick", action="store_true", help="one round, fewer requests")
    ap.add_argument("--dram", default="4GiB", help="quilld arena size")
    ap.add_argument("--pure", action="store_true",
                    help="also a quilld running the plain Python build (QUILLD_PURE_PYTHON=1), side by side")
    ap.add_argument("--small", action="store_true",
                    help="only SET/GET of small values, 200,000 requests each, with and without -P 16")
    add_flag(ap)
    args = ap.parse_args()
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: apt-get install redis-server redis-tools")
    rounds = 1 if args.quick else args.rounds
    scale = 0.2 if args.quick else 1.0

    tmp = tempfile.mkdtemp(prefix="quilld-bench-")
    rport, qport = free_port(), free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("QUILLD_PURE_PYTHON", None)

    def start(port: int, **extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "quilld", "--port", str(port), "--admin-port", "0",
                                 "--dram", args.dram, "--log-level", "warning"], env=dict(env, **extra),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    quilld_proc = start(qport)
    pport = free_port() if args.pure else 0
    pure_proc = start(pport, QUILLD_PURE_PYTHON="1") if args.pure else None
    try:
        wait_port(rport, redis_proc)
        wait_port(qport, quilld_proc)
        if pure_proc is not None:
            wait_port(pport, pure_proc)
        if args.pure or args.small:
            return compare_builds(args, rport, redis_proc, qport, quilld_proc, pport, pure_proc)
        workloads = [
            # (label, test, requests, clients, pipeline, value size)
            ("SET -c 50", "set", 100_000, 50, 1, 3),
            ("GET -c 50", "get", 100_000, 50, 1, 3),
            ("SET -c 50 -P 16", "set", 1_000_000, 50, 16, 3),
            ("GET -c 50 -P 16", "get", 1_000_000, 50, 16, 3),
            ("SET 1 MiB -c 50", "set", 2_000, 50, 1, 1 << 20),
            ("GET 1 MiB -c 50", "get", 2_000, 50, 1, 1 << 20),
            ("SET 4 MiB -c 50", "set", 500, 50, 1, 4 << 20),
            ("GET 4 MiB -c 50", "get", 500, 50, 1, 4 << 20),
        ]
        print(f"quilld vs redis-server {subprocess.run(['redis-server', '--version'], capture_output=True, text=True).stdout.split()[2]}"
              f", {rounds} alternating round(s), medians; {os.cpu_count()} cores, loopback\n")
        print("| workload | redis req/s | quilld req/s | quilld/redis |")
        print("|---|---:|---:|---:|")
        rows = []
        for label, test, n, clients, pipeline, size in workloads:
            n = max(int(n * scale), 100)
            theirs, ours = [], []
            for _ in range(rounds):
                theirs.append(bench(rport, test, n, clients, pipeline, size))
                ours.append(bench(qport, test, n, clients, pipeline, size))
            t, o = statistics.median(theirs), statistics.median(ours)
            print(f"| {label} | {t:,.0f} | {o:,.0f} | {o / t:.2f}x |", flush=True)
            rows.append((label, t, o))

        # Memory per resident small key: fresh servers would be cleaner; FLUSHALL then measure growth.
        count = int(100_000 * (0.2 if args.quick else 1.0))
        import redis

        for port in (rport, qport):
            redis.Redis(port=port).flushall()
        time.sleep(0.5)
        before = {p.pid: rss_bytes(p.pid) for p in (redis_proc, quilld_proc)}
        for port in (rport, qport):
            fill_small_keys(port, count)
        time.sleep(0.5)
        per = {p.pid: (rss_bytes(p.pid) - before[p.pid]) / count for p in (redis_proc, quilld_proc)}
        print(f"\nRSS growth per resident key ({count:,} keys of 64 B): redis {per[redis_proc.pid]:.0f} B, "
              f"quilld {per[quilld_proc.pid]:.0f} B ({per[quilld_proc.pid] / max(per[redis_proc.pid], 1):.2f}x)")
        if args.plot:
            plot(args.plot, rows, rounds, per[redis_proc.pid], per[quilld_proc.pid])
    finally:
        procs = [p for p in (redis_proc, quilld_proc, pure_proc) if p is not None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def build_of(port: int) -> str:
    import redis

    return str(redis.Redis(port=port).info("server").get("quilld_build", "?"))


def compare_builds(args, rport: int, redis_proc, qport: int, quilld_proc, pport: int, pure_proc) -> int:
    """The small-value workloads against redis-server, this tree's quilld and (--pure) the plain
    Python one, alternating, `--rounds` times: medians of requests/s and of CPU us/request."""
    rounds = 1 if args.quick else args.rounds
    n = 40_000 if args.quick else 200_000
    servers = [("redis", rport, redis_proc), (f"quilld {build_of(qport)}", qport, quilld_proc)]
    if pure_proc is not None:
        servers.append((f"quilld {build_of(pport)}", pport, pure_proc))
    load = os.getloadavg()
    print(f"redis-benchmark -n {n} -c 50 -d 3, {rounds} alternating round(s), medians; {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start\n")
    head = " | ".join(f"{name} req/s | {name} us/req" for name, _, _ in servers)
    print(f"| workload | {head} | " + " | ".join(f"{name}/redis" for name, _, _ in servers[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(servers) + len(servers) - 1))
    for label, test, pipeline in (("SET", "set", 1), ("GET", "get", 1), ("SET -P 16", "set", 16),
                                  ("GET -P 16", "get", 16)):
        got: list[list[tuple[float, float]]] = [[] for _ in servers]
        for _ in range(rounds):
            for i, (_, port, proc) in enumerate(servers):
                got[i].append(bench(port, test, n, 50, pipeline, 3, proc.pid))  # type: ignore[arg-type]
        rates = [statistics.median(r for r, _ in g) for g in got]
        cpus = [statistics.median(c for _, c in g) for g in got]
        cells = " | ".join(f"{r:,.0f} | {c:.2f}" for r, c in zip(rates, cpus))
        ratios = " | ".join(f"{r / rates[0]:.2f}x" for r in rates[1:])
        print(f"| {label} -c 50 | {cells} | {ratios} |", flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
