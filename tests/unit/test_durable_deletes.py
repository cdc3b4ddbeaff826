"""Acknowledged deletes stay deleted (issue 11, finding 8), at the handler level.

Real handlers (through the command table), a real keyspace and a real SSD tier in a
temporary directory; "kill -9" is simulated by closing the tier's files with no flush
and no checkpoint (the page cache, like after a real kill, keeps what was written),
then a new node recovers the same directory. A reply that involves an SSD copy is a
Pending that resolves only once the deletion's WAL record is durable; a pure-DRAM
reply is immediate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

import pytest

from handler_context import make_context, session
from quilld.config import SsdConfig
from quilld.model import Pending, Pinned
from quilld.protocol.resp import OK
from quilld.tiers.arena import PAGE
from quilld.tiers.block import Block
from quilld.tiers.tiering import Tiering
from quilld.tiers.wal import DelRecord, WalReader, decode_batch, parse_wal_name

TIMEOUT = 20.0
BIG = 2 * PAGE  # an arena block, demoted to SSD by the tests


def run_async(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def no_space_wait(timeout: float) -> None:
    await asyncio.sleep(timeout)


def cmd(ctx, c, *args):
    return ctx.table.dispatch(c, [a.encode() if isinstance(a, str) else a for a in args])


async def acked(reply):
    """What the client receives: a Pending is awaited as the server does before replying."""
    if type(reply) is Pending:
        reply = await reply.awaitable
    if type(reply) is Pinned:
        data_ = bytes(reply.view)
        reply.release()
        return data_
    return reply


@contextlib.asynccontextmanager
async def node(ssd_dir, pages=64):
    """A node's keyspace and handlers over a started SSD tier. Leaving the block kills it
    (no flush, no checkpoint) unless the test stopped it."""
    ctx = make_context(pages=pages)
    cfg = SsdConfig(dir=str(ssd_dir), size=128 * PAGE, segment_size=128 * PAGE)
    t = Tiering(ctx.keyspace, cfg, no_space_wait, workers=2)
    await t.start(ctx.scopes)
    try:
        yield ctx, t, session(ctx)
    finally:
        await kill(t)


async def kill(t: Tiering) -> None:
    """As kill -9: nothing more reaches the files (what was written stays, as in the page cache)."""
    if t._task is not None:
        t._task.cancel()
        await asyncio.gather(t._task, return_exceptions=True)
    if t._deleting is not None:
        t._deleting.cancel()
        await asyncio.gather(t._deleting, return_exceptions=True)
    t.executor.shutdown(wait=True)
    t.ssd.close()


async def demote_all(t: Tiering) -> None:
    for _ in range(100):
        if not await t._demote_batch(everything=True):
            return
    raise AssertionError("demotion did not converge")


def logged_dels(ssd_dir) -> set[bytes]:
    """Keys with a DEL record in the tier's logs right now."""
    out = set()
    for name in os.listdir(ssd_dir):
        if parse_wal_name(name) is None:
            continue
        with open(os.path.join(ssd_dir, name), "rb") as f:
            for _, raw in WalReader(f.read()):
                out |= {rec.key for rec in decode_batch(raw) if type(rec) is DelRecord}
    return out


async def on_ssd(ctx, t, c, key: str, value: bytes) -> None:
    assert cmd(ctx, c, "SET", key, value) is OK
    await demote_all(t)
    assert ctx.keyspace.lower.get(c.tag + key.encode()) is not None


# -- every acknowledging command waits for the deletion of the SSD copy -----------------------

CHANGES = {
    "DEL": (("DEL", "k"), 1, None),
    "UNLINK": (("UNLINK", "k"), 1, None),
    "FLUSHALL": (("FLUSHALL",), OK, None),
    "SET inline": (("SET", "k", "new"), OK, b"new"),
    "SET block": (("SET", "k", data(BIG, 2)), OK, data(BIG, 2)),
    "SET GET": (("SET", "k", "new", "GET"), data(BIG, 1), b"new"),
    "SET EX": (("SET", "k", "new", "EX", "100"), OK, b"new"),
    "MSET": (("MSET", "other", "x", "k", "new"), OK, b"new"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_to_an_ssd_value_is_answered_once_its_deletion_is_durable(tmp_path, change):
    args, expected_reply, new_value = CHANGES[change]

    async def body():
        async with node(tmp_path) as (ctx, t, c):
            await on_ssd(ctx, t, c, "k", data(BIG, 1))
            reply = cmd(ctx, c, *args)
            assert type(reply) is Pending  # not acknowledged yet
            assert b"k" not in logged_dels(tmp_path)
            assert await acked(reply) == expected_reply
            assert b"k" in logged_dels(tmp_path)  # durable before the reply
            assert await acked(cmd(ctx, c, "GET", "k")) == new_value
        async with node(tmp_path) as (ctx, t, c):  # after kill -9: never the old value
            assert await acked(cmd(ctx, c, "GET", "k")) is None  # the new value lived in DRAM only
            assert t.report.recovered == 0
    run_async(body())


def test_put2phase_commit_over_an_ssd_value_is_answered_once_its_deletion_is_durable(tmp_path):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            handle = cmd(ctx, c, "PUT2PHASE", "BEGIN", "k", str(BIG))
            assert type(handle) is bytes
            await on_ssd(ctx, t, c, "k", data(BIG, 1))  # the key appeared while the put was open
            assert cmd(ctx, c, "PUT2PHASE", "DATA", handle, "0", data(BIG, 3)) is OK
            reply = cmd(ctx, c, "PUT2PHASE", "COMMIT", handle)
            assert type(reply) is Pending
            assert await acked(reply) is OK and b"k" in logged_dels(tmp_path)
            assert await acked(cmd(ctx, c, "GET", "k")) == data(BIG, 3)
        async with node(tmp_path) as (ctx, t, c):
            assert await acked(cmd(ctx, c, "GET", "k")) is None
    run_async(body())


def test_changes_to_dram_only_values_are_answered_at_once(tmp_path):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            ks = ctx.keyspace
            for args, reply in ((("SET", "s", "v"), OK), (("SET", "b", data(BIG, 4)), OK),
                                (("SET", "b", data(BIG, 5)), OK), (("MSET", "s", "w", "b", "x"), OK),
                                (("SET", "b", data(BIG, 6), "GET"), b"x"), (("DEL", "s", "b", "nope"), 2),
                                (("FLUSHALL",), OK)):
                got = cmd(ctx, c, *args)
                assert type(got) is not Pending and got == reply, args
                assert ks.unsynced is False and ks.take_unsynced() is None
            assert t.stats["delete_syncs"] == 0
    run_async(body())


def test_deleting_a_promoted_block_waits_for_its_ssd_copy(tmp_path):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            await on_ssd(ctx, t, c, "k", data(BIG, 1))
            assert await acked(cmd(ctx, c, "GET", "k")) == data(BIG, 1)  # promoted, keeps its SSD copy
            block = ctx.keyspace.data[c.tag + b"k"]
            assert type(block) is Block and block.lower is not None
            reply = cmd(ctx, c, "DEL", "k")
            assert type(reply) is Pending and await acked(reply) == 1
        async with node(tmp_path) as (ctx, t, c):
            assert await acked(cmd(ctx, c, "GET", "k")) is None
    run_async(body())


@pytest.mark.parametrize("change", ["DEL", "SET"])
def test_a_change_while_the_demotion_write_is_in_flight_waits_for_that_write(tmp_path, change):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            assert cmd(ctx, c, "SET", "k", data(BIG, 1)) is OK
            batch = asyncio.create_task(t._demote_batch(everything=True))
            await asyncio.sleep(0)
            assert ctx.keyspace.data[c.tag + b"k"].pins == 1  # being written to SSD
            reply = cmd(ctx, c, *(("DEL", "k") if change == "DEL" else ("SET", "k", "new")))
            assert type(reply) is Pending
            await acked(reply)
            assert batch.done()  # the write landed, and then its copy's deletion was made durable
            assert b"k" in logged_dels(tmp_path)
        async with node(tmp_path) as (ctx, t, c):
            assert await acked(cmd(ctx, c, "GET", "k")) is None
    run_async(body())


def test_deletions_from_many_clients_share_one_wal_sync(tmp_path):
    async def body():
        async with node(tmp_path, pages=128) as (ctx, t, c):
            keys = [f"k{i}" for i in range(40)]
            for k in keys:
                assert cmd(ctx, c, "SET", k, data(BIG, 7)) is OK
            await demote_all(t)
            before = t.stats["delete_syncs"]
            replies = [cmd(ctx, session(ctx), "DEL", k) for k in keys]  # 40 clients, one loop turn
            assert all(type(r) is Pending for r in replies)
            assert await asyncio.gather(*(acked(r) for r in replies)) == [1] * 40
            assert t.stats["delete_syncs"] - before == 1 and t.stats["ssd_deletes"] >= 40
    run_async(body())


def test_a_failed_tier_fences_itself_before_acknowledging_a_deletion(tmp_path):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            await on_ssd(ctx, t, c, "k", data(BIG, 1))
            await on_ssd(ctx, t, c, "j", data(BIG, 2))
            t.ssd.failed = "simulated: Input/output error"
            reply = cmd(ctx, c, "DEL", "k")
            assert await acked(reply) == 1
            assert t.ssd.fenced
            assert await acked(cmd(ctx, c, "GET", "j")) == data(BIG, 2)  # still served while it runs
        async with node(tmp_path) as (ctx, t, c):
            assert t.report.path == "fenced"
            assert await acked(cmd(ctx, c, "GET", "k")) is None
            assert await acked(cmd(ctx, c, "GET", "j")) is None  # the fenced tier started empty
    run_async(body())


def test_a_deletion_that_cannot_be_made_durable_is_answered_with_an_error(tmp_path, monkeypatch):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            await on_ssd(ctx, t, c, "k", data(BIG, 1))
            t.ssd.failed = "simulated: Input/output error"

            def unremovable():
                raise OSError(30, "Read-only file system")

            monkeypatch.setattr(t.ssd.files, "remove_key", unremovable)
            reply = cmd(ctx, c, "DEL", "k")
            with pytest.raises(Exception, match="not durable"):
                await acked(reply)
    run_async(body())


def test_kill_right_after_any_acknowledgement_never_brings_back_a_deleted_or_older_value(tmp_path):
    """Random SET/MSET/DEL/FLUSHALL over values on SSD and in DRAM, demotions and reads in
    between, a kill after a random acknowledgement, then a restart: every key holds its
    last acknowledged value or nothing (DRAM is lost), never a deleted or older one."""
    rng = random.Random(2026)
    keys = [f"k{i}" for i in range(6)]
    last: dict[str, bytes | None] = {}  # the last acknowledged value of each key

    async def body():
        for rnd in range(6):
            async with node(tmp_path, pages=48) as (ctx, t, c):
                for k in keys:  # after the restart: nothing but the last acknowledged value, or nothing
                    got = await acked(cmd(ctx, c, "GET", k))
                    assert got is None or got == last.get(k), (rnd, k)
                    last[k] = got
                for step in range(rng.randrange(5, 25)):
                    op = rng.choice(["set", "set", "small", "mset", "del", "del", "demote", "demote", "get",
                                     "flushall" if rng.random() < 0.1 else "get"])
                    k = rng.choice(keys)
                    if op in ("set", "small"):
                        v = data(BIG if op == "set" else 100, rnd * 1000 + step)
                        assert await acked(cmd(ctx, c, "SET", k, v)) is OK
                        last[k] = v
                    elif op == "mset":
                        k2 = rng.choice(keys)
                        v, v2 = data(BIG, rnd * 1000 + step), data(BIG + 1, rnd * 1000 + step)
                        assert await acked(cmd(ctx, c, "MSET", k, v, k2, v2)) is OK
                        last[k], last[k2] = v, v2
                    elif op == "del":
                        await acked(cmd(ctx, c, "DEL", k))
                        last[k] = None
                    elif op == "flushall":
                        assert await acked(cmd(ctx, c, "FLUSHALL")) is OK
                        last.clear()
                    elif op == "demote":
                        await demote_all(t)
                    else:
                        assert await acked(cmd(ctx, c, "GET", k)) == last.get(k)
            # leaving the block killed the node right after the last acknowledgement
    run_async(body())
