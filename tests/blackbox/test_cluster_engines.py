"""Engines across a cluster of three real quilld nodes on 127.0.0.1 (issue 20.5): an engine
registered on one node is known, loaded and routed to alike on every node; its pushed KV
events are applied by its home (forwarded there from any node); a removal on any node
removes it everywhere; when its home is killed another node takes it over, with its
directory entries."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import http, wait_until
from test_cluster import DEAD_BOUND, members, three, until

pytestmark = pytest.mark.timeout(120)

MODEL, TOKENIZER = "meta-llama/Llama-3.1-8B", "llama3"
SETTLE = 15.0  # gossip, a table pull, the directory's owners: a bound on a loaded machine


def admin(cluster, node: str, method: str, path: str, body=None) -> tuple[int, object]:
    status, _, raw = http(cluster.nodes[node].admin_port, method, path,
                          None if body is None else json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def engines(cluster, node: str) -> dict[str, dict]:
    status, body = admin(cluster, node, "GET", "/v1/engines")
    assert status == 200, body
    return {e["id"]: e for e in body["engines"]}


def register(cluster, node: str, engine_id: str, port: int) -> None:
    status, body = admin(cluster, node, "POST", "/v1/engines", {
        "id": engine_id, "kind": "vllm", "url": f"http://127.0.0.1:{port}", "model": MODEL, "tokenizer": TOKENIZER,
        "block_size": 16})
    assert status == 201, body


def stored(blocks: list[int], parent: int | None = None) -> str:
    return json.dumps({"events": [{"type": "block_stored", "block_hashes": blocks, "parent_block_hash": parent,
                                   "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU"}]})


def removed(blocks: list[int]) -> str:
    return json.dumps({"events": [{"type": "block_removed", "block_hashes": blocks, "medium": "GPU"}]})


def route(cluster, node: str, blocks: list[int], **extra) -> dict:
    status, body = admin(cluster, node, "POST", "/v1/route", {"model": MODEL, "tokenizer": TOKENIZER,
                                                               "blocks": blocks, "decode_tokens": 32, **extra})
    assert status == 200, body
    return body


def routes_agree(cluster, nodes: str, blocks: list[int], plan: list[str], what: str) -> dict:
    """Wait until ROUTE on every node answers `plan`; then each node's decision must be the same."""
    answers: dict[str, dict] = {}

    def settled():
        for n in nodes:
            answers[n] = route(cluster, n, blocks)
        return all([f"{s['action']}:{s['holder']}:{s['tier']}" if s["holder"] else s["action"]
                    for s in d["plan"]] == plan for d in answers.values())

    assert wait_until(settled, timeout=SETTLE, interval=0.05), \
        f"{what}: ROUTE on {nodes} did not answer {plan} within {SETTLE} s: {answers}"
    first = answers[nodes[0]]
    for n, d in answers.items():
        assert (d["engine"], d["cost"], d["candidates"]) == (first["engine"], first["cost"], first["candidates"]), \
            f"{what}: ROUTE on {n} decided {d}, on {nodes[0]} {first}"
    return first


HBM = "hit:vllm-b:hbm"


def new_home(cluster) -> str:
    """Once a and c both name the same home for vllm-b other than the killed b: that home."""
    homes: set[str] = set()

    def agreed():
        homes.clear()
        homes.update(engines(cluster, n)["vllm-b"]["home"] for n in "ac")
        return len(homes) == 1 and "b" not in homes

    assert wait_until(agreed, timeout=SETTLE, interval=0.05), f"a and c name vllm-b's home {homes}"
    return homes.pop()


def test_an_engine_registered_on_b_is_the_clusters_and_survives_b(cluster):
    three(cluster)
    r = {n: cluster.client(n) for n in "abc"}
    t0 = time.monotonic()
    register(cluster, "b", "vllm-b", 9)
    register(cluster, "b", "vllm-gone", 10)
    register(cluster, "c", "vllm-c", 11)

    # listed on every node, with where it was registered and where it is homed
    def listed():
        views = {n: engines(cluster, n) for n in "abc"}
        return all(set(v) == {"vllm-b", "vllm-gone", "vllm-c"} for v in views.values()) and views
    views = until(listed, SETTLE, "every node to list the three engines")
    known_s = time.monotonic() - t0
    for n, v in views.items():
        assert (v["vllm-b"]["origin"], v["vllm-b"]["home"], v["vllm-b"]["kv_node"]) == ("b", "b", "b"), (n, v)
        assert (v["vllm-c"]["origin"], v["vllm-c"]["home"]) == ("c", "c"), (n, v)

    # KV events pushed to its home credit it on every node, with the same decision everywhere
    blocks = [0xB10C0 + i for i in range(6)]
    assert r["b"].execute_command("KVEVENTS", "vllm-b", stored(blocks[:4])) == 1
    d = routes_agree(cluster, "abc", blocks, [HBM] * 4 + ["recompute"] * 2, "events pushed to b")
    assert d["engine"] == "vllm-b"
    assert [c["engine"] for c in d["candidates"]] == ["vllm-b", "vllm-gone", "vllm-c"]
    # pushed to another node, they are forwarded to the home and applied there
    assert r["a"].execute_command("KVEVENTS", "vllm-b", stored([blocks[4]], blocks[3])) == 1
    routes_agree(cluster, "abc", blocks, [HBM] * 5 + ["recompute"], "an event pushed to a")
    assert r["a"].info("cluster")["cluster_engine_events_forwarded"] == 1

    # a lease taken on a weighs on vllm-b everywhere
    lease = route(cluster, "a", blocks, acquire=True)["lease"]
    until(lambda: all(engines(cluster, n)["vllm-b"]["in_flight"] == 1 for n in "bc"), SETTLE,
          "b and c to count a's lease on vllm-b")
    assert r["a"].execute_command("RELEASE", lease) == 1
    until(lambda: all(engines(cluster, n)["vllm-b"]["in_flight"] == 0 for n in "abc"), SETTLE,
          "the released lease to leave every node's load")

    # removed on c, it is gone everywhere
    status, body = admin(cluster, "c", "DELETE", "/v1/engines/vllm-gone")
    assert status == 200, body
    until(lambda: all("vllm-gone" not in engines(cluster, n) for n in "abc"), SETTLE,
          "every node to forget vllm-gone")
    d = routes_agree(cluster, "abc", blocks, [HBM] * 5 + ["recompute"], "after the removal")
    assert [c["engine"] for c in d["candidates"]] == ["vllm-b", "vllm-c"]
    info = r["a"].info("cluster")
    assert info["cluster_engine_table_pulls"] >= 1 and info["cluster_engine_table_merges"] >= 3

    # b is killed: another node becomes vllm-b's home, adopting its entries
    os.kill(cluster.nodes["b"].proc.pid, signal.SIGKILL)
    cluster.nodes["b"].proc.wait(10)
    for n in "ac":
        until(lambda n=n: members(r[n]).get("b") == "dead", DEAD_BOUND, f"{n} to declare b dead")
    t_dead = time.monotonic()
    home = new_home(cluster)
    until(lambda: r[home].info("cluster")["cluster_engine_rehomes"] == 1, SETTLE, f"{home} to take vllm-b over")
    print(f"\nthree engines registered on b and c known on every node {known_s:.2f} s after the first POST; "
          f"vllm-b re-homed on {home} {time.monotonic() - t_dead:.2f} s after b was dead everywhere")
    assert r[home].info("cluster")["cluster_engine_entries_adopted"] == 5
    routes_agree(cluster, "ac", blocks, [HBM] * 5 + ["recompute"], "after b was killed")
    # its new home is the authority of what b placed: a removal pushed anywhere now reaches the owners
    other = "a" if home == "c" else "c"
    assert r[other].execute_command("KVEVENTS", "vllm-b", removed([blocks[4]])) == 1
    routes_agree(cluster, "ac", blocks, [HBM] * 4 + ["recompute"] * 2, "a removal after the re-home")


def test_only_the_home_subscribes_and_a_new_home_catches_up_from_the_replay_socket(cluster):
    """An engine with a ZMQ publisher, registered on b: only b subscribes; its events are credited
    on every node; when b dies, its new home subscribes and replays the publisher's buffer, so
    what the engine published after b died is credited too."""
    import vllm_schema as vllm
    from test_kv_events import Publisher

    pub = Publisher()
    try:
        three(cluster)
        status, body = admin(cluster, "b", "POST", "/v1/engines", {
            "id": "vllm-b", "url": "http://127.0.0.1:9", "model": MODEL, "tokenizer": TOKENIZER,
            "kv_events": f"tcp://127.0.0.1:{pub.pub_port}", "replay": f"tcp://127.0.0.1:{pub.replay_port}"})
        assert status == 201, body
        until(lambda: all("vllm-b" in engines(cluster, n) for n in "abc"), SETTLE, "every node to know vllm-b")
        pub.publish(vllm.gpu([1, 2]))
        pub.publish(vllm.gpu([3], parent=2))
        hit = "hit:vllm-b:hbm"
        routes_agree(cluster, "abc", [1, 2, 3, 4], [hit] * 3 + ["recompute"], "events published to b's subscription")
        subscribed = {n: engines(cluster, n)["vllm-b"]["feed"]["subscribed"] for n in "abc"}
        assert subscribed == {"a": False, "b": True, "c": False}, subscribed
        replays_before = len(pub.requests)

        os.kill(cluster.nodes["b"].proc.pid, signal.SIGKILL)
        cluster.nodes["b"].proc.wait(10)
        pub.publish(vllm.gpu([4], parent=3))  # nobody subscribed hears it: only the replay buffer has it
        for n in "ac":
            until(lambda n=n: members(cluster.client(n)).get("b") == "dead", DEAD_BOUND, f"{n} to declare b dead")
        home = new_home(cluster)
        routes_agree(cluster, "ac", [1, 2, 3, 4], [hit] * 4, "the new home's catch-up")
        views = {n: engines(cluster, n)["vllm-b"] for n in "ac"}
        feed = views[home]["feed"]
        assert feed["subscribed"] and feed["last_seq"] == 2 and feed["missed"] == 0, feed
        assert not views["c" if home == "a" else "a"]["feed"]["subscribed"]
        assert len(pub.requests) > replays_before and 0 in pub.requests[replays_before:]  # replayed from the start
    finally:
        pub.close()


def test_every_nodes_views_agree_with_route_and_flag_an_engine_whose_kv_node_is_dead(cluster):
    """Issue 29, item 6: on a node that is not an engine's home, /v1/hot said "held by nobody" for a
    prefix ROUTE on that node credited to the engine, /v1/engines read 0 cached blocks, and an engine
    whose KV node was dead was not flagged. Every node now says what its ROUTE scores against."""
    three(cluster)
    r = {n: cluster.client(n) for n in "abc"}
    register(cluster, "b", "vllm-b", 9)
    status, body = admin(cluster, "b", "POST", "/v1/engines", {
        "id": "vllm-kc", "kind": "vllm", "url": "http://127.0.0.1:12", "model": MODEL, "tokenizer": TOKENIZER,
        "block_size": 16, "locality": "c"})  # stores its KV through c
    assert status == 201, body
    until(lambda: all({"vllm-b", "vllm-kc"} <= set(engines(cluster, n)) for n in "abc"), SETTLE,
          "every node to list both engines")
    blocks = [0xF00D0 + i for i in range(6)]
    assert r["b"].execute_command("KVEVENTS", "vllm-b", stored(blocks[:4])) == 1
    d = routes_agree(cluster, "abc", blocks, [HBM] * 4 + ["recompute"] * 2, "events pushed to b")
    assert d["engine"] == "vllm-b"

    def hot_holders(n: str) -> list:
        status, body = admin(cluster, n, "GET", "/v1/hot")
        assert status == 200, body
        return [h["holders"] for h in body["top"] if h["block"] == blocks[0].to_bytes(8, "big").hex()]

    for n in "abc":  # ROUTE on n credited vllm-b with the first block: so does n's /v1/hot
        assert hot_holders(n) == [[{"holder": "vllm-b", "tier": "hbm"}]], (n, hot_holders(n))
    until(lambda: all(engines(cluster, n)["vllm-b"]["blocks"] == {"hbm": 4} for n in "abc"), SETTLE,
          "every node to read vllm-b's 4 cached blocks")
    for n in "abc":
        assert engines(cluster, n)["vllm-kc"]["kv_node_state"] == "alive", n

    os.kill(cluster.nodes["c"].proc.pid, signal.SIGKILL)
    cluster.nodes["c"].proc.wait(10)
    for n in "ab":
        until(lambda n=n: members(r[n]).get("c") == "dead", DEAD_BOUND, f"{n} to declare c dead")
        view = engines(cluster, n)
        assert (view["vllm-kc"]["kv_node"], view["vllm-kc"]["kv_node_state"]) == ("c", "dead"), (n, view["vllm-kc"])
        assert view["vllm-b"]["kv_node_state"] == "alive", n
