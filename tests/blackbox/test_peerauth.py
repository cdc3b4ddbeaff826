"""Issue 19, item 13: PEERAUTH is throttled and counted as AUTH is, gives peer rights only, and
never takes an empty secret.

Before the fix, one unauthenticated connection tried about 13,000 secrets a second, uncounted; a
right one made the connection a peer *and* the operator (GET of the default tenant's keys,
CONFIG SET, FLUSHALL ...); and on a loopback cluster without `cluster.secret`, `PEERAUTH ""`
from any client succeeded. Such a cluster now authenticates its peers with the host's secret
(quilld/cluster/local_secret.py), which this test reads as a node's user can.
"""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest
import redis

from conftest import cmd, free_gossip_port, exchange, read_lines, start_quilld, stop_process, wait_until
from quilld.cluster.local_secret import FILE_NAME, local_secret, secret_dir

pytestmark = pytest.mark.timeout(120)

WRONG = b"-WRONGPASS invalid cluster secret\r\n"


def test_a_cluster_without_a_secret_refuses_the_empty_one_and_counts_and_slows_guesses(tmp_path):
    q = start_quilld(tmp_path, "--dram", "16MiB", "--gossip-port", str(free_gossip_port()),
                     env={"QUILLD_SECURITY_AUTH_DELAY_MAX_MS": "400"})
    try:
        assert exchange(q.port, cmd("PEERAUTH", "") + cmd("DIR", "x", ""), lines=2)[0] == \
            WRONG + b"-NOPERM node-to-node command: PEERAUTH first\r\n"
        # the host's secret: a file of this user's alone, the one every node of this user shares
        path = os.path.join(secret_dir(), FILE_NAME)
        st = os.stat(path)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600
        secret = local_secret()
        assert exchange(q.port, cmd("PEERAUTH", secret) + cmd("DIR", "x", b"\x92\xa1l\x90"), lines=2)[0].startswith(
            b"+OK\r\n$")
        # one connection pipelines 3,000 guesses: before the fix all were answered within ~0.25 s
        with socket.create_connection(("127.0.0.1", q.port), timeout=30) as s:
            s.sendall(cmd("PEERAUTH", "guess") * 3000)
            t0 = time.monotonic()
            got = read_lines(s, 3000, timeout=3.0)
            elapsed = time.monotonic() - t0
        answered = got.count(WRONG)
        r = q.client()
        failures = r.info("stats")["peerauth_failures"]
        print(f"\nPEERAUTH guesses answered on one connection in {elapsed:.1f} s: {answered} "
              f"({answered / elapsed:.0f}/s); peerauth_failures={failures}")
        # 10 free, then one per delay (50, 100, 200, then 400 ms) on a connection
        assert answered <= 10 + 4 + elapsed / 0.4, (answered, elapsed)
        assert failures >= answered + 1 and r.info("stats")["peerauth_throttled"] >= answered - 10
    finally:
        stop_process(q.proc)


def test_a_peer_is_no_operator_and_no_tenant(tmp_path):
    users = tmp_path / "users"
    users.write_text("alice apw\n")
    q = start_quilld(tmp_path, "--dram", "16MiB", "--gossip-port", str(free_gossip_port()), "--requirepass", "opw",
                     "--users-file", str(users), env={"QUILLD_CLUSTER_SECRET": "peer-secret"})
    try:
        alice = q.client(username="alice", password="apw")
        alice.set("hers", b"alice's block")
        operator = q.client(password="opw")
        operator.set("ops", b"operator's")
        s = socket.create_connection(("127.0.0.1", q.port), timeout=10)
        s.sendall(cmd("PEERAUTH", "peer-secret"))
        assert read_lines(s, 1) == b"+OK\r\n"
        # peer rights: the node-to-node commands, for any tenant's key (what peer fetch needs)
        s.sendall(cmd("PEERGET", "alice", "", "", "", "hers"))
        reply = read_lines(s, 3)
        assert reply.startswith(b"*2\r\n:") and reply.endswith(b"$13\r\nalice's block\r\n"), reply
        # nothing else: before the fix the connection was the operator (user default)
        for command in (cmd("GET", "ops"), cmd("CONFIG", "SET", "maxclients", "7"), cmd("FLUSHALL"),
                        cmd("CLIENT", "LIST"), cmd("SCOPE", "m", "t"), cmd("KEYS", "*"), cmd("DBSIZE")):
            s.sendall(command)
            assert read_lines(s, 1) == b"-NOAUTH Authentication required.\r\n", command
        # a peer's commands are parsed as a logged-in client's, not under the pre-AUTH limits
        # (10 arguments, 16 KiB): a long PEERRELEASE is answered, the connection kept
        s.sendall(cmd("PEERRELEASE", *range(1, 40)) + cmd("PEERGET", "alice", "", "", "", "x" * 20000))
        assert read_lines(s, 2) == (b"-ERR RDMA is not enabled on this node (see INFO cluster: "
                                    b"cluster_rdma_unavailable_reason)\r\n$-1\r\n")
        s.close()
        assert operator.get("ops") == b"operator's" and alice.get("hers") == b"alice's block"
        assert operator.config_get("maxclients")["maxclients"] == "10000"
        # a peer that logs in as a tenant has that tenant's rights, not the operator's
        s = socket.create_connection(("127.0.0.1", q.port), timeout=10)
        s.sendall(cmd("AUTH", "alice", "apw") + cmd("PEERAUTH", "peer-secret") + cmd("CONFIG", "SET", "maxclients", "7")
                  + cmd("GET", "ops"))
        assert read_lines(s, 4) == (b"+OK\r\n+OK\r\n-NOPERM this user has no permissions to run the 'config|set' "
                                    b"command\r\n$-1\r\n")
        s.close()
    finally:
        stop_process(q.proc)


def test_two_nodes_without_a_secret_still_fetch_from_each_other(tmp_path):
    ga, gb = free_gossip_port(), free_gossip_port()
    fast = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80"}
    a = start_quilld(tmp_path, "--node-id", "a", "--gossip-port", str(ga), "--dram", "32MiB", env=fast)
    b = start_quilld(tmp_path, "--node-id", "b", "--gossip-port", str(gb), "--dram", "32MiB",
                     "--seeds", f"127.0.0.1:{ga}", env=fast)
    try:
        ra, rb = redis.Redis(port=a.port, socket_timeout=20), redis.Redis(port=b.port, socket_timeout=20)
        assert wait_until(lambda: rb.info("cluster").get("cluster_members_alive") == 2, 30)
        ra.set("big", b"x" * 100_000)
        assert wait_until(lambda: rb.execute_command("GETBLK", "big") == b"x" * 100_000, 20)
        assert ra.info("stats")["peerauth_failures"] == 0
    finally:
        stop_process(b.proc)
        stop_process(a.proc)
