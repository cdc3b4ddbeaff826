"""Issue 14, item 2: GET, MGET and EXISTS see the whole pool, on real nodes on 127.0.0.1.

LMCache's `redis://` connector (replayed as tests/blackbox/test_lmcache_styles.py does:
a pool from the URL, `K + "kv_bytes"` written before `K + "metadata"`, `EXISTS K +
"metadata"` as the lookup, metadata then kv_bytes as the read) writes on node a and reads
on nodes b and c, unchanged. The docs' walk from one node to three (docs/cluster.md) runs as
written.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import time

import pytest
import redis
import redis.asyncio as aioredis
from test_cluster import holders, members, three, until
from test_lmcache_styles import assert_same, chunk_key, metadata, payload

from conftest import ROOT, free_gossip_port, free_port
from doc_blocks import doc_block

MiB = 1024 * 1024
CHUNK = 4 * MiB  # an LMCache chunk here: big enough to be an arena block, small enough to be quick
IO_TIMEOUT = 20.0
SCENARIO_DEADLINE = 60.0

pytestmark = pytest.mark.timeout(180)


def cluster_info(r: redis.Redis) -> dict:
    return r.info("cluster")


# -- LMCache's redis:// connector across nodes ---------------------------------------------

def test_lmcache_redis_pattern_written_on_a_is_read_on_b_and_c(cluster):
    three(cluster)
    urls = {n: f"redis://127.0.0.1:{cluster.nodes[n].port}" for n in "abc"}
    keys = [chunk_key(i) for i in range(6)]
    kvs = [payload(i, CHUNK) for i in range(6)]
    missing = chunk_key(999)

    async def connector(url: str):
        pool = aioredis.ConnectionPool.from_url(url, max_connections=150, socket_timeout=IO_TIMEOUT)
        return pool, aioredis.Redis.from_pool(pool)

    async def scenario():
        pool_a, on_a = await connector(urls["a"])
        pool_b, on_b = await connector(urls["b"])
        try:
            async def put(k, kv):  # kv_bytes first: metadata visible implies kv_bytes visible
                await on_a.set(k + "kv_bytes", kv)
                await on_a.set(k + "metadata", metadata(len(kv)))

            async def contains_prefix(ks):
                hits = 0
                for k in ks:
                    if not await on_b.exists(k + "metadata"):
                        return hits
                    hits += 1
                return hits

            async def get(k):
                meta = await on_b.get(k + "metadata")
                if meta is None:
                    return None
                (length,) = struct.unpack_from("<i", meta)
                kv = await on_b.get(k + "kv_bytes")
                if kv is None:  # the connector's consistency path: it would delete the metadata
                    return b"kv_bytes missing"
                return bytes(kv[:length])

            await asyncio.gather(*(put(k, kv) for k, kv in zip(keys, kvs)))
            # b learns nothing it was not asked: the lookup alone finds every chunk on a
            assert await contains_prefix(keys) == len(keys)
            assert await contains_prefix(keys[:2] + [missing] + keys[2:]) == 2
            got = await asyncio.gather(*(get(k) for k in keys[:3] + [missing]))
            for i in range(3):
                assert_same(got[i], kvs[i], f"GET on b of chunk {i} written on a")
            assert got[3] is None
            # the connector's batched get: gathered reads of chunks b has not read yet
            got = await asyncio.gather(*(get(k) for k in keys[3:]))
            for i, kv in enumerate(kvs[3:], 3):
                assert_same(got[i - 3], kv, f"batched GET on b of chunk {i}")
        finally:
            await on_a.aclose()
            await on_b.aclose()
            await pool_a.aclose()
            await pool_b.aclose()

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_DEADLINE))
    b = cluster.client("b")
    info = cluster_info(b)
    assert info["cluster_pool_read_hits"] >= 2 * len(keys), info  # every metadata and kv_bytes key
    assert info["cluster_lookups"] >= 1, info  # metadata keys too: the directory names their holder
    assert info["cluster_peer_fetches"] >= len(keys), info
    # b keeps what it fetched: the same reads are local now
    for k, kv in zip(keys, kvs):
        assert_same(b.execute_command("GETBLK", k + "kv_bytes", "LOCAL"), kv, "b's kept copy")
    before = cluster_info(b)["cluster_pool_reads"]
    assert b.exists(*(k + "metadata" for k in keys)) == len(keys)
    assert cluster_info(b)["cluster_pool_reads"] == before

    # c: MGET of metadata and kv_bytes keys, a missing one among them, in one command
    c = cluster.client("c")
    names = [keys[0] + "metadata", keys[1] + "kv_bytes", missing + "kv_bytes", keys[2] + "kv_bytes"]
    got = c.mget(names)
    assert got[0] == metadata(CHUNK) and got[2] is None
    assert_same(got[1], kvs[1], "MGET on c, chunk 1")
    assert_same(got[3], kvs[2], "MGET on c, chunk 2")
    assert c.exists(missing + "metadata", keys[4] + "metadata", keys[4] + "metadata") == 2  # counted as redis does
    assert c.get(missing + "metadata") is None and c.mget([missing + "a", missing + "b"]) == [None, None]


def test_exists_of_a_block_the_directory_names_needs_no_transfer_and_scopes_stay_apart(cluster):
    cluster.start("a")
    cluster.start("b", ["a"])
    until(lambda: members(cluster.client("b")) == {"a": "alive", "b": "alive"}, 15, "two members")
    port = {n: cluster.nodes[n].port for n in "ab"}
    in_m = {n: redis.Redis.from_url(f"redis://default~m~t@127.0.0.1:{port[n]}", socket_timeout=IO_TIMEOUT)
            for n in "ab"}
    in_x = redis.Redis.from_url(f"redis://default~x~t@127.0.0.1:{port['b']}", socket_timeout=IO_TIMEOUT)
    plain_b = cluster.client("b")
    big, small = os.urandom(MiB + 3), b"a small value"
    in_m["a"].set("big", big)
    in_m["a"].set("small", small)
    until(lambda: "a" in holders(in_m["b"], "big"), 10, "b's directory to list a's block")
    assert in_m["b"].exists("big") == 1
    info = cluster_info(plain_b)
    assert info.get("cluster_peer_fetches", 0) == 0 and info["cluster_pool_reads"] == 0, info
    assert in_m["b"].execute_command("GETBLK", "big", "LOCAL") is None  # nothing was copied
    # other scopes on b see none of it, from the directory or from a peer
    for r in (in_x, plain_b):
        assert r.exists("big", "small") == 0
        assert r.get("big") is None and r.get("small") is None
        assert r.mget(["big", "small"]) == [None, None]
    assert in_m["b"].mget(["small", "big"]) == [small, big]


def test_pool_reads_false_keeps_get_mget_exists_local(cluster):
    off = {"QUILLD_CLUSTER_POOL_READS": "false"}
    cluster.start("a", **off)
    cluster.start("b", ["a"], **off)
    a, b = cluster.client("a"), cluster.client("b")
    until(lambda: members(b) == {"a": "alive", "b": "alive"}, 15, "two members")
    big = os.urandom(MiB)
    a.set("big", big)
    a.set("small", b"inline")
    until(lambda: "a" in holders(b, "big"), 10, "b's directory to list a's block")
    assert b.get("big") is None and b.get("small") is None
    assert b.mget(["big", "small"]) == [None, None]
    assert b.exists("big", "small") == 0
    assert cluster_info(b)["cluster_pool_reads"] == 0
    assert b.execute_command("GETBLK", "big") == big  # GETBLK still fetches
    assert b.get("big") == big  # and keeps a copy


def test_a_copy_read_from_a_peer_expires_with_the_holders(cluster):
    cluster.start("a")
    cluster.start("b", ["a"])
    a, b = cluster.client("a"), cluster.client("b")
    until(lambda: members(b) == {"a": "alive", "b": "alive"}, 15, "two members")
    big, small = os.urandom(MiB), b"inline value"
    a.set("big", big, px=4000)
    a.set("small", small, px=4000)
    a.set("forever", big)
    until(lambda: "a" in holders(b, "big") and "a" in holders(b, "forever"), 10, "b's directory to list a's blocks")
    assert b.get("big") == big and b.get("small") == small and b.get("forever") == big  # read and kept
    for key in ("big", "small"):
        assert b.pexpiretime(key) == a.pexpiretime(key) > 0, key  # the holder's expiry, to the ms
    assert b.pexpiretime("forever") == -1
    until(lambda: a.get("big") is None and a.get("small") is None, 15, "a's copies to expire")
    assert b.get("big") is None and b.get("small") is None, "b's copies outlived the holder's TTL"
    assert b.get("forever") == big  # b's kept copy has no TTL of its own
    a.delete("forever")  # a delete is the pool's: b's kept copy goes too
    until(lambda: b.get("forever") is None, 5, "b's kept copy to be dropped after a's DEL")


def test_a_holder_killed_is_a_miss_on_get_never_an_error(cluster):
    cluster.start("a")
    cluster.start("b", ["a"])
    a, b = cluster.client("a"), cluster.client("b")
    until(lambda: members(b) == {"a": "alive", "b": "alive"}, 15, "two members")
    a.set("big", os.urandom(2 * MiB))
    until(lambda: "a" in holders(b, "big"), 10, "b's directory to list a's block")
    node_a = cluster.nodes["a"]
    os.kill(node_a.proc.pid, signal.SIGKILL)
    node_a.proc.wait(5)
    t0 = time.monotonic()
    assert b.get("big") is None
    assert b.mget(["big", "other"]) == [None, None]
    assert time.monotonic() - t0 < 10, "a dead holder must not hold a read up"
    assert cluster_info(b)["cluster_pool_read_errors"] >= 1


# -- the docs' walk from one node to three (docs/cluster.md) ----------------------------------------------

WALK_PORTS = ("7379", "7380", "7381", "7479", "7480", "7481", "7579", "7580", "7581")
WALK_TIMEOUT = 90.0


def test_the_docs_walk_from_one_node_to_three_runs_as_written(tmp_path):
    m = doc_block("walkthrough: three-nodes")  # docs/cluster.md
    ports = {p: str(free_gossip_port() if p.endswith("81") else free_port()) for p in WALK_PORTS}
    script = re.sub(r"\b(" + "|".join(WALK_PORTS) + r")\b", lambda x: ports[x[1]], m[1])
    assert script.count("quilld ") == 3 and "kill %1 %2 %3" in script
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "quilld").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m quilld \"$@\"\n")
    (shims / "quilld").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env.update(PYTHONPATH=str(ROOT), PATH=f"{shims}:{env.get('PATH', '')}")
    log = tmp_path / "nodes.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], stdout=subprocess.PIPE, stderr=err,
                                cwd=tmp_path, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=WALK_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the walkthrough did not finish in {WALK_TIMEOUT} s:\n{log.read_text(errors='replace')}")
    finally:
        _end_group(proc.pid, terminate=proc.returncode is None)
    text = out.decode(errors="replace")
    nodes_log = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{text}\n{nodes_log}"
    lines = text.splitlines()
    nodes = [ln for ln in lines if re.match(r"^[abc] (alive|suspect)", ln)]
    assert [ln.split()[:2] for ln in nodes] == [["c", "alive"], ["a", "alive"], ["b", "alive"]], text
    assert "myself" in nodes[0] and f"127.0.0.1:{ports['7579']}" in nodes[0], text
    assert "OK" in lines and "65537" in lines, text
    located = lines[lines.index("65537") + 1:]
    assert {"a", "c"} <= set(located), text  # LOCATE on c: a's copy and c's own
    assert "cluster_peer_fetches:1" in lines and "cluster_pool_read_hits:1" in lines, text
    for name in "bc":
        assert re.search(rf"cluster: {name} joined: gossip 127\.0\.0\.1:\d+, RESP 127\.0\.0\.1:\d+", nodes_log), \
            nodes_log
    assert "Traceback" not in nodes_log, nodes_log
    assert nodes_log.count("quilld stopped") == 3, nodes_log  # `kill %1 %2 %3`: three clean stops


def _end_group(pgid: int, terminate: bool, timeout: float = 15.0) -> None:
    """Wait until every process the walkthrough started is gone (its own `kill` stops the nodes;
    SIGTERM first when it did not finish), SIGKILL what is left after `timeout`."""
    deadline = time.monotonic() + timeout
    try:
        os.killpg(pgid, signal.SIGTERM if terminate else 0)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(pgid, 0)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return



def test_a_full_dram_with_keep_fetched_answers_every_peer_read(cluster):
    """Issue 32, item 2: on a node whose DRAM is full, a block fetched from a peer is answered
    (from plain memory) and not kept; nothing is evicted or waited for, and it is counted."""
    cluster.start("a")
    cluster.start("b", ["a"])
    a, b = cluster.client("a"), cluster.client("b")
    until(lambda: members(b) == {"a": "alive", "b": "alive"}, 15, "two members")
    blocks = {f"blk{i}": os.urandom(MiB) for i in range(24)}
    for k, v in blocks.items():
        a.set(k, v)
    until(lambda: all("a" in holders(b, k) for k in blocks), 10, "b's directory to list a's blocks")
    b.config_set("maxmemory-policy", "noeviction")
    b.config_set("maxmemory", str(16 * MiB))
    filled = 0
    with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
        for i in range(64):  # b's own values until DRAM takes no more
            b.set(f"own{i}", os.urandom(MiB))
            filled += 1
    assert filled >= 8
    got = [b.get(k) for k in blocks] + [b.execute_command("GETBLK", k) for k in blocks]
    assert got == list(blocks.values()) * 2, f"{sum(v is None for v in got)} of {len(got)} peer reads missed"
    assert b.mget(list(blocks)) == list(blocks.values())
    info = cluster_info(b)
    assert info["cluster_pool_keep_skipped"] >= len(blocks)
    assert all(b.exists(f"own{i}") for i in range(filled)), "a copy for later evicted b's own values"
