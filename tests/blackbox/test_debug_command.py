"""DEBUG behind security.enable_debug_command (redis 7's enable-debug-command).

Replies are compared byte for byte with a real redis-server 7.0.15's, in RESP2 and RESP3:
every DEBUG PROTOCOL type, ERROR, the errors of unknown subcommands and bad arguments,
CONFIG GET/SET of the setting, and the refusal when the setting is "no" (before AUTH too)
or "local" and the client is not local. What has no byte-level twin is checked as a user
sees it: SET-ACTIVE-EXPIRE 0 leaves expired keys counted until read, SLEEP stops the node,
and a tenant other than `default` may not run it.
"""

from __future__ import annotations

import socket
import time

import pytest

from conftest import read_reply, start_redis, stop_process, wait_until
from quillwire.encode import encode_command
from test_compat import split_replies

REFUSAL = (b'-ERR DEBUG command not allowed. If the enable-debug-command option is set to "local", you can '
           b"run it from a local connection, otherwise you need to set this option in the configuration file, "
           b"and then restart the server.\r\n")
TYPES = ("string", "integer", "double", "bignum", "null", "array", "set", "map", "attrib", "push", "verbatim",
         "true", "false", "TRUE", "nosuch")
SCRIPT = [("DEBUG", "PROTOCOL", t) for t in TYPES] + [
    ("DEBUG", "ERROR", "MYERR with\r\nnewlines"), ("DEBUG", "ERROR", "plain"),
    ("DEBUG", "SET-ACTIVE-EXPIRE", "0"), ("DEBUG", "SET-ACTIVE-EXPIRE", "1"), ("DEBUG", "SLEEP", "0"),
    ("DEBUG", "SLEEP", "not-a-number"), ("DEBUG", "LOG", "from test_debug_command"),
    ("DEBUG", "PROTOCOL"), ("DEBUG", "PROTOCOL", "string", "extra"), ("DEBUG", "HELP", "extra"),
    ("DEBUG", "NOSUCH"), ("debug", "sleep"), ("DEBUG",),
    ("CONFIG", "GET", "enable-debug-command"), ("CONFIG", "SET", "enable-debug-command", "no"),
    ("CONFIG", "GET", "enable-debug-command"),
]


def exchange(port: int, commands, resp3: bool, source: str | None = None) -> bytes:
    """Send `commands` on one connection (after HELLO 3 when `resp3`) and return every byte
    answered to them; attribute and push frames are read as frames of their own."""
    frames = len(commands) + (sum(c[1:] == ("PROTOCOL", "attrib") for c in commands) if resp3 else 0) + (
        sum(c[1:] == ("PROTOCOL", "push") for c in commands) if resp3 else 0)
    with socket.socket() as s:
        s.settimeout(10)
        if source is not None:
            s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        if resp3:
            s.sendall(encode_command("HELLO", "3"))
            read_reply(s)
        s.sendall(b"".join(encode_command(*c) for c in commands))
        buf, deadline = b"", time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if len(split_replies(buf)) >= frames:
                    break
            except (ValueError, IndexError):
                pass  # a frame cut in the middle: read on
            s.settimeout(max(0.05, deadline - time.monotonic()))
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return buf


def same(theirs: bytes, ours: bytes) -> None:
    if ours != theirs:
        at = next(i for i in range(min(len(ours), len(theirs)) + 1) if ours[i:i + 1] != theirs[i:i + 1])
        pytest.fail(f"replies differ at byte {at}: redis {theirs[max(at - 120, 0):at + 80]!r}, "
                    f"quilld {ours[max(at - 120, 0):at + 80]!r}")


@pytest.fixture
def pair(quilld_factory, tmp_path):
    """(redis port, quilld port) with the given enable-debug-command setting, and extra redis flags."""
    procs = []

    def make(setting: str | None, *redis_flags: str, quilld_flags: tuple[str, ...] = ()):
        extra = ("--enable-debug-command", setting) if setting else ()
        port, proc = start_redis(tmp_path, *extra, *redis_flags)
        procs.append(proc)
        env = {"QUILLD_SECURITY_ENABLE_DEBUG_COMMAND": setting} if setting else None
        return port, quilld_factory(*quilld_flags, env=env, admin=False).port

    yield make
    for proc in procs:
        stop_process(proc)


def test_replies_match_redis_byte_for_byte(pair):
    redis_port, quilld_port = pair("yes")
    for resp3 in (False, True):
        theirs = exchange(redis_port, SCRIPT, resp3)
        assert theirs.count(b"\r\n") > len(SCRIPT)
        assert (b"|1\r\n$14\r\nkey-popularity" in theirs) == resp3  # the attribute frame: RESP3 only
        same(theirs, exchange(quilld_port, SCRIPT, resp3))


def test_refused_by_default_and_before_auth_as_redis(pair):
    redis_port, quilld_port = pair(None, "--requirepass", "pw", quilld_flags=("--requirepass", "pw"))
    script = [("DEBUG", "HELP"), ("DEBUG", "PROTOCOL", "string"), ("DEBUG",), ("AUTH", "pw"),
              ("DEBUG", "SET-ACTIVE-EXPIRE", "0"), ("CONFIG", "GET", "enable-debug-command")]
    theirs = exchange(redis_port, script, False)
    assert theirs.count(REFUSAL) == 3  # before AUTH too: the setting is checked first, as redis does
    same(theirs, exchange(quilld_port, script, False))


def test_local_allows_loopback_and_unix_socket_only(pair, tmp_path):
    sock_path = tmp_path / "q.sock"
    redis_port, quilld_port = pair("local", "--protected-mode", "no",  # else redis turns 127.0.0.2 away first
                                   quilld_flags=("--unixsocket", str(sock_path), "--protected-mode", "no"))
    script = [("DEBUG", "PROTOCOL", "integer")]
    for source in ("127.0.0.1", "127.0.0.2"):  # redis's "local" is 127.0.0.1 and ::1 exactly
        theirs = exchange(redis_port, script, False, source=source)
        assert theirs == (b":12345\r\n" if source == "127.0.0.1" else REFUSAL)
        same(theirs, exchange(quilld_port, script, False, source=source))
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        s.sendall(encode_command("DEBUG", "PROTOCOL", "integer"))
        assert read_reply(s) == 12345


def test_set_active_expire_and_sleep(quilld_factory):
    q = quilld_factory(env={"QUILLD_SECURITY_ENABLE_DEBUG_COMMAND": "yes"}, admin=False)
    with socket.create_connection(("127.0.0.1", q.port), timeout=10) as a, \
            socket.create_connection(("127.0.0.1", q.port), timeout=10) as b:
        def call(s, *args):
            s.sendall(encode_command(*args))
            return read_reply(s)

        assert call(a, "DEBUG", "SET-ACTIVE-EXPIRE", "0") == b"OK"
        for k in ("k1", "k2", "k3"):
            call(a, "PSETEX", k, "100", "v")
        time.sleep(0.6)  # long past the deadlines and many sweep periods: nothing may reclaim them
        assert call(a, "DBSIZE") == 3
        assert call(a, "MGET", "k1", "k2", "k3") == [None, None, None]  # reads reclaim them
        assert call(a, "DBSIZE") == 0
        call(a, "SET", "foo", "bar")
        call(a, "PEXPIRE", "foo", "100")
        time.sleep(0.3)
        assert call(a, "EXPIRE", "foo", "10") == 0  # an expired key is not brought back
        assert call(a, "DEBUG", "SET-ACTIVE-EXPIRE", "1") == b"OK"
        call(a, "PSETEX", "k4", "100", "v")
        assert wait_until(lambda: call(a, "DBSIZE") == 0, timeout=10), "the sweep did not resume"

        # b's PING is answered only once the node wakes up. Which of the two the node read first
        # is the machine's to decide: the slowlog (every call, in the order run) tells, and an
        # attempt where PING ran first is made again (events, not a pause that hopes to suffice)
        assert call(a, "CONFIG", "SET", "slowlog-log-slower-than", "0") == b"OK"
        for attempt in range(10):
            assert call(a, "SLOWLOG", "RESET") == b"OK"
            start = time.monotonic()
            a.sendall(encode_command("DEBUG", "SLEEP", "0.5"))
            assert call(b, "PING") == b"PONG"
            answered = time.monotonic() - start
            assert read_reply(a) == b"OK"
            order = [entry[3][0].upper() for entry in reversed(call(a, "SLOWLOG", "GET", "10"))]
            if order.index(b"DEBUG") < order.index(b"PING"):
                break
        else:
            pytest.fail("PING was read before DEBUG SLEEP in every attempt")
        assert answered >= 0.5  # it waited for the whole sleep


def test_only_the_operator_runs_it(quilld_factory, tmp_path):
    users = tmp_path / "users"
    users.write_text("alice apw\n")
    q = quilld_factory("--users-file", str(users), "--requirepass", "opw",
                       env={"QUILLD_SECURITY_ENABLE_DEBUG_COMMAND": "yes"}, admin=False)
    with socket.create_connection(("127.0.0.1", q.port), timeout=10) as s:
        def call(*args):
            s.sendall(encode_command(*args))
            return read_reply(s)

        assert call("AUTH", "alice", "apw") == b"OK"
        err = call("DEBUG", "SET-ACTIVE-EXPIRE", "0")
        assert isinstance(err, Exception) and "no permissions to run the 'debug' command" in str(err)
        assert call("AUTH", "default", "opw") == b"OK"
        assert call("DEBUG", "PROTOCOL", "true") == 1
