"""A dozen quilld nodes, each a host of its own: a network namespace with its own address, joined
to the others by a veth pair into one bridge (tests/netns.py makes and tears down the topology,
tests/netns_cluster.py starts the nodes). Issue 20's real-process proof of the cluster directory:

- LMCache's `redis://` pattern across nodes: a chunk (`K + "kv_bytes"`, then the small
  `K + "metadata"`) SET on one node, EXISTS and GET on every other, byte for byte;
- ROUTE from every node answers the same decision for blocks stored on several nodes;
- kill -9 three nodes, start two new ones: once the membership has converged, every block a live
  node holds is found (EXISTS, GET) from every live node, new ones included, and the blocks only
  the killed nodes held are misses (0, nil), never errors; ROUTE still agrees everywhere.

It needs root and `ip` (CI runs as root; .ci/run installs iproute2); where it cannot make
namespaces it fails, saying why: a test that skipped did not run.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time

import pytest
import redis

from netns_cluster import NetnsCluster, Node

pytestmark = pytest.mark.timeout(300)

NODES = 12
VICTIMS = ("n3", "n7", "n11")  # killed with SIGKILL; n0, every node's seed, stays
CHUNK = 1024 * 1024  # an LMCache KV chunk (small enough for 12 nodes x ~30 chunks on 2 cores)
ROUTE_BLOCK = 64 * 1024  # above dram.inline_max: an arena block, logged and replicated
MODEL, TOKENIZER = "meta-llama/Llama-3.1-8B", "llama3"
ENGINES = "".join(f"""
[[engines]]
id = "{e}"
kind = "vllm"
url = "http://127.0.0.1:{8001 + i}"
model = "{MODEL}"
tokenizer = "{TOKENIZER}"
block_size = 16
""" for i, e in enumerate(("vllm-0", "vllm-1")))
SETTLE_TIMEOUT = 30.0  # replication and pool asks on a loaded machine: a bound, not a speed claim


@pytest.fixture
def cluster(topo, tmp_path):
    c = NetnsCluster(topo, tmp_path, config=ENGINES)
    try:
        yield c
    finally:
        c.stop_all()


# -- LMCache's redis:// connector, as tests/blackbox/test_lmcache_styles.py describes it ---------

def chunk_key(name: str) -> str:
    """A CacheEngineKey.to_string()-shaped key: fmt@model@world_size@worker_id@chunk_hash@dtype."""
    return f"vllm@{MODEL}@1@0@{hashlib.sha256(name.encode()).hexdigest()}@bfloat16"


def metadata(length: int) -> bytes:
    """A RemoteMetadata-like header: length, a 4-d shape, dtype and format codes."""
    return struct.pack("<7i", length, 2, 32, 256, 1024, 7, 1)


def lmcache_put(r: redis.Redis, key: str, kv: bytes) -> None:
    assert r.set(key + "kv_bytes", kv) is True  # kv_bytes first: metadata visible implies kv_bytes visible
    assert r.set(key + "metadata", metadata(len(kv))) is True


def lmcache_get(r: redis.Redis, key: str) -> bytes | None:
    """The connector's lookup then read: EXISTS metadata, GET metadata, GET kv_bytes (its length
    from the metadata). None for a miss."""
    if r.exists(key + "metadata") != 1:
        return None
    meta = r.get(key + "metadata")
    assert meta is not None and len(meta) == 28, f"metadata of {key}: {meta!r}"
    (length,) = struct.unpack_from("<i", meta)
    kv = r.get(key + "kv_bytes")
    assert kv is not None, f"{key}: metadata found but kv_bytes missing"
    assert len(kv) == length, f"{key}: kv_bytes is {len(kv)} bytes, its metadata says {length}"
    return kv


def assert_found(node: Node, key: str, want: bytes, what: str) -> None:
    got = lmcache_get(node.r, key)
    assert got is not None, f"{what}: {key} not found from {node.node_id}"
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        pytest.fail(f"{what}: {key} read from {node.node_id} differs from what was written, first at byte {first}")


def assert_gone(node: Node, key: str, what: str, exists: bool = True) -> None:
    """A miss through LMCache's calls (GETs), and EXISTS 0 too unless told: until a killed holder
    is declared dead the directory still names it, and EXISTS of a key the directory names answers 1
    without a transfer (README, "Pool-wide reads"); LMCache's GET that follows is then a miss."""
    r = node.r
    if exists:
        assert r.exists(key + "metadata") == 0, f"{what}: EXISTS {key}metadata from {node.node_id}"
        assert r.exists(key + "kv_bytes") == 0, f"{what}: EXISTS {key}kv_bytes from {node.node_id}"
    assert r.get(key + "metadata") is None, f"{what}: GET {key}metadata from {node.node_id}"
    assert r.get(key + "kv_bytes") is None, f"{what}: GET {key}kv_bytes from {node.node_id}"


def located(node: Node, key: str) -> set[str]:
    """The nodes LOCATE on `node` names for `key` (each place a map, or a flat list in RESP2)."""
    places = node.r.execute_command("LOCATE", key)[0]
    return {(p if isinstance(p, dict) else dict(zip(p[::2], p[1::2])))[b"node"].decode() for p in places}


# -- ROUTE ------------------------------------------------------------------------------------------

def put_hashed(node: Node, key: str, block_hash: int, value: bytes) -> None:
    """A block an engine could load instead of recomputing: PUT2PHASE ... HASH, in the engines' scope."""
    with node.client((MODEL, TOKENIZER)) as r:
        handle = r.execute_command("PUT2PHASE", "BEGIN", key, len(value), "HASH", block_hash)
        assert r.execute_command("PUT2PHASE", "DATA", handle, 0, value) in (b"OK", "OK")
        assert r.execute_command("PUT2PHASE", "COMMIT", handle) in (b"OK", "OK")


def route(node: Node, blocks: list[int]) -> dict:
    with node.client((MODEL, TOKENIZER), protocol=3, decode_responses=True) as r:
        return r.execute_command("ROUTE", json.dumps({"blocks": blocks, "decode_tokens": 32}))


def expected_plan(holders: list[str], dead: set[str]) -> list[str]:
    """The chosen engine's plan: each block fetched from the one node holding it, up to the first
    block no live node holds; the rest recomputed."""
    plan = []
    for h in holders:
        if h in dead:
            break
        plan.append(f"fetch:{h}:dram")
    return plan + ["recompute"] * (len(holders) - len(plan))


def wait_routes_agree(nodes: list[Node], blocks: list[int], plan: list[str], what: str,
                      timeout: float = SETTLE_TIMEOUT) -> dict:
    """Poll ROUTE on every node until each answers `plan` (the residency log is followed
    asynchronously); then every node's whole decision must be the same. Returns it."""
    deadline = time.monotonic() + timeout
    answers: dict[str, dict] = {}
    for node in nodes:
        while (d := route(node, blocks))["plan"] != plan and time.monotonic() < deadline:
            time.sleep(0.1)
        answers[node.node_id] = d
    wrong = {n: d["plan"] for n, d in answers.items() if d["plan"] != plan}
    assert not wrong, f"{what}: ROUTE plans after {timeout} s differ from {plan}: {wrong}"
    first = next(iter(answers.values()))
    for n, d in answers.items():
        assert (d["engine"], d["cost"], d["candidates"]) == (first["engine"], first["cost"], first["candidates"]), \
            f"{what}: ROUTE on {n} decided {d}, on {nodes[0].node_id} {first}"
    return first


# -- the test ---------------------------------------------------------------------------------------

def test_twelve_hosts_share_chunks_route_alike_and_survive_three_kills(cluster):
    t0 = time.monotonic()
    cluster.start(NODES)
    started = time.monotonic() - t0
    converged = cluster.wait_converged()
    nodes = list(cluster.nodes.values())
    ids = [n.node_id for n in nodes]
    survivors = [n for n in nodes if n.node_id not in VICTIMS]
    rng = random.Random(20)

    # Chunks, by who holds them when the three are killed:
    # everywhere: written on each node, read from every other (each keeps a copy: keep_fetched)
    everywhere = {f"all-{w}": (w, rng.randbytes(CHUNK)) for w in ids}
    # only on a victim: written there, never read before the kill
    victim_only = {f"lost-{v}": (v, rng.randbytes(CHUNK)) for v in VICTIMS}
    # only on a survivor: written there, not read before the kill
    survivor_only = {f"kept-{s}": (s, rng.randbytes(CHUNK)) for s in ("n1", "n5", "n9")}
    # written on a victim and read by one survivor before the kill: that survivor's copy is the one left
    copied = {f"copied-{v}": (v, rng.randbytes(CHUNK)) for v in VICTIMS}
    copier = dict(zip(VICTIMS, ("n4", "n8", "n0")))

    for name, (w, kv) in {**everywhere, **victim_only, **survivor_only, **copied}.items():
        lmcache_put(cluster.nodes[w].r, chunk_key(name), kv)

    # LMCache's pattern across hosts: SET on one node, EXISTS and GET on each other one, at once
    # (no wait for replication: a key the log has not brought yet is asked of every live peer)
    t_reads = time.monotonic()
    for name, (w, kv) in everywhere.items():
        key = chunk_key(name)
        for node in nodes:
            if node.node_id == w:
                continue
            assert node.r.execute_command("GETBLK", key + "kv_bytes", "LOCAL") is None  # a pool read, not local
            assert_found(node, key, kv, f"chunk written on {w}")
    for v, name in zip(VICTIMS, copied):
        assert_found(cluster.nodes[copier[v]], chunk_key(name), copied[name][1], f"chunk written on {v}")
    reads = time.monotonic() - t_reads
    hits = sum(n.r.info("cluster")["cluster_pool_read_hits"] for n in nodes)
    assert hits >= len(everywhere) * (NODES - 1), f"pool read hits {hits}: the GETs were not served by peers"

    # ROUTE from every node: 8 blocks stored with their engine hash on 8 nodes (one a victim)
    route_holders = ["n0", "n1", "n2", "n3", "n4", "n5", "n6", "n8"]
    hashes = [0x5EED0000 + i for i in range(len(route_holders))]
    for i, (h, holder) in enumerate(zip(hashes, route_holders)):
        put_hashed(cluster.nodes[holder], f"route-block-{i}", h, rng.randbytes(ROUTE_BLOCK))
    before = wait_routes_agree(nodes, hashes, expected_plan(route_holders, set()), "before the kill")
    assert before["engine"] == "vllm-0"  # both engines credit the pool alike: the tie goes to the first id
    assert before["cost"] == pytest.approx((len(hashes) - 0.75 * len(hashes)) + 32 / 16)

    # kill -9 three nodes
    for v in VICTIMS:
        cluster.nodes[v].kill()
    t_kill = time.monotonic()
    # Right away, before anyone has declared them dead, a survivor reading what only they held
    # gets a miss, and a chunk a survivor copied is still found (from the copy), never an error.
    probe = cluster.nodes["n2"]
    for name in victim_only:
        assert_gone(probe, chunk_key(name), "read right after the kill", exists=False)
    for name, (v, kv) in copied.items():
        assert_found(probe, chunk_key(name), kv, f"copy of {v}'s chunk read right after the kill")

    # two new nodes join; membership converges: 9 old and 2 new alive everywhere, the victims nowhere
    newcomers = cluster.start(2)
    cluster.wait_converged()
    after_kill = time.monotonic() - t_kill
    live = cluster.live()
    assert len(live) == NODES - len(VICTIMS) + 2 and {n.node_id for n in newcomers} == {"n12", "n13"}
    for node in survivors:
        view = node.members()
        assert all(view.get(v, "dead") == "dead" for v in VICTIMS), f"{node.node_id} sees {view}"

    # every chunk a live node holds is found from every live node, the newcomers included
    held = {**everywhere, **survivor_only, **copied}
    t_reads2 = time.monotonic()
    for node in live:
        for name, (w, kv) in held.items():
            assert not located(node, chunk_key(name) + "kv_bytes") & set(VICTIMS), \
                f"{node.node_id}'s directory still names a dead holder of {name}"
            assert_found(node, chunk_key(name), kv, f"after the kill, chunk written on {w}")
        for name in victim_only:
            assert not located(node, chunk_key(name) + "kv_bytes"), f"{node.node_id} still locates {name}"
            assert_gone(node, chunk_key(name), "after the kill, a chunk only a killed node held")
    reads2 = time.monotonic() - t_reads2

    # ROUTE from every live node, newcomers included: the walk stops at n3's block (gone)
    after = wait_routes_agree(live, hashes, expected_plan(route_holders, set(VICTIMS)), "after the kill")
    assert after["engine"] == "vllm-0"

    print(f"\n{NODES} nodes listening after {started:.1f} s, converged {converged:.1f} s later; "
          f"{len(everywhere) * (NODES - 1)} cross-node chunk reads in {reads:.1f} s; after kill -9 of 3 and 2 "
          f"joins, converged in {after_kill:.1f} s; {len(live) * (len(held) + len(victim_only))} reads in "
          f"{reads2:.1f} s; total {time.monotonic() - t0:.1f} s")


def test_an_engine_registered_on_one_node_is_routed_to_from_every_node(cluster):
    """An engine told to one node (admin API, KV events) is the cluster's: every node lists it
    and ROUTE on every node credits its KV events (issue 20.5)."""
    cluster.start(4)
    cluster.wait_converged()
    n0 = cluster.nodes["n0"]
    status, body = n0.admin("POST", "/v1/engines", {"id": "vllm-2", "kind": "vllm", "url": "http://127.0.0.1:8003",
                                                   "model": MODEL, "tokenizer": TOKENIZER, "block_size": 16})
    assert status == 201, body
    blocks = [1001, 1002, 1003, 1004, 1005]
    status, body = n0.admin("POST", "/v1/kv-events", {"engine_id": "vllm-2", "events": [
        {"type": "block_stored", "block_hashes": blocks[:4], "parent_block_hash": None, "token_ids": [],
         "block_size": 16, "lora_id": None, "lora_name": None, "medium": "GPU"}]})
    assert (status, body) == (200, {"engine_id": "vllm-2", "applied": 1})
    d = wait_routes_agree(list(cluster.nodes.values()), blocks, ["hit:vllm-2:hbm"] * 4 + ["recompute"],
                          "an engine registered on n0", timeout=5.0)
    assert d["engine"] == "vllm-2"


def test_a_host_cut_off_the_network_is_a_miss_then_found_again_when_plugged_back(cluster, topo):
    """Unlike kill -9 (the kernel resets its connections), a host whose link dies just stops
    answering: reads from every other node are misses or served by a copy, never errors, and once
    it is back its chunks are found again everywhere."""
    cluster.start(6)
    cluster.wait_converged()
    nodes = list(cluster.nodes.values())
    cut, others = nodes[3], [n for n in nodes if n is not nodes[3]]
    rng = random.Random(6)
    only, copied = rng.randbytes(CHUNK), rng.randbytes(CHUNK)
    lmcache_put(cut.r, chunk_key("only"), only)
    lmcache_put(cut.r, chunk_key("copied"), copied)
    assert_found(nodes[4], chunk_key("copied"), copied, "read before the cut")
    topo.cut(cut.host)
    t0 = time.monotonic()
    for node in others:  # at once, and on while the others find out
        assert_gone(node, chunk_key("only"), "its holder cut off", exists=False)
        assert_found(node, chunk_key("copied"), copied, "a copy of a chunk of the cut host")
    first_round = time.monotonic() - t0
    deadline = time.monotonic() + 60
    while any(n.members().get(cut.node_id) != "dead" for n in others):
        assert time.monotonic() < deadline, f"the cut host is not declared dead: {cluster.views()}"
        time.sleep(0.1)
    declared = time.monotonic() - t0
    for node in others:
        assert_gone(node, chunk_key("only"), "its holder declared dead")
        assert_found(node, chunk_key("copied"), copied, "a copy, its writer declared dead")
    topo.mend(cut.host)
    cluster.wait_converged()
    for node in others:
        assert_found(node, chunk_key("only"), only, "the chunk of a host plugged back in")
    print(f"\nreads while cut: {first_round:.1f} s for {len(others)} nodes; dead everywhere {declared:.1f} s after the cut")
