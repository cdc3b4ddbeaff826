"""Builds a quilld node's parts and owns their start and stop order.

Start: store, command table, RESP listener, admin API, housekeeping.
Stop: stop accepting, drain open replies, close connections, stop the
admin API, then release the arena.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from typing import Any

from quilld import __version__
from quilld.protocol.commands import build_table
from quilld.protocol.commands.blocks import large_target, release_args
from quilld.protocol.commands.connection import REDIS_VERSION
from quilld.config import Config
from quilld.index.control import ControlPlane
from quilld.scopes import ScopeRegistry
from quilld.protocol.server import RespConnection
from quilld.index.residency_feed import ResidencyFeed
from quilld.security import Users
from quilld.tiers.keyspace import Store
from quilld.tiers.puts import TwoPhasePuts

log = logging.getLogger("quilld")

HOUSEKEEPING_INTERVAL = 0.05  # seconds between expiry sweeps, lease checks and pin checks
DRAIN_TIMEOUT = 5.0  # seconds shutdown waits for replies still being written


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.2f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return str(n)


class Node:
    def __init__(self, cfg: Config, config_file: str = "") -> None:
        self.cfg = cfg
        self.config_file = config_file
        self.node_id = cfg.server.node_id or f"{socket.gethostname()}:{cfg.server.port}"
        self.users = Users.from_config(cfg.security)
        self.scopes = ScopeRegistry()
        self.store = Store(cfg.dram, self.scopes)
        self._space = asyncio.Event()  # set (and replaced) when arena space is freed while writers wait
        self._space_waiters = 0
        self.store.on_free = self._space_freed
        self.tiering: Any = None  # tiers/tiering.py Tiering when ssd.dir is set
        if cfg.ssd.dir:
            from quilld.tiers.tiering import Tiering

            self.tiering = Tiering(self.store, cfg.ssd, self.space_freed)
        self.puts = TwoPhasePuts(self.store, cfg.blocks.default_lease_ms, cfg.blocks.max_lease_ms)
        self.control = ControlPlane(cfg, self.scopes)
        self.feed = ResidencyFeed(self.control.index, self.node_id, self.scopes)
        self.store.listener = self.feed
        self.control.pool = [self.node_id]  # pool nodes whose copies ROUTE can fetch from
        self.table = build_table()
        self.connections: dict[int, RespConnection] = {}
        self.sessions: dict[int, Any] = {}
        self._draining: set[RespConnection] = set()
        self.stats: Counter[str] = Counter()
        self.commands_processed = 0
        self.net_in = 0
        self.net_out = 0
        self.started = time.time()
        self._server: asyncio.AbstractServer | None = None
        self._admin: Any = None
        self.gateway: Any = None  # quilld.http.gateway.Gateway when gateway.port is set
        self.cluster: Any = None  # quilld.cluster.cluster.Cluster when cluster.gossip_port is set
        self.gateway_port = cfg.gateway.port
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self.port = cfg.server.port
        self.admin_port = cfg.admin.port

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.cfg.server
        if self.tiering is not None:
            await self.tiering.start(self.scopes)  # recovery completes before anything is served
        self._server = await loop.create_server(
            lambda: RespConnection(self, large_target, release_args), s.bind, s.port,
            reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.cfg.admin.port:
            from quilld.http.admin import AdminServer

            self._admin = AdminServer(self)
            self.admin_port = await self._admin.start(s.bind, self.cfg.admin.port)
        await self.control.start()
        if self.cfg.cluster.gossip_port:
            from quilld.cluster.cluster import Cluster

            self.cluster = Cluster(self)
            await self.cluster.start()
        if self.cfg.gateway.port:
            from quilld.http.gateway import Gateway

            self.gateway = Gateway(self)
            self.gateway_port = await self.gateway.start(s.bind, self.cfg.gateway.port)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        log.info("quilld %s node %s listening on %s:%d (RESP), admin %s, DRAM %s",
                 __version__, self.node_id, s.bind, self.port,
                 f"{s.bind}:{self.admin_port}" if self._admin else "off", _human(self.store.capacity))

    async def stop(self) -> None:
        """Stop accepting, drain replies in flight, close clients, stop admin, free memory."""
        if self._server is None:
            return
        self._server.close()
        if self.cluster is not None:
            await self.cluster.stop()
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while any(c.has_pins for c in self.connections.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections.values()):
            conn.transport.close()
        await asyncio.sleep(0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.gateway is not None:
            await self.gateway.stop()
        if self._admin is not None:
            await self._admin.stop()
        await self.control.stop()
        self.puts.close()
        if self.tiering is not None:
            await self.tiering.stop()
        self.store.close()
        self._server = None
        self._stopped.set()
        log.info("quilld stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            try:
                self.store.sweep_expired()
                self.puts.reclaim_expired()
                self.control.housekeeping()
                if self._draining:
                    waiting, self._draining = self._draining, set()
                    for conn in waiting:
                        conn.check_drained()
            except Exception:  # a housekeeping bug must not stop housekeeping
                log.exception("housekeeping failed")

    # -- arena space ----------------------------------------------------------
    def _space_freed(self) -> None:
        if self._space_waiters:
            ev, self._space = self._space, asyncio.Event()
            ev.set()

    async def space_freed(self, timeout: float) -> None:
        """Return when arena space is next freed, or after `timeout` seconds, whichever is first."""
        self._space_waiters += 1
        try:
            await asyncio.wait_for(self._space.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._space_waiters -= 1

    # -- connection hooks -----------------------------------------------------
    def connection_opened(self, conn: RespConnection) -> None:
        if len(self.connections) >= self.cfg.server.max_clients:
            self.stats["rejected_connections"] += 1
            conn.transport.write(b"-ERR max number of clients reached\r\n")
            conn.transport.close()
            return
        self.connections[conn.session.id] = conn
        self.sessions[conn.session.id] = conn.session
        self.stats["total_connections_received"] += 1

    def connection_closed(self, conn: RespConnection) -> None:
        self.connections.pop(conn.session.id, None)
        self.sessions.pop(conn.session.id, None)
        self._draining.discard(conn)
        if self.cluster is not None:
            self.cluster.transfers.session_closed(conn.session.id)

    def parser_auth_changed(self, session: Any) -> None:
        conn = self.connections.get(session.id)
        if conn is not None:
            conn.parser.authenticated = session.authenticated

    def watch_drain(self, conn: RespConnection) -> None:
        self._draining.add(conn)

    def reset_stats(self) -> None:
        self.stats.clear()
        self.store.stats.clear()
        self.store.hits = self.store.misses = self.store.writes = 0
        self.scopes.refusals.clear()
        self.commands_processed = self.net_in = self.net_out = 0

    # -- introspection ------------------------------------------------------
    def counters(self) -> dict[str, int]:
        st, puts = self.store.stats, self.puts
        out = {
            "total_connections_received": self.stats["total_connections_received"],
            "total_commands_processed": self.commands_processed,
            "total_net_input_bytes": self.net_in,
            "total_net_output_bytes": self.net_out,
            "rejected_connections": self.stats["rejected_connections"],
            "expired_keys": st["expired"],
            "evicted_keys": st["evictions"],
            "keyspace_hits": self.store.hits,
            "keyspace_misses": self.store.misses,
            "auth_failures": self.stats["auth_failures"],
            "guard_refusals": self.scopes.total_refusals,
        }
        for reason in ("cross_tenant", "cross_model", "cross_tokenizer", "cross_adapter"):
            out[f"guard_refusals_{reason}"] = self.scopes.refusals[reason]
        out.update(put2phase_open=len(puts.open), put2phase_committed=puts.committed,
                   put2phase_aborted=puts.aborted, put2phase_expired=puts.expired)
        ctl = self.control
        out.update(kv_batches=ctl.stats["kv_batches"], kv_events=ctl.stats["kv_events"],
                   kv_malformed=ctl.stats["kv_malformed"], kv_gaps=ctl.stats["kv_gaps"],
                   routes=ctl.stats["routes"], engine_leases_expired=ctl.engines.expired_leases)
        return out

    def tier_stats(self) -> dict[str, Any]:
        st = self.store
        arena = st.arena.stats()
        return {
            "dram_capacity": st.capacity,
            "dram_used": st.used,
            "dram_used_arena": arena["used"],
            "dram_used_inline": st.inline_bytes,
            "dram_keys": len(st.data),
            "dram_blocks": st.block_count,
            "dram_reserved_blocks": st.reserved_blocks,
            "dram_pinned_unlinked": st.unlinked_pinned,
            "dram_held_bytes": st.held_bytes,
            "dram_largest_free": arena["largest_free"],
            "dram_fragmentation": arena["fragmentation"],
            "dram_high_watermark": self.cfg.dram.high_watermark,
            "dram_low_watermark": self.cfg.dram.low_watermark,
            "dram_inline_max": st.inline_max,
            "ssd_keys": len(st.ssd_data),
            "ssd_capacity": self.tiering.capacity if self.tiering else 0,
            "ssd_used": self.tiering.used if self.tiering else 0,
        }

    def info_sections(self, session: Any, names: list[str]) -> list[tuple[str, list[tuple[str, Any]]]]:
        now = time.time()
        uptime = int(now - self.started)
        st = self.store
        build = {
            "server": lambda: [
                ("redis_version", REDIS_VERSION), ("quilld_version", __version__), ("redis_mode", "standalone"),
                ("os", f"{os.uname().sysname} {os.uname().release} {os.uname().machine}"), ("arch_bits", 64),
                ("process_id", os.getpid()), ("node_id", self.node_id), ("tcp_port", self.port),
                ("server_time_usec", int(now * 1e6)), ("uptime_in_seconds", uptime),
                ("uptime_in_days", uptime // 86400), ("config_file", self.config_file)],
            "clients": lambda: [
                ("connected_clients", len(self.connections)), ("maxclients", self.cfg.server.max_clients),
                ("blocked_clients", 0)],
            "memory": lambda: [
                ("used_memory", st.used), ("used_memory_human", _human(st.used)),
                ("used_memory_rss", _rss_bytes()), ("used_memory_rss_human", _human(_rss_bytes())),
                ("maxmemory", st.capacity), ("maxmemory_human", _human(st.capacity)),
                ("maxmemory_policy", "allkeys-lru")],
            "stats": lambda: list(self.counters().items()),
            "replication": lambda: [
                ("role", "master"), ("connected_slaves", 0), ("master_failover_state", "no-failover"),
                ("master_replid", "0" * 40), ("master_replid2", "0" * 40), ("master_repl_offset", 0),
                ("second_repl_offset", -1), ("repl_backlog_active", 0), ("repl_backlog_size", 0),
                ("repl_backlog_first_byte_offset", 0), ("repl_backlog_histlen", 0)],
            "tiers": lambda: list(self.tier_stats().items()),
            "router": lambda: self._router_info(),
            "persistence": lambda: self.tiering.info() if self.tiering else [("ssd_enabled", 0)],
            "cluster": lambda: self.cluster.info() if self.cluster else [("cluster_enabled", 0)],
            "gateway": lambda: self.gateway.info() if self.gateway else [("gateway_enabled", 0)],
            "keyspace": lambda: self._keyspace(session),
        }
        return [(name.capitalize(), build[name]()) for name in names]

    def _router_info(self) -> list[tuple[str, Any]]:
        ctl = self.control
        subs = ctl.subscriber_stats()
        top = ",".join(f"{key.hex()}:{n}" for key, n in ctl.hot.top(5))
        return [("engines", len(ctl.engines.engines)), ("engine_residencies", len(ctl.index)),
                ("in_flight", sum(ctl.engines.in_flight.values())), ("routes", ctl.stats["routes"]),
                ("kv_batches", ctl.stats["kv_batches"]), ("kv_gaps", ctl.stats["kv_gaps"]),
                ("kv_subscriptions", ctl.subscriptions),
                ("kv_zmq_malformed", subs["malformed"]), ("kv_zmq_replays", subs["replays"]),
                ("kv_zmq_duplicates", subs["duplicates"]),
                ("hot_prefixes", top)]

    def _keyspace(self, session: Any) -> list[tuple[str, Any]]:
        keys = self.store.keys_in(session.tag)
        if not keys:
            return []
        tag = session.tag
        expires = sum(1 for fk in self.store.expires if fk[:len(tag)] == tag)
        return [("db0", f"keys={keys},expires={expires},avg_ttl=0")]
