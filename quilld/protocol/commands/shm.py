"""SHM: the shared-memory path for same-host clients (HELLO, ATTACH, GET, RELEASE, RESERVE, COMMIT).

- `SHM HELLO` (any connection, TCP too) says whether the path is open to this
  client: the unix socket's path, the host's boot id (so a client can tell it
  is on the same host), the arena's size, the lease length, and whether this
  user may map.
- `SHM ATTACH [TABLE]` (the unix socket only, users in security.map_users only) is
  answered with the DRAM arena's descriptor and the lease table's attached
  (SCM_RIGHTS): the client maps both. Both files are sealed so that nobody can
  resize them (tiers/memfd.py: a truncated arena would kill quilld with SIGBUS),
  and the lease table's descriptor is read-only; a node whose files cannot be
  sealed refuses ATTACH. With TABLE (when HELLO offered `lookup_slots`), two more
  follow: the lookup table (read-only) and its read marks (tiers/lookup_table.py),
  with the salt of this connection's identity scope: the client then finds its
  scope's blocks there and copies them without asking quilld at all.
- `SHM GET key [key ...]` answers per key nil (missing), the bytes (a value kept
  inline in the index, or one read from below DRAM that could not be brought
  back), or `[offset, length, crc32c, slot, generation]`: where the block lies in
  the arena, pinned by a lease (tiers/leases.py) until `SHM RELEASE slot ...`,
  the connection's end, or server.shm_lease_ms. On a connection attached with
  TABLE a block is put in the lookup table instead, when it can be, and the
  answer is its entry there (an integer): the client reads it as it reads any
  entry, with no lease and nothing to release. A value only on SSD is brought
  back into DRAM first (as a promoting read does) and leased like any block.
  A user's connections together hold at most its share of the lease table
  (server.shm_max_leases_per_user); past it SHM GET answers `-BUSY` and the
  client reads those keys over TCP.
  Keys are read in the connection's identity scope, exactly as GET reads them.
- `SHM RELEASE slot [slot ...]` ends leases; the number it ended.

Writes: `SHM RESERVE lease-ms key nbytes [key nbytes ...]` is PUT2PHASE BEGIN ... SHM
(LEASE lease-ms; 0: the default) for N blocks in one command (`SHM RESERVE lease-ms CHAINED key
nbytes hash parent ...`: with each block's HASH and PARENT too): per key `[handle, offset]`
(the region to write in place),
`EXISTS` (complete already) or its error; `SHM COMMIT handle crc32c [handle crc32c ...]`
commits them, each checked against its CRC32C over its whole region: per handle OK or
its error. So a batch of blocks is two commands, whatever its length (PUT2PHASE BEGIN
... SHM and COMMIT, blocks.py, still do one block each).
"""

from __future__ import annotations

import functools

import crc32c

from quilld.config import map_user_names
from quilld.errors import CommandError, NoPerm, OutOfMemory, QuillError
from quilld.model import Pending
from quilld.protocol.commands.batches import EXISTS, crc_arg
from quilld.index.route_request import parse_block_hash
from quilld.protocol.commands.common import acked, parse_int, text
from quilld.protocol.resp import OK, WithFds
from quilld.protocol.table import FAST, READONLY, WRITE, CommandTable
from quilld.tiers.block import Block
from quilld.tiers.lookup_table import PROBE as LOOKUP_PROBE
from quilld.tiers.lookup_table import VERSION as LOOKUP_VERSION

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
WITH_TABLE = 2  # Session.shm of a connection attached with the lookup table (1: without; 0: not attached)


@functools.cache
def boot_id() -> bytes:
    """This host's boot id: a client on the same host (and boot) reads the same."""
    try:
        with open(BOOT_ID_FILE, "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


_map_users = functools.cache(map_user_names)


def may_map(c) -> bool:
    """Whether this connection's user is one security.map_users names."""
    return c.user in _map_users(c.ctx.cfg.security.map_users)


def check_map(c, what: str) -> None:
    """Refuse `what` unless this connection may use the arena's memory: the user is allowed to
    map it, and the connection is over the unix socket."""
    ctx = c.ctx
    if ctx.leases is None:
        raise CommandError(f"{what} needs server.unixsocket: this node has no unix socket, so no shared memory")
    if not may_map(c):
        ctx.stats["shm_attach_refused"] += what == "SHM ATTACH"
        raise NoPerm(f"user '{c.user}' may not map the arena (security.map_users)")
    if not c.unix:
        ctx.stats["shm_attach_refused"] += what == "SHM ATTACH"
        raise CommandError(f"{what} needs a connection over the unix socket (server.unixsocket)")


def _table(ctx):
    """The lookup table a client may be handed, or None."""
    table = ctx.keyspace.lookup_table
    return table if table is not None and table.usable else None


def cmd_shm_hello(c, args):
    ctx = c.ctx
    cfg = ctx.cfg.server
    table = _table(ctx) if ctx.leases is not None else None
    return {b"unixsocket": cfg.unixsocket.encode() if ctx.leases is not None else b"",
            b"boot_id": boot_id(), b"arena_bytes": ctx.keyspace.capacity if c.keyspace is ctx.keyspace else 0,
            b"lease_ms": cfg.shm_lease_ms, b"may_map": 1 if may_map(c) and ctx.leases is not None else 0,
            b"lookup_slots": table.slots if table is not None else 0}


def cmd_shm_attach(c, args):
    if len(args) > 3 or (len(args) == 3 and bytes(args[2]).upper() != b"TABLE"):
        raise CommandError("syntax error: SHM ATTACH [TABLE]")
    check_map(c, "SHM ATTACH")
    ctx = c.ctx
    ks, leases = ctx.keyspace, ctx.leases
    if not (ks.arena.sealed and leases.sealed):  # a file a client could truncate under us: never handed out
        ctx.stats["shm_attach_refused"] += 1
        raise CommandError("SHM ATTACH needs memory files sealed against resizing (an anonymous arena, on Linux "
                           "5.1 or later): this node's cannot be, so it maps nothing out")
    reply = {b"arena_bytes": ks.capacity, b"lease_slots": leases.slots,
             b"lease_ms": ctx.cfg.server.shm_lease_ms, b"boot_id": boot_id()}
    fds: tuple = (ks.arena.fd, leases.shared_fd)
    table = _table(ctx) if len(args) == 3 else None
    salt = table.salt(c.tag) if table is not None else None
    if salt is not None and c.keyspace is ks:
        reply.update({b"lookup_version": LOOKUP_VERSION, b"lookup_slots": table.slots,
                      b"lookup_probe": LOOKUP_PROBE, b"lookup_salt": salt})
        fds += (table.shared_fd, table.marks_fd)
    c.shm = WITH_TABLE if len(fds) == 4 else 1
    ctx.stats["shm_attaches"] += 1
    return WithFds(reply, fds)


def _lease(c, block: Block, key) -> list | int:
    """[offset, length, crc32c, slot, generation] of `block`, pinned by a new lease; on a connection
    attached with the lookup table, its entry there instead when it can be put there (no lease)."""
    ks = c.keyspace
    if block.crc is None:  # published blocks never change: computed once, served many times
        block.crc = crc32c.crc32c(ks.view(block))
    if c.shm == WITH_TABLE:
        entry = ks.lookup_table.add(c.tag + key, block)
        if entry >= 0:
            return entry
    slot, gen = c.ctx.leases.grant(c.id, block, c.user)
    return [ks.arena.offset(block.handle), block.length, block.crc, slot, gen]


def cmd_shm_get(c, args):
    check_map(c, "SHM GET")
    ks, tag = c.keyspace, c.tag
    out: list = []
    later: list[int] = []  # keys to read below DRAM or from the pool
    granted: list[int] = []
    try:
        for i, key in enumerate(args[2:]):
            value = ks.lookup(tag, key)
            t = value.__class__
            if t is Block:
                item = _lease(c, value, key)
                if item.__class__ is list:
                    granted.append(item[3])
                out.append(item)
            elif t is bytes:
                out.append(value)
            elif value is None and c.ctx.cluster is None:
                out.append(None)
            else:  # only below DRAM, or a local miss that the pool may have
                out.append(None)
                later.append(i)
    except BaseException:
        _unlease(c, granted)
        raise
    if not later:
        return out
    return Pending(_fill(c, args[2:], out, later, granted))


def _unlease(c, slots: list[int]) -> None:
    leases = c.ctx.leases
    for slot in slots:
        leases.release(c.id, slot)


async def _fill(c, keys: list, out: list, later: list[int], granted: list[int]) -> list:
    """SHM GET's keys that are not in DRAM: brought back from below DRAM (or read from the pool),
    then leased as any block; bytes when they cannot be brought back."""
    ctx, ks, tag = c.ctx, c.keyspace, c.tag
    try:
        for i in later:
            key = bytes(keys[i])
            if ks.below_only(tag, key):
                try:
                    await ks.bring_back(tag, key, ctx.space_freed)
                except OutOfMemory:  # DRAM is full of what cannot go yet: the bytes instead
                    pending = ks.get(tag, key)
                    value = await pending.awaitable if pending.__class__ is Pending else pending
                    out[i] = _settled(value)
                    continue
            elif ctx.cluster is not None and ctx.cluster.pool_reads and ctx.cluster.addresses:
                _settled(await ctx.cluster.pool_read(c.scope, tag, key))  # a copy kept here, or the bytes
            value = ks.lookup(tag, key)
            if value.__class__ is Block:
                item = _lease(c, value, key)
                if item.__class__ is list:
                    granted.append(item[3])
                out[i] = item
            elif value.__class__ is bytes or value is None:
                out[i] = value
            else:  # still below DRAM (deleted and written again meanwhile, say): its bytes
                pending = ks.get(tag, key)
                out[i] = _settled(await pending.awaitable if pending.__class__ is Pending else pending)
    except BaseException:
        _unlease(c, granted)
        raise
    if c.id not in ctx.clients.sessions:  # the connection closed while we read: nobody will release these
        _unlease(c, granted)
    return out


def _settled(value):
    """A read's value as plain bytes (a Pinned view is copied and released) or None."""
    if value is None or value.__class__ is bytes:
        return value
    view = getattr(value, "view", None)
    if view is not None:
        try:
            return bytes(view)
        finally:
            value.release()
    return bytes(value)


def cmd_shm_release(c, args):
    leases = c.ctx.leases
    if leases is None:
        return 0
    slots = [parse_int(a) for a in args[2:]]
    return sum(1 for slot in slots if leases.release(c.id, slot))


def cmd_shm_reserve(c, args):
    """RESERVE lease-ms key nbytes [key nbytes ...]: per key [handle, offset], EXISTS or its error
    (lease-ms 0: blocks.default_lease_ms). When the first key cannot have its space (-OOM) the
    command fails as a whole, so that the server runs it again once space is freed (as a lone
    BEGIN); a later key's -OOM is its own item (the client puts it in its next round, once these
    are committed).

    `RESERVE lease-ms CHAINED key nbytes hash parent [...]` also names each block's engine hash
    and the hash of the block before it in its chain (empty: none), as PUT2PHASE BEGIN's HASH and
    PARENT do, so ROUTE credits the copies. The two forms differ in arity (pairs after the lease,
    or CHAINED and quads), so a key named CHAINED is never taken for the flag."""
    chained = len(args) % 4 == 0 and len(args) > 4 and bytes(args[3]).upper() == b"CHAINED"
    if not chained and len(args) % 2 == 0:
        raise CommandError("wrong number of arguments for 'shm|reserve' command")
    check_map(c, "SHM RESERVE")
    lease = parse_int(args[2]) or None
    limit = c.ctx.cfg.server.proto_max_bulk_len
    first, step = (4, 4) if chained else (3, 2)
    sizes = [parse_int(args[i + 1]) for i in range(first, len(args), step)]
    if any(not 0 <= n <= limit for n in sizes):
        raise CommandError(f"block size must be within 0..{limit} bytes")
    hashes: list = [None] * len(sizes)
    parents: list = [None] * len(sizes)
    if chained:
        cluster = c.ctx.cluster
        for n, i in enumerate(range(first, len(args), step)):
            hashes[n] = parse_block_hash(text(args[i + 2]))
            if len(args[i + 3]):
                parents[n] = parent = parse_block_hash(text(args[i + 3]))
                if cluster is not None:
                    cluster.link.note_parent(c.tag, hashes[n], parent)
    puts, tag, user = c.puts, c.tag, c.user
    out: list = []
    for n, i in enumerate(range(first, len(args), step)):
        try:
            handle = puts.begin(tag, bytes(args[i]), user, sizes[n], lease, hashes[n], in_place=True,
                                parent=parents[n])
        except OutOfMemory:
            if not out:
                raise
            out.append(OutOfMemory("command not allowed when used memory > 'maxmemory'."))
            continue
        except QuillError as e:
            out.append(e)
            continue
        out.append(EXISTS if handle is None else [handle, puts.region(puts.open[handle])])
    return out


def cmd_shm_commit(c, args):
    """COMMIT handle crc32c [handle crc32c ...]: per handle OK or its error (one put's error does not
    stop the others; a put refused by its CRC32C stays open, as PUT2PHASE COMMIT leaves it)."""
    if len(args) % 2:
        raise CommandError("wrong number of arguments for 'shm|commit' command")
    crcs = [crc_arg(args[i]) for i in range(3, len(args), 2)]
    puts, user = c.puts, c.user
    out: list = []
    for n, i in enumerate(range(2, len(args), 2)):
        try:
            put = puts.get(bytes(args[i]), user)
            if not put.in_place:
                raise CommandError("SHM COMMIT commits puts written in place (SHM RESERVE, PUT2PHASE BEGIN ... SHM)")
            puts.commit(put, crcs[n])
            out.append(OK)
        except QuillError as e:
            out.append(e)
    store = c.keyspace
    return acked(store, out) if store.unsynced else out  # over values on SSD: once their deletion is durable


def register(t: CommandTable) -> None:
    sub = CommandTable()
    sub.add("shm|hello", 2, FAST, cmd_shm_hello)
    sub.add("shm|attach", -2, "", cmd_shm_attach)
    sub.add("shm|get", -3, f"{READONLY} {FAST}", cmd_shm_get)
    sub.add("shm|release", -3, FAST, cmd_shm_release)
    sub.add("shm|reserve", -5, WRITE, cmd_shm_reserve)
    sub.add("shm|commit", -4, WRITE, cmd_shm_commit)
    t.add("shm", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: cmd for n, cmd in sub.commands.items()})
