"""The shared-memory path's perimeter (issue 19, items 5 and 15), with real client processes.

- Item 15: a map user handed the arena's descriptor could `ftruncate` it, and quilld died of
  SIGBUS at its next read of a block. Both memory files are now sealed against resizing, and the
  lease table's descriptor is read-only (and sealed against new writers): a client process that
  attaches and tries everything fails at each step, and quilld keeps serving.
- Item 5: one map user's 16 connections took all 65,536 lease slots; every other user got `-BUSY`
  and quillclient raised it. Each user now holds at most its share of the table, and quillclient
  reads over TCP what it cannot lease.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import redis

from conftest import ROOT, cmd, read_lines, start_quilld, stop_process, wait_until
from quillclient import QuillClient

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
CLIENT_ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'clients' / 'python'}:{ROOT / 'wire'}"}


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="qp", dir="/tmp")  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


ATTACKER = textwrap.dedent(r"""
    import ctypes, errno, fcntl, json, mmap, os, sys
    import numpy as np
    from quillclient import QuillClient
    from quillwire.encode import pack_command
    c = QuillClient("127.0.0.1", int(sys.argv[1]), shared_memory="require")
    conn = c._shm_pool().acquire()
    # the descriptors SHM ATTACH handed over, as this process holds them (the client closed its copies
    # once mapped): ask for them again on the same connection
    conn.send(pack_command("SHM", "ATTACH"))
    reply, fds = conn._reply_with_fds()
    arena, leases = fds
    size = os.fstat(arena).st_size
    out = {"arena_size": size, "lease_size": os.fstat(leases).st_size}

    def attempt(name, f):
        try:
            f()
            out[name] = "done"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno, str(e.errno))

    PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    libc = ctypes.CDLL(None, use_errno=True)

    def punch(fd, off, n):
        if libc.fallocate(fd, PUNCH, ctypes.c_long(off), ctypes.c_long(n)):
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    attempt("arena_shrink", lambda: os.ftruncate(arena, 4096))
    attempt("arena_zero", lambda: os.ftruncate(arena, 0))
    attempt("arena_grow", lambda: os.ftruncate(arena, size * 2))
    attempt("arena_fallocate_past_end", lambda: os.posix_fallocate(arena, size, 1 << 20))
    attempt("arena_seal_write", lambda: fcntl.fcntl(arena, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
    attempt("arena_seal_future_write", lambda: fcntl.fcntl(arena, fcntl.F_ADD_SEALS, 0x10))
    reopened = os.open(f"/proc/self/fd/{arena}", os.O_RDWR)
    attempt("arena_reopened_shrink", lambda: os.ftruncate(reopened, 0))
    attempt("lease_shrink", lambda: os.ftruncate(leases, 0))
    attempt("lease_map_writable", lambda: mmap.mmap(leases, 4096, flags=mmap.MAP_SHARED))
    lease_rw = os.open(f"/proc/self/fd/{leases}", os.O_RDWR)
    attempt("lease_reopened_shrink", lambda: os.ftruncate(lease_rw, 0))
    attempt("lease_reopened_write", lambda: os.pwrite(lease_rw, b"\xff" * 8, 0))
    attempt("lease_reopened_map_writable", lambda: mmap.mmap(lease_rw, 4096, flags=mmap.MAP_SHARED))
    ro = mmap.mmap(leases, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    ro_addr = np.frombuffer(ro, np.uint8).__array_interface__["data"][0]

    def mprotect(addr, n, prot):
        if libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(n), prot):
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    attempt("lease_mprotect_writable", lambda: mprotect(ro_addr, 4096, mmap.PROT_READ | mmap.PROT_WRITE))
    # what a mapping user may still do: punch a hole (pages read back as zeros), survived by quilld
    attempt("arena_punch_hole", lambda: punch(arena, size - (1 << 20), 1 << 20))
    print(json.dumps(out), flush=True)
    ctypes.memmove(ro_addr, b"x", 1)  # a write through the read-only mapping: this process dies (SIGSEGV)
""")


def test_a_client_cannot_resize_the_memory_it_maps_and_quilld_keeps_serving(tmp_path, sock_dir):
    path = os.path.join(sock_dir, "q.sock")
    q = start_quilld(tmp_path, "--unixsocket", path, "--dram", "64MiB", "--map-users", "default", admin=False)
    try:
        assert wait_until(lambda: os.path.exists(path), timeout=10)
        r = redis.Redis(port=q.port)
        values = {f"k{i}": os.urandom(1 * MiB + i) for i in range(8)}
        for k, v in values.items():
            r.set(k, v)
        child = subprocess.run([sys.executable, "-c", ATTACKER, str(q.port)], capture_output=True, env=CLIENT_ENV,
                               timeout=60)
        lines = child.stdout.decode().strip().splitlines()
        assert child.returncode != 0 or lines, child.stderr.decode()[-2000:]
        # a write through the read-only mapping kills the client itself (SIGSEGV), never quilld
        assert child.returncode == -11, (child.returncode, child.stderr.decode()[-2000:])
        out = json.loads(lines[-1]) if lines else {}
        assert out["arena_size"] == 64 * MiB and out["lease_size"] == 65536 * 8
        for what in ("arena_shrink", "arena_zero", "arena_grow", "arena_fallocate_past_end", "arena_seal_write",
                     "arena_seal_future_write", "arena_reopened_shrink", "lease_reopened_shrink",
                     "lease_reopened_write", "lease_reopened_map_writable"):
            assert out[what] == "EPERM", (what, out)
        assert out["lease_shrink"] == "EINVAL"  # its descriptor is read-only
        assert out["lease_map_writable"] == out["lease_mprotect_writable"] == "EACCES"
        assert out["arena_punch_hole"] == "done"  # allowed: the pages read back as zeros, quilld goes on
        # quilld is alive and every block reads back whole (over TCP: quilld's own reads of the arena)
        assert q.proc.poll() is None, q.log()[-3000:]
        for k, v in values.items():
            assert r.get(k) == v
        assert r.set("after", b"a" * (2 * MiB)) and r.get("after") == b"a" * (2 * MiB)
        with QuillClient("127.0.0.1", q.port, shared_memory="require") as c:
            buf = bytearray(2 * MiB)
            assert c.get_into("k3", buf) == len(values["k3"]) and bytes(buf[:len(values["k3"])]) == values["k3"]
        assert "Traceback" not in q.log()
    finally:
        stop_process(q.proc)


def test_a_named_arena_file_is_never_mapped_out(tmp_path):
    """A named memory file cannot be sealed: quilld refuses to hand it to map users at all."""
    from conftest import run_quilld

    proc = run_quilld("--port", "0", "--admin-port", "0", "--map-users", "default",
                      env={"QUILLD_DRAM_MEMORY_FILE": f"/dev/shm/quilld-test-{os.getpid()}"})
    assert proc.returncode == 2 and "dram.memory_file cannot be shared with security.map_users" in proc.stderr


def _hold(path: str, user: str, password: str, key: str, leases: int) -> tuple[socket.socket, int]:
    """A raw unix connection of `user` that takes `leases` leases on `key` and never releases them;
    (the socket, how many it got before -BUSY)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    s.sendall(cmd("AUTH", user, password))
    assert read_lines(s, 1) == b"+OK\r\n"
    got = 0
    while got < leases:
        n = min(64, leases - got)
        s.sendall(cmd("SHM", "GET", *[key] * n))
        head = s.recv(64, socket.MSG_PEEK)
        if head.startswith(b"-BUSY"):
            s.recv(4096)
            break
        reply = read_lines(s, 1 + 6 * n)
        assert reply.startswith(b"*%d\r\n" % n), reply[:100]
        got += n
    return s, got


@pytest.mark.parametrize("table", [False, True], ids=["leases", "lookup-table"])
def test_one_user_cannot_take_the_lease_table_and_a_busy_client_reads_over_tcp(tmp_path, sock_dir, table):
    """With the lookup table (the default) a mapped client needs no lease at all: alice's own reads
    go through it even while her raw connections hold her whole share of the lease table."""
    users = tmp_path / "users"
    users.write_text("alice apw\nbob bpw\n")
    path = os.path.join(sock_dir, "q.sock")
    q = start_quilld(tmp_path, "--unixsocket", path, "--dram", "64MiB", "--users-file", str(users),
                     "--map-users", "alice,bob", admin=False,
                     env={"QUILLD_SERVER_SHM_LEASE_MS": "600000",  # held until the test lets go
                          "QUILLD_SERVER_SHM_LOOKUP_SLOTS": "0" if table else "-1"})
    socks = []
    try:
        assert wait_until(lambda: os.path.exists(path), timeout=10)
        alice_r = redis.Redis(port=q.port, username="alice", password="apw")
        bob_r = redis.Redis(port=q.port, username="bob", password="bpw")
        alice_r.set("a", b"A" * 65536)
        blocks = {f"b{i}": os.urandom(65536 + i) for i in range(8)}
        for k, v in blocks.items():
            bob_r.set(k, v)
        # alice's 16 connections each ask for 4096 leases (server.shm_max_leases): 65,536 in all
        held = 0
        for _ in range(16):
            s, got = _hold(path, "alice", "apw", "a", 4096)
            socks.append(s)
            held += got
        info = bob_r.info("shm")
        print(f"\nalice's 16 connections hold {held} of {info['shm_lease_slots']} lease slots "
              f"(her share: {info['shm_lease_slots_per_user']})")
        assert held == info["shm_lease_slots_per_user"] == 32768  # half the table: two map users
        assert info["shm_leases_refused_user"] >= 1
        # bob reads through shared memory as if alice were not there
        with QuillClient("127.0.0.1", q.port, username="bob", password="bpw", shared_memory="require") as bob:
            bufs = [np.zeros(70000, np.uint8) for _ in blocks]
            assert bob.get_many_into(list(blocks), bufs) == [len(v) for v in blocks.values()]
            assert all(bytes(b[:len(v)]) == v for b, v in zip(bufs, blocks.values()))
            assert bob.shm_busy_rereads == 0 and bob.transport == "shm"
        # alice's own client finds no lease to be had: it reads over TCP instead of raising -BUSY
        with QuillClient("127.0.0.1", q.port, username="alice", password="apw", shared_memory="require") as alice:
            buf = bytearray(65536)
            assert alice.get_into("a", buf) == 65536 and bytes(buf) == b"A" * 65536
            assert alice.get_many_into(["a", "missing"], [bytearray(65536), bytearray(10)]) == [65536, -1]
            assert alice.shm_busy_rereads == (0 if table else 3) and alice.transport == "shm"
            assert alice.shm_direct_reads == (1 if table else 0)  # the first read put "a" in the table
        for s in socks:
            s.close()
        assert wait_until(lambda: bob_r.info("shm")["shm_leases_live"] == 0, timeout=20)
        assert q.proc.poll() is None
    finally:
        for s in socks:
            s.close()
        stop_process(q.proc)
