"""maxmemory refuses what does not fit, and maxmemory-policy chooses what goes (issue 29.12).

A write that cannot fit under maxmemory once the policy has let go of what it may gets
redis's own `-OOM command not allowed when used memory > 'maxmemory'.` (checked byte for
byte against redis-server 7.0.15); reads and deletes still work; each policy keeps what
redis's keeps; CONFIG SET maxmemory-policy changes it at run time, and INFO, CONFIG GET and
CONFIG REWRITE agree with it. A node with no SSD tier, so that eviction is what makes room.
"""

from __future__ import annotations

import time

import pytest
import redis

from conftest import cmd, exchange

KiB, MiB = 1024, 1024 * 1024
OOM = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
VALUE = b"v" * (64 * KiB)  # arena blocks of 16 pages: 4 MiB of maxmemory holds about 60 of them


@pytest.fixture
def node(quilld_factory):
    q = quilld_factory("--dram", "64MiB")
    yield q
    assert q.proc.poll() is None, f"quilld exited:\n{q.log()}"


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=30, single_connection_client=True)


def test_a_value_that_cannot_fit_gets_redis_oom_byte_for_byte(node, redis_server):
    """The two cases of the issue, on both servers: a 4 MiB SET under maxmemory 3000000, and
    a 100 KB value under maxmemory 1, under each server's default policy and under noeviction."""
    for policy in (None, "noeviction"):
        for port in (node.port, redis_server):
            r = _client(port)
            if policy:
                assert r.config_set("maxmemory-policy", policy)
            assert r.config_set("maxmemory", 3000000)
            assert exchange(port, cmd("SET", "big", b"x" * (4 * MiB)), lines=1)[0] == OOM, port
            assert r.config_set("maxmemory", 1)
            assert exchange(port, cmd("SET", "k", b"x" * 100_000), lines=1)[0] == OOM, port
            assert r.exists("big", "k") == 0
            assert r.config_set("maxmemory", 0)
            assert r.set("k", b"x" * 100_000) and r.strlen("k") == 100_000  # no limit: it fits
            r.flushall()
            r.close()


def test_noeviction_refuses_writes_keeps_every_key_and_serves_reads_and_deletes(node):
    r = _client(node.port)
    assert r.config_set("maxmemory-policy", "noeviction") and r.config_set("maxmemory", 4 * MiB)
    stored, refused = [], None
    for i in range(200):  # 12.5 MiB offered to 4 MiB
        try:
            r.set(f"k{i}", VALUE)
            stored.append(f"k{i}")
        except redis.exceptions.OutOfMemoryError as e:
            refused = str(e)
            break
    assert refused == "command not allowed when used memory > 'maxmemory'."
    assert 61 <= len(stored) <= 64, len(stored)  # up to maxmemory (64 blocks), past the high watermark
    info = r.info()
    assert info["evicted_keys"] == 0 and info["used_memory"] <= 4 * MiB
    assert r.exists(*stored) == len(stored) and r.get(stored[0]) == VALUE  # every key kept, reads served
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        r.set("small", b"s" * 100 * KiB)  # an inline-sized or a block-sized write alike
    assert r.delete(stored[0], stored[1]) == 2  # deletes are never refused, and make room
    assert r.set("after", VALUE) and r.get("after") == VALUE


def test_allkeys_lru_the_default_evicts_the_least_recently_used(node):
    r = _client(node.port)
    assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert r.info("memory")["maxmemory_policy"] == "allkeys-lru"
    assert r.config_set("maxmemory", 4 * MiB)
    for i in range(20):
        r.set(f"old{i}", VALUE)
    r.get("old0")  # read: now the most recently used of the old ones
    for i in range(100):
        assert r.set(f"new{i}", VALUE)  # never refused while something can go
    info = r.info()
    assert info["evicted_keys"] > 0 and info["used_memory"] <= 4 * MiB
    assert r.exists("old1") == 0 and r.exists("new99") == 1
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # evicting everything would not make room
        r.set("huge", b"h" * (5 * MiB))
    assert r.info("memory")["used_memory"] <= 4 * MiB and r.exists("new99") == 1


def test_a_lower_maxmemory_evicts_at_once_as_the_policy_allows(node):
    """CONFIG SET maxmemory below what is used: redis evicts at once, not at the next write."""
    r = _client(node.port)
    for i in range(40):
        r.set(f"k{i}", VALUE)  # 2.5 MiB, no limit yet
    assert r.config_set("maxmemory-policy", "noeviction") and r.config_set("maxmemory", 1 * MiB)
    info = r.info()
    assert info["evicted_keys"] == 0 and r.dbsize() == 40  # noeviction: nothing goes, writes are refused
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        r.set("more", VALUE)
    assert r.config_set("maxmemory-policy", "allkeys-lru") and r.config_set("maxmemory", 1 * MiB)
    info = r.info()
    assert info["evicted_keys"] > 0 and info["used_memory"] <= 1 * MiB, info["used_memory"]
    assert r.exists("k39") == 1 and r.exists("k0") == 0


def test_allkeys_lfu_keeps_the_often_read_over_the_recently_written(node):
    r = _client(node.port)
    assert r.config_set("maxmemory-policy", "allkeys-lfu") and r.config_set("maxmemory", 4 * MiB)
    assert r.info("memory")["maxmemory_policy"] == "allkeys-lfu"
    r.set("f", "v1")
    assert r.object("freq", "f") == 5  # a new key's counter, as redis's LFU_INIT_VAL
    r.get("f")
    assert r.object("freq", "f") == 6  # the first hit always counts
    with pytest.raises(redis.ResponseError, match="An LFU maxmemory policy is selected, idle time not tracked"):
        r.object("idletime", "f")
    hot = [f"hot{i}" for i in range(8)]
    for k in hot:
        r.set(k, VALUE)
    for _ in range(200):
        for k in hot:
            r.get(k)
    for i in range(8):
        r.set(f"cold{i}", VALUE)
    # the hot keys are now the least recently used
    for i in range(100):
        assert r.set(f"new{i}", VALUE)
    assert r.info()["evicted_keys"] > 0
    assert r.exists(*hot) == len(hot)  # under LRU these were the first to go
    assert r.exists(*(f"cold{i}" for i in range(8))) == 0
    assert r.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(redis.ResponseError, match="An LFU maxmemory policy is not selected"):
        r.object("freq", "f")


def test_lfu_counters_follow_lfu_log_factor_as_redis_s(node, redis_server):
    """With lfu-log-factor 0 every hit counts: the counters are exact, so both servers agree.

    Both decay a counter by one for each minute boundary crossed since the key's last access
    (lfu-decay-time 1), so the script starts where no boundary can fall inside it."""
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)
    script = [("CONFIG", "SET", "maxmemory-policy", "allkeys-lfu"), ("CONFIG", "SET", "lfu-log-factor", "0"),
              ("SET", "k", "v1"), ("GET", "k"), ("GET", "k"), ("GET", "k"), ("OBJECT", "FREQ", "k"),
              ("SET", "k", "v2"), ("OBJECT", "FREQ", "k"), ("CONFIG", "GET", "lfu-log-factor"),
              ("OBJECT", "IDLETIME", "k"), ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
              ("OBJECT", "FREQ", "k"), ("CONFIG", "SET", "lfu-log-factor", "10")]
    for c in script:
        theirs = exchange(redis_server, cmd(*c), lines=1)[0]
        ours = exchange(node.port, cmd(*c), lines=1)[0]
        assert ours == theirs, f"{c}: redis answered {theirs!r}, quilld {ours!r}"


def test_volatile_policies_evict_only_keys_with_a_ttl(node):
    for policy in ("volatile-lru", "volatile-lfu", "volatile-ttl"):
        r = _client(node.port)
        r.flushall()
        r.config_resetstat()
        assert r.config_set("maxmemory-policy", policy) and r.config_set("maxmemory", 4 * MiB)
        for i in range(20):
            r.set(f"keep{i}", VALUE)
        for i in range(20):
            r.set(f"ttl{i}", VALUE, ex=1000 + i)
        for i in range(25):  # past the high watermark (61 blocks): room from the keys with a TTL
            assert r.set(f"more{i}", VALUE), (policy, i)
        assert r.exists(*(f"keep{i}" for i in range(20))) == 20, policy
        assert r.info()["evicted_keys"] > 0
        if policy == "volatile-ttl":  # the nearest deadlines went first
            assert r.exists("ttl0") == 0 and r.exists("ttl19") == 1
        with pytest.raises(redis.exceptions.OutOfMemoryError):  # no key with a TTL left: nothing may go
            for i in range(100):
                r.set(f"more{i + 25}", VALUE)
        assert r.exists(*(f"ttl{i}" for i in range(20))) == 0, policy
        assert r.exists(*(f"keep{i}" for i in range(20))) == 20, policy
        r.close()


def test_policy_and_maxmemory_agree_everywhere_and_are_rewritten(quilld_factory, tmp_path):
    conf = tmp_path / "q.toml"
    conf.write_text("[dram]\nmaxmemory_policy = \"volatile-ttl\"\n")
    q = quilld_factory("--dram", "64MiB", "--config", str(conf))
    r = _client(q.port)
    assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-ttl"}
    # INFO's maxmemory is what CONFIG GET answers (as redis: 0 when unset, here the whole arena)
    assert r.info("memory")["maxmemory"] == 0 and r.config_get("maxmemory") == {"maxmemory": "0"}
    assert r.config_set("maxmemory", 5 * MiB)
    assert r.info("memory")["maxmemory"] == 5 * MiB and r.config_get("maxmemory") == {"maxmemory": str(5 * MiB)}
    with pytest.raises(redis.ResponseError, match="quilld does not offer allkeys-random"):
        r.config_set("maxmemory-policy", "allkeys-random")
    with pytest.raises(redis.ResponseError, match="argument 'maxmemory-policy'"):
        r.config_set("maxmemory-policy", "sometimes")
    assert r.config_set("maxmemory-policy", "noeviction")
    assert r.info("memory")["maxmemory_policy"] == "noeviction"
    assert r.config_rewrite()
    assert 'maxmemory_policy = "noeviction"' in conf.read_text()
