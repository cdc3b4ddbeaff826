"""The node's Prometheus metrics (prometheus-client), in one registry per node.

Two kinds of metric:

- **Figures read at scrape time.** Every figure of `/v1/stats` (and of INFO's
  router section) is read off the part that keeps it when `/metrics` is
  scraped, by `Figures`, a custom collector: counters as counters, gauges as
  gauges, per engine (label `engine`), per tenant (`tenant`) or per guard
  reason (`reason`) where the part keeps them so. Nothing is counted twice.
  The optional parts (SSD tier, cluster, gateway) report at zero while they
  are off, so every metric exists from the start; only series of labels that
  do not exist yet (an engine, a tenant) appear later.
- **Histograms observed at the source.** Peer fetch, SSD read, demotion batch,
  ROUTE and gateway TTFT are prometheus-client `Histogram`s, observed by their
  part through an injected observer (`observe(seconds)`; tiers, index and
  cluster import nothing of Prometheus). Command latency per command family
  (the table's `group`) is read at scrape time from the dispatcher's own
  latency buckets (INFO latencystats): the dispatcher times a sample of the
  calls of the commands redis calls fast (GET, SET, ...; one in its
  `SAMPLE_EVERY`) and every call of the others, so the histogram counts timed
  calls, and `quilld_commands_total` counts every call.

Names follow Prometheus's rules (`promtool check metrics` is clean, and a test
keeps it so): base units (seconds, bytes), the unit last, `_total` once, at the
end of a counter. INFO keeps redis-style names (`ssd_fsync_total_ms`); a figure
kept in other units is renamed and scaled on its way out (`metric_name`): `_ms`
and `_usec` become `_seconds`, sizes get `_bytes`, a Unix time
`_timestamp_seconds` (docs/operations/metrics.md lists the renames).

One registry per node, never prometheus-client's global one: tests run
several nodes in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quilld import __version__
from quilld.cluster.engines_sync import COUNTERS as ENGINE_COUNTERS
from quilld.http.command_latency import CommandLatency
from quilld.http.gateway_stats import COUNTERS as GATEWAY_COUNTERS
from quilld.http.gateway_stats import GatewayStats, handoff_histogram, ttft_histogram
from quilld.index.engines import FEED_COUNTERS
from quilld.index.hash_check import RESULTS as HASH_CHECK_RESULTS
from quilld.index.pairing import REASONS
from quilld.model import CacheTier
from quilld.context.node_context import NodeContext
from quilld.context.figures import counters, tier_stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()  # no `_created` series (the start time of each histogram): not in the text format's spirit

PEER_FETCH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0)
SSD_READ_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)
DEMOTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUTE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 1.0)

# counters(): the few that are gauges; `guard_refusals_<reason>` are one family by reason
NODE_GAUGES = {"identity_scopes", "put2phase_open"}
HELP = {
    "connections_received": "Connections accepted.",
    "commands_processed": "Commands executed.",
    "net_input_bytes": "Bytes read from clients.",
    "net_output_bytes": "Bytes written to clients.",
    "rejected_connections": "Connections refused (maxclients).",
    "payload_timeouts": "Connections closed because a value's payload stalled.",
    "expired_keys": "Keys removed by their TTL.",
    "evicted_keys": "Values evicted for space.",
    "evicted_chain_tails": "Evictions that took a chain's tail instead of its least recently used head (chains.py).",
    "unfilled_refused": "Reservations refused by the caps on unfilled payloads.",
    "keyspace_hits": "Lookups that found their key.",
    "keyspace_misses": "Lookups that did not.",
    "auth_failures": "Failed AUTH attempts.",
    "auth_throttled": "AUTH attempts answered late (or checked late) because their user or address kept failing.",
    "peerauth_failures": "PEERAUTH attempts with a wrong cluster secret.",
    "peerauth_throttled": "PEERAUTH attempts answered late because their address kept failing.",
    "client_query_buffer_limit_disconnections": "Connections closed for an oversized query buffer.",
    "exec_holds": "EXECs that held the node's other clients while a queued command waited (SSD, a peer).",
    "exec_hold_timeouts": "Commands of such EXECs cut off after server.exec_hold_ms.",
    "internal_errors": "Commands answered 'internal error' (a bug, logged).",
    "guard_refusals": "Lookups refused because the key exists only in another identity scope.",
    "identity_scopes": "Identity scopes held.",
    "identity_scopes_released": "Identity scopes released after being idle.",
    "identity_scopes_refused": "New identity scopes refused by the per-tenant cap.",
    "put2phase_open": "Two-phase puts in progress.",
    "put2phase_committed": "Two-phase puts committed.",
    "put2phase_aborted": "Two-phase puts aborted.",
    "put2phase_expired": "Two-phase puts reclaimed after their lease.",
    "put2phase_refused": "PUT2PHASE BEGINs refused: their tenant had security.max_open_puts_per_tenant open.",
    "kv_batches": "KV-event batches applied (every engine).",
    "kv_events": "KV events applied (every engine).",
    "kv_malformed": "KV events or batches skipped as undecodable (every engine).",
    "kv_gaps": "KV-event losses that dropped an engine's residencies.",
    "routes": "Routing decisions made (ROUTE, POST /v1/route, the gateway).",
    "engine_leases_expired": "In-flight leases on engines that expired unreleased.",
}
DRAM_HELP = {
    "dram_capacity": "DRAM tier capacity in bytes.",
    "dram_used": "DRAM tier bytes in use (arena pages and inline values).",
    "dram_used_arena": "Arena bytes in use.",
    "dram_used_inline": "Bytes of small values kept inline, outside the arena.",
    "dram_keys": "Keys resident in DRAM.",
    "dram_blocks": "Arena blocks resident in DRAM.",
    "dram_reserved_blocks": "Arena blocks reserved and not yet published.",
    "dram_pinned_unlinked": "Blocks deleted or replaced while readers still pin them.",
    "dram_held_bytes": "Bytes held by readers' pins.",
    "dram_unfilled_bytes": "Bytes reserved for payloads still being received.",
    "dram_largest_free": "Largest free arena extent in bytes.",
    "dram_fragmentation": "1 - largest free extent / free bytes.",
    "dram_high_watermark": "DRAM use share above which blocks are demoted to SSD.",
    "dram_low_watermark": "DRAM use share demotion brings use back to.",
    "dram_inline_max": "Largest value kept inline (bytes).",
}
FEED_HELP = {
    "batches": "KV-event batches applied.", "events": "KV events applied.",
    "malformed": "KV events or batches skipped because they could not be decoded.",
    "gaps": "Holes seen in the KV-event sequence.", "missed": "KV-event batches lost for good.",
    "replays": "Replays that delivered missed batches (or caught up after a connect).",
    "restarts": "KV-event publisher restarts detected.",
    "drops": "Times the engine's residencies were dropped (events lost or publisher restarted).",
    "duplicates": "KV-event batches received twice and skipped.",
    "errors": "KV-event socket errors.",
}
# the SSD tier's INFO section (tiers.ssd in /v1/stats): its gauges; every other figure is a counter
SSD_GAUGES = ("ssd_enabled", "ssd_capacity", "ssd_used", "ssd_keys", "ssd_failed", "ssd_dirty_bytes", "ssd_wal_bytes",
              "ssd_last_checkpoint", "ssd_fsync_last_ms", "ssd_fsync_avg_ms", "ssd_fsync_max_ms", "recovery_blocks",
              "recovery_dropped_corrupt", "recovery_wal_stops", "recovery_wal_records", "recovery_checkpoint_errors",
              "recovery_scanned_blocks", "recovery_scrubbed", "recovery_ms", "ssd_io_threads",
              "ssd_demote_inflight_bytes", "ssd_last_run_unclean", "ssd_last_run_lost_keys", "ssd_dram_only_keys",
              "ssd_unstorable_held")
SSD_COUNTERS = ("ssd_fsyncs", "demotions", "demoted_bytes", "demote_batches", "demote_usec", "demoted_clean",
                "promotions", "checkpoints", "failures", "ssd_reads", "ssd_read_bytes", "ssd_read_corrupt",
                "ssd_read_errors", "ssd_evictions", "ssd_copies_dropped", "ssd_deletes", "delete_syncs", "ssd_scrubbed",
                "ssd_fsync_total_ms", "ssd_write_total_ms", "ssd_retimes", "ssd_expired_at_start", "ssd_unstorable",
                "demote_errors")
SSD_HELP = {
    "ssd_capacity": "SSD tier capacity in bytes.", "ssd_used": "SSD tier bytes in use.",
    "ssd_keys": "Values whose only copy is on SSD.", "ssd_failed": "1 once the SSD tier has failed.",
    "ssd_last_checkpoint": "Unix time of the last checkpoint (0: none).",
    "ssd_demotions": "Blocks written from DRAM to SSD.", "ssd_demoted_bytes": "Bytes written from DRAM to SSD.",
    "ssd_promotions": "Blocks read back from SSD and kept in DRAM.", "ssd_reads": "Blocks read from SSD.",
    "ssd_fsync_last_ms": "Duration of the SSD tier's last fsync, in seconds.",
    "ssd_fsync_avg_ms": "Mean duration of the SSD tier's fsyncs, in seconds.",
    "ssd_fsync_max_ms": "Longest fsync of the SSD tier, in seconds.",
    "ssd_fsync_total_ms": "Time the SSD tier spent in fsync, in seconds.",
    "ssd_write_total_ms": "Time the SSD tier spent writing blocks, in seconds.",
    "ssd_demote_usec": "Time with at least one demotion batch in flight, in seconds.",
    "recovery_ms": "Duration of the SSD tier's recovery at start, in seconds.",
    "ssd_last_run_unclean": "1 when the run before this start did not stop cleanly (killed or crashed).",
    "ssd_last_run_lost_keys": "Keys that run held only in DRAM and lost (its last census, or what its stop could "
                              "not keep).",
    "ssd_dram_only_keys": "Keys whose value is only in DRAM now (a kill -9 would lose them).",
    "ssd_unstorable": "Values and TTL changes the SSD tier refused: its format cannot hold them (an expiry past "
                      "its i64).",
    "ssd_unstorable_held": "Values held in DRAM that the SSD tier refused (a stop cannot keep them).",
    "ssd_demote_errors": "Demotion batches that failed on an error other than I/O (given back to DRAM).",
}
# the cluster's INFO section: its gauges; ports and text are not metrics; every other figure is a counter.
# A counter a part adds to its INFO section is listed here too, so it exists from the start (test_admin.py
# compares a fresh node's names with a busy one's).
CLUSTER_GAUGES = ("cluster_enabled", "cluster_members", "cluster_members_alive", "cluster_members_suspect",
                  "cluster_members_dead", "cluster_members_left", "cluster_directory_replicas",
                  "cluster_directory_entries_owned", "cluster_directory_buckets_owned", "cluster_directory_entries_held",
                  "cluster_directory_handoffs_in_flight", "cluster_directory_buckets_filling",
                  "cluster_engines_known", "cluster_engines_homed", "cluster_peer_breakers_open")
CLUSTER_COUNTERS = ("cluster_peer_fetches", "cluster_peer_fetch_bytes",
                    "cluster_peer_fetch_usec", "cluster_peer_fetch_errors", "cluster_peer_fetch_stale",
                    "cluster_peer_fetch_checksum_failures", "cluster_members_without_address",
                    "cluster_peer_connections", "cluster_peer_gets_served", "cluster_rdma_leases_granted",
                    "cluster_transfer_fetches_tcp", "cluster_transfer_fetches_rdma", "cluster_transfer_rdma_errors",
                    "cluster_transfer_rdma_fallbacks", "cluster_rdma_connects", "cluster_rdma_accepts",
                    "cluster_rdma_reads", "cluster_rdma_read_bytes", "cluster_rdma_read_errors",
                    "cluster_rdma_read_timeouts", "cluster_rdma_inline_replies", "cluster_rdma_leases_dropped",
                    *(f"cluster_gossip_{k}" for k in (
                        "packets_in", "packets_out", "bytes_in", "bytes_out", "auth_failures", "replays_rejected",
                        "stale_rejected", "malformed", "send_errors", "udp_errors", "event_errors",
                        "internal_errors", "seed_unresolved", "push_pull_ok", "push_pull_failed",
                        "push_pull_refused", "push_pull_served", "push_pull_skipped")),
                    "cluster_peers_declared_dead", "cluster_peers_left", "cluster_pool_reads",
                    "cluster_pool_read_hits", "cluster_pool_read_errors", "cluster_pool_read_ask_failures",
                    "cluster_pool_read_batches", "cluster_pool_kept", "cluster_pool_keep_skipped",
                    "cluster_lookups", "cluster_lookups_local", "cluster_lookups_one_hop",
                    "cluster_lookups_two_hops", "cluster_lookup_failures", "cluster_lookup_misses",
                    "cluster_lookup_misses_unreachable", "cluster_lookup_hedged", "cluster_lookup_hedges_won",
                    "cluster_lookup_breaker_skips", "cluster_peer_breaker_opens",
                    "cluster_route_lookups",
                    "cluster_route_owner_round_trips", "cluster_directory_requests",
                    "cluster_directory_message_failures", "cluster_peer_connection_waits",  # the link's
                    "cluster_peer_connection_busy_timeouts",
                    *(f"cluster_directory_{k}" for k in (
                        "placements", "placement_items", "batches_sent", "batches_applied", "full_syncs",
                        "retries", "batch_failures", "resyncs_asked", "digests_sent", "ae_mismatches",
                        "ae_repairs", "handoff_buckets", "buckets_gained", "buckets_lost", "buckets_copied",
                        "copy_failures", "entries_released", "holders_dropped", "peer_restarts",
                        "blocks_unanchored")),
                    *(f"cluster_{k}" for k in ENGINE_COUNTERS))
CLUSTER_HELP = {
    "cluster_members": "Cluster members this node knows (itself included).",
    "cluster_members_alive": "Members alive.", "cluster_members_suspect": "Members suspected of failure.",
    "cluster_peer_fetches": "Blocks fetched from peers.", "cluster_peer_fetch_bytes": "Bytes fetched from peers.",
    "cluster_peers_declared_dead": "Peers declared dead (events).", "cluster_peers_left": "Peers that left (events).",
    "cluster_peer_fetch_usec": "Time spent in peer fetches, in seconds.",
    "cluster_directory_replicas": "Owners each directory entry has (cluster.directory_replicas, or every node when fewer).",
    "cluster_directory_entries_owned": "Directory entries this node keeps as an owner (every holder's, its buckets).",
    "cluster_directory_entries_held": "Directory entries this node is the authority for (its values, its engines' blocks).",
    "cluster_directory_handoffs_in_flight": "Buckets being filled and channels with placements not yet acknowledged.",
    "cluster_engines_known": "Engines of the cluster this node knows (its engine table, removals left out).",
    "cluster_engines_homed": "Engines this node is home to (it consumes their KV events).",
    "cluster_engine_table_pulls": "Peers' engine tables pulled (PEERENGINES) because their digest differed.",
    "cluster_engine_table_merges": "Engine table entries a pull changed here.",
    "cluster_engine_rehomes": "Engines this node took over as home from another node (their entries adopted).",
    "cluster_engine_homes_left": "Engines whose home moved away from this node.",
    "cluster_engine_events_forwarded": "KV-event batches forwarded to the engine's home node.",
    "cluster_lookups_local": "Directory lookups this node answered itself (it owns the bucket).",
    "cluster_lookups_one_hop": "Directory lookups that took one owner round trip.",
    "cluster_lookups_two_hops": "Directory lookups that took two owner round trips (an owner failed or was filling).",
    "cluster_lookup_misses": "Directory lookup items with no holder, answered so by an owner.",
    "cluster_lookup_misses_unreachable": "Directory lookup items with no holder because no owner could answer "
                                         "(every owner asked failed or was still filling).",
    "cluster_lookup_hedged": "Directory lookup calls not answered within the owner's hedge delay (the next owner asked too).",
    "cluster_lookup_hedges_won": "Hedged directory lookups answered before the slow owner did.",
    "cluster_lookup_breaker_skips": "Directory lookup rounds that passed over an owner whose circuit breaker was open.",
    "cluster_peer_breaker_opens": "Times a peer's circuit breaker opened (a lookup call to it failed or timed out).",
    "cluster_peer_breakers_open": "Peers whose circuit breaker is open now.",
    "cluster_pool_kept": "Peer-fetched values kept in this node's DRAM for later reads (cluster.keep_fetched).",
    "cluster_pool_keep_skipped": "Peer-fetched values served but not kept: keeping them would have evicted "
                                 "or exceeded maxmemory.",
    "cluster_route_owner_round_trips": "Owner round trips of ROUTE lookups (divide by cluster_route_lookups).",
    "cluster_directory_ae_repairs": "Buckets replaced after an anti-entropy digest differed.",
    "cluster_directory_message_failures": "Directory messages to a peer (batches, lookups, copies, digests) that "
                                          "failed.",
    "cluster_directory_batch_failures": "Placement batches to an owner that failed (retried).",
    "cluster_gossip_bytes_in": "Gossip bytes received.", "cluster_gossip_bytes_out": "Gossip bytes sent.",
}
NOT_METRICS = {"cluster_gossip_port"}
GATEWAY_GAUGES = ("gateway_in_flight", "gateway_engines_cooling", "gateway_ttft_slo_ms", "gateway_goodput")
GATEWAY_HELP = {
    "gateway_requests": "Completion requests received by the gateway.",
    "gateway_in_flight": "Completion requests being served.",
    "gateway_ttft_slo_ms": "The gateway's default TTFT budget, in seconds.",
    "gateway_slo_counted": "Requests counted for goodput.",
    "gateway_within_slo": "Counted requests whose first byte came within their TTFT budget.",
    "gateway_goodput": "Share of counted requests within their TTFT budget, since the start.",
    "gateway_dropped_kv_transfer_params": "Requests whose client-sent kv_transfer_params the gateway dropped.",
    "gateway_dropped_cache_salt": "Requests whose client-sent cache_salt the gateway dropped.",
    "gateway_engine_hashed": "Prompts routed on their engines' own block hashes (engine_prompts.py).",
    "gateway_engine_hash_fallbacks": "Prompts for engines that name their hashing routed on quilld's own hashes "
                                     "instead (a request or engine not covered).",
}
GATEWAY_FROM_HISTOGRAM = {"gateway_ttft_p50_ms", "gateway_ttft_p99_ms",  # quilld_gateway_ttft_seconds
                          "gateway_handoff_wait_p50_ms", "gateway_handoff_wait_p99_ms"}  # ..._handoff_wait_seconds
TIERS = tuple(t.value for t in CacheTier)

# Figures whose INFO name lacks their unit, or carries it in the middle: their metric's name. Names
# ending in _ms or _usec need no entry: metric_name turns them into seconds.
RENAMES = {
    "dram_capacity": "dram_capacity_bytes", "dram_used": "dram_used_bytes",
    "dram_used_arena": "dram_used_arena_bytes", "dram_used_inline": "dram_used_inline_bytes",
    "dram_largest_free": "dram_largest_free_bytes", "dram_inline_max": "dram_inline_max_bytes",
    "ssd_capacity": "ssd_capacity_bytes", "ssd_used": "ssd_used_bytes",
    "ssd_last_checkpoint": "ssd_last_checkpoint_timestamp_seconds",
    "ssd_fsync_total_ms": "ssd_fsync_seconds", "ssd_write_total_ms": "ssd_write_seconds",  # counters: + _total
    "recovery_ms": "recovery_duration_seconds",
    "cluster_gossip_bytes_in": "cluster_gossip_received_bytes", "cluster_gossip_bytes_out": "cluster_gossip_sent_bytes",
}
UNIT_SCALES = (("_ms", "_seconds", 1_000), ("_usec", "_seconds", 1_000_000))


def metric_name(figure: str) -> tuple[str, float]:
    """A figure's metric name (without `quilld_` and a counter's `_total`) and what to divide its
    value by to have it in the metric's base unit."""
    name = RENAMES.get(figure, figure)
    for suffix, unit, per in UNIT_SCALES:
        if figure.endswith(suffix):
            return (name if figure in RENAMES else figure.removesuffix(suffix) + unit), per
    return name, 1


def _ignore(seconds: float) -> None:
    """An observer that keeps nothing."""


class NodeMetrics:
    """One node's registry, its histograms, and the collector of its figures.

    Built by node.py with the node's context; it hands the parts that exist then
    (control plane, SSD tier) their observers. The cluster (started later) gets
    `peer_fetch.observe`, the gateway `gateway_ttft`.
    """

    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, buckets=buckets, registry=reg)

        self.peer_fetch = histogram("quilld_peer_fetch_duration_seconds", "Peer fetch: request to a verified copy "
                                    "in this node (successful fetches).", PEER_FETCH_BUCKETS)
        self.ssd_read = histogram("quilld_ssd_read_duration_seconds", "SSD tier read of one block into DRAM, "
                                  "verified (successful reads).", SSD_READ_BUCKETS)
        self.demotion = histogram("quilld_demotion_batch_duration_seconds", "One demotion batch: its group "
                                  "commit to SSD and the freeing of its DRAM.", DEMOTION_BUCKETS)
        self.route = histogram("quilld_route_duration_seconds", "One routing decision (scoring every candidate "
                               "engine).", ROUTE_BUCKETS)
        self.gateway_ttft = ttft_histogram(reg)
        self.gateway_handoff = handoff_histogram(reg)
        reg.register(Figures(node))
        self.commands = CommandLatency(node)
        reg.register(self.commands)
        ProcessCollector(namespace="quilld", registry=reg)
        node.control.observe_route = self.route.observe
        if node.tiering is not None:
            node.tiering.observe_read = self.ssd_read.observe
            node.tiering.observe_demotion = self.demotion.observe

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format (CONTENT_TYPE)."""
        return generate_latest(self.registry)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"quilld_{name}", help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"quilld_{name}", help_text, value=value)


def _labelled(kind: type[Metric], name: str, help_text: str, labels: list[str],
              rows: Iterable[tuple[list[str], float]]) -> Metric:
    family = kind(f"quilld_{name}", help_text, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _section(figures: list[tuple[str, Any]] | None, gauges: tuple[str, ...], zero_counters: tuple[str, ...],
             label: str, helps: dict[str, str]) -> Iterator[Metric]:
    """An optional part's INFO section as metrics: `gauges` as gauges, every other number as a
    counter; the known names at zero when the part is off (`figures` None) or has not counted yet.
    Each name once: a family repeated is a scrape Prometheus refuses (INFO's names are unique, a test
    keeps them so)."""
    seen: set[str] = set()

    def text(name: str) -> str:
        return helps.get(name) or f"{label}: {name.replace('_', ' ')} (INFO)."

    def metric(name: str, value: float) -> Metric:
        exposed, per = metric_name(name)
        make = _gauge if name in gauges else _counter
        return make(exposed, text(name), value / per if per != 1 else value)

    for name, value in figures or ():
        if not _number(value) or name in NOT_METRICS or name in GATEWAY_FROM_HISTOGRAM or name in seen:
            continue
        seen.add(name)
        yield metric(name, value)
    for name in (*gauges, *zero_counters):
        if name not in seen:
            seen.add(name)
            yield metric(name, 0)


def _ssd_name(key: str) -> str:
    """The SSD tier's counters as metrics: `ssd_` before those named without it (demotions -> ssd_demotions)."""
    return key if key.startswith(("ssd_", "recovery_")) else f"ssd_{key}"


class Figures(Collector):
    """Every figure of /v1/stats (and INFO router), read off the parts at scrape time."""

    def __init__(self, node: NodeContext) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        yield _labelled(GaugeMetricFamily, "build_info", "This node's quilld version and node id (always 1).",
                        ["version", "node_id"], [([__version__, node.node_id], 1)])
        yield from self._node_counters()
        yield _gauge("connected_clients", "Open client connections.", len(node.clients.connections))
        yield _gauge("max_clients", "Most client connections accepted at once.", node.cfg.server.max_clients)
        for name, value in tier_stats(node).items():
            if name.startswith("dram_"):
                yield _gauge(metric_name(name)[0], DRAM_HELP.get(name, f"DRAM tier: {name} (INFO tiers)."), value)
        yield from self._tenants()
        yield from self._router()
        yield from self._ssd()
        cluster = node.cluster
        yield from _section(cluster.info() if cluster is not None else None, CLUSTER_GAUGES, CLUSTER_COUNTERS,
                            "Cluster", CLUSTER_HELP)
        yield from self._listeners()
        gateway = node.gateway
        yield _gauge("gateway_enabled", "1 when this node runs the OpenAI-compatible gateway.",
                     int(gateway is not None))
        # a gateway that is off reports as a fresh one would: nothing counted, goodput 1
        figures = gateway.info() if gateway is not None else GatewayStats().info(node.cfg.gateway.ttft_slo_ms, 0)
        yield from _section(figures, GATEWAY_GAUGES, tuple(f"gateway_{c}" for c in GATEWAY_COUNTERS), "Gateway",
                            GATEWAY_HELP)

    def _node_counters(self) -> Iterator[Metric]:
        reasons = []
        for key, value in counters(self.node).items():
            name = key.removeprefix("total_")
            if name.startswith("guard_refusals_"):
                reasons.append(([name.removeprefix("guard_refusals_")], value))
            elif name in NODE_GAUGES:
                yield _gauge(name, HELP.get(name, f"{name} (INFO stats)."), value)
            else:
                yield _counter(name, HELP.get(name, f"{name} (INFO stats)."), value)
        yield _labelled(CounterMetricFamily, "guard_refusals_by_reason", "Refused cross-scope lookups by reason.",
                        ["reason"], reasons)

    def _listeners(self) -> Iterator[Metric]:
        """The HTTP ports' perimeters (listener.py), per listener: admin, gateway (at zero while off)."""
        rows = self.node.listeners
        yield _labelled(GaugeMetricFamily, "http_connections", "HTTP connections open, per listener.", ["listener"],
                        [([n], f.open) for n, f in rows.items()])
        yield _labelled(GaugeMetricFamily, "http_max_connections", "HTTP connections a listener takes at once "
                        "(its max_connections within the HTTP share of the descriptor limit; 0: off).",
                        ["listener"], [([n], f.max_connections) for n, f in rows.items()])
        yield _labelled(CounterMetricFamily, "http_connections_refused", "HTTP connections refused at the "
                        "listener's cap (answered 503).", ["listener"], [([n], f.refused) for n, f in rows.items()])
        yield _labelled(CounterMetricFamily, "http_header_timeouts", "HTTP connections cut off for not sending a "
                        "complete request head in time.", ["listener"],
                        [([n], f.header_timeouts) for n, f in rows.items()])
        yield _labelled(CounterMetricFamily, "http_body_timeouts", "HTTP requests answered 408 for not sending "
                        "their body in time.", ["listener"], [([n], f.body_timeouts) for n, f in rows.items()])
        yield _labelled(CounterMetricFamily, "http_malformed_requests", "HTTP requests that could not be parsed, "
                        "per kind (answered 400, logged once per kind).", ["listener", "kind"],
                        [([n, k], v) for n, f in rows.items() for k, v in f.malformed.items()])
        yield _labelled(CounterMetricFamily, "http_requests_refused", "HTTP requests refused by the perimeter, "
                        "per reason (protected mode, a wrong token, a foreign origin or host, a body not JSON).",
                        ["listener", "reason"], [([n, r], v) for n, f in rows.items() for r, v in f.refusals.items()])

    def _tenants(self) -> Iterator[Metric]:
        """Per tenant (/v1/stats tenants): clients, scopes, lookups, the guard's refusals."""
        rows = tenant_stats(self.node)
        yield _labelled(GaugeMetricFamily, "tenant_connected_clients", "Open client connections per tenant.",
                        ["tenant"], [([t], s["connected_clients"]) for t, s in rows.items()])
        yield _labelled(GaugeMetricFamily, "tenant_scopes", "Identity scopes held per tenant.", ["tenant"],
                        [([t], s["scopes"]) for t, s in rows.items()])
        yield _labelled(CounterMetricFamily, "tenant_keyspace_hits", "Lookups that found their key, per tenant.",
                        ["tenant"], [([t], s["keyspace_hits"]) for t, s in rows.items()])
        yield _labelled(CounterMetricFamily, "tenant_keyspace_misses", "Lookups that did not, per tenant.",
                        ["tenant"], [([t], s["keyspace_misses"]) for t, s in rows.items()])
        yield _labelled(CounterMetricFamily, "tenant_guard_refusals", "Refused cross-scope lookups per tenant "
                        "(the tenant refused) and reason.", ["tenant", "reason"],
                        [([t, k.removeprefix("guard_refusals_")], v) for t, s in rows.items() for k, v in s.items()
                         if k.startswith("guard_refusals_")])

    def _router(self) -> Iterator[Metric]:
        """The control plane: engines, their leases and KV-event feeds, residencies, hot prefixes."""
        ctl = self.node.control
        now = time.monotonic()
        engines = list(ctl.engines.engines)
        views = {e: ctl.feed_view(e, now) for e in engines}
        yield _gauge("engines", "Registered inference engines.", len(engines))
        yield _gauge("kv_subscriptions", "Engines followed over ZMQ KV events.", ctl.subscriptions)
        yield _gauge("engine_residencies", "(scope, block) entries in the residency index.", len(ctl.index))
        yield _counter("hot_prefix_lookups", "Routed requests counted by the hot-prefix sketch.", ctl.hot.total)
        yield _gauge("sessions", "Sessions whose engine is remembered (ROUTE session, x-quillcache-session).",
                     len(ctl.sessions))
        yield _labelled(CounterMetricFamily, "session_evictions", "Sessions forgotten: table full (full) or "
                        "unused for gateway.session_idle_s (idle).", ["reason"],
                        [(["full"], ctl.sessions.evicted_full), (["idle"], ctl.sessions.evicted_idle)])
        yield _labelled(GaugeMetricFamily, "engine_in_flight", "Requests in flight per engine (leases held).",
                        ["engine"], [([e], ctl.engines.in_flight[e]) for e in engines])
        loads = {e: ctl.engines.load(e) for e in engines}
        yield _labelled(GaugeMetricFamily, "engine_prefills", "Requests prefilling per engine (prefill leases, and "
                        "whole requests before their first byte).", ["engine"],
                        [([e], load.prefills) for e, load in loads.items()])
        yield _labelled(GaugeMetricFamily, "engine_prefill_tokens", "Uncached prompt tokens those requests still "
                        "prefill, per engine.", ["engine"], [([e], load.prefill_tokens) for e, load in loads.items()])
        yield _labelled(GaugeMetricFamily, "engine_decodes", "Requests decoding per engine (decode leases and whole "
                        "requests).", ["engine"], [([e], load.decodes) for e, load in loads.items()])
        yield _labelled(GaugeMetricFamily, "engine_info", "1 per engine: its role (prefill, decode, both) and the "
                        "node it stores its KV through.", ["engine", "role", "kv_node"],
                        [([e.id, e.role, e.locality or ctl.node_id], 1) for e in ctl.engines.engines.values()])
        yield _labelled(CounterMetricFamily, "route_pairs", "Prefill-decode decisions (engines with roles), by "
                        "reason: disaggregated (cost, always) or one engine (short, queue, never, no_prefill_engine).",
                        ["reason"], [([r], ctl.stats[f"pair_{r}"]) for r in REASONS])
        for key in FEED_COUNTERS:
            yield _labelled(CounterMetricFamily, f"kv_engine_{key}", FEED_HELP.get(key, f"KV-event feed: {key}."),
                            ["engine"], [([e], v[key]) for e, v in views.items()])
        checks = {e: v["hash_check"] for e, v in views.items() if v["hash_check"] is not None}
        yield _labelled(CounterMetricFamily, "kv_engine_hash_check_blocks", "Blocks of an engine's KV events whose "
                        "hash quilld computed again from their token ids (engines with prefix_caching_hash_algo), "
                        "by result: agreed, disagreed (the engine hashes otherwise: its blocks are never credited), "
                        "unverifiable (LoRA, extra keys or a parent not seen).", ["engine", "result"],
                        [([e, r], c[r]) for e, c in checks.items() for r in HASH_CHECK_RESULTS])
        yield _labelled(GaugeMetricFamily, "kv_engine_last_sequence", "Sequence number of the last KV-event batch "
                        "applied (-1: none).", ["engine"],
                        [([e], -1 if v["last_seq"] is None else v["last_seq"]) for e, v in views.items()])
        yield _labelled(GaugeMetricFamily, "kv_engine_idle_seconds", "Seconds since the engine's KV-event feed last "
                        "received anything.", ["engine"], [([e], v["idle_s"]) for e, v in views.items()])
        yield _labelled(GaugeMetricFamily, "kv_engine_subscribed", "1 when the engine's KV events are followed "
                        "over ZMQ, 0 when pushed (POST /v1/kv-events, KVEVENTS).", ["engine"],
                        [([e], int(v["subscribed"])) for e, v in views.items()])
        index = ctl.index
        yield _labelled(GaugeMetricFamily, "residency_blocks", "Blocks the residency index places per holder "
                        "(engine or pool node) and tier.", ["holder", "tier"],
                        [([h, t], n) for h in index.holders() for t in TIERS if (n := index.count(h, t))])

    def _ssd(self) -> Iterator[Metric]:
        tiering = self.node.tiering
        figures = [(_ssd_name(k), v) for k, v in tiering.info()] if tiering is not None else None
        yield from _section(figures, SSD_GAUGES, tuple(_ssd_name(k) for k in SSD_COUNTERS), "SSD tier", SSD_HELP)


def tenant_stats(node: NodeContext) -> dict[str, dict[str, int]]:
    """Per tenant, what RESP clients see of their own tenant only (INFO) — the operator's view."""
    tenants = {s.user for s in node.clients.sessions.values()} | {t for t, _ in node.scopes.refusals}
    out = {}
    for tenant in sorted(tenants):
        hits, misses = node.keyspace.lookups_of(tenant)
        out[tenant] = {"connected_clients": sum(1 for s in node.clients.sessions.values() if s.user == tenant),
                       "scopes": node.scopes.scopes_of(tenant), "keyspace_hits": hits, "keyspace_misses": misses,
                       **{f"guard_refusals_{k}": v for k, v in node.scopes.refusals_of(tenant).items()}}
    return out


__all__ = ["CONTENT_TYPE", "NodeMetrics", "tenant_stats"]
