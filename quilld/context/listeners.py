"""The HTTP listeners' figures, and the share of the process's file descriptors they may hold.

Each HTTP port (the admin API, the gateway) counts what its perimeter did in a
`ListenerFigures` kept in the node's context, so `/metrics`, `/v1/stats` and the
status page read the same numbers.

Descriptors. A process has RLIMIT_NOFILE descriptors (its soft limit); RESP clients,
the SSD tier's files, gossip and peer connections need theirs. The HTTP listeners
together may hold at most `1 / HTTP_FD_SHARE` of the limit (`http_budget`), whatever
their configured `max_connections`: a flood of HTTP connections (slowloris) then never
takes a descriptor a RESP client needs. A gateway connection may hold a connection to
an engine too (the gateway's pool to engines is capped at the same number), so it counts
twice. Whoever sizes RESP's `maxclients` to the limit leaves `http_budget(...).fds`
descriptors to HTTP.
"""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import dataclass, field

from quilld.config import Config

HTTP_FD_SHARE = 4  # the HTTP listeners hold at most a quarter of RLIMIT_NOFILE's soft limit
ADMIN_SHARE = 4  # of the HTTP quarter, the admin API takes at most a quarter; the gateway the rest
LISTENERS = ("admin", "gateway")
UNLIMITED = 1 << 20  # what an unlimited RLIMIT_NOFILE counts as (Linux's default nr_open)


@dataclass
class ListenerFigures:
    """What one HTTP port's perimeter counted (the listener's name is its key in `NodeContext.listeners`)."""

    max_connections: int = 0  # the cap in force (0: the listener is off)
    open: int = 0  # connections open now
    refused: int = 0  # connections refused at the cap (answered 503 and closed)
    header_timeouts: int = 0  # connections closed for sending no complete request head in time
    body_timeouts: int = 0  # requests answered 408 for sending no complete body in time
    malformed: Counter[str] = field(default_factory=Counter)  # requests that were not HTTP, by kind
    refusals: Counter[str] = field(default_factory=Counter)  # requests refused by the perimeter, by reason


@dataclass(frozen=True)
class HttpBudget:
    """The connection caps of the HTTP listeners under a descriptor limit."""

    nofile: int  # RLIMIT_NOFILE's soft limit they were computed for
    admin: int  # connections the admin API may hold (0: off)
    gateway: int  # client connections the gateway may hold, and connections to engines (0: off)

    @property
    def fds(self) -> int:
        """Descriptors the HTTP listeners may hold at most, all connections open."""
        return self.admin + 2 * self.gateway


def http_budget(cfg: Config, nofile: int) -> HttpBudget:
    """The caps `cfg`'s HTTP listeners get under a limit of `nofile` descriptors: each its
    `max_connections`, cut so that together they fit in `nofile // HTTP_FD_SHARE` (at least one each)."""
    share = nofile // HTTP_FD_SHARE
    admin = min(cfg.admin.max_connections, max(1, share // ADMIN_SHARE)) if cfg.admin.port else 0
    gateway = min(cfg.gateway.max_connections, max(1, (share - admin) // 2)) if cfg.gateway.port else 0
    return HttpBudget(nofile, admin, gateway)


def soft_nofile() -> int:
    """The process's descriptor limit now (RLIMIT_NOFILE's soft limit)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return UNLIMITED if soft == resource.RLIM_INFINITY else soft
