"""The admin API's status page (GET /) in a real browser: Debian's chromium, headless.

A real quilld (DRAM over an SSD tier, a gateway in front of a fake engine, and an
engine registered over the admin API with KV events and a request in flight) is
given traffic; chromium loads the page, lets its script fetch the JSON routes
(virtual time: the page's 2 s refresh runs twice), and dumps the DOM it built and
a screenshot (saved under the test's tmp dir). What the page shows is compared
with /v1/stats, /v1/engines and /v1/hot read right after. With an admin token the
page holds no data until it is given the token.

On a cluster of three with one peer killed (issue 18, item 6), the page's first
render (before its first refresh) shows current rates, latencies, errors, peer
fetches and pool reads, charts of the last minutes, every node with its SSD,
version and uptime, the dead one marked as such, and on which node the engines
are registered.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import redis
from conftest import ROOT, free_gossip_port, free_port, start_quilld, stop_process, wait_port, wait_until
from conftest import http as conftest_http

pytestmark = pytest.mark.timeout(180)

MiB = 1024 * 1024
BROWSER_TIMEOUT = 90.0  # seconds one chromium run may take before it is killed
VIRTUAL_TIME_MS = 5000  # the page's refresh (every 2 s) runs at 0, 2 and 4 s of virtual time
HTTP_TIMEOUT = 10.0
ENGINE_SCRIPT = ROOT / "tests" / "fake_engine.py"
VOID = frozenset({"meta", "link", "input", "br", "img", "hr"})  # elements without an end tag


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: .ci/run installs it (apt-get install chromium)")
    return path


def browse(url: str, tmp_path: Path, name: str, virtual_ms: int = VIRTUAL_TIME_MS) -> tuple[str, Path]:
    """Load `url` in headless chromium, its scripts running `virtual_ms` of virtual time; returns the
    DOM they built and the screenshot's path."""
    profile = tmp_path / f"chromium-{name}"
    shot = tmp_path / f"{name}.png"
    args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"--virtual-time-budget={virtual_ms}", f"--screenshot={shot}",
            "--window-size=1280,900", "--dump-dom", url]
    # its own session, so that on a timeout the browser and every process it started go at once
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BROWSER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish loading {url} within {BROWSER_TIMEOUT} s")
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no screenshot"
    return out.decode(), shot


class Page(HTMLParser):
    """What a dumped DOM shows: each element with an id (its data-value, its text, whether it
    or an ancestor is hidden, its attributes), the table rows of nodes, engines and command
    families (their cells and attributes), and the charts' series (the points each drew)."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.ids: dict[str, dict] = {}
        self.rows: dict[str, dict[str, list[dict]]] = {"data-engine": {}, "data-node": {}, "data-family": {}}
        self.row_attrs: dict[str, dict[str, dict]] = {key: {} for key in self.rows}
        self.series: dict[tuple[str, str], int] = {}  # (chart id, series name) -> points drawn
        self._stack: list[tuple[str, dict, list[str]]] = []
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        hidden = "hidden" in a or any(entry[1].get("_hidden") for entry in self._stack)
        a["_hidden"] = hidden
        if "data-points" in a:
            chart = next((entry[1]["id"] for entry in reversed(self._stack) if "id" in entry[1]), "")
            self.series[(chart, a.get("data-series", ""))] = int(a["data-points"])
        if tag in VOID:
            if "id" in a:
                self.ids[a["id"]] = {"value": a.get("data-value"), "text": "", "hidden": hidden}
            return
        self._stack.append((tag, a, []))

    def handle_data(self, data: str) -> None:
        for _, _, texts in self._stack:
            texts.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID or not self._stack:
            return
        while self._stack:
            name, a, texts = self._stack.pop()
            text = " ".join("".join(texts).split())
            if "id" in a:
                self.ids[a["id"]] = {"value": a.get("data-value"), "text": text, "hidden": a["_hidden"], "attrs": a}
            if name == "td":
                parent = self._stack[-1][1] if self._stack else {}
                parent.setdefault("_cells", []).append({"value": a.get("data-value"), "text": text})
            if name == "tr":
                for key in self.rows:
                    if key in a:
                        self.rows[key][a[key]] = a.get("_cells", [])
                        self.row_attrs[key][a[key]] = a
            if name == tag:
                return

    def value(self, element_id: str) -> float:
        raw = self.ids[element_id]["value"]
        assert raw not in (None, ""), (element_id, self.ids[element_id])
        return float(raw)

    def text(self, element_id: str) -> str:
        return self.ids[element_id]["text"]


def http(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple:
    data = None if body is None else json.dumps(body).encode()
    return conftest_http(port, method, path, data, {"Content-Type": "application/json", **(headers or {})},
                         HTTP_TIMEOUT)


def admin_json(port: int, path: str, body: dict | None = None, headers: dict | None = None) -> dict:
    status, _, raw = http(port, "GET" if body is None else "POST", path, body, headers)
    assert status in (200, 201), (path, status, raw[:300])
    return json.loads(raw)


@pytest.fixture
def engine(tmp_path):
    """A fake OpenAI-compatible engine (tests/fake_engine.py) on a free port: its port."""
    port = free_port()
    with open(tmp_path / "engine.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), "--port", str(port), "--model", "tiny",
                                 "--name", "fake-1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
        yield port
    finally:
        stop_process(proc)


def stored(engine_id: str, hashes: list[int]) -> dict:
    return {"engine_id": engine_id, "events": [{"type": "block_stored", "block_hashes": hashes,
                                                "parent_block_hash": None, "token_ids": [], "block_size": 16,
                                                "medium": "GPU"}]}


def settled(port: int, timeout: float = 30.0) -> dict:
    """/v1/stats once demotion has stopped moving (two reads 1 s apart agree on the tiers)."""
    last: list[dict] = [admin_json(port, "/v1/stats")]

    def same() -> bool:
        now = admin_json(port, "/v1/stats")
        prev, last[0] = last[0], now
        return now["tiers"] == prev["tiers"]

    assert wait_until(same, timeout, 1.0), "the tiers kept changing"
    return last[0]


def browse_still(port: int, tmp_path: Path, name: str, attempts: int = 3) -> tuple[str, Path, dict]:
    """The page loaded while the node stood still: /v1/stats the same before and after the load
    (a demotion batch still settling moves figures between the page's reads and ours)."""
    for attempt in range(attempts):
        before = settled(port)
        dom, shot = browse(f"http://127.0.0.1:{port}/", tmp_path, f"{name}-{attempt}" if attempt else name)
        after = admin_json(port, "/v1/stats")
        if after["tiers"] == before["tiers"] and after["counters"] == before["counters"]:
            return dom, shot, after
    pytest.fail(f"the node kept changing while the page loaded ({attempts} tries)")


def test_the_status_page_shows_what_the_json_routes_say(quilld_factory, engine, tmp_path):
    conf = tmp_path / "quilld.toml"
    conf.write_text(f'[[engines]]\nid = "fake-1"\nmodel = "tiny"\nurl = "http://127.0.0.1:{engine}"\n')
    gw_port = free_port()
    q = quilld_factory("--dram", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "256MiB",
                       "--config", str(conf), "--gateway-port", str(gw_port))
    wait_port(gw_port, q.proc)
    r = q.client()
    for i in range(96):  # 96 MiB into 64 MiB of DRAM: the coldest are demoted to SSD
        r.set(f"blk:{i}", os.urandom(MiB))
    assert wait_until(lambda: admin_json(q.admin_port, "/v1/stats")["tiers"]["ssd"]["ssd_keys"] >= 16, 20)
    for i in range(4):  # the oldest are SSD-only by now: reading them promotes them
        assert len(r.get(f"blk:{i}")) == MiB
    # an engine pushing its KV events, a hot prefix it holds, a request in flight on it
    admin_json(q.admin_port, "/v1/engines", {"id": "vllm-a", "model": "llama", "url": "http://127.0.0.1:9"})
    assert admin_json(q.admin_port, "/v1/kv-events", stored("vllm-a", [11, 12, 13]))["applied"] == 1
    for _ in range(3):
        assert admin_json(q.admin_port, "/v1/route", {"model": "llama", "blocks": [11, 12, 13, 14]})["engine"] == \
            "vllm-a"
    assert admin_json(q.admin_port, "/v1/route", {"model": "llama", "blocks": [11, 12], "acquire": True})["lease"]
    # two completions through the gateway: goodput against the SLO
    for _ in range(2):
        status, _, body = http(gw_port, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello"})
        assert status == 200, body
    dom, shot, stats = browse_still(q.admin_port, tmp_path, "status")
    page = Page(dom)
    assert not page.ids["main"]["hidden"] and page.ids["login"]["hidden"], dom[:2000]
    assert page.text("node-id") == stats["node_id"]
    dram, ssd = stats["tiers"]["dram"], stats["tiers"]["ssd"]
    for element, figure in (("dram-used", dram["dram_used"]), ("dram-capacity", dram["dram_capacity"]),
                            ("dram-keys", dram["dram_keys"]), ("dram-blocks", dram["dram_blocks"]),
                            ("ssd-used", ssd["ssd_used"]), ("ssd-capacity", ssd["ssd_capacity"]),
                            ("ssd-keys", ssd["ssd_keys"]), ("demotions", ssd["demotions"]),
                            ("promotions", ssd["promotions"]),
                            ("commands-processed", stats["counters"]["total_commands_processed"]),
                            ("goodput", stats["gateway"]["gateway_goodput"])):
        assert page.value(element) == figure, (element, page.ids[element], figure)
    assert page.text("dram-capacity") == "64.0 MiB"
    assert ssd["promotions"] >= 4 and ssd["demotions"] >= 16
    assert stats["gateway"]["gateway_slo_counted"] == 2 and page.text("goodput") == "100.0%"
    slo = stats["gateway"]["gateway_ttft_slo_ms"]
    assert page.text("gateway-counts") == f"SLO {slo} ms: 2 of 2 within · 0 in flight"
    for rate in ("demotion-rate", "promotion-rate", "ops-rate"):  # two refreshes happened: rates are shown
        assert page.value(rate) >= 0, page.ids[rate]
    # the node, and both engines: in-flight, cached blocks, the hot prefixes each holds
    assert list(page.rows["data-node"]) == [stats["node_id"]]
    assert "this node" in page.rows["data-node"][stats["node_id"]][0]["text"]
    engines = {e["id"]: e for e in admin_json(q.admin_port, "/v1/engines")["engines"]}
    assert set(page.rows["data-engine"]) == set(engines) == {"vllm-a", "fake-1"}
    a = page.rows["data-engine"]["vllm-a"]
    assert [c["text"] for c in a[:3]] == ["vllm-a", "llama", stats["node_id"]]  # homed on this node
    assert float(a[3]["value"]) == engines["vllm-a"]["in_flight"] == 1
    assert float(a[5]["value"]) == sum(engines["vllm-a"]["blocks"].values()) == 3
    hot = admin_json(q.admin_port, "/v1/hot")
    assert hot["top"][0]["holders"] == [{"holder": "vllm-a", "tier": "hbm"}]
    assert a[6]["text"] == f"1 of {len(hot['top'])}"
    assert float(page.rows["data-engine"]["fake-1"][3]["value"]) == 0
    assert page.text("engines-note") == f"The engines registered on {stats['node_id']}."
    # the node itself: its SSD, version and uptime beside its DRAM
    me = page.rows["data-node"][stats["node_id"]]
    assert me[2]["text"] == stats["version"] and float(me[3]["value"]) >= 0
    assert float(me[8]["value"]) == ssd["ssd_used"] and float(me[9]["value"]) == ssd["ssd_capacity"]
    assert "000000000000000b" in dom  # block 11, the hottest prefix
    assert "Traceback" not in q.log(), q.log()
    assert shot.stat().st_size > 20_000  # a rendered page, kept beside the test's logs


def test_with_an_admin_token_the_page_shows_nothing_until_given_it(quilld_factory, tmp_path):
    q = quilld_factory("--dram", "64MiB", env={"QUILLD_ADMIN_TOKEN": "page-tok"})
    bearer = {"Authorization": "Bearer page-tok"}
    node_id = admin_json(q.admin_port, "/v1/stats", headers=bearer)["node_id"]
    status, headers, html = http(q.admin_port, "GET", "/")  # the page itself needs no token, and holds no data
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert node_id.encode() not in html and b"http://" not in html and b"https://" not in html
    assert http(q.admin_port, "GET", "/v1/stats")[0] == 401

    for name, query, meta in (("no-token", "", "admin token needed"),
                              ("wrong-token", "?token=nope", "wrong or missing admin token")):
        page = Page(browse(f"http://127.0.0.1:{q.admin_port}/{query}", tmp_path, name)[0])
        assert page.ids["main"]["hidden"] and not page.ids["login"]["hidden"], name
        assert node_id not in page.text("node-id") and page.text("meta") == meta, name
        assert page.ids["dram-capacity"]["value"] is None, name  # nothing was filled in

    dom, _ = browse(f"http://127.0.0.1:{q.admin_port}/?token=page-tok", tmp_path, "token")
    page = Page(dom)
    assert not page.ids["main"]["hidden"] and page.ids["login"]["hidden"]
    assert page.text("node-id") == node_id
    assert page.value("dram-capacity") == 64 * MiB
    assert "page-tok" not in dom  # taken out of the address and the page once stored


def test_a_page_waiting_for_its_token_asks_once_and_is_not_counted_as_a_brute_force(quilld_factory, tmp_path):
    """Issue 29, item 4: a tab left at the token form (none given, or a wrong one) asked six routes every
    2 s without the token: one 5 s load added 19 to the refusals (`quilld_http_requests_refused_total
    {reason="token"}` and the page's "auth failures"). It asks once, then waits for the token."""
    q = quilld_factory("--dram", "64MiB", env={"QUILLD_ADMIN_TOKEN": "page-tok"})
    bearer = {"Authorization": "Bearer page-tok"}

    def refused() -> tuple[int, float]:
        stats = admin_json(q.admin_port, "/v1/stats", headers=bearer)
        status, _, body = http(q.admin_port, "GET", "/metrics", headers=bearer)
        assert status == 200
        line = 'quilld_http_requests_refused_total{listener="admin",reason="token"} '
        metric = [float(x.removeprefix(line)) for x in body.decode().splitlines() if x.startswith(line)]
        assert stats["http"]["admin"]["requests_refused"].get("token", 0) == (metric[0] if metric else 0)
        return stats["http"]["admin"]["requests_refused"].get("token", 0), \
            admin_json(q.admin_port, "/v1/history", headers=bearer)["totals"]["auth_failures"]

    for name, query in (("idle-no-token", ""), ("idle-wrong-token", "?token=nope")):
        before = refused()
        page = Page(browse(f"http://127.0.0.1:{q.admin_port}/{query}", tmp_path, name)[0])  # 5 s: 3 refreshes
        assert not page.ids["login"]["hidden"], name
        after = refused()
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (name, before, after)


# -- a cluster: every node's figures, a dead peer, the node's last minutes ------------------------------------
FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}
FIRST_RENDER_MS = 1000  # less than the page's 2 s refresh: what its first render shows


def members(port: int, headers: dict) -> dict[str, str]:
    return {m["id"]: m["state"] for m in admin_json(port, "/v1/nodes", headers=headers)["nodes"]}


def test_a_cluster_page_shows_every_node_marks_the_dead_one_and_draws_the_last_minutes(tmp_path, nodes):
    env = {**FAST_GOSSIP, "QUILLD_CLUSTER_SECRET": "page-secret", "QUILLD_SECURITY_REQUIREPASS": "pw"}
    gossip = {name: free_gossip_port() for name in "abc"}
    started = {}
    for name in "abc":
        extra = ["--node-id", name, "--gossip-port", str(gossip[name]), "--dram", "64MiB"]
        if name == "a":
            extra += ["--ssd-dir", str(tmp_path / "ssd-a"), "--ssd-size", "256MiB"]
        else:
            extra += ["--seeds", f"127.0.0.1:{gossip['a']}"]
        started[name] = start_quilld(tmp_path, *extra, env=env)
        nodes.append(started[name])
    a, b, c = started["a"], started["b"], started["c"]
    bearer = a.admin_headers()
    assert wait_until(lambda: members(a.admin_port, bearer) == dict.fromkeys("abc", "alive"), 30)
    ra, rb = a.client(password="pw"), b.client(password="pw")
    blocks = {f"b:{i}": os.urandom(MiB) for i in range(8)}
    for key, data in blocks.items():  # held by b
        rb.set(key, data)
    for i in range(4):  # fetched from b by a: peer fetches
        assert wait_until(lambda: ra.execute_command("GETBLK", f"b:{i}") == blocks[f"b:{i}"], 20)
    assert ra.get("b:6") == blocks["b:6"]  # a pool read: GET sees the whole pool
    for i in range(40):
        ra.set(f"a:{i}", os.urandom(256 * 1024))
        assert ra.get(f"a:{i}") is not None
    assert ra.get("nowhere") is None
    with pytest.raises(redis.ResponseError):
        ra.execute_command("GET")  # a command error
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=a.port, password="wrong", socket_timeout=10).ping()  # an auth failure
    admin_json(a.admin_port, "/v1/engines", {"id": "vllm-a", "model": "llama", "url": "http://127.0.0.1:9"}, bearer)
    assert admin_json(a.admin_port, "/v1/route", {"model": "llama", "blocks": [1, 2]}, bearer)["engine"] == "vllm-a"
    c.proc.send_signal(signal.SIGKILL)  # a peer dies
    c.proc.wait(10)
    assert wait_until(lambda: members(a.admin_port, bearer)["c"] == "dead", 30), members(a.admin_port, bearer)

    def totals() -> tuple:
        h = admin_json(a.admin_port, "/v1/history", headers=bearer)
        string = next(f["calls"] for f in h["families"] if f["family"] == "string")
        return tuple(h["totals"][k] for k in ("command_errors", "auth_failures", "peer_fetches", "pool_reads")), \
            string

    for attempt in range(3):  # the page's first render, taken while these figures stood still
        before = totals()
        dom, shot = browse(f"http://127.0.0.1:{a.admin_port}/?token={a.admin_token}", tmp_path,
                           f"cluster-{attempt}", FIRST_RENDER_MS)
        if totals() == before:
            break
    else:
        pytest.fail(f"the figures kept moving while the page loaded: {before} {totals()}")
    (errors, auth_failures, peer_fetches, pool_reads), string_calls = before
    page = Page(dom)
    assert not page.ids["main"]["hidden"], dom[:2000]
    # the first render has current rates and latencies (the node's own history), not "–"
    for element in ("ops-rate", "demotion-rate", "promotion-rate", "command-errors-rate", "refused-rate",
                    "auth-failures-rate", "peer-fetch-rate", "pool-read-rate"):
        assert page.value(element) >= 0, (element, page.ids[element])
    # errors, refusals and failed credentials; peer fetches and pool reads: as the node counts them
    assert page.value("command-errors") == errors >= 1
    assert page.value("auth-failures") == auth_failures >= 1
    assert page.value("peer-fetches") == peer_fetches >= 4 and page.value("pool-reads") == pool_reads >= 1
    family = page.rows["data-family"]["string"]
    assert float(family[5]["value"]) == string_calls >= 80 and float(family[3]["value"]) > 0  # p50 of the minute
    # charts of the last minutes, drawn by the page itself
    for chart, series, least in (("chart-rates", "ops/s", 2), ("chart-rates", "peer fetches/s", 2),
                                 ("chart-hits", "keyspace", 1), ("chart-latency", "command p50", 1),
                                 ("chart-latency", "peer fetch p99", 1), ("chart-latency", "ROUTE p99", 1),
                                 ("chart-errors", "command errors/s", 2), ("chart-errors", "auth failures/s", 2)):
        assert page.series.get((chart, series), 0) >= least, (chart, series, page.series)
    # every node, with its SSD, version and uptime; the dead one marked, its figures its last known
    assert set(page.rows["data-node"]) == {"a", "b", "c"}
    kinds = {n: page.row_attrs["data-node"][n]["data-kind"] for n in "abc"}
    assert kinds == {"a": "current", "b": "current", "c": "dead"}, kinds
    dead = page.rows["data-node"]["c"]
    assert dead[1]["text"].startswith("dead") and "last known figures" in dead[1]["text"], dead[1]
    version = admin_json(a.admin_port, "/v1/stats", headers=bearer)["version"]
    for name in "ab":
        row = page.rows["data-node"][name]
        assert row[2]["text"] == version and float(row[3]["value"]) >= 0, row
    assert float(page.rows["data-node"]["a"][9]["value"]) == 256 * MiB  # a's SSD tier
    assert page.rows["data-node"]["b"][9]["text"] == "no SSD"
    # the header says the cluster is not whole
    assert page.ids["health-dot"]["attrs"]["data-state"] == "degraded"
    assert "1 of 3 nodes dead" in page.text("meta"), page.text("meta")
    # engines are the cluster's: the page says where each is homed
    assert page.rows["data-engine"]["vllm-a"][2]["text"] == "a"
    assert "Every engine of the cluster" in page.text("engines-note")
    assert "Traceback" not in a.log()
    assert shot.stat().st_size > 20_000
