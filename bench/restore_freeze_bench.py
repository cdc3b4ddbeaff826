"""How long a RESTORE of a large LZF payload stops other clients (issue 29.13).

One client sends `RESTORE k 0 <payload>`, the 293 KiB payload redis-server DUMPs for 26.4 MB
of one byte (LZF back references); another sends GET every 5 ms meanwhile. Prints the
RESTORE's own time and the slowest GET answered while it ran, for quilld and redis-server.

    python bench/restore_freeze_bench.py [--mb 26.4] [--plot PATH]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import redis  # noqa: E402

from procs import start_quilld, start_redis, stop_process  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot import Panel, add_flag, ratio, save  # noqa: E402


def freeze(port: int, payload: bytes) -> tuple[float, float, int]:
    """(RESTORE's seconds, the slowest GET meanwhile in seconds, GETs answered meanwhile)."""
    a, b = redis.Redis(port=port, socket_timeout=120), redis.Redis(port=port, socket_timeout=120)
    b.set("probe", "x")
    a.delete("k")
    done = threading.Event()
    took = [0.0]

    def restore() -> None:
        start = time.perf_counter()
        a.restore("k", 0, payload, replace=True)
        took[0] = time.perf_counter() - start
        done.set()

    t = threading.Thread(target=restore)
    t.start()
    worst, n = 0.0, 0
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        start = time.perf_counter()
        b.get("probe")
        worst = max(worst, time.perf_counter() - start)
        n += 1
        time.sleep(0.005)
    t.join(120)
    assert a.strlen("k") == int.from_bytes(payload[8:12], "big")  # the size the payload declares
    return took[0], worst, n


def plot(path: str, rows: dict[str, tuple[float, float, int]], mb: float, payload_kib: float) -> None:
    """rows: server -> (RESTORE s, slowest GET meanwhile s, GETs answered). Bars in ms, redis first."""
    names = ["redis-server", "quilld"]
    panels = [Panel(title, [f"{mb} MB from {payload_kib:.0f} KiB"], {n: [rows[n][i] * 1000] for n in names}, "ms",
                    labels=[f"quilld {ratio(rows['quilld'][i], rows['redis-server'][i])}"])
              for i, title in ((0, "RESTORE's own time"), (1, "slowest GET of another client meanwhile"))]
    save(path, panels, "A large LZF RESTORE: how long it stops other clients",
         note="bench/restore_freeze_bench.py; lower is better; x: quilld / redis-server")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=26.4, help="the restored value's size, in MB (10^6 bytes)")
    add_flag(ap)
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found: apt-get install redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="quilld-restore-"))
    port, redis_proc = start_redis(tmp)
    q = start_quilld(tmp, "--dram", "256MiB", admin=False)
    try:
        r = redis.Redis(port=port)
        r.set("src", b"a" * int(args.mb * 1e6))
        payload = r.dump("src")
        r.delete("src")
        assert payload[1] == 0xC3  # LZF
        print(f"payload {len(payload) / 1024:.0f} KiB, expands to {args.mb} MB")
        rows = {}
        for name, p in (("quilld", q.port), ("redis-server", port)):
            took, worst, n = rows[name] = freeze(p, payload)
            print(f"{name}: RESTORE {took * 1000:.0f} ms; slowest of {n} GETs meanwhile {worst * 1000:.0f} ms")
        if args.plot:
            plot(args.plot, rows, args.mb, len(payload) / 1024)
    finally:
        stop_process(q.proc)
        stop_process(redis_proc)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
