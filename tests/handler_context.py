"""Real parts for handler-level tests: a NodeContext and Sessions with no server or sockets.

Command handlers take a Session; these build one over a real keyspace,
two-phase puts, scopes, users, control plane and command table, so a test
calls `handler(session, args)` and asserts on the reply value.
"""

from __future__ import annotations

from quilld.config import BlocksConfig, Config, DramConfig, SecurityConfig, ServerConfig
from quilld.index.control import ControlPlane
from quilld.protocol.clients import Clients
from quilld.protocol.commands import build_table
from quilld.context.node_context import NodeContext
from quilld.protocol.session import Session
from quilld.scopes import ScopeRegistry
from quilld.security import Users
from quilld.tiers.arena import PAGE
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.puts import TwoPhasePuts


def make_context(pages: int = 64, inline_max: int = 256, requirepass: str = "", cluster=None,
                 **server) -> NodeContext:
    cfg = Config(server=ServerConfig(**server), dram=DramConfig(size=pages * PAGE, inline_max=inline_max),
                 security=SecurityConfig(requirepass=requirepass), blocks=BlocksConfig())
    scopes = ScopeRegistry()
    keyspace = Keyspace(cfg.dram, scopes)
    return NodeContext(cfg=cfg, node_id="n1", keyspace=keyspace,
                       puts=TwoPhasePuts(keyspace, cfg.blocks.default_lease_ms, cfg.blocks.max_lease_ms),
                       scopes=scopes, users=Users.from_config(cfg.security), control=ControlPlane(cfg, scopes),
                       table=build_table(), clients=Clients(cfg.server.max_clients), cluster=cluster)


def session(ctx: NodeContext, user: str | None = None, peer: bool = False) -> Session:
    s = Session(ctx, "127.0.0.1:50000", "127.0.0.1:7379")
    if user is not None:
        s.login(user)
    s.peer = peer
    return s
