"""KV-event ingest: events applied per second, and ROUTE latency while it runs.

    python bench/events_bench.py              # 100k events/s for 5 s at 64 a batch, then 200k a batch size
    python bench/events_bench.py --quick      # 2 s paced, 40k a batch size
    python bench/events_bench.py --sizes 1    # one batch size only
    python bench/events_bench.py --rate 0     # no paced phase
    python bench/events_bench.py --quick --plot events.png   # also the figure (the `bench` extra)
    python bench/events_bench.py --quick --rate 0 --hash-check   # ingest with and without the block hash check

A real quilld (uvloop, as deployed) follows one engine's KV events over ZMQ. The engine
is a publisher process doing on the wire what vLLM 0.33's ZmqEventPublisher does (PUB
`(topic, seq, payload)`, a replay ROUTER), with payloads encoded by msgspec from vLLM's
structs: three BlockStored (one block, 16 tokens, group 0, the previous block of one of 64
running requests as its parent) for each BlockRemoved (of a random stored block). For
1, 16 and 64 events per batch the publisher sends its events as fast as ZMQ takes them
while this process sends a ROUTE (32 blocks, redis-py, one connection) every 2 ms
(`--route-interval-ms`, 0 for back to back) and INFO router every 20th request, as a
router and a monitoring client would. quilld's CPU time per run is printed: on a shared
2-core machine it shows how much of a core quilld actually got. Reported:
events applied per second (first send to the last event counted in INFO), ROUTE p50/p99
during ingest, and ROUTE at rest on the same index. Targets (issue 12): >= 100k events/s
at 64 per batch, >= 20k/s at 1 per batch, ROUTE p99 <= 5 ms during ingest.

First, between two spells of ROUTE at rest, the publisher sends at a steady `--rate`
(100k events/s) in batches of `--paced-batch` (64) for `--seconds` (5): issue 22's figure
is ROUTE p99 there (target <= 5 ms), with how far behind the schedule quilld fell. quilld
runs under a probe (`--probed-quilld`, below), so each phase also says where its time went: GC pauses per
generation, the longest stretches the KV-event subscriber held the event loop, ROUTE's own
decision time, each reply's write to its transport, and how long quilld waited for a CPU (its
run-queue wait from /proc/PID/schedstat: the scheduler's share of the tail). With `--nodes 3`
the quilld are a cluster: the engine's home also places the residencies in the sharded
directory, and the other nodes' CPU is printed, with the home's ROUTE lookups by hops and the
entries it sent the owners. The bench first waits until the home answers ROUTE from its own
directory (a node that has just gained a bucket also asks the other owners for
`handoff_grace_s`, 10 s), so that what it measures is the settled cluster.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from plot import COLORS, Panel, add_flag, save  # noqa: E402

MODEL = "m"
REQUEST_BLOCKS = 32
WARM = [7_000_000 + i for i in range(REQUEST_BLOCKS // 2)]  # resident before ingest: ROUTE has work to do
# The engine's requests, as its events chain their blocks: this many running at once, each of
# about this many blocks (vLLM stores a request's new full block with the one before as parent).
REQUESTS, REQUEST_LENGTH = 64, 64


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ---------------------------------------------------------------- the engine (a separate process)


def engine_events(total: int, rng: random.Random, real_hashes: bool) -> list:
    """`total` events of 64 running requests: three BlockStored of one 16-token block for each
    BlockRemoved. `real_hashes`: tokens drawn at random and each block's hash the one vLLM 0.33
    computes (sha256, PYTHONHASHSEED unset: quilld/index/engine_hashes.py), its parent the
    request's previous block; else random hashes over tokens 0..15."""
    import vllm_schema as vllm
    from quilld.index.engine_hashes import EngineHashing

    hashing = EngineHashing("sha256", None, 16)
    stored: list[int] = []
    events = []
    chains: list = [None] * REQUESTS  # each running request's last block (event form, full digest)
    for i in range(total):
        if i % 4 == 3:
            events.append(vllm.removed([stored.pop(rng.randrange(len(stored)))]))
            continue
        r = rng.randrange(REQUESTS)
        parent = chains[r]
        if real_hashes:
            tokens = [rng.randrange(150_000) for _ in range(16)]
            full = hashing.block_hashes(tokens, parent=None if parent is None else parent[1])[0]
            h = full.event_form()
            events.append(vllm.BlockStored(block_hashes=[h], parent_block_hash=None if parent is None else parent[0],
                                           token_ids=tokens, block_size=16, lora_id=None, medium=vllm.MEDIUM_GPU,
                                           lora_name=None, extra_keys=[None], group_idx=0,
                                           kv_cache_spec_kind="full_attention"))
        else:
            h, full = rng.getrandbits(64), None
            events.append(vllm.gpu([h], parent=None if parent is None else parent[0]))
        stored.append(h)
        chains[r] = (h, full) if rng.random() > 1 / REQUEST_LENGTH else None  # a request ends, another starts
    return events


def check_cost(n: int = 20_000) -> str:
    """The hash check's own cost per event, in this process: every event checked (an engine's first
    CHECK_FIRST events), and as sampled after them."""
    import vllm_schema as vllm
    from quilld.index import hash_check
    from quilld.index.events import decode_payload

    events = decode_payload(vllm.encode(engine_events(n, random.Random(2), True))).events
    out = []
    for label, first in (("every event checked", n + 1), ("sampled (the steady state)", hash_check.CHECK_FIRST)):
        saved, hash_check.CHECK_FIRST = hash_check.CHECK_FIRST, first
        try:
            check = hash_check.HashCheck("bench", "sha256", "", 16)
            t0 = time.perf_counter()
            for i in range(0, n, 64):
                check.events(events[i:i + 64])
            took = time.perf_counter() - t0
        finally:
            hash_check.CHECK_FIRST = saved
        v = check.view()
        out.append(f"{label}: {took / n * 1e6:.2f} µs per event ({v['agreed']:,} blocks agreed, {v['disagreed']} "
                   f"disagreed, {v['unverifiable']:,} unverifiable of {n:,} events)")
    return "hash check in-process, 64 events a call: " + "; ".join(out)


def publisher(pub_port: int, replay_port: int, conn, real_hashes: bool = False) -> None:
    """vLLM's publisher: encodes what it is told to send, then sends it all when told to go."""
    from collections import deque

    import vllm_schema as vllm
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # no limit: this measures quilld's ingest, not PUB drops (vLLM's hwm is 100 000)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
    lock = threading.Lock()
    seq = 0
    stop = threading.Event()

    def serve_replay() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with lock:
                held = [(s, p) for s, p in buffer if s >= first]
            for s, p in held:
                router.send_multipart((client, b"", b"kv", s.to_bytes(8, "big"), p))
            router.send_multipart((client, b"", b"", vllm.END_SEQ, b""))

    replayer = threading.Thread(target=serve_replay, daemon=True)
    replayer.start()
    rng = random.Random(1)
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        interval = 0.0
        if msg[0] == "warm":
            payloads = [vllm.encode([vllm.gpu(WARM)], ts=time.time())]
        else:
            _, total, per_batch, rate = msg
            interval = per_batch / rate if rate else 0.0
            events = engine_events(total, rng, real_hashes)
            ts = time.time()
            payloads = [vllm.encode(events[i:i + per_batch], ts=ts) for i in range(0, total, per_batch)]
            conn.send("ready")
            conn.recv()  # go
        t0 = time.perf_counter()
        late = 0.0  # how far behind its schedule the publisher itself fell (paced runs)
        for i, p in enumerate(payloads):
            if interval:
                pause = t0 + i * interval - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                else:
                    late = max(late, -pause)
            with lock:
                pub.send_multipart((b"kv", seq.to_bytes(8, "big"), p))
                buffer.append((seq, p))
                seq += 1
        conn.send((time.perf_counter() - t0, late))
    stop.set()
    replayer.join(5)
    pub.close(0)
    router.close(0)
    ctx.term()


# ---------------------------------------------------------------- quilld under the probe
# `events_bench.py --probed-quilld OUT.json [quilld flags...]` runs `quilld.cli.main` unchanged,
# with three probes around it (measurement only, no behaviour changed):
# - GC: every collection's generation and pause (`gc.callbacks`);
# - ingest's stretches on the loop: each KV-event subscriber task is stepped through a wrapper
#   that times every step, i.e. every stretch the task held the event loop between two awaits
#   (what a ROUTE arriving meanwhile waits behind), by the wall clock and by the thread's CPU
#   time (the difference: the process was off the CPU meanwhile);
# - ROUTE's own time: `ControlPlane.route`, the decision without the wire;
# - the write: each reply handed to the transport (`RespConnection._write`, ROUTE's and INFO's),
#   by the wall clock and in CPU time.
# On SIGUSR1 it writes what it gathered since the last SIGUSR1 to OUT.json (count, total, p50,
# p99, max in milliseconds) and starts again. quilld's scheduler wait is read from
# /proc/PID/schedstat by the bench itself.

clock = time.perf_counter
cpu_clock = time.thread_time
_samples: dict[str, list[float]] = {"gc0": [], "gc1": [], "gc2": [], "ingest_step": [], "ingest_step_cpu": [],
                                    "route": [], "write": [], "write_cpu": []}
_gc_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = clock()
    else:
        _samples[f"gc{info['generation']}"].append(clock() - _gc_started[0])


class _Timed:
    """Awaits a coroutine, timing each of its steps (each stretch it runs on the loop)."""

    def __init__(self, coro, out: list[float], out_cpu: list[float]) -> None:
        self.coro, self.out, self.out_cpu = coro, out, out_cpu

    def __await__(self):
        coro, out, out_cpu = self.coro, self.out, self.out_cpu
        value, error = None, None
        while True:
            t, c = clock(), cpu_clock()
            try:
                yielded = coro.throw(error) if error is not None else coro.send(value)
            except StopIteration as e:
                out.append(clock() - t)
                out_cpu.append(cpu_clock() - c)
                return e.value
            out.append(clock() - t)
            out_cpu.append(cpu_clock() - c)
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # noqa: BLE001 - handed on to the coroutine, as await would
                value, error = None, e


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    pick = lambda p: xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000  # noqa: E731
    return {"n": len(xs), "total_ms": sum(xs) * 1000, "p50_ms": pick(50), "p99_ms": pick(99), "max_ms": xs[-1] * 1000,
            "over_1ms": sum(1 for x in xs if x > 0.001), "over_5ms": sum(1 for x in xs if x > 0.005)}


def _dump(out: str) -> None:
    snap = {k: _summary(v) for k, v in _samples.items()}
    snap["gc_frozen"] = gc.get_freeze_count()
    snap["gc_threshold"] = gc.get_threshold()
    for v in _samples.values():
        v.clear()
    Path(out + ".part").write_text(json.dumps(snap))
    os.replace(out + ".part", out)


def probed_quilld(out: str, argv: list[str]) -> int:
    """quilld's own CLI (`argv`), with the probes; on SIGUSR1 what they gathered goes to `out`."""
    sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)).split(os.pathsep)[0])  # the tree under test
    from quilld.index import control, subscriber
    from quilld.protocol import server

    run = subscriber.KvEventSubscriber._run

    async def timed_run(self):
        return await _Timed(run(self), _samples["ingest_step"], _samples["ingest_step_cpu"])

    subscriber.KvEventSubscriber._run = timed_run
    route = control.ControlPlane.route

    def timed_route(self, *a, **kw):
        t = clock()
        try:
            return route(self, *a, **kw)
        finally:
            _samples["route"].append(clock() - t)

    control.ControlPlane.route = timed_route
    write = server.RespConnection._write

    def timed_write(self, *a):
        t, c = clock(), cpu_clock()
        try:
            return write(self, *a)
        finally:
            _samples["write"].append(clock() - t)
            _samples["write_cpu"].append(cpu_clock() - c)

    server.RespConnection._write = timed_write
    gc.callbacks.append(_on_gc)
    signal.signal(signal.SIGUSR1, lambda *_: _dump(out))
    from quilld.cli import main as quilld_main
    return quilld_main(argv)


# ---------------------------------------------------------------- quilld and its clients


CLUSTER_ENV = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80"}


def start_quilld(pub_port: int, replay_port: int, probe_out: Path, tree: Path = ROOT, extra: tuple = (),
                 env: dict | None = None, checked: tuple[int, int] | None = None):
    """One quilld under the probe, following the engine (in a cluster, if it becomes its home)."""
    import redis
    from procs import free_port, wait_port

    port = free_port()
    conf = Path(tempfile.mkdtemp()) / "events.toml"
    engines = [("vllm-0", pub_port, replay_port, "")]
    if checked is not None:  # --hash-check: a second engine, its block hashes checked (vLLM's default sha256)
        engines.append(("vllm-1", *checked, 'prefix_caching_hash_algo = "sha256"\n'))
    conf.write_text("".join(f'[[engines]]\nid = "{e}"\nurl = "http://127.0.0.1:9"\nmodel = "{MODEL}"\n'
                            f'kv_events = "tcp://127.0.0.1:{pub}"\nreplay = "tcp://127.0.0.1:{rep}"\n{more}'
                            for e, pub, rep, more in engines))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--probed-quilld", str(probe_out),
                             "--port", str(port), "--admin-port", "0",
                             "--config", str(conf), "--log-level", "warning", *extra],
                            env=dict(os.environ, PYTHONPATH=str(tree), **(env or {})), stdout=subprocess.DEVNULL)
    wait_port(port, proc)
    r = redis.Redis(port=port, protocol=2)
    r.execute_command("SCOPE", MODEL, "")
    return proc, r, redis.Redis(port=port, protocol=2)


def start_nodes(n: int, pub_port: int, replay_port: int, tree: Path,
                checked: tuple[int, int] | None = None) -> list[tuple]:
    """`n` quilld (a cluster when n > 1, every node configured with the engine), each
    (proc, ROUTE client, INFO client, probe file); the engine's home first."""
    from procs import free_port

    nodes, seeds = [], []
    for i in range(n):
        out = Path(tempfile.mkdtemp()) / "probe.json"
        extra: tuple = ()
        if n > 1:
            gport = free_port()
            extra = ("--node-id", f"n{i}", "--gossip-port", str(gport), *(("--seeds", seeds[0]) if seeds else ()))
            seeds.append(f"127.0.0.1:{gport}")
        nodes.append((*start_quilld(pub_port, replay_port, out, tree, extra, CLUSTER_ENV if n > 1 else None,
                                    checked), out))
    if n == 1:
        return nodes
    deadline = time.monotonic() + 60
    while True:
        homes = [node for node in nodes if node[2].info("cluster").get("cluster_members_alive") == n
                 and node[2].info("cluster").get("cluster_engines_homed") == 1]
        if len(homes) == 1 and all(node[2].info("cluster").get("cluster_members_alive") == n for node in nodes):
            return homes + [node for node in nodes if node is not homes[0]]
        assert time.monotonic() < deadline, "the cluster did not form, or no node became the engine's home"
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def applied(info_client) -> int:
    """Events applied so far, over every engine (--hash-check follows two, one at a time)."""
    info = info_client.info("router")
    return sum(line["events"] for key, line in info.items() if key.startswith("kv_engine_"))


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of a process's main thread so far."""
    run, wait, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(run) / 1e9, int(wait) / 1e9


def probe(proc, out: Path) -> dict:
    """What the probe gathered in quilld since the last call (and start again)."""
    out.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not out.exists():  # written whole, then renamed into place
        assert time.monotonic() < deadline, "quilld's probe did not answer"
        time.sleep(0.02)
    return json.loads(out.read_text())


def route_loop(r, info_client, until, limit_s: float, interval_s: float = 0.0,
               progress: list | None = None) -> tuple[list[float], float | None]:
    """ROUTE every `interval_s` (0: back to back), INFO every 20th, until `until(events)` holds;
    returns latencies (ms) and when it held (perf_counter). `progress` gets (when, events applied)
    at each INFO."""
    req = json.dumps({"blocks": WARM + [9_000_000 + i for i in range(REQUEST_BLOCKS - len(WARM))]})
    lat: list[float] = []
    deadline = time.perf_counter() + limit_s
    i = 0
    tick = time.perf_counter()
    while time.perf_counter() < deadline:
        if interval_s:
            tick += interval_s
            pause = tick - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        t = time.perf_counter()
        r.execute_command("ROUTE", req)
        lat.append((time.perf_counter() - t) * 1000)
        i += 1
        if i % 20 == 0:
            n = applied(info_client)
            if progress is not None:
                progress.append((time.perf_counter(), n))
            if until(n):
                return lat, time.perf_counter()
    return lat, None


def where(snap: dict, cpu: float, sched: tuple[float, float], wall: float) -> str:
    """One phase's probe figures as two lines."""
    gcs = " ".join(f"gen{g} {snap[f'gc{g}']['n']}x max {snap[f'gc{g}'].get('max_ms', 0):.2f} ms"
                   for g in range(3))
    gc_total = sum(snap[f"gc{g}"].get("total_ms", 0) for g in range(3))
    step, step_cpu, route, write = snap["ingest_step"], snap["ingest_step_cpu"], snap["route"], snap["write"]
    line = (f"    quilld: {cpu:.2f} CPU-s in {wall:.2f} s, waited {sched[1]:.2f} s for a CPU; GC {gc_total:.0f} ms "
            f"({gcs})")
    if step["n"]:
        line += (f"\n    ingest held the loop {step['n']:,} times: p50 {step['p50_ms']:.3f} ms, p99 "
                 f"{step['p99_ms']:.3f} ms, max {step['max_ms']:.2f} ms, {step['total_ms'] / 1000:.2f} s in all "
                 f"({step['over_1ms']} over 1 ms, {step['over_5ms']} over 5 ms); in CPU time p99 "
                 f"{step_cpu['p99_ms']:.3f} ms, max {step_cpu['max_ms']:.2f} ms ({step_cpu['over_1ms']} over 1 ms)")
    if route["n"]:
        line += (f"\n    ROUTE's decision in quilld: p50 {route['p50_ms']:.3f} ms, p99 {route['p99_ms']:.3f} ms, "
                 f"max {route['max_ms']:.2f} ms; a reply's write p50 {write['p50_ms']:.3f} ms, p99 "
                 f"{write['p99_ms']:.3f} ms, max {write['max_ms']:.2f} ms (in CPU time p99 "
                 f"{snap['write_cpu']['p99_ms']:.3f} ms)")
    return line


def summary(name: str, lat: list[float]) -> str:
    return (f"ROUTE {name}: p50 {statistics.median(lat):.3f} ms, p99 {percentile(lat, 99):.3f} ms, "
            f"max {max(lat):.1f} ms ({len(lat)} requests)")


def plot(path: str, rates: dict[int, float], latencies: list[tuple[str, float, float]], total: int) -> None:
    panels = [Panel("KV events applied (vLLM-style ZMQ publisher)", [f"{n}/batch" for n in rates],
                    {"events/s": list(rates.values())}, "events/s"),
              Panel("ROUTE latency over RESP, at rest and during ingest", [x[0] for x in latencies],
                    {"p50": [x[1] for x in latencies], "p99": [x[2] for x in latencies]}, "ms",
                    bar_colors=[COLORS[1], COLORS[3]])]
    save(path, panels, f"quilld following an engine's KV events ({total:,} events per batch size)",
         f"{os.cpu_count()} cores shared by quilld, the publisher, the client and other work (noisy)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="1,16,64", help="events per batch, comma-separated (as fast as ZMQ takes them)")
    ap.add_argument("--events", type=int, default=0, help="events per batch size (default 200k, 40k with --quick)")
    ap.add_argument("--rate", type=float, default=100_000, help="events/s of the paced phase (0: none)")
    ap.add_argument("--paced-batch", type=int, default=64, help="events per batch in the paced phase")
    ap.add_argument("--seconds", type=float, default=0, help="length of the paced phase (default 5 s, 2 with --quick)")
    ap.add_argument("--route-interval-ms", type=float, default=2.0,
                    help="one ROUTE every this many ms during ingest and at rest (0: back to back)")
    ap.add_argument("--py-spy", metavar="FILE", help="record quilld with py-spy during ingest (collapsed stacks of "
                    "the samples where it holds the GIL: its CPU in Python, and the system calls made holding it)")
    ap.add_argument("--nodes", type=int, default=1, help="quilld nodes (a cluster when > 1: the engine's home "
                    "also places its residencies in the sharded directory; the other nodes' CPU is printed too)")
    ap.add_argument("--hash-check", action="store_true", help="real vLLM block hashes over random tokens, and each "
                    "batch size run twice in the same quilld: for an engine without the block hash check and for "
                    "one with it (prefix_caching_hash_algo = sha256, index/hash_check.py); also the check's cost "
                    "per event in this process")
    ap.add_argument("--tree", type=Path, default=ROOT, help="run the quilld of this source tree (default: this one), "
                    "for old-against-new runs")
    add_flag(ap)
    args = ap.parse_args()
    total = args.events or (40_000 if args.quick else 200_000)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    interval = args.route_interval_ms / 1000
    sizes = [int(s) for s in args.sizes.split(",") if s]

    from procs import free_port, stop_process

    if args.hash_check:
        if args.nodes != 1:
            ap.error("--hash-check runs one node")
        print(check_cost())
    pub_port, replay_port = free_port(), free_port()
    here, there = mp.Pipe()
    engine = mp.Process(target=publisher, args=(pub_port, replay_port, there, args.hash_check), daemon=True)
    engine.start()
    pipes = {"vllm-0": here}
    checked = None
    if args.hash_check:  # the checked engine's own publisher, the same events
        checked = (free_port(), free_port())
        pipes["vllm-1"], there1 = mp.Pipe()
        engine1 = mp.Process(target=publisher, args=(*checked, there1, True), daemon=True)
        engine1.start()
    nodes = start_nodes(args.nodes, pub_port, replay_port, args.tree.resolve(), checked)
    proc, r, info_client, probe_out = nodes[0]
    others = [node[0] for node in nodes[1:]]
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} on {os.cpu_count()} cores"
          + (f"; {args.nodes} nodes, ROUTE asked of the engine's home" if others else ""))
    try:
        deadline = time.monotonic() + 10
        while any(info_client.info("router")[f"kv_engine_{e}"]["state"] != "live" for e in pipes):
            assert time.monotonic() < deadline, "quilld never connected to the publisher"
            time.sleep(0.05)
        here.send(("warm",))
        here.recv()
        while applied(info_client) < 1:
            time.sleep(0.01)

        counted = ("cluster_lookups_local", "cluster_lookups_one_hop", "cluster_lookups_two_hops",
                   "cluster_directory_batches_sent", "cluster_directory_placement_items")

        def others_cpu() -> tuple[list[float], dict]:
            """The other nodes' CPU so far, and the home's directory counters (in a cluster)."""
            if not others:
                return [], {}
            cluster = info_client.info("cluster")
            return [cpu_seconds(p.pid) for p in others], {k: cluster.get(k, 0) for k in counted}

        def others_line(before: tuple[list[float], dict]) -> str:
            if not others:
                return ""
            cpu, counts = others_cpu()
            used = [b - a for a, b in zip(before[0], cpu)]
            got = {k[len("cluster_"):]: counts[k] - before[1][k] for k in counted}
            return (f"\n    the other nodes: {', '.join(f'{u:.2f}' for u in used)} CPU-s; the home's ROUTE lookups "
                    f"{got['lookups_local']} local, {got['lookups_one_hop']} one hop, {got['lookups_two_hops']} two; "
                    f"it sent the owners {got['directory_placement_items']:,} entries in "
                    f"{got['directory_batches_sent']:,} batches")

        def at_rest(name: str) -> list[float]:
            probe(proc, probe_out)
            cpu0, sched0, t0, o0 = cpu_seconds(proc.pid), schedstat(proc.pid), time.perf_counter(), others_cpu()
            rest, _ = route_loop(r, info_client, lambda n: False, 2.0, interval)
            sched = tuple(b - a for a, b in zip(sched0, schedstat(proc.pid)))
            print(summary(name, rest))
            print(where(probe(proc, probe_out), cpu_seconds(proc.pid) - cpu0, sched, time.perf_counter() - t0)
                  + others_line(o0))
            return rest

        def ingest(events: int, per_batch: int, rate: float, limit_s: float, engine: str = "vllm-0"):
            """Send `events` (at `rate` events/s, 0: as fast as ZMQ takes them); ROUTE meanwhile."""
            here = pipes[engine]
            before = applied(info_client)
            here.send(("blast", events, per_batch, rate))
            assert here.recv() == "ready"
            probe(proc, probe_out)
            t0, cpu0, sched0, o0 = time.perf_counter(), cpu_seconds(proc.pid), schedstat(proc.pid), others_cpu()
            here.send("go")
            progress: list[tuple[float, int]] = []
            lat, t1 = route_loop(r, info_client, lambda n, want=before + events: n >= want, limit_s, interval,
                                 progress)
            send_s, late = here.recv()
            sched = tuple(b - a for a, b in zip(sched0, schedstat(proc.pid)))
            cpu = cpu_seconds(proc.pid) - cpu0
            snap = probe(proc, probe_out)
            behind = 0.0  # the longest a published event waited to be applied, by the schedule and INFO's counts
            if rate:
                for when, n in progress:
                    due = min(when - t0, (n - before) / rate if n - before < events else when - t0)
                    behind = max(behind, (when - t0) - due)
            return lat, t1, t0, send_s, late, cpu, sched, snap, behind, others_line(o0)

        if others:  # a new owner asks the others too for handoff_grace_s (10 s) after it gains a bucket
            t0, req = time.monotonic(), json.dumps({"blocks": WARM})
            while True:
                local = info_client.info("cluster")["cluster_lookups_local"]
                r.execute_command("ROUTE", req)
                if info_client.info("cluster")["cluster_lookups_local"] > local:
                    break
                assert time.monotonic() < t0 + 60, "the home's ROUTE never became local"
                time.sleep(0.2)
            print(f"    (the home answers ROUTE from its own directory {time.monotonic() - t0:.1f} s after the "
                  "cluster formed: what follows is the settled cluster)")
        rest = at_rest("at rest (32 blocks, 16 resident)")
        results = {}
        latencies = [("at rest", statistics.median(rest), percentile(rest, 99))]
        spies = []
        if args.py_spy:  # every node: FILE for the engine's home, FILE.1, FILE.2 ... for the others
            for i, node in enumerate(nodes):
                spies.append(subprocess.Popen(["py-spy", "record", "--pid", str(node[0].pid), "--rate", "250",
                                               "--format", "raw", "--gil", "--nonblocking", "--output",
                                               args.py_spy + (f".{i}" if i else "")], stdout=subprocess.DEVNULL))
            time.sleep(1.0)
        if args.rate:
            events = int(args.rate * seconds) // args.paced_batch * args.paced_batch
            lat, t1, t0, send_s, late, cpu, sched, snap, behind, rest_of = ingest(events, args.paced_batch,
                                                                                 args.rate, seconds + 60)
            done = "all applied" if t1 is not None else "NOT all applied within the limit"
            print(summary(f"during ingest at {args.rate:,.0f} events/s, {args.paced_batch} a batch", lat))
            print(f"    {events:,} events sent in {send_s:.2f} s (publisher at most {late * 1000:.1f} ms behind its "
                  f"schedule), {done} {((t1 or time.perf_counter()) - t0):.2f} s after the first; quilld at most "
                  f"{behind * 1000:.0f} ms behind the schedule (as INFO's counts show, every 40 ms)")
            print(where(snap, cpu, sched, (t1 or time.perf_counter()) - t0) + rest_of)
            latencies.append((f"ingest {args.rate / 1000:.0f}k/s,\n{args.paced_batch}/batch", statistics.median(lat),
                              percentile(lat, 99)))
        for per_batch in sizes:
            cpu_per_event = {}
            for name in pipes:  # vllm-1 (--hash-check): the same events, their hashes checked
                checked_now = name != "vllm-0"
                lat, t1, t0, send_s, _, cpu, sched, snap, _, rest_of = ingest(total, per_batch, 0, 120.0, name)
                label = " (hash check on)" if checked_now else " (hash check off)" if args.hash_check else ""
                if t1 is None:
                    print(f"{per_batch:>3} events/batch{label}: did not finish in 120 s")
                    continue
                rate = total / (t1 - t0)
                cpu_per_event[name] = cpu / total * 1e6
                if not checked_now:
                    results[per_batch] = rate
                    latencies.append((f"ingest,\n{per_batch}/batch", statistics.median(lat), percentile(lat, 99)))
                print(f"{per_batch:>3} events/batch as fast as ZMQ takes them{label}: {rate:>9,.0f} events/s applied "
                      f"({total:,} events, publisher sent them in {send_s:.2f} s, quilld "
                      f"{cpu_per_event[name]:.1f} CPU-µs per event); {summary('during ingest', lat)}")
                print(where(snap, cpu, sched, t1 - t0) + rest_of)
            if len(cpu_per_event) == 2:
                print(f"    the hash check's cost at {per_batch} a batch: "
                      f"{cpu_per_event['vllm-1'] - cpu_per_event['vllm-0']:+.2f} CPU-µs per event")
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(30)
        at_rest("at rest after ingest")
        for e in pipes:
            print(f"feed {e}: {info_client.info('router')[f'kv_engine_{e}']}")
        print("targets: >= 100,000 events/s at 64 per batch, >= 20,000 at 1 per batch, ROUTE p99 <= 5 ms during ingest")
        if args.plot:
            plot(args.plot, results, latencies, total)
    finally:
        for pipe in pipes.values():
            pipe.send(("quit",))
        engine.join(10)
        if args.hash_check:
            engine1.join(10)
        for node in nodes:
            stop_process(node[0])
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probed-quilld"]:
        raise SystemExit(probed_quilld(sys.argv[2], sys.argv[3:]))
    raise SystemExit(main())
