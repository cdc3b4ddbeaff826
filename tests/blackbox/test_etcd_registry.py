"""Membership from a real etcd cluster (cluster.registry = "etcd", issue 33): three etcd members on
127.0.0.1 started by the test (tests/etcd_cluster.py), quilld nodes registered under a prefix.

- Six nodes list each other; a value written on one reads byte for byte from all; two nodes
  killed with SIGKILL are dead in every view within the lease's TTL plus 2 s; an engine
  registered on one node is known to all and homed on another within the TTL plus 2 s of its
  home's death.
- The etcd leader killed, then every etcd member down for 15 s: no GET or SET fails on any node
  meanwhile, the nodes say etcd is unreachable (INFO, /readyz), and read the members again, all
  alive, once etcd is back.
- Two prefixes on one etcd are two clusters that do not see each other.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time

import pytest
import redis

from conftest import free_port, start_quilld, stop_process, wait_until
from etcd_cluster import EtcdCluster, EtcdUnavailable

pytestmark = pytest.mark.timeout(240)

TTL = 3  # seconds: the nodes' lease (a short one, so the test is short; the default is 5)
MiB = 1024 * 1024


@pytest.fixture
def etcd(tmp_path):
    try:
        cluster = EtcdCluster(tmp_path)
    except EtcdUnavailable as e:
        pytest.fail(str(e))
    with cluster:
        yield cluster


class Nodes:
    """quilld nodes registered in `etcd` under one prefix."""

    def __init__(self, tmp_path, etcd: EtcdCluster, prefix: str | None = None) -> None:
        self.tmp_path, self.etcd = tmp_path, etcd
        self.prefix = prefix or f"/quilltest-{secrets.token_hex(4)}"
        self.procs: dict[str, object] = {}

    def start(self, *names: str) -> None:
        for name in names:
            self.procs[name] = start_quilld(
                self.tmp_path, "--node-id", name, "--registry", "etcd", "--etcd-endpoints", self.etcd.endpoints,
                "--etcd-prefix", self.prefix, "--dram", "128MiB",
                env={"QUILLD_CLUSTER_ETCD_LEASE_TTL_S": str(TTL)})

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.procs[name].port, socket_timeout=20)

    def members(self, name: str) -> dict[str, str]:
        lines = self.client(name).execute_command("NODES").decode().strip().splitlines()
        return {line.split()[0]: line.split()[1] for line in lines}

    def live(self) -> list[str]:
        return [n for n, q in self.procs.items() if q.proc.poll() is None]

    def kill(self, name: str) -> None:
        q = self.procs[name]
        os.kill(q.proc.pid, 9)
        q.proc.wait(10)

    def stop_all(self) -> None:
        for q in self.procs.values():
            stop_process(q.proc)


@pytest.fixture
def nodes(tmp_path, etcd):
    n = Nodes(tmp_path, etcd)
    try:
        yield n
    finally:
        n.stop_all()


def wait_views(nodes: Nodes, want: dict[str, str], timeout: float, what: str) -> float:
    """Until every live node's NODES says `want` for each node named there; the seconds it took."""
    t0 = time.monotonic()
    ok = wait_until(lambda: all({k: nodes.members(n).get(k) for k in want} == want for n in nodes.live()),
                    timeout=timeout, interval=0.05)
    assert ok, f"{what}: views after {timeout} s: { {n: nodes.members(n) for n in nodes.live()} }"
    return time.monotonic() - t0


def admin(q, method: str, path: str, body=None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{q.admin_port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"null")


def etcd_get(etcd: EtcdCluster, key: str) -> str | None:
    """One key read from etcd as an operator would (etcdctl get), through the same client."""
    import asyncio

    import aetcd

    async def read():
        client = aetcd.Client(host="127.0.0.1", port=etcd.client_ports[etcd.names[0]], timeout=5)
        await client.connect()
        try:
            got = await client.get(key.encode())
            return None if got is None else got.value.decode()
        finally:
            await client.close()
    return asyncio.run(read())


def test_six_nodes_share_data_see_kills_within_the_ttl_and_rehome_an_engine(nodes):
    names = [f"n{i}" for i in range(6)]
    t0 = time.monotonic()
    nodes.start(*names)
    joined = wait_views(nodes, {n: "alive" for n in names}, 30, "six nodes alive everywhere")
    print(f"\nsix nodes started and in every view in {time.monotonic() - t0:.1f} s ({joined:.1f} s after the last start)")
    big, small = os.urandom(MiB), b"a small value"
    a = nodes.client("n0")
    a.set("big", big)
    a.set("small", small)
    for n in names:
        assert nodes.client(n).get("big") == big and nodes.client(n).get("small") == small, n
    status, body = admin(nodes.procs["n1"], "POST", "/v1/engines", {"id": "e1", "url": "http://127.0.0.1:9",
                                                                    "model": "m", "tokenizer": "t"})
    assert status == 201, body
    assert wait_until(lambda: all(admin(nodes.procs[n], "GET", "/v1/engines")[1]["engines"] for n in names),
                      timeout=10), "not every node learned of e1"
    homes = {n: admin(nodes.procs[n], "GET", "/v1/engines")[1]["engines"][0]["home"] for n in names}
    assert set(homes.values()) == {"n1"}, homes
    home_key = f"{nodes.prefix}/homes/e1"  # the election: one key, held under the home's lease
    assert wait_until(lambda: etcd_get(nodes.etcd, home_key) == "n1", timeout=10), etcd_get(nodes.etcd, home_key)
    killed = time.monotonic()
    nodes.kill("n1")
    nodes.kill("n4")
    took = wait_views(nodes, {"n1": "dead", "n4": "dead"}, TTL + 10, "the killed nodes dead everywhere")
    listed = {m["id"]: m["state"] for m in admin(nodes.procs["n2"], "GET", "/v1/nodes")[1]["nodes"]}
    assert listed == {n: "dead" if n in ("n1", "n4") else "alive" for n in names}, listed  # as NODES says
    print(f"two nodes killed: dead in every view {took:.2f} s later (TTL {TTL} s)")
    assert took <= TTL + 2, f"the kills took {took:.1f} s to reach every view (TTL {TTL} s)"

    def one_home():
        homes = {n: admin(nodes.procs[n], "GET", "/v1/engines")[1]["engines"][0]["home"] for n in nodes.live()}
        counts = [nodes.client(n).info("cluster")["cluster_engines_homed"] for n in nodes.live()]
        return len(set(homes.values())) == 1 and "n1" not in homes.values() and sum(counts) == 1

    assert wait_until(one_home, timeout=TTL + 10, interval=0.05), "e1 has no single new home"
    rehomed = time.monotonic() - killed
    new_home = admin(nodes.procs["n0"], "GET", "/v1/engines")[1]["engines"][0]["home"]
    assert wait_until(lambda: etcd_get(nodes.etcd, home_key) == new_home, timeout=5), etcd_get(nodes.etcd, home_key)
    print(f"e1 homed again {rehomed:.2f} s after its home was killed")
    assert rehomed <= TTL + 2
    assert nodes.client("n5").get("small") == small  # n0's values are still found


def test_the_etcd_leader_killed_and_etcd_down_cost_no_read_or_write(nodes, etcd):
    names = ["n0", "n1", "n2"]
    nodes.start(*names)
    wait_views(nodes, {n: "alive" for n in names}, 30, "three nodes alive")
    errors: list[str] = []
    done = {"ops": 0}
    stop = threading.Event()

    def load():
        clients = {n: redis.Redis(port=nodes.procs[n].port, socket_timeout=5) for n in names}
        i = 0
        while not stop.is_set():
            for n, r in clients.items():
                try:
                    r.set(f"k{i % 50}:{n}", f"v{i}")
                    got = clients[names[(names.index(n) + 1) % 3]].get(f"k{i % 50}:{n}")
                    if got != f"v{i}".encode():
                        errors.append(f"GET of k{i % 50}:{n} read {got!r}, wrote v{i}")
                except redis.RedisError as e:
                    errors.append(f"{n}: {type(e).__name__}: {e}")
                done["ops"] += 2
            i += 1
            time.sleep(0.01)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        time.sleep(1)
        leader = etcd.leader()
        etcd.kill(leader)
        time.sleep(TTL + 2)  # the leases outlive an election
        assert all(set(nodes.members(n).values()) == {"alive"} for n in names)
        etcd.start(leader)
        etcd.wait_healthy()
        etcd.stop_all()  # etcd wholly down
        assert wait_until(lambda: all(nodes.client(n).info("cluster")["cluster_registry_state"] == "unreachable"
                                      for n in names), timeout=TTL * 3), "the nodes did not notice etcd was gone"
        status, ready = admin(nodes.procs["n0"], "GET", "/readyz")
        assert status == 200 and "etcd unreachable" in ready["notes"][0], ready
        time.sleep(15)
        assert all(set(nodes.members(n).values()) == {"alive"} for n in names)  # the last view stands
        back = time.monotonic()
        etcd.start_all()
        assert wait_until(lambda: all(nodes.client(n).info("cluster")["cluster_registry_state"] == "connected"
                                      for n in names), timeout=30), \
            "the nodes did not reconnect:\n" + "\n".join(nodes.procs[n].log_path.read_text()[-2000:] for n in names)
        print(f"\nnodes connected again {time.monotonic() - back:.1f} s after etcd was started again")
        wait_views(nodes, {n: "alive" for n in names}, 10, "three alive after etcd came back")
    finally:
        stop.set()
        worker.join(20)
    print(f"{done['ops']} GETs and SETs while the leader was killed and etcd was down: {len(errors)} errors")
    assert done["ops"] > 1000 and not errors, errors[:10]


def test_two_prefixes_are_two_clusters(tmp_path, etcd):
    one, two = Nodes(tmp_path, etcd), Nodes(tmp_path, etcd)
    try:
        one.start("a1", "a2")
        two.start("b1", "b2")
        wait_views(one, {"a1": "alive", "a2": "alive"}, 30, "the first prefix's nodes")
        wait_views(two, {"b1": "alive", "b2": "alive"}, 30, "the second prefix's nodes")
        time.sleep(1)
        assert set(one.members("a1")) == {"a1", "a2"} and set(two.members("b2")) == {"b1", "b2"}
        one.client("a1").set("k", "one")
        assert one.client("a2").get("k") == b"one" and two.client("b1").get("k") is None
    finally:
        one.stop_all()
        two.stop_all()


def test_a_node_whose_etcd_never_answers_serves_alone_and_says_so(tmp_path):
    port = free_port()  # nothing listens there
    q = start_quilld(tmp_path, "--node-id", "lone", "--registry", "etcd", "--etcd-endpoints",
                     f"http://127.0.0.1:{port}", env={"QUILLD_CLUSTER_ETCD_LEASE_TTL_S": str(TTL)})
    try:
        r = redis.Redis(port=q.port)
        assert r.set("k", "v") and r.get("k") == b"v"
        info = r.info("cluster")
        assert info["cluster_registry"] == "etcd" and info["cluster_registry_state"] == "unreachable", info
        assert wait_until(lambda: "serving alone" in q.log_path.read_text(), timeout=10)
    finally:
        stop_process(q.proc)
