"""Introspection that tells the truth (issue 13, part 3): COMMAND, INFO, CLIENT, CONFIG, SLOWLOG,
LATENCY, MONITOR, RESET, ACL, HELLO before AUTH.

Where redis's reply is deterministic, quilld's is compared byte for byte with a real
redis-server 7.0.15's, in RESP2 and RESP3 (test_compat.run_script); where values differ by
nature (ids, times, addresses, memory) the shape is checked and the values against what
quilld did. Tenants: CLIENT LIST, CLIENT KILL, MONITOR and SLOWLOG show a tenant its own.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
import tomllib

import pytest
import redis

from conftest import read_lines, read_reply, require_tool, start_quilld, start_redis, stop_process, wait_until
from quillwire.encode import encode_command
from test_compat import run_script, split_replies


def _same(redis_port: int, quilld_port: int, script, resp3: bool) -> None:
    theirs = run_script(redis_port, script, resp3)
    ours = run_script(quilld_port, script, resp3)
    assert len(theirs) == len(script), theirs
    for cmd, t, o in zip(script, theirs, ours):
        if o != t:
            at = next(i for i in range(min(len(o), len(t)) + 1) if o[i:i + 1] != t[i:i + 1])
            pytest.fail(f"{cmd}: replies differ at byte {at}: redis {t[max(at - 120, 0):at + 80]!r}, "
                        f"quilld {o[max(at - 120, 0):at + 80]!r}")
    assert len(ours) == len(theirs)


# -- COMMAND ----------------------------------------------------------------------------------
COMMAND_SCRIPT = [
    ("COMMAND", "INFO", "get", "set", "mget", "mset", "del", "exists", "lcs", "bitfield", "bitop", "getex",
     "expire", "rename", "copy", "scan", "keys", "touch", "object|encoding", "memory|usage", "ping", "auth",
     "hello", "client|kill", "client|list", "config|set", "slowlog|get", "latency|latest", "monitor", "info",
     "acl|whoami", "reset", "nosuch", "get|key", "config|get|key"),
    ("COMMAND", "DOCS", "get", "set", "getset", "bitfield", "scan", "expire", "hello", "auth", "client|kill",
     "config|get", "command|docs", "slowlog|get", "latency|reset", "acl|cat", "nosuch"),
    ("COMMAND", "GETKEYS", "get", "key"), ("COMMAND", "GETKEYS", "lcs", "k1", "k2"),
    ("COMMAND", "GETKEYS", "memory", "usage", "key"), ("COMMAND", "GETKEYS", "mset", "a", "1", "b", "2"),
    ("COMMAND", "GETKEYS", "ping"), ("COMMAND", "GETKEYS", "nosuch"), ("COMMAND", "GETKEYS", "get"),
    ("COMMAND", "GETKEYS", "get", "a", "b"), ("COMMAND", "GETKEYS", "del", "a", "b", "c"),
    ("COMMAND", "GETKEYSANDFLAGS", "set", "k1", "v1"), ("COMMAND", "GETKEYSANDFLAGS", "set", "k1", "v1", "get"),
    ("COMMAND", "GETKEYSANDFLAGS", "mset", "k1", "v1", "k2", "v2"),
    ("COMMAND", "GETKEYSANDFLAGS", "bitfield", "k", "get", "u8", "0"),
    ("COMMAND", "GETKEYSANDFLAGS", "bitfield", "k", "set", "u8", "0", "1"),
    ("COMMAND", "GETKEYSANDFLAGS", "copy", "a", "b", "replace"), ("COMMAND", "GETKEYSANDFLAGS", "getdel", "a"),
    ("COMMAND", "HELP"), ("command", "help"), ("COMMAND", "LIST", "bad_arg"),
    ("COMMAND", "LIST", "FILTERBY", "bad_arg"), ("COMMAND", "LIST", "FILTERBY", "bad", "bad2"),
    ("COMMAND", "LIST", "FILTERBY", "ACLCAT", "non_existing_category"),
    ("COMMAND", "LIST", "FILTERBY", "MODULE", "non_existing_module"),
    ("COMMAND", "LIST", "FILTERBY", "PATTERN", "set"), ("COMMAND", "LIST", "FILTERBY", "PATTERN", "non_exists*"),
    ("COMMAND", "FOO"),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_command_replies_match_redis_byte_for_byte(quilld, redis_server, resp3):
    _same(redis_server, quilld.port, COMMAND_SCRIPT, resp3)


def client(port: int, raw: bool = True, **kw) -> redis.Redis:
    """A RESP2 redis-py client; `raw`: replies as they come (no parsing of COMMAND, CLIENT, SLOWLOG ...)."""
    c = redis.Redis(host="127.0.0.1", port=port, protocol=2, socket_timeout=30, **kw)
    if raw:
        c.response_callbacks.clear()
    return c


def _raw(c: redis.Redis) -> redis.Redis:
    """Another client on `c`'s connection pool, without redis-py's reply parsing."""
    r = redis.Redis(connection_pool=c.connection_pool)
    r.response_callbacks.clear()
    return r


def _pairs(reply) -> dict:
    """A map reply as a dict, whichever protocol the client speaks."""
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))


def test_every_command_is_described_and_listed(quilld, redis_server):
    q, r = client(quilld.port), client(redis_server)
    names = [n.decode() for n in q.execute_command("COMMAND", "LIST")]
    assert {"set", "client|list", "config|rewrite", "put2phase", "getblk", "locate", "route", "scope",
            "slowlog|get", "latency|doctor", "monitor", "reset", "acl|cat"} <= set(names)
    assert q.execute_command("COMMAND", "COUNT") == len([n for n in names if "|" not in n])
    docs = _pairs(q.execute_command("COMMAND", "DOCS"))
    infos = {i[0].decode(): i for i in q.execute_command("COMMAND", "INFO")}
    assert set(infos) == {n for n in names if "|" not in n}
    for name in names:
        fields = _pairs(docs[name.split("|")[0].encode()])
        if "|" in name:
            fields = _pairs(_pairs(fields[b"subcommands"])[name.encode()])
        assert fields[b"summary"] and fields[b"since"] and fields[b"group"], name
    # redis's own commands are described exactly as redis describes them (flags, categories, keys)
    shared = [n for n in names if "|" not in n and r.execute_command("COMMAND", "INFO", n)[0] is not None]
    assert len(shared) > 60
    theirs = r.execute_command("COMMAND", "INFO", *shared)
    ours = q.execute_command("COMMAND", "INFO", *shared)
    for t, o in zip(theirs, ours):
        assert o[:9] == t[:9], o[0]
    # quilld's own: in the same terms, with key specs where they take keys
    getblk, locate, put2phase, scope = q.execute_command("COMMAND", "INFO", "getblk", "locate", "put2phase", "scope")
    assert getblk[1:6] == [-2, [b"readonly", b"fast"], 1, 1, 1] and b"@read" in getblk[6]
    assert locate[3:6] == [1, -1, 1]
    assert put2phase[2] == [b"write", b"denyoom", b"no_mandatory_keys", b"movablekeys"]  # DATA names no key
    assert scope[6] == [b"@fast", b"@connection"]
    assert q.execute_command("COMMAND", "GETKEYS", "put2phase", "BEGIN", "k", "10") == [b"k"]
    assert q.execute_command("COMMAND", "GETKEYS", "put2phase", "DATA", "h", "0", "x") == []
    assert q.execute_command("COMMAND", "GETKEYS", "put2phase", "PUT", "k", "CRC32C", "1", "x") == [b"k"]
    assert q.execute_command("COMMAND", "GETKEYS", "put2phase", "DATA", "h", "0", "BEGIN") == []
    aclcat = q.execute_command("COMMAND", "LIST", "FILTERBY", "ACLCAT", "dangerous")
    assert b"client|kill" in aclcat and b"get" not in aclcat
    pattern = q.execute_command("COMMAND", "LIST", "FILTERBY", "PATTERN", "config|*re*")
    assert sorted(pattern) == [b"config|resetstat", b"config|rewrite"]


# -- INFO -------------------------------------------------------------------------------------
def _info(c: redis.Redis, *sections) -> str:
    text = _raw(c).execute_command("INFO", *sections)
    return text if isinstance(text, str) else text.decode()


def _fields(text: str) -> dict[str, str]:
    return dict(line.split(":", 1) for line in text.split("\r\n") if line and not line.startswith("#"))


def _titles(text: str) -> list[str]:
    return [line[2:] for line in text.split("\r\n") if line.startswith("# ")]


def test_info_sections_and_fields_follow_redis(quilld, redis_server):
    q, r = client(quilld.port), client(redis_server)
    q.set("a", "1")
    q.set("b", "2", ex=100)
    theirs, ours = _info(r, "everything"), _info(q, "everything")
    assert _titles(ours)[:13] == _titles(theirs)[:13] == [
        "Server", "Clients", "Memory", "Persistence", "Stats", "Replication", "CPU", "Modules", "Commandstats",
        "Errorstats", "Latencystats", "Cluster", "Keyspace"]
    assert _titles(ours)[13:] == ["Tiers", "Shm", "Router", "Gateway"]
    # every field redis has in these sections, quilld has too, in redis's order
    for section in ("server", "clients", "memory", "persistence", "stats", "replication", "cpu"):
        t, o = list(_fields(_info(r, section))), list(_fields(_info(q, section)))
        missing = [f for f in t if f not in o and f not in ("total_reads_processed", "total_writes_processed",
                                                            "reply_buffer_shrinks", "reply_buffer_expands")]
        assert not missing, (section, missing)
        assert [f for f in o if f in t] == [f for f in t if f in o], section
    f = _fields(ours)
    assert f["redis_version"] == "7.0.15" and re.fullmatch(r"[0-9a-f]{40}", f["run_id"])
    assert f["hz"] == "20" and f["executable"] and f["tcp_port"] == str(quilld.port)
    assert f["loading"] == "0" and f["mem_allocator"] and int(f["used_memory"]) > 0
    assert f["maxmemory"] == "0" and f["role"] == "master" and f["db0"].startswith("keys=2,expires=1")
    assert float(f["used_cpu_user"]) > 0 and f["dram_capacity"] == str(256 << 20)
    assert re.fullmatch(r"calls=2,usec=\d+,usec_per_call=\d+\.\d\d,rejected_calls=0,failed_calls=0", f["cmdstat_set"])
    assert re.fullmatch(r"p50=\d+\.\d{3},p99=\d+\.\d{3},p99\.9=\d+\.\d{3}", f["latency_percentiles_usec_set"])
    # default, all, several sections, any case
    default = _info(q)
    assert "rejected_calls" not in default and "Errorstats" in _titles(default) and "Tiers" in _titles(default)
    assert "rejected_calls" in _info(q, "all")
    several = _titles(_info(q, "cpu", "commandSTATS", "tiers"))
    assert several == ["CPU", "Commandstats", "Tiers"]
    assert _titles(_info(q, "cpu", "default")).count("CPU") == 1


def test_commandstats_and_errorstats_count_what_happened(quilld):
    q = client(quilld.port)
    q.config_resetstat()
    q.set("foo", "bar")
    with pytest.raises(redis.ResponseError):
        q.execute_command("GET")  # rejected: arity
    with pytest.raises(redis.ResponseError):
        q.execute_command("INCR", "foo")  # failed: not an integer
    with pytest.raises(redis.ResponseError):
        q.execute_command("NOSUCH")
    for _ in range(40):
        q.get("foo")  # the fast path: counted every time, timed the first call and one in 64
    f = _fields(_info(q, "commandstats", "errorstats", "stats"))
    assert f["cmdstat_get"].startswith("calls=40,") and f["cmdstat_get"].endswith(",rejected_calls=1,failed_calls=0")
    assert f["cmdstat_incr"].endswith("rejected_calls=0,failed_calls=1")
    assert f["errorstat_ERR"] == "count=3" and f["total_error_replies"] == "3"
    assert int(re.search(r"usec=(\d+)", f["cmdstat_get"]).group(1)) > 0


# -- CLIENT -----------------------------------------------------------------------------------
CLIENT_SCRIPT = [
    ("CLIENT", "KILL"), ("CLIENT", "KILL", "id", "10", "wrong_arg"), ("CLIENT", "KILL", "id", "str"),
    ("CLIENT", "KILL", "id", "-1"), ("CLIENT", "KILL", "id", "0"), ("CLIENT", "KILL", "type", "wrong_type"),
    ("CLIENT", "KILL", "user", "wrong_user"), ("CLIENT", "KILL", "skipme", "yes_or_no"),
    ("CLIENT", "KILL", "1.2.3.4:5"), ("CLIENT", "KILL", "id", "999999"), ("CLIENT", "KILL", "type", "pubsub"),
    ("CLIENT", "LIST", "TYPE", "x"), ("CLIENT", "LIST", "ID", "x"), ("CLIENT", "LIST", "foo"),
    ("CLIENT", "LIST", "ID", "99999"), ("CLIENT", "LIST", "TYPE", "pubsub"), ("CLIENT", "GETREDIR"),
    ("CLIENT", "NO-EVICT", "on"), ("CLIENT", "NO-EVICT", "x"), ("CLIENT", "NO-EVICT", "off"),
    ("CLIENT", "PAUSE", "x"), ("CLIENT", "PAUSE", "-1"), ("CLIENT", "PAUSE", "10", "x"), ("CLIENT", "PAUSE", "0"),
    ("CLIENT", "UNPAUSE"), ("CLIENT", "REPLY", "x"), ("CLIENT", "SETINFO", "LIB-NAME", "x"), ("CLIENT", "FOO"),
    ("CLIENT", "SETNAME", "a b"), ("CLIENT", "SETNAME", "n1"), ("CLIENT", "GETNAME"), ("RESET",),
    ("CLIENT", "GETNAME"), ("CLIENT", "REPLY", "OFF"), ("PING", "silenced"), ("CLIENT", "REPLY", "ON"),
    ("CLIENT", "REPLY", "SKIP"), ("PING", "skipped"), ("PING", "seen"), ("CLIENT", "REPLY", "SKIP"),
    ("CLIENT", "REPLY", "ON"), ("PING",),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_client_replies_match_redis_byte_for_byte(quilld, redis_server, resp3):
    # OFF and SKIP drop replies: five commands of the script answer nothing, in both servers
    script = CLIENT_SCRIPT
    replies = len(script) - 5
    payload = b"".join(encode_command(*c) for c in script)

    def run(port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            if resp3:
                s.sendall(encode_command("HELLO", "3"))
                read_reply(s)
            s.sendall(payload)
            buf, deadline = b"", time.monotonic() + 10
            while time.monotonic() < deadline:
                s.settimeout(0.5)
                try:
                    data = s.recv(65536)
                except socket.timeout:
                    data = None
                buf += data or b""
                try:
                    if len(split_replies(buf)) >= replies:
                        break
                except (ValueError, IndexError):
                    pass
            return split_replies(buf)

    theirs, ours = run(redis_server), run(quilld.port)
    assert len(theirs) == replies
    assert ours == theirs


LIST_FIELDS = ["id", "addr", "laddr", "fd", "name", "age", "idle", "flags", "db", "sub", "psub", "ssub", "multi",
               "qbuf",
               "qbuf-free", "argv-mem", "multi-mem", "rbs", "rbp", "obl", "oll", "omem", "tot-mem", "events", "cmd",
               "user", "redir", "resp"]


def _line_fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split(" "))


def test_client_list_and_info_have_redis_7_0_fields_and_real_figures(quilld, redis_server):
    for port in (redis_server, quilld.port):
        r = client(port, single_connection_client=True)
        for text in (r.execute_command("CLIENT", "LIST").decode(), r.execute_command("CLIENT", "INFO").decode()):
            line = text.strip().split("\n")[-1] if "client|info" in text else [
                x for x in text.strip().split("\n") if "cmd=client|list" in x][0]
            fields = _line_fields(line)
            assert list(fields) == LIST_FIELDS, port
            assert fields["qbuf"] == "26" and fields["argv-mem"] in ("10", "11"), (port, fields)
            assert int(fields["fd"]) > 0 and fields["events"] == "r" and fields["resp"] == "2"
    q = client(quilld.port, single_connection_client=True)
    other = socket.create_connection(("127.0.0.1", quilld.port))
    try:
        other.sendall(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\nabc")  # a command still arriving
        cid = q.client_id()

        def partial():
            lines = [_line_fields(x) for x in q.execute_command("CLIENT", "LIST").decode().strip().split("\n")]
            return [f for f in lines if f["id"] != str(cid) and f["qbuf"] != "0"]

        busy = wait_until(partial)
        assert busy and int(busy[0]["qbuf"]) > 0 and busy[0]["cmd"] == "NULL"
        assert int(busy[0]["tot-mem"]) >= int(busy[0]["qbuf"]) + int(busy[0]["argv-mem"])
        mine = q.execute_command("CLIENT", "LIST", "ID", cid, 999999).decode().strip().split("\n")
        assert len(mine) == 1 and mine[0].startswith(f"id={cid} ") and "cmd=client|list" in mine[0]
        q.execute_command("CLIENT", "NO-EVICT", "on")
        assert " flags=e " in q.execute_command("CLIENT", "INFO").decode()
    finally:
        other.close()


def test_client_info_is_verbatim_in_resp3(quilld):
    raw = run_script(quilld.port, [("CLIENT", "INFO")], resp3=True)[0]
    assert raw.startswith(b"=") and b"txt:id=" in raw and raw.endswith(b"resp=3\n\r\n")


def test_client_kill_skipme_and_the_old_form(quilld):
    q = client(quilld.port, single_connection_client=True)
    others = [socket.create_connection(("127.0.0.1", quilld.port)) for _ in range(3)]
    try:
        for s in others:
            s.sendall(b"PING\r\n")
            s.recv(100)
        n = len(q.execute_command("CLIENT", "LIST").decode().strip().split("\n"))
        assert q.execute_command("CLIENT", "KILL", "SKIPME", "yes") == n - 1
        for s in others:
            s.settimeout(5)
            assert s.recv(100) == b""  # closed by the server
        victim = socket.create_connection(("127.0.0.1", quilld.port))
        victim.sendall(b"CLIENT ID\r\n")
        vid = int(victim.recv(100)[1:-2])
        line = [x for x in q.execute_command("CLIENT", "LIST").decode().split("\n") if f"id={vid} " in x][0]
        addr = _line_fields(line)["addr"]
        assert q.execute_command("CLIENT", "KILL", addr) in (True, b"OK")
        victim.settimeout(5)
        assert victim.recv(100) == b""
        with pytest.raises(redis.ResponseError, match="No such client"):
            q.execute_command("CLIENT", "KILL", addr)
        mine = q.client_id()
        assert q.execute_command("CLIENT", "KILL", "ID", mine, "SKIPME", "no") == 1
        listing = client(quilld.port).execute_command("CLIENT", "LIST").decode()
        assert f"id={mine} " not in listing
    finally:
        for s in others:
            s.close()


def test_client_pause_holds_writes_or_everything_until_it_ends(quilld):
    admin = client(quilld.port, single_connection_client=True)
    worker = client(quilld.port, single_connection_client=True)
    worker.set("k", "v")
    # Each `start` is taken before its PAUSE is sent, so the pause ends at least its length after
    # `start` however slow the machine: a held command cannot be answered sooner than that.
    start = time.monotonic()
    assert admin.execute_command("CLIENT", "PAUSE", 600, "WRITE") in (True, b"OK")
    worker.set("k", "w")  # held until the pause ends
    assert time.monotonic() - start >= 0.6
    # ALL: every command waits, new connections' too (CLIENT UNPAUSE as well, as in redis)
    start = time.monotonic()
    assert admin.execute_command("CLIENT", "PAUSE", 700) in (True, b"OK")
    with socket.create_connection(("127.0.0.1", quilld.port), timeout=10) as late:
        late.sendall(b"GET k\r\n")
        assert late.recv(100) == b"$1\r\nw\r\n" and time.monotonic() - start >= 0.7
    # a long WRITE pause ends at CLIENT UNPAUSE (not a write: it runs); reads go on meanwhile
    assert admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE") in (True, b"OK")
    with socket.create_connection(("127.0.0.1", quilld.port), timeout=10) as writer:
        writer.sendall(b"SET k x\r\n")
        assert worker.get("k") == b"w"  # answered (redis-py's 30 s timeout), the pause has 60 s to run
        writer.settimeout(0.3)
        with pytest.raises(socket.timeout):
            writer.recv(100)  # held: nothing ends a 60 s pause this soon but the UNPAUSE below
        assert client(quilld.port).execute_command("CLIENT", "UNPAUSE") in (True, b"OK")
        writer.settimeout(10)
        assert writer.recv(100) == b"+OK\r\n"
    assert worker.get("k") == b"x"


def test_client_reply_and_pause_in_one_pipeline(quilld):
    with socket.create_connection(("127.0.0.1", quilld.port), timeout=5) as s:
        s.sendall(b"CLIENT REPLY OFF\r\nSET a 1\r\nGET a\r\nCLIENT REPLY ON\r\nGET a\r\n"
                  b"CLIENT REPLY SKIP\r\nGET a\r\nCLIENT PAUSE 200 WRITE\r\nSET a 2\r\nGET a\r\n")
        buf, deadline = b"", time.monotonic() + 5
        while buf.count(b"\r\n") < 7 and time.monotonic() < deadline:
            buf += s.recv(1000)
    assert buf == b"+OK\r\n$1\r\n1\r\n+OK\r\n+OK\r\n$1\r\n2\r\n"


# -- CONFIG -----------------------------------------------------------------------------------
CONFIG_SCRIPT = [
    ("CONFIG", "GET", "save"), ("CONFIG", "GET", "appendonly"), ("CONFIG", "GET", "nosuchparam"),
    ("CONFIG", "GET", "hash-max-listpack-entries"), ("CONFIG", "GET", "key-load-delay"),
    ("CONFIG", "GET", "timeout"), ("CONFIG", "GET", "slowlog-log-slower-than"),
    ("CONFIG", "GET", "client-output-buffer-limit"), ("CONFIG", "GET", "latency-tracking-info-percentiles"),
    ("CONFIG", "SET", "maxmemory-clients", "200%"), ("CONFIG", "SET", "maxmemory", "10000001", "maxmemory", "2"),
    ("CONFIG", "SET", "daemonize", "yes"), ("CONFIG", "SET", "foo", "bar"), ("CONFIG", "SET", "a"),
    ("CONFIG", "SET", "a", "b", "c"), ("CONFIG", "SET", "hz", "abc"), ("CONFIG", "SET", "appendfsync", "bad"),
    ("CONFIG", "SET", "activedefrag", "maybe"), ("CONFIG", "SET", "proto-max-bulk-len", "1x"),
    ("CONFIG", "SET", "proto-max-bulk-len", "100"), ("CONFIG", "SET", "save", "1"),
    ("CONFIG", "SET", "unixsocketperm", "999"), ("CONFIG", "SET", "dir", "/tmp"),
    ("CONFIG", "SET", "slowlog-max-len", "-1"), ("CONFIG", "SET", "maxmemory-clients", "-5%"),
    ("CONFIG", "SET", "maxmemory-clients", "x"), ("CONFIG", "SET", "client-query-buffer-limit", "invalid"),
    ("CONFIG", "SET", "hash-max-listpack-entries", "100"), ("CONFIG", "GET", "hash-max-listpack-entries"),
    ("CONFIG", "GET", "hash-max-ziplist-entries"), ("CONFIG", "SET", "hash-max-listpack-entries", "512"),
    ("CONFIG", "SET", "timeout", "5"), ("CONFIG", "GET", "timeout"), ("CONFIG", "SET", "timeout", "0"),
    ("CONFIG", "SET", "shutdown-on-sigterm", "nosave now"), ("CONFIG", "GET", "shutdown-on-sigterm"),
    ("CONFIG", "SET", "shutdown-on-sigterm", "default"), ("CONFIG", "SET", "repl-backlog-size", "10000002"),
    ("CONFIG", "GET", "repl-backlog-size"), ("CONFIG", "SET", "repl-backlog-size", "1mb"),
    ("CONFIG", "SET", "slowlog-log-slower-than", "20000", "slowlog-max-len", "64"),
    ("CONFIG", "GET", "slowlog-max-len"),
    ("CONFIG", "SET", "slowlog-log-slower-than", "10000", "slowlog-max-len", "128"),
    ("CONFIG", "RESETSTAT"), ("CONFIG", "REWRITE"), ("CONFIG", "FOO"),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_config_replies_match_redis_byte_for_byte(quilld, redis_server, resp3):
    _same(redis_server, quilld.port, CONFIG_SCRIPT, resp3)


def test_config_get_patterns_cover_every_redis_parameter(quilld, redis_server):
    q, r = client(quilld.port, False, decode_responses=True), client(redis_server, False, decode_responses=True)
    theirs, ours = r.config_get("*"), q.config_get("*")  # redis-py: a dict
    assert set(ours) == set(theirs) and len(ours) > 180
    assert "key-load-delay" not in ours and q.config_get("key-load-delay") == {"key-load-delay": "0"}
    assert ours["maxmemory"] == theirs["maxmemory"] == "0" and ours["port"] == str(quilld.port)  # as set
    assert ours["save"] == "" and ours["appendonly"] == "no" and ours["maxmemory-policy"] == "allkeys-lru"
    assert ours["databases"] == "1" and ours["hz"] == "20" and ours["bind"] == "127.0.0.1"
    both = q.config_get("maxmemory", "maxmemory*", "bind", "*of")
    assert {"maxmemory", "maxmemory-samples", "maxmemory-clients", "bind", "slaveof", "replicaof"} <= set(both)
    # every parameter can be set to the value it has (redis's CONFIG sanity), except the immutable
    immutable = {"rdbchecksum", "daemonize", "io-threads-do-reads", "always-show-logo", "syslog-enabled",
                 "cluster-enabled", "disable-thp", "aclfile", "unixsocket", "pidfile", "syslog-ident",
                 "appendfilename", "appenddirname", "supervised", "syslog-facility", "databases", "io-threads",
                 "logfile", "unixsocketperm", "replicaof", "slaveof", "server_cpulist", "bio_cpulist",
                 "aof_rewrite_cpulist", "bgsave_cpulist", "set-proc-title", "cluster-config-file", "cluster-port",
                 "enable-protected-configs", "enable-debug-command", "enable-module-command", "dbfilename", "dir",
                 "tcp-backlog", "socket-mark-id"}
    for k, v in ours.items():
        if k not in immutable:
            assert q.config_set(k, v), k
    assert q.config_get("*") == ours


def test_config_set_changes_what_quilld_does(quilld):
    q = client(quilld.port, False, decode_responses=True, single_connection_client=True)
    # maxmemory: the watermarks follow (eviction between 85% and 95% of it), at most the arena
    assert q.config_set("maxmemory", 100 << 20)
    info = _fields(_info(q, "memory", "tiers"))
    assert info["maxmemory"] == str(100 << 20) and info["dram_high_watermark"] == str(round(0.95 * 100 / 256, 6))
    with pytest.raises(redis.ResponseError, match="cannot exceed the DRAM arena"):
        q.config_set("maxmemory", 1 << 40)
    assert q.config_get("maxmemory") == {"maxmemory": str(100 << 20)}
    for i in range(300):
        q.set(f"big:{i}", b"x" * (512 << 10))  # 150 MiB written into 100: the oldest go
    assert int(_fields(_info(q, "stats"))["evicted_keys"]) > 0
    assert int(_fields(_info(q, "memory"))["used_memory"]) <= 96 << 20
    assert q.config_set("maxmemory", 0) and q.config_get("maxmemory") == {"maxmemory": "0"}  # as redis: as set
    assert _fields(_info(q, "memory"))["maxmemory"] == "0"  # INFO: as CONFIG GET (issue 29.8), the whole arena
    # several pairs at once (redis-py's test_config_set_multi_params)
    assert q.config_set("timeout", 70, "maxmemory", 100) and q.config_get("timeout", "maxmemory") == {
        "timeout": "70", "maxmemory": "100"}
    assert q.config_set("timeout", 0, "maxmemory", 0) and q.config_get("timeout", "maxmemory") == {
        "timeout": "0", "maxmemory": "0"}
    # a refusal leaves every parameter of the call as it was, and says why
    with pytest.raises(redis.ResponseError, match="argument 'appendonly'.*no append-only file"):
        q.execute_command("CONFIG", "SET", "timeout", "7", "appendonly", "yes")
    assert q.config_get("timeout") == {"timeout": "0"}
    # proto-max-bulk-len applies at once, to this very connection
    assert q.config_set("proto-max-bulk-len", "1mb")
    with pytest.raises(redis.ResponseError, match="invalid bulk length"):
        q.set("k", b"x" * (2 << 20))
    assert q.config_set("proto-max-bulk-len", "512mb")
    # maxclients
    assert q.config_set("maxclients", 1)
    assert raw_first_line(quilld.port) == b"-ERR max number of clients reached"
    assert q.config_set("maxclients", 10000)
    # timeout closes an idle client, about once a second
    assert q.config_set("timeout", 1)
    idle = socket.create_connection(("127.0.0.1", quilld.port))
    idle.settimeout(6)
    assert idle.recv(10) == b""
    assert client(quilld.port).config_set("timeout", 0)


def raw_first_line(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(1000).split(b"\r\n")[0]


def test_config_rewrite_writes_the_toml_file_a_restart_reads(tmp_path):
    conf = tmp_path / "quilld.toml"
    conf.write_text("# mine\n[server]\n# idle clients\ntimeout = 0\n\n[dram]\nsize = \"64MiB\"\n")
    q = start_quilld(tmp_path, "--config", str(conf), admin=False)
    try:
        r = q.client(decode_responses=True)
        assert r.config_get("timeout") == {"timeout": "0"}
        r.config_set("timeout", 300)
        r.config_set("slowlog-max-len", 17)
        r.config_set("maxmemory", 32 << 20)
        r.config_set("hash-max-listpack-entries", 64)  # recorded, not a quilld setting: not written
        assert r.config_rewrite()
        text = conf.read_text()
        assert text.startswith("# mine\n[server]\n# idle clients\ntimeout = 300\n")
        data = tomllib.loads(text)
        assert data["server"] == {"timeout": 300, "slowlog_max_len": 17}
        assert data["dram"] == {"size": "64MiB", "maxmemory": 32 << 20}
    finally:
        stop_process(q.proc)
    q = start_quilld(tmp_path, "--config", str(conf), admin=False)
    try:
        r = q.client(decode_responses=True)
        assert r.config_get("timeout", "slowlog-max-len") == {"timeout": "300", "slowlog-max-len": "17"}
        assert _fields(_info(r, "memory"))["maxmemory"] == str(32 << 20)
        assert _fields(_info(r, "tiers"))["dram_high_watermark"] == "0.475"  # 95% of 32 MiB, of a 64 MiB arena
    finally:
        stop_process(q.proc)


def test_config_rewrite_without_a_file(quilld):
    with pytest.raises(redis.ResponseError, match="^The server is running without a config file$"):
        quilld.client().config_rewrite()


# -- SLOWLOG, LATENCY, MONITOR -----------------------------------------------------------------
SLOWLOG_SCRIPT = [
    ("SLOWLOG", "RESET"), ("SLOWLOG", "LEN"), ("SLOWLOG", "GET", "x"), ("SLOWLOG", "GET", "-2"),
    ("SLOWLOG", "GET", "1", "2"), ("slowlog", "get", "1", "2"), ("SLOWLOG", "HELP"), ("SLOWLOG", "FOO"),
    ("LATENCY", "RESET"), ("LATENCY", "LATEST"), ("LATENCY", "HISTORY", "command"), ("LATENCY", "DOCTOR"),
    ("LATENCY", "FOO"), ("LATENCY", "HISTOGRAM", "nosuch"), ("ACL", "WHOAMI"), ("ACL", "USERS"), ("ACL", "CAT"),
    ("ACL", "CAT", "nope"), ("ACL", "CAT", "a", "b"),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_slowlog_latency_acl_replies_match_redis_byte_for_byte(quilld, redis_server, resp3):
    _same(redis_server, quilld.port, SLOWLOG_SCRIPT, resp3)


def test_slowlog_keeps_slow_commands_with_redis_s_entry_shape(quilld):
    q = client(quilld.port, single_connection_client=True, client_name="slowpoke")
    q.config_set("slowlog-log-slower-than", 0)
    q.slowlog_reset()
    q.set("k", b"v" * 300)
    q.execute_command("AUTH", "default", "secret-thing")  # its arguments never show
    q.execute_command("MGET", *[f"k{i}" for i in range(40)])
    entries = q.execute_command("SLOWLOG", "GET", -1)
    assert q.execute_command("SLOWLOG", "LEN") == len(entries) + 1 >= 5  # SLOWLOG GET is logged too
    ids = [e[0] for e in entries]
    assert ids == sorted(ids, reverse=True)
    by_cmd = {e[3][0].lower(): e for e in entries}
    sid, ts, usec, args, addr, name = by_cmd[b"set"]
    assert abs(ts - time.time()) < 60 and usec >= 0 and name == b"slowpoke" and addr.startswith(b"127.0.0.1:")
    assert args == [b"SET", b"k", b"v" * 128 + b"... (172 more bytes)"]
    assert by_cmd[b"auth"][3] == [b"AUTH", b"(redacted)", b"(redacted)"]
    mget = by_cmd[b"mget"][3]
    assert len(mget) == 32 and mget[-1] == b"... (10 more arguments)"
    assert len(q.execute_command("SLOWLOG", "GET", 2)) == 2
    q.config_set("slowlog-max-len", 2)
    q.ping()
    assert q.execute_command("SLOWLOG", "LEN") == 2
    q.config_set("slowlog-log-slower-than", -1)
    q.slowlog_reset()
    q.ping()
    assert q.execute_command("SLOWLOG", "LEN") == 0
    q.config_set("slowlog-log-slower-than", 10000)


def test_latency_monitor_records_slow_commands(quilld):
    q = client(quilld.port)
    assert b"Latency monitoring is disabled" in q.execute_command("LATENCY", "DOCTOR")
    q.config_set("latency-monitor-threshold", 1)
    pipe = q.pipeline(transaction=False)
    for i in range(2000):
        pipe.set(f"k{i}", "v")  # one timed SET in 64 feeds the histogram
    for i in range(0, 60_000, 1000):
        pipe.mset({f"m{j}": "v" for j in range(i, i + 1000)})
    pipe.execute()
    q.execute_command("KEYS", "*")  # 62,000 names: well over 1 ms on any machine, so a latency event
    deadline = time.monotonic() + 20
    while not q.execute_command("LATENCY", "LATEST") and time.monotonic() < deadline:
        q.execute_command("KEYS", "*")
    latest = q.execute_command("LATENCY", "LATEST")
    assert latest and latest[0][0] in (b"command", b"fast-command")
    event, when, last, worst = latest[0]
    assert abs(when - time.time()) < 60 and worst >= last >= 1
    history = q.execute_command("LATENCY", "HISTORY", event)
    assert history and history[-1] == [when, last]
    assert b"latency spikes" in q.execute_command("LATENCY", "DOCTOR")
    histogram = q.execute_command("LATENCY", "HISTOGRAM", "set")
    calls = dict(zip(histogram[1][::2], histogram[1][1::2]))
    assert histogram[0] == b"set" and calls[b"calls"] > 0
    assert q.execute_command("LATENCY", "RESET") >= 1 and q.execute_command("LATENCY", "LATEST") == []
    q.config_set("latency-monitor-threshold", 0)


def _read_lines(sock: socket.socket, n: int, timeout: float = 5.0) -> list[bytes]:
    return read_lines(sock, n, timeout).split(b"\r\n")[:-1]


def test_monitor_lines_as_redis_writes_them(quilld):
    mon = socket.create_connection(("127.0.0.1", quilld.port))
    mon.sendall(b"MONITOR\r\n")
    assert _read_lines(mon, 1) == [b"+OK"]
    q = client(quilld.port)
    q.set("foo", "bar \"x\"\n\x01")
    q.get("foo")
    with pytest.raises(redis.RedisError, match="invalid username-password pair"):
        q.execute_command("AUTH", "nobody", "secret")
    q.config_get("maxmemory")  # an admin command: never shown, as in redis
    q.echo("end")
    buf, deadline = b"", time.monotonic() + 5
    while b'"end"' not in buf and time.monotonic() < deadline:
        mon.settimeout(max(0.05, deadline - time.monotonic()))
        buf += mon.recv(65536)
    lines = buf.split(b"\r\n")[:-1]
    assert len(lines) >= 4
    pattern = rb'\+\d{10}\.\d{6} \[0 127\.0\.0\.1:\d+\] '
    assert all(re.match(pattern, x) for x in lines)
    tails = [re.sub(pattern, b"", x) for x in lines]
    assert b'"SET" "foo" "bar \\"x\\"\\n\\x01"' in tails and b'"GET" "foo"' in tails
    assert b'"AUTH" "(redacted)" "(redacted)"' in tails and b'"ECHO" "end"' in tails
    assert not any(x.startswith((b'"MONITOR"', b'"CONFIG"')) for x in tails)
    mon.sendall(b"RESET\r\n")
    assert b"+RESET" in b"\r\n".join(_read_lines(mon, 1))
    q.ping()
    mon.settimeout(0.3)
    with pytest.raises(socket.timeout):
        mon.recv(100)  # no longer monitoring
    mon.close()


# -- tenants ----------------------------------------------------------------------------------
@pytest.fixture
def tenants(tmp_path):
    users = tmp_path / "users"
    users.write_text("alice apw\nbob bpw\n")
    q = start_quilld(tmp_path, "--users-file", str(users), "--requirepass", "opw", "--dram", "64MiB", admin=False)
    yield q
    stop_process(q.proc)


def test_tenants_see_and_kill_their_own_connections_only(tenants):
    alice = client(tenants.port, username="alice", password="apw", single_connection_client=True)
    alice2 = client(tenants.port, username="alice", password="apw", single_connection_client=True)
    bob = client(tenants.port, username="bob", password="bpw", single_connection_client=True)
    op = client(tenants.port, password="opw", single_connection_client=True)
    alice2.ping()
    bob_id = bob.client_id()
    listing = alice.execute_command("CLIENT", "LIST").decode().strip().split("\n")
    assert len(listing) == 2 and all("user=alice" in x for x in listing)
    assert alice.execute_command("CLIENT", "LIST", "ID", bob_id) == b""
    assert alice.execute_command("CLIENT", "KILL", "ID", bob_id) == 0
    with pytest.raises(redis.ResponseError, match="No such user 'bob'"):
        alice.execute_command("CLIENT", "KILL", "USER", "bob")
    assert alice.execute_command("CLIENT", "KILL", "SKIPME", "yes") == 1  # alice2 only
    assert bob.ping() and op.ping()
    assert alice.execute_command("ACL", "USERS") == [b"alice"] and alice.execute_command("ACL", "WHOAMI") == b"alice"
    assert op.execute_command("ACL", "USERS") == [b"alice", b"bob", b"default"]
    assert len(op.execute_command("CLIENT", "LIST").decode().strip().split("\n")) == 1  # its own: default's
    assert op.execute_command("CLIENT", "KILL", "USER", "bob") == 0  # default is a tenant too: its own only
    assert bob.ping()
    # what changes the node for everyone is the operator's
    for cmd in (("CLIENT", "PAUSE", "10"), ("CONFIG", "SET", "timeout", "5"), ("CONFIG", "RESETSTAT"),
                ("LATENCY", "RESET")):
        with pytest.raises(redis.ResponseError, match="^this user has no permissions to run the"):
            alice.execute_command(*cmd)
    assert op.config_set("timeout", 0) and alice.execute_command("CONFIG", "GET", "timeout") == [b"timeout", b"0"]
    assert alice.execute_command("CONFIG", "GET", "requirepass") == [b"requirepass", b""]
    assert op.execute_command("CONFIG", "GET", "requirepass") == [b"requirepass", b"opw"]


def test_monitor_and_slowlog_never_show_another_tenant_s_commands(tenants):
    op = client(tenants.port, password="opw")
    op.config_set("slowlog-log-slower-than", 0)
    mon = socket.create_connection(("127.0.0.1", tenants.port))
    mon.sendall(encode_command("AUTH", "alice", "apw") + encode_command("MONITOR"))
    assert _read_lines(mon, 2) == [b"+OK", b"+OK"]
    bob = client(tenants.port, username="bob", password="bpw")
    alice = client(tenants.port, username="alice", password="apw")
    bob.set("bob-secret", "1")
    alice.set("alice-key", "1")
    lines = b"\n".join(_read_lines(mon, 3, timeout=2))
    assert b"alice-key" in lines and b"bob-secret" not in lines
    mon.close()
    assert b"bob-secret" not in repr(alice.execute_command("SLOWLOG", "GET", -1)).encode()
    assert any(e[3][:2] == [b"SET", b"bob-secret"] for e in bob.execute_command("SLOWLOG", "GET", -1))
    alice.slowlog_reset()  # alice's entries only
    assert bob.execute_command("SLOWLOG", "LEN") > 0


# -- HELLO before AUTH, RESET -----------------------------------------------------------------
@pytest.fixture
def redis_with_password(tmp_path):
    port, proc = start_redis(tmp_path, "--requirepass", "pw")
    try:
        yield port
    finally:
        stop_process(proc)


AUTH_SCRIPT = [("HELLO", "3"), ("HELLO",), ("CLIENT", "ID"), ("RESET",), ("AUTH", "pw"), ("SET", "a", "1"),
               ("RESET",), ("GET", "a"), ("HELLO", "2", "AUTH", "default", "pw"), ("ACL", "WHOAMI"), ("RESET",),
               ("ACL", "WHOAMI")]


def test_hello_before_auth_and_reset_match_redis(quilld_factory, redis_with_password):
    q = quilld_factory("--requirepass", "pw", admin=False)
    theirs = run_script(redis_with_password, AUTH_SCRIPT, resp3=False)
    ours = run_script(q.port, AUTH_SCRIPT, resp3=False)
    assert len(ours) == len(theirs) == len(AUTH_SCRIPT)
    assert ours[0] == theirs[0] == (
        b"-NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO AUTH <user> "
        b"<pass> option can be used to authenticate the client and select the RESP protocol version at the same "
        b"time\r\n")
    hello = [i for i, c in enumerate(AUTH_SCRIPT) if c[0] == "HELLO" and len(c) > 2]
    for i, (cmd, t, o) in enumerate(zip(AUTH_SCRIPT, theirs, ours)):
        if i not in hello:  # HELLO's map holds the connection's id and redis's modules
            assert o == t, f"{cmd}: redis answered {t!r}, quilld {o!r}"


# -- redis-benchmark --------------------------------------------------------------------------
def test_redis_benchmark_default_tests_complete(quilld):
    binary = require_tool("redis-benchmark")
    out = subprocess.run([binary, "-h", "127.0.0.1", "-p", str(quilld.port), "-t",
                          "set,get,incr,mset,ping_inline,ping_mbulk", "-n", "2000", "-q"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for test in ("SET", "GET", "INCR", "MSET (10 keys)", "PING_INLINE", "PING_MBULK"):
        assert re.search(rf"^{re.escape(test)}: [\d.]+ requests per second", out.stdout, re.M), out.stdout
    assert "ERR" not in out.stdout + out.stderr
