"""CLIENT TRACKING inside the node, driven without sockets: what the tracking table hears from the
keyspace's and the cluster directory's one change hook (shared with WATCH), and where the
messages go. The black-box side (every mode against redis-server, redis-py's cache) is
tests/blackbox/test_tracking.py."""

from __future__ import annotations

from handler_context import make_context
from quilld.protocol.resp import OK
from test_server_loop import _cmd, connect, feed

INVALIDATE_K = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$3\r\nblk\r\n"


def run(ctx, s, *args):
    return ctx.table.dispatch(s, [a if isinstance(a, bytes) else str(a).encode() for a in args])


def _tracking(ctx):
    """A RESP3 connection with tracking on (its stand-in transport collects what it is sent)."""
    _, conn, t = connect(ctx)
    feed(conn, _cmd("HELLO", "3") + _cmd("CLIENT", "TRACKING", "ON"))
    assert t.out.endswith(b"+OK\r\n")
    t.out.clear()
    return conn, t


def test_a_peers_placement_of_a_tracked_key_invalidates_it():
    """In a cluster, a key another node places (its directory entry, applied here when this node
    owns the key's bucket) may have changed: a connection that read it here is told."""
    from quilld.cluster.dir_entries import KEY, TIER_BIT, code_of, key_shard
    from quilld.cluster.dir_link import DirectoryLink
    from quilld.cluster.directory import BATCH, Directory

    class Joined:  # what NodeContext.cluster offers: the directory's link (no peer to read from)
        link = None
        pool_reads = False
        addresses: dict = {}

    joined = Joined()
    ctx = make_context(cluster=joined)
    directory = Directory("me")
    directory.set_members({"me": 1.0, "peer-1": 1.0}, 0.0)  # two nodes: each owns every bucket
    joined.link = DirectoryLink(directory, ctx.scopes, (), {})
    conn, t = _tracking(ctx)
    feed(conn, _cmd("GET", "blk"))
    assert t.out == b"_\r\n"
    t.out.clear()
    assert joined.link.touched is not None
    ctag = joined.link.ctag(conn.session.tag)

    def put(seq, key, begin=False):
        eid = ctag + key
        items = [("S",)] if begin else []
        items.append(("P", "peer-1", KEY, eid, key_shard(eid), code_of(TIER_BIT["dram"], 10)))
        assert directory.handle("peer-1", (BATCH, "ep", seq, items), 0.0)[0] == "ok"

    put(1, b"other", begin=True)
    assert t.out == b""  # a key it never read
    put(2, b"blk")
    assert t.out == INVALIDATE_K
    feed(conn, _cmd("CLIENT", "TRACKING", "OFF"))
    assert joined.link.touched is None and ctx.keyspace.touched is None  # nobody listens: the hooks are off


def test_watch_and_tracking_share_the_one_hook():
    """With WATCH and tracking both on, one change reaches both; either going leaves the other's."""
    ctx = make_context()
    ks = ctx.keyspace
    conn, t = _tracking(ctx)
    feed(conn, _cmd("GET", "blk"))
    t.out.clear()
    tracking_only = ks.touched
    assert tracking_only is not None
    _, wconn, _ = connect(ctx)
    w = wconn.session
    assert run(ctx, w, "WATCH", "blk") is OK
    _, oconn, _ = connect(ctx)
    assert run(ctx, oconn.session, "SET", "blk", "v") is OK
    assert w.cas_dirty and t.out == INVALIDATE_K  # both heard it
    assert ks.touched == tracking_only  # the watcher unwatched on its change: tracking's alone again
    feed(conn, _cmd("CLIENT", "TRACKING", "OFF"))
    assert ks.touched is None
    t.out.clear()
    run(ctx, w, "UNWATCH")
    assert run(ctx, w, "WATCH", "blk") is OK
    assert run(ctx, oconn.session, "SET", "blk", "w") is OK
    assert w.cas_dirty and t.out == b""  # nothing more for the connection that stopped tracking


def test_own_change_is_sent_after_the_reply_even_with_replies_off():
    """The connection that changes a key it tracks gets the message after that command's reply,
    and gets it while its replies are off (redis pushes through CLIENT REPLY OFF)."""
    ctx = make_context()
    conn, t = _tracking(ctx)
    feed(conn, _cmd("GET", "blk") + _cmd("SET", "blk", "v") + _cmd("PING"))
    assert t.out == b"_\r\n+OK\r\n" + INVALIDATE_K + b"+PONG\r\n"
    t.out.clear()
    feed(conn, _cmd("GET", "blk") + _cmd("CLIENT", "REPLY", "OFF") + _cmd("SET", "blk", "w")
         + _cmd("CLIENT", "REPLY", "ON"))
    assert t.out == b"$1\r\nv\r\n" + INVALIDATE_K + b"+OK\r\n"
