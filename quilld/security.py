"""Users and passwords: `--requirepass` for user `default`, or a users file.

A users file holds one `user password` pair per line; `#` starts a comment.
With neither, every connection is user `default` and AUTH is refused as
redis refuses it when no password is configured.
"""

from __future__ import annotations

import hmac

from quilld.config import SecurityConfig
from quilld.errors import ConfigError


class Users:
    def __init__(self, passwords: dict[str, str]) -> None:
        self._passwords = passwords

    @classmethod
    def from_config(cls, cfg: SecurityConfig) -> "Users":
        passwords: dict[str, str] = {}
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
                parts = line.split()
                if len(parts) != 2:
                    raise ConfigError(f"{cfg.users_file}:{n}: expected `user password`")
                passwords[parts[0]] = parts[1]
        if cfg.requirepass:
            passwords["default"] = cfg.requirepass
        return cls(passwords)

    @property
    def required(self) -> bool:
        """Whether a connection must AUTH before running commands."""
        return bool(self._passwords)

    @property
    def default_has_password(self) -> bool:
        return "default" in self._passwords

    def check(self, user: str, password: str) -> bool:
        expected = self._passwords.get(user)
        if expected is None:
            hmac.compare_digest(password, password)  # same work whether or not the user exists
            return False
        return hmac.compare_digest(expected.encode(), password.encode())

    def user_for_token(self, token: str) -> str | None:
        """The user whose password is `token` (an API key of the OpenAI gateway), or None.

        Every password is compared, in constant time, whether or not one matched;
        a token that is the password of two users names neither (None).
        """
        given = token.encode()
        found = [user for user, password in self._passwords.items()
                 if hmac.compare_digest(password.encode(), given)]
        return found[0] if len(found) == 1 else None
