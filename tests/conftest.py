"""Shared fixtures: real quilld and redis-server processes on free loopback ports.

Every process is started on 127.0.0.1, waited for with a deadline, and
stopped by PID (SIGTERM, then SIGKILL after a bound) when the test ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The hundreds of quilld processes the suite starts may cache their compiled modules (about
# 0.6 s of each start on these machines when PYTHONDONTWRITEBYTECODE forbids it).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0
ADMIN_TOKEN = "conftest-admin-token"  # given to a node with passwords and an admin port (quilld requires one)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port} after {timeout}s")


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


def start_quilld(tmp_path: Path, *extra: str, env: dict | None = None, admin: bool = True) -> Quilld:
    port = free_port()
    admin_port = free_port() if admin else 0
    log_path = tmp_path / f"quilld-{port}.log"
    args = [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(port),
            "--admin-port", str(admin_port), *extra]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    full_env["PYTHONPATH"] = str(ROOT)
    full_env.update(env or {})
    passwords = {"--requirepass", "--users-file"} & set(extra) or \
        {"QUILLD_SECURITY_REQUIREPASS", "QUILLD_SECURITY_USERS_FILE"} & set(env or {})
    if admin_port and passwords and "QUILLD_ADMIN_TOKEN" not in full_env:
        full_env["QUILLD_ADMIN_TOKEN"] = ADMIN_TOKEN  # quilld refuses passwords with an open admin API
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env)
    q = Quilld(port, admin_port, proc, log_path, args, full_env.get("QUILLD_ADMIN_TOKEN", ""))
    try:
        wait_port(port, proc)
        if admin_port:
            wait_port(admin_port, proc)
    except Exception:
        stop_process(proc)
        raise RuntimeError(f"quilld did not start:\n{log_path.read_text(errors='replace')}")
    return q


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


@pytest.fixture
def quilld(quilld_factory) -> Quilld:
    """A fresh quilld with a 256 MiB arena."""
    return quilld_factory("--dram", "256MiB")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: .ci/run installs it (apt-get install redis-server redis-tools)")
    return path


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free port, for byte-for-byte comparisons."""
    binary = require_tool("redis-server")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--databases", "1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc)
        yield port
    finally:
        stop_process(proc)


def raw_exchange(port: int, payload: bytes, expect_close: bool = False, timeout: float = 5.0,
                 settle: float = 0.3) -> bytes:
    """Send raw bytes, read everything the server answers until it is quiet for `settle` s."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        deadline = time.monotonic() + timeout
        s.settimeout(settle)
        while time.monotonic() < deadline:
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


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05):
    """Poll `predicate` until it is truthy or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
