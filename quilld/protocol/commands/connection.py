"""Connection commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, SCOPE (CLIENT and RESET: client.py).

Password guessing is slowed per user and per client address (`AuthThrottle`, the node's:
context/auth_throttle.py, which the gateway's API keys may share): once a user
name, or an address, has failed `security.auth_throttle_after` times within
`auth_throttle_window_ms`, each further failure naming that user or coming from that address
is answered only after a delay that doubles with every failure, up to `auth_delay_max_ms`.
A right password is answered at once. Because of that, an answer that does not come at once
tells a guesser its guess was wrong without waiting for it; so once an address (or a user
name) has AUTH_UNANSWERED failures waiting for their answer, a further attempt from it (or
for it) is checked only when the first of them is answered, or auth_delay_max_ms after it
came, whichever is first: right or wrong, never refused. The waits are deferred replies
marked `on_purpose`: the event loop never blocks, and an EXEC never holds the node for them
(commands/multi.py). Cluster peers' PEERAUTH (cluster.py) has a throttle of its own, the same way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from quilld.context.auth_throttle import AuthThrottle
from quilld.errors import CommandError, NoAuth, QuillError, WrongPass, echo
from quilld.model import IdentityScope, Pending
from quilld.protocol.commands.common import parse_int, text
from quilld.protocol.info import REDIS_VERSION
from quilld.protocol.resp import OK, PONG, Status
from quilld.protocol.table import FAST, NOAUTH, CommandTable
from quilld.security import LoginError, split_login

_SYNTAX = CommandError("syntax error")
_WRONGPASS = "invalid username-password pair or user is disabled."


class NoProto(QuillError):
    prefix = "NOPROTO"


def cmd_ping(c, args):
    if len(args) > 2:
        raise CommandError("wrong number of arguments for 'ping' command")
    if c.channels and not c.resp3:  # a RESP2 subscriber: as a message (redis's pingCommand)
        return [b"pong", bytes(args[1]) if len(args) == 2 else b""]
    if len(args) == 2:
        return bytes(args[1])
    return PONG


def cmd_echo(c, args):
    return bytes(args[1])


def client_ip(c) -> str:
    return c.addr.rpartition(":")[0] or c.addr


def _credentials_match(users, user: bytes, password: bytes) -> bool:
    """Users.check on the bytes a client sent. Configured users and passwords are text, so
    bytes that are not UTF-8 match nobody; the comparison's work is done all the same."""
    try:
        name, secret = user.decode(), password.decode()
    except UnicodeDecodeError:
        name, secret = "", ""
        users.check(name, secret)
        return False
    try:
        return users.check(name, secret)
    except TypeError:  # hmac.compare_digest refuses non-ASCII str, as Users.check does for an
        return False   # unknown user: such a user matches nothing


def _login_user(login: bytes) -> tuple[bytes, tuple[bytes, bytes, bytes] | None]:
    try:
        return split_login(login)
    except LoginError as e:
        raise CommandError(f"invalid scope in the user name: {e}") from None


def _authenticate(c, login: bytes, password: bytes) -> None:
    """Log the session in as `login`'s user, in the scope it names (`user~model~tokenizer[~adapter]`)
    if any, or raise WRONGPASS."""
    users = c.ctx.users
    user, fields = _login_user(login)
    if not users.required and user == b"default":
        pass  # redis: the default user has nopass (users ACL SETUSER added log in with their own)
    elif not _credentials_match(users, user, password):
        raise WrongPass(_WRONGPASS)
    name = user.decode()
    c.login(name, None if fields is None else IdentityScope(name, *map(text, fields)))
    c.ctx.clients.auth_changed(c)


async def _late(answer: Any, delay: float) -> Any:
    await asyncio.sleep(delay)
    if isinstance(answer, BaseException):
        raise answer
    return answer


def after_throttle(c, throttle: AuthThrottle, user: bytes, check: Callable[[], Any], counter: str,
                   failures: str, slowed: bool = True) -> Any:
    """`check()`'s reply at once, or its WrongPass counted in `failures` and remembered by the
    throttle: at once, or late by the throttle's delay (a deferred reply, counted in `counter`).
    While `user` or the client's address has too many failures unanswered, the check itself
    waits (counted too). `slowed=False`: failures are counted and answered at once."""
    cfg, addr, stats = c.ctx.cfg.security, client_ip(c), c.ctx.stats

    def checked():
        try:
            return check()
        except WrongPass as e:
            stats[failures] += 1
            now = time.monotonic()
            delay = throttle.failed(cfg, user, addr, now)
            if not delay or not slowed:
                raise
            stats[counter] += 1
            return Pending(_late(e, delay), on_purpose=True, answer=e, due=now + delay)

    start = time.monotonic()
    ahead = throttle.admit_in(cfg, user, addr, start) if slowed else 0.0
    if not ahead:
        return checked()
    stats[counter] += 1

    async def admitted():
        wait, deadline = ahead, start + cfg.auth_delay_max_ms / 1000
        while wait > 0:
            await asyncio.sleep(wait)
            now = time.monotonic()
            wait = min(throttle.admit_in(cfg, user, addr, now), deadline - now)
        reply = checked()
        return await reply.awaitable if reply.__class__ is Pending else reply

    return Pending(admitted(), on_purpose=True)


def _after_auth(c, throttle: AuthThrottle, login: bytes, password: bytes, then: Callable[[], Any]) -> Any:
    """Check the credentials, then answer with `then()`; a failure at once, or late (the throttle's)."""
    user, _ = _login_user(login)

    def check():
        _authenticate(c, login, password)
        return then()

    return after_throttle(c, throttle, user, check, "auth_throttled", "auth_failures", c.ctx.users.required)


def cmd_auth(c, args, throttle: AuthThrottle):
    if len(args) > 3:
        raise _SYNTAX
    if len(args) == 2:
        if not c.ctx.users.default_has_password and not c.ctx.users.required:
            raise CommandError("AUTH <password> called without any password configured for the default user. "
                               "Are you sure your configuration is correct?")
        user, password = b"default", bytes(args[1])
    else:
        user, password = bytes(args[1]), bytes(args[2])
    return _after_auth(c, throttle, user, password, lambda: OK)


def cmd_hello(c, args, throttle: AuthThrottle):
    """As redis 7 does it: the version, then every option checked, then AUTH, then the rest."""
    proto = None
    if len(args) >= 2:
        proto = parse_int(args[1], "Protocol version is not an integer or out of range")
        if proto not in (2, 3):
            raise NoProto("unsupported protocol version")
    name = credentials = None
    i = 2
    while i < len(args):
        opt = bytes(args[i]).upper()
        more = len(args) - i - 1
        if opt == b"AUTH" and more >= 2:
            credentials = bytes(args[i + 1]), bytes(args[i + 2])
            i += 3
        elif opt == b"SETNAME" and more >= 1:
            name = _client_name(args[i + 1])
            i += 2
        else:
            raise CommandError(f"Syntax error in HELLO option '{echo(args[i])}'")

    def finish():
        if not c.authenticated:
            raise NoAuth("HELLO must be called with the client already authenticated, otherwise the "
                         "HELLO AUTH <user> <pass> option can be used to authenticate the client "
                         "and select the RESP protocol version at the same time")
        if name is not None:
            c.name = name or None
        if proto is not None:
            c.resp3 = proto == 3
            if c.channels:  # a subscriber: RESP2's subscribed context starts or ends
                c.subscriptions_changed()
        return {b"server": b"redis", b"version": REDIS_VERSION.encode(), b"proto": 3 if c.resp3 else 2,
                b"id": c.id, b"mode": b"standalone", b"role": b"master", b"modules": []}

    if credentials is None:
        return finish()
    return _after_auth(c, throttle, *credentials, finish)


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
    t.add("auth", -2, f"{NOAUTH} {FAST}", lambda c, args: cmd_auth(c, args, c.ctx.auth_throttle),
          "Authenticates the connection.", "connection")
    t.add("hello", -1, f"{NOAUTH} {FAST}", lambda c, args: cmd_hello(c, args, c.ctx.auth_throttle),
          "Handshakes with the server.", "connection", "6.0.0")
    t.add("select", 2, FAST, cmd_select, "Changes the selected database.", "connection")
    t.add("quit", -1, f"{NOAUTH} {FAST}", cmd_quit, "Closes the connection.", "connection")
    t.add("scope", -3, FAST, cmd_scope, "Sets the connection's identity scope: model tokenizer [adapter].",
          "quillcache", "0.1.0")
