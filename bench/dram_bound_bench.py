"""Does maxmemory bound DRAM with an SSD tier? Small values and values with a TTL (issues
19.1 and 19.2), one quilld per tree side by side.

For each tree given (`--tree NAME=PATH`, the current one by default) and each case, a fresh
quilld with a 256 MiB arena, dram.maxmemory 32 MiB and an SSD tier (or none) gets `--values`
values from one pipelined client, then the client waits until the node has settled (INFO's
used_memory stops changing, bounded in time). Printed per run: used_memory (peak seen while
writing, and at the end), RSS (VmRSS of the process, /proc), evicted keys, values demoted to
SSD, keys on SSD, write errors (-OOM after server.space_wait_ms), and the CPU seconds quilld
spent.

Cases:
  small      4096-byte values (at most dram.inline_max: inline values)
  small-ttl  the same with SET ... EX 3600
  block-ttl  320 MiB of 64 KiB blocks with SET ... EX 3600 (one tenant's TTL'd blocks, more than
             the arena), then a second client's 50 plain 64 KiB blocks: how many of those are
             refused. server.space_wait_ms is 200 ms in this case (5 s by default, as in the
             others), so a refused write costs the run 0.2 s.

    python bench/dram_bound_bench.py [--values 100000] [--tree main=/work/main --tree new=.]
                                     [--cases small,small-ttl,block-ttl] [--no-ssd] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from plot import Panel, add_flag, ratio, save

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
from procs import free_port, stop_process, wait_port  # noqa: E402

MiB = 1 << 20
MAXMEMORY = 32 * MiB  # dram.maxmemory of every run (QUILLD_DRAM_MAXMEMORY)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(tree: Path, work: Path, ssd: bool, space_wait_ms: int = 5000) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env.update(PYTHONPATH=str(tree), QUILLD_DRAM_MAXMEMORY=f"{MAXMEMORY // MiB}MiB", QUILLD_SSD_SEGMENT_SIZE="256MiB",
               QUILLD_SERVER_SPACE_WAIT_MS=str(space_wait_ms))
    argv = [sys.executable, "-m", "quilld", "--port", str(port), "--admin-port", "0", "--dram", "256MiB"]
    if ssd:
        argv += ["--ssd-dir", str(work / "ssd"), "--ssd-size", "2GiB"]
    log = open(work / f"quilld-{port}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
    wait_port(port, proc, 60)
    return proc, port


def run_case(tree: Path, case: str, n: int, ssd: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="dram-bound-"))
    proc, port = start(tree, work, ssd, 200 if case == "block-ttl" else 5000)
    r = redis.Redis(port=port, socket_timeout=60)
    peak = errors = refused = 0
    size = 64 * 1024 if case == "block-ttl" else 4096
    count = 5120 if case == "block-ttl" else n
    payload = b"v" * size
    try:
        t0 = cpu(proc.pid)
        pipe = r.pipeline(transaction=False)
        for i in range(count):
            if case == "small":
                pipe.set(b"k%07d" % i, payload)
            else:
                pipe.set(b"k%07d" % i, payload, ex=3600)
            if i % 500 == 499 or i == count - 1:
                for reply in pipe.execute(raise_on_error=False):
                    errors += isinstance(reply, Exception)
                peak = max(peak, r.info("memory")["used_memory"])
        if case == "block-ttl":  # another tenant's plain blocks, after the TTL'd ones filled DRAM
            other = redis.Redis(port=port, socket_timeout=60)
            for i in range(50):
                try:
                    other.set(b"other%04d" % i, payload)
                except redis.ResponseError:
                    refused += 1
        last, deadline = -1, time.monotonic() + 60
        while time.monotonic() < deadline:
            used = r.info("memory")["used_memory"]
            if used == last:
                break
            last = used
            time.sleep(0.5)
        mem, stats, pers = r.info("memory"), r.info("stats"), r.info("persistence")
        return {"used_peak": max(peak, mem["used_memory"]), "used": mem["used_memory"], "rss": rss(proc.pid),
                "evicted": stats.get("evicted_keys", 0), "demoted": pers.get("demotions", 0),
                "ssd_keys": pers.get("ssd_keys", 0), "errors": errors, "refused": refused,
                "keys": r.dbsize(), "cpu_s": cpu(proc.pid) - t0}
    finally:
        r.close()
        stop_process(proc, 60)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=100_000)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a quilld source tree")
    p.add_argument("--cases", default="small,small-ttl,block-ttl")
    p.add_argument("--no-ssd", action="store_true", help="also run each case without an SSD tier")
    add_flag(p)
    a = p.parse_args()
    trees = [t.split("=", 1) for t in a.tree] or [["this", str(HERE)]]
    print(f"# uptime: {os.getloadavg()}; {a.values} values; maxmemory {MAXMEMORY // MiB} MiB, arena 256 MiB")
    print(f"{'tree':8} {'case':10} {'ssd':4} {'used_peak':>10} {'used':>10} {'rss':>10} {'evicted':>8} "
          f"{'demoted':>8} {'ssd_keys':>8} {'errors':>7} {'refused':>7} {'keys':>7} {'cpu_s':>6}")
    rows = []
    for case in a.cases.split(","):
        for ssd in ([True, False] if a.no_ssd else [True]):
            for name, path in trees:  # side by side: each tree in turn, case by case
                m = run_case(Path(path).resolve(), case, a.values, ssd)
                rows.append((name, case, ssd, m))
                print(f"{name:8} {case:10} {'yes' if ssd else 'no':4} {m['used_peak'] / MiB:9.1f}M "
                      f"{m['used'] / MiB:9.1f}M {m['rss'] / MiB:9.1f}M {m['evicted']:8} {m['demoted']:8} "
                      f"{m['ssd_keys']:8} {m['errors']:7} {m['refused']:7} {m['keys']:7} {m['cpu_s']:6.1f}",
                      flush=True)
    if a.plot:
        plot(a.plot, rows, a.values)


def plot(path: str, rows: list[tuple[str, str, bool, dict]], values: int) -> None:
    """rows: (tree, case, ssd, the run's figures) as main() prints them. One group of bars a case
    (and SSD tier or none), one bar a tree: used_memory's peak against maxmemory, RSS at the end,
    the writes refused and keys evicted, and quilld's CPU time."""
    trees = list(dict.fromkeys(r[0] for r in rows))
    runs = list(dict.fromkeys((r[1], r[2]) for r in rows))
    got = {(r[0], r[1], r[2]): r[3] for r in rows}
    categories = [case if ssd else f"{case}, no SSD" for case, ssd in runs]

    def series(key: str, scale: float = 1.0, suffix: str = "") -> dict[str, list[float]]:
        return {f"{t}{suffix}": [got[(t, *run)][key] / scale for run in runs] for t in trees}

    peak = series("used_peak", MiB)
    if len(trees) == 1:  # over each case: how far the peak went past maxmemory
        peak_labels, over = [ratio(v, MAXMEMORY / MiB) for v in peak[trees[0]]], "peak / maxmemory"
    else:  # over each case: the last tree's peak against the first's
        peak_labels, over = [ratio(b, a) for a, b in zip(peak[trees[0]], peak[trees[-1]])], f"{trees[-1]} / {trees[0]}"
    counts: dict[str, list[float]] = {}
    for key, what in (("errors", "writes -OOM"), ("refused", "other client refused"), ("evicted", "evicted")):
        if len(trees) == 1:
            counts[what] = series(key)[trees[0]]
        else:
            counts |= series(key, suffix=f" {what}")
    panels = [Panel(f"used_memory peak, maxmemory {MAXMEMORY // MiB} MiB (over each: {over})", categories, peak,
                    "MiB", peak_labels),
              Panel("RSS at the end", categories, series("rss", MiB), "MiB"),
              Panel("writes refused and keys evicted" + ("" if any(map(any, counts.values())) else ": none"),
                    categories, counts, "count"),
              Panel("quilld CPU time", categories, series("cpu_s"), "s")]
    save(path, panels, f"Is DRAM bounded with an SSD tier? {values:,} values per small case",
         f"one quilld per tree and case: arena 256 MiB, dram.maxmemory {MAXMEMORY // MiB} MiB; block-ttl: "
         f"320 MiB of 64 KiB blocks with EX, then 50 plain blocks of another client; {os.cpu_count()} cores "
         f"shared with other work (noisy)")


if __name__ == "__main__":
    main()
