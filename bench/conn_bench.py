"""Idle connections: memory per connection, quilld against redis-server in one run.

Opens N idle connections (default 5,000) to each server in turn, each having
sent one PING, and prints the RSS growth per connection and the ratio; then
checks both still answer. The figure issue 11 asks for ("the 5,000-connection
idle test (RSS per connection)").

    python bench/conn_bench.py [--connections 5000] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from plot import Panel, add_flag, ratio, save
from vs_redis import ROOT, free_port, rss_bytes, wait_port  # vs_redis puts tests/procs.py on the path


def open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"PING\r\n")
        socks.append(s)
        if i % 500 == 499:  # read the replies in batches, so no reply is left unread
            for t in socks[i - 499:i + 1]:
                assert t.recv(16) == b"+PONG\r\n"
    for t in socks[len(socks) - len(socks) % 500:]:
        assert t.recv(16) == b"+PONG\r\n"
    return socks


def per_connection(pid: int, port: int, n: int) -> float:
    time.sleep(0.5)
    before = rss_bytes(pid)
    socks = open_idle(port, n)
    time.sleep(1.0)  # let the server settle
    after = rss_bytes(pid)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # still serving
        s.sendall(b"PING\r\n")
        assert s.recv(16) == b"+PONG\r\n"
    for s in socks:
        s.close()
    return (after - before) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=5000)
    add_flag(ap)
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found: apt-get install redis-server")
    tmp = tempfile.mkdtemp(prefix="quilld-conn-")
    rport, qport = free_port(), free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", tmp, "--maxclients", str(args.connections + 100)],
                                  stdout=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    quilld_proc = subprocess.Popen([sys.executable, "-m", "quilld", "--port", str(qport), "--admin-port", "0",
                                    "--dram", "64MiB", "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_port(rport, redis_proc)
        wait_port(qport, quilld_proc)
        r = per_connection(redis_proc.pid, rport, args.connections)
        q = per_connection(quilld_proc.pid, qport, args.connections)
        print(f"{args.connections} idle connections, RSS growth per connection: "
              f"redis-server {r:,.0f} B, quilld {q:,.0f} B ({q / max(r, 1):.2f}x)")
        if args.plot:
            save(args.plot, [Panel(f"{args.connections:,} idle connections", ["RSS growth per connection"],
                                   {"redis-server": [r], "quilld": [q]}, "bytes", [ratio(q, r)])],
                 "Idle connections: memory, quilld vs redis-server (bench/conn_bench.py)",
                 "each connection sent one PING; RSS sampled 1 s after the last one opened")
    finally:
        for p in (redis_proc, quilld_proc):
            p.terminate()
        for p in (redis_proc, quilld_proc):
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
