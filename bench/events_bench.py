"""KV-event ingest: events applied per second, and ROUTE latency while it runs.

    python bench/events_bench.py              # 200k events per batch size
    python bench/events_bench.py --quick      # 40k
    python bench/events_bench.py --sizes 1    # one batch size only
    python bench/events_bench.py --quick --plot events.png   # also the figure (the `bench` extra)

A real quilld (uvloop, as deployed) follows one engine's KV events over ZMQ. The engine
is a publisher process doing on the wire what vLLM 0.33's ZmqEventPublisher does (PUB
`(topic, seq, payload)`, a replay ROUTER), with payloads encoded by msgspec from vLLM's
structs: three BlockStored (one block, 16 tokens, group 0) for each BlockRemoved. For
1, 16 and 64 events per batch the publisher sends its events as fast as ZMQ takes them
while this process sends a ROUTE (32 blocks, redis-py, one connection) every 2 ms
(`--route-interval-ms`, 0 for back to back) and INFO router every 20th request, as a
router and a monitoring client would. quilld's CPU time per run is printed: on a shared
2-core machine it shows how much of a core quilld actually got. Reported:
events applied per second (first send to the last event counted in INFO), ROUTE p50/p99
during ingest, and ROUTE at rest on the same index. Targets (issue 12): >= 100k events/s
at 64 per batch, >= 20k/s at 1 per batch, ROUTE p99 <= 5 ms during ingest.
"""

from __future__ import annotations

import argparse
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


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ---------------------------------------------------------------- the engine (a separate process)


def publisher(pub_port: int, replay_port: int, conn) -> None:
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
        if msg[0] == "warm":
            payloads = [vllm.encode([vllm.gpu(WARM)], ts=time.time())]
        else:
            _, total, per_batch = msg
            stored: list[int] = []
            events = []
            for i in range(total):
                if i % 4 == 3:
                    events.append(vllm.removed([stored.pop(rng.randrange(len(stored)))]))
                else:
                    h = rng.getrandbits(64)
                    stored.append(h)
                    events.append(vllm.gpu([h], parent=None))
            ts = time.time()
            payloads = [vllm.encode(events[i:i + per_batch], ts=ts) for i in range(0, total, per_batch)]
            conn.send("ready")
            conn.recv()  # go
        t0 = time.perf_counter()
        for p in payloads:
            with lock:
                pub.send_multipart((b"kv", seq.to_bytes(8, "big"), p))
                buffer.append((seq, p))
                seq += 1
        conn.send(time.perf_counter() - t0)
    stop.set()
    replayer.join(5)
    pub.close(0)
    router.close(0)
    ctx.term()


# ---------------------------------------------------------------- quilld and its clients


def start_quilld(pub_port: int, replay_port: int):
    import redis
    from procs import free_port, wait_port

    port = free_port()
    conf = Path(tempfile.mkdtemp()) / "events.toml"
    conf.write_text(f'[[engines]]\nid = "vllm-0"\nurl = "http://127.0.0.1:9"\nmodel = "{MODEL}"\n'
                    f'kv_events = "tcp://127.0.0.1:{pub_port}"\nreplay = "tcp://127.0.0.1:{replay_port}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "quilld", "--port", str(port), "--admin-port", "0",
                             "--config", str(conf), "--log-level", "warning"],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    wait_port(port, proc)
    r = redis.Redis(port=port, protocol=2)
    r.execute_command("SCOPE", MODEL, "")
    return proc, r, redis.Redis(port=port, protocol=2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def applied(info_client) -> int:
    line = info_client.info("router")["kv_engine_vllm-0"]
    return line["events"]


def route_loop(r, info_client, until, limit_s: float, interval_s: float = 0.0) -> tuple[list[float], float | None]:
    """ROUTE every `interval_s` (0: back to back), INFO every 20th, until `until(events)` holds;
    returns latencies (ms) and when it held (perf_counter)."""
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
        if i % 20 == 0 and until(applied(info_client)):
            return lat, time.perf_counter()
    return lat, None


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
    ap.add_argument("--sizes", default="1,16,64", help="events per batch, comma-separated")
    ap.add_argument("--events", type=int, default=0, help="events per batch size (default 200k, 40k with --quick)")
    ap.add_argument("--route-interval-ms", type=float, default=2.0,
                    help="one ROUTE every this many ms during ingest and at rest (0: back to back)")
    ap.add_argument("--py-spy", metavar="FILE", help="record quilld with py-spy during ingest (collapsed stacks)")
    add_flag(ap)
    args = ap.parse_args()
    total = args.events or (40_000 if args.quick else 200_000)
    interval = args.route_interval_ms / 1000
    sizes = [int(s) for s in args.sizes.split(",")]

    from procs import free_port

    pub_port, replay_port = free_port(), free_port()
    here, there = mp.Pipe()
    engine = mp.Process(target=publisher, args=(pub_port, replay_port, there), daemon=True)
    engine.start()
    proc, r, info_client = start_quilld(pub_port, replay_port)
    try:
        deadline = time.monotonic() + 10
        while info_client.info("router")["kv_engine_vllm-0"]["state"] != "live":
            assert time.monotonic() < deadline, "quilld never connected to the publisher"
            time.sleep(0.05)
        here.send(("warm",))
        here.recv()
        while applied(info_client) < 1:
            time.sleep(0.01)
        rest, _ = route_loop(r, info_client, lambda n: False, 2.0, interval)
        print(f"ROUTE at rest ({REQUEST_BLOCKS} blocks, {len(WARM)} resident): p50 {statistics.median(rest):.3f} ms, "
              f"p99 {percentile(rest, 99):.3f} ms ({len(rest)} requests)")
        results = {}
        latencies = [("at rest", statistics.median(rest), percentile(rest, 99))]
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--rate", "250", "--format", "raw",
                                    "--output", args.py_spy, "--nonblocking"], stdout=subprocess.DEVNULL)
            time.sleep(1.0)
        for per_batch in sizes:
            before = applied(info_client)
            here.send(("blast", total, per_batch))
            assert here.recv() == "ready"
            t0, cpu0 = time.perf_counter(), cpu_seconds(proc.pid)
            here.send("go")
            lat, t1 = route_loop(r, info_client, lambda n, want=before + total: n >= want, 120.0, interval)
            send_s = here.recv()
            if t1 is None:
                print(f"{per_batch:>3} events/batch: did not finish in 120 s ({applied(info_client) - before} applied)")
                continue
            rate = total / (t1 - t0)
            cpu = cpu_seconds(proc.pid) - cpu0
            results[per_batch] = rate
            latencies.append((f"ingest,\n{per_batch}/batch", statistics.median(lat), percentile(lat, 99)))
            print(f"{per_batch:>3} events/batch: {rate:>9,.0f} events/s applied ({total:,} events, publisher sent them "
                  f"in {send_s:.2f} s; quilld used {cpu:.2f} CPU-s of {t1 - t0:.2f} s, ROUTE and INFO included); "
                  f"ROUTE during ingest p50 {statistics.median(lat):.3f} ms, p99 {percentile(lat, 99):.3f} ms, "
                  f"max {max(lat):.1f} ms ({len(lat)} requests)")
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        rest, _ = route_loop(r, info_client, lambda n: False, 2.0, interval)
        print(f"ROUTE at rest after ingest: p50 {statistics.median(rest):.3f} ms, p99 {percentile(rest, 99):.3f} ms")
        line = info_client.info("router")["kv_engine_vllm-0"]
        print(f"feed: {line}")
        print("targets: >= 100,000 events/s at 64 per batch, >= 20,000 at 1 per batch, ROUTE p99 <= 5 ms during ingest")
        if args.plot:
            plot(args.plot, results, latencies, total)
    finally:
        here.send(("quit",))
        engine.join(10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
