"""The residency index's storage study (issue 23): every backend on one trace of vLLM-shaped events.

    python bench/index_study.py                       # 1M resident blocks (about 7 minutes here)
    python bench/index_study.py --quick               # 100k
    python bench/index_study.py --plot docs/img/index_study.png   # also the figure (the `bench` extra)
    python bench/index_study.py --tree ../dir         # and the cluster directory's owner store of that tree

Backends: memory, lmdb, rocksdb, and lmdb-nosync / rocksdb-nosync (the same with index.fsync off).

The trace (bench/index_trace.py): 16 engines of one model, shared system prompts, multi-turn
sessions with chained block hashes, HBM evictions offloaded to a CPU tier and dropped from there;
about `--blocks` entries at the end, in batches of 64 events per engine. It is written once and
streamed by every run.

Each backend runs in its own process (so RSS and /proc/self/io are its own), through the control
plane's real path (ControlPlane.apply_events, the subscriber's cursor, housekeeping's flush every
50 ms, commits every 100 ms, fsync on), and reports:

- ingest: events applied per second (wall and CPU of the whole process, the writer thread included);
- ROUTE's prefix walk for 32 blocks (`leading_masks`, what ROUTE reads), and a whole ROUTE, p50/p99;
  for LMDB and RocksDB also the walk read through the store itself (a read transaction or `get`
  per block), and for an in-memory adaptive radix tree (blart-py) built from the same entries;
- bytes physically written (/proc/self/io write_bytes: pages this process dirtied; RocksDB's own
  statistics beside it) per event and per byte of the entries committed (write amplification),
  over the trace's last third applied at `--rate` events/s (a steady state's pace: how much is
  written depends on how many changes a commit gathers);
- on-disk size, RSS (anonymous and file-backed);
- recovery: a new process from exec to its first ROUTE, checked against the answer before the
  stop, after a clean stop and after kill -9 mid-ingest; after the kill, the recovered index is
  compared entry by entry with the trace replayed in memory up to each engine's persisted cursor.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from index_trace import BATCH, ENGINES, WALK, make_trace, read_trace, to_events  # noqa: E402

MODEL = "m"
BACKENDS = ("memory", "lmdb", "rocksdb", "lmdb-nosync", "rocksdb-nosync")


# ---------------------------------------------------------------- one backend's process


def proc_figures() -> dict:
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    kb = lambda k: int(status.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
    t = os.times()
    return {"write_bytes": int(io["write_bytes"]), "rss": kb("VmRSS"), "rss_anon": kb("RssAnon"),
            "rss_file": kb("RssFile"), "cpu": t.user + t.system}


def control_plane(backend: str, path: str):
    """`backend` as the study names it: memory, lmdb, rocksdb, or lmdb-nosync / rocksdb-nosync (fsync off)."""
    from quilld.config import Config, EngineConfig, IndexConfig
    from quilld.index.control import ControlPlane
    from quilld.scopes import ScopeRegistry

    engines = tuple(EngineConfig(id=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", model=MODEL) for i in range(ENGINES))
    name, _, variant = backend.partition("-")
    cfg = Config(engines=engines, index=IndexConfig(backend=name, path=path, commit_ms=100, fsync=variant != "nosync"))
    return ControlPlane(cfg, ScopeRegistry())


def settle(control) -> None:
    """Commit what is left and wait for the writer thread."""
    control.index.flush(force=True)
    writer = getattr(control.index, "_writer", None)
    if writer is not None:
        while writer.busy():
            time.sleep(0.001)


def written(control) -> dict:
    """This process's bytes written and the entries' bytes committed so far."""
    writer = getattr(control.index, "_writer", None)
    return {"write_bytes": proc_figures()["write_bytes"], "committed_bytes": writer.bytes if writer else 0,
            "commits": writer.commits if writer else 0}


def ingest(control, trace: Path, stop_after: int | None = None, progress=None, paced: int = 0,
           rate: float = 0.0) -> dict:
    """Apply the trace as the subscriber and housekeeping would, as fast as it goes, then its last
    `paced` batches at `rate` events/s (a steady state's pace, for what is written per event); time
    only the control plane's work."""
    from quilld.index.subscriber import Cursor

    apply, applied, flush = control.apply_events, control._applied, control.index.flush
    clock = time.perf_counter
    busy = {False: 0.0, True: 0.0}
    events = {False: 0, True: 0}
    batches = 0
    pace_at = max(0, count_batches(trace) - paced) if paced and stop_after is None else None
    marks: dict = {}
    next_flush = clock() + 0.05
    t_start = t_pace = clock()
    for e, seq, raw in read_trace(trace):
        pacing = pace_at is not None and batches >= pace_at
        if pacing and batches == pace_at:
            settle(control)
            marks["before"] = written(control)
            t_pace = clock()
        evs = to_events(raw)
        engine = f"e{e}"
        if pacing:  # wait for this batch's time at `rate`
            delay = t_pace + events[True] / rate - clock()
            if delay > 0:
                time.sleep(delay)
        t0 = clock()
        apply(engine, evs)
        applied(engine, Cursor(seq, seq, float(seq)))
        if t0 >= next_flush:  # housekeeping's tick
            flush()
            next_flush = t0 + 0.05
        busy[pacing] += clock() - t0
        events[pacing] += len(evs)
        batches += 1
        if progress is not None and batches % 200 == 0:
            progress(batches)
        if stop_after is not None and batches >= stop_after:
            break
    t0 = clock()
    settle(control)
    out = {"events": events[False], "busy_s": busy[False], "paced_events": events[True], "paced_busy_s": busy[True],
           "batches": batches, "wall_s": clock() - t_start, "settle_s": clock() - t0}
    if "before" in marks:
        after = written(control)
        out["paced"] = {k: after[k] - marks["before"][k] for k in after}
        out["paced"]["seconds"] = clock() - t_pace
    return out


def count_batches(trace: Path) -> int:
    return sum(1 for _ in read_trace(trace))


def percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def walks(control, probes: list[list[int]]) -> dict:
    """ROUTE's prefix walk and a whole ROUTE, in microseconds, over the probes (twice: the first round warms)."""
    from quilld.model import IdentityScope

    index = control.index
    scope = IdentityScope("default", MODEL)
    tag = control.scopes.tag(scope)
    lm = index.leading_masks
    clock = time.perf_counter_ns
    walk, route = [], []
    for round_ in range(2):
        for p in probes:
            t0 = clock()
            lm(tag, p)
            t1 = clock()
            control.route(scope, tag, p)
            t2 = clock()
            if round_:
                walk.append((t1 - t0) / 1000)
                route.append((t2 - t1) / 1000)
    return {"walk": percentiles(walk), "route": percentiles(route)}


def answers(control, probes: list[list[int]]) -> list:
    """What ROUTE reads for each probe, by holder name and tier (comparable across processes)."""
    from quilld.model import IdentityScope

    tag = control.scopes.tag(IdentityScope("default", MODEL))
    index = control.index
    return [[sorted([h, t.value] for h, t in index.slots(m)) for m in index.leading_masks(tag, p)] for p in probes]


def store_walks(control, probes: list[list[int]]) -> dict:
    """The walk read through the storage engine itself (what a read-through backend would do)."""
    index = control.index
    store = index.store
    from quilld.model import IdentityScope

    sid = index._sid_of[control.scopes.tag(IdentityScope("default", MODEL))]
    prefix = b"e" + sid
    clock = time.perf_counter_ns
    out = []
    if store.name == "lmdb":
        env = store.env

        def reader():  # LMDB reads in a transaction: one a walk, in the walk's time
            return env.begin(buffers=False)
    else:
        db = store.db

        def reader():
            return contextlib.nullcontext(db)
    for round_ in range(2):
        for p in probes:
            t0 = clock()
            with reader() as r:
                get = r.get
                masks = []
                for b in p:
                    v = get(prefix + b.to_bytes(8, "big"))
                    if v is None:
                        break
                    masks.append(int.from_bytes(v))
            if round_:
                out.append((clock() - t0) / 1000)
    return {"store_walk": percentiles(out)}


def art_walks(control, probes: list[list[int]]) -> dict:
    """An in-memory adaptive radix tree (blart-py) holding the same entries: keys are 8 bytes as a str
    (blart-py takes str keys only; all of one length, so none is a prefix of another)."""
    import blart

    from quilld.model import IdentityScope

    tag = control.scopes.tag(IdentityScope("default", MODEL))
    entries = control.index.entries(tag)
    before = proc_figures()
    t0 = time.perf_counter()
    tree = blart.TreeMap()
    for key, mask in entries.items():
        tree[key.to_bytes(8, "big").decode("latin-1")] = mask
    build = time.perf_counter() - t0
    after = proc_figures()
    get = tree.get
    clock = time.perf_counter_ns
    out = []
    for round_ in range(2):
        for p in probes:
            t0 = clock()
            masks = []
            for b in p:
                m = get(b.to_bytes(8, "big").decode("latin-1"))
                if m is None:
                    break
                masks.append(m)
            if round_:
                out.append((clock() - t0) / 1000)
    return {"art_walk": percentiles(out), "art_rss": after["rss_anon"] - before["rss_anon"], "art_build_s": build,
            "art_entries": len(tree)}


def child_ingest(args) -> None:
    probes = json.loads(Path(args.probes).read_text())
    base = proc_figures()
    control = control_plane(args.backend, args.dir)
    opened = proc_figures()
    ing = ingest(control, Path(args.trace), paced=int(count_batches(Path(args.trace)) * args.paced_share),
                 rate=args.rate)
    done = proc_figures()
    res = {"backend": args.backend, "ingest": ing, "entries": len(control.index),
           "cpu_s": done["cpu"] - opened["cpu"], "write_bytes": done["write_bytes"] - opened["write_bytes"],
           "rss": done["rss"], "rss_anon": done["rss_anon"] - base["rss_anon"], "rss_file": done["rss_file"],
           **walks(control, probes)}
    index = control.index
    if index.persistent:
        res["describe"] = index.describe()
        res["engine_stats"] = index.store.engine_stats()
        res["disk_bytes"] = index.store.disk_bytes()
        res.update(store_walks(control, probes))
        if index.store.name == "rocksdb":  # the compaction this run left for later: what a full one writes
            before = index.store.engine_stats()
            index.store.db.compact_range(None, None)
            after = index.store.engine_stats()
            res["compaction_debt"] = after["compact_write_bytes"] - before["compact_write_bytes"]
            res["disk_bytes_compacted"] = index.store.disk_bytes()
    elif args.art:
        res.update(art_walks(control, probes))
    Path(args.answers).write_text(json.dumps(answers(control, probes)))
    Path(args.answers).with_suffix(".route.json").write_text(json.dumps(expected_route(control, probes)))
    control.index.close()
    print(json.dumps(res))


def render(step) -> str:
    return "recompute" if step.action == "recompute" else f"{step.action}:{step.holder}:{step.tier.value}"


def expected_route(control, probes: list[list[int]]) -> dict:
    """A probe most of whose blocks some engine holds, and ROUTE's plan for it (what a restarted daemon
    must answer)."""
    from quilld.model import IdentityScope

    scope = IdentityScope("default", MODEL)
    tag = control.scopes.tag(scope)
    for p in probes:
        d = control.route(scope, tag, p)
        if sum(s.action == "hit" for s in d.plan) >= WALK // 2:
            return {"blocks": p, "plan": [render(s) for s in d.plan], "engine": d.engine}
    raise SystemExit("no probe has half its blocks held: the trace is too small")


def child_owned(args) -> None:
    """The cluster directory's owner store (quilld/cluster/dir_entries.py, OwnedEntries: an owner's
    packed runs of each holder's blocks per prompt segment) against ResidencyIndex on the same
    (holder, block) residencies: chains of one segment (32 blocks) each held by 1-3 of 16 engines,
    as many residencies as the trace ends with. Its lookup is of one segment, ROUTE's 32 blocks."""
    import tracemalloc

    if args.tree:
        sys.path.insert(0, args.tree)
    from quilld.cluster.dir_entries import BLOCK, TIER_BIT, block_shard, code_of, scope_digest
    try:
        from quilld.cluster.dir_owned import OwnedEntries
    except ImportError:  # a tree from before the owner's store had a module of its own
        from quilld.cluster.dir_entries import OwnedEntries
    from quilld.index.residency import ResidencyIndex

    rng = random.Random(7)
    ctag, tag = scope_digest("default", MODEL, "", ""), b"\0\0\0\1"
    chains, total = [], 0
    while total < args.residencies:
        chain = [rng.getrandbits(64) for _ in range(WALK)]
        holders = rng.sample(range(ENGINES), rng.choice([1, 1, 1, 2, 3]))
        chains.append((chain, holders))
        total += WALK * len(holders)

    def owned():
        o = OwnedEntries()
        for chain, holders in chains:
            shard, bucket = block_shard(ctag, chain[0].to_bytes(8, "big")), chain[0] & 1023
            for h in holders:
                for i, b in enumerate(chain):
                    o.put(f"e{h}", BLOCK, ctag + b.to_bytes(8, "big"), shard, bucket, code_of(TIER_BIT["hbm"], i))
        return o, lambda chain: o.segment(chain[0] & 1023, block_shard(ctag, chain[0].to_bytes(8, "big")),
                                          [b.to_bytes(8, "big") for b in chain])

    def index():
        ix = ResidencyIndex()
        for chain, holders in chains:
            for h in holders:
                ix.put_many(tag, chain, f"e{h}", "hbm")
        return ix, lambda chain: ix.leading_masks(tag, chain)

    out = {"residencies": total}
    for name, build in (("owned", owned), ("index", index)):
        tracemalloc.start()
        t0 = time.perf_counter()
        store, lookup = build()
        built = time.perf_counter() - t0
        nbytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        lat = []
        probes = rng.sample(chains, min(3000, len(chains)))
        for round_ in range(2):
            for chain, _ in probes:
                t0 = time.perf_counter_ns()
                lookup(chain)
                if round_:
                    lat.append((time.perf_counter_ns() - t0) / 1000)
        out[name] = {"bytes_each": nbytes / total, "build_s": built, "lookup": percentiles(lat)}
        del store, lookup
    print(json.dumps(out))


def child_crash(args) -> None:
    """Ingest and say how far it got; the parent kills this process with SIGKILL midway."""
    control = control_plane(args.backend, args.dir)
    ingest(control, Path(args.trace), progress=lambda n: print(n, flush=True))
    print("done", flush=True)
    time.sleep(60)


def child_recover(args) -> None:
    """A restarted quilld's control plane: open, first ROUTE, checked; then (after a crash) every entry."""
    t_start = time.monotonic()
    from quilld.model import IdentityScope  # noqa: F401  (the imports a node has made by then)
    import quilld.index.control  # noqa: F401

    t_imported = time.monotonic()
    control = control_plane(args.backend, args.dir)
    t_opened = time.monotonic()
    probes = json.loads(Path(args.probes).read_text())
    first = answers(control, probes[:1])
    t_route = time.monotonic()
    res = {"t_start": t_start, "t_imported": t_imported, "t_opened": t_opened, "t_route": t_route,
           "entries": len(control.index), "load_s": control.index.describe().get("load_seconds")}
    if args.answers:
        want = json.loads(Path(args.answers).read_text())
        res["first_correct"] = first[0] == want[0]
        res["all_correct"] = answers(control, probes) == want
    if args.verify:
        res.update(verify_crash(control, Path(args.trace)))
    control.index.close()
    print(json.dumps(res))


def verify_crash(control, trace: Path) -> dict:
    """Replay the trace in memory up to each engine's persisted cursor; compare every entry."""
    cursors = {e: c.seq for e, c in control._cursors.items()}
    reference = control_plane("memory", "")
    for e, seq, raw in read_trace(trace):
        engine = f"e{e}"
        if seq <= cursors.get(engine, -1):
            reference.apply_events(engine, to_events(raw))

    def view(c) -> dict:
        return {(c.scopes.scope_of(t), hk): sorted((h, tier.value) for h, tier in slots)
                for (t, hk), slots in c.index.snapshot().items()}

    same = view(control) == view(reference)
    return {"crash_cursor_batches": sum(c + 1 for c in cursors.values()), "crash_entries": len(control.index),
            "crash_equal": same}


# ---------------------------------------------------------------- the parent


def run_child(mode: str, **kw) -> dict:
    argv = [sys.executable, __file__, "--child", mode]
    for k, v in kw.items():
        if v is True:
            argv.append(f"--{k}")
        elif v not in (None, False):
            argv += [f"--{k}", str(v)]
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if out.returncode:
        raise SystemExit(f"{mode} {kw.get('backend')}: exit {out.returncode}\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["t_spawn"] = t0
    return res


def daemon_start(backend: str, d: Path, work: Path, expected: dict) -> dict:
    """A whole quilld (`python -m quilld`) on the index the ingest left: exec to its first ROUTE over RESP,
    and whether that ROUTE's plan is the one the ingest's process gave."""
    import redis

    sys.path.insert(0, str(ROOT / "tests"))
    from procs import free_port

    conf = work / f"quilld-{backend}.toml"
    name, _, variant = backend.partition("-")
    fsync = str(variant != "nosync").lower()
    conf.write_text(f'[index]\nbackend = "{name}"\npath = "{d}"\nfsync = {fsync}\n\n' + "".join(
        f'[[engines]]\nid = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodel = "{MODEL}"\n\n'
        for i in range(ENGINES)))
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "quilld", "--port", str(port), "--admin-port", "0", "--config",
                             str(conf), "--log-level", "warning"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port, protocol=2, socket_connect_timeout=1)
        while True:
            try:
                r.execute_command("SCOPE", MODEL, "")
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() - t0 > 60:
                    raise SystemExit(f"quilld with the {backend} index did not start") from None
                time.sleep(0.005)
        reply = r.execute_command("ROUTE", json.dumps({"blocks": expected["blocks"]}))
        t1 = time.monotonic()
        fields = {reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 2)}
        plan = [p.decode() for p in fields["plan"]]
        r.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"first_route_s": t1 - t0, "correct": plan == expected["plan"],
            "hits": sum(p.startswith("hit") for p in plan)}


def crash_run(backend: str, d: str, trace: Path, batches: int) -> int:
    """Ingest in a child and SIGKILL it at a random point of its second half; returns batches reported."""
    argv = [sys.executable, __file__, "--child", "crash", "--backend", backend, "--dir", d, "--trace", str(trace)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    kill_at = random.Random(backend).randint(batches // 2, batches * 9 // 10)
    seen = 0
    for line in p.stdout:
        if line.strip() == "done":
            break
        seen = int(line)
        if seen >= kill_at:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    return seen


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k resident blocks")
    ap.add_argument("--blocks", type=int, default=0, help="resident blocks (default 1M, 100k with --quick)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--dir", default="", help="where the trace and the stores go (a temporary directory)")
    ap.add_argument("--rate", type=float, default=5_000,
                    help="events/s of the paced part, what is written per event is measured over (16 engines' "
                         "steady state; at 1M blocks its ~200k events take ~40 s, longer than the kernel's 30 s "
                         "dirty-page expiry, so a page written back and dirtied again counts again)")
    ap.add_argument("--paced-share", type=float, default=1 / 3, help="the share of the trace's batches, at its "
                    "end, applied at --rate")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--probes", help=argparse.SUPPRESS)
    ap.add_argument("--answers", help=argparse.SUPPRESS)
    ap.add_argument("--art", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--residencies", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tree", default="", help="a source tree whose quilld/cluster/dir_entries.py (the directory's "
                    "owner store) is measured beside the index, when this one has none")
    from plot import add_flag

    add_flag(ap)
    args = ap.parse_args()
    if args.child == "ingest":
        child_ingest(args)
        return 0
    if args.child == "owned":
        child_owned(args)
        return 0
    if args.child == "crash":
        child_crash(args)
        return 0
    if args.child == "recover":
        child_recover(args)
        return 0
    blocks = args.blocks or (100_000 if args.quick else 1_000_000)
    work = Path(args.dir or tempfile.mkdtemp(prefix="index-study-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    t0 = time.monotonic()
    trace = work / "trace.pkl"
    shape = make_trace(trace, blocks)
    probes = work / "probes.json"
    probes.write_text(json.dumps(shape.pop("probes")[:4000]))
    print(f"trace: {shape['entries']:,} entries ({shape['residencies']:,} residencies) on {ENGINES} engines at "
          "the end; "
          f"{shape['events']:,} events ({shape['blocks']:,} block hashes) in {shape['batches']:,} batches of "
          f"{BATCH}, {shape['turns']:,} turns; HBM {shape['hbm_cap']:,} + CPU {shape['cpu_cap']:,} blocks an engine "
          f"({time.monotonic() - t0:.0f} s to generate)")
    results = {}
    art = importlib.util.find_spec("blart") is not None
    if not art:  # an optional row: the rest of the study needs nothing more
        print("ART row skipped: blart-py is not installed (it is in the bench extra: pip install -e '.[bench]')")
    for backend in args.backends.split(","):
        d = work / f"store-{backend}"
        shutil.rmtree(d, ignore_errors=True)
        ans = work / f"answers-{backend}.json"
        res = run_child("ingest", backend=backend, dir=d, trace=trace, probes=probes, answers=ans,
                        art=art and backend == "memory", rate=args.rate, **{"paced-share": args.paced_share})
        if backend != "memory":
            clean = run_child("recover", backend=backend, dir=d, probes=probes, answers=ans)
            res["clean"] = clean
            crash_dir = work / f"crash-{backend}"
            shutil.rmtree(crash_dir, ignore_errors=True)
            res["killed_at"] = crash_run(backend, str(crash_dir), trace, res["ingest"]["batches"])
            res["crash"] = run_child("recover", backend=backend, dir=crash_dir, probes=probes, trace=trace,
                                     verify=True)
            shutil.rmtree(crash_dir, ignore_errors=True)
        expected = json.loads(ans.with_suffix(".route.json").read_text())
        starts = [daemon_start(backend, d, work, expected) for _ in range(3)]  # a noisy machine: the median of 3
        res["daemon"] = sorted(starts, key=lambda x: x["first_route_s"])[1]
        res["daemon"]["correct"] = all(x["correct"] for x in starts)
        results[backend] = res
        print(f"{backend}: done ({time.monotonic() - t0:.0f} s so far)", flush=True)
    owner = ROOT / "quilld" / "cluster" / "dir_entries.py"
    if args.tree or owner.exists():
        results["_owned"] = run_child("owned", residencies=shape["residencies"], tree=args.tree)
    report(results, shape, args)
    if args.plot:
        figure(results, shape, args.plot)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {work / 'results.json'}; {time.monotonic() - t0:.0f} s in all")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def paced(r: dict) -> tuple[float, float]:
    """Bytes written per event and write amplification in the paced part (0, 0 without one)."""
    p = r["ingest"].get("paced")
    if not p or not r["ingest"]["paced_events"]:
        return 0.0, 0.0
    return p["write_bytes"] / r["ingest"]["paced_events"], (p["write_bytes"] / p["committed_bytes"]
                                                            if p["committed_bytes"] else 0.0)


def report(results: dict, shape: dict, args) -> None:
    owned = results.get("_owned")
    results = {k: v for k, v in results.items() if not k.startswith("_")}
    mem = results.get("memory")
    print()
    print(f"ingest as fast as it goes, then the last {args.paced_share:.0%} of the batches at {args.rate:,.0f} "
          "events/s; write figures of that paced part (B/ev, WA: /proc/self/io write_bytes over the bytes of "
          "the entries committed)")
    print(f"{'backend':<15}{'walk p50/p99 us':>17}{'ROUTE p50/p99 us':>18}{'events/s':>10}{'CPU us/ev':>10}"
          f"{'B/ev':>7}{'WA':>6}{'commits':>8}{'disk MiB':>9}{'RSS anon':>9}{'RSS file':>9}")
    for name, r in results.items():
        ing = r["ingest"]
        eps = ing["events"] / ing["busy_s"]
        per_event, wa = paced(r)
        commits = ing.get("paced", {}).get("commits", 0)
        print(f"{name:<15}{r['walk'][0]:>8.1f}/{r['walk'][1]:<8.1f}{r['route'][0]:>9.1f}/{r['route'][1]:<8.1f}"
              f"{eps:>10,.0f}{r['cpu_s'] / (ing['events'] + ing['paced_events']) * 1e6:>10.1f}{per_event:>7.0f}"
              f"{wa:>6.1f}{commits:>8}{mib(r.get('disk_bytes', 0)):>9}{mib(r['rss_anon']):>9}{mib(r['rss_file']):>9}")
    print()
    for name, r in results.items():
        if "store_walk" in r:
            print(f"{name}: the walk read through the store: p50 {r['store_walk'][0]:.1f} us, "
                  f"p99 {r['store_walk'][1]:.1f} us")
        if "art_walk" in r:
            print(f"ART (blart-py, {r['art_entries']:,} entries): walk p50 {r['art_walk'][0]:.1f} us, "
                  f"p99 {r['art_walk'][1]:.1f} us; {mib(r['art_rss'])} MiB beside the dicts, built in "
                  f"{r['art_build_s']:.1f} s")
        if "describe" in r:
            d, es = r["describe"], r.get("engine_stats", {})
            events = r["ingest"]["events"] + r["ingest"]["paced_events"]
            line = (f"{name}, whole run: {d['commits']:,} commits, {d['committed_rows']:,} rows, "
                    f"{mib(d['committed_bytes'])} MiB of entries committed; {mib(r['write_bytes'])} MiB written "
                    f"({r['write_bytes'] / events:.0f} B/event, "
                    f"{r['write_bytes'] / max(1, d['committed_bytes']):.1f}x)")
            if "wal_bytes" in es:
                rocks = es["wal_bytes"] + es["flush_write_bytes"] + es["compact_write_bytes"]
                debt = r.get("compaction_debt", 0)
                line += (f"; RocksDB's statistics: WAL {mib(es['wal_bytes'])} + flush {mib(es['flush_write_bytes'])} "
                         f"+ compaction {mib(es['compact_write_bytes'])} MiB = "
                         f"{rocks / max(1, es['bytes_written']):.1f}x "
                         f"its user bytes ({mib(es['bytes_written'])} MiB); a full compaction afterwards writes "
                         f"{mib(debt)} MiB more ({(rocks + debt) / max(1, es['bytes_written']):.1f}x in all) and "
                         f"leaves {mib(r.get('disk_bytes_compacted', 0))} MiB on disk")
            print(line)
    print()
    for name, r in results.items():
        for how in ("clean", "crash"):
            c = r.get(how)
            if not c:
                continue
            ms = {k: (c[k] - c[since]) * 1000 for k, since in (("t_imported", "t_spawn"), ("t_opened", "t_imported"))}
            line = (f"{name} after {'a clean stop' if how == 'clean' else 'kill -9'}: first ROUTE "
                    f"{(c['t_route'] - c['t_spawn']) * 1000:.0f} ms after exec (interpreter and the control plane's "
                    f"imports {ms['t_imported']:.0f} ms, open and load {c['entries']:,} entries "
                    f"{ms['t_opened']:.0f} ms, ROUTE {(c['t_route'] - c['t_opened']) * 1000:.1f} ms)")
            if how == "clean":
                line += f"; as before the stop: first ROUTE {c['first_correct']}, every probe {c['all_correct']}"
            else:
                line += (f"; killed after {r['killed_at']:,} batches, {c['crash_cursor_batches']:,} committed; "
                         f"every entry as the trace replayed to the persisted cursors: {c['crash_equal']}")
            print(line)
        dm = r.get("daemon")
        if dm:
            print(f"{name}: a whole quilld (python -m quilld) from exec to its first ROUTE over RESP: "
                  f"{dm['first_route_s'] * 1000:.0f} ms (median of 3), {dm['hits']} of {WALK} blocks credited, the "
                  f"plan before the stop: {dm['correct']}")
    if owned:
        o, i = owned["owned"], owned["index"]
        print(f"the directory's owner store (OwnedEntries) on {owned['residencies']:,} residencies: "
              f"{o['bytes_each']:.0f} B each (ResidencyIndex {i['bytes_each']:.0f}), built in {o['build_s']:.1f} s "
              f"({i['build_s']:.1f}), a {WALK}-block segment looked up in p50 {o['lookup'][0]:.1f} us, p99 "
              f"{o['lookup'][1]:.1f} us (leading_masks {i['lookup'][0]:.1f} / {i['lookup'][1]:.1f} us)")
    if mem:
        print()
        mem_eps = mem["ingest"]["events"] / mem["ingest"]["busy_s"]
        for name, r in results.items():
            if name != "memory":
                eps = r["ingest"]["events"] / r["ingest"]["busy_s"]
                print(f"{name}/memory: ROUTE p50 {r['route'][0] / mem['route'][0]:.2f}x, walk p50 "
                      f"{r['walk'][0] / mem['walk'][0]:.2f}x, events/s {eps / mem_eps:.2f}x")


def figure(results: dict, shape: dict, path: str) -> None:
    from plot import Panel, save

    results = {k: v for k, v in results.items() if not k.startswith("_")}
    names = list(results)
    base = results.get("memory") or next(iter(results.values()))
    walk_cats, p50, p99 = ["dicts\n(every backend)"], [base["walk"][0]], [base["walk"][1]]
    for name, r in results.items():
        if "art_walk" in r:
            walk_cats.append("ART\n(blart-py)")
            p50.append(r["art_walk"][0])
            p99.append(r["art_walk"][1])
    for name, r in results.items():
        if "store_walk" in r and not name.endswith("-nosync"):
            walk_cats.append(f"{name}\nread-through")
            p50.append(r["store_walk"][0])
            p99.append(r["store_walk"][1])
    eps = [r["ingest"]["events"] / r["ingest"]["busy_s"] / 1000 for r in results.values()]
    per_event = [paced(r)[0] for r in results.values()]
    wa = [f"{paced(r)[1]:.1f}x" if paced(r)[1] else "-" for r in results.values()]
    persistent = [n for n in names if "clean" in results[n]]
    clean = [(results[n]["clean"]["t_route"] - results[n]["clean"]["t_spawn"]) * 1000 for n in persistent]
    crash = [(results[n]["crash"]["t_route"] - results[n]["crash"]["t_spawn"]) * 1000 for n in persistent]
    anon = [r["rss_anon"] / 2**20 for r in results.values()]
    disk = [r.get("disk_bytes", 0) / 2**20 for r in results.values()]
    panels = [
        Panel(f"ROUTE's walk of {WALK} blocks, {shape['entries'] / 1e6:.2f}M entries (us, log)", walk_cats,
              {"p50": p50, "p99": p99}, "microseconds", logy=True),
        Panel(f"events applied per second, {BATCH} per batch (thousands)", names, {"events/s": eps}, "k events/s",
              labels=[f"{e / eps[0]:.2f}x" for e in eps]),
        Panel("bytes written per event at a steady pace (log), write amplification",
              [n for n in names if n != "memory"],
              {"bytes/event": [b for n, b in zip(names, per_event) if n != "memory"]}, "bytes",
              labels=[w for n, w in zip(names, wa) if n != "memory"], logy=True),
        Panel("first correct ROUTE after exec (ms)", persistent, {"after a clean stop": clean, "after kill -9": crash},
              "milliseconds"),
        Panel("memory and disk (MiB)", names, {"RSS beyond the trace (anon)": anon, "on disk": disk}, "MiB"),
        Panel("a whole quilld: exec to its first ROUTE (ms)", names,
              {"first ROUTE": [r["daemon"]["first_route_s"] * 1000 for r in results.values()]}, "milliseconds",
              labels=[f"{r['daemon']['hits']}/{WALK} hits" for r in results.values()]),
    ]
    save(path, panels, "The residency index: one trace, every backend",
         note=f"{shape['events']:,} vLLM-shaped events, {ENGINES} engines; each backend in its own process; "
              "LMDB and RocksDB keep the in-memory dicts for reads (write-through), read-through shown beside")


if __name__ == "__main__":
    sys.exit(main())
