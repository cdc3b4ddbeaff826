"""What a command handler may reach, typed: the node's shared parts, and its own session.

`NodeContext` is built once by node.py and shared by every connection (and
by the admin API). Handlers receive their connection's `Session`
(session.py), which carries the context as `c.ctx` and the parts every data
command needs as direct attributes (`c.keyspace`, `c.puts`, `c.control`).
A handler test builds a NodeContext from real parts, with no server.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from quilld.cluster.cluster import Cluster
from quilld.cluster.local_secret import local_secret
from quilld.config import Config
from quilld.errors import ConfigError
from quilld.context.auth_throttle import AuthThrottle
from quilld.context.listeners import LISTENERS, ListenerFigures
from quilld.index.control import ControlPlane
from quilld.scopes import ScopeRegistry
from quilld.security import Users
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.leases import LeaseTable
from quilld.tiers.puts import TwoPhasePuts
from quilld.tiers.tiering import Tiering


class CommandFigures(Protocol):
    """What the node's figures read of the RESP command table (protocol/table.py's
    CommandTable): its commands and their call, error and latency counters."""

    commands: dict[bytes, Any]
    stats: dict[str, list]
    errors: Any
    error_replies: int

    def latency_of(self, name: str) -> Any: ...

    def reset_stats(self) -> None: ...

    def set_timing(self, slow_ns: int) -> None: ...


class Reporting(Protocol):
    """A part that reports an INFO section of its own (the gateway)."""

    def info(self) -> list[tuple[str, Any]]: ...


async def _no_wait(timeout: float) -> None:
    return None


log = logging.getLogger("quilld")


@dataclass
class Runtime:
    """The settings CONFIG SET may change while the node runs (the config tree is frozen).

    Each starts from its config key (server.*); CONFIG SET changes it here, CONFIG GET reads
    it here, CONFIG REWRITE writes it back to the config file. What else CONFIG SET changes
    lives with the part that uses it: maxclients in `Clients.max_clients`, maxmemory in the
    keyspace's watermarks, the log level in the `quilld` logger.
    """

    timeout: int = 0  # seconds a client may stay idle before it is closed; 0: never (redis's timeout)
    slowlog_log_slower_than: int = 10_000  # microseconds; negative: nothing is logged; 0: every command
    slowlog_max_len: int = 128
    latency_monitor_threshold: int = 0  # milliseconds; 0: the latency monitor is off
    proto_max_bulk_len: int = 512 * 1024 * 1024
    maxmemory: int = 0  # dram.maxmemory: 0 is the whole arena; the keyspace's watermarks are fractions of it
    client_query_buffer_limit: int = 1024 * 1024 * 1024
    # redis parameters quilld has no use for, set by CONFIG SET where that is harmless (answered back)
    inert: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Config) -> "Runtime":
        s = cfg.server
        return cls(timeout=s.timeout, slowlog_log_slower_than=s.slowlog_log_slower_than,
                   slowlog_max_len=s.slowlog_max_len, latency_monitor_threshold=s.latency_monitor_threshold,
                   proto_max_bulk_len=s.proto_max_bulk_len, client_query_buffer_limit=s.client_query_buffer_limit,
                   maxmemory=cfg.dram.maxmemory)


@dataclass(eq=False)
class NodeContext:
    cfg: Config
    node_id: str
    keyspace: Keyspace
    puts: TwoPhasePuts
    scopes: ScopeRegistry
    users: Users
    control: ControlPlane
    table: CommandFigures  # protocol/table.py CommandTable
    clients: Any  # protocol/clients.py Clients (set right after construction: it needs the context)
    tiering: Tiering | None = None
    cluster: Cluster | None = None  # set once the node has joined (cluster.gossip_port)
    gateway: Reporting | None = None  # set once the gateway listens (gateway.port)
    leases: LeaseTable | None = None  # the shared-memory path's read leases (server.unixsocket set)
    config_file: str = ""
    port: int = 0  # the RESP port actually bound
    admin_port: int = 0
    gateway_port: int = 0
    # returns when arena space is next freed, or after `timeout` seconds
    space_freed: Callable[[float], Awaitable[None]] = _no_wait
    stats: Counter[str] = field(default_factory=Counter)  # node-wide cold counters (auth_failures, ...)
    auth_throttle: AuthThrottle = field(default_factory=AuthThrottle)  # failed logins per user and address
    started: float = field(default_factory=time.time)
    runtime: Runtime = field(default_factory=Runtime)  # replaced from cfg in __post_init__
    run_id: str = field(default_factory=lambda: os.urandom(20).hex())  # INFO run_id: this start of the node
    # the start step under way ("recovering the SSD tier", ...), "serving", then "stopping" (node.py);
    # the admin API's readiness (/readyz) reads it
    phase: str = "not started"
    replid: str = field(default_factory=lambda: os.urandom(20).hex())  # INFO master_replid
    # each HTTP listener's perimeter figures (connections, timeouts, malformed and refused requests)
    listeners: dict[str, ListenerFigures] = field(
        default_factory=lambda: {name: ListenerFigures() for name in LISTENERS})

    _salt_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.runtime = Runtime.from_config(self.cfg)
        self.table.set_timing(slow_ns(self.runtime))
        if self.runtime.maxmemory:
            apply_maxmemory(self, self.runtime.maxmemory)

    def salt_key(self) -> bytes:
        """The key of every cache_salt (index/engine_prompts.py `salt_for`), for the gateway and ROUTE
        alike: cluster.secret, else the host's peer secret (cluster/local_secret.py), the secret every
        node of the cluster already shares and no client can read."""
        if self._salt_key is None:
            try:
                self._salt_key = (self.cfg.cluster.secret or local_secret()).encode()
            except ConfigError as e:
                log.warning("no cluster secret for cache salts (%s): a random one, this process only", e.message)
                self._salt_key = secrets.token_bytes(32)
        return self._salt_key


def apply_maxmemory(ctx: NodeContext, n: int) -> None:
    """maxmemory `n` bytes (0: the whole arena): the keyspace's watermarks become fractions of it."""
    ks, dram = ctx.keyspace, ctx.cfg.dram
    ctx.runtime.maxmemory = n
    n = min(n or ks.capacity, ks.capacity)
    ks.limit = n  # with an SSD tier, writes past it wait for demotion (keyspace.py)
    ks.high_bytes = int(n * dram.high_watermark)
    ks.low_bytes = int(n * dram.low_watermark)
    ks.fit()


def slow_ns(rt: Runtime) -> int:
    """The shortest call (ns) the slowlog or the latency monitor wants to hear about."""
    limits = [rt.slowlog_log_slower_than * 1000] if rt.slowlog_log_slower_than >= 0 else []
    if rt.latency_monitor_threshold > 0:
        limits.append(rt.latency_monitor_threshold * 1_000_000)
    return min(limits) if limits else 1 << 62
