"""Throughput of OffsetAllocator on a mixed alloc/free workload.

Sizes are uniform in 1..8192 units over a 1<<20-unit space; the loop allocates while
under half full and otherwise frees a random live allocation. Reports the median of
5 runs; the figures include the loop's own overhead (list bookkeeping of handles).

    python bench/alloc_bench.py [--ops N] [--seed S] [--plot PATH]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plot import Panel, add_flag, save  # noqa: E402
from quilld.tiers.offset_alloc import NO_SPACE, OffsetAllocator  # noqa: E402

CAPACITY = 1 << 20
MAX_SIZE = 8192
RUNS = 5


def run(ops: int, seed: int) -> tuple[float, int, float]:
    """Seconds for `ops` alloc/free calls, how many were allocs, and the final fragmentation."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, MAX_SIZE) for _ in range(ops)]
    picks = [rng.random() for _ in range(ops)]
    a = OffsetAllocator(CAPACITY)
    alloc, free = a.alloc, a.free
    live: list[int] = []
    half = CAPACITY // 2
    allocs = 0
    start = time.perf_counter()
    for i in range(ops):
        if CAPACITY - a.free_units < half:
            h = alloc(sizes[i])
            if h != NO_SPACE:
                live.append(h)
            allocs += 1
        else:
            j = int(picks[i] * len(live))
            live[j], live[-1] = live[-1], live[j]
            free(live.pop())
    elapsed = time.perf_counter() - start
    return elapsed, allocs, a.fragmentation()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000, help="alloc+free calls per run")
    parser.add_argument("--seed", type=int, default=1)
    add_flag(parser)
    args = parser.parse_args()

    results = [run(args.ops, args.seed + r) for r in range(RUNS)]
    times = sorted(t for t, _, _ in results)
    median = statistics.median(times)
    allocs = results[0][1]
    print(f"OffsetAllocator: {args.ops:,} ops ({allocs:,} alloc, {args.ops - allocs:,} free), "
          f"capacity {CAPACITY:,} units, sizes 1..{MAX_SIZE}")
    print(f"  median of {RUNS}: {args.ops / median:,.0f} ops/s, "
          f"{median / args.ops * 1e9:,.0f} ns/op (runs: {', '.join(f'{t:.3f}s' for t in times)})")
    print(f"  fragmentation at end of runs: {', '.join(f'{f:.3f}' for _, _, f in results)}")
    if args.plot:
        plot(args.plot, results, args.ops)


def plot(path: str, results: list[tuple[float, int, float]], ops: int) -> None:
    runs = [f"run {i + 1}" for i in range(len(results))]
    save(path, [Panel("operations per second", runs, {"ops/s": [ops / t for t, _, _ in results]}, "alloc+free calls/s"),
                Panel("fragmentation at the end of the run", runs, {"fragmentation": [f for _, _, f in results]},
                      "1 - largest free / all free")],
         f"OffsetAllocator: {ops:,} mixed alloc/free calls over {CAPACITY:,} units, sizes 1..{MAX_SIZE}",
         "one core of a shared, noisy machine; the loop's own bookkeeping included")


if __name__ == "__main__":
    main()
