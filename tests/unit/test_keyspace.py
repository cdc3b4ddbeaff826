"""The keyspace (tiers/keyspace.py), two-phase puts (tiers/puts.py) and identity scopes (scopes.py).

Small arenas (a few 4 KiB pages) make eviction, pins and out-of-memory easy to reach.
The accounting invariant `store.used == store.arena.used + store.inline_bytes` is
checked after every step of the random sequences.
"""

from __future__ import annotations

import random
import time

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from quilld.config import DramConfig
from quilld.errors import ChecksumMismatch, CommandError, Incomplete, NoHandle, OutOfMemory, UnfilledLimit
from quilld.scopes import TAG_LEN, ScopeRegistry, refusal_reason
from quilld.model import IdentityScope, Pending, Pinned
from quilld.tiers.block import BlockState
from quilld.tiers.keyspace import Block, Keyspace, now_ms
from quilld.tiers.arena import PAGE
from quilld.tiers.puts import PUT_OVERHEAD, IntoBlock, Put, TwoPhasePuts

DEFAULT = IdentityScope()


def make_store(pages: int = 64, high: float = 0.9, low: float = 0.5, inline_max: int = 256) -> Keyspace:
    cfg = DramConfig(size=pages * PAGE, high_watermark=high, low_watermark=low, inline_max=inline_max)
    return Keyspace(cfg, ScopeRegistry())


def check_accounting(store: Keyspace) -> None:
    assert store.used == store.arena.used + store.inline_bytes
    values = list(store.data.values())
    assert store.inline_bytes == sum(len(v) for v in values if type(v) is bytes)
    assert store.block_count == sum(1 for v in values if type(v) is Block)
    assert all(v.state == BlockState.RESIDENT for v in values if type(v) is Block)
    assert sum(store.per_scope.values()) == len(store.data)


def put(store: Keyspace, tag: bytes, key: bytes, value: bytes) -> None:
    store.publish(tag, key, store.materialize(value))


def read(store: Keyspace, tag: bytes, key: bytes) -> bytes | None:
    value = store.lookup(tag, key)
    if value is None or type(value) is bytes:
        return value
    return bytes(store.view(value))


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def store() -> Keyspace:
    return make_store()


@pytest.fixture
def tag(store: Keyspace) -> bytes:
    return store.scopes.tag(DEFAULT)


# -- values: inline and in the arena ---------------------------------------------

def test_small_values_stay_inline_large_ones_take_pages(store, tag):
    small, edge, large = b"s" * 10, b"e" * store.inline_max, b"L" * (store.inline_max + 1)
    assert type(store.materialize(small)) is bytes
    assert type(store.materialize(edge)) is bytes
    block = store.materialize(large)
    assert type(block) is Block and len(block) == len(large)
    assert bytes(store.view(block)) == large
    assert store.arena.used == PAGE
    store.discard(block)
    assert store.arena.used == 0 and store.used == 0
    check_accounting(store)


def test_materialize_copies_from_any_buffer(store):
    data = bytearray(b"x" * 5000)
    block = store.materialize(memoryview(data))
    data[:] = b"y" * 5000  # the caller's buffer is reused: the block keeps its own copy
    assert bytes(store.view(block)) == b"x" * 5000
    inline = store.materialize(bytearray(b"abc"))
    assert type(inline) is bytes and inline == b"abc"


def test_publish_lookup_delete(store, tag):
    assert read(store, tag, b"k") is None
    put(store, tag, b"k", b"v1")
    assert read(store, tag, b"k") == b"v1"
    assert store.block_count == 0 and store.inline_bytes == 2
    big = pattern(3 * PAGE + 1, 1)
    put(store, tag, b"k", big)  # inline -> block
    assert read(store, tag, b"k") == big
    assert store.inline_bytes == 0 and store.arena.used == 4 * PAGE and store.block_count == 1
    put(store, tag, b"k", b"v3")  # block -> inline: the pages go back
    assert read(store, tag, b"k") == b"v3"
    assert store.arena.used == 0 and store.block_count == 0
    check_accounting(store)
    assert store.keys_in(tag) == 1
    assert store.delete(tag, b"k") is True
    assert store.delete(tag, b"k") is False
    assert read(store, tag, b"k") is None
    assert store.used == 0 and store.keys_in(tag) == 0
    check_accounting(store)


def test_empty_value(store, tag):
    put(store, tag, b"k", b"")
    assert read(store, tag, b"k") == b""
    assert store.contains(tag, b"k")


def test_zero_byte_reservation_takes_one_page(store):
    block = store.reserve(0)
    assert len(block) == 0 and store.arena.used == PAGE
    store.discard(block)
    assert store.used == 0


def test_hits_misses_and_writes(store, tag):
    put(store, tag, b"a", b"1")
    store.lookup(tag, b"a")
    store.lookup(tag, b"a")
    store.lookup(tag, b"nope")
    assert (store.lookups_of(), store.writes) == ((2, 1), 1)
    assert store.lookups_of("default") == (2, 1) and store.lookups_of("someone-else") == (0, 0)


def test_reserved_block_is_invisible_until_published(store, tag):
    block = store.reserve(5000)
    store.write_view(block)[:] = b"z" * 5000
    assert block.state == BlockState.WRITING
    assert store.lookup(tag, b"k") is None and store.reserved_blocks == 1
    store.publish(tag, b"k", block)
    assert block.state == BlockState.RESIDENT and store.reserved_blocks == 0
    assert read(store, tag, b"k") == b"z" * 5000


def test_discard_gives_the_reservation_back(store):
    block = store.reserve(3 * PAGE)
    assert store.used == 3 * PAGE
    store.discard(block)
    assert store.used == 0 and store.reserved_blocks == 0 and block.state == BlockState.GONE
    check_accounting(store)


def test_flush_scope(store):
    a, b = store.scopes.tag(IdentityScope("a")), store.scopes.tag(IdentityScope("b"))
    for i in range(5):
        put(store, a, b"k%d" % i, pattern(100 + 2000 * i, i))
        put(store, b, b"k%d" % i, b"b")
    assert store.flush_scope(a) == 5
    assert store.keys_in(a) == 0 and store.keys_in(b) == 5
    assert store.arena.used == 0
    assert read(store, b, b"k3") == b"b"
    check_accounting(store)


# -- eviction -----------------------------------------------------------------------

def test_lru_eviction_from_high_down_to_low_watermark():
    store = make_store(pages=100, high=0.9, low=0.5, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    for i in range(90):  # 90 pages: exactly the high watermark, nothing evicted yet
        put(store, tag, b"k%d" % i, b"v%d" % i)
    assert store.used == 90 * PAGE == store.high_bytes
    assert store.stats["evictions"] == 0
    for i in range(10):  # looked up: now the most recently used
        assert read(store, tag, b"k%d" % i) == b"v%d" % i
    for i in range(10, 20):  # contains() is not a use
        assert store.contains(tag, b"k%d" % i)
    put(store, tag, b"new", b"x")  # above the high watermark: evict down to the low one
    assert store.used == 50 * PAGE == store.low_bytes
    assert store.stats["evictions"] == 41
    gone = {i for i in range(90) if not store.contains(tag, b"k%d" % i)}
    assert gone == set(range(10, 51))  # least recently looked up first
    assert read(store, tag, b"new") == b"x"
    check_accounting(store)


def test_publish_order_is_use_order():
    store = make_store(pages=10, high=1.0, low=0.5, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    for i in range(10):
        put(store, tag, b"k%d" % i, b"v")
    put(store, tag, b"k0", b"again")  # rewriting k0 makes it the most recent
    put(store, tag, b"k10", b"v")
    present = [i for i in range(11) if store.contains(tag, b"k%d" % i)]
    assert present == [0] + list(range(6, 11))
    check_accounting(store)


def test_inline_values_count_and_are_evicted():
    store = make_store(pages=16, high=0.5, low=0.25, inline_max=4096)
    tag = store.scopes.tag(DEFAULT)
    for i in range(8):  # 8 x 4 KiB inline = the high watermark
        put(store, tag, b"k%d" % i, bytes([i]) * 4096)
    assert store.used == 8 * 4096 and store.arena.used == 0
    assert store.stats["evictions"] == 0
    put(store, tag, b"k8", b"\x08" * 4096)
    assert store.used == store.low_bytes == 4 * 4096
    assert [i for i in range(9) if store.contains(tag, b"k%d" % i)] == [5, 6, 7, 8]
    check_accounting(store)


def test_eviction_makes_room_in_a_fragmented_arena():
    store = make_store(pages=8, high=1.0, low=1.0, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    for i in range(8):
        put(store, tag, b"k%d" % i, b"v")
    # a 3-page value needs contiguous pages: the least recently used are evicted until it fits
    put(store, tag, b"big", b"B" * (3 * PAGE))
    assert read(store, tag, b"big") == b"B" * (3 * PAGE)
    assert store.contains(tag, b"k7")
    check_accounting(store)


def test_reserve_larger_than_the_arena_is_out_of_memory(store, tag):
    put(store, tag, b"keep", b"x" * 5000)
    before = store.used
    with pytest.raises(OutOfMemory) as info:
        store.reserve(store.capacity + 1)
    assert info.value.wire().startswith("OOM ")
    with pytest.raises(OutOfMemory):
        store.materialize(b"x" * (store.capacity + 1))
    assert store.used == before and read(store, tag, b"keep") == b"x" * 5000
    check_accounting(store)


def test_whole_arena_value_fits_when_nothing_else_is_held():
    store = make_store(pages=4, high=1.0, low=0.5, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    put(store, tag, b"a", b"a")
    put(store, tag, b"all", b"A" * store.capacity)
    assert read(store, tag, b"all") == b"A" * store.capacity
    assert not store.contains(tag, b"a")
    check_accounting(store)


# -- pins -------------------------------------------------------------------------

def test_pinned_blocks_are_never_evicted():
    store = make_store(pages=10, high=1.0, low=0.5, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    for i in range(10):
        put(store, tag, b"k%d" % i, b"v%d" % i)
    pinned = [store.lookup(tag, b"k%d" % i) for i in (0, 1, 2)]
    for block in pinned:
        store.pin(block)
    for i in range(10, 40):  # heavy pressure: everything else cycles through
        put(store, tag, b"k%d" % i, b"v%d" % i)
        check_accounting(store)
    for i, block in zip((0, 1, 2), pinned):
        assert block.state == BlockState.RESIDENT
        assert read(store, tag, b"k%d" % i) == b"v%d" % i
    for block in pinned:
        store.unpin(block)
    check_accounting(store)


def test_overwritten_pinned_block_is_freed_at_unpin(store, tag):
    old_value = pattern(2 * PAGE, 7)
    put(store, tag, b"k", old_value)
    block = store.lookup(tag, b"k")
    store.pin(block)
    view = store.view(block)  # what a reader is sending
    put(store, tag, b"k", b"new")
    assert read(store, tag, b"k") == b"new"
    assert block.state == BlockState.EVICTING and store.unlinked_pinned == 1
    assert store.arena.used == 2 * PAGE  # still held for the reader
    for i in range(20):  # new writes must not reuse its pages
        put(store, tag, b"other%d" % i, pattern(PAGE, 100 + i))
    assert bytes(view) == old_value
    check_accounting(store)
    before = store.arena.used
    store.unpin(block)
    assert block.state == BlockState.GONE and store.unlinked_pinned == 0
    assert store.arena.used == before - 2 * PAGE
    check_accounting(store)


def test_deleted_pinned_block_is_freed_at_last_unpin(store, tag):
    put(store, tag, b"k", b"q" * 5000)
    block = store.lookup(tag, b"k")
    store.pin(block)
    store.pin(block)  # two readers
    assert store.delete(tag, b"k")
    assert store.lookup(tag, b"k") is None
    assert store.arena.used == 2 * PAGE
    store.unpin(block)
    assert store.arena.used == 2 * PAGE and block.state == BlockState.EVICTING
    store.unpin(block)
    assert store.arena.used == 0 and block.state == BlockState.GONE
    check_accounting(store)


def test_unpin_of_a_resident_block_frees_nothing(store, tag):
    put(store, tag, b"k", b"q" * 5000)
    block = store.lookup(tag, b"k")
    store.pin(block)
    store.unpin(block)
    assert block.state == BlockState.RESIDENT and read(store, tag, b"k") == b"q" * 5000
    assert store.arena.used == 2 * PAGE


def test_all_pinned_and_no_space_is_out_of_memory():
    store = make_store(pages=8, high=1.0, low=0.5, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    for i in range(8):
        put(store, tag, b"k%d" % i, b"v%d" % i)
        store.pin(store.lookup(tag, b"k%d" % i))
    with pytest.raises(OutOfMemory):
        store.reserve(1)
    with pytest.raises(OutOfMemory):
        put(store, tag, b"more", b"x")
    assert all(read(store, tag, b"k%d" % i) == b"v%d" % i for i in range(8))
    assert store.used == 8 * PAGE
    check_accounting(store)
    store.unpin(store.lookup(tag, b"k3"))  # one reader done: now there is room
    put(store, tag, b"more", b"x")
    assert read(store, tag, b"more") == b"x" and not store.contains(tag, b"k3")
    check_accounting(store)


def test_reservations_in_progress_are_not_evicted():
    store = make_store(pages=4, high=1.0, low=0.5, inline_max=0)
    held = [store.reserve(PAGE) for _ in range(4)]
    with pytest.raises(OutOfMemory):
        store.reserve(1)
    store.discard(held.pop())
    store.discard(store.reserve(1))
    for block in held:
        store.discard(block)
    assert store.used == 0


# -- the accounting invariant under random operations ----------------------------------

SIZES = [0, 1, 255, 256, 257, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE]


class StoreMachine(RuleBasedStateMachine):
    """Random puts, reads, deletes, pins, expiries and reservations against a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.store = make_store(pages=24, high=0.75, low=0.5, inline_max=256)
        self.tags = [self.store.scopes.tag(IdentityScope(t)) for t in ("a", "b")]
        self.model: dict[tuple[int, bytes], bytes] = {}
        self.pinned: list[tuple[Block, bytes]] = []  # (block, the bytes its readers see)
        self.serial = 0

    def _sync(self) -> None:
        """Keys the store no longer holds were evicted or expired: drop them from the model."""
        for (s, key) in list(self.model):
            if self.tags[s] + key not in self.store.data:
                del self.model[(s, key)]

    @rule(s=st.integers(0, 1), key=st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4"]),
          size=st.sampled_from(SIZES))
    def write(self, s, key, size):
        self.serial += 1
        value = pattern(size, self.serial)
        try:
            put(self.store, self.tags[s], key, value)
        except OutOfMemory:
            assert self.pinned, "out of memory with nothing pinned"
        else:
            self.model[(s, key)] = value
        self._sync()

    @rule(s=st.integers(0, 1), key=st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4"]))
    def lookup(self, s, key):
        got = read(self.store, self.tags[s], key)
        if got is None:
            self.model.pop((s, key), None)
        else:
            assert got == self.model[(s, key)]

    @rule(s=st.integers(0, 1), key=st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4"]))
    def delete(self, s, key):
        existed = self.store.delete(self.tags[s], key)
        assert existed == ((s, key) in self.model)
        self.model.pop((s, key), None)

    @rule(s=st.integers(0, 1), key=st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4"]))
    def pin(self, s, key):
        value = self.store.lookup(self.tags[s], key)
        if type(value) is Block:
            self.store.pin(value)
            self.pinned.append((value, bytes(self.store.view(value))))

    @rule(i=st.integers(0, 10))
    def unpin(self, i):
        if self.pinned:
            block, seen = self.pinned.pop(i % len(self.pinned))
            assert bytes(self.store.view(block)) == seen  # never freed or reused under the pin
            self.store.unpin(block)

    @rule(s=st.integers(0, 1), key=st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4"]),
          sweep=st.booleans())
    def expire_now(self, s, key, sweep):
        if (s, key) in self.model:
            self.store.set_expire(self.tags[s], key, now_ms() - 1)
            if sweep:
                assert self.store.sweep_expired() == 1
            else:
                assert self.store.lookup(self.tags[s], key) is None
            del self.model[(s, key)]

    @rule(size=st.sampled_from(SIZES))
    def reserve_and_discard(self, size):
        try:
            block = self.store.reserve(size)
        except OutOfMemory:
            assert self.pinned
        else:
            check_accounting(self.store)
            self.store.discard(block)
        self._sync()

    @invariant()
    def accounting(self):
        check_accounting(self.store)
        assert self.store.reserved_blocks == 0
        assert self.store.unlinked_pinned == sum(
            1 for b in {id(b): b for b, _ in self.pinned}.values() if b.state == BlockState.EVICTING)

    @invariant()
    def pinned_blocks_hold_their_bytes(self):
        for block, seen in self.pinned:
            assert block.state in (BlockState.RESIDENT, BlockState.EVICTING)
            assert bytes(self.store.view(block)) == seen

    @invariant()
    def model_agrees(self):
        for (s, key), value in self.model.items():
            held = self.store.data[self.tags[s] + key]
            assert (held if type(held) is bytes else bytes(self.store.view(held))) == value

    def teardown(self):
        for block, _ in self.pinned:
            self.store.unpin(block)
        check_accounting(self.store)
        assert self.store.arena.used == sum(
            -(-max(len(v), 1) // PAGE) * PAGE for v in self.store.data.values() if type(v) is Block)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


# -- TTLs ----------------------------------------------------------------------------

def test_ttl(store, tag):
    put(store, tag, b"k", b"v")
    assert store.ttl_ms(tag, b"k") == -1
    assert store.ttl_ms(tag, b"missing") == -2
    store.set_expire(tag, b"k", now_ms() + 10_000)
    assert 9_000 < store.ttl_ms(tag, b"k") <= 10_000
    assert read(store, tag, b"k") == b"v"


def test_expired_key_is_gone_on_access(store, tag):
    put(store, tag, b"k", b"x" * 5000)
    store.set_expire(tag, b"k", now_ms() - 1)
    assert store.lookup(tag, b"k") is None
    assert store.ttl_ms(tag, b"k") == -2
    assert store.stats["expired"] == 1
    assert store.used == 0
    check_accounting(store)


@pytest.mark.parametrize("probe", ["contains", "ttl_ms", "delete"])
def test_every_access_sees_expiry(store, tag, probe):
    put(store, tag, b"k", b"v")
    store.set_expire(tag, b"k", now_ms() - 1)
    result = getattr(store, probe)(tag, b"k")
    assert result == {"contains": False, "ttl_ms": -2, "delete": False}[probe]
    assert store.used == 0 and store.keys_in(tag) == 0
    check_accounting(store)


def test_sweep_expired(store, tag):
    for i in range(10):
        put(store, tag, b"k%d" % i, pattern(100 + 1000 * i, i))
    now = now_ms()
    for i in range(6):
        store.set_expire(tag, b"k%d" % i, now - 1000 + i)
    store.set_expire(tag, b"k6", now + 60_000)
    assert store.sweep_expired(limit=4) == 4
    assert store.sweep_expired() == 2
    assert store.sweep_expired() == 0
    assert [i for i in range(10) if store.contains(tag, b"k%d" % i)] == [6, 7, 8, 9]
    assert store.stats["expired"] == 6
    assert store.ttl_ms(tag, b"k6") > 50_000
    check_accounting(store)


def test_sweep_off_leaves_expired_keys_to_reads(store, tag):
    """active_expire off (DEBUG SET-ACTIVE-EXPIRE 0): the sweep reclaims nothing; an expired key
    stays counted until a read reclaims it; switched back on, the sweep takes the rest."""
    for i in range(3):
        put(store, tag, b"k%d" % i, b"v")
        store.set_expire(tag, b"k%d" % i, now_ms() - 1)
    store.active_expire = False
    assert store.sweep_expired() == 0
    assert store.keys_in(tag) == 3
    assert store.lookup(tag, b"k0") is None
    assert store.keys_in(tag) == 2
    store.active_expire = True
    assert store.sweep_expired() == 2
    assert store.keys_in(tag) == 0
    check_accounting(store)


def test_overwrite_clears_ttl_unless_kept(store, tag):
    put(store, tag, b"k", b"v")
    store.set_expire(tag, b"k", now_ms() + 10_000)
    store.publish(tag, b"k", store.materialize(b"v2"), keep_ttl=True)
    assert store.ttl_ms(tag, b"k") > 0
    store.publish(tag, b"k", store.materialize(b"v3"))
    assert store.ttl_ms(tag, b"k") == -1
    assert store.sweep_expired() == 0


def test_stale_ttl_never_hits_a_recreated_key(store, tag):
    put(store, tag, b"k", b"v")
    store.set_expire(tag, b"k", now_ms() - 1)
    put(store, tag, b"k", b"new")  # overwritten before the sweep: the old deadline is void
    assert store.sweep_expired() == 0
    assert read(store, tag, b"k") == b"new" and store.ttl_ms(tag, b"k") == -1
    put(store, tag, b"d", b"v")
    store.set_expire(tag, b"d", now_ms() + 60_000)
    store.delete(tag, b"d")
    put(store, tag, b"d", b"again")
    assert store.ttl_ms(tag, b"d") == -1


def test_evicted_key_leaves_no_ttl_behind():
    store = make_store(pages=4, high=1.0, low=0.5, inline_max=0)
    tag = store.scopes.tag(DEFAULT)
    put(store, tag, b"k", b"v")
    store.set_expire(tag, b"k", now_ms() + 60_000)
    for i in range(8):
        put(store, tag, b"o%d" % i, b"v")
    assert not store.contains(tag, b"k")
    assert store.expires == {}
    put(store, tag, b"k", b"again")
    assert store.ttl_ms(tag, b"k") == -1


# -- identity scopes ---------------------------------------------------------------------

def test_equal_keys_in_two_scopes_are_distinct(store):
    a = store.scopes.tag(IdentityScope("alice", "llama"))
    b = store.scopes.tag(IdentityScope("bob", "llama"))
    assert a != b and len(a) == len(b) == TAG_LEN
    assert store.scopes.tag(IdentityScope("alice", "llama")) == a  # interned
    put(store, a, b"k", b"alice's")
    put(store, b, b"k", b"bob's" * 2000)
    assert read(store, a, b"k") == b"alice's"
    assert read(store, b, b"k") == b"bob's" * 2000
    assert store.delete(a, b"k")
    assert read(store, a, b"k") is None and read(store, b, b"k") == b"bob's" * 2000
    assert store.scopes.scope_of(b) == IdentityScope("bob", "llama")


@pytest.mark.parametrize("held, wanted, reason", [
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("bob", "m", "t", "x"), "cross_tenant"),
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("bob", "m2", "t2", "x2"), "cross_tenant"),
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("alice", "m2", "t", "x"), "cross_model"),
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("alice", "m2", "t2", "x2"), "cross_model"),
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("alice", "m", "t2", "x"), "cross_tokenizer"),
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("alice", "m", "t2", "x2"), "cross_tokenizer"),
    (IdentityScope("alice", "m", "t", "x"), IdentityScope("alice", "m", "t", "lora2"), "cross_adapter"),
])
def test_miss_held_by_another_scope_is_a_counted_refusal(store, held, wanted, reason):
    h, w = store.scopes.tag(held), store.scopes.tag(wanted)
    put(store, h, b"prefix-hash", b"kv")
    assert refusal_reason(wanted, held) == reason
    assert store.lookup(w, b"prefix-hash") is None  # never served across scopes
    assert store.scopes.refusals == {(wanted.tenant, reason): 1}
    assert not store.contains(w, b"prefix-hash")
    assert store.scopes.refusals == {(wanted.tenant, reason): 2}
    assert store.scopes.total_refusals == 2
    # a plain miss, or a hit in its own scope, is no refusal
    assert store.lookup(w, b"other") is None
    assert read(store, h, b"prefix-hash") == b"kv"
    assert store.scopes.total_refusals == 2


def test_no_refusal_with_a_single_scope(store, tag):
    put(store, tag, b"k", b"v")
    assert store.lookup(tag, b"missing") is None
    assert store.scopes.total_refusals == 0


def test_refused_counts_by_the_refused_tenant_and_reason():
    scopes = ScopeRegistry()
    a, b = scopes.tag(IdentityScope("a")), scopes.tag(IdentityScope("b"))
    assert scopes.refused(b, a) is True
    assert scopes.refused(b, b"\x00\x00\x09\x99") is False  # an unknown scope: nothing to blame
    assert scopes.refusals == {("b", "cross_tenant"): 1}
    assert scopes.refusals_of("b")["cross_tenant"] == 1 and scopes.refusals_of("a")["cross_tenant"] == 0


# -- two-phase puts ------------------------------------------------------------------------

def make_puts(store: Keyspace, default_lease_ms: int = 30_000, max_lease_ms: int = 600_000) -> TwoPhasePuts:
    return TwoPhasePuts(store, default_lease_ms, max_lease_ms)


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([0, 1, 100, 256, 257, PAGE, 2 * PAGE + 3]), data=st.data())
def test_two_phase_put_in_random_chunk_order_publishes_exactly_the_bytes(size, data):
    store = make_store(pages=16, inline_max=256)
    tag = store.scopes.tag(DEFAULT)
    puts = make_puts(store)
    payload = pattern(size, size)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, size), max_size=8), label="cuts")))
    ranges = [(a, b) for a, b in zip([0] + cuts, cuts + [size]) if a < b]
    order = data.draw(st.permutations(ranges), label="order")
    handle = puts.begin(tag, b"blk", "default", size, None)
    assert handle is not None
    for a, b in order:
        assert store.lookup(tag, b"blk") is None  # nothing visible before COMMIT
        puts.write(puts.get(handle, "default"), a, payload[a:b])
    puts.commit(puts.get(handle, "default"), crc32c.crc32c(payload))
    assert read(store, tag, b"blk") == payload
    assert type(store.lookup(tag, b"blk")) is (bytes if size <= store.inline_max else Block)
    assert puts.committed == 1 and puts.open == {}
    assert store.reserved_blocks == 0
    check_accounting(store)
    with pytest.raises(NoHandle):
        puts.get(handle, "default")


def test_commit_with_missing_bytes_is_incomplete(store, tag):
    puts = make_puts(store)
    handle = puts.begin(tag, b"k", "default", 1000, None)
    put_ = puts.get(handle, "default")
    puts.write(put_, 0, b"a" * 400)
    puts.write(put_, 600, b"c" * 400)
    with pytest.raises(Incomplete) as info:
        puts.commit(put_, None)
    assert "200 of 1000" in info.value.message
    assert info.value.wire().startswith("INCOMPLETE ")
    assert store.lookup(tag, b"k") is None
    puts.write(puts.get(handle, "default"), 400, b"b" * 200)  # still open: finish it
    puts.commit(puts.get(handle, "default"), None)
    assert read(store, tag, b"k") == b"a" * 400 + b"b" * 200 + b"c" * 400


def test_wrong_checksum_is_refused_and_the_put_stays_open(store, tag):
    puts = make_puts(store)
    payload = pattern(3 * PAGE, 3)
    handle = puts.begin(tag, b"k", "default", len(payload), None)
    puts.write(puts.get(handle, "default"), 0, payload)
    used = store.used
    with pytest.raises(ChecksumMismatch) as info:
        puts.commit(puts.get(handle, "default"), crc32c.crc32c(payload) ^ 1)
    assert info.value.wire().startswith("CHECKSUM ")
    assert store.lookup(tag, b"k") is None
    assert store.used == used and handle in puts.open
    puts.commit(puts.get(handle, "default"), crc32c.crc32c(payload))
    assert read(store, tag, b"k") == payload
    assert store.used == used  # the reserved block itself was published
    check_accounting(store)


def test_begin_on_a_complete_key_is_idempotent(store, tag):
    puts = make_puts(store)
    put(store, tag, b"k", b"done")
    assert puts.begin(tag, b"k", "default", 100, None) is None
    assert puts.open == {} and store.reserved_blocks == 0


def test_abort_frees_the_space(store, tag):
    puts = make_puts(store)
    before = store.used
    handle = puts.begin(tag, b"k", "default", 5 * PAGE, None)
    assert store.used == before + 5 * PAGE
    puts.write(puts.get(handle, "default"), 0, b"x" * 100)
    puts.abort(puts.get(handle, "default"))
    assert store.used == before and store.reserved_blocks == 0
    assert puts.aborted == 1
    with pytest.raises(NoHandle):
        puts.get(handle, "default")
    assert store.lookup(tag, b"k") is None
    check_accounting(store)


def test_expired_lease_is_reclaimed(store, tag):
    puts = make_puts(store)
    before = store.used
    short = puts.begin(tag, b"short", "default", 3 * PAGE, 1)
    long = puts.begin(tag, b"long", "default", 2 * PAGE, 60_000)
    time.sleep(0.02)
    assert puts.reclaim_expired() == 1
    assert store.used == before + 2 * PAGE and puts.expired == 1
    with pytest.raises(NoHandle):
        puts.get(short, "default")
    assert puts.get(long, "default").nbytes == 2 * PAGE
    check_accounting(store)


def test_expired_handle_fails_on_use_and_frees_its_space(store, tag):
    puts = make_puts(store)
    before = store.used
    handle = puts.begin(tag, b"k", "default", 3 * PAGE, 1)
    time.sleep(0.02)
    with pytest.raises(NoHandle) as info:
        puts.get(handle, "default")
    assert "expired" in info.value.message
    assert store.used == before and puts.expired == 1
    assert puts.reclaim_expired() == 0


def test_handle_of_another_tenant_is_unknown(store, tag):
    puts = make_puts(store)
    handle = puts.begin(tag, b"k", "alice", 100, None)
    with pytest.raises(NoHandle):
        puts.get(handle, "bob")
    with pytest.raises(NoHandle):
        puts.get(b"0" * 24, "alice")
    assert puts.get(handle, "alice").key == b"k"


@pytest.mark.parametrize("lease", [0, -5, 600_001])
def test_lease_out_of_range(store, tag, lease):
    puts = make_puts(store)
    with pytest.raises(CommandError):
        puts.begin(tag, b"k", "default", 100, lease)
    assert store.used == 0 and puts.open == {}


def test_write_outside_the_block(store, tag):
    puts = make_puts(store)
    put_ = puts.get(puts.begin(tag, b"k", "default", 100, None), "default")
    with pytest.raises(CommandError):
        puts.write(put_, 90, b"x" * 11)
    with pytest.raises(CommandError):
        puts.write(put_, -1, b"x")
    puts.write(put_, 100, b"")  # an empty write at the end is fine
    assert put_.received() == 0


def test_begin_larger_than_the_arena_is_out_of_memory(store, tag):
    puts = make_puts(store)
    with pytest.raises(OutOfMemory):
        puts.begin(tag, b"k", "default", store.capacity + 1, None)
    assert puts.open == {} and store.used == 0


def test_abort_during_a_direct_write_frees_at_the_writers_end(store, tag):
    puts = make_puts(store)
    before = store.used
    handle = puts.begin(tag, b"k", "default", 2 * PAGE, None)
    put_ = puts.get(handle, "default")
    view = puts.open_writer(put_, 0, PAGE)  # a DATA payload arriving straight into the block
    with pytest.raises(Incomplete):
        puts.commit(put_, None)
    puts.abort(put_)
    assert store.used == before + 2 * PAGE  # the receive is still writing into it
    view[:] = b"w" * PAGE
    puts.close_writer(IntoBlock(put_, 0, PAGE), complete=True)
    assert store.used == before and store.reserved_blocks == 0
    check_accounting(store)


def test_direct_write_then_commit(store, tag):
    puts = make_puts(store)
    payload = pattern(2 * PAGE, 9)
    put_ = puts.get(puts.begin(tag, b"k", "default", len(payload), None), "default")
    view = puts.open_writer(put_, PAGE, PAGE)
    view[:] = payload[PAGE:]
    puts.close_writer(IntoBlock(put_, PAGE, PAGE), complete=True)
    view = puts.open_writer(put_, 0, PAGE)
    puts.close_writer(IntoBlock(put_, 0, PAGE), complete=False)  # the sender went away
    with pytest.raises(Incomplete):
        puts.commit(put_, None)
    puts.write(put_, 0, payload[:PAGE])
    puts.commit(put_, crc32c.crc32c(payload))
    assert read(store, tag, b"k") == payload


def test_close_drops_open_puts(store, tag):
    puts = make_puts(store)
    for i in range(3):
        puts.begin(tag, b"k%d" % i, "default", PAGE, None)
    puts.close()
    assert puts.open == {} and store.used == 0


@settings(max_examples=100, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=25))
def test_put_mark_merges_ranges_like_a_set_of_bytes(ranges):
    p = Put(b"h", b"t", b"k", "default", None, 80, 0.0)
    model: set[int] = set()
    for start, length in ranges:
        p.mark(start, start + length)
        model.update(range(start, start + length))
        assert p.received() == len(model)
        covered = set()
        for s, e in zip(p.starts, p.ends):
            assert s < e
            covered.update(range(s, e))
        assert covered == model
        # sorted, disjoint and not touching: every range is maximal
        assert all(e < s for e, s in zip(p.ends, p.starts[1:]))


def test_put_mark_examples():
    p = Put(b"h", b"t", b"k", "default", None, 100, 0.0)
    p.mark(10, 20)
    p.mark(30, 40)
    assert (p.starts, p.ends) == ([10, 30], [20, 40])
    p.mark(20, 30)  # touching both: one range
    assert (p.starts, p.ends) == ([10], [40])
    p.mark(0, 5)
    p.mark(50, 50)  # empty: ignored
    p.mark(60, 55)  # reversed: ignored
    assert (p.starts, p.ends) == ([0, 10], [5, 40])
    p.mark(3, 12)
    assert (p.starts, p.ends) == ([0], [40])
    assert p.received() == 40


def test_a_put_that_cannot_fit_evicts_nothing():
    """When pinned and reserved blocks leave too little room, refuse without evicting."""
    store = make_store(pages=16, high=1.0, low=1.0)
    tag = store.scopes.tag(DEFAULT)
    put(store, tag, b"pinned", pattern(10 * PAGE, 1))
    put(store, tag, b"small", pattern(4 * PAGE, 2))
    pinned = store.lookup(tag, b"pinned")
    store.pin(pinned)
    assert store.held_bytes == 10 * PAGE
    with pytest.raises(OutOfMemory):
        store.reserve(8 * PAGE)  # 16 pages - 10 held < 8: hopeless
    assert read(store, tag, b"small") == pattern(4 * PAGE, 2)  # not evicted for nothing
    block = store.reserve(6 * PAGE)  # fits once "small" is evicted
    assert store.held_bytes == 16 * PAGE
    assert store.lookup(tag, b"small") is None
    store.discard(block)
    store.unpin(pinned)
    assert store.held_bytes == 0
    check_accounting(store)


# -- the generic keyspace: scope key arrays, SCAN, RANDOMKEY, RENAME, COPY, TTL changes ---

def check_scope_keys(store: Keyspace) -> None:
    """Each enumerated scope's key array holds exactly its keys (DRAM and below), `_slot`
    their places; other scopes have none."""
    held: dict[bytes, set[bytes]] = {}
    for fk in list(store.data) + list(store.lower):
        held.setdefault(fk[:TAG_LEN], set()).add(fk)
    assert {t: set(keys) for t, keys in store._scope_keys.items()} == {t: held[t] for t in store._scope_keys}
    assert all(len(keys) == len(set(keys)) == store.per_scope[t] for t, keys in store._scope_keys.items())
    assert all(store._scope_keys[fk[:TAG_LEN]][i] == fk for fk, i in store._slot.items())
    assert len(store._slot) == sum(len(keys) for keys in store._scope_keys.values())


def full_scan(store: Keyspace, tag: bytes, count: int, between=None, keep=None) -> list[bytes]:
    """Every key one scan returns, calling `between()` after each step; bounded."""
    seen, cursor = [], 0
    for _ in range(100_000):
        cursor, keys = store.scan(tag, cursor, count, keep)
        seen += keys
        if cursor == 0:
            return seen
        if between is not None:
            between()
    raise AssertionError("scan did not end")


def test_scope_key_arrays_follow_every_way_in_and_out():
    """New keys, overwrites, deletes, expiry (lazy and swept), eviction, flushes: the arrays
    always hold exactly each scope's keys."""
    store = make_store(pages=24, high=0.75, low=0.5)
    tags = [store.scopes.tag(IdentityScope(t)) for t in ("a", "b", "c")]
    rng = random.Random(7)
    for step in range(3000):
        if step == 500:
            store.scan(tags[0], 0, 1)  # scope a is enumerated from now on; b and c later, c never
        if step == 1500:
            store.keys_matching(tags[1])
        t, key = rng.choice(tags), b"k%d" % rng.randrange(60)
        op = rng.random()
        if op < 0.45:
            put(store, t, key, pattern(rng.choice((3, 200, PAGE + 1)), step))
        elif op < 0.6:
            store.delete(t, key)
        elif op < 0.7:
            if store.contains(t, key):
                store.set_expire(t, key, now_ms() - 1)
                store.sweep_expired() if rng.random() < 0.5 else store.lookup(t, key)
        elif op < 0.8:
            store.rename(t, key, b"k%d" % rng.randrange(60), nx=rng.random() < 0.3)
        elif op < 0.9:
            dst = b"k%d" % rng.randrange(60)
            if dst != key:
                store.copy(t, key, dst, replace=rng.random() < 0.5)
        elif op < 0.92:
            store.flush_scope(t)
        elif t != tags[2]:
            store.random_key(t)
        check_scope_keys(store)
        check_accounting(store)
    assert tags[2] not in store._scope_keys  # never enumerated: no array


def test_a_scope_nobody_enumerates_costs_no_memory_and_its_array_is_built_on_first_use(store, tag):
    for i in range(100):
        put(store, tag, b"k%d" % i, b"v")
    store.delete(tag, b"k0")
    assert store._scope_keys == {} and store._slot == {}
    assert len(store.keys_matching(tag)) == 99
    check_scope_keys(store)
    assert len(store._scope_keys[tag]) == 99
    for i in range(100):
        store.delete(tag, b"k%d" % i)
    assert store._scope_keys == {} and store._slot == {}  # an emptied scope's array goes
    put(store, tag, b"new", b"v")
    assert store.random_key(tag) == b"new"
    check_scope_keys(store)


def test_scan_returns_every_key_present_for_the_whole_scan():
    """Keys added, deleted, renamed, read (LRU moves), expired and evicted during a scan:
    every key present from its start to its end is returned; nothing from another scope."""
    rng = random.Random(3)
    for trial in range(20):
        store = make_store(pages=64, high=0.9, low=0.5)
        tag, other = store.scopes.tag(IdentityScope("a")), store.scopes.tag(IdentityScope("b"))
        stable = {b"s%d" % i for i in range(300)}
        churn = [b"c%d" % i for i in range(200)]
        first = sorted(stable) + churn[:100]
        rng.shuffle(first)  # stable keys everywhere in the array, the last slots included
        for key in first:
            put(store, tag, key, b"v")
            put(store, other, key + b"-other", b"v")

        def between():
            for _ in range(rng.randrange(1, 12)):
                op, key = rng.random(), rng.choice(churn)
                if op < 0.35:
                    put(store, tag, key, b"v")
                elif op < 0.6:
                    store.delete(tag, key)
                elif op < 0.7:
                    store.rename(tag, key, rng.choice(churn))
                elif op < 0.8:
                    if store.contains(tag, key):
                        store.set_expire(tag, key, now_ms() - 1)
                else:
                    store.lookup(tag, rng.choice(sorted(stable)))  # an LRU move

        seen = full_scan(store, tag, rng.choice((1, 3, 10, 50)), between)
        assert stable <= set(seen)
        assert all(not k.endswith(b"-other") for k in seen)
        assert set(seen) <= stable | set(churn)
        check_scope_keys(store)


def test_scan_cursor_is_the_slots_left_and_ends_at_zero(store, tag):
    for i in range(25):
        put(store, tag, b"k%02d" % i, b"v")
    cursor, keys = store.scan(tag, 0, 10)
    assert (cursor, len(keys)) == (15, 10)
    cursor, keys = store.scan(tag, cursor, 10)
    assert (cursor, len(keys)) == (5, 10)
    assert store.scan(tag, cursor, 10)[0] == 0
    assert store.scan(tag, 10**20, 10)[0] == 15  # past the top: starts at the top
    assert store.scan(store.scopes.tag(IdentityScope("nobody")), 0, 10) == (0, [])
    assert sorted(full_scan(store, tag, 7)) == [b"k%02d" % i for i in range(25)]


def test_scan_reclaims_expired_keys_it_keeps_and_counts_them(store, tag):
    for i in range(10):
        put(store, tag, b"k%d" % i, b"v")
    store.set_expire(tag, b"k1", now_ms() - 1)
    store.set_expire(tag, b"k2", now_ms() - 1)
    seen = full_scan(store, tag, 3, keep=lambda k: k != b"k2")  # k2 is filtered out first: kept
    assert set(seen) == {b"k%d" % i for i in range(10)} - {b"k1", b"k2"}
    assert store.stats["expired"] == 1 and store.keys_in(tag) == 9
    assert store.keys_matching(tag) == [k for k in store.keys_matching(tag) if k != b"k2"]
    assert sorted(store.keys_matching(tag, lambda k: k < b"k5")) == [b"k0", b"k3", b"k4"]
    check_scope_keys(store)


def test_random_key_stays_in_its_scope_and_reclaims_expired_keys(store):
    a, b = store.scopes.tag(IdentityScope("a")), store.scopes.tag(IdentityScope("b"))
    assert store.random_key(a) is None
    put(store, a, b"only-a", b"v")
    for i in range(20):
        put(store, b, b"b%d" % i, b"v")
    assert {store.random_key(a) for _ in range(50)} == {b"only-a"}
    assert {store.random_key(b) for _ in range(400)} == {b"b%d" % i for i in range(20)}
    for i in range(20):
        store.set_expire(b, b"b%d" % i, now_ms() - 1)
    assert store.random_key(b) is None
    assert store.stats["expired"] == 20 and store.keys_in(b) == 0 and store.keys_in(a) == 1
    check_scope_keys(store)


def test_rename_moves_value_and_ttl_within_the_scope(store, tag):
    other = store.scopes.tag(IdentityScope("other"))
    big = pattern(3 * PAGE, 1)
    put(store, tag, b"src", big)
    put(store, other, b"dst", b"theirs")
    store.set_expire(tag, b"src", now_ms() + 60_000)
    used = store.used
    assert store.rename(tag, b"src", b"dst") == 1
    assert read(store, tag, b"dst") == big and store.lookup(tag, b"src") is None
    assert 59_000 < store.ttl_ms(tag, b"dst") <= 60_000
    assert read(store, other, b"dst") == b"theirs"  # the other scope's key is untouched
    assert store.used == used  # the block moved, nothing was copied
    put(store, tag, b"x", b"1")
    store.set_expire(tag, b"x", now_ms() + 60_000)
    put(store, tag, b"y", b"2")
    assert store.rename(tag, b"y", b"x") == 1  # replaces x, and x's TTL goes with it
    assert store.ttl_ms(tag, b"x") == -1 and read(store, tag, b"x") == b"2"
    assert store.rename(tag, b"missing", b"x") == -1
    assert store.rename(tag, b"x", b"dst", nx=True) == 0
    assert store.rename(tag, b"x", b"x", nx=True) == 0 and store.rename(tag, b"x", b"x") == 1
    assert store.rename(tag, b"dst", b"other-dst", nx=True) == 1
    assert store.rename(other, b"x", b"y") == -1  # another scope's name is not ours
    check_scope_keys(store)
    check_accounting(store)
    for _ in range(3):  # stale TTL heap entries under the old names never touch the new ones
        store.sweep_expired()
    assert read(store, tag, b"other-dst") == big


def test_copy_is_independent_and_keeps_the_ttl(store, tag):
    big = pattern(2 * PAGE + 5, 2)
    put(store, tag, b"src", big)
    store.set_expire(tag, b"src", now_ms() + 60_000)
    assert store.copy(tag, b"src", b"dup")
    assert read(store, tag, b"dup") == big and store.ttl_ms(tag, b"dup") > 59_000
    put(store, tag, b"src", pattern(2 * PAGE + 5, 3))  # overwrite the source
    assert read(store, tag, b"dup") == big
    assert not store.copy(tag, b"src", b"dup")  # exists, no REPLACE
    assert store.copy(tag, b"src", b"dup", replace=True)
    assert read(store, tag, b"dup") == pattern(2 * PAGE + 5, 3) and store.ttl_ms(tag, b"dup") == -1
    put(store, tag, b"small", b"abc")
    assert store.copy(tag, b"small", b"small2") and read(store, tag, b"small2") == b"abc"
    assert not store.copy(tag, b"missing", b"x")
    assert not store.copy(store.scopes.tag(IdentityScope("other")), b"src", b"x")
    check_scope_keys(store)
    check_accounting(store)


def test_copy_that_cannot_fit_is_out_of_memory_and_changes_nothing():
    store = make_store(pages=8, high=1.0, low=1.0)
    tag = store.scopes.tag(DEFAULT)
    put(store, tag, b"src", pattern(5 * PAGE, 1))
    with pytest.raises(OutOfMemory):
        store.copy(tag, b"src", b"dup")  # the source is pinned while room is made: never evicted
    assert read(store, tag, b"src") == pattern(5 * PAGE, 1) and store.lookup(tag, b"dup") is None
    assert store.held_bytes == 0 and store.active_pins == 0
    check_accounting(store)


def test_ttl_changes(store, tag):
    assert store.expire_time(tag, b"k") == -2 and not store.set_ttl(tag, b"k", now_ms() + 1000)
    put(store, tag, b"k", b"v")
    assert store.expire_time(tag, b"k") == -1 and not store.persist(tag, b"k")
    at = now_ms() + 10_000
    assert store.set_ttl(tag, b"k", at) and store.expire_time(tag, b"k") == at
    assert store.persist(tag, b"k") and store.expire_time(tag, b"k") == -1
    store.sweep_expired()
    assert store.contains(tag, b"k")
    assert store.set_ttl(tag, b"k", now_ms() + 20)
    time.sleep(0.03)
    assert store.sweep_expired() == 1 and store.expire_time(tag, b"k") == -2


def test_facts_describe_without_counting_a_read(store, tag):
    put(store, tag, b"small", b"12345")
    put(store, tag, b"big", pattern(PAGE + 1, 1))
    hits = store.lookups_of()
    small, big = store.facts(tag, b"small"), store.facts(tag, b"big")
    assert (small.inline, small.length, small.dram_bytes, small.idle_s) == (b"12345", 5, 5, None)
    assert (big.inline, big.length, big.dram_bytes) == (None, PAGE + 1, 2 * PAGE) and big.idle_s < 5
    assert store.lookups_of() == hits
    store.set_expire(tag, b"small", now_ms() - 1)
    assert store.facts(tag, b"small", expire=False).length == 5  # not yet reclaimed
    assert store.facts(tag, b"small") is None and store.facts(tag, b"missing") is None


# SSD-only values: EXPIRE, RENAME and COPY read them back into DRAM first (bring_back)

def _ssd_only(tmp_path, body):
    from test_tiering import VAL, check_ssd, data, demote_all, run, tiered

    async def go():
        async with tiered(tmp_path) as (ks, t, tag):
            ks.publish(tag, b"k1", ks.materialize(data(VAL, 1)))
            ks.publish(tag, b"k2", ks.materialize(data(VAL, 2)))
            await demote_all(t)
            assert ks.below_only(tag, b"k1") and ks.below_only(tag, b"k2")
            await body(ks, tag, data(VAL, 1))
            wait = ks.take_unsynced()
            if wait is not None:
                await wait
            check_scope_keys(ks)
            await check_ssd(ks, t)

    run(go())


def test_ttl_on_an_ssd_only_value_stays_on_ssd_and_is_logged_there(tmp_path):
    """The SSD tier keeps TTLs (issue 19.2): EXPIRE and PERSIST of an SSD-only value change
    its copy's TTL (a META record the caller waits for), without reading it back."""
    async def body(ks, tag, value):
        at = now_ms() + 60_000
        entry = ks.lower[tag + b"k1"]
        assert ks.set_ttl(tag, b"k1", at)
        assert ks.below_only(tag, b"k1") and entry.expire == at and ks.unsynced
        await ks.take_unsynced()
        assert ks.ttl_ms(tag, b"k1") > 59_000 and ks.expire_time(tag, b"k1") == at
        assert ks.persist(tag, b"k1") and entry.expire == 0 and ks.unsynced
        await ks.take_unsynced()
        assert ks.expire_time(tag, b"k1") == -1
        assert not ks.persist(tag, b"k1") and not ks.unsynced  # nothing changed: nothing to wait for

    _ssd_only(tmp_path, body)


def test_ttl_on_a_promoted_value_keeps_its_ssd_copy_and_retimes_it(tmp_path):
    async def body(ks, tag, value):
        await ks.bring_back(tag, b"k1")
        entry = ks.data[tag + b"k1"].lower
        assert entry is not None
        assert ks.set_ttl(tag, b"k1", now_ms() + 60_000)
        assert ks.data[tag + b"k1"].lower is entry and entry.expire > 0 and ks.unsynced
        assert bytes(ks.view(ks.data[tag + b"k1"])) == value and ks.ttl_ms(tag, b"k1") > 59_000

    _ssd_only(tmp_path, body)


def test_rename_of_an_ssd_only_value_leaves_no_copy_under_the_old_name(tmp_path):
    async def body(ks, tag, value):
        await ks.bring_back(tag, b"k1")
        assert ks.rename(tag, b"k1", b"k9") == 1 and ks.unsynced
        assert ks.data[tag + b"k9"].lower is None and bytes(ks.view(ks.data[tag + b"k9"])) == value
        assert ks.expire_time(tag, b"k1") == -2

    _ssd_only(tmp_path, body)


def test_copy_of_an_ssd_only_value_keeps_its_ssd_copy(tmp_path):
    async def body(ks, tag, value):
        await ks.bring_back(tag, b"k1")
        assert ks.copy(tag, b"k1", b"k3")
        assert bytes(ks.view(ks.data[tag + b"k3"])) == value == bytes(ks.view(ks.data[tag + b"k1"]))
        assert ks.data[tag + b"k1"].lower is not None and not ks.unsynced
        await ks.bring_back(tag, b"k1")  # already in DRAM: nothing to do

    _ssd_only(tmp_path, body)


# -- parts of a value: read_slice, write_range, size (GETRANGE, SETRANGE, APPEND, bits) ----------

def _slice(lo, hi):
    return lambda n: (min(lo, n), min(hi, n))


def _writer(offset, data):
    def write(view):
        view[offset:offset + len(data)] = data
        return len(view)
    return write


def test_read_slice_of_a_block_is_a_pinned_view_of_just_the_slice(store, tag):
    big = pattern(10 * PAGE, 1)
    put(store, tag, b"k", big)
    part = store.read_slice(tag, b"k", _slice(5000, 9000))
    assert type(part) is Pinned and len(part.view) == 4000
    assert part.view.obj is store.arena._mmap  # a view of the arena itself: nothing was copied
    assert bytes(part.view) == big[5000:9000] and store.active_pins == 1
    part.release()
    assert store.active_pins == 0
    assert store.read_slice(tag, b"k", _slice(20 * PAGE, 30 * PAGE)) == b"" and store.active_pins == 0
    put(store, tag, b"s", b"small")
    assert store.read_slice(tag, b"s", _slice(1, 3)) == b"ma"
    assert store.read_slice(tag, b"missing", _slice(0, 1)) is None
    assert store.size(tag, b"k") == len(big) and store.size(tag, b"s") == 5 and store.size(tag, b"missing") is None


def test_write_range_writes_an_unpinned_block_in_place(store, tag):
    big = bytearray(pattern(3 * PAGE + 100, 2))
    put(store, tag, b"k", bytes(big))
    block, used = store.data[tag + b"k"], store.arena.used
    block.crc = 1234
    store.set_expire(tag, b"k", now_ms() + 60_000)
    assert store.write_range(tag, b"k", 500, 4, _writer(500, b"WXYZ")) == len(big)
    big[500:504] = b"WXYZ"
    assert store.data[tag + b"k"] is block and store.arena.used == used and store.reserved_blocks == 0
    assert block.crc is None and bytes(store.view(block)) == bytes(big) and store.ttl_ms(tag, b"k") > 59_000
    # growing into the last page's slack: still the same block, zero-padded
    assert store.write_range(tag, b"k", 3 * PAGE + 200, 1, _writer(3 * PAGE + 200, b"!")) == 3 * PAGE + 201
    assert store.data[tag + b"k"] is block and store.arena.used == used
    assert read(store, tag, b"k") == bytes(big) + bytes(100) + b"!"
    check_accounting(store)


def test_write_range_past_a_blocks_pages_moves_it_to_a_larger_block(store, tag):
    put(store, tag, b"k", b"a" * (PAGE + 1))
    old = store.data[tag + b"k"]
    assert store.write_range(tag, b"k", None, PAGE, _writer(PAGE + 1, b"b" * PAGE)) == 2 * PAGE + 1
    assert store.data[tag + b"k"] is not old and old.state is BlockState.GONE
    assert read(store, tag, b"k") == b"a" * (PAGE + 1) + b"b" * PAGE and store.arena.used == 3 * PAGE
    check_accounting(store)


def test_write_range_on_a_pinned_block_copies_and_leaves_the_reader_its_bytes(store, tag):
    big = pattern(4 * PAGE, 3)
    put(store, tag, b"k", big)
    old = store.data[tag + b"k"]
    reader = store.get(tag, b"k")  # a GET being sent
    assert store.write_range(tag, b"k", 0, 3, _writer(0, b"NEW")) == len(big)
    assert store.data[tag + b"k"] is not old and old.state is BlockState.EVICTING
    assert bytes(reader.view) == big  # never written under its reader
    assert read(store, tag, b"k") == b"NEW" + big[3:]
    reader.release()
    assert old.state is BlockState.GONE and store.arena.used == 4 * PAGE and store.unlinked_pinned == 0
    check_accounting(store)


def test_write_range_moves_inline_values_into_the_arena_and_creates_missing_keys(store, tag):
    put(store, tag, b"k", b"x" * (store.inline_max - 2))
    store.set_expire(tag, b"k", now_ms() + 60_000)
    assert store.write_range(tag, b"k", None, 2, _writer(store.inline_max - 2, b"yz")) == store.inline_max
    assert type(store.data[tag + b"k"]) is bytes  # exactly inline_max: still inline
    assert store.write_range(tag, b"k", None, 1, _writer(store.inline_max, b"!")) == store.inline_max + 1
    assert type(store.data[tag + b"k"]) is Block and store.inline_bytes == 0
    assert read(store, tag, b"k") == b"x" * (store.inline_max - 2) + b"yz!" and store.ttl_ms(tag, b"k") > 59_000
    assert store.write_range(tag, b"new", 5, 1, _writer(5, b"v")) == 6 and read(store, tag, b"new") == bytes(5) + b"v"
    assert store.write_range(tag, b"none", 0, 0, bytes) == b"" and not store.contains(tag, b"none")
    assert store.write_range(tag, b"k", 0, 0, len) == store.inline_max + 1  # a read: nothing changes
    store.set_expire(tag, b"new", now_ms() - 1)
    assert store.write_range(tag, b"new", 0, 1, _writer(0, b"z")) == 1 and read(store, tag, b"new") == b"z"
    check_accounting(store)


def test_write_range_that_cannot_fit_is_out_of_memory_and_changes_nothing():
    store = make_store(pages=4, inline_max=16)
    tag = store.scopes.tag(DEFAULT)
    put(store, tag, b"k", b"abc")
    with pytest.raises(OutOfMemory):
        store.write_range(tag, b"k", 10 * PAGE, 1, _writer(10 * PAGE, b"x"))
    assert read(store, tag, b"k") == b"abc" and store.reserved_blocks == 0
    check_accounting(store)


def test_write_range_of_an_ssd_only_value_reads_it_back_and_drops_the_stale_ssd_copy(tmp_path):
    async def body(ks, tag, value):
        got = ks.write_range(tag, b"k1", 10, 4, _writer(10, b"ABCD"))
        assert type(got) is Pending
        assert await got.awaitable == len(value)
        block = ks.data[tag + b"k1"]
        assert bytes(ks.view(block)) == value[:10] + b"ABCD" + value[14:]
        assert block.lower is None and ks.unsynced  # the SSD copy is stale: being deleted
        part = ks.read_slice(tag, b"k2", _slice(100, 200))
        assert type(part) is Pending
        part = await part.awaitable
        assert bytes(part.view) == data(VAL, 2)[100:200]
        part.release()
        brought = ks.write_range(tag, b"k2", 0, 0, len)  # n == 0: back in DRAM, its SSD copy kept
        assert (await brought.awaitable if type(brought) is Pending else brought) == VAL
        assert not ks.below_only(tag, b"k2") and ks.data[tag + b"k2"].lower is not None

    from test_tiering import VAL, data
    _ssd_only(tmp_path, body)


def test_every_open_put_is_charged_to_its_tenant_zero_byte_ones_included():
    """Issue 29 item 16: `PUT2PHASE BEGIN key 0` reserved nothing, so no cap applied: 400 of them
    with 1 MiB keys grew RSS by 400 MB while nothing was counted. Now each open put's key and
    bookkeeping count with its tenant's unfilled reservations until it is closed."""
    store = make_store(pages=64)
    tag = store.scopes.tag(DEFAULT)
    puts = make_puts(store)
    key = b"k" * (store.max_unfilled // 4)
    opened = []
    with pytest.raises(UnfilledLimit, match="tenant 'a'"):
        for i in range(100):
            opened.append(puts.begin(tag, b"%03d" % i + key, "a", 0, None))
    assert len(opened) == 3  # up to max_unfilled (a quarter of it each, and a bit more)
    assert store.unfilled["a"] == sum(p.charge for p in puts.open.values()) == 3 * (len(key) + 3 + PUT_OVERHEAD)
    assert puts.begin(tag, b"other", "b", 0, None) is not None  # another tenant's own charge
    # committed, aborted or expired: the charge is given back
    puts.commit(puts.get(opened[0], "a"), None)
    puts.abort(puts.get(opened[1], "a"))
    short = make_puts(store, default_lease_ms=1)
    h = short.begin(tag, b"late", "a", 0, None)
    time.sleep(0.01)
    assert short.reclaim_expired() == 1 and h not in short.open
    assert store.unfilled["a"] == len(key) + 3 + PUT_OVERHEAD
    for h in opened[2:]:
        puts.abort(puts.get(h, "a"))
    puts.abort(puts.get(next(iter(puts.open)), "b"))
    assert store.unfilled == {} and store.unfilled_bytes == 0
    # a put with a block is checked with its key in one go: a tenant's first is still always allowed
    big = puts.begin(tag, b"big", "a", store.max_unfilled + PAGE, None)
    assert store.unfilled["a"] == store.max_unfilled + PAGE + 3 + PUT_OVERHEAD
    with pytest.raises(UnfilledLimit):
        puts.begin(tag, b"small", "a", 0, None)
    puts.abort(puts.get(big, "a"))
    assert store.unfilled == {}


def test_a_tenant_may_have_max_open_per_tenant_puts_open():
    """Issue 29 item 16: 200,000 zero-byte puts with short keys grew RSS by 97 MB; now a tenant's
    open puts are counted and capped (security.max_open_puts_per_tenant)."""
    store = make_store(pages=64)
    tag = store.scopes.tag(DEFAULT)
    puts = TwoPhasePuts(store, 30_000, 600_000, max_open_per_tenant=3)
    handles = [puts.begin(tag, b"k%d" % i, "a", 0, None) for i in range(3)]
    with pytest.raises(UnfilledLimit, match="3 open puts"):
        puts.begin(tag, b"k3", "a", 0, None)
    assert puts.refused == 1 and puts.open_of == {"a": 3}
    assert puts.begin(tag, b"b0", "b", 0, None) is not None
    puts.commit(puts.get(handles[0], "a"), None)
    assert puts.begin(tag, b"k3", "a", 0, None) is not None and puts.open_of == {"a": 3, "b": 1}
    puts.close()
    assert puts.open_of == {} and store.unfilled == {}
