"""MULTI, EXEC, DISCARD, WATCH and UNWATCH against redis-server 7.0.15, byte for byte (issue 25).

Each script is a sequence of (connection, command) steps run on raw sockets, one reply read
before the next step is sent, on quilld and on redis-server; every reply is compared byte for
byte, in RESP2 and in RESP3. Then redis-py's calling patterns (its default transactional
`pipeline()`, `transaction()` with a watched key changed by another client, WATCH through a
pipeline) are run against both and their results compared. CLIENT LIST's flags and INFO's
command and error statistics are compared field by field.
"""

from __future__ import annotations

import re
import socket
import time

import pytest
import redis

from quillwire.encode import encode_command

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module


def _skip(buf: bytes, pos: int) -> int:
    """The end of the reply at `pos` in `buf`; IndexError/ValueError while it is incomplete."""
    kind = buf[pos:pos + 1]
    end = buf.index(b"\r\n", pos)
    if kind in (b"$", b"=", b"!"):
        n = int(buf[pos + 1:end])
        if n >= 0 and len(buf) < end + 2 + n + 2:
            raise IndexError("incomplete bulk")
        return end + 2 if n < 0 else end + 2 + n + 2
    if kind in (b"*", b"~", b">", b"%", b"|"):
        n = int(buf[pos + 1:end])
        pos = end + 2
        for _ in range(max(n, 0) * (2 if kind in (b"%", b"|") else 1)):
            pos = _skip(buf, pos)
        return pos
    if not kind:
        raise IndexError("nothing yet")
    return end + 2


class Conns:
    """Raw connections to one server; `run(i, *cmd)` sends on connection i and returns its whole
    raw reply (an attribute frame before it included)."""

    def __init__(self, port: int, n: int, resp3: bool) -> None:
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
        self.bufs = [b""] * n
        if resp3:
            for i in range(n):
                self.run(i, "HELLO", "3")

    def run(self, i: int, *cmd) -> bytes:
        self.socks[i].sendall(encode_command(*cmd))
        deadline = time.monotonic() + 10
        while True:
            buf = self.bufs[i]
            try:
                end = _skip(buf, 0)
                self.bufs[i] = buf[end:]
                return buf[:end]
            except (IndexError, ValueError):
                pass
            assert time.monotonic() < deadline, f"no whole reply to {cmd} within 10 s: {buf!r}"
            data = self.socks[i].recv(1 << 20)
            assert data, f"connection {i} closed after {cmd}: {buf!r}"
            self.bufs[i] += data

    def close(self) -> None:
        for s in self.socks:
            s.close()


def run_steps(port: int, steps, resp3: bool) -> list[bytes]:
    n = 1 + max(i for i, *_ in steps)
    conns = Conns(port, n, resp3)
    try:
        return [conns.run(i, *cmd) for i, *cmd in steps]
    finally:
        conns.close()


def on(i: int, *lines: str):
    """Steps on connection `i`, one command a line (arguments split on spaces)."""
    return [(i, *line.split()) for line in lines]


SCRIPTS = {
    "basics": on(0, "SET a 1", "MULTI", "INCR a", "GET a", "SET b x", "GET b", "MGET a b nokey", "EXEC", "GET a",
                 "MULTI", "EXEC", "EXEC", "DISCARD", "MULTI", "DISCARD", "DISCARD", "PING"),
    "nesting and watch in multi": on(0, "MULTI", "MULTI", "WATCH a", "SET a 2", "EXEC", "GET a"),
    "errors while queueing abort": on(0, "SET a 1", "MULTI", "SET a 2", "NOSUCHCOMMAND x y", "SET b", "GET", "EXEC",
                                      "GET a", "MULTI", "PING", "EXEC", "MULTI", "SET a 3", "CLIENT NOSUCH",
                                      "EXEC"),
    "runtime errors do not abort": on(0, "SET s notanumber", "MULTI", "INCR s", "SET a 5 NX XX", "SET a 6",
                                      "EXPIRE a abc", "GETRANGE s 0 2", "INCRBYFLOAT s 1", "EXEC", "GET a"),
    "exec with arguments": on(0, "EXEC x", "MULTI", "SET a 1", "EXEC x", "EXEC", "GET a", "DISCARD x",
                              "MULTI", "DISCARD x", "EXEC", "MULTI x", "UNWATCH x", "WATCH"),
    "keys and ttls inside": on(0, "MULTI", "SET t v EX 100", "TTL t", "PERSIST t", "TTL t", "GETDEL t", "EXISTS t",
                               "SETEX u 100 w", "GETEX u PERSIST", "TTL u", "RENAME u r", "COPY r c", "MSET m1 1 m2 2",
                               "MSETNX m1 x m3 y", "DEL m1 m2 c", "STRLEN r", "APPEND r !", "SETRANGE r 0 W",
                               "GET r", "DBSIZE", "EXEC"),
    "connection commands inside": on(0, "MULTI", "PING", "PING hi", "ECHO e", "SELECT 0", "CLIENT SETNAME txn",
                                     "CLIENT GETNAME", "MONITOR", "EXEC", "CLIENT GETNAME"),
    "protocol switched inside": on(0, "MULTI", "HELLO 3", "GET nokey", "SET k v", "HELLO 2", "GET nokey", "EXEC",
                                   "MULTI", "HELLO 2", "GET nokey", "EXEC"),
    "reset and quit end it": on(0, "SET a 1", "WATCH a", "MULTI", "SET a 2", "RESET", "EXEC", "GET a", "MULTI",
                                "SET a 3", "QUIT"),
    "flushall inside": on(0, "MSET a 1 b 2", "MULTI", "FLUSHALL", "DBSIZE", "SET a 9", "EXEC", "MGET a b"),
    "watched key changed": [
        *on(0, "SET x 30", "WATCH x"), *on(1, "SET x 40"), *on(0, "MULTI", "PING", "EXEC", "GET x"),
        *on(0, "WATCH x"), *on(1, "SET y 1"), *on(0, "MULTI", "INCR x", "EXEC"),
        *on(0, "WATCH a b x k z"), *on(1, "SET x 1"), *on(0, "MULTI", "PING", "EXEC"),
        *on(0, "WATCH x"), *on(0, "SET x 10"), *on(0, "MULTI", "INCR x", "EXEC"),  # its own change counts too
        *on(0, "WATCH x"), *on(1, "SET x 30"), *on(0, "UNWATCH", "MULTI", "PING", "EXEC"),
        *on(0, "WATCH x"), *on(1, "SET x 30"), *on(0, "MULTI", "DISCARD", "MULTI", "INCR x", "EXEC"),
    ],
    "what counts as a change": [
        step for cmd in ("SET x v", "SET x same", "DEL x", "EXPIRE x 100", "PEXPIREAT x 99999999999999",
                         "PERSIST x", "APPEND x !", "SETRANGE x 0 Z", "INCR n", "INCRBYFLOAT n 1.5", "GETDEL x",
                         "GETEX x PX 100000", "GETEX x PERSIST", "RENAME x x2", "RENAME x2 x", "COPY c x REPLACE",
                         "MSET x 1 o 2", "SETBIT x 0 1", "BITOP NOT x c", "GETSET x g", "UNLINK x",
                         "FLUSHALL", "FLUSHDB")
        for step in [*on(1, "SET x same", "SET n 5", "SET c copy", "PERSIST x"), *on(0, "WATCH x n"),
                     (1, *cmd.split()), *on(0, "MULTI", "PING", "EXEC")]
    ],
    "what does not count": [
        step for cmd in ("GET x", "EXISTS x", "SETNX x other", "SET x other NX", "DEL nokey", "PERSIST x",
                         "EXPIRE nokey 10", "RENAME nokey y", "TTL x", "GETRANGE x 0 1", "STRLEN x", "MGET x",
                         "SET y 1", "INCR cnt", "GETDEL nokey", "COPY nokey x REPLACE", "TOUCH x")
        for step in [*on(1, "SET x same", "PERSIST x"), *on(0, "WATCH x nokey"), (1, *cmd.split()),
                     *on(0, "MULTI", "PING", "EXEC")]
    ],
    "append of nothing": [  # changes nothing, yet redis counts it
        *on(1, "SET x v"), *on(0, "WATCH x"), (1, "APPEND", "x", ""), *on(0, "MULTI", "PING", "EXEC"),
        *on(0, "WATCH x"), (1, "SETRANGE", "x", "0", ""), *on(0, "MULTI", "PING", "EXEC"),  # ... and this not
    ],
    "bit writes that change nothing": [  # redis counts SETBIT and BITFIELD only when a bit changes (issue 29.10)
        step for cmd in ("SETBIT b 0 0", "SETBIT b 7 0", "BITFIELD b SET u8 0 0", "BITFIELD b INCRBY u8 0 0",
                         "BITFIELD b OVERFLOW FAIL INCRBY u8 0 -1", "BITFIELD b SET i4 4 0 GET u8 0",
                         "BITFIELD b OVERFLOW SAT INCRBY u8 0 -1", "BITFIELD b SET u8 0 0 SET u8 0 1",
                         "SETBIT b 0 1", "SETBIT b 8 0", "BITFIELD b SET u8 8 0", "BITFIELD b SET u4 0 1",
                         "BITFIELD b INCRBY i8 0 1", "SETBIT new 0 0")
        for step in [*on(1, "DEL new"), (1, "SET", "b", "\x00"), *on(0, "WATCH b new"), (1, *cmd.split()),
                     *on(0, "MULTI", "PING", "EXEC", "GET b")]
    ],
    "bit writes that change nothing, in an arena block": [
        step for cmd in ("SETBIT b 9 0", "BITFIELD b SET u8 16 0", "SETBIT b 9 1")
        for step in [(1, "SET", "b", "\x00" * 70000), *on(0, "WATCH b"), (1, *cmd.split()),
                     *on(0, "MULTI", "PING", "EXEC", "STRLEN b", "GETBIT b 9")]
    ],
    "watch a missing key": [
        *on(0, "DEL x", "WATCH x"), *on(1, "DEL x", "FLUSHALL"), *on(0, "MULTI", "PING", "EXEC"),
        *on(0, "WATCH x"), *on(1, "SET x 1"), *on(0, "MULTI", "PING", "EXEC"),
    ],
    "watched by two": [
        *on(0, "SET x 1", "WATCH x"), *on(1, "WATCH x"), *on(1, "MULTI", "INCR x", "EXEC"),
        *on(0, "MULTI", "INCR x", "EXEC", "GET x"),
    ],
    "exec write touches other watchers": [
        *on(0, "WATCH k"), *on(1, "MULTI", "SET k 1", "EXEC"), *on(0, "MULTI", "GET k", "EXEC"),
    ],
    "command info": on(0, "COMMAND INFO multi exec discard watch unwatch", "COMMAND DOCS multi exec discard watch",
                       "COMMAND DOCS unwatch", "COMMAND GETKEYS WATCH a b c", "COMMAND GETKEYSANDFLAGS WATCH a"),
    "watch expiring key": [
        *on(0, "SET x v PX 100000", "WATCH x"), *on(1, "PEXPIRE x 100000"), *on(0, "MULTI", "PING", "EXEC"),
        *on(0, "WATCH x"), *on(0, "MULTI", "PING", "EXEC"),
    ],
}


_HELLO_ID = re.compile(rb"\$2\r\nid\r\n:\d+\r\n")


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_transaction_scripts_match_redis_byte_for_byte(quilld, redis_server, name, resp3):
    steps = SCRIPTS[name]
    theirs = run_steps(redis_server, steps, resp3)
    ours = run_steps(quilld.port, steps, resp3)
    for step, t, o in zip(steps, theirs, ours):
        t, o = _HELLO_ID.sub(b"id:*", t), _HELLO_ID.sub(b"id:*", o)  # connection ids differ by nature
        assert o == t, f"{name}, step {step}: redis answered {t!r}, quilld {o!r}"
    assert len(ours) == len(theirs) == len(steps)


def test_an_expired_key_watched_is_no_change_until_it_lives_again(quilld, redis_server):
    """A key watched after its deadline (not reclaimed yet): reclaiming it is no change, a new value
    is; one that expires after WATCH fails the EXEC (redis's isWatchedKeyExpired)."""
    for port in (quilld.port, redis_server):
        r = redis.Redis(port=port, socket_timeout=10)
        r.set("gone", "v", px=1)
        time.sleep(0.01)  # `gone` is past its deadline (a precondition, not a measurement)
        with r.pipeline() as p:
            p.watch("gone")
            assert r.exists("gone") == 0  # reclaimed by this read: no change of a key already dead
            p.multi()
            p.ping()
            assert p.execute() == [True]
        with r.pipeline() as p:
            p.watch("gone")
            r.set("gone", "back")  # it lives again: a change
            p.multi()
            p.ping()
            with pytest.raises(redis.WatchError):
                p.execute()
        for _ in range(10):  # a loaded machine may let it expire before WATCH: then try again
            with r.pipeline() as p:
                r.set("soon", "v", px=500)
                p.watch("soon")
                if r.pttl("soon") <= 0:
                    continue
                deadline = time.monotonic() + 10
                while r.pttl("soon") > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                p.multi()
                p.ping()
                with pytest.raises(redis.WatchError):  # expired since it was watched
                    p.execute()
                break
        else:
            pytest.fail("the key expired before WATCH every time")
        r.close()


# -- CLIENT LIST and INFO --------------------------------------------------------------------------

def _fields(line: bytes, names: tuple[str, ...]) -> dict[str, str]:
    parts = dict(kv.split("=", 1) for kv in line.decode().split())
    return {n: parts[n] for n in names}


def test_client_list_flags_and_queue_length_match_redis(quilld, redis_server):
    out = {}
    for port in (quilld.port, redis_server):
        a, b = (redis.Redis(port=port, socket_timeout=10, protocol=2) for _ in range(2))
        a_id = a.client_id()
        seen = []
        for step in ("plain", "multi", "queued", "dirty", "dirty+multi", "after"):
            if step == "multi":
                a.execute_command("MULTI")
            elif step == "queued":
                a.execute_command("SET", "q", "1")
                a.execute_command("GET", "q")
            elif step == "dirty":
                a.execute_command("DISCARD")
                a.execute_command("WATCH", "w")
                b.set("w", "changed")
            elif step == "dirty+multi":
                a.execute_command("MULTI")
            elif step == "after":
                a.execute_command("EXEC")
            line = b.execute_command("CLIENT", "LIST", "ID", a_id)
            seen.append(_fields(line, ("flags", "multi")))
        out[port] = seen
        a.close()
        b.close()
    assert out[quilld.port] == out[redis_server], out
    assert [s["flags"] for s in out[quilld.port]] == ["N", "x", "x", "d", "xd", "N"]


def _stats(r) -> dict:
    out = {}
    for section in ("commandstats", "errorstats"):
        for k, v in r.info(section).items():
            out[k] = {f: n for f, n in v.items() if not f.startswith("usec")} if isinstance(v, dict) else v
    out["total_error_replies"] = r.info("stats")["total_error_replies"]
    return out


@pytest.mark.parametrize("scenario", ["failed inside", "rejected inside", "multi stats"])
def test_command_and_error_stats_of_transactions_match_redis(quilld, redis_server, scenario):
    """INFO commandstats and errorstats as redis's unit/info tests count them."""
    got = {}
    for port in (quilld.port, redis_server):
        r = redis.Redis(port=port, socket_timeout=10, protocol=2)
        r.config_resetstat()
        if scenario == "failed inside":  # errorstats: failed call within MULTI/EXEC
            r.execute_command("MULTI")
            r.execute_command("SET", "a", "b")
            r.execute_command("AUTH", "a")
            replies = r.execute_command("EXEC")
            assert isinstance(replies[1], redis.RedisError)
            with pytest.raises(redis.ResponseError, match="EXEC without MULTI"):
                r.execute_command("EXEC")
        elif scenario == "rejected inside":  # errorstats: rejected call within MULTI/EXEC
            r.execute_command("MULTI")
            with pytest.raises(redis.ResponseError):
                r.execute_command("SET")
            with pytest.raises(redis.ResponseError, match="EXECABORT|discarded"):
                r.execute_command("EXEC")
        else:  # command stats for MULTI
            r.execute_command("MULTI")
            r.execute_command("SET", "foo", "bar")
            r.execute_command("EXPIRE", "foo", "0")
            r.execute_command("EXEC")
        stats = _stats(r)
        got[port] = {k: v for k, v in stats.items()
                     if k.split("_", 1)[-1] in ("multi", "exec", "set", "auth", "expire", "ERR", "EXECABORT")
                     or k == "total_error_replies"}
        r.close()
    assert got[quilld.port] == got[redis_server]


# -- redis-py's calling patterns (tests/test_pipeline.py), on both servers ------------------------

def _both(quilld, redis_server, fn, **kw):
    """fn(client) on quilld and on redis-server, each from empty; returns (quilld's, redis's)."""
    out = []
    for port in (quilld.port, redis_server):
        r = redis.Redis(port=port, socket_timeout=10, **kw)
        r.flushall()
        try:
            out.append(fn(r, port))
        finally:
            r.close()
    return out


def _norm(x):
    """Results made comparable: an exception by its class and text."""
    if isinstance(x, Exception):
        return (type(x).__name__, str(x))
    if isinstance(x, list):
        return [_norm(i) for i in x]
    return x


@pytest.mark.parametrize("protocol", [2, 3])
def test_default_pipeline_is_a_transaction_as_against_redis(quilld, redis_server, protocol):
    def batch(r, port):
        with r.pipeline() as pipe:  # transaction=True: MULTI ... EXEC
            pipe.set("a", "a1").get("a").incr("n").incrbyfloat("f", 1.5).mset({"x": 1, "y": 2}).mget("x", "y", "z")
            pipe.expire("a", 100).ttl("a").delete("x").exists("x", "y").getdel("y").strlen("a")
            results = pipe.execute()
        with r.pipeline() as pipe:  # a runtime error: the others still run, the error is raised after
            pipe.set("s", "text").incr("s").set("after", "yes")
            try:
                pipe.execute()
                raised = None
            except redis.ResponseError as e:
                raised = str(e)
        with r.pipeline() as pipe:
            pipe.set("s2", "text").incr("s2").set("after2", "yes")
            kept = pipe.execute(raise_on_error=False)
        with r.pipeline() as pipe:  # an error while queueing: nothing runs
            pipe.set("q", "1").execute_command("NOSUCHCOMMAND").set("q2", "2")
            try:
                pipe.execute()
                aborted = None
            except redis.ResponseError as e:
                aborted = str(e)
        with r.pipeline() as pipe:  # empty
            empty = pipe.execute()
        return _norm([results, raised, r.get("after"), kept, aborted, r.exists("q", "q2"), empty])

    ours, theirs = _both(quilld, redis_server, batch, protocol=protocol)
    assert ours == theirs


@pytest.mark.parametrize("protocol", [2, 3])
def test_transaction_retries_when_another_client_changes_the_watched_key(quilld, redis_server, protocol):
    def run(r, port):
        other = redis.Redis(port=port, socket_timeout=10, protocol=protocol)
        r.set("counter", 10)
        attempts = []

        def incr(pipe):
            value = int(pipe.get("counter"))
            attempts.append(value)
            if len(attempts) == 1:
                other.incrby("counter", 5)  # another client changes it between WATCH and EXEC
            pipe.multi()
            pipe.set("counter", value + 1)
            pipe.get("counter")

        result = r.transaction(incr, "counter")
        other.close()
        return [attempts, result, r.get("counter")]

    ours, theirs = _both(quilld, redis_server, run, protocol=protocol)
    assert ours == theirs == [[10, 15], [True, b"16"], b"16"]


def test_watch_through_a_pipeline_as_against_redis(quilld, redis_server):
    """test_pipeline.py's watch patterns: immediate mode after WATCH, WatchError, UNWATCH, reset."""
    def run(r, port):
        other = redis.Redis(port=port, socket_timeout=10)
        r.set("a", 1)
        r.set("b", 2)
        out = []
        with r.pipeline() as pipe:
            pipe.watch("a", "b")
            out.append(pipe.get("a"))  # immediate while watching
            pipe.multi()
            pipe.get("a").get("b")
            out.append(pipe.execute())
        with r.pipeline() as pipe:
            pipe.watch("a")
            other.set("a", 3)
            pipe.multi()
            pipe.get("a")
            try:
                pipe.execute()
            except redis.WatchError as e:
                out.append(("WatchError", str(e)))
        with r.pipeline() as pipe:
            pipe.watch("a")
            other.set("a", 4)
            pipe.unwatch()
            pipe.multi()
            pipe.get("a")
            out.append(pipe.execute())
        with r.pipeline() as pipe:
            pipe.watch("a")
            pipe.reset()  # UNWATCH: the next transaction ignores changes before it
            other.set("a", 5)
            pipe.multi()
            pipe.get("a")
            out.append(pipe.execute())
        with r.pipeline(transaction=False) as pipe:
            pipe.watch("b")
            other.set("b", 6)
            pipe.multi()
            pipe.get("b")
            try:
                pipe.execute()
            except redis.WatchError as e:
                out.append(("WatchError", str(e)))
        other.close()
        return _norm(out)

    ours, theirs = _both(quilld, redis_server, run)
    assert ours == theirs


def test_large_values_in_a_transaction_as_against_redis(quilld, redis_server):
    """Values received into the arena while queued (SET, MSET) are published by EXEC, read back
    inside the same transaction, and given back when the transaction is discarded."""
    big = bytes(range(256)) * 4096 * 2  # 2 MiB

    def run(r, port):
        with r.pipeline() as pipe:
            pipe.set("big", big).mset({"b1": big[:100_000], "b2": big}).get("big").mget("b1", "b2", "none")
            pipe.strlen("b2").getrange("big", 1000, 1010)
            results = pipe.execute()
        with r.pipeline() as pipe:
            pipe.set("gone", big).execute_command("NOSUCHCOMMAND")
            try:
                pipe.execute()
            except redis.ResponseError:
                pass
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(encode_command("MULTI") + encode_command("SET", "dropped", big))
        sock.close()  # the connection ends with a large value queued
        return [results[0], results[1], results[2] == big, [v == w for v, w in zip(results[3], [big[:100_000], big])],
                results[3][2], results[4], results[5], r.exists("gone", "dropped")]

    ours, theirs = _both(quilld, redis_server, run)
    assert ours == theirs == [True, True, True, [True, True], None, len(big), big[1000:1011], 0]
    with quilld.client() as r:  # nothing the discarded and dropped transactions queued stays reserved
        tiers = r.info("tiers")
        assert tiers["dram_reserved_blocks"] == 0, tiers
