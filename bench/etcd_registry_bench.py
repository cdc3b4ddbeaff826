"""The etcd registry at scale: N members (the real `EtcdRegistry`, many to this process) on one
real etcd (Debian's etcd-server, started here on 127.0.0.1).

Each member keeps its own lease and key and watches the others, as a quilld node does; members
are spread over --workers processes (each an event loop, as each node has its own) and share a
gRPC client per CLIENT_SHARE members, so that a thousand fit on this machine.
Measured from the fault to each live member's view:

- start: N members registered in a rolling start (waves of START_WAVE, each in every earlier
  member's view before the next starts), until every one's view lists all N (wall clock);
- a 5 % crash: that many members stop renewing their leases at once (as kill -9 leaves them);
  from then until every live member lists every one of them dead;
- a 10 % join: that many new members start at once; until every earlier member lists them alive;

with p50 and max over the members, and etcd's CPU (utime + stime from /proc) and resident memory
while the N leases are kept for HOLD_S. The lease TTL is the registry's default (5 s) unless
--ttl says otherwise: a crash cannot reach a view sooner than the TTL.

    python bench/etcd_registry_bench.py [--members 100 1000] [--ttl 5] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from etcd_cluster import EtcdCluster  # noqa: E402
from plot import Panel, add_flag, save  # noqa: E402

from quilld.cluster import etcd_registry  # noqa: E402
from quilld.cluster.etcd_registry import EtcdRegistry  # noqa: E402
from quilld.cluster.wire import State  # noqa: E402

CLIENT_SHARE = 25  # members per gRPC client
START_WAVE = 100  # members started at once (each wave registered and synced before the next)
HOLD_S = 10.0  # etcd's CPU and memory are read over this long with every lease kept
LIMIT_S = 120.0


@dataclass
class Cfg:
    etcd_endpoints: str
    etcd_prefix: str
    etcd_lease_ttl_s: int
    etcd_user: str = ""
    etcd_password: str = ""


class Shared:
    """An aetcd client several members use; closing is the bench's, not a member's."""

    def __init__(self, client) -> None:
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Views:
    """Each member's view, kept from its events (no scan of every view: that is N x N a look), and
    the moment each member's view first holds what the current phase waits for."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, State]] = {}  # member -> node -> state, as its events said
        self.want: dict[str, State] = {}
        self.missing: dict[str, int] = {}  # member -> how many of `want` its view lacks still
        self.done: dict[str, float] = {}
        self.t0 = 0.0

    def on_event(self, member: str):
        def seen(event) -> None:
            view = self.state.setdefault(member, {})
            node, old = event.member.node_id, view.get(event.member.node_id)
            view[node] = event.member.state
            if member in self.missing and node in self.want:
                was, now = old == self.want[node], event.member.state == self.want[node]
                if was != now:
                    self.missing[member] += -1 if now else 1
                    self.check(member)
        return seen

    def check(self, member: str) -> None:
        if self.missing.get(member) == 0 and member not in self.done:
            self.done[member] = time.monotonic() - self.t0

    def phase(self, want: dict[str, State], among: list[str]) -> None:
        self.want, self.done, self.t0 = want, {}, time.monotonic()
        self.missing = {m: sum(1 for k, st in want.items() if k != m and self.state.get(m, {}).get(k) != st)
                        for m in among}
        for m in among:
            self.check(m)

    async def wait(self) -> list[float]:
        while len(self.done) < len(self.missing):
            if time.monotonic() - self.t0 > LIMIT_S:
                raise TimeoutError(f"{len(self.missing) - len(self.done)} of {len(self.missing)} members never "
                                   "converged")
            await asyncio.sleep(0.02)
        return sorted(self.done.values())


class Worker:
    """One process's share of the members (`--worker`): commands on stdin, one JSON line each,
    answers on stdout. A member's meta is static here (only its registration writes)."""

    def __init__(self, endpoint: str, prefix: str, ttl: int) -> None:
        self.host, port = endpoint.rsplit(":", 1)
        self.port, self.prefix, self.ttl = int(port), prefix, ttl
        self.members: dict[str, EtcdRegistry] = {}
        self.clients: list = []
        self.views = Views()

    async def make(self, names: list[str]) -> None:
        import aetcd
        for i in range(0, len(names), CLIENT_SHARE):
            client = aetcd.Client(host=self.host, port=self.port, timeout=10)
            await client.connect()
            self.clients.append(client)
            shared = Shared(client)
            for name in names[i:i + CLIENT_SHARE]:
                self.members[name] = EtcdRegistry(
                    name, {"resp": ["127.0.0.1", 1], "dram_capacity": 1 << 30},
                    Cfg(f"http://{self.host}:{self.port}", self.prefix, self.ttl), self.views.on_event(name),
                    client_factory=lambda shared=shared, **kw: shared)
        await asyncio.gather(*(self.members[m].start() for m in names))

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            reply: dict = {"ok": True}
            if cmd["cmd"] == "phase":
                among = [m for m in cmd["among"] if m in self.members]
                self.views.phase({k: State(v) for k, v in cmd["want"].items()}, among)
            elif cmd["cmd"] == "make":
                await self.make([m for m in cmd["names"] if hash_share(m, cmd["workers"]) == cmd["me"]])
            elif cmd["cmd"] == "crash":
                for m in cmd["names"]:
                    if m in self.members:
                        await self.members[m].stop(leave=False)  # no renewals from now: its lease runs out
            elif cmd["cmd"] == "wait":
                reply["done"] = await self.views.wait()
            elif cmd["cmd"] == "stop":
                await asyncio.gather(*(m.stop(leave=True) for m in self.members.values()))
                for c in self.clients:
                    await c.close()
                reply["errors"] = sum(m.stats["registry_errors"] for m in self.members.values())
                reply["reregistered"] = sum(max(0, m.stats["registry_registrations"] - 1)
                                            for m in self.members.values())
            print(json.dumps(reply), flush=True)
            if cmd["cmd"] == "stop":
                return


def hash_share(name: str, workers: int) -> int:
    return int(name[1:]) % workers


class Coordinator:
    """Starts the workers and runs each phase across all of them."""

    def __init__(self, endpoint: str, prefix: str, ttl: int, workers: int) -> None:
        self.workers = workers
        self.procs = [subprocess.Popen([sys.executable, __file__, "--worker", endpoint, prefix, str(ttl)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(workers)]

    def all(self, cmd: dict, **per) -> list[dict]:
        for i, p in enumerate(self.procs):
            p.stdin.write(json.dumps(cmd | {"me": i, "workers": self.workers}) + "\n")
            p.stdin.flush()
        out = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a worker died (its error is above)")
            out.append(json.loads(line))
        return out

    def phase(self, want: dict[str, str], among: list[str], then: dict) -> list[float]:
        self.all({"cmd": "phase", "want": want, "among": among})
        self.all(then)
        return sorted(t for r in self.all({"cmd": "wait"}) for t in r["done"])


def run(n: int, etcd: EtcdCluster, ttl: int, workers: int, rng: random.Random) -> dict:
    endpoint = f"127.0.0.1:{etcd.client_ports[etcd.names[0]]}"
    co = Coordinator(endpoint, f"/bench-{os.urandom(3).hex()}", ttl, workers)
    try:
        first = [f"m{i:05d}" for i in range(n)]
        t0 = time.monotonic()
        for i in range(0, n, START_WAVE):  # a rolling start: each wave in every view before the next
            wave = first[i:i + START_WAVE]
            co.phase({m: "alive" for m in wave}, first[:i], {"cmd": "make", "names": wave})
        co.phase({m: "alive" for m in first}, first, {"cmd": "noop"})
        started_all = time.monotonic() - t0
        pid = etcd.procs[etcd.names[0]].pid
        cpu0, w0 = proc_cpu_s(pid), time.monotonic()
        time.sleep(HOLD_S)
        etcd_cpu = (proc_cpu_s(pid) - cpu0) / (time.monotonic() - w0)
        rss = proc_rss_mib(pid)
        victims = rng.sample(first, max(1, n // 20))
        live = [m for m in first if m not in victims]
        crash = co.phase({v: "dead" for v in victims}, live, {"cmd": "crash", "names": victims})
        new = [f"j{i:05d}" for i in range(max(1, n // 10))]
        join = co.phase({m: "alive" for m in new}, live, {"cmd": "make", "names": new})  # in the earlier members' views
        stops = co.all({"cmd": "stop"})
    finally:
        for p in co.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return {"start": [started_all], "crash": crash, "join": join, "etcd_cpu": etcd_cpu, "etcd_rss_mib": rss,
            "errors": sum(r["errors"] for r in stops), "reregistered": sum(r["reregistered"] for r in stops)}


def p50_max(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} / {max(xs):6.2f} s"


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        etcd_registry.CALL_TIMEOUT_S = 15.0  # see below
        endpoint, prefix, ttl = sys.argv[2], sys.argv[3], int(sys.argv[4])
        asyncio.run(Worker(endpoint, prefix, ttl).serve())
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, nargs="*", default=[100, 1000])
    ap.add_argument("--ttl", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4, help="processes the members are spread over")
    ap.add_argument("--seed", type=int, default=1)
    add_flag(ap)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="quill-etcd-") as tmp, EtcdCluster(Path(tmp), members=1) as etcd:
        for n in args.members:
            print(f"{n} members ...", file=sys.stderr, flush=True)
            rows.append((n, run(n, etcd, args.ttl, args.workers, rng)))
    print(f"members | start: all registered and in every view | 5% crash (TTL {args.ttl} s) p50/max | "
          f"10% join p50/max | etcd CPU (cores) | etcd RSS | registry errors, leases lapsed")
    for n, r in rows:
        print(f"{n:7d} | {r['start'][0]:6.2f} s | {p50_max(r['crash'])} | {p50_max(r['join'])} | "
              f"{r['etcd_cpu']:6.3f} | {r['etcd_rss_mib']:6.0f} MiB | {r['errors']}, {r['reregistered']}")
    if args.plot:
        plot(args.plot, rows, args.ttl)


def plot(path: str, rows: list[tuple[int, dict]], ttl: int) -> None:
    """Per size: p50 and max of each phase, and etcd's CPU and memory."""
    sizes = [f"{n} members" for n, _ in rows]
    panels = [Panel(f"{phase} in every view", sizes,
                    {"p50": [statistics.median(r[phase]) for _, r in rows], "max": [max(r[phase]) for _, r in rows]},
                    "s") for phase in ("start", "crash", "join")]
    panels.append(Panel("etcd while every lease is kept", sizes,
                        {"CPU (cores x 100)": [r["etcd_cpu"] * 100 for _, r in rows],
                         "RSS (MiB)": [r["etcd_rss_mib"] for _, r in rows]}, ""))
    save(path, panels, "the etcd registry on one real etcd", f"lease TTL {ttl} s; a crash waits out the TTL")


if __name__ == "__main__":
    main()
