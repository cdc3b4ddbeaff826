"""A running quilld says which build of its hot path it runs (quilld/native.py): INFO server's
`quilld_build` and a line of its start log. Under .ci/run (QUILLD_EXPECT_BUILD=compiled) that is
the compiled one: the suite's nodes ran the compiled modules."""

from __future__ import annotations

import os
import time

import redis

from quilld import native


def test_info_server_and_the_start_log_name_the_build(quilld):
    expected = os.environ.get("QUILLD_EXPECT_BUILD") or ("compiled" if native.check()[0] else "pure")
    assert redis.Redis(port=quilld.port).info("server")["quilld_build"] == expected
    line = "hot path compiled (" if expected == "compiled" else "hot path not compiled: running the pure-Python build"
    deadline = time.monotonic() + 10
    while line not in quilld.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in quilld.log()
