"""The node's figures, gathered from each part: INFO's sections, and the admin API's stats.

Each part keeps its own counters; this module only reads and names them, so
INFO, `/v1/stats` and `/metrics` always agree.

INFO answers redis 7.0's sections with redis's field names, in redis's order
(server, clients, memory, persistence, stats, replication, cpu, modules,
commandstats, errorstats, latencystats, cluster, keyspace), then quilld's own
(tiers, router, gateway); `cluster` is quilld's cluster. Redis fields for what
quilld does not have (RDB and AOF, replication, Lua, forks, active defrag) are
those of a redis that never used it: zeros, `ok` statuses. `used_memory` is
what maxmemory (dram.maxmemory, of which the DRAM watermarks are fractions; 0, as
set, is the whole arena, the tiers section's dram_capacity) is measured against: the arena's pages and the values kept inline, not the Python
heap (`used_memory_rss` is the process).
What a tenant sees of other tenants is aggregate only: its own clients, its own
keyspace hits and misses, its own keys.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any, Callable

from quilld import __version__, native
from quilld.context.figures import counters, human, rss_bytes, system_memory, tier_stats
from quilld.context.node_context import NodeContext
from quilld.protocol.table import bucket_top

REDIS_VERSION = "7.0.15"  # what INFO and HELLO report: the redis release whose replies quilld matches
HZ = 20  # node.py's housekeeping runs every 0.05 s (HOUSEKEEPING_INTERVAL): redis's hz
MEM_ALLOCATOR = "pymalloc+arena"  # values in quilld's offset-allocated mmap arena, the rest in Python's heap
LATENCY_PERCENTILES = (50.0, 99.0, 99.9)  # latency-tracking-info-percentiles
DEFAULT_SECTIONS = ("server", "clients", "memory", "persistence", "stats", "replication", "cpu", "modules",
                    "errorstats", "cluster", "keyspace", "tiers", "shm", "router", "gateway")
ALL_SECTIONS = ("server", "clients", "memory", "persistence", "stats", "replication", "cpu", "modules",
                "commandstats", "errorstats", "latencystats", "cluster", "keyspace", "tiers", "shm", "router",
                "gateway")
_ALIASES = {"module_list": "modules"}
_TITLES = {"cpu": "CPU"}


def wanted_sections(args: list[str]) -> list[str]:
    """The sections INFO's arguments name, in INFO's order (`default`, `all`, `everything`)."""
    if not args:
        return list(DEFAULT_SECTIONS)
    names: set[str] = set()
    for a in (a.lower() for a in args):
        if a == "default":
            names.update(DEFAULT_SECTIONS)
        elif a in ("all", "everything"):
            names.update(ALL_SECTIONS)
        else:
            names.add(_ALIASES.get(a, a))
    return [n for n in ALL_SECTIONS if n in names]


def info_sections(ctx: NodeContext, session: Any, names: list[str]) -> list[tuple[str, list[tuple[str, Any]]]]:
    builders: dict[str, Callable[[NodeContext, Any], list[tuple[str, Any]]]] = {
        "server": _server, "clients": _clients, "memory": _memory, "persistence": _persistence,
        "stats": _stats, "replication": _replication, "cpu": _cpu, "modules": lambda ctx, s: [],
        "commandstats": _commandstats, "errorstats": _errorstats, "latencystats": _latencystats,
        "cluster": lambda ctx, s: ctx.cluster.info() if ctx.cluster else [("cluster_enabled", 0)],
        "keyspace": _keyspace, "tiers": lambda ctx, s: list(tier_stats(ctx).items()), "shm": _shm,
        "router": _router,
        "gateway": lambda ctx, s: ctx.gateway.info() if ctx.gateway else [("gateway_enabled", 0)],
    }
    return [(_TITLES.get(name, name.capitalize()), builders[name](ctx, session)) for name in names if name in builders]


def render_info(sections: list[tuple[str, list[tuple[str, Any]]]]) -> str:
    return "\r\n".join(f"# {title}\r\n" + "".join(f"{k}:{v}\r\n" for k, v in fields)
                       for title, fields in sections)


def _server(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    now = time.time()
    uptime = int(now - ctx.started)
    u = os.uname()
    return [
        ("redis_version", REDIS_VERSION), ("redis_git_sha1", "00000000"), ("redis_git_dirty", 0),
        ("redis_build_id", f"quilld-{__version__}"), ("redis_mode", "standalone"),
        ("os", f"{u.sysname} {u.release} {u.machine}"), ("arch_bits", 64),
        ("monotonic_clock", "POSIX clock_gettime"), ("multiplexing_api", "epoll"), ("atomicvar_api", "none"),
        ("gcc_version", "0.0.0"), ("process_id", os.getpid()), ("process_supervised", "no"),
        ("run_id", ctx.run_id), ("tcp_port", ctx.port), ("server_time_usec", int(now * 1e6)),
        ("uptime_in_seconds", uptime), ("uptime_in_days", uptime // 86400), ("hz", HZ), ("configured_hz", HZ),
        ("lru_clock", int(now) & 0xFFFFFF), ("executable", sys.executable), ("config_file", ctx.config_file),
        ("io_threads_active", 0), ("quilld_version", __version__), ("node_id", ctx.node_id),
        ("python_version", ".".join(map(str, sys.version_info[:3]))),
        ("quilld_build", native.running()[0]),  # compiled | pure: the hot path (quilld/native.py)
    ]


def _clients(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    clients = ctx.clients
    mine = [conn for conn in clients.connections.values() if conn.session.user == session.user]
    max_in = max((conn.parser.query_bytes() for conn in mine), default=0)
    max_out = max((conn.transport.get_write_buffer_size() for conn in mine if conn.transport), default=0)
    watching, watched = clients.watches.clients_watching(conn.session for conn in mine)
    return [("connected_clients", len(mine)), ("cluster_connections", 0), ("maxclients", clients.max_clients),
            ("client_recent_max_input_buffer", max_in), ("client_recent_max_output_buffer", max_out),
            ("blocked_clients", 0), ("tracking_clients", sum(conn.session.tracking is not None for conn in mine)),
            ("clients_in_timeout_table", 0),
            ("watching_clients", watching), ("total_watched_keys", watched)]  # these two: redis 7.4's


def _memory(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    ks = ctx.keyspace
    used, rss = ks.used, rss_bytes()
    peak = ctx.stats["used_memory_peak"] = max(ctx.stats["used_memory_peak"], used)
    overhead = max(rss - used, 0)
    total = system_memory()
    arena = ks.arena.stats()
    maxmemory = ctx.runtime.maxmemory  # as set, as CONFIG GET answers it: 0 is the whole arena (dram_capacity)
    return [
        ("used_memory", used), ("used_memory_human", human(used)), ("used_memory_rss", rss),
        ("used_memory_rss_human", human(rss)), ("used_memory_peak", peak), ("used_memory_peak_human", human(peak)),
        ("used_memory_peak_perc", f"{used * 100 / peak if peak else 100:.2f}%"),
        ("used_memory_overhead", overhead), ("used_memory_startup", 0), ("used_memory_dataset", used),
        ("used_memory_dataset_perc", f"{used * 100 / (used + overhead) if used + overhead else 0:.2f}%"),
        ("allocator_allocated", arena["used"]), ("allocator_active", arena["used"]), ("allocator_resident", rss),
        ("total_system_memory", total), ("total_system_memory_human", human(total)),
        ("used_memory_lua", 0), ("used_memory_vm_eval", 0), ("used_memory_lua_human", "0B"),
        ("used_memory_scripts_eval", 0), ("number_of_cached_scripts", 0), ("number_of_functions", 0),
        ("number_of_libraries", 0), ("used_memory_vm_functions", 0), ("used_memory_vm_total", 0),
        ("used_memory_vm_total_human", "0B"), ("used_memory_functions", 0), ("used_memory_scripts", 0),
        ("used_memory_scripts_human", "0B"), ("maxmemory", maxmemory), ("maxmemory_human", human(maxmemory)),
        ("maxmemory_policy", ks.policy), ("allocator_frag_ratio", f"{arena['fragmentation'] + 1:.2f}"),
        ("allocator_frag_bytes", 0), ("allocator_rss_ratio", f"{rss / arena['used'] if arena['used'] else 1:.2f}"),
        ("allocator_rss_bytes", max(rss - arena["used"], 0)), ("rss_overhead_ratio", "1.00"),
        ("rss_overhead_bytes", 0), ("mem_fragmentation_ratio", f"{rss / used if used else 0:.2f}"),
        ("mem_fragmentation_bytes", rss - used), ("mem_not_counted_for_evict", 0), ("mem_replication_backlog", 0),
        ("mem_total_replication_buffers", 0), ("mem_clients_slaves", 0),
        ("mem_clients_normal", sum(conn.parser.query_bytes() for conn in ctx.clients.connections.values())),
        ("mem_cluster_links", 0), ("mem_aof_buffer", 0), ("mem_allocator", MEM_ALLOCATOR),
        ("active_defrag_running", 0), ("lazyfree_pending_objects", 0), ("lazyfreed_objects", 0),
    ]


def _persistence(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    """redis's fields as a redis that never saves reports them, then the SSD tier's."""
    redis = [
        ("loading", 0), ("async_loading", 0), ("current_cow_peak", 0), ("current_cow_size", 0),
        ("current_cow_size_age", 0), ("current_fork_perc", "0.00"), ("current_save_keys_processed", 0),
        ("current_save_keys_total", 0), ("rdb_changes_since_last_save", 0), ("rdb_bgsave_in_progress", 0),
        ("rdb_last_save_time", int(ctx.started)), ("rdb_last_bgsave_status", "ok"), ("rdb_last_bgsave_time_sec", -1),
        ("rdb_current_bgsave_time_sec", -1), ("rdb_saves", 0), ("rdb_last_cow_size", 0),
        ("rdb_last_load_keys_expired", 0), ("rdb_last_load_keys_loaded", 0), ("aof_enabled", 0),
        ("aof_rewrite_in_progress", 0), ("aof_rewrite_scheduled", 0), ("aof_last_rewrite_time_sec", -1),
        ("aof_current_rewrite_time_sec", -1), ("aof_last_bgrewrite_status", "ok"), ("aof_rewrites", 0),
        ("aof_rewrites_consecutive_failures", 0), ("aof_last_write_status", "ok"), ("aof_last_cow_size", 0),
        ("module_fork_in_progress", 0), ("module_fork_last_cow_size", 0),
    ]
    return redis + (ctx.tiering.info() if ctx.tiering else [("ssd_enabled", 0)])


def _stats(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    c = counters(ctx, session.user)
    ops, kin, kout = ctx.clients.instantaneous()
    _, keys, items, prefixes = ctx.clients.tracking.figures()
    if session.user != "default":  # the table is the node's: a tenant is not told how full others keep it
        keys = items = 0
        prefixes = sum(len(s.tracking.prefixes) for s in ctx.clients.sessions.values()
                       if s.user == session.user and s.tracking is not None)
    channels = int(any(s.channels for s in ctx.clients.sessions.values() if s.user == session.user))
    redis = [
        ("total_connections_received", c["total_connections_received"]),
        ("total_commands_processed", c["total_commands_processed"]), ("instantaneous_ops_per_sec", ops),
        ("total_net_input_bytes", c["total_net_input_bytes"]), ("total_net_output_bytes", c["total_net_output_bytes"]),
        ("total_net_repl_input_bytes", 0), ("total_net_repl_output_bytes", 0),
        ("instantaneous_input_kbps", f"{kin:.2f}"), ("instantaneous_output_kbps", f"{kout:.2f}"),
        ("instantaneous_input_repl_kbps", "0.00"), ("instantaneous_output_repl_kbps", "0.00"),
        ("rejected_connections", c["rejected_connections"]), ("sync_full", 0), ("sync_partial_ok", 0),
        ("sync_partial_err", 0), ("expired_keys", c["expired_keys"]), ("expired_stale_perc", "0.00"),
        ("expired_time_cap_reached_count", 0), ("expire_cycle_cpu_milliseconds", 0),
        ("evicted_keys", c["evicted_keys"]), ("evicted_clients", 0), ("total_eviction_exceeded_time", 0),
        ("current_eviction_exceeded_time", 0), ("keyspace_hits", c["keyspace_hits"]),
        ("keyspace_misses", c["keyspace_misses"]), ("pubsub_channels", channels), ("pubsub_patterns", 0),
        ("pubsubshard_channels", 0), ("latest_fork_usec", 0), ("total_forks", 0), ("migrate_cached_sockets", 0),
        ("slave_expires_tracked_keys", 0), ("active_defrag_hits", 0), ("active_defrag_misses", 0),
        ("active_defrag_key_hits", 0), ("active_defrag_key_misses", 0), ("total_active_defrag_time", 0),
        ("current_active_defrag_time", 0), ("tracking_total_keys", keys), ("tracking_total_items", items),
        ("tracking_total_prefixes", prefixes), ("unexpected_error_replies", 0),
        ("total_error_replies", ctx.table.error_replies), ("dump_payload_sanitizations", 0),
        ("io_threaded_reads_processed", 0), ("io_threaded_writes_processed", 0),
    ]
    seen = {k for k, _ in redis}
    return redis + [(k, v) for k, v in c.items() if k not in seen]


def _replication(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    backlog = ctx.runtime.inert.get("repl-backlog-size", "1048576")
    return [("role", "master"), ("connected_slaves", 0), ("master_failover_state", "no-failover"),
            ("master_replid", ctx.replid), ("master_replid2", "0" * 40), ("master_repl_offset", 0),
            ("second_repl_offset", -1), ("repl_backlog_active", 0), ("repl_backlog_size", backlog),
            ("repl_backlog_first_byte_offset", 0), ("repl_backlog_histlen", 0)]


def _seconds(t: float) -> str:
    return f"{int(t)}.{int(round((t - int(t)) * 1e6)) % 1000000:06d}"


def _cpu(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = [("used_cpu_sys", _seconds(me.ru_stime)), ("used_cpu_user", _seconds(me.ru_utime)),
           ("used_cpu_sys_children", _seconds(kids.ru_stime)), ("used_cpu_user_children", _seconds(kids.ru_utime))]
    thread = getattr(resource, "RUSAGE_THREAD", None)
    if thread is not None:
        main = resource.getrusage(thread)
        out += [("used_cpu_sys_main_thread", _seconds(main.ru_stime)),
                ("used_cpu_user_main_thread", _seconds(main.ru_utime))]
    return out


def _info_name(name: str) -> str:
    """A name as an INFO field: redis replaces `#:\\n\\r` (and quilld `,= ` too) with `_`."""
    return "".join("_" if c in "#:,= \r\n" else c for c in name)


def _every_command(ctx: NodeContext):
    for cmd in ctx.table.commands.values():
        yield cmd
        yield from cmd.subcommands.values()


def _commandstats(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    """cmdstat_<name>:calls,usec,usec_per_call,rejected_calls,failed_calls: usec is the timed calls'
    total scaled to all calls (the fast path times one call in table.SAMPLE_EVERY)."""
    out = []
    for cmd in _every_command(ctx):
        calls, ns, timed, rejected, failed, _ = ctx.table.stats[cmd.name]
        if not (calls or rejected or failed):
            continue
        usec = round(ns / timed * calls / 1000) if timed else 0
        out.append((f"cmdstat_{_info_name(cmd.name)}",
                    f"calls={calls},usec={usec},usec_per_call={usec / calls if calls else 0:.2f},"
                    f"rejected_calls={rejected},failed_calls={failed}"))
    return out


def _errorstats(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    return [(f"errorstat_{_info_name(name)}", f"count={n}") for name, n in sorted(ctx.table.errors.items())]


def percentiles(hist: dict[int, int], wanted: tuple[float, ...] = LATENCY_PERCENTILES) -> list[float]:
    """Microseconds at each percentile of a table latency histogram (bucket -> count)."""
    total = sum(hist.values())
    buckets = sorted(hist.items())
    out = []
    for p in wanted:
        need, seen, value = total * p / 100, 0, 0
        for bucket, n in buckets:
            seen += n
            value = bucket_top(bucket)
            if seen >= need:
                break
        out.append(value / 1000)
    return out


def _latencystats(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    out = []
    for cmd in _every_command(ctx):
        hist = ctx.table.stats[cmd.name][5]
        if hist:
            values = percentiles(hist)
            out.append((f"latency_percentiles_usec_{_info_name(cmd.name)}",
                        ",".join(f"p{p:g}={v:.3f}" for p, v in zip(LATENCY_PERCENTILES, values))))
    return out


def _shm(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    """The shared-memory path (server.unixsocket): clients attached, leases live and how they ended."""
    leases = ctx.leases
    if leases is None:
        return [("shm_enabled", 0)]
    return [("shm_enabled", 1), ("shm_unixsocket", ctx.cfg.server.unixsocket),
            ("shm_attached_clients", sum(1 for s in ctx.clients.sessions.values() if s.shm)),
            ("shm_attaches", ctx.stats["shm_attaches"]), ("shm_attaches_refused", ctx.stats["shm_attach_refused"]),
            ("shm_leases_live", leases.live), ("shm_leases_granted", leases.granted),
            ("shm_leases_released", leases.released), ("shm_leases_expired", leases.expired),
            ("shm_leases_dropped", leases.dropped), ("shm_lease_slots", leases.slots),
            ("shm_lease_slots_per_user", leases.max_per_user), ("shm_leases_refused_user", leases.refused_user),
            *_lookup_fields(ctx.keyspace.lookup_table)]


def _lookup_fields(table) -> list:
    """The same-host lookup table: its entries, how many blocks went in and out, how many found no
    entry free, and how many keys clients were seen reading through it (housekeeping's count)."""
    if table is None:
        return [("shm_lookup_slots", 0)]
    return [("shm_lookup_slots", table.slots), ("shm_lookup_entries", table.entries),
            ("shm_lookup_added", table.added), ("shm_lookup_dropped", table.dropped),
            ("shm_lookup_full", table.full), ("shm_lookup_reads_noted", table.reads_noted)]


def _router(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
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
            ("sessions", len(ctl.sessions)), ("session_evictions_full", ctl.sessions.evicted_full),
            ("session_evictions_idle", ctl.sessions.evicted_idle),
            ("hot_prefixes", top)] + _engine_feeds(ctx)


HASH_CHECK_RESULTS = ("agreed", "disagreed", "unverifiable")
ENGINE_FEED_FIELDS = ("batches", "events", "malformed", "gaps", "replays", "restarts", "missed", "drops")


def _engine_feeds(ctx: NodeContext) -> list[tuple[str, Any]]:
    """One INFO line per engine, `kv_engine_<id>:batches=..,...,last_seq=..,state=..,idle_s=..`, then, for an
    engine whose block hashes are checked, the blocks `hash_agreed=..,hash_disagreed=..,hash_unverifiable=..`
    and `hash_check=` its state (checking, seed_unknown)."""
    ctl, now, out = ctx.control, time.monotonic(), []
    for engine_id in ctl.engines.engines:
        f = ctl.feed_view(engine_id, now)
        fields = [f"{k}={f[k]}" for k in ENGINE_FEED_FIELDS]
        last = f["last_seq"]
        fields += [f"last_seq={-1 if last is None else last}", f"state={f['state']}", f"idle_s={f['idle_s']}"]
        check = f["hash_check"]  # engines naming their prefix-cache hashing (index/hash_check.py)
        if check is not None:
            fields += [f"hash_{k}={check[k]}" for k in HASH_CHECK_RESULTS] + [f"hash_check={check['state']}"]
        out.append((f"kv_engine_{_info_name(engine_id)}", ",".join(fields)))
    return out


def _keyspace(ctx: NodeContext, session: Any) -> list[tuple[str, Any]]:
    keys = ctx.keyspace.keys_in(session.tag)
    if not keys:
        return []
    tag = session.tag
    expires = sum(1 for fk in ctx.keyspace.expires if fk[:len(tag)] == tag)
    return [("db0", f"keys={keys},expires={expires},avg_ttl=0")]
