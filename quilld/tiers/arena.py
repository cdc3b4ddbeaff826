"""The DRAM tier: one memory file, mapped shared, carved into 4 KiB pages by the offset allocator.

The arena knows nothing of keys: it hands out extents, gives memoryviews of
them, and takes them back. Pages are touched only when written, so a large
`--dram` costs address space, not memory, until it is used.

The memory is a file rather than an anonymous mapping so that it has a
descriptor (`fd`): same-host clients allowed to may map it (the shared-memory
path) and large replies can be sent from it with `sendfile`. By default it is
an anonymous memfd that vanishes with the process; `dram.memory_file` names a
file instead (on /dev/shm, say) for operators who want to see it. Either way
its mode is 0600: only a descriptor handed over a unix socket lets another
process map it. The memfd is sealed against resizing (memfd.py), so a client that maps it
cannot truncate it under quilld; a named file cannot be sealed, so no client is handed one.
"""

from __future__ import annotations

import mmap
import os

from quilld.tiers.memfd import seal, sealed_memfd
from quilld.tiers.offset_alloc import NO_SPACE, OffsetAllocator

PAGE = 4096


class DramArena:
    def __init__(self, size: int, memory_file: str = "") -> None:
        """`memory_file`: a path to create the arena as (it must not exist; it is removed at
        close), or "" for an anonymous memfd."""
        self.pages = size // PAGE
        if self.pages < 1:
            raise ValueError("the DRAM arena needs at least one 4 KiB page")
        self.capacity = self.pages * PAGE
        self.path = memory_file
        if memory_file:
            try:
                self.fd = os.open(memory_file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                raise FileExistsError(f"dram.memory_file {memory_file} already exists: another quilld's arena, "
                                      "or one left by a quilld that was killed (remove it if so)") from None
        else:
            self.fd = sealed_memfd("quilld-arena", self.capacity)
        try:
            if memory_file:
                os.ftruncate(self.fd, self.capacity)
            self._mmap = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED)
        except BaseException:
            self._drop_file()
            raise
        # whether the file's size is fixed for good (memfd.py): only then may a client map it
        self.sealed = not memory_file and seal(self.fd)
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
        self._drop_file()

    def _drop_file(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            if self.path:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass


__all__ = ["DramArena", "NO_SPACE", "PAGE"]
