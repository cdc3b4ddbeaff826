"""/metrics follows Prometheus's naming rules (issue 18, item 5): `promtool check metrics`
(Debian's prometheus package) finds nothing in a scrape of a busy node: SSD tier demoting
and promoting, a cluster of two with a peer fetch, a gateway in front of a fake engine, an
engine with KV events and routes, command errors. Figures INFO keeps in milliseconds or
microseconds are exposed in seconds, sizes in bytes, each under its renamed metric.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, free_port, http, stop_process, wait_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024
FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: .ci/run installs it (apt-get install prometheus)")
    return path


def scrape(port: int) -> str:
    status, _, body = http(port, "GET", "/metrics")
    assert status == 200, body
    return body.decode()


def promtool_findings(text: str) -> tuple[int, str]:
    """`promtool check metrics` on a scrape: its exit status and what it printed."""
    done = subprocess.run([promtool(), "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    return done.returncode, (done.stdout + done.stderr).decode()


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http(port, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


@pytest.fixture
def engine(tmp_path):
    port = free_port()
    with open(tmp_path / "engine.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port", str(port),
                                 "--model", "tiny"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
        yield port
    finally:
        stop_process(proc)


def test_promtool_finds_nothing_in_a_busy_nodes_scrape(quilld_factory, engine, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(f'[[engines]]\nid = "e1"\nmodel = "tiny"\nurl = "http://127.0.0.1:{engine}"\n')
    gossip_a, gateway = free_port(), free_port()
    a = quilld_factory("--dram", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256MiB",
                       "--config", str(conf), "--gateway-port", str(gateway), "--node-id", "a",
                       "--gossip-port", str(gossip_a), env=FAST_GOSSIP)
    b = quilld_factory("--dram", "64MiB", "--node-id", "b", "--gossip-port", str(free_port()),
                       "--seeds", f"127.0.0.1:{gossip_a}", env=FAST_GOSSIP)
    wait_port(gateway, a.proc)
    ra, rb = a.client(), b.client()
    for i in range(80):  # 80 MiB into 64 MiB: demotion batches, fsyncs
        ra.set(f"blk:{i}", os.urandom(MiB))
    assert wait_until(lambda: ra.info("persistence")["ssd_keys"] >= 8, 30)
    assert len(ra.get("blk:0")) == MiB  # SSD-only by now: a read and a promotion
    with pytest.raises(Exception):
        ra.execute_command("GET")  # a command error
    assert post(a.admin_port, "/v1/engines", {"id": "vllm-0", "model": "m", "url": "http://127.0.0.1:9"})[0] == 201
    assert post(a.admin_port, "/v1/kv-events", {"engine_id": "vllm-0", "events": [
        {"type": "block_stored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [],
         "block_size": 16}]})[0] == 200
    assert post(a.admin_port, "/v1/route", {"model": "m", "blocks": [1, 2, 3]})[1]["engine"] == "vllm-0"
    for _ in range(2):
        assert post(gateway, "/v1/completions", {"model": "tiny", "prompt": "hello"})[0] == 200
    assert wait_until(lambda: rb.execute_command("GETBLK", "blk:79") is not None, 20), "b never fetched a's block"

    for node in (a, b):
        text = scrape(node.admin_port)
        code, findings = promtool_findings(text)
        assert (code, findings) == (0, ""), findings
        names = {f.name for f in text_string_to_metric_families(text)}
        # no unit but a base one, and none in the middle of a name
        assert not [n for n in names if re.search(r"_(ms|usec|us|msec|kb|mb)(_|$)", n)], sorted(names)
        assert not [n for n in names if "_total" in n], sorted(names)  # the parser strips a counter's one

    # the renamed figures, in their base units: INFO's milliseconds are the metrics' seconds (a scrape
    # between two INFO reads that agree, so that both describe the same moment)
    seen: list = []

    def steady() -> bool:
        before = ra.info("persistence")
        seen[:] = [{f.name: f for f in text_string_to_metric_families(scrape(a.admin_port))}, ra.info("persistence")]
        return before == seen[1]

    assert wait_until(steady, 20)
    fams, persistence = seen

    def value(name: str) -> float:
        (s,) = [s for s in fams[name].samples if not s.labels]
        return s.value

    assert value("quilld_dram_capacity_bytes") == 64 * MiB
    assert value("quilld_ssd_capacity_bytes") == 256 * MiB
    assert value("quilld_recovery_duration_seconds") == persistence["recovery_ms"] / 1000
    assert value("quilld_gateway_ttft_slo_seconds") == 0.8
    assert value("quilld_ssd_fsync_seconds") == pytest.approx(persistence["ssd_fsync_total_ms"] / 1000)
    assert fams["quilld_ssd_fsync_seconds"].type == "counter"
    assert value("quilld_ssd_fsync_max_seconds") == pytest.approx(persistence["ssd_fsync_max_ms"] / 1000)
    assert value("quilld_ssd_demote_seconds") > 0 and fams["quilld_ssd_demote_seconds"].type == "counter"
    assert value("quilld_cluster_gossip_received_bytes") > 0
