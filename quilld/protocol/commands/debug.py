"""DEBUG: the part of redis 7.0.15's debugging command that quilld can serve for real.

DEBUG is a protected command (table.PROTECTED): the dispatcher refuses it with redis's
text unless `security.enable_debug_command` allows it ("yes", or "local" for the unix
socket and 127.0.0.1 / ::1), before the auth check, as redis's processCommand does. It
is the operator's (`default`'s) only: SLEEP stops the node and SET-ACTIVE-EXPIRE
changes it for every tenant.

Served, with redis's replies (debug.c):

- PROTOCOL <type>: one test value of each RESP type, in RESP2 and RESP3 (attrib sends
  an attribute frame before its reply to a RESP3 client only; push is RESP3 only).
- SLEEP <seconds>: the node stops (the event loop sleeps), as redis's does.
- SET-ACTIVE-EXPIRE <0|1>: the periodic sweep of expired keys off or on; while off, a
  key past its deadline stays (DBSIZE counts it) until something reads it.
- ERROR <string>: that string as an error reply; LOG <message>: a WARNING log line.
- HELP: these subcommands, in redis's words.

The rest of redis's subcommands (RELOAD, LOADAOF, OBJECT, DIGEST, POPULATE, JMAP,
crash and allocator ones, ...) concern RDB/AOF files, redis's object encodings or its C
runtime, which quilld does not have: they get redis's unknown-subcommand error.
"""

from __future__ import annotations

import logging
import math
import re
import time

from quilld.errors import CommandError, echo
from quilld.protocol.commands.client import operator_only
from quilld.protocol.commands.command_docs import help_reply, render
from quilld.protocol.resp import OK, Attribute, BigNumber, OrderedSet, Push, Raw, Verbatim, encode
from quilld.protocol.table import PROTECTED, CommandTable

log = logging.getLogger("quilld")

_HELP = (
    "ERROR <string>",
    "    Return a Redis protocol error with <string> as message. Useful for clients",
    "    unit tests to simulate Redis errors.",
    "LOG <message>",
    "    Write <message> to the server log.",
    "PROTOCOL <type>",
    "    Reply with a test value of the specified type. <type> can be: string,",
    "    integer, double, bignum, null, array, set, map, attrib, push, verbatim,",
    "    true, false.",
    "SET-ACTIVE-EXPIRE <0|1>",
    "    Setting it to 0 disables expiring keys in background when they are not",
    "    accessed (otherwise the Redis behavior). Setting it to 1 reenables back the",
    "    default.",
    "SLEEP <seconds>",
    "    Stop the server for <seconds>. Decimals allowed.",
)

_ATOI = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_STRTOD = re.compile(rb"[ \t\n\v\f\r]*([+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                     rb"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN]))")


def atoi(raw: bytes) -> int:
    """C's atoi(): the leading integer, 0 when there is none."""
    m = _ATOI.match(raw)
    return int(m.group(1)) if m else 0


def strtod(raw: bytes) -> float:
    """C's strtod(raw, NULL) on decimal input: the leading number, 0.0 when there is none."""
    m = _STRTOD.match(raw)
    return float(m.group(1)) if m else 0.0


def protocol_reply(name: bytes, resp3: bool) -> Raw | CommandError:
    """DEBUG PROTOCOL's test value of type `name`, encoded for the connection's protocol."""
    out: list = []
    if name == b"string":
        value = b"Hello World"
    elif name == b"integer":
        value = 12345
    elif name == b"double":
        value = 3.141
    elif name == b"bignum":
        value = BigNumber(b"1234567999999999999999999999999999999")
    elif name == b"null":
        value = None
    elif name == b"array":
        value = [0, 1, 2]
    elif name == b"set":
        value = OrderedSet((0, 1, 2))
    elif name == b"map":
        value = {0: False, 1: True, 2: False}
    elif name == b"attrib":
        encode(Attribute({b"key-popularity": [b"key:123", 90]}), resp3, out)  # nothing in RESP2
        value = b"Some real reply following the attribute"
    elif name == b"push":
        if not resp3:
            return CommandError("RESP2 is not supported by this command")
        # a push frame is not the command's reply: the reply follows it, for clients that drop pushes
        encode(Push((b"server-cpu-usage", 42)), resp3, out)
        value = b"Some real reply following the push reply"
    elif name == b"true":
        value = True
    elif name == b"false":
        value = False
    elif name == b"verbatim":
        value = Verbatim(b"This is a verbatim\nstring")
    else:
        return CommandError("Wrong protocol type name. Please use one of the following: "
                            "string|integer|double|bignum|null|array|set|map|attrib|push|verbatim|true|false")
    return Raw(b"".join(out) + render(value, resp3))


def cmd_debug(c, args):
    sub, n = bytes(args[1]).lower(), len(args)
    if sub == b"help" and n == 2:
        return help_reply(args, _HELP)
    operator_only(c, "debug")
    if sub == b"protocol" and n == 3:
        return protocol_reply(bytes(args[2]).lower(), c.resp3)
    if sub == b"sleep" and n == 3:
        seconds = strtod(bytes(args[2]))
        if math.isfinite(seconds) and seconds > 0:
            time.sleep(int(seconds * 1_000_000) / 1_000_000)  # the whole node stops, as redis does
        return OK
    if sub == b"set-active-expire" and n == 3:
        c.ctx.keyspace.active_expire = atoi(bytes(args[2])) != 0
        return OK
    if sub == b"error" and n == 3:
        return Raw(b"-" + bytes(args[2]).replace(b"\r", b" ").replace(b"\n", b" ") + b"\r\n")
    if sub == b"log" and n == 3:
        text = bytes(args[2]).decode("utf-8", "backslashreplace")
        log.warning("DEBUG LOG: %s", text.replace("\r", "\\r").replace("\n", "\\n"))
        return OK
    raise CommandError(f"unknown subcommand or wrong number of arguments for '{echo(args[1], 128)}'. "
                       f"Try {echo(bytes(args[0]).upper())} HELP.")


def register(t: CommandTable) -> None:
    t.add("debug", -2, PROTECTED, cmd_debug)
