"""QuillConnector's worker side, saving and loading one prompt's blocks, over shared memory and over
TCP, beside the floor any CPU offloading pays: the same blocks copied out of and back into the KV
tensors with no store at all. One run.

Each round saves `--blocks` blocks (32 by default) of a Llama-3-8B-shaped KV cache (32 layers, 8
KV heads of 128, float16, 16 tokens: 2 MiB a block, every layer's K and V in one object) the way
vLLM's model runner drives a connector (metadata bound, `wait_for_save`, then waiting for the
puts), then loads them into other blocks of the cache (`start_load_kv`, sync), and checks the
loaded blocks byte for byte. The floor side does the connector's own gather (blocks out of the
per-layer `[B, H, N, C]` views into one host buffer) and scatter (back in), and nothing else:
vLLM's CPU offloading copies the same bytes GPU to host, so no store of KV blocks in host
memory can be faster than it on this machine. The KV tensors are vLLM's own
(`allocate_kv_cache`), the connector is built from a VllmConfig as vLLM builds it. It prints the
median time of a save and a load per side, in ms and GiB/s, and the ratios to the floor.

    python bench/vllm_connector_bench.py                  # 32 blocks, 5 rounds
    python bench/vllm_connector_bench.py --blocks 128 --rounds 3
    python bench/vllm_connector_bench.py --plot conn.png  # also the figure (the `bench` extra)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (os.path.join(ROOT, "clients", "python"), os.path.join(ROOT, "wire"), os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

from plot import Panel, add_flag, ratio, save  # noqa: E402

LAYERS, KV_HEADS, HEAD, TOKENS = 32, 8, 128, 16
BLOCK = LAYERS * 2 * KV_HEADS * HEAD * TOKENS * 2  # 2 MiB
SIDES = ("copy floor", "QuillConnector shm", "QuillConnector tcp")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=32, help="blocks of one prompt, saved and loaded at once")
    p.add_argument("--rounds", type=int, default=5)
    add_flag(p)
    args = p.parse_args()
    if args.blocks < 1 or args.rounds < 1:
        p.error("--blocks and --rounds must be at least 1")

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache
    except ImportError as e:
        sys.exit(f"vllm_connector_bench needs vLLM 0.33 and torch in this Python ({e}); .ci/run installs them")
    from procs import start_quilld, stop_process
    from vllm_configs import kv_cache_config, vllm_config, write_model

    from quillclient.vllm.connector import QuillConnector, QuillConnectorMetadata, Transfer

    n = args.blocks
    work = Path(tempfile.mkdtemp(prefix="qcb", dir="/tmp"))
    q = start_quilld(work, "--unixsocket", str(work / "q.sock"), "--map-users", "default",
                     "--dram", f"{max(1, (n * BLOCK * 3) >> 30) + 1}GiB", admin=False)
    workers = {}
    try:
        model = write_model(work / "model", LAYERS, KV_HEADS, HEAD, heads=32)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kvc = kv_cache_config(KVCacheLayout.LBHNC, names, 2 * n, TOKENS, KV_HEADS, HEAD)
        kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC)
        url = f"quill://127.0.0.1:{q.port}?model=llama-3-8b&tokenizer=llama3"
        for side, shm in (("QuillConnector shm", "require"), ("QuillConnector tcp", "off")):
            w = QuillConnector(vllm_config(model, url, shared_memory=shm), KVConnectorRole.WORKER, kvc)
            w.register_kv_caches(kv)
            workers[side] = w
        gen = torch.Generator().manual_seed(7)
        for name in names:
            kv[name][:n] = torch.randn(kv[name][:n].shape, generator=gen, dtype=torch.float32).to(torch.float16)
        layers = [kv[name] for name in names]
        src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
        saves = {s: [] for s in SIDES}
        loads = {s: [] for s in SIDES}
        print(f"{n} blocks of {BLOCK >> 20} MiB (Llama-3-8B: {LAYERS} layers, {KV_HEADS} KV heads of {HEAD}, "
              f"float16, {TOKENS} tokens), {args.rounds} rounds", flush=True)

        def floor() -> tuple[float, float]:
            w = workers["QuillConnector tcp"]._worker
            t0 = time.perf_counter()
            staged = w._gather(src_ids)
            t1 = time.perf_counter()
            w._scatter(staged, list(range(n)), dst_ids)
            return t1 - t0, time.perf_counter() - t1

        for rnd in range(-1, args.rounds):  # round -1 warms up, uncounted
            order = SIDES[rnd % 3:] + SIDES[:rnd % 3]
            for side in order:
                for layer in layers:
                    layer[n:] = 0
                if side == "copy floor":
                    st, ld = floor()
                else:
                    conn = workers[side]
                    hashes = [f"{side}/{rnd}/{i}".encode().ljust(32, b".") for i in range(n)]
                    t0 = time.perf_counter()
                    conn.bind_connector_metadata(QuillConnectorMetadata(saves=[Transfer(
                        f"r{rnd}", hashes, src_ids, parents=[None] + hashes[:-1])]))
                    conn.wait_for_save()
                    conn._worker.drain()
                    st = time.perf_counter() - t0
                    conn.bind_connector_metadata(QuillConnectorMetadata(loads=[Transfer(f"r{rnd}", hashes, dst_ids)]))
                    t0 = time.perf_counter()
                    conn.start_load_kv(None)
                    ld = time.perf_counter() - t0
                    conn.clear_connector_metadata()
                    assert not conn.get_block_ids_with_load_errors(), f"{side}: blocks failed to load"
                    stats = conn.get_kv_connector_stats()
                    assert stats is not None and stats.data["save_errors"] == 0, f"{side}: saves failed"
                    conn._worker._client.delete(*(f"{h.hex()}.{conn._worker._obj.tag}.r0" for h in hashes))
                for layer in layers:
                    assert torch.equal(layer[n:], layer[:n]), f"{side}: a loaded block differs from the saved one"
                if rnd >= 0:
                    saves[side].append(st)
                    loads[side].append(ld)
            print(f"  round {rnd + 1}/{args.rounds} done" if rnd >= 0 else "  warm-up round done", flush=True)
        total = n * BLOCK
        med = {s: (statistics.median(saves[s]), statistics.median(loads[s])) for s in SIDES}
        print(f"\n{'side':<20} {'save ms':>8} {'GiB/s':>6} {'load ms':>8} {'GiB/s':>6}")
        for s in SIDES:
            st, ld = med[s]
            print(f"{s:<20} {st * 1e3:>8.1f} {total / st / 2**30:>6.2f} {ld * 1e3:>8.1f} {total / ld / 2**30:>6.2f}")
        fl_st, fl_ld = med[SIDES[0]]
        for s in SIDES[1:]:
            print(f"{s}: save {ratio(fl_st, med[s][0])} and load {ratio(fl_ld, med[s][1])} the speed of the copy floor")
        if args.plot:
            save(args.plot, [Panel(f"{n} x {BLOCK >> 20} MiB blocks", ["save", "load"],
                                   {s: [total / med[s][0] / 2**30, total / med[s][1] / 2**30] for s in SIDES},
                                   "GiB/s (higher is better)")],
                 "QuillConnector against the copy floor (vLLM 0.33, CPU tensors)",
                 note=f"medians of {args.rounds} rounds; every load checked byte for byte")
    finally:
        for w in workers.values():
            w.shutdown()
        stop_process(q.proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
