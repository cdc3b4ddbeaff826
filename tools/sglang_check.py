"""By hand, inside SGLang: QuillHiCacheStorage on SGLang 0.5.23's own host pools and controller steps.

Needs SGLang importable (its own virtual environment: docs/connectors.md, "Run inside SGLang").
For every host pool layout SGLang 0.5.23 has on CPU (`MHATokenToKVPoolHost`: page_first,
layer_first, page_first_direct, page_head, page_unified; `MLATokenToKVPoolHost`: page_first,
layer_first, page_first_direct), on the generic and the v1 path, over shared memory and TCP:

- the backend is made by SGLang's `StorageBackendFactory.create_backend("dynamic", ...)` from
  docs/connectors.md's recipe and registered with the pool (a refusal is reported as such);
- `CacheController._generic_page_set` / `_page_set_zero_copy` store 10 pages of a filled pool,
  a second backend finds them (`batch_exists`) and `_generic_page_get` / `_page_get_zero_copy`
  read them into another pool, compared bit for bit;
- `get(key)` and `exists(key)` agree, for stored pages and a missing one;
- the object quilld holds for a page is byte for byte the file SGLang's `HiCacheFile` writes.

It prints one line a case and exits 1 if any failed: a check, not a bench (no figures; the
speed of the same steps is bench/sglang_bench.py's, whose quilld start it uses).

    /work/venvs/sglang/bin/python tools/sglang_check.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from sglang_bench import ROOT, Op, start_quilld  # noqa: E402  (it puts tests/ and clients/python on the path)

from procs import stop_process  # noqa: E402
from quillclient import QuillClient  # noqa: E402

try:
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController as C
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    MISSING = None
except ImportError as e:  # said after the arguments are parsed: --help answers anywhere
    MISSING = e

PAGE, LAYERS, PAGES = 16, 3, 10
LAYOUTS = {"mha": ["page_first", "layer_first", "page_first_direct", "page_head", "page_unified"],
           "mla": ["page_first", "layer_first", "page_first_direct"]}


def host_pool(kind: str, layout: str, pages: int = 32):
    if kind == "mha":
        dev = MHATokenToKVPool(size=2 * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64,
                               layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        return MHATokenToKVPoolHost(dev._mha_buffer_info(), 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=pages * PAGE, start_layer=0, end_layer=LAYERS)
    dev = MLATokenToKVPool(size=2 * PAGE, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16,
                           layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPoolHost(dev._mla_buffer_info(), 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=pages * PAGE, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


def bits(t) -> torch.Tensor:
    return t.contiguous().view(torch.int16)  # bfloat16 noise holds NaNs: compare the bits


def storage_config(is_mla: bool, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="sglang/check", extra_config=dict(extra))


def one_case(port: int, recipe: dict, kind: str, layout: str, v1: bool, transport: str) -> str:
    src, dst = host_pool(kind, layout), host_pool(kind, layout)
    flat = bits(src.kv_buffer).view(-1)
    flat.copy_(torch.randint(-2000, 2000, flat.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(7)))
    extra = {**recipe, "host": "127.0.0.1", "port": port, "interface_v1": int(v1),
             "shared_memory": "require" if transport == "shm" else "off"}
    config = storage_config(kind == "mla", extra)
    writer = StorageBackendFactory.create_backend("dynamic", config, src)
    reader = StorageBackendFactory.create_backend("dynamic", config, dst)
    try:
        try:
            writer.register_mem_pool_host(src)  # CacheController.attach_storage_backend
        except ValueError as e:
            return f"refused at registration: {e}"
        reader.register_mem_pool_host(dst)
        hashes = [hashlib.sha256(f"{kind}-{layout}-{v1}-{transport}-{i}".encode()).hexdigest() for i in range(PAGES)]
        write = SimpleNamespace(storage_backend=writer, storage_host_pool=src, page_size=PAGE)
        read = SimpleNamespace(storage_backend=reader, storage_host_pool=dst, page_size=PAGE)
        src_indices = torch.arange(4 * PAGE, (4 + PAGES) * PAGE)
        assert (C._page_set_zero_copy if v1 else C._generic_page_set)(write, hashes, src_indices), "set failed"
        assert reader.batch_exists(hashes, None) == PAGES, "batch_exists"
        got = (C._page_get_zero_copy if v1 else C._generic_page_get)(read, Op(), hashes, torch.arange(PAGES * PAGE))
        assert got == PAGES, f"{got} pages read"
        for i in range(PAGES):
            assert torch.equal(bits(dst.get_data_page(i * PAGE)), bits(src.get_data_page((4 + i) * PAGE))), f"page {i}"
        for h in hashes[:2] + ["f" * 64]:
            assert reader.exists(h) == (reader.get(h) is not None), f"exists and get disagree on {h}"
        file_dir = tempfile.mkdtemp(prefix="hicache-check-")
        try:
            files = HiCacheFile(storage_config(kind == "mla", {"file_storage_path": file_dir}))
            C._generic_page_set(SimpleNamespace(storage_backend=files, storage_host_pool=src, page_size=PAGE),
                                hashes[:1], src_indices)
            name = next(n for n in os.listdir(file_dir) if n.startswith(hashes[0]))
            with open(os.path.join(file_dir, name), "rb") as f, \
                    QuillClient(config=writer.client.config) as c:
                assert c.get(writer.page_key(hashes[0])) == f.read(), "quilld's object is not HiCacheFile's file"
        finally:
            shutil.rmtree(file_dir, ignore_errors=True)
        return "ok"
    finally:
        writer.clear()
        writer.close()
        reader.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quilld-python", default=shutil.which("python3"),
                    help="the Python that runs quilld (SGLang's environment has not quilld's packages)")
    args = ap.parse_args()
    if MISSING is not None:
        raise SystemExit(f"SGLang is not importable here ({MISSING}): run this in SGLang's environment")
    recipe = json.loads(re.search(r"<!-- recipe: sglang-hicache -->\s*```\w*\n(.*?)```",
                                  open(os.path.join(ROOT, "docs", "connectors.md")).read(), re.DOTALL).group(1))
    recipe.pop("password")
    sock_dir = tempfile.mkdtemp(prefix="qc", dir="/tmp")
    failed = 0
    proc = None
    try:
        proc, port = start_quilld(args.quilld_python, "512MiB", os.path.join(sock_dir, "q.sock"), sock_dir)
        for kind, layouts in LAYOUTS.items():
            for layout in layouts:
                for v1 in (False, True):
                    for transport in ("shm", "tcp"):
                        try:
                            outcome = one_case(port, recipe, kind, layout, v1, transport)
                        except Exception as e:  # noqa: BLE001 - reported, counted
                            traceback.print_exc()
                            outcome = f"FAILED {type(e).__name__}: {e}"
                        failed += outcome.startswith("FAILED")
                        print(f"{kind} {layout:18s} {'v1' if v1 else 'generic':8s} {transport}  {outcome}", flush=True)
    finally:
        if proc is not None:
            stop_process(proc, 30)
        shutil.rmtree(sock_dir, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
