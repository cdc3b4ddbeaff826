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

from quilld.errors import ConfigError
from quilld.tiers.memfd import seal, sealed_memfd
from quilld.tiers.offset_alloc import NO_SPACE, OffsetAllocator

PAGE = 4096
DRAM_WARN_SHARE = 0.8  # of MemAvailable: an arena larger than this may not fit once it fills
MEMINFO = "/proc/meminfo"
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory(meminfo: str = MEMINFO, cgroup_limits: tuple[str, ...] = CGROUP_LIMITS) -> tuple[int, int]:
    """(total, available) bytes of memory this process may use: MemTotal and MemAvailable,
    each capped by the cgroup's memory limit when there is one; 0 where unknown."""
    total = avail = 0
    try:
        with open(meminfo) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    n = int(rest.split()[0]) * 1024
                    total, avail = (n, avail) if name == "MemTotal" else (total, n)
    except (OSError, ValueError, IndexError):
        pass
    for path in cgroup_limits:
        try:
            with open(path) as f:
                limit = int(f.read().strip())  # "max" (no limit) does not parse
        except (OSError, ValueError):
            continue
        if 0 < limit < (total or limit + 1):
            total, avail = limit, min(avail, limit) if avail else limit
        break
    return total, avail


def check_arena_size(size: int, memory: tuple[int, int] | None = None) -> str | None:
    """Refuse (ConfigError) an arena larger than the machine's memory (MemTotal, or the
    cgroup's limit): it could never be filled, and filling it would be killed. Returns a
    warning when it is larger than DRAM_WARN_SHARE of the memory available now, else None.
    Pages are backed only once written, so a large arena starts fine either way: this is
    what makes it fail later, said before it does."""
    total, avail = memory if memory is not None else machine_memory()
    gib = 1 << 30
    if total and size > total:
        raise ConfigError(f"dram.size {size / gib:.1f} GiB (--dram) is larger than this machine's memory "
                          f"({total / gib:.1f} GiB): the arena could never be filled. Give at most "
                          f"{DRAM_WARN_SHARE:.0%} of the memory available ({avail / gib:.1f} GiB now)")
    if avail and size > DRAM_WARN_SHARE * avail:
        return (f"dram.size {size / gib:.1f} GiB (--dram) is more than {DRAM_WARN_SHARE:.0%} of the memory "
                f"available now ({avail / gib:.1f} GiB of {total / gib:.1f} GiB): once the arena fills, the "
                "machine may run out of memory (the kernel's OOM killer, or swapping)")
    return None


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
