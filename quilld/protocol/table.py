"""The declarative command table and the one dispatcher.

A command is (name, arity, flags, handler). Existence, arity and auth are
checked here, once, in redis's order, with redis's error text; handlers stay
small, return reply values and never touch the transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from quilld.errors import CommandError, NoAuth, QuillError

Handler = Callable[[Any, list], Any]

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
        """Run one command; returns the reply value (errors are returned, not raised)."""
        fast = self._fast.get(args[0])
        if fast is not None and client.authenticated:
            handler, arity, client.last_cmd = fast
            n = len(args)
            if n == arity or (arity < 0 and n >= -arity):
                try:
                    return handler(client, args)
                except QuillError as e:
                    return e
        return self._dispatch_checked(client, args)

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
                name = _printable(args[1])
                return CommandError(f"unknown subcommand '{name}'. Try {cmd.name.upper()} HELP.")
            arity = sub.arity
            if (arity > 0 and n != arity) or n < -arity:
                return CommandError(f"wrong number of arguments for '{sub.name}' command")
            cmd = sub
        if not client.authenticated and NOAUTH not in cmd.flags:
            return NoAuth("Authentication required.")
        client.last_cmd = cmd.name
        try:
            return cmd.handler(client, args)
        except QuillError as e:
            return e


def _printable(arg: bytes, limit: int = 128) -> str:
    return bytes(arg[:limit]).decode("utf-8", "replace")


def unknown_command(args: list) -> CommandError:
    """Redis 7's text: the name, then the first arguments, each quoted and followed by a space."""
    rest = ""
    for a in args[1:]:
        if len(rest) >= 128:
            break
        piece = _printable(a, 128 - len(rest))
        rest += f"'{piece}' "
    return CommandError(f"unknown command '{_printable(args[0])}', with args beginning with: {rest}")
