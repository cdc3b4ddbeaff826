"""MULTI/EXEC inside the node (issue 25): what WATCH learns from the keyspace, and how an EXEC
whose queued command waits holds every other client, driven without sockets.

The keyspace tests run real commands through the real table on a real keyspace and check
which changes a watching connection sees. The server-loop tests use test_server_loop.py's
stand-in transport; a command whose reply waits on a gate the test opens stands for a read
of the SSD or a peer (the black-box tests read the real SSD tier).
"""

from __future__ import annotations

import asyncio

from handler_context import make_context, session
from quilld.model import Pending
from quilld.protocol.resp import OK
from quilld.tiers.expiry import now_ms
from test_server_loop import LARGE, _cmd, connect, feed


def run(ctx, s, *args):
    return ctx.table.dispatch(s, [a if isinstance(a, bytes) else str(a).encode() for a in args])


def watching(ctx, key: bytes = b"k"):
    """A connection that watches `key` (and a second one to change things with)."""
    w, other = session(ctx), session(ctx)
    assert run(ctx, w, "WATCH", key) is OK
    assert not w.cas_dirty
    return w, other


# -- which changes WATCH sees (the keyspace's `touched` hook) ------------------------------------

def test_every_kind_of_write_touches_the_watched_key():
    ctx = make_context(pages=256)
    big = b"b" * 20_000  # an arena block, written in place by SETRANGE
    for setup, change in [
        ((), ("SET", "k", "v")),
        (("SET", "k", "v"), ("DEL", "k")),
        (("SET", "k", "v"), ("EXPIRE", "k", "100")),
        (("SET", "k", "v", "EX", "100"), ("PERSIST", "k")),
        (("SET", "k", big), ("SETRANGE", "k", "3", "xyz")),  # in place: no publish
        (("SET", "k", "v"), ("APPEND", "k", "w")),
        (("SET", "k", "v"), ("RENAME", "k", "k2")),  # renamed away
        (("SET", "src", "v"), ("RENAME", "src", "k")),  # renamed onto it
        (("SET", "src", "v"), ("COPY", "src", "k")),
        (("SET", "k", "v"), ("FLUSHALL",)),
        (("SET", "k", "1"), ("INCR", "k")),
        (("SET", "k", "v"), ("GETDEL", "k")),
        (("SET", "k", "v"), ("SETBIT", "k", "0", "1")),
    ]:
        if setup:
            run(ctx, session(ctx), *setup)
        w, other = watching(ctx)
        run(ctx, other, *change)
        assert w.cas_dirty, (setup, change)
        assert w.watched is None  # a touched connection watches nothing more (redis's unwatchAllKeys)
        run(ctx, w, "UNWATCH")
        run(ctx, other, "FLUSHALL")


def test_reads_and_failed_writes_do_not_touch():
    ctx = make_context(pages=256)
    run(ctx, session(ctx), "SET", "k", "v")
    w, other = watching(ctx)
    for cmd in (("GET", "k"), ("EXISTS", "k"), ("SETNX", "k", "x"), ("SET", "k", "x", "NX"), ("TTL", "k"),
                ("DEL", "missing"), ("PERSIST", "k"), ("STRLEN", "k"), ("SET", "other", "v"),
                ("SETRANGE", "k", "0", "")):
        run(ctx, other, *cmd)
        assert not w.cas_dirty, cmd
    assert w.watched is not None


def test_expiry_touches_once_the_key_is_reclaimed_by_a_read_or_the_sweep():
    ctx = make_context()
    ks = ctx.keyspace
    for reclaim in ("read", "sweep"):
        run(ctx, session(ctx), "SET", "k", "v", "PX", "100000")
        w, _ = watching(ctx)
        ks.ttls.set(w.tag + b"k", now_ms() - 1)  # time passes: its deadline is behind (no TTL command)
        assert not w.cas_dirty
        if reclaim == "read":
            assert ks.get(w.tag, b"k") is None
        else:
            assert ks.sweep_expired() == 1
        assert w.cas_dirty, reclaim
        run(ctx, w, "UNWATCH")


def test_eviction_touches_the_watched_key():
    ctx = make_context(pages=16)  # 64 KiB of arena, no tier below: eviction loses the value
    run(ctx, session(ctx), "SET", "k", b"v" * 8000)
    w, other = watching(ctx)
    for i in range(20):  # fills the arena: the least recently used (k) goes first
        run(ctx, other, "SET", f"fill{i}", b"f" * 8000)
    assert ctx.keyspace.stats["evictions"] > 0
    assert w.cas_dirty


def test_a_key_is_watched_in_the_scope_it_was_watched_in():
    ctx = make_context()
    w, other = watching(ctx)
    assert run(ctx, other, "SCOPE", "model-b", "tok") is OK
    run(ctx, other, "SET", "k", "v")  # the same name in another identity scope: another key
    assert not w.cas_dirty
    run(ctx, w, "SCOPE", "model-b", "tok")  # the watch stays on the scope it was made in
    run(ctx, session(ctx), "SET", "k", "v")
    assert w.cas_dirty


def test_the_hook_is_off_while_nothing_is_watched():
    ctx = make_context()
    ks = ctx.keyspace
    assert ks.touched is None
    w, _ = watching(ctx)
    assert ks.touched is not None
    run(ctx, w, "UNWATCH")
    assert ks.touched is None and ctx.clients.watches.keys == {}
    w, _ = watching(ctx)
    w.close()  # a connection's end forgets its watches
    assert ks.touched is None and ctx.clients.watches.keys == {}


def test_scope_inside_multi_applies_from_the_next_command():
    ctx = make_context()
    s = session(ctx)
    for cmd in (("MULTI",), ("SET", "k", "default"), ("SCOPE", "m", "t"), ("SET", "k", "scoped"), ("GET", "k")):
        run(ctx, s, *cmd)
    assert run(ctx, s, "EXEC") == [OK, OK, OK, b"scoped"]
    assert run(ctx, s, "GET", "k") == b"scoped"
    assert run(ctx, session(ctx), "GET", "k") == b"default"


# -- the server loop: an EXEC that waits holds the node ------------------------------------------

def _gated(ctx):
    """A command `SLOW` whose reply waits until the returned gate opens; `ended` lists how each
    of its waits ended ("done" or "cancelled")."""
    gate, ended = asyncio.Event(), []

    async def slow():
        try:
            await gate.wait()
            ended.append("done")
            return b"late"
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    ctx.table.add("slow", 1, "", lambda c, a: Pending(slow()))
    return gate, ended


async def _until(predicate, steps: int = 2000):
    for _ in range(steps):
        if predicate():
            return True
        await asyncio.sleep(0.001)
    return predicate()


def test_an_exec_that_waits_holds_every_other_client_until_it_is_over():
    async def main():
        ctx, a, ta = connect()
        gate, _ = _gated(ctx)
        _, b, tb = connect(ctx)
        feed(a, _cmd("SET", "k", "old") + _cmd("MULTI") + _cmd("SLOW") + _cmd("GET", "k") + _cmd("EXEC"))
        assert bytes(ta.out) == b"+OK\r\n+OK\r\n+QUEUED\r\n+QUEUED\r\n"  # EXEC waits on SLOW
        feed(b, _cmd("SET", "k", "new") + _cmd("GET", "k"))
        await asyncio.sleep(0.01)
        assert bytes(tb.out) == b"" and tb.paused  # held: it would have run between SLOW and GET
        assert ctx.clients.stats["exec_holds"] == 1
        gate.set()
        assert await _until(lambda: tb.out)
        assert bytes(ta.out).endswith(b"*2\r\n$4\r\nlate\r\n$3\r\nold\r\n")
        assert bytes(tb.out) == b"+OK\r\n$3\r\nnew\r\n" and not tb.paused
        assert ctx.clients.exclusive is None

    asyncio.run(main())


def test_a_cluster_peer_is_not_held():
    async def main():
        ctx, a, ta = connect()
        gate, _ = _gated(ctx)
        _, p, tp = connect(ctx)
        p.session.peer = True
        feed(a, _cmd("MULTI") + _cmd("SLOW") + _cmd("EXEC"))
        feed(p, b"PING\r\n")
        assert bytes(tp.out) == b"+PONG\r\n"  # two nodes' EXECs never wait for each other
        gate.set()
        assert await _until(lambda: ta.out.endswith(b"$4\r\nlate\r\n"))

    asyncio.run(main())


def test_the_hold_is_bounded_by_exec_hold_ms():
    async def main():
        ctx, a, ta = connect(make_context(exec_hold_ms=30))
        _, ended = _gated(ctx)  # never opens
        _, b, tb = connect(ctx)
        feed(a, _cmd("MULTI") + _cmd("SLOW") + _cmd("PING") + _cmd("SLOW") + _cmd("SET", "k", "v") + _cmd("EXEC"))
        feed(b, b"PING\r\n")
        assert await _until(lambda: tb.out)  # the hold ended at its bound
        replies = bytes(ta.out).split(b"*4\r\n", 1)[1]
        assert replies.startswith(b"-TIMEOUT 'slow' still waited")
        assert replies.count(b"-TIMEOUT") == 2 and b"+PONG\r\n" in replies and replies.endswith(b"+OK\r\n")
        assert ended == ["cancelled", "cancelled"]  # each wait was cancelled, its clean-up run
        assert ctx.clients.stats["exec_hold_timeouts"] == 2
        assert ctx.table.stats["slow"][4] == 2  # counted as failed calls
        assert bytes(tb.out) == b"+PONG\r\n"

    asyncio.run(main())


def test_a_throttled_auth_in_an_exec_never_holds_the_node():
    """Issue 29 item 15: before, MULTI / AUTH nobody wrong / EXEC from a throttled address held
    every other client until the AUTH's delay ended (or exec_hold_ms): another tenant's GETs took
    0.55-1.01 s. Now the EXEC runs on, holds nothing, and only its own reply is sent late."""
    async def main():
        ctx = make_context(requirepass="pw")
        ctx.users._passwords["bob"] = "bpw"
        _, a, ta = connect(ctx)
        _, b, tb = connect(ctx)
        feed(b, _cmd("AUTH", "bob", "bpw") + _cmd("SET", "k", "v"))
        assert bytes(tb.out) == b"+OK\r\n+OK\r\n"
        feed(a, _cmd("AUTH", "pw") + _cmd("AUTH", "nobody", "wrong") * 10)  # past auth_throttle_after
        assert bytes(ta.out).count(b"-WRONGPASS") == 10
        ta.out.clear()
        tb.out.clear()
        t0 = asyncio.get_running_loop().time()
        feed(a, _cmd("MULTI") + _cmd("AUTH", "nobody", "wrong") + _cmd("PING") + _cmd("EXEC"))
        assert bytes(ta.out) == b"+OK\r\n+QUEUED\r\n+QUEUED\r\n"  # the EXEC's reply is late ...
        feed(b, _cmd("GET", "k"))
        assert bytes(tb.out) == b"$1\r\nv\r\n" and not tb.paused  # ... but nobody else waits for it
        assert ctx.clients.exclusive is None and ctx.clients.stats["exec_holds"] == 0
        assert await _until(lambda: ta.out.endswith(b"+PONG\r\n"))
        assert asyncio.get_running_loop().time() - t0 >= 0.04  # the AUTH's 50 ms, for its own client only
        assert bytes(ta.out).endswith(b"*2\r\n-WRONGPASS invalid username-password pair or user is disabled."
                                      b"\r\n+PONG\r\n")
        assert ctx.stats["auth_failures"] == 11 and ctx.table.stats["auth"][4] == 11

    asyncio.run(main())


def test_a_tenants_holds_are_bounded_by_its_budget_a_second():
    """Issue 29 item 15: the hold had no budget, so a client repeating EXECs that wait held the
    node nearly all the time. A tenant earns server.exec_hold_budget_ms of hold a second, saved up
    to exec_hold_ms: once spent, its EXECs' waits are cut off at once and nobody is held."""
    async def main():
        ctx = make_context(exec_hold_ms=60, exec_hold_budget_ms=0)
        _, ended = _gated(ctx)  # never opens
        _, a, ta = connect(ctx)
        _, b, tb = connect(ctx)
        t0 = asyncio.get_running_loop().time()
        feed(a, _cmd("MULTI") + _cmd("SLOW") + _cmd("EXEC"))
        assert await _until(lambda: b"-TIMEOUT" in ta.out)
        assert asyncio.get_running_loop().time() - t0 >= 0.05  # its saved 60 ms
        for _ in range(3):  # spent: each later EXEC is cut off at once, holding nobody for long
            ta.out.clear()
            t1 = asyncio.get_running_loop().time()
            feed(a, _cmd("MULTI") + _cmd("SLOW") + _cmd("EXEC"))
            assert await _until(lambda: b"-TIMEOUT" in ta.out)
            assert asyncio.get_running_loop().time() - t1 < 0.03
        assert ended == ["cancelled"] * 4
        # another tenant has its own savings
        b.session.login("bob")
        t2 = asyncio.get_running_loop().time()
        feed(b, _cmd("MULTI") + _cmd("SLOW") + _cmd("EXEC"))
        assert await _until(lambda: b"-TIMEOUT" in tb.out)
        assert asyncio.get_running_loop().time() - t2 >= 0.05

    asyncio.run(main())


def test_blocks_read_inside_an_exec_stay_pinned_until_sent():
    ctx, conn, t = connect(make_context(pages=1024))
    value = b"v" * LARGE
    feed(conn, _cmd("SET", "a", value) + _cmd("SET", "b", value))
    t.out.clear()
    t.buffered = 1  # the kernel has not taken the reply yet
    feed(conn, _cmd("MULTI") + _cmd("GET", "a") + _cmd("MGET", "a", "b", "nokey") + _cmd("EXEC"))
    assert bytes(t.out).count(value) == 3
    assert ctx.keyspace.active_pins == 3  # the MGET's two inside the EXEC's array included
    t.buffered = 0
    conn.check_drained()
    assert ctx.keyspace.active_pins == 0


def test_a_large_value_queued_keeps_its_block_until_exec_discard_or_the_end():
    ctx, conn, t = connect(make_context(pages=1024))
    ks = ctx.keyspace
    value = bytes(range(256)) * (LARGE // 256)
    for end in (b"EXEC", b"DISCARD", None):
        feed(conn, _cmd("MULTI") + _cmd("SET", "big", value))
        assert ks.reserved_blocks == 1  # received into the arena, kept by the queue
        if end is None:
            conn.connection_lost(None)
        else:
            feed(conn, _cmd(end.decode()))
        assert ks.reserved_blocks == 0, end
        assert ks.block_count == 1  # the EXEC's value, published without a copy; nothing else
    assert ks.get(session(ctx).tag, b"big").view == value


def test_a_large_value_refused_while_queueing_aborts_the_exec():
    async def main():
        ctx, conn, t = connect(make_context(pages=64))  # 256 KiB of arena
        feed(conn, _cmd("MULTI") + _cmd("SET", "ok", "1") + _cmd("SET", "big", b"x" * (1 << 20)) + _cmd("EXEC")
             + _cmd("EXISTS", "ok"))
        assert await _until(lambda: t.out.endswith(b":0\r\n"))
        out = bytes(t.out)
        assert out.startswith(b"+OK\r\n+QUEUED\r\n-OOM ")
        assert out.endswith(b"-EXECABORT Transaction discarded because of previous errors.\r\n:0\r\n")

    asyncio.run(main())


def test_put2phase_data_inside_multi_is_refused_and_lands_nowhere():
    ctx, conn, t = connect(make_context(pages=1024))
    handle = "0123456789abcdef"
    feed(conn, _cmd("PUT2PHASE", "BEGIN", "blk", LARGE, "HANDLE", handle))
    assert bytes(t.out) == b"$16\r\n%s\r\n" % handle.encode()
    t.out.clear()
    feed(conn, _cmd("MULTI") + _cmd("PUT2PHASE", "DATA", handle, 0, b"d" * LARGE) + _cmd("EXEC")
         + _cmd("PUT2PHASE", "COMMIT", handle))
    out = bytes(t.out)
    assert out.startswith(b"+OK\r\n-ERR Command not allowed inside a transaction: PUT2PHASE BEGIN, DATA, COMMIT")
    assert b"-EXECABORT" in out
    assert out.endswith(b"\r\n") and b"-INCOMPLETE" in out.rsplit(b"-EXECABORT", 1)[1]  # the put got none of it


def test_client_pause_write_holds_an_exec_of_writes_queued_before_it():
    async def main():
        ctx, a, ta = connect()
        _, b, tb = connect(ctx)
        feed(a, _cmd("MULTI") + _cmd("SET", "k", "v"))
        feed(b, _cmd("CLIENT", "PAUSE", "100000", "WRITE"))
        ta.out.clear()
        feed(a, _cmd("EXEC"))
        assert bytes(ta.out) == b""  # held, as redis holds an EXEC whose queue may replicate
        _, c, tc = connect(ctx)
        feed(c, _cmd("MULTI") + _cmd("GET", "k") + _cmd("EXEC"))
        assert bytes(tc.out) == b"+OK\r\n+QUEUED\r\n*1\r\n$-1\r\n"  # reads only: runs during the pause
        feed(b, _cmd("CLIENT", "UNPAUSE"))
        assert await _until(lambda: ta.out)
        assert bytes(ta.out) == b"*1\r\n+OK\r\n"

    asyncio.run(main())


def test_a_peers_placement_of_a_watched_key_counts_as_a_change():
    """In a cluster, a key another node places or removes (its directory entry, applied here when
    this node owns the key's bucket) touches the key here: this node reads that copy on a local miss."""
    from quilld.cluster.dir_entries import KEY, TIER_BIT, code_of, key_shard
    from quilld.cluster.dir_link import DirectoryLink
    from quilld.cluster.directory import BATCH, Directory

    class Joined:  # what NodeContext.cluster offers WATCH: the directory's link
        link = None

    joined = Joined()
    ctx = make_context(cluster=joined)
    directory = Directory("me")
    directory.set_members({"me": 1.0, "peer-1": 1.0}, 0.0)  # two nodes: each owns every bucket
    joined.link = DirectoryLink(directory, ctx.scopes, (), {})
    w, _ = watching(ctx, b"blk")
    assert joined.link.touched is not None
    ctag = joined.link.ctag(w.tag)

    def put(seq, key, begin=False):
        eid = ctag + key
        items = [("S",)] if begin else []
        items.append(("P", "peer-1", KEY, eid, key_shard(eid), code_of(TIER_BIT["dram"], 10)))
        assert directory.handle("peer-1", (BATCH, "ep", seq, items), 0.0)[0] == "ok"

    put(1, b"other", begin=True)
    assert not w.cas_dirty
    put(2, b"blk")
    assert w.cas_dirty
    assert joined.link.touched is None  # nothing watched any more: the hook is off


def test_monitor_sees_a_waiting_exec_after_the_commands_it_ran():
    async def main():
        ctx, a, ta = connect()
        gate, _ = _gated(ctx)
        _, m, tm = connect(ctx)
        feed(m, b"MONITOR\r\n")
        feed(a, _cmd("MULTI") + _cmd("SLOW") + _cmd("PING") + _cmd("EXEC"))
        gate.set()
        assert await _until(lambda: b'"EXEC"' in tm.out)
        names = [line.split(b'"')[1] for line in bytes(tm.out).split(b"\r\n")[1:] if line]
        assert names == [b"MULTI", b"SLOW", b"PING", b"EXEC"]  # as redis feeds them

    asyncio.run(main())
