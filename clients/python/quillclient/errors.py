"""Typed errors, mapped back from quilld's wire prefixes.

quilld answers a failed command with `-PREFIX message` (its `quilld/errors.py`
gives each error class a `prefix`). The same prefixes name the classes here, so
`except OutOfMemory` catches what the server raised as `OutOfMemory`. Errors
with `prefix = None` are the client's own: they never come from the wire.

Transport failures (refused, reset, timed out) become `QuillConnectionError`
or `QuillTimeout`, which are also the built-in `ConnectionError` and
`TimeoutError`, so code that only knows the standard library still catches them.
"""

from __future__ import annotations

import redis.exceptions as rx


class QuillError(Exception):
    """Any error reply from quilld, or a failure of the client itself."""

    prefix: str | None = "ERR"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class CommandError(QuillError):
    """`ERR`: syntax errors, bad arguments, unknown commands."""


class WrongType(QuillError):
    prefix = "WRONGTYPE"


class AuthError(QuillError):
    """The connection is not allowed in: NOAUTH or WRONGPASS."""

    prefix = None


class NoAuth(AuthError):
    """A command was sent before authenticating (no password configured on the client)."""

    prefix = "NOAUTH"


class WrongPass(AuthError):
    """The username or password was refused."""

    prefix = "WRONGPASS"


class OutOfMemory(QuillError):
    """The value is larger than the arena, or nothing is left to evict."""

    prefix = "OOM"


class NoHandle(QuillError):
    """A PUT2PHASE handle that is unknown, committed, aborted or expired."""

    prefix = "NOHANDLE"


class Incomplete(QuillError):
    """A PUT2PHASE COMMIT with bytes still missing."""

    prefix = "INCOMPLETE"


class ChecksumMismatch(QuillError):
    """A PUT2PHASE COMMIT whose CRC32C did not match the bytes the server holds."""

    prefix = "CHECKSUM"


class NotFound(QuillError):
    """The key has no value in this client's scope (the server answered a nil bulk)."""

    prefix = None

    def __init__(self, key: bytes | str) -> None:
        super().__init__(f"no value for key {key!r} in this scope")
        self.key = key


class BufferTooSmall(QuillError, ValueError):
    """`get_into`: the block is larger than the buffer. Nothing was written into it.

    `needed` is the block's size. For `get_many_into`, `index` is the first
    key that did not fit and `results` the outcome of every key (its length,
    -1 for a miss, None where the buffer was too small).
    """

    prefix = None

    def __init__(self, needed: int, size: int, index: int | None = None,
                 results: list[int | None] | None = None) -> None:
        where = "" if index is None else f" (key #{index})"
        super().__init__(f"block is {needed} bytes but the buffer holds {size}{where}")
        self.needed = needed
        self.size = size
        self.index = index
        self.results = results


class ProtocolError(QuillError):
    """The server sent something this client cannot read; the connection was closed."""

    prefix = None


class QuillConnectionError(QuillError, ConnectionError):
    """Could not reach the server, or lost the connection (after the retries)."""

    prefix = None


class QuillTimeout(QuillConnectionError, TimeoutError):
    """socket_timeout or connect_timeout ran out."""

    prefix = None


_BY_PREFIX: dict[str, type[QuillError]] = {
    cls.prefix: cls
    for cls in (CommandError, WrongType, NoAuth, WrongPass, OutOfMemory, NoHandle, Incomplete, ChecksumMismatch)
}


def from_wire(line: str) -> QuillError:
    """The typed error for an error reply, given the text after its `-`."""
    prefix, _, message = line.partition(" ")
    cls = _BY_PREFIX.get(prefix)
    if cls is None:
        err = QuillError(line)
        if prefix.isupper() and prefix.isalpha():
            err.prefix = prefix  # a prefix this client does not know yet, e.g. NOPROTO
            err.message = message
        return err
    return cls(message)


def from_redis(exc: Exception) -> Exception:
    """Translate a redis-py exception into this module's types (others pass through)."""
    if isinstance(exc, QuillError) or not isinstance(exc, rx.RedisError):
        return exc
    text = str(exc)
    code = getattr(exc, "status_code", None)  # redis-py >= 8 keeps the prefix it stripped
    if isinstance(exc, rx.AuthenticationError):
        if code == "NOAUTH" or (code is None and text.startswith("Authentication required")):
            return NoAuth(text)
        return WrongPass(text)
    if isinstance(exc, rx.TimeoutError):
        return QuillTimeout(text)
    if isinstance(exc, rx.ConnectionError):
        return QuillConnectionError(text)
    if isinstance(exc, rx.OutOfMemoryError):
        return OutOfMemory(text)
    if isinstance(exc, rx.ResponseError):
        if code is not None:
            return from_wire(f"{code} {text}")
        # redis-py < 8 strips a prefix it knows (ERR) and keeps the others: only
        # a prefix known here is taken as one, so "ERR DATA range ..." stays ERR.
        prefix = text.partition(" ")[0]
        return from_wire(text) if prefix in _BY_PREFIX else CommandError(text)
    return QuillError(text)


__all__ = [
    "QuillError", "CommandError", "WrongType", "AuthError", "NoAuth", "WrongPass", "OutOfMemory",
    "NoHandle", "Incomplete", "ChecksumMismatch", "NotFound", "BufferTooSmall", "ProtocolError",
    "QuillConnectionError", "QuillTimeout", "from_wire", "from_redis",
]
