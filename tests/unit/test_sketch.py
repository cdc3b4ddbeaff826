"""The hot-prefix sketch against exact counts on seeded, skewed streams."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quilld.index.sketch import HotPrefixes

N_KEYS = 50_000
N_EVENTS = 200_000


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def zipf_stream(a: float = 1.3, n_keys: int = N_KEYS, n_events: int = N_EVENTS, seed: int = 7) -> np.ndarray:
    """Key numbers drawn with P(rank r) ~ r**-a, ranks shuffled so heat is not ordered by key."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, n_keys + 1, dtype=np.float64) ** -a
    ranks = rng.choice(n_keys, size=n_events, p=p / p.sum())
    return rng.permutation(n_keys)[ranks]


@pytest.fixture(scope="module")
def stream() -> tuple[list[bytes], np.ndarray]:
    ids = zipf_stream()
    return [key(i) for i in ids.tolist()], np.bincount(ids, minlength=N_KEYS)


def fed(keys: list[bytes], chunk: int = 10_000, **kw) -> HotPrefixes:
    hp = HotPrefixes(**kw)
    for lo in range(0, len(keys), chunk):
        hp.add_many(keys[lo:lo + chunk])
    return hp


def true_top(counts: np.ndarray, n: int) -> list[int]:
    return np.argsort(-counts, kind="stable")[:n].tolist()


@pytest.mark.parametrize("width", [256, 4096])
def test_never_below_true_count_and_mostly_within_bound(stream, width):
    keys, counts = stream
    hp = fed(keys, width=width)
    assert hp.total == N_EVENTS
    seen = np.flatnonzero(counts)
    est = np.array([hp.estimate(key(i)) for i in seen.tolist()])
    err = est - counts[seen]
    assert err.min() >= 0
    bound = math.e / width * hp.total
    assert np.mean(err <= bound) >= 0.95
    if width == 256:  # 256 columns for ~30k keys: collisions are everywhere, so the bound is not vacuous
        assert err.max() > 0


def test_top_finds_true_heavy_hitters_streaming(stream):
    keys, counts = stream
    hp = HotPrefixes()
    for k in keys:
        hp.add(k)
    got = [k for k, _ in hp.top(10)]
    want = [key(i) for i in true_top(counts, 10)]
    assert len(set(got) & set(want)) >= 9
    top = hp.top()
    assert len(top) == hp.top_k
    assert [e for _, e in top] == sorted((e for _, e in top), reverse=True)
    for k, e in top:
        assert e == hp.estimate(k) >= counts[int.from_bytes(k, "big")]


def test_top_finds_true_heavy_hitters_batched(stream):
    keys, counts = stream
    hp = fed(keys, chunk=5_000)
    got = [k for k, _ in hp.top(10)]
    want = [key(i) for i in true_top(counts, 10)]
    assert len(set(got) & set(want)) >= 9
    assert hp.top(3) == hp.top()[:3]
    assert hp.top(0) == []


def test_add_many_equals_repeated_add(stream):
    keys, _ = stream
    keys = keys[:20_000]
    one, many = HotPrefixes(width=512, seed=3), fed(keys, chunk=3_000, width=512, seed=3)
    for k in keys:
        one.add(k)
    assert np.array_equal(one._counts, many._counts)
    assert one.total == many.total == len(keys)
    for k in set(keys[:2_000]):
        assert one.estimate(k) == many.estimate(k)
    assert [k for k, _ in one.top(5)] == [k for k, _ in many.top(5)]

    few = [key(i % 10) for i in range(1, 200) for _ in range(i % 10)]  # 9 distinct keys < top_k
    one, many = HotPrefixes(), HotPrefixes()
    returned = [one.add(k) for k in few]
    many.add_many(few)
    assert one.top() == many.top()
    assert returned[-1] == one.estimate(few[-1])
    many.add_many([])
    assert many.total == len(few)


def test_add_with_count_returns_estimate():
    hp = HotPrefixes(width=64, depth=2)
    assert hp.add(b"a", 5) == 5
    assert hp.add(b"a", np.int64(3)) == 8
    assert hp.add(b"a", 0) == 8
    assert hp.total == 8
    assert hp.estimate(b"a") >= 8


def test_decay_halves_counters_total_and_top(stream):
    keys, counts = stream
    hp = fed(keys)
    before = {k: hp.estimate(k) for k in keys[:1_000]}
    top_before = hp.top()
    hp.decay()
    assert hp.total == N_EVENTS // 2
    assert all(hp.estimate(k) == e // 2 for k, e in before.items())
    assert hp.top() == [(k, e // 2) for k, e in top_before]
    for k in keys[:1_000]:  # still an upper bound on the decayed true count
        assert hp.estimate(k) >= counts[int.from_bytes(k, "big")] // 2

    hp.decay(0.25)
    assert hp.total == N_EVENTS // 2 // 4
    assert all(hp.estimate(k) == e // 2 // 4 for k, e in before.items())
    hp.decay(0.0)
    assert hp.total == 0 and hp.top() and all(e == 0 for _, e in hp.top())


def test_old_heat_fades_so_a_new_hot_key_takes_the_lead():
    hp = HotPrefixes(top_k=2)
    for _ in range(1_000):
        hp.add(b"old")
    for _ in range(3):
        hp.decay()
    for _ in range(200):
        hp.add(b"new")
    assert [k for k, _ in hp.top()] == [b"new", b"old"]


def test_late_heavy_key_evicts_the_smallest_tracked():
    hp = HotPrefixes(width=1024, top_k=3)
    for k, n in ((b"a", 10), (b"b", 20), (b"c", 30)):
        hp.add(k, n)
    hp.add(b"d", 5)  # below the smallest tracked: stays out
    assert {k for k, _ in hp.top()} == {b"a", b"b", b"c"}
    for _ in range(11):
        hp.add(b"d")  # 16 > 10: "a" goes
    assert [k for k, _ in hp.top()] == [b"c", b"b", b"d"]
    hp.add_many([b"e"] * 25)  # the batch path evicts too
    assert [k for k, _ in hp.top()] == [b"c", b"e", b"b"]


def test_seed_picks_the_hash_rows():
    a, b, c = HotPrefixes(width=256, seed=1), HotPrefixes(width=256, seed=1), HotPrefixes(width=256, seed=2)
    for hp in (a, b, c):
        hp.add_many([key(i) for i in range(100)])
    assert np.array_equal(a._counts, b._counts)
    assert not np.array_equal(a._counts, c._counts)


def test_memory_bytes_counts_the_matrix_and_the_tracked_keys():
    small, big = HotPrefixes(width=1024, depth=4), HotPrefixes(width=8192, depth=4)
    assert small.memory_bytes() >= 1024 * 4 * 8
    assert big.memory_bytes() - small.memory_bytes() == (8192 - 1024) * 4 * 8
    empty = small.memory_bytes()
    small.add_many([key(i) for i in range(100)])
    assert empty < small.memory_bytes() < 1024 * 4 * 8 + 32 * 1024


@pytest.mark.parametrize("kw", [
    {"width": 0}, {"width": -1}, {"width": 1.5}, {"width": 1 << 30},
    {"depth": 0}, {"depth": 100}, {"depth": "4"},
    {"top_k": 0}, {"seed": 1.0},
])
def test_invalid_construction_raises(kw):
    with pytest.raises(ValueError):
        HotPrefixes(**kw)


def test_invalid_calls_raise():
    hp = HotPrefixes()
    with pytest.raises(ValueError):
        hp.add(b"a", -1)
    with pytest.raises(TypeError):
        hp.add(b"a", 1.5)
    for factor in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            hp.decay(factor)
    with pytest.raises(ValueError):
        hp.top(-1)
    assert hp.total == 0


def test_top_reports_current_estimates_after_collisions():
    hp = HotPrefixes(width=1, depth=1, top_k=2)  # one counter: every key collides
    hp.add(b"a")
    hp.add(b"b", 5)
    assert hp.top() == [(b"a", 6), (b"b", 6)]


@pytest.mark.parametrize("batched", [False, True])
def test_a_growing_tracked_key_stops_being_the_smallest(batched):
    hp = HotPrefixes(width=1024, top_k=2)
    hp.add(b"a", 10)
    hp.add(b"b", 20)
    if batched:  # a: 25, so b (20) is now the smallest tracked
        hp.add_many([b"a"] * 15)
    else:
        hp.add(b"a", 15)
    hp.add(b"c", 12)  # 12 < 20: stays out
    assert [k for k, _ in hp.top()] == [b"a", b"b"]
