"""Users and passwords: `--requirepass` for user `default`, or a users file.

A users file holds one user per line: `user password`, optionally followed by
the identity scope that user's connections start in, as `model=...`,
`tokenizer=...` and `adapter=...` (each at most once, in any order; values
without whitespace). `#` starts a comment. A line of two words is what it
always was: a user with a password and no scope of its own.

A login name may also carry a scope for its connection alone:
`user~model~tokenizer[~adapter]` (`SCOPE_SEP`). The user name is the one
place every redis URL carries (`redis://alice~llama-3-8b~llama3-tok:pw@host`),
so a client configured by URL alone, pooled and reconnected, always lands in
its scope. User names in the file may therefore not contain `~`.

With neither file nor password, every connection is user `default` and AUTH is
refused as redis refuses it when no password is configured (AUTH as
`default`, or `default~model~tokenizer`, with any password, is accepted).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from quilld.config import SecurityConfig
from quilld.errors import ConfigError
from quilld.model import IdentityScope

SCOPE_SEP = "~"  # separates a login name's user from its scope: needs no escaping in a URL
SCOPE_KEYS = ("model", "tokenizer", "adapter")
MAX_SCOPE_FIELD = 256  # bytes in one scope field (as SCOPE allows)


def digest(password: bytes) -> str:
    """A password as redis's ACL keeps it: its SHA-256, in lowercase hex."""
    return hashlib.sha256(password).hexdigest()


@dataclass(frozen=True)
class Login:
    """How a user logs in: enabled (`on`) or not, `nopass` (any password), else one of `digests`."""

    enabled: bool = True
    nopass: bool = False
    digests: tuple[str, ...] = ()

    def accepts(self, password: bytes) -> bool:
        given = digest(password)
        found = False
        for d in self.digests:  # every digest compared: the time does not tell which matched
            found |= hmac.compare_digest(d, given)
        return self.enabled and (self.nopass or found)


class Users:
    def __init__(self, passwords: dict[str, str], scopes: dict[str, IdentityScope] | None = None) -> None:
        self._passwords = passwords
        self._scopes = scopes or {}  # user -> the scope its connections start in
        self._logins: dict[str, Login] = {}  # users set at run time (ACL SETUSER): they override _passwords
        self._acl: dict[str, Any] = {}  # user -> its command and key rules (the protocol's), when restricted
        self._default_nopass = not passwords  # with no user configured, `default` logs in with anything

    @classmethod
    def from_config(cls, cfg: SecurityConfig) -> "Users":
        passwords: dict[str, str] = {}
        scopes: dict[str, IdentityScope] = {}
        if cfg.users_file:
            try:
                with open(cfg.users_file, encoding="utf-8") as f:
                    lines = f.readlines()
            except OSError as e:
                raise ConfigError(f"cannot read users file {cfg.users_file}: {e.strerror}") from None
            for n, line in enumerate(lines, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                where = f"{cfg.users_file}:{n}"
                words = line.split()
                if len(words) < 2:
                    raise ConfigError(f"{where}: expected `user password [model=M] [tokenizer=T] [adapter=A]`")
                user, password, fields = words[0], words[1], words[2:]
                if SCOPE_SEP in user:
                    raise ConfigError(f"{where}: user name {user!r} contains {SCOPE_SEP!r}, which separates the "
                                      f"scope in a login name (user{SCOPE_SEP}model{SCOPE_SEP}tokenizer)")
                if user in passwords:
                    raise ConfigError(f"{where}: user {user!r} is listed twice")
                passwords[user] = password
                if fields:
                    scopes[user] = _scope_fields(where, user, fields)
        if cfg.requirepass:
            passwords["default"] = cfg.requirepass
        return cls(passwords, scopes)

    @property
    def required(self) -> bool:
        """Whether a connection must AUTH before running commands (user default is not `on nopass`)."""
        login = self.login_of("default")
        return not (login.enabled and login.nopass)

    @property
    def default_has_password(self) -> bool:
        return not self.login_of("default").nopass

    @property
    def scoped(self) -> bool:
        """Whether any user has a scope of its own in the users file."""
        return bool(self._scopes)

    def scope_of(self, user: str) -> IdentityScope | None:
        """The scope `user`'s connections start in (its tenant is `user`), or None."""
        return self._scopes.get(user)

    def check(self, user: str, password: str | bytes) -> bool:
        """Whether `password` is `user`'s (compared as bytes: any client bytes are fine)."""
        given = password if isinstance(password, bytes) else password.encode("utf-8", "surrogateescape")
        login = self._logins.get(user)
        if login is not None:
            return login.accepts(given)
        expected = self._passwords.get(user)
        if expected is None:
            hmac.compare_digest(given, given)  # same work whether or not the user exists
            return False
        return hmac.compare_digest(expected.encode(), given)

    def user_for_token(self, token: str) -> str | None:
        """The user whose password is `token` (an API key of the OpenAI gateway), or None.

        Every password is compared, in constant time, whether or not one matched;
        a token that is the password of two users names neither (None).
        """
        given = token.encode()
        found = [user for user, password in self._passwords.items()
                 if hmac.compare_digest(password.encode(), given)]
        found += [user for user, login in self._logins.items()  # a nopass user has no token to match
                  if login.digests and not login.nopass and login.accepts(given)]
        return found[0] if len(found) == 1 else None

    # -- users set at run time (ACL SETUSER, ACL DELUSER, CONFIG SET requirepass) -----------------
    def names(self) -> list[str]:
        """Every user, by name (as redis lists them)."""
        return sorted({"default"} | set(self._passwords) | set(self._logins))

    def exists(self, user: str) -> bool:
        return user == "default" or user in self._logins or user in self._passwords

    def login_of(self, user: str) -> Login | None:
        """How `user` logs in now, or None when there is no such user."""
        login = self._logins.get(user)
        if login is not None:
            return login
        password = self._passwords.get(user)
        if password is not None:
            return Login(digests=(digest(password.encode()),))
        if user == "default":  # no password: nopass, unless the node started with users that need one
            return Login(nopass=self._default_nopass)
        return None

    def set_login(self, user: str, login: Login, acl: Any = None) -> None:
        """Add `user`, or change how it logs in and its rules (`acl`: None for every command and key)."""
        self._passwords.pop(user, None)
        self._logins[user] = login
        if acl is None:
            self._acl.pop(user, None)
        else:
            self._acl[user] = acl

    def acl_of(self, user: str) -> Any:
        """`user`'s command and key rules, or None when it may run every command on every key."""
        return self._acl.get(user)

    def delete(self, user: str) -> bool:
        """Remove `user` (not `default`); whether it existed."""
        existed = self.exists(user)
        self._passwords.pop(user, None)
        self._logins.pop(user, None)
        self._acl.pop(user, None)
        self._scopes.pop(user, None)
        return existed


def _scope_fields(where: str, user: str, fields: list[str]) -> IdentityScope:
    values: dict[str, str] = {}
    for item in fields:
        key, eq, value = item.partition("=")
        if not eq or key not in SCOPE_KEYS:
            raise ConfigError(f"{where}: {item!r} is not one of model=..., tokenizer=..., adapter=...")
        if key in values:
            raise ConfigError(f"{where}: {key} is given twice")
        problem = scope_field_problem(value.encode())
        if problem:
            raise ConfigError(f"{where}: {key}: {problem}")
        values[key] = value
    return IdentityScope(user, **values)


def scope_field_problem(raw: bytes) -> str:
    """Why `raw` cannot be a scope field (too long, or a control byte), or ""."""
    if len(raw) > MAX_SCOPE_FIELD or any(b < 32 or b == 127 for b in raw):
        return f"scope fields are at most {MAX_SCOPE_FIELD} printable bytes"
    return ""


class LoginError(ValueError):
    """A login name whose scope part is malformed."""


def split_login(name: bytes) -> tuple[bytes, tuple[bytes, bytes, bytes] | None]:
    """`user` -> (user, None); `user~model~tokenizer[~adapter]` -> (user, (model, tokenizer, adapter)).

    LoginError when a `~` is there but the rest is not two or three fields of at most
    MAX_SCOPE_FIELD printable bytes (fields may be empty: `alice~~tok`).
    """
    user, sep, rest = bytes(name).partition(SCOPE_SEP.encode())
    if not sep:
        return user, None
    parts = rest.split(SCOPE_SEP.encode())
    if len(parts) not in (2, 3):
        raise LoginError(f"a scoped user name is user{SCOPE_SEP}model{SCOPE_SEP}tokenizer"
                         f"[{SCOPE_SEP}adapter], not {len(parts)} field{'s' * (len(parts) != 1)} after the user")
    for part in parts:
        problem = scope_field_problem(part)
        if problem:
            raise LoginError(problem)
    model, tokenizer, adapter = (*parts, b"")[:3]
    return user, (model, tokenizer, adapter)
