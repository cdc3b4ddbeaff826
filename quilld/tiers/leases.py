"""Read leases of the shared-memory path: arena blocks pinned for readers that copy them themselves.

A same-host client that has mapped the arena (SHM ATTACH) asks where a block lies
and copies it from its own mapping. While it copies, the block must not be freed
and reused; a *lease* pins it. Leases live in a small table of `slots` unsigned
64-bit generations, in a memory file of its own (`fd`) that the client maps too:

- a lease is (slot, generation): `grant` takes a free slot, pins the block, and
  hands out the slot's current generation;
- a lease ends by `release` (the client is done), `expire` (it ran past its
  deadline: the periodic timer, at most `limit` entries a pass) or `drop_owner`
  (its connection closed). Ending BUMPS the slot's generation, then unpins.

So a client that copies a block and then reads its slot's generation again
knows whether the lease was still alive when the copy ended: equal, the bytes
are the block's; different, the lease ended meanwhile and the block may have
been freed and reused, so what was copied is not trusted (the client reads the
block again another way). This needs the client's data loads not to be
performed after its generation load, and quilld's generation store not after
its later writes into the reused block: x86-64's memory model (TSO) orders
loads with loads and stores with stores, which is what the client library
relies on; on a weaker model (ARM) the client would need a load barrier between
the copy and the check.

The table has a fixed number of slots for all connections together
(config.SHM_SLOTS, 512 KiB); each owner (a connection) may hold at most
`max_per_owner`, and each user (the connections of one tenant together) at most
`max_per_user`, its share of the table: one user's connections cannot take the slots
another user needs (16 connections of one user took all 65,536 before). Storage knows
nothing of connections: an owner is an int, a user a name.

The table's memory file is sealed (memfd.py): no process can resize it, and none but
quilld's own mapping can write it; clients are handed `shared_fd`, a read-only descriptor.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import deque

from quilld.errors import QuillError
from quilld.tiers.block import Block
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.memfd import reopened_read_only, seal, sealed_memfd

EXPIRE_PER_PASS = 4096  # table entries one expiry pass looks at, at most (live or already ended)


class LeaseLimit(QuillError):
    """No lease can be granted: the owner or its user holds its maximum, or the table is full."""

    prefix = "BUSY"


class LeaseTable:
    def __init__(self, keyspace: Keyspace, slots: int, lease_ms: int, max_per_owner: int,
                 max_per_user: int | None = None) -> None:
        self.keyspace = keyspace
        self.slots = slots
        self.lease_s = lease_ms / 1000
        self.max_per_owner = max_per_owner
        self.max_per_user = slots if max_per_user is None else max_per_user
        self.fd = sealed_memfd("quilld-leases", slots * 8)
        try:
            self._mmap = mmap.mmap(self.fd, slots * 8, flags=mmap.MAP_SHARED)
            self.sealed = seal(self.fd, read_only=True)  # after our mapping: it alone writes
            self.shared_fd = reopened_read_only(self.fd)  # what a client is handed
        except BaseException:
            os.close(self.fd)
            raise
        self.gens = memoryview(self._mmap).cast("Q")  # the shared generations, one u64 per slot
        self._free = list(range(slots - 1, -1, -1))  # pop() gives slot 0 first
        self._block: list[Block | None] = [None] * slots
        self._owner = [0] * slots
        self._user: list[str] = [""] * slots
        self._by_owner: dict[int, set[int]] = {}
        self._by_user: dict[str, int] = {}
        self.refused_user = 0  # grants refused because the user held its share
        self._order: deque[tuple[float, int, int]] = deque()  # (deadline, slot, generation), in grant order
        self.granted = 0
        self.released = 0
        self.expired = 0
        self.dropped = 0  # ended because their owner went away

    @property
    def live(self) -> int:
        return self.slots - len(self._free)

    def held_by(self, owner: int) -> int:
        return len(self._by_owner.get(owner, ()))

    def held_by_user(self, user: str) -> int:
        return self._by_user.get(user, 0)

    def grant(self, owner: int, block: Block, user: str = "") -> tuple[int, int]:
        """Pin `block` for `owner` (a connection of `user`); its lease (slot, generation)."""
        held = self._by_owner.get(owner)
        if held is not None and len(held) >= self.max_per_owner:
            raise LeaseLimit(f"this connection holds {len(held)} shared-memory leases, its maximum "
                             "(server.shm_max_leases): release some (SHM RELEASE) first")
        if not self._free:
            raise LeaseLimit(f"all {self.slots} shared-memory lease slots are taken: try again shortly")
        by_user = self._by_user.get(user, 0)
        if by_user >= self.max_per_user:
            self.refused_user += 1
            raise LeaseLimit(f"user '{user}' holds {by_user} shared-memory leases, its share of the table "
                             "(server.shm_max_leases_per_user): try again shortly, or read over TCP")
        slot = self._free.pop()
        self.keyspace.pin(block)
        self._block[slot] = block
        self._owner[slot] = owner
        self._user[slot] = user
        self._by_user[user] = by_user + 1
        if held is None:
            held = self._by_owner[owner] = set()
        held.add(slot)
        gen = self.gens[slot]
        self._order.append((time.monotonic() + self.lease_s, slot, gen))
        self.granted += 1
        return slot, gen

    def release(self, owner: int, slot: int) -> bool:
        """End `owner`'s lease in `slot`; False when it holds none there (ended already)."""
        if not 0 <= slot < self.slots or self._block[slot] is None or self._owner[slot] != owner:
            return False
        self._end(slot)
        self.released += 1
        return True

    def drop_owner(self, owner: int) -> int:
        """End every lease `owner` holds (its connection closed); how many."""
        held = self._by_owner.get(owner)
        if not held:
            return 0
        n = len(held)
        for slot in list(held):
            self._end(slot)
        self.dropped += n
        return n

    def expire(self, now: float | None = None, limit: int = EXPIRE_PER_PASS) -> int:
        """End leases past their deadline, looking at `limit` entries at most; how many ended."""
        now = time.monotonic() if now is None else now
        order, blocks, gens = self._order, self._block, self.gens
        ended = 0
        for _ in range(min(limit, len(order))):
            deadline, slot, gen = order[0]
            if deadline > now:
                break
            order.popleft()
            if blocks[slot] is not None and gens[slot] == gen:  # still that lease: not released meanwhile
                self._end(slot)
                ended += 1
        self.expired += ended
        return ended

    def _end(self, slot: int) -> None:
        block = self._block[slot]
        self.gens[slot] += 1  # first: a reader still copying must see the lease end before the block can go
        self._block[slot] = None
        owner = self._owner[slot]
        held = self._by_owner[owner]
        held.discard(slot)
        if not held:
            del self._by_owner[owner]
        self._owner[slot] = 0
        user = self._user[slot]
        left = self._by_user[user] - 1
        if left:
            self._by_user[user] = left
        else:
            del self._by_user[user]
        self._user[slot] = ""
        self._free.append(slot)
        self.keyspace.unpin(block)

    def close(self) -> None:
        """End every lease and drop the table's memory (the node stops)."""
        for owner in list(self._by_owner):
            self.drop_owner(owner)
        self.gens.release()
        self._mmap.close()
        os.close(self.fd)
        os.close(self.shared_fd)
        self.fd = self.shared_fd = -1
