"""A DRAM block's life, owned here: the states, the legal moves between them, the object.

    RESERVED --(bytes start to arrive)--> WRITING --(publish)--> RESIDENT
       |                                     |                      |
       +--------------(discard)--------------+             (unlinked while pinned)
       |                                                            v
       +------------------------> GONE <-------(last unpin)---- EVICTING

A RESERVED or WRITING block is invisible; only RESIDENT ones are in the
keyspace. A block unlinked (deleted, overwritten, evicted, demoted) while a
reader holds a pin is EVICTING until the last pin goes; its space returns to
the allocator only on GONE. The keyspace (keyspace.py) performs the moves;
`Block.to` refuses any move the diagram does not have.
"""

from __future__ import annotations

import enum
from typing import Any

from quilld.tiers.arena import PAGE


class BlockState(enum.IntEnum):
    RESERVED = 0  # space held, nothing received yet, invisible
    WRITING = 1  # bytes arriving (a large SET, PUT2PHASE DATA, an SSD read, a peer fetch), invisible
    RESIDENT = 2  # published, readable
    EVICTING = 3  # unlinked from the keyspace, space freed when the last reader unpins
    GONE = 4  # space returned to the allocator


_MOVES = {
    BlockState.RESERVED: (BlockState.WRITING, BlockState.RESIDENT, BlockState.GONE),
    BlockState.WRITING: (BlockState.RESIDENT, BlockState.GONE),
    BlockState.RESIDENT: (BlockState.EVICTING, BlockState.GONE),
    BlockState.EVICTING: (BlockState.GONE,),
    BlockState.GONE: (),
}
UNPUBLISHED = (BlockState.RESERVED, BlockState.WRITING)


class BlockStateError(AssertionError):
    """A move the life cycle does not allow: a bug in whoever asked for it."""


class Block:
    """An arena-resident value: the one per-block object beyond its dict entry."""

    __slots__ = ("handle", "length", "pins", "state", "last_access", "lower", "crc", "owner")

    def __init__(self, handle: int, length: int) -> None:
        self.handle = handle
        self.length = length
        self.pins = 0
        self.state = BlockState.RESERVED
        self.last_access = 0.0
        self.lower: Any = None  # the lower tier's entry holding the same bytes, when there is one
        self.crc: int | None = None  # CRC32C of the published bytes, once someone computed it
        self.owner: str | None = None  # the tenant whose bytes are awaited, while unpublished

    def __len__(self) -> int:
        return self.length

    @property
    def unpublished(self) -> bool:
        return self.state in UNPUBLISHED

    def to(self, state: BlockState) -> None:
        if state not in _MOVES[self.state]:
            raise BlockStateError(f"block {self.handle}: {self.state.name} -> {state.name} is not a legal move")
        self.state = state


def page_extent(nbytes: int) -> int:
    """Arena bytes a value of `nbytes` occupies: whole pages, at least one."""
    return max(1, -(-nbytes // PAGE)) * PAGE
