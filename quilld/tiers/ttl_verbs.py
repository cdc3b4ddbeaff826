"""The TTL verbs: EXPIRE and its siblings, TTL, PERSIST, and the periodic sweep.

`TtlVerbs` is mixed into `Keyspace` (keyspace.py) and holds no state of its own: the
deadlines are `Expiry`'s (expiry.py; `Keyspace.expires` is its dict), the values the
keyspace's. A TTL belongs to its key wherever the value is, in DRAM or only below it;
a copy in the lower tier carries it too, so a change of it is made durable there before
it is acknowledged (`_retimed`: whoever answers the client waits for `take_unsynced()`),
whether the copy is written already or being written by a demotion in flight.
"""

from __future__ import annotations

from quilld.tiers.block import Block
from quilld.tiers.expiry import now_ms


class TtlVerbs:
    """Keyspace methods for TTLs (mixed into `Keyspace`)."""

    def set_expire(self, tag: bytes, key: bytes, at_ms: int) -> None:
        """`key` (present) expires at `at_ms`. A copy in the lower tier gets the same TTL,
        durably: whoever acknowledges this waits for `take_unsynced()` (see `_retimed`)."""
        fk = tag + key
        if self.lookup_table is not None:  # its entry holds the old deadline
            self.lookup_table.drop(fk)
        self.ttls.set(fk, at_ms)
        if self.lower_tier is not None:
            self._retimed(fk)
        if self.touched is not None:
            self.touched(fk)

    def ttl_ms(self, tag: bytes, key: bytes) -> int:
        """-2 when missing, -1 when it never expires, else the milliseconds left."""
        if not self.contains(tag, key):
            return -2
        at = self.expires.get(tag + key)
        return -1 if at is None else max(0, at - now_ms())

    def expire_time(self, tag: bytes, key: bytes) -> int:
        """-2 when missing, -1 when it never expires, else when it expires (unix ms)."""
        if not self.contains(tag, key):
            return -2
        return self.expires.get(tag + key, -1)

    def set_ttl(self, tag: bytes, key: bytes, at_ms: int) -> bool:
        """Make `key` expire at `at_ms`, wherever its value is; False when it is missing.

        A copy in the lower tier keeps its TTL too: the change is logged there (or, for a
        write in flight, once it lands) and whoever acknowledges this waits for
        `take_unsynced()`, so no crash brings the value back with its old TTL."""
        if not self.contains(tag, key):
            return False
        self.set_expire(tag, key, at_ms)
        return True

    def persist(self, tag: bytes, key: bytes) -> bool:
        """Remove `key`'s TTL; False when it is missing or has none. As `set_ttl`, a copy in
        the lower tier loses it too, durably once `take_unsynced()` resolves."""
        if not self.contains(tag, key):
            return False
        fk = tag + key
        if self.expires.pop(fk, None) is None:
            return False
        if self.lookup_table is not None:  # its entry holds the old deadline
            self.lookup_table.drop(fk)
        if self.lower_tier is not None:
            self._retimed(fk)
        if self.touched is not None:
            self.touched(fk)
        return True

    def _retimed(self, fk: bytes) -> None:
        """`fk`'s TTL changed: a copy in the lower tier (its only copy, a DRAM value's copy, or
        the one a demotion in flight is writing) must carry the new one before the change is
        acknowledged. The lower tier logs it (`retime`), or checks it when the write lands
        (`writing`); `unsynced` makes the caller wait for that."""
        at = self.expires.get(fk, 0)
        entry = self.lower.get(fk)
        if entry is None:
            value = self.data.get(fk)
            if value is None:
                return
            entry = self.copy_below(fk, value)
            if entry is None:
                if value.__class__ is Block:
                    writing = value.pins and self.lower_tier.writing(value)
                else:
                    writing = self.lower_tier.writing_inline(fk)
                if writing:
                    self.unsynced = True
                return
        if entry.expire != at:
            self.lower_tier.retime(entry, at)
            self.unsynced = True

    def sweep_expired(self, limit: int = 1000) -> int:
        """Remove up to `limit` keys whose time has come (called periodically); none while
        `active_expire` is off (then an expired key stays, counted, until something reads it)."""
        if not self.active_expire:
            return 0
        due, now, n = self.ttls.next_due, now_ms(), 0
        while n < limit:
            fk = due(now)
            if fk is None:
                break
            self._unlink(fk)
            self.stats["expired"] += 1
            n += 1
        return n
