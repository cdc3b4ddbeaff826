"""`redis-cli` and `redis-benchmark` (Debian redis-tools) against a real quilld.

One-shot commands, commands read from stdin, `--pipe` mass insertion, the
formatted (`--no-raw`) and RESP3 (`-3`) output modes, and short benchmark runs.
Where redis-server answers the same command, its output through the same
redis-cli is the expected output.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import require_tool


RUN_TIMEOUT = 30.0
BENCH_RE = re.compile(r"(?:^|[\r\n])\s*(SET|GET): ([0-9.]+) requests per second")

pytestmark = [pytest.mark.timeout(120), pytest.mark.shared_node]  # one quilld and one redis-server for the module


def cli(port: int, *args: str, stdin: bytes | None = None, timeout: float = RUN_TIMEOUT):
    binary = require_tool("redis-cli")
    return subprocess.run([binary, "-h", "127.0.0.1", "-p", str(port), *args], input=stdin,
                          capture_output=True, timeout=timeout)


def out(port: int, *args: str) -> str:
    res = cli(port, *args)
    assert res.returncode == 0, (args, res.returncode, res.stderr)
    return res.stdout.decode()


def cli_version() -> tuple[int, ...]:
    res = subprocess.run([require_tool("redis-cli"), "--version"], capture_output=True, timeout=RUN_TIMEOUT)
    m = re.search(rb"redis-cli (\d+)\.(\d+)\.(\d+)", res.stdout)
    assert m, res.stdout
    return tuple(int(x) for x in m.groups())


def test_one_shot_commands(quilld):
    p = quilld.port
    assert out(p, "PING") == "PONG\n"
    assert out(p, "PING", "hello") == "hello\n"
    assert out(p, "SET", "k", "v") == "OK\n"
    assert out(p, "GET", "k") == "v\n"
    assert out(p, "EXISTS", "k") == "1\n"
    assert out(p, "DBSIZE") == "1\n"
    assert out(p, "DEL", "k") == "1\n"
    assert out(p, "GET", "k") == "\n"  # nil prints as an empty line outside a tty
    assert out(p, "DBSIZE") == "0\n"
    info = out(p, "INFO", "server")
    assert info.startswith("# Server\r\n")
    assert re.search(r"^redis_version:\d+\.\d+\.\d+\r$", info, re.M), info
    assert "# Memory" not in info
    # redis-cli prints an error reply followed by an empty line
    assert out(p, "NOSUCHCMD", "a", "b") == "ERR unknown command 'NOSUCHCMD', with args beginning with: 'a' 'b' \n\n"
    assert out(p, "GET") == "ERR wrong number of arguments for 'get' command\n\n"


def test_one_shot_matches_redis_server(quilld, redis_server):
    """The same redis-cli invocations print the same bytes and exit the same way."""
    script = [
        ("PING",), ("SET", "k", "v"), ("SET", "k", "v", "NX"), ("SET", "n", "12", "XX"), ("GET", "k"),
        ("GET", "missing"), ("MSET", "a", "1", "b", "2"), ("MGET", "a", "missing", "b"), ("EXISTS", "a", "b", "zz"),
        ("STRLEN", "k"), ("TYPE", "k"), ("TYPE", "zz"), ("TTL", "k"), ("SET", "t", "x", "EX", "100"),
        ("SET", "t", "x", "EX", "0"), ("SET", "t", "x", "BOGUS"), ("DEL", "a", "b", "zz"), ("DBSIZE",),
        ("ECHO", "héllo wörld"), ("SELECT", "1"), ("NOSUCHCMD", "x"), ("GET",), ("CLIENT", "SETNAME", "cli"),
        ("CONFIG", "GET", "databases"), ("FLUSHALL",), ("DBSIZE",),
    ]
    for mode in ((), ("--no-raw",)):
        for args in script:
            mine, theirs = cli(quilld.port, *mode, *args), cli(redis_server, *mode, *args)
            assert (mine.returncode, mine.stdout) == (theirs.returncode, theirs.stdout), (mode, args)


def test_commands_from_stdin(quilld):
    """No command arguments: redis-cli reads one command per stdin line, in order."""
    script = b"PING\nSET a 1\nGET a\nSET b \"two words\"\nGET b\nEXISTS a b c\nNOSUCH\nDEL a\nDBSIZE\n"
    res = cli(quilld.port, stdin=script)
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode().splitlines() == [
        "PONG", "OK", "1", "OK", "two words", "2",
        "ERR unknown command 'NOSUCH', with args beginning with: ", "", "1", "1",
    ]
    assert quilld.client().get("b") == b"two words"


def test_pipe_mass_insertion(quilld):
    n = 4000
    parts = []
    for i in range(n):
        key = b"pipe:%d" % i
        value = b"value-%d\r\nwith\x00binary" % i if i % 7 == 0 else b"v%d" % i
        parts.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(key), key, len(value), value))
    res = cli(quilld.port, "--pipe", stdin=b"".join(parts))
    text = res.stdout.decode()
    assert res.returncode == 0, (text, res.stderr)
    assert "All data transferred" in text
    assert f"errors: 0, replies: {n}" in text, text
    assert out(quilld.port, "DBSIZE") == f"{n}\n"
    r = quilld.client()
    assert r.get("pipe:0") == b"value-0\r\nwith\x00binary"
    assert r.get("pipe:3999") == b"v3999"


def test_pipe_counts_errors(quilld):
    parts = [b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$1\r\n1\r\n", b"*1\r\n$6\r\nNOSUCH\r\n", b"*2\r\n$3\r\nGET\r\n$1\r\nx\r\n"]
    res = cli(quilld.port, "--pipe", stdin=b"".join(parts))
    text = res.stdout.decode()
    assert "errors: 1, replies: 3" in text, text
    assert "ERR unknown command 'NOSUCH'" in res.stderr.decode()


def test_formatted_output(quilld):
    p = quilld.port
    assert out(p, "--no-raw", "SET", "k", "v") == "OK\n"
    assert out(p, "--no-raw", "GET", "k") == '"v"\n'
    assert out(p, "--no-raw", "GET", "missing") == "(nil)\n"
    assert out(p, "--no-raw", "EXISTS", "k") == "(integer) 1\n"
    assert out(p, "--no-raw", "MGET", "k", "missing") == '1) "v"\n2) (nil)\n'
    assert out(p, "--no-raw", "NOSUCH").startswith("(error) ERR unknown command 'NOSUCH'")


def test_resp3_mode(quilld):
    if cli_version() < (6, 0, 0):
        pytest.fail("redis-cli older than 6.0 has no -3 (RESP3); .ci/run installs redis-tools 7")
    p = quilld.port
    hello = out(p, "-3", "--no-raw", "HELLO", "3")
    assert '1# "server" => "redis"' in hello
    assert '3# "proto" => (integer) 3' in hello
    assert '6# "role" => "master"' in hello
    assert '7# "modules" => (empty array)' in hello
    assert out(p, "-3", "--no-raw", "SET", "k", "v") == "OK\n"
    assert out(p, "-3", "--no-raw", "GET", "k") == '"v"\n'
    assert out(p, "-3", "--no-raw", "GET", "missing") == "(nil)\n"
    assert out(p, "-3", "--no-raw", "MGET", "k", "missing") == '1) "v"\n2) (nil)\n'
    assert out(p, "-3", "--no-raw", "CONFIG", "GET", "maxmemory") == '1# "maxmemory" => "0"\n'
    assert "resp=3" in out(p, "-3", "CLIENT", "INFO")
    info = out(p, "-3", "INFO", "replication")
    assert "role:master" in info


def bench(port: int, *extra: str) -> dict[str, float]:
    binary = require_tool("redis-benchmark")
    res = subprocess.run([binary, "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-n", "2000", "-c", "10",
                          "-q", *extra], capture_output=True, timeout=60)
    text = res.stdout.decode(errors="replace")
    assert res.returncode == 0, (text, res.stderr)
    assert "ERR" not in text and "error" not in text.lower(), text
    rates = {name: float(value) for name, value in BENCH_RE.findall(text)}
    assert set(rates) == {"SET", "GET"}, text
    return rates


def test_benchmark_unpipelined(quilld):
    rates = bench(quilld.port)
    assert rates["SET"] > 0 and rates["GET"] > 0, rates
    r = quilld.client()
    assert r.strlen("key:__rand_int__") == 3  # redis-benchmark's default value size
    assert int(r.info("stats")["total_commands_processed"]) >= 4000


def test_benchmark_pipelined(quilld):
    rates = bench(quilld.port, "-P", "16")
    assert rates["SET"] > 0 and rates["GET"] > 0, rates
    assert int(quilld.client().info("stats")["total_commands_processed"]) >= 4000


def test_benchmark_large_values(quilld):
    """1 MiB values, the size of a small KV block."""
    binary = require_tool("redis-benchmark")
    res = subprocess.run([binary, "-h", "127.0.0.1", "-p", str(quilld.port), "-t", "set,get", "-n", "100",
                          "-c", "4", "-d", str(1 << 20), "-q"], capture_output=True, timeout=60)
    text = res.stdout.decode(errors="replace")
    assert res.returncode == 0, (text, res.stderr)
    rates = {name: float(value) for name, value in BENCH_RE.findall(text)}
    assert set(rates) == {"SET", "GET"} and min(rates.values()) > 0, text
    assert quilld.client().strlen("key:__rand_int__") == 1 << 20


def test_client_info_names_current_command(quilld, redis_server):
    """CLIENT INFO / CLIENT LIST report the running command as redis does: `cmd=client|info`."""
    for args, expect in ((("CLIENT", "INFO"), "cmd=client|info"), (("CLIENT", "LIST"), "cmd=client|list")):
        theirs = cli(redis_server, *args).stdout.decode()
        assert expect in theirs, theirs
        mine = cli(quilld.port, *args).stdout.decode()
        assert expect in mine, mine


def test_password_options(quilld_factory):
    q = quilld_factory("--dram", "256MiB", "--requirepass", "pw")
    assert out(q.port, "PING") == "NOAUTH Authentication required.\n\n"
    assert out(q.port, "-a", "pw", "--no-auth-warning", "PING") == "PONG\n"
    assert out(q.port, "-a", "pw", "--no-auth-warning", "SET", "k", "v") == "OK\n"
    res = cli(q.port, "-a", "wrong", "--no-auth-warning", "GET", "k")
    assert b"WRONGPASS invalid username-password pair or user is disabled." in res.stdout + res.stderr
    # RESP3 mode authenticates inside HELLO: HELLO 3 AUTH default pw
    assert out(q.port, "-3", "--user", "default", "--pass", "pw", "--no-auth-warning", "GET", "k") == "v\n"
    res = cli(q.port, "-a", "pw", "--no-auth-warning", stdin=b"GET k\nDBSIZE\n")
    assert res.stdout.decode().splitlines() == ["v", "1"]
