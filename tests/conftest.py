"""Shared fixtures: real quilld and redis-server processes on free loopback ports.

Every process is started on 127.0.0.1, waited for with a deadline, and
stopped by PID (SIGTERM, then SIGKILL after a bound) when the test ends.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import procs

# The hundreds of quilld processes the suite starts may cache their compiled modules (about
# 0.6 s of each start on these machines when PYTHONDONTWRITEBYTECODE forbids it).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The process helpers live in procs.py (no pytest there: the benches use them too).
from procs import (ADMIN_TOKEN, PORT_ATTEMPTS, PORT_RANGE, PURE_ENV, ROOT, START_TIMEOUT, STOP_TIMEOUT,  # noqa: E402,F401
                   PortTaken, Quilld, free_gossip_port, free_port, ignoring_sigint, listens, start_listening, start_quilld, stop_process,
                   wait_port, with_nofile)


def takes_o_direct(path: Path) -> bool:
    """Whether the file system under `path` takes O_DIRECT at open (tmpfs does from Linux 6.6);
    what the SSD tier's probe should find there."""
    probe = path / "probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False
    os.close(fd)
    os.unlink(probe)
    return True


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm (tmpfs), removed after the test."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    d = Path(tempfile.mkdtemp(prefix="quilld-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_quilld(*args: str, env: dict | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """quilld with `args` (and `env` over a QUILLD_-free environment) run to its exit, for the
    starts it refuses; its output captured as text. Fails the test if it does not exit in time."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_") or k == PURE_ENV}
    full.update(env or {}, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "quilld", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=full, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        out, err = proc.communicate()
        pytest.fail(f"quilld did not exit within {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ssd_node(tmp_path: Path, ssd_dir: Path, dram: str = "8MiB", ssd_size: str = "128MiB", **env) -> Quilld:
    """A quilld with a small DRAM arena over an SSD tier in `ssd_dir` (32 MiB segments)."""
    return start_quilld(tmp_path, "--dram", dram, "--ssd-dir", str(ssd_dir), "--ssd-size", ssd_size,
                        env={"QUILLD_SSD_SEGMENT_SIZE": "32MiB", **env})


def tiers_of(r, key) -> set[str]:
    """The tiers of this node LOCATE reports for `key` (RESP2 or RESP3)."""
    out = set()
    for place in r.execute_command("LOCATE", key)[0]:
        d = place if isinstance(place, dict) else dict(zip(place[::2], place[1::2]))
        out.add(d[b"tier"].decode())
    return out


def spill_to_ssd(r, values: dict, settled, timeout: float = 30) -> None:
    """SET every value of `values`, then wait until each key of `settled` is on SSD only (the
    demoter takes DRAM down to its low watermark, oldest first)."""
    for k, v in values.items():
        r.set(k, v)
    assert wait_until(lambda: all(tiers_of(r, k) == {"ssd"} for k in settled), timeout=timeout), \
        f"blocks were not demoted to SSD within {timeout} s"


@pytest.fixture
def quilld_factory(tmp_path):
    started: list[Quilld] = []

    def make(*extra: str, **kw) -> Quilld:
        q = start_quilld(tmp_path, *extra, **kw)
        started.append(q)
        return q

    yield make
    for q in started:
        stop_process(q.proc)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "shared_node: the module's tests get one quilld and one redis-server for "
                            "the whole module (emptied before each test) as `quilld` and `redis_server`")
    # .ci/run sets EXPECT_QUILLD_BUILD=compiled: the suite must run against the compiled hot path
    # (quilld/native.py), in this process and in every quilld it starts (same tree, same check)
    expected = os.environ.get("EXPECT_QUILLD_BUILD")
    if expected:
        import quilld.native

        if quilld.native.BUILD != expected:
            pytest.exit(f"EXPECT_QUILLD_BUILD={expected} but quilld's build here is {quilld.native.BUILD} "
                        f"({quilld.native.REASON})", returncode=3)


def pytest_report_header(config) -> str:
    import quilld.native

    return f"quilld build: {quilld.native.BUILD} ({quilld.native.REASON})"


@pytest.fixture
def quilld(request, quilld_factory) -> Quilld:
    """A fresh quilld with a 256 MiB arena; in a module marked `shared_node`, the module's one
    (see `shared_quilld`)."""
    if request.node.get_closest_marker("shared_node"):
        return request.getfixturevalue("shared_quilld")
    return quilld_factory("--dram", "256MiB")


@pytest.fixture(scope="module")
def module_quilld(tmp_path_factory):
    """One quilld (256 MiB arena) for a whole test module: see `shared_quilld`."""
    nodes = [start_quilld(tmp_path_factory.mktemp("quilld"), "--dram", "256MiB")]
    yield nodes
    for q in nodes:
        stop_process(q.proc)


@pytest.fixture
def shared_quilld(module_quilld, tmp_path_factory) -> Quilld:
    """The module's one quilld, as a fresh one looks to a test of the default scope: no keys
    (FLUSHALL), no command, error or latency statistics (CONFIG RESETSTAT). A module whose tests
    need no fresh process opts in with `pytestmark = pytest.mark.shared_node`; a test that stops,
    kills or reconfigures its node, or that counts what every connection adds up, uses
    `quilld_factory`. One that leaves it dead fails at teardown, and the next test gets a new one."""
    q = module_quilld[-1]
    if q.proc.poll() is not None:  # a test before this one failed at teardown for it
        q = start_quilld(tmp_path_factory.mktemp("quilld"), "--dram", "256MiB")
        module_quilld.append(q)
    with q.client() as r:
        r.flushall()
        r.config_resetstat()
    yield q
    assert q.proc.poll() is None, f"the module's shared quilld exited during this test:\n{q.log()[-3000:]}"


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    port, proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield port
    stop_process(proc)


@pytest.fixture
def shared_redis_server(module_redis) -> int:
    """A module's one redis-server, emptied (FLUSHALL) and its statistics reset for each test."""
    import redis

    with redis.Redis(port=module_redis, socket_timeout=30) as r:
        r.flushall()
        r.config_resetstat()
    return module_redis


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: .ci/run installs it (apt-get install redis-server redis-tools)")
    return path


def start_redis(tmp_path: Path, *extra: str, bind: tuple[str, ...] = ("127.0.0.1",)) -> tuple[int, subprocess.Popen]:
    """procs.start_redis, failing the test (not erroring) when redis-server is not installed."""
    return procs.start_redis(tmp_path, *extra, bind=bind, binary=require_tool("redis-server"))


@pytest.fixture
def redis_server(request, tmp_path):
    """A real redis-server on a free port, for byte-for-byte comparisons; in a module marked
    `shared_node`, the module's one, emptied for each test."""
    if request.node.get_closest_marker("shared_node"):
        yield request.getfixturevalue("shared_redis_server")
        return
    port, proc = start_redis(tmp_path)
    try:
        yield port
    finally:
        stop_process(proc)


def raw_exchange(port: int, payload: bytes, expect_close: bool = False, timeout: float = 5.0,
                 settle: float = 0.3) -> bytes:
    """Send raw bytes, read everything the server answers until it is quiet for `settle` s once it
    has begun to answer (the first byte is waited for up to `timeout`: a loaded machine may be slow)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(min(settle, left) if chunks else left)
            try:
                data = s.recv(1 << 20)
            except socket.timeout:
                if not expect_close:
                    break
                continue
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05):
    """Poll `predicate` until it is truthy or `timeout` passes; returns its last value. The
    timeout bounds a loaded machine's wait for what must happen; it is no claim about speed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


# -- raw RESP over a socket ------------------------------------------------------------------------

def cmd(*args: bytes | str | int) -> bytes:
    """One RESP multibulk command; str and int arguments are encoded as redis-cli sends them."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a.encode() if isinstance(a, str) else str(a).encode() if isinstance(a, int) else a
        out.append(b"$%d\r\n%b\r\n" % (len(a), a))
    return b"".join(out)


def exchange(port: int, payload: bytes, timeout: float = 5.0, quiet: float | None = 0.3,
             source: str | None = None, host: str = "127.0.0.1", lines: int = 0) -> tuple[bytes, bool]:
    """Send `payload` (from address `source`, if given) and read until the server closes (True), or
    until it stays silent for `quiet` s or `timeout` passes (False). quiet=None waits out `timeout`.
    `lines`: the CRLFs expected; until that many have come a silence is waited out (a loaded machine
    may be slow to answer), after them `quiet` s of silence shows that nothing more comes."""
    s = socket.socket()
    s.settimeout(timeout)
    if source:
        s.bind((source, 0))
    s.connect((host, port))
    with s:
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed before it read everything: what it answered is still readable
        chunks, deadline, seen = [], time.monotonic() + timeout, 0
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(max(0.01, min(left, quiet or left) if seen >= lines else left))
            try:
                data = s.recv(1 << 20)
            except socket.timeout:
                break
            except ConnectionResetError:
                return b"".join(chunks), True
            if not data:
                return b"".join(chunks), True
            chunks.append(data)
            seen += data.count(b"\r\n")
        return b"".join(chunks), False


def same_reply(cmd, ours: bytes, theirs: bytes) -> bool:
    """Two servers' raw replies to `cmd` agree: byte for byte, except that a TTL in seconds, asked of
    each server a moment apart, may be one second apart (the deadline is the same; the clock moved)."""
    name = cmd[0].upper() if isinstance(cmd[0], str) else bytes(cmd[0]).decode(errors="replace").upper()
    if name == "TTL" and ours[:1] == theirs[:1] == b":" and ours.endswith(b"\r\n") and theirs.endswith(b"\r\n"):
        a, b = int(ours[1:-2]), int(theirs[1:-2])
        return a == b or (min(a, b) >= 0 and abs(a - b) <= 1)
    return ours == theirs


def read_lines(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    """Read from `sock` until `n` CRLFs have arrived, the peer closes or `timeout` passes."""
    buf, deadline = bytearray(), time.monotonic() + timeout
    while buf.count(b"\r\n") < n and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(max(0.05, left))
        try:
            chunk = sock.recv(1 << 20)
        except socket.timeout:
            break
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def read_reply(sock: socket.socket, timeout: float = 10.0):
    """Read one whole RESP reply from `sock` (hiredis parses it); fails if it does not come in `timeout` s."""
    import hiredis

    reader, deadline = hiredis.Reader(), time.monotonic() + timeout
    while (reply := reader.gets()) is False:
        left = deadline - time.monotonic()
        assert left > 0, f"no whole reply within {timeout} s"
        sock.settimeout(left)
        chunk = sock.recv(1 << 20)
        assert chunk, "the server closed the connection before a whole reply"
        reader.feed(chunk)
    return reply


def assert_alive(q: Quilld) -> None:
    """The node is still running and answers a PING on a new connection."""
    assert q.proc.poll() is None, f"quilld exited:\n{q.log()}"
    assert raw_exchange(q.port, b"PING\r\n") == b"+PONG\r\n"


def wait_held(r, nbytes: int, timeout: float = 30.0) -> int:
    """Wait until at least `nbytes` of the arena are held (pinned by a reply being sent, or reserved
    for a payload arriving): what a test sets up before it acts on the held block. Fails past `timeout`."""
    held = wait_until(lambda: r.info("tiers")["dram_held_bytes"] >= nbytes, timeout=timeout)
    assert held, f"dram_held_bytes never reached {nbytes}: {r.info('tiers')}"
    return r.info("tiers")["dram_held_bytes"]


@pytest.fixture
def nodes():
    """A list a test appends the quilld it starts to; each is stopped (by PID) at the end."""
    started = []
    yield started
    for q in started:
        stop_process(q.proc)


def http(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """One HTTP request to 127.0.0.1:`port`: (status, headers, body), an error status included."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


@pytest.fixture
def cluster(tmp_path):
    """Real quilld nodes on 127.0.0.1 (blackbox/test_cluster.py's Cluster), every one stopped at the end."""
    from test_cluster import Cluster

    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def topo():
    """A bridge and its hosts in network namespaces (tests/netns.py), torn down at the end; a
    machine that cannot make them fails the test (CI runs as root), never skips it."""
    from netns import NetnsUnavailable, Topology

    try:
        t = Topology()
    except NetnsUnavailable as e:
        pytest.fail(f"this test needs network namespaces (root and iproute2; CI runs as root): {e}")
    try:
        yield t
    finally:
        t.destroy()
