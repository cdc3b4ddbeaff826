"""Real quilld processes on free loopback ports, for the tests and the benchmarks alike.

No pytest here: the benches (bench/) import this module in an environment that has only
the `bench` extra, and tests/conftest.py re-exports it for the tests. Every process is
started on 127.0.0.1, waited for with a deadline, and stopped by PID (SIGTERM, then
SIGKILL after a bound).
"""

from __future__ import annotations

import os
import random
import signal
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0
ADMIN_TOKEN = "conftest-admin-token"  # given to a node with passwords and an admin port (quilld requires one)
PURE_ENV = "QUILLD_PURE_PYTHON"  # quilld/native.py's build switch: passed on to the nodes, unlike other QUILLD_ keys


# The servers tests start listen on ports below the kernel's ephemeral range (32768-60999 by
# default, where every client connection takes its source port, on any address), each xdist
# worker in its own slice, and no port is handed out twice in a worker: a port bind(0) chose
# could be taken, before the server bound it, by another worker's server or by a connection's
# source port (seen in CI: "the port is in use" on 192.0.2.2, and a wait_port that reached
# another worker's server).
PORT_RANGE = (20000, 32000)
_given_ports: set[int] = set()
_port_rng = random.Random(os.urandom(8))  # apart from tests that seed `random`


def free_port() -> int:
    """A TCP port nothing is bound to on any address, in this worker's slice of PORT_RANGE."""
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    index = int(worker) % count if worker.isdigit() else 0
    span = (PORT_RANGE[1] - PORT_RANGE[0]) // count
    first, offset = PORT_RANGE[0] + index * span, _port_rng.randrange(span)
    for attempt in range(2):
        for i in range(span):
            port = first + (offset + i) % span
            if port in _given_ports:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))  # conflicts with a socket on any address, TIME_WAIT included
                except OSError:
                    continue
            _given_ports.add(port)
            return port
        _given_ports.clear()  # every port of the slice handed out once: hand them out again
    raise RuntimeError(f"no free port in {first}-{first + span - 1}")


# Limits and signal dispositions a process starts with are set by a small program that execs it
# (same PID), never by a `preexec_fn`: a preexec_fn makes Python fork() the test worker instead of
# vfork()ing it, and in a long-lived worker each such start took 18 s.

def with_nofile(argv: list[str], soft: int, hard: int | None = None) -> list[str]:
    """`argv` started with RLIMIT_NOFILE (soft, hard) (util-linux's prlimit)."""
    return [shutil.which("prlimit") or "prlimit", f"--nofile={soft}:{soft if hard is None else hard}", "--", *argv]


def ignoring_sigint(argv: list[str]) -> list[str]:
    """`argv` started with SIGINT ignored, as a shell starts a background job (kept across exec)."""
    return ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]


def free_gossip_port() -> int:
    """A port free for TCP (`free_port`) and for UDP too: a gossip port (quilld listens on both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            try:
                u.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no port free for both TCP and UDP")


def _listening_inodes(port: int, pid: int | str = "self") -> set[str]:
    """The socket inodes listening on TCP `port` (any address) in `pid`'s network namespace
    (this process's by default), from /proc/<pid>/net/tcp{,6}."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(cols[9])
    return inodes


def holds_listener(pids: Iterable[int], port: int, namespace_of: int | str = "self") -> bool:
    """Whether one of `pids` holds a socket listening on TCP `port` in `namespace_of`'s network
    namespace (this process's by default)."""
    inodes = _listening_inodes(port, namespace_of)
    if not inodes:
        return False
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a shell's children run the server in some tests)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def listens(proc: subprocess.Popen, port: int) -> bool:
    """Whether `proc` (or a child of it) holds the listening socket on `port`. A port from
    free_port() is free only when chosen: another test's server can take it before `proc`
    binds it, and a bare connect would then reach that server instead."""
    return holds_listener(_process_tree(proc.pid), port)


class PortTaken(RuntimeError):
    """The process could not bind its port: another process took it after free_port() chose it."""


def wait_port(port: int, proc: subprocess.Popen, timeout: float = START_TIMEOUT) -> None:
    """Wait until `proc` itself listens on `port` (not merely anybody: see listens())."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if _listening_inodes(port):
                raise PortTaken(f"process exited with {proc.returncode}: port {port} was taken by another process")
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        if listens(proc, port):
            return
        time.sleep(0.05)
    other = " (another process listens there)" if _listening_inodes(port) else ""
    raise TimeoutError(f"the process did not listen on {port} after {timeout}s{other}")


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


@dataclass
class Quilld:
    """A running quilld process."""

    port: int
    admin_port: int
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    admin_token: str = ""  # the admin API's bearer token, when the node has one

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def client(self, **kw):
        import redis

        kw.setdefault("socket_timeout", 30)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        return stop_process(self.proc)


PORT_ATTEMPTS = 3  # fresh ports when another process took the chosen one first


def _port_taken(e: Exception, log: str) -> bool:
    return isinstance(e, PortTaken) or "the port is in use" in log or "Address already in use" in log


def start_listening(what: str, log_path: Callable[[int], Path], spawn: Callable[[list[int], Path], subprocess.Popen],
                    nports: int = 1) -> tuple[subprocess.Popen, list[int], Path]:
    """`spawn(ports, log)`: a process to listen on `nports` free ports, writing to `log`; wait
    until it listens on each, and start it again on fresh ports (PORT_ATTEMPTS times in all) when
    another process took one first. (process, ports, log)."""
    for attempt in range(PORT_ATTEMPTS):
        ports = [free_port() for _ in range(nports)]
        log = log_path(ports[0])
        proc = spawn(ports, log)
        try:
            for port in ports:
                wait_port(port, proc)
            return proc, ports, log
        except Exception as e:
            stop_process(proc)
            text = log.read_text(errors="replace")
            if attempt + 1 < PORT_ATTEMPTS and _port_taken(e, text):
                continue
            raise RuntimeError(f"{what} did not start ({e}):\n{text}") from None
    raise AssertionError("unreachable")


SERVING = b" (RESP), admin "  # node.py's start line, logged once the node serves (every listener open)


def wait_serving(proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT) -> None:
    """Wait until quilld says it serves. Its RESP and admin ports listen earlier (the admin API
    first, answering 503 until then; RESP before the cluster is joined and the gateway opened),
    so a test that asked the admin API right after the ports opened could be told "the node is
    starting"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if SERVING in log.read_bytes():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"quilld exited with {proc.returncode} before serving:\n{log.read_text(errors='replace')}")
        time.sleep(0.02)
    stop_process(proc)
    raise TimeoutError(f"quilld did not serve after {timeout}s:\n{log.read_text(errors='replace')}")


def start_quilld(tmp_path: Path, *extra: str, env: dict | None = None, admin: bool = True,
                 tree: Path = ROOT) -> Quilld:
    """A quilld of source tree `tree` (this one by default: a bench may compare another's)."""
    # a QUILLD_-free environment, but for the build switch (quilld/native.py): a suite run with
    # QUILLD_PURE_PYTHON=1 runs its nodes on the pure-Python build too
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_") or k == PURE_ENV}
    full_env["PYTHONPATH"] = str(tree)
    full_env.update(env or {})
    passwords = {"--requirepass", "--users-file"} & set(extra) or \
        {"QUILLD_SECURITY_REQUIREPASS", "QUILLD_SECURITY_USERS_FILE"} & set(env or {})
    if admin and passwords and "QUILLD_ADMIN_TOKEN" not in full_env:
        full_env["QUILLD_ADMIN_TOKEN"] = ADMIN_TOKEN  # quilld refuses passwords with an open admin API
    argv: list[str] = []

    def spawn(ports: list[int], log: Path) -> subprocess.Popen:
        argv[:] = [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(ports[0]),
                   "--admin-port", str(ports[1] if admin else 0), *extra]
        with open(log, "wb") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=tree, env=full_env)

    proc, ports, log = start_listening("quilld", lambda port: tmp_path / f"quilld-{port}.log", spawn, 1 + admin)
    wait_serving(proc, log)
    return Quilld(ports[0], ports[1] if admin else 0, proc, log, list(argv), full_env.get("QUILLD_ADMIN_TOKEN", ""))


def start_redis(tmp_path: Path, *extra: str, bind: tuple[str, ...] = ("127.0.0.1",),
                binary: str | None = None) -> tuple[int, subprocess.Popen]:
    """A real redis-server on a free port (no persistence, one database); (port, process).
    `bind` must include 127.0.0.1: the start is waited for there."""
    binary = binary or shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")

    def spawn(ports: list[int], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            return subprocess.Popen([binary, "--port", str(ports[0]), "--bind", *bind, "--save", "", "--appendonly",
                                     "no", "--databases", "1", "--dir", str(tmp_path), *extra],
                                    stdout=f, stderr=subprocess.STDOUT)

    proc, ports, _ = start_listening("redis-server", lambda port: tmp_path / f"redis-{port}.log", spawn)
    return ports[0], proc
