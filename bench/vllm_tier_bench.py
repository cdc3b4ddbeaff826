"""vLLM 0.33's offloading tiers side by side: QuillTier (over shared memory and over TCP) against
vLLM's own file-system tier, one run.

Each round stores one prompt's chunks (`--blocks`, 32 by default) from vLLM's CPU region into
the tier (one `submit_store` job, waited for through `get_finished_jobs`, as vLLM's tiering
manager polls it), then loads them back into other slots of the region (one `submit_load`
job), for each side in turn (the order rotated every round); every load is checked byte for
byte. A chunk is a Llama-3-8B-shaped block: 32 layers, K and V, 8 KV heads of 128 in bfloat16,
16 tokens (2 MiB). It prints the median time of a store and of a load per side, in ms and GiB/s,
and quilld's ratios to the file-system tier.

The tiers are vLLM's own classes built by vLLM's `SecondaryTierFactory` from the config a user
writes, over the CPU region of a real `TieringOffloadingSpec`; quilld runs with a unix socket
and `--map-users default` (shared memory) on a free loopback port. The file-system tier writes
to `--dir` (default: a temporary directory under /tmp), a local disk; its reads come back from
the page cache. A first round warms both up, uncounted; after each round quilld's copies are
deleted, as a full pool's evictions free space in its steady state (otherwise every round would
write arena pages touched for the first time). Needs vLLM 0.33 and torch (CPU) in this Python:
`.ci/run` installs them.

    python bench/vllm_tier_bench.py                 # 32 blocks, 5 rounds
    python bench/vllm_tier_bench.py --blocks 128 --rounds 3
    python bench/vllm_tier_bench.py --plot tier.png # also the figure (the `bench` extra)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (os.path.join(ROOT, "clients", "python"), os.path.join(ROOT, "wire"), os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

from plot import Panel, add_flag, ratio, save  # noqa: E402

LAYERS, KV_HEADS, HEAD, TOKENS, DTYPE_BYTES = 32, 8, 128, 16, 2
CHUNK = LAYERS * 2 * KV_HEADS * HEAD * TOKENS * DTYPE_BYTES  # 2 MiB
SIDES = ("vLLM fs tier", "QuillTier shm", "QuillTier tcp")


def spec_and_region(chunks: int):
    """A real TieringOffloadingSpec's CPU region of `chunks` Llama-3-8B-shaped chunks."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS, tuple(f"layer.{i}" for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * CHUNK, "secondary_tiers": []},
        engine_id=f"tierbench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="llama-3-8b", dtype="bfloat16", max_model_len=8192),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))
    spec = TieringOffloadingSpec(config)
    manager = spec.get_manager()
    return spec, manager


def run_job(tier, job) -> float:
    """Submit, then poll get_finished_jobs as vLLM's tiering manager does; seconds taken."""
    t0 = time.perf_counter()
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    deadline = t0 + 120
    while True:
        done = list(tier.get_finished_jobs())
        if done:
            assert all(r.success for r in done), f"{tier.tier_type}: job {job.job_id} failed"
            return time.perf_counter() - t0
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{tier.tier_type}: job {job.job_id} never finished")
        time.sleep(0.0002)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=32, help="chunks of one prompt, stored and loaded as one job")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", help="the file-system tier's directory (default: a temporary one under /tmp)")
    add_flag(p)
    args = p.parse_args()
    if args.blocks < 1 or args.rounds < 1:
        p.error("--blocks and --rounds must be at least 1")

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import numpy as np
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as e:
        sys.exit(f"vllm_tier_bench needs vLLM 0.33 and torch in this Python ({e}); .ci/run installs them")
    from procs import start_quilld, stop_process

    work = Path(tempfile.mkdtemp(prefix="qtb", dir="/tmp"))
    fs_dir = Path(args.dir) if args.dir else work / "fs"
    n = args.blocks
    q = start_quilld(work, "--unixsocket", str(work / "q.sock"), "--map-users", "default",
                     "--dram", f"{max(1, (n * CHUNK * 3) >> 30) + 1}GiB", admin=False)
    spec, manager = spec_and_region(2 * n)
    tiers = {}
    try:
        view = manager.primary_tier.get_kv_memoryview()
        region = np.frombuffer(view, dtype=np.uint8).reshape(-1, CHUNK)
        url = f"quill://127.0.0.1:{q.port}?model=llama-3-8b&tokenizer=llama3"
        configs = {"vLLM fs tier": {"type": "fs", "root_dir": str(fs_dir)},
                   "QuillTier shm": {"type": "QuillTier", "module_path": "quillclient.vllm", "url": url,
                                     "shared_memory": "require"},
                   "QuillTier tcp": {"type": "QuillTier", "module_path": "quillclient.vllm", "url": url,
                                     "shared_memory": "off"}}
        for side, cfg in configs.items():
            tiers[side] = SecondaryTierFactory.create_secondary_tier(cfg, view, spec)
        rng = np.random.default_rng(7)
        region[:n] = rng.integers(0, 256, (n, CHUNK), dtype=np.uint8)
        stores: dict[str, list[float]] = {s: [] for s in SIDES}
        loads: dict[str, list[float]] = {s: [] for s in SIDES}
        job_id = 0
        print(f"{n} chunks of {CHUNK >> 20} MiB (Llama-3-8B: {LAYERS} layers, {KV_HEADS} KV heads of {HEAD}, "
              f"bf16, {TOKENS} tokens) per job, {args.rounds} rounds", flush=True)
        from quillclient import QuillClient
        pool = QuillClient("127.0.0.1", q.port, shared_memory="off", scope=("llama-3-8b", "llama3"))
        for rnd in range(-1, args.rounds):  # round -1 warms up, uncounted
            order = SIDES[rnd % 3:] + SIDES[:rnd % 3]
            for side in order:
                tier = tiers[side]
                ctx = ReqContext(req_id=f"{side}-{rnd}")
                keys = [make_offload_key(f"{side}/{rnd}/{i}".encode().ljust(32, b"."), 0) for i in range(n)]
                job_id += 1
                stores[side].append(run_job(tier, TransferJob(job_id, keys, np.arange(n, dtype=np.int64), False, ctx)))
                region[n:] = 0
                job_id += 1
                loads[side].append(run_job(tier, TransferJob(job_id, keys, np.arange(n, 2 * n, dtype=np.int64),
                                                             True, ctx)))
                assert np.array_equal(region[n:], region[:n]), f"{side}: a loaded chunk differs from the stored one"
                if side.startswith("QuillTier"):  # a full pool's steady state: its evictions free as much
                    pool.delete(*(k.hex() for k in (key[:-4] for key in keys)))
                if rnd < 0:
                    stores[side].pop()
                    loads[side].pop()
            print(f"  round {rnd + 1}/{args.rounds} done" if rnd >= 0 else "  warm-up round done", flush=True)
        pool.close()
        total = n * CHUNK
        med = {s: (statistics.median(stores[s]), statistics.median(loads[s])) for s in SIDES}
        print(f"\n{'side':<16} {'store ms':>9} {'GiB/s':>6} {'load ms':>9} {'GiB/s':>6}")
        for s in SIDES:
            st, ld = med[s]
            print(f"{s:<16} {st * 1e3:>9.1f} {total / st / 2**30:>6.2f} {ld * 1e3:>9.1f} {total / ld / 2**30:>6.2f}")
        fs_st, fs_ld = med[SIDES[0]]
        for s in SIDES[1:]:
            print(f"{s}: store {ratio(fs_st, med[s][0])} and load {ratio(fs_ld, med[s][1])} the speed of vLLM's fs tier")
        if args.plot:
            save(args.plot, [Panel(f"{n} x {CHUNK >> 20} MiB chunks, one job", ["store", "load"],
                                   {s: [total / med[s][0] / 2**30, total / med[s][1] / 2**30] for s in SIDES},
                                   "GiB/s (higher is better)")],
                 "vLLM 0.33 offloading tiers: QuillTier against vLLM's fs tier", note=f"medians of {args.rounds} rounds; every load checked byte for byte")
    finally:
        for t in tiers.values():
            t.shutdown()
        manager.shutdown()
        stop_process(q.proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
