"""ROUTE latency, index memory, guard overhead and the unsafe share of a naive cache.

    python bench/route_bench.py             # 1M resident blocks, 16 engines, 32-block requests
    python bench/route_bench.py --quick     # 100k resident blocks
    python bench/route_bench.py --quick --plot route.png   # also the figure (the `bench` extra)

In-process: ControlPlane.route() directly. Over RESP: a real quilld holding a tenth
of the residencies (loaded with KVEVENTS); GET of a 64-byte value and ROUTE in each
request form (JSON, HASHES, PACKED, PACKED COMPACT) alternated on one redis-py
connection, on one plain socket read by hiredis (the least any client pays) and
through quillclient, each ROUTE as a ratio to the GET of the same connection.
Guard overhead: the same requests with every engine and request in one shared
identity (no guard can refuse anything) against one identity per tenant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quilld.config import Config, EngineConfig  # noqa: E402
from quilld.index.control import ControlPlane  # noqa: E402
from quilld.index.events import Batch, Stored  # noqa: E402
from quilld.scopes import ScopeRegistry  # noqa: E402
from quilld.model import IdentityScope  # noqa: E402
from plot import COLORS, Panel, add_flag, save  # noqa: E402

ENGINES = 16
REQUEST_BLOCKS = 32


def build(blocks: int, tenants: list[str], seed: int = 1):
    """A control plane whose engines hold `blocks` resident blocks: chains of 32, each engine
    holding a random prefix (8 to 32 blocks) of its chains, spread over tenants."""
    engines = tuple(EngineConfig(id=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", model="m",
                                 tenant=tenants[i % len(tenants)]) for i in range(ENGINES))
    control = ControlPlane(Config(engines=engines), ScopeRegistry())
    rng = random.Random(seed)
    chains = []
    c = -1
    while len(control.index) < blocks:
        c += 1
        chain = [rng.getrandbits(64) for _ in range(REQUEST_BLOCKS)]
        chains.append(chain)
        engine = f"e{c % ENGINES}"
        keep = rng.randint(8, REQUEST_BLOCKS)
        control.apply(engine, Batch(0.0, (Stored(tuple(chain[:keep]), None, (), 16, None, "GPU"),), None, None))
    return control, chains


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def time_routes(control: ControlPlane, chains, tenants, n: int, rng: random.Random) -> list[float]:
    scopes = [IdentityScope(t, "m") for t in tenants]
    tags = [control.scopes.tag(s) for s in scopes]
    out = []
    for _ in range(n):
        chain = rng.choice(chains)
        i = rng.randrange(len(scopes))
        t0 = time.perf_counter_ns()
        control.route(scopes[i], tags[i], chain)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def start_server(chains, blocks_per_engine: dict):
    """A real quilld with the 16 engines configured and `blocks_per_engine` loaded with KVEVENTS."""
    import redis

    sys.path.insert(0, str(ROOT / "tests"))
    from procs import free_port, wait_port  # noqa: E402

    port = free_port()
    conf = Path(tempfile.mkdtemp()) / "engines.toml"
    conf.write_text("".join(f'[[engines]]\nid = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodel = "m"\n\n'
                            for i in range(ENGINES)))
    proc = subprocess.Popen([sys.executable, "-m", "quilld", "--port", str(port), "--admin-port", "0",
                             "--config", str(conf), "--log-level", "warning"],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    try:
        wait_port(port, proc)
        r = redis.Redis(port=port, protocol=2)
        r.execute_command("SCOPE", "m", "")
        for engine, hashes in blocks_per_engine.items():
            for i in range(0, len(hashes), 4096):
                ev = {"events": [{"type": "block_stored", "block_hashes": hashes[i:i + 4096], "block_size": 16}]}
                r.execute_command("KVEVENTS", engine, json.dumps(ev))
        r.set("get-bench-key", b"v" * 64)
        r.close()
    except BaseException:
        proc.kill()
        raise
    return proc, port


def route_forms(chain: list[int]) -> dict[str, list]:
    """ROUTE's request forms for one chain of block hashes, as argument lists."""
    packed = struct.pack(f"<{len(chain)}Q", *chain)
    return {"ROUTE json": ["ROUTE", json.dumps({"blocks": chain})],
            "ROUTE HASHES": ["ROUTE", "HASHES", len(chain), *chain],
            "ROUTE PACKED": ["ROUTE", "PACKED", packed],
            "ROUTE PACKED COMPACT": ["ROUTE", "PACKED", packed, "COMPACT"]}


class RawConn:
    """A plain socket and hiredis's reader: what any client must pay at least, without redis-py."""

    def __init__(self, port: int) -> None:
        import hiredis
        import socket

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        self.pack = hiredis.pack_command
        self.sock.sendall(self.pack(("SCOPE", "m", "")))
        self.read()

    def read(self):
        reply = self.reader.gets()
        while reply is False:
            self.reader.feed(self.sock.recv(1 << 16))
            reply = self.reader.gets()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def call(self, packed: bytes):
        self.sock.sendall(packed)
        return self.read()


def over_resp(port: int, chains, n: int) -> dict[str, list[float]]:
    """GET and every ROUTE form, alternated on one redis-py connection and on one raw socket, in
    microseconds: each round times one GET then each ROUTE form, so drift and load hit all alike."""
    import redis

    r = redis.Redis(port=port, protocol=2)
    r.execute_command("SCOPE", "m", "")
    raw = RawConn(port)
    rng = random.Random(3)
    out: dict[str, list[float]] = {}
    clock = time.perf_counter_ns
    get_packed = raw.pack(("GET", "get-bench-key"))
    for i in range(n + n // 10):  # the first tenth warms up and is dropped
        forms = route_forms(rng.choice(chains))
        timings = []
        t0 = clock()
        r.execute_command("GET", "get-bench-key")
        timings.append(("redis-py GET", clock() - t0))
        for name, argv in forms.items():
            t0 = clock()
            r.execute_command(*argv)
            timings.append((f"redis-py {name}", clock() - t0))
        t0 = clock()
        raw.call(get_packed)
        timings.append(("raw GET", clock() - t0))
        for name, argv in forms.items():
            packed = raw.pack(tuple(argv))
            t0 = clock()
            raw.call(packed)
            timings.append((f"raw {name}", clock() - t0))
        if i >= n // 10:
            for name, ns in timings:
                out.setdefault(name, []).append(ns / 1000)
    r.close()
    raw.sock.close()
    return out


def over_quillclient(port: int, chains, n: int) -> dict[str, list[float]]:
    """get() (GETBLK), route() (ROUTE PACKED, full reply) and route(candidates=False) (COMPACT) through
    quillclient, alternated, in microseconds."""
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    sys.path.insert(0, str(ROOT / "wire"))
    from quillclient import QuillClient

    rng = random.Random(4)
    out: dict[str, list[float]] = {}
    clock = time.perf_counter_ns
    with QuillClient("127.0.0.1", port, scope=("m", "")) as c:
        for i in range(n + n // 10):
            chain = rng.choice(chains)
            timings = []
            t0 = clock()
            c.get("get-bench-key")
            timings.append(("quillclient GET", clock() - t0))  # get(): GETBLK
            t0 = clock()
            c.route(blocks=chain)
            timings.append(("quillclient route()", clock() - t0))
            t0 = clock()
            c.route(blocks=chain, candidates=False)
            timings.append(("quillclient route(candidates=False)", clock() - t0))
            if i >= n // 10:
                for name, ns in timings:
                    out.setdefault(name, []).append(ns / 1000)
    return out


def naive_unsafe_share(seed: int = 5) -> tuple[int, int, int, int]:
    """Collision workload: the same content under 4 tenants x 2 models x 2 adapters.

    Returns (naive hits, unsafe naive hits, quilld hits, quilld refusals). quilld's
    hits are same-identity by construction (the scope is part of the key)."""
    from quilld.index.residency import ResidencyIndex

    identities = [IdentityScope(t, m, "", a) for t in ("t1", "t2", "t3", "t4") for m in ("m1", "m2")
                  for a in ("", "lora-a")]
    rng = random.Random(seed)
    content = [[rng.getrandbits(64) for _ in range(8)] for _ in range(200)]
    naive: dict[int, IdentityScope] = {}  # content hash -> who stored it last
    scopes = ScopeRegistry()
    index = ResidencyIndex(scopes)
    hits = unsafe = guarded_hits = 0
    for _ in range(4000):
        who = rng.choice(identities)
        tag = scopes.tag(who)
        for h in rng.choice(content):
            owner = naive.get(h)
            if owner is not None:
                hits += 1
                unsafe += owner != who
            if index.masks(tag, [h])[0]:
                guarded_hits += 1
            else:
                other = index.held_elsewhere(tag, h)
                if other is not None:
                    scopes.refused(tag, other)
            naive[h] = who
            index.put(tag, h, "e0", "hbm")
    return hits, unsafe, guarded_hits, scopes.total_refusals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the RESP comparison (medians of rounds)")
    add_flag(ap)
    args = ap.parse_args()
    blocks = 100_000 if args.quick else 1_000_000
    n = 2_000 if args.quick else 10_000

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    control, chains = build(blocks, ["default"])
    resident = len(control.index)
    per_block = (tracemalloc.get_traced_memory()[0] - base) / max(resident, 1)
    tracemalloc.stop()
    print(f"{resident:,} resident blocks on {ENGINES} engines; {per_block:.0f} B per block for the index and "
          f"the benchmark's own chains (tests/unit/test_residency.py measures the index alone)")

    rng = random.Random(2)
    lat = time_routes(control, chains, ["default"], n, rng)
    figures = [("in-process", statistics.median(lat), percentile(lat, 99))]
    print(f"ROUTE in-process, {REQUEST_BLOCKS} blocks x {ENGINES} engines: p50 {statistics.median(lat):.1f} us, "
          f"p99 {percentile(lat, 99):.1f} us (target p50 <= 50 us)")

    # guard overhead on a mostly-same-identity workload: 95% of requests come from the engines'
    # tenant, 5% from others. Guard on: each request in its own identity. Guard off: every
    # request looked up in the engines' identity, as an identity-blind cache would.
    mix = ["default"] * 19 + ["other"]
    scopes = {t: IdentityScope(t, "m") for t in set(mix)}
    tags = {t: control.scopes.tag(sc) for t, sc in scopes.items()}

    def run(guard: bool) -> list[int]:
        rng, out = random.Random(4), []
        for _ in range(n):
            chain, who = rng.choice(chains), rng.choice(mix)
            who = who if guard else "default"
            t0 = time.perf_counter_ns()
            control.route(scopes[who], tags[who], chain)
            out.append(time.perf_counter_ns() - t0)
        return out

    run(True)  # warm-up: caches and the hot-prefix sketch's top set
    on, off = run(True), run(False)  # two passes each, in both orders, against drift
    off += run(False)
    on += run(True)
    a, b = statistics.median(off) / 1000, statistics.median(on) / 1000
    figures += [("in-process,\nguard off", a, percentile(off, 99) / 1000),
                ("in-process,\nguard on", b, percentile(on, 99) / 1000)]
    print(f"guard overhead, 95% same identity: off {a:.1f} us, on {b:.1f} us per ROUTE ({(b / a - 1) * 100:+.1f}%, "
          f"target <= 2%)")

    hits, unsafe, guarded, refused = naive_unsafe_share()
    print(f"collision workload: a naive content-hash cache hits {hits:,} times, {unsafe:,} of them across "
          f"identities ({unsafe / max(hits, 1) * 100:.1f}% unsafe); quilld hits {guarded:,} times, all within "
          f"their identity, and refuses {refused:,} cross-identity matches")

    per_engine: dict[str, list[int]] = {}
    served = chains[: max(1, (blocks // 10) // REQUEST_BLOCKS)]
    for c, chain in enumerate(served):
        per_engine.setdefault(f"e{c % ENGINES}", []).extend(chain)
    proc, port = start_server(served, per_engine)
    try:
        rounds = [over_resp(port, served, min(n, 3000) // args.rounds) |
                  over_quillclient(port, served, min(n, 3000) // args.rounds) for _ in range(args.rounds)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    load = os.getloadavg()[0]
    print(f"over RESP, {len(served) * REQUEST_BLOCKS:,} blocks loaded, GET of 64 B and ROUTE alternated on one "
          f"connection ({args.rounds} round(s); load average {load:.1f} on {os.cpu_count()} cores):")
    resp = {}
    for name in rounds[0]:
        meds = [statistics.median(rd[name]) for rd in rounds]
        resp[name] = (statistics.median(meds), statistics.median(percentile(rd[name], 99) for rd in rounds))
    for client in ("redis-py", "raw", "quillclient"):
        get = resp[f"{client} GET"][0]
        for name, (p50, p99) in resp.items():
            if not name.startswith(client + " "):
                continue
            ratio = "" if name.endswith(" GET") else f"  {p50 / get:.2f}x GET (target <= 2x)"
            print(f"  {name:<38} p50 {p50:7.1f} us  p99 {p99:7.1f} us{ratio}")
    if args.plot:
        plot(args.plot, figures, resp, (hits, unsafe, guarded, refused), resident)
    return 0


FORMS = (("JSON", ("ROUTE json",)), ("HASHES", ("ROUTE HASHES",)), ("PACKED", ("ROUTE PACKED", "route()")),
         ("PACKED COMPACT", ("ROUTE PACKED COMPACT", "route(candidates=False)")))


def plot(path: str, figures: list[tuple[str, float, float]], resp: dict[str, tuple[float, float]],
         collisions: tuple[int, int, int, int], resident: int) -> None:
    hits, unsafe, guarded, refused = collisions
    clients = ("redis-py", "raw", "quillclient")

    def ratio(client: str, names: tuple[str, ...]) -> float:
        for name in names:
            if f"{client} {name}" in resp:
                return resp[f"{client} {name}"][0] / resp[f"{client} GET"][0]
        return 0.0

    ratios = {form: [ratio(c, names) for c in clients] for form, names in FORMS}
    panels = [Panel(f"ROUTE in process, {REQUEST_BLOCKS} blocks x {ENGINES} engines", [f[0] for f in figures],
                    {"p50": [f[1] for f in figures], "p99": [f[2] for f in figures]}, "microseconds (log)",
                    logy=True, bar_colors=[COLORS[1], COLORS[3]]),
              Panel("over RESP: ROUTE's p50 / GET's p50, same connection (target <= 2x)",
                    ["redis-py", "plain socket\n(hiredis)", "quillclient\n(get(), route())"], ratios,
                    "x GET", bar_colors=list(COLORS[:4])),
              Panel("collision workload: hits served across identities",
                    ["naive content-hash\ncache", "quilld (scoped)"],
                    {"hits": [hits, guarded], "across identities": [unsafe, 0], "refused": [0, refused]},
                    "lookups", bar_colors=[COLORS[1], COLORS[3], COLORS[2]])]
    save(path, panels, f"The router with {resident:,} resident blocks (bench/route_bench.py)",
         f"{os.cpu_count()} cores shared with other work (noisy); in-process figures time control.route alone")


if __name__ == "__main__":
    raise SystemExit(main())
