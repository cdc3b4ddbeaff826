"""Memory files that other processes may map but never resize (the shared-memory path).

A descriptor handed to a client (SHM ATTACH) lets it do to the file whatever its open mode
allows. Had it truncated the arena, quilld's next access to a page past the new end would
have died of SIGBUS, which no Python code survives. So the arena and the lease table are
memfds created with MFD_ALLOW_SEALING and sealed once sized:

- F_SEAL_SHRINK and F_SEAL_GROW: ftruncate and fallocate past the end fail (EPERM) for
  everyone, through any descriptor, reopened ones (/proc/<pid>/fd/N) included;
- F_SEAL_FUTURE_WRITE (the lease table only: clients only read it): no new writable mapping
  and no write(2), while quilld's own mapping, made before, still writes;
- F_SEAL_SEAL: nobody adds a seal after (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE on the arena
  would stop other clients' in-place puts).

What a mapping client can still do to the arena is write its bytes (docs/tiers/shared-memory.md: map users are
trusted with every tenant's blocks) or punch holes in it (the pages read back as zeros):
neither stops quilld; a block's CRC32C says when its bytes changed.
"""

from __future__ import annotations

import fcntl
import os

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; Python has no name for it
RESIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of `size` bytes that can take seals (`seal` them once mapped)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal(fd: int, read_only: bool = False) -> bool:
    """Forbid resizing `fd`'s file (and, `read_only`, any new writer); whether the seals took
    (a file that is no memfd, or a kernel without seals: False)."""
    seals = RESIZE_SEALS | (F_SEAL_FUTURE_WRITE if read_only else 0)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals == seals
    except OSError:
        return False


def reopened_read_only(fd: int) -> int:
    """A second descriptor of `fd`'s file, opened read-only: what a reader is handed."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
