"""Issue 19, item 6: maxclients fits the descriptor limit, as redis's does at start.

Before the fix quilld neither raised its soft RLIMIT_NOFILE nor lowered maxclients: under a
limit of 256, the clients past it were accepted and closed at once by the event loop (EOF, no
error, no log line) while CONFIG GET maxclients still said 10000. Now the soft limit is raised
towards the hard one; when that is not enough maxclients is lowered to fit, with one log line,
and every client past it gets redis's `-ERR max number of clients reached`, counted.
redis-server 7, started under the same limits, is the reference.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import redis

from conftest import (ROOT, Quilld, read_lines, require_tool, start_listening, stop_process, wait_until,
                      with_nofile)
from quilld.config import RESERVED_FDS, Config, reserved_fds

pytestmark = pytest.mark.timeout(120)

FULL = b"-ERR max number of clients reached\r\n"


def start_limited(tmp_path, soft: int, hard: int, *extra: str) -> Quilld:
    """A quilld whose RLIMIT_NOFILE starts at (soft, hard), no admin API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = str(ROOT)

    def spawn(ports: list[int], log) -> subprocess.Popen:
        argv = [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(ports[0]),
                "--admin-port", "0", "--dram", "16MiB", *extra]
        with open(log, "wb") as f:
            return subprocess.Popen(with_nofile(argv, soft, hard), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=env)

    proc, ports, log = start_listening("quilld", lambda port: tmp_path / f"quilld-{port}.log", spawn)
    return Quilld(ports[0], 0, proc, log)


def nofile(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no limit")


def open_clients(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        out.append(s)
    return out


def test_maxclients_is_lowered_to_fit_a_low_hard_limit_and_clients_past_it_are_told(tmp_path):
    q = start_limited(tmp_path, 256, 256)
    fits = 256 - reserved_fds(Config())
    assert fits == 256 - RESERVED_FDS
    socks = []
    try:
        assert nofile(q.proc.pid) == (256, 256)
        warning = f"maxclients 10000 needs {10000 + RESERVED_FDS} open files but the limit could not be raised"
        log = q.log()
        assert log.count(warning) == 1 and f"maxclients has been reduced to {fits} to fit" in log, log
        r = q.client(single_connection_client=True)
        assert r.config_get("maxclients") == {"maxclients": str(fits)}
        assert r.info("clients")["maxclients"] == fits
        # fill every place (r holds one), then 20 more: each is told, none gets a bare EOF
        socks = open_clients(q.port, fits - 1)
        for s in socks[-5:]:
            s.sendall(b"PING\r\n")
            assert read_lines(s, 1) == b"+PONG\r\n"
        extra = open_clients(q.port, 20)
        for s in extra:
            assert read_lines(s, 1) == FULL
            s.close()
        assert r.info("stats")["rejected_connections"] == 20
        wait_until(lambda: "max number of clients reached (maxclients" in q.log(), 10)
        assert q.log().count("max number of clients reached (maxclients") == 1  # once a minute at most
        # more than the limit can hold is refused with redis's error; fewer is taken
        with pytest.raises(redis.ResponseError, match=r"CONFIG SET failed \(possibly related to argument "
                           rf"'maxclients'\) - The operating system is not able to handle the specified "
                           rf"number of clients, try with {fits}$"):
            r.config_set("maxclients", 1000)
        assert r.config_set("maxclients", 100) and r.info("clients")["maxclients"] == 100
    finally:
        for s in socks:
            s.close()
        stop_process(q.proc)


def test_the_soft_limit_is_raised_towards_the_hard_one(tmp_path):
    q = start_limited(tmp_path, 256, 20000)
    try:
        needed = 10000 + RESERVED_FDS
        assert nofile(q.proc.pid) == (needed, 20000)
        assert f"increased the open files limit to {needed} (it was 256) to fit maxclients 10000" in q.log()
        r = q.client()
        assert r.config_get("maxclients") == {"maxclients": "10000"}
        # CONFIG SET raises it further, within the hard limit
        assert r.config_set("maxclients", 12000)
        assert nofile(q.proc.pid) == (12000 + RESERVED_FDS, 20000)
    finally:
        stop_process(q.proc)


def test_redis_does_the_same_under_the_same_limits(tmp_path):
    """The reference: redis-server 7 under (256, 256) also lowers maxclients to 256 - 32, says so,
    and tells the clients past it the same."""
    binary = require_tool("redis-server")

    def spawn(ports: list[int], log) -> subprocess.Popen:
        with open(log, "wb") as f:
            return subprocess.Popen(with_nofile([binary, "--port", str(ports[0]), "--bind", "127.0.0.1", "--save", "",
                                                 "--appendonly", "no", "--dir", str(tmp_path)], 256),
                                    stdout=f, stderr=subprocess.STDOUT)

    proc, ports, log = start_listening("redis-server", lambda port: tmp_path / f"redis-{port}.log", spawn)
    socks = []
    try:
        r = redis.Redis(port=ports[0], single_connection_client=True)
        fits = 256 - RESERVED_FDS
        assert r.config_get("maxclients") == {"maxclients": str(fits)}
        assert f"maxclients has been reduced to {fits}" in log.read_text()
        socks = open_clients(ports[0], fits - 1)
        extra = open_clients(ports[0], 3)
        assert [read_lines(s, 1) for s in extra] == [FULL] * 3
        assert r.info("stats")["rejected_connections"] == 3
        with pytest.raises(redis.ResponseError, match=rf"try with {fits}$"):
            r.config_set("maxclients", 1000)
        for s in extra:
            s.close()
    finally:
        for s in socks:
            s.close()
        stop_process(proc)


def test_a_limit_too_low_for_anything_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(with_nofile([sys.executable, "-m", "quilld", "--port", "0", "--admin-port", "0", "--dram",
                                       "16MiB"], RESERVED_FDS),
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"the open files limit ('ulimit -n') of {RESERVED_FDS} is not enough for quilld to start" in proc.stderr
