"""Client-side caching (CLIENT TRACKING) against a real quilld, as redis 7.0.15 answers it.

The modes' replies and invalidation messages are compared byte for byte with a real
redis-server run through the same steps; what only quilld has (scopes, its tiers' eviction, a
cluster-less expiry sweep) is checked on its own. redis-py's own client-side cache
(`cache_config=CacheConfig()`) is driven against quilld too.
"""

from __future__ import annotations

import re
import socket
import time

import pytest

from tests.conftest import cmd, read_reply, wait_until

# (connection, command, whether the replies name connection ids: those are compared with the ids
# replaced by the names of the connections they belong to). Connections a, b, d, e, f speak
# RESP3 once they said HELLO 3; c stays RESP2 and subscribes to the invalidation channel.
STEPS = [
    ("a", ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "x", "PREFIX", "xy"]),
    ("a", ["CLIENT", "TRACKING", "ON", "PREFIX", "x"]),
    ("a", ["CLIENT", "TRACKING", "ON", "BCAST", "OPTIN"]),
    ("a", ["CLIENT", "TRACKING", "ON", "OPTIN", "OPTOUT"]),
    ("a", ["CLIENT", "TRACKING", "ON", "REDIRECT", "999999"]),
    ("a", ["CLIENT", "TRACKING", "ON", "REDIRECT", "abc"]),
    ("a", ["CLIENT", "TRACKING", "MAYBE"]),
    ("a", ["CLIENT", "TRACKING", "ON", "FOO"]),
    ("a", ["CLIENT", "CACHING", "YES"]),
    ("a", ["CLIENT", "GETREDIR"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    # default mode: every key read, found or not, is sent once when it next changes
    ("a", ["CLIENT", "TRACKING", "ON"]),
    ("a", ["GET", "k1"]),
    ("a", ["MGET", "k2", "k3", "k4"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    ("b", ["SET", "k1", "v"]),
    ("b", ["SET", "k1", "again"]),  # k1 was sent already: not again until it is read again
    ("b", ["MSET", "k2", "v", "k3", "x"]),
    ("b", ["DEL", "k4"]),  # nothing to delete: no change, nothing sent
    ("b", ["APPEND", "k4", "z"]),
    ("a", ["GET", "k1"]),
    ("a", ["SET", "k1", "own"]),  # the connection's own change: after its reply
    ("a", ["GET", "k1"]),
    ("a", ["MULTI"]),
    ("a", ["GET", "m1"]),
    ("a", ["SET", "m1", "v"]),
    ("a", ["EXEC"]),  # the invalidation follows EXEC's reply, not inside it
    ("a", ["GET", "k2"]),
    ("b", ["EXPIRE", "k2", "100"]),
    ("a", ["GET", "k2"]),
    ("b", ["RENAME", "k2", "k9"]),
    ("a", ["GET", "k3"]),
    ("b", ["FLUSHALL"]),  # one message with a null: every key
    ("b", ["SET", "k3", "after the flush"]),  # forgotten by the flush: nothing sent
    ("a", ["CLIENT", "TRACKING", "OFF"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    ("a", ["CLIENT", "GETREDIR"]),
    # BCAST with prefixes: every change of a matching key, gathered per prefix; NOLOOP leaves out
    # the connection's own changes
    ("a", ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "b", "PREFIX", "a", "NOLOOP"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    ("a", ["CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "ab"]),
    ("a", ["CLIENT", "TRACKING", "ON"]),
    ("b", ["MSET", "a1", "1", "b1", "2", "c1", "3"]),
    ("a", ["SET", "a2", "x"]),
    ("a", ["MSET", "a3", "x", "b3", "y"]),
    ("b", ["FLUSHDB"]),
    ("a", ["CLIENT", "TRACKING", "OFF"]),
    # OPTIN: only the reads after CLIENT CACHING yes; OPTOUT: all but those after CLIENT CACHING no
    ("a", ["CLIENT", "TRACKING", "ON", "OPTIN"]),
    ("a", ["CLIENT", "CACHING", "NO"]),
    ("a", ["CLIENT", "CACHING", "YES"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    ("a", ["GET", "k"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    ("a", ["GET", "k2"]),
    ("a", ["CLIENT", "CACHING", "YES"]),
    ("a", ["MULTI"]),
    ("a", ["GET", "t1"]),
    ("a", ["GET", "t2"]),
    ("a", ["EXEC"]),  # CACHING covers the whole transaction
    ("b", ["MSET", "k", "1", "k2", "1", "t1", "1", "t2", "1"]),
    ("a", ["CLIENT", "TRACKING", "OFF"]),
    ("a", ["CLIENT", "TRACKING", "ON", "OPTOUT", "NOLOOP"]),
    ("a", ["CLIENT", "CACHING", "NO"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
    ("a", ["GET", "k"]),
    ("a", ["GET", "k2"]),
    ("a", ["SET", "k2", "z"]),
    ("b", ["SET", "k", "1"]),
    ("b", ["SET", "k2", "1"]),
    ("a", ["CLIENT", "TRACKING", "OFF"]),
    # RESP2: the messages go to a connection subscribed to __redis__:invalidate
    ("c", ["SUBSCRIBE", "__redis__:invalidate"]),
    ("f", ["HELLO", "2"]),
    ("f", ["CLIENT", "TRACKING", "ON", "REDIRECT", "$c"]),
    ("f", ["CLIENT", "GETREDIR"]),
    ("f", ["CLIENT", "TRACKINGINFO"]),
    ("f", ["GET", "r1"]),
    ("b", ["SET", "r1", "v"]),
    ("b", ["FLUSHDB"]),
    ("f", ["CLIENT", "LIST", "TYPE", "pubsub"]),
    ("c", ["GET", "r1"]),  # a RESP2 subscriber runs only the pub/sub commands, PING, QUIT, RESET
    ("c", ["PING"]),
    ("c", ["PING", "hello"]),
    ("c", ["SUBSCRIBE", "__redis__:invalidate"]),
    ("c", ["UNSUBSCRIBE"]),
    ("c", ["PING"]),
    ("c", ["UNSUBSCRIBE"]),
    ("f", ["GET", "r2"]),
    ("b", ["SET", "r2", "v"]),  # c no longer subscribed: nothing is sent anywhere
    # a RESP3 redirect target, and one that has gone
    ("d", ["CLIENT", "TRACKING", "ON", "REDIRECT", "$a"]),
    ("d", ["GET", "z1"]),
    ("b", ["SET", "z1", "1"]),
    ("d", ["CLIENT", "TRACKING", "ON", "REDIRECT", "$e"]),
    ("d", ["GET", "z"]),
    ("e", ["QUIT"]),
    ("b", ["SET", "z", "1"]),
    ("d", ["CLIENT", "TRACKINGINFO"]),
    ("d", ["CLIENT", "LIST", "ID", "$d"]),
    ("a", ["RESET"]),
    ("a", ["CLIENT", "TRACKINGINFO"]),
]
RESP3 = "abdef"


def _run(port: int) -> list[tuple[str, list[str], dict[str, bytes]]]:
    """Each step's command, then what every connection received meanwhile: each is read up to
    the reply of a mark sent after the step (everything sent because of the step has gone out
    before it): an ECHO on a RESP3 connection, a PING on the RESP2 one (a subscriber may PING)."""
    socks = {n: socket.create_connection(("127.0.0.1", port), timeout=10) for n in "abcdef"}
    try:
        ids = {}
        for n, s in socks.items():
            s.sendall(cmd("CLIENT", "ID"))
            ids[n] = str(read_reply(s))
            if n in RESP3:
                s.sendall(cmd("HELLO", "3"))
                read_reply(s)
        closed: set[str] = set()
        in_multi: set[str] = set()
        got_all = []
        for i, (who, args) in enumerate(STEPS):
            args = [ids[a[1:]] if a.startswith("$") else a for a in args]
            socks[who].sendall(cmd(*args))
            got: dict[str, bytes] = {}
            if args[0] == "MULTI":
                in_multi.add(who)
            elif args[0] == "EXEC":
                in_multi.discard(who)
            if args[0] == "QUIT":
                closed.add(who)
                socks[who].settimeout(5)
                got[who] = socks[who].recv(1 << 16)
            for n in [who] + [n for n in socks if n != who]:  # the step's own reply first: it has run then
                s = socks[n]
                if n in closed:
                    continue
                data = bytearray()
                if n in in_multi:  # inside MULTI an ECHO would be queued: the one-line reply (+OK, +QUEUED)
                    while not data.endswith(b"\r\n"):
                        data += s.recv(1 << 16)
                else:
                    # a mark the connection answers once everything the step sent it has gone out: ECHO
                    # on a RESP3 connection; PING on the RESP2 one, which may be a subscriber (answered
                    # as a message then: *2 pong mark) and may not ECHO
                    mark = f"sync-{i}".encode()
                    bulk = b"$%d\r\n%b\r\n" % (len(mark), mark)
                    ends = (b"*2\r\n$4\r\npong\r\n" + bulk, bulk) if n == "c" else (bulk,)
                    s.sendall(cmd("PING", mark) if n == "c" else cmd("ECHO", mark))
                    deadline = time.monotonic() + 10
                    while not data.endswith(ends) and time.monotonic() < deadline:
                        s.settimeout(max(0.05, deadline - time.monotonic()))
                        try:
                            data += s.recv(1 << 16)
                        except socket.timeout:
                            break
                    end = next((e for e in ends if data.endswith(e)), None)
                    assert end is not None, (i, n, bytes(data))
                    data = data[:-len(end)]
                if data:
                    got[n] = _named(bytes(data), ids, args)
            got_all.append((who, args, got))
        return got_all
    finally:
        for s in socks.values():
            s.close()


def _named(data: bytes, ids: dict[str, str], args: list[str]) -> bytes:
    """`data` with each connection's id (where a reply or message names one) and the figures no
    two servers share (addresses, ages, fds, memory) replaced by fixed names."""
    for n, i in ids.items():
        for before in (b"$8\r\nredirect\r\n", b"$21\r\ntracking-redir-broken\r\n", b"$2\r\nid\r\n"):
            data = data.replace(before + b":%s\r\n" % i.encode(), before + b":<%s>\r\n" % n.encode())
        if args[:2] == ["CLIENT", "GETREDIR"] and data == b":%s\r\n" % i.encode():
            data = b":<%s>\r\n" % n.encode()
        data = data.replace(b"id=%s " % i.encode(), b"id=<%s> " % n.encode())
        data = data.replace(b"redir=%s " % i.encode(), b"redir=<%s> " % n.encode())
    if b"addr=" in data:  # a CLIENT LIST line: only the fields tracking decides are compared
        keep = (b"id", b"flags", b"sub", b"redir", b"resp", b"cmd")
        lines = []
        for line in data.split(b"\n"):
            fields = [f for f in line.split(b" ") if f.split(b"=", 1)[0] in keep]
            lines.append(b" ".join(fields))
        data = re.sub(rb"^[$=]\d+\r\n(txt:)?", b"", b"\n".join(lines))
    return data


def test_tracking_modes_answer_as_redis(quilld, redis_server):
    ours, theirs = _run(quilld.port), _run(redis_server)
    diffs = [f"step {i} {who} {' '.join(args)}:\n  quilld {a}\n  redis  {b}"
             for i, ((who, args, a), (_, _, b)) in enumerate(zip(ours, theirs)) if a != b]
    assert not diffs, "\n".join(diffs)
    # and they did say something: the invalidations are there
    assert any(b"invalidate" in got.get("a", b"") for _, _, got in ours)
    assert any(b"__redis__:invalidate" in got.get("c", b"") for _, _, got in ours)


class Resp3:
    """A RESP3 connection that keeps what it read past one reply (a push may share a read with
    a reply); `call` answers the next reply that is not an invalidation, `invalidated` the next
    invalidation's keys (None: every key). Invalidations read meanwhile are kept in order."""

    def __init__(self, port: int) -> None:
        import hiredis

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = hiredis.Reader()
        self.pushes: list = []
        self.call("HELLO", "3")

    def _next(self, timeout: float):
        deadline = time.monotonic() + timeout
        while (reply := self.reader.gets()) is False:
            left = deadline - time.monotonic()
            assert left > 0, f"nothing whole within {timeout} s"
            self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            self.reader.feed(chunk)
        return reply

    def call(self, *args, timeout: float = 10.0):
        self.sock.sendall(cmd(*args))
        while True:
            reply = self._next(timeout)
            if isinstance(reply, list) and reply[:1] == [b"invalidate"]:
                self.pushes.append(reply[1])
            else:
                return reply

    def invalidated(self, timeout: float = 10.0):
        if self.pushes:
            return self.pushes.pop(0)
        msg = self._next(timeout)
        assert isinstance(msg, list) and msg[0] == b"invalidate", msg
        return msg[1]

    def close(self) -> None:
        self.sock.close()


def test_expiry_and_eviction_invalidate(quilld_factory):
    """A key that expires (the sweep reclaims it, nobody reads it) or is evicted to make room is
    sent to the connection that read it, as redis sends it (signalModifiedKey in both)."""
    q = quilld_factory("--dram", "8MiB")
    t, w = Resp3(q.port), q.client()
    w.set("short", "v", px=150)
    t.call("CLIENT", "TRACKING", "ON")
    assert t.call("GET", "short") == b"v"
    assert t.invalidated() == [b"short"]  # the sweep, with no command naming the key
    w.set("cold", b"x" * 200_000)
    assert t.call("GET", "cold") == b"x" * 200_000
    for i in range(200):  # far more than the 8 MiB arena holds: the least recently used go first
        w.set(f"filler-{i}", b"y" * 200_000)
    assert t.invalidated() == [b"cold"]
    assert w.exists("cold") == 0
    t.close()


def test_scopes_are_tracked_apart(quilld):
    """Tracking is per identity scope: a write in another scope to a key of the same name is no
    change of the key a connection read, and a BCAST connection hears only its own scope's keys."""
    t, bc, w = Resp3(quilld.port), Resp3(quilld.port), quilld.client()
    for s in (t, bc):
        assert s.call("SCOPE", "model-a", "tok") == b"OK"
    t.call("CLIENT", "TRACKING", "ON")
    bc.call("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "k")
    t.call("GET", "k")
    w.execute_command("SCOPE", "model-b", "tok")
    w.set("k", "other scope")  # same name, another scope: nothing is sent to either
    w.execute_command("SCOPE", "model-a", "tok")
    w.set("k", "this scope")
    assert t.invalidated() == [b"k"]
    assert bc.invalidated() == [b"k"]  # the first message: the other scope's write sent nothing
    for s in (t, bc):
        assert s.call("PING") == b"PONG" and not s.pushes  # and nothing else came
        s.close()


def test_table_is_bounded(quilld):
    """tracking-table-max-keys bounds the table (CONFIG GET/SET); the keys it forgets are sent to
    their readers as if changed, so no cached copy outlives what the node remembers."""
    r, t = quilld.client(), Resp3(quilld.port)
    assert r.config_get("tracking-table-max-keys") == {"tracking-table-max-keys": "1000000"}
    assert r.config_set("tracking-table-max-keys", 10)
    assert r.config_get("tracking-table-max-keys") == {"tracking-table-max-keys": "10"}
    t.call("CLIENT", "TRACKING", "ON")
    t.sock.sendall(b"".join(cmd("GET", f"key-{i}") for i in range(30)))
    replies, forgotten = 0, []
    while replies < 30 or len(forgotten) < 20:
        msg = t._next(10)
        if isinstance(msg, list) and msg[:1] == [b"invalidate"]:
            forgotten += msg[1]
        else:
            replies += 1
    assert forgotten == [f"key-{i}".encode() for i in range(20)]  # the oldest first
    stats = r.info("stats")
    assert stats["tracking_total_keys"] == 10 and stats["tracking_total_items"] == 10
    assert r.info("clients")["tracking_clients"] == 1
    r.set("key-25", "changed")
    assert t.invalidated() == [b"key-25"]  # still tracked
    assert r.config_set("tracking-table-max-keys", 0)  # no bound
    t.close()


def test_watch_and_tracking_hear_the_same_changes(quilld):
    """WATCH and tracking share the keyspace's one change hook: with both on, a write fails the
    watcher's EXEC and invalidates the tracker; with tracking off again WATCH still works."""
    t, w, other = Resp3(quilld.port), quilld.client(), quilld.client()
    t.call("CLIENT", "TRACKING", "ON")
    t.call("GET", "k")
    with w.pipeline() as p:
        p.watch("k")
        other.set("k", "1")
        p.multi()
        p.get("k")
        with pytest.raises(Exception, match="Watched variable changed"):
            p.execute()
    assert t.invalidated() == [b"k"]
    t.call("CLIENT", "TRACKING", "OFF")
    with w.pipeline() as p:
        p.watch("k")
        other.set("k", "2")
        p.multi()
        p.get("k")
        with pytest.raises(Exception, match="Watched variable changed"):
            p.execute()
    t.close()


def test_redis_py_client_side_cache(quilld, monkeypatch):
    """redis-py's own client-side cache against quilld: reads are served from the cache until
    another client changes the key, then read again from the node."""
    import redis
    import redis.connection
    from redis.cache import CacheConfig

    # redis-py refuses caching below server version 7.4 (a vendor gate: quilld answers as redis
    # 7.0.15, whose tracking it implements); lowered here, nothing else about the client changes
    monkeypatch.setattr(redis.connection.CacheProxyConnection, "MIN_ALLOWED_VERSION", "7.0.0")
    cached = redis.Redis(host="127.0.0.1", port=quilld.port, protocol=3, cache_config=CacheConfig(),
                         socket_timeout=10)
    other = quilld.client()
    other.set("k", "v1")
    assert cached.get("k") == b"v1"
    calls = other.info("commandstats")["cmdstat_get"]["calls"]
    for _ in range(5):
        assert cached.get("k") == b"v1"  # from the cache: the node sees no GET
    assert other.info("commandstats")["cmdstat_get"]["calls"] == calls
    other.set("k", "v2")
    assert wait_until(lambda: cached.get("k") == b"v2", timeout=10)
    other.flushall()
    assert wait_until(lambda: cached.get("k") is None, timeout=10)
    cached.close()


def test_unread_messages_close_the_connection(quilld_factory):
    """A tracking connection that never reads its messages does not grow the node's memory without
    bound: once more than 32 MiB beyond server.client_output_high_water wait for it, it is closed
    (redis closes a pub/sub client past its output limit); the node and other clients go on."""
    q = quilld_factory("--dram", "64MiB", env={"QUILLD_SERVER_CLIENT_OUTPUT_HIGH_WATER": "1MiB"})
    t, w = Resp3(q.port), q.client()
    t.call("CLIENT", "TRACKING", "ON")
    names = [b"%06d" % i + b"k" * 100_000 for i in range(500)]  # 50 MB of invalidations once all change
    t.sock.sendall(b"".join(cmd("GET", n) for n in names))
    for _ in names:
        assert t._next(30) is None
    with w.pipeline(transaction=False) as p:  # t reads nothing from here on
        for n in names:
            p.set(n, "changed")
        p.execute()
    assert wait_until(lambda: len(w.client_list()) == 1, timeout=30)  # t is gone, the writer is not
    assert "does not read its invalidation messages" in q.log()
    assert w.ping()
    t.sock.settimeout(10)
    got = 0
    try:
        while chunk := t.sock.recv(1 << 20):
            got += len(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    assert got < len(names) * 100_000  # not everything was sent: it was closed first
    t.close()


def test_bcast_prefixes_are_bounded_per_connection(quilld):
    """One connection's BCAST prefixes are matched against every change of its scope: at most
    1024 of them (redis has no bound), a CLIENT TRACKING that would pass it is refused whole."""
    t, w = Resp3(quilld.port), quilld.client()
    args = ["CLIENT", "TRACKING", "ON", "BCAST"]
    for i in range(1024):
        args += ["PREFIX", f"p{i:04d}:"]
    assert t.call(*args) == b"OK"
    refused = t.call("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "q:")
    assert isinstance(refused, Exception) and "at most 1024 BCAST prefixes" in str(refused), refused
    assert len(t.call("CLIENT", "TRACKINGINFO")[b"prefixes"]) == 1024
    w.set("p0500:x", "1")
    assert t.invalidated() == [b"p0500:x"]
    t.close()
