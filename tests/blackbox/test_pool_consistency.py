"""One value per key across real quilld nodes (issue 32, items 3 and 4), on 127.0.0.1.

- SET k on node a, then SET k on node b: every node reads b's value within 2 s, and never a's
  again once it has read b's (a's own copy is dropped: an owner told it a newer version exists).
- DEL on a while c, holding kept copies, is down; c restarts with its SSD tier: the keys never
  come back, on any node (c's recovered copies lose to a's tombstones).
- DEL of a key only a peer holds deletes it there (and counts it).
"""

from __future__ import annotations

import contextlib
import signal
import time

import pytest
import redis
from test_cluster import members, until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["gossip", "etcd"])
def cluster(request, tmp_path):
    """Each test twice: members by gossip, and members through a real etcd (one member here;
    test_etcd_registry.py runs three)."""
    from etcd_cluster import EtcdCluster
    from test_cluster import Cluster

    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdCluster(tmp_path, members=1)) if request.param == "etcd" else None
        c = Cluster(tmp_path, etcd=etcd.endpoints if etcd else "")
        stack.callback(c.stop_all)
        yield c

CONVERGE_S = 2.0


def three_alive(cluster, names="abc"):
    for n in names:
        until(lambda n=n: set(members(cluster.client(n)).values()) == {"alive"}
              and len(members(cluster.client(n))) == len(names), 20, f"{n} to see {len(names)} alive")


def test_a_key_written_on_two_nodes_reads_as_the_second_write_everywhere(cluster):
    cluster.start("a")
    for n in "bc":
        cluster.start(n, ["a"])
    three_alive(cluster)
    a, b, c = (cluster.client(n) for n in "abc")
    keys = [f"user:{i}" for i in range(50)]
    for k in keys:
        a.set(k, b"first")
    until(lambda: all(c.get(k) == b"first" for k in keys), 10, "c to read a's values")  # c keeps copies
    t0 = time.monotonic()
    for k in keys:
        b.set(k, b"second")
    seen: dict[tuple[str, str], float] = {}
    regressed = []
    while time.monotonic() - t0 < CONVERGE_S + 3.0:
        for name, r in (("a", a), ("b", b), ("c", c)):
            for k in keys:
                got = r.get(k)
                if got == b"second":
                    seen.setdefault((name, k), time.monotonic() - t0)
                elif (name, k) in seen:
                    regressed.append((name, k, got))
        if len(seen) == 3 * len(keys) and time.monotonic() - t0 > CONVERGE_S:
            break
        time.sleep(0.02)
    late = {nk: t for nk, t in seen.items() if t > CONVERGE_S}
    missing = [(n, k) for n in "abc" for k in keys if (n, k) not in seen]
    print(f"every node read the second write after at most {max(seen.values()) * 1e3:.0f} ms;"
          f" a dropped {a.info('cluster').get('cluster_directory_stale_copies_dropped')} stale copies")
    assert not missing, f"never read the second write: {missing[:5]}"
    assert not late, f"read the second write only after {CONVERGE_S} s: {sorted(late.items())[:5]}"
    assert not regressed, f"read an older value after the second: {regressed[:5]}"


def test_keys_deleted_while_a_holder_was_down_never_come_back(cluster, tmp_path):
    ssd = tmp_path / "c-ssd"
    cluster.start("a")
    cluster.start("b", ["a"])
    cluster.start("c", ["a"], QUILLD_SSD_DIR=str(ssd), QUILLD_SSD_SIZE="256MiB")
    three_alive(cluster)
    a, c = cluster.client("a"), cluster.client("c")
    keys = [f"doc:{i}" for i in range(20)]
    for k in keys:
        a.set(k, k.encode() * 100)
    until(lambda: all(c.get(k) == k.encode() * 100 for k in keys), 10, "c to read (and keep) a's values")
    proc = cluster.nodes["c"].proc
    proc.send_signal(signal.SIGTERM)  # a clean stop: its kept copies are flushed to its SSD tier
    proc.wait(30)
    until(lambda: "c" not in members(a) or members(a)["c"] in ("dead", "left"), 15, "a to see c gone")
    assert a.delete(*keys) == len(keys)
    cluster.start("c", ["a"], QUILLD_SSD_DIR=str(ssd), QUILLD_SSD_SIZE="256MiB")
    three_alive(cluster)
    c = cluster.client("c")
    recovered = c.info("cluster")
    end = time.monotonic() + 5.0
    back = []
    while time.monotonic() < end:
        for name in "abc":
            r = cluster.client(name)
            back += [(name, k) for k in keys if r.get(k) is not None]
        time.sleep(0.2)
    print(f"c dropped {c.info('cluster').get('cluster_directory_stale_copies_dropped')} recovered copies"
          f" (directory entries held after its restart: {recovered.get('cluster_directory_entries_held')})")
    assert not back, f"deleted keys came back: {sorted(set(back))[:6]}"
    assert c.dbsize() == 0


def test_del_of_a_key_only_a_peer_holds_deletes_it_there(cluster):
    cluster.start("a")
    cluster.start("b", ["a"], QUILLD_CLUSTER_KEEP_FETCHED="false")
    for n in "ab":
        until(lambda n=n: list(members(cluster.client(n)).values()) == ["alive", "alive"], 20, f"{n}: two alive")
    a, b = cluster.client("a"), cluster.client("b")
    a.set("held-on-a", b"v")
    assert b.exists("held-on-a") == 1
    assert b.delete("held-on-a", "never-written") == 1
    assert a.get("held-on-a") is None and b.get("held-on-a") is None
    with pytest.raises(redis.ResponseError):
        b.execute_command("DEL")
