"""Transactions: MULTI, EXEC, DISCARD, WATCH, UNWATCH, as redis 7.0.15 answers them.

The queue and the watched keys are protocol/transactions.py's (the dispatcher queues,
table.py); this module is the five commands and the EXEC that runs a queue.

EXEC runs the queued commands one after another, each counted, timed and monitored as
any call, and answers their replies as one array; an error of one command is its reply,
and the others still run (redis's "runtime errors do not abort"). Nothing else runs in
between: the event loop is not given up while they run. When a queued command's reply
must wait (a value only on SSD, a peer's copy, a deletion made durable), the EXEC waits for
it before it runs the next one, and meanwhile holds the node: no other client's command runs
until the EXEC is over (`Clients.hold_for`; a cluster peer's connection is not held, so two
nodes' EXECs never wait for each other). The hold is bounded: once it has lasted
`server.exec_hold_ms`, or what is left of its tenant's budget (`server.exec_hold_budget_ms`
a second, Clients.hold_for), the command still waiting is cut off (cancelled, answered
`-TIMEOUT`; a change it made before it began to wait, such as a write whose SSD deletion was
being made durable, stands) and so is every later one that would wait; the commands that
need no wait still run. What other clients had already started before the EXEC (their own
waits for the disk or a peer) may finish during the hold.

A wait on purpose (a Pending marked `on_purpose`: the AUTH throttle's) never holds the node.
When its answer is known already (a failed AUTH, answered late), the EXEC takes it at once,
runs on, and sends its own reply no earlier than that answer was due; when it is not (an
AUTH that waits before it is even checked), the command is answered `-TIMEOUT` at once.

A queued HELLO may switch the protocol mid-transaction: as redis, each reply is then
written in the protocol in force when its command ran.

Each queued command's rights are checked again when EXEC runs it, as redis does: one the
user's ACL no longer allows (ACL SETUSER since it was queued) is not run and answers redis's
`-NOPERM ACLs rules changed ...`, the others run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from quilld.errors import CommandError, QuillError
from quilld.model import Pending, Pinned
from quilld.protocol.resp import OK, Raw, array_header, encode
from quilld.protocol.table import Command, CommandTable
from quilld.protocol.transactions import ExecAbort, end, unwatch

NULL_ARRAY2 = Raw(b"*-1\r\n")  # a failed EXEC's reply in RESP2 (RESP3: a null)
# refused when EXEC runs them (redis runs EXEC's commands with CLIENT_DENY_BLOCKING)
DENIED_IN_EXEC = {"monitor": "MONITOR isn't allowed for DENY BLOCKING client"}


class HoldTimeout(QuillError):
    """A command of an EXEC still waiting once the EXEC has held the node server.exec_hold_ms."""

    prefix = "TIMEOUT"


def cmd_multi(c, args):
    if c.multi is not None:
        raise CommandError("MULTI calls can not be nested")
    c.multi = []
    return OK


def cmd_discard(c, args):
    if c.multi is None:
        raise CommandError("DISCARD without MULTI")
    end(c)
    return OK


def cmd_watch(c, args):
    if c.multi is not None:
        raise CommandError("WATCH inside MULTI is not allowed")
    if not c.cas_dirty:  # already doomed: nothing to watch for
        c.ctx.clients.watches.watch(c, c.keyspace, c.tag, args[1:])
    return OK


def cmd_unwatch(c, args):
    unwatch(c)
    return OK


def cmd_exec(c, args):
    if c.multi is None:
        raise CommandError("EXEC without MULTI")
    if c.watched and not c.cas_dirty and c.ctx.clients.watches.expired_since(c):
        c.cas_dirty = True
    if c.multi_error:
        end(c)
        raise ExecAbort("Transaction discarded because of previous errors.")
    if c.cas_dirty:
        end(c)
        return None if c.resp3 else NULL_ARRAY2
    queued, c.multi = c.multi, None  # out of MULTI; each command's arguments are given back once it ran
    c.multi_bytes = 0
    unwatch(c)
    return _Exec(c, queued, args).run()


def _denied(message: str):
    def handler(c, args):
        raise CommandError(message)
    return handler


def _release(reply) -> None:
    pins: list = []
    _pins_of(reply, pins)
    for release in pins:
        release()


def _pins_of(reply, pins: list) -> None:
    if reply.__class__ is Pinned:
        pins.append(reply.release)
    elif reply.__class__ is list:
        for item in reply:
            _pins_of(item, pins)


class _Exec:
    """One EXEC's run of its queue."""

    __slots__ = ("c", "queued", "args", "replies", "protos", "resp3", "due")

    def __init__(self, c, queued: list, args: list) -> None:
        self.c = c
        self.queued = queued
        self.args = args  # the EXEC's own, for MONITOR
        self.replies: list = []
        self.protos: list[bool] | None = None  # each reply's protocol, once a HELLO switched it
        self.resp3 = c.resp3
        self.due = 0.0  # the EXEC's reply is not sent before this (monotonic): a late answer's

    def run(self):
        """The EXEC's reply: the array, or a Pending of it when a command must wait."""
        for i, (cmd, args) in enumerate(self.queued):
            reply = self._call(cmd, args)
            if reply.__class__ is Pending and not reply.on_purpose:
                allowed = self.c.ctx.clients.hold_for(self.c)
                return Pending(self._finish(i, reply, allowed))
            self._add(reply)
        reply = self._late(self._reply())
        if reply.__class__ is Pending:  # the table feeds MONITOR no waiting EXEC: its commands ran
            self._monitor()
        return reply

    def _monitor(self) -> None:
        table = self.c.ctx.table
        if table.monitor is not None:  # after its commands, as redis feeds a MONITOR
            table.monitor(self.c, table.commands[b"exec"], self.args)

    def _late(self, reply):
        """`reply`, or a Pending of it sent once the late answers it holds are due."""
        left = self.due - time.monotonic()
        if left <= 0:
            return reply

        async def later():
            try:
                await asyncio.sleep(left)
            except BaseException:  # shutting down: what the replies pin is given back
                _release(reply)
                raise
            return reply

        return Pending(later(), on_purpose=True, answer=reply, due=self.due)

    def _on_purpose(self, cmd: Command, reply: Pending):
        """A wait on purpose, never waited for here: its answer now (the reply goes out no
        earlier than it was due), or -TIMEOUT when it is not known yet."""
        reply.awaitable.close()  # never started
        if reply.due is None:
            err = HoldTimeout(f"'{cmd.name}' would wait on purpose (the AUTH throttle: too many failures "
                              "from this address or for this user not answered yet); an EXEC never holds "
                              "the node for that: send it outside MULTI")
            self.c.ctx.table.failed(cmd.name, err)
            return err
        self.due = max(self.due, reply.due)
        if isinstance(reply.answer, QuillError):
            self.c.ctx.table.failed(cmd.name, reply.answer)
        return reply.answer

    def _call(self, cmd: Command, args: list):
        c = self.c
        table = c.ctx.table
        name = c.last_cmd
        denied = DENIED_IN_EXEC.get(cmd.name)
        try:
            refusal = None if c.perms is None else c.perms.refusal_at_exec(cmd, args)
            if refusal is not None:  # the user's rights changed since it was queued (ACL SETUSER)
                table.count_error(refusal)  # errorstats' NOPERM; the command itself never ran
                return refusal
            return table.call(c, cmd if denied is None else replace(cmd, handler=_denied(denied)), args)
        finally:
            c.last_cmd = name  # CLIENT LIST's cmd= stays `exec`
            table.release_args(c, args)

    def _add(self, reply) -> None:
        if reply.__class__ is Pending:  # on purpose (run and _finish wait for the others)
            reply = self._on_purpose(self.queued[len(self.replies)][0], reply)
        self.replies.append(reply)
        if self.c.resp3 != self.resp3 or self.protos is not None:  # a HELLO switched the protocol
            if self.protos is None:
                self.protos = [self.resp3] * (len(self.replies) - 1)
            self.protos.append(self.c.resp3)

    def _reply(self):
        if self.protos is None:
            return self.replies
        out = [array_header(len(self.replies))]  # an array's header is the same in RESP2 and RESP3
        for reply, resp3 in zip(self.replies, self.protos):
            encode(reply, resp3, out)
        raw = Raw(b"".join(out))
        _release(self.replies)
        return raw

    async def _finish(self, first: int, pending: Pending, allowed: float):
        """The rest of the run, once the command at `first` waits: each wait is awaited in turn,
        while the node is held, for `allowed` seconds in all."""
        c = self.c
        deadline = time.monotonic() + allowed
        queued, i = self.queued, first
        try:
            self._add(await self._wait(queued[first][0], pending, deadline))
            for i in range(first + 1, len(queued)):
                cmd, args = queued[i]
                reply = self._call(cmd, args)
                if reply.__class__ is Pending and not reply.on_purpose:
                    reply = await self._wait(cmd, reply, deadline)
                self._add(reply)
        except BaseException:  # shutting down (or a bug): what is held is given back
            _release(self.replies)
            for _, args in queued[i + 1:]:
                c.ctx.table.release_args(c, args)
            raise
        finally:
            c.ctx.clients.release_hold()
            self._monitor()
        reply = self._late(self._reply())
        return await reply.awaitable if reply.__class__ is Pending else reply

    async def _wait(self, cmd: Command, pending: Pending, deadline: float):
        """`pending`'s value, or HoldTimeout once `deadline` has passed (the wait is cancelled)."""
        c = self.c
        task = asyncio.ensure_future(pending.awaitable)
        left = deadline - time.monotonic()
        if left <= 0:
            await asyncio.sleep(0)  # started, so that being cancelled runs its own clean-up
        await asyncio.wait((task,), timeout=max(left, 0))
        if not task.done():
            task.cancel()
            try:
                _release(await task)  # it finished as it was cancelled
            except BaseException:
                pass
            c.ctx.clients.stats["exec_hold_timeouts"] += 1
            reply: object = HoldTimeout(f"'{cmd.name}' still waited for the disk or a peer when the EXEC had held "
                                        "the node for server.exec_hold_ms; cut off (a change it made before it "
                                        "waited stands)")
        else:
            try:
                reply = task.result()
            except Exception as e:  # a bug in a read path is answered too, rather than failing the EXEC
                reply = c.ctx.table.raised(c.ctx, cmd.name, e)
        if isinstance(reply, QuillError):
            c.ctx.table.failed(cmd.name, reply)
        return reply


def register(t: CommandTable) -> None:
    t.add("multi", 1, "", cmd_multi)
    t.add("exec", 1, "", cmd_exec)
    t.add("discard", 1, "", cmd_discard)
    t.add("watch", -2, "", cmd_watch)
    t.add("unwatch", 1, "", cmd_unwatch)
