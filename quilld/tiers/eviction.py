"""Which value DRAM drops when it is full: redis's `maxmemory-policy`, for the keyspace.

The keyspace keeps `used` within `limit` (maxmemory). With a working lower tier nothing is
dropped for room: DRAM demotes to it (tiering.py), whatever the policy (a full SSD tier still
drops its own coldest, noeviction or not: that is tiering.py's). Without one, room is
made by dropping values, and the policy says which (the names and meanings are redis's):

- `allkeys-lru` (the default): the least recently used value of any key. The keyspace's
  dict is its LRU order, so this is the front of it (keyspace.py `_evict_one`), exact
  rather than sampled: what quilld always did, and what a cache pool wants (any block can
  be recomputed or fetched again).
- `allkeys-lfu`: the least frequently used of the `WINDOW` least recently used values,
  by a counter per key that grows logarithmically with hits and decays with idle minutes,
  as redis's LFU counter (`Frequencies`; OBJECT FREQ reads it).
- `volatile-lru`, `volatile-lfu`, `volatile-ttl`: the same, or the nearest deadline, among
  keys with a TTL only; with none left, nothing goes.
- `noeviction`: nothing goes.

When nothing may go and the value does not fit, the write is refused with redis's
`-OOM command not allowed when used memory > 'maxmemory'.` (keyspace.py `reserve`,
tier_moves.py `_admit`); reads and deletes never are. The random policies are not offered:
a cache pool has an exact LRU at no cost, and a random victim is only worse.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

from quilld.config import MAXMEMORY_POLICIES

WINDOW = 16  # candidates looked at, from the LRU end, by the LFU and volatile policies (redis samples 5 + a pool of 16)
SCAN = 1024  # LRU entries the volatile policies look through for keys with a TTL before any of those
LFU_INIT = 5  # a new key's counter (redis's LFU_INIT_VAL): a fresh key is not the first to go
LFU_LOG_FACTOR = 10  # lfu-log-factor's default: about a million hits take the counter to 255
LFU_DECAY_MINUTES = 1  # lfu-decay-time's default: the counter loses one per this many idle minutes (0: never)

__all__ = ["MAXMEMORY_POLICIES", "Frequencies", "victim"]


def _minutes() -> int:
    return int(time.time() // 60)


class Frequencies:
    """Each key's LFU counter (0..255) and the minute it was last changed; `log_factor` and
    `decay_minutes` are redis's lfu-log-factor and lfu-decay-time (CONFIG SET changes them)."""

    def __init__(self) -> None:
        self.at: dict[bytes, tuple[int, int]] = {}  # full key -> (counter, minute)
        self.log_factor = LFU_LOG_FACTOR
        self.decay_minutes = LFU_DECAY_MINUTES

    def of(self, fk: bytes) -> int:
        """The counter now, decayed by the minutes since it last changed (a key it never saw:
        a new key's)."""
        counter, minute = self.at.get(fk, (LFU_INIT, None))
        if minute is None or not self.decay_minutes:
            return counter
        return max(counter - (_minutes() - minute) // self.decay_minutes, 0)

    def created(self, fk: bytes) -> None:
        self.at[fk] = (LFU_INIT, _minutes())

    def hit(self, fk: bytes) -> None:
        """An access: decay, then one more with probability 1 / ((counter - LFU_INIT) * factor + 1)."""
        counter = self.of(fk)
        if counter < 255 and random.random() < 1.0 / (max(counter - LFU_INIT, 0) * self.log_factor + 1):
            counter += 1
        self.at[fk] = (counter, _minutes())

    def moved(self, src: bytes, dst: bytes) -> None:
        """A rename: the value keeps its counter under its new name."""
        if src in self.at:
            self.at[dst] = self.at[src]

    def forget(self, fk: bytes) -> None:
        self.at.pop(fk, None)


def victim(policy: str, data: dict, expires: dict, freq: Frequencies | None, evictable: Any) -> bytes | None:
    """The key `policy` drops next (not for allkeys-lru, which the keyspace does itself), or None.

    `data` is DRAM in LRU order, `expires` the TTL deadlines, `evictable(value)` whether a
    value may go now (a pinned block may not). The volatile policies look for keys with a TTL
    among the first `SCAN` of the LRU order, then (keys with a TTL all recently used) in the
    order their TTLs were set."""
    if policy == "noeviction":
        return None
    if policy == "allkeys-lfu":
        return _best(iter(data), data, lambda fk: freq.of(fk), evictable)
    score = (lambda fk: expires[fk]) if policy == "volatile-ttl" else \
        (lambda fk: freq.of(fk)) if policy == "volatile-lfu" else None
    lru = (fk for fk in itertools.islice(data, SCAN) if fk in expires)
    found = _best(lru, data, score, evictable)
    if found is None:
        found = _best((fk for fk in expires if fk in data), data, score, evictable)
    return found


def _best(keys, data: dict, score, evictable) -> bytes | None:
    """The lowest-scoring evictable key of the first `WINDOW` evictable ones (the first when
    `score` is None)."""
    best, best_score, seen = None, None, 0
    for fk in keys:
        if not evictable(data[fk]):
            continue
        if score is None:
            return fk
        s = score(fk)
        if best_score is None or s < best_score:
            best, best_score = fk, s
        seen += 1
        if seen >= WINDOW:
            break
    return best
