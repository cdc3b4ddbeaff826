"""Tenants kept apart in what they can use and what they can see (issue 11, findings 3, 6, 7).

- Identity scopes are bounded per tenant and reclaimed when unused, and a lookup
  miss costs the same however many scopes exist (finding 3).
- Headers alone cannot hold the arena: clients' unfilled reservations are capped per
  tenant and in all (finding 6).
- INFO's counters and CLIENT LIST show a tenant its own; the admin API shows all (finding 7).
"""

from __future__ import annotations

import json
import socket
import statistics
import time
import urllib.request

import pytest
import redis

from conftest import cmd, read_lines, start_quilld, stop_process, wait_until

MiB = 1 << 20
TOKEN = "admin-secret-token"


@pytest.fixture(scope="module")
def users(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    path = tmp / "users"
    path.write_text("alice apw\nbob bpw\nmallory mpw\n")
    return tmp, path


def _admin(q, path: str):
    req = urllib.request.Request(f"http://127.0.0.1:{q.admin_port}{path}",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def _start(tmp, users_path, *flags, **env):
    env = {"QUILLD_ADMIN_TOKEN": TOKEN, **env}
    return start_quilld(tmp, "--users-file", str(users_path), *flags, env=env)


# -- finding 3: scopes ----------------------------------------------------------------------
def test_scopes_are_capped_per_tenant_and_unused_ones_reclaimed(users):
    tmp, path = users
    q = _start(tmp, path, "--dram", "64MiB", QUILLD_SECURITY_MAX_SCOPES_PER_TENANT="20")
    try:
        alice = q.client(username="alice", password="apw", single_connection_client=True)
        # switching scopes with nothing kept in them never runs into the cap: idle ones are reclaimed
        for i in range(200):
            assert alice.execute_command("SCOPE", f"model-{i}", "tok") == b"OK"
        # scopes that hold keys (or connections) count: a 21st is refused
        for i in range(20):
            alice.execute_command("SCOPE", f"kept-{i}", "tok")
            alice.set("k", f"v{i}")
        with pytest.raises(redis.ResponseError, match=r"tenant 'alice' already uses 20 identity scopes "
                                                      r"\(security.max_scopes_per_tenant\)"):
            alice.execute_command("SCOPE", "one-too-many", "tok")
        assert alice.ping() is True and alice.get("k") == b"v19"  # the connection stays in its scope
        # another tenant is not affected by alice's cap
        bob = q.client(username="bob", password="bpw", single_connection_client=True)
        assert bob.execute_command("SCOPE", "one-too-many", "tok") == b"OK"
        # once a scope holds nothing it can be reused for another
        alice.execute_command("SCOPE", "kept-0", "tok")
        alice.delete("k")
        alice.execute_command("SCOPE", "kept-1", "tok")
        assert alice.execute_command("SCOPE", "finally", "tok") == b"OK"
        assert _admin(q, "/v1/stats")["tenants"]["alice"]["scopes"] <= 20
    finally:
        stop_process(q.proc)


def _median_miss_us(client, n: int = 300) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        assert client.get(f"absent-{i}") is None
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def test_a_miss_costs_the_same_however_many_scopes_exist(users):
    tmp, path = users
    q = _start(tmp, path, "--dram", "256MiB", QUILLD_SECURITY_MAX_SCOPES_PER_TENANT="100000")
    try:
        bob = q.client(username="bob", password="bpw", single_connection_client=True)
        bob.set("own", "x")
        before = _median_miss_us(bob)
        n = 20_000
        with socket.create_connection(("127.0.0.1", q.port), timeout=60) as s:
            s.sendall(cmd("AUTH", "mallory", "mpw"))
            assert read_lines(s, 1) == b"+OK\r\n"
            batch = b"".join(cmd("SCOPE", f"m{i}", "t") + cmd("SET", f"key-{i}", "v") for i in range(n))
            s.sendall(batch)
            replies = read_lines(s, 2 * n, timeout=60)
            assert replies.count(b"+OK\r\n") == 2 * n, replies[:200]
        after = _median_miss_us(bob)
        # before the fix every miss scanned every scope: 100k scopes took a miss from 39 us to 10 ms
        # (a scan of 20k scopes is a fifth of that). Medians of 300 misses each, on one connection
        # one after the other; the bound leaves room for a loaded machine and still catches a scan.
        assert after < 5 * before + 500, (before, after)
        # and a key another identity holds is still refused, not served
        mallory_key = q.client(username="bob", password="bpw", single_connection_client=True)
        assert mallory_key.get("key-7") is None
        assert _admin(q, "/v1/stats")["tenants"]["bob"]["guard_refusals_cross_tenant"] == 1  # the operator's view
    finally:
        stop_process(q.proc)


# -- finding 7: what a tenant sees ---------------------------------------------------------------
def test_info_and_client_list_show_a_tenant_only_its_own(users):
    tmp, path = users
    q = _start(tmp, path, "--dram", "64MiB")
    try:
        alice = q.client(username="alice", password="apw", single_connection_client=True)
        bob = q.client(username="bob", password="bpw", single_connection_client=True)
        bob_too = q.client(username="bob", password="bpw", single_connection_client=True)
        alice.set("secret-prefix", "kv")
        bob_too.ping()
        before = alice.info("stats")
        for _ in range(5):
            assert bob.get("secret-prefix") is None  # refused: alice holds it
            assert bob.get("nothing") is None
        after = alice.info("stats")
        for field in ("keyspace_hits", "keyspace_misses", "guard_refusals", "guard_refusals_cross_tenant"):
            assert after[field] == before[field], field  # nothing of bob's shows in alice's INFO
        bob_stats = bob.info("stats")
        # bob's own misses; refusals for keys of alice's are the operator's to see (issue 19 item 16)
        assert bob_stats["guard_refusals_cross_tenant"] == 0 and bob_stats["keyspace_misses"] == 10
        assert alice.info("clients")["connected_clients"] == 1
        assert bob.info("clients")["connected_clients"] == 2
        listed = alice.execute_command("CLIENT", "LIST").decode()
        assert listed.count("\n") == 1 and "user=alice" in listed and "user=bob" not in listed
        assert bob.execute_command("CLIENT", "LIST").decode().count("user=bob") == 2
        # the operator sees everyone, behind the admin token
        everyone = _admin(q, "/v1/clients")["clients"]
        assert sorted(c["user"] for c in everyone) == ["alice", "bob", "bob"]
        tenants = _admin(q, "/v1/stats")["tenants"]
        assert tenants["bob"]["guard_refusals_cross_tenant"] == 5 and tenants["alice"]["keyspace_misses"] == 0
    finally:
        stop_process(q.proc)


def test_a_tenants_figures_do_not_depend_on_other_tenants_keys(users):
    """Issue 19 item 16: bob's guard_refusals_cross_tenant rose by 1 when he missed a key alice
    holds and by 0 when nobody held it. Every figure bob's INFO shows now moves the same."""
    tmp, path = users
    q = _start(tmp, path, "--dram", "64MiB")
    try:
        alice = q.client(username="alice", password="apw", single_connection_client=True)
        bob = q.client(username="bob", password="bpw", single_connection_client=True)
        for i in range(20):
            alice.set(f"held-{i}", "kv")
        bob.execute_command("SCOPE", "m2", "t")
        for i in range(10):
            bob.set(f"held-{i}", "bob's own, other model")  # some keys he holds too, under another model
        bob.execute_command("SCOPE", "m", "t")

        def moves(keys) -> dict:
            before = bob.info("stats")
            for k in keys:
                assert bob.get(k) is None and bob.exists(k) == 0
            after = bob.info("stats")
            return {k: after[k] - before[k] for k in after
                    if k.startswith(("guard_", "keyspace_", "expired", "evicted"))}

        held = moves([f"held-{i}" for i in range(10, 20)])  # alice holds these
        nobodys = moves([f"none-{i}" for i in range(10)])  # nobody does
        assert held == nobodys, (held, nobodys)
        # and misses on keys bob holds under his other model count cross_model, alice's copies or not
        own = moves([f"held-{i}" for i in range(10)])
        assert own["guard_refusals_cross_model"] == 20 and own["guard_refusals_cross_tenant"] == 0
        tenants = _admin(q, "/v1/stats")["tenants"]
        assert tenants["bob"]["guard_refusals_cross_tenant"] == 20  # the operator still sees them
    finally:
        stop_process(q.proc)


# -- finding 6: headers alone cannot starve the arena ---------------------------------------------
def test_unfilled_reservations_are_capped_per_tenant(users):
    tmp, path = users
    q = _start(tmp, path, "--dram", "256MiB")
    try:
        alice = q.client(username="alice", password="apw", single_connection_client=True)
        kept = bytes(range(256)) * (128 * 1024)  # 32 MiB
        alice.set("kept", kept)
        # mallory announces payloads she never sends: 3 x 80 MiB; her first is allowed (alone, as any
        # value that fits), the others are past her 64 MiB cap; the first times out in 4 s
        stalled = []
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", q.port), timeout=30)
            s.sendall(cmd("AUTH", "mallory", "mpw"))
            assert read_lines(s, 1) == b"+OK\r\n"
            s.sendall(b"*3\r\n$3\r\nSET\r\n$4\r\nhold\r\n$%d\r\n" % (80 * MiB))
            stalled.append(s)
        # alice's value was not evicted for them, and alice can still write a large value
        assert wait_until(lambda: alice.info("stats").get("unfilled_refused", 0) >= 2, timeout=15)
        assert alice.info("tiers")["dram_unfilled_bytes"] == 80 * MiB
        assert alice.get("kept") == kept  # 80 MiB reserved did not need to evict it
        # alice's 64 MiB goes through at once: a tenant's first reservation never waits for another's.
        # Waiting would mean waiting for mallory's payload to time out (4 s): none times out meanwhile.
        timeouts = alice.info("stats")["payload_timeouts"]
        assert alice.set("more", b"m" * (64 * MiB)) is True
        assert alice.info("stats")["payload_timeouts"] == timeouts
        assert alice.get("kept") == kept
        # mallory's other headers, waiting meanwhile, take her turn one at a time and are cut off too
        # (wait for the three cuts, the events: between one cut and the next header's turn nothing is
        # reserved for a moment, so "nothing reserved" alone came true after one cut on a loaded machine)
        assert wait_until(lambda: alice.info("stats")["payload_timeouts"] == 3, timeout=60)
        assert wait_until(lambda: alice.info("tiers")["dram_unfilled_bytes"] == 0, timeout=30)
        for s in stalled:
            s.settimeout(5)
            assert s.recv(100) == b""  # closed by the server
            s.close()
        # within the cap a payload is accepted and completes normally
        mallory = q.client(username="mallory", password="mpw", single_connection_client=True)
        assert mallory.set("fine", b"f" * (16 * MiB)) is True
        assert mallory.strlen("fine") == 16 * MiB
    finally:
        stop_process(q.proc)


def test_a_stalled_payload_is_cut_off_and_its_space_freed(users):
    tmp, path = users
    q = _start(tmp, path, "--dram", "256MiB", QUILLD_SERVER_PAYLOAD_TIMEOUT_MS="600")
    try:
        alice = q.client(username="alice", password="apw", single_connection_client=True)
        s = socket.create_connection(("127.0.0.1", q.port), timeout=30)
        s.sendall(cmd("AUTH", "mallory", "mpw"))
        assert read_lines(s, 1) == b"+OK\r\n"
        s.sendall(b"*3\r\n$3\r\nSET\r\n$4\r\nhold\r\n$%d\r\n" % (40 * MiB) + b"x" * MiB)  # then nothing
        assert wait_until(lambda: alice.info("tiers")["dram_unfilled_bytes"] > 0, timeout=10)
        # a slow sender that keeps sending is not cut off
        slow = socket.create_connection(("127.0.0.1", q.port), timeout=30)
        slow.sendall(cmd("AUTH", "alice", "apw"))
        assert read_lines(slow, 1) == b"+OK\r\n"
        slow.sendall(b"*3\r\n$3\r\nSET\r\n$4\r\nslow\r\n$%d\r\n" % (20 * 64 * 1024))
        for _ in range(20):
            slow.sendall(b"s" * 64 * 1024)
            time.sleep(0.1)  # 2 s in all, each gap well under the 0.6 s timeout
        slow.sendall(b"\r\n")
        assert read_lines(slow, 1) == b"+OK\r\n"
        slow.close()
        # the stalled one was closed and its 40 MiB given back
        s.settimeout(10)
        assert s.recv(100) == b""
        assert wait_until(lambda: alice.info("tiers")["dram_unfilled_bytes"] == 0, timeout=10)
        assert alice.info("stats")["payload_timeouts"] == 1
        assert alice.strlen("slow") == 20 * 64 * 1024 and alice.exists("hold") == 0
    finally:
        stop_process(q.proc)
