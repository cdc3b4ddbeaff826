"""Enumeration: each scope's keys in an array, for KEYS, SCAN and RANDOMKEY.

`ScopeKeys` holds the keys of each scope that was ever enumerated in an array with
swap-remove, built at the scope's first enumeration (`of`) and kept up to date from then
on while the scope has keys; `slot` is a key's index in its scope's array. The upkeep is
on the write path (a SET of a new key), so the keyspace does it inline in
`Keyspace._added`/`_removed` (keyspace.py), with no call: a key added is appended, a key
removed leaves its slot to the scope's last key, and an emptied scope's array goes. A node
nobody enumerates pays nothing for it: no memory, one truth test per new or gone key.

It holds full keys (scope tag + key) and knows nothing of values or TTLs: the keyspace's
`keys_matching`, `scan` and `random_key` skip and reclaim expired keys.
"""

from __future__ import annotations

from collections.abc import Iterable

from quilld.scopes import TAG_LEN


class ScopeKeys:
    def __init__(self) -> None:
        self.arrays: dict[bytes, list[bytes]] = {}  # scope tag -> its full keys
        self.slot: dict[bytes, int] = {}  # full key -> its index in its scope's array

    def of(self, tag: bytes, held: int, *sources: Iterable[bytes]) -> list[bytes]:
        """Scope `tag`'s key array; at its first use built by one pass over `sources` (every
        full key of the keyspace), unless the scope holds no key (`held` is 0)."""
        keys = self.arrays.get(tag)
        if keys is None:
            if not held:
                return []
            keys = [fk for source in sources for fk in source if fk[:TAG_LEN] == tag]
            slot = self.slot
            for i, fk in enumerate(keys):
                slot[fk] = i
            self.arrays[tag] = keys
        return keys

    @staticmethod
    def window(keys: list[bytes], cursor: int, count: int) -> tuple[int, list[bytes]]:
        """One step of a scan of a scope's array `keys`: (next cursor, the full keys to visit).

        A key removed leaves its slot to the scope's last key (swap-remove) and a new key is
        appended, so a key's index only ever goes down. A cursor `c` means "the slots below
        `c` are left" (0 starts at the top: every slot is left) and a step visits the `count`
        slots just below it, from the top down; the next cursor is the lowest slot visited
        (0 once the scan is over). A key present for the whole scan starts below the first
        cursor and only moves lower, so it is visited; one added meanwhile may or may not be,
        one moved by a removal may be visited twice. LRU reordering, tier moves and TTLs never
        move a key. A scope's array is built at its first enumeration with every key it has
        then, so a key present for the whole scan is in it.
        """
        n = len(keys)
        top = n if cursor == 0 or cursor > n else cursor
        low = max(0, top - count)
        window = keys[low:top]
        window.reverse()
        return low, window
