"""Redis string commands over the scoped keyspace: GET, SET, MGET, MSET, DEL, TTL..."""

from __future__ import annotations

from quilld.errors import CommandError
from quilld.protocol.commands.common import acked, parse_int, settle
from quilld.protocol.resp import OK, Status
from quilld.protocol.table import FAST, READONLY, WRITE, CommandTable
from quilld.tiers.block import Block
from quilld.tiers.keyspace import now_ms

_SYNTAX = CommandError("syntax error")


def cmd_get(c, args):
    return c.keyspace.get(c.tag, args[1])


def _storable(store, value):
    """Turn a parsed argument into a value the store keeps (bytes inline, or a Block)."""
    t = type(value)
    if t is bytes and len(value) <= store.inline_max:
        return value
    if t is Block:
        return value
    return store.materialize(value)


def cmd_set(c, args):
    store = c.keyspace
    if len(args) == 3:
        value = args[2]
        if value.__class__ is not bytes or len(value) > store.inline_max:
            value = _storable(store, value)
        store.publish(c.tag, args[1], value)
        if store.unsynced:
            return acked(store, OK)
        return OK
    nx = xx = get = keepttl = False
    exp_opt = exp_raw = None
    i, n = 3, len(args)
    while i < n:
        opt = bytes(args[i]).upper()
        if opt == b"NX" and not xx:
            nx = True
        elif opt == b"XX" and not nx:
            xx = True
        elif opt == b"GET":
            get = True
        elif opt == b"KEEPTTL" and exp_opt is None:
            keepttl = True
        elif opt in _EXPIRE_OPTS and exp_opt in (None, opt) and not keepttl and i + 1 < n:
            exp_opt, exp_raw = opt, args[i + 1]
            i += 1
        else:
            raise _SYNTAX
        i += 1
    expire_at = None if exp_opt is None else _expire_at(exp_opt, exp_raw)
    key = args[1]
    reply = store.get(c.tag, key) if get else OK
    if nx or xx:
        exists = reply is not None if get else store.contains(c.tag, key)
        if (nx and exists) or (xx and not exists):
            return reply if get else None
    store.publish(c.tag, key, _storable(store, args[2]), keep_ttl=keepttl)
    if expire_at is not None:
        store.set_expire(c.tag, key, expire_at)
    return acked(store, reply) if store.unsynced else reply


_EXPIRE_OPTS = (b"EX", b"PX", b"EXAT", b"PXAT")


def _expire_at(opt: bytes, raw: bytes) -> int:
    """Absolute expiry in ms, validated as redis 7 does (integer first, then range)."""
    amount = parse_int(raw)
    seconds = opt in (b"EX", b"EXAT")
    if amount <= 0 or (seconds and amount > (1 << 63) // 1000):
        raise CommandError("invalid expire time in 'set' command")
    at = amount * (1000 if seconds else 1) + (now_ms() if opt in (b"EX", b"PX") else 0)
    if at >= 1 << 63:
        raise CommandError("invalid expire time in 'set' command")
    return at


def cmd_mget(c, args):
    store, tag = c.keyspace, c.tag
    get = store.get
    return settle([get(tag, k) for k in args[1:]])


def cmd_mset(c, args):
    if len(args) % 2 == 0:
        raise CommandError("wrong number of arguments for 'mset' command")
    store, tag = c.keyspace, c.tag
    for i in range(1, len(args), 2):
        store.publish(tag, args[i], _storable(store, args[i + 1]))
    return acked(store, OK) if store.unsynced else OK


def cmd_exists(c, args):
    store, tag = c.keyspace, c.tag
    return sum(1 for k in args[1:] if store.contains(tag, k))


def cmd_del(c, args):
    store, tag = c.keyspace, c.tag
    n = sum(1 for k in args[1:] if store.delete(tag, k))
    return acked(store, n) if store.unsynced else n


def cmd_strlen(c, args):
    v = c.keyspace.lookup(c.tag, args[1])
    return 0 if v is None else len(v)


def cmd_type(c, args):
    return Status(b"none" if not c.keyspace.contains(c.tag, args[1]) else b"string")


def cmd_ttl(c, args):
    ms = c.keyspace.ttl_ms(c.tag, args[1])
    return ms if ms < 0 else (ms + 500) // 1000


def cmd_pttl(c, args):
    return c.keyspace.ttl_ms(c.tag, args[1])


def cmd_dbsize(c, args):
    return c.keyspace.keys_in(c.tag)


def cmd_flushall(c, args):
    if len(args) > 2 or (len(args) == 2 and bytes(args[1]).upper() not in (b"ASYNC", b"SYNC")):
        raise _SYNTAX
    store = c.keyspace
    store.flush_scope(c.tag)
    return acked(store, OK) if store.unsynced else OK


def register(t: CommandTable) -> None:
    t.add("get", 2, f"{READONLY} {FAST}", cmd_get, "Returns the string value of a key.", "string", keys=(1, 1, 1))
    t.add("set", -3, WRITE, cmd_set, "Sets the string value of a key, ignoring its type.", "string", keys=(1, 1, 1))
    t.add("mget", -2, f"{READONLY} {FAST}", cmd_mget, "Atomically returns the string values of one or more keys.",
          "string", keys=(1, -1, 1))
    t.add("mset", -3, WRITE, cmd_mset, "Atomically creates or modifies the string values of one or more keys.",
          "string", keys=(1, -1, 2))
    t.add("exists", -2, f"{READONLY} {FAST}", cmd_exists, "Determines whether one or more keys exist.",
          keys=(1, -1, 1))
    t.add("del", -2, WRITE, cmd_del, "Deletes one or more keys.", keys=(1, -1, 1))
    t.add("unlink", -2, f"{WRITE} {FAST}", cmd_del, "Asynchronously deletes one or more keys.", keys=(1, -1, 1))
    t.add("strlen", 2, f"{READONLY} {FAST}", cmd_strlen, "Returns the length of a string value.", "string",
          keys=(1, 1, 1))
    t.add("type", 2, f"{READONLY} {FAST}", cmd_type, "Determines the type of value stored at a key.", keys=(1, 1, 1))
    t.add("ttl", 2, f"{READONLY} {FAST}", cmd_ttl, "Returns the expiration time in seconds of a key.", keys=(1, 1, 1))
    t.add("pttl", 2, f"{READONLY} {FAST}", cmd_pttl, "Returns the expiration time in milliseconds of a key.",
          keys=(1, 1, 1))
    t.add("dbsize", 1, f"{READONLY} {FAST}", cmd_dbsize, "Returns the number of keys in the database.", "server")
    t.add("flushall", -1, WRITE, cmd_flushall, "Removes all keys from all databases.", "server")
