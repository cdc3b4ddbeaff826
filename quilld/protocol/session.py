"""Per-connection state that commands read and change (identity, protocol, name, transaction).

A handler's `c` is its connection's Session: the node's shared parts are in
`c.ctx` (quilld/context/node_context.py), and the ones every data command uses are also direct
attributes (`c.keyspace`, `c.puts`, `c.control`).

Identity: the tenant is the logged-in user; the scope (model, tokenizer,
adapter) is chosen by `SCOPE`, named in the login name
(`user~model~tokenizer[~adapter]`), or bound to the user in the users file
(security.py). On a node with `security.require_scope`, a connection that has
chosen none holds `UNSCOPED` instead of the keyspace and the two-phase puts:
every data command it runs is refused with `-NOSCOPE`, and no dispatcher check
is paid by connections that did choose.

Transaction: while in MULTI, `multi` holds the queued commands (None otherwise: the
dispatcher's fast path checks that one attribute); the watched keys and whether one changed
are here too. protocol/transactions.py keeps them; RESET and the connection's end drop them.
"""

from __future__ import annotations

import itertools
import time

from quilld.errors import CommandError, QuillError
from quilld.model import IdentityScope
from quilld.context.node_context import NodeContext
from quilld.protocol.transactions import end

_ids = itertools.count(1)


class NoScope(QuillError):
    """A data command on a connection without an identity scope (security.require_scope)."""

    prefix = "NOSCOPE"


class _Unscoped:
    """Stands in for the keyspace and the two-phase puts until the connection has a scope."""

    __slots__ = ()

    def __getattr__(self, name: str):
        raise NoScope("this connection has no identity scope and this node requires one (security.require_scope): "
                      "log in as a user with a scope in the users file, name it in the user name "
                      "(user~model~tokenizer[~adapter]), or send SCOPE model tokenizer [adapter]")


UNSCOPED = _Unscoped()


class Session:
    __slots__ = ("ctx", "keyspace", "puts", "control", "id", "addr", "laddr", "name", "lib_name", "lib_ver",
                 "resp3", "user", "authenticated", "scope", "tag", "created", "last_active", "last_cmd",
                 "closing", "qbuf", "peer", "reply_mode", "monitor", "no_evict", "unix", "shm", "multi",
                 "multi_error", "multi_bytes", "watched", "cas_dirty", "perms", "tracking", "channels")

    def __init__(self, ctx: NodeContext, addr: str, laddr: str, unix: bool = False) -> None:
        self.ctx = ctx
        self.unix = unix  # over the unix socket (server.unixsocket): SHM ATTACH may hand it descriptors
        self.shm = False  # SHM ATTACH handed it the arena's descriptor (INFO counts attached clients)
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
        self.perms = _perms(ctx, "default")  # the user's ACL when it restricts anything (dispatcher checks it)
        self.created = self.last_active = time.monotonic()
        self.last_cmd = "NULL"
        self.closing = False  # QUIT: close once the reply is written
        self.qbuf = 0
        self.peer = False  # a cluster peer (PEERAUTH): may run the node-to-node commands (table.PEER)
        self.reply_mode = 0  # CLIENT REPLY: 0 on, 1 off, 3 skip the next command's reply (2: skipping it)
        self.monitor = False  # MONITOR: the connection receives the commands its user runs
        self.no_evict = False  # CLIENT NO-EVICT (a flag only: quilld never evicts clients)
        # MULTI/EXEC (protocol/transactions.py): the queued (command, arguments) while in MULTI, else
        # None; whether queueing failed (EXEC aborts); the queue's bytes; the watched keys (full key ->
        # expired already when watched), None when none; whether one changed since (EXEC fails)
        self.multi: list | None = None
        self.multi_error = False
        self.multi_bytes = 0
        self.watched: dict[bytes, bool] | None = None
        self.cas_dirty = False
        # CLIENT TRACKING (protocol/tracking.py): the connection's state while tracking is on, else
        # None (the dispatcher's fast path checks that one attribute); the pub/sub channels it
        # is subscribed to (SUBSCRIBE: the tracking channel only)
        self.tracking = None
        self.channels: set[bytes] = set()
        self.tag = b""
        self.set_scope(IdentityScope(), capped=False, chosen=False)
        if ctx.cfg.security.require_scope:
            self.keyspace = self.puts = UNSCOPED

    def set_scope(self, scope: IdentityScope, capped: bool = True, chosen: bool = True) -> None:
        """Use `scope` from now on; the connection holds it (a client's new scope counts
        against its tenant's cap: ScopeLimit). `chosen`: the client named it (SCOPE, a scoped
        login, its user's bound scope), so storage is reachable; else only if it already was."""
        scopes = self.ctx.scopes
        tag = scopes.tag(scope, capped=capped)
        scopes.hold(tag)
        if self.tag:
            scopes.drop(self.tag)
        self.scope, self.tag = scope, tag
        if chosen:
            self.keyspace, self.puts = self.ctx.keyspace, self.ctx.puts

    def login(self, user: str, scope: IdentityScope | None = None) -> None:
        """The tenant becomes the authenticated user. Its scope: `scope` when the login named one,
        else the user's scope from the users file, else the model part the connection had."""
        if scope is None:
            scope = self.ctx.users.scope_of(user)
        if scope is not None:
            self.set_scope(scope._replace(tenant=user))
        else:
            kept = self.scope._replace(tenant=user)
            self.set_scope(kept, capped=bool(kept.model or kept.tokenizer or kept.adapter), chosen=False)
        self.user = user
        self.set_perms(_perms(self.ctx, user))
        self.authenticated = True

    def set_perms(self, acl) -> None:
        """The user's ACL changed (None: it restricts nothing); a RESP2 subscribed connection keeps
        its subscribed context on top of it."""
        self.perms = Subscribed(acl) if self.channels and not self.resp3 else acl

    def subscriptions_changed(self) -> None:
        """SUBSCRIBE or UNSUBSCRIBE ran: the subscribed context starts or ends (RESP2 only)."""
        acl = self.perms.acl if self.perms.__class__ is Subscribed else self.perms
        self.set_perms(acl)

    def peer_login(self) -> None:
        """A cluster peer (PEERAUTH): it may run the node-to-node commands, which name the scope
        of each key they read. Nothing else changes: no user is logged in, the operator least."""
        self.peer = True

    def reset(self) -> None:
        """RESET: the state of a new connection (its id, addresses and age kept): RESP2, no name,
        replies on, user `default` (authenticated only when it has no password), no scope chosen,
        no transaction, no key watched, no tracking, no subscription."""
        end(self)
        self.ctx.clients.tracking.disable(self)
        self.channels = set()
        self.name = None
        self.resp3 = False
        self.reply_mode = 0
        self.monitor = self.no_evict = self.peer = False
        self.user = "default"
        self.authenticated = not self.ctx.users.required
        self.perms = _perms(self.ctx, "default")
        self.set_scope(IdentityScope(), capped=False, chosen=not self.ctx.cfg.security.require_scope)
        if self.ctx.cfg.security.require_scope:
            self.keyspace = self.puts = UNSCOPED

    def close(self) -> None:
        """The connection is gone: its scope is no longer held by it, its transaction and watched
        keys are dropped (what its queued commands held is given back), and its tracking."""
        end(self)
        self.ctx.clients.tracking.disable(self)
        if self.tag:
            self.ctx.scopes.drop(self.tag)
            self.tag = b""


def _perms(ctx: NodeContext, user: str):
    """`user`'s ACL (commands/acl_rules.py) when it denies anything, else None: the dispatcher's
    fast path serves a session whose `perms` is None without asking."""
    acl = ctx.users.acl_of(user)
    return acl if acl is not None and acl.restricted else None


SUBSCRIBED_MAY_RUN = frozenset({"subscribe", "psubscribe", "ssubscribe", "unsubscribe", "punsubscribe",
                                "sunsubscribe", "ping", "quit", "reset"})


class Subscribed:
    """A RESP2 connection subscribed to a channel (SUBSCRIBE, commands/pubsub.py) runs only what
    redis's processCommand allows there, after what its user's ACL (`acl`, or None) allows."""

    __slots__ = ("acl",)

    def __init__(self, acl) -> None:
        self.acl = acl

    def refusal(self, cmd, argv: list):
        refused = self.acl.refusal(cmd, argv) if self.acl is not None else None
        if refused is None and cmd.name not in SUBSCRIBED_MAY_RUN:
            refused = CommandError(f"Can't execute '{cmd.name}': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / "
                                   "QUIT / RESET are allowed in this context")
        return refused
