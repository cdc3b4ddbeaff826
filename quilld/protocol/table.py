"""The declarative command table and the one dispatcher.

A command is (name, arity, flags, handler). Existence, arity and auth are
checked here, once, in redis's order, with redis's error text; handlers stay
small, return reply values and never touch the transport.

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
from dataclasses import dataclass, field
from typing import Any, Callable

from quilld.errors import CommandError, NoAuth, QuillError, echo

Handler = Callable[[Any, list], Any]
log = logging.getLogger("quilld.protocol")
FAILURE_SITES = 256  # distinct places a handler failed at that are remembered (each logged once)
FAILURE_RELOG = 60.0  # seconds between the one-line reminders of a failure seen again

NOAUTH = "noauth"  # may run before AUTH (AUTH, HELLO, QUIT)
WRITE = "write"
READONLY = "readonly"
FAST = "fast"
ADMIN = "admin"


@dataclass(frozen=True)
class Command:
    name: str  # lowercase, as redis names it in errors (`client|setname` for subcommands)
    arity: int  # redis convention: n means exactly n arguments (name included), -n at least n
    flags: frozenset[str]
    handler: Handler
    summary: str = ""
    group: str = "generic"
    since: str = "1.0.0"
    first_key: int = 0
    last_key: int = 0
    step: int = 0
    subcommands: dict[bytes, "Command"] = field(default_factory=dict)


class CommandTable:
    def __init__(self) -> None:
        self.commands: dict[bytes, Command] = {}
        # name as sent (lower or upper case) -> (handler, arity, name), for plain commands only
        self._fast: dict[bytes, tuple[Handler, int, str]] = {}
        self._failures: dict[tuple, list] = {}  # failure site -> [times seen, seen since logged, logged at]

    def add(self, name: str, arity: int, flags: str, handler: Handler, summary: str = "",
            group: str = "generic", since: str = "1.0.0", keys: tuple[int, int, int] = (0, 0, 0),
            subcommands: dict[bytes, Command] | None = None) -> Command:
        cmd = Command(name, arity, frozenset(flags.split()), handler, summary, group, since,
                      keys[0], keys[1], keys[2], subcommands or {})
        self.commands[name.encode()] = cmd
        if not cmd.subcommands and NOAUTH not in cmd.flags:
            for spelling in (name.encode(), name.upper().encode()):
                self._fast[spelling] = (handler, arity, name)
        return cmd

    def lookup(self, name: bytes) -> Command | None:
        cmd = self.commands.get(name)
        if cmd is None:
            cmd = self.commands.get(name.lower())
        return cmd

    def dispatch(self, client: Any, args: list) -> Any:
        """Run one command; returns the reply value (errors are returned, never raised)."""
        try:
            fast = self._fast.get(args[0])
            if fast is not None and client.authenticated:
                handler, arity, client.last_cmd = fast
                n = len(args)
                if n == arity or (arity < 0 and n >= -arity):
                    return handler(client, args)
            return self._dispatch_checked(client, args)
        except QuillError as e:
            return e
        except Exception as e:  # a bug: answer it, keep the connection, log it once
            client.ctx.stats["internal_errors"] += 1
            return self.internal_error(client.last_cmd, e)

    def internal_error(self, name: str, exc: BaseException) -> CommandError:
        """The reply to a command whose handler (or deferred reply) raised `exc`; logs it.

        The traceback is logged the first time a failure is seen at a given place, then a
        one-line reminder with a count at most every FAILURE_RELOG seconds. Neither the
        arguments nor the exception's message are logged: both may quote client bytes.
        """
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
        """Existence, arity and auth checks in redis's order, then the handler."""
        cmd = self.commands.get(args[0])
        if cmd is None:
            cmd = self.commands.get(bytes(args[0]).lower())
            if cmd is None:
                return unknown_command(args)
        n = len(args)
        arity = cmd.arity
        if (arity > 0 and n != arity) or n < -arity:
            return CommandError(f"wrong number of arguments for '{cmd.name}' command")
        if cmd.subcommands and n > 1:
            sub = cmd.subcommands.get(bytes(args[1]).lower())
            if sub is None:
                return CommandError(f"unknown subcommand '{echo(args[1], 128)}'. Try {cmd.name.upper()} HELP.")
            arity = sub.arity
            if (arity > 0 and n != arity) or n < -arity:
                return CommandError(f"wrong number of arguments for '{sub.name}' command")
            cmd = sub
        if not client.authenticated and NOAUTH not in cmd.flags:
            return NoAuth("Authentication required.")
        client.last_cmd = cmd.name
        return cmd.handler(client, args)


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
