"""Two-phase puts: reserve a block, fill it in any order from any connection, publish it whole.

BEGIN reserves arena space and returns a handle; DATA writes a range; COMMIT
checks that every byte arrived (and the CRC32C when given) and publishes the
block atomically; ABORT or an expired lease gives the space back. Nothing is
visible before COMMIT. PUT does all three at once for a block sent whole in
one command with its CRC32C (`put_whole`): no handle, one reply. A DATA payload that is being received straight into
the block holds a writer count, so the space is never reused under it.

An in-place put (`in_place`, the shared-memory path) is filled by a same-host
client writing straight into the arena through its own mapping: no DATA. quilld
cannot see those writes, so "every byte arrived" is proven by the CRC32C instead,
which its COMMIT must carry and which is checked over the whole region. Its
space is not reused at once when its lease runs out (the client may still be
writing into it): it waits one more lease length in quarantine.

Every open put costs memory besides its block: its key and its bookkeeping, even a zero-byte
one that reserves no block at all. So each is charged to its tenant with its block
(`charge`: the key's length plus PUT_OVERHEAD), against the same caps as the tenant's unfilled
reservations (security.max_unfilled_bytes_per_tenant, dram.max_unfilled_share), until it is
committed, aborted or expired; and a tenant may have at most `max_open_per_tenant` open puts
(security.max_open_puts_per_tenant).
"""

from __future__ import annotations

import bisect
import re
import secrets
import time

import crc32c

from quilld.errors import ChecksumMismatch, CommandError, Incomplete, NoHandle, UnfilledLimit
from quilld.tiers.block import Block
from quilld.tiers.keyspace import Keyspace


HANDLE_FORM = re.compile(rb"[0-9a-f]{16,64}")  # a client-chosen handle (PUT2PHASE BEGIN ... HANDLE h)
# bytes an open put holds besides its key and block (the Put, its handle, the open table's entry,
# the scope's hold): 200,000 zero-byte puts with short keys grew quilld's RSS by 97 MB, ~490 each
PUT_OVERHEAD = 512


class Put:
    __slots__ = ("handle", "tag", "key", "tenant", "block", "nbytes", "deadline",
                 "starts", "ends", "writers", "dead", "bhash", "parent", "in_place", "lease_s", "charge")

    def __init__(self, handle: bytes, tag: bytes, key: bytes, tenant: str, block: Block | None,
                 nbytes: int, deadline: float) -> None:
        self.handle = handle
        self.tag = tag
        self.key = key
        self.tenant = tenant
        self.block = block
        self.nbytes = nbytes
        self.deadline = deadline
        self.starts: list[int] = []  # received ranges, sorted and merged
        self.ends: list[int] = []
        self.writers = 0  # DATA payloads being received into the block right now
        self.dead = False  # aborted or expired while a writer was active
        self.bhash: int | bytes | None = None  # the engine block hash it holds (PUT2PHASE BEGIN ... HASH)
        self.parent: int | bytes | None = None  # the block before it in its chain (... PARENT)
        self.in_place = False  # written through the client's mapping of the arena (SHM): COMMIT needs the CRC
        self.lease_s = 0.0
        self.charge = len(key) + PUT_OVERHEAD  # counted with the tenant's unfilled reservations while open

    def mark(self, start: int, end: int) -> None:
        """Record that bytes [start, end) arrived, merging with touching ranges."""
        if start >= end:
            return
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(ends, start)
        j = bisect.bisect_right(starts, end)
        if i < j:
            start = min(start, starts[i])
            end = max(end, ends[j - 1])
        starts[i:j] = [start]
        ends[i:j] = [end]

    def received(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))


class IntoBlock:
    """A DATA payload that was received directly into its put's block."""

    __slots__ = ("put", "offset", "length")

    def __init__(self, put: Put, offset: int, length: int) -> None:
        self.put = put
        self.offset = offset
        self.length = length

    def __len__(self) -> int:  # as a received argument's length (CLIENT LIST's qbuf, MONITOR, SLOWLOG)
        return self.length


class TwoPhasePuts:
    def __init__(self, store: Keyspace, default_lease_ms: int, max_lease_ms: int,
                 max_open_per_tenant: int = 16384) -> None:
        self.store = store
        self.default_lease_ms = default_lease_ms
        self.max_lease_ms = max_lease_ms
        self.max_open_per_tenant = max_open_per_tenant
        self.open: dict[bytes, Put] = {}
        self.open_of: dict[str, int] = {}  # tenant -> its open puts
        self.refused = 0  # BEGINs refused because their tenant had max_open_per_tenant open
        self.quarantine: list[tuple[float, Block]] = []  # (free after, block) of expired in-place puts
        self.expired = 0
        self.committed = 0
        self.aborted = 0

    def begin(self, tag: bytes, key: bytes, tenant: str, nbytes: int, lease_ms: int | None,
              bhash: int | bytes | None = None, in_place: bool = False, handle: bytes | None = None,
              parent: int | bytes | None = None) -> bytes | None:
        """A new handle, or None when the key is already complete (idempotent success).
        `in_place`: the client writes the bytes itself (see `region`), COMMIT carries the CRC.
        `handle`: one the client chose (HANDLE_FORM), so it can pipeline DATA and COMMIT right
        behind BEGIN in one round trip; refused while a put holds it."""
        if handle is not None:
            if not HANDLE_FORM.fullmatch(handle):
                raise CommandError("HANDLE must be 16 to 64 lowercase hex digits")
            if handle in self.open:
                raise CommandError("HANDLE is in use by an open put: choose another")
        if self.store.contains(tag, key):
            return None
        lease = self.default_lease_ms if lease_ms is None else lease_ms
        if not 0 < lease <= self.max_lease_ms:
            raise CommandError(f"LEASE must be within 1..{self.max_lease_ms} ms")
        mine = self.open_of.get(tenant, 0)
        if mine >= self.max_open_per_tenant:
            self.refused += 1
            raise UnfilledLimit(f"tenant '{tenant}' already has {mine} open puts (limit {self.max_open_per_tenant}, "
                                "security.max_open_puts_per_tenant): COMMIT or ABORT some first")
        handle = handle or secrets.token_hex(12).encode()
        put = Put(handle, tag, key, tenant, None, nbytes, time.monotonic() + lease / 1000)
        if nbytes:  # the key and bookkeeping are checked and counted with the block, in one go
            put.block = self.store.reserve(nbytes, tenant, extra=put.charge)
        else:
            self.store.hold_unfilled(tenant, put.charge)
        put.bhash = bhash
        put.parent = parent
        put.in_place = in_place
        put.lease_s = lease / 1000
        self.open[handle] = put
        self.open_of[tenant] = mine + 1
        self.store.scopes.hold(tag)  # the scope lives at least as long as the put
        return handle

    def get(self, handle: bytes, tenant: str) -> Put:
        put = self.open.get(handle)
        if put is None or put.tenant != tenant:
            raise NoHandle("no such PUT2PHASE handle (unknown, committed, aborted or expired)")
        if time.monotonic() > put.deadline:
            self._drop(put, quarantine=True)
            self.expired += 1
            raise NoHandle("PUT2PHASE handle expired: its lease ran out and its space was reclaimed")
        return put

    def region(self, put: Put) -> int:
        """The arena offset an in-place put's bytes go to (0 for an empty one)."""
        return self.store.arena.offset(put.block.handle) if put.block is not None else 0

    def check_range(self, put: Put, offset: int, length: int) -> None:
        if put.in_place:
            raise CommandError("this put is written in place (SHM): it takes no DATA, only COMMIT with its CRC32C")
        if offset < 0 or offset + length > put.nbytes:
            raise CommandError(f"DATA range {offset}..{offset + length} is outside the block's {put.nbytes} bytes")

    def write(self, put: Put, offset: int, data: bytes) -> None:
        self.check_range(put, offset, len(data))
        if data:
            self.store.write_view(put.block)[offset:offset + len(data)] = data
            put.mark(offset, offset + len(data))

    def open_writer(self, put: Put, offset: int, length: int) -> memoryview:
        """The slice of the block a large DATA payload is received into."""
        self.check_range(put, offset, length)
        put.writers += 1
        return self.store.write_view(put.block)[offset:offset + length]

    def close_writer(self, into: IntoBlock, complete: bool) -> None:
        put = into.put
        put.writers -= 1
        if complete and not put.dead:
            put.mark(into.offset, into.offset + into.length)
        if put.dead and put.writers == 0 and put.block is not None:
            self.store.discard(put.block)

    def commit(self, put: Put, crc: int | None) -> None:
        if put.in_place:
            if crc is None:
                raise Incomplete("commit refused: a put written in place (SHM) needs COMMIT handle CRC32C crc, "
                                 "the checksum over all its bytes")
            put.mark(0, put.nbytes)  # every byte is vouched for by the CRC, checked below over the region
        missing = put.nbytes - put.received()
        if missing:
            raise Incomplete(f"commit refused: {missing} of {put.nbytes} bytes were never written")
        if put.writers:
            raise Incomplete("commit refused: a DATA payload is still being received")
        view = self.store.view(put.block) if put.block is not None else memoryview(b"")
        if crc is not None:
            actual = crc32c.crc32c(view)
            if actual != crc:
                raise ChecksumMismatch(f"commit refused: crc32c is {actual}, the client said {crc}")
        self._close(put)
        store = self.store
        if put.block is None or put.nbytes <= store.inline_max:
            value = bytes(view)
            if put.block is not None:
                store.discard(put.block)
            store.publish(put.tag, put.key, value, bhash=put.bhash, parent=put.parent)
        else:
            put.block.crc = crc  # verified above (or None: computed when first needed)
            store.publish(put.tag, put.key, put.block, bhash=put.bhash, parent=put.parent)
        store.scopes.drop(put.tag)  # the published key holds the scope now (dropped after: no gap)
        self.committed += 1

    def _close(self, put: Put) -> bool:
        """Take `put` out of the open ones, and its charge off its tenant (not the scope's hold:
        the caller's). False when it was not open."""
        if self.open.pop(put.handle, None) is None:
            return False
        self.store.release_unfilled(put.tenant, put.charge)
        left = self.open_of[put.tenant] - 1
        if left:
            self.open_of[put.tenant] = left
        else:
            del self.open_of[put.tenant]
        return True

    def put_whole(self, tag: bytes, key: bytes, tenant: str, value: bytes | Block, crc: int,
                  bhash: int | bytes | None = None) -> bool:
        """BEGIN, DATA and COMMIT in one step (PUT2PHASE PUT): `value` is the whole block, already
        received (into a reserved arena block, or as bytes). Published only if its CRC32C is `crc`;
        False, and nothing changed, when the key is already complete (idempotent success). A
        reserved block this does not publish is the caller's to give back."""
        store = self.store
        if store.contains(tag, key):
            return False
        view = store.view(value) if value.__class__ is Block else memoryview(value)
        actual = crc32c.crc32c(view)
        if actual != crc:
            raise ChecksumMismatch(f"put refused: crc32c is {actual}, the client said {crc}")
        if value.__class__ is not Block or value.length <= store.inline_max:
            stored: bytes | Block = bytes(view)  # small: kept inline (a reserved block is given back)
            if len(stored) > store.inline_max:
                stored = store.reserve(len(view), tenant)
                store.write_view(stored)[:] = view
                stored.crc = crc
        else:
            value.crc = crc  # verified above
            stored = value
        store.publish(tag, key, stored, bhash=bhash)
        self.committed += 1
        return True

    def abort(self, put: Put) -> None:
        self._drop(put)
        self.aborted += 1

    def reclaim_expired(self) -> int:
        """Drop every put whose lease ran out (called periodically)."""
        now = time.monotonic()
        late = [p for p in self.open.values() if now > p.deadline]
        for put in late:
            self._drop(put, quarantine=True)
        self.expired += len(late)
        if self.quarantine and self.quarantine[0][0] <= now:
            keep = []
            for until, block in self.quarantine:
                if until <= now:
                    self.store.discard(block)
                else:
                    keep.append((until, block))
            self.quarantine = keep
        return len(late)

    def _drop(self, put: Put, quarantine: bool = False) -> None:
        if self._close(put):
            self.store.scopes.drop(put.tag)
        if put.block is None or not put.block.unpublished:
            return
        if quarantine and put.in_place:  # its client may still be writing: not reused for one more lease
            self.quarantine.append((time.monotonic() + put.lease_s, put.block))
        elif put.writers:
            put.dead = True  # freed when the last writer finishes
        else:
            self.store.discard(put.block)

    def close(self) -> None:
        for put in list(self.open.values()):
            self._drop(put)
        for _, block in self.quarantine:
            self.store.discard(block)
        self.quarantine = []
