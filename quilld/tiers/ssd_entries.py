"""The SSD tier's items, as its loop thread and its I/O threads pass them around: an extent
given by the allocators, a write on its way to disk, a published entry; and how a batch of
writes is cut into the runs one pwritev each writes (ssd.py). No I/O here."""

from __future__ import annotations

import ctypes

from quilld.tiers.ssd_format import PAGE, Scope, block_pages, payload_offset

WRITE_CHUNK = 4 << 20  # bytes of adjacent blocks one pwritev writes, at most (one I/O thread's share)


class Extent:
    """Space for one block, from `allocate`: `pages` pages at byte `offset` of segment `seg`."""

    __slots__ = ("seg", "offset", "pages", "handle", "generation")

    def __init__(self, seg: int, offset: int, pages: int, handle: int, generation: int) -> None:
        self.seg, self.offset, self.pages = seg, offset, pages
        self.handle, self.generation = handle, generation


class PendingWrite:
    """A block on its way to disk. `write_blocks` fills `length` and `crc` (unless given:
    the CRC32C of `payload`, already known) and `commit` sets `durable` once the batch is
    in the WAL; only durable writes can be published. `expire`: when the value expires
    (unix ms, 0: never), written into its header and record."""

    __slots__ = ("scope", "key", "payload", "extent", "length", "crc", "durable", "head", "header", "expire")

    def __init__(self, scope: Scope, key: bytes, payload, extent: Extent, crc: int | None = None,
                 expire: int = 0) -> None:
        self.scope, self.key, self.payload, self.extent = scope, key, payload, extent
        self.expire = expire
        self.length = 0
        self.crc = crc
        self.durable = False
        self.head = None  # the head's first page as written (between write_blocks and commit)
        self.header = b""


class SsdEntry:
    """A published block. `pins` > 0 keeps its space while reads are in flight; a
    `retired` entry (replaced or forgotten) is freed at the last unpin. `expire` is when
    its value expires (unix ms, 0: never) as its record and any META record since say,
    or as a META record still to be logged will (`log_changes`)."""

    __slots__ = ("scope", "key", "seg", "offset", "length", "crc", "generation", "handle",
                 "pins", "retired", "expire")

    def __init__(self, scope: Scope, key: bytes, seg: int, offset: int, length: int, crc: int,
                 generation: int, handle: int, expire: int = 0) -> None:
        self.scope, self.key, self.seg, self.offset = scope, key, seg, offset
        self.length, self.crc, self.generation, self.handle = length, crc, generation, handle
        self.expire = expire
        self.pins = 0
        self.retired = False

    def __len__(self) -> int:
        return self.length


Freed = tuple[int, int, int]  # seg, byte offset, allocator handle: an extent waiting for its scrub


def page_aligned(view: memoryview) -> bool:
    """Whether `view`'s memory starts on a page boundary (only writable memory is looked
    at: the arena's is; a bytes payload is copied under O_DIRECT)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE == 0
    except (TypeError, ValueError):
        return False


def spare_pages(it: PendingWrite, direct: bool) -> int:
    """Aligned scratch pages `SsdTier._write_run` needs for `it`: its head (a packed block's
    payload inside it), and the part of its payload that cannot be written from where it lies."""
    view = memoryview(it.payload).cast("B")
    n = len(view)
    pages = block_pages(it.scope, it.key, n)
    if pages == 1 or direct and not page_aligned(view):
        return pages
    return payload_offset(it.scope, it.key, n) // PAGE + (1 if n % PAGE else 0)


def cut_runs(items: list[PendingWrite]) -> list[list[PendingWrite]]:
    """`items` (sorted by segment and offset) cut into runs of adjacent extents of at most
    WRITE_CHUNK bytes (a block larger than that is a run of its own)."""
    runs: list[list[PendingWrite]] = []
    end = seg = -1
    size = 0
    for it in items:
        ext = it.extent
        if ext.seg == seg and ext.offset == end and size + ext.pages * PAGE <= WRITE_CHUNK:
            runs[-1].append(it)
            size += ext.pages * PAGE
        else:
            runs.append([it])
            size = ext.pages * PAGE
        seg, end = ext.seg, ext.offset + ext.pages * PAGE
    return runs
