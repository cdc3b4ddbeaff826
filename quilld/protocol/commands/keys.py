"""The generic keyspace: TTLs, KEYS/SCAN/RANDOMKEY, RENAME/COPY, FLUSHDB, OBJECT, MEMORY, TIME.

Replies and error texts are redis 7.0.15's, in its order of checks. Everything
happens inside the caller's identity scope (`c.tag`): KEYS, SCAN and RANDOMKEY
see only its keys, RENAME and COPY never leave it (both names get the same tag).

Values kept only on SSD: the SSD tier keeps TTLs, so EXPIRE (and its siblings)
and PERSIST change one where it is, and answer once its copy's new TTL is durable
(`_reply`), so a crash never brings the key back with its old TTL. Its copies are
stored under their key: RENAME and COPY of such a value first read it back into
DRAM (a deferred reply; the key then lives in DRAM as after a promoting GET), then
run as for any DRAM value; RENAME drops the SSD copy and answers once that
deletion is durable, so a crash never brings the key back under its old name.

The SCAN cursor is described in `Keyspace.scan` (tiers/keyspace.py): each
scope's keys sit in an array from which a removal swap-removes, so a key's
slot only ever goes down, and a cursor is "the slots below it are left".
"""

from __future__ import annotations

import functools
import re
import sys
import time
from typing import Callable

from quilld.errors import CommandError, OutOfMemory
from quilld.model import CacheTier, Pending
from quilld.protocol.commands.common import EMBSTR_MAX, parse_int
from quilld.protocol.commands.strings import acked
from quilld.context.figures import human, rss_bytes
from quilld.protocol.resp import OK, Status, Verbatim
from quilld.protocol.table import FAST, READONLY, WRITE, CommandTable
from quilld.scopes import TAG_LEN
from quilld.tiers.keyspace import now_ms

_SYNTAX = CommandError("syntax error")
LLONG_MAX = (1 << 63) - 1
LLONG_MIN = -(1 << 63)
ULONG_MAX = (1 << 64) - 1
SCAN_COUNT = 10  # SCAN's default COUNT
BRING_BACK_TRIES = 8  # reads of an SSD-only value back into DRAM (or waits for room) before giving up

# MEMORY USAGE's estimate of what a key costs beyond its value's bytes: the key's bytes
# object, its slots in the LRU dict and the scope's key array, and the value's object
KEY_OVERHEAD = sys.getsizeof(b"") + 8 + 104
INLINE_OVERHEAD = sys.getsizeof(b"")
BLOCK_OVERHEAD = 96


def _token(raw) -> bytes:
    """An option as redis's strcasecmp() reads it: up to a NUL byte, in upper case."""
    raw = bytes(raw)
    nul = raw.find(0)
    return (raw if nul < 0 else raw[:nul]).upper()


def _reply(store, reply):
    """`reply`, once any copy below DRAM that the command released is durably gone."""
    return acked(store, reply) if store.unsynced else reply


def _in_dram(c, key: bytes, fn: Callable, *a):
    """`fn(*a)` once `key`'s value is in DRAM: a value kept only on SSD is read back first."""
    store = c.keyspace
    if store.lower and store.below_only(c.tag, key):
        return Pending(_brought_back(store, c.tag, key, c.ctx.space_freed, c.ctx.cfg.server.space_wait_ms, fn, a))
    return fn(*a)


async def _brought_back(store, tag: bytes, key: bytes, space_freed, wait_ms: int, fn: Callable, a: tuple):
    """Read the value back, then run the command; while the arena is full of blocks the
    SSD tier is about to take (COPY needs room for its copy), wait for room, as the server
    shell does for a command that found none."""
    deadline, moved = time.monotonic() + wait_ms / 1000, 0
    while True:
        await store.bring_back(tag, key, space_freed)
        if store.below_only(tag, key):  # demoted again before its turn came
            moved += 1
            if moved >= BRING_BACK_TRIES:
                raise CommandError("the value went back to SSD while being read into DRAM; try again")
            continue
        try:
            reply = fn(*a)
        except OutOfMemory:
            if time.monotonic() > deadline or not store.space_may_free():
                raise
            store.lower_tier.wake()
            await space_freed(0.01)
            continue
        return await reply.awaitable if reply.__class__ is Pending else reply


# -- TTLs ---------------------------------------------------------------------------
_NX, _XX, _GT, _LT = 1, 2, 4, 8
_EXPIRE_FLAGS = {b"NX": _NX, b"XX": _XX, b"GT": _GT, b"LT": _LT}


def _expire(c, args, name: str, base_ms: int, seconds: bool):
    """EXPIRE, PEXPIRE, EXPIREAT, PEXPIREAT: options, then the time, then the key."""
    flags = 0
    for raw in args[3:]:
        flag = _EXPIRE_FLAGS.get(_token(raw))
        if flag is None:
            raw = bytes(raw)
            nul = raw.find(0)
            raise CommandError("Unsupported option " + (raw if nul < 0 else raw[:nul]).decode(
                "utf-8", "surrogateescape"))
        flags |= flag
    if flags & _NX and flags & (_XX | _GT | _LT):
        raise CommandError("NX and XX, GT or LT options at the same time are not compatible")
    if flags & _GT and flags & _LT:
        raise CommandError("GT and LT options at the same time are not compatible")
    when = parse_int(args[2])
    if seconds:
        if when > LLONG_MAX // 1000 or when < -(-LLONG_MIN // 1000):  # C division truncates
            raise CommandError(f"invalid expire time in '{name}' command")
        when *= 1000
    if when > LLONG_MAX - base_ms:
        raise CommandError(f"invalid expire time in '{name}' command")
    return _set_expire(c, args[1], when + base_ms, flags)  # wherever the value is: the SSD tier keeps TTLs


def _set_expire(c, key: bytes, when: int, flags: int):
    store, tag = c.keyspace, c.tag
    current = store.expire_time(tag, key)
    if current == -2:
        return 0
    if flags:
        if flags & _NX and current != -1:
            return 0
        if flags & _XX and current == -1:
            return 0
        if flags & _GT and (current == -1 or when <= current):
            return 0
        if flags & _LT and current != -1 and when >= current:
            return 0
    if when <= now_ms():  # already in the past: a deletion, as redis makes it
        store.delete(tag, key)
    else:
        store.set_ttl(tag, key, when)
    return _reply(store, 1)


def cmd_expire(c, args):
    return _expire(c, args, "expire", now_ms(), True)


def cmd_pexpire(c, args):
    return _expire(c, args, "pexpire", now_ms(), False)


def cmd_expireat(c, args):
    return _expire(c, args, "expireat", 0, True)


def cmd_pexpireat(c, args):
    return _expire(c, args, "pexpireat", 0, False)


def cmd_persist(c, args):
    store = c.keyspace
    return _reply(store, 1 if store.persist(c.tag, args[1]) else 0)  # an SSD copy's TTL goes durably first


def cmd_expiretime(c, args):
    at = c.keyspace.expire_time(c.tag, args[1])
    return at if at < 0 else (at + 500) // 1000


def cmd_pexpiretime(c, args):
    return c.keyspace.expire_time(c.tag, args[1])


def cmd_touch(c, args):
    store, tag = c.keyspace, c.tag
    return sum(1 for k in args[1:] if store.lookup(tag, k) is not None)


# -- enumeration --------------------------------------------------------------------
def _signed(b: int) -> int:
    """A byte as redis's (signed) char compares it in a [a-z] range."""
    return b - 256 if b > 127 else b


def _glob_tokens(pattern: bytes) -> list:
    """redis's stringmatchlen() pattern as tokens: None for a run of `*`, else the set of
    bytes one position accepts (`?`, `[...]` with `^`, ranges and `\\` escapes, a literal)."""
    tokens: list = []
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == 42:  # '*'
            if not tokens or tokens[-1] is not None:
                tokens.append(None)
            i += 1
            continue
        if ch == 63:  # '?'
            tokens.append(range(256))
        elif ch == 91:  # '['
            i += 1
            negate = i < n and pattern[i] == 94  # '^'
            if negate:
                i += 1
            members: set[int] = set()
            while True:
                if i < n - 1 and pattern[i] == 92:  # '\' escapes the next byte
                    i += 1
                    members.add(pattern[i])
                elif i < n and pattern[i] == 93:  # ']'
                    break
                elif i >= n:  # no closing ']': the class ends with the pattern
                    i = n - 1
                    break
                elif n - i >= 3 and pattern[i + 1] == 45:  # 'a-z', either way round, as signed chars
                    lo, hi = sorted((_signed(pattern[i]), _signed(pattern[i + 2])))
                    members.update(b for b in range(256) if lo <= _signed(b) <= hi)
                    i += 2
                else:
                    members.add(pattern[i])
                i += 1
            tokens.append(set(range(256)) - members if negate else members)
        elif ch == 92 and i + 1 < n:  # '\x' is a literal x; a trailing '\' is itself
            i += 1
            tokens.append((pattern[i],))
        else:
            tokens.append((ch,))
        i += 1
    return tokens


def _class(accepts) -> bytes:
    accepts = set(accepts)
    if len(accepts) == 256:
        return b"."
    if not accepts:
        return b"(?!)"
    if len(accepts) == 1:
        return re.escape(bytes(accepts))
    return b"[" + b"".join(b"\\x%02x" % b for b in sorted(accepts)) + b"]"


@functools.lru_cache(maxsize=256)
def glob_matcher(pattern: bytes) -> Callable[[bytes], bool]:
    """A predicate that accepts exactly the keys redis's stringmatchlen(pattern) matches.

    Every token but `*` takes exactly one byte, so a pattern is fixed-length segments
    between stars: the first must match at the start, the last at the end, and each
    middle one is placed leftmost after the one before. That is linear in practice and
    never backtracks exponentially (redis's "long nested loops" regression). An empty
    key matches only an empty pattern, as in redis (its loop never runs).
    """
    tokens = _glob_tokens(pattern)
    segments: list[list] = [[]]
    for t in tokens:
        if t is None:
            segments.append([])
        else:
            segments[-1].append(t)
    regexes = [re.compile(b"".join(_class(t) for t in seg), re.DOTALL) for seg in segments]
    lengths = [len(seg) for seg in segments]
    if len(segments) == 1:  # no star: the whole key, one byte per token
        whole = regexes[0]
        if not pattern:
            return _empty
        return lambda key: bool(key) and whole.fullmatch(key) is not None
    head, tail, middle = regexes[0], regexes[-1], regexes[1:-1]
    need = lengths[0] + lengths[-1]
    tail_len = lengths[-1]

    def match(key: bytes) -> bool:
        n = len(key)
        if not n or n < need or head.match(key) is None or tail.match(key, n - tail_len) is None:
            return False
        pos, end = lengths[0], n - tail_len
        for seg in middle:
            m = seg.search(key, pos, end)
            if m is None:
                return False
            pos = m.end()
        return True

    return match


def _empty(key: bytes) -> bool:
    return not key


def cmd_keys(c, args):
    pattern = bytes(args[1])
    return c.keyspace.keys_matching(c.tag, None if pattern == b"*" else glob_matcher(pattern))


_CURSOR = re.compile(rb"([+-]?)(\d*)")


def _cursor(raw) -> int:
    """SCAN's cursor as redis's strtoul() reads it (a sign, leading zeros, "" is 0; a
    negative wraps around; no leading space, nothing after the digits, at most 2^64-1)."""
    raw = bytes(raw)
    nul = raw.find(0)
    if nul >= 0:
        raw = raw[:nul]
    m = _CURSOR.fullmatch(raw)
    if m is None or (m.group(1) and not m.group(2)) or len((m.group(2) or b"").lstrip(b"0")) > 20:
        raise CommandError("invalid cursor")  # (over 20 significant digits is past 2^64)
    value = int(m.group(2) or b"0")
    if value > ULONG_MAX:
        raise CommandError("invalid cursor")
    return (-value) & ULONG_MAX if m.group(1) == b"-" else value


def cmd_scan(c, args):
    """SCAN cursor [MATCH pattern] [COUNT count] [TYPE type].

    The cursor is an index into the scope's key array, counted from the top: every
    key present from the first call to the last is returned (see `Keyspace.scan`).
    COUNT is the number of slots visited per call, as redis's is buckets visited.
    """
    cursor = _cursor(args[1])
    count, match, type_name = SCAN_COUNT, None, None
    i, n = 2, len(args)
    while i < n:
        opt = _token(args[i])
        if opt == b"COUNT" and n - i >= 2:
            count = parse_int(args[i + 1])
            if count < 1:
                raise _SYNTAX
        elif opt == b"MATCH" and n - i >= 2:
            pattern = bytes(args[i + 1])
            match = None if pattern == b"*" else glob_matcher(pattern)
        elif opt == b"TYPE" and n - i >= 2:
            type_name = _token(args[i + 1])
        else:
            raise _SYNTAX
        i += 2
    keep = match
    if type_name is not None and type_name != b"STRING":  # every value here is a string
        keep = _nothing
    cursor, keys = c.keyspace.scan(c.tag, cursor, count, keep)
    return [str(cursor).encode(), keys]


def _nothing(key: bytes) -> bool:
    return False


def cmd_randomkey(c, args):
    return c.keyspace.random_key(c.tag)


# -- renames and copies -------------------------------------------------------------
def _rename(c, src: bytes, dst: bytes, nx: bool):
    store = c.keyspace
    done = store.rename(c.tag, src, dst, nx)
    if done < 0:
        raise CommandError("no such key")
    return _reply(store, done if nx else OK)


def cmd_rename(c, args):
    return _in_dram(c, args[1], _rename, c, args[1], args[2], False)


def cmd_renamenx(c, args):
    return _in_dram(c, args[1], _rename, c, args[1], args[2], True)


def cmd_copy(c, args):
    """COPY source destination [DB 0] [REPLACE]: within the caller's scope; this node has
    one database, so DB names 0 or is out of range (as SELECT)."""
    replace = False
    i, n = 3, len(args)
    while i < n:
        opt = _token(args[i])
        if opt == b"REPLACE":
            replace = True
        elif opt == b"DB" and i + 1 < n:
            db = parse_int(args[i + 1])
            if not -(1 << 31) <= db < (1 << 31):
                raise CommandError("value is out of range, value must between -2147483648 and 2147483647")
            if db != 0:
                raise CommandError("DB index is out of range")
            i += 1
        else:
            raise _SYNTAX
        i += 1
    if bytes(args[1]) == bytes(args[2]):
        raise CommandError("source and destination objects are the same")
    return _in_dram(c, args[1], _copy, c, args[1], args[2], replace)


def _copy(c, src: bytes, dst: bytes, replace: bool):
    store = c.keyspace
    return _reply(store, 1 if store.copy(c.tag, src, dst, replace) else 0)


def cmd_flushdb(c, args):
    """FLUSHDB [ASYNC|SYNC]: the caller's scope, as FLUSHALL (one database per scope)."""
    if len(args) > 2 or (len(args) == 2 and _token(args[1]) not in (b"ASYNC", b"SYNC")):
        raise _SYNTAX
    store = c.keyspace
    with c.ctx.clients.tracking.flush(c.tag):  # one invalidation of every key, not one a key
        store.flush_scope(c.tag)
    return _reply(store, OK)


# -- introspection ------------------------------------------------------------------
def _help(name: str, lines: tuple[str, ...]) -> list:
    """redis's addReplyHelp(): status lines, a header and the HELP footer."""
    return [Status(f"{name} <subcommand> [<arg> [value] [opt] ...]. Subcommands are:".encode())] + [
        Status(line.encode()) for line in lines] + [Status(b"HELP"), Status(b"    Prints this help.")]


_OBJECT_HELP = (
    "ENCODING <key>",
    "    Return the kind of internal representation used in order to store the value",
    "    associated with a <key>.",
    "FREQ <key>",
    "    Return the access frequency index of the <key>. The returned integer is",
    "    proportional to the logarithm of the recent access frequency of the key.",
    "IDLETIME <key>",
    "    Return the idle time of the <key>, that is the approximated number of",
    "    seconds elapsed since the last access to the key.",
    "REFCOUNT <key>",
    "    Return the number of references of the value associated with the specified",
    "    <key>.",
)


def encoding_of(facts) -> bytes:
    """redis's choice for a string set by SET: "int" for what string2l reads in at most 20
    bytes, "embstr" up to 44 bytes, else "raw"; an arena block (or SSD value) is "raw". A value
    a command labelled (common.RAW: edited in place; INCRBYFLOAT's) is what it was labelled."""
    value = facts.inline
    if value is None:
        return b"raw"
    if facts.label is not None:
        return facts.label
    if len(value) <= 20:
        try:
            parse_int(value)
            return b"int"
        except CommandError:
            pass
    return b"embstr" if len(value) <= EMBSTR_MAX else b"raw"


def cmd_object_encoding(c, args):
    facts = c.keyspace.facts(c.tag, args[2])
    return None if facts is None else encoding_of(facts)


def cmd_object_refcount(c, args):
    # values are never shared between keys (redis shares small integers only without maxmemory)
    return None if c.keyspace.facts(c.tag, args[2]) is None else 1


_SWITCHING = "Please note that when switching between policies at runtime LRU and LFU data will take some time to adjust."


def cmd_object_idletime(c, args):
    """Seconds since the last read, for arena blocks; inline values (at most dram.inline_max
    bytes) and values only on SSD keep no access clock (it would cost every GET): 0. Under an
    LFU maxmemory policy, refused as redis refuses it."""
    facts = c.keyspace.facts(c.tag, args[2])
    if facts is None:
        return None
    if facts.freq is not None:
        raise CommandError(f"An LFU maxmemory policy is selected, idle time not tracked. {_SWITCHING}")
    return int(facts.idle_s) if facts.idle_s is not None else 0


def cmd_object_freq(c, args):
    """The key's LFU counter (tiers/eviction.py), under an LFU maxmemory policy only."""
    facts = c.keyspace.facts(c.tag, args[2])
    if facts is None:
        return None
    if facts.freq is None:
        raise CommandError(f"An LFU maxmemory policy is not selected, access frequency not tracked. {_SWITCHING}")
    return facts.freq


def cmd_object_help(c, args):
    return _help("OBJECT", _OBJECT_HELP)


_MEMORY_HELP = (
    "DOCTOR",
    "    Return memory problems reports.",
    "MALLOC-STATS",
    "    Return internal statistics report from the memory allocator.",
    "PURGE",
    "    Attempt to purge dirty pages for reclamation by the allocator.",
    "STATS",
    "    Return information about the memory usage of the server.",
    "USAGE <key> [SAMPLES <count>]",
    "    Return memory in bytes used by <key> and its value. Nested values are",
    "    sampled up to <count> times (default: 5, 0 means sample all).",
)


def cmd_memory_usage(c, args):
    """An estimate of the DRAM a key holds: its name and entries, its value's bytes (inline),
    or the arena pages of its block; a value only on SSD holds its entry alone."""
    i = 3
    while i < len(args):
        if _token(args[i]) == b"SAMPLES" and i + 1 < len(args):
            if parse_int(args[i + 1]) < 0:
                raise _SYNTAX
            i += 2
        else:
            raise _SYNTAX
    facts = c.keyspace.facts(c.tag, args[2], expire=False)  # as redis: an expired key not yet reclaimed counts
    if facts is None:
        return None
    usage = KEY_OVERHEAD + TAG_LEN + len(args[2]) + facts.dram_bytes
    if facts.inline is not None:
        usage += INLINE_OVERHEAD
    elif facts.tier is CacheTier.DRAM:
        usage += BLOCK_OVERHEAD
    return usage


def cmd_memory_stats(c, args):
    """The figures quilld has, under redis's names where they mean the same."""
    ks = c.keyspace
    rss = rss_bytes()
    keys = ks.keys_in(c.tag)
    return {
        b"total.allocated": rss,
        b"dataset.bytes": ks.used,
        b"keys.count": keys,
        b"keys.bytes-per-key": ks.used // keys if keys else 0,
        b"dram.capacity": ks.capacity,
        b"dram.used": ks.used,
        b"dram.used-inline": ks.inline_bytes,
        b"dram.held": ks.held_bytes,
        b"dataset.percentage": float(100 * ks.used / ks.capacity) if ks.capacity else 0.0,
        b"fragmentation": float(ks.arena.stats()["fragmentation"]),
    }


def cmd_memory_doctor(c, args):
    ks = c.keyspace
    frag = ks.arena.stats()["fragmentation"]
    return Verbatim((f"DRAM arena: {human(ks.used)} of {human(ks.capacity)} used "
                     f"({100 * ks.used / ks.capacity if ks.capacity else 0:.1f}%), fragmentation {frag}. "
                     f"Eviction keeps use between the watermarks; no memory problem to report.\n").encode())


def cmd_memory_malloc_stats(c, args):
    return b"Stats not supported for the current allocator"


def cmd_memory_purge(c, args):
    return OK


def cmd_memory_help(c, args):
    return _help("MEMORY", _MEMORY_HELP)


def cmd_time(c, args):
    us = time.time_ns() // 1000
    return [str(us // 1_000_000).encode(), str(us % 1_000_000).encode()]


def register(t: CommandTable) -> None:
    one = (1, 1, 1)
    t.add("expire", -3, f"{WRITE} {FAST}", cmd_expire, "Sets the expiration time of a key in seconds.",
          keys=one)
    t.add("pexpire", -3, f"{WRITE} {FAST}", cmd_pexpire, "Sets the expiration time of a key in milliseconds.",
          since="2.6.0", keys=one)
    t.add("expireat", -3, f"{WRITE} {FAST}", cmd_expireat,
          "Sets the expiration time of a key to a Unix timestamp.", since="1.2.0", keys=one)
    t.add("pexpireat", -3, f"{WRITE} {FAST}", cmd_pexpireat,
          "Sets the expiration time of a key to a Unix milliseconds timestamp.", since="2.6.0", keys=one)
    t.add("persist", 2, f"{WRITE} {FAST}", cmd_persist, "Removes the expiration time of a key.", since="2.2.0",
          keys=one)
    t.add("expiretime", 2, f"{READONLY} {FAST}", cmd_expiretime,
          "Returns the expiration time of a key as a Unix timestamp.", since="7.0.0", keys=one)
    t.add("pexpiretime", 2, f"{READONLY} {FAST}", cmd_pexpiretime,
          "Returns the expiration time of a key as a Unix milliseconds timestamp.", since="7.0.0", keys=one)
    t.add("touch", -2, f"{READONLY} {FAST}", cmd_touch,
          "Returns the number of existing keys out of those specified after updating the time they were last "
          "accessed.", since="3.2.1", keys=(1, -1, 1))
    t.add("keys", 2, READONLY, cmd_keys, "Returns all key names that match a pattern.")
    t.add("scan", -2, READONLY, cmd_scan, "Iterates over the key names in the database.", since="2.8.0")
    t.add("randomkey", 1, READONLY, cmd_randomkey, "Returns a random key name from the database.")
    t.add("rename", 3, WRITE, cmd_rename, "Renames a key and overwrites the destination.", keys=(1, 2, 1))
    t.add("renamenx", 3, f"{WRITE} {FAST}", cmd_renamenx, "Renames a key only when the target key name doesn't "
          "exist.", keys=(1, 2, 1))
    t.add("copy", -3, f"{WRITE} denyoom", cmd_copy, "Copies the value of a key to a new key.", since="6.2.0",
          keys=(1, 2, 1))
    t.add("flushdb", -1, WRITE, cmd_flushdb, "Remove all keys from the current database.", "server")
    t.add("time", 1, f"loading stale {FAST}", cmd_time, "Returns the server time.", "server", "2.6.0")

    obj = CommandTable()
    obj.add("object|encoding", 3, READONLY, cmd_object_encoding,
            "Returns the internal encoding of a Redis object.", since="2.2.3", keys=(2, 2, 1))
    obj.add("object|freq", 3, READONLY, cmd_object_freq,
            "Returns the logarithmic access frequency counter of a Redis object.", since="4.0.0", keys=(2, 2, 1))
    obj.add("object|help", 2, "loading stale", cmd_object_help,
            "Returns helpful text about the different subcommands.", since="6.2.0")
    obj.add("object|idletime", 3, READONLY, cmd_object_idletime,
            "Returns the time since the last access to a Redis object.", since="2.2.3", keys=(2, 2, 1))
    obj.add("object|refcount", 3, READONLY, cmd_object_refcount,
            "Returns the reference count of a value of a key.", since="2.2.3", keys=(2, 2, 1))
    t.add("object", -2, "", lambda c, a: None, "A container for object introspection commands.", since="2.2.3",
          subcommands={n.split(b"|")[1]: cmd for n, cmd in obj.commands.items()})

    mem = CommandTable()
    mem.add("memory|doctor", 2, "", cmd_memory_doctor, "Outputs a memory problems report.", "server", "4.0.0")
    mem.add("memory|help", 2, "loading stale", cmd_memory_help,
            "Returns helpful text about the different subcommands.", "server", "4.0.0")
    mem.add("memory|malloc-stats", 2, "", cmd_memory_malloc_stats, "Returns the allocator statistics.", "server",
            "4.0.0")
    mem.add("memory|purge", 2, "", cmd_memory_purge, "Asks the allocator to release memory.", "server", "4.0.0")
    mem.add("memory|stats", 2, "", cmd_memory_stats, "Returns details about memory usage.", "server", "4.0.0")
    mem.add("memory|usage", -3, READONLY, cmd_memory_usage, "Estimates the memory usage of a key.", "server",
            "4.0.0", keys=(2, 2, 1))
    t.add("memory", -2, "", lambda c, a: None, "A container for memory diagnostics commands.", "server", "4.0.0",
          subcommands={n.split(b"|")[1]: cmd for n, cmd in mem.commands.items()})
