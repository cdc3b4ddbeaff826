"""Bit commands on string values: SETBIT, GETBIT, BITCOUNT, BITPOS, BITOP, BITFIELD(_RO).

As redis 7.0 defines them (bitops.c): bit 0 is the most significant bit of byte 0, a value
is zero-padded as far as a write reaches, offsets stop at proto-max-bulk-len bytes, and
BITFIELD's overflow arithmetic is 64-bit two's complement, edge cases included.

Reads take only the bytes they need (`Keyspace.read_slice`: GETBIT one byte, BITCOUNT and
BITPOS their range), writes go where the value lies (`Keyspace.write_range`: an arena block
in place unless a reader pins it). Every key is the caller's (`c.tag`); BITOP reads and
writes in that scope only.
"""

from __future__ import annotations

from quilld.errors import CommandError
from quilld.model import Pending, Pinned
from quilld.protocol.commands.common import RAW, acked, parse_int
from quilld.protocol.table import FAST, READONLY, WRITE, CommandTable

_SYNTAX = CommandError("syntax error")
_BAD_OFFSET = "bit offset is not an integer or out of range"
_BAD_BIT = "bit is not an integer or out of range"
_BAD_TYPE = CommandError("Invalid bitfield type. Use something like i16 u8. Note that u64 is not supported but i64 is.")
_CHUNK = 1 << 20  # bytes looked at per step when counting or searching a large value
_U64 = (1 << 64) - 1


def _ack(store, reply):
    return acked(store, reply) if store.unsynced else reply


def _deferred(store, pending: Pending) -> Pending:
    return Pending(_write_then_ack(store, pending))


async def _write_then_ack(store, pending: Pending):
    result = await pending.awaitable
    wait = store.take_unsynced()
    if wait is not None:
        await wait
    return result


def _reading(value, fn):
    """`fn(bytes-like or None)` of a read's value, now or once a read of the SSD resolves;
    a pinned view is released once `fn` is done with it."""
    if value.__class__ is Pending:
        return Pending(_reading_later(value, fn))
    if value.__class__ is Pinned:
        try:
            return fn(value.view)
        finally:
            value.release()
    return fn(value)


async def _reading_later(pending: Pending, fn):
    return _reading(await pending.awaitable, fn)


def _s64(x: int) -> int:
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def bit_offset(c, raw, bits: int = 0) -> int:
    """A bit offset (redis's getBitOffsetFromArgument); "#n" means n * bits when `bits`."""
    raw = bytes(raw)
    by_width = bits > 0 and raw[:1] == b"#"
    offset = parse_int(raw[1:] if by_width else raw, _BAD_OFFSET)
    if by_width:
        offset = _s64(offset * bits)
    if offset < 0 or (offset >> 3) >= c.ctx.cfg.server.proto_max_bulk_len:
        raise CommandError(_BAD_OFFSET)
    return offset


def cmd_setbit(c, args):
    offset = bit_offset(c, args[2])
    on = parse_int(args[3], _BAD_BIT)
    if on & ~1:
        raise CommandError(_BAD_BIT)
    byte, mask = offset >> 3, 1 << (7 - (offset & 7))

    def flip(view):
        old = view[byte]
        view[byte] = old | mask if on else old & ~mask
        return 1 if old & mask else 0

    store = c.keyspace  # a bit set to what it was is no change (unless the key is created or grows)
    result = store.write_range(c.tag, args[1], byte, 1, flip, lambda old: old == on, RAW)
    if result.__class__ is Pending:
        return _deferred(store, result)
    return _ack(store, result)


def cmd_getbit(c, args):
    offset = bit_offset(c, args[2])
    byte, shift = offset >> 3, 7 - (offset & 7)
    value = c.keyspace.read_slice(c.tag, args[1], lambda n: (byte, byte + 1) if byte < n else (0, 0))
    return _reading(value, lambda v: (v[0] >> shift) & 1 if v else 0)


def _popcount(view) -> int:
    return sum(int.from_bytes(view[i:i + _CHUNK], "big").bit_count() for i in range(0, len(view), _CHUNK))


def _bit_range(start: int, end: int, length: int, in_bits: bool):
    """Redis's range conversion: (first byte, last byte, mask of the first byte's bits before
    the range, mask of the last byte's bits after it), or None when the range is empty."""
    total = length * 8 if in_bits else length
    if start < 0:
        start += total
    if end < 0:
        end += total
    start, end = max(start, 0), max(end, 0)
    if end >= total:
        end = total - 1
    if start > end:
        return None
    if not in_bits:
        return start, end, 0, 0
    before = ~((1 << (8 - (start & 7))) - 1) & 0xFF
    after = (1 << (7 - (end & 7))) - 1
    return start >> 3, end >> 3, before, after


def _unit(raw) -> bool:
    unit = bytes(raw).upper()
    if unit == b"BIT":
        return True
    if unit == b"BYTE":
        return False
    raise _SYNTAX


def cmd_bitcount(c, args):
    store, n = c.keyspace, len(args)
    length = store.size(c.tag, args[1])
    if length is None:
        store.lookup(c.tag, args[1])  # counted as a miss
        return 0
    if n == 2:
        span = (0, length - 1, 0, 0) if length else None
    elif n in (4, 5):
        start, end = parse_int(args[2]), parse_int(args[3])
        if start < 0 and end < 0 and start > end:
            return 0
        span = _bit_range(start, end, length, _unit(args[4]) if n == 5 else False)
    else:
        raise _SYNTAX
    if span is None:
        return 0
    first, last, before, after = span

    def count(view):
        if view is None:
            return 0
        total = _popcount(view)
        if before:
            total -= (view[0] & before).bit_count()
        if after:
            total -= (view[-1] & after).bit_count()
        return total

    return _reading(store.read_slice(c.tag, args[1], lambda _: (first, last + 1)), count)


def _first_byte_not(view, skip: int) -> int:
    """Index of the first byte of `view` that is not `skip`, or -1."""
    strip = bytes((skip,))
    for i in range(0, len(view), _CHUNK):
        part = bytes(view[i:i + _CHUNK])
        rest = part.lstrip(strip)
        if rest:
            return i + len(part) - len(rest)
    return -1


def cmd_bitpos(c, args):
    bit = parse_int(args[2])
    if bit not in (0, 1):
        raise CommandError("The bit argument must be 1 or 0.")
    store, n = c.keyspace, len(args)
    length = store.size(c.tag, args[1])
    if length is None:
        store.lookup(c.tag, args[1])  # counted as a miss
        return -1 if bit else 0
    end_given = False
    if n in (4, 5, 6):
        start = parse_int(args[3])
        in_bits = _unit(args[5]) if n == 6 else False
        if n >= 5:
            end = parse_int(args[4])
            end_given = True
        else:
            end = length * 8 + 7 if in_bits else length - 1
        span = _bit_range(start, end, length, in_bits)
    elif n == 3:
        span = (0, length - 1, 0, 0) if length else None
    else:
        raise _SYNTAX
    if span is None:
        return -1
    first, last, before, after = span

    def find(view):
        if view is None:
            return -1
        head, tail = view[0], view[-1]
        if bit:  # bits outside the range count as 0 ...
            head &= ~before
            tail = (head if len(view) == 1 else tail) & ~after
        else:  # ... or as 1 when looking for a 0
            head |= before
            tail = (head if len(view) == 1 else tail) | after
        skip = 0 if bit else 0xFF
        if len(view) == 1:
            where, byte = (0, tail) if tail != skip else (-1, 0)
        elif head != skip:
            where, byte = 0, head
        else:
            inner = _first_byte_not(view[1:-1], skip)
            if inner >= 0:
                where, byte = inner + 1, view[inner + 1]
            elif tail != skip:
                where, byte = len(view) - 1, tail
            else:
                where = -1
        if where < 0:  # none in the range: for a 0, the first bit past it, unless an end was given
            return -1 if bit or end_given else (last + 1) * 8
        target = byte if bit else ~byte & 0xFF
        return (first + where) * 8 + 8 - target.bit_length()

    return _reading(store.read_slice(c.tag, args[1], lambda _: (first, last + 1)), find)


_OPS = (b"AND", b"OR", b"XOR", b"NOT")


def cmd_bitop(c, args):
    op = bytes(args[1]).upper()
    if op not in _OPS:
        raise _SYNTAX
    if op == b"NOT" and len(args) != 4:
        raise CommandError("BITOP NOT must be called with a single source key.")
    store, tag = c.keyspace, c.tag
    sources = [store.read_slice(tag, k, _whole) for k in args[3:]]
    if any(s.__class__ is Pending for s in sources):
        return Pending(_bitop_later(c, args[2], op, sources))
    return _bitop(c, args[2], op, [_bytes(s) for s in sources])


def _whole(n: int) -> tuple[int, int]:
    return 0, n


def _bytes(value) -> bytes:
    if value.__class__ is Pinned:
        try:
            return bytes(value.view)
        finally:
            value.release()
    return b"" if value is None else bytes(value)


async def _bitop_later(c, dest, op: bytes, sources: list):
    values, failure = [], None
    for s in sources:  # every read is awaited, so every pin taken is given back
        try:
            values.append(_bytes(await s.awaitable if s.__class__ is Pending else s))
        except BaseException as e:
            failure = failure or e
    if failure is not None:
        raise failure
    reply = _bitop(c, dest, op, values)
    return await reply.awaitable if reply.__class__ is Pending else reply


def _bitop(c, dest, op: bytes, values: list[bytes]):
    store = c.keyspace
    size = max(len(v) for v in values)
    if not size:
        store.delete(c.tag, dest)
        return _ack(store, 0)
    ints = [int.from_bytes(v, "big") << (8 * (size - len(v))) for v in values]  # zero-padded at the end
    result = ints[0]
    if op == b"NOT":
        result = ~result & ((1 << (8 * size)) - 1)
    elif op == b"AND":
        for v in ints[1:]:
            result &= v
    elif op == b"OR":
        for v in ints[1:]:
            result |= v
    else:
        for v in ints[1:]:
            result ^= v
    store.publish(c.tag, dest, store.materialize(result.to_bytes(size, "big")))
    store.label(c.tag, dest, RAW)  # redis builds BITOP's result as a raw string
    return _ack(store, size)


# -- BITFIELD ---------------------------------------------------------------------------

_GET, _SET, _INCRBY = 0, 1, 2
_WRAP, _SAT, _FAIL = 0, 1, 2
_OVERFLOWS = {b"WRAP": _WRAP, b"SAT": _SAT, b"FAIL": _FAIL}


def _field_type(raw) -> tuple[bool, int]:
    raw = bytes(raw)
    sign = raw[:1]
    if sign not in (b"i", b"u"):
        raise _BAD_TYPE
    digits = raw[1:].split(b"\0", 1)[0]  # redis reads it as a C string
    bits = parse_int(digits, _BAD_TYPE.message)
    if bits < 1 or bits > (64 if sign == b"i" else 63):
        raise _BAD_TYPE
    return sign == b"i", bits


def _get_field(view, offset: int, bits: int, signed: bool) -> int:
    """The field at bit `offset`, reading past the value's end as zero bits."""
    byte = offset >> 3
    word = int.from_bytes(bytes(view[byte:byte + 9]).ljust(9, b"\0"), "big")
    value = (word >> (72 - (offset & 7) - bits)) & ((1 << bits) - 1)
    if signed and value >> (bits - 1):
        value -= 1 << bits
    return value


def _set_field(view, offset: int, bits: int, value: int) -> None:
    byte, lead = offset >> 3, offset & 7
    nbytes = (lead + bits + 7) >> 3
    shift = nbytes * 8 - lead - bits
    mask = ((1 << bits) - 1) << shift
    word = int.from_bytes(view[byte:byte + nbytes], "big")
    view[byte:byte + nbytes] = ((word & ~mask) | ((value << shift) & mask)).to_bytes(nbytes, "big")


def _unsigned_overflow(value: int, incr: int, bits: int, how: int) -> tuple[int, int]:
    """(overflow: 1, -1 or 0, the value to store) for a `bits`-wide unsigned field holding
    `value` (a uint64) plus `incr` (an int64): checkUnsignedBitfieldOverflow's arithmetic."""
    top = (1 << bits) - 1
    wrapped = ((value + incr) & _U64) & top
    if value > top or (incr > 0 and incr > _s64(top - value)):
        return 1, wrapped if how == _WRAP else top
    if incr < 0 and incr < _s64(-value):
        return -1, wrapped if how == _WRAP else 0
    return 0, value + incr


def _signed_overflow(value: int, incr: int, bits: int, how: int) -> tuple[int, int]:
    """As checkSignedBitfieldOverflow: int64 arithmetic wrapping as the C code's does."""
    top = (1 << 63) - 1 if bits == 64 else (1 << (bits - 1)) - 1
    low = -top - 1
    max_incr, min_incr = _s64(top - value), _s64(low - value)
    total = (value + incr) & _U64
    if bits < 64:
        total = total | (_U64 << bits) & _U64 if total >> (bits - 1) & 1 else total & ((1 << bits) - 1)
    wrapped = _s64(total)
    if value > top or (bits != 64 and incr > max_incr) or (value >= 0 and incr > 0 and incr > max_incr):
        return 1, wrapped if how == _WRAP else top
    if value < low or (bits != 64 and incr < min_incr) or (value < 0 and incr < 0 and incr < min_incr):
        return -1, wrapped if how == _WRAP else low
    return 0, value + incr


def _parse_fields(c, args) -> tuple[list, int]:
    """The operations (op, signed, bits, offset, argument, overflow) and the highest bit a
    write reaches (-1 when none writes), errors in redis's order."""
    ops, highest, how = [], -1, _WRAP
    i, n = 2, len(args)
    while i < n:
        left = n - i - 1
        sub = bytes(args[i]).upper()
        if sub == b"GET" and left >= 2:
            op = _GET
        elif sub == b"SET" and left >= 3:
            op = _SET
        elif sub == b"INCRBY" and left >= 3:
            op = _INCRBY
        elif sub == b"OVERFLOW" and left >= 1:
            how = _OVERFLOWS.get(bytes(args[i + 1]).upper(), -1)
            if how < 0:
                raise CommandError("Invalid OVERFLOW type specified")
            i += 2
            continue
        else:
            raise _SYNTAX
        signed, bits = _field_type(args[i + 1])
        offset = bit_offset(c, args[i + 2], bits)
        arg = 0
        if op != _GET:
            highest = max(highest, offset + bits - 1)
            arg = parse_int(args[i + 3])
        ops.append((op, signed, bits, offset, arg, how))
        i += 3 if op == _GET else 4
    return ops, highest


def _run_fields(view, ops: list, changes: list | None = None) -> list:
    """The replies of `ops` on `view`; `changes[0]` counts the writes that changed a field."""
    out = []
    for op, signed, bits, offset, arg, how in ops:
        if op == _GET:
            out.append(_get_field(view, offset, bits, signed))
            continue
        old = _get_field(view, offset, bits, signed)
        if signed:
            value, incr = (old, arg) if op == _INCRBY else (arg, 0)
            overflow, new = _signed_overflow(value, incr, bits, how)
        else:
            value, incr = (old, arg) if op == _INCRBY else (arg & _U64, 0)
            overflow, new = _unsigned_overflow(value, incr, bits, how)
        if overflow and how == _FAIL:
            out.append(None)
            continue
        out.append(new if op == _INCRBY else old)
        _set_field(view, offset, bits, new & _U64)
        if changes is not None and new != old:
            changes[0] += 1
    return out


def _bitfield(c, args, read_only: bool):
    ops, highest = _parse_fields(c, args)
    store = c.keyspace
    if highest < 0:  # only GETs: a read, no key created
        return _reading(store.read_slice(c.tag, args[1], _whole), lambda v: _run_fields(v or b"", ops))
    if read_only:
        raise CommandError("BITFIELD_RO only supports the GET subcommand")
    changes = [0]  # writes that changed a field: none is no change of the key (redis's `changes`)
    result = store.write_range(c.tag, args[1], 0, (highest >> 3) + 1, lambda view: _run_fields(view, ops, changes),
                               lambda _: not changes[0], RAW)
    if result.__class__ is Pending:
        return _deferred(store, result)
    return _ack(store, result)


def cmd_bitfield(c, args):
    return _bitfield(c, args, False)


def cmd_bitfield_ro(c, args):
    return _bitfield(c, args, True)


def register(t: CommandTable) -> None:
    one, g, wd = (1, 1, 1), "bitmap", f"{WRITE} denyoom"
    t.add("setbit", 4, wd, cmd_setbit, "Sets or clears the bit at offset of the string value. Creates the key if "
          "it doesn't exist.", g, "2.2.0", keys=one)
    t.add("getbit", 3, f"{READONLY} {FAST}", cmd_getbit, "Returns a bit value by offset.", g, "2.2.0", keys=one)
    t.add("bitcount", -2, READONLY, cmd_bitcount, "Counts the number of set bits (population counting) in a "
          "string.", g, "2.6.0", keys=one)
    t.add("bitpos", -3, READONLY, cmd_bitpos, "Finds the first set (1) or clear (0) bit in a string.", g, "2.8.7",
          keys=one)
    t.add("bitop", -4, wd, cmd_bitop, "Performs bitwise operations on multiple strings, and stores the result.", g,
          "2.6.0", keys=(2, -1, 1))
    t.add("bitfield", -2, wd, cmd_bitfield, "Performs arbitrary bitfield integer operations on strings.", g,
          "3.2.0", keys=one)
    t.add("bitfield_ro", -2, f"{READONLY} {FAST}", cmd_bitfield_ro, "Performs arbitrary read-only bitfield integer "
          "operations on strings.", g, "6.0.0", keys=one)
