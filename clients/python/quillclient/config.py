"""The client's settings: one frozen dataclass, and the identity scope."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

MiB = 1024 * 1024
# CPUs that keep loads in order (TSO): there the generation check alone catches a stale
# shared-memory copy; elsewhere (ARM, POWER...) each copy's CRC32C is checked too, by default.
ORDERED_LOADS = ("x86_64", "amd64", "i386", "i686")


def loads_may_reorder() -> bool:
    return platform.machine().lower() not in ORDERED_LOADS


class Scope(NamedTuple):
    """quilld's identity scope for every connection of a client (`SCOPE model tokenizer [adapter]`).

    The tenant is not part of it: the server takes it from the authenticated user.
    """

    model: str
    tokenizer: str
    adapter: str = ""

    def command(self) -> tuple:
        return ("SCOPE", self.model, self.tokenizer, self.adapter) if self.adapter else (
            "SCOPE", self.model, self.tokenizer)


@dataclass(frozen=True)
class ClientConfig:
    host: str = "127.0.0.1"
    port: int = 7379
    username: str | None = None
    password: str | None = None
    scope: Scope | None = None
    # Timeouts in seconds (None waits forever). socket_timeout bounds each read or write.
    socket_timeout: float | None = 30.0
    connect_timeout: float | None = 5.0
    # Pool: at most this many redis-py connections (callers wait up to pool_timeout for one),
    # and at most this many idle sockets kept for get_into.
    max_connections: int = 32
    pool_timeout: float | None = 20.0
    max_idle_raw: int = 8
    # Retries of idempotent commands after a lost connection: exponential backoff with jitter.
    retries: int = 3
    backoff_base: float = 0.02
    backoff_cap: float = 1.0
    retry_on_timeout: bool = False
    # put_blocks: DATA chunk size, parallel connections (threads), bytes reserved per round.
    chunk_size: int = 4 * MiB
    parallelism: int = 4
    put_round_bytes: int = 256 * MiB
    lease_ms: int | None = None
    # get_into / get_many_into: replies in flight per batch window; a too-large reply up to
    # drain_max bytes is read and dropped (the socket is kept), a larger one closes the socket.
    pipeline_window: int = 64
    drain_max: int = 8 * MiB
    # The shared-memory path (quillclient.shm) for a quilld on this host: "auto" uses it when the
    # server offers it to this user and falls back to TCP otherwise (client.transport and
    # client.shm_unavailable_reason say which and why); "require" raises instead of falling back;
    # "off" never tries. verify_crc: check each shared-memory copy's CRC32C too (costs a pass);
    # on by default where the CPU may reorder loads (anything but x86), where the generation
    # check alone could miss a copy that overlapped the reuse of its block.
    shared_memory: str = "auto"
    verify_crc: bool = field(default_factory=loads_may_reorder)

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        if self.parallelism <= 0:
            raise ValueError("parallelism must be positive")
        if self.pipeline_window <= 0:
            raise ValueError("pipeline_window must be positive")
        if self.max_connections < self.parallelism:
            raise ValueError("max_connections must be at least parallelism")
        if self.shared_memory not in ("auto", "off", "require"):
            raise ValueError("shared_memory must be 'auto', 'off' or 'require'")
        if self.scope is not None and not isinstance(self.scope, Scope):
            object.__setattr__(self, "scope", Scope(*self.scope))

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> ClientConfig:
        """A config from `quill://[user[:password]@]host[:port][?model=M&tokenizer=T&adapter=A]`
        (`redis://` is read alike). The query names the identity scope (none: the user's default
        scope); `password_file=PATH` or `password_env=NAME` in the query read the password from a
        file or the environment instead of the URL. Other query keys are ClientConfig fields
        (`shared_memory=off`, `socket_timeout=10`); `overrides` win over all of it."""
        parts = urlsplit(url)
        if parts.scheme not in ("quill", "redis"):
            raise ValueError(f"{_safe(url)}: the scheme must be quill:// (or redis://), not {parts.scheme!r}://")
        if not parts.hostname:
            raise ValueError(f"{_safe(url)}: no host")
        if parts.path not in ("", "/"):
            raise ValueError(f"{_safe(url)}: a path means nothing here (quilld has one keyspace per scope): "
                             "name the scope with ?model=...&tokenizer=...")
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        given: dict[str, Any] = {"host": parts.hostname}
        try:
            if parts.port is not None:
                given["port"] = parts.port
        except ValueError:
            raise ValueError(f"{_safe(url)}: the port is not a number within 0..65535") from None
        if parts.username:
            given["username"] = unquote(parts.username)
        if parts.password is not None:
            given["password"] = unquote(parts.password)
        password_file, password_env = query.pop("password_file", None), query.pop("password_env", None)
        if password_file is not None:
            try:
                with open(password_file, encoding="utf-8") as f:
                    given["password"] = f.read().strip()
            except OSError as e:
                raise ValueError(f"{_safe(url)}: password_file {password_file}: {e.strerror}") from None
        if password_env is not None:
            if password_env not in os.environ:
                raise ValueError(f"{_safe(url)}: password_env names {password_env}, which is not set")
            given["password"] = os.environ[password_env]
        model, tokenizer, adapter = query.pop("model", None), query.pop("tokenizer", None), query.pop("adapter", "")
        if model is not None or tokenizer is not None or adapter:
            if not model:
                raise ValueError(f"{_safe(url)}: a scope needs its model (?model=...)")
            given["scope"] = Scope(model, tokenizer or "", adapter)
        known = {f.name: f for f in fields(cls)}
        for name, raw in query.items():
            f = known.get(name)
            if f is None or name in ("host", "port", "username", "password", "scope"):
                raise ValueError(f"{_safe(url)}: unknown option {name!r}")
            given[name] = _typed(name, raw, f.type)
        return cls(**{**given, **overrides})

    def handshake(self) -> list[tuple]:
        """The commands that set a fresh connection up: AUTH, then SCOPE."""
        cmds: list[tuple] = []
        if self.password is not None:
            cmds.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.scope is not None:
            cmds.append(self.scope.command())
        return cmds


def _safe(url: str) -> str:
    """A URL fit for an error message or a log: its password left out."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _typed(name: str, raw: str, kind: Any) -> Any:
    text = str(kind)
    try:
        if "bool" in text:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return raw.lower() in ("1", "true", "yes", "on")
        if "int" in text:
            return None if raw.lower() == "none" and "None" in text else int(raw)
        if "float" in text:
            return None if raw.lower() == "none" and "None" in text else float(raw)
    except ValueError:
        raise ValueError(f"option {name}={raw!r} is not a {text}") from None
    return raw
