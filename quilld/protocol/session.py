"""Per-connection state that commands read and change (identity, protocol, name).

A handler's `c` is its connection's Session: the node's shared parts are in
`c.ctx` (context.py), and the ones every data command uses are also direct
attributes (`c.keyspace`, `c.puts`, `c.control`).
"""

from __future__ import annotations

import itertools
import time

from quilld.model import IdentityScope
from quilld.protocol.context import NodeContext

_ids = itertools.count(1)


class Session:
    __slots__ = ("ctx", "keyspace", "puts", "control", "id", "addr", "laddr", "name", "lib_name", "lib_ver",
                 "resp3", "user", "authenticated", "scope", "tag", "created", "last_active", "last_cmd",
                 "closing", "qbuf", "peer")

    def __init__(self, ctx: NodeContext, addr: str, laddr: str) -> None:
        self.ctx = ctx
        self.keyspace = ctx.keyspace
        self.puts = ctx.puts
        self.control = ctx.control
        self.id = next(_ids)
        self.addr = addr
        self.laddr = laddr
        self.name: bytes | None = None
        self.lib_name = b""
        self.lib_ver = b""
        self.resp3 = False
        self.user = "default"
        self.authenticated = not ctx.users.required
        self.created = self.last_active = time.monotonic()
        self.last_cmd = "NULL"
        self.closing = False  # QUIT: close once the reply is written
        self.qbuf = 0
        self.peer = False  # a cluster peer (PEERAUTH): may run REPLOG and PEERGET
        self.tag = b""
        self.set_scope(IdentityScope(), capped=False)

    def set_scope(self, scope: IdentityScope, capped: bool = True) -> None:
        """Use `scope` from now on; the connection holds it (a client's new scope counts
        against its tenant's cap: ScopeLimit)."""
        scopes = self.ctx.scopes
        tag = scopes.tag(scope, capped=capped)
        scopes.hold(tag)
        if self.tag:
            scopes.drop(self.tag)
        self.scope, self.tag = scope, tag

    def login(self, user: str) -> None:
        """The tenant becomes the authenticated user; the model part of the scope is kept."""
        self.user = user
        self.authenticated = True
        self.set_scope(self.scope._replace(tenant=user), capped=bool(self.scope.model or self.scope.tokenizer
                                                                     or self.scope.adapter))

    def close(self) -> None:
        """The connection is gone: its scope is no longer held by it."""
        if self.tag:
            self.ctx.scopes.drop(self.tag)
            self.tag = b""
