"""Typed errors. Each carries the prefix it takes on the wire (`-PREFIX message`).

The RESP layer turns a `QuillError` into an error reply in exactly one place
(`protocol/resp.py: encode_error`); the client library maps prefixes back.

A message that quotes what a client sent carries those bytes as they came, as
redis echoes them: `echo()` decodes them with surrogate escapes, which
`encode_error` turns back into the very same bytes (never U+FFFD).
"""


def echo(raw: bytes | bytearray | memoryview, limit: int | None = None) -> str:
    """Client bytes quoted in an error message, as redis's `%s` / `%.<limit>s` quote them.

    Up to the first NUL byte (a C string ends there), at most `limit` bytes, and any
    byte that is not UTF-8 kept as a surrogate escape so the wire gets it back raw.
    """
    raw = bytes(raw)
    nul = raw.find(0)
    if nul >= 0:
        raw = raw[:nul]
    if limit is not None:
        raw = raw[:limit]
    return raw.decode("utf-8", "surrogateescape")


class QuillError(Exception):
    prefix = "ERR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def wire(self) -> str:
        """`PREFIX message`, as sent after the `-`."""
        return f"{self.prefix} {self.message}"


class CommandError(QuillError):
    """Generic `ERR` reply: syntax errors, bad arguments, unknown commands."""


class ProtocolError(QuillError):
    """The client sent bytes that are not RESP; the connection is closed after the reply."""

    def wire(self) -> str:
        return f"ERR Protocol error: {self.message}"


class NoAuth(QuillError):
    prefix = "NOAUTH"


class WrongPass(QuillError):
    prefix = "WRONGPASS"


class OutOfMemory(QuillError):
    prefix = "OOM"


class UnfilledLimit(OutOfMemory):
    """Clients' reservations still waiting for their bytes hold as much of the arena as they may."""


class NoHandle(QuillError):
    """A PUT2PHASE handle that is unknown, committed, aborted or expired."""

    prefix = "NOHANDLE"


class Incomplete(QuillError):
    """A PUT2PHASE COMMIT with bytes still missing."""

    prefix = "INCOMPLETE"


class ChecksumMismatch(QuillError):
    prefix = "CHECKSUM"


class ConfigError(QuillError):
    """Bad configuration: a startup error, never sent on the wire."""


class StopFailed(QuillError):
    """A clean stop ran every step, but some part failed to stop (each logged why): exit status 1,
    never sent on the wire."""


class NoPerm(QuillError):
    """The user may not do this (redis's ACL refusals share the prefix)."""

    prefix = "NOPERM"


class PeerOnly(NoPerm):
    """A node-to-node command from a connection that did not PEERAUTH."""
