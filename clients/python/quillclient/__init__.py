"""Python client for quilld (QuillCache): redis-py underneath, zero-copy block reads on top."""

from quillclient.client import QuillClient
from quillclient.config import ClientConfig, Scope
from quillclient.errors import (AuthError, BufferTooSmall, ChecksumMismatch, CommandError, Incomplete, NoAuth,
                                NoHandle, NotFound, OutOfMemory, ProtocolError, QuillConnectionError, QuillError,
                                QuillTimeout, WrongPass, WrongType)

__version__ = "0.1.0"

__all__ = [
    "QuillClient", "ClientConfig", "Scope",
    "QuillError", "CommandError", "WrongType", "AuthError", "NoAuth", "WrongPass", "OutOfMemory", "NoHandle",
    "Incomplete", "ChecksumMismatch", "NotFound", "BufferTooSmall", "ProtocolError", "QuillConnectionError",
    "QuillTimeout",
]
