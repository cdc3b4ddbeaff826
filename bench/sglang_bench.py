"""SGLang HiCache L3: quilld (`QuillHiCacheStorage`) against SGLang's own file backend, one run.

Each round stores `--pages` pages (SGLang's STORAGE_BATCH_SIZE, 128: one controller batch) of
every size, then reads them back, through each of three sides in turn (the order rotated every
round): SGLang's file backend, quilld on SGLang's generic path, quilld on the v1 path. It prints
the median MiB/s of writes and reads, quilld's ratios to the file backend, and the CPU time a
page cost. The calls are the ones SGLang 0.5.23's `CacheController` makes
(`sglang/srt/managers/cache_controller.py`):

- write: `_generic_page_set`, `get_data_page(host_index)` per page then `batch_set(hashes,
  pages)`; or `_page_set_zero_copy`, `batch_set_v1(hashes, host_indices)` (the file backend has
  no v1 calls: SGLang runs it on the generic path);
- read: `_storage_hit_query` (`batch_exists(hashes)`), then `_generic_page_get`,
  `batch_get(hashes, [get_dummy_flat_data_page() per page])` and
  `set_from_flat_data_page(host_index, page)` per page; or `_page_get_zero_copy`,
  `batch_get_v1(hashes, host_indices)`.

Every read is checked byte for byte against what was written. Pages are MHA pages of 8 layers,
4 KV heads of 128 in bfloat16 (16 KiB a token), `page_size` tokens each: 16 tokens for 256 KiB,
48 for 768 KiB, 128 for 2 MiB, 512 for 8 MiB. The host pool is `--layout` (page_first).

With SGLang importable (its own virtual environment, see docs/connectors.md), the host pool is
SGLang's `MHATokenToKVPoolHost` on CPU, the file backend is SGLang's `HiCacheFile`, and the write
and read steps are SGLang's own `CacheController` methods. Without it, they are copies of the same
code (numpy host pool with SGLang's layouts; `HiCacheFile`'s I/O: `os.path.exists`, `tofile` to a
temporary file and `os.replace`, `open(buffering=0).readinto`), and the output says which.

quilld runs with a unix socket and `--map-users default`, so the client moves pages through
shared memory (`--tcp`: over TCP instead). The file backend writes to `--dir` (default: a
temporary directory under /tmp), a local disk; reads come back from the page cache, as they do
for SGLang.

    python bench/sglang_bench.py                       # 256 KiB, 768 KiB, 2 MiB, 8 MiB; 5 rounds
    python bench/sglang_bench.py --layout layer_first --rounds 3
    /work/venvs/sglang/bin/python bench/sglang_bench.py  # with SGLang's own classes
    python bench/sglang_bench.py --plot sglang.png     # also the figure (the `bench` extra)

tools/sglang_check.py, in SGLang's environment, checks the same steps for every host pool layout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (os.path.join(ROOT, "clients", "python"), os.path.join(ROOT, "wire")):
    if path not in sys.path:
        sys.path.insert(0, path)

sys.path.insert(0, os.path.join(ROOT, "tests"))

from plot import Panel, add_flag, ratio, save  # noqa: E402
from procs import start_listening, stop_process  # noqa: E402
from quillclient.sglang import QuillHiCacheStorage  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
LAYERS, HEADS, DIM, ITEM = 8, 4, 128, 2  # bfloat16
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * ITEM  # 16 KiB: K and V of every layer
SIZES = [256 * KiB, 768 * KiB, 2 * MiB, 8 * MiB]

try:
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController as _Controller
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    SGLANG = True
except ImportError:
    torch = None
    SGLANG = False


# -- host pools -------------------------------------------------------------------

class NumpyHostPool:
    """SGLang's MHATokenToKVPoolHost (mem_cache/pool_host/mha.py) for one layout, over numpy:
    kv_buffer, get_data_page, get_dummy_flat_data_page, set_from_flat_data_page, get_page_buffer_meta."""

    def __init__(self, tokens: int, page_size: int, layout: str) -> None:
        self.size, self.page_size, self.layout = tokens, page_size, layout
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        dims = {"page_first": (2, tokens, LAYERS, HEADS, DIM), "layer_first": (2, LAYERS, tokens, HEADS, DIM)}[layout]
        self.kv_buffer = np.zeros(dims, np.uint16)

    def _page(self, index: int) -> np.ndarray:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index:index + self.page_size]
        return self.kv_buffer[:, index:index + self.page_size]

    def get_data_page(self, index: int, flat: bool = True) -> np.ndarray:
        page = self._page(int(index))
        return page.reshape(-1) if flat else page  # as torch's flatten: a view, a copy if strided (layer_first)

    def get_dummy_flat_data_page(self) -> np.ndarray:
        return np.zeros(2 * LAYERS * self.page_size * HEADS * DIM, np.uint16)

    def set_from_flat_data_page(self, index: int, data_page: np.ndarray) -> None:
        page = self._page(int(index))
        page[...] = data_page.reshape(page.shape)

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        indices = list(indices)
        base, item = self.kv_buffer.ctypes.data, ITEM
        v_offset = LAYERS * self.size * HEADS * DIM * item
        ptrs = []
        if self.layout == "layer_first":
            for index in indices[::self.page_size]:
                for layer in range(LAYERS):
                    k = base + int(index) * HEADS * DIM * item + layer * self.size * HEADS * DIM * item
                    ptrs += [k, k + v_offset]
            return ptrs, [item * self.page_size * HEADS * DIM] * len(ptrs)
        for index in indices[::self.page_size]:
            k = base + int(index) * LAYERS * HEADS * DIM * item
            ptrs += [k, k + v_offset]
        return ptrs, [LAYERS * item * self.page_size * HEADS * DIM] * len(ptrs)

    def fill(self, seed: int) -> None:
        flat = self.kv_buffer.reshape(-1)
        flat[:] = np.random.default_rng(seed).integers(0, 1 << 16, flat.size, dtype=np.uint16)

    def page_bytes(self, index: int) -> bytes:
        return self.get_data_page(index).tobytes()


class SGLangHostPool:
    """SGLang's own MHATokenToKVPoolHost on CPU, over a (small) CPU device pool of the same geometry."""

    def __init__(self, tokens: int, page_size: int, layout: str) -> None:
        device = MHATokenToKVPool(size=2 * page_size, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS,
                                  head_dim=DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                  enable_alt_stream=False)
        # the host pool's size: device_capacity_tokens x the ratio (1.0), plus one padding page
        self.pool = MHATokenToKVPoolHost(device._mha_buffer_info(), 1.0, 0, page_size, layout, pin_memory=False,
                                         device="cpu", device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS)

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        flat = self.pool.kv_buffer.view(-1).view(torch.int16)
        flat.copy_(torch.randint(-(1 << 15), 1 << 15, flat.shape, dtype=torch.int16, generator=g))

    def page_bytes(self, index: int) -> bytes:
        return self.pool.get_data_page(index).view(torch.uint8).numpy().tobytes()


def host_pool(tokens: int, page_size: int, layout: str):
    """(the pool SGLang hands the backend, a helper with fill and page_bytes)"""
    if SGLANG:
        p = SGLangHostPool(tokens, page_size, layout)
        return p.pool, p
    p = NumpyHostPool(tokens, page_size, layout)
    return p, p


def index_array(start: int, stop: int):
    return torch.arange(start, stop, dtype=torch.int64) if SGLANG else np.arange(start, stop)


# -- the file backend ----------------------------------------------------------------

class FileBackendCopy:
    """HiCacheFile's I/O (sglang/srt/mem_cache/hicache_storage.py, 0.5.23) without SGLang: set skips
    an existing file, writes the page to a temporary file and renames it; get reads it into the
    target with one unbuffered readinto; exists is os.path.exists. (The LRU evictor is off unless
    a size cap is configured, as here.)"""

    def __init__(self, path: str, suffix: str) -> None:
        self.file_path, self.suffix = path, suffix

    def _path(self, key: str) -> str:
        return os.path.join(self.file_path, f"{key}{self.suffix}.bin")

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def batch_exists(self, keys, extra_info=None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def set(self, key: str, value) -> bool:
        if self.exists(key):
            return True
        tmp = os.path.join(self.file_path, f".{os.urandom(16).hex()}.tmp")
        np.ascontiguousarray(value).view(np.uint8).tofile(tmp)
        os.replace(tmp, self._path(key))
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values))

    def get(self, key: str, target):
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                if f.readinto(memoryview(target.view(np.uint8))) != target.nbytes:
                    raise IOError(f"short read for {key}")
            return target
        except FileNotFoundError:
            return None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations)]


def file_backend(path: str):
    if SGLANG:
        config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                      is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                      model_name="bench/model", extra_config={"file_storage_path": path})
        return HiCacheFile(config)
    return FileBackendCopy(path, "_bench-model_0_1")


# -- SGLang's controller steps ----------------------------------------------------------

def controller(backend, pool, page_size: int):
    """What CacheController's storage steps read of `self`."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool, page_size=page_size)


class Op:
    def __init__(self) -> None:
        self.request_id = "bench"

    def is_terminated(self) -> bool:
        return False


def generic_set(ctl, hashes, host_indices) -> bool:
    if SGLANG:
        return _Controller._generic_page_set(ctl, hashes, host_indices)
    data = [ctl.storage_host_pool.get_data_page(host_indices[i * ctl.page_size]) for i in range(len(hashes))]
    return ctl.storage_backend.batch_set(hashes, data)


def v1_set(ctl, hashes, host_indices) -> bool:
    if SGLANG:
        return _Controller._page_set_zero_copy(ctl, hashes, host_indices)
    return all(ctl.storage_backend.batch_set_v1(hashes, host_indices, None))


def hit_query(ctl, hashes) -> int:
    return ctl.storage_backend.batch_exists(hashes, None)


def generic_get(ctl, hashes, host_indices) -> int:
    if SGLANG:
        return _Controller._generic_page_get(ctl, Op(), hashes, host_indices)
    pool = ctl.storage_host_pool
    pages = ctl.storage_backend.batch_get(hashes, [pool.get_dummy_flat_data_page() for _ in hashes])
    count = 0
    for i, page in enumerate(pages):
        if page is None:
            break
        pool.set_from_flat_data_page(host_indices[i * ctl.page_size], page)
        count += 1
    return count


def v1_get(ctl, hashes, host_indices) -> int:
    if SGLANG:
        return _Controller._page_get_zero_copy(ctl, Op(), hashes, host_indices)
    results = ctl.storage_backend.batch_get_v1(hashes, host_indices, None)
    return next((i for i, ok in enumerate(results) if not ok), len(hashes))


# -- the run ------------------------------------------------------------------------------

def start_quilld(python: str, dram: str, sock: str, log_dir: str) -> tuple[subprocess.Popen, int]:
    """A quilld run by `python` on a free loopback port (tests/procs.py's) and on the unix socket
    `sock`, mappable by `default`; its log in `log_dir`. Returned once both listen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = ROOT

    def spawn(ports: list[int], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            return subprocess.Popen([python, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(ports[0]),
                                     "--admin-port", "0", "--dram", dram, "--log-level", "warning",
                                     "--unixsocket", sock, "--map-users", "default"],
                                    env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)

    try:
        proc, (port,), log = start_listening("quilld", lambda port: Path(log_dir) / f"quilld-{port}.log", spawn)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    deadline = time.monotonic() + 60  # the unix socket is opened after the TCP port
    while True:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(sock)
                return proc, port
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    stop_process(proc)
                    raise SystemExit(f"quilld did not listen on {sock} (see {log})") from None
        time.sleep(0.05)


class StorageConfig(SimpleNamespace):
    """HiCacheStorageConfig's fields, as the controller fills them for one MHA rank."""


def quill_backend(port: int, v1: bool, tcp: bool, pool):
    extra = {"backend_name": "quill", "module_path": "quillclient.sglang", "class_name": "QuillHiCacheStorage",
             "host": "127.0.0.1", "port": port, "interface_v1": int(v1)}
    if tcp:
        extra["shared_memory"] = "off"
    config = StorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                           is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                           model_name="bench/model", extra_config=extra, dcp_size=1, dcp_rank=0,
                           should_split_heads=False)
    backend = QuillHiCacheStorage(config, {})
    backend.register_mem_pool_host(pool)
    return backend


def page_hashes(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time of this process (every thread), or of process `pid`'s threads (quilld), from the
    scheduler's nanosecond counters."""
    if pid is None:
        return time.process_time()
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass  # a thread that ended meanwhile
    return total / 1e9


SIDES = ("file", "quilld generic", "quilld v1")


def run_size(size: int, args, port: int, file_dir: str, results: dict, quilld_pid: int) -> None:
    """One page size: every round, each side stores `pages` pages and reads them back."""
    page_size = size // TOKEN_BYTES
    pages = args.pages
    pool, helper = host_pool(2 * pages * page_size, page_size, args.layout)
    helper.fill(size)
    src = index_array(0, pages * page_size)  # written from the first half of the pool
    dst = index_array(pages * page_size, 2 * pages * page_size)  # read into the second half
    expected = [helper.page_bytes(i * page_size) for i in range(pages)]
    generic, v1 = quill_backend(port, False, args.tcp, pool), quill_backend(port, True, args.tcp, pool)
    for backend in (generic, v1):
        if backend.client.transport != ("tcp" if args.tcp else "shm"):
            raise SystemExit(f"quilld transport is {backend.client.transport}: {backend.client.shm_unavailable_reason}")
    sides = {"file": (controller(file_backend(file_dir), pool, page_size), generic_set, generic_get),
             "quilld generic": (controller(generic, pool, page_size), generic_set, generic_get),
             "quilld v1": (controller(v1, pool, page_size), v1_set, v1_get)}
    for r in range(args.rounds):
        for name in SIDES[r % 3:] + SIDES[:r % 3]:  # each side first, second and last in turn
            ctl, write, read = sides[name]
            hashes = page_hashes(pages, f"{size}:{r}:{name}")
            server = quilld_pid if name != "file" else None
            c0, s0, t0 = cpu_seconds(), server and cpu_seconds(server), time.perf_counter()
            assert write(ctl, hashes, src), f"{name}: a write failed"
            c1, s1, t1 = cpu_seconds(), server and cpu_seconds(server), time.perf_counter()
            hit = hit_query(ctl, hashes)
            got = read(ctl, hashes[:hit], dst)
            c2, s2, t2 = cpu_seconds(), server and cpu_seconds(server), time.perf_counter()
            assert hit == got == pages, f"{name}: {hit} hits, {got} read of {pages}"
            for i in range(pages):
                if helper.page_bytes((pages + i) * page_size) != expected[i]:
                    raise SystemExit(f"{name}: page {i} of {size} bytes read back different")
            results.setdefault((size, name, "write"), []).append(pages * size / (t1 - t0) / MiB)
            results.setdefault((size, name, "read"), []).append(pages * size / (t2 - t1) / MiB)
            results.setdefault((size, name, "write cpu"), []).append((c1 - c0 + ((s1 - s0) if server else 0)) / pages)
            results.setdefault((size, name, "read cpu"), []).append((c2 - c1 + ((s2 - s1) if server else 0)) / pages)
            if server:
                generic.clear()
            else:
                for f in os.listdir(file_dir):
                    os.remove(os.path.join(file_dir, f))
            pool_clear(helper, pages, page_size)
    generic.close()
    v1.close()


def pool_clear(helper, pages: int, page_size: int) -> None:
    """Zero the read half, so the next read proves itself."""
    if SGLANG:
        buf = helper.pool.kv_buffer
        if helper.pool.layout == "layer_first":
            buf[:, :, pages * page_size:].zero_()
        else:
            buf[:, pages * page_size:].zero_()
    elif helper.layout == "layer_first":
        helper.kv_buffer[:, :, pages * page_size:] = 0
    else:
        helper.kv_buffer[:, pages * page_size:] = 0


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pages", type=int, default=128, help="pages per repetition (SGLang's STORAGE_BATCH_SIZE)")
    ap.add_argument("--sizes", default="256K,768K,2M,8M", help="page sizes, e.g. 768K,2M")
    ap.add_argument("--layout", default="page_first", choices=["page_first", "layer_first"])
    ap.add_argument("--tcp", action="store_true", help="quilld over TCP instead of shared memory")
    ap.add_argument("--dir", default=None, help="the file backend's directory (default: a new one under /tmp)")
    ap.add_argument("--quilld-python", default=shutil.which("python3") if SGLANG else sys.executable,
                    help="the Python that runs quilld (SGLang's environment has not quilld's packages)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's intra-op threads (SGLang's page copies on both sides; more threads spin on a busy machine)")
    add_flag(ap)
    args = ap.parse_args()
    if SGLANG:
        torch.set_num_threads(args.torch_threads)
    sizes = [int(s[:-1]) * (KiB if s[-1] in "kK" else MiB) for s in args.sizes.split(",")]
    file_dir = tempfile.mkdtemp(prefix="hicache-file-", dir=args.dir or "/tmp")
    sock_dir = tempfile.mkdtemp(prefix="qb", dir="/tmp")
    dram = f"{max(sizes) * args.pages // MiB + 512}MiB"
    results: dict = {}
    before = loadavg()
    proc = None
    try:
        proc, port = start_quilld(args.quilld_python, dram, os.path.join(sock_dir, "q.sock"), sock_dir)
        for size in sizes:
            run_size(size, args, port, file_dir, results, proc.pid)
    finally:
        if proc is not None:
            stop_process(proc, 30)
        shutil.rmtree(file_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    what = "SGLang 0.5.23's own HiCacheFile, MHATokenToKVPoolHost and CacheController steps" if SGLANG else \
        "copies of SGLang 0.5.23's HiCacheFile I/O, host pool layout and CacheController steps (SGLang not importable)"
    summary = {key: statistics.median(values) for key, values in results.items()}
    print(f"{what}; quilld over {'TCP' if args.tcp else 'shared memory'}; {args.layout} host pool; "
          f"{args.pages} pages a repetition, {args.rounds} rounds, medians; "
          f"load average {before} before, {loadavg()} after")
    print("| page | op | file MiB/s | quilld generic | /file | quilld v1 | /file | CPU ms/page: file, generic, v1 |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for size in sizes:
        for op in ("write", "read"):
            f, g, v = (summary[(size, side, op)] for side in SIDES)
            cpu = ", ".join(f"{summary[(size, side, op + ' cpu')] * 1000:.2f}" for side in SIDES)
            print(f"| {size_label(size)} | {op} | {f:.0f} | {g:.0f} | {g / f:.2f}x | {v:.0f} | {v / f:.2f}x | {cpu} |")
    print("(CPU: the bench process's time, plus quilld's for quilld; the kernel's write-back of the file "
          "backend's pages, by its flusher threads, is not counted)")
    if args.plot:
        plot(args.plot, summary, sizes, args, SGLANG)


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def plot(path: str, summary: dict, sizes: list[int], args: argparse.Namespace, sglang: bool) -> None:
    """summary: (page size, side, op) -> the median main() prints, op "write", "read", "write cpu"
    (seconds a page) or "read cpu". MiB/s of writes and of reads per page size, one bar a side, with
    quilld's ratios to the file backend over each size (generic | v1); then the CPU a page cost."""
    categories = [size_label(size) for size in sizes]
    panels = []
    for op in ("write", "read"):
        speeds = {side: [summary[(size, side, op)] for size in sizes] for side in SIDES}
        panels.append(Panel(f"{op}s, {args.pages} pages a batch (over each: generic/file | v1/file)", categories,
                            speeds, "MiB/s (median)",
                            [f"{ratio(g, f)} | {ratio(v, f)}" for f, g, v in zip(*speeds.values())]))
    for op in ("write", "read"):
        panels.append(Panel(f"CPU per page {op} (bench process, plus quilld's for quilld)", categories,
                            {side: [summary[(size, side, f"{op} cpu")] * 1000 for size in sizes] for side in SIDES},
                            "ms (median)"))
    what = "SGLang 0.5.23's own HiCacheFile, host pool and CacheController steps" if sglang else \
        "copies of SGLang 0.5.23's HiCacheFile I/O, host pool and CacheController steps (SGLang not importable)"
    save(path, panels, "SGLang HiCache L3: quilld (QuillHiCacheStorage) vs SGLang's file backend",
         f"{what}; quilld over {'TCP' if args.tcp else 'shared memory'}; {args.layout} host pool; medians of "
         f"{args.rounds} rounds; {os.cpu_count()} cores shared with other work (noisy); the file backend's "
         f"write-back by the kernel is not in its CPU")


if __name__ == "__main__":
    main()
