"""Reading blocks from quilld: redis-py `get` (a new bytes object) against `QuillClient.get_into`
(straight into a preallocated numpy buffer) and `get_many_into` (pipelined batches), in one run.

Starts its own quilld (2 GiB arena) on a free loopback port, loads 16 blocks of each size,
then for each size runs every method in turn, `--rounds` times with the order rotated,
and prints the median GB/s of each and the ratios. A second table does the same for
writes (redis-py `set`, `QuillClient.put`, `put_blocks`).

    python bench/get_into_bench.py --rounds 3
    python bench/get_into_bench.py --rounds 3 --mooncake    # also Mooncake Store, if it runs here
    python bench/get_into_bench.py --rounds 1 --mib 64 --mooncake --plot docs/img/get_into.png   # and a figure
    python bench/get_into_bench.py --rounds 3 --mib 64 --sizes 64KiB,1MiB,4MiB --cpu-hog --mooncake

`--cpu-hog` keeps one core busy (`python3 -c 'while True: pass'`) for the whole run, as a
serving machine's other work would: a read that needs quilld to run (a round trip) then
competes for the CPU, one served from shared memory by the client alone does not.

`--mooncake` (optional, never a dependency): needs `pip install mooncake-transfer-engine-non-cuda`
and Debian's `libibverbs1` (in a throwaway venv that sees the system's packages, say:
`python3 -m venv --system-site-packages /tmp/mcvenv && /tmp/mcvenv/bin/pip install
mooncake-transfer-engine-non-cuda`, then run the bench with `/tmp/mcvenv/bin/python` and
`/tmp/mcvenv/bin` on PATH, where `mooncake_master` is). It runs `mooncake_master` and a store client (P2PHANDSHAKE metadata,
TCP transport, MC_STORE_MEMCPY=0 so a local read still goes through the transport) inside a
private network namespace (`unshare -n`, loopback only) together with a second quilld, measures
both single-threaded in turn (order swapped each round, so both see the same machine load) and
prints Mooncake's put_from / get_into / batch_put_from / batch_get_into next to quilld's put /
get_into / put_blocks / get_many_into, and put_from also next to a put_blocks of one block and a
raw RESP SET (one sendmsg, no client library: what quilld itself costs a put). If any of that is not possible on the machine, it says
exactly why and skips the section.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
try:
    import quillclient  # noqa: F401
except ImportError:  # not installed: use the source tree (redis, hiredis and crc32c are still needed)
    sys.path.insert(0, str(ROOT / "clients" / "python"))

sys.path.insert(0, str(ROOT / "tests"))
from procs import free_port, stop_process as stop, wait_port  # noqa: E402
from plot import Panel, add_flag, ratio, save  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
SIZES = [64 * KiB, MiB, 4 * MiB, 32 * MiB]
MOONCAKE_SIZES = [64 * KiB, MiB, 4 * MiB]


def parse_size(text: str) -> int:
    """64KiB, 1MiB, 4MiB (or plain bytes)."""
    for unit, mult in (("KiB", KiB), ("MiB", MiB)):
        if text.endswith(unit):
            return int(text[:-len(unit)]) * mult
    return int(text)


def human(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn, count: int) -> float:
    t0 = time.perf_counter()
    for i in range(count):
        fn(i)
    return time.perf_counter() - t0


def median_table(results: dict) -> dict:
    return {k: statistics.median(v) for k, v in results.items()}


# -- quilld ---------------------------------------------------------------------------

def bench_quilld(port: int, rounds: int, budget: int, batch: int, sizes: list[int]) -> tuple[dict, dict]:
    import redis

    from quillclient import QuillClient

    r = redis.Redis(port=port, socket_timeout=60)  # RESP2, hiredis parser: redis-py as people use it
    qc = QuillClient("127.0.0.1", port, socket_timeout=60, parallelism=2, shared_memory="off")  # over TCP
    qs = QuillClient("127.0.0.1", port, socket_timeout=60, shared_memory="require")  # over shared memory
    rng = np.random.default_rng(1)
    data = {size: [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(batch)] for size in sizes}
    keys = {size: [f"blk:{size}:{i}" for i in range(batch)] for size in sizes}
    for size in sizes:
        assert qc.put_blocks(dict(zip(keys[size], data[size]))) == [True] * batch
        bufs = [np.empty(size, np.uint8) for _ in range(batch)]
        assert qc.get_many_into(keys[size], bufs) == [size] * batch
        assert all(np.array_equal(a, b) for a, b in zip(bufs, data[size])), "read back differs"
        assert r.get(keys[size][0]) == data[size][0].tobytes()

    gets: dict = {}
    puts: dict = {}
    serial = [0]

    def fresh_keys(n: int) -> list[str]:
        serial[0] += 1
        return [f"put:{serial[0]}:{i}" for i in range(n)]

    # Preallocated and touched once, as a serving engine's KV buffers are: no page faults while timed.
    targets = {size: [np.ones(size, np.uint8) for _ in range(batch)] for size in sizes}
    for rnd in range(rounds):
        for size in sizes:
            ks, bufs = keys[size], targets[size]
            ops = max(budget // size, 2 * batch)
            batches = max(ops // batch, 2)
            pipe_ks = ks

            def redis_get(i):
                r.get(ks[i % batch])

            def quill_get_into(i):
                qc.get_into(ks[i % batch], bufs[i % batch])

            def redis_pipeline(i):
                p = r.pipeline(transaction=False)
                for k in pipe_ks:
                    p.get(k)
                p.execute()

            def quill_get_many_into(i):
                qc.get_many_into(ks, bufs)

            srcs = data[size]

            def shm_get_into(i):
                qs.get_into(ks[i % batch], bufs[i % batch])

            def shm_get_many_into(i):
                qs.get_many_into(ks, bufs)

            def memcpy(i):  # the ceiling: the same bytes copied within this process
                np.copyto(bufs[i % batch], srcs[i % batch])

            def memcpy_batch(i):
                for b, a in zip(bufs, srcs):
                    np.copyto(b, a)

            methods = [("redis-py get", redis_get, ops, size),
                       ("get_into", quill_get_into, ops, size),
                       (f"redis-py pipeline x{batch}", redis_pipeline, batches, size * batch),
                       (f"get_many_into x{batch}", quill_get_many_into, batches, size * batch),
                       ("shm get_into", shm_get_into, ops, size),
                       (f"shm get_many_into x{batch}", shm_get_many_into, batches, size * batch),
                       ("memcpy", memcpy, ops, size), (f"memcpy x{batch}", memcpy_batch, batches, size * batch)]
            shift = rnd % len(methods)
            for name, fn, count, unit in methods[shift:] + methods[:shift]:
                fn(0)  # warm: connections open, buffers touched
                gets.setdefault((size, name), []).append(gbps(count * unit, timed(fn, count)))

            # writes: fresh keys each time (put_blocks skips complete ones), dropped untimed afterwards
            src = data[size]
            as_bytes = [a.tobytes() for a in src]
            put_ops = max(min(ops, (512 * MiB) // size), batch)
            put_batches = max(put_ops // batch, 2)
            wmethods = [("redis-py set", lambda k, i: r.set(k[i], as_bytes[i % batch]), put_ops, size, False),
                        ("put", lambda k, i: qc.put(k[i], src[i % batch]), put_ops, size, False),
                        (f"put_blocks x{batch}",
                         lambda k, i: qc.put_blocks(dict(zip(k[i * batch:(i + 1) * batch], src))),
                         put_batches, size * batch, True)]
            shift = rnd % len(wmethods)
            for name, fn, count, unit, batched in wmethods[shift:] + wmethods[:shift]:
                k = fresh_keys(count * (batch if batched else 1))
                seconds = timed(lambda i: fn(k, i), count)
                puts.setdefault((size, name), []).append(gbps(count * unit, seconds))
                for lo in range(0, len(k), 256):
                    r.delete(*k[lo:lo + 256])
    assert qs.transport == "shm" and qs.shm_stale_reads == 0, "the shared-memory reads all went through the mapping"
    qc.close()
    qs.close()
    r.close()
    return median_table(gets), median_table(puts)


def print_tables(gets: dict, puts: dict, sizes: list[int], batch: int) -> None:
    g1, g2, g3, g4 = "redis-py get", "get_into", f"redis-py pipeline x{batch}", f"get_many_into x{batch}"
    print(f"\nReads, GB/s (median)\n\n| block | {g1} | {g2} | get_into/redis-py | {g3} | {g4} "
          f"| batched/redis-py pipeline | {g4} / {g1} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in sizes:
        a, b, c, d = (gets[(s, m)] for m in (g1, g2, g3, g4))
        print(f"| {human(s)} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {c:.2f} | {d:.2f} | {d / c:.2f}x | {d / a:.2f}x |")
    m1, m2, s1, s2 = "memcpy", f"memcpy x{batch}", "shm get_into", f"shm get_many_into x{batch}"
    print(f"\nReads over shared memory, GB/s (median): quillclient over the mapping against a plain memcpy of the "
          f"same bytes (numpy copyto, the ceiling), quillclient over TCP and redis-py\n\n| block | {m1} | {s1} "
          f"| shm/memcpy | shm/TCP get_into | shm/redis-py get | {m2} | {s2} | shm/memcpy | shm/TCP get_many_into |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in sizes:
        a, b, c, d, t1, t2, rp = (gets[(s, m)] for m in (m1, s1, m2, s2, g2, g4, g1))
        print(f"| {human(s)} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {b / t1:.2f}x | {b / rp:.2f}x | {c:.2f} | {d:.2f} "
              f"| {d / c:.2f}x | {d / t2:.2f}x |")
    p1, p2, p3 = "redis-py set", "put", f"put_blocks x{batch}"
    print(f"\nWrites, GB/s (median)\n\n| block | {p1} | {p2} | put/redis-py | {p3} | put_blocks/redis-py |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in sizes:
        a, b, c = (puts[(s, m)] for m in (p1, p2, p3))
        print(f"| {human(s)} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {c:.2f} | {c / a:.2f}x |")


# -- Mooncake (optional) ------------------------------------------------------------

def mooncake_unavailable() -> str | None:
    """Why the Mooncake section cannot run here, or None."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        return (f"cannot import mooncake.store ({e}); it needs `pip install mooncake-transfer-engine-non-cuda` "
                "and Debian's libibverbs1")
    if shutil.which("mooncake_master") is None:
        return "mooncake.store imports but the mooncake_master command is not on PATH"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux / iproute2): no private network namespace"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a private network namespace (`unshare -n`): {probe.stderr.strip() or probe.returncode}"
    return None


def start_quilld(dram: str, log, unixsocket: str = "") -> tuple[subprocess.Popen, int]:
    """A quilld on a free port; with `unixsocket`, listening there too and mappable by `default`."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = str(ROOT)
    shm = ["--unixsocket", unixsocket, "--map-users", "default"] if unixsocket else []
    proc = subprocess.Popen([sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(port),
                             "--admin-port", "0", "--dram", dram, "--log-level", "warning", *shm],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, port


class MooncakeSide:
    """Mooncake Store's four operations on one size, from registered numpy buffers."""

    def __init__(self, store, size: int, batch: int, src: np.ndarray, dst: np.ndarray, tag: str) -> None:
        self.store, self.size, self.batch = store, size, batch
        self.sp = [src.ctypes.data + i * size for i in range(batch)]
        self.dp = [dst.ctypes.data + i * size for i in range(batch)]
        self.sizes = [size] * batch
        self.keys = [f"mc:{tag}:{i}" for i in range(batch)]
        self.written: list[str] = []
        codes = store.batch_put_from(self.keys, self.sp, self.sizes)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"batch_put_from returned {codes}")
        if store.batch_get_into(self.keys, self.dp, self.sizes) != self.sizes or not np.array_equal(src, dst):
            raise RuntimeError("batch_get_into returned other sizes or other bytes")

    def put(self, keys: list[str], i: int) -> None:
        if self.store.put_from(keys[i], self.sp[i % self.batch], self.size) != 0:
            raise RuntimeError("put_from failed")

    def get(self, i: int) -> None:
        if self.store.get_into(self.keys[i % self.batch], self.dp[i % self.batch], self.size) != self.size:
            raise RuntimeError("get_into failed")

    def batch_put(self, keys: list[str], i: int) -> None:
        codes = self.store.batch_put_from(keys[i * self.batch:(i + 1) * self.batch], self.sp, self.sizes)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"batch_put_from returned {codes}")

    def batch_get(self, i: int) -> None:
        if self.store.batch_get_into(self.keys, self.dp, self.sizes) != self.sizes:
            raise RuntimeError("batch_get_into failed")

    def drop(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)


class RawResp:
    """A raw RESP client, as small as one can be: SET as one sendmsg of the command's header, the
    caller's bytes and CRLF (no copy), then its `+OK` read back. What quilld itself costs a put."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set(self, key: str, data: np.ndarray) -> None:
        view = memoryview(data).cast("B")
        k = key.encode()
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(k), k, view.nbytes)
        pieces = [head, view, b"\r\n"]
        sent = self.sock.sendmsg(pieces)  # a blocking socket takes it all but for a signal
        for piece in pieces:  # what a partial send left, in order
            n = len(piece)
            if sent < n:
                self.sock.sendall(memoryview(piece)[sent:])
            sent = max(0, sent - n)
        reply = self.sock.recv(64)
        while not reply.endswith(b"\r\n"):
            reply += self.sock.recv(64)
        if reply != b"+OK\r\n":
            raise RuntimeError(f"SET answered {reply!r}")

    def close(self) -> None:
        self.sock.close()


class QuilldSide:
    """The same four operations with QuillClient: put, get_into, put_blocks, get_many_into; over
    TCP also one block per put_blocks call and a raw RESP SET (`extra`)."""

    def __init__(self, qc, size: int, batch: int, src: np.ndarray, dst: np.ndarray, tag: str) -> None:
        self.qc, self.batch = qc, batch
        self.src = [src[i * size:(i + 1) * size] for i in range(batch)]
        self.dst = [dst[i * size:(i + 1) * size] for i in range(batch)]
        self.keys = [f"qc:{tag}:{i}" for i in range(batch)]
        if qc.put_blocks(dict(zip(self.keys, self.src))) != [True] * batch:
            raise RuntimeError("put_blocks did not store every block")
        if qc.get_many_into(self.keys, self.dst) != [size] * batch or not np.array_equal(src, dst):
            raise RuntimeError("get_many_into returned other sizes or other bytes")
        self.raw: RawResp | None = None

    def put(self, keys: list[str], i: int) -> None:
        self.qc.put(keys[i], self.src[i % self.batch])

    def put_one(self, keys: list[str], i: int) -> None:
        self.qc.put_blocks({keys[i]: self.src[i % self.batch]})

    def raw_put(self, keys: list[str], i: int) -> None:
        if self.raw is None:
            self.raw = RawResp(self.qc.config.host, self.qc.config.port)
        self.raw.set(keys[i], self.src[i % self.batch])

    def get(self, i: int) -> None:
        self.qc.get_into(self.keys[i % self.batch], self.dst[i % self.batch])

    def batch_put(self, keys: list[str], i: int) -> None:
        self.qc.put_blocks(dict(zip(keys[i * self.batch:(i + 1) * self.batch], self.src)))

    def batch_get(self, i: int) -> None:
        self.qc.get_many_into(self.keys, self.dst)

    def drop(self, keys: list[str]) -> None:
        for lo in range(0, len(keys), 256):
            self.qc.delete(*keys[lo:lo + 256])
        if self.raw is not None:
            self.raw.close()
            self.raw = None


def mooncake_child(rounds: int, budget: int, batch: int) -> None:
    """Runs inside `unshare -n`: mooncake_master, a Mooncake store client and a quilld, all on
    127.0.0.1, measured in turn (order swapped each round) so both see the same machine."""
    os.environ["MC_STORE_MEMCPY"] = "0"
    from mooncake.store import MooncakeDistributedStore

    from quillclient import QuillClient

    log = open(os.environ.get("MC_BENCH_LOG", os.devnull), "w")
    master = subprocess.Popen(["mooncake_master", "-rpc_address", "127.0.0.1", "-rpc_port", "50051",
                               "-enable_metric_reporting=false", "-metrics_port", "9003"],
                              stdout=log, stderr=subprocess.STDOUT)
    quilld = None
    try:
        wait_port(50051, master)
        sock_dir = tempfile.mkdtemp(prefix="mcq")
        quilld, port = start_quilld("2GiB", log, os.path.join(sock_dir, "q.sock"))
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 1536 * MiB, 512 * MiB, "tcp", "", "127.0.0.1:50051")
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        qc = QuillClient("127.0.0.1", port, socket_timeout=60, parallelism=2, shared_memory="off")
        qs = QuillClient("127.0.0.1", port, socket_timeout=60, shared_memory="require")
        rng = np.random.default_rng(2)
        results: dict[str, list[float]] = {}
        serial = [0]
        for rnd in range(rounds):
            for size in MOONCAKE_SIZES:
                src = rng.integers(0, 256, size * batch, dtype=np.uint8)
                dst = np.ones(size * batch, np.uint8)  # touched: no page faults while timed
                for arr in (src, dst):
                    if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                        raise RuntimeError("register_buffer failed")
                serial[0] += 1
                sides = [("mooncake", MooncakeSide(store, size, batch, src, dst, str(serial[0]))),
                         ("quilld", QuilldSide(qc, size, batch, src, dst, str(serial[0]))),
                         ("quilld-shm", QuilldSide(qs, size, batch, src, dst, "s" + str(serial[0])))]
                ops = max(budget // size, 2 * batch)
                batches = max(ops // batch, 2)
                for who, side in sides[rnd % 3:] + sides[:rnd % 3]:
                    serial[0] += 1
                    put_keys = [f"p:{serial[0]}:{i}" for i in range(ops)]
                    bput_keys = [f"b:{serial[0]}:{i}" for i in range(batches * batch)]
                    one_keys = [f"o:{serial[0]}:{i}" for i in range(ops)]
                    raw_keys = [f"r:{serial[0]}:{i}" for i in range(ops)]
                    extra = (("put one", partial(side.put_one, one_keys), ops, size),
                             ("raw put", partial(side.raw_put, raw_keys), ops, size)) if who == "quilld" else ()
                    for op, fn, count, unit in (("put", partial(side.put, put_keys), ops, size),
                                                ("get", side.get, ops, size),
                                                ("batch put", partial(side.batch_put, bput_keys), batches,
                                                 size * batch),
                                                ("batch get", side.batch_get, batches, size * batch), *extra):
                        results.setdefault(f"{who}|{size}|{op}", []).append(gbps(count * unit, timed(fn, count)))
                    side.drop(put_keys + bput_keys + side.keys + (one_keys + raw_keys if extra else []))
                for arr in (src, dst):
                    store.unregister_buffer(arr.ctypes.data)
        qc.close()
        qs.close()
        store.close()
        print("MOONCAKE_RESULT " + json.dumps({k: statistics.median(v) for k, v in results.items()}), flush=True)
    finally:
        if quilld is not None:
            stop(quilld)
        stop(master)
        log.close()


def run_mooncake(rounds: int, budget: int, batch: int, logdir: str) -> dict | str:
    """{(who, size, op): median GB/s}, or the reason it could not run."""
    why = mooncake_unavailable()
    if why:
        return why
    log = os.path.join(logdir, "mooncake.log")
    script = (f"ip link set lo up && exec {sys.executable} {Path(__file__).resolve()} --mooncake-child "
              f"--rounds {rounds} --mib {budget // MiB} --batch {batch}")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, MC_BENCH_LOG=log, MC_STORE_MEMCPY="0"))
    for line in proc.stdout.splitlines():
        if line.startswith("MOONCAKE_RESULT "):
            raw = json.loads(line.split(" ", 1)[1])
            return {(k.split("|")[0], int(k.split("|")[1]), k.split("|")[2]): v for k, v in raw.items()}
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
    return f"the Mooncake run failed (exit {proc.returncode}); last lines:\n{tail}"


def print_mooncake(mc: dict, batch: int) -> None:
    names = {"put": "put_from / put", "get": "get_into / get_into",
             "batch put": f"batch_put_from / put_blocks (x{batch})",
             "batch get": f"batch_get_into / get_many_into (x{batch})"}
    print("\nMooncake Store (TCP transport, P2PHANDSHAKE, MC_STORE_MEMCPY=0) vs quilld, both in one private "
          "network namespace, measured in turn; GB/s (median), single thread\n")
    def table(quilld: str, label: str, extra: tuple = ()) -> None:
        """Per size, each op's Mooncake and `quilld` figures; `extra`: (quilld op, row name)
        pairs set against Mooncake's put_from."""
        print(f"| block | Mooncake op / quilld op | Mooncake | {label} | {label}/Mooncake |")
        print("|---|---|---:|---:|---:|")
        for size in MOONCAKE_SIZES:
            rows = [(op, op, names[op]) for op in ("put", "get", "batch put", "batch get")]
            for m_op, q_op, name in rows + [("put", op, name) for op, name in extra]:
                m, q = mc[("mooncake", size, m_op)], mc[(quilld, size, q_op)]
                print(f"| {human(size)} | {name} | {m:.2f} | {q:.2f} | {q / m:.2f}x |")

    table("quilld", "quilld", (("put one", "put_from / put_blocks (x1)"), ("raw put", "put_from / raw RESP SET")))
    print("\nquilld over shared memory (same host, mapped arena) vs Mooncake Store's TCP transport, same run\n")
    table("quilld-shm", "quilld shm")


def plot(path: str, gets: dict, puts: dict, mc: dict | None, batch: int, rounds: int) -> None:
    """quilld's client against redis-py (reads, writes) and, when measured, against Mooncake Store."""
    cats = [human(s) for s in SIZES]
    g = {m: [gets[(s, m)] for s in SIZES] for m in ("redis-py get", "get_into", f"redis-py pipeline x{batch}",
                                                    f"get_many_into x{batch}")}
    w = {m: [puts[(s, m)] for s in SIZES] for m in ("redis-py set", "put", f"put_blocks x{batch}")}
    panels = [Panel("reads: quillclient vs redis-py (get_into/redis-py get)", cats, g, "GB/s (median)",
                    [ratio(b, a) for a, b in zip(g["redis-py get"], g["get_into"])]),
              Panel("writes: quillclient vs redis-py (put/redis-py set)", cats, w, "GB/s (median)",
                    [ratio(b, a) for a, b in zip(w["redis-py set"], w["put"])])]
    if mc is not None:
        for ops, title in ((("get", "batch get"), "reads"), (("put", "batch put"), "writes")):
            keys = [(s, op) for op in ops for s in MOONCAKE_SIZES]
            m = [mc[("mooncake", s, op)] for s, op in keys]
            q = [mc[("quilld", s, op)] for s, op in keys]
            panels.append(Panel(f"{title} vs Mooncake Store over TCP (quilld/Mooncake)",
                                [f"{human(s)}\n{op.replace('batch ', f'x{batch} ')}" for s, op in keys],
                                {"Mooncake Store": m, "quilld": q}, "GB/s (median)",
                                [ratio(b, a) for a, b in zip(m, q)]))
    save(path, panels, "Reading and writing KV blocks from Python (bench/get_into_bench.py), one thread",
         f"{os.cpu_count()} cores shared with other work (noisy); medians of {rounds} round(s); x{batch}: batched "
         "calls of that many blocks. Mooncake: TCP transport, P2PHANDSHAKE, MC_STORE_MEMCPY=0, private net namespace.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, order rotated each round (median taken)")
    ap.add_argument("--mib", type=int, default=256, help="MiB moved per measurement (at least 2 batches)")
    ap.add_argument("--batch", type=int, default=16, help="keys per get_many_into / pipeline / put_blocks call")
    ap.add_argument("--mooncake", action="store_true", help="also measure Mooncake Store, if it runs here")
    ap.add_argument("--quick", action="store_true", help="one round of 32 MiB per measurement (a smoke run)")
    ap.add_argument("--sizes", default="", help="block sizes to measure, e.g. 64KiB,1MiB,4MiB (default: all)")
    ap.add_argument("--cpu-hog", action="store_true", help="keep one core busy for the whole run (another process)")
    ap.add_argument("--mooncake-child", action="store_true", help=argparse.SUPPRESS)
    add_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.mib = 1, 32
    budget = args.mib * MiB
    if args.mooncake_child:
        mooncake_child(args.rounds, budget, args.batch)
        return 0

    sizes = [parse_size(x) for x in args.sizes.split(",")] if args.sizes else SIZES
    tmp = tempfile.mkdtemp(prefix="quilld-getinto-bench-")
    log = open(os.path.join(tmp, "quilld.log"), "wb")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.cpu_hog else None
    print(f"load average before: {os.getloadavg()}; one core kept busy by pid {hog.pid}" if hog else
          f"load average before: {os.getloadavg()}", flush=True)
    try:
        proc, port = start_quilld("2GiB", log, os.path.join(tmp, "q.sock"))
        try:
            import redis

            print(f"quilld on 127.0.0.1:{port}, 2 GiB arena; redis-py {redis.__version__}; {os.cpu_count()} cores; "
                  f"{args.rounds} round(s), {args.mib} MiB per measurement, batches of {args.batch}", flush=True)
            gets, puts = bench_quilld(port, args.rounds, budget, args.batch, sizes)
            print_tables(gets, puts, sizes, args.batch)
        finally:
            stop(proc)
            log.close()
        if args.mooncake:
            mc = run_mooncake(args.rounds, min(budget, 128 * MiB), args.batch, tmp)
            if isinstance(mc, str):
                print(f"\nMooncake section skipped: {mc}")
            else:
                print_mooncake(mc, args.batch)
    finally:
        if hog is not None:
            stop(hog)
    print(f"\nload average after: {os.getloadavg()}")
    if args.plot and sizes == SIZES:
        plot(args.plot, gets, puts, mc if args.mooncake and not isinstance(mc, str) else None, args.batch,
             args.rounds)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
