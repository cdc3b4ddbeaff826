"""Eviction on a small (64 MiB) DRAM arena: writes never fail while something can be
evicted, memory stays within capacity, the newest and the recently read values stay,
and a value larger than the whole arena is refused with OOM.
"""

from __future__ import annotations

import random

import pytest
import redis

from conftest import raw_exchange

MiB = 1024 * 1024
CAPACITY = 64 * MiB
N = 200


def value(i: int) -> bytes:
    """The 1 MiB value of key i: distinct per key, so a wrong or mixed read shows."""
    return random.Random(i).randbytes(MiB)


def key(i: int) -> str:
    return f"v:{i:04d}"


@pytest.fixture
def small(quilld_factory):
    q = quilld_factory("--dram", "64MiB")
    yield q
    assert q.proc.poll() is None, f"quilld exited:\n{q.log()}"


def test_writes_beyond_capacity_evict_lru_and_never_fail(small):
    r = small.client(single_connection_client=True)
    t = r.info("tiers")
    assert t["dram_capacity"] == CAPACITY
    high = int(t["dram_high_watermark"] * CAPACITY)
    for i in range(N):
        assert r.set(key(i), value(i)) is True, i
        t = r.info("tiers")
        assert t["dram_used"] <= CAPACITY and t["dram_used_arena"] <= CAPACITY, (i, t)
        assert t["dram_used"] <= high, (i, t)  # eviction starts at the high watermark
    st = r.info("stats")
    assert st["evicted_keys"] > 0
    left = r.dbsize()
    assert st["evicted_keys"] + left == N
    assert 40 <= left <= 64, left  # what 85-95% of 64 MiB holds

    # Exactly the newest values survive (LRU with no reads = insertion order), byte-exact.
    present = [i for i in range(N) if r.exists(key(i))]
    assert present == list(range(N - left, N))
    for i in range(N - 40, N):
        assert r.get(key(i)) == value(i), i
    assert r.get(key(0)) is None
    assert r.info("tiers")["dram_keys"] == left

    # A value far larger than what is free (but within capacity) still fits: it evicts.
    big = random.Random("big").randbytes(48 * MiB)
    assert r.set("big", big) is True
    assert r.get("big") == big
    t = r.info("tiers")
    assert t["dram_used"] <= CAPACITY and t["dram_reserved_blocks"] == 0
    # So does a two-phase reservation.
    h = r.execute_command("PUT2PHASE", "BEGIN", "blk", 40 * MiB)
    assert r.info("tiers")["dram_reserved_blocks"] == 1
    assert r.execute_command("PUT2PHASE", "ABORT", h) == b"OK"


def test_value_larger_than_the_arena_is_oom_and_the_server_stays_up(small):
    r = small.client(single_connection_client=True)
    for i in range(5):
        r.set(key(i), value(i))
    before = r.info("tiers")
    # redis-py turns an error starting with `OOM` into OutOfMemoryError (prefix stripped).
    with pytest.raises(redis.exceptions.OutOfMemoryError, match="larger than the DRAM arena"):
        r.set("huge", b"\x00" * (100 * MiB))
    # The same connection is still in sync, nothing was stored, nothing was evicted or leaked.
    assert r.ping() is True
    assert r.exists("huge") == 0
    after = r.info("tiers")
    for field in ("dram_used", "dram_used_arena", "dram_keys", "dram_reserved_blocks"):
        assert after[field] == before[field], field
    assert [r.get(key(i)) == value(i) for i in range(5)] == [True] * 5
    assert small.client().ping() is True

    assert raw_exchange(small.port, b"PUT2PHASE BEGIN huge %d\r\n" % (100 * MiB)).startswith(b"-OOM ")
    assert r.info("stats")["put2phase_open"] == 0
    assert r.info("tiers")["dram_reserved_blocks"] == 0


def test_recently_read_values_survive_eviction_better_than_untouched_ones(small):
    r = small.client(single_connection_client=True)
    hot = list(range(0, 20, 2))  # written first, then read over and over
    cold = list(range(1, 20, 2))  # written at the same time, never read
    for i in range(20):
        r.set(key(i), value(i))
    for i in range(20, 20 + 150):
        r.set(key(i), value(i))
        if i % 5 == 0:
            for h in hot:
                assert r.get(key(h)) == value(h), (i, h)
    assert r.info("stats")["evicted_keys"] >= 100
    assert [r.exists(key(c)) for c in cold] == [0] * len(cold)
    assert [r.get(key(h)) == value(h) for h in hot] == [True] * len(hot)


def test_mget_of_blocks_releases_their_pins(small):
    # MGET answers arena blocks straight from memory; once sent they must be
    # unpinned, or they could never be evicted or freed
    r = redis.Redis(port=small.port)
    r.set("big", value(1))
    r.set("small", b"s")
    for _ in range(3):
        assert r.mget("big", "small", "none") == [value(1), b"s", None]
    r.delete("big")
    tiers = r.info("tiers")
    assert tiers["dram_held_bytes"] == 0 and tiers["dram_pinned_unlinked"] == 0
    assert r.info("memory")["used_memory"] < MiB


def put_chained(r: redis.Redis, key: str, block_hash: int, parent: int | None, payload: bytes) -> None:
    """One block stored with its engine hash and its parent's (PUT2PHASE BEGIN ... HASH h PARENT p)."""
    extra = ["HASH", block_hash] + ([] if parent is None else ["PARENT", parent])
    handle = r.execute_command("PUT2PHASE", "BEGIN", key, len(payload), *extra)
    r.execute_command("PUT2PHASE", "DATA", handle, 0, payload)
    r.execute_command("PUT2PHASE", "COMMIT", handle)


def test_a_chain_written_past_the_arena_keeps_its_head(small):
    """A KV prefix is only worth its first blocks: 1.5x the arena of one chain (each block naming
    its parent) leaves a prefix from block 0, as long as fits, not the chain's last blocks; plain
    keys written after it are still evicted least recently used first."""
    r = redis.Redis(port=small.port)
    block = 1024 * 1024
    count = CAPACITY * 3 // 2 // block
    for i in range(count):
        put_chained(r, f"chain:{i}", 1000 + i, None if i == 0 else 1000 + i - 1, bytes([i % 256]) * block)
    present = [r.exists(f"chain:{i}") == 1 for i in range(count)]
    prefix = present.index(False) if False in present else count
    fits = int(CAPACITY * 0.8) // block  # under the low watermark, and a block or so of slack
    print(f"\n{count} chained 1 MiB blocks into a {CAPACITY >> 20} MiB arena: blocks 0..{prefix - 1} kept "
          f"({sum(present)} in all), {r.info('stats')['evicted_chain_tails']} chain tails evicted")
    assert prefix >= fits * 3 // 4, present
    assert r.get("chain:0") == bytes([0]) * block  # the head, byte for byte
    assert sum(present[prefix:]) <= 2  # past the prefix, at most the newest block or two (orphans go first)
