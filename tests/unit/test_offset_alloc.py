"""OffsetAllocator against a plain interval model: no overlap, no lost units, merged
free space, and alloc failing only when no free region is large enough."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quilld.tiers.offset_alloc import (
    MAX_CAPACITY,
    NO_SPACE,
    OffsetAllocator,
    bin_round_down,
    bin_round_up,
    bin_size,
)


def complement(capacity, live):
    """Free regions implied by the live (offset, size) extents."""
    gaps, pos = [], 0
    for off, size in sorted(live):
        if off > pos:
            gaps.append((pos, off - pos))
        pos = off + size
    if pos < capacity:
        gaps.append((pos, capacity - pos))
    return gaps


def check(a, model):
    """Every invariant the allocator promises, against `model` (handle -> extent)."""
    assert a.used + a.free_units == a.capacity
    assert a.used == sum(size for _, size in model.values())
    for h, (off, size) in model.items():
        assert (a.offset(h), a.size(h)) == (off, size)
        assert 0 <= off and off + size <= a.capacity
    extents = sorted(model.values())
    for (o1, s1), (o2, _) in zip(extents, extents[1:]):
        assert o1 + s1 <= o2, "live allocations overlap"
    regions = a.free_regions()
    assert regions == complement(a.capacity, extents)
    for (o1, s1), (o2, _) in zip(regions, regions[1:]):
        assert o1 + s1 < o2, "adjacent free regions were not merged"
    assert a.largest_free() == max((s for _, s in regions), default=0)
    assert 0.0 <= a.fragmentation() <= 1.0


def test_bin_encoding_round_trips():
    rng = random.Random(1)
    for size in [*range(1, 5000), *(rng.randrange(1, MAX_CAPACITY) for _ in range(5000))]:
        up, down = bin_round_up(size), bin_round_down(size)
        assert bin_size(up) >= size
        assert bin_size(down) <= size
        assert up - down in (0, 1)
        assert (up == down) == (bin_size(down) == size)
        assert up <= 255
    for b in range(256):
        assert bin_round_up(bin_size(b)) == b == bin_round_down(bin_size(b))
    assert [bin_size(b) for b in range(18)] == [*range(16), 16, 18]
    assert bin_size(255) == MAX_CAPACITY


def test_randomized_against_model():
    rng = random.Random(20240601)
    capacity = 1 << 12
    a = OffsetAllocator(capacity)
    model = {}
    frag_max = 0.0
    for step in range(20_000):
        if model and (rng.random() < 0.45 or a.free_units == 0):
            h = rng.choice(list(model))
            a.free(h)
            del model[h]
        else:
            size = rng.randint(1, 64) if rng.random() < 0.9 else rng.randint(65, 1024)
            largest = a.largest_free()
            h = a.alloc(size)
            if h == NO_SPACE:
                assert largest < size, "alloc failed although a region was large enough"
            else:
                assert h not in model
                assert a.size(h) == size
                model[h] = (a.offset(h), size)
        frag_max = max(frag_max, a.fragmentation())
        if step % 7 == 0 or not model:
            check(a, model)
    check(a, model)
    print(f"\nmax fragmentation over 20k ops: {frag_max:.3f}, at end: {a.fragmentation():.3f}")
    assert 0.0 < frag_max <= 1.0
    for h in list(model):
        a.free(h)
        del model[h]
    check(a, model)
    assert a.free_regions() == [(0, capacity)]
    assert a.used == 0 and a.largest_free() == capacity and a.fragmentation() == 0.0


def test_exhaustion_returns_no_space_and_recovers():
    a = OffsetAllocator(100)
    handles = [a.alloc(10) for _ in range(10)]
    assert NO_SPACE not in handles and a.used == 100
    assert a.alloc(1) == NO_SPACE
    assert a.largest_free() == 0 and a.fragmentation() == 0.0
    a.free(handles[3])
    a.free(handles[5])
    assert a.alloc(11) == NO_SPACE
    assert a.fragmentation() == 0.5
    a.free(handles[4])
    h = a.alloc(30)
    assert (a.offset(h), a.size(h)) == (30, 30)
    assert a.free_units == 0


def test_exact_fit_of_size_between_bins():
    # 17 is not a bin size (bins go 16, 18): plain TLSF would refuse it here.
    a = OffsetAllocator(17)
    h = a.alloc(17)
    assert (a.offset(h), a.size(h)) == (0, 17)


def test_double_free_and_bad_handles_raise():
    a = OffsetAllocator(64)
    h = a.alloc(8)
    a.free(h)
    with pytest.raises(ValueError):
        a.free(h)
    for bad in (-1, 10**6):
        with pytest.raises(ValueError):
            a.free(bad)
        with pytest.raises(ValueError):
            a.offset(bad)
    with pytest.raises(ValueError):
        a.size(h)
    assert a.free_regions() == [(0, 64)]


def test_argument_validation():
    for bad in (0, -5, MAX_CAPACITY + 1):
        with pytest.raises(ValueError):
            OffsetAllocator(bad)
    a = OffsetAllocator(10)
    with pytest.raises(ValueError):
        a.alloc(0)
    assert a.alloc(11) == NO_SPACE


def test_max_allocs_cap():
    a = OffsetAllocator(100, max_allocs=2)
    h1, h2 = a.alloc(1), a.alloc(1)
    assert a.alloc(1) == NO_SPACE
    a.free(h1)
    assert a.alloc(1) != NO_SPACE
    assert h2 != NO_SPACE


def test_node_table_grows_past_initial_size():
    a = OffsetAllocator(10_000)
    handles = [a.alloc(1) for _ in range(5_000)]
    assert NO_SPACE not in handles and len(set(handles)) == 5_000
    for h in handles[::2]:
        a.free(h)
    assert len(a.free_regions()) == 2_501
    for h in handles[1::2]:
        a.free(h)
    assert a.free_regions() == [(0, 10_000)]


def test_from_extents_rebuilds_and_refills_gaps_exactly():
    rng = random.Random(7)
    capacity = 5_000
    extents, pos = [], 0
    while True:
        pos += rng.randint(0, 40)
        size = rng.randint(1, 60)
        if pos + size > capacity:
            break
        extents.append((pos, size))
        pos += size
    rng.shuffle(extents)
    a, handles = OffsetAllocator.from_extents(capacity, extents)
    model = dict(zip(handles, extents))
    assert len(model) == len(extents)
    check(a, model)

    gaps = a.free_regions()
    for off, size in sorted(gaps, key=lambda r: -r[1]):
        h = a.alloc(size)
        assert h != NO_SPACE
        model[h] = (a.offset(h), size)
    assert a.free_units == 0
    check(a, model)
    assert sorted(model.values()) == sorted(extents + gaps)

    for h in list(model):
        a.free(h)
    assert a.free_regions() == [(0, capacity)]


def test_from_extents_edges():
    a, hs = OffsetAllocator.from_extents(10, [])
    assert a.free_regions() == [(0, 10)] and hs == []
    a, hs = OffsetAllocator.from_extents(10, [(0, 10)])
    assert a.free_units == 0 and a.alloc(1) == NO_SPACE
    a.free(hs[0])
    assert a.free_regions() == [(0, 10)]
    a, hs = OffsetAllocator.from_extents(10, [(9, 1), (0, 1)])
    assert [a.offset(h) for h in hs] == [9, 0]
    assert a.free_regions() == [(1, 8)]


@pytest.mark.parametrize(
    "extents",
    [
        [(0, 5), (4, 2)],  # overlap
        [(3, 4), (3, 1)],  # same start
        [(0, 5), (2, 1)],  # contained
        [(8, 3)],  # runs past the end
        [(-1, 2)],  # before the start
        [(2, 0)],  # empty
    ],
)
def test_from_extents_rejects_bad_extents(extents):
    with pytest.raises(ValueError):
        OffsetAllocator.from_extents(10, extents)


class AllocatorMachine(RuleBasedStateMachine):
    capacity = 300

    def __init__(self):
        super().__init__()
        self.a = OffsetAllocator(self.capacity)
        self.model = {}

    @rule(size=st.integers(1, 120))
    def alloc(self, size):
        largest = self.a.largest_free()
        h = self.a.alloc(size)
        if h == NO_SPACE:
            assert largest < size
        else:
            self.model[h] = (self.a.offset(h), size)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        h = data.draw(st.sampled_from(sorted(self.model)))
        self.a.free(h)
        del self.model[h]

    @invariant()
    def consistent(self):
        check(self.a, self.model)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
