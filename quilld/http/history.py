"""The node's last minutes, for the status page: a sample of its counters every few seconds.

The status page used to compute rates from two of its own reads, so a page just
opened showed "–" and had nothing to draw. Here the admin API samples the node's
cumulative figures every `INTERVAL` seconds and keeps the last `KEPT` samples
(five minutes); `GET /v1/history` turns them into one point per interval
(rates per second, hit ratios, latency percentiles from the histograms' bucket
counts) and adds a point from the last sample to now, so the first render has
current rates and charts of the last minutes.

A sample holds counters only (they never go down, except at CONFIG RESETSTAT:
then a difference below zero counts as zero); percentiles are read off the
difference of two samples' bucket counts, linearly inside a bucket (as
Prometheus's histogram_quantile does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram

from quilld.context.figures import counters
from quilld.context.node_context import NodeContext
from quilld.http.command_latency import COMMAND_BUCKETS, CommandLatency

log = logging.getLogger("quilld.http")

INTERVAL = 2.0  # seconds between two samples
FIRST_SAMPLE_S = 0.05  # until the first sample is in, the sampler looks this often
KEPT = 150  # samples kept: five minutes
LIVE_AFTER = 0.5  # a request adds a point from the last sample to now once it is this old (seconds)
FAMILY_WINDOW = 60.0  # seconds the per-family table covers
SAMPLED_PHASES = ("serving", "stopping")  # a node still starting is not sampled (its SSD tier may be recovering)


@dataclass
class Sample:
    """The node's cumulative figures at one moment."""

    t: float  # Unix time
    mono: float  # time.monotonic(), for differences
    figures: dict[str, float]
    families: dict[str, tuple[int, int, list[int]]]  # family -> (calls, errors, latency buckets)
    histograms: dict[str, list[float]] = field(default_factory=dict)  # peer_fetch, route -> bucket counts


def _histogram_buckets(h: Histogram) -> list[float]:
    """A prometheus-client Histogram's bucket counts, not cumulative, +Inf last."""
    cumulative = [s.value for m in h.collect() for s in m.samples if s.name.endswith("_bucket")]
    return [c - (cumulative[i - 1] if i else 0) for i, c in enumerate(cumulative)]


def _bounds(h: Histogram) -> list[float]:
    return [float(s.labels["le"]) for m in h.collect() for s in m.samples if s.name.endswith("_bucket")]


def quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """The q-quantile of observations counted per bucket (`bounds` their upper bounds, +Inf last),
    interpolated inside its bucket; None without observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            upper = bounds[i]
            lower = bounds[i - 1] if i else 0.0
            if upper == float("inf"):
                return lower  # beyond the last bound: the last bound is all that is known
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
    return bounds[-2] if len(bounds) > 1 else None


class History:
    """The samples, and the series the status page draws (`series`)."""

    def __init__(self, node: NodeContext, commands: CommandLatency, peer_fetch: Histogram, route: Histogram) -> None:
        self.node = node
        self.commands = commands
        self.histograms = {"peer_fetch": peer_fetch, "route": route}
        self.bounds = {name: _bounds(h) for name, h in self.histograms.items()}
        self.command_bounds = [*COMMAND_BUCKETS, float("inf")]
        self.samples: deque[Sample] = deque(maxlen=KEPT)
        self._task: asyncio.Task | None = None

    # -- sampling -----------------------------------------------------------------
    def sample(self) -> Sample:
        node = self.node
        c = counters(node)
        ssd = dict(node.tiering.info()) if node.tiering is not None else {}
        cluster = dict(node.cluster.info()) if node.cluster is not None else {}
        http = node.listeners.values()
        figures = {
            "commands": c["total_commands_processed"],
            "hits": c["keyspace_hits"], "misses": c["keyspace_misses"],
            "demotions": ssd.get("demotions", 0), "promotions": ssd.get("promotions", 0),
            "demoted_bytes": ssd.get("demoted_bytes", 0),
            "peer_fetches": cluster.get("cluster_peer_fetches", 0),
            "peer_fetch_errors": cluster.get("cluster_peer_fetch_errors", 0),
            "pool_reads": cluster.get("cluster_pool_reads", 0),
            "pool_read_hits": cluster.get("cluster_pool_read_hits", 0),
            # connections refused: RESP (maxclients, protected mode), HTTP (caps, protected mode)
            "refused": c["rejected_connections"] + sum(f.refused + f.refusals["protected_mode"] for f in http),
            # failed credentials: AUTH (and its throttle), the admin token, gossip's HMAC
            "auth_failures": c["auth_failures"] + c["peerauth_failures"] + sum(f.refusals["token"] for f in http)
            + cluster.get("cluster_gossip_auth_failures", 0),
        }
        families = {f: (row.calls, row.rejected + row.failed, row.buckets)
                    for f, row in self.commands.per_family().items()}
        histograms = {name: _histogram_buckets(h) for name, h in self.histograms.items()}
        return Sample(time.time(), time.monotonic(), figures, families, histograms)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="status-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                if self.node.phase in SAMPLED_PHASES:
                    self.samples.append(self.sample())
            except Exception:  # a bug here must not stop the sampling, nor the node
                log.exception("status history: sampling failed")
            # the first sample as soon as the node serves: the page's first render has a rate from it
            await asyncio.sleep(INTERVAL if self.samples else FIRST_SAMPLE_S)

    # -- what the page draws ------------------------------------------------------------
    def series(self) -> dict[str, Any]:
        """GET /v1/history: a point per interval (the last one up to now), and the families' last minute."""
        samples = list(self.samples)
        if self.node.phase in SAMPLED_PHASES:
            now = self.sample()
            if len(samples) < 2 or now.mono - samples[-1].mono >= LIVE_AFTER:  # two at least: one point
                samples.append(now)
            else:
                samples[-1] = now  # a sample taken this instant: the newest figures, same moment
        points = [self._point(a, b) for a, b in zip(samples, samples[1:])]
        families = []
        if len(samples) >= 2:
            last = samples[-1]
            first = next((s for s in samples if last.mono - s.mono <= FAMILY_WINDOW), samples[0])
            if first is last:
                first = samples[-2]
            families = self._families(first, last)
        return {"interval_s": INTERVAL, "now": time.time(), "points": points, "families": families,
                "totals": {"command_errors": sum(e for _, e, _ in samples[-1].families.values()) if samples else 0,
                           **(samples[-1].figures if samples else {})}}

    def _point(self, a: Sample, b: Sample) -> dict[str, Any]:
        dt = max(b.mono - a.mono, 1e-6)

        def delta(key: str) -> float:
            return max(0.0, b.figures[key] - a.figures[key])

        def rate(key: str) -> float:
            return delta(key) / dt

        def ratio(part: str, whole: float) -> float | None:
            return delta(part) / whole if whole > 0 else None

        lookups = delta("hits") + delta("misses")
        cmd = self._sum_buckets(a, b)
        errors = sum(max(0, fb[1] - a.families[f][1]) for f, fb in b.families.items() if f in a.families)
        point = {
            "t": round(b.t, 3), "dt": round(dt, 3),
            "ops": rate("commands"), "demotions": rate("demotions"), "promotions": rate("promotions"),
            "demoted_bytes": rate("demoted_bytes"),
            "peer_fetches": rate("peer_fetches"), "peer_fetch_errors": rate("peer_fetch_errors"),
            "pool_reads": rate("pool_reads"),
            "hit_ratio": ratio("hits", lookups), "pool_hit_ratio": ratio("pool_read_hits", delta("pool_reads")),
            "command_errors": errors / dt, "refused": rate("refused"), "auth_failures": rate("auth_failures"),
            "command_p50": quantile(0.5, self.command_bounds, cmd),
            "command_p99": quantile(0.99, self.command_bounds, cmd),
        }
        for name, bounds in self.bounds.items():
            counts = [max(0.0, y - x) for x, y in zip(a.histograms[name], b.histograms[name])]
            point[f"{name}_p50"] = quantile(0.5, bounds, counts)
            point[f"{name}_p99"] = quantile(0.99, bounds, counts)
        return point

    @staticmethod
    def _sum_buckets(a: Sample, b: Sample) -> list[int]:
        """Every family's timed calls between two samples, per latency bucket."""
        total: list[int] = []
        for family, (_, _, after) in b.families.items():
            before = a.families.get(family, (0, 0, [0] * len(after)))[2]
            counts = [max(0, y - x) for x, y in zip(before, after)]
            total = counts if not total else [t + n for t, n in zip(total, counts)]
        return total

    def _families(self, a: Sample, b: Sample) -> list[dict[str, Any]]:
        dt = max(b.mono - a.mono, 1e-6)
        out = []
        for family, (calls, errors, buckets) in b.families.items():
            before = a.families.get(family, (0, 0, [0] * len(buckets)))
            counts = [max(0, y - x) for x, y in zip(before[2], buckets)]
            out.append({"family": family, "calls": calls, "errors": errors, "window_s": round(dt, 1),
                        "calls_per_s": max(0, calls - before[0]) / dt,
                        "errors_per_s": max(0, errors - before[1]) / dt,
                        "p50": quantile(0.5, self.command_bounds, counts),
                        "p99": quantile(0.99, self.command_bounds, counts)})
        return out
