"""Three real quilld nodes on 127.0.0.1: gossip, the sharded directory, peer fetch."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import time

import pytest
import redis

from conftest import free_gossip_port, free_port, start_quilld, stop_process, wait_until

MiB = 1024 * 1024
FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}
DEAD_BOUND = 8.0  # seconds: probe round (3 x 0.2 s) + suspicion (4 x 0.2 s x log10) + slack for a slow machine


class Cluster:
    """Nodes on 127.0.0.1 that find each other by gossip, or through etcd when given its client
    URLs (`etcd`: every node under one prefix of its own; `seeds` are then ignored)."""

    def __init__(self, tmp_path, etcd: str = ""):
        self.tmp_path = tmp_path
        self.nodes: dict[str, object] = {}
        self.gossip: dict[str, int] = {}
        self.etcd = etcd
        self.prefix = f"/quilltest-{os.urandom(4).hex()}"

    def start(self, name: str, seeds: list[str] = (), **env):
        extra = ["--node-id", name, "--dram", "128MiB"]
        if self.etcd:
            extra += ["--registry", "etcd", "--etcd-endpoints", self.etcd, "--etcd-prefix", self.prefix]
            env = {"QUILLD_CLUSTER_ETCD_LEASE_TTL_S": "3", **env}
        else:
            gport = self.gossip.get(name) or free_gossip_port()
            self.gossip[name] = gport
            extra += ["--gossip-port", str(gport)]
            if seeds:
                extra += ["--seeds", ",".join(f"127.0.0.1:{self.gossip[s]}" for s in seeds)]
        q = start_quilld(self.tmp_path, *extra, env={**FAST_GOSSIP, **env})
        self.nodes[name] = q
        return q

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.nodes[name].port, socket_timeout=20)

    def stop_all(self):
        for q in self.nodes.values():
            stop_process(q.proc)


def until(predicate, timeout: float, what: str):
    """Poll until `predicate` holds; fail naming `what` when `timeout` passes first."""
    value = wait_until(predicate, timeout=timeout, interval=0.05)
    assert value, f"timed out after {timeout} s waiting for {what}"
    return value


def holders(r: redis.Redis, key: str) -> list[str]:
    """The node names LOCATE lists for `key` (each place is a map, or a flat list in RESP2)."""
    out = []
    for place in r.execute_command("LOCATE", key)[0]:
        if isinstance(place, dict):
            out.append(place[b"node"].decode())
        else:
            out.append(dict(zip(place[::2], place[1::2]))[b"node"].decode())
    return out


def members(r: redis.Redis) -> dict[str, str]:
    lines = r.execute_command("NODES").decode().strip().splitlines()
    return {line.split()[0]: line.split()[1] for line in lines}


def three(cluster):
    cluster.start("a")
    cluster.start("b", ["a"])
    cluster.start("c", ["a"])
    for n in "abc":
        until(lambda n=n: members(cluster.client(n)) == {"a": "alive", "b": "alive", "c": "alive"},
                   timeout=15, what=f"node {n} to see three alive members")


def test_a_block_put_on_a_is_read_identical_through_b_and_c(cluster):
    three(cluster)
    a, b, c = (cluster.client(n) for n in "abc")
    payload = random.Random(7).randbytes(3 * MiB + 17)
    small = b"tiny value"
    a.set("blk:1", payload)
    a.set("small", small)
    t0 = time.monotonic()
    until(lambda: "a" in holders(c, "blk:1"),
               timeout=10, what="LOCATE on c to list a")
    delay = time.monotonic() - t0
    print(f"replication visible on c after {delay * 1000:.0f} ms")
    assert b.execute_command("GETBLK", "blk:1") == payload
    assert c.execute_command("GETBLK", "blk:1") == payload
    # small (inline) values are placed in the directory too: a pool read never asks every peer
    assert c.execute_command("GETBLK", "small") == small
    # LOCAL never fetches; a fetched copy is kept (cluster.keep_fetched), so b now has it locally
    assert c.execute_command("GETBLK", "blk:1", "LOCAL") == payload
    assert a.execute_command("GETBLK", "missing") is None
    assert b.execute_command("GETBLK", "never-put") is None
    info = b.info("cluster")
    assert info["cluster_peer_fetches"] >= 1
    # the three are still one cluster (waited for: on a loaded machine a late probe answer can make
    # a peer suspect for a moment, until it refutes it)
    until(lambda: b.info("cluster")["cluster_members_alive"] == 3, timeout=10, what="b to see three alive")
    import json
    import urllib.request

    def nodes_of_c() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.nodes['c'].admin_port}/v1/nodes", timeout=5) as r:
            return json.loads(r.read())

    until(lambda: {n["id"]: n["state"] for n in nodes_of_c()["nodes"]} == {"a": "alive", "b": "alive", "c": "alive"},
          timeout=10, what="c's /v1/nodes to list three alive")
    view = nodes_of_c()
    me = next(n for n in view["nodes"] if n["self"])
    assert me["id"] == "c" and me["resp"][1] == cluster.nodes["c"].port
    # a delete on a reaches the others' directories: they stop listing a
    a.delete("blk:1")
    until(lambda: not "a" in holders(c, "blk:1"),
               timeout=10, what="c to forget a's deleted copy")


def test_scopes_are_kept_apart_across_nodes(cluster):
    cluster.start("a")
    cluster.start("b", ["a"])
    until(lambda: members(cluster.client("b")) == {"a": "alive", "b": "alive"}, timeout=15,
               what="two members")
    a, b = cluster.client("a"), cluster.client("b")
    a.execute_command("SCOPE", "model-x", "")
    a.set("k", b"x" * 100_000)
    b.execute_command("SCOPE", "model-x", "")
    until(lambda: b.execute_command("GETBLK", "k") == b"x" * 100_000, timeout=10, what="fetch in scope")
    other = cluster.client("b")
    other.execute_command("SCOPE", "model-y", "")
    assert other.execute_command("GETBLK", "k") is None


def test_a_killed_node_is_declared_dead_and_its_residencies_dropped_then_it_rejoins(cluster):
    three(cluster)
    a, b = cluster.client("a"), cluster.client("b")
    c_node = cluster.nodes["c"]
    cluster.client("c").set("on-c", b"c" * 200_000)
    until(lambda: "c" in holders(a, "on-c"), timeout=10,
               what="a to learn c's block")
    os.kill(c_node.proc.pid, signal.SIGKILL)
    c_node.proc.wait(5)
    t0 = time.monotonic()
    for r in (a, b):
        until(lambda r=r: members(r).get("c") == "dead", timeout=DEAD_BOUND, what="c declared dead")
    print(f"c declared dead by a and b within {time.monotonic() - t0:.2f} s")
    assert not "c" in holders(a, "on-c")
    assert a.execute_command("GETBLK", "on-c") is None
    # restarted with the same id (fresh memory): it rejoins and is alive everywhere
    cluster.start("c", ["a"])  # same id and gossip port; its RESP port is new and gossip says so
    for r in (a, b):
        until(lambda r=r: members(r).get("c") == "alive", timeout=15, what="c alive again")
    cluster.client("c").set("again", b"z" * 50_000)
    until(lambda: a.execute_command("GETBLK", "again") == b"z" * 50_000, timeout=10,
               what="a to read c's new block")


def test_a_holder_killed_mid_transfer_fails_cleanly_or_another_serves(cluster):
    three(cluster)
    a, b, c = (cluster.client(n) for n in "abc")
    payload = random.Random(3).randbytes(48 * MiB)
    a.set("big", payload)
    until(lambda: "a" in holders(c, "big"), timeout=10,
               what="c to learn a's block")
    # b takes a copy too, so two nodes hold it
    assert b.execute_command("GETBLK", "big") == payload
    until(lambda: set(holders(c, "big")) >= {"a", "b"}, timeout=10,
               what="c to see both holders")
    import threading

    def kill_soon():
        time.sleep(0.02)
        os.kill(cluster.nodes["a"].proc.pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    try:
        got = c.execute_command("GETBLK", "big")
    except redis.ResponseError as e:
        assert "PEERFAIL" in str(e)  # a clean error, never a corrupt answer
    else:
        assert got == payload  # served by b (or by a before it died)
    # whatever happened, c never keeps a corrupt copy
    local = c.execute_command("GETBLK", "big", "LOCAL")
    assert local is None or local == payload


def test_with_passwords_peers_authenticate_with_the_cluster_secret(cluster):
    env = {"QUILLD_CLUSTER_SECRET": "s3cret", "QUILLD_SECURITY_REQUIREPASS": "pw"}
    cluster.start("a", **env)
    cluster.start("b", ["a"], **env)
    a = redis.Redis(port=cluster.nodes["a"].port, password="pw")
    b = redis.Redis(port=cluster.nodes["b"].port, password="pw")
    until(lambda: members(b) == {"a": "alive", "b": "alive"}, 15, "two members")
    a.set("k", b"v" * 100_000)
    until(lambda: "a" in holders(b, "k"), 10, "b to learn a's block")
    assert b.execute_command("GETBLK", "k") == b"v" * 100_000
    # a client cannot pose as a peer without the secret
    with pytest.raises(redis.AuthenticationError, match="invalid cluster secret"):
        b.execute_command("PEERAUTH", "guess")
    with pytest.raises(redis.exceptions.NoPermissionError, match="PEERAUTH first"):
        b.execute_command("DIR", "x", "")


def test_rdma_is_used_only_when_available_and_rdma_mode_fails_loudly(cluster, tmp_path):
    # these machines have no RDMA device: "auto" runs on TCP and says why ...
    cluster.start("a", QUILLD_CLUSTER_TRANSFER="auto")
    info = cluster.client("a").info("cluster")
    assert info["cluster_transfer"] == "tcp" and info["cluster_rdma_unavailable_reason"]
    # ... and "rdma" refuses to start instead of silently falling back
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "quilld", "--port", str(free_port()), "--admin-port", "0",
                           "--gossip-port", str(free_gossip_port()), "--dram", "16MiB"],
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")},
                               "QUILLD_CLUSTER_TRANSFER": "rdma"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert 'cluster.transfer = "rdma" but RDMA is unavailable' in proc.stderr


def test_gossip_needs_a_secret_off_loopback_and_counts_replays_in_info(cluster):
    """Issue 11, finding 11: without cluster.secret one forged UDP packet could mark a node dead,
    so a node refuses to gossip off loopback without one; with one, a replayed packet is refused
    and counted in INFO cluster."""
    import subprocess
    import sys

    from quilld.cluster.wire import Codec, Ping, Rumor, State, Update

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    proc = subprocess.run([sys.executable, "-m", "quilld", "--bind", "0.0.0.0", "--port", str(free_port()),
                           "--admin-port", "0", "--gossip-port", str(free_gossip_port()), "--dram", "16MiB"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cluster.secret" in proc.stderr and "QUILLD_CLUSTER_SECRET" in proc.stderr, \
        proc.stderr
    cluster.start("a", QUILLD_CLUSTER_SECRET="s3cret")
    cluster.start("b", ["a"], QUILLD_CLUSTER_SECRET="s3cret")
    a = cluster.client("a")
    until(lambda: members(a) == {"a": "alive", "b": "alive"}, 15, "two members")
    info = a.info("cluster")
    assert info["cluster_gossip_replays_rejected"] == info["cluster_gossip_stale_rejected"] == 0
    ping = Codec("s3cret").encode(Ping(1, "a", "b"))  # an authentic packet, as captured on the wire
    forged = Codec("guess").encode(Rumor("b", (Update(State.DEAD, "b", 99, source="b"),)))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for packet in (ping, ping, ping, forged):
            s.sendto(packet, ("127.0.0.1", cluster.gossip["a"]))
    until(lambda: a.info("cluster")["cluster_gossip_replays_rejected"] == 2, 5, "two replays counted")
    info = a.info("cluster")
    assert info["cluster_gossip_auth_failures"] == 1 and info["cluster_gossip_stale_rejected"] == 0
    time.sleep(1.0)  # several probe rounds: b was never declared dead
    assert members(a) == {"a": "alive", "b": "alive"}


# -- a cluster that speaks (issue 14, item 3) --------------------------------------------------

def test_a_single_node_answers_nodes_and_v1_nodes_with_itself(tmp_path):
    import json
    import urllib.request

    q = start_quilld(tmp_path, "--node-id", "solo", "--dram", "64MiB")
    try:
        r = redis.Redis(port=q.port, socket_timeout=10)
        r.set("blk", b"x" * 100_000)
        line = r.execute_command("NODES").decode()
        assert line.endswith("\n") and line.count("\n") == 1, line
        node_id, state, me, incarnation, resp, admin, dram = line.split()
        assert (node_id, state, me, incarnation) == ("solo", "alive", "myself", "0")
        assert (resp, admin) == (f"127.0.0.1:{q.port}", f"127.0.0.1:{q.admin_port}")
        used, capacity = map(int, dram.split("/"))
        assert capacity == 64 * MiB and used >= 100_000
        with urllib.request.urlopen(f"http://127.0.0.1:{q.admin_port}/v1/nodes", timeout=5) as resp_:
            view = json.loads(resp_.read())
        assert view["node_id"] == "solo" and len(view["nodes"]) == 1, view
        me_ = view["nodes"][0]
        assert (me_["id"], me_["state"], me_["self"], me_["incarnation"]) == ("solo", "alive", True, 0)
        assert me_["resp"] == ["127.0.0.1", q.port] and me_["admin"] == ["127.0.0.1", q.admin_port]
        assert me_["dram_capacity"] == 64 * MiB and me_["dram_used"] >= 100_000
    finally:
        stop_process(q.proc)


def test_seeds_without_a_gossip_port_is_a_startup_error():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    proc = subprocess.run([sys.executable, "-m", "quilld", "--port", str(free_port()), "--admin-port", "0",
                           "--dram", "16MiB", "--seeds", "127.0.0.1:7381"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "cluster.seeds (--seeds) needs cluster.gossip_port (--gossip-port)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_membership_changes_are_logged_one_line_each(cluster):
    three(cluster)
    log_a = cluster.nodes["a"].log
    for name in "bc":
        until(lambda name=name: re.search(rf"INFO quilld.cluster: cluster: {name} joined: gossip 127\.0\.0\.1:"
                                          rf"{cluster.gossip[name]}, RESP 127\.0\.0\.1:{cluster.nodes[name].port}",
                                          log_a()), 5, f"a to log that {name} joined")
    c_node = cluster.nodes["c"]
    os.kill(c_node.proc.pid, signal.SIGKILL)
    c_node.proc.wait(5)
    until(lambda: "WARNING quilld.cluster: cluster: c is dead; dropped the" in log_a(), DEAD_BOUND, "a: c is dead")
    logs = log_a() + cluster.nodes["b"].log()
    assert "INFO quilld.cluster: cluster: c is suspect" in logs, logs  # before dead, on a or b
    # the new process's return, not an ALIVE the old one gossiped before the kill (a meta refresh in
    # flight can bring it back for a moment, and its death is then said again)
    before = len(log_a())
    cluster.start("c", ["a"])
    until(lambda: "INFO quilld.cluster: cluster: c joined (back after dead): gossip" in log_a()[before:], 15,
          "a to log that c came back")
    stop_process(cluster.nodes["b"].proc)
    until(lambda: "INFO quilld.cluster: cluster: b left; dropped the" in log_a(), 10, "a to log that b left")
    said = [ln for ln in log_a().splitlines() if "quilld.cluster: cluster: c " in ln]
    kinds = [re.sub(r".*cluster: c ((joined( \(back after dead\))?)|is suspect|is dead|is alive again).*", r"\1", ln)
             for ln in said]
    # one line per change: joined, (suspect), dead, back; never the same change twice in a row
    assert kinds[0] == "joined" and "is dead" in kinds and kinds[-1] == "joined (back after dead)", said
    assert all(x != y for x, y in zip(kinds, kinds[1:])), said


def test_unanswered_seeds_are_warned_about_then_contact_is_said(cluster):
    seed_port = free_gossip_port()
    cluster.gossip["a"] = seed_port  # a is not started yet: b's seed answers nothing
    t0 = time.monotonic()
    b = cluster.start("b", ["a"], QUILLD_CLUSTER_SEED_WARNING_MS="2000")
    until(lambda: "WARNING quilld.gossip: gossip: no seed has answered" in b.log(), 20,
          "b to warn that its seed does not answer")
    assert time.monotonic() - t0 >= 1.9, "warned before cluster.seed_warning_ms"
    warning = next(ln for ln in b.log().splitlines() if "no seed has answered" in ln)
    assert f"127.0.0.1:{seed_port} connection refused" in warning, warning
    cluster.start("a")
    until(lambda: members(cluster.client("b")) == {"a": "alive", "b": "alive"}, 15, "b to reach a")
    until(lambda: "INFO quilld.gossip: gossip: in contact with the cluster after" in b.log(), 5,
          "b to say it is in contact")
    assert b.log().count("no seed has answered") == 1  # at most once a minute
