"""Issue 32, item 5: an owner that stops answering (SIGSTOP: alive in SWIM's view for a while,
its sockets open, nothing answered) must not stall the reads whose lookups it owns.

Four real nodes on 127.0.0.1, two directory owners per entry. Node b reads a's small keys
(each a lookup, keep_fetched off so every GET asks again) every 20 ms while c is stopped for
10 s: hedging to the next owner covers even the first stall, and c's breaker then skips it.
SWIM is made slow to declare c dead, as it is for a one-way partition, so the reads cannot
lean on the view.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from test_cluster import Cluster, members, until

pytestmark = pytest.mark.timeout(120)

STOPPED_S = 10.0
PACE_S = 0.02
P99_LIMIT_S = 0.25


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for n in c.nodes.values():  # a stopped node must be able to die
            try:
                os.kill(n.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        c.stop_all()


def test_a_stopped_owner_does_not_stall_reads(cluster):
    # SWIM slow to declare c dead (as it is for a one-way partition): the reads must not need it
    env = {"QUILLD_CLUSTER_DIRECTORY_REPLICAS": "2", "QUILLD_CLUSTER_SUSPICION_MULT": "30"}
    cluster.start("a", **env)
    for n in "bcd":
        cluster.start(n, ["a"], **env, **({"QUILLD_CLUSTER_KEEP_FETCHED": "false"} if n == "b" else {}))
    a, b = cluster.client("a"), cluster.client("b")
    until(lambda: len(members(b)) == 4 and set(members(b).values()) == {"alive"}, 20, "four members")
    keys = [f"k{i}" for i in range(64)]
    for k in keys:
        a.set(k, k.encode() * 8)
    until(lambda: all(b.get(k) == k.encode() * 8 for k in keys), 15, "b to read every key")
    reader = redis.Redis(port=cluster.nodes["b"].port, socket_timeout=15)

    def read_for(seconds: float) -> tuple[list[float], int]:
        took, missed, i = [], 0, 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            k = keys[i % len(keys)]
            i += 1
            t0 = time.monotonic()
            got = reader.get(k)
            took.append(time.monotonic() - t0)
            missed += got != k.encode() * 8
            time.sleep(max(0.0, PACE_S - took[-1]))
        return sorted(took), missed

    before, _ = read_for(2.0)
    c = cluster.nodes["c"].proc.pid
    os.kill(c, signal.SIGSTOP)
    try:
        during, missed = read_for(STOPPED_S)
    finally:
        os.kill(c, signal.SIGCONT)
    p50, p99 = during[len(during) // 2], during[int(len(during) * 0.99)]
    info = b.info("cluster")
    print(f"all alive p50 {before[len(before) // 2] * 1e3:.2f} ms p99 {before[int(len(before) * 0.99)] * 1e3:.2f} ms;"
          f" c stopped p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms max {during[-1] * 1e3:.0f} ms,"
          f" {len(during)} reads, {missed} missed; hedged {info.get('cluster_lookup_hedged')}"
          f" won {info.get('cluster_lookup_hedges_won')} breaker opens {info.get('cluster_peer_breaker_opens')}"
          f" skips {info.get('cluster_lookup_breaker_skips')}")
    assert p99 <= P99_LIMIT_S, f"GET p99 {p99 * 1e3:.0f} ms while an owner was stopped"
    assert during[-1] < 1.0, f"a GET waited {during[-1]:.1f} s for the stopped owner"
    assert missed == 0
    assert info["cluster_lookup_hedged"] >= 1 and info["cluster_peer_breaker_opens"] >= 1
