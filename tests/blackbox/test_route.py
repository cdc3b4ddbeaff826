"""ROUTE, KVEVENTS and engine residencies against a real quilld with configured engines."""

from __future__ import annotations

import json
import socket
import time

import msgpack
import pytest
import redis
import zmq

from conftest import free_port, http, read_lines, wait_until

ENGINES = """
[[engines]]
id = "e1"
url = "http://127.0.0.1:9001"
model = "m"

[[engines]]
id = "e2"
url = "http://127.0.0.1:9002"
model = "m"

[[engines]]
id = "other"
url = "http://127.0.0.1:9003"
model = "not-m"
"""


MiB = 1024 * 1024


def read_reply_line(s: socket.socket) -> bytes:
    return read_lines(s, 1).rstrip(b"\r\n")


def stored(hashes, medium="GPU", lora=None):
    ev = {"type": "block_stored", "block_hashes": hashes, "block_size": 16}
    if medium:
        ev["medium"] = medium
    if lora:
        ev["lora_name"] = lora
    return ev


@pytest.fixture
def routed(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINES)
    q = quilld_factory("--config", str(conf))
    r = q.client(protocol=2, decode_responses=False)
    assert r.execute_command("SCOPE", "m", "") == b"OK"
    return q, r


def publish_until_applied(pub, r, hashes: list[int]) -> int:
    """Publish one vLLM BlockStored batch until quilld applies it (a ZMQ subscription takes a
    moment to join); returns the next sequence number."""
    payload = msgpack.packb([time.time(), [["BlockStored", hashes, None, list(range(16 * len(hashes))), 16,
                                             None, "GPU"]], 0])
    seq = 0

    def delivered() -> bool:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        return r.info("stats")["kv_batches"] > 0

    assert wait_until(delivered, timeout=10, interval=0.1), "no KV event reached quilld"
    return seq


def route(r, **req):
    reply = r.execute_command("ROUTE", json.dumps(req))
    return {reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 2)}


def test_the_engine_holding_the_prefix_wins_and_the_plan_says_why(routed):
    q, r = routed
    assert r.execute_command("KVEVENTS", "e2", json.dumps({"events": [stored(list(range(1, 7)))]})) == 1
    d = route(r, blocks=list(range(1, 9)))
    assert d["engine"] == b"e2" and d["url"] == b"http://127.0.0.1:9002"
    assert d["plan"] == [b"hit:e2:hbm"] * 6 + [b"recompute"] * 2
    assert float(d["cost"]) == 2.0
    engines = {c[1] for c in d["candidates"]}
    assert engines == {b"e1", b"e2"}  # never the engine of another model
    located = r.execute_command("LOCATE", "3")
    assert located[0][0][1] == b"e2" and located[0][0][3] == b"hbm"


def test_cpu_tier_credits_less_than_hbm_and_removal_and_clear_work(routed):
    q, r = routed
    r.execute_command("KVEVENTS", "e1", json.dumps({"events": [stored([1, 2, 3, 4], medium="CPU")]}))
    r.execute_command("KVEVENTS", "e2", json.dumps({"events": [stored([1, 2, 3, 4])]}))
    d = route(r, blocks=[1, 2, 3, 4])
    credits = {c[1]: float(c[5]) for c in d["candidates"]}
    assert credits == {b"e1": 3.0, b"e2": 4.0}
    r.execute_command("KVEVENTS", "e2", json.dumps({"events": [{"type": "block_removed", "block_hashes": [1]}]}))
    assert route(r, blocks=[1, 2, 3, 4])["engine"] == b"e1"
    r.execute_command("KVEVENTS", "e1", json.dumps({"events": [{"type": "all_blocks_cleared"}]}))
    d = route(r, blocks=[1, 2, 3, 4])
    assert all(float(c[5]) == 0.0 for c in d["candidates"])


def test_acquired_requests_spread_a_burst_and_release_frees_them(routed):
    q, r = routed
    r.execute_command("KVEVENTS", "e1", json.dumps({"events": [stored([7, 8])]}))
    leases, chosen = [], []
    for _ in range(8):
        d = route(r, blocks=[7, 8, 9, 10], acquire=True)
        chosen.append(d["engine"])
        leases.append(d["lease"])
    assert set(chosen) == {b"e1", b"e2"}
    assert all(r.execute_command("RELEASE", lease) == 1 for lease in leases)
    assert r.execute_command("RELEASE", leases[0]) == 0
    assert route(r, blocks=[7, 8, 9, 10])["engine"] == b"e1"


def test_no_reuse_across_identities_and_refusals_are_counted(routed, quilld_factory):
    q, r = routed
    r.execute_command("KVEVENTS", "e1", json.dumps({"events": [stored([100, 101, 102], lora="adapter-x")]}))
    before = r.info("stats")["guard_refusals"]
    d = route(r, blocks=[100, 101, 102])  # scope m, no adapter: the adapter-x blocks do not count
    assert all(float(c[5]) == 0.0 for c in d["candidates"])
    assert r.info("stats")["guard_refusals"] == before + 1
    assert r.info("stats")["guard_refusals_cross_adapter"] >= 1
    r.execute_command("SCOPE", "m", "", "adapter-x")
    assert route(r, blocks=[100, 101, 102])["engine"] == b"e1"


def test_tokens_are_hashed_into_prefix_preserving_blocks(routed):
    q, r = routed
    a = route(r, tokens=list(range(64)), block_size=16)
    assert len(a["plan"]) == 4
    with pytest.raises(redis.ResponseError, match="unknown field"):
        route(r, blox=[1])
    with pytest.raises(redis.ResponseError, match="malformed KV event"):
        r.execute_command("KVEVENTS", "e1", "{not json")
    with pytest.raises(redis.ResponseError, match="no engine"):
        r.execute_command("KVEVENTS", "nope", json.dumps({"events": []}))
    assert r.info("stats")["kv_malformed"] == 1


def test_a_real_zmq_publisher_feeds_the_index(quilld_factory, tmp_path):
    port = free_port()
    conf = tmp_path / "zmq.toml"
    conf.write_text(f"""
[[engines]]
id = "live"
url = "http://127.0.0.1:9100"
model = "m"
kv_events = "tcp://127.0.0.1:{port}"
""")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        q = quilld_factory("--config", str(conf))
        r = q.client(protocol=2)
        r.execute_command("SCOPE", "m", "")
        seq = publish_until_applied(pub, r, [11, 12, 13])
        d = route(r, blocks=[11, 12, 13])
        assert d["engine"] == b"live" and d["plan"] == [b"hit:live:hbm"] * 3
        pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1not msgpack"])
        assert wait_until(lambda: r.info("router")["kv_zmq_malformed"] == 1, timeout=5)
        assert r.info("router")["kv_subscriptions"] == 1
    finally:
        pub.close()
        ctx.term()


def test_admin_api_engines_route_events_and_hot(routed):
    import urllib.error
    import urllib.request

    q, r = routed
    base = f"http://127.0.0.1:{q.admin_port}"

    def call(method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = call("POST", "/v1/engines", {"id": "e4", "url": "http://127.0.0.1:9004", "model": "m"})
    assert status == 201 and body["id"] == "e4"
    assert call("POST", "/v1/engines", {"id": "bad"})[0] == 400
    assert {e["id"] for e in call("GET", "/v1/engines")[1]["engines"]} == {"e1", "e2", "other", "e4"}
    status, body = call("POST", "/v1/kv-events", {"engine_id": "e4", "events": [stored([5, 6, 7])]})
    assert (status, body["applied"]) == (200, 1)
    assert call("POST", "/v1/kv-events", {"engine_id": "e4", "events": [{"type": "nope"}]})[0] == 400
    status, body = call("POST", "/v1/route", {"model": "m", "blocks": [5, 6, 7, 8]})
    assert status == 200 and body["engine"] == "e4"
    assert [s["action"] for s in body["plan"]] == ["hit", "hit", "hit", "recompute"]
    assert call("POST", "/v1/route", {"model": "nobody-serves-this", "blocks": [1]})[0] == 503
    assert call("POST", "/v1/route", {"blocks": [1]})[0] == 400
    assert route(r, blocks=[5, 6, 7])["engine"] == b"e4"  # the RESP side sees the same index
    status, body = call("DELETE", "/v1/engines/e4")
    assert status == 200 and body["residencies_dropped"] == 3
    assert call("DELETE", "/v1/engines/e4")[0] == 404
    hot = call("GET", "/v1/hot")[1]
    assert hot["total"] >= 2 and hot["top"][0]["count"] >= 1
    info = r.info("router")
    assert info["engines"] == 3 and info["routes"] >= 2


def test_session_affinity_holds_while_its_engine_is_eligible(routed):
    q, r = routed
    r.execute_command("KVEVENTS", "e2", json.dumps({"events": [stored([30, 31])]}))
    assert route(r, blocks=[30, 31, 32], session="chat-1")["engine"] == b"e2"
    r.execute_command("KVEVENTS", "e1", json.dumps({"events": [stored([30, 31, 32], medium="GPU")]}))
    assert route(r, blocks=[30, 31, 32])["engine"] == b"e1"  # hotter now, for a request without a session
    assert route(r, blocks=[30, 31, 32], session="chat-1")["engine"] == b"e2"  # the session stays put


def test_an_engine_added_at_run_time_is_subscribed_and_removal_unsubscribes(routed):
    import urllib.request

    q, r = routed
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")

    def call(method, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{q.admin_port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    try:
        call("POST", "/v1/engines", {"id": "late", "url": "http://127.0.0.1:9200", "model": "m",
                                     "kv_events": f"tcp://127.0.0.1:{port}"})
        assert r.info("router")["kv_subscriptions"] == 1
        publish_until_applied(pub, r, [41, 42])
        assert route(r, blocks=[41, 42])["engine"] == b"late"
        assert call("DELETE", "/v1/engines/late")["residencies_dropped"] == 2
        assert r.info("router")["kv_subscriptions"] == 0
        assert route(r, blocks=[41, 42])["engine"] != b"late"
    finally:
        pub.close()
        ctx.term()


def put_block(r, key, data, bhash):
    handle = r.execute_command("PUT2PHASE", "BEGIN", key, len(data), "HASH", bhash)
    r.execute_command("PUT2PHASE", "DATA", handle, 0, data)
    assert r.execute_command("PUT2PHASE", "COMMIT", handle) == b"OK"


def test_blocks_in_this_pool_are_credited_as_host_memory_and_fetched(routed):
    q, r = routed
    for h in (1, 2, 3, 4):
        put_block(r, f"kv:{h}", bytes([h]) * 20000, h)
    r.execute_command("KVEVENTS", "e1", json.dumps({"events": [stored([1, 2])]}))
    d = route(r, blocks=[1, 2, 3, 4, 5])
    credits = {c[1]: float(c[5]) for c in d["candidates"]}
    assert credits == {b"e1": 2 * 1.0 + 2 * 0.75, b"e2": 4 * 0.75}
    assert d["engine"] == b"e1"
    assert d["plan"][:2] == [b"hit:e1:hbm"] * 2
    assert all(p.startswith(b"fetch:") and p.endswith(b":dram") for p in d["plan"][2:4])
    assert d["plan"][4] == b"recompute"
    # a deleted or overwritten block stops counting; a hash in another scope never counts
    r.delete("kv:3")
    r.set("kv:4", b"x" * 20000)  # a plain SET names no block hash
    credits = {c[1]: float(c[5]) for c in route(r, blocks=[1, 2, 3, 4])["candidates"]}
    assert credits == {b"e1": 2.0, b"e2": 2 * 0.75}
    other = q.client(protocol=2, decode_responses=False)
    assert other.execute_command("SCOPE", "m", "", "adapter-y") == b"OK"
    put_block(other, "kv:9", b"y" * 20000, 9)
    credits = {c[1]: float(c[5]) for c in route(r, blocks=[9])["candidates"]}
    assert credits == {b"e1": 0.0, b"e2": 0.0}
    with pytest.raises(redis.ResponseError, match="syntax error"):
        r.execute_command("PUT2PHASE", "BEGIN", "k", 10, "HASH", 1, "HASH", 2)
    with pytest.raises(redis.ResponseError, match="bad block hash"):
        r.execute_command("PUT2PHASE", "BEGIN", "k", 10, "HASH", "zz")


# -- session affinity: per tenant, bounded (issue 19.4) ------------------------------------------


def test_sessions_are_per_tenant_capped_in_length_and_bounded_in_number(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINES)
    users = tmp_path / "users"
    users.write_text("alice apw\nbob bpw\n")
    q = quilld_factory("--config", str(conf), "--users-file", str(users),
                       env={"QUILLD_GATEWAY_SESSION_MAX": "100"})
    alice, bob = (q.client(protocol=2, decode_responses=False, username=u, password=p)
                  for u, p in (("alice", "apw"), ("bob", "bpw")))
    for r in (alice, bob):
        assert r.execute_command("SCOPE", "m", "") == b"OK"
    # e1 busy: alice's session goes to e2 and stays there once e1 is idle again
    lease = route(alice, blocks=[1], acquire=1)["lease"]
    assert route(alice, blocks=[1], session="chat-1")["engine"] == b"e2"
    assert alice.execute_command("RELEASE", lease) == 1
    assert route(alice, blocks=[1], session="chat-1")["engine"] == b"e2"
    # bob's equal id is his own: with both idle, the tie goes to e1
    assert route(bob, blocks=[1], session="chat-1")["engine"] == b"e1"
    assert route(bob, blocks=[1])["engine"] == b"e1"

    # an id over 256 bytes is refused, on every way in, and nothing of it is kept
    with pytest.raises(redis.ResponseError, match="session id of 32768 bytes is too long"):
        route(alice, blocks=[1], session="x" * 32768)
    with pytest.raises(redis.ResponseError, match="too long"):
        alice.execute_command("ROUTE", "HASHES", 1, 1, "SESSION", "y" * 257)
    status, _, body = http(q.admin_port, "POST", "/v1/route",
                           json.dumps({"model": "m", "blocks": [1], "session": "z" * 257}).encode(),
                           {"Content-Type": "application/json", **q.admin_headers()})
    assert status == 400 and b"too long" in body
    info = alice.info("router")
    assert info["sessions"] == 2 and info["session_evictions_full"] == 0

    # 300 more sessions: the table keeps 100, the least recently used go (chat-1s among them)
    for i in range(300):
        route(bob, blocks=[1], session=f"s{i:04d}" + "x" * 250)
    info = alice.info("router")
    assert info["sessions"] == 100 and info["session_evictions_full"] == 202
    metrics = http(q.admin_port, "GET", "/metrics", headers=q.admin_headers())[2].decode()
    assert "quilld_sessions 100.0" in metrics
    assert 'quilld_session_evictions_total{reason="full"} 202.0' in metrics


def test_an_engine_registered_with_group_kinds_is_credited_as_vllm_would_hit(routed):
    """Issue 18.8 over the admin API and KVEVENTS' JSON: a Mamba group keeping its state at the last
    block of a prefill makes the whole prefix reusable."""
    q, r = routed
    headers = {"Content-Type": "application/json", **q.admin_headers()}

    def post(path, body):
        status, _, raw = http(q.admin_port, "POST", path, json.dumps(body).encode(), headers)
        return status, json.loads(raw)

    status, body = post("/v1/engines", {"id": "bad", "url": "http://127.0.0.1:9005", "model": "m",
                                        "groups": [{"kind": "full"}, {"kind": "sliding_window"}]})
    assert status == 400 and "a sliding_window group needs window_tokens" in body["error"]
    status, body = post("/v1/engines", {"id": "e5", "url": "http://127.0.0.1:9005", "model": "m",
                                        "groups": [{"kind": "full"}, {"kind": "mamba"}]})
    assert status == 201 and body["groups"] == [{"kind": "full", "window_tokens": 0},
                                                {"kind": "mamba", "window_tokens": 0}]
    blocks = list(range(500, 508))
    events = [stored(blocks) | {"group_idx": 0, "kv_cache_spec_kind": "full_attention"},
              stored(blocks[-1:]) | {"group_idx": 1, "kv_cache_spec_kind": "mamba"}]
    assert r.execute_command("KVEVENTS", "e5", json.dumps({"events": events})) == 2
    d = route(r, blocks=blocks + [9])
    assert d["engine"] == b"e5" and d["plan"] == [b"hit:e5:hbm"] * 8 + [b"recompute"]
    assert route(r, blocks=blocks[:7])["plan"] == [b"recompute"] * 7  # no state at block 6


def test_only_the_operator_and_the_engines_own_tenant_send_its_kv_events(quilld_factory, tmp_path):
    """Issue 19.12: a tenant's KVEVENTS for another tenant's engine rewrote that tenant's ROUTE
    decision. Now only the operator (user default, the admin API) and the engine's tenant may."""
    conf = tmp_path / "engines.toml"
    conf.write_text('[[engines]]\nid = "a1"\nurl = "http://127.0.0.1:9001"\nmodel = "m"\ntenant = "alice"\n\n'
                    '[[engines]]\nid = "a2"\nurl = "http://127.0.0.1:9002"\nmodel = "m"\ntenant = "alice"\n')
    users = tmp_path / "users"
    users.write_text("alice apw\nmallory mpw\n")
    q = quilld_factory("--config", str(conf), "--users-file", str(users), "--requirepass", "opw")
    base = f"redis://{{}}:{{}}@127.0.0.1:{q.port}"
    alice, mallory, operator = (redis.Redis.from_url(base.format(u, p), protocol=2) for u, p in
                                (("alice", "apw"), ("mallory", "mpw"), ("default", "opw")))
    alice.execute_command("SCOPE", "m", "")
    assert alice.execute_command("KVEVENTS", "a2", json.dumps({"events": [stored([1, 2, 3, 4])]})) == 1
    assert route(alice, blocks=[1, 2, 3, 4])["engine"] == b"a2"
    # mallory can neither move alice's decision nor learn which engine ids exist
    for engine in ("a1", "a2", "nope"):
        with pytest.raises(redis.exceptions.NoPermissionError,
                           match=f"user 'mallory' may not send KV events for engine '{engine}'"):
            mallory.execute_command("KVEVENTS", engine, json.dumps({"events": [{"type": "all_blocks_cleared"}]}))
    assert route(alice, blocks=[1, 2, 3, 4])["engine"] == b"a2"
    # the operator may, over RESP and the admin API (bearer token); so may the engine's tenant
    assert operator.execute_command("KVEVENTS", "a1", json.dumps({"events": [stored([1, 2, 3, 4, 5])]})) == 1
    assert route(alice, blocks=[1, 2, 3, 4, 5])["engine"] == b"a1"
    with pytest.raises(redis.ResponseError, match="no engine 'nope'"):
        operator.execute_command("KVEVENTS", "nope", json.dumps({"events": []}))
    status, _, body = http(q.admin_port, "POST", "/v1/kv-events?engine_id=a1",
                           json.dumps({"events": [{"type": "all_blocks_cleared"}]}).encode(),
                           {"Content-Type": "application/json", **q.admin_headers()})
    assert status == 200 and json.loads(body)["applied"] == 1
    assert route(alice, blocks=[1, 2, 3, 4, 5])["engine"] == b"a2"


def test_an_oversized_route_is_refused_before_it_is_read(routed):
    """Issue 19.7: a 32 MiB ROUTE {json} was read whole, decoded and walked on the event loop
    (other clients waited seconds) before "at most 65536 blocks". Its declared size alone now
    refuses it: the bytes are dropped as they arrive, never held, never decoded."""
    from quilld.index.route_request import MAX_REQUEST_BYTES

    q, r = routed
    size = MAX_REQUEST_BYTES + 1
    before = r.info("stats")["total_net_input_bytes"]
    with socket.create_connection(("127.0.0.1", q.port), timeout=30) as s:
        head = b"*2\r\n$5\r\nROUTE\r\n$%d\r\n" % size
        s.sendall(head + b'{"blocks": [' + b"1," * (MiB // 2))
        sent = len(head) + 12 + MiB
        assert wait_until(lambda: r.info("stats")["total_net_input_bytes"] >= before + sent, timeout=30)
        (line,) = [c for c in r.client_list() if c["cmd"] != "client|list"]
        assert int(line["qbuf"]) + int(line["argv-mem"]) < 64 * 1024, line  # nothing of the MiB is kept
        s.sendall(b"1," * ((size - 12 - MiB) // 2) + b" " * ((size - 12 - MiB) % 2) + b"\r\n")
        assert read_reply_line(s) == (f"-ERR ROUTE: an argument is at most {MAX_REQUEST_BYTES} bytes, this one is "
                                      f"{size}: refused before it was read").encode()
        s.sendall(b"PING\r\n")
        assert read_reply_line(s) == b"+PONG"  # the connection goes on
