"""The SSD tiering policy (tiers/tiering.py) over a real keyspace and a real SSD tier in a
temporary directory: demotion, pins, overwrites in flight, promotion, corruption, a full
SSD, and shutdown followed by recovery.

No daemon, no sockets: each test drives the policy's steps (`_demote_batch`, `read`,
`_flush_deletes`) on its own event loop, bounded by TIMEOUT. Values of VAL bytes take
exactly one DRAM page and SSD_BLOCK bytes on SSD: a head page (header and identity) and
one payload page (block format 4; a small value takes one page, packed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

import pytest

from quilld.config import DramConfig, SsdConfig
from quilld.model import IdentityScope, Pending, Pinned
from quilld.scopes import ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.block import Block, BlockState, page_extent
from quilld.tiers.keyspace import Keyspace, now_ms
from quilld.tiers.ssd import seg_name
from quilld.tiers.ssd_format import block_pages, payload_offset
from quilld.tiers.tier_moves import INLINE_SLACK_SHARE
from quilld.tiers.tiering import Tiering

SCOPE = IdentityScope("alice", "llama-3-8b", "tok-v1", "")
VAL = PAGE  # one DRAM page; on SSD a head page and a payload page
SSD_BLOCK = 2 * PAGE
INLINE_MAX = 256
TIMEOUT = 10.0  # seconds one test's event loop may run


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def no_space_wait(timeout: float) -> None:
    await asyncio.sleep(timeout)


@contextlib.asynccontextmanager
async def tiered(ssd_dir, *, pages=32, high=1.0, low=0.9, ssd_pages=64, promote=True,
                 group_commit=64 << 20, maxmemory=0):
    """A started Tiering over a fresh keyspace; stopped (DRAM flushed, files closed) on exit.

    With `high` = 1.0 the background demoter never runs on its own (use cannot exceed the
    arena), so the steps the test calls are the only ones that move blocks.
    """
    scopes = ScopeRegistry()
    ks = Keyspace(DramConfig(size=pages * PAGE, high_watermark=high, low_watermark=low,
                             inline_max=INLINE_MAX, maxmemory=maxmemory), scopes)
    cfg = SsdConfig(dir=str(ssd_dir), size=ssd_pages * PAGE, segment_size=ssd_pages * PAGE,
                    promote_on_read=promote, group_commit_bytes=group_commit)
    tiering = Tiering(ks, cfg, no_space_wait, workers=2)
    await tiering.start(scopes)
    try:
        yield ks, tiering, scopes.tag(SCOPE)
    finally:
        await tiering.stop()


def put(ks: Keyspace, tag: bytes, key: bytes, value: bytes):
    ks.publish(tag, key, ks.materialize(value))
    return ks.data[tag + key]


async def read_back(ks: Keyspace, tag: bytes, key: bytes) -> bytes | None:
    """What a GET returns, copied out, with any pin released."""
    value = ks.get(tag, key)
    if type(value) is Pending:
        value = await value.awaitable
    if value is None or type(value) is bytes:
        return value
    assert type(value) is Pinned
    try:
        return bytes(value.view)
    finally:
        value.release()


async def demote_all(t: Tiering) -> None:
    for _ in range(100):
        if not await t._demote_batch(everything=True):
            return
    raise AssertionError("demotion did not converge")


async def settle_deletes(t: Tiering) -> None:
    if t._deleting is not None:
        await t._deleting
    await t._flush_deletes()


def check_accounting(ks: Keyspace) -> None:
    """Nothing pinned, reserved or held; byte counts match what is stored."""
    assert (ks.active_pins, ks.held_bytes, ks.reserved_blocks, ks.unlinked_pinned) == (0, 0, 0, 0)
    blocks = [v for v in ks.data.values() if type(v) is Block]
    assert all(b.state is BlockState.RESIDENT and b.pins == 0 for b in blocks)
    assert ks.block_count == len(blocks)
    assert ks.arena.used == sum(page_extent(b.length) for b in blocks)
    assert ks.inline_bytes == sum(len(v) for v in ks.data.values() if type(v) is bytes)
    assert ks.used == ks.arena.used + ks.inline_bytes
    assert not ks.data.keys() & ks.lower.keys()
    assert sum(ks.per_scope.values()) == len(ks.data) + len(ks.lower)


async def check_ssd(ks: Keyspace, t: Tiering) -> None:
    """Once deletions are durable, the SSD index holds exactly the keyspace's SSD copies and
    its allocators exactly their pages (no leaked, no stale extent)."""
    await settle_deletes(t)
    copies = dict(ks.lower)
    copies.update({fk: b.lower for fk, b in ks.data.items() if type(b) is Block and b.lower is not None})
    copies.update(ks.small_copies)
    tag_of = ks.scopes.tag
    indexed = {tag_of(IdentityScope(*scope)) + key: e for (scope, key), e in t.ssd.entries.items()}
    assert indexed.keys() == copies.keys()
    assert all(indexed[fk] is e for fk, e in copies.items())
    assert t.used == sum(block_pages(e.scope, e.key, e.length) for e in indexed.values()) * PAGE
    assert not t.ssd.has_freed  # every freed extent scrubbed and reclaimed


# -- demotion --------------------------------------------------------------------------

def test_demoter_moves_the_coldest_unpinned_blocks_above_the_high_watermark(tmp_path):
    async def body():
        async with tiered(tmp_path, pages=32, high=0.75, low=0.5) as (ks, t, tag):
            values = {b"k%02d" % i: data(VAL, i) for i in range(28)}  # 28 pages > 24 (high)
            for key, value in values.items():
                put(ks, tag, key, value)
            p = ks.get(tag, b"k00")  # a read: k00 is now the most recently used
            p.release()
            reader = ks.get(tag, b"k01")  # held by a reader across the demotion
            assert ks.used > ks.high_bytes
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3
            while ks.used > ks.high_bytes and loop.time() < deadline:
                await asyncio.sleep(0.01)
            # one batch: down to the low watermark (16 pages), the 12 coldest unpinned blocks
            demoted = {b"k%02d" % i for i in range(2, 14)}
            assert {fk[len(tag):] for fk in ks.lower} == demoted
            assert t.stats["demotions"] == 12
            assert ks.used == ks.arena.used == 16 * PAGE
            assert type(ks.data[tag + b"k00"]) is Block and type(ks.data[tag + b"k01"]) is Block
            assert bytes(reader.view) == values[b"k01"]
            reader.release()
            for key in (b"k02", b"k07", b"k13"):
                pending = ks.get(tag, key)
                assert type(pending) is Pending
                pinned = await pending.awaitable
                assert type(pinned) is Pinned and bytes(pinned.view) == values[key]
                pinned.release()
            for key in (b"k00", b"k20"):
                assert await read_back(ks, tag, key) == values[key]
        check_accounting(ks)
    run(body())


def test_block_read_during_its_demotion_keeps_its_ssd_copy_and_goes_on_a_later_pass(tmp_path):
    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            value = data(3 * PAGE + 100, 1)
            block = put(ks, tag, b"k", value)
            batch = asyncio.create_task(t._demote_batch())
            await asyncio.sleep(0)
            assert block.pins == 1  # staged: its write to SSD is in flight
            reader = ks.get(tag, b"k")
            assert await batch is True
            entry = t.ssd.lookup(SCOPE, b"k")
            assert entry is not None and block.lower is entry
            assert ks.data[tag + b"k"] is block and block.state is BlockState.RESIDENT
            assert ks.arena.used == 4 * PAGE and tag + b"k" not in ks.lower
            assert bytes(reader.view) == value
            assert await t._demote_batch() is False  # still pinned: not freed under the reader
            assert block.state is BlockState.RESIDENT and ks.arena.used == 4 * PAGE
            reader.release()
            writes = t.stats["demotions"]
            assert await t._demote_batch() is True
            assert t.stats["demoted_clean"] == 1 and t.stats["demotions"] == writes
            assert block.state is BlockState.GONE and ks.arena.used == 0
            assert ks.lower[tag + b"k"] is entry
            check_accounting(ks)
            await check_ssd(ks, t)
            assert await read_back(ks, tag, b"k") == value
            check_accounting(ks)
    run(body())


@pytest.mark.parametrize("change", ["inline", "block", "delete"])
def test_overwrite_during_demotion_leaves_no_stale_ssd_copy(tmp_path, change):
    old, new_block = data(2 * PAGE, 2), data(PAGE + 1, 3)
    expected = {"inline": b"new", "block": new_block, "delete": None}[change]

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            block = put(ks, tag, b"k", old)
            batch = asyncio.create_task(t._demote_batch())
            await asyncio.sleep(0)
            assert block.pins == 1  # its write to SSD is in flight
            if change == "delete":
                assert ks.delete(tag, b"k")
            else:
                put(ks, tag, b"k", b"new" if change == "inline" else new_block)
            assert await batch is True
            assert block.state is BlockState.GONE
            await settle_deletes(t)
            assert t.ssd.lookup(SCOPE, b"k") is None
            assert t.stats["ssd_deletes"] == 1
            assert tag + b"k" not in ks.lower
            assert await read_back(ks, tag, b"k") == expected
            check_accounting(ks)
            await check_ssd(ks, t)
        # after a restart only the newest value can come back (the clean stop wrote it to SSD)
        async with tiered(tmp_path) as (ks, t, tag):
            assert t.report.recovered == (0 if change == "delete" else 1)
            assert await read_back(ks, tag, b"k") == expected
            check_accounting(ks)
    run(body())


def test_pipelined_batches_commit_in_order_and_a_release_waits_for_its_own(tmp_path):
    """Two batches in flight (the second written while the first commits): a block of the
    first overwritten meanwhile leaves no stale copy, and its releaser waits for the batch
    it is in; every block ends up in exactly one place, and a restart finds them."""
    values = {b"a%d" % i: data(2 * PAGE, 60 + i) for i in range(4)}
    values.update({b"b%d" % i: data(PAGE + 7, 70 + i) for i in range(4)})

    async def body():
        async with tiered(tmp_path, pages=64, group_commit=4 * 2 * PAGE) as (ks, t, tag):
            for key, value in values.items():
                put(ks, tag, key, value)
            assert await t._start_batch() is True  # the a-blocks: written, their commit running
            first = t._committing
            assert first is not None and not first.done()
            assert await t._start_batch() is True  # the b-blocks: written after waiting for the first commit
            assert first.done() and t._committing is not None
            assert set(t._writing) == {ks.data[tag + b"b%d" % i] for i in range(4)}
            old = ks.data[tag + b"b1"]
            put(ks, tag, b"b1", b"new" * 2000)  # released while its batch commits
            values[b"b1"] = b"new" * 2000
            waiter = ks.take_unsynced()
            assert waiter is not None and old.state is not BlockState.GONE
            await waiter  # returns once the second batch settled and the stale copy's DEL is durable
            assert t._committing is None or t._committing.done()
            assert t.ssd.lookup(SCOPE, b"b1") is None
            await t._drain()
            assert t._inflight == 0 and not t._writing
            for key, value in values.items():
                assert await read_back(ks, tag, key) == value
            check_accounting(ks)
            await check_ssd(ks, t)
        async with tiered(tmp_path, pages=64) as (ks, t, tag):
            for key, value in values.items():
                assert await read_back(ks, tag, key) == value
    run(body())


def test_values_with_a_ttl_and_inline_values_are_demoted_with_their_ttl(tmp_path):
    """Issues 19.1 and 19.2: small values and values with a TTL move to SSD like any block
    (before, the demoter skipped both, so DRAM filled with them); a small value takes one
    page there; each keeps its TTL on SSD, across a restart, and expires there."""
    soon = now_ms() + 60_000

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            plain, timed, small, small_timed = data(2 * PAGE, 4), data(2 * PAGE, 5), data(100, 6), data(28, 7)
            put(ks, tag, b"plain", plain)
            put(ks, tag, b"timed", timed)
            ks.set_expire(tag, b"timed", soon)
            put(ks, tag, b"small", small)
            put(ks, tag, b"small-timed", small_timed)
            ks.set_expire(tag, b"small-timed", soon + 1)
            assert ks.take_unsynced() is None  # no copy on SSD yet: nothing to wait for
            await demote_all(t)
            assert set(ks.lower) == {tag + k for k in (b"plain", b"timed", b"small", b"small-timed")}
            assert ks.used == ks.inline_bytes == ks.arena.used == 0
            assert t._pick(everything=True) == []
            assert ks.lower[tag + b"small"].length == 100
            assert t.used == 2 * SSD_BLOCK + 2 * PAGE + 2 * PAGE  # the small ones: one page each
            assert (ks.lower[tag + b"timed"].expire, ks.lower[tag + b"small-timed"].expire) == (soon, soon + 1)
            assert ks.expire_time(tag, b"timed") == soon and ks.expire_time(tag, b"small-timed") == soon + 1
            # a small value comes back as bytes, keeping its SSD copy (so it leaves DRAM again for free)
            assert await read_back(ks, tag, b"small") == small
            assert ks.data[tag + b"small"] == small and ks.small_copies[tag + b"small"] is t.ssd.lookup(SCOPE, b"small")
            assert ks.arena.used == 0 and ks.used == 100
            check_accounting(ks)
            await check_ssd(ks, t)
            writes = t.stats["demotions"]
            await demote_all(t)
            assert t.stats["demotions"] == writes and t.stats["demoted_clean"] == 1 and ks.used == 0
            assert await read_back(ks, tag, b"timed") == timed
            assert await read_back(ks, tag, b"plain") == plain
            check_accounting(ks)
            await check_ssd(ks, t)
        async with tiered(tmp_path) as (ks, t, tag):
            assert t.report.recovered == 4
            assert ks.expire_time(tag, b"timed") == soon and ks.expire_time(tag, b"small-timed") == soon + 1
            assert ks.expire_time(tag, b"plain") == -1 and ks.expire_time(tag, b"small") == -1
            assert await read_back(ks, tag, b"small-timed") == small_timed
            # expiring on SSD: the key goes, and so does its copy
            ks.set_expire(tag, b"plain", now_ms() - 1)
            await settle_deletes(t)
            assert ks.get(tag, b"plain") is None and tag + b"plain" not in ks.lower
            await settle_deletes(t)
            assert t.ssd.lookup(SCOPE, b"plain") is None
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


def test_a_value_expired_while_the_node_was_down_is_not_adopted_and_its_copy_goes(tmp_path, monkeypatch):
    deadline = now_ms() + 600_000

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            put(ks, tag, b"brief", data(2 * PAGE, 11))
            put(ks, tag, b"small", b"s" * 10)
            ks.set_expire(tag, b"brief", deadline)
            ks.set_expire(tag, b"small", deadline)
            put(ks, tag, b"lasting", b"l" * 10)
        # the next start comes after the deadline: both expired while "the node was down"
        monkeypatch.setattr("quilld.tiers.tiering.now_ms", lambda: deadline + 1)
        async with tiered(tmp_path) as (ks, t, tag):
            assert t.report.recovered == 3 and t.stats["ssd_expired_at_start"] == 2
            assert set(ks.lower) == {tag + b"lasting"}
            await settle_deletes(t)
            assert t.ssd.lookup(SCOPE, b"brief") is None and t.ssd.lookup(SCOPE, b"small") is None
            await check_ssd(ks, t)
    run(body())


def test_maxmemory_bounds_inline_values_and_blocks_with_a_working_ssd_tier(tmp_path):
    """Issue 19.1: with an SSD tier, a write that would take used_memory past maxmemory gets
    OutOfMemory before anything changes (the server retries it while the demoter frees
    DRAM); before, inline values grew DRAM without bound."""
    from quilld.errors import OutOfMemory

    async def body():
        async with tiered(tmp_path, pages=32, maxmemory=8 * PAGE) as (ks, t, tag):
            assert ks.limit == 8 * PAGE and ks.high_bytes == 8 * PAGE  # high = 1.0: no background demotion
            n = 0
            with pytest.raises(OutOfMemory):
                while True:
                    ks.publish(tag, b"s%03d" % n, data(INLINE_MAX, n))
                    n += 1
            # past maxmemory by at most its slack (1/64: one command may finish what it started)
            slack = ks.limit // INLINE_SLACK_SHARE
            assert ks.limit < ks.used <= ks.limit + slack < ks.used + INLINE_MAX
            assert not ks.contains(tag, b"s%03d" % n)  # the refused write changed nothing
            assert ks.space_may_free()  # so the server waits and retries
            with pytest.raises(OutOfMemory):
                ks.reserve(2 * PAGE)  # a block too: the arena has room, maxmemory does not
            assert t._pressure  # the demoter was woken: it frees DRAM in the background
            loop = asyncio.get_running_loop()
            deadline = loop.time() + TIMEOUT / 2
            while ks.used > ks.limit - PAGE and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert ks.used <= ks.limit - PAGE
            ks.publish(tag, b"s%03d" % n, data(INLINE_MAX, n))  # the retry goes through
            assert ks.used <= ks.limit
            check_accounting(ks)
            for i in range(n + 1):
                assert await read_back(ks, tag, b"s%03d" % i) == data(INLINE_MAX, i)
                assert ks.used <= ks.limit + slack
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


# -- reads -------------------------------------------------------------------------------

def test_promoted_read_keeps_the_ssd_copy_so_a_second_eviction_writes_nothing(tmp_path):
    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            value = data(5 * PAGE + 7, 7)
            put(ks, tag, b"k", value)
            assert await t._demote_batch() is True
            entry = ks.lower[tag + b"k"]
            assert ks.arena.used == 0
            pending = ks.get(tag, b"k")
            assert type(pending) is Pending
            pinned = await pending.awaitable
            assert type(pinned) is Pinned and bytes(pinned.view) == value
            block = ks.data[tag + b"k"]
            assert block.lower is entry and block.crc == entry.crc
            assert ks.active_pins == 1
            pinned.release()
            assert t.stats["promotions"] == 1 and tag + b"k" not in ks.lower
            check_accounting(ks)
            await check_ssd(ks, t)
            before = (t.stats["demotions"], t.ssd.stats()["wal_bytes"], t.used)
            assert await t._demote_batch() is True
            assert (t.stats["demotions"], t.ssd.stats()["wal_bytes"], t.used) == before
            assert t.stats["demoted_clean"] == 1
            assert ks.lower[tag + b"k"] is entry and ks.arena.used == 0
            assert block.state is BlockState.GONE
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


def test_read_without_promotion_leaves_the_key_on_ssd_and_gives_dram_back(tmp_path):
    async def body():
        async with tiered(tmp_path, promote=False) as (ks, t, tag):
            value = data(2 * PAGE + 1, 8)
            put(ks, tag, b"k", value)
            await demote_all(t)
            entry = ks.lower[tag + b"k"]
            pinned = await t.read(entry)
            assert entry.pins == 0  # the entry is pinned only while it is read
            assert bytes(pinned.view) == value
            assert ks.arena.used == 3 * PAGE and ks.reserved_blocks == 1
            pinned.release()
            assert ks.arena.used == 0 and ks.lower[tag + b"k"] is entry
            assert t.stats["promotions"] == 0 and t.stats["ssd_reads"] == 1
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_ssd_block_reads_as_a_miss_and_is_counted(tmp_path, where):
    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            value = data(2 * PAGE, 9)
            put(ks, tag, b"k", value)
            put(ks, tag, b"other", data(VAL, 10))
            await demote_all(t)
            entry = ks.lower[tag + b"k"]
            offset = entry.offset + (payload_offset(SCOPE, b"k", entry.length) + 1000 if where == "payload" else 20)
            with open(os.path.join(tmp_path, seg_name(entry.seg)), "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
            pending = ks.get(tag, b"k")
            assert type(pending) is Pending
            assert await pending.awaitable is None
            assert t.stats["ssd_read_corrupt"] == 1 and t.stats["ssd_reads"] == 0
            assert not ks.contains(tag, b"k") and ks.get(tag, b"k") is None
            assert ks.arena.used == 0
            await settle_deletes(t)
            assert t.ssd.lookup(SCOPE, b"k") is None
            assert await read_back(ks, tag, b"other") == data(VAL, 10)  # the rest is unaffected
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


# -- a full SSD ---------------------------------------------------------------------------

def test_full_ssd_drops_ssd_copies_of_dram_blocks_first_then_its_lru(tmp_path):
    async def body():
        # room for 8 blocks on SSD; one block per group commit
        async with tiered(tmp_path, ssd_pages=8 * 2, group_commit=PAGE) as (ks, t, tag):
            values = {b"k%d" % i: data(VAL, 20 + i) for i in range(8)}
            for key, value in values.items():
                put(ks, tag, key, value)
            await demote_all(t)
            assert t.used == t.capacity == 8 * SSD_BLOCK and len(ks.lower) == 8
            new = data(VAL, 30)
            put(ks, tag, b"new", new)
            assert await read_back(ks, tag, b"k7") == values[b"k7"]  # promoted: DRAM + SSD copy
            k7 = ks.data[tag + b"k7"]
            assert k7.lower is not None
            # the batch takes the coldest block, "new": the SSD has no room for it
            assert await t._demote_batch() is True
            assert t.stats["ssd_copies_dropped"] == 1 and t.stats["ssd_evictions"] == 1
            assert k7.lower is None and ks.data[tag + b"k7"] is k7
            assert not ks.contains(tag, b"k0")  # the SSD's least recently used key
            assert set(ks.lower) == {tag + b"k%d" % i for i in range(1, 7)} | {tag + b"new"}
            await settle_deletes(t)
            assert t.used == 7 * SSD_BLOCK
            assert await read_back(ks, tag, b"new") == new
            assert await read_back(ks, tag, b"k1") == values[b"k1"]
            direct = ks.get(tag, b"k7")
            assert type(direct) is Pinned  # straight from DRAM
            direct.release()
            assert await read_back(ks, tag, b"k7") == values[b"k7"]
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


# -- shutdown and recovery -------------------------------------------------------------------

def test_stop_flushes_dram_blocks_and_a_new_tiering_recovers_them(tmp_path):
    blocks = {b"a": data(VAL, 40), b"b": data(3 * PAGE + 5, 41), b"c": data(20_000, 42)}

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            for key, value in blocks.items():
                put(ks, tag, key, value)
            put(ks, tag, b"small", b"inline")
            assert not ks.lower
        blocks[b"small"] = b"inline"  # inline values are flushed too (issue 18.1)
        assert ks.arena.used == ks.used == 0 and set(ks.lower) == {tag + k for k in blocks}
        assert t.not_kept == 0
        check_accounting(ks)
        async with tiered(tmp_path) as (ks, t, tag):
            assert t.report.recovered == 4 and t.report.dropped_corrupt == 0
            assert set(ks.lower) == {tag + k for k in blocks}
            for key, value in blocks.items():
                assert await read_back(ks, tag, key) == value
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


# -- a random sequence against a model ---------------------------------------------------------

def test_random_sequence_keeps_values_and_accounting(tmp_path):
    rng = random.Random(1234)
    keys = [b"k%d" % i for i in range(10)]
    model: dict[bytes, bytes] = {}

    async def body():
        async with tiered(tmp_path, pages=64, ssd_pages=256) as (ks, t, tag):
            for step in range(60):
                key = rng.choice(keys)
                op = rng.choice(["block", "block", "inline", "delete", "read", "demote", "race"])
                if op in ("block", "inline"):
                    value = data(rng.randrange(INLINE_MAX + 1, 2 * PAGE) if op == "block"
                                 else rng.randrange(0, INLINE_MAX + 1), step)
                    put(ks, tag, key, value)
                    model[key] = value
                elif op == "delete":
                    assert ks.delete(tag, key) == (model.pop(key, None) is not None)
                elif op == "read":
                    assert await read_back(ks, tag, key) == model.get(key)
                elif op == "demote":
                    await t._demote_batch(everything=rng.random() < 0.5)
                else:  # overwrite a key while a batch is being written
                    batch = asyncio.create_task(t._demote_batch(everything=True))
                    await asyncio.sleep(0)
                    value = data(rng.randrange(INLINE_MAX + 1, 2 * PAGE), step)
                    put(ks, tag, key, value)
                    model[key] = value
                    await batch
                check_accounting(ks)
                await check_ssd(ks, t)
            for key in keys:
                assert await read_back(ks, tag, key) == model.get(key)
        async with tiered(tmp_path, pages=64, ssd_pages=256) as (ks, t, tag):
            survivors = model  # a clean stop keeps inline values too
            assert {fk[len(tag):] for fk in ks.lower} == set(survivors)
            for key, value in survivors.items():
                assert await read_back(ks, tag, key) == value
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


# -- what the SSD format cannot hold (issue 29.14) -------------------------------------------

# The doors keep every deadline within an i64 (RESTORE k 9223372036854775807 makes no key, as in
# redis), which is what the block header holds; so these tests lower the format's ceiling
# (wal.EXPIRE_MAX, read at each check) to get a deadline the keyspace takes and the tier cannot hold.
ABSURD = now_ms() + 10 ** 13  # about 317 years: within an i64, past the lowered ceiling


@pytest.fixture
def low_ceiling(monkeypatch):
    import quilld.tiers.wal as wal
    monkeypatch.setattr(wal, "EXPIRE_MAX", now_ms() + 10 ** 12)


def test_a_value_whose_ttl_the_ssd_cannot_hold_stays_in_dram_and_fails_only_itself(tmp_path, low_ceiling):
    """Before, packing its expiry raised struct.error inside the batch: every batch failed, its
    blocks stayed pinned, DRAM filled, the stop flushed nothing; ssd_failed stayed 0."""
    values = {b"k%d" % i: data(VAL, 90 + i) for i in range(6)}

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            for key, value in values.items():
                put(ks, tag, key, value)
            put(ks, tag, b"small", b"inline")
            ks.set_expire(tag, b"k0", ABSURD)  # the coldest: first in every batch
            ks.set_expire(tag, b"small", ABSURD)
            await demote_all(t)
            assert set(ks.lower) == {tag + k for k in values if k != b"k0"}
            assert set(ks.data) == {tag + b"k0", tag + b"small"}
            assert t.active and t.stats["ssd_unstorable"] == 2 and t.unstorable_held() == 2
            assert t.stats["demote_errors"] == 0
            await demote_all(t)  # refused once: not picked again, not counted again
            assert t.stats["ssd_unstorable"] == 2
            check_accounting(ks)  # nothing left pinned
            await check_ssd(ks, t)
            for key, value in values.items():
                assert await read_back(ks, tag, key) == value
            assert ks.expire_time(tag, b"k0") == ABSURD
            # a new value of the key is a new value: picked again (and it fits)
            put(ks, tag, b"small", b"inline2")
            assert t.unstorable_held() == 1
            await demote_all(t)
            assert tag + b"small" in ks.lower
            put(ks, tag, b"late", b"x" * 300)  # refused, then given a TTL the tier can hold
            ks.set_expire(tag, b"late", ABSURD)
            await demote_all(t)
            assert tag + b"late" in ks.data and t.unstorable_held() == 2
            ks.set_expire(tag, b"late", now_ms() + 600_000)
            assert t.unstorable_held() == 1
            await demote_all(t)
            assert tag + b"late" in ks.lower and t.stats["ssd_unstorable"] == 3
        assert t.not_kept == 1  # the stop flushed everything else
        async with tiered(tmp_path) as (ks, t, tag):
            assert t.report.recovered == len(values) + 1  # k1.. k5, small and late; k0's value could not be kept
            assert ks.get(tag, b"k0") is None
            for key, value in values.items():
                if key != b"k0":
                    assert await read_back(ks, tag, key) == value
            assert await read_back(ks, tag, b"small") == b"inline2"
    run(body())


def test_a_batch_failing_on_anything_but_io_gives_its_values_back_and_the_tier_goes_on(tmp_path, monkeypatch):
    values = {b"k%d" % i: data(VAL, 120 + i) for i in range(4)}

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            for key, value in values.items():
                put(ks, tag, key, value)
            real = t.ssd.write_blocks
            calls = []

            def fails_once(items):
                calls.append(len(items))
                if len(calls) == 1:
                    raise RuntimeError("a bug in the write path")
                return real(items)

            monkeypatch.setattr(t.ssd, "write_blocks", fails_once)
            assert not await t._demote_batch(everything=True)
            assert t.active and t.stats["demote_errors"] == 1 and not ks.lower
            check_accounting(ks)  # its blocks unpinned, its extents freed
            assert t.used == 0
            await demote_all(t)
            assert set(ks.lower) == {tag + k for k in values}
            check_accounting(ks)
            await check_ssd(ks, t)
    run(body())


def test_a_new_ttl_the_ssd_cannot_hold_is_refused_alone(tmp_path, low_ceiling):
    soon = now_ms() + 60_000

    async def body():
        async with tiered(tmp_path) as (ks, t, tag):
            put(ks, tag, b"a", data(VAL, 7))
            put(ks, tag, b"b", data(VAL, 8))
            await demote_all(t)
            ks.set_expire(tag, b"a", ABSURD)
            ks.set_expire(tag, b"b", soon)
            await settle_deletes(t)
            assert t.active and t.stats["ssd_unstorable"] == 1 and t.stats["ssd_retimes"] == 1
            assert t.ssd.lookup(SCOPE, b"b").expire == soon
        async with tiered(tmp_path) as (ks, t, tag):
            assert ks.expire_time(tag, b"b") == soon and ks.expire_time(tag, b"a") == -1
    run(body())
