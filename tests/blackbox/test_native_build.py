"""A running quilld says which build of its hot path it runs (quilld/native.py): INFO server's
`quilld_build` and a line of its start log. Under .ci/run (EXPECT_QUILLD_BUILD=compiled) that is
the compiled one: the suite's nodes ran the compiled modules."""

from __future__ import annotations

import os
import time

import redis

from quilld import native


def test_info_server_and_the_start_log_name_the_build(quilld):
    expected = os.environ.get("EXPECT_QUILLD_BUILD") or ("compiled" if native.check()[0] else "pure")
    assert redis.Redis(port=quilld.port).info("server")["quilld_build"] == expected
    line = "hot path compiled (" if expected == "compiled" else "hot path not compiled: running the pure-Python build"
    deadline = time.monotonic() + 10
    while line not in quilld.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in quilld.log()


def test_quilld_pure_python_runs_the_plain_build_and_says_so(quilld_factory):
    q = quilld_factory("--dram", "64MiB", env={"QUILLD_PURE_PYTHON": "1"})
    assert redis.Redis(port=q.port).info("server")["quilld_build"] == "pure"
    line = "hot path not compiled: running the pure-Python build, slower (QUILLD_PURE_PYTHON=1)"
    deadline = time.monotonic() + 10
    while line not in q.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in q.log()
