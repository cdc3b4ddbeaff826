"""TTLs: when each key expires, and which keys' time has come.

`Expiry` owns the deadlines: `at` (full key -> unix ms, the dict the keyspace reads as
`Keyspace.expires` on its read path, with no call in between) and a min-heap of them
for the periodic sweep. It knows nothing of values: the keyspace (keyspace.py) removes a
key whose time has come, and its TTL verbs (`set_expire`, `ttl_ms`, `expire_time`,
`set_ttl`, `persist`, `sweep_expired`) are built on this. A key that is read after its
deadline is reclaimed by that read; the sweep reclaims the others.

A deadline is a signed 64-bit unix time in ms, as redis keeps it and as the SSD tier's
records store it: every way a TTL comes in (RESTORE, the EXPIRE family, SET and GETEX's
options, a peer's copy) range-checks it at the door, and `set` refuses one that is not.
"""

from __future__ import annotations

import heapq
import time


MAX_DEADLINE_MS = (1 << 63) - 1  # redis's LLONG_MAX; the SSD tier packs a deadline as an i64


def now_ms() -> int:
    return int(time.time() * 1000)


class Expiry:
    def __init__(self) -> None:
        self.at: dict[bytes, int] = {}  # full key -> when it expires (unix ms); removed with the key
        # (deadline, full key) for every deadline set, including ones changed or removed since:
        # an entry counts only while `at` still holds the same deadline for its key
        self._heap: list[tuple[int, bytes]] = []

    def set(self, fk: bytes, at_ms: int) -> None:
        if not 0 < at_ms <= MAX_DEADLINE_MS:  # the doors check first: this is a bug, refused before it is stored
            raise ValueError(f"a deadline of {at_ms} ms is not a positive signed 64-bit unix time")
        self.at[fk] = at_ms
        heap = self._heap
        heapq.heappush(heap, (at_ms, fk))
        if len(heap) > 64 and len(heap) > 2 * len(self.at):  # mostly stale entries: rebuild it
            self._heap = [(at, k) for k, at in self.at.items()]
            heapq.heapify(self._heap)

    def expired(self, fk: bytes, now: int) -> bool:
        at = self.at.get(fk)
        return at is not None and at <= now

    def next_due(self, now: int) -> bytes | None:
        """A key whose deadline is at or before `now`, or None when there is none.

        Its deadline stays in `at` until the keyspace removes the key; stale heap entries met
        on the way are dropped."""
        heap, at = self._heap, self.at
        while heap and heap[0][0] <= now:
            when, fk = heapq.heappop(heap)
            if at.get(fk) == when:
                return fk
        return None
