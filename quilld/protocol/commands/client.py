"""CLIENT (LIST, INFO, KILL, ID, GETNAME, SETNAME, REPLY, PAUSE, UNPAUSE, NO-EVICT, TRACKING,
CACHING, GETREDIR, TRACKINGINFO, HELP) and RESET, as redis 7.0.15 answers them.

A tenant sees and kills its own connections only (their user is its user); a node without
passwords has one user, `default`, who sees everyone. Pausing every client is the
operator's (`default`'s) alone. CLIENT LIST's figures are the connection's own: `qbuf` the
bytes received and not yet run (with the command being run, as redis counts it),
`qbuf-free` what the parser's buffer holds unused, `argv-mem` the arguments of the command
being run or assembled, `omem` what the transport has not sent yet, `tot-mem` their sum.
`redir` and the flags `t`, `R`, `B` are CLIENT TRACKING's (protocol/tracking.py), `P` a
subscription to its channel. CLIENT SETINFO is unknown, as in redis 7.0.
"""

from __future__ import annotations

import time

from quilld.errors import CommandError, NoPerm, echo
from quilld.protocol.commands.command_docs import help_reply
from quilld.protocol.commands.connection import _client_name
from quilld.protocol.resp import OK, OrderedSet, Raw, Status, Verbatim, array_header, bulk_header
from quilld.protocol.table import FAST, NOAUTH, CommandTable
from quilld.protocol.tracking import MAX_PREFIXES
from quilld.protocol.transactions import multi_mem

_SYNTAX = CommandError("syntax error")
NO_REPLY = Raw(b"")  # CLIENT REPLY OFF and SKIP send nothing back
REPLY_ON, REPLY_OFF, REPLY_SKIP_NEXT = 0, 1, 3  # Session.reply_mode (2: the shell is skipping this reply)
CLIENT_TYPES = {b"normal": "normal", b"master": "master", b"slave": "replica", b"replica": "replica",
                b"pubsub": "pubsub"}
_EMPTY_BUFFER = bytearray().__sizeof__()


def operator_only(c, name: str) -> None:
    """Commands that change the node for every tenant are the `default` user's (redis's ACL error)."""
    if c.user != "default":
        raise NoPerm(f"this user has no permissions to run the '{name}' command")


def _connections(c):
    """The connections `c` may see: its user's (all of them on a node without passwords)."""
    return [conn for conn in c.ctx.clients.connections.values() if conn.session.user == c.user]


def _kind(s) -> str:
    """redis's getClientType: a subscribed connection is a pubsub client, every other one normal."""
    return "pubsub" if s.channels else "normal"


def _command_bytes(args: list) -> int:
    return sum(len(bulk_header(len(a))) + len(a) + 2 for a in args) + len(array_header(len(args)))


def client_line(conn, now: float, current: list | None = None) -> str:
    """One CLIENT LIST line (redis 7.0's fields); `current`: the arguments of the command `conn`'s
    session is running now (CLIENT LIST and CLIENT INFO's own), counted as redis counts them."""
    s, parser, transport = conn.session, conn.parser, conn.transport
    pending = parser.pending_bytes()
    qbuf = pending + (_command_bytes(current) if current else 0)
    buf = getattr(parser, "_buf", None)  # the parser's own buffer (the codec has no public view of it)
    qbuf_free = max(buf.__sizeof__() - _EMPTY_BUFFER - len(buf) - 1, 0) if isinstance(buf, bytearray) else 0
    argv = sum(len(a) for a in current) if current else parser.query_bytes() - pending
    omem = transport.get_write_buffer_size() if transport is not None else 0
    sock = transport.get_extra_info("socket") if transport is not None else None
    fd = sock.fileno() if sock is not None else -1
    # redis's order (networking.c catClientInfoString): O x d c U e
    t = s.tracking
    tflags = "" if t is None else "t" + ("R" if t.broken else "") + ("B" if t.bcast else "")
    flags = ("O" if s.monitor else "") + ("P" if s.channels else "") + ("x" if s.multi is not None else "") + (
        tflags) + ("d" if s.cas_dirty else "") + (
        "c" if s.closing else "") + ("U" if s.unix else "") + ("e" if s.no_evict else "")
    mmem = multi_mem(s)
    reading = transport is not None and getattr(transport, "is_reading", lambda: True)()
    events = ("r" if reading else "") + ("w" if omem else "")
    name = (s.name or b"").decode("utf-8", "surrogateescape")
    return (f"id={s.id} addr={s.addr} laddr={s.laddr} fd={fd} name={name} age={int(now - s.created)} "
            f"idle={int(now - s.last_active)} flags={flags or 'N'} db=0 sub={len(s.channels)} psub=0 ssub=0 "
            f"multi={-1 if s.multi is None else len(s.multi)} qbuf={qbuf} "
            f"qbuf-free={qbuf_free} argv-mem={argv} multi-mem={mmem} rbs=0 rbp=0 obl=0 oll=0 omem={omem} "
            f"tot-mem={qbuf + qbuf_free + argv + mmem + omem} events={events} cmd={s.last_cmd} user={s.user} redir={-1 if t is None else t.redirect} "
            f"resp={3 if s.resp3 else 2}\n")


def _line(c, conn, now: float, args: list) -> str:
    return client_line(conn, now, args if conn.session is c else None)


def cmd_client_list(c, args):
    now, conns = time.monotonic(), _connections(c)
    if len(args) == 4 and bytes(args[2]).lower() == b"type":
        kind = CLIENT_TYPES.get(bytes(args[3]).lower())
        if kind is None:
            raise CommandError(f"Unknown client type '{echo(args[3])}'")
        conns = [conn for conn in conns if _kind(conn.session) == kind]
    elif len(args) > 3 and bytes(args[2]).lower() == b"id":
        ids = []
        for raw in args[3:]:
            try:
                ids.append(_int(raw))
            except ValueError:
                raise CommandError("Invalid client ID") from None
        by_id = {conn.session.id: conn for conn in conns}
        conns = [by_id[i] for i in ids if i in by_id]
    elif len(args) != 2:
        raise _SYNTAX
    return Verbatim("".join(_line(c, conn, now, args) for conn in conns).encode("utf-8", "surrogateescape"))


def cmd_client_info(c, args):
    conn = c.ctx.clients.connections.get(c.id)
    if conn is None:  # a session without a connection (handler tests)
        return Verbatim(b"")
    return Verbatim(client_line(conn, time.monotonic(), args).encode("utf-8", "surrogateescape"))


def _int(raw) -> int:
    raw = bytes(raw)
    if not raw or not (raw.lstrip(b"-").isdigit()) or len(raw) > 20 or (raw[:1] == b"0" and len(raw) > 1) or \
            raw.startswith(b"-0"):
        raise ValueError(raw)
    value = int(raw)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(raw)
    return value


def cmd_client_kill(c, args):
    """CLIENT KILL addr | CLIENT KILL [ID id] [TYPE type] [ADDR addr] [LADDR addr] [USER user] [SKIPME yes|no]"""
    addr = laddr = user = kind = None
    cid, skipme = 0, True
    if len(args) == 3:
        addr, skipme = bytes(args[2]), False  # the old form may kill the caller
    else:
        i = 2
        while i < len(args):
            opt, more = bytes(args[i]).lower(), i + 1 < len(args)
            if not more:
                raise _SYNTAX
            value = bytes(args[i + 1])
            if opt == b"id":
                try:
                    cid = _int(value)
                except ValueError:
                    cid = 0
                if cid < 1:
                    raise CommandError("client-id should be greater than 0")
            elif opt == b"type":
                kind = CLIENT_TYPES.get(value.lower())
                if kind is None:
                    raise CommandError(f"Unknown client type '{echo(value)}'")
            elif opt == b"addr":
                addr = value
            elif opt == b"laddr":
                laddr = value
            elif opt == b"user":
                if value.decode("utf-8", "surrogateescape") != c.user and not _user_exists(c, value):
                    raise CommandError(f"No such user '{echo(value)}'")
                user = value.decode("utf-8", "surrogateescape")
            elif opt == b"skipme":
                if value.lower() not in (b"yes", b"no"):
                    raise _SYNTAX
                skipme = value.lower() == b"yes"
            else:
                raise _SYNTAX
            i += 2
    killed = 0
    for conn in _connections(c):
        s = conn.session
        if (addr is not None and s.addr.encode() != addr) or (laddr is not None and s.laddr.encode() != laddr):
            continue
        if (kind is not None and kind != _kind(s)) or (cid and s.id != cid) or (user is not None and s.user != user):
            continue
        if s is c:
            if skipme:
                continue
            c.closing = True  # after this reply, as redis's CLIENT_CLOSE_AFTER_REPLY
        else:
            conn.transport.close()
        killed += 1
    if len(args) == 3:
        if not killed:
            raise CommandError("No such client")
        return OK
    return killed


def _user_exists(c, name: bytes) -> bool:
    """Whether `name` is a user the caller may name: only the operator may name others."""
    users = c.ctx.users
    if c.user != "default":
        return False  # a tenant's view has no other users in it (as its CLIENT LIST has none)
    text = name.decode("utf-8", "surrogateescape")
    return users.exists(text)


def cmd_client_reply(c, args):
    mode = bytes(args[2]).lower()
    if mode == b"on":
        c.reply_mode = REPLY_ON
        return Status(b"OK")  # not the shared OK: the shell looks at the mode after this reply
    if mode == b"off":
        c.reply_mode = REPLY_OFF
    elif mode == b"skip":
        if c.reply_mode != REPLY_OFF:
            c.reply_mode = REPLY_SKIP_NEXT
    else:
        raise _SYNTAX
    return NO_REPLY


def cmd_client_no_evict(c, args):
    mode = bytes(args[2]).lower()
    if mode not in (b"on", b"off"):
        raise _SYNTAX
    c.no_evict = mode == b"on"  # quilld evicts values, never clients: this is a flag in CLIENT LIST
    return OK


def cmd_client_pause(c, args):
    """CLIENT PAUSE timeout-ms [WRITE|ALL]: every client's commands (or only its writes) wait."""
    operator_only(c, "client|pause")
    mode = "all"
    if len(args) == 4:
        mode = bytes(args[3]).lower().decode("latin-1")
        if mode not in ("write", "all"):
            raise CommandError("CLIENT PAUSE mode must be WRITE or ALL")
    try:
        ms = _int(args[2])
    except ValueError:
        raise CommandError("timeout is not an integer or out of range") from None
    if ms < 0:
        raise CommandError("timeout is negative")
    c.ctx.clients.pause(mode, ms / 1000)
    return Status(b"OK")  # not the shared OK: the shell looks at the pause after this reply


def cmd_client_unpause(c, args):
    operator_only(c, "client|unpause")
    c.ctx.clients.unpause()
    return OK


def cmd_client_tracking(c, args):
    """CLIENT TRACKING ON|OFF [REDIRECT id] [BCAST] [PREFIX p ...] [OPTIN] [OPTOUT] [NOLOOP],
    checked as redis checks it, in its order and with its errors (protocol/tracking.py keeps
    the table). REDIRECT names a connection of the caller's own user (a tenant sees no other)."""
    redirect, prefixes = 0, []
    bcast = optin = optout = noloop = False
    i, n = 3, len(args)
    while i < n:
        opt = bytes(args[i]).lower()
        more = i + 1 < n
        if opt == b"redirect" and more:
            i += 1
            if redirect:
                raise CommandError("A client can only redirect to a single other client")
            try:
                redirect = _int(args[i])
            except ValueError:
                raise CommandError("value is not an integer or out of range") from None
            target = c.ctx.clients.sessions.get(redirect)
            if target is None or target.user != c.user:
                raise CommandError("The client ID you want redirect to does not exist")
        elif opt == b"bcast":
            bcast = True
        elif opt == b"optin":
            optin = True
        elif opt == b"optout":
            optout = True
        elif opt == b"noloop":
            noloop = True
        elif opt == b"prefix" and more:
            i += 1
            prefixes.append(bytes(args[i]))
        else:
            raise _SYNTAX
        i += 1
    on = bytes(args[2]).lower()
    tracking = c.ctx.clients.tracking
    if on == b"on":
        t = c.tracking
        if not bcast and prefixes:
            raise CommandError("PREFIX option requires BCAST mode to be enabled")
        if t is not None and t.bcast != bcast:
            raise CommandError("You can't switch BCAST mode on/off before disabling tracking for this client, "
                               "and then re-enabling it with a different mode.")
        if bcast and (optin or optout):
            raise CommandError("OPTIN and OPTOUT are not compatible with BCAST")
        if optin and optout:
            raise CommandError("You can't specify both OPTIN mode and OPTOUT mode")
        if t is not None and ((optin and t.optout) or (optout and t.optin)):
            raise CommandError("You can't switch OPTIN/OPTOUT mode before disabling tracking for this client, "
                               "and then re-enabling it with a different mode.")
        if bcast:
            clash = tracking.overlap(t.prefixes if t is not None else [], prefixes)
            if clash is not None:
                raise CommandError(clash.decode("utf-8", "surrogateescape"))
            if len(set(prefixes) | set(t.prefixes if t is not None else ())) > MAX_PREFIXES:
                raise CommandError(f"a connection may have at most {MAX_PREFIXES} BCAST prefixes in quilld "
                                   "(each change of a key of its scope is matched against them)")
        tracking.enable(c, redirect, bcast, optin, optout, noloop, prefixes)
    elif on == b"off":
        tracking.disable(c)
    else:
        raise _SYNTAX
    return OK


def cmd_client_caching(c, args):
    """CLIENT CACHING YES|NO: whether the next command's reads are remembered (OPTIN, OPTOUT)."""
    t = c.tracking
    if t is None:
        raise CommandError("CLIENT CACHING can be called only when the client is in tracking mode with OPTIN or "
                           "OPTOUT mode enabled")
    opt = bytes(args[2]).lower()
    if opt == b"yes":
        if not t.optin:
            raise CommandError("CLIENT CACHING YES is only valid when tracking is enabled in OPTIN mode.")
    elif opt == b"no":
        if not t.optout:
            raise CommandError("CLIENT CACHING NO is only valid when tracking is enabled in OPTOUT mode.")
    else:
        raise _SYNTAX
    t.caching = True
    return OK


def cmd_client_getredir(c, args):
    """The connection the invalidations go to: 0 this one, -1 when tracking is off."""
    return -1 if c.tracking is None else c.tracking.redirect


def cmd_client_trackinginfo(c, args):
    t = c.tracking
    if t is None:
        return {b"flags": OrderedSet((b"off",)), b"redirect": -1, b"prefixes": []}
    return {b"flags": OrderedSet((b"on", *t.flags())), b"redirect": t.redirect, b"prefixes": sorted(t.prefixes)}


def cmd_client_setname(c, args):
    name = _client_name(args[2])
    c.name = name or None
    return OK


def cmd_client_getname(c, args):
    return c.name


def cmd_client_id(c, args):
    return c.id


_HELP = (
    "CACHING (YES|NO)",
    "    Enable/disable tracking of the keys for next command in OPTIN/OPTOUT modes.",
    "GETREDIR",
    "    Return the client ID we are redirecting to when tracking is enabled.",
    "GETNAME",
    "    Return the name of the current connection.",
    "ID",
    "    Return the ID of the current connection.",
    "INFO",
    "    Return information about the current client connection.",
    "KILL <ip:port>",
    "    Kill connection made from <ip:port>.",
    "KILL <option> <value> [<option> <value> [...]]",
    "    Kill connections. Options are:",
    "    * ADDR (<ip:port>|<unixsocket>:0)",
    "      Kill connections made from the specified address",
    "    * LADDR (<ip:port>|<unixsocket>:0)",
    "      Kill connections made to specified local address",
    "    * TYPE (NORMAL|MASTER|REPLICA|PUBSUB)",
    "      Kill connections by type.",
    "    * USER <username>",
    "      Kill connections authenticated by <username>.",
    "    * SKIPME (YES|NO)",
    "      Skip killing current connection (default: yes).",
    "LIST [options ...]",
    "    Return information about client connections. Options:",
    "    * TYPE (NORMAL|MASTER|REPLICA|PUBSUB)",
    "      Return clients of specified type.",
    "UNPAUSE",
    "    Stop the current client pause, resuming traffic.",
    "PAUSE <timeout> [WRITE|ALL]",
    "    Suspend all, or just write, clients for <timeout> milliseconds.",
    "REPLY (ON|OFF|SKIP)",
    "    Control the replies sent to the current connection.",
    "SETNAME <name>",
    "    Assign the name <name> to the current connection.",
    "TRACKING (ON|OFF) [REDIRECT <id>] [BCAST] [PREFIX <prefix> [...]]",
    "         [OPTIN] [OPTOUT] [NOLOOP]",
    "    Control server assisted client side caching.",
    "TRACKINGINFO",
    "    Report tracking status for the current connection.",
    "NO-EVICT (ON|OFF)",
    "    Protect current client connection from eviction.",
)


def cmd_client_help(c, args):
    return help_reply(args, _HELP)


def cmd_reset(c, args):
    """RESET: the connection as it was when it connected (RESP2, no name, replies on, not
    monitoring, user `default`, which must AUTH again when it has a password)."""
    c.ctx.clients.monitor_off(c)
    c.reset()
    c.ctx.clients.auth_changed(c)
    return Status(b"RESET")


def register(t: CommandTable) -> None:
    sub = CommandTable()
    sub.add("client|caching", 3, "", cmd_client_caching)
    sub.add("client|getname", 2, FAST, cmd_client_getname)
    sub.add("client|getredir", 2, FAST, cmd_client_getredir)
    sub.add("client|help", 2, "", cmd_client_help)
    sub.add("client|id", 2, FAST, cmd_client_id)
    sub.add("client|info", 2, "", cmd_client_info)
    sub.add("client|kill", -3, "", cmd_client_kill)
    sub.add("client|list", -2, "", cmd_client_list)
    sub.add("client|no-evict", 3, "", cmd_client_no_evict)
    sub.add("client|pause", -3, "", cmd_client_pause)
    sub.add("client|reply", 3, "", cmd_client_reply)
    sub.add("client|setname", 3, FAST, cmd_client_setname)
    sub.add("client|tracking", -3, "", cmd_client_tracking)
    sub.add("client|trackinginfo", 2, "", cmd_client_trackinginfo)
    sub.add("client|unpause", 2, "", cmd_client_unpause)
    t.add("client", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: cmd for n, cmd in sub.commands.items()})
    t.add("reset", 1, f"{NOAUTH} {FAST}", cmd_reset)
