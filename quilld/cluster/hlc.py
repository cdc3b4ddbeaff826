"""Versions of mutable keys: a hybrid logical clock, one per node, sans-IO.

A version is one 64-bit int, compared as an int: the wall clock in milliseconds (42 bits,
from 2020), a logical counter (12 bits) for writes within one millisecond or behind a clock
seen from a peer, and 10 bits of the node's name, so two nodes' writes in the same
millisecond with the same counter still differ (they tie only when two names share those
10 bits as well; then either may win, the same everywhere).

A node's clock never runs backwards, and it never issues a version below one it has seen
(`observe`: versions in the directory's answers and notices): a write made after a read of
version v gets a version above v, whatever the two nodes' wall clocks say. Between writes
that never saw each other, the later wall clock wins (last writer wins), as exactly as the
nodes' clocks agree.

Version 0 is "older than anything": a value recovered from the SSD tier at start, whose
version was not kept, loses to every versioned write and delete of its key.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import xxhash

EPOCH_MS = 1_577_836_800_000  # 2020-01-01 UTC
LOGICAL_BITS, NODE_BITS = 12, 10
_LOW = LOGICAL_BITS + NODE_BITS
_LOGICAL_MAX = (1 << LOGICAL_BITS) - 1


def wall_ms_of(version: int) -> int:
    """The unix milliseconds a version was issued at (by its node's clock)."""
    return (version >> _LOW) + EPOCH_MS


class Hlc:
    def __init__(self, node_id: str, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.node = xxhash.xxh32_intdigest(node_id.encode()) & ((1 << NODE_BITS) - 1)
        self.ms = 0  # the physical part of the last version issued or seen
        self.logical = 0

    def now(self) -> int:
        """A new version, above every one issued or seen here."""
        ms = int(self.wall() * 1000) - EPOCH_MS
        if ms > self.ms:
            self.ms, self.logical = ms, 0
        elif self.logical < _LOGICAL_MAX:
            self.logical += 1
        else:  # 4096 versions in one millisecond: borrow the next
            self.ms, self.logical = self.ms + 1, 0
        return (self.ms << LOGICAL_BITS | self.logical) << NODE_BITS | self.node

    def observe(self, version: int) -> None:
        """A version seen from elsewhere: every later `now()` is above it."""
        ms, logical = version >> _LOW, version >> NODE_BITS & _LOGICAL_MAX
        if ms > self.ms or (ms == self.ms and logical > self.logical):
            self.ms, self.logical = ms, logical
