"""What observers see of a payload received straight into the arena.

A large SET value or PUT2PHASE DATA chunk is received into its arena block, never as a
bytes argument. Everything that shows a command's arguments (MONITOR, SLOWLOG, CLIENT
LIST's qbuf) must cope with that: it shows `(N bytes received into the arena)` and the
command itself still succeeds. Before this, MONITOR turned such a SET into an internal
error.
"""

from __future__ import annotations

import threading

import crc32c
import pytest

from conftest import start_quilld, stop_process

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.fixture(scope="module")
def quilld(tmp_path_factory):
    q = start_quilld(tmp_path_factory.mktemp("arena-args"), admin=False)
    yield q
    assert stop_process(q.proc) == 0, q.log()


def test_monitor_shows_arena_payloads_by_size_and_the_commands_succeed(quilld):
    r, watcher = quilld.client(), quilld.client()
    seen: list[str] = []
    ready = threading.Event()

    def watch() -> None:
        with watcher.monitor() as mon:
            ready.set()
            for cmd in mon.listen():
                seen.append(cmd["command"])
                if cmd["command"].startswith("PUT2PHASE COMMIT"):
                    return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert ready.wait(10)
    value = b"v" * MiB
    assert r.set("big", value) is True
    handle = r.execute_command("PUT2PHASE", "BEGIN", "blk", 2 * MiB)
    assert r.execute_command("PUT2PHASE", "DATA", handle, 0, value) == b"OK"
    assert r.execute_command("PUT2PHASE", "DATA", handle, MiB, value) == b"OK"
    assert r.execute_command("PUT2PHASE", "COMMIT", handle, "CRC32C", crc32c.crc32c(value * 2)) == b"OK"
    t.join(10)
    assert not t.is_alive(), seen
    assert "SET big (1048576 bytes received into the arena)" in seen, seen
    data = [s for s in seen if s.startswith("PUT2PHASE DATA")]
    assert len(data) == 2 and all(s.endswith("(1048576 bytes received into the arena)") for s in data), seen
    assert r.get("big") == value and r.strlen("blk") == 2 * MiB


def test_slowlog_records_an_arena_payload_by_size(quilld):
    r = quilld.client()
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()
    try:
        assert r.set("slow", b"s" * MiB) is True
        entries = [e for e in r.slowlog_get(10) if e["command"].startswith(b"SET slow")]
        assert entries and entries[0]["command"] == b"SET slow (1048576 bytes received into the arena)", entries
    finally:
        r.config_set("slowlog-log-slower-than", 10000)


def test_large_and_small_payloads_pipelined_back_to_back_land_whole(quilld):
    """After a large payload the server reads small (the next header, then straight into the next
    block): every mix of sizes, sent in one pipeline, must still land byte for byte."""
    r = quilld.client()
    sizes = [MiB, 10, 300 * 1024, 16 * 1024, 16 * 1024 + 1, 3, 2 * MiB + 7, 8 * 1024, 70_000, MiB]
    values = {f"mix{i}": bytes([65 + i]) * n for i, n in enumerate(sizes)}
    pipe = r.pipeline(transaction=False)
    for k, v in values.items():
        pipe.set(k, v)
    assert pipe.execute() == [True] * len(values)
    assert r.mget(list(values)) == list(values.values())
