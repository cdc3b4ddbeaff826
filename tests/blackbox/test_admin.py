"""The admin HTTP API on a real quilld: health, stats, Prometheus metrics, the
effective config (secrets redacted), bearer-token auth, config from QUILLD_*
environment variables, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port, http, stop_process, wait_held, wait_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024
HTTP_TIMEOUT = 10.0
FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}


def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    return http(port, "GET", path, headers=headers, timeout=HTTP_TIMEOUT)


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
    assert wait_until(lambda: get_json(quilld.admin_port, "/v1/stats")["clients"]["connected"] == 0)


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
    assert samples["quilld_dram_capacity_bytes"] == 256 * MiB
    assert samples["quilld_dram_keys"] == 2
    assert samples["quilld_dram_used_bytes"] >= 1_000_000
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
    assert r.info("memory")["maxmemory"] == 0  # as set (none: the whole arena), as CONFIG GET and redis answer
    assert r.config_get("maxmemory") == {"maxmemory": "0"}
    assert get_json(q.admin_port, "/v1/stats")["tiers"]["dram"]["dram_capacity"] == 64 * MiB


def test_flag_overrides_environment(quilld_factory):
    q = quilld_factory("--dram", "32MiB", env={"QUILLD_DRAM_SIZE": "64MiB"})
    assert get_json(q.admin_port, "/v1/config")["dram"]["size"] == 32 * MiB
    assert q.client().info("tiers")["dram_capacity"] == 32 * MiB


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
        wait_held(quilld.client(), 64 * MiB)  # the reply is queued (its block pinned), the SET's space reserved
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
    return http(port, "POST", path, body, {"Content-Type": "application/json", **(headers or {})}, HTTP_TIMEOUT)


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


# -- /metrics: prometheus-client's registry (quilld/http/metrics.py) and the Grafana dashboard ------------------
DASHBOARD = Path(__file__).resolve().parents[2] / "conf" / "grafana-quilld.json"
HISTOGRAMS = ("quilld_command_duration_seconds", "quilld_peer_fetch_duration_seconds",
              "quilld_ssd_read_duration_seconds", "quilld_demotion_batch_duration_seconds",
              "quilld_route_duration_seconds", "quilld_gateway_ttft_seconds")
# figures that are settings or capacities, not counts: not zero on a fresh node
SETTINGS = {"quilld_build_info", "quilld_max_clients", "quilld_dram_capacity_bytes", "quilld_dram_largest_free_bytes",
            "quilld_dram_high_watermark", "quilld_dram_low_watermark", "quilld_dram_inline_max_bytes",
            "quilld_gateway_ttft_slo_seconds", "quilld_gateway_goodput", "quilld_ssd_enabled",
            "quilld_ssd_capacity_bytes", "quilld_recovery_duration_seconds", "quilld_ssd_io_threads",
            "quilld_ssd_fsync_last_seconds", "quilld_ssd_fsync_avg_seconds", "quilld_ssd_fsync_max_seconds",
            "quilld_ssd_wal_bytes", "quilld_ssd_last_checkpoint_timestamp_seconds", "quilld_ssd_fsyncs",
            "quilld_cluster_enabled",
            "quilld_cluster_members", "quilld_cluster_members_alive", "quilld_gateway_enabled",
            "quilld_connections_received",  # the fixture's readiness probe connects once
            "quilld_identity_scopes",  # the default scope, held by the SSD tier's recovery
            "quilld_http_max_connections", "quilld_http_connections"}  # the scrape's own connection


def families(port: int, headers: dict | None = None) -> dict:
    """/metrics parsed by prometheus_client: family name -> Metric (type, samples)."""
    status, hdrs, body = http_get(port, "/metrics", headers)
    assert status == 200, body
    assert hdrs["Content-Type"].startswith("text/plain; version=0.0.4"), hdrs
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(fams: dict, metric: str, suffix: str = "", /, **labels) -> float:
    """The one sample of family `metric` named metric+suffix with exactly `labels`."""
    found = [s.value for s in fams[metric].samples if s.name == metric + suffix and s.labels == labels]
    assert len(found) == 1, (metric, suffix, labels, fams[metric].samples)
    return found[0]


def sample_names(fams: dict) -> set[str]:
    """Every sample name a family of this type is exposed under (counters: _total; histograms:
    _bucket, _count, _sum), whether or not it has samples yet (a labelled family may not)."""
    out = set()
    for name, f in fams.items():
        out |= {"counter": {name + "_total"}, "histogram": {name + s for s in ("_bucket", "_count", "_sum")}}.get(
            f.type, {name})
    return out


# time the SSD tier spent syncing while it was created at start (its key file and first checkpoint)
STARTUP_IO = {"quilld_ssd_fsync_seconds"}


def test_metrics_exist_from_the_start_at_zero_with_their_types(quilld_factory, tmp_path):
    q = quilld_factory("--dram", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256MiB")
    fams = families(q.admin_port)
    assert all(name.startswith("quilld_") for name in fams), sorted(fams)
    types = {name: f.type for name, f in fams.items()}
    for name in HISTOGRAMS:
        assert types[name] == "histogram", (name, types.get(name))
    for name in ("quilld_commands", "quilld_commands_processed", "quilld_keyspace_hits", "quilld_evicted_keys",
                 "quilld_guard_refusals_by_reason", "quilld_tenant_guard_refusals", "quilld_routes",
                 "quilld_engine_leases_expired", "quilld_kv_events", "quilld_kv_engine_events",
                 "quilld_kv_engine_missed", "quilld_ssd_demotions", "quilld_ssd_promotions", "quilld_ssd_reads",
                 "quilld_cluster_peer_fetches", "quilld_gateway_requests", "quilld_gateway_within_slo",
                 "quilld_hot_prefix_lookups", "quilld_process_cpu_seconds"):
        assert types[name] == "counter", (name, types.get(name))
    for name in ("quilld_dram_used_bytes", "quilld_dram_capacity_bytes", "quilld_connected_clients",
                 "quilld_put2phase_open", "quilld_identity_scopes", "quilld_ssd_used_bytes", "quilld_ssd_keys",
                 "quilld_engines",
                 "quilld_engine_in_flight", "quilld_kv_engine_last_sequence", "quilld_kv_engine_idle_seconds",
                 "quilld_residency_blocks", "quilld_cluster_members", "quilld_gateway_in_flight",
                 "quilld_gateway_goodput", "quilld_process_resident_memory_bytes"):
        assert types[name] == "gauge", (name, types.get(name))
    # one series per command family of the table, at zero; the histograms empty
    assert {s.labels["family"] for s in fams["quilld_commands"].samples} >= {"string", "generic", "connection",
                                                                             "server", "quillcache"}
    for name in HISTOGRAMS:
        assert all(s.value == 0 for s in fams[name].samples if s.name.endswith(("_count", "_sum"))), name
    for name, f in fams.items():
        if name in SETTINGS or name.startswith("quilld_process_") or name in STARTUP_IO:
            continue
        assert all(s.value == 0 for s in f.samples), (name, f.samples)
    assert sample(fams, "quilld_ssd_enabled") == 1 and sample(fams, "quilld_cluster_enabled") == 0
    assert sample(fams, "quilld_gateway_goodput") == 1  # nothing counted, nothing missed
    # the parts that are off report at zero all the same: a node without SSD, cluster or gateway has every name
    plain = quilld_factory("--dram", "64MiB")
    assert set(families(plain.admin_port)) == set(fams)


def test_metrics_histograms_move_and_engines_are_labelled(quilld_factory, tmp_path):
    q = quilld_factory("--dram", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256MiB")
    fresh = families(q.admin_port)
    r = q.client()
    for i in range(80):  # 80 MiB into 64 MiB: demotion batches
        r.set(f"blk:{i}", b"%02d" % i * (MiB // 2))
    assert wait_until(lambda: get_json(q.admin_port, "/v1/stats")["tiers"]["ssd"]["ssd_keys"] >= 8, 20)
    assert r.get("blk:0")[:2] == b"00"  # SSD-only by now: an SSD read
    for _ in range(64):
        r.get("blk:79")
    assert http_post(q.admin_port, "/v1/engines", json.dumps({"id": "vllm-0", "model": "m",
                                                              "url": "http://127.0.0.1:9"}).encode())[0] == 201
    batch = {"engine_id": "vllm-0", "events": [{"type": "block_stored", "block_hashes": [1, 2, 3],
                                                "parent_block_hash": None, "token_ids": [], "block_size": 16}]}
    assert http_post(q.admin_port, "/v1/kv-events", json.dumps(batch).encode())[0] == 200
    status, _, body = http_post(q.admin_port, "/v1/route", json.dumps({"model": "m", "blocks": [1, 2, 3, 4],
                                                                       "acquire": True}).encode())
    assert status == 200 and json.loads(body)["engine"] == "vllm-0"
    # the demoter may still be finishing a batch (batches are pipelined): take the metrics between
    # two /v1/stats reads that agree on the SSD tier's counts, so both describe the same moment
    seen: list = []

    def steady() -> bool:
        before = get_json(q.admin_port, "/v1/stats")
        seen[:] = [families(q.admin_port), get_json(q.admin_port, "/v1/stats")]
        keys = ("demote_batches", "demotions", "ssd_reads", "promotions")
        return all(before["tiers"]["ssd"][k] == seen[1]["tiers"]["ssd"][k] for k in keys)
    assert wait_until(steady, 20)
    fams, stats = seen

    ssd = stats["tiers"]["ssd"]
    assert sample(fams, "quilld_demotion_batch_duration_seconds", "_count") == ssd["demote_batches"] >= 1
    assert sample(fams, "quilld_ssd_demotions", "_total") == ssd["demotions"]
    assert sample(fams, "quilld_ssd_read_duration_seconds", "_count") == ssd["ssd_reads"] >= 1
    assert sample(fams, "quilld_ssd_promotions", "_total") == ssd["promotions"] >= 1
    assert sample(fams, "quilld_route_duration_seconds", "_count") == stats["counters"]["routes"] == 1
    assert sample(fams, "quilld_route_duration_seconds", "_sum") > 0
    # commands: every call counted per family; the timed ones (a sample of GET and SET) in the histogram
    calls = sample(fams, "quilld_commands", "_total", family="string")
    assert calls == 80 + 1 + 64
    timed = sample(fams, "quilld_command_duration_seconds", "_count", family="string")
    assert 1 <= timed <= calls  # the dispatcher's sampling decides how many (latencystats)
    assert sample(fams, "quilld_command_duration_seconds", "_sum", family="string") > 0
    buckets = [s for s in fams["quilld_command_duration_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["family"] == "string"]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == timed
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)  # cumulative
    # per engine: its feed, its load, what the index holds for it
    assert sample(fams, "quilld_kv_engine_events", "_total", engine="vllm-0") == 1
    assert sample(fams, "quilld_kv_engine_batches", "_total", engine="vllm-0") == 1
    assert sample(fams, "quilld_kv_engine_last_sequence", engine="vllm-0") == -1
    assert sample(fams, "quilld_kv_engine_subscribed", engine="vllm-0") == 0
    assert sample(fams, "quilld_engine_in_flight", engine="vllm-0") == 1
    assert sample(fams, "quilld_residency_blocks", holder="vllm-0", tier="hbm") == 3
    assert sample(fams, "quilld_engines") == 1 and sample(fams, "quilld_hot_prefix_lookups", "_total") == 1
    assert sample(fams, "quilld_tenant_keyspace_hits", "_total", tenant="default") == \
        stats["tenants"]["default"]["keyspace_hits"] >= 65
    assert sample(fams, "quilld_dram_keys") == stats["tiers"]["dram"]["dram_keys"]
    assert sample(fams, "quilld_ssd_keys") == ssd["ssd_keys"]
    # nothing appeared that was not there from the start
    assert set(fams) == set(fresh), set(fams) ^ set(fresh)


def test_stats_keeps_one_copy_of_each_dram_figure_and_ssd_figures_under_ssd(quilld_factory, tmp_path):
    q = quilld_factory("--dram", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256MiB")
    stats = get_json(q.admin_port, "/v1/stats")
    dram, ssd = stats["tiers"]["dram"], stats["tiers"]["ssd"]
    assert all(k.startswith("dram_") for k in dram), sorted(dram)  # the arena's own names are gone
    assert "persistence" not in stats
    assert ssd["ssd_enabled"] == 1 and ssd["ssd_capacity"] > 0 and "demotions" not in dram
    assert get_json(quilld_factory("--dram", "64MiB").admin_port, "/v1/stats")["tiers"]["ssd"] == {"ssd_enabled": 0}


def test_the_ttft_histogram_and_peer_fetch_histogram_move(quilld_factory, tmp_path):
    """TTFT through the gateway (a fake engine), peer-fetch latency on a second node that fetched a block."""
    engine_port = free_port()
    with open(tmp_path / "engine.log", "wb") as log:
        engine = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port",
                                   str(engine_port), "--model", "tiny", "--delay-ms", "30"], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        wait_port(engine_port, engine)
        conf = tmp_path / "engines.toml"
        conf.write_text(f'[[engines]]\nid = "e1"\nmodel = "tiny"\nurl = "http://127.0.0.1:{engine_port}"\n')
        gossip_a, gateway = free_port(), free_port()
        a = quilld_factory("--dram", "64MiB", "--config", str(conf), "--gateway-port", str(gateway),
                           "--node-id", "a", "--gossip-port", str(gossip_a), env=FAST_GOSSIP)
        b = quilld_factory("--dram", "64MiB", "--node-id", "b", "--gossip-port", str(free_port()),
                           "--seeds", f"127.0.0.1:{gossip_a}", env=FAST_GOSSIP)
        fresh_b = families(b.admin_port)
        wait_port(gateway, a.proc)
        for _ in range(3):
            status, _, body = http_post(gateway, "/v1/completions", json.dumps({"model": "tiny",
                                                                                 "prompt": "hi"}).encode())
            assert status == 200, body
        fams = families(a.admin_port)
        assert sample(fams, "quilld_gateway_ttft_seconds", "_count") == 3
        assert sample(fams, "quilld_gateway_ttft_seconds", "_sum") >= 3 * 0.03
        assert sample(fams, "quilld_gateway_ttft_seconds", "_bucket", le="0.025") == 0  # each took >= 30 ms
        assert sample(fams, "quilld_gateway_requests", "_total") == sample(fams, "quilld_gateway_within_slo",
                                                                          "_total") == 3
        info = a.client().info("gateway")
        assert 30 <= info["gateway_ttft_p50_ms"] <= info["gateway_ttft_p99_ms"] <= 5000  # read off the histogram

        block = os.urandom(2 * MiB)
        a.client().set("blk", block)
        rb = b.client()
        assert wait_until(lambda: rb.execute_command("GETBLK", "blk") == block, 15), "b never fetched a's block"
        fams = families(b.admin_port)
        assert sample(fams, "quilld_cluster_enabled") == 1 and sample(fams, "quilld_cluster_members_alive") == 2
        fetches = sample(fams, "quilld_cluster_peer_fetches", "_total")
        assert fetches >= 1 and sample(fams, "quilld_peer_fetch_duration_seconds", "_count") == fetches
        assert set(fams) == set(fresh_b), set(fams) ^ set(fresh_b)
    finally:
        stop_process(engine)


def test_the_grafana_dashboard_loads_and_names_only_metrics_a_node_has(quilld):
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["panels"]
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 9
    panel_exprs = list(exprs)
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    fams = families(quilld.admin_port)
    exposed = sample_names(fams)
    types = {}
    for name, f in fams.items():
        for n in sample_names({name: f}):
            types[n] = f.type
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for wanted in ("ops/s", "latency", "dram", "ssd", "demotion", "promotion", "peer fetch", "route", "kv events",
                   "guard", "ttft", "cluster membership", "hit ratio", "ssd health", "http perimeter"):
        assert wanted in titles, (wanted, titles)
    # the node picker lists node ids (issue 18.7); the instances of the nodes picked are what panels select
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["node"]["definition"] == "label_values(quilld_build_info, node_id)"
    assert variables["node"].get("hide", 0) == 0 and variables["instance"]["hide"] == 2
    assert variables["instance"]["definition"] == 'label_values(quilld_build_info{node_id=~"$node"}, instance)'
    for expr in panel_exprs:
        assert 'instance=~"$instance"' in expr, expr
    legends = [t["legendFormat"] for p in board["panels"] for t in p.get("targets", [])]
    assert not [legend for legend in legends if "{{instance}}" in legend], legends  # series named by node id
    for expr in exprs:
        names = set(re.findall(r"\bquilld_[a-z0-9_]+", expr))
        assert names, expr
        for name in names:
            assert name in exposed, (name, expr)
        # rate() and increase() only over counters and histogram series
        for name in re.findall(r"(?:rate|increase)\(\s*(quilld_[a-z0-9_]+)", expr):
            assert types[name] in ("counter", "histogram"), (name, types[name], expr)
        if expr.startswith("histogram_quantile("):
            assert all(n.endswith("_bucket") and types[n] == "histogram" for n in names), expr
