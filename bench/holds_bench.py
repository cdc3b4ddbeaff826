"""Issue 29 items 15, 16 and 22, measured on a real quilld (a few seconds each).

  hold   another tenant's GET latency (p50, p99, max) while one client repeats
         MULTI / AUTH nobody wrong / EXEC (item 15)
  puts   RSS growth of 400 zero-byte PUT2PHASE BEGINs with 1 MiB keys, and how many were
         accepted (item 16)
  short  RSS growth of 200,000 zero-byte BEGINs with short keys, and how many were accepted
  login  a right password's AUTH latency while another client from the same address keeps
         failing (item 22)

    python bench/holds_bench.py [--tree PATH] [--plot PATH] [hold|puts|short|login ...]

`--tree` runs another source tree's quilld (e.g. the unfixed /work/main) for a before figure.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from procs import start_quilld, stop_process  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from plot import QUILLD, Panel, add_flag, save  # noqa: E402

import redis  # noqa: E402

PASSWORD = "s3cret"


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def hold(q, seconds: float = 4.0) -> str:
    stop = threading.Event()

    def attacker():  # a raw socket: redis-py raises on an EXEC whose AUTH failed
        s = socket.create_connection(("127.0.0.1", q.port))
        s.settimeout(30)
        f = s.makefile("rb")
        s.sendall(b"AUTH %s\r\n" % PASSWORD.encode())
        f.readline()
        while not stop.is_set():
            s.sendall(b"MULTI\r\nAUTH nobody wrong\r\nEXEC\r\n")
            for _ in range(4):  # +OK, +QUEUED, *1, the AUTH's reply
                f.readline()
        s.close()

    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    time.sleep(0.5)  # past the throttle's first free failures
    b = redis.Redis(host="127.0.0.1", port=q.port, password=PASSWORD, socket_timeout=30)
    b.set("k", "v")
    lat = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        s = time.perf_counter()
        b.get("k")
        lat.append(time.perf_counter() - s)
    stop.set()
    t.join(30)
    holds = b.info("stats")["exec_holds"]
    p50, p99, worst = pct(lat, .5) * 1e3, pct(lat, .99) * 1e3, max(lat) * 1e3
    return (f"hold: {len(lat)} GETs of another tenant in {seconds:.0f} s: p50 {p50:.2f} ms, "
            f"p99 {p99:.2f} ms, max {worst:.2f} ms; exec_holds={holds}",
            ("another tenant's GET during MULTI/AUTH wrong/EXEC", {"p50": p50, "p99": p99, "max": worst}, "ms"))


def puts(q, n: int = 400, key_len: int = 1 << 20) -> str:
    r = redis.Redis(host="127.0.0.1", port=q.port, password=PASSWORD, socket_timeout=30)
    before = rss(q.proc.pid)
    ok = refused = 0
    t0 = time.monotonic()
    for i in range(n):
        key = b"%06d" % i + b"k" * (key_len - 6)
        try:
            r.execute_command("PUT2PHASE", "BEGIN", key, 0)
            ok += 1
        except redis.ResponseError:
            refused += 1
    elapsed = time.monotonic() - t0
    time.sleep(0.5)
    grown = rss(q.proc.pid) - before
    used = r.info("memory")["used_memory"]
    return (f"puts: {n} BEGIN key(1 MiB) 0 in {elapsed:.1f} s: {ok} accepted, {refused} refused; "
            f"RSS +{grown / 2**20:.0f} MiB, used_memory {used}",
            (f"{n} zero-byte BEGINs, 1 MiB keys", {"accepted": ok, "RSS growth (MiB)": grown / 2**20}, "count / MiB"))


def short(q, n: int = 200_000, batch: int = 2000) -> str:
    s = socket.create_connection(("127.0.0.1", q.port))
    s.settimeout(60)
    f = s.makefile("rb")
    s.sendall(b"AUTH %s\r\n" % PASSWORD.encode())
    f.readline()
    before = rss(q.proc.pid)
    ok = 0
    t0 = time.monotonic()
    for start in range(0, n, batch):
        s.sendall(b"".join(b"PUT2PHASE BEGIN short:%d 0\r\n" % i for i in range(start, start + batch)))
        for _ in range(batch):
            line = f.readline()
            if line.startswith(b"$"):
                f.readline()
                ok += 1
    elapsed = time.monotonic() - t0
    grown = rss(q.proc.pid) - before
    s.close()
    return (f"short: {n} BEGIN <short key> 0 in {elapsed:.1f} s: {ok} accepted; RSS +{grown / 2**20:.0f} MiB",
            (f"{n:,} zero-byte BEGINs, short keys", {"accepted (thousands)": ok / 1000,
                                                     "RSS growth (MiB)": grown / 2**20}, "thousands / MiB"))


def login(q, tries: int = 10) -> str:
    stop = threading.Event()

    def guesser():
        while not stop.is_set():
            s = socket.create_connection(("127.0.0.1", q.port))
            s.settimeout(30)
            try:
                for _ in range(5):
                    s.sendall(b"AUTH wrong\r\n")
                    s.recv(1024)
                    if stop.is_set():
                        break
            except OSError:
                pass
            finally:
                s.close()

    t = threading.Thread(target=guesser, daemon=True)
    t.start()
    time.sleep(0.5)
    lat = []
    for _ in range(tries):
        s = time.perf_counter()
        redis.Redis(host="127.0.0.1", port=q.port, password=PASSWORD, socket_timeout=30).ping()
        lat.append(time.perf_counter() - s)
    stop.set()
    t.join(30)
    median, worst = statistics.median(lat) * 1e3, max(lat) * 1e3
    return (f"login: {tries} right-password logins while another client at the same address fails: "
            f"median {median:.1f} ms, max {worst:.1f} ms",
            ("a right password while a neighbour fails", {"median": median, "max": worst}, "ms"))


def plot(path: str, figures: list[tuple[str, dict[str, float], str]], tree: Path) -> None:
    """One panel per measure run: its figures as bars, exactly the numbers the text lines print."""
    panels = [Panel(title, list(values), {"quilld": list(values.values())}, unit, bar_colors=[QUILLD] * len(values))
              for title, values, unit in figures]
    save(path, panels, f"EXEC holds, open puts and logins under attack ({tree})",
         note="bench/holds_bench.py; run again with --tree OLD_TREE for the before figure")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the source tree whose quilld runs (default: this one)")
    ap.add_argument("what", nargs="*", default=["hold", "puts", "login"], help="hold, puts, short, login")
    add_flag(ap)
    a = ap.parse_args()
    figures = []
    for what in a.what:
        with tempfile.TemporaryDirectory() as tmp:
            q = start_quilld(Path(tmp), "--dram", "64MiB", "--requirepass", PASSWORD, tree=a.tree)
            try:
                text, figure = {"hold": hold, "puts": puts, "short": short, "login": login}[what](q)
                print(f"[{a.tree}] {text}", flush=True)
                figures.append(figure)
            finally:
                stop_process(q.proc)
    if a.plot:
        plot(a.plot, figures, a.tree)


if __name__ == "__main__":
    main()
