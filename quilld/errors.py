"""Typed errors. Each carries the prefix it takes on the wire (`-PREFIX message`).

The RESP layer turns a `QuillError` into an error reply in exactly one place
(`protocol/resp.py: encode_error`); the client library maps prefixes back.
"""


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


class Behind(QuillError):
    """A replication follower asked for log entries the node no longer keeps."""

    prefix = "BEHIND"


class PeerOnly(QuillError):
    """A node-to-node command from a connection that did not PEERAUTH."""

    prefix = "NOPERM"
