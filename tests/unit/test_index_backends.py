"""Every residency-index backend against the same contract (issue 23): the in-memory index is the
reference, LMDB and RocksDB must answer alike, and after a reopen (a restart) must answer what
they answered before for every durable holder (engines), with scopes, tiers, groups and engines.

Each persistent test reopens the store in a fresh ScopeRegistry whose tags are shifted, so an
index that persisted a tag instead of its scope fails."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quilld.config import Config, EngineConfig, GroupConfig, IndexConfig
from quilld.errors import ConfigError
from quilld.index.backend import BACKENDS, open_index
from quilld.index.control import ControlPlane
from quilld.index.events import Batch, Cleared, Removed, Stored
from quilld.index.persistent import PersistentIndex
from quilld.index.residency import ResidencyIndex, hash_key
from quilld.index.stores import open_store
from quilld.index.subscriber import Cursor
from quilld.model import CacheTier, IdentityScope
from quilld.scopes import ScopeRegistry

SCOPE_A = IdentityScope("alice", "m", "tok", "")
SCOPE_B = IdentityScope("alice", "m", "tok", "lora-1")
ENGINES = ("engine-a", "engine-b", "engine-c")
HOLDERS = [("node-1", "dram"), ("node-1", "ssd"), ("engine-a", "hbm"), ("engine-a", "cpu"),
           ("engine-b", "hbm"), ("engine-c", "cpu"), ("engine-c", "storage")]


class Opened:
    """One backend in one directory, reopened at will as a restarted quilld would."""

    def __init__(self, backend: str, path) -> None:
        self.backend, self.path = backend, path
        self.generation = 0
        self.index: ResidencyIndex = self._open()

    def _open(self) -> ResidencyIndex:
        scopes = ScopeRegistry()
        for i in range(self.generation * 3):  # other scopes first: the tags differ in each generation
            scopes.tag(IdentityScope(f"other-{i}", "m"))
        self.scopes = scopes
        self.A, self.B = scopes.tag(SCOPE_A), scopes.tag(SCOPE_B)
        index = open_index(IndexConfig(backend=self.backend, path=str(self.path)), scopes)
        for engine in ENGINES:
            index.keep(engine)
        return index

    def reopen(self, crash: bool = False) -> ResidencyIndex:
        """Close (committing) or, with `crash`, abandon what was not committed, and open again."""
        if crash:
            if isinstance(self.index, PersistentIndex):
                self.index._writer.close()  # what was committed stays; the marks in memory die with the process
                self.index.store.close()
        else:
            self.index.close()
        self.generation += 1
        self.index = self._open()
        return self.index

    def by_scope(self, index: ResidencyIndex | None = None) -> dict:
        index = index or self.index
        return {(index.scopes.scope_of(tag), hk): sorted((h, t.value) for h, t in slots)
                for (tag, hk), slots in index.snapshot().items()}


@pytest.fixture(params=BACKENDS)
def opened(request, tmp_path):
    o = Opened(request.param, tmp_path / "index")
    yield o
    o.index.close()


def durable_only(view: dict) -> dict:
    out = {}
    for key, slots in view.items():
        kept = [s for s in slots if s[0] in ENGINES]
        if kept:
            out[key] = kept
    return out


def assert_survives(o: Opened) -> None:
    """A restart keeps every durable holder's residencies (a memory backend keeps none)."""
    before = o.by_scope()
    counts = {(h, t): o.index.count(h, t) for h in ENGINES for t in CacheTier}
    o.reopen()
    if o.backend == "memory":
        assert len(o.index) == 0
        return
    assert o.by_scope() == durable_only(before)
    assert {(h, t): o.index.count(h, t) for h in ENGINES for t in CacheTier} == counts
    assert sum(o.index.tag_entries.values()) == len(o.by_scope())


# ---------------------------------------------------------------- the reference's behaviour, every backend


def test_put_locate_remove(opened):
    idx, A, B = opened.index, opened.A, opened.B
    assert idx.put(A, 42, "engine-a", CacheTier.HBM)
    assert not idx.put(A, 42, "engine-a", "hbm")
    assert idx.put(A, 42, "node-1", "dram")
    assert sorted(idx.locate(A, [42])[0]) == [("engine-a", CacheTier.HBM), ("node-1", CacheTier.DRAM)]
    assert idx.locate(B, [42]) == [[]]
    assert idx.put(A, 43, "engine-b", "cpu")
    assert idx.remove(A, 43, "engine-b", "cpu") and not idx.remove(A, 43, "engine-b", "cpu")
    assert not idx.remove(A, 42, "nobody", "hbm")
    assert_survives(opened)
    idx, A = opened.index, opened.A
    if opened.backend != "memory":
        assert idx.locate(A, [42, 43]) == [[("engine-a", CacheTier.HBM)], []]
        assert idx.remove(A, 42, "engine-a", "hbm") and len(idx) == 0
        assert_survives(opened)
        assert len(opened.index) == 0


def test_hash_forms_and_scopes(opened):
    """-1, 2**64 - 1 and 8 bytes of 0xff are one block; other raw hashes stay bytes; equal hashes in
    two scopes are two entries, and stay two after a restart whose tags differ."""
    idx, A, B = opened.index, opened.A, opened.B
    idx.put(A, -1, "engine-a", "hbm")
    idx.put(A, b"\xde\xad", "engine-a", "cpu")
    idx.put(A, b"", "engine-c", "storage")
    idx.put(B, -1, "engine-b", "hbm")
    idx.put_many(B, [b"\x01" * 9, 5, 2**63], "engine-c", "cpu")
    with pytest.raises(TypeError):
        idx.put(A, 1.5, "engine-a", "hbm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tier"):
        idx.put(A, 1, "engine-a", "gpu")
    assert_survives(opened)
    idx, A, B = opened.index, opened.A, opened.B
    if opened.backend != "memory":
        assert idx.locate(A, [(1 << 64) - 1, b"\xff" * 8, b"\xde\xad", b""]) == [
            [("engine-a", CacheTier.HBM)], [("engine-a", CacheTier.HBM)], [("engine-a", CacheTier.CPU)],
            [("engine-c", CacheTier.STORAGE)]]
        assert idx.locate(B, [-1, b"\x01" * 9, 5, -(2**63)]) == [
            [("engine-b", CacheTier.HBM)], [("engine-c", CacheTier.CPU)], [("engine-c", CacheTier.CPU)],
            [("engine-c", CacheTier.CPU)]]
        assert idx.leading_masks(A, [2**64 - 1]) == idx.masks(A, [-1]) != [0]
        assert sorted(idx.held_elsewhere(A, -1)) == [B]
        assert idx.has(B + hash_key(5)) and not idx.has(A + hash_key(5))


def test_clear_holder_one_tier_or_all(opened):
    idx, A = opened.index, opened.A
    for h in range(100):
        idx.put(A, h, "engine-a", "hbm")
        idx.put(A, h, "engine-a", "cpu")
        idx.put(A, h, "node-1", "dram")
        idx.put(A, h, "engine-b", "hbm")
    assert idx.clear_holder("engine-a", "cpu") == 100
    assert idx.count("engine-a", "cpu") == 0 and idx.count("engine-a", "hbm") == 100
    assert_survives(opened)
    idx, A = opened.index, opened.A
    assert idx.clear_holder("engine-a") == (100 if opened.backend != "memory" else 0)
    assert idx.clear_holder("nobody") == 0
    assert_survives(opened)
    if opened.backend != "memory":
        assert opened.index.locate(opened.A, [5]) == [[("engine-b", CacheTier.HBM)]]


def test_prefix_walks_and_counts(opened):
    idx, A, B = opened.index, opened.A, opened.B
    chain = list(range(10))
    idx.put_many(A, chain[:7], "engine-a", "hbm")
    idx.put_many(A, chain[:3], "engine-b", "cpu")
    idx.put_many(A, chain[1:], "engine-c", "cpu")
    idx.put_many(A, chain, "node-1", "ssd")
    idx.put(A, chain[4], "engine-b", "hbm")
    want = {"engine-a": 7, "engine-b": 3, "node-1": 10}
    assert idx.prefix_lengths(A, chain) == want
    assert idx.prefix_lengths(B, chain) == {}
    masks = idx.leading_masks(A, chain)
    assert_survives(opened)
    if opened.backend != "memory":
        idx, A = opened.index, opened.A
        assert idx.prefix_lengths(A, chain) == {"engine-a": 7, "engine-b": 3}
        node = idx.holder_bits("node-1")
        assert [m & ~node for m in idx.leading_masks(A, chain)] == [m & ~node for m in masks]
        assert idx.holder_tags() == {"engine-a": {A}, "engine-b": {A}, "engine-c": {A}}


def test_holder_entries_and_holders(opened):
    idx, A, B = opened.index, opened.A, opened.B
    idx.put(A, 1, "engine-a", "hbm")
    idx.put(B, b"\x07\x07", "engine-a", "storage")
    idx.put(A, 2, "node-1", "dram")
    want = sorted([(A, hash_key(1), 0), (B, b"\x07\x07", list(CacheTier).index(CacheTier.STORAGE))])
    assert sorted(idx.holder_entries("engine-a")) == want
    assert_survives(opened)
    if opened.backend != "memory":
        idx, A, B = opened.index, opened.A, opened.B
        assert sorted(idx.holder_entries("engine-a")) == sorted(
            [(A, hash_key(1), 0), (B, b"\x07\x07", list(CacheTier).index(CacheTier.STORAGE))])
        assert idx.holder_entries("node-1") == [] and "engine-a" in idx.holders()


def model_prefix(model: dict, tag: bytes, blocks: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in {h for h, _ in HOLDERS}:
        n = 0
        for b in blocks:
            if any(hh == h for hh, _ in model.get((tag, hash_key(b)), set())):
                n += 1
            else:
                break
        if n:
            out[h] = n
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "remove", "put_many", "remove_many", "clear"]),
                              st.booleans(), st.lists(st.integers(0, 30), min_size=1, max_size=4),
                              st.sampled_from(HOLDERS)), max_size=120),
       query=st.lists(st.integers(0, 30), max_size=12), crash=st.booleans())
def test_matches_a_reference_model_across_a_restart(backend, tmp_path_factory, ops, query, crash):
    o = Opened(backend, tmp_path_factory.mktemp("idx") / "index")
    try:
        model: dict = {}
        for op, in_b, blocks, (holder, tier) in ops:
            idx = o.index
            tag = o.B if in_b else o.A
            if op == "clear":
                idx.clear_holder(holder, tier if in_b else None)
                for slots in model.values():
                    slots -= {s for s in slots if s[0] == holder and (not in_b or s[1] == tier)}
                continue
            for b in blocks if op.endswith("many") else blocks[:1]:
                key = (tag, hash_key(b))
                if op.startswith("put"):
                    model.setdefault(key, set()).add((holder, tier))
                else:
                    model.get(key, set()).discard((holder, tier))
            if op == "put":
                idx.put(tag, blocks[0], holder, tier)
            elif op == "remove":
                idx.remove(tag, blocks[0], holder, tier)
            else:
                getattr(idx, op)(tag, blocks, holder, tier)
        for tag in (o.A, o.B):
            got = [sorted((h, t.value) for h, t in row) for row in o.index.locate(tag, query)]
            assert got == [sorted(model.get((tag, hash_key(b)), set())) for b in query]
            assert o.index.prefix_lengths(tag, query) == model_prefix(model, tag, query)
        if backend == "memory":
            return
        o.index.flush(force=True)  # committed: a crash now loses nothing
        names = {o.A: SCOPE_A, o.B: SCOPE_B}
        want = {(names[t], hk): sorted(s for s in slots if s[0] in ENGINES) for (t, hk), slots in model.items()}
        o.reopen(crash=crash)
        assert o.by_scope() == {k: v for k, v in want.items() if v}
        for h, t in HOLDERS:
            n = sum(1 for (_, _), slots in want.items() if (h, t) in slots)
            assert o.index.count(h, t) == n
    finally:
        o.index.close()


# ---------------------------------------------------------------- what a commit holds, and what a crash loses


@pytest.mark.parametrize("backend", ["lmdb", "rocksdb"])
def test_a_crash_loses_what_was_not_committed_and_nothing_else(backend, tmp_path):
    o = Opened(backend, tmp_path / "index")
    idx = o.index
    idx.put_many(o.A, range(50), "engine-a", "hbm")
    idx.flush(force=True)
    idx.put_many(o.A, range(50, 60), "engine-a", "hbm")  # never committed
    idx.remove(o.A, 0, "engine-a", "hbm")
    o.reopen(crash=True)
    assert sorted(b for (_, b) in [(s, int.from_bytes(hk, "big")) for (s, hk) in o.by_scope()]) == list(range(50))
    o.index.close()


@pytest.mark.parametrize("backend", ["lmdb", "rocksdb"])
def test_volatile_holders_are_never_written(backend, tmp_path):
    """This node's own copies and peers' are not persisted: commits carry engines' changes only."""
    o = Opened(backend, tmp_path / "index")
    idx = o.index
    idx.put_many(o.A, range(1000), "node-1", "dram")
    idx.put_many(o.A, range(1000), "peer-2", "ssd")
    idx.flush(force=True)
    idx._writer.close()
    rows = idx._writer.rows
    assert rows < 10  # the format version, holder names: no entry
    idx.put_many(o.A, range(1000), "engine-a", "hbm")
    idx.flush(force=True)
    idx._writer.close()
    assert idx._writer.rows - rows >= 1000
    o.reopen()
    assert o.index.count("engine-a", "hbm") == 1000 and o.index.count("node-1", "dram") == 0
    o.index.close()


@pytest.mark.parametrize("backend", ["lmdb", "rocksdb"])
def test_changes_between_two_commits_coalesce(backend, tmp_path):
    o = Opened(backend, tmp_path / "index")
    idx = o.index
    idx.put(o.A, 1, "engine-a", "hbm")  # the scope's and holder's records go with this commit
    idx.flush(force=True)
    idx._writer.close()
    before = idx._writer.rows
    for _ in range(20):  # stored and evicted again and again: one row at the next commit
        idx.put(o.A, 7, "engine-a", "hbm")
        idx.remove(o.A, 7, "engine-a", "hbm")
    idx.put(o.A, 7, "engine-a", "hbm")
    idx.flush(force=True)
    idx._writer.close()
    assert idx._writer.rows - before == 1
    o.index.close()


@pytest.mark.parametrize("backend", ["lmdb", "rocksdb"])
def test_a_second_process_on_one_path_and_a_foreign_format_are_refused(backend, tmp_path):
    scopes = ScopeRegistry()
    cfg = IndexConfig(backend=backend, path=str(tmp_path / "index"))
    first = open_index(cfg, scopes)
    with pytest.raises(ConfigError, match="in use by another quilld"):
        open_index(cfg, ScopeRegistry())
    first.close()
    store = open_store(backend, tmp_path / "index")
    store.write([(b"v", b"99")], [])
    store.close()
    with pytest.raises(ConfigError, match="index format"):
        open_index(cfg, ScopeRegistry())
    open_index(IndexConfig(), scopes).close()  # memory: no path needed


# ---------------------------------------------------------------- engines, groups and the control plane


def control_plane(path, backend: str, engines: tuple[EngineConfig, ...], generation: int = 0) -> ControlPlane:
    scopes = ScopeRegistry()
    for i in range(generation * 2):
        scopes.tag(IdentityScope(f"other-{i}", "m"))
    return ControlPlane(Config(engines=engines, index=IndexConfig(backend=backend, path=str(path))), scopes)


def stored(hashes, medium="GPU", group=None, lora=None) -> Stored:
    return Stored(tuple(hashes), None, (), 16, None, medium, lora, group)


def removed(hashes, medium="GPU", group=None) -> Removed:
    return Removed(tuple(hashes), medium, group)


def batch(*events) -> Batch:
    return Batch(0.0, tuple(events), None, None)


def route_view(c: ControlPlane, blocks: list, adapter: str = "") -> dict:
    scope = IdentityScope("default", "m", "", adapter)
    d = c.route(scope, c.scopes.tag(scope), blocks)
    return {cand.engine: (cand.overlap_blocks, cand.credit) for cand in d.candidates}


ENGINE_CFG = (EngineConfig(id="e0", url="http://127.0.0.1:9", model="m"),
              EngineConfig(id="e1", url="http://127.0.0.1:9", model="m"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_engines_residencies_cursors_and_adapters_survive_a_restart(backend, tmp_path):
    c = control_plane(tmp_path, backend, ENGINE_CFG)
    c.apply("e0", batch(stored(range(8)), stored(range(8), "CPU"), removed([7])))
    c.apply("e1", batch(stored(range(4)), stored([100, 101], lora="ad")))
    c._applied("e0", Cursor(41, 0xABC, 12.5))
    c.index.put(c.engine_tag("e0", None), 0, "node-self", "dram")
    before = route_view(c, list(range(8))), route_view(c, [100, 101], "ad")
    c.index.flush(force=True)
    c.index.close()
    again = control_plane(tmp_path, backend, ENGINE_CFG, 1)
    if backend == "memory":
        assert len(again.index) == 0 and again._cursors == {}
        return
    assert (route_view(again, list(range(8))), route_view(again, [100, 101], "ad")) == before
    assert again._cursors == {"e0": Cursor(41, 0xABC, 12.5)}
    assert again.feed_view("e0")["persisted_seq"] == 41 and again.feed_view("e1")["persisted_seq"] is None
    assert again.index.count("node-self", "dram") == 0  # this node's copies: its SSD tier's to bring back
    # a removal under the adapter's scope still reaches the restored entries (the engine's scopes came back)
    again.apply("e1", batch(removed([100])))
    assert route_view(again, [100, 101], "ad")["e1"] == (0, 0.0)
    again.apply("e0", batch(Cleared()))
    assert again.index.count("e0", "hbm") == 0
    again.index.close()
    third = control_plane(tmp_path, backend, ENGINE_CFG, 2)
    assert third.index.count("e0", "hbm") == third.index.count("e0", "cpu") == 0  # the clear was committed
    assert third.index.count("e1", "hbm") == 5  # 0..3 and the adapter's 101
    third.index.close()


@pytest.mark.parametrize("backend", ["lmdb", "rocksdb"])
def test_engines_no_longer_configured_are_forgotten_and_removed_engines_stay_removed(backend, tmp_path):
    c = control_plane(tmp_path, backend, ENGINE_CFG)
    c.apply("e0", batch(stored(range(5))))
    c.apply("e1", batch(stored(range(5))))
    c.index.close()
    only_e1 = control_plane(tmp_path, backend, ENGINE_CFG[1:], 1)
    assert only_e1.index.holder_tags().keys() == {"e1"} and len(only_e1.index) == 5
    only_e1.index.close()
    both = control_plane(tmp_path, backend, ENGINE_CFG, 2)
    assert both.index.count("e0", "hbm") == 0 and both.index.count("e1", "hbm") == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_named_by_events_keep_their_holdings_across_a_restart(backend, tmp_path):
    """GroupedHoldings (no kinds declared): a block counts while every named group holds it; after a
    restart a group's removal still takes the block out of the index."""
    c = control_plane(tmp_path, backend, ENGINE_CFG)
    c.apply("e0", batch(stored(range(6), group=0), stored(range(4), group=1), stored([9]), stored([9], "CPU")))
    assert c.index.count("e0", "hbm") == 5  # 0..3 and 9
    c.index.close()
    again = control_plane(tmp_path, backend, ENGINE_CFG, 1)
    if backend == "memory":
        return
    assert again.index.count("e0", "hbm") == 5 and again.index.count("e0", "cpu") == 1
    again.apply("e0", batch(removed([2], group=1)))  # group 1 lets 2 go: it no longer counts
    again.apply("e0", batch(stored([4, 5], group=1)))  # group 1 now has 4 and 5: they count
    again.apply("e0", batch(stored([7], group=2)))  # a third group: blocks it lacks stop counting
    assert again.index.holder_entries("e0") == [(again.scopes.tag(IdentityScope("default", "m")), hash_key(9), 0),
                                                (again.scopes.tag(IdentityScope("default", "m")), hash_key(9), 1)]
    again.index.close()
    third = control_plane(tmp_path, backend, ENGINE_CFG, 2)
    third.apply("e0", batch(stored([0, 1, 3, 4, 5], group=2)))
    in_hbm = sorted(int.from_bytes(hk, "big") for _, hk, t in third.index.holder_entries("e0") if t == 0)
    assert in_hbm == [0, 1, 3, 4, 5, 9]
    third.index.close()


HYBRID = (EngineConfig(id="h0", url="http://127.0.0.1:9", model="m", block_size=16,
                       groups=(GroupConfig("full"), GroupConfig("sliding_window", 33))),)


@pytest.mark.parametrize("backend", BACKENDS)
def test_declared_hybrid_groups_keep_their_holdings_across_a_restart(backend, tmp_path):
    c = control_plane(tmp_path, backend, HYBRID)
    c.apply("h0", batch(stored(range(10), group=0), stored([7, 8, 9], group=1), stored(range(10), "CPU", group=1)))
    before = route_view(c, list(range(10)))
    assert before["h0"][0] == 10
    c.index.close()
    again = control_plane(tmp_path, backend, HYBRID, 1)
    if backend == "memory":
        assert route_view(again, list(range(10)))["h0"] == (0, 0.0)
        return
    assert route_view(again, list(range(10))) == before
    again.apply("h0", batch(removed([8], group=1)))  # the window's HBM copy of 8 is gone: CPU then
    mid = route_view(again, list(range(10)))
    assert mid["h0"][0] == 10 and mid["h0"][1] < before["h0"][1]
    again.index.close()
    third = control_plane(tmp_path, backend, HYBRID, 2)
    assert route_view(third, list(range(10))) == mid
    third.index.close()
    # the groups declared otherwise: what was kept per group is dropped, never misread
    other = (HYBRID[0].__class__(**{**HYBRID[0].__dict__, "groups": (GroupConfig("full"), GroupConfig("mamba"))}),)
    changed = control_plane(tmp_path, backend, other, 3)
    assert route_view(changed, list(range(10)))["h0"] == (0, 0.0) and len(changed.index) == 0
    changed.index.close()


def test_the_memory_backend_is_the_reference_class():
    """The default stays the in-memory index, with nothing in its way."""
    idx = open_index(IndexConfig(), ScopeRegistry())
    assert type(idx) is ResidencyIndex and not idx.persistent and idx.describe()["backend"] == "memory"
    rng = random.Random(1)
    assert idx.put_many(b"\0\0\0\0", [rng.getrandbits(64) for _ in range(10)], "e", "hbm") == 10


@pytest.mark.parametrize("env, message", [
    ({"QUILLD_INDEX_BACKEND": "btree"}, "index.backend must be one of memory, lmdb, rocksdb"),
    ({"QUILLD_INDEX_BACKEND": "lmdb"}, "needs index.path"),
    ({"QUILLD_INDEX_BACKEND": "rocksdb", "QUILLD_INDEX_PATH": "/x", "QUILLD_INDEX_COMMIT_MS": "0"}, "commit_ms"),
])
def test_the_index_section_is_checked(env, message):
    from quilld.config import load

    with pytest.raises(ConfigError, match=message):
        load(environ=env)
    assert load(environ={"QUILLD_INDEX_BACKEND": "lmdb", "QUILLD_INDEX_PATH": "/x", "QUILLD_INDEX_FSYNC": "no"}).index \
        == IndexConfig(backend="lmdb", path="/x", fsync=False)
