"""Command handlers called directly on a real NodeContext: no server, no sockets.

The wire-level behaviour (byte-exact replies, redis-server comparisons) is tested
black-box in tests/blackbox; here each handler's reply *value* and its effect on
storage are asserted, including the pins and reservations it must give back.
"""

from __future__ import annotations

import asyncio

import crc32c
import pytest

from handler_context import make_context, session
from quilld.errors import ChecksumMismatch, CommandError, Incomplete, NoAuth, NoHandle, PeerOnly, WrongPass
from quilld.model import CacheTier, IdentityScope, Pending, Pinned
from quilld.protocol.commands.blocks import large_target, release_args
from quilld.protocol.resp import OK, Status
from quilld.tiers.arena import PAGE
from quilld.tiers.block import Block, BlockState


def run(ctx, c, *args):
    """Dispatch as the server does: errors come back as values."""
    return ctx.table.dispatch(c, [str(a).encode() if isinstance(a, (str, int)) else a for a in args])


def value_of(reply):
    """A reply's bytes; a Pinned view is released once read, as the server does after sending."""
    if isinstance(reply, Pinned):
        data = bytes(reply.view)
        reply.release()
        return data
    return reply


@pytest.fixture
def ctx():
    return make_context(pages=64)


@pytest.fixture
def c(ctx):
    return session(ctx)


def test_get_set_small_and_large_values(ctx, c):
    assert run(ctx, c, "SET", "small", "v") is OK
    assert run(ctx, c, "GET", "small") == b"v"
    big = bytes(range(256)) * 40  # over inline_max: an arena block
    assert run(ctx, c, "SET", "big", big) is OK
    reply = run(ctx, c, "GET", "big")
    assert isinstance(reply, Pinned)
    assert ctx.keyspace.active_pins == 1  # pinned until sent
    assert value_of(reply) == big
    assert ctx.keyspace.active_pins == 0
    assert run(ctx, c, "GET", "missing") is None


def test_mget_pins_each_block_and_returns_values_in_order(ctx, c):
    big = b"b" * 5000
    run(ctx, c, "MSET", "a", "1", "big", big)
    reply = run(ctx, c, "MGET", "a", "nope", "big")
    assert reply[0] == b"1" and reply[1] is None and isinstance(reply[2], Pinned)
    assert value_of(reply[2]) == big and ctx.keyspace.active_pins == 0


def test_set_options_follow_redis(ctx, c):
    assert run(ctx, c, "SET", "k", "1", "NX") is OK
    assert run(ctx, c, "SET", "k", "2", "NX") is None
    assert run(ctx, c, "SET", "k", "3", "XX", "GET") == b"1"
    assert run(ctx, c, "GET", "k") == b"3"
    assert run(ctx, c, "SET", "k", "4", "PX", "100000") is OK
    assert 0 < run(ctx, c, "PTTL", "k") <= 100000
    err = run(ctx, c, "SET", "k", "5", "NX", "XX")
    assert isinstance(err, CommandError) and err.message == "syntax error"
    err = run(ctx, c, "SET", "k", "5", "EX", "0")
    assert isinstance(err, CommandError) and err.message == "invalid expire time in 'set' command"


def test_del_exists_strlen_type_dbsize_flushall(ctx, c):
    run(ctx, c, "MSET", "a", "1", "b", "22")
    assert run(ctx, c, "EXISTS", "a", "b", "c", "a") == 3
    assert run(ctx, c, "STRLEN", "b") == 2
    assert run(ctx, c, "TYPE", "a") == Status(b"string") and run(ctx, c, "TYPE", "z") == Status(b"none")
    assert run(ctx, c, "DBSIZE") == 2
    assert run(ctx, c, "DEL", "a", "z") == 1
    assert run(ctx, c, "FLUSHALL") is OK and run(ctx, c, "DBSIZE") == 0


def test_scopes_keep_keys_apart_and_refusals_are_counted(ctx, c):
    other = session(ctx)
    assert run(ctx, other, "SCOPE", "llama", "tok") is OK
    run(ctx, c, "SET", "k", "default-scope")
    assert run(ctx, other, "GET", "k") is None
    assert ctx.scopes.refusals_of("default")["cross_model"] == 1
    assert run(ctx, other, "DBSIZE") == 0 and run(ctx, c, "DBSIZE") == 1


def test_auth_changes_the_tenant_and_failures_are_counted():
    ctx = make_context(requirepass="s3cret")
    c = session(ctx)
    assert isinstance(run(ctx, c, "GET", "k"), NoAuth)
    assert isinstance(run(ctx, c, "AUTH", "wrong"), WrongPass)
    assert ctx.stats["auth_failures"] == 1
    assert run(ctx, c, "AUTH", "s3cret") is OK
    assert run(ctx, c, "GET", "k") is None


# -- two-phase puts through their commands ---------------------------------------------
def test_put2phase_life_cycle(ctx, c):
    data = bytes(range(256)) * 64  # 16 KiB: an arena block
    h = run(ctx, c, "PUT2PHASE", "BEGIN", "blk", len(data))
    assert isinstance(h, bytes) and run(ctx, c, "EXISTS", "blk") == 0
    assert run(ctx, c, "PUT2PHASE", "DATA", h, 8192, data[8192:]) is OK
    assert isinstance(run(ctx, c, "PUT2PHASE", "COMMIT", h), Incomplete)
    assert run(ctx, c, "PUT2PHASE", "DATA", h, 0, data[:8192]) is OK
    bad = run(ctx, c, "PUT2PHASE", "COMMIT", h, "CRC32C", (crc32c.crc32c(data) + 1) % (1 << 32))
    assert isinstance(bad, ChecksumMismatch)
    assert run(ctx, c, "PUT2PHASE", "COMMIT", h, "CRC32C", crc32c.crc32c(data)) is OK
    assert value_of(run(ctx, c, "GET", "blk")) == data
    assert run(ctx, c, "PUT2PHASE", "BEGIN", "blk", len(data)) == Status(b"EXISTS")
    assert isinstance(run(ctx, c, "PUT2PHASE", "ABORT", h), NoHandle)  # committed: gone


def test_put2phase_handles_belong_to_their_tenant():
    ctx = make_context(requirepass="pw")
    alice, bob = session(ctx, user="default"), session(ctx, user="bob")
    h = run(ctx, alice, "PUT2PHASE", "BEGIN", "k", 10)
    assert isinstance(run(ctx, bob, "PUT2PHASE", "DATA", h, 0, b"x" * 10), NoHandle)
    assert run(ctx, alice, "PUT2PHASE", "ABORT", h) is OK
    assert ctx.keyspace.used == 0 and ctx.keyspace.reserved_blocks == 0


# -- where large payloads land, and giving them back ------------------------------------
def test_large_set_payload_lands_in_a_reserved_block_and_is_given_back_if_unused(ctx, c):
    n = 3 * PAGE
    target, view = large_target(c, [b"SET", b"k"], 2, n)
    assert type(target) is Block and target.state is BlockState.WRITING and len(view) == n
    assert ctx.keyspace.reserved_blocks == 1
    release_args(c, [b"SET", b"k", target])  # the connection dropped mid-payload
    assert target.state is BlockState.GONE
    assert ctx.keyspace.used == 0 and ctx.keyspace.reserved_blocks == 0 and ctx.keyspace.held_bytes == 0


def test_large_data_payload_is_received_into_its_put(ctx, c):
    n = 4 * PAGE
    h = run(ctx, c, "PUT2PHASE", "BEGIN", "k", n)
    into, view = large_target(c, [b"PUT2PHASE", b"DATA", h, b"0"], 4, n)
    view[:] = b"z" * n
    assert run(ctx, c, "PUT2PHASE", "DATA", h, "0", into) is OK
    assert run(ctx, c, "PUT2PHASE", "COMMIT", h) is OK
    assert value_of(run(ctx, c, "GET", "k")) == b"z" * n


def test_large_payload_before_auth_is_refused():
    ctx = make_context(requirepass="pw")
    with pytest.raises(NoAuth):
        large_target(session(ctx), [b"SET", b"k"], 2, 5 * PAGE)
    assert ctx.keyspace.used == 0


# -- LOCATE, GETBLK and the peer commands -------------------------------------------------
def test_locate_lists_this_nodes_copy_and_engine_residencies(ctx, c):
    run(ctx, c, "SET", "k", b"v" * 5000)
    ctx.control.index.put(c.tag, b"k", "engine-1", CacheTier.HBM)
    places = run(ctx, c, "LOCATE", "k", "none")
    assert places[1] == []
    mine, engine = places[0]
    assert mine[b"node"] == b"n1" and mine[b"tier"] == b"dram" and mine[b"bytes"] == 5000
    assert engine[b"node"] == b"engine-1" and engine[b"tier"] == b"hbm"


def test_getblk_without_a_cluster_is_a_local_read(ctx, c):
    run(ctx, c, "SET", "k", b"v" * 5000)
    assert value_of(run(ctx, c, "GETBLK", "k")) == b"v" * 5000
    assert value_of(run(ctx, c, "GETBLK", "k", "LOCAL")) == b"v" * 5000
    assert run(ctx, c, "GETBLK", "nope") is None
    assert isinstance(run(ctx, c, "GETBLK", "k", "FAR"), CommandError)


class _ClusterStandIn:
    """Only what the peer commands read from the cluster: its counters and transfer paths."""

    def __init__(self):
        from collections import Counter
        from types import SimpleNamespace

        self.stats = Counter()
        self.transfers = SimpleNamespace(rdma=None)


def test_peerget_answers_crc_and_bytes_for_peers_only():
    ctx = make_context(cluster=_ClusterStandIn())
    writer = session(ctx)
    writer.set_scope(IdentityScope("default", "m", "t", ""))
    run(ctx, writer, "SET", "blk", b"q" * 5000)
    args = ("PEERGET", "default", "m", "t", "", "blk")
    assert isinstance(run(ctx, session(ctx), *args), PeerOnly)
    crc, data = run(ctx, session(ctx, peer=True), *args)
    assert crc == crc32c.crc32c(b"q" * 5000) and value_of(data) == b"q" * 5000
    assert ctx.keyspace.active_pins == 0
    assert run(ctx, session(ctx, peer=True), "PEERGET", "default", "m", "t", "", "gone") is None
    assert ctx.cluster.stats["peer_gets_served"] == 2


def test_replies_that_wait_are_pending_values(ctx, c):
    """A GET of a value only on a lower tier answers Pending: the server awaits it in order."""

    class LowerStandIn:
        tier = CacheTier.SSD
        active = True

        async def _read(self):
            return b"from below"

        def read(self, entry):
            return self._read()

    ks = ctx.keyspace
    ks.lower_tier = LowerStandIn()
    entry = type("Entry", (), {"length": 10, "crc": 0, "pins": 0, "expire": 0})()
    ks.adopt(c.tag + b"k", entry)
    reply = run(ctx, c, "GET", "k")
    assert isinstance(reply, Pending)
    assert asyncio.run(reply.awaitable) == b"from below"
    assert run(ctx, c, "LOCATE", "k")[0][0][b"tier"] == b"ssd"
