"""put_blocks over TCP: many blocks, pipelined on one raw socket, every CRC32C checked by quilld.

A round groups blocks up to `put_round_bytes`. The cost to cut is quilld's work per command
(parsing, dispatch, a reply), so each block takes as few commands as its guarantees allow, sent
back to back in `sendmsg` windows of `_WINDOW` commands (the blocks are the caller's memory,
never copied or joined), the window's replies read before the next one goes:

- a round of at most `chunk_size` bytes: one `MPUTBLK key crc32c bytes [key crc32c bytes ...]`
  for the whole round (BEGIN, DATA and COMMIT of every block at once, one command for quilld to
  dispatch: quilld/protocol/commands/batches.py). `+EXISTS` means the key is already complete:
  that block is skipped (reported as not stored);
- a larger round whose blocks are each at most `chunk_size`: first BEGIN for every block,
  pipelined (the space for the whole round is reserved before any byte goes: a reservation that
  fails stores nothing of the round), then one `PUT2PHASE DATA handle 0 bytes CRC32C crc` per
  block (its bytes, then its COMMIT);
- a round with a larger block: BEGINs, then each block cut into `chunk_size` pieces spread over
  `parallelism` lanes (threads pipelining on pooled connections, CRCs computed meanwhile), then
  COMMIT with the CRC32C, pipelined.

The server checks every byte arrived and the checksum, then publishes each block whole. On any
failure the round's handles still open are aborted (best effort; a handle nobody aborts is
reclaimed when its lease runs out) and the first error is raised. Blocks committed in earlier
rounds stay, and so do the blocks of an MPUTBLK round that quilld stored beside a block it refused
(a wrong CRC32C, say: per block, one's error does not stop the others).

A lost connection in a pipeline leaves unknown what went through: the keys now present count as
stored, the rest go the long way (BEGIN for each first, then DATA and COMMIT).
DATA is idempotent and retried after a lost connection like any read. BEGIN is
retried too: a reply lost with the connection leaves a reservation behind until
its lease runs out (`lease_ms`). A COMMIT whose reply was lost is re-sent; if the
handle is gone by then (the first one went through), the key's existence decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import crc32c
from quillwire.encode import as_readable, pack_command
from quillwire.reply import Bulk, ReplyError, Status

from quillclient.errors import (
    NoHandle,
    ProtocolError,
    QuillConnectionError,
    QuillError,
    QuillTimeout,
    from_wire,
)

if TYPE_CHECKING:
    from quillclient.client import QuillClient

_MAX_PIPELINE = 128  # DATA commands per round trip within a lane
_WINDOW = 128  # puts sent before their replies are read: those replies (under ~150 bytes a put,
#                an error's text included) always fit the socket buffers, so neither side can stall


def _is_exists(reply: Any) -> bool:
    return reply in (b"EXISTS", "EXISTS")


def _is_ok(reply: Any) -> bool:
    return reply in (b"OK", "OK", True)


def _rounds(sizes: list[int], round_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) groups of at most round_bytes each (a larger block goes alone)."""
    out, lo, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > lo and total + n > round_bytes:
            out.append((lo, i))
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def _lanes(pieces: list[tuple[bytes, int, memoryview]], lanes: int) -> list[list]:
    """Spread pieces over lanes, largest first, each to the lane with the fewest bytes."""
    load = [0] * lanes
    out: list[list] = [[] for _ in range(lanes)]
    for piece in sorted(pieces, key=lambda p: -p[2].nbytes):
        j = load.index(min(load))
        out[j].append(piece)
        load[j] += piece[2].nbytes
    return [lane for lane in out if lane]


def _batches(lane: list[tuple[bytes, int, memoryview]], chunk_size: int) -> list[list]:
    """A lane's pieces as pipelines of about chunk_size bytes (or _MAX_PIPELINE commands)."""
    out, cur, size = [], [], 0
    for piece in lane:
        if cur and (size + piece[2].nbytes > chunk_size or len(cur) >= _MAX_PIPELINE):
            out.append(cur)
            cur, size = [], 0
        cur.append(piece)
        size += piece[2].nbytes
    if cur:
        out.append(cur)
    return out


def put_blocks(client: QuillClient, items: Iterable | Mapping, chunk_size: int, parallelism: int,
               round_bytes: int, lease_ms: int | None, hashes: list[tuple[Any, Any]] | None = None) -> list[bool]:
    pairs = items.items() if isinstance(items, Mapping) else items
    blocks = [(key, as_readable(data)) for key, data in pairs]
    stored = [False] * len(blocks)
    for lo, hi in _rounds([v.nbytes for _, v in blocks], round_bytes):
        _put_round(client, blocks, lo, hi, stored, chunk_size, parallelism, lease_ms, hashes)
    return stored


def _chain(hashes: list[tuple[Any, Any]] | None, i: int) -> tuple:
    """BEGIN's HASH and PARENT options for block `i`."""
    if hashes is None:
        return ()
    h, parent = hashes[i]
    return ("HASH", h) if parent is None else ("HASH", h, "PARENT", parent)


def _put_round(client: QuillClient, blocks: list, lo: int, hi: int, stored: list[bool], chunk_size: int,
               parallelism: int, lease_ms: int | None, hashes: list[tuple[Any, Any]] | None = None) -> None:
    # MPUTBLK names no engine hashes: blocks that carry them always BEGIN
    if (hashes is None and sum(blocks[i][1].nbytes for i in range(lo, hi)) <= chunk_size
            and _put_whole(client, blocks, lo, hi, stored)):
        return
    lease = ("LEASE", lease_ms) if lease_ms is not None else ()
    begins = [("PUT2PHASE", "BEGIN", blocks[i][0], blocks[i][1].nbytes, *lease, *_chain(hashes, i))
              for i in range(lo, hi)]
    try:
        replies = _raw_pipeline(client, begins, take_bulks=True)
    except QuillConnectionError:  # BEGIN again, with redis-py's retries (a lost reply's space is leased)
        replies = client._pipeline(begins)
    handles: dict[int, bytes] = {}
    error: Exception | None = None
    for i, reply in zip(range(lo, hi), replies):
        if isinstance(reply, Exception):
            error = error or reply
        elif not _is_exists(reply):
            handles[i] = reply
    if error is not None:
        _abort(client, handles.values())
        raise error
    if not handles:
        return
    if all(blocks[i][1].nbytes <= chunk_size for i in handles):
        _put_small(client, blocks, handles, stored, chunk_size, parallelism)
        return
    try:
        crcs = _send_data(client, blocks, handles, chunk_size, parallelism)
    except BaseException:
        _abort(client, handles.values())
        raise
    _commit(client, blocks, handles, crcs, stored)


def _put_whole(client: QuillClient, blocks: list, lo: int, hi: int, stored: list[bool]) -> bool:
    """A round of at most chunk_size bytes as ONE `MPUTBLK key crc32c bytes [key crc32c bytes ...]`:
    every block received by quilld straight into its own arena block, each checked against its
    CRC32C and published whole, one command to dispatch and one reply for the whole round (the
    blocks are the caller's memory, sent with `sendmsg`, never copied or joined). Per block `+OK`,
    `+EXISTS` (the key was complete already: not stored) or its error; a reservation that fails
    while the command is received fails it whole, before anything of the round is stored.

    False when the connection was lost on the way (what went through is unknown): the keys now
    present count as stored, and the caller goes the long way for the rest.
    """
    order = list(range(lo, hi))
    args = [arg for i in order for arg in (blocks[i][0], crc32c.crc32c(blocks[i][1]), blocks[i][1])]

    def request(conn) -> list:
        conn.send(pack_command("MPUTBLK", *args))
        reply = conn.next_event()
        if isinstance(reply, ReplyError):
            raise from_wire(reply.message)
        if type(reply) is not list or len(reply) != len(order):
            raise ProtocolError(f"unexpected reply to MPUTBLK: {reply!r:.60}")
        return [from_wire(r.message) if isinstance(r, ReplyError) else r for r in reply]

    try:
        replies = _on_raw_socket(client, request)
    except QuillConnectionError:
        for i in order:
            stored[i] = client.exists(blocks[i][0])
        return all(stored[i] for i in order)
    error: Exception | None = None
    for i, reply in zip(order, replies):
        if isinstance(reply, Exception):
            error = error or reply
        elif not _is_exists(reply):
            stored[i] = True
    if error is not None:
        raise error
    return True


def _raw_pipeline(client: QuillClient, commands: list[tuple], take_bulks: bool = False) -> list:
    """Replies to `commands` (errors as exception objects), pipelined on one raw socket, never
    retried: `_WINDOW` commands packed into one `sendmsg` batch (large arguments stay the caller's
    memory), then their replies read, then the next window."""

    def request(conn) -> list:
        out = []
        for w in range(0, len(commands), _WINDOW):
            part = commands[w:w + _WINDOW]
            conn.send([piece for cmd in part for piece in pack_command(*cmd)])
            out += [_reply(conn, take_bulks) for _ in part]
        return out

    return _on_raw_socket(client, request)


def _reply(conn, take_bulk: bool = False) -> Any:
    """The next reply on a raw socket: a status as bytes, a bulk as bytes (`take_bulk`: BEGIN's
    handle) or else dropped, a server error as its typed exception object."""
    event = conn.next_event()
    if type(event) is Bulk:
        if event.depth:
            raise ProtocolError(f"unexpected array reply in a put pipeline: {event!r:.60}")
        if take_bulk and event.length <= 64:
            conn.reader.take()
            return bytes(conn.next_event())
        conn.skip_payload()
        return b"BULK"
    if type(event) is Status:
        return bytes(event)
    if isinstance(event, ReplyError):
        return from_wire(event.message)
    raise ProtocolError(f"unexpected reply in a put pipeline: {event!r:.60}")


def _on_raw_socket(client: QuillClient, request):
    """`request` on a pooled raw socket, never retried (a put pipeline is not idempotent)."""
    pool = client._raw
    conn = pool.acquire()
    try:
        result = request(conn)
    except ProtocolError:
        conn.close()
        raise
    except (BlockingIOError, TimeoutError) as e:  # SO_RCVTIMEO/SO_SNDTIMEO give EAGAIN
        conn.close()
        raise QuillTimeout(f"no reply within socket_timeout={client.config.socket_timeout}s") from e
    except OSError as e:
        conn.close()
        pool.reset()  # the other idle sockets likely point at the same dead server
        raise QuillConnectionError(f"connection to {client.config.host}:{client.config.port} lost: {e}") from e
    except BaseException:
        conn.close()  # e.g. KeyboardInterrupt mid-pipeline: the socket's state is unknown
        raise
    pool.release(conn)
    return result


def _put_small(client: QuillClient, blocks: list, handles: dict[int, bytes], stored: list[bool],
               chunk_size: int, parallelism: int) -> None:
    """A round of blocks of at most chunk_size each: one `PUT2PHASE DATA handle 0 bytes CRC32C crc` per
    block (its whole bytes, then its COMMIT), pipelined on one raw socket, on this thread. If the
    connection is lost, which COMMITs went through is unknown: keys now present count as stored, the
    others go the long way (DATA again, then COMMIT).
    """
    order = list(handles)
    crcs = {i: crc32c.crc32c(blocks[i][1]) for i in order}
    commands = [("PUT2PHASE", "DATA", handles[i], 0, blocks[i][1], "CRC32C", crcs[i]) if blocks[i][1].nbytes
                else ("PUT2PHASE", "COMMIT", handles[i], "CRC32C", crcs[i]) for i in order]
    try:
        replies = _raw_pipeline(client, commands)
    except QuillConnectionError:
        pending = {}
        for i in order:
            if client.exists(blocks[i][0]):
                stored[i] = True
            else:
                pending[i] = handles[i]
        _abort(client, [handles[i] for i in order if stored[i]])  # committed already: NOHANDLE, ignored
        try:
            _send_data(client, blocks, pending, chunk_size, parallelism)
        except BaseException:
            _abort(client, pending.values())
            raise
        _commit(client, blocks, pending, crcs, stored)
        return
    _settle(client, order, handles, replies, stored, None)


def _send_data(client: QuillClient, blocks: list, handles: dict[int, bytes], chunk_size: int,
               parallelism: int) -> dict[int, int]:
    pieces = [(handle, off, blocks[i][1][off:off + chunk_size])
              for i, handle in handles.items() for off in range(0, blocks[i][1].nbytes, chunk_size)]
    executor = client._executor_for_puts()
    lane_futures: list[Future] = [executor.submit(_send_lane, client, _batches(lane, chunk_size))
                                  for lane in _lanes(pieces, parallelism)]
    crc_futures = {i: executor.submit(crc32c.crc32c, blocks[i][1]) for i in handles}
    error: BaseException | None = None
    for f in lane_futures:  # wait for all of them before the caller may abort
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        for f in crc_futures.values():
            f.cancel()
        raise error
    return {i: f.result() for i, f in crc_futures.items()}


def _send_lane(client: QuillClient, batches: list[list]) -> None:
    for batch in batches:
        replies = client._pipeline([("PUT2PHASE", "DATA", handle, off, view) for handle, off, view in batch])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            if not _is_ok(reply):
                raise QuillError(f"unexpected reply to PUT2PHASE DATA: {reply!r}")


def _commit(client: QuillClient, blocks: list, handles: dict[int, bytes], crcs: dict[int, int],
            stored: list[bool]) -> None:
    order = list(handles)
    try:
        replies = client._pipeline([("PUT2PHASE", "COMMIT", handles[i], "CRC32C", crcs[i]) for i in order],
                                   idempotent=False)
    except QuillConnectionError:
        replies = [_commit_again(client, blocks[i][0], handles[i], crcs[i]) for i in order]
    _settle(client, order, handles, replies, stored, None)


def _settle(client: QuillClient, order: list[int], handles: dict[int, bytes], replies: list, stored: list[bool],
            error: Exception | None) -> None:
    """Record the COMMIT replies; abort the puts they left open and raise the first error."""
    still_open = []
    for i, reply in zip(order, replies):
        if isinstance(reply, Exception):
            error = error or reply
            if not isinstance(reply, NoHandle):
                still_open.append(handles[i])  # CHECKSUM and INCOMPLETE leave the put open
        else:
            stored[i] = True
    if error is not None:
        _abort(client, still_open)
        raise error


def _commit_again(client: QuillClient, key, handle: bytes, crc: int) -> Any:
    """A COMMIT whose reply was lost with the connection: send it again, once it can be."""
    try:
        return client._call(lambda: client._redis.execute_command("PUT2PHASE", "COMMIT", handle, "CRC32C", crc))
    except NoHandle as e:
        return b"OK" if client.exists(key) else e
    except QuillError as e:
        return e


def _abort(client: QuillClient, handles: Iterable[bytes]) -> None:
    handles = list(handles)
    if not handles:
        return
    try:
        client._pipeline([("PUT2PHASE", "ABORT", h) for h in handles], idempotent=False)
    except QuillError:
        pass  # the leases reclaim whatever could not be aborted now
