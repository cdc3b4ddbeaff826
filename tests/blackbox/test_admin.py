"""The admin HTTP API on a real quilld: health, stats, Prometheus metrics, the
effective config (secrets redacted), bearer-token auth, config from QUILLD_*
environment variables, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024
HTTP_TIMEOUT = 10.0


def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def get_json(port: int, path: str, headers: dict | None = None) -> dict:
    status, hdrs, body = http_get(port, path, headers)
    assert status == 200, (path, status, body)
    assert hdrs["Content-Type"].startswith("application/json"), hdrs
    return json.loads(body)


def metrics(port: int, headers: dict | None = None) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name), parsed by prometheus_client."""
    status, hdrs, body = http_get(port, "/metrics", headers)
    assert status == 200, body
    assert hdrs["Content-Type"].startswith("text/plain"), hdrs
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def poll(predicate, timeout: float = 5.0, step: float = 0.05):
    """Wait until `predicate()` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def test_healthz(quilld):
    status, hdrs, body = http_get(quilld.admin_port, "/healthz")
    assert status == 200
    assert hdrs["Content-Type"].startswith("application/json")
    doc = json.loads(body)
    assert doc["status"] == "ok"
    assert doc["version"]


def test_unknown_route_is_404(quilld):
    status, _, _ = http_get(quilld.admin_port, "/v1/nope")
    assert status == 404


def test_stats(quilld):
    before = get_json(quilld.admin_port, "/v1/stats")
    dram = before["tiers"]["dram"]
    assert dram["dram_capacity"] == 256 * MiB
    assert dram["dram_keys"] == 0
    counters = before["counters"]
    assert before["clients"]["connected"] == 0

    r = quilld.client()
    n = 25
    for i in range(n):
        r.set(f"k{i}", b"x" * 100_000)  # arena-sized values, not inline
    assert r.get("k0") == b"x" * 100_000
    assert r.get("missing") is None

    after = get_json(quilld.admin_port, "/v1/stats")
    grown = after["counters"]["total_commands_processed"] - counters["total_commands_processed"]
    assert grown >= n + 2, grown
    assert after["counters"]["keyspace_hits"] == counters["keyspace_hits"] + 1
    assert after["counters"]["keyspace_misses"] == counters["keyspace_misses"] + 1
    assert after["counters"]["total_net_input_bytes"] > counters["total_net_input_bytes"] + n * 100_000
    assert after["clients"]["connected"] == 1  # the redis-py connection is still open
    assert after["tiers"]["dram"]["dram_keys"] == n
    assert after["tiers"]["dram"]["dram_used"] >= n * 100_000

    r.close()
    assert poll(lambda: get_json(quilld.admin_port, "/v1/stats")["clients"]["connected"] == 0)


def test_metrics_prometheus(quilld):
    r = quilld.client()
    r.set("a", "1")
    r.set("big", b"y" * 1_000_000)
    for _ in range(3):
        assert r.get("a") == b"1"
    assert r.get("nope") is None
    info = r.info("stats")
    # nothing between INFO and the scrape touches the keyspace
    status, _, body = http_get(quilld.admin_port, "/metrics")
    assert status == 200
    text = body.decode()
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert types and all(line.startswith("# TYPE quilld_") for line in types), types
    samples = metrics(quilld.admin_port)
    assert all(name.startswith("quilld_") for name in samples), sorted(samples)
    assert samples["quilld_keyspace_hits_total"] == info["keyspace_hits"] == 3
    assert samples["quilld_keyspace_misses_total"] == info["keyspace_misses"] == 1
    assert samples["quilld_commands_processed_total"] >= info["total_commands_processed"]
    assert samples["quilld_dram_capacity"] == 256 * MiB
    assert samples["quilld_dram_keys"] == 2
    assert samples["quilld_dram_used"] >= 1_000_000
    assert samples["quilld_connected_clients"] == 1
    assert samples["quilld_guard_refusals_by_reason_total{reason=cross_tenant}"] == 0


def test_config_redacts_password(quilld_factory):
    q = quilld_factory("--dram", "256MiB", "--requirepass", "hunter2-pw",
                       env={"QUILLD_CLUSTER_SECRET": "gossip-key-1", "QUILLD_ADMIN_TOKEN": "admin-tok-1"})
    status, _, body = http_get(q.admin_port, "/v1/config", {"Authorization": "Bearer admin-tok-1"})
    assert status == 200
    assert b"hunter2-pw" not in body and b"gossip-key-1" not in body and b"admin-tok-1" not in body
    assert json.loads(body)["cluster"]["secret"] == "***"
    cfg = json.loads(body)
    assert cfg["security"]["requirepass"] == "***"
    assert cfg["dram"]["size"] == 256 * MiB
    assert cfg["server"]["port"] == q.port
    assert cfg["server"]["bind"] == "127.0.0.1"
    # the password still works on the RESP port
    assert q.client(password="hunter2-pw").ping() is True


def test_config_without_password_is_empty(quilld):
    cfg = get_json(quilld.admin_port, "/v1/config")
    assert cfg["security"]["requirepass"] == ""
    assert cfg["admin"]["token"] == ""


def test_admin_token(quilld_factory):
    q = quilld_factory("--dram", "256MiB", env={"QUILLD_ADMIN_TOKEN": "tok"})
    for path in ("/healthz", "/v1/stats", "/metrics", "/v1/config"):
        status, hdrs, _ = http_get(q.admin_port, path)
        assert status == 401, path
        assert hdrs.get("WWW-Authenticate", "").startswith("Bearer"), hdrs
        for wrong in ("Bearer nope", "Bearer tok2", "Basic dG9rOg==", "tok", "Bearer  tok"):
            assert http_get(q.admin_port, path, {"Authorization": wrong})[0] == 401, (path, wrong)
        status, _, body = http_get(q.admin_port, path, {"Authorization": "Bearer tok"})
        assert status == 200, (path, body)
    cfg = get_json(q.admin_port, "/v1/config", {"Authorization": "Bearer tok"})
    assert cfg["admin"]["token"] == "***"
    # the RESP port does not use the admin token
    assert q.client().ping() is True


def test_dram_size_from_environment(quilld_factory):
    q = quilld_factory(env={"QUILLD_DRAM_SIZE": "64MiB"})
    cfg = get_json(q.admin_port, "/v1/config")
    assert cfg["dram"]["size"] == 64 * MiB
    r = q.client()
    assert r.info("memory")["maxmemory"] == 64 * MiB
    assert r.config_get("maxmemory") == {"maxmemory": str(64 * MiB)}
    assert get_json(q.admin_port, "/v1/stats")["tiers"]["dram"]["dram_capacity"] == 64 * MiB


def test_flag_overrides_environment(quilld_factory):
    q = quilld_factory("--dram", "32MiB", env={"QUILLD_DRAM_SIZE": "64MiB"})
    assert get_json(q.admin_port, "/v1/config")["dram"]["size"] == 32 * MiB
    assert q.client().info("memory")["maxmemory"] == 32 * MiB


def test_unknown_environment_key_refuses_to_start(quilld_factory):
    with pytest.raises(RuntimeError, match="QUILLD_DRAM_SIZZE"):
        quilld_factory("--dram", "256MiB", env={"QUILLD_DRAM_SIZZE": "64MiB"})


def test_sigterm_exits_cleanly(quilld):
    r = quilld.client()
    r.set("k", b"z" * 1_000_000)
    idle = socket.create_connection(("127.0.0.1", quilld.port), timeout=5)  # a client that never speaks
    try:
        quilld.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            code = quilld.proc.wait(timeout=10)
        except Exception:
            pytest.fail(f"quilld still running 10 s after SIGTERM:\n{quilld.log()}")
        assert time.monotonic() - t0 < 10
    finally:
        idle.close()
    assert code == 0, quilld.log()
    assert quilld.stop() == 0
    log = quilld.log()
    assert "quilld stopped" in log, log
    assert "Traceback" not in log, log
    for port in (quilld.port, quilld.admin_port):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_stop_returns_exit_code(quilld):
    assert get_json(quilld.admin_port, "/healthz")["status"] == "ok"
    t0 = time.monotonic()
    assert quilld.stop() == 0, quilld.log()
    assert time.monotonic() - t0 < 10
    assert "quilld stopped" in quilld.log()


def test_sigterm_with_reply_in_flight(quilld):
    """A 32 MiB reply to a client that does not read, and a SET cut off mid-payload:
    shutdown drains for a bounded time, then exits 0 all the same."""
    big = b"q" * (32 * MiB)
    quilld.client().set("big", big)
    reader = socket.create_connection(("127.0.0.1", quilld.port), timeout=5)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    writer = socket.create_connection(("127.0.0.1", quilld.port), timeout=5)
    try:
        reader.sendall(b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n")
        writer.sendall(b"*3\r\n$3\r\nSET\r\n$4\r\nhalf\r\n$%d\r\n" % (32 * MiB) + b"h" * MiB)
        time.sleep(0.3)  # the reply is queued, the SET's arena space reserved
        quilld.proc.send_signal(signal.SIGTERM)
        try:
            code = quilld.proc.wait(timeout=10)
        except Exception:
            pytest.fail(f"quilld still running 10 s after SIGTERM:\n{quilld.log()}")
    finally:
        reader.close()
        writer.close()
    assert code == 0, quilld.log()
    assert "quilld stopped" in quilld.log()
    assert "Traceback" not in quilld.log(), quilld.log()


def http_post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


MALFORMED_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the interpreter's recursion limit
    b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    b'{"model": "m", "blocks": ' + b"[" * 200 + b"]" * 200 + b"}",  # valid JSON, 201 levels deep
    b"\xff\xfe\xfd",  # not UTF-8
    b"not json",
    b"",
    b'{"model": "m", "blocks": [' + b"9" * 5_000 + b"]}",  # past Python's 4300-digit int limit
]


def test_malformed_json_bodies_answer_400_never_500(quilld):
    """Issue 11, finding 12: deeply nested (or otherwise malformed) JSON on any admin route is a 400."""
    for path in ("/v1/engines", "/v1/route", "/v1/kv-events"):
        for body in MALFORMED_BODIES:
            status, hdrs, answer = http_post(quilld.admin_port, path, body)
            assert status == 400, (path, body[:40], status, answer[:200])
            assert hdrs["Content-Type"].startswith("application/json") and json.loads(answer)["error"]
    status, _, answer = http_post(quilld.admin_port, "/v1/route", b'{"model": "m", "blocks": ' + b"[" * 200
                                  + b"]" * 200 + b"}")
    assert b"nested deeper than 128" in answer
    # just within the limit is parsed, and judged on its fields
    status, _, answer = http_post(quilld.admin_port, "/v1/engines", b'{"id": "e", "model": "m", "url": "http://x", '
                                  b'"locality": ' + b"[" * 127 + b"]" * 127 + b"}")
    assert status == 201, answer
    assert get_json(quilld.admin_port, "/healthz")["status"] == "ok"
    assert "Traceback" not in quilld.log(), quilld.log()
