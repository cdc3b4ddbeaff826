"""A block made of several buffers: gathered for a put, scattered by a read.

An engine's page is often not one buffer: SGLang's `layer_first` host pool holds a page as
one K and one V slice per layer, 2 x layers buffers in all. `put_blocks` stores a list of
buffers as one block (their concatenation, in order) and `get_many_into` reads a block into
a list of buffers (the first `len(b0)` bytes into b0, the next into b1, ...), so such a
page is one object, written and read whole (one command, one CRC32C, never half stored).

Over shared memory the pieces are copied straight between the caller's buffers and the
arena. Over TCP a read is received straight into the pieces (quillwire's ReplyReader
scatters a payload over a list of buffers); a put joins them into one staging buffer
first (one extra copy of the page, on a path that already copies through the socket).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c

from quillwire.encode import as_readable


class Segments:
    """Buffers that make one block, in order. `len()` is their total size in bytes."""

    __slots__ = ("views", "nbytes")

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = list(views)
        self.nbytes = sum(v.nbytes for v in self.views)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<Segments {len(self.views)} buffers, {self.nbytes} bytes>"

    def crc32c(self, n: int | None = None) -> int:
        """CRC32C of the first `n` bytes (all by default), chained over the pieces."""
        left = self.nbytes if n is None else n
        crc = 0
        for v in self.views:
            if left <= 0:
                break
            piece = v if v.nbytes <= left else v[:left]
            crc = crc32c.crc32c(piece, crc)
            left -= piece.nbytes
        return crc

    def copy_to(self, dst: memoryview) -> None:
        """Gather: the pieces, one after the other, into the front of `dst`."""
        pos = 0
        for v in self.views:
            end = pos + v.nbytes
            dst[pos:end] = v
            pos = end

    def fill_from(self, src: memoryview) -> None:
        """Scatter: `src` (at most `nbytes`) over the pieces, in order."""
        pos, total = 0, src.nbytes
        for v in self.views:
            if pos >= total:
                break
            take = min(v.nbytes, total - pos)
            v[:take] = src[pos:pos + take]
            pos += take

    def joined(self) -> bytearray:
        """The block as one new buffer (the TCP path's staging copy)."""
        out = bytearray(self.nbytes)
        self.copy_to(memoryview(out))
        return out


def readable(data: Any) -> memoryview | Segments:
    """A flat byte view of one buffer, or Segments for a list or tuple of buffers."""
    if isinstance(data, (list, tuple)):
        return Segments([as_readable(d) for d in data])
    return as_readable(data)


def writable(buffer: Any) -> memoryview | Segments:
    """A flat writable byte view of one buffer, or Segments for a list or tuple of buffers."""
    if isinstance(buffer, (list, tuple)):
        return Segments([as_writable(b) for b in buffer])
    return as_writable(buffer)


def as_writable(buffer: Any) -> memoryview:
    """A flat writable byte view of `buffer`; TypeError for read-only objects."""
    view = as_readable(buffer)
    if view.readonly:
        raise TypeError(f"{type(buffer).__name__} is read-only: get_into needs a writable buffer "
                        "(bytearray, numpy array, mmap, memoryview)")
    return view


def crc_of(data: memoryview | Segments) -> int:
    return data.crc32c() if isinstance(data, Segments) else crc32c.crc32c(data)


def store(dst: memoryview, data: memoryview | Segments) -> None:
    """`data` copied into the front of `dst`."""
    if isinstance(data, Segments):
        data.copy_to(dst)
    else:
        dst[:data.nbytes] = data


def land(target: memoryview | Segments, src: Any) -> None:
    """`src` (bytes or a view) copied into the front of `target`."""
    if isinstance(target, Segments):
        target.fill_from(memoryview(src))
    else:
        target[:len(src)] = src
