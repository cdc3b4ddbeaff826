"""DUMP and RESTORE, as redis 7.0.15 answers them, over redis's own payload (rdb_payload.py).

A DUMP from redis-server restores here and one from here restores into redis-server.
quilld holds strings only: a payload of another type is refused with its type named.
Checks come in redis's order (options, BUSYKEY, the TTL, the payload's version and
checksum, then its contents), with redis's texts. IDLETIME and FREQ are checked as redis
checks them; quilld keeps no access frequency (its policy is LRU, where redis ignores
FREQ too) and a restored key starts as just used.

A payload declares its string's size: one beyond proto-max-bulk-len is refused before any
work. A large payload (its checksum) or a large LZF string (its decoding, into the arena
block that becomes the value) is worked on in a worker thread, the GIL released, while
the loop serves everyone else; the BUSYKEY check is made again when the value is ready.

A relative TTL is added to the clock in 64 bits as redis adds it: past 2^63 - 1 ms it wraps
negative, so redis 7.0.15 answers OK and creates no key (deleting the old one with
REPLACE); quilld does the same. An absolute one (ABSTTL) is a unix time in ms below 2^63.
"""

from __future__ import annotations

import asyncio

from quilld.errors import CommandError, QuillError
from quilld.model import Pending, Pinned
from quilld.protocol.commands.common import acked, parse_int
from quilld.protocol.commands.rdb_payload import Compressed, check, dump, expand_into, held
from quilld.protocol.commands.strings import storable
from quilld.protocol.resp import OK
from quilld.protocol.table import READONLY, WRITE, CommandTable
from quilld.tiers.block import Block
from quilld.tiers.keyspace import now_ms

_SYNTAX = CommandError("syntax error")
OFF_LOOP = 1 << 20  # a payload, or an LZF string, of more bytes is worked on in a worker thread
LLONG_MAX = (1 << 63) - 1


class BusyKey(QuillError):
    prefix = "BUSYKEY"


def _payload(value):
    if value is None:
        return None
    if value.__class__ is Pinned:
        try:
            return dump(value.view)
        finally:
            value.release()
    return dump(value)


async def _payload_later(pending: Pending):
    return _payload(await pending.awaitable)


def cmd_dump(c, args):
    value = c.keyspace.get(c.tag, args[1])
    if value.__class__ is Pending:  # on the SSD tier: read back first
        return Pending(_payload_later(value))
    return _payload(value)


def cmd_restore(c, args):
    replace = absttl = False
    idle = freq = None
    i, n = 4, len(args)
    while i < n:
        opt = bytes(args[i]).lower()
        more = n - i - 1
        if opt == b"replace":
            replace = True
        elif opt == b"absttl":
            absttl = True
        elif opt == b"idletime" and more >= 1 and freq is None:
            idle = parse_int(args[i + 1])
            if idle < 0:
                raise CommandError("Invalid IDLETIME value, must be >= 0")
            i += 1
        elif opt == b"freq" and more >= 1 and idle is None:
            freq = parse_int(args[i + 1])
            if not 0 <= freq <= 255:
                raise CommandError("Invalid FREQ value, must be >= 0 and <= 255")
            i += 1
        else:
            raise _SYNTAX
        i += 1
    store, key = c.keyspace, args[1]
    if not replace and store.contains(c.tag, key):
        raise BusyKey("Target key name already exists.")
    ttl = parse_int(args[2])
    if ttl < 0:
        raise CommandError("Invalid TTL value, must be >= 0")
    payload, limit = bytes(args[3]), c.ctx.runtime.proto_max_bulk_len
    if len(payload) > OFF_LOOP:
        return Pending(_restore_later(c, key, ttl, absttl, replace, payload, limit))
    check(payload)
    value = held(payload, limit)
    if value.__class__ is Compressed:
        if value.size > OFF_LOOP:
            return Pending(_restore_later(c, key, ttl, absttl, replace, payload, limit))
        out = bytearray(value.size)
        expand_into(value, out)
        value = bytes(out)
    return _create(c, key, ttl, absttl, replace, value)


def _checked(payload, limit: int):
    check(payload)
    return held(payload, limit)


async def _restore_later(c, key: bytes, ttl: int, absttl: bool, replace: bool, payload, limit: int):
    """RESTORE's work on a large payload, in a worker thread: the checksum, then the decoding
    of an LZF string into the arena block that becomes the value."""
    loop = asyncio.get_running_loop()
    value = await loop.run_in_executor(None, _checked, payload, limit)
    store = c.keyspace
    if value.__class__ is not Compressed:
        return _create(c, key, ttl, absttl, replace, value)
    if value.size <= store.inline_max:
        out = bytearray(value.size)
        expand_into(value, out)
        return _create(c, key, ttl, absttl, replace, bytes(out))
    block = store.reserve(value.size, c.user)
    try:
        await loop.run_in_executor(None, expand_into, value, store.write_view(block))
    except BaseException:  # a bad stream, or cancelled (the node stops)
        store.discard(block)
        raise
    return _create(c, key, ttl, absttl, replace, block)  # (gives the block back unless it is the value)


def _create(c, key: bytes, ttl: int, absttl: bool, replace: bool, value):
    """The key, made from its decoded value as redis makes it: `value` is bytes or a view of the
    payload (stored here, once the key is to be made), or an arena Block already filled (given
    back unless it becomes the value)."""
    store = c.keyspace
    now = now_ms()
    if ttl and not absttl:
        ttl += now
        if ttl > LLONG_MAX:  # redis's 64-bit sum wraps negative: already expired
            ttl = -1
    busy = not replace and store.contains(c.tag, key)  # made meanwhile, while a large payload was decoded
    if busy or (ttl and ttl <= now):
        if value.__class__ is Block:
            store.discard(value)
        if busy:
            raise BusyKey("Target key name already exists.")
        if replace:  # already expired: nothing is created (an old key is deleted)
            store.delete(c.tag, key)
        return OK
    store.publish(c.tag, key, value if value.__class__ is Block else storable(store, value))
    if ttl:
        store.set_expire(c.tag, key, ttl)
    return acked(store, OK) if store.unsynced else OK


def register(t: CommandTable) -> None:
    t.add("dump", 2, READONLY, cmd_dump, keys=(1, 1, 1))
    t.add("restore", -4, WRITE, cmd_restore, keys=(1, 1, 1))
