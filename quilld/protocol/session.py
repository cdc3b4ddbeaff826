"""Per-connection state that commands read and change (identity, protocol, name)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from quilld.model import IdentityScope

_ids = itertools.count(1)


class Session:
    __slots__ = ("node", "store", "id", "addr", "laddr", "name", "lib_name", "lib_ver", "resp3",
                 "user", "authenticated", "scope", "tag", "created", "last_active", "last_cmd",
                 "closing", "qbuf", "peer")

    def __init__(self, node: Any, addr: str, laddr: str) -> None:
        self.node = node
        self.store = node.store
        self.id = next(_ids)
        self.addr = addr
        self.laddr = laddr
        self.name: bytes | None = None
        self.lib_name = b""
        self.lib_ver = b""
        self.resp3 = False
        self.user = "default"
        self.authenticated = not node.users.required
        self.created = self.last_active = time.monotonic()
        self.last_cmd = "NULL"
        self.closing = False  # QUIT: close once the reply is written
        self.qbuf = 0
        self.peer = False  # a cluster peer (PEERAUTH): may run REPLOG and PEERGET
        self.set_scope(IdentityScope())

    def set_scope(self, scope: IdentityScope) -> None:
        self.scope = scope
        self.tag = self.node.scopes.tag(scope)

    def login(self, user: str) -> None:
        """The tenant becomes the authenticated user; the model part of the scope is kept."""
        self.user = user
        self.authenticated = True
        self.set_scope(self.scope._replace(tenant=user))
