"""The node's figures, gathered from each part: INFO's sections, and the admin API's stats.

Each part keeps its own counters; this module only reads and names them, so
INFO, `/v1/stats` and `/metrics` always agree.
"""

from __future__ import annotations

import os
import time
from typing import Any

from quilld import __version__
from quilld.protocol.context import NodeContext

REDIS_VERSION = "7.0.15"  # what INFO and HELLO report: the redis release whose replies quilld matches


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.2f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return str(n)


def counters(ctx: NodeContext, tenant: str | None = None) -> dict[str, int]:
    """The node's counters; with `tenant`, those that tell about tenants' data (lookups, the
    guard's refusals) count that tenant's own only. The admin API shows everyone's (None)."""
    ks, puts, clients, scopes = ctx.keyspace, ctx.puts, ctx.clients, ctx.scopes
    st = ks.stats
    hits, misses = ks.lookups_of(tenant)
    refusals = scopes.refusals_of(tenant)
    out = {
        "total_connections_received": clients.stats["total_connections_received"],
        "total_commands_processed": clients.commands_processed,
        "total_net_input_bytes": clients.net_in,
        "total_net_output_bytes": clients.net_out,
        "rejected_connections": clients.stats["rejected_connections"],
        "payload_timeouts": clients.stats["payload_timeouts"],
        "expired_keys": st["expired"],
        "evicted_keys": st["evictions"],
        "unfilled_refused": st["unfilled_refused"],
        "keyspace_hits": hits,
        "keyspace_misses": misses,
        "auth_failures": ctx.stats["auth_failures"],
        "auth_throttled": ctx.stats["auth_throttled"],  # AUTHs answered late: their address kept failing
        "auth_throttle_refused": ctx.stats["auth_throttle_refused"],  # ... or refused outright
        "client_query_buffer_limit_disconnections": clients.stats["client_query_buffer_limit_disconnections"],
        "internal_errors": ctx.stats["internal_errors"],  # commands answered "internal error" (a bug; logged)
        "guard_refusals": sum(refusals.values()),
        "identity_scopes": len(scopes) if tenant is None else scopes.scopes_of(tenant),
        "identity_scopes_released": scopes.released,
        "identity_scopes_refused": scopes.limited,
    }
    for reason, n in refusals.items():
        out[f"guard_refusals_{reason}"] = n
    out.update(put2phase_open=len(puts.open), put2phase_committed=puts.committed,
               put2phase_aborted=puts.aborted, put2phase_expired=puts.expired)
    ctl = ctx.control
    out.update(kv_batches=ctl.stats["kv_batches"], kv_events=ctl.stats["kv_events"],
               kv_malformed=ctl.stats["kv_malformed"], kv_gaps=ctl.stats["kv_gaps"],
               routes=ctl.stats["routes"], engine_leases_expired=ctl.engines.expired_leases)
    return out


def reset_stats(ctx: NodeContext) -> None:
    """CONFIG RESETSTAT."""
    ctx.stats.clear()
    ctx.clients.reset_stats()
    ks = ctx.keyspace
    ks.stats.clear()
    ks.reset_lookups()
    ctx.scopes.refusals.clear()


def tier_stats(ctx: NodeContext) -> dict[str, Any]:
    ks, cfg, tiering = ctx.keyspace, ctx.cfg, ctx.tiering
    arena = ks.arena.stats()
    return {
        "dram_capacity": ks.capacity,
        "dram_used": ks.used,
        "dram_used_arena": arena["used"],
        "dram_used_inline": ks.inline_bytes,
        "dram_keys": len(ks.data),
        "dram_blocks": ks.block_count,
        "dram_reserved_blocks": ks.reserved_blocks,
        "dram_pinned_unlinked": ks.unlinked_pinned,
        "dram_held_bytes": ks.held_bytes,
        "dram_unfilled_bytes": ks.unfilled_bytes,
        "dram_largest_free": arena["largest_free"],
        "dram_fragmentation": arena["fragmentation"],
        "dram_high_watermark": cfg.dram.high_watermark,
        "dram_low_watermark": cfg.dram.low_watermark,
        "dram_inline_max": ks.inline_max,
        "ssd_keys": len(ks.lower),
        "ssd_capacity": tiering.capacity if tiering else 0,
        "ssd_used": tiering.used if tiering else 0,
    }


def info_sections(ctx: NodeContext, session: Any, names: list[str]) -> list[tuple[str, list[tuple[str, Any]]]]:
    now = time.time()
    uptime = int(now - ctx.started)
    ks = ctx.keyspace
    build = {
        "server": lambda: [
            ("redis_version", REDIS_VERSION), ("quilld_version", __version__), ("redis_mode", "standalone"),
            ("os", f"{os.uname().sysname} {os.uname().release} {os.uname().machine}"), ("arch_bits", 64),
            ("process_id", os.getpid()), ("node_id", ctx.node_id), ("tcp_port", ctx.port),
            ("server_time_usec", int(now * 1e6)), ("uptime_in_seconds", uptime),
            ("uptime_in_days", uptime // 86400), ("config_file", ctx.config_file)],
        "clients": lambda: [
            ("connected_clients", sum(1 for s in ctx.clients.sessions.values() if s.user == session.user)), ("maxclients", ctx.cfg.server.max_clients),
            ("blocked_clients", 0)],
        "memory": lambda: [
            ("used_memory", ks.used), ("used_memory_human", human(ks.used)),
            ("used_memory_rss", rss_bytes()), ("used_memory_rss_human", human(rss_bytes())),
            ("maxmemory", ks.capacity), ("maxmemory_human", human(ks.capacity)),
            ("maxmemory_policy", "allkeys-lru")],
        "stats": lambda: list(counters(ctx, session.user).items()),
        "replication": lambda: [
            ("role", "master"), ("connected_slaves", 0), ("master_failover_state", "no-failover"),
            ("master_replid", "0" * 40), ("master_replid2", "0" * 40), ("master_repl_offset", 0),
            ("second_repl_offset", -1), ("repl_backlog_active", 0), ("repl_backlog_size", 0),
            ("repl_backlog_first_byte_offset", 0), ("repl_backlog_histlen", 0)],
        "tiers": lambda: list(tier_stats(ctx).items()),
        "router": lambda: _router_info(ctx),
        "persistence": lambda: ctx.tiering.info() if ctx.tiering else [("ssd_enabled", 0)],
        "cluster": lambda: ctx.cluster.info() if ctx.cluster else [("cluster_enabled", 0)],
        "gateway": lambda: ctx.gateway.info() if ctx.gateway else [("gateway_enabled", 0)],
        "keyspace": lambda: _keyspace(ctx, session),
    }
    return [(name.capitalize(), build[name]()) for name in names]


def _router_info(ctx: NodeContext) -> list[tuple[str, Any]]:
    ctl = ctx.control
    subs = ctl.subscriber_stats()
    top = ",".join(f"{key.hex()}:{n}" for key, n in ctl.hot.top(5))
    return [("engines", len(ctl.engines.engines)), ("engine_residencies", len(ctl.index)),
            ("in_flight", sum(ctl.engines.in_flight.values())), ("routes", ctl.stats["routes"]),
            ("kv_batches", ctl.stats["kv_batches"]), ("kv_gaps", ctl.stats["kv_gaps"]),
            ("kv_subscriptions", ctl.subscriptions),
            ("kv_zmq_malformed", subs["malformed"]), ("kv_zmq_replays", subs["replays"]),
            ("kv_zmq_duplicates", subs["duplicates"]),
            ("kv_events", ctl.stats["kv_events"]), ("kv_malformed", ctl.stats["kv_malformed"]),
            ("kv_zmq_gaps", subs["gaps"]), ("kv_zmq_missed", subs["missed"]), ("kv_zmq_restarts", subs["restarts"]),
            ("hot_prefixes", top)] + _engine_feeds(ctx)


ENGINE_FEED_FIELDS = ("batches", "events", "malformed", "gaps", "replays", "restarts", "missed", "drops")


def _engine_feeds(ctx: NodeContext) -> list[tuple[str, Any]]:
    """One INFO line per engine, `kv_engine_<id>:batches=..,...,last_seq=..,state=..,idle_s=..`."""
    ctl, now, out = ctx.control, time.monotonic(), []
    for engine_id in ctl.engines.engines:
        f = ctl.feed_view(engine_id, now)
        fields = [f"{k}={f[k]}" for k in ENGINE_FEED_FIELDS]
        last = f["last_seq"]
        fields += [f"last_seq={-1 if last is None else last}", f"state={f['state']}", f"idle_s={f['idle_s']}"]
        out.append((f"kv_engine_{_info_name(engine_id)}", ",".join(fields)))
    return out


def _info_name(name: str) -> str:
    return "".join("_" if c in ":,= \r\n" else c for c in name)


def _keyspace(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    keys = ctx.keyspace.keys_in(session.tag)
    if not keys:
        return []
    tag = session.tag
    expires = sum(1 for fk in ctx.keyspace.expires if fk[:len(tag)] == tag)
    return [("db0", f"keys={keys},expires={expires},avg_ttl=0")]
