"""The asyncio shell: moves bytes between a transport and the codec.

Small commands are parsed from a reusable receive buffer. A large bulk
argument is received straight into the buffer the command layer names for
it (an arena block): `get_buffer` hands the transport that memory. Block
replies are written from arena memoryviews with `writelines`; each block
stays pinned until the transport's buffer has drained past it. Reading is
paused while the peer does not drain what we write.

While a client streams pipelined commands (a read filled the whole buffer it was
given, so the transport reads again at once), their small replies are held and
written together: once the input runs dry, or at the latest when the loop next
runs its ready callbacks, before it waits for I/O again (as redis writes replies
before it sleeps). A batch of 16 pipelined 64 KiB puts took one write per put.

A client whose unfinished input holds more than `server.client_query_buffer_limit`
bytes is closed without a reply, as redis closes it (client-query-buffer-limit).
A reply that cannot be encoded, or a deferred reply that fails, is answered with
an error and its pins are given back; the connection stays.

The same class serves the unix socket (server.unixsocket). One reply there may carry
file descriptors (`WithFds`, SHM ATTACH's): the codec cannot encode it, so it reaches
`_send_with_fds` from the path of unencodable replies, never the GET/SET fast path.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import logging
import os
import socket
import time
from typing import Any, Callable

from quilld.errors import CommandError, OutOfMemory, ProtocolError, QuillError
from quilld.model import Pending, Pinned
from quilld.context.node_context import NodeContext
from quilld.protocol.resp import OK, LargeBulk, RespParser, WithFds, encode, encode_error
from quilld.protocol.session import Session
from quilld.protocol.table import ABORT, CommandTable

RECV_BUFFER = 256 * 1024
# One receive buffer serves every connection: the loop calls get_buffer() and then
# buffer_updated() back to back, and buffer_updated() consumes the bytes before returning.
_shared_rbuf = memoryview(bytearray(RECV_BUFFER))
# Right after a large payload, the next read is this small: it takes the next command's header
# and little more, so a next large payload lands straight in its arena block instead of being
# copied there from the receive buffer (up to RECV_BUFFER bytes of it otherwise).
AFTER_LARGE_READ = 8 * 1024
_after_large_rbuf = _shared_rbuf[:AFTER_LARGE_READ]
SENDFILE_MIN = 64 * 1024  # a peer's reply block at least this large leaves the arena by sendfile
SENT_HOLD = 2.0  # seconds a block sent by sendfile stays pinned at most when its peer sends nothing more
ARENA_RETRY = 0.01
log = logging.getLogger("quilld.protocol")


def _write_some(fd: int, data: bytes) -> int:
    """Bytes of `data` the socket took now (0 when it is full)."""
    try:
        return os.write(fd, data)
    except OSError:  # full (EAGAIN), or broken: the transport sends the rest, or finds the error
        return 0


def _sendfile_some(fd: int, src: int, offset: int, n: int) -> int:
    """Bytes of [offset, offset + n) of `src` the socket took now, by sendfile (0 when it is full)."""
    done = 0
    try:
        while done < n:
            k = os.sendfile(fd, src, offset + done, n - done)
            if not k:
                break
            done += k
    except OSError:  # full (EAGAIN), or broken: the transport sends the rest, or finds the error
        pass
    return done


def _collect_pins(reply: Any, pins: list) -> None:
    """The releases of the block replies in `reply`: itself, or the items of an array (MGET), or
    of an array in an array (an MGET in an EXEC's reply)."""
    if reply.__class__ is Pinned:
        pins.append(reply.release)
    elif reply.__class__ is list:
        for item in reply:
            if item.__class__ is Pinned:
                pins.append(item.release)
            elif item.__class__ is list:
                _collect_pins(item, pins)


def _address(view: memoryview) -> int:
    """Where `view`'s bytes lie in this process (-1 for a read-only view, never an arena's)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return -1


class RespConnection(asyncio.BufferedProtocol):
    """One client connection.

    `large_target(session, args, index, length)` names where a large bulk argument is received
    (and raises a QuillError to refuse it), or returns None to have the parser receive it as an
    ordinary argument; `release_args(session, args)` gives back whatever a command, or a
    connection lost mid-command, left unconsumed.
    """

    def __init__(self, ctx: NodeContext, large_target: Callable, release_args: Callable) -> None:
        self.ctx = ctx
        self.table: CommandTable = ctx.table  # type: ignore[assignment]  # the dispatcher itself, not its figures
        self.clients: Any = ctx.clients
        self._large_target = large_target
        self._release_args = release_args
        self.parser = RespParser(max_bulk_len=ctx.runtime.proto_max_bulk_len)
        self._rbuf = _shared_rbuf
        self._pins: list[Callable[[], None]] = []  # releases waiting for the write buffer to drain
        self._sent_pins: list[Callable[[], None]] = []  # blocks sent by sendfile: held until the peer reads on
        self._sent_at = 0.0  # when the last of them was sent
        self._large = False  # the command being parsed carries a large bulk
        self._after_large = False  # the last read completed a large payload: read small next
        self._waiting: tuple[LargeBulk, float] | None = None  # a large bulk waiting for arena space
        self.transport: Any = None  # asyncio's or uvloop's (Any: a test's stand-in too)
        self.session: Any = None  # a Session once connected
        self._write_paused = False
        self._deferred: Any = None  # a reply being awaited (disk or peer read): an asyncio future
        self._backlog: list = []  # parsed commands queued behind the deferred reply
        self._out: list | None = None  # the replies being gathered by _process (MONITOR lines join them)
        self._drop_deferred = False  # CLIENT REPLY OFF/SKIP: the deferred reply is not sent
        self._read_len = 0  # the size of the buffer last handed to the transport
        self._more_input = False  # the last read filled it: more input is likely already here
        self._held: list = []  # small replies held while the input streams in (see the module docstring)
        self._after: list = []  # invalidations of this connection's own change: sent after that command's reply

    # -- transport callbacks ----------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport  # type: ignore[assignment]
        ctx = self.ctx
        transport.set_write_buffer_limits(high=ctx.cfg.server.client_output_high_water)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("sockname") or ("?", 0)
        if sock.__class__ is str:  # the unix socket: addresses as redis shows them (`path:0`)
            self.session = Session(ctx, f"{sock}:0", f"{sock}:0", unix=True)
        else:
            peer = transport.get_extra_info("peername") or ("?", 0)
            self.session = Session(ctx, f"{peer[0]}:{peer[1]}", f"{sock[0]}:{sock[1]}")
        self.parser.authenticated = self.session.authenticated
        self.clients.opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        view: Any
        if self.parser.receiving:
            view = self.parser.sink_view()
        else:
            view = _after_large_rbuf if self._after_large else self._rbuf
        self._read_len = len(view)
        return view

    def buffer_updated(self, nbytes: int) -> None:
        self.clients.net_in += nbytes
        self._more_input = nbytes == self._read_len
        if self._sent_pins:  # a peer sends its next command only once it has read our last reply
            self._release_sent()
        parser = self.parser
        if parser.receiving:
            parser.sink_advance(nbytes)
            self._after_large = not parser.receiving
        else:
            self._after_large = False
            parser.feed(self._rbuf[:nbytes])
        self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._held = []
        self._waiting = None
        self._backlog = []
        self._release_args(self.session, self.parser.abandon())
        self._release_pins()
        self._release_sent()
        self.clients.closed(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._waiting is None and self._deferred is None:
            self.transport.resume_reading()
        self.check_drained()

    @property
    def busy(self) -> bool:
        """A reply is being awaited (disk, peer, arena space)."""
        return self._deferred is not None or self._waiting is not None

    def push(self, data: bytes) -> None:
        """Send `data` (a MONITOR line) after the replies already due on this connection."""
        if self._out is not None:
            self._out.append(data)
        elif self._held:
            self._held.append(data)
        elif not self.transport.is_closing():
            self.clients.net_out += len(data)
            self.transport.write(data)

    def push_after(self, data: bytes) -> None:
        """Send `data` (an invalidation caused by the command running now on this connection)
        after that command's reply."""
        if self._out is not None:
            self._after.append(data)
        else:
            self.push(data)

    def resume_after_pause(self) -> None:
        """CLIENT PAUSE ended: run the commands it held."""
        if self.transport.is_closing():
            return
        if not self._write_paused:
            self.transport.resume_reading()
        self._process()

    # -- the loop over buffered commands ----------------------------------
    def _process(self) -> None:
        """Run every complete command buffered, in order, and write their replies in one go."""
        if self.busy:  # (not `self._deferred is not None`: mypyc would take it for None below, set or not)
            return  # a large bulk waits for arena space, or a reply for the disk: nothing may overtake it
        clients = self.clients
        if clients.exclusive is not None and clients.held_out(self):
            self.transport.pause_reading()  # another client's EXEC holds the node: resumed at its end
            return
        session = self.session
        out: list = []
        pins: list = []
        self._out = out
        clients.running = session
        ncmds = 0
        cluster = self.ctx.cluster
        placed = cluster.link.placements if cluster is not None else 0
        while not session.closing:
            batch = self._next_batch(out)
            if not batch:
                break
            if session.reply_mode or clients.paused is not None:
                ncmds += self._run_careful(batch, out, pins)
                if self._backlog and not self._deferred and clients.paused is not None:
                    break  # held by CLIENT PAUSE
            else:
                ncmds += self._run_batch(batch, out, pins)
            if self._after:
                out += self._after
                self._after = []
            if self._deferred is not None:
                break
        self._out = None
        clients.running = None
        if ncmds:
            self.clients.commands_processed += ncmds
            session.last_active = time.monotonic()
        if session.closing == ABORT:  # an HTTP request on the RESP port (table.py): nothing more is sent
            self._held = []
            for release in pins:
                release()
            self.transport.abort()
            return
        if out and cluster is not None and cluster.link.placements != placed and not session.closing:
            acked = cluster.link.acknowledged()  # the batch's writes reach their owners before its replies
            if acked is not None:
                self._write_when(acked, out, pins)
                return
        if out:
            if self._more_input and not pins and not session.closing:
                if not self._held:
                    asyncio.get_running_loop().call_soon(self._flush_held)
                self._held += out
            else:
                self._write(out, pins)
        elif self._held and (not self._more_input or session.closing):
            self._flush_held()
        if session.closing:
            self.transport.close()

    def _write_when(self, acked: Any, out: list, pins: list) -> None:
        """Hold `out` (and reading) until the owners have acknowledged the writes it answers."""
        self._deferred = asyncio.ensure_future(acked)
        self.transport.pause_reading()

        def done(fut: Any) -> None:
            self._deferred = None
            if self.transport.is_closing():
                for release in pins:
                    release()
                return
            self._write(out, pins)
            if not self._write_paused:
                self.transport.resume_reading()
            self._process()

        self._deferred.add_done_callback(done)

    def _flush_held(self) -> None:
        if self._held and not self.transport.is_closing():
            self._write([], [])

    def _next_batch(self, out: list) -> list | tuple | None:
        """Commands ready to run: what waited behind a pending reply, what the fast path parsed,
        or the next one the Python parser completes (None when nothing is complete)."""
        if self._backlog:
            backlog, self._backlog = self._backlog, []
            return backlog
        parser = self.parser
        batch: Any = parser.parsed()
        while not batch:
            if not parser.buffered():
                return None
            try:
                item = parser.next_command()
            except ProtocolError as e:
                out.append(encode_error(e))
                self.session.closing = True
                return None
            except Exception as e:  # a parser bug: its state is unknown, so the connection ends
                out.append(encode_error(self.table.internal_error(self.ctx, "(parser)", e)))
                self.session.closing = True
                return None
            if item is None:
                if parser.query_bytes() > self.ctx.runtime.client_query_buffer_limit:
                    self._over_query_limit()
                return None
            if item.__class__ is LargeBulk:
                if not self._attach_large(item):
                    return None
                continue
            batch = (item,)
        return batch

    def _run_batch(self, batch: list | tuple, out: list, pins: list) -> int:
        """Dispatch each command and encode its reply; stops at a pending reply or QUIT.
        Returns how many commands ran."""
        session = self.session
        table = self.table  # table.dispatch(...), not a bound method: compiled, a direct call
        append = out.append
        resp3 = session.resp3
        for i, item in enumerate(batch):
            if self._after:  # the previous command's own invalidations, after its reply
                out += self._after
                self._after = []
            large = self._large
            if large:
                self._large = False
                try:
                    refused = next((a for a in item if isinstance(a, QuillError)), None)
                    reply = refused if refused is not None else table.dispatch(session, item)
                    if refused is not None and session.multi is not None:
                        session.multi_error = True  # refused while queueing: its EXEC aborts
                finally:  # whatever happens, what the command did not consume is given back
                    self._release_args(session, item)
            else:
                reply = table.dispatch(session, item)
            # the common replies inline; everything else through the codec
            if reply is OK:
                append(b"+OK\r\n")
            elif reply.__class__ is bytes:
                append(b"$%d\r\n%b\r\n" % (len(reply), reply))
            elif reply is None and not resp3:
                append(b"$-1\r\n")
            elif reply.__class__ is Pending:
                self._backlog = list(batch[i + 1:])
                self._defer(reply)
                return i + 1
            elif reply.__class__ is OutOfMemory and not large and self.ctx.keyspace.space_may_free():
                # space is only held for now (pins, puts, blocks being demoted): retry shortly
                # (a large command cannot be run again: its payload is already given back)
                self._backlog = list(batch[i + 1:])
                self._defer(Pending(self._retry_when_space(item)))
                return i + 1
            else:
                self._encode(reply, out, pins)
                resp3 = session.resp3  # HELLO may have switched the protocol
                if session.closing:
                    return i + 1  # QUIT: what follows it is never run
                if session.reply_mode or self.clients.paused is not None:
                    self._backlog = list(batch[i + 1:])  # CLIENT REPLY or PAUSE: the rest runs carefully
                    return i + 1
        return len(batch)

    def _run_careful(self, batch: list | tuple, out: list, pins: list) -> int:
        """One command at a time while CLIENT PAUSE may hold commands or CLIENT REPLY OFF/SKIP
        drops replies (redis's order: SKIP drops the reply of the command after it, ON is answered)."""
        session, clients, table = self.session, self.clients, self.table
        for i, item in enumerate(batch):
            if clients.paused is not None and clients.holds(self, table.resolve(item)):
                self._backlog = list(batch[i:])
                self.transport.pause_reading()
                return i
            mode = session.reply_mode  # Session.reply_mode: 0 on, 1 off, 2 skip this reply, 3 skip the next
            if mode == 3:
                session.reply_mode = mode = 2
            mark, held = len(out), len(pins)
            self._run_batch((item,), out, pins)
            if mode and session.reply_mode:  # the reply of a command run while replies are off
                del out[mark:]
                for release in pins[held:]:
                    release()
                del pins[held:]
                self._drop_deferred = self._deferred is not None
                if mode == 2 and session.reply_mode == 2:
                    session.reply_mode = 0  # SKIP covered this one command
            if self._after:  # invalidations are pushed even while replies are off (redis's CLIENT_PUSHING)
                out += self._after
                self._after = []
            if session.closing or self._deferred is not None:
                self._backlog = list(batch[i + 1:])
                return i + 1
            if not session.reply_mode and clients.paused is None:
                self._backlog = list(batch[i + 1:])
                return i + 1
        return len(batch)

    def _encode(self, reply: Any, out: list, pins: list) -> None:
        """Append `reply`'s encoding and its pins; a reply that cannot be encoded becomes an
        internal error of the command that made it, and the pins it held are released at once."""
        mark, held = len(out), len(pins)
        _collect_pins(reply, pins)
        try:
            encode(reply, self.session.resp3, out)
        except Exception as e:
            del out[mark:]
            if reply.__class__ is WithFds:  # the codec cannot encode it: here, not on the fast path
                self._send_with_fds(reply, out, pins)
                return
            for release in pins[held:]:
                release()
            del pins[held:]
            out.append(encode_error(self.table.internal_error(self.ctx, self.session.last_cmd, e)))

    def _send_with_fds(self, reply: WithFds, out: list, pins: list) -> None:
        """Send `reply` with its descriptors attached (SCM_RIGHTS), after every earlier reply.

        The replies gathered so far are handed to the transport first; the descriptors ride
        on the first byte of this reply, sent with sendmsg on the socket itself, which is only
        in order while the transport holds nothing unsent. So when it does (the client pipelined
        the command behind replies it has not read yet) the command is refused with an error
        instead. A partial send's rest goes through the transport as usual.
        """
        if out:
            self._write(list(out), list(pins))
            out.clear()
            pins.clear()
        resp3, transport = self.session.resp3, self.transport
        if transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        if not self.session.unix or sock is None or transport.get_write_buffer_size():
            encode(CommandError("a reply carrying descriptors must be read before anything is pipelined "
                                "behind it; send the command alone"), resp3, out)
            return
        chunks: list = []
        encode(reply.value, resp3, chunks)
        data = b"".join(chunks)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=sock.fileno())
        try:
            sent = raw.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", reply.fds))])
        except (BlockingIOError, InterruptedError):
            sent = -1
        except OSError:
            transport.close()
            return
        finally:
            raw.detach()  # the descriptor stays the transport's
        if sent < 0:
            encode(CommandError("the reply carrying descriptors could not be sent now; try again"), resp3, out)
            return
        self.clients.net_out += sent
        if sent < len(data):
            out.append(data[sent:])

    async def _retry_when_space(self, item: list):
        deadline = time.monotonic() + self.ctx.cfg.server.space_wait_ms / 1000
        keyspace, dispatch = self.ctx.keyspace, self.table.dispatch
        while True:
            await self.ctx.space_freed(ARENA_RETRY)
            if self.clients.exclusive is not None and self.clients.exclusive is not self.session:
                continue  # another client's EXEC holds the node
            reply = dispatch(self.session, item)
            if reply.__class__ is Pending:
                return await reply.awaitable
            if reply.__class__ is not OutOfMemory or time.monotonic() > deadline or not keyspace.space_may_free():
                return reply

    def _defer(self, reply: Pending) -> None:
        """Stop reading and running commands until `reply` resolves."""
        self._deferred = asyncio.ensure_future(reply.awaitable)
        self.transport.pause_reading()
        self._deferred.add_done_callback(self._resolved)

    def _resolved(self, fut: Any) -> None:
        self._deferred = None
        drop, self._drop_deferred = self._drop_deferred, False
        if fut.cancelled():  # shutting down
            return
        try:
            reply = fut.result()
        except Exception as e:  # a bug in a read path is answered too, rather than hanging the client
            reply = self.table.raised(self.ctx, self.session.last_cmd, e)
        if isinstance(reply, QuillError):
            self.table.failed(self.session.last_cmd, reply)
        if self.transport.is_closing() or drop:
            pins: list = []
            _collect_pins(reply, pins)
            for release in pins:
                release()
            return
        out: list = []
        pins = []
        self._encode(reply, out, pins)
        self._write(out, pins)
        if not self._write_paused and self._waiting is None:
            self.transport.resume_reading()
        self._process()

    def _attach_large(self, item: LargeBulk, deadline: float | None = None) -> bool:
        """Name where the announced payload goes: a target buffer, or nowhere (refused).

        When the arena is full only because blocks are pinned by readers or held by
        puts in progress, reading pauses and the reservation is retried until
        server.space_wait_ms has passed; False means "waiting".
        """
        self._large = True
        try:
            where = self._large_target(self.session, item.args, item.index, item.length)
        except OutOfMemory as e:
            deadline = deadline or time.monotonic() + self.ctx.cfg.server.space_wait_ms / 1000
            if self.ctx.keyspace.space_may_free() and time.monotonic() < deadline:
                self._waiting = (item, deadline)
                self.transport.pause_reading()
                asyncio.ensure_future(self._wait_space())
                return False
            self.parser.drop(e, item.length)
            return True
        except QuillError as e:
            self.parser.drop(e, item.length)
            return True
        except Exception as e:  # a bug: the payload is read and dropped, the command answered with it
            cmd = self.table.lookup(bytes(item.args[0])) if item.args else None
            self.parser.drop(self.table.internal_error(self.ctx, cmd.name if cmd else "?", e), item.length)
            return True
        if where is None:  # an ordinary argument: the parser's buffer grows as its bytes arrive
            self.parser.accumulate()
        else:
            self.parser.attach(*where)
        return True

    def _over_query_limit(self) -> None:
        """Close a client whose unfinished input passed the query-buffer limit, as redis does:
        no reply, one line in the log."""
        session, parser = self.session, self.parser
        self.clients.stats["client_query_buffer_limit_disconnections"] += 1
        log.warning("closing client that reached the max query buffer length: addr=%s id=%d qbuf=%d "
                    "limit=%d (qbuf initial bytes: %r)", session.addr, session.id, parser.query_bytes(),
                    self.ctx.runtime.client_query_buffer_limit, parser.head(64))
        session.closing = True

    async def _wait_space(self) -> None:
        await self.ctx.space_freed(ARENA_RETRY)  # woken as soon as space is freed, polled meanwhile
        self._retry_large()

    def _retry_large(self) -> None:
        if self._waiting is None or self.transport.is_closing():
            return
        item, deadline = self._waiting
        self._waiting = None
        if self._attach_large(item, deadline):
            if not self._write_paused:
                self.transport.resume_reading()
            self._process()

    def _write(self, out: list, pins: list) -> None:
        transport = self.transport
        if self._held:  # replies held while the input streamed in go first
            out, self._held = self._held + out, []
        if len(out) == 1:
            chunk = out[0]
            self.clients.net_out += len(chunk)
            transport.write(chunk)
        elif pins:
            self.clients.net_out += sum(len(x) for x in out)
            if self.session.peer and self.ctx.cfg.cluster.peer_sendfile and not transport.get_write_buffer_size():
                out = self._sendfile(out, pins)
            if out:
                transport.writelines(out)
        else:
            chunk = b"".join(out)
            self.clients.net_out += len(chunk)
            transport.write(chunk)
        if pins:
            self._pins.extend(pins)
            self.check_drained()

    def _sendfile(self, out: list, pins: list) -> list:
        """Send a peer's reply (PEERGET) straight from the arena's memory file: its large blocks
        with sendfile, the rest with plain writes; returns what is left for the transport (a
        partial send's remainder: nothing ever blocks the loop). Only while the transport holds
        nothing unsent, so the order is kept.

        sendfile hands the kernel the arena's pages, not a copy: until the peer has read them,
        they must not be reused. So the reply's pins are held until this connection's next
        command arrives (the peer client reads a reply whole before it sends again) or it
        closes, or at most SENT_HOLD seconds (an idle pooled connection); a peer verifies the
        CRC32C of what it received all the same, so a reader later than that gets an error, never
        other bytes.
        """
        sock = self.transport.get_extra_info("socket")
        arena = self.ctx.keyspace.arena
        if sock is None or arena.fd < 0:
            return out
        fd, base = sock.fileno(), _address(arena.region)
        stats = self.ctx.cluster.stats if self.ctx.cluster is not None else None  # a peer's reply: a cluster
        head: list = []
        sent_any = False
        # corked: header, block and CRLF leave as one stream, so the peer wakes once for all of it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        try:
            for i, piece in enumerate(out):
                offset = -1
                if piece.__class__ is memoryview and piece.nbytes >= SENDFILE_MIN:
                    offset = _address(piece) - base
                    if not 0 <= offset <= arena.capacity - piece.nbytes:
                        offset = -1
                if offset < 0:
                    head.append(piece)
                    continue
                if head:
                    data = b"".join(head)
                    head = []
                    done = _write_some(fd, data)
                    if done < len(data):
                        return [data[done:], *out[i:]]
                sent_any = True
                if stats is not None:
                    stats["peer_replies_sendfile"] += 1
                n = piece.nbytes
                done = _sendfile_some(fd, arena.fd, offset, n)
                if done < n:
                    return [piece[done:], *out[i + 1:]]
            if head:
                data = b"".join(head)
                done = _write_some(fd, data)
                if done < len(data):
                    return [data[done:]]
            return []
        finally:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)  # and out it goes
            except OSError:
                pass
            if sent_any:  # the pages are the kernel's until the peer reads them: held, not drained
                self._sent_pins.extend(pins)
                pins.clear()
                self._sent_at = time.monotonic()
                self.clients.watch_drain(self)

    def _release_sent(self) -> None:
        pins, self._sent_pins = self._sent_pins, []
        for release in pins:
            release()

    def check_drained(self) -> None:
        """Unpin every block whose reply the transport has fully handed to the kernel (and those
        sent by sendfile SENT_HOLD seconds ago)."""
        if self._pins and self.transport.get_write_buffer_size() == 0:
            self._release_pins()
        elif self._pins:
            self.clients.watch_drain(self)
        if self._sent_pins:
            if time.monotonic() - self._sent_at >= SENT_HOLD:
                self._release_sent()
            else:
                self.clients.watch_drain(self)

    @property
    def has_pins(self) -> bool:
        return bool(self._pins)

    def _release_pins(self) -> None:
        pins, self._pins = self._pins, []
        for release in pins:
            release()
