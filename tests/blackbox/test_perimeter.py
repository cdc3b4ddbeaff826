"""Issue 11, finding 1: who may reach a real quilld's listeners.

- With a password (requirepass or a users file), the admin API needs a token:
  quilld refuses to start without `admin.token`, and every route answers 401
  without it.
- With no password at all, protected mode (as redis's protected-mode) admits
  loopback clients only, on every listener: RESP answers `-DENIED ...` and
  closes, as redis-server 7 does; the admin API and the gateway answer 403.

The non-loopback client is this machine itself, connecting from its own
address other than loopback (found with `ip`, e.g. the one `hostname -I`
prints): to quilld that peer is as remote as any other host. A machine with
no such address skips these tests (the decision itself is unit-tested in
tests/unit/test_config.py).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, exchange, free_port, read_reply, start_quilld, start_redis, stop_process

from quilld.config import PROTECTED_MODE_REFUSAL

pytestmark = pytest.mark.timeout(90)

START_TIMEOUT = 20.0
DENIED = f"-DENIED {PROTECTED_MODE_REFUSAL}\r\n".encode()


def non_loopback_address() -> str:
    """An IPv4 address of this machine other than loopback."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not info[4][0].startswith("127."):
                return info[4][0]
    except OSError:
        pass
    pytest.skip("this machine has no IPv4 address other than loopback to connect from")


@pytest.fixture(scope="module")
def addr() -> str:
    return non_loopback_address()


def connect_from(source: str, host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    s.bind((source, 0))
    s.connect((host, port))
    return s


def ping_from(source: str, host: str, port: int, payload: bytes = b"PING\r\n") -> tuple[bytes, bool]:
    """Send `payload` from `source`; (everything answered, whether the server closed the connection)."""
    return exchange(port, payload, quiet=0.5, source=source, host=host)


def http_from(source: str, host: str, port: int, method: str, path: str, body: bytes | None = None,
              headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


class Node:
    def __init__(self, proc: subprocess.Popen, log: Path, port: int, admin: int, gateway: int) -> None:
        self.proc, self.log_path, self.port, self.admin, self.gateway = proc, log, port, admin, gateway

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def bound(tmp_path):
    """start(host, *flags, env=...) -> Node: quilld bound to `host`, with admin and gateway ports."""
    started: list[subprocess.Popen] = []

    def start(host: str, *flags: str, env: dict | None = None) -> Node:
        port, admin, gateway = free_port(), free_port(), free_port()
        log = tmp_path / f"quilld-{port}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
        full_env.update(PYTHONPATH=str(ROOT), **(env or {}))
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "quilld", "--bind", host, "--port", str(port),
                                     "--admin-port", str(admin), "--gateway-port", str(gateway), "--dram", "32MiB",
                                     *flags], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env)
        started.append(proc)
        node = Node(proc, log, port, admin, gateway)
        deadline = time.monotonic() + START_TIMEOUT
        while "quilld ready" not in node.log():
            assert proc.poll() is None and time.monotonic() < deadline, f"quilld did not start:\n{node.log()}"
            time.sleep(0.05)
        return node

    yield start
    for proc in started:
        stop_process(proc)


def test_protected_mode_admits_only_loopback_on_every_listener(bound, addr, tmp_path):
    node = bound(addr)  # bound to this machine's non-loopback address, no password
    # RESP: refused before a byte is read, with the refusal line, then closed (as redis does) ...
    answer, closed = ping_from(addr, addr, node.port)
    assert answer == DENIED and closed
    # ... while a loopback client of the same listener is served
    answer, closed = ping_from("127.0.0.1", addr, node.port)
    assert answer == b"+PONG\r\n" and not closed
    # the admin API and the gateway follow the same rule
    status, body = http_from(addr, addr, node.admin, "GET", "/healthz")
    assert status == 403 and "protected mode" in body["error"]
    status, body = http_from(addr, addr, node.admin, "DELETE", "/v1/engines/e1")
    assert status == 403
    assert http_from("127.0.0.1", addr, node.admin, "GET", "/healthz")[0] == 200
    # an orchestrator's probes (issue 18.4) come from the node's network and say nothing: answered to anyone
    assert http_from(addr, addr, node.admin, "GET", "/livez") == (200, {"status": "ok"})
    assert http_from(addr, addr, node.admin, "GET", "/readyz") == (200, {"status": "ready"})
    status, body = http_from(addr, addr, node.gateway, "GET", "/v1/models")
    assert status == 403 and body["error"]["code"] == "protected_mode" and "protected mode" in body["error"]["message"]
    status, body = http_from(addr, addr, node.gateway, "POST", "/v1/chat/completions", b'{"model": "m"}')
    assert status == 403
    assert http_from("127.0.0.1", addr, node.gateway, "GET", "/v1/models")[0] == 200
    # counted as redis counts it: a rejected connection, not a received one
    with connect_from("127.0.0.1", addr, node.port) as s:
        s.sendall(b"INFO stats\r\n")
        stats = read_reply(s).decode()
    assert "rejected_connections:1\r\n" in stats and "total_connections_received:2\r\n" in stats, stats
    assert "protected mode: loopback clients only" in node.log()
    assert "Traceback" not in node.log()


def test_redis_server_refuses_the_same_client_the_same_way(addr, tmp_path):
    """What quilld's RESP refusal copies: redis-server 7 in protected mode, bound to the same address."""
    port, proc = start_redis(tmp_path, bind=(addr, "127.0.0.1"))
    try:
        answer, closed = ping_from(addr, addr, port)
        assert answer.startswith(b"-DENIED Redis is running in protected mode because protected mode is enabled "
                                 b"and no password is set for the default user. In this mode connections are only "
                                 b"accepted from the loopback interface.") and answer.endswith(b"\r\n") and closed
        assert ping_from("127.0.0.1", addr, port)[0] == b"+PONG\r\n"
    finally:
        stop_process(proc)
    # quilld's line has the same shape: the error prefix, the same first two sentences, one line
    assert DENIED.startswith(b"-DENIED quilld is running in protected mode because protected mode is enabled "
                             b"and no password is set for the default user. In this mode connections are only "
                             b"accepted from the loopback interface.") and DENIED.count(b"\r\n") == 1


def test_protected_mode_off_or_a_password_admits_other_hosts(bound, addr):
    node = bound(addr, "--protected-mode", "no")  # the operator says so, explicitly
    assert ping_from(addr, addr, node.port) == (b"+PONG\r\n", False)
    assert http_from(addr, addr, node.admin, "GET", "/healthz")[0] == 200
    assert http_from(addr, addr, node.gateway, "GET", "/v1/models")[0] == 200
    node = bound(addr, "--requirepass", "pw", env={"QUILLD_ADMIN_TOKEN": "tok"})
    answer, closed = ping_from(addr, addr, node.port)
    assert answer.startswith(b"-NOAUTH") and not closed  # admitted: AUTH guards it
    assert ping_from(addr, addr, node.port, b"AUTH pw\r\nPING\r\n")[0] == b"+OK\r\n+PONG\r\n"
    assert http_from(addr, addr, node.admin, "GET", "/healthz")[0] == 401
    assert http_from(addr, addr, node.admin, "GET", "/healthz", headers={"Authorization": "Bearer tok"})[0] == 200
    assert http_from(addr, addr, node.gateway, "GET", "/v1/models")[0] == 401  # API keys are the passwords
    assert http_from(addr, addr, node.gateway, "GET", "/v1/models", headers={"Authorization": "Bearer pw"})[0] == 200


@pytest.mark.parametrize("password", [["--requirepass", "pw"], ["--users-file", "USERS"]])
def test_a_password_without_an_admin_token_refuses_to_start(tmp_path, password):
    users = tmp_path / "users"
    users.write_text("alice alice-pw\n")
    password = [str(users) if p == "USERS" else p for p in password]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    proc = subprocess.run([sys.executable, "-m", "quilld", "--port", str(free_port()), "--admin-port",
                           str(free_port()), "--dram", "16MiB", *password], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "admin.token" in proc.stderr and "QUILLD_ADMIN_TOKEN" in proc.stderr and "quilld ready" not in proc.stdout
    # the admin API turned off, the same node starts and serves
    q = start_quilld(tmp_path, "--dram", "16MiB", *password, admin=False)
    try:
        assert q.client(password="pw" if "--requirepass" in password else "alice-pw",
                        username=None if "--requirepass" in password else "alice").ping()
    finally:
        assert stop_process(q.proc) == 0


def test_with_a_password_every_admin_route_needs_the_token(tmp_path):
    """The attack of finding 1: remove the engine, register another for its model. Not without the token."""
    conf = tmp_path / "engines.toml"
    conf.write_text('[[engines]]\nid = "e1"\nmodel = "m"\nurl = "http://127.0.0.1:9"\n')
    q = start_quilld(tmp_path, "--requirepass", "pw", "--config", str(conf), "--dram", "32MiB")
    try:
        assert q.admin_token  # given by conftest: quilld would not start without one
        evil = json.dumps({"id": "evil", "model": "m", "url": "http://127.0.0.1:1"}).encode()
        for method, path, body in (("GET", "/healthz", None), ("GET", "/v1/stats", None), ("GET", "/metrics", None),
                                   ("GET", "/v1/config", None), ("GET", "/v1/engines", None),
                                   ("POST", "/v1/engines", evil), ("DELETE", "/v1/engines/e1", None),
                                   ("POST", "/v1/route", b'{"model": "m", "blocks": [1]}'),
                                   ("POST", "/v1/kv-events", b'{"engine_id": "e1", "events": []}'),
                                   ("GET", "/v1/hot", None), ("GET", "/v1/nodes", None)):
            conn = http.client.HTTPConnection("127.0.0.1", q.admin_port, timeout=10)
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            assert resp.status == 401, (method, path, resp.status)
            resp.read()
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", q.admin_port, timeout=10)
        conn.request("GET", "/v1/engines", headers=q.admin_headers())
        engines = json.loads(conn.getresponse().read())["engines"]
        conn.close()
        assert [e["id"] for e in engines] == ["e1"]
    finally:
        stop_process(q.proc)
