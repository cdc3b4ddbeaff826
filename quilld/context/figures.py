"""The node's figures that both front ends read: INFO (protocol/info.py), `/v1/stats` and
`/metrics` (http/). Each part keeps its own counters; these functions only read and name them.
What a tenant sees of other tenants is aggregate only.
"""

from __future__ import annotations

import os
from typing import Any

from quilld.context.node_context import NodeContext


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def human(n: float) -> str:
    """redis's bytesToHuman: 100B, 1.50K, 2.00M ..."""
    n = int(n)
    if n < 1024:
        return f"{n}B"
    for i, unit in enumerate("KMGTP", 1):
        if n < 1024 ** (i + 1) or unit == "P":
            return f"{n / 1024 ** i:.2f}{unit}"
    return f"{n}B"


def counters(ctx: NodeContext, tenant: str | None = None) -> dict[str, int]:
    """The node's counters; with `tenant`, those that tell about tenants' data (lookups, the
    guard's refusals) count that tenant's own only. The admin API shows everyone's (None)."""
    ks, puts, clients, scopes = ctx.keyspace, ctx.puts, ctx.clients, ctx.scopes
    st = ks.stats
    hits, misses = ks.lookups_of(tenant)
    refusals = scopes.refusals_of() if tenant is None else scopes.refusals_seen_by(tenant)
    out = {
        "total_connections_received": clients.stats["total_connections_received"],
        "total_commands_processed": clients.commands_processed,
        "total_net_input_bytes": clients.net_in,
        "total_net_output_bytes": clients.net_out,
        "rejected_connections": clients.stats["rejected_connections"],
        "payload_timeouts": clients.stats["payload_timeouts"],
        "expired_keys": st["expired"],
        "evicted_keys": st["evictions"],
        "evicted_chain_tails": st["evictions_chain_tail"],  # of those: a chain's tail taken before its head
        "unfilled_refused": st["unfilled_refused"],
        "keyspace_hits": hits,
        "keyspace_misses": misses,
        "auth_failures": ctx.stats["auth_failures"],
        "auth_throttled": ctx.stats["auth_throttled"],  # AUTHs answered late: their user or address kept failing
        "peerauth_failures": ctx.stats["peerauth_failures"],  # PEERAUTHs with a wrong cluster secret
        "peerauth_throttled": ctx.stats["peerauth_throttled"],  # ... and those answered late
        "cross_protocol_closed": ctx.stats["cross_protocol_closed"],  # HTTP requests sent to the RESP port
        "client_query_buffer_limit_disconnections": clients.stats["client_query_buffer_limit_disconnections"],
        "exec_holds": clients.stats["exec_holds"],  # EXECs that held the node while a command waited (SSD, peer)
        "exec_hold_timeouts": clients.stats["exec_hold_timeouts"],  # ... commands they cut off (server.exec_hold_ms)
        "internal_errors": ctx.stats["internal_errors"],  # commands answered "internal error" (a bug; logged)
        "guard_refusals": sum(refusals.values()),
        "identity_scopes": len(scopes) if tenant is None else scopes.scopes_of(tenant),
        "identity_scopes_released": scopes.released,
        "identity_scopes_refused": scopes.limited,
    }
    for reason, n in refusals.items():
        out[f"guard_refusals_{reason}"] = n
    out.update(put2phase_open=len(puts.open), put2phase_committed=puts.committed,
               put2phase_aborted=puts.aborted, put2phase_expired=puts.expired,
               put2phase_refused=puts.refused)
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
    ctx.table.reset_stats()


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
        "dram_high_watermark": round(ks.high_bytes / ks.capacity, 6) if ks.capacity else cfg.dram.high_watermark,
        "dram_low_watermark": round(ks.low_bytes / ks.capacity, 6) if ks.capacity else cfg.dram.low_watermark,
        "dram_inline_max": ks.inline_max,
        "ssd_keys": len(ks.lower),
        "ssd_capacity": tiering.capacity if tiering else 0,
        "ssd_used": tiering.used if tiering else 0,
    }
