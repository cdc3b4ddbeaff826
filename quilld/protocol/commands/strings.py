"""Redis string commands over the scoped keyspace: GET, SET, MGET, MSET, DEL, TTL..., and the
rest of redis 7.0's string family (APPEND, INCR/DECR and INCRBYFLOAT, GETRANGE/SETRANGE/SUBSTR,
GETDEL, GETEX, GETSET, SETNX/SETEX/PSETEX, MSETNX, LCS). The bit commands are in bits.py."""

from __future__ import annotations

from quilld.errors import CommandError
from quilld.model import Pending, Pinned
from quilld.protocol.commands.common import (
    RAW, acked, float_encoding, parse_int, pool_delete, pool_exists, pool_get, pool_mget, settle,
)
from quilld.protocol.commands.lcs import LcsTable
from quilld.protocol.commands.longdouble import (
    MAX_LONG_DOUBLE_CHARS,
    NOT_FLOAT,
    ZERO,
    add_long_double,
    format_long_double,
    parse_long_double,
)
from quilld.protocol.resp import OK, Status
from quilld.protocol.table import FAST, READONLY, WRITE, CommandTable
from quilld.protocol.transactions import touch
from quilld.tiers.block import Block
from quilld.tiers.keyspace import now_ms

_SYNTAX = CommandError("syntax error")


def cmd_get(c, args):
    value = c.keyspace.get(c.tag, args[1])
    if value is None and c.ctx.cluster is not None:
        return pool_get(c, args[1])
    return value


def storable(store, value):
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
            value = storable(store, value)
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
    store.publish(c.tag, key, storable(store, args[2]), keep_ttl=keepttl)
    if expire_at is not None:
        store.set_expire(c.tag, key, expire_at)
    return acked(store, reply) if store.unsynced else reply


_EXPIRE_OPTS = (b"EX", b"PX", b"EXAT", b"PXAT")


def _expire_at(opt: bytes, raw: bytes, name: str = "set") -> int:
    """Absolute expiry in ms, validated as redis 7 does (integer first, then range)."""
    amount = parse_int(raw)
    seconds = opt in (b"EX", b"EXAT")
    if amount <= 0 or (seconds and amount > (1 << 63) // 1000):
        raise CommandError(f"invalid expire time in '{name}' command")
    at = amount * (1000 if seconds else 1) + (now_ms() if opt in (b"EX", b"PX") else 0)
    if at >= 1 << 63:
        raise CommandError(f"invalid expire time in '{name}' command")
    return at


def cmd_mget(c, args):
    store, tag = c.keyspace, c.tag
    get = store.get
    values = [get(tag, k) for k in args[1:]]
    if c.ctx.cluster is not None and None in values:
        return pool_mget(c, args[1:], values)
    return settle(values)


def cmd_mset(c, args):
    if len(args) % 2 == 0:
        raise CommandError("wrong number of arguments for 'mset' command")
    store, tag = c.keyspace, c.tag
    for i in range(1, len(args), 2):
        store.publish(tag, args[i], storable(store, args[i + 1]))
    return acked(store, OK) if store.unsynced else OK


def cmd_exists(c, args):
    store, tag = c.keyspace, c.tag
    missing = [k for k in args[1:] if not store.contains(tag, k)]
    if missing and c.ctx.cluster is not None:
        return pool_exists(c, len(args) - 1 - len(missing), missing)
    return len(args) - 1 - len(missing)


def cmd_del(c, args):
    store, tag = c.keyspace, c.tag
    if c.ctx.cluster is None:
        n = sum(1 for k in args[1:] if store.delete(tag, k))
        return acked(store, n) if store.unsynced else n
    missing = [k for k in args[1:] if not store.delete(tag, k)]  # a cluster: peers may hold the rest
    reply = pool_delete(c, len(args) - 1 - len(missing), missing) if missing else len(args) - 1
    return acked(store, reply) if store.unsynced else reply


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
    with c.ctx.clients.tracking.flush(c.tag):  # one invalidation of every key, not one a key
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
    # the rest of the string family, with redis 7.0's arity, flags and key positions
    one, s, w, wd = (1, 1, 1), "string", f"{WRITE} {FAST}", f"{WRITE} denyoom"
    wdf = f"{wd} {FAST}"
    t.add("append", 3, wdf, cmd_append, "Appends a string to the value of a key. Creates the key if it doesn't exist.",
          s, "2.0.0", keys=one)
    t.add("decr", 2, wdf, cmd_decr, "Decrements the integer value of a key by one. Uses 0 as initial value if the "
          "key doesn't exist.", s, keys=one)
    t.add("decrby", 3, wdf, cmd_decrby, "Decrements a number from the integer value of a key. Uses 0 as initial "
          "value if the key doesn't exist.", s, keys=one)
    t.add("getdel", 2, w, cmd_getdel, "Returns the string value of a key after deleting the key.", s, "6.2.0",
          keys=one)
    t.add("getex", -2, w, cmd_getex, "Returns the string value of a key after setting its expiration time.", s,
          "6.2.0", keys=one)
    t.add("getrange", 4, READONLY, cmd_getrange, "Returns a substring of the string stored at a key.", s, "2.4.0",
          keys=one)
    t.add("getset", 3, wdf, cmd_getset, "Returns the previous string value of a key after setting it to a new "
          "value.", s, keys=one)
    t.add("incr", 2, wdf, cmd_incr, "Increments the integer value of a key by one. Uses 0 as initial value if the "
          "key doesn't exist.", s, keys=one)
    t.add("incrby", 3, wdf, cmd_incrby, "Increments the integer value of a key by a number. Uses 0 as initial "
          "value if the key doesn't exist.", s, keys=one)
    t.add("incrbyfloat", 3, wdf, cmd_incrbyfloat, "Increment the floating point value of a key by a number. Uses "
          "0 as initial value if the key doesn't exist.", s, "2.6.0", keys=one)
    t.add("lcs", -3, READONLY, cmd_lcs, "Finds the longest common substring.", s, "7.0.0", keys=(1, 2, 1))
    t.add("msetnx", -3, wd, cmd_msetnx, "Atomically modifies the string values of one or more keys only when all "
          "keys don't exist.", s, "1.0.1", keys=(1, -1, 2))
    t.add("psetex", 4, wd, cmd_psetex, "Sets both string value and expiration time in milliseconds of a key. The "
          "key is created if it doesn't exist.", s, "2.6.0", keys=one)
    t.add("setex", 4, wd, cmd_setex, "Sets the string value and expiration time of a key. Creates the key if it "
          "doesn't exist.", s, "2.0.0", keys=one)
    t.add("setnx", 3, wdf, cmd_setnx, "Set the string value of a key only when the key doesn't exist.", s,
          keys=one)
    t.add("setrange", 4, wd, cmd_setrange, "Overwrites a part of a string value with another by an offset. "
          "Creates the key if it doesn't exist.", s, "2.2.0", keys=one)
    t.add("substr", 4, READONLY, cmd_substr, "Returns a substring from a string value.", s, keys=one)


# -- the rest of the string family (issue 13) -----------------------------------------
#
# Values are written where they lie (Keyspace.write_range): an arena block in place unless a
# reader pins it (then copy-on-write), an inline value rebuilt and moved into the arena once it
# outgrows dram.inline_max, a value only on SSD read back first (a Pending reply). Any handler
# that overwrites or deletes answers through `acked`, so an acknowledged change of a value on
# SSD never comes back after a crash. Every key is the caller's (`c.tag`).

_MAX_INT_LEN = 20  # "-9223372036854775808": a longer value is never an integer (redis's string2ll)
_TOO_BIG = CommandError("string exceeds maximum allowed size (proto-max-bulk-len)")
_NOT_INT = CommandError("value is not an integer or out of range")


def _ack(store, reply):
    return acked(store, reply) if store.unsynced else reply


def _deferred(store, pending: Pending, reply_of=None) -> Pending:
    """A write that first reads a value back from SSD: its reply once done and durable."""
    return Pending(_write_then_ack(store, pending, reply_of))


async def _write_then_ack(store, pending: Pending, reply_of):
    result = await pending.awaitable
    wait = store.take_unsynced()
    if wait is not None:
        await wait
    return result if reply_of is None else reply_of(result)


async def _rerun(pending: Pending, again):
    """Once `pending` is done (a value read back into DRAM), run the command again."""
    await pending.awaitable
    reply = again()
    return await reply.awaitable if reply.__class__ is Pending else reply


def _unchanged(view) -> bytes:
    return bytes(view)


def _in_dram(c, key, again):
    """`key`'s bytes (b"" when missing), or a Pending that reads a value only on SSD back into
    DRAM and then runs `again()`: for commands that replace a small value they must parse."""
    raw = c.keyspace.write_range(c.tag, key, 0, 0, _unchanged)
    if raw.__class__ is Pending:
        return Pending(_rerun(raw, again))
    return raw


def _then(reply, fn):
    """`fn(value)` of a read's value, now or once a pending read of the SSD resolves."""
    if reply.__class__ is Pending:
        return Pending(_later(reply, fn))
    return fn(reply)


async def _later(pending: Pending, fn):
    return fn(await pending.awaitable)


def _empty_if_missing(value):
    return b"" if value is None else value


def range_span(start: int, end: int):
    """GETRANGE's indexes (inclusive, negative from the end, clamped) as a slice of a length."""
    def span(n: int) -> tuple[int, int]:
        if start < 0 and end < 0 and start > end:
            return 0, 0
        lo = max(0, start + n if start < 0 else start)
        hi = max(0, end + n if end < 0 else end)
        if hi >= n:
            hi = n - 1
        if lo > hi or n == 0:
            return 0, 0
        return lo, hi + 1
    return span


def cmd_getrange(c, args):
    start, end = parse_int(args[2]), parse_int(args[3])
    return _then(c.keyspace.read_slice(c.tag, args[1], range_span(start, end)), _empty_if_missing)


def cmd_substr(c, args):
    return cmd_getrange(c, args)


def cmd_setrange(c, args):
    offset, data = parse_int(args[2]), args[3]
    if offset < 0:
        raise CommandError("offset is out of range")
    store, key, n = c.keyspace, args[1], len(data)
    size = store.size(c.tag, key)
    if n == 0:
        return 0 if size is None else size
    if offset + n > c.ctx.cfg.server.proto_max_bulk_len:
        raise _TOO_BIG

    def write(view):
        view[offset:offset + n] = data
        return len(view)

    result = store.write_range(c.tag, key, offset, n, write, label=RAW)
    if result.__class__ is Pending:
        return _deferred(store, result)
    return _ack(store, result)


def cmd_append(c, args):
    store, key, data = c.keyspace, args[1], args[2]
    n = len(data)
    size = store.size(c.tag, key)
    if size is None and n == 0:  # redis creates the key, empty
        store.publish(c.tag, key, b"")
        return 0
    if size is not None and size + n > c.ctx.cfg.server.proto_max_bulk_len:
        raise _TOO_BIG
    if n == 0:  # nothing changes, but redis counts it as a change of the key (WATCH)
        touch(c, key)

    def write(view):
        if n:
            view[len(view) - n:] = data
        return len(view)

    # appended to, a value is a raw string in redis; a new key is encoded as SET would
    result = store.write_range(c.tag, key, None, n, write, label=None if size is None else RAW)
    if result.__class__ is Pending:
        return _deferred(store, result)
    return _ack(store, result)


def _incr(c, args, by: int):
    store, key = c.keyspace, args[1]
    size = store.size(c.tag, key)
    if size is None:
        current = 0
    else:
        if size > _MAX_INT_LEN:
            raise _NOT_INT
        raw = _in_dram(c, key, lambda: _incr(c, args, by))
        if raw.__class__ is Pending:
            return raw
        current = parse_int(raw)
    value = current + by
    if not -(1 << 63) <= value < (1 << 63):
        raise CommandError("increment or decrement would overflow")
    store.publish(c.tag, key, storable(store, b"%d" % value), keep_ttl=True)
    return _ack(store, value)


def cmd_incr(c, args):
    return _incr(c, args, 1)


def cmd_decr(c, args):
    return _incr(c, args, -1)


def cmd_incrby(c, args):
    return _incr(c, args, parse_int(args[2]))


def cmd_decrby(c, args):
    by = parse_int(args[2])
    if by == -(1 << 63):
        raise CommandError("decrement would overflow")
    return _incr(c, args, -by)


def cmd_incrbyfloat(c, args):
    store, key = c.keyspace, args[1]
    size = store.size(c.tag, key)
    if size is None:
        current = ZERO
    else:
        if size >= MAX_LONG_DOUBLE_CHARS:
            raise NOT_FLOAT
        raw = _in_dram(c, key, lambda: cmd_incrbyfloat(c, args))
        if raw.__class__ is Pending:
            return raw
        current = parse_long_double(raw)
    value = add_long_double(current, parse_long_double(args[2]))
    text = format_long_double(value)
    store.publish(c.tag, key, storable(store, text), keep_ttl=True)
    store.label(c.tag, key, float_encoding(text))
    return _ack(store, text)


def cmd_getset(c, args):
    store, key = c.keyspace, args[1]
    value = storable(store, args[2])
    old = store.get(c.tag, key)
    store.publish(c.tag, key, value)
    return _ack(store, old)


def cmd_getdel(c, args):
    store, key = c.keyspace, args[1]
    old = store.get(c.tag, key)
    if old is not None:
        store.delete(c.tag, key)
    return _ack(store, old)


def cmd_getex(c, args):
    exp_opt = exp_raw = None
    persist = False
    i, n = 2, len(args)
    while i < n:
        opt = bytes(args[i]).upper()
        if opt == b"PERSIST" and exp_opt is None:
            persist = True
        elif opt in _EXPIRE_OPTS and exp_opt in (None, opt) and not persist and i + 1 < n:
            exp_opt, exp_raw = opt, args[i + 1]
            i += 1
        else:
            raise _SYNTAX
        i += 1
    store, key = c.keyspace, args[1]
    if exp_opt is None and not persist:
        return store.get(c.tag, key)
    if not store.contains(c.tag, key):
        store.lookup(c.tag, key)  # counted as a miss, as GET would
        return None
    at = None if exp_opt is None else _expire_at(exp_opt, exp_raw, "getex")
    value = store.get(c.tag, key)  # a TTL change of a value with an SSD copy is made durable there (_ack)
    if at is not None and exp_opt in (b"EXAT", b"PXAT") and at <= now_ms():
        store.delete(c.tag, key)
    elif at is not None:
        store.set_ttl(c.tag, key, at)
    elif persist:
        store.persist(c.tag, key)
    return _ack(store, value)


def _whole(n: int) -> tuple[int, int]:
    return 0, n


def _bytes_and_release(value) -> bytes:
    if value is None:
        return b""
    if value.__class__ is Pinned:
        try:
            return bytes(value.view)
        finally:
            value.release()
    return bytes(value)


def cmd_lcs(c, args):
    store = c.keyspace
    a = store.read_slice(c.tag, args[1], _whole)
    b = store.read_slice(c.tag, args[2], _whole)
    if a.__class__ is Pending or b.__class__ is Pending:
        return Pending(_lcs_later(c, args, a, b))
    return _lcs(c, args, _bytes_and_release(a), _bytes_and_release(b))


async def _lcs_later(c, args, a, b):
    if a.__class__ is Pending:
        try:
            a = await a.awaitable
        except BaseException:
            if b.__class__ is not Pending:
                _bytes_and_release(b)
            raise
    a = _bytes_and_release(a)
    if b.__class__ is Pending:
        b = await b.awaitable
    return _lcs(c, args, a, _bytes_and_release(b))


def _lcs(c, args, a: bytes, b: bytes):
    get_len = get_idx = with_len = False
    min_len = 0
    i, n = 3, len(args)
    while i < n:
        opt = bytes(args[i]).upper()
        if opt == b"IDX":
            get_idx = True
        elif opt == b"LEN":
            get_len = True
        elif opt == b"WITHMATCHLEN":
            with_len = True
        elif opt == b"MINMATCHLEN" and i + 1 < n:
            min_len = max(0, parse_int(args[i + 1]))
            i += 1
        else:
            raise _SYNTAX
        i += 1
    if get_len and get_idx:
        raise CommandError("If you want both the length and indexes, please just use IDX.")
    if (len(a) + 1) * (len(b) + 1) * 4 > c.ctx.cfg.server.proto_max_bulk_len:
        raise CommandError("Insufficient memory, transient memory for LCS exceeds proto-max-bulk-len")
    table = LcsTable(a, b)
    total = table.at(len(a), len(b))
    if get_len:
        return total
    text, matches = table.walk(min_len, with_len)
    if get_idx:
        return {b"matches": matches, b"len": total}
    return text


def cmd_setnx(c, args):
    store, key = c.keyspace, args[1]
    if store.contains(c.tag, key):
        return 0
    store.publish(c.tag, key, storable(store, args[2]))
    return 1


def _setex(c, args, opt: bytes, name: str):
    at = _expire_at(opt, args[2], name)
    store, key = c.keyspace, args[1]
    store.publish(c.tag, key, storable(store, args[3]))
    store.set_expire(c.tag, key, at)
    return _ack(store, OK)


def cmd_setex(c, args):
    return _setex(c, args, b"EX", "setex")


def cmd_psetex(c, args):
    return _setex(c, args, b"PX", "psetex")


def cmd_msetnx(c, args):
    if len(args) % 2 == 0:
        raise CommandError("wrong number of arguments for 'msetnx' command")
    store, tag = c.keyspace, c.tag
    if any(store.contains(tag, args[i]) for i in range(1, len(args), 2)):
        return 0
    values = []
    try:  # all or nothing: every value is stored before any key is set
        for i in range(2, len(args), 2):
            values.append(storable(store, args[i]))
    except BaseException:
        for v in values:
            if v.__class__ is Block:
                store.discard(v)
        raise
    for i, value in zip(range(1, len(args), 2), values):
        store.publish(tag, args[i], value)
    return 1
