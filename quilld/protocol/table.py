"""The declarative command table and the one dispatcher.

A command is a row: (name, arity, flags, handler), and what COMMAND INFO and
COMMAND DOCS tell about it (`Doc`: redis's command flags, ACL categories, key
specs, tips, documented arguments). Existence, arity and auth are checked
here, once, in redis's order, with redis's error text; handlers stay small,
return reply values and never touch the transport.

The dispatcher also keeps what INFO commandstats, errorstats and latencystats
report, at the price of one list-item increment per call on the fast path
(an authenticated plain command with the right arity). Reading the clock costs
more than a GET's handler here, so the fast path times one call in
`SAMPLE_EVERY` of the commands redis calls fast (O(1)) and of SET and MSET;
every other call is timed. commandstats' `usec` is the timed calls' total
scaled to all calls, latencystats' percentiles are the timed calls'; a fast
command is seen by the slowlog only if it was timed, unless the slowlog's
threshold is under `TIME_ALL_BELOW_US`, when every call is timed. While a
client MONITORs, the fast path is off: every call goes through the checked
path, which feeds the monitors.

A command named `POST` or `Host:` is an HTTP request sent to the RESP port (a web page
in a local browser can send one: cross-protocol scripting). As redis does, the connection is
closed at once, with nothing after it run and no reply (not even those of the commands
before it that were not sent yet, as redis drops them), and a warning is logged (at most
once a minute, `CROSS_PROTOCOL_RELOG`). The check costs the fast path nothing: neither name
is a command.

A handler that raises anything but a QuillError is a bug, never the client's
fault: the dispatcher answers `-ERR internal error ...`, keeps the connection,
and logs the traceback once per place it was raised (never the arguments).
Whatever the command reserved is given back by the server shell as for any
error reply.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Mapping

from quilld.errors import CommandError, NoAuth, QuillError, echo
from quilld.model import Pending
from quilld.protocol.command_specs import (  # re-exported: the command modules take them from here
    ACL_CATEGORIES,
    ADMIN,
    ARG_FLAGS,
    COMMAND_FLAGS,
    FAST,
    KEY_FLAGS,
    NOAUTH,
    PEER,
    PROTECTED,
    READONLY,
    WRITE,
    Arg,
    Command,
    Doc,
    Handler,
    KeySpec,
    KeysOf,
    keys_from_specs,
    legacy_range,
    ordered,
)
from quilld.protocol.resp import Raw
from quilld.protocol.transactions import QUEUED, RUN_IN_MULTI, ExecAbort, end, queue

log = logging.getLogger("quilld.protocol")
FAILURE_SITES = 256  # distinct places a handler failed at that are remembered (each logged once)
FAILURE_RELOG = 60.0  # seconds between the one-line reminders of a failure seen again
_clock = time.perf_counter_ns
SAMPLE_EVERY = 64  # the fast path times one call in this many (a power of two)
TIME_ALL_BELOW_US = 1000  # a slowlog threshold under this (microseconds) has every call timed
HTTP_NAMES = (b"post", b"host:")  # redis's processCommand: an HTTP request's method line or Host header
CROSS_PROTOCOL_RELOG = 60.0  # seconds between two warnings of HTTP sent to the RESP port (redis: 60)
_NO_REPLY = Raw(b"")
ABORT = 2  # Session.closing: close at once, dropping every reply not sent yet (True: close once they are)

# a protected command -> its key in the config's security section (redis's name: dashes, `enable-...`)
PROTECTED_BY = {"debug": "enable_debug_command"}
LOCAL_ADDRESSES = ("127.0.0.1", "::1")  # redis's islocalClient(): these two exactly, or the unix socket


def _bucket(ns: int) -> int:
    """A latency histogram bucket: 16 per power of two (about 6% wide)."""
    b = ns.bit_length()
    return b << 4 if b <= 5 else (b << 4) | ((ns >> (b - 5)) & 15)


def bucket_top(bucket: int) -> int:
    """The largest duration (ns) a bucket holds."""
    b, sub = bucket >> 4, bucket & 15
    return (1 << b) - 1 if b <= 5 else ((16 | sub) + 1 << (b - 5)) - 1


class CommandTable:
    def __init__(self, docs: Mapping[str, Doc] | None = None) -> None:
        self.commands: dict[bytes, Command] = {}
        self.docs: Mapping[str, Doc] = docs or {}
        # name as sent (lower or upper case) -> (handler, arity, name, stats, sample mask), for plain commands
        self._fast: dict[bytes, tuple[Handler, int, str, list, int]] = {}
        self._fast_off: dict = {}  # the fast path while something needs every call checked (MONITOR)
        self._failures: dict[tuple, list] = {}  # failure site -> [times seen, seen since logged, logged at]
        # per command: [calls, timed ns, timed calls, rejected calls, failed calls, {latency bucket: count}]
        self.stats: dict[str, list] = {}
        self.errors: Counter[str] = Counter()  # error replies by their first word (INFO errorstats)
        self.error_replies = 0
        self.slow_ns = 10_000_000  # calls at least this long are reported to `on_slow`
        self.on_slow: Callable[[Any, Command | None, list, int], None] | None = None  # slowlog, latency monitor
        self.observer: Any = None  # what on_slow feeds: the slowlog and latency events (commands/observe.py)
        self.monitor: Callable[[Any, Command, list], None] | None = None  # MONITOR's feed, while any
        self.time_all = False
        # gives back what a command left of its arguments (a value received into the arena): for
        # the queued commands of a transaction that ends without running them (commands/blocks.py's)
        self.release_args: Callable[[Any, list], None] = lambda client, args: None
        self._cross_logged = float("-inf")  # when an HTTP request on the RESP port was last logged

    def add(self, name: str, arity: int, flags: str, handler: Handler, summary: str = "",
            group: str = "generic", since: str = "1.0.0", keys: tuple[int, int, int] = (0, 0, 0),
            subcommands: dict[bytes, Command] | None = None, arg_limit: int = 0) -> Command:
        subs = {k: self._described(s) for k, s in (subcommands or {}).items()}
        cmd = self._described(Command(name, arity, frozenset(flags.split()), handler, summary, group, since,
                                      keys[0], keys[1], keys[2], subs, arg_limit=arg_limit))
        self.commands[name.encode()] = cmd
        for c in (cmd, *subs.values()):
            self.stats.setdefault(c.name, [0, 0, 0, 0, 0, None])
        for spelling in (name.encode(), name.upper().encode()):
            self._fast.pop(spelling, None)
        if not cmd.subcommands and NOAUTH not in cmd.flags and PROTECTED not in cmd.flags:
            mask = self._mask(cmd)
            for spelling in (name.encode(), name.upper().encode()):
                self._fast[spelling] = (handler, arity, name, self.stats[name], mask)
        return cmd

    def _described(self, cmd: Command) -> Command:
        doc = self.docs.get(cmd.name) or cmd.doc
        if doc is None:
            return cmd
        return replace(cmd, doc=doc, summary=doc.summary, group=doc.group, since=doc.since)

    def _mask(self, cmd: Command) -> int:
        if self.time_all:
            return 0
        doc = cmd.doc
        sampled = doc.sampled if doc is not None and doc.sampled is not None else "fast" in cmd.info_flags
        return SAMPLE_EVERY - 1 if sampled else 0

    def set_timing(self, slow_ns: int) -> None:
        """Calls at least `slow_ns` long go to `on_slow`; under TIME_ALL_BELOW_US every call is timed."""
        self.slow_ns = slow_ns
        time_all = slow_ns < TIME_ALL_BELOW_US * 1000
        if time_all != self.time_all:
            self.time_all = time_all
            fast = self._fast or self._fast_off
            for spelling, (handler, arity, name, st, _) in fast.items():
                fast[spelling] = (handler, arity, name, st, self._mask(self.commands[name.encode()]))

    def set_monitor(self, feed: Callable[[Any, Command, list], None] | None) -> None:
        """Feed every call to `feed` (MONITOR), or stop (None): the fast path is off meanwhile."""
        self.monitor = feed
        if feed is not None and self._fast:
            self._fast_off, self._fast = self._fast, {}
        elif feed is None and self._fast_off:
            self._fast, self._fast_off = self._fast_off, {}

    def lookup(self, name: bytes) -> Command | None:
        cmd = self.commands.get(name)
        if cmd is None:
            cmd = self.commands.get(name.lower())
        return cmd

    def resolve(self, argv: list) -> Command | None:
        """The command or subcommand `argv` names (redis's lookupCommand), or None."""
        cmd = self.lookup(bytes(argv[0])) if argv else None
        if cmd is None or not cmd.subcommands or len(argv) < 2:
            return cmd
        return cmd.subcommands.get(bytes(argv[1]).lower())

    def dispatch(self, client: Any, args: list) -> Any:
        """Run one command; returns the reply value (errors are returned, never raised)."""
        try:
            fast = self._fast.get(args[0])
            if fast is not None and client.authenticated and client.multi is None and client.perms is None and (
                    client.tracking is None):
                handler, arity, client.last_cmd, st, mask = fast
                n = len(args)
                if n == arity or (arity < 0 and n >= -arity):
                    calls = st[0]
                    st[0] = calls + 1
                    if calls & mask:  # the first call, then one in SAMPLE_EVERY, is timed
                        return handler(client, args)
                    return self._timed(client, st, handler, args)
            return self._dispatch_checked(client, args)
        except Exception as e:
            err = self.raised(client.ctx, client.last_cmd, e)
            self.failed(client.last_cmd, err)
            return err

    def _timed(self, client: Any, st: list, handler: Handler, args: list) -> Any:
        start = _clock()
        try:
            return handler(client, args)
        finally:
            ns = _clock() - start
            st[1] += ns
            st[2] += 1
            hist = st[5]
            if hist is None:
                hist = st[5] = {}
            bucket = _bucket(ns)
            hist[bucket] = hist.get(bucket, 0) + 1
            if ns >= self.slow_ns and self.on_slow is not None:
                self.on_slow(client, self.resolve(args), args, ns)

    def failed(self, name: str, err: QuillError) -> None:
        """A command answered with an error (counted in its failed calls and in errorstats)."""
        st = self.stats.get(name)
        if st is not None:
            st[4] += 1
        self.count_error(err)

    def count_error(self, err: QuillError) -> None:
        self.error_replies += 1
        self.errors[err.wire()[:32].split(" ", 1)[0] or "ERR"] += 1

    def _rejected(self, client: Any, cmd: Command | None, err: QuillError) -> QuillError:
        """A command refused before it ran: counted; inside MULTI the transaction is marked to
        fail, and a refused EXEC ends it (redis's rejectCommand, flagTransaction, execCommandAbort)."""
        if cmd is not None:
            self.stats[cmd.name][3] += 1
        if client.multi is not None:
            client.multi_error = True
        if cmd is not None and cmd.name == "exec":
            end(client)
            # redis quotes its own refusals (existence, arity, ...) without their `ERR`
            err = ExecAbort(f"Transaction discarded because of: {err.message if err.prefix == 'ERR' else err.wire()}")
            if self.monitor is not None:
                self.monitor(client, cmd, [b"exec"])
        self.count_error(err)
        return err

    def reset_stats(self) -> None:
        """CONFIG RESETSTAT: command, error and latency statistics start afresh."""
        for st in self.stats.values():
            st[:] = [0, 0, 0, 0, 0, None]
        self.errors.clear()
        self.error_replies = 0

    def latency_of(self, name: str) -> list[tuple[int, int]]:
        """A command's timed calls by bucket: (the bucket's longest duration in ns, calls), shortest
        first (the admin API's metrics read them at scrape time)."""
        hist = self.stats[name][5]
        return sorted((bucket_top(b), n) for b, n in hist.items()) if hist else []

    def raised(self, ctx: Any, name: str, exc: Exception) -> QuillError:
        """The reply to command `name` that raised `exc` (in its handler or its deferred reply):
        a typed error as it is; anything else is a bug, answered as an internal error (counted
        in `ctx.stats`, logged once) so the connection is kept. Not yet counted as failed."""
        return exc if isinstance(exc, QuillError) else self.internal_error(ctx, name, exc)

    def internal_error(self, ctx: Any, name: str, exc: BaseException) -> CommandError:
        """The reply to a command whose handler (or deferred reply) raised `exc`, a bug: counted
        in `ctx.stats` (INFO's internal_errors) and logged.

        The traceback is logged the first time a failure is seen at a given place, then a
        one-line reminder with a count at most every FAILURE_RELOG seconds. Neither the
        arguments nor the exception's message are logged: both may quote client bytes.
        """
        ctx.stats["internal_errors"] += 1
        frames = traceback.extract_tb(exc.__traceback__)
        site = (name, type(exc).__name__, frames[-1].filename, frames[-1].lineno) if frames else (
            name, type(exc).__name__)
        now = time.monotonic()
        seen = self._failures.get(site)
        if seen is None:
            if len(self._failures) >= FAILURE_SITES:
                self._failures.pop(next(iter(self._failures)))
            self._failures[site] = [1, 0, now]
            log.error("command '%s' raised %s (a bug: answered with an error, connection kept; "
                      "arguments not logged)\n%s", name, type(exc).__name__,
                      "".join(traceback.format_list(frames)).rstrip())
        else:
            seen[0] += 1
            seen[1] += 1
            if now - seen[2] >= FAILURE_RELOG:
                log.error("command '%s' raised %s again: %d times since last logged, %d in all (traceback "
                          "logged the first time)", name, type(exc).__name__, seen[1], seen[0])
                seen[1], seen[2] = 0, now
        return CommandError(f"internal error running '{name}' (logged by the server)")

    def _dispatch_checked(self, client: Any, args: list) -> Any:
        """Existence, arity and auth checks in redis's order, then the handler (timed)."""
        cmd = self.commands.get(args[0])
        if cmd is None:
            name = bytes(args[0]).lower()
            cmd = self.commands.get(name)
            if cmd is None:
                if name in HTTP_NAMES:
                    return self._cross_protocol(client)
                return self._rejected(client, None, unknown_command(args))
        n = len(args)
        arity = cmd.arity
        if (arity > 0 and n != arity) or n < -arity:
            return self._rejected(client, cmd, CommandError(f"wrong number of arguments for '{cmd.name}' command"))
        if cmd.subcommands and n > 1:
            sub = cmd.subcommands.get(bytes(args[1]).lower())
            if sub is None:
                return self._rejected(client, None, CommandError(
                    f"unknown subcommand '{echo(args[1], 128)}'. Try {cmd.name.upper()} HELP."))
            arity = sub.arity
            if (arity > 0 and n != arity) or n < -arity:
                return self._rejected(client, sub, CommandError(
                    f"wrong number of arguments for '{sub.name}' command"))
            cmd = sub
        if PROTECTED in cmd.flags:
            refusal = protected_refusal(client, cmd.name)
            if refusal is not None:
                return self._rejected(client, cmd, refusal)
        if not client.authenticated and NOAUTH not in cmd.flags and not (client.peer and PEER in cmd.flags):
            return self._rejected(client, cmd, NoAuth("Authentication required."))
        if client.perms is not None:  # the user's ACL restricts it (commands/acl_rules.py)
            refusal = client.perms.refusal(cmd, args)
            if refusal is not None:
                return self._rejected(client, cmd, refusal)
        client.last_cmd = cmd.name
        if client.multi is not None and cmd.name not in RUN_IN_MULTI:
            refused = queue(client, cmd, args, client.ctx.runtime.client_query_buffer_limit)
            return QUEUED if refused is None else self._rejected(client, cmd, refused)
        return self._call(client, cmd, args)

    def _call(self, client: Any, cmd: Command, args: list, top: bool = True) -> Any:
        st = self.stats[cmd.name]
        st[0] += 1
        reply = None
        try:
            reply = self._timed(client, st, cmd.handler, args)
            return reply
        finally:
            if client.tracking is not None:  # CLIENT TRACKING: a read's keys are remembered (tracking.py)
                client.ctx.clients.tracking.after_command(client, cmd, args, top)
            if self.monitor is not None and not {"admin", "skip_monitor"} & set(cmd.info_flags) and not (
                    reply.__class__ is Pending and cmd.name == "exec"):  # a waiting EXEC: once its commands ran
                self.monitor(client, cmd, args)

    def call(self, client: Any, cmd: Command, args: list) -> Any:
        """Run a command checked already (one EXEC runs): counted, timed and monitored as any
        call; its errors are returned, as dispatch returns them."""
        try:
            return self._call(client, cmd, args, top=False)
        except Exception as e:
            err = self.raised(client.ctx, cmd.name, e)
            self.failed(cmd.name, err)
            return err


    def _cross_protocol(self, client: Any) -> Any:
        """An HTTP request on the RESP port (redis's securityWarningCommand): the connection is
        closed without a reply, nothing after it runs; a warning once a minute at most."""
        client.closing = ABORT
        client.ctx.stats["cross_protocol_closed"] += 1
        now = time.monotonic()
        if now - self._cross_logged >= CROSS_PROTOCOL_RELOG:
            self._cross_logged = now
            log.warning("Possible SECURITY ATTACK detected. It looks like somebody is sending POST or Host: "
                        "commands to the RESP port (client %s). This is likely due to an attacker attempting to "
                        "use Cross Protocol Scripting to compromise this quilld. Connection aborted.", client.addr)
        return _NO_REPLY


def protected_refusal(client: Any, name: str) -> CommandError | None:
    """None when `client` may run protected command `name`, else redis's refusal (server.c
    processCommand, allowProtectedAction): its setting is "yes", or "local" and the client is on
    the unix socket or comes from 127.0.0.1 or ::1."""
    key = PROTECTED_BY[name]
    setting = getattr(client.ctx.cfg.security, key)
    if setting == "yes" or (setting == "local" and (
            client.unix or client.addr.rpartition(":")[0] in LOCAL_ADDRESSES)):
        return None
    option = key.replace("_", "-")
    return CommandError(f"{name.upper()} command not allowed. If the {option} option is set to \"local\", "
                        "you can run it from a local connection, otherwise you need to set this option in the "
                        "configuration file, and then restart the server.")


def unknown_command(args: list) -> CommandError:
    """Redis 7's text: the name, then the first arguments, each quoted and followed by a space.

    As redis's `'%.128s'` and `'%.*s' `: each piece stops at a NUL byte, the name at 128
    bytes, the arguments once 128 bytes of quoted text are written; bytes go back raw.
    """
    rest = b""
    for a in args[1:]:
        if len(rest) >= 128:
            break
        piece = bytes(a)
        nul = piece.find(0)
        rest += b"'" + (piece if nul < 0 else piece[:nul])[:128 - len(rest)] + b"' "
    return CommandError(f"unknown command '{echo(args[0], 128)}', with args beginning with: {echo(rest)}")
