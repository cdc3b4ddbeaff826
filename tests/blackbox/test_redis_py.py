"""redis-py against a real quilld: RESP2 and RESP3, pipelines, large values."""

from __future__ import annotations

import os
import random
import threading

import pytest
import redis

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def client(request, quilld):
    return quilld.client(protocol=request.param)


def test_basic_commands(client):
    assert client.ping() is True
    assert client.set("k", b"v") is True
    assert client.get("k") == b"v"
    assert client.get("missing") is None
    assert client.mget("k", "missing") == [b"v", None]
    assert client.exists("k", "k", "missing") == 2
    assert client.strlen("k") == 1
    assert client.type("k") == b"string"
    assert client.ttl("k") == -1
    assert client.delete("k", "missing") == 1
    assert client.ttl("k") == -2
    assert client.echo(b"a\r\nb") == b"a\r\nb"


def test_set_options_and_ttl(client):
    assert client.set("t", "1", ex=100)
    assert 99 <= client.ttl("t") <= 100
    assert 99_000 <= client.pttl("t") <= 100_000
    assert client.set("t", "2", nx=True) is None
    assert client.set("t", "3", xx=True, get=True) == b"1"
    assert client.ttl("t") == -1  # a plain overwrite clears the TTL, as in redis
    assert client.set("u", "x", px=50)
    import time

    deadline = time.monotonic() + 5
    while client.get("u") is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.get("u") is None
    assert client.exists("u") == 0
    with pytest.raises(redis.ResponseError, match="invalid expire time"):
        client.set("t", "x", ex=0)


def test_pipelines_keep_order(client):
    pipe = client.pipeline(transaction=False)
    for i in range(500):
        pipe.set(f"p{i}", str(i))
    for i in range(500):
        pipe.get(f"p{i}")
    pipe.mget([f"p{i}" for i in range(10)])
    replies = pipe.execute()
    assert replies[:500] == [True] * 500
    assert replies[500:1000] == [str(i).encode() for i in range(500)]
    assert replies[1000] == [str(i).encode() for i in range(10)]
    assert client.dbsize() == 500


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 16383, 16384, 65536, 1 << 20, 32 << 20])
def test_values_of_every_size_round_trip(client, size):
    data = os.urandom(size)
    assert client.set(f"v{size}", data)
    assert client.get(f"v{size}") == data
    assert client.strlen(f"v{size}") == size
    assert client.execute_command("GETBLK", f"v{size}") == data


def test_large_values_in_a_pipeline(client):
    blobs = [os.urandom(random.randint(1 << 16, 4 << 20)) for _ in range(8)]
    pipe = client.pipeline(transaction=False)
    for i, b in enumerate(blobs):
        pipe.set(f"b{i}", b)
    pipe.execute()
    pipe = client.pipeline(transaction=False)
    for i in range(len(blobs)):
        pipe.get(f"b{i}")
    assert pipe.execute() == blobs


def test_mset_with_large_and_small_values(client):
    big = os.urandom(3 << 20)
    assert client.mset({"m1": b"small", "m2": big, "m3": b""})
    assert client.mget("m1", "m2", "m3") == [b"small", big, b""]


def test_resp3_types(quilld):
    r = quilld.client(protocol=3)
    assert r.get("nothing") is None
    info = r.info("replication")
    assert info["role"] == "master"
    assert isinstance(r.config_get("maxmemory"), dict)


def test_concurrent_clients(quilld):
    errors: list[Exception] = []

    def worker(n: int) -> None:
        try:
            r = quilld.client()
            for i in range(200):
                key = f"w{n}:{i}"
                r.set(key, key * 10)
                assert r.get(key) == (key * 10).encode()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert quilld.client().dbsize() == 8 * 200


def test_client_commands(quilld):
    r = quilld.client(protocol=2, client_name="bench-1")
    assert r.client_getname() == "bench-1"
    cid = r.client_id()
    assert isinstance(cid, int) and cid > 0
    listing = r.client_list()
    assert any(c["name"] == "bench-1" for c in listing)
    # quilld reports redis 7.0.15, which has no CLIENT SETINFO (7.2): its exact error, as redis-py expects
    with pytest.raises(redis.ResponseError, match=r"^unknown subcommand 'SETINFO'\. Try CLIENT HELP\.$"):
        r.execute_command("CLIENT", "SETINFO", "LIB-NAME", "quill-test")
    assert "id=%d " % cid in r.execute_command("CLIENT", "INFO").decode()
    assert r.command_count() >= 20
    docs = r.execute_command("COMMAND DOCS", "get")
    assert docs and b"summary" in docs[1]
    assert "set" in r.command()


def test_info_sections(quilld):
    r = quilld.client(protocol=2)
    r.set("x", "y")
    info = r.info()
    for key in ("redis_version", "connected_clients", "used_memory", "keyspace_hits", "role", "dram_capacity"):
        assert key in info
    assert info["db0"]["keys"] == 1
    assert r.info("tiers")["dram_keys"] == 1
    assert "redis_version" not in r.info("tiers")
