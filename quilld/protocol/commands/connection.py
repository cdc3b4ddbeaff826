"""Connection commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, CLIENT, SCOPE."""

from __future__ import annotations

import time

from quilld.errors import CommandError, NoAuth, QuillError, WrongPass
from quilld.model import IdentityScope
from quilld.protocol.commands.common import parse_int, text
from quilld.protocol.info import REDIS_VERSION
from quilld.protocol.resp import OK, PONG, Status
from quilld.protocol.table import FAST, NOAUTH, CommandTable

_SYNTAX = CommandError("syntax error")


class NoProto(QuillError):
    prefix = "NOPROTO"


def cmd_ping(c, args):
    if len(args) > 2:
        raise CommandError("wrong number of arguments for 'ping' command")
    if len(args) == 2:
        return bytes(args[1])
    return PONG


def cmd_echo(c, args):
    return bytes(args[1])


def _authenticate(c, user: str, password: str) -> None:
    users = c.ctx.users
    if not users.required:
        if user != "default":  # redis: the default user has nopass; nobody else exists
            raise WrongPass("invalid username-password pair or user is disabled.")
        c.login("default")
        return
    if not users.check(user, password):
        c.ctx.stats["auth_failures"] += 1
        raise WrongPass("invalid username-password pair or user is disabled.")
    c.login(user)


def cmd_auth(c, args):
    if len(args) > 3:
        raise _SYNTAX
    if len(args) == 2:
        if not c.ctx.users.default_has_password and not c.ctx.users.required:
            raise CommandError("AUTH <password> called without any password configured for the default user. "
                               "Are you sure your configuration is correct?")
        _authenticate(c, "default", text(args[1]))
    else:
        _authenticate(c, text(args[1]), text(args[2]))
    c.ctx.clients.auth_changed(c)
    return OK


def cmd_hello(c, args):
    proto = None
    if len(args) >= 2:
        try:
            proto = parse_int(args[1])
        except CommandError:
            raise CommandError("Protocol version is not an integer or out of range") from None
        if proto not in (2, 3):
            raise NoProto("unsupported protocol version")
    name = None
    i = 2
    while i < len(args):
        opt = bytes(args[i]).upper()
        more = len(args) - i - 1
        if opt == b"AUTH" and more >= 2:
            _authenticate(c, text(args[i + 1]), text(args[i + 2]))
            c.ctx.clients.auth_changed(c)
            i += 3
        elif opt == b"SETNAME" and more >= 1:
            name = _client_name(args[i + 1])
            i += 2
        else:
            raise CommandError(f"Syntax error in HELLO option '{text(args[i])}'")
    if not c.authenticated:
        raise NoAuth("HELLO must be called with the client already authenticated, otherwise the "
                     "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client "
                     "and select the RESP protocol version at the same time")
    if name is not None:
        c.name = name or None
    if proto is not None:
        c.resp3 = proto == 3
    return {b"server": b"redis", b"version": REDIS_VERSION.encode(), b"proto": 3 if c.resp3 else 2,
            b"id": c.id, b"mode": b"standalone", b"role": b"master", b"modules": []}


def cmd_select(c, args):
    db = parse_int(args[1])
    if db != 0:
        raise CommandError("DB index is out of range")
    return OK


def cmd_quit(c, args):
    c.closing = True
    return Status(b"OK")  # not the shared OK: the shell checks `closing` on this path


def _client_name(raw: bytes) -> bytes:
    raw = bytes(raw)
    if any(b < 33 or b > 126 for b in raw):
        raise CommandError("Client names cannot contain spaces, newlines or special characters.")
    return raw


def cmd_client_setname(c, args):
    name = _client_name(args[2])
    c.name = name or None
    return OK


def cmd_client_getname(c, args):
    return c.name


def cmd_client_id(c, args):
    return c.id


def cmd_client_setinfo(c, args):
    attr = bytes(args[2]).upper()
    if attr not in (b"LIB-NAME", b"LIB-VER"):
        raise CommandError(f"Unrecognized option '{text(args[2])}'")
    value = bytes(args[3])
    if any(b < 33 or b > 126 for b in value):
        raise CommandError(f"{text(args[2]).lower()} cannot contain spaces, newlines or special characters.")
    if attr == b"LIB-NAME":
        c.lib_name = value
    else:
        c.lib_ver = value
    return OK


def client_line(c, now: float) -> bytes:
    name = c.name or b""
    fields = (
        f"id={c.id} addr={c.addr} laddr={c.laddr} fd=-1 name={name.decode()} "
        f"age={int(now - c.created)} idle={int(now - c.last_active)} flags=N db=0 sub=0 psub=0 ssub=0 "
        f"multi=-1 qbuf={c.qbuf} qbuf-free=0 argv-mem=0 multi-mem=0 rbs=0 rbp=0 obl=0 oll=0 omem=0 "
        f"tot-mem=0 events=r cmd={c.last_cmd} user={c.user} redir=-1 resp={3 if c.resp3 else 2} "
        f"lib-name={c.lib_name.decode()} lib-ver={c.lib_ver.decode()}"
    )
    return fields.encode() + b"\n"


def cmd_client_list(c, args):
    now = time.monotonic()
    return b"".join(client_line(s, now) for s in c.ctx.clients.sessions.values())


def cmd_client_info(c, args):
    return client_line(c, time.monotonic())


def cmd_client_help(c, args):
    return [b"CLIENT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            b"GETNAME", b"    Return the name of the current connection.",
            b"ID", b"    Return the ID of the current connection.",
            b"INFO", b"    Return information about the current client connection.",
            b"LIST", b"    Return information about client connections.",
            b"SETINFO <option> <value>", b"    Set client meta attr. Options are: LIB-NAME, LIB-VER.",
            b"SETNAME <name>", b"    Assign the name <name> to the current connection.",
            b"HELP", b"    Print this help."]


_MAX_SCOPE_FIELD = 256


def cmd_scope(c, args):
    if len(args) > 4:
        raise CommandError("wrong number of arguments for 'scope' command")
    parts = []
    for raw in args[1:]:
        if len(raw) > _MAX_SCOPE_FIELD or any(b < 32 or b == 127 for b in bytes(raw)):
            raise CommandError(f"scope fields are at most {_MAX_SCOPE_FIELD} printable bytes")
        parts.append(text(raw))
    model, tokenizer = parts[0], parts[1]
    adapter = parts[2] if len(parts) > 2 else ""
    c.set_scope(IdentityScope(c.user, model, tokenizer, adapter))
    return OK


def register(t: CommandTable) -> None:
    t.add("ping", -1, FAST, cmd_ping, "Returns the server's liveliness response.", "connection")
    t.add("echo", 2, FAST, cmd_echo, "Returns the given string.", "connection")
    t.add("auth", -2, f"{NOAUTH} {FAST}", cmd_auth, "Authenticates the connection.", "connection")
    t.add("hello", -1, f"{NOAUTH} {FAST}", cmd_hello, "Handshakes with the server.", "connection", "6.0.0")
    t.add("select", 2, FAST, cmd_select, "Changes the selected database.", "connection")
    t.add("quit", -1, f"{NOAUTH} {FAST}", cmd_quit, "Closes the connection.", "connection")
    t.add("scope", -3, FAST, cmd_scope, "Sets the connection's identity scope: model tokenizer [adapter].",
          "quillcache", "0.1.0")
    sub = CommandTable()
    sub.add("client|setname", 3, FAST, cmd_client_setname, "Sets the connection name.", "connection", "2.6.9")
    sub.add("client|getname", 2, FAST, cmd_client_getname, "Returns the name of the connection.", "connection")
    sub.add("client|id", 2, FAST, cmd_client_id, "Returns the unique client ID of the connection.", "connection")
    sub.add("client|setinfo", 4, FAST, cmd_client_setinfo, "Sets information specific to the client.",
            "connection", "7.2.0")
    sub.add("client|list", -2, "", cmd_client_list, "Lists open connections.", "connection")
    sub.add("client|info", 2, "", cmd_client_info, "Returns information about the connection.", "connection")
    sub.add("client|help", 2, "", cmd_client_help, "Returns helpful text about the different subcommands.",
            "connection")
    t.add("client", -2, "", lambda c, a: None, "A container for client connection commands.", "connection",
          subcommands={name.split(b"|")[1]: cmd for name, cmd in sub.commands.items()})
