"""The DRAM tier: one anonymous mmap carved into 4 KiB pages by the offset allocator.

The arena knows nothing of keys: it hands out extents, gives memoryviews of
them, and takes them back. Pages are touched only when written, so a large
`--dram` costs address space, not memory, until it is used.
"""

from __future__ import annotations

import mmap

from quilld.tiers.offset_alloc import NO_SPACE, OffsetAllocator

PAGE = 4096


class DramArena:
    def __init__(self, size: int) -> None:
        self.pages = size // PAGE
        if self.pages < 1:
            raise ValueError("the DRAM arena needs at least one 4 KiB page")
        self.capacity = self.pages * PAGE
        self._mmap = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._mmap)
        self._alloc = OffsetAllocator(self.pages)

    def reserve(self, nbytes: int) -> int:
        """An extent of at least `nbytes` (rounded up to pages): its handle, or NO_SPACE."""
        return self._alloc.alloc(max(1, -(-nbytes // PAGE)))

    def offset(self, handle: int) -> int:
        return self._alloc.offset(handle) * PAGE

    def view(self, handle: int, nbytes: int) -> memoryview:
        start = self._alloc.offset(handle) * PAGE
        return self._view[start:start + nbytes]

    @property
    def region(self) -> memoryview:
        """The whole arena, for registering it with an RDMA device (cluster/rdma.py)."""
        return self._view

    def release(self, handle: int) -> None:
        self._alloc.free(handle)

    @property
    def used(self) -> int:
        return self._alloc.used * PAGE

    def stats(self) -> dict[str, float]:
        a = self._alloc
        return {
            "capacity": self.capacity,
            "used": a.used * PAGE,
            "free": a.free_units * PAGE,
            "largest_free": a.largest_free() * PAGE,
            "fragmentation": round(a.fragmentation(), 4),
        }

    def close(self) -> None:
        self._view.release()
        self._mmap.close()


__all__ = ["DramArena", "NO_SPACE", "PAGE"]
