"""Block commands: PUT2PHASE, GETBLK, LOCATE; and where large payloads land.

`large_target` decides where a large bulk argument is received while it is
still on the wire: a SET/MSET value, a PUT2PHASE PUT block or each block of an
MPUTBLK (batches.py) into a freshly reserved arena block, a PUT2PHASE DATA
payload into its put's block at its offset, one longer than its command's
declared `arg_limit` nowhere (dropped as it arrives, the command answered with
an error), anything else into a plain buffer. `release_args` gives back
whatever a command did not consume (and everything, when the connection drops
mid-payload).
"""

from __future__ import annotations

import re

from quilld.errors import CommandError, NoAuth, NoHandle
from quilld.index.route_request import parse_block_hash
from quilld.model import CacheTier, Pending
from quilld.protocol.commands.batches import is_block_arg
from quilld.protocol.commands.common import acked, parse_int, text
from quilld.protocol.commands.shm import check_map
from quilld.protocol.resp import OK, Status
from quilld.protocol.table import FAST, READONLY, WRITE, CommandTable
from quilld.tiers.block import Block
from quilld.tiers.puts import IntoBlock

EXISTS = Status(b"EXISTS")


def large_target(c, args: list, index: int, length: int):
    """(object standing for the argument, writable view to receive it into), or None.

    None: the argument is an ordinary one, received by the parser as its bytes
    arrive (memory grows with what is sent, never with what a header claims).
    Raising a QuillError makes the payload be read and dropped, and the
    command answered with that error.
    """
    name = bytes(args[0]).lower() if args else b""
    if not c.authenticated:  # nothing reaches the arena before AUTH
        if name in (b"set", b"mset", b"put2phase", b"mputblk"):
            raise NoAuth("Authentication required.")
        return None  # the table answers as redis does (an unknown command, AUTH itself)
    cmd = c.ctx.table.lookup(name)
    if cmd is not None and cmd.arg_limit and length > cmd.arg_limit:  # the row's declared limit
        raise CommandError(f"{cmd.name.upper()}: an argument is at most {cmd.arg_limit} bytes, this one is "
                           f"{length}: refused before it was read")
    if (name == b"set" and index == 2) or (name == b"mset" and index % 2 == 0):
        block = c.keyspace.reserve(length, c.user)
        return block, c.keyspace.write_view(block)
    if (name == b"put2phase" and index == 5 and bytes(args[1]).upper() == b"PUT") or (
            name == b"mputblk" and is_block_arg(index)):
        if c.keyspace.contains(c.tag, bytes(args[index - 3 if name == b"put2phase" else index - 2])):
            return None  # complete already: the payload only passes through (answered EXISTS)
        block = c.keyspace.reserve(length, c.user)
        return block, c.keyspace.write_view(block)
    if name == b"put2phase" and index == 4 and bytes(args[1]).upper() == b"DATA":
        if c.multi is not None:
            return None  # refused at queue time (never queued): nothing lands in the put
        put = c.puts.get(bytes(args[2]), c.user)
        offset = parse_int(args[3])
        view = c.puts.open_writer(put, offset, length)
        return IntoBlock(put, offset, length), view
    return None


def release_args(c, args: list) -> None:
    """Give back reservations a command left unconsumed (or a dropped connection left)."""
    for a in args:
        t = type(a)
        if t is Block and a.unpublished:
            c.keyspace.discard(a)
        elif t is IntoBlock and a.put is not None:
            c.puts.close_writer(a, complete=False)
            a.put = None


def _put2phase_begin(c, args):
    if not 4 <= len(args) <= 13:
        raise CommandError("wrong number of arguments for 'put2phase|begin' command")
    nbytes = parse_int(args[3])
    if nbytes < 0 or nbytes > c.ctx.cfg.server.proto_max_bulk_len:
        raise CommandError(f"block size must be within 0..{c.ctx.cfg.server.proto_max_bulk_len} bytes")
    lease = bhash = handle = parent = None
    in_place = False
    i = 4
    while i < len(args):
        opt = bytes(args[i]).upper()
        if opt == b"SHM" and not in_place:  # written in place through the client's mapping (commands/shm.py)
            in_place = True
            i += 1
            continue
        if i + 1 >= len(args):
            raise CommandError("syntax error")
        if opt == b"LEASE" and lease is None:
            lease = parse_int(args[i + 1])
        elif opt == b"HASH" and bhash is None:
            bhash = parse_block_hash(text(args[i + 1]))
        elif opt == b"PARENT" and parent is None:  # the block before it in its chain (the directory's segment)
            parent = parse_block_hash(text(args[i + 1]))
        elif opt == b"HANDLE" and handle is None:  # chosen by the client: DATA and COMMIT pipelined behind
            handle = bytes(args[i + 1])
        else:
            raise CommandError("syntax error")
        i += 2
    if in_place:
        check_map(c, "PUT2PHASE BEGIN ... SHM")
    if parent is not None:
        if bhash is None:
            raise CommandError("PUT2PHASE BEGIN: PARENT names the block before HASH's; give HASH too")
        cluster = c.ctx.cluster
        if cluster is not None:
            cluster.link.note_parent(c.tag, bhash, parent)
    puts = c.puts
    handle = puts.begin(c.tag, bytes(args[2]), c.user, nbytes, lease, bhash, in_place, handle, parent=parent)
    if handle is None:
        return EXISTS
    return [handle, puts.region(puts.open[handle])] if in_place else handle


def _put2phase_data(c, args):
    """DATA handle offset bytes [CRC32C crc]: with the CRC, the put is committed right after
    (DATA and COMMIT in one command, for a block sent whole)."""
    if len(args) not in (5, 7):
        raise CommandError("wrong number of arguments for 'put2phase|data' command")
    crc = _crc_option(args, 5)
    payload = args[4]
    puts = c.puts
    if type(payload) is IntoBlock:
        put, dead = payload.put, payload.put.dead
        puts.close_writer(payload, complete=True)
        payload.put = None
        if dead:
            raise NoHandle("PUT2PHASE handle expired or was aborted while its DATA was arriving")
    else:
        put = puts.get(bytes(args[2]), c.user)
        puts.write(put, parse_int(args[3]), payload)
    if crc is None:
        return OK
    puts.commit(puts.get(put.handle, c.user), crc)
    store = c.keyspace
    return acked(store, OK) if store.unsynced else OK


def _crc_option(args, i: int) -> int | None:
    """`CRC32C crc` at args[i], or None when the command ends before it."""
    if len(args) <= i:
        return None
    if bytes(args[i]).upper() != b"CRC32C":
        raise CommandError("syntax error")
    crc = parse_int(args[i + 1])
    if not 0 <= crc < 1 << 32:
        raise CommandError("CRC32C must be an unsigned 32-bit integer")
    return crc


def _put2phase_commit(c, args):
    if len(args) not in (3, 5):
        raise CommandError("wrong number of arguments for 'put2phase|commit' command")
    crc = _crc_option(args, 3)
    puts = c.puts
    puts.commit(puts.get(bytes(args[2]), c.user), crc)
    store = c.keyspace
    return acked(store, OK) if store.unsynced else OK  # over a value on SSD: once its deletion is durable


def _put2phase_put(c, args):
    """PUT key CRC32C crc bytes: BEGIN, DATA and COMMIT of a whole block in one command."""
    if len(args) != 6:
        raise CommandError("wrong number of arguments for 'put2phase|put' command")
    crc = _crc_option(args, 3)
    if not c.puts.put_whole(c.tag, bytes(args[2]), c.user, args[5], crc):
        return EXISTS  # the block received for it, if any, is given back by release_args
    store = c.keyspace
    return acked(store, OK) if store.unsynced else OK


def _put2phase_abort(c, args):
    if len(args) != 3:
        raise CommandError("wrong number of arguments for 'put2phase|abort' command")
    puts = c.puts
    puts.abort(puts.get(bytes(args[2]), c.user))
    return OK


_PHASES = {b"BEGIN": _put2phase_begin, b"DATA": _put2phase_data,
           b"COMMIT": _put2phase_commit, b"ABORT": _put2phase_abort, b"PUT": _put2phase_put}


def cmd_put2phase(c, args):
    phase = _PHASES.get(bytes(args[1]).upper())
    if phase is None:
        raise CommandError(f"unknown PUT2PHASE phase '{text(args[1])}' (expected BEGIN, DATA, COMMIT, ABORT or PUT)")
    return phase(c, args)


def cmd_getblk(c, args):
    if len(args) > 3:
        raise CommandError("wrong number of arguments for 'getblk' command")
    if len(args) == 3 and bytes(args[2]).upper() != b"LOCAL":
        raise CommandError("syntax error")
    value = c.keyspace.get(c.tag, args[1])
    cluster = c.ctx.cluster
    if value is None and cluster is not None and len(args) == 2:
        return Pending(cluster.fetch(c.scope, c.tag, bytes(args[1])))
    return value


def _engine_hash(key: bytes) -> int | bytes:
    """A LOCATE key as an engine block hash: decimal digits are an int hash, else raw bytes."""
    k = bytes(key)
    if _INT_HASH.fullmatch(k):
        value = int(k)
        if -(1 << 63) <= value < 1 << 64:
            return value
    return k


_INT_HASH = re.compile(rb"-?[0-9]{1,20}")


def _place(node: str, tier: CacheTier, nbytes: int | None = None, last_ms: int | None = None) -> dict:
    return {b"node": node.encode(), b"tier": tier.value.encode(), b"bytes": nbytes, b"last_access_ms": last_ms}


def cmd_locate(c, args):
    """LOCATE key [key ...]: this node's copies, the other nodes' (the directory's word, with their
    bytes; in a cluster a deferred reply when an owner is elsewhere), then the engines' (a key
    that is a block hash)."""
    ks, node_id, index, cluster = c.keyspace, c.ctx.node_id, c.control.index, c.ctx.cluster
    own = [[_place(node_id, tier, nbytes, last) for tier, nbytes, last in ks.places(c.tag, key)] for key in args[1:]]
    engines = [[_place(holder, tier) for holder, tier in index.locate(c.tag, [_engine_hash(key)])[0]]
               for key in args[1:]]
    if cluster is None:
        return [a + b for a, b in zip(own, engines)]
    tag, keys = c.tag, [bytes(k) for k in args[1:]]

    async def with_peers():
        peers = await cluster.locate(tag, keys)
        return [a + [_place(h, t, n) for h, t, n in p] + b for a, p, b in zip(own, peers, engines)]

    return Pending(with_peers())


def register(t: CommandTable) -> None:
    t.add("put2phase", -3, WRITE, cmd_put2phase,
          "Two-phase block put: BEGIN key nbytes [LEASE ms] [HASH blockhash] [SHM] [HANDLE h] | DATA handle offset bytes [CRC32C crc] (then COMMIT) | "
          "COMMIT handle [CRC32C crc] | ABORT handle | PUT key CRC32C crc bytes (all three at once).", "quillcache", "0.1.0")
    t.add("getblk", -2, f"{READONLY} {FAST}", cmd_getblk, "Returns a block's bytes: GETBLK key [LOCAL].",
          "quillcache", "0.1.0", keys=(1, 1, 1))
    t.add("locate", -2, f"{READONLY} {FAST}", cmd_locate, "Lists every residency of each key in the caller's scope.",
          "quillcache", "0.1.0", keys=(1, -1, 1))

