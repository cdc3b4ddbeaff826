"""Small helpers shared by the command families."""

from __future__ import annotations

from quilld.errors import CommandError
from quilld.model import Pending, Pinned
from quilld.protocol.resp import _parse_len as _strict_int

_NOT_INT = "value is not an integer or out of range"
EMBSTR_MAX = 44  # OBJ_ENCODING_EMBSTR_SIZE_LIMIT: redis keeps shorter strings in one allocation
# OBJECT ENCODING of a string redis changed in place (APPEND, SETRANGE, SETBIT, BITFIELD: its
# dbUnshareStringValue) or built as a raw one (BITOP), whatever its bytes: the keyspace's label
RAW = b"raw"


def float_encoding(text: bytes) -> bytes:
    """OBJECT ENCODING of INCRBYFLOAT's result: redis makes a string of it, never an integer."""
    return b"embstr" if len(text) <= EMBSTR_MAX else RAW


def parse_int(raw: bytes, message: str = _NOT_INT) -> int:
    """A strict signed 64-bit integer, as redis's string2ll; ERR otherwise."""
    value = _strict_int(bytes(raw)) if raw else None
    if value is None or not -(1 << 63) <= value < (1 << 63) or (raw[:2] == b"-0") or (
            len(raw) > 1 and raw[:1] == b"0"):
        raise CommandError(message)
    return value


def settle(replies: list):
    """An array reply whose items may be deferred (MGET of SSD blocks): one deferred reply."""
    if not any(type(r) is Pending for r in replies):
        return replies

    async def gather():
        out = []
        for r in replies:
            out.append(await r.awaitable if type(r) is Pending else r)
        return out

    return Pending(gather())


def pool_get(c, key: bytes):
    """GET's local miss on a node in a cluster: the pool's copy, read into this node (a deferred
    reply), unless cluster.pool_reads is off; None when no peer has it."""
    cluster = c.ctx.cluster
    if not (cluster.pool_reads and cluster.addresses):  # off, or no peer to ask
        return None
    return Pending(cluster.pool_read(c.scope, c.tag, bytes(key)))


def pool_mget(c, keys: list, values: list):
    """MGET's reply when some keys missed locally on a node in a cluster: the misses are read from
    the pool all at once (cluster.pool_reads), then the reply settles as a local one does."""
    cluster = c.ctx.cluster
    if not (cluster.pool_reads and cluster.addresses):
        return settle(values)
    misses = [i for i, v in enumerate(values) if v is None]

    async def fill():
        got = await cluster.pool_read_many(c.scope, c.tag, [bytes(keys[i]) for i in misses])
        for i, value in zip(misses, got):
            values[i] = value
        reply = settle(values)
        return await reply.awaitable if reply.__class__ is Pending else reply

    return Pending(fill())


def pool_exists(c, found: int, missing: list):
    """EXISTS's count when some keys missed locally on a node in a cluster: those a peer holds count
    too (the directory's word: no transfer), unless cluster.pool_reads is off."""
    cluster = c.ctx.cluster
    if not (cluster.pool_reads and cluster.addresses):
        return found

    async def count():
        held = await cluster.pool_has_many(c.tag, [bytes(k) for k in missing])
        return found + sum(held)

    return Pending(count())


def pool_delete(c, found: int, missing: list):
    """DEL's count when some keys missed locally on a node in a cluster: those a peer holds are
    deleted there too (a tombstone each) and counted, unless cluster.pool_reads is off."""
    cluster = c.ctx.cluster
    if not (cluster.pool_reads and cluster.addresses):
        return found

    async def count():
        return found + await cluster.pool_delete(c.tag, [bytes(k) for k in missing])

    return Pending(count())


def text(raw: bytes) -> str:
    return bytes(raw).decode("utf-8", "surrogateescape")


def acked(store, reply):
    """`reply`, or when the storage calls just made released a copy on a lower tier (an
    overwrite or delete of a value on SSD), a Pending of it that resolves only once that
    deletion is durable: an acknowledged DEL or overwrite never comes back after a crash."""
    wait = store.take_unsynced()
    if wait is None:
        return reply
    return Pending(_after(wait, reply))


async def _after(wait, reply):
    value = await reply.awaitable if reply.__class__ is Pending else reply  # SET ... GET of an SSD value
    try:
        await wait
    except BaseException:
        if value.__class__ is Pinned:
            value.release()
        raise
    return value
