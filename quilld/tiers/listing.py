"""What KEYS, SCAN, RANDOMKEY, OBJECT and MEMORY USAGE see of a scope's keys.

`Listing` is mixed into `Keyspace` (keyspace.py) and holds no state of its own: each
enumerated scope's key array is `ScopeKeys`' (scope_keys.py), kept by the keyspace's
`_added`/`_removed`. Keys met expired are reclaimed, as redis does.
"""

from __future__ import annotations

import random
import time
from typing import Callable, NamedTuple

from quilld.model import CacheTier
from quilld.scopes import TAG_LEN
from quilld.tiers.block import page_extent
from quilld.tiers.expiry import now_ms


class KeyFacts(NamedTuple):
    """What OBJECT and MEMORY USAGE tell about one key's value."""

    tier: CacheTier  # where the value lives (DRAM, or only the tier below)
    length: int  # the value's bytes
    inline: bytes | None  # the value itself when it is kept in the entry (at most dram.inline_max bytes)
    idle_s: float | None  # seconds since its last read: arena blocks only (inline values keep no clock)
    dram_bytes: int  # DRAM the value holds: its bytes inline, whole pages in the arena, 0 below DRAM
    freq: int | None = None  # its LFU counter (eviction.py), under an LFU maxmemory policy only
    label: bytes | None = None  # what a caller labelled its inline value (`label`), if anything


class Listing:
    """Keyspace methods for enumeration and key facts (mixed into `Keyspace`)."""

    def _keys_of(self, tag: bytes) -> list[bytes]:
        """Scope `tag`'s key array, built by one pass over the keyspace at its first use."""
        return self.enumerated.of(tag, self.per_scope.get(tag, 0), self.data, self.lower)

    def keys_matching(self, tag: bytes, match: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Scope `tag`'s live keys (without the tag) that `match` accepts (all when None)."""
        keys = self._keys_of(tag)
        if not keys:
            return []
        expires, expired, now, cut = self.expires, self.ttls.expired, now_ms(), TAG_LEN
        out = []
        for fk in keys:
            key = fk[cut:]
            if match is not None and not match(key):
                continue
            if expires and expired(fk, now):
                continue
            out.append(key)
        return out

    def scan(self, tag: bytes, cursor: int, count: int,
             keep: Callable[[bytes], bool] | None = None) -> tuple[int, list[bytes]]:
        """One step of a scan of scope `tag`: (next cursor, keys), 0 once the scan is over.

        Which keys a scan returns, and why a key present for the whole scan is returned,
        is told at `ScopeKeys.window` (scope_keys.py). Keys that `keep` accepts and that
        have expired are reclaimed, as redis's SCAN does.
        """
        keys = self._keys_of(tag)
        if not keys:
            return 0, []
        low, window = self.enumerated.window(keys, cursor, count)
        out = []
        expires, expired, now, cut = self.expires, self.ttls.expired, now_ms(), TAG_LEN
        for fk in window:
            key = fk[cut:]
            if keep is not None and not keep(key):
                continue
            if expires and expired(fk, now):
                self._unlink(fk)  # its slot goes to a key at or above `low`: visited or new
                self.stats["expired"] += 1
                continue
            out.append(key)
        return low, out

    def random_key(self, tag: bytes) -> bytes | None:
        """A live key of scope `tag` picked at random, or None; expired keys met are reclaimed."""
        keys = self._keys_of(tag)
        now = now_ms()
        while keys:
            fk = keys[random.randrange(len(keys))]
            if self.expires and self.ttls.expired(fk, now):
                self._unlink(fk)
                self.stats["expired"] += 1
                keys = self._scope_keys.get(tag)
                continue
            return fk[TAG_LEN:]
        return None

    def label(self, tag: bytes, key: bytes, label: bytes) -> None:
        """Label `key`'s inline value (facts' `label`) until it is replaced or deleted: for what its
        bytes do not tell (OBJECT ENCODING of a string redis edited in place). A block, or a
        missing key, takes no label."""
        fk = tag + key
        if self.data.get(fk).__class__ is bytes:
            self.labels[fk] = label

    def facts(self, tag: bytes, key: bytes, expire: bool = True) -> KeyFacts | None:
        """What is known of `key`'s value, without counting a read or refreshing its LRU
        place; None when missing. `expire=False` also describes an expired key not yet
        reclaimed (as MEMORY USAGE does)."""
        fk = tag + key
        if expire and not self.contains(tag, key):
            return None
        value = self.data.get(fk)
        entry = None
        if value is None:
            entry = self.lower.get(fk)
            if entry is None:
                return None
        freq = None if self.freq is None else self.freq.of(fk)
        if value is None:
            return KeyFacts(self.lower_tier.tier, entry.length, None, None, 0, freq)
        if value.__class__ is bytes:
            return KeyFacts(CacheTier.DRAM, len(value), value, None, len(value), freq, self.labels.get(fk))
        return KeyFacts(CacheTier.DRAM, value.length, None, max(0.0, time.time() - value.last_access),
                        page_extent(value.length), freq)
