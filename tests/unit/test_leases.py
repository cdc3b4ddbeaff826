"""The shared-memory path's lease table (quilld/tiers/leases.py) on a real keyspace, no server.

What a reader of the table's memory observes: a lease's generation changes when the lease
ends, before its block can be freed; expiry is bounded per pass; an owner's leases end with it.
"""

from __future__ import annotations

import mmap
import os

import pytest

from quilld.config import DramConfig
from quilld.scopes import ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.block import BlockState
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.leases import LeaseLimit, LeaseTable


@pytest.fixture
def ks():
    k = Keyspace(DramConfig(size=64 * PAGE, inline_max=256), ScopeRegistry())
    yield k
    k.close()


def _block(ks: Keyspace, key: bytes, nbytes: int = 3 * PAGE, fill: bytes = b"a"):
    b = ks.reserve(nbytes)
    ks.write_view(b)[:] = fill * nbytes
    ks.publish(b"", key, b)
    return b


def _mapped(table: LeaseTable) -> memoryview:
    """The table as another process maps it: through its descriptor."""
    mm = mmap.mmap(os.dup(table.fd), table.slots * 8, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return memoryview(mm).cast("Q")


def test_grant_pins_and_release_bumps_the_generation_before_the_block_can_go(ks):
    table = LeaseTable(ks, 8, lease_ms=1000, max_per_owner=4)
    seen = _mapped(table)
    block = _block(ks, b"k")
    slot, gen = table.grant(1, block)
    assert block.pins == 1 and seen[slot] == gen and table.live == 1
    assert ks.delete(b"", b"k")
    assert block.state is BlockState.EVICTING  # deleted, but the lease keeps it
    assert not table.release(2, slot), "another owner cannot end it"
    assert table.release(1, slot)
    assert seen[slot] == gen + 1, "a reader re-checking its slot sees the lease ended"
    assert block.state is BlockState.GONE and table.live == 0
    assert not table.release(1, slot), "a lease ends once"
    table.close()


def test_a_slot_reused_gets_a_new_generation(ks):
    table = LeaseTable(ks, 1, lease_ms=1000, max_per_owner=4)
    b = _block(ks, b"k")
    s1, g1 = table.grant(1, b)
    table.release(1, s1)
    s2, g2 = table.grant(1, b)
    assert s1 == s2 and g2 == g1 + 1
    table.close()


def test_expiry_ends_leases_past_their_deadline_bounded_per_pass(ks):
    table = LeaseTable(ks, 16, lease_ms=10, max_per_owner=16)
    b = _block(ks, b"k")
    leases = [table.grant(7, b) for _ in range(10)]
    assert b.pins == 10
    assert table.expire(now=0.0) == 0, "nothing is due yet"
    far = 1e12
    assert table.expire(now=far, limit=4) == 4
    assert table.live == 6
    assert table.expire(now=far) == 6
    assert b.pins == 0 and table.expired == 10
    gens = _mapped(table)
    assert all(gens[slot] == gen + 1 for slot, gen in leases)
    table.close()


def test_released_leases_are_not_expired_again(ks):
    table = LeaseTable(ks, 4, lease_ms=10, max_per_owner=4)
    b = _block(ks, b"k")
    slot, gen = table.grant(1, b)
    table.release(1, slot)
    slot2, gen2 = table.grant(2, b)  # the same slot, a new lease
    assert slot2 == slot
    assert table.expire(now=1e12, limit=1) == 0, "the released lease's entry is skipped, not ended twice"
    assert table.live == 1 and b.pins == 1
    assert table.expire(now=1e12) == 1 and b.pins == 0
    table.close()


def test_an_owner_that_goes_away_frees_its_leases(ks):
    table = LeaseTable(ks, 8, lease_ms=60_000, max_per_owner=8)
    a, b = _block(ks, b"a"), _block(ks, b"b")
    table.grant(1, a)
    table.grant(1, b)
    other = table.grant(2, a)
    assert table.drop_owner(1) == 2
    assert a.pins == 1 and b.pins == 0 and table.live == 1
    assert table.release(2, other[0])
    table.close()


def test_limits_per_owner_and_for_the_table(ks):
    table = LeaseTable(ks, 3, lease_ms=60_000, max_per_owner=2)
    b = _block(ks, b"k")
    table.grant(1, b)
    table.grant(1, b)
    with pytest.raises(LeaseLimit, match="shm_max_leases"):
        table.grant(1, b)
    table.grant(2, b)
    with pytest.raises(LeaseLimit, match="lease slots are taken"):
        table.grant(3, b)
    assert b.pins == 3, "a refused lease pins nothing"
    table.close()
    assert b.pins == 0


def test_each_user_holds_at_most_its_share_of_the_table(ks):
    """Issue 19 item 5: one user's connections together stop at its share; another user's go on."""
    table = LeaseTable(ks, 8, lease_ms=60_000, max_per_owner=8, max_per_user=4)
    b = _block(ks, b"k")
    for owner in (1, 2, 3, 4):  # four connections of alice, one lease each
        table.grant(owner, b, "alice")
    with pytest.raises(LeaseLimit, match=r"user 'alice' holds 4 shared-memory leases, its share"):
        table.grant(5, b, "alice")
    assert table.refused_user == 1 and table.held_by_user("alice") == 4
    for owner in (6, 6, 7, 7):
        table.grant(owner, b, "bob")
    assert table.live == 8 and table.held_by_user("bob") == 4
    table.drop_owner(1)  # a connection of alice's closes: her share has room again
    slot, _ = table.grant(5, b, "alice")
    assert table.held_by_user("alice") == 4
    table.release(5, slot)
    table.expire(now=10**9)
    assert table.held_by_user("alice") == table.held_by_user("bob") == table.live == 0
    table.close()


def test_the_table_is_sealed_and_clients_get_a_read_only_descriptor(ks):
    """Issue 19 item 15: nobody can resize the table's file, nor write it but through quilld's mapping."""
    table = LeaseTable(ks, 8, lease_ms=1000, max_per_owner=4)
    assert table.sealed and ks.arena.sealed
    for fd in (table.fd, table.shared_fd, ks.arena.fd):
        with pytest.raises(PermissionError):
            os.ftruncate(os.open(f"/proc/self/fd/{fd}", os.O_RDWR), 0)
    with pytest.raises(PermissionError):
        os.pwrite(table.fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(table.shared_fd, 64, flags=mmap.MAP_SHARED)
    slot, gen = table.grant(1, _block(ks, b"k"))
    table.release(1, slot)  # quilld's own mapping still writes the generations
    assert _mapped(table)[slot] == gen + 1
    table.close()
