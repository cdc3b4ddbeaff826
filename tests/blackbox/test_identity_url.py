"""Issue 14, item 1: an identity scope that survives connection pools and reconnects.

A client configured by a URL alone (redis-py's pools, LMCache, redis-cli -u) must land in
its scope on every connection: the scope comes with the login (a user bound to a scope in
the users file, or `user~model~tokenizer[~adapter]` as the user name), which every new
connection repeats. Reconnects are forced for real: the clients talk through a TCP relay
that the test cuts (the client sees its server close the connection), and pools are
disconnected under load.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import redis

from conftest import raw_exchange, require_tool
from doc_blocks import doc_block

IO_TIMEOUT = 10.0
LOAD_DEADLINE = 120.0  # seconds a loaded machine may take to reach MIN_READS and MIN_CUTS (a bound, not a duration)
MIN_READS = 8  # reads each pool makes while connections are cut
MIN_CUTS = 4  # cuts that found connections to close
CUT_EVERY = 0.25  # seconds between two cuts

pytestmark = pytest.mark.timeout(180)


class Relay:
    """A TCP relay to quilld whose connections the test can cut, as a server or network would."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0
        self.closed = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=IO_TIMEOUT)
            except OSError:  # quilld is gone (the test is ending): the client sees a closed connection
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            with self.lock:
                self.pairs.append((client, server))
                self.accepted += 1
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> int:
        """Close every relayed connection, both ways; how many there were."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        return len(pairs)

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def relay_to():
    relays: list[Relay] = []

    def make(port: int) -> Relay:
        relays.append(Relay(port))
        return relays[-1]

    yield make
    for r in relays:
        r.close()


def readme_block(marker: str) -> str:
    """The block marked `<!-- marker -->`: the README's tour, or the docs page it moved to."""
    return doc_block(marker)[1]


def node_with_users(quilld_factory, tmp_path, users: str, *flags: str, env: dict | None = None):
    path = tmp_path / "users"
    path.write_text(users)
    return quilld_factory("--dram", "128MiB", "--users-file", str(path), *flags, env=env)


USERS = "alice s3cret model=llama tokenizer=tok\nbob hunter2\n"


def under_load(pools: dict[str, tuple[redis.ConnectionPool, bytes]], relay: Relay, threads_per_pool: int = 8):
    """Read `k` from every pool with `threads_per_pool` threads while the relay's connections are
    cut and the pools disconnected, until every pool has MIN_READS reads, MIN_CUTS cuts found
    connections to close and the pools reconnected more than three times a thread (events, not
    a time: a loaded machine only takes longer, up to LOAD_DEADLINE). Returns (reads per pool,
    values seen that were not the pool's own, errors)."""
    stop = threading.Event()
    reads: Counter[str] = Counter()
    wrong: list[tuple[str, bytes | None]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def reader(name: str, pool: redis.ConnectionPool, want: bytes) -> None:
        r = redis.Redis(connection_pool=pool)
        while not stop.is_set():
            try:
                got = r.get("k")
            except Exception as e:  # a cut that outlived redis-py's retries (or raced its pool): not a wrong answer
                with lock:
                    errors.append(f"{name}: {type(e).__name__}: {e}")
                continue
            with lock:
                reads[name] += 1
                if got != want:
                    wrong.append((name, got))

    def enough() -> bool:
        with lock:
            read = all(reads[name] >= MIN_READS for name in pools)
        return read and cuts >= MIN_CUTS and relay.accepted > 3 * threads_per_pool

    workers = [threading.Thread(target=reader, args=(name, pool, want))
               for name, (pool, want) in pools.items() for _ in range(threads_per_pool)]
    for w in workers:
        w.start()
    cuts, deadline = 0, time.monotonic() + LOAD_DEADLINE
    try:
        while not enough() and time.monotonic() < deadline:
            time.sleep(CUT_EVERY)
            found = relay.cut()
            cuts += found > 0
            if cuts % 3 == 0:
                for pool, _ in pools.values():
                    pool.disconnect()  # the client side restarts its pool, in-use connections too
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not any(w.is_alive() for w in workers), "a reader thread hung"
    assert cuts >= MIN_CUTS, "the relay never had connections to cut"
    return reads, wrong, errors


@pytest.mark.parametrize("protocol", [2, 3])
def test_pools_of_eight_threads_with_forced_reconnects_read_only_their_scope(quilld_factory, tmp_path, relay_to,
                                                                             protocol):
    q = node_with_users(quilld_factory, tmp_path, USERS)
    base = f"127.0.0.1:{q.port}"
    # the same key in four scopes of alice's
    values = {"bound": b"alice/llama/tok", "named": b"alice/mistral/mtok", "default": b"alice/default",
              "adapter": b"alice/llama/tok/sql"}
    writers = {"bound": "alice", "named": "alice~mistral~mtok", "default": "alice~~",
               "adapter": "alice~llama~tok~sql"}
    for scope, user in writers.items():
        assert redis.Redis.from_url(f"redis://{user}:s3cret@{base}").set("k", values[scope])
    relay = relay_to(q.port)
    pools = {scope: (redis.ConnectionPool.from_url(f"redis://{writers[scope]}:s3cret@127.0.0.1:{relay.port}",
                                                   protocol=protocol, socket_timeout=IO_TIMEOUT),
                     values[scope])
             for scope in ("bound", "named", "adapter")}
    reads, wrong, errors = under_load(pools, relay)
    assert not wrong, f"reads that landed in another scope: {Counter(wrong).most_common(5)}"
    for scope in pools:
        assert reads[scope] >= MIN_READS, (reads, errors[:5])
    assert relay.accepted > 3 * 8, "the pools never reconnected"
    assert len(errors) <= sum(reads.values()) // 4, errors[:5]


def test_the_readme_redis_py_example_keeps_its_scope_after_reconnects(quilld_factory, relay_to):
    """The issue's finding: after a reconnect the README's own example read the default scope."""
    q = quilld_factory("--dram", "256MiB")
    relay = relay_to(q.port)
    code = readme_block("example: redis-py").replace("7379", str(relay.port))
    ns: dict = {}
    exec(compile(code, "README.md (the tour's redis-py example)", "exec"), ns)
    llama, r = ns["llama"], ns["r"]
    own = llama.get("prefix:0")
    assert own is not None and own != ns["block"]
    for _ in range(3):
        assert relay.cut() >= 1
        assert llama.get("prefix:0") == own  # reconnected, and still in its scope
        assert r.get("prefix:0") == ns["block"]
    assert relay.accepted >= 4


def test_the_readme_identity_examples_run_as_written(quilld_factory, tmp_path):
    users = readme_block("identity-url: users")
    q = node_with_users(quilld_factory, tmp_path, users)
    code = readme_block("identity-url: redis-py").replace("7379", str(q.port))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    require_tool("redis-cli")
    line = readme_block("identity-url: redis-cli").strip().replace("7379", str(q.port))
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "llama's block", (out.stdout, out.stderr)
    # bob, a user of two words, logs in as before and sees none of alice's scopes
    bob = redis.Redis.from_url(f"redis://bob:hunter2@127.0.0.1:{q.port}")
    assert bob.get("prefix:0") is None and bob.client_info()["user"] == "bob"


def test_redis_cli_url_carries_the_scope(quilld_factory, tmp_path):
    cli = require_tool("redis-cli")
    q = node_with_users(quilld_factory, tmp_path, "alice s3cret model=meta-llama/Llama-3.1-8B tokenizer=llama3\n")

    def run(url: str, *cmd: str) -> str:
        out = subprocess.run([cli, "--no-auth-warning", "-u", url, *cmd], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    base = f"127.0.0.1:{q.port}"
    assert run(f"redis://alice~meta-llama%2FLlama-3.1-8B~llama3:s3cret@{base}", "SET", "k", "bound-scope") == "OK"
    assert run(f"redis://alice:s3cret@{base}", "GET", "k") == "bound-scope"  # the same scope, bound
    assert run(f"redis://alice~other~llama3:s3cret@{base}", "GET", "k") == ""  # another model
    assert run(f"redis://alice~other~llama3:s3cret@{base}", "SET", "k", "other") == "OK"
    assert run(f"redis://alice~other~llama3:s3cret@{base}", "GET", "k") == "other"
    assert run(f"redis://alice:s3cret@{base}", "GET", "k") == "bound-scope"
    assert "user=alice " in run(f"redis://alice~other~llama3:s3cret@{base}", "CLIENT", "INFO")  # the tenant


def test_without_passwords_the_default_user_names_a_scope(quilld_factory):
    cli = require_tool("redis-cli")
    q = quilld_factory("--dram", "64MiB")
    plain = q.client()
    plain.set("k", b"default scope")
    scoped = redis.Redis.from_url(f"redis://default~m~t@127.0.0.1:{q.port}", protocol=3)
    assert scoped.get("k") is None
    scoped.set("k", b"m/t")
    out = subprocess.run([cli, "-u", f"redis://default~m~t:@127.0.0.1:{q.port}", "GET", "k"],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "m/t", out.stderr
    assert plain.get("k") == b"default scope"
    with pytest.raises(redis.AuthenticationError):  # nobody but default exists without passwords
        redis.Redis.from_url(f"redis://alice~m~t@127.0.0.1:{q.port}").get("k")


def test_auth_and_hello_take_the_login_scope_and_malformed_names_are_refused_clearly(quilld_factory, tmp_path):
    q = node_with_users(quilld_factory, tmp_path, USERS)
    admin = redis.Redis.from_url(f"redis://alice~llama~tok:s3cret@127.0.0.1:{q.port}")
    admin.set("k", b"bound")
    # redis-py logs in with HELLO 3 AUTH alice s3cret, then CLIENT SETNAME
    r = q.client(protocol=3, username="alice", password="s3cret", client_name="w1", single_connection_client=True)
    assert r.get("k") == b"bound"  # alice's bound scope
    assert r.client_info()["name"] == "w1"
    r.execute_command("SCOPE", "other", "tok")
    assert r.get("k") is None  # SCOPE changes it for this connection
    r.execute_command("AUTH", "alice", "s3cret")
    assert r.get("k") == b"bound"  # logging in again takes the bound scope again
    r.execute_command("AUTH", "alice~other~tok", "s3cret")
    assert r.get("k") is None
    failures = r.info("stats")["auth_failures"]
    for bad in ("alice~llama", "alice~a~b~c~d", "alice~" + "m" * 300 + "~t"):
        with pytest.raises(redis.ResponseError, match="invalid scope in the user name"):
            r.execute_command("AUTH", bad, "s3cret")
    assert r.info("stats")["auth_failures"] == failures  # a syntax error, not a guess
    # a failed AUTH changes nothing (redis-py would reconnect after one: spoken raw)
    got = raw_exchange(q.port, b"AUTH alice~other~tok s3cret\r\nAUTH alice~llama~tok wrong\r\nGET k\r\n"
                               b"AUTH alice~llama~tok s3cret\r\nGET k\r\n")
    assert got == (b"+OK\r\n-WRONGPASS invalid username-password pair or user is disabled.\r\n$-1\r\n"
                   b"+OK\r\n$5\r\nbound\r\n"), got


def test_require_scope_refuses_data_commands_of_a_connection_without_one(quilld_factory, tmp_path, relay_to):
    q = node_with_users(quilld_factory, tmp_path, USERS, env={"QUILLD_SECURITY_REQUIRE_SCOPE": "true"})
    base = f"127.0.0.1:{q.port}"
    # bob has no bound scope: only PING, INFO, CLIENT... until it names one
    bob = redis.Redis.from_url(f"redis://bob:hunter2@{base}", socket_timeout=IO_TIMEOUT, single_connection_client=True)
    assert bob.ping()
    for call in (lambda: bob.get("k"), lambda: bob.set("k", b"v"), lambda: bob.exists("k"), lambda: bob.dbsize(),
                 lambda: bob.set("big", b"x" * 200_000),  # received into nothing, the connection kept
                 lambda: bob.execute_command("PUT2PHASE", "BEGIN", "blk", 10),
                 lambda: bob.execute_command("GETBLK", "k")):
        with pytest.raises(redis.ResponseError, match=r"^NOSCOPE this connection has no identity scope"):
            call()
    assert bob.info("server")["redis_version"] and bob.client_info()["user"] == "bob"
    bob.execute_command("SCOPE", "m", "t")
    assert bob.set("k", b"bob's m/t") and bob.get("k") == b"bob's m/t"
    # the explicit default scope, named in the user name, is a choice too
    explicit = redis.Redis.from_url(f"redis://bob~~:hunter2@{base}")
    assert explicit.set("k", b"bob's default")
    # alice is bound: nothing to send
    assert redis.Redis.from_url(f"redis://alice:s3cret@{base}").set("k", b"alice's")

    # the failure: SCOPE sent once on a pooled client, then a reconnect. With
    # require_scope the reconnected connection is refused; it never reads the default scope.
    relay = relay_to(q.port)
    pooled = redis.Redis.from_url(f"redis://bob:hunter2@127.0.0.1:{relay.port}", socket_timeout=IO_TIMEOUT)
    pooled.execute_command("SCOPE", "m", "t")
    assert pooled.get("k") == b"bob's m/t"
    assert relay.cut() >= 1
    with pytest.raises(redis.ResponseError, match="^NOSCOPE"):
        pooled.get("k")
    # and under 8 threads: each read is bob's m/t value or NOSCOPE, never another scope's
    pool = redis.ConnectionPool.from_url(f"redis://bob:hunter2@127.0.0.1:{relay.port}", socket_timeout=IO_TIMEOUT)
    redis.Redis(connection_pool=pool).execute_command("SCOPE", "m", "t")
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def reader() -> None:
        r = redis.Redis(connection_pool=pool)
        while not stop.is_set():
            try:
                got = r.get("k")
                outcome = "own" if got == b"bob's m/t" else f"WRONG {got!r}"
            except redis.ResponseError as e:
                outcome = "noscope" if str(e).startswith("NOSCOPE") else f"error {e}"
            except redis.ConnectionError:
                outcome = "cut"
            with lock:
                outcomes[outcome] += 1

    def seen(outcome: str) -> int:
        with lock:
            return outcomes[outcome]

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    cuts, deadline = 0, time.monotonic() + LOAD_DEADLINE
    try:  # until reconnected connections were refused after MIN_CUTS cuts (events, not a time)
        while (cuts < MIN_CUTS or not seen("noscope")) and time.monotonic() < deadline:
            time.sleep(CUT_EVERY)
            cuts += relay.cut() > 0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert set(outcomes) <= {"own", "noscope", "cut"}, outcomes
    assert cuts >= MIN_CUTS and outcomes["noscope"] > 0, (cuts, outcomes)


def test_require_scope_leaves_cluster_peers_working(tmp_path):
    from test_cluster import Cluster, holders, members, until

    cluster = Cluster(tmp_path)
    try:
        env = {"QUILLD_SECURITY_REQUIRE_SCOPE": "true"}
        cluster.start("a", **env)
        cluster.start("b", ["a"], **env)
        ports = {n: cluster.nodes[n].port for n in "ab"}
        on = {n: redis.Redis.from_url(f"redis://default~m~t@127.0.0.1:{ports[n]}", socket_timeout=20) for n in "ab"}
        until(lambda: members(on["b"]) == {"a": "alive", "b": "alive"}, 15, "two members")
        block = b"q" * 300_000
        on["a"].set("blk", block)
        until(lambda: "a" in holders(on["b"], "blk"), 10, "b to follow a's log (REPLOG as a peer)")
        assert on["b"].execute_command("GETBLK", "blk") == block  # PEERGET as a peer
        with pytest.raises(redis.ResponseError, match="^NOSCOPE"):
            cluster.client("b").execute_command("GETBLK", "blk")
    finally:
        cluster.stop_all()

