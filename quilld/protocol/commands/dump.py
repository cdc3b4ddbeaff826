"""DUMP and RESTORE, as redis 7.0.15 answers them, over redis's own payload (rdb_payload.py).

A DUMP from redis-server restores here and one from here restores into redis-server.
quilld holds strings only: a payload of another type is refused with its type named.
Checks come in redis's order (options, BUSYKEY, the TTL, the payload's version and
checksum, then its contents), with redis's texts. IDLETIME and FREQ are checked as redis
checks them; quilld keeps no access frequency (its policy is LRU, where redis ignores
FREQ too) and a restored key starts as just used.
"""

from __future__ import annotations

from quilld.errors import CommandError, QuillError
from quilld.model import Pending, Pinned
from quilld.protocol.commands.common import acked, parse_int
from quilld.protocol.commands.rdb_payload import check, dump, load
from quilld.protocol.commands.strings import storable
from quilld.protocol.resp import OK
from quilld.protocol.table import READONLY, WRITE, CommandTable
from quilld.tiers.keyspace import now_ms

_SYNTAX = CommandError("syntax error")


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
    payload = bytes(args[3])
    check(payload)
    value = load(payload)
    if ttl and not absttl:
        ttl += now_ms()
    if ttl and ttl <= now_ms():  # already expired: nothing is created (an old key is deleted)
        if replace:
            store.delete(c.tag, key)
        return OK
    store.publish(c.tag, key, storable(store, value))
    if ttl:
        store.set_expire(c.tag, key, ttl)
    return acked(store, OK) if store.unsynced else OK


def register(t: CommandTable) -> None:
    t.add("dump", 2, READONLY, cmd_dump, keys=(1, 1, 1))
    t.add("restore", -4, WRITE, cmd_restore, keys=(1, 1, 1))
