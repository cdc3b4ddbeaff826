"""The residency index against a plain reference model, and its memory per entry."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quilld.index.residency import ResidencyIndex, hash_key
from quilld.model import CacheTier

A, B = b"\x00\x00\x00\x01", b"\x00\x00\x00\x02"  # two scope tags
HOLDERS = [("node-1", "dram"), ("node-1", "ssd"), ("engine-a", "hbm"), ("engine-a", "cpu"),
           ("engine-b", "hbm"), ("engine-c", "cpu")]


def model_prefix(model: dict, tag: bytes, blocks: list) -> dict[str, int]:
    out: dict[str, int] = {}
    holders = {h for h, _ in HOLDERS}
    for h in holders:
        n = 0
        for b in blocks:
            if any(hh == h for hh, _ in model.get((tag, hash_key(b)), set())):
                n += 1
            else:
                break
        if n:
            out[h] = n
    return out


def test_put_locate_remove():
    idx = ResidencyIndex()
    assert idx.put(A, 42, "engine-a", CacheTier.HBM)
    assert not idx.put(A, 42, "engine-a", "hbm")  # already there
    assert idx.put(A, 42, "node-1", "dram")
    assert sorted(idx.locate(A, [42])[0]) == [("engine-a", CacheTier.HBM), ("node-1", CacheTier.DRAM)]
    assert idx.locate(B, [42]) == [[]]  # another scope sees nothing
    assert idx.remove(A, 42, "engine-a", "hbm")
    assert not idx.remove(A, 42, "engine-a", "hbm")
    assert not idx.remove(A, 42, "nobody", "hbm")
    assert idx.locate(A, [42]) == [[("node-1", CacheTier.DRAM)]]
    assert idx.remove(A, 42, "node-1", "dram")
    assert len(idx) == 0


def test_int_hashes_are_64_bit_and_bytes_hashes_stay_raw():
    idx = ResidencyIndex()
    idx.put(A, -1, "engine-a", "hbm")
    assert idx.locate(A, [(1 << 64) - 1]) == [[("engine-a", CacheTier.HBM)]]
    idx.put(A, b"\xde\xad", "engine-a", "cpu")
    assert idx.locate(A, [b"\xde\xad"]) == [[("engine-a", CacheTier.CPU)]]
    with pytest.raises(TypeError):
        idx.put(A, 1.5, "engine-a", "hbm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tier"):
        idx.put(A, 1, "engine-a", "gpu")


def test_clear_holder_one_tier_or_all():
    idx = ResidencyIndex()
    for h in range(100):
        idx.put(A, h, "engine-a", "hbm")
        idx.put(A, h, "engine-a", "cpu")
        idx.put(A, h, "node-1", "dram")
    assert idx.count("engine-a", "hbm") == 100
    assert idx.clear_holder("engine-a", "cpu") == 100
    assert idx.count("engine-a", "cpu") == 0 and idx.count("engine-a", "hbm") == 100
    assert idx.clear_holder("engine-a") == 100
    assert idx.count("engine-a", "hbm") == 0
    assert idx.locate(A, [5]) == [[("node-1", CacheTier.DRAM)]]
    assert idx.clear_holder("node-1") == 100
    assert len(idx) == 0
    assert idx.clear_holder("nobody") == 0


def test_prefix_lengths():
    idx = ResidencyIndex()
    chain = list(range(10))
    for b in chain[:7]:
        idx.put(A, b, "engine-a", "hbm")
    for b in chain[:3]:
        idx.put(A, b, "engine-b", "cpu")
    for b in chain[1:]:  # misses block 0: no prefix at all
        idx.put(A, b, "engine-c", "cpu")
    for b in chain:
        idx.put(A, b, "node-1", "ssd")
    idx.put(A, chain[4], "engine-b", "hbm")  # a hole before it: does not extend the prefix
    assert idx.prefix_lengths(A, chain) == {"engine-a": 7, "engine-b": 3, "node-1": 10}
    assert idx.prefix_lengths(B, chain) == {}
    assert idx.prefix_lengths(A, []) == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from([A, B]), st.integers(0, 30),
                          st.sampled_from(HOLDERS)), max_size=200),
       st.lists(st.integers(0, 30), max_size=12))
def test_matches_a_reference_model(ops, query):
    idx = ResidencyIndex()
    model: dict = {}
    for add, tag, block, (holder, tier) in ops:
        key = (tag, hash_key(block))
        have = (holder, tier) in model.get(key, set())
        if add:
            assert idx.put(tag, block, holder, tier) == (not have)
            model.setdefault(key, set()).add((holder, tier))
        else:
            assert idx.remove(tag, block, holder, tier) == have
            model.get(key, set()).discard((holder, tier))
    for tag in (A, B):
        got = [sorted((h, t.value) for h, t in row) for row in idx.locate(tag, query)]
        want = [sorted(model.get((tag, hash_key(b)), set())) for b in query]
        assert got == want
        assert idx.prefix_lengths(tag, query) == model_prefix(model, tag, query)
    assert len(idx) == sum(1 for v in model.values() if v)


def test_memory_per_entry():
    """Report bytes per resident block; bound it so a regression is caught."""
    n = 200_000
    rng = random.Random(7)
    hashes = [rng.getrandbits(64) for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = ResidencyIndex()
    for h in hashes:
        idx.put(A, h, "engine-a", "hbm")
        idx.put(A, h, "node-1", "dram")
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    print(f"residency index: {per_entry:.0f} bytes per block (two holders each), {n} blocks")
    assert len(idx) == n
    assert per_entry < 160


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=9),
                                                   max_size=6), st.sampled_from(["hbm", "cpu", "storage"])),
                max_size=20))
def test_put_many_and_remove_many_match_one_at_a_time(ops):
    one, many = ResidencyIndex(), ResidencyIndex()
    for is_put, blocks, tier in ops:
        if is_put:
            want = sum(one.put(A, b, "engine-a", tier) for b in blocks)
            assert many.put_many(A, blocks, "engine-a", tier) == want
        else:
            want = sum(one.remove(A, b, "engine-a", tier) for b in blocks)
            assert many.remove_many(A, blocks, "engine-a", tier) == want
    assert one._entries == many._entries and one.tag_entries == many.tag_entries
    assert all(one.count("engine-a", t) == many.count("engine-a", t) for t in ("hbm", "cpu", "storage"))
    assert sorted(many.holder_entries("engine-a")) == sorted(one.holder_entries("engine-a"))
    assert many.remove_many(A, [1], "nobody", "hbm") == 0


def test_the_storage_tier_is_one_more_bit_per_holder():
    idx = ResidencyIndex()
    idx.put(A, 1, "engine-a", CacheTier.STORAGE)
    idx.put(A, 1, "node-1", CacheTier.DRAM)
    assert sorted(idx.locate(A, [1])[0]) == [("engine-a", CacheTier.STORAGE), ("node-1", CacheTier.DRAM)]
    assert idx.prefix_lengths(A, [1, 2]) == {"engine-a": 1, "node-1": 1}
