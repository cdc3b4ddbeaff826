"""The seam between the keyspace and a tier below DRAM.

The keyspace keeps every key whose only copy lies below DRAM in one LRU
dict of *entries*; it never knows what the tier is. A tier below DRAM (today
the SSD tier through tiering.py; a CXL or remote-memory tier would be one
more file implementing this) provides what the keyspace needs to serve,
drop and make room. Moves between tiers (demotion, promotion) are the tier's
policy: it calls `Keyspace.demoted` / `Keyspace.promoted` / `Keyspace.adopt`.
"""

from __future__ import annotations

from typing import Any, Awaitable, Protocol

from quilld.model import CacheTier, Pinned


class LowerEntry(Protocol):
    """One value held by a lower tier."""

    length: int
    crc: int
    pins: int
    expire: int  # when its value expires (unix ms, 0: never), as the tier keeps it


class LowerTier(Protocol):
    tier: CacheTier  # what the residency index calls this tier

    @property
    def active(self) -> bool:
        """Whether the tier takes writes (it exists and has not failed)."""

    def read(self, entry: Any) -> Awaitable[Pinned | bytes | None]:
        """The entry's verified bytes in DRAM (promoted or not, by policy; bytes for a value of
        at most `inline_max` bytes); None when they failed verification (the entry is then
        dropped). Pins the entry until the read is done."""

    async def read_bytes(self, entry: Any) -> bytes:
        """The entry's verified bytes, without promoting it."""

    def drop(self, entry: Any) -> None:
        """The entry's value is no longer wanted: free its space once that is durable."""

    def wake(self) -> None:
        """DRAM is short of space for a write: make room (demote) now."""

    def retime(self, entry: Any, expire: int) -> None:
        """The entry's value now expires at `expire` (unix ms, 0: never): make that durable
        (`synced()` says when)."""

    def writing(self, block: Any) -> bool:
        """Whether `block` is being written to this tier right now (it changed: the tier drops
        or retimes its copy when the write settles, and `synced()` waits for that)."""

    def writing_inline(self, fk: bytes) -> bool:
        """As `writing`, for the inline value of full key `fk`."""

    def synced(self) -> Awaitable[None] | None:
        """What makes every deletion and TTL change requested so far durable (None: nothing to
        wait for).
        The keyspace hands it to callers that must not acknowledge before (take_unsynced)."""
