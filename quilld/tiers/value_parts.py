"""Parts of a value, read and written in place (GETRANGE, SETRANGE, APPEND, the bit commands).

`ValueParts` is mixed into `Keyspace` (keyspace.py) and holds no state of its own: it is
built on the front door's primitives (`lookup`, `pin`/`unpin`, `reserve`/`write_view`/
`discard`, `publish`, `bring_back`) and its fields (`data`, `lower`, `expires`, `arena`,
`lower_tier`). `size` and `read_slice` read a slice without copying a block; `write_range`
changes bytes where they lie when no reader can see it, and otherwise copies on write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from quilld.model import CacheTier, Pending, Pinned
from quilld.tiers.block import Block, page_extent
from quilld.tiers.expiry import now_ms

_ZEROS = memoryview(bytes(1 << 20))


def _never(result: Any) -> bool:
    return False


def _zero(view: memoryview) -> None:
    """Fill `view` with zero bytes, a MiB at a time (no buffer the size of the view)."""
    step = len(_ZEROS)
    for i in range(0, len(view), step):
        part = view[i:i + step]
        part[:] = _ZEROS[:len(part)]


class ValueParts:
    """Keyspace methods for parts of a value (mixed into `Keyspace`)."""

    def size(self, tag: bytes, key: bytes) -> int | None:
        """The length of `key`'s value wherever it lives; None when missing. Not counted as a read."""
        if not self.contains(tag, key):
            return None
        fk = tag + key
        value = self.data.get(fk)
        return len(value if value is not None else self.lower[fk])

    def read_slice(self, tag: bytes, key: bytes, span: Callable[[int], tuple[int, int]]):
        """Bytes `lo:hi` of `key`'s value, `(lo, hi) = span(length)` with 0 <= lo and hi <= length.

        An inline value gives bytes; an arena block a `Pinned` view of just that slice, no copy
        of the block (release it when sent: until then the block is neither freed nor written in
        place, see `write_range`); a value only below DRAM a `Pending` read resolving to the
        same; a missing key None. An empty slice is b"".
        """
        value = self.lookup(tag, key)
        t = value.__class__
        if t is bytes:
            lo, hi = span(len(value))
            return value[lo:hi]
        if t is Block:
            lo, hi = span(value.length)
            if lo >= hi:
                return b""
            self.pin(value)
            return Pinned(self.arena.view(value.handle, hi)[lo:], lambda: self.unpin(value))
        if value is None:
            return None
        return Pending(self._slice_below(self.lower_tier.read(value), span))  # read() pins the entry now

    @staticmethod
    async def _slice_below(read: Any, span: Callable[[int], tuple[int, int]]):
        pinned = await read
        if pinned is None:  # it failed verification: the value is gone
            return None
        lo, hi = span(len(pinned.view))
        if lo >= hi:
            pinned.release()
            return b""
        return Pinned(pinned.view[lo:hi], pinned.release)

    def write_range(self, tag: bytes, key: bytes, offset: int | None, n: int, fn: Callable[[memoryview], Any],
                    unchanged: Callable[[Any], bool] | None = None, label: bytes | None = None) -> Any:
        """Change bytes `offset:offset+n` of `key`'s value where it lies; returns `fn`'s result.

        The value is first made at least `offset + n` bytes long, padded with zero bytes (a
        missing key is created, unless that length is 0); `offset=None` means its end (an
        append). Then `fn(view)` gets a writable view of the whole value; it may read all of it
        but write only those `n` bytes, and must not keep the view. The TTL is kept.

        - An inline value is rebuilt; past `dram.inline_max` bytes it moves to a new arena block.
        - An arena block no reader pins is written in place, no copy of it made, if it keeps its
          pages (it may grow into its last page's slack). Its CRC is forgotten, and a copy in
          the lower tier is stale, so it is dropped: whoever acknowledges the write waits for
          `take_unsynced()` first.
        - A pinned block (a reply being sent, a peer's RDMA lease, a demotion being written) is
          never written under its readers: the change goes to a copy published in its place
          (copy-on-write), and they keep the old bytes until they release them. Likewise a
          block that must grow past its pages.
        - A value only below DRAM is read back into a DRAM block first (keeping its lower copy,
          as a promoting read does): a `Pending` is returned, resolving to `fn`'s result.
          With `n == 0` that alone happens, and nothing is written anywhere.

        `unchanged(result)`, when given, tells from `fn`'s result that `fn` changed no byte: a
        value that neither is created nor grows is then no change at all (no WATCH touched, no
        copy published, its CRC and lower copy kept), as redis counts SETBIT and BITFIELD.
        `label`, when given, is the value's `label` once written (changed or not; see Listing.label).

        OutOfMemory is raised before anything changes.
        """
        result = self._write_range(tag, key, offset, n, fn, unchanged, label)
        if label is not None and result.__class__ is not Pending:
            self.label(tag, key, label)
        return result

    def _write_range(self, tag: bytes, key: bytes, offset: int | None, n: int, fn: Callable[[memoryview], Any],
                     unchanged: Callable[[Any], bool] | None, label: bytes | None) -> Any:
        fk = tag + key
        value = self.data.get(fk)
        if value is None:
            if fk in self.lower:
                return Pending(self._write_below(tag, key, offset, n, fn, unchanged, label))
        elif self.expires and fk in self.expires and self.expires[fk] <= now_ms():
            self._unlink(fk)
            self.stats["expired"] += 1
            value = None
        is_block = value.__class__ is Block
        if n == 0:  # nothing is written: no copy, nothing forgotten
            if is_block:
                return fn(self.arena.view(value.handle, value.length))
            return fn(memoryview(value or b""))
        old = 0 if value is None else len(value)
        new = max(old, (old if offset is None else offset) + n)
        if unchanged is None or value is None or new > old:  # created or grown: a change whatever fn does
            unchanged = _never
        if not is_block:
            return self._rebuilt(tag, key, value or b"", new, fn, unchanged)
        if not value.pins and page_extent(new) == page_extent(old):
            if self.lookup_table is not None:  # before its bytes change under a reader
                self.lookup_table.drop(fk)
            view = self.arena.view(value.handle, new)
            if new > old:
                _zero(view[old:])
                value.length = new
            result = fn(view)
            if not unchanged(result):
                self._rewritten(fk, value)
            return result
        self.pin(value)  # copy-on-write: making room must not evict the source
        try:
            return self._rebuilt(tag, key, self.arena.view(value.handle, old), new, fn, unchanged)
        finally:
            self.unpin(value)

    def _rebuilt(self, tag: bytes, key: bytes, src: Any, new: int, fn: Callable[[memoryview], Any],
                 unchanged: Callable[[Any], bool]) -> Any:
        """Publish a new value of `new` bytes: `src`, zero bytes up to `new`, then changed by `fn`
        (unless `unchanged(result)`: then the old value stays, untouched)."""
        had = len(src)
        if new <= self.inline_max:
            buf = bytearray(new)
            buf[:had] = src
            result = fn(memoryview(buf))
            if not unchanged(result):
                self.publish(tag, key, bytes(buf), keep_ttl=True)
            return result
        block = self.reserve(new)
        try:
            view = self.write_view(block)
            view[:had] = src
            _zero(view[had:])
            result = fn(view)
        except BaseException:
            self.discard(block)
            raise
        if unchanged(result):
            self.discard(block)
        else:
            self.publish(tag, key, block, keep_ttl=True)
        return result

    def _rewritten(self, fk: bytes, block: Block) -> None:
        """`block` (resident, unpinned) was changed in place: its CRC and lower copy are stale."""
        block.crc = None
        block.last_access = time.time()
        if block.lower is not None:
            self.lower_tier.drop(block.lower)
            block.lower = None
            self.unsynced = True
        if self.listener is not None:
            if self.tracked:
                self._forget(fk)  # its bytes changed: no longer the engine block it was published as
            self.tracked[fk] = None
            self.listener.placed(fk, CacheTier.DRAM, block.length, None)
        self.data.move_to_end(fk)
        self.writes += 1
        if self.touched is not None:
            self.touched(fk)

    async def _write_below(self, tag: bytes, key: bytes, offset: int | None, n: int, fn: Callable[[memoryview], Any],
                           unchanged: Callable[[Any], bool] | None, label: bytes | None) -> Any:
        await self.bring_back(tag, key)
        result = self.write_range(tag, key, offset, n, fn, unchanged, label)  # in DRAM now, unless changed meanwhile
        return await result.awaitable if result.__class__ is Pending else result
