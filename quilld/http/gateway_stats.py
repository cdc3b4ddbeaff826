"""The gateway's counters, its time-to-first-token histogram and goodput.

Goodput is the share of *counted* requests whose first body byte reached the
client within their TTFT budget (`gateway.ttft_slo_ms`, or the request's
`x-quillcache-ttft-slo-ms` header). A request is counted when its outcome
against the budget is known:

- its first body byte of a 2xx answer is written: counted, within the SLO when
  the time since the request arrived is at most the budget;
- the gateway gives up without having written one (no healthy engine, every
  attempt failed, a stream broken before its first byte): counted, missed;
- the client leaves before the first byte: counted (missed) only when the
  budget had already run out, since an earlier departure says nothing;
- requests the gateway or the engine refuses as malformed, unauthorized or for
  an unknown model (4xx) are not counted: they are the client's errors.

Each first byte's TTFT is observed in a prometheus-client histogram
(`quilld_gateway_ttft_seconds`, in the node's registry when the node gives
one). INFO's `gateway_ttft_p50_ms` and `gateway_ttft_p99_ms` are read off that
histogram as Prometheus's `histogram_quantile` reads it: linear within the
bucket the rank falls in, over every first byte since the start.
"""

from __future__ import annotations

import logging
from collections import Counter

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("quilld.gateway")

# TTFT buckets (seconds): fine around common SLOs (100 ms - 1 s), coarse beyond
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
# the counters of `info()` (every one a Prometheus counter); the rest of its figures are gauges
COUNTERS = ("requests", "completed", "bad_requests", "unauthorized", "unknown_model", "unavailable",
            "upstream_client_errors", "retries", "upstream_errors", "stream_errors", "client_disconnects",
            "residencies_recorded", "residencies_forgotten", "slo_counted", "within_slo",
            # fields of the gateway's own a client sent and the gateway dropped (gateway_request.OWNED_FIELDS)
            "dropped_kv_transfer_params", "dropped_cache_salt",
            # prompts hashed as their engines hash them, and those that fell back to quilld's own hashes
            "engine_hashed", "engine_hash_fallbacks",
            # disaggregated requests (engine roles): prefills, the handoff, the prefetch, decodes
            "disaggregated", "prefills", "prefill_failures", "prefill_fallbacks", "decode_retries",
            "handoff_on_time", "handoff_late", "handoff_missing", "handoff_blocks", "handoff_blocks_late",
            "handoff_blocks_missing", "prefetches", "prefetch_blocks",
            # handoffs engine to engine (a prefill engine with kv_transfer = "nixl"): no pool wait
            "handoff_direct")
# handoff waits (seconds): from the prefill's answer until its blocks are in the pool (or the wait ends)
HANDOFF_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def ttft_histogram(registry: CollectorRegistry | None) -> Histogram:
    """The gateway's TTFT histogram, registered in `registry` (None: in no registry)."""
    return Histogram("quilld_gateway_ttft_seconds", "Gateway time to first token: from the request's arrival to "
                     "its first body byte written to the client (2xx answers).", buckets=TTFT_BUCKETS,
                     registry=registry)


def handoff_histogram(registry: CollectorRegistry | None) -> Histogram:
    """The gateway's handoff-wait histogram, registered in `registry` (None: in no registry)."""
    return Histogram("quilld_gateway_handoff_wait_seconds", "Disaggregated requests: from the prefill engine's "
                     "answer until every block of the prompt was in the pool (or gateway.handoff_wait_ms ran out), "
                     "the prefetch toward the decode engine's node included.", buckets=HANDOFF_BUCKETS,
                     registry=registry)


def histogram_quantile(histogram: Histogram, q: float) -> float:
    """The q-quantile (0..1) of an unlabelled histogram, as PromQL's histogram_quantile estimates it
    (0.0 with no observation; the largest finite bound when the rank is in the +Inf bucket)."""
    buckets = [(float(s.labels["le"]), s.value) for metric in histogram.collect() for s in metric.samples
               if s.name.endswith("_bucket")]
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return 0.0
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


class GatewayStats:
    def __init__(self, ttft: Histogram | None = None, handoff: Histogram | None = None) -> None:
        """`ttft`, `handoff`: the node's histograms (metrics.py); ones of its own otherwise."""
        self.counts: Counter[str] = Counter()
        self.ttft = ttft if ttft is not None else ttft_histogram(None)
        self.handoff = handoff if handoff is not None else handoff_histogram(None)
        self.in_flight = 0
        self._dropped_logged: set[str] = set()  # owned fields a client sent, logged already

    def dropped(self, fields: tuple[str, ...], tenant: str) -> None:
        """Count the gateway's own fields a client sent (gateway_request.OWNED_FIELDS), dropped from its
        request; each field is logged the first time only."""
        for name in fields:
            self.counts[f"dropped_{name}"] += 1
            if name not in self._dropped_logged:
                self._dropped_logged.add(name)
                log.warning("gateway: dropped `%s` from a request of tenant %r: the gateway sets it, never a "
                            "client (counted in gateway_dropped_%s; logged once)", name, tenant, name)

    def first_byte(self, ttft_ms: float, slo_ms: float) -> None:
        self.counts["slo_counted"] += 1
        if ttft_ms <= slo_ms:
            self.counts["within_slo"] += 1
        self.ttft.observe(ttft_ms / 1000)

    def missed(self) -> None:
        self.counts["slo_counted"] += 1

    @property
    def goodput(self) -> float:
        """within / counted; 1.0 before any request was counted (nothing was missed)."""
        counted = self.counts["slo_counted"]
        return self.counts["within_slo"] / counted if counted else 1.0

    def info(self, slo_ms: int, cooling: int) -> list[tuple[str, int | float | str]]:
        c = self.counts
        return [
            ("gateway_requests", c["requests"]),  # completion requests received
            ("gateway_in_flight", self.in_flight),
            ("gateway_completed", c["completed"]),  # 2xx answers relayed to their end
            ("gateway_bad_requests", c["bad_requests"]),  # 400 from the gateway
            ("gateway_unauthorized", c["unauthorized"]),  # 401
            ("gateway_unknown_model", c["unknown_model"]),  # 404
            ("gateway_unavailable", c["unavailable"]),  # 503: no engine answered
            ("gateway_upstream_client_errors", c["upstream_client_errors"]),  # engine 4xx relayed as is
            ("gateway_retries", c["retries"]),  # attempts after the first
            ("gateway_upstream_errors", c["upstream_errors"]),  # refused, reset, 5xx or timeout before a byte
            ("gateway_stream_errors", c["stream_errors"]),  # engine failed after bytes reached the client
            ("gateway_client_disconnects", c["client_disconnects"]),
            ("gateway_residencies_recorded", c["residencies_recorded"]),
            ("gateway_residencies_forgotten", c["residencies_forgotten"]),  # past gateway.recorded_blocks
            ("gateway_dropped_kv_transfer_params", c["dropped_kv_transfer_params"]),  # a client's, never sent on
            ("gateway_dropped_cache_salt", c["dropped_cache_salt"]),
            ("gateway_engine_hashed", c["engine_hashed"]),  # routed on their engines' own block hashes
            ("gateway_engine_hash_fallbacks", c["engine_hash_fallbacks"]),  # ... or not covered: quilld's own
            ("gateway_engines_cooling", cooling),
            ("gateway_ttft_slo_ms", slo_ms),
            ("gateway_slo_counted", c["slo_counted"]),
            ("gateway_within_slo", c["within_slo"]),
            ("gateway_goodput", round(self.goodput, 6)),
            ("gateway_ttft_p50_ms", round(histogram_quantile(self.ttft, 0.50) * 1000, 3)),
            ("gateway_ttft_p99_ms", round(histogram_quantile(self.ttft, 0.99) * 1000, 3)),
            ("gateway_disaggregated", c["disaggregated"]),  # requests served by a prefill and a decode engine
            ("gateway_prefills", c["prefills"]),  # prefill requests sent (retries included)
            ("gateway_prefill_failures", c["prefill_failures"]),  # prefill engines that failed
            ("gateway_prefill_fallbacks", c["prefill_fallbacks"]),  # every prefill failed: served aggregated
            ("gateway_decode_retries", c["decode_retries"]),  # decode engines tried after a first one failed
            ("gateway_handoff_on_time", c["handoff_on_time"]),  # every block in the pool when the prefill answered
            ("gateway_handoff_late", c["handoff_late"]),  # ... after a wait
            ("gateway_handoff_missing", c["handoff_missing"]),  # ... not all within gateway.handoff_wait_ms
            ("gateway_handoff_direct", c["handoff_direct"]),  # engine to engine (kv_transfer = "nixl"): no wait
            ("gateway_handoff_blocks", c["handoff_blocks"]),  # blocks checked
            ("gateway_handoff_blocks_late", c["handoff_blocks_late"]),
            ("gateway_handoff_blocks_missing", c["handoff_blocks_missing"]),
            ("gateway_prefetches", c["prefetches"]),  # pulls asked of a decode engine's node
            ("gateway_prefetch_blocks", c["prefetch_blocks"]),  # blocks that node held once its pull was done
            ("gateway_handoff_wait_p50_ms", round(histogram_quantile(self.handoff, 0.50) * 1000, 3)),
            ("gateway_handoff_wait_p99_ms", round(histogram_quantile(self.handoff, 0.99) * 1000, 3)),
        ]
