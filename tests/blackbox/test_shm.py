"""The shared-memory path, end to end: a real quilld with a unix socket, real quillclient clients.

What a same-host user observes: blocks of any size read and written through the mapping come
back byte-identical (and agree with TCP); a lease that ends while a client copies is detected,
never served as good data; a user not allowed to map is refused with a clear error and served
over TCP; a client killed while holding leases frees them; a quilld killed under a mapped client
fails the client's next call fast and leaves the SSD tier intact; identities never see each
other's blocks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
import redis

from conftest import ROOT, ssd_node, start_quilld, tiers_of, wait_until
from quillclient import NotFound, QuillClient, QuillConnectionError, QuillError, lookup, shm

MiB = 1 << 20


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="qs", dir="/tmp")  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _node(tmp_path, sock_dir, nodes, *extra, env=None):
    path = os.path.join(sock_dir, "q.sock")
    q = start_quilld(tmp_path, "--unixsocket", path, *extra, env=env, admin=False)
    nodes.append(q)
    assert wait_until(lambda: os.path.exists(path), timeout=10)
    return q, path


def _info(q, **kw) -> dict:
    return redis.Redis(port=q.port, **kw).info("shm")


SIZES = [0, 1, 4095, 4096, 4097, 1 * MiB, 64 * MiB]


NO_TABLE = {"QUILLD_SERVER_SHM_LOOKUP_SLOTS": "-1"}  # every read asks quilld: SHM GET, leases


@pytest.mark.parametrize("table", [True, False], ids=["lookup-table", "leases"])
def test_reads_and_writes_of_every_size_are_byte_identical(tmp_path, sock_dir, nodes, table):
    q, path = _node(tmp_path, sock_dir, nodes, "--dram", "256MiB", "--map-users", "default",
                    env=None if table else NO_TABLE)
    rng = np.random.default_rng(15)
    data = {f"k{n}": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES}
    with QuillClient("127.0.0.1", q.port, shared_memory="require", verify_crc=True) as c, \
            QuillClient("127.0.0.1", q.port, shared_memory="off") as tcp:
        assert c.transport == "shm" and c.shm_unavailable_reason == ""
        assert tcp.transport == "tcp"
        assert c.put_blocks(data) == [True] * len(data)
        for key, value in data.items():
            buf = bytearray(len(value) + 3)
            assert c.get_into(key, buf) == len(value)
            assert bytes(buf[:len(value)]) == value, key
            assert tcp.get(key) == value, f"{key}: what was written in place reads the same over TCP"
        bufs = [np.zeros(len(v), np.uint8) for v in data.values()]
        assert c.get_many_into(list(data), bufs) == [len(v) for v in data.values()]
        assert all(b.tobytes() == v for b, v in zip(bufs, data.values()))
        # written over TCP (SET: inline and arena values), read through the mapping
        tcp.put("small", b"inline value")
        tcp.put("big", data["k4097"][::-1])
        buf = bytearray(8192)
        assert c.get_into("small", buf) == 12 and bytes(buf[:12]) == b"inline value"
        assert c.get_into("big", buf) == 4097 and bytes(buf[:4097]) == data["k4097"][::-1]
        with pytest.raises(NotFound):
            c.get_into("missing", buf)
        assert c.shm_stale_reads == 0 and c.shm_crc_rereads == 0
        if table:  # every block found in the table (SET's once SHM GET put it there): no lease at all
            assert c.shm_direct_reads == 2 * 3 and _info(q)["shm_leases_granted"] == 0  # 3 blocks, 4 inline
        else:
            assert c.shm_direct_reads == 0 and _info(q)["shm_leases_granted"] >= 6
    assert wait_until(lambda: _info(q)["shm_leases_live"] == 0, timeout=10)  # all released, or dropped at close


def test_a_lease_that_ends_while_the_client_copies_is_detected(tmp_path, sock_dir, nodes, monkeypatch):
    q, path = _node(tmp_path, sock_dir, nodes, "--dram", "64MiB", "--map-users", "default",
                    env={"QUILLD_SERVER_SHM_LEASE_MS": "200", **NO_TABLE})
    r = redis.Redis(port=q.port)
    n = 1 * MiB
    v1, v2, v3 = (bytes([x]) * n for x in (1, 2, 3))
    r.set("k", v1)
    offsets: list[int] = []
    copy = shm._copy

    def slow_copy(conn, key, item, view, verify):
        """A reader preempted between SHM GET's reply and its copy, for longer than the lease."""
        if type(item) is list:
            offsets.append(item[0])
            r.set("k", v2)  # the leased block is unlinked (still pinned) ...
            assert wait_until(lambda: r.info("shm")["shm_leases_expired"] >= 1, timeout=10)  # ... then freed
            r.set("filler", v3)  # and reused by another value of the same size
            reused = redis.Redis(unix_socket_path=path).execute_command("SHM", "GET", "filler")[0]
            offsets.append(reused[0])
        return copy(conn, key, item, view, verify)

    monkeypatch.setattr(shm, "_copy", slow_copy)
    with QuillClient("127.0.0.1", q.port, shared_memory="require") as c:
        buf = bytearray(n)
        got = c.get_into("k", buf)
        assert offsets[0] == offsets[1], "the test must make quilld reuse the leased block"
        assert got == n and bytes(buf) == v2, "the copy of a reused block was not served: k read again"
        assert c.shm_stale_reads == 1


@pytest.mark.parametrize("table", [True, False], ids=["lookup-table", "leases"])
@pytest.mark.parametrize("machine", ["aarch64", "x86_64"])
def test_where_loads_may_be_reordered_each_copy_is_checked_by_default(tmp_path, sock_dir, nodes, monkeypatch,
                                                                      machine, table):
    """On a CPU without TSO a copy may take bytes of the block's next owner and still see the
    generation its lease had (or its table entry's seq): only the CRC32C catches it, so it is
    checked there by default."""
    import platform
    monkeypatch.setattr(platform, "machine", lambda: machine)
    q, _ = _node(tmp_path, sock_dir, nodes, "--dram", "64MiB", "--map-users", "default",
                 env=None if table else NO_TABLE)
    value = bytes(range(256)) * 4096
    with QuillClient("127.0.0.1", q.port, shared_memory="require") as c:
        assert c.put_blocks({"k": value}) == [True]  # with its CRC32C: in the lookup table at once

        class Reordered:
            """The arena as a copy with reordered loads sees it: its end holds bytes the check of a
            generation (or of an entry's seq) cannot see."""

            def __init__(self, arena):
                self.arena = arena

            def __getitem__(self, where):
                got = bytearray(self.arena[where])
                if len(got) == len(value):
                    got[-1] ^= 0xFF
                return got

        mapping = c._shm_pool().mappings.current
        mapping.arena = Reordered(mapping.arena)  # read through by leases (shm._copy)
        if mapping.lookup is not None:  # and by the lookup table's reader
            mapping.lookup.arena = Reordered(mapping.lookup.arena)
        assert c.config.verify_crc is (machine == "aarch64")
        buf = bytearray(len(value))
        assert c.get_into("k", buf) == len(value)
        if machine == "aarch64":
            assert bytes(buf) == value, "the damaged copies were thrown away, the block read over TCP at last"
            if table:  # thrown away TRIES times, TRIES more once SHM GET named its entry, then TCP
                assert c.shm_direct_retries == 2 * lookup.TRIES and c.shm_direct_reads == 0
            else:
                assert c.shm_crc_rereads == 1
        else:  # x86-64 keeps loads in order: such a copy cannot happen there, and nothing checks for it
            assert bytes(buf) != value and c.shm_crc_rereads == 0 and c.shm_direct_retries == 0
            assert c.shm_direct_reads == (1 if table else 0)


def test_a_release_never_costs_a_message_of_its_own(tmp_path, sock_dir, nodes, monkeypatch):
    """Reads that still take leases (no lookup table here) release them with the connection's next
    command, in the same send: a 4 MiB read is one message to quilld, not two."""
    q, _ = _node(tmp_path, sock_dir, nodes, "--dram", "64MiB", "--map-users", "default", env=NO_TABLE)
    r = redis.Redis(port=q.port)
    for i in range(4):
        r.set(f"b{i}", bytes([i]) * (4 * MiB))
    sends = []
    real = shm.ShmConnection.send
    monkeypatch.setattr(shm.ShmConnection, "send", lambda conn, pieces: (sends.append(1), real(conn, pieces)))
    with QuillClient("127.0.0.1", q.port, shared_memory="require") as c:
        buf = bytearray(4 * MiB)
        c.get_into("b0", buf)  # the client's first call: its connection attached (its sends counted too)
        sends.clear()
        for i in range(1, 4):
            assert c.get_into(f"b{i}", buf) == 4 * MiB and buf[-1] == i
        assert len(sends) == 3, "one send a read: its SHM GET, behind the release of the read before"
        assert r.info("shm")["shm_leases_live"] == 1 and r.info("commandstats")["cmdstat_shm|release"]["calls"] == 3


def test_a_user_who_may_not_map_is_refused_and_served_over_tcp(tmp_path, sock_dir, nodes):
    users = tmp_path / "users"
    users.write_text("alice a-pass\nbob b-pass\n")
    q, path = _node(tmp_path, sock_dir, nodes, "--users-file", str(users), "--map-users", "alice")
    with QuillClient("127.0.0.1", q.port, username="bob", password="b-pass") as bob:
        bob.put_blocks({"blk": b"x" * 10000})
        buf = bytearray(10000)
        assert bob.get_into("blk", buf) == 10000 and bytes(buf) == b"x" * 10000
        assert bob.transport == "tcp"
        assert bob.shm_unavailable_reason == "user 'bob' may not map the arena (security.map_users)"
    with pytest.raises(QuillError, match="may not map"):
        QuillClient("127.0.0.1", q.port, username="bob", password="b-pass", shared_memory="require").transport
    raw = redis.Redis(unix_socket_path=path, username="bob", password="b-pass")
    with pytest.raises(redis.exceptions.NoPermissionError) as e:  # -NOPERM user 'bob' ...
        raw.execute_command("SHM", "ATTACH")
    assert str(e.value) == "user 'bob' may not map the arena (security.map_users)"
    with pytest.raises(redis.exceptions.NoPermissionError):
        raw.execute_command("SHM", "GET", "blk")
    tcp_alice = redis.Redis(port=q.port, username="alice", password="a-pass")
    with pytest.raises(redis.ResponseError,
                       match=r"SHM ATTACH needs a connection over the unix socket \(server.unixsocket\)"):
        tcp_alice.execute_command("SHM", "ATTACH")
    with QuillClient("127.0.0.1", q.port, username="alice", password="a-pass") as alice:
        assert alice.transport == "shm"
    info = _info(q, username="alice", password="a-pass")
    assert info["shm_attaches_refused"] >= 2 and info["shm_attaches"] >= 1


HOLDER = textwrap.dedent("""
    import sys, time
    from quillclient import shm, QuillClient
    c = QuillClient("127.0.0.1", int(sys.argv[1]), shared_memory="require")
    pool = c._shm_pool()
    conn = pool.acquire()
    items = conn.command(shm.pack_command("SHM", "GET", "held"))
    print("leased", items[0][3], flush=True)
    time.sleep(60)
""")


def test_a_client_killed_while_holding_leases_frees_them(tmp_path, sock_dir, nodes):
    q, path = _node(tmp_path, sock_dir, nodes, "--dram", "8MiB", "--map-users", "default",
                    env={"QUILLD_SERVER_SHM_LEASE_MS": "600000", **NO_TABLE})  # only its end can free it
    r = redis.Redis(port=q.port)
    r.set("held", b"h" * (6 * MiB))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'clients' / 'python'}:{ROOT / 'wire'}"}
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(q.port)], stdout=subprocess.PIPE, env=env)
    try:
        line = child.stdout.readline()
        assert line.startswith(b"leased"), line
        assert r.info("shm")["shm_leases_live"] == 1
        assert r.delete("held") == 1  # unlinked, but its space stays pinned by the child's lease
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_until(lambda: r.info("shm")["shm_leases_live"] == 0, timeout=10)
        assert r.info("shm")["shm_leases_dropped"] == 1
        assert r.set("next", b"n" * (6 * MiB)), "the freed block's space is reused"
        assert r.get("next") == b"n" * (6 * MiB)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_quilld_killed_under_a_mapped_client_fails_fast_and_the_ssd_tier_is_intact(tmp_path, sock_dir, nodes):
    path = os.path.join(sock_dir, "q.sock")
    ssd_dir = tmp_path / "ssd"
    env = {"QUILLD_SERVER_UNIXSOCKET": path, "QUILLD_SECURITY_MAP_USERS": "default"}
    q = ssd_node(tmp_path, ssd_dir, **env)
    nodes.append(q)
    rng = np.random.default_rng(9)
    data = {f"b{i}": rng.integers(0, 256, 1 * MiB, dtype=np.uint8).tobytes() for i in range(20)}
    c = QuillClient("127.0.0.1", q.port, shared_memory="require", socket_timeout=5, retries=0)
    try:
        assert c.put_blocks(data) == [True] * len(data)  # 20 MiB through an 8 MiB arena: most go to SSD
        r = redis.Redis(port=q.port)
        assert wait_until(lambda: sum("ssd" in tiers_of(r, k) for k in data) >= 10, timeout=20)
        on_ssd = [k for k in data if "ssd" in tiers_of(r, k)]
        buf = bytearray(1 * MiB)
        assert c.get_into(on_ssd[0], buf) == MiB and bytes(buf) == data[on_ssd[0]]  # brought back, then leased
        q.proc.send_signal(signal.SIGKILL)
        q.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(QuillConnectionError):
            c.get_into(on_ssd[0], buf)
        assert time.monotonic() - t0 < 5, "the client's call failed fast, it did not hang"
        q2 = ssd_node(tmp_path, ssd_dir, **env)  # the killed node's socket file is replaced
        nodes.append(q2)
        with QuillClient("127.0.0.1", q2.port, shared_memory="require") as fresh:
            for key in on_ssd:
                assert fresh.get_into(key, buf) == MiB and bytes(buf) == data[key], key
        c.close()
        c = QuillClient("127.0.0.1", q2.port, shared_memory="require")
        assert c.get_into(on_ssd[-1], buf) == MiB and bytes(buf) == data[on_ssd[-1]]
    finally:
        c.close()


def test_a_lease_never_hands_out_another_identitys_block(tmp_path, sock_dir, nodes):
    q, path = _node(tmp_path, sock_dir, nodes, "--map-users", "default")
    a = QuillClient("127.0.0.1", q.port, scope=("model-a", "tok"), shared_memory="require")
    b = QuillClient("127.0.0.1", q.port, scope=("model-b", "tok"), shared_memory="require")
    try:
        a.put_blocks({"same-key": b"A" * 50000})
        buf = bytearray(50000)
        with pytest.raises(NotFound):
            b.get_into("same-key", buf)
        b.put_blocks({"same-key": b"B" * 50000})
        assert a.get_into("same-key", buf) == 50000 and bytes(buf) == b"A" * 50000
        assert b.get_into("same-key", buf) == 50000 and bytes(buf) == b"B" * 50000
        ra = redis.Redis(unix_socket_path=path)
        rb = redis.Redis(unix_socket_path=path)
        ra.execute_command("SCOPE", "model-a", "tok")
        rb.execute_command("SCOPE", "model-b", "tok")
        la, lb = ra.execute_command("SHM", "GET", "same-key")[0], rb.execute_command("SHM", "GET", "same-key")[0]
        assert la[0] != lb[0], "each identity's lease points at its own block"
        assert redis.Redis(unix_socket_path=path).execute_command("SHM", "GET", "same-key") == [None]
    finally:
        a.close()
        b.close()


def test_in_place_puts_need_their_crc_and_take_no_data(tmp_path, sock_dir, nodes):
    q, path = _node(tmp_path, sock_dir, nodes, "--map-users", "default")
    r = redis.Redis(unix_socket_path=path)
    handle, offset = r.execute_command("PUT2PHASE", "BEGIN", "p", 10000, "SHM")
    assert offset % 4096 == 0
    with pytest.raises(redis.ResponseError, match="takes no DATA"):
        r.execute_command("PUT2PHASE", "DATA", handle, 0, b"x" * 10)
    with pytest.raises(redis.ResponseError, match="needs COMMIT handle CRC32C"):
        r.execute_command("PUT2PHASE", "COMMIT", handle)
    with pytest.raises(redis.ResponseError, match="CHECKSUM|crc32c is"):
        r.execute_command("PUT2PHASE", "COMMIT", handle, "CRC32C", 12345)
    assert r.get("p") is None, "nothing is visible before a good COMMIT"
    with pytest.raises(redis.ResponseError, match="unix socket"):
        redis.Redis(port=q.port).execute_command("PUT2PHASE", "BEGIN", "p2", 10, "SHM")


def test_the_unix_socket_listens_as_redis_does(tmp_path, sock_dir, nodes):
    q, path = _node(tmp_path, sock_dir, nodes, "--unixsocketperm", "770")
    assert os.stat(path).st_mode & 0o777 == 0o770
    r = redis.Redis(unix_socket_path=path)
    assert r.config_get("unixsocket*") == {"unixsocket": path, "unixsocketperm": "770"}
    assert r.client_list()[0]["addr"] == f"{path}:0"
    assert r.info("shm")["shm_enabled"] == 1
    with pytest.raises(redis.exceptions.NoPermissionError, match="security.map_users"):
        r.execute_command("SHM", "ATTACH")  # nobody may map by default
    other = tmp_path / "second"
    other.mkdir()
    with pytest.raises(RuntimeError, match=r"cannot open .*q.sock: another process is listening on it"):
        start_quilld(other, "--unixsocket", path, admin=False)
    q.stop()
    assert not os.path.exists(path), "removed at stop"
