"""The reply values handlers return that are not plain Python values: a simple string, verbatim
text, pre-encoded bytes, a big number, an attribute or push frame, an ordered set, a reply with
descriptors. `resp.encode` turns them into RESP.

They subclass bytes, dict and tuple, so they stay interpreted: resp.py, which encodes them, is
compiled with mypyc (quilld/native.py) and re-exports them for the handlers.
"""

from __future__ import annotations

from typing import Any


class Status(bytes):
    """A simple string reply (`+OK`)."""


class Verbatim(bytes):
    """A verbatim text reply (RESP3 `=`), a bulk string in RESP2 (INFO uses it)."""


class Raw(bytes):
    """Already-encoded reply bytes, written as they are."""


class BigNumber(bytes):
    """A big number's decimal digits (RESP3 `(`), a bulk string in RESP2."""


class Attribute(dict):
    """An attribute frame (RESP3 `|`): metadata sent before a reply, never a reply itself.
    RESP2 has no attributes: nothing is sent to a RESP2 client."""


class Push(tuple):
    """An out-of-band push frame (RESP3 `>`); in RESP2, an array (as redis sends pub/sub messages)."""


class OrderedSet(tuple):
    """A set reply whose order is given (RESP3 `~`, an array in RESP2): COMMAND's flags, ACL
    categories and key specs, whose order redis fixes."""


class WithFds:
    """A reply to be sent with open file descriptors attached (SCM_RIGHTS over a unix socket):
    SHM ATTACH's. The codec does not encode it (it is not bytes on a wire): the server shell
    sends it with sendmsg once the connection's earlier replies have left (server.py)."""

    __slots__ = ("value", "fds")

    def __init__(self, value: Any, fds: tuple[int, ...]) -> None:
        self.value = value
        self.fds = fds


OK = Status(b"OK")
PONG = Status(b"PONG")
