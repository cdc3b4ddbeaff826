"""RENAME and COPY: a value (with its TTL) moved or copied to another key of its scope.

`Renames` is mixed into `Keyspace` (keyspace.py) and holds no state of its own: a rename
moves the entry between keys keeping the keyspace's books (scope counts and key arrays,
TTL, tracked placements, the copy in the lower tier, which is stored under the old name);
a copy is a read and a publish through the front door.
"""

from __future__ import annotations

from quilld.model import CacheTier
from quilld.tiers.block import Block


class Renames:
    """Keyspace methods for RENAME and COPY (mixed into `Keyspace`)."""

    def rename(self, tag: bytes, src: bytes, dst: bytes, nx: bool = False) -> int:
        """Move `src`'s value (and TTL) to `dst` in the same scope, replacing `dst` unless `nx`.

        -1 when `src` is missing, 0 when `nx` and `dst` exists (or `nx` and the names are
        the same), 1 when done. `src` must be in DRAM (see `bring_back`). A value's copy in
        the lower tier is stored under the old name: it is dropped (`take_unsynced()`).
        """
        fk, nk = tag + src, tag + dst
        if not self.contains(tag, src):
            return -1
        if fk == nk:
            return 0 if nx else 1
        if self.contains(tag, dst):
            if nx:
                return 0
            if self._unlink(nk):
                self.unsynced = True
        value = self.data.pop(fk)
        at = self.expires.pop(fk, None)
        was_tracked = fk in self.tracked
        bhash = self.tracked.get(fk)
        if was_tracked:
            self._forget(fk)
        if self.lower_tier is not None:  # a copy below is stored under the old name: it goes
            if value.__class__ is not Block:
                if self._small_below(fk):
                    self.unsynced = True
            elif value.lower is not None:
                self.lower_tier.drop(value.lower)
                value.lower = None
                self.unsynced = True
            elif value.pins and self.lower_tier.writing(value):
                self.unsynced = True  # the demotion in flight writes it under the old name
        self.data[nk] = value
        self._added(nk)
        if self.freq is not None:  # the value keeps its LFU counter under its new name
            self.freq.moved(fk, nk)
        if fk in self.labels:  # and its label
            self.labels[nk] = self.labels[fk]
        self._removed(fk)
        if self.deleted is not None:  # the old name is gone as by a DEL
            self.deleted(fk)
        if self.touched is not None:
            self.touched(nk)
        if at is not None:
            self.set_expire(tag, dst, at)
        if self.listener is not None and (was_tracked or value.__class__ is Block or self.track_all):
            self.tracked[nk] = bhash
            self.listener.placed(nk, CacheTier.DRAM, len(value), bhash)
        return 1

    def copy(self, tag: bytes, src: bytes, dst: bytes, replace: bool = False) -> bool:
        """Copy `src`'s value (and TTL) to `dst` in the same scope; False when `src` is
        missing, or `dst` exists and not `replace`. `src` must be in DRAM (see `bring_back`);
        a block is copied into a new block (OutOfMemory when none fits)."""
        value = self.lookup(tag, src)
        if value is None:
            return False
        if not replace and self.contains(tag, dst):
            return False
        at = self.expires.get(tag + src)
        if value.__class__ is Block:
            self.pin(value)  # making room must not evict the source
            try:
                dup = self.reserve(value.length)
                self.write_view(dup)[:] = self.view(value)
            finally:
                self.unpin(value)
            value = dup
        self.publish(tag, dst, value)
        label = self.labels.get(tag + src)
        if label is not None:
            self.labels[tag + dst] = label
        if at is not None:
            self.set_expire(tag, dst, at)
        return True
