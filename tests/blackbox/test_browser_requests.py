"""What a web page elsewhere can make a browser send to quilld's HTTP ports (issue 19, item 11).

With no password (the default) the admin API took a `text/plain` POST from any page:
the page's script replaced an engine's URL. Now a state-changing request whose Origin
or Host is not the admin API's own is refused 403, and one whose body is not declared
JSON 415; with no admin token, a request naming another host (DNS rebinding, which
would let a page read the answers) is refused too. The gateway, without a password,
follows the same rules but for the JSON content type. Shown with the attack itself, in
headless Chromium: a page served from another port posts to the admin API.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import http, stop_process, wait_port
from prometheus_client.parser import text_string_to_metric_families
from test_status_page import browse

pytestmark = pytest.mark.timeout(180)

ENGINE = '[[engines]]\nid = "e1"\nmodel = "m"\nurl = "http://127.0.0.1:9001"\n'
EVIL = json.dumps({"id": "e1", "model": "m", "url": "http://evil.example:1"}).encode()
JSON = {"Content-Type": "application/json"}


def engine_urls(port: int, headers: dict | None = None) -> dict[str, str]:
    status, _, body = http(port, "GET", "/v1/engines", headers=headers)
    assert status == 200, body
    return {e["id"]: e["url"] for e in json.loads(body)["engines"]}


def refusals(port: int, headers: dict | None = None) -> dict[tuple[str, str], float]:
    status, _, body = http(port, "GET", "/metrics", headers=headers)
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "quilld_http_requests_refused":
            for s in family.samples:
                out[(s.labels["listener"], s.labels["reason"])] = s.value
    return out


@pytest.fixture
def node(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINE)
    return quilld_factory("--dram", "32MiB", "--config", str(conf))


def test_a_page_elsewhere_cannot_replace_an_engine_through_a_browser(node, tmp_path):
    """The attack as a browser runs it: a page on another origin posts `text/plain` (no preflight)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text(f"""<!DOCTYPE html><html><body><p id="done">sending</p><script>
fetch("http://127.0.0.1:{node.admin_port}/v1/engines", {{method: "POST", mode: "no-cors",
      headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(EVIL.decode())}}})
  .finally(() => {{ document.getElementById("done").textContent = "sent"; }});
</script></body></html>""")
    from conftest import free_port
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_port(port, server)
        dom, _ = browse(f"http://127.0.0.1:{port}/index.html", tmp_path, "attack")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        stop_process(server)
    assert ">sent<" in dom, dom[:500]  # the page's request went out and came back (unreadable to it)
    assert engine_urls(node.admin_port) == {"e1": "http://127.0.0.1:9001"}
    assert refusals(node.admin_port)[("admin", "cross_origin")] == 1


def test_state_changing_admin_requests_come_from_its_own_origin_with_json(node):
    port = node.admin_port
    own = f"127.0.0.1:{port}"
    cases = [  # (headers, method, path, body, status, reason)
        ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, "POST", "/v1/engines", EVIL, 403,
         "cross_origin"),
        ({**JSON, "Origin": "http://evil.example"}, "POST", "/v1/engines", EVIL, 403, "cross_origin"),
        ({**JSON, "Origin": "null"}, "POST", "/v1/engines", EVIL, 403, "cross_origin"),
        ({**JSON, "Origin": f"http://127.0.0.1:{port + 1}"}, "POST", "/v1/engines", EVIL, 403, "cross_origin"),
        ({**JSON, "Sec-Fetch-Site": "cross-site"}, "POST", "/v1/engines", EVIL, 403, "cross_origin"),
        ({"Origin": "http://evil.example"}, "DELETE", "/v1/engines/e1", None, 403, "cross_origin"),
        ({"Content-Type": "text/plain"}, "POST", "/v1/engines", EVIL, 415, "content_type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, "POST", "/v1/kv-events", b"{}", 415,
         "content_type"),
        # DNS rebinding: the page's origin is its own name, resolved to 127.0.0.1; Origin and Host agree
        ({**JSON, "Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}, "POST",
         "/v1/engines", EVIL, 403, "foreign_host"),
        ({"Host": f"evil.example:{port}"}, "GET", "/v1/config", None, 403, "foreign_host"),  # and reading
    ]
    for headers, method, path, body, status, reason in cases:
        got, _, answer = http(port, method, path, body, headers)
        assert got == status, (headers, method, path, got, answer)
        assert reason in answer.decode() or json.loads(answer)["error"], answer
    assert engine_urls(port) == {"e1": "http://127.0.0.1:9001"}
    counted = refusals(port)
    assert counted[("admin", "cross_origin")] == 6 and counted[("admin", "content_type")] == 2
    assert counted[("admin", "foreign_host")] == 2
    # what tools and the admin API's own pages send is taken: JSON with no Origin (curl), or its own origin
    ok = json.dumps({"id": "e2", "model": "m", "url": "http://127.0.0.1:9002"}).encode()
    assert http(port, "POST", "/v1/engines", ok, JSON)[0] == 201
    assert http(port, "POST", "/v1/engines", ok, {"Content-Type": "application/json; charset=utf-8",
                                                   "Origin": f"http://{own}", "Sec-Fetch-Site": "same-origin"})[0] == 200
    assert http(port, "POST", "/v1/engines", ok, {**JSON, "Host": f"localhost:{port}"})[0] == 200
    assert http(port, "DELETE", "/v1/engines/e2", None, {"Origin": f"http://{own}"})[0] == 200
    assert http(port, "GET", "/v1/config", None, {"Host": f"[::1]:{port}"})[0] == 200
    assert "Traceback" not in node.log()


def test_allowed_hosts_names_the_hosts_a_proxy_reaches_quilld_by(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINE)
    q = quilld_factory("--dram", "32MiB", "--config", str(conf),
                       env={"QUILLD_SERVER_ALLOWED_HOSTS": "quilld.internal, cache.example"})
    port = q.admin_port
    assert http(port, "GET", "/v1/engines", None, {"Host": "cache.example"})[0] == 200
    assert http(port, "POST", "/v1/engines", EVIL, {**JSON, "Host": f"quilld.internal:{port}",
                                                     "Origin": f"http://quilld.internal:{port}"})[0] == 200
    assert http(port, "GET", "/v1/engines", None, {"Host": "other.example"})[0] == 403


def test_with_an_admin_token_reads_are_not_host_checked_but_writes_are(quilld_factory, tmp_path):
    q = quilld_factory("--dram", "32MiB", env={"QUILLD_ADMIN_TOKEN": "tok"})
    bearer = {"Authorization": "Bearer tok"}
    # a page cannot send the token: reads by any name are the operator's (a proxy, a scraper)
    assert http(q.admin_port, "GET", "/v1/stats", None, {**bearer, "Host": "metrics.example"})[0] == 200
    # state-changing requests keep the checks, after the token's
    assert http(q.admin_port, "POST", "/v1/engines", EVIL, {"Content-Type": "text/plain"})[0] == 401
    assert http(q.admin_port, "POST", "/v1/engines", EVIL, {**bearer, "Content-Type": "text/plain"})[0] == 415
    assert http(q.admin_port, "POST", "/v1/engines", EVIL, {**bearer, **JSON, "Origin": "http://evil.example"})[0] \
        == 403
    assert http(q.admin_port, "POST", "/v1/engines", EVIL, {**bearer, **JSON})[0] == 201


def test_the_gateway_without_a_password_takes_no_request_from_a_page_elsewhere(quilld_factory):
    from conftest import free_port
    gateway = free_port()
    q = quilld_factory("--dram", "32MiB", "--gateway-port", str(gateway))
    wait_port(gateway, q.proc)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    status, _, answer = http(gateway, "POST", "/v1/completions", body, {"Content-Type": "text/plain",
                                                                        "Origin": "http://evil.example"})
    assert status == 403 and json.loads(answer)["error"]["code"] == "cross_origin", answer
    status, _, answer = http(gateway, "GET", "/v1/models", None, {"Host": "evil.example"})
    assert status == 403 and json.loads(answer)["error"]["code"] == "foreign_host", answer
    # a tool's request (no Origin) reaches the gateway: no engine serves "m", so a 404 from the gateway itself
    status, _, answer = http(gateway, "POST", "/v1/completions", body, JSON)
    assert status == 404 and json.loads(answer)["error"]["code"] == "model_not_found", answer
    counted = refusals(q.admin_port)
    assert counted[("gateway", "cross_origin")] == 1 and counted[("gateway", "foreign_host")] == 1
