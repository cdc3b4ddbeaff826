"""A block's life cycle (tiers/block.py) as the keyspace drives it, and the moves it refuses."""

from __future__ import annotations

import pytest

from quilld.config import DramConfig
from quilld.scopes import ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.block import Block, BlockState, BlockStateError
from quilld.tiers.keyspace import Keyspace

S = BlockState


def keyspace() -> Keyspace:
    return Keyspace(DramConfig(size=16 * PAGE, inline_max=256), ScopeRegistry())


def test_reserved_writing_resident_evicting_gone():
    ks = keyspace()
    block = ks.reserve(2 * PAGE)
    assert block.state is S.RESERVED and block.unpublished
    ks.write_view(block)[:] = b"a" * 2 * PAGE
    assert block.state is S.WRITING and block.unpublished
    ks.publish(b"\0\0\0\0", b"k", block)
    assert block.state is S.RESIDENT and not block.unpublished
    pinned = ks.pinned(block)
    ks.delete(b"\0\0\0\0", b"k")
    assert block.state is S.EVICTING  # a reader still holds it
    assert bytes(pinned.view[:1]) == b"a"
    pinned.release()
    assert block.state is S.GONE and ks.used == 0


def test_a_reservation_never_written_can_be_published_or_discarded():
    ks = keyspace()
    empty = ks.reserve(PAGE)
    ks.discard(empty)
    assert empty.state is S.GONE and ks.reserved_blocks == 0 and ks.used == 0


def test_discard_of_a_published_block_does_nothing():
    ks = keyspace()
    block = ks.materialize(b"x" * 5000)
    ks.publish(b"\0\0\0\0", b"k", block)
    ks.discard(block)
    assert block.state is S.RESIDENT and ks.block_count == 1


@pytest.mark.parametrize("start,bad", [
    (S.RESERVED, S.EVICTING), (S.WRITING, S.RESERVED), (S.WRITING, S.EVICTING),
    (S.RESIDENT, S.WRITING), (S.RESIDENT, S.RESERVED), (S.EVICTING, S.RESIDENT), (S.GONE, S.RESIDENT),
    (S.GONE, S.GONE),
])
def test_moves_outside_the_diagram_are_refused(start, bad):
    block = Block(0, 10)
    block.state = start
    with pytest.raises(BlockStateError):
        block.to(bad)
    assert block.state is start
