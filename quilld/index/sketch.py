"""Hot prefixes: a Count-Min sketch of block accesses plus its heavy hitters.

The sketch is a (depth x width) matrix of int64 counters. A key is hashed once
per row with xxh64 under that row's seed; adding `count` bumps one counter per
row, and the estimate is the smallest of the key's `depth` counters. Collisions
only ever add, so an estimate is never below the true count, and with
probability at least 1 - e**-depth it is at most true + (e / width) * total
(Cormode and Muthukrishnan, 2005).

Heavy hitters are tracked beside the sketch: a dict of at most `top_k` keys and
their estimates. A key enters when there is room or when its new estimate
exceeds the smallest tracked one, which is then evicted. The smallest tracked
entry is cached, so a cold key costs one comparison; top_k is small and a
linear min search runs only when the tracked set changes at its bottom.

`decay(factor)` multiplies every counter by `factor` (rounding down) so old
heat fades. Rounding each cell down keeps the guarantee against the decayed
true counts, since floor(a + b) >= floor(a) + floor(b).

Keys are bytes (a block hash in its stored form, see `residency.hash_key`).
"""

from __future__ import annotations

import heapq
import operator
import sys
from collections import Counter
from typing import Iterable

import numpy as np
import xxhash

_U64 = (1 << 64) - 1
_h64 = xxhash.xxh64_intdigest

MAX_WIDTH = 1 << 24  # 16 Mi counters per row is already 128 MiB per row
MAX_DEPTH = 32  # error probability e**-32; more rows only cost time


class HotPrefixes:
    def __init__(self, width: int = 4096, depth: int = 4, top_k: int = 32, seed: int = 0) -> None:
        if type(width) is not int or not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"width must be an int in 1..{MAX_WIDTH}, not {width!r}")
        if type(depth) is not int or not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth must be an int in 1..{MAX_DEPTH}, not {depth!r}")
        if type(top_k) is not int or top_k < 1:
            raise ValueError(f"top_k must be a positive int, not {top_k!r}")
        if type(seed) is not int:
            raise ValueError(f"seed must be an int, not {seed!r}")
        self.width = width
        self.depth = depth
        self.top_k = top_k
        # One 64-bit seed per row, derived from `seed` so two sketches with
        # different seeds share no row.
        self._seeds = tuple(_h64(row.to_bytes(4, "little"), seed & _U64) for row in range(depth))
        self._counts = np.zeros((depth, width), dtype=np.int64)
        # A flat int64 view for the scalar path: memoryview item access returns
        # plain ints and is several times faster than numpy scalar indexing.
        # Every later change to _counts is made in place so this stays valid.
        self._flat = memoryview(self._counts.reshape(-1))
        self._offsets = tuple(row * width for row in range(depth))
        self._total = 0
        self._tracked: dict[bytes, int] = {}
        self._min_key: bytes | None = None  # the smallest tracked entry, once the dict is full
        self._min_est = -1

    # -- recording -------------------------------------------------------------
    def add(self, key: bytes, count: int = 1) -> int:
        """Record `count` accesses of `key`; return its new estimate."""
        if type(count) is not int:
            count = operator.index(count)  # numpy ints in, TypeError for floats
        if count < 0:
            raise ValueError(f"count must be >= 0, not {count!r}")
        flat, width = self._flat, self.width
        est = -1
        for seed, off in zip(self._seeds, self._offsets):
            i = off + _h64(key, seed) % width
            c = flat[i] + count
            flat[i] = c
            if est < 0 or c < est:
                est = c
        self._total += count
        self._offer(key, est)
        return est

    def add_many(self, keys: Iterable[bytes]) -> None:
        """Record one access of each key in `keys` (repeats count again)."""
        mult = Counter(keys)
        if not mult:
            return
        uniq = list(mult)
        width, n = self.width, len(uniq)
        cols = np.empty((self.depth, n), dtype=np.int64)
        for row, seed in enumerate(self._seeds):
            cols[row] = [_h64(k, seed) % width for k in uniq]
        flat_idx = (cols + np.arange(self.depth, dtype=np.int64)[:, None] * width).reshape(-1)
        weights = np.fromiter(mult.values(), dtype=np.int64, count=n)
        # Keys in the same cell must add up, so scatter with add.at, not fancy +=.
        flat = self._counts.reshape(-1)
        np.add.at(flat, flat_idx, np.tile(weights, self.depth))
        self._total += int(weights.sum())
        est = self._counts[np.arange(self.depth)[:, None], cols].min(axis=0)
        self._merge(uniq, est)

    # -- reading ---------------------------------------------------------------
    def estimate(self, key: bytes) -> int:
        """An upper bound on the (decayed) number of times `key` was added."""
        flat, width = self._flat, self.width
        est = -1
        for seed, off in zip(self._seeds, self._offsets):
            c = flat[off + _h64(key, seed) % width]
            if est < 0 or c < est:
                est = c
        return est

    def top(self, n: int | None = None) -> list[tuple[bytes, int]]:
        """The tracked heavy hitters with their current estimates, highest first.

        Estimates are refreshed from the sketch, since collisions with other
        keys may have raised them since the key was last added."""
        if n is not None and n < 0:
            raise ValueError(f"n must be >= 0, not {n!r}")
        self._refresh()
        ranked = sorted(self._tracked.items(), key=lambda kv: (-kv[1], kv[0]))
        return ranked if n is None else ranked[:n]

    @property
    def total(self) -> int:
        """The total count added, scaled down by every decay since."""
        return self._total

    def memory_bytes(self) -> int:
        """Bytes held: the counter matrix plus the heavy-hitter dict and its keys."""
        tracked = sys.getsizeof(self._tracked) + sum(
            sys.getsizeof(k) + sys.getsizeof(v) for k, v in self._tracked.items()
        )
        return int(self._counts.nbytes) + tracked

    # -- aging -----------------------------------------------------------------
    def decay(self, factor: float = 0.5) -> None:
        """Multiply every counter, the total and the tracked estimates by `factor`, rounding down."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"factor must be in [0, 1], not {factor!r}")
        if factor == 0.5:
            np.right_shift(self._counts, 1, out=self._counts)  # exact at any magnitude
            self._total >>= 1
        else:
            np.floor(self._counts * factor, out=self._counts, casting="unsafe")
            self._total = int(self._total * factor)
        self._refresh()

    # -- heavy hitters ---------------------------------------------------------
    def _offer(self, key: bytes, est: int) -> None:
        tracked = self._tracked
        if key in tracked:
            tracked[key] = est
            if key == self._min_key:  # it grew, so the bottom may have moved
                self._find_min()
        elif len(tracked) < self.top_k:
            tracked[key] = est
            if len(tracked) == self.top_k:
                self._find_min()
        elif est > self._min_est:
            del tracked[self._min_key]
            tracked[key] = est
            self._find_min()

    def _merge(self, keys: list[bytes], est: np.ndarray) -> None:
        """Offer a batch: keep the top_k of (tracked | keys) by estimate, tracked keys winning ties."""
        k = self.top_k
        if len(keys) > k:
            pick = np.argpartition(est, len(keys) - k)[len(keys) - k:]
            cand = {keys[i]: int(est[i]) for i in pick.tolist()}
        else:
            cand = dict(zip(keys, est.tolist()))
        tracked = self._tracked
        for key in list(cand):  # a tracked key takes its new estimate
            if key in tracked:
                tracked[key] = cand.pop(key)
        merged = [(v, 1, key) for key, v in tracked.items()] + [(v, 0, key) for key, v in cand.items()]
        self._tracked = {key: v for v, _, key in heapq.nlargest(k, merged)}
        self._find_min()

    def _refresh(self) -> None:
        tracked = self._tracked
        for key in tracked:
            tracked[key] = self.estimate(key)
        self._find_min()

    def _find_min(self) -> None:
        if len(self._tracked) < self.top_k:
            self._min_key, self._min_est = None, -1
        else:
            self._min_key = min(self._tracked, key=self._tracked.__getitem__)
            self._min_est = self._tracked[self._min_key]
