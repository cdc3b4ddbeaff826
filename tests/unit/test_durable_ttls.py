"""Acknowledged TTL changes stay as acknowledged across a kill -9 (issue 19.17 and its
siblings), at the handler level, for blocks and inline values alike.

Same harness as test_durable_deletes.py: real handlers, a real keyspace and a real SSD
tier in a temporary directory; "kill -9" closes the tier's files with no flush and no
checkpoint, and a new node recovers the same directory.

Every TTL verb (EXPIRE, PEXPIRE, EXPIREAT, PEXPIREAT with their options, PERSIST, GETEX
EX/PX/EXAT/PXAT/PERSIST) is tried on a value in each of the three states where it has, or
is getting, a copy on SSD: its demotion write in flight (the case of 19.17: the key came
back with no TTL, 11 times in 45 crash rounds), only on SSD, and promoted back to DRAM
with its SSD copy kept. The reply must wait until the change is durable, and after the
kill the key must carry exactly the acknowledged TTL.
"""

from __future__ import annotations

import asyncio

import pytest

from test_durable_deletes import BIG, acked, cmd, data, demote_all, node, run_async
from quilld.model import Pending
from quilld.protocol.resp import OK
from quilld.tiers.block import Block
from quilld.tiers.expiry import now_ms

FAR = now_ms() + 3_600_000  # an absolute deadline an hour away (ms)

# name: (the TTL the value starts with, in seconds or None; the command; its reply ("value": the value))
TTL_CHANGES = {
    "EXPIRE": (None, ("EXPIRE", "k", "500"), 1),
    "PEXPIRE": (None, ("PEXPIRE", "k", "500000"), 1),
    "EXPIREAT": (None, ("EXPIREAT", "k", str(FAR // 1000)), 1),
    "PEXPIREAT": (None, ("PEXPIREAT", "k", str(FAR)), 1),
    "EXPIRE GT": (200, ("EXPIRE", "k", "900", "GT"), 1),
    "EXPIRE LT": (900, ("EXPIRE", "k", "200", "LT"), 1),
    "PERSIST": (300, ("PERSIST", "k"), 1),
    "GETEX EX": (None, ("GETEX", "k", "EX", "700"), "value"),
    "GETEX PXAT": (300, ("GETEX", "k", "PXAT", str(FAR)), "value"),
    "GETEX PERSIST": (300, ("GETEX", "k", "PERSIST"), "value"),
}
STATES = ["in-flight", "ssd-only", "promoted"]
KINDS = {"block": BIG, "inline": 100}


async def setup(ctx, t, c, state: str, value: bytes, ttl: int | None) -> asyncio.Task | None:
    """`k` holding `value` (with `ttl` seconds) in `state`; for "in-flight", the demotion task
    whose write is under way."""
    args = ("SET", "k", value) + (("EX", str(ttl)) if ttl else ())
    assert cmd(ctx, c, *args) is OK
    fk = c.tag + b"k"
    if state == "in-flight":
        batch = asyncio.create_task(t._demote_batch(everything=True))
        await asyncio.sleep(0)
        v = ctx.keyspace.data[fk]
        assert (v.pins == 1) if type(v) is Block else (fk in t._writing)  # its write is under way
        return batch
    await demote_all(t)
    assert fk in ctx.keyspace.lower
    if ttl:
        assert ctx.keyspace.lower[fk].expire > 0  # the TTL went to SSD with the value
    if state == "promoted":
        assert await acked(cmd(ctx, c, "GET", "k")) == value
        assert ctx.keyspace.copy_below(fk, ctx.keyspace.data[fk]) is not None
    return None


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("change", sorted(TTL_CHANGES))
def test_an_acknowledged_ttl_change_survives_a_kill(tmp_path, change, state, kind):
    ttl, args, reply = TTL_CHANGES[change]
    value = data(KINDS[kind], 1)

    async def body():
        async with node(tmp_path) as (ctx, t, c):
            batch = await setup(ctx, t, c, state, value, ttl)
            before = ctx.keyspace.expire_time(c.tag, b"k")
            got = cmd(ctx, c, *args)
            assert type(got) is Pending, "acknowledged before the TTL's change was durable on SSD"
            assert await acked(got) == (value if reply == "value" else reply)
            want = await acked(cmd(ctx, c, "PEXPIRETIME", "k"))
            assert want != before and (want == -1) == (change.endswith("PERSIST"))
            if batch is not None:
                assert batch.done()  # the write landed first, then its copy got the new TTL
                await batch
        async with node(tmp_path) as (ctx, t, c):  # after kill -9, no flush, no checkpoint
            assert await acked(cmd(ctx, c, "GET", "k")) == value
            assert await acked(cmd(ctx, c, "PEXPIRETIME", "k")) == want
    run_async(body())


def test_a_ttl_change_of_a_dram_only_value_is_answered_at_once(tmp_path):
    async def body():
        async with node(tmp_path) as (ctx, t, c):
            for value in (data(BIG, 2), b"small"):
                assert cmd(ctx, c, "SET", "k", value) is OK
                for args in (("EXPIRE", "k", "100"), ("PERSIST", "k"), ("GETEX", "k", "PX", "5000"),
                             ("PEXPIREAT", "k", str(FAR))):
                    got = cmd(ctx, c, *args)
                    assert type(got) is not Pending, args
                    assert ctx.keyspace.take_unsynced() is None
            assert t.stats["delete_syncs"] == 0 and t.stats["ssd_retimes"] == 0
    run_async(body())


def test_ttl_changes_from_many_clients_share_one_wal_sync(tmp_path):
    from handler_context import session

    async def body():
        async with node(tmp_path, pages=128) as (ctx, t, c):
            keys = [f"k{i}" for i in range(30)]
            for i, k in enumerate(keys):
                assert cmd(ctx, c, "SET", k, data(BIG if i % 2 else 50, i)) is OK
            await demote_all(t)
            before = t.stats["delete_syncs"]
            replies = [cmd(ctx, session(ctx), "EXPIRE", k, "100") for k in keys]
            assert all(type(r) is Pending for r in replies)
            assert await asyncio.gather(*(acked(r) for r in replies)) == [1] * 30
            assert t.stats["delete_syncs"] - before == 1 and t.stats["ssd_retimes"] == 30
    run_async(body())


def test_a_rename_or_delete_while_the_write_is_in_flight_leaves_no_copy_of_an_inline_value(tmp_path):
    """The siblings of 19.17 for inline values: a DEL, RENAME or overwrite of a small value
    whose demotion write is in flight waits for the write, whose copy is then dropped."""
    async def body():
        for change in (("DEL", "k"), ("RENAME", "k", "j"), ("SET", "k", "other")):
            async with node(tmp_path) as (ctx, t, c):
                assert cmd(ctx, c, "SET", "k", "small") is OK
                batch = asyncio.create_task(t._demote_batch(everything=True))
                await asyncio.sleep(0)
                assert c.tag + b"k" in t._writing
                got = cmd(ctx, c, *change)
                assert type(got) is Pending, change
                await acked(got)
                assert batch.done()
                await batch
                assert t.ssd.lookup(tuple(c.scope), b"k") is None
            async with node(tmp_path) as (ctx, t, c):
                assert await acked(cmd(ctx, c, "GET", "k")) is None, change  # the old value never returns
                assert await acked(cmd(ctx, c, "FLUSHALL")) is OK
    run_async(body())
