"""What a command handler may reach, typed: the node's shared parts, and its own session.

`NodeContext` is built once by node.py and shared by every connection (and
by the admin API). Handlers receive their connection's `Session`
(session.py), which carries the context as `c.ctx` and the parts every data
command needs as direct attributes (`c.keyspace`, `c.puts`, `c.control`).
A handler test builds a NodeContext from real parts, with no server.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from quilld.cluster.cluster import Cluster
from quilld.config import Config
from quilld.index.control import ControlPlane
from quilld.protocol.table import CommandTable
from quilld.scopes import ScopeRegistry
from quilld.security import Users
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.puts import TwoPhasePuts
from quilld.tiers.tiering import Tiering


class Reporting(Protocol):
    """A part that reports an INFO section of its own (the gateway)."""

    def info(self) -> list[tuple[str, Any]]: ...


async def _no_wait(timeout: float) -> None:
    return None


@dataclass(eq=False)
class NodeContext:
    cfg: Config
    node_id: str
    keyspace: Keyspace
    puts: TwoPhasePuts
    scopes: ScopeRegistry
    users: Users
    control: ControlPlane
    table: CommandTable
    clients: Any  # protocol/clients.py Clients (set right after construction: it needs the context)
    tiering: Tiering | None = None
    cluster: Cluster | None = None  # set once the node has joined (cluster.gossip_port)
    gateway: Reporting | None = None  # set once the gateway listens (gateway.port)
    config_file: str = ""
    port: int = 0  # the RESP port actually bound
    admin_port: int = 0
    gateway_port: int = 0
    # returns when arena space is next freed, or after `timeout` seconds
    space_freed: Callable[[float], Awaitable[None]] = _no_wait
    stats: Counter[str] = field(default_factory=Counter)  # node-wide cold counters (auth_failures, ...)
    started: float = field(default_factory=time.time)
