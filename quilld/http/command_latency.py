"""Per command family (the command table's `group`): calls, errors, and latency buckets, read
off the dispatcher's own counters for `/metrics` (a collector) and the status page's history."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from quilld.context.node_context import NodeContext

COMMAND_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0)


class Family(NamedTuple):
    """One command family's counts since the start (or CONFIG RESETSTAT)."""

    calls: int
    rejected: int  # refused by the dispatcher's checks (arity, auth, scope ...)
    failed: int  # answered an error by their handler
    buckets: list[int]  # timed calls per COMMAND_BUCKETS bound, then one for +Inf (not cumulative)
    sum_ns: int  # time of the timed calls


class CommandLatency(Collector):
    """Per command family (the table's `group`): calls, errors, and the dispatcher's latency buckets.

    The dispatcher keeps, per command, its calls, the calls it timed and a histogram of
    their durations in buckets 16 per power of two (`CommandTable.latency_of`); each of
    those is put in the first Prometheus bucket whose bound is at least its top (so a bound
    is at most 6% generous). The families are those of the table, at zero from the start.
    """

    def __init__(self, node: NodeContext) -> None:
        self.table = node.table
        self._family: dict[str, str] = {}  # command name (`client|list`) -> its family
        for cmd in self.table.commands.values():
            self._family[cmd.name] = cmd.group
            for sub in cmd.subcommands.values():
                self._family[sub.name] = cmd.group
        self.families = sorted(set(self._family.values()))
        self._bounds_ns = [int(b * 1e9) for b in COMMAND_BUCKETS]
        self._slot: dict[int, int] = {}  # a dispatcher bucket's top (ns) -> index of its Prometheus bucket

    def _slot_of(self, top: int) -> int:
        slot = self._slot.get(top)
        if slot is None:
            slot = self._slot[top] = next((i for i, b in enumerate(self._bounds_ns) if top <= b),
                                          len(self._bounds_ns))
        return slot

    def per_family(self) -> dict[str, Family]:
        """Every family of the table, with its counts now."""
        calls = dict.fromkeys(self.families, 0)
        rejected = dict.fromkeys(self.families, 0)
        failed = dict.fromkeys(self.families, 0)
        buckets = {f: [0] * (len(COMMAND_BUCKETS) + 1) for f in self.families}
        sums = dict.fromkeys(self.families, 0)
        for name, st in self.table.stats.items():
            family = self._family.get(name)
            if family is None:
                continue
            calls[family] += st[0]
            rejected[family] += st[3]
            failed[family] += st[4]
            sums[family] += st[1]
            counts = buckets[family]
            for top, n in self.table.latency_of(name):
                counts[self._slot_of(top)] += n
        return {f: Family(calls[f], rejected[f], failed[f], buckets[f], sums[f]) for f in self.families}

    def collect(self) -> Iterator[Metric]:
        rows = self.per_family()
        calls = CounterMetricFamily("quilld_commands", "Commands run, per command family (exact).",
                                    labels=["family"])
        errors = CounterMetricFamily("quilld_command_errors", "Commands answered with an error, per family: "
                                     "rejected by the dispatcher's checks or failed in their handler.",
                                     labels=["family", "kind"])
        hist = HistogramMetricFamily("quilld_command_duration_seconds", "Time a command ran on the event loop, "
                                     "per family (timed calls: a sample of fast commands such as GET and SET, "
                                     "every call of the others; a reply that waits on SSD or a peer is timed "
                                     "until it starts waiting).", labels=["family"])
        bounds = [repr(b) for b in COMMAND_BUCKETS] + ["+Inf"]
        for family, row in rows.items():
            calls.add_metric([family], row.calls)
            errors.add_metric([family, "rejected"], row.rejected)
            errors.add_metric([family, "failed"], row.failed)
            running, cumulative = 0, []
            for bound, n in zip(bounds, row.buckets):
                running += n
                cumulative.append((bound, running))
            hist.add_metric([family], cumulative, row.sum_ns / 1e9)
        yield calls
        yield errors
        yield hist
