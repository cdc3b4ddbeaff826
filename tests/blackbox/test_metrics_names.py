"""/metrics follows Prometheus's naming rules (issue 18, item 5): `promtool check metrics`
(Debian's prometheus package) finds nothing in a scrape of a busy node: SSD tier demoting
and promoting, a cluster of two with a peer fetch, a gateway in front of a fake engine, an
engine with KV events and routes, command errors. Figures INFO keeps in milliseconds or
microseconds are exposed in seconds, sizes in bytes, each under its renamed metric.

The Grafana dashboard (issue 18, item 7): promtool parses every query, and a real
Prometheus scraping two nodes answers each of them; its node picker lists node ids.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse

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


def info_names(port: int, section: str) -> list[str]:
    """The figure names of one INFO section as sent, in order (redis-py's dict would hide a repeated one)."""
    done = subprocess.run(["redis-cli", "-p", str(port), "info", section], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [line.split(":", 1)[0] for line in done.stdout.decode().splitlines() if ":" in line]


@pytest.mark.parametrize("shape", ["single", "cluster", "ssd", "gateway"])
def test_promtool_passes_a_fresh_scrape_of_every_shape_of_node(quilld_factory, tmp_path, shape):
    """Issue 29, item 3: each shape of node as started, before any traffic (what a new operator scrapes
    first): a plain one, one of a cluster of two, one with an SSD tier, one with a gateway. promtool
    exits 0 on each; no metric family is there twice, and no INFO section repeats a figure's name."""
    def check(n) -> None:
        text = scrape(n.admin_port)
        code, findings = promtool_findings(text)
        assert (code, findings) == (0, ""), findings
        helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
        assert len(helps) == len(set(helps)), sorted({h for h in helps if helps.count(h) > 1})
        for section in ("cluster", "persistence", "stats"):
            names = info_names(n.port, section)
            assert len(names) == len(set(names)), (section, sorted({x for x in names if names.count(x) > 1}))

    args: dict[str, tuple[str, ...]] = {
        "single": (),
        "cluster": ("--node-id", "a", "--gossip-port", str(free_port())),
        "ssd": ("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "64MiB"),
        "gateway": ("--gateway-port", str(free_port())),
    }
    node = quilld_factory("--dram", "32MiB", *args[shape], env=FAST_GOSSIP)
    if shape == "cluster":
        peer = quilld_factory("--dram", "32MiB", "--node-id", "b", "--gossip-port", str(free_port()),
                              "--seeds", f"127.0.0.1:{args['cluster'][3]}", env=FAST_GOSSIP)
        assert wait_until(lambda: node.client().info("cluster")["cluster_members_alive"] == 2, 20)
        for n in (node, peer):
            check(n)
        # the peer killed: a's placements to it fail (the directory's batches and the link's messages)
        peer.proc.kill()
        peer.proc.wait(10)
        r = node.client()

        def failed() -> bool:
            r.set(f"k{time.monotonic()}", b"v")
            return r.info("cluster").get("cluster_directory_message_failures", 0) > 0

        assert wait_until(failed, 20, 0.2)
        nodes_ = (node,)
    else:
        nodes_ = (node,)
    for n in nodes_:
        check(n)


DASHBOARD = ROOT / "conf" / "grafana-quilld.json"


def test_every_query_of_the_dashboard_is_promql_promtool_accepts(tmp_path):
    """The dashboard's queries (conf/grafana-quilld.json), Grafana's variables given values, as recording
    rules: `promtool check rules` parses each (a typo, a bad `by`, a vector matching that cannot work)."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 40
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(exprs):
        concrete = expr.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$node", ".*")
        assert "$" not in concrete, expr
        rules += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(concrete)}"]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text("\n".join(rules) + "\n")
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout.decode(), done.stdout.decode()


def prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed: .ci/run installs it (apt-get install prometheus)")
    return path


def test_a_real_prometheus_answers_every_dashboard_query_and_picks_nodes_by_id(quilld_factory, tmp_path):
    """Prometheus (Debian's) scrapes two nodes each second; every query of the dashboard is asked of it:
    each evaluates, the node picker lists node ids, and the per-node panels name their series by node id."""
    gossip = free_port()
    a = quilld_factory("--node-id", "alpha", "--gossip-port", str(gossip), "--dram", "64MiB", "--ssd-dir",
                       str(tmp_path / "ssd"), "--ssd-size", "256MiB", env=FAST_GOSSIP)
    b = quilld_factory("--node-id", "beta", "--gossip-port", str(free_port()), "--seeds", f"127.0.0.1:{gossip}",
                       "--dram", "64MiB", env=FAST_GOSSIP)
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: quilld\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{a.admin_port}', '127.0.0.1:{b.admin_port}']\n")
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen([prometheus(), f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, prom, 60)

        def query(expr: str) -> dict:
            status, _, body = http(port, "GET", "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            return json.loads(body)

        def scraped() -> bool:  # both nodes, several scrapes each: rates over 5 s have their samples
            got = query("count_over_time(quilld_build_info[10s])")
            return len(got["data"]["result"]) == 2 and all(float(r["value"][1]) >= 4 for r in got["data"]["result"])

        ra, rb = a.client(), b.client()
        for i in range(24):
            ra.set(f"k{i}", os.urandom(MiB))
            assert ra.get(f"k{i}") is not None and ra.get("missing") is None
            rb.get(f"k{i}")  # a pool read
        assert wait_until(scraped, 60), (tmp_path / "prometheus.log").read_text()[-2000:]
        board = json.loads(DASHBOARD.read_text())
        picker = {v["name"]: v for v in board["templating"]["list"]}["node"]["definition"]
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", picker).groups()
        ids = {r["metric"][label] for r in query(f"count by ({label}) ({metric})")["data"]["result"]}
        assert ids == {"alpha", "beta"}  # node ids, not admin addresses
        answered = {}
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "5s").replace("$instance", ".*")
                got = query(expr)
                assert got["status"] == "success", (panel["title"], expr, got)
                answered[(panel["title"], target["legendFormat"])] = got["data"]["result"]
        for key in (("DRAM use", "used {{node_id}}"), ("Cluster membership", "alive seen by {{node_id}}"),
                    ("Hit ratio", "keyspace {{node_id}}"), ("SSD health", "failed {{node_id}}"),
                    ("HTTP connections", "cap {{listener}}")):
            assert answered[key], key
        assert {r["metric"]["node_id"] for r in answered[("DRAM use", "used {{node_id}}")]} == {"alpha", "beta"}
        alive = {r["metric"]["node_id"]: float(r["value"][1]) for r in answered[("Cluster membership",
                                                                                 "alive seen by {{node_id}}")]}
        assert alive == {"alpha": 2, "beta": 2}
    finally:
        stop_process(prom)
