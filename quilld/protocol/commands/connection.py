"""Connection commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, SCOPE (CLIENT and RESET: client.py).

Password guessing is slowed per client address (`AuthThrottle`): once an address
has failed `security.auth_throttle_after` times within `auth_throttle_window_ms`,
each further AUTH (or HELLO ... AUTH) from it is checked only after a delay that
doubles with every failure, up to `auth_delay_max_ms`, and one at a time across
all its connections; an attempt that would wait longer is refused at once. The
wait is a deferred reply: the event loop never blocks, and a correct password
from an address that is not failing is answered at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Callable

from quilld.config import SecurityConfig
from quilld.errors import CommandError, NoAuth, QuillError, WrongPass, echo
from quilld.model import IdentityScope, Pending
from quilld.protocol.commands.common import parse_int, text
from quilld.protocol.info import REDIS_VERSION
from quilld.protocol.resp import OK, PONG, Status
from quilld.protocol.table import FAST, NOAUTH, CommandTable
from quilld.security import LoginError, split_login

_SYNTAX = CommandError("syntax error")
_WRONGPASS = "invalid username-password pair or user is disabled."
AUTH_THROTTLE_ADDRESSES = 65536  # client addresses whose failures are remembered (oldest forgotten first)
AUTH_DELAY_FIRST = 0.05  # seconds: the first throttled attempt's delay; each failure doubles it


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


class _Failures:
    __slots__ = ("count", "last", "next_at")

    def __init__(self) -> None:
        self.count = 0  # failures within the window
        self.last = 0.0  # when the last one happened
        self.next_at = 0.0  # no attempt from this address is checked before this time


class AuthThrottle:
    """Failed AUTH attempts per client address, and how long the next attempt waits."""

    def __init__(self) -> None:
        self._by_addr: OrderedDict[str, _Failures] = OrderedDict()

    def _entry(self, cfg: SecurityConfig, addr: str, now: float) -> _Failures | None:
        f = self._by_addr.get(addr)
        if f is not None and now - f.last > cfg.auth_throttle_window_ms / 1000:
            del self._by_addr[addr]  # quiet for a whole window: starts afresh
            return None
        return f

    def wait(self, cfg: SecurityConfig, addr: str, now: float) -> float | None:
        """Seconds an attempt from `addr` waits before it is checked (0: at once), or None when it
        would wait longer than auth_delay_max_ms (refused). Reserves the attempt's turn."""
        f = self._entry(cfg, addr, now)
        if f is None or not cfg.auth_throttle_after or f.count < cfg.auth_throttle_after:
            return 0.0
        delay = min(cfg.auth_delay_max_ms / 1000,
                    AUTH_DELAY_FIRST * 2.0 ** min(f.count - cfg.auth_throttle_after, 32))
        at = max(now, f.next_at) + delay
        if at - now > cfg.auth_delay_max_ms / 1000:
            return None
        f.next_at = at
        return at - now

    def failed(self, cfg: SecurityConfig, addr: str, now: float) -> None:
        f = self._entry(cfg, addr, now)
        if f is None:
            if len(self._by_addr) >= AUTH_THROTTLE_ADDRESSES:
                self._by_addr.popitem(last=False)
            f = self._by_addr[addr] = _Failures()
        else:
            self._by_addr.move_to_end(addr)
        f.count += 1
        f.last = now

    def throttled(self) -> int:
        """Addresses whose attempts are slowed now (for tests and INFO)."""
        return len(self._by_addr)


def _client_ip(c) -> str:
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


def _authenticate(c, throttle: AuthThrottle, login: bytes, password: bytes) -> None:
    """Log the session in as `login`'s user, in the scope it names (`user~model~tokenizer[~adapter]`)
    if any, or raise WRONGPASS (counted, and remembered per address)."""
    users = c.ctx.users
    try:
        user, fields = split_login(login)
    except LoginError as e:
        raise CommandError(f"invalid scope in the user name: {e}") from None
    if not users.required and user == b"default":
        pass  # redis: the default user has nopass (users ACL SETUSER added log in with their own)
    elif not _credentials_match(users, user, password):
        c.ctx.stats["auth_failures"] += 1
        throttle.failed(c.ctx.cfg.security, _client_ip(c), time.monotonic())
        raise WrongPass(_WRONGPASS)
    name = user.decode()
    c.login(name, None if fields is None else IdentityScope(name, *map(text, fields)))
    c.ctx.clients.auth_changed(c)


def _after_auth(c, throttle: AuthThrottle, user: bytes, password: bytes, then: Callable[[], Any]) -> Any:
    """Check the credentials, then answer with `then()`: at once, or after the address's
    throttle delay (a deferred reply), or refused when the address is failing too often."""
    cfg = c.ctx.cfg.security
    delay = throttle.wait(cfg, _client_ip(c), time.monotonic()) if c.ctx.users.required else 0.0
    if delay is None:
        c.ctx.stats["auth_throttle_refused"] += 1
        raise CommandError("too many failed AUTH attempts from this address: try again later")
    if not delay:
        _authenticate(c, throttle, user, password)
        return then()
    c.ctx.stats["auth_throttled"] += 1

    async def later():
        await asyncio.sleep(delay)
        _authenticate(c, throttle, user, password)
        return then()

    return Pending(later())


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
    throttle = AuthThrottle()  # one per node (one table per node)
    t.add("auth", -2, f"{NOAUTH} {FAST}", lambda c, args: cmd_auth(c, args, throttle),
          "Authenticates the connection.", "connection")
    t.add("hello", -1, f"{NOAUTH} {FAST}", lambda c, args: cmd_hello(c, args, throttle),
          "Handshakes with the server.", "connection", "6.0.0")
    t.add("select", 2, FAST, cmd_select, "Changes the selected database.", "connection")
    t.add("quit", -1, f"{NOAUTH} {FAST}", cmd_quit, "Closes the connection.", "connection")
    t.add("scope", -3, FAST, cmd_scope, "Sets the connection's identity scope: model tokenizer [adapter].",
          "quillcache", "0.1.0")
