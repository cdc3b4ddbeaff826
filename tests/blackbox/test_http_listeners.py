"""The HTTP ports' perimeter (quilld/http/listener.py), on real quilld processes.

Issue 19, item 8: slow clients (slowloris: a request head that never ends, a body that
never comes) on the admin or gateway port, no token needed, used to hold their
connections for an hour each and take every descriptor the process had; RESP clients
with the right password then got nothing. Now each HTTP port takes a capped number of
connections (within a quarter of the descriptor limit), cuts off a head or a body that
does not arrive in time, and RESP clients are served throughout.

Issue 19, item 9: a malformed HTTP request logged a traceback each, before any
credential check. Now each is answered 400, counted by kind in /metrics, and only the
first of each kind is logged, in one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from conftest import ADMIN_TOKEN, ROOT, Quilld, http, start_listening, stop_process, wait_until, with_nofile
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(120)

NOFILE = 256  # the quilld under test gets this descriptor limit, soft and hard
SLOW = 400  # slow connections opened, half on each HTTP port: more than the process has descriptors
DEADLINE_MS = 1000  # header and body timeouts of the node under test
BEARER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def start_limited(tmp_path: Path, *extra: str, nofile: int = NOFILE, env: dict | None = None) -> tuple[Quilld, int]:
    """A quilld with a password, an admin token and a gateway, under a descriptor limit of `nofile`;
    (the node, its gateway port)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    full_env.update(PYTHONPATH=str(ROOT), QUILLD_ADMIN_TOKEN=ADMIN_TOKEN, **(env or {}))

    def spawn(ports: list[int], log: Path) -> subprocess.Popen:
        argv = [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(ports[0]), "--admin-port",
                str(ports[1]), "--gateway-port", str(ports[2]), "--requirepass", "pw", "--dram", "64MiB", *extra]
        with open(log, "wb") as f:
            return subprocess.Popen(with_nofile(argv, nofile), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=full_env)

    proc, ports, log = start_listening("quilld", lambda port: tmp_path / f"quilld-{port}.log", spawn, 3)
    return Quilld(ports[0], ports[1], proc, log, [], ADMIN_TOKEN), ports[2]


def families(port: int) -> dict:
    status, _, body = http(port, "GET", "/metrics", headers=BEARER)
    assert status == 200, body
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def per_listener(fams: dict, name: str) -> dict[str, float]:
    """A listener-labelled family as {listener: value} (summed over any other label)."""
    out: dict[str, float] = {}
    for s in fams[name].samples:
        if s.name in (name, name + "_total"):
            out[s.labels["listener"]] = out.get(s.labels["listener"], 0) + s.value
    return out


def is_closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (EOF or reset); what it sent first is read and dropped."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def resp_pings(port: int, clients: int = 5) -> int:
    """How many of `clients` new RESP clients with the right password got PONG."""
    answered = 0
    for _ in range(clients):
        r = redis.Redis(port=port, password="pw", socket_timeout=5, socket_connect_timeout=5)
        try:
            answered += r.ping() is True
        except redis.RedisError:
            pass
        finally:
            r.close()
    return answered


def test_slow_clients_on_http_ports_never_take_resp_clients_descriptors(tmp_path):
    q, gateway = start_limited(tmp_path, env={"QUILLD_ADMIN_HEADER_TIMEOUT_MS": str(DEADLINE_MS),
                                              "QUILLD_GATEWAY_HEADER_TIMEOUT_MS": str(DEADLINE_MS)})
    slow: list[socket.socket] = []
    try:
        fams = families(q.admin_port)
        caps = {k: int(v) for k, v in per_listener(fams, "quilld_http_max_connections").items()}
        # within a quarter of the limit; a gateway connection may hold one to an engine too
        assert 1 <= caps["admin"] and 1 <= caps["gateway"] and caps["admin"] + 2 * caps["gateway"] <= NOFILE // 4
        for i in range(SLOW):  # a request head begun, never finished: no token needed for that
            s = socket.create_connection(("127.0.0.1", (q.admin_port, gateway)[i % 2]), timeout=5)
            s.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(s)
        # every RESP client with the right password is answered while the slow ones hang on
        assert resp_pings(q.port) == 5, q.log()[-3000:]
        # the HTTP ports kept no more than their caps: the rest were answered 503 and closed
        assert wait_until(lambda: sum(not is_closed(s) for s in slow) <= caps["admin"] + caps["gateway"], 10)
        # then the heads that never ended are cut off at the header deadline, and the ports answer again
        assert wait_until(lambda: all(is_closed(s) for s in slow), 30), "slow connections still open"
        fams = families(q.admin_port)
        refused = per_listener(fams, "quilld_http_connections_refused")
        cut = per_listener(fams, "quilld_http_header_timeouts")
        assert refused["admin"] + refused["gateway"] + cut["admin"] + cut["gateway"] >= SLOW, (refused, cut)
        assert cut["admin"] >= 1 and cut["gateway"] >= 1 and refused["admin"] >= 1 and refused["gateway"] >= 1
        status, _, body = http(q.admin_port, "GET", "/v1/stats", headers=BEARER)
        assert status == 200
        stats = json.loads(body)["http"]  # /v1/stats says the same
        assert {n: stats[n]["refused"] for n in stats} == refused and {n: stats[n]["header_timeouts"]
                                                                      for n in stats} == cut
        assert resp_pings(q.port) == 5
        log = q.log()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("connection(s) refused") <= 2, log[-3000:]  # a line per listener, not one per refusal
    finally:
        for s in slow:
            s.close()
        stop_process(q.proc)


def test_a_body_that_does_not_arrive_in_time_is_answered_408(tmp_path):
    q, gateway = start_limited(tmp_path, env={"QUILLD_ADMIN_BODY_TIMEOUT_MS": str(DEADLINE_MS),
                                              "QUILLD_GATEWAY_BODY_TIMEOUT_MS": str(DEADLINE_MS)})
    try:
        answers = {}
        for name, port, head in (
                ("admin", q.admin_port, b"POST /v1/engines HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                        b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n"),
                ("gateway", gateway, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                     b"Authorization: Bearer pw\r\n")):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(head + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"id\": ")
            data = b""
            while chunk := s.recv(65536):  # until the server closes
                data += chunk
            s.close()
            answers[name] = data
        assert answers["admin"].startswith(b"HTTP/1.1 408 "), answers["admin"]
        assert b"did not arrive within 1 s" in answers["admin"]
        assert answers["gateway"].startswith(b"HTTP/1.1 408 "), answers["gateway"]
        body = json.loads(answers["gateway"].partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "body_timeout"  # OpenAI-shaped on the gateway
        assert per_listener(families(q.admin_port), "quilld_http_body_timeouts") == {"admin": 1, "gateway": 1}
        assert "Traceback" not in q.log(), q.log()[-3000:]
    finally:
        stop_process(q.proc)


# kinds of request aiohttp cannot parse, each as sent on a fresh connection
MALFORMED = [
    b"GET / HTTP/1.1 trailing\r\nHost: x\r\n\r\n",  # a bad request line
    b"GET / HTTP/1.1\r\nHost: x\r\nNo Colon Here\r\n\r\n",  # a header that is not one
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line too long
    b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",  # a length that is not a number
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS after a request
    b"POST /v1/kv-events HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n",  # bad chunk
]
ROUNDS = 200


def test_malformed_requests_are_counted_by_kind_and_logged_once_each(tmp_path):
    q, gateway = start_limited(tmp_path)
    try:
        for i in range(ROUNDS):
            port = (q.admin_port, gateway)[i % 2]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(MALFORMED[i % len(MALFORMED)])
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert reply.startswith((b"HTTP/1.1 400 ", b"HTTP/1.0 400 ")), (i, reply[:300])
        fams = families(q.admin_port)
        kinds = {}
        for s in fams["quilld_http_malformed_requests"].samples:
            kinds[s.labels["kind"]] = kinds.get(s.labels["kind"], 0) + s.value
        assert sum(kinds.values()) == ROUNDS, kinds  # every malformed request counted once
        assert len(kinds) >= 4, kinds
        log = q.log()
        assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
        lines = [line for line in log.splitlines() if "malformed HTTP request" in line]
        assert len(lines) <= 2 * len(kinds), lines  # at most one per kind on each port
        assert {k for k in kinds if any(k in line for line in lines)} == set(kinds), (kinds, lines)
    finally:
        stop_process(q.proc)
