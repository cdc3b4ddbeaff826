"""Health checks for orchestrators (issue 18, item 4), on real quilld processes.

`/livez` (is the process answering) and `/readyz` (should it get traffic) need no
token and say nothing of the node but a status; readiness is 503 while the node
starts (its SSD tier recovering: the admin API listens before), while it stops, and
while it is degraded (its SSD tier failed). `/healthz` is the operator's (token),
with the details, and 503 unless ok.

To hold a node in SSD recovery for as long as the test needs, its tier's key file is
replaced by a FIFO that the test fills with the same bytes: recovery opens it and waits for a writer;
the test is the writer, once it has looked.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from conftest import ROOT, free_port, http, ssd_node, start_listening, stop_process, wait_held, wait_until
from test_ssd_tier import tiny_fs  # noqa: F401 (a fixture: a 24 MiB tmpfs)

from quilld.tiers.ssd_files import KEY_FILE

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024
TOKEN = "health-tok"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict]:
    status, _, body = http(port, "GET", path, headers=headers)
    return status, json.loads(body)


def test_probes_need_no_token_and_say_nothing_else(quilld_factory):
    q = quilld_factory("--dram", "32MiB", env={"QUILLD_ADMIN_TOKEN": TOKEN})
    assert get(q.admin_port, "/livez") == (200, {"status": "ok"})
    assert get(q.admin_port, "/readyz") == (200, {"status": "ready"})
    assert get(q.admin_port, "/healthz")[0] == 401  # the operator's view needs the token
    status, health = get(q.admin_port, "/healthz", BEARER)
    assert status == 200 and health["status"] == "ok" and health["phase"] == "serving" and health["node_id"]


def test_a_recovering_node_is_alive_and_not_ready(tmp_path):
    ssd_dir = tmp_path / "ssd"
    first = ssd_node(tmp_path, ssd_dir, dram="8MiB")
    r = first.client()
    for i in range(24):  # 24 MiB into 8 MiB: most of it on SSD
        r.set(f"k{i}", bytes([i]) * MiB)
    assert stop_process(first.proc) == 0, first.log()
    key_file = ssd_dir / KEY_FILE
    key = key_file.read_bytes()
    key_file.unlink()
    os.mkfifo(key_file, 0o600)  # the owner's alone, as a key must be; recovery's open waits here for the key

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env.update(PYTHONPATH=str(ROOT), QUILLD_ADMIN_TOKEN=TOKEN, QUILLD_SSD_SEGMENT_SIZE="32MiB")
    resp_port = [0]

    def spawn(ports: list[int], log: Path) -> subprocess.Popen:
        resp_port[0] = free_port()
        argv = [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(resp_port[0]), "--admin-port",
                str(ports[0]), "--dram", "8MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "128MiB"]
        with open(log, "wb") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    proc, (admin,), log = start_listening("quilld", lambda port: tmp_path / f"recovering-{port}.log", spawn, 1)
    writer = None
    try:
        assert wait_until(lambda: "ssd tier: recovering" in log.read_text(), 15), log.read_text()
        assert get(admin, "/livez") == (200, {"status": "ok"})
        assert get(admin, "/readyz") == (503, {"status": "not ready", "reasons": ["starting: recovering the SSD tier"]})
        status, health = get(admin, "/healthz", BEARER)
        assert status == 503 and health["status"] == "starting" and health["phase"] == "recovering the SSD tier"
        status, answer = get(admin, "/v1/stats", BEARER)  # the rest waits until the node serves
        assert status == 503 and "starting" in answer["error"]
        with pytest.raises(OSError):  # nor does RESP listen yet
            socket.create_connection(("127.0.0.1", resp_port[0]), timeout=2).close()

        def write_key() -> None:
            with open(key_file, "wb") as f:
                f.write(key)
        writer = threading.Thread(target=write_key, daemon=True)
        writer.start()
        assert wait_until(lambda: get(admin, "/readyz")[0] == 200, 30), log.read_text()
        assert get(admin, "/readyz")[1] == {"status": "ready"}
        assert redis.Redis(port=resp_port[0], socket_timeout=10).get("k3") == bytes([3]) * MiB
        assert get(admin, "/v1/stats", BEARER)[0] == 200
    finally:
        if writer is None or writer.is_alive():  # let a recovery still waiting on the FIFO go on to its stop
            fd = os.open(key_file, os.O_RDWR | os.O_NONBLOCK)
            os.close(fd)
        stop_process(proc)
    assert "Traceback" not in log.read_text()


def test_a_failed_ssd_tier_is_not_ready_and_still_alive(tmp_path, tiny_fs):  # noqa: F811
    q = ssd_node(tmp_path, tiny_fs / "ssd", dram="8MiB", ssd_size="16MiB", QUILLD_SSD_SEGMENT_SIZE="16MiB",
                 QUILLD_ADMIN_TOKEN=TOKEN)
    try:
        r = q.client()
        with open(tiny_fs / "filler", "wb", buffering=0) as f:  # the disk full: the WAL cannot grow
            try:
                while True:
                    f.write(b"\0" * MiB)
            except OSError:
                pass
        for i in range(30):
            r.set(f"f{i}", b"x" * (512 * 1024))
        assert wait_until(lambda: r.info("persistence")["ssd_failed"] == 1, 20)
        assert get(q.admin_port, "/livez") == (200, {"status": "ok"})
        assert get(q.admin_port, "/readyz") == (503, {"status": "not ready",
                                                      "reasons": ["degraded: the SSD tier failed"]})
        status, health = get(q.admin_port, "/healthz", BEARER)
        assert status == 503 and health["status"] == "degraded" and health["ssd_error"]
    finally:
        stop_process(q.proc)


def test_a_stopping_node_is_not_ready_while_it_drains(quilld_factory):
    q = quilld_factory("--dram", "128MiB")
    q.client().set("big", b"q" * (32 * MiB))
    reader = socket.create_connection(("127.0.0.1", q.port), timeout=5)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        reader.sendall(b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n")  # a reply it never reads: the stop drains it
        wait_held(q.client(), 32 * MiB)
        q.proc.terminate()
        seen: list = []

        def stopping() -> bool:
            try:
                seen[:] = [get(q.admin_port, "/readyz")]
            except OSError:
                return False
            return seen[0][0] == 503

        assert wait_until(stopping, 10), seen
        assert seen[0] == (503, {"status": "not ready", "reasons": ["stopping"]})
    finally:
        reader.close()
    assert q.proc.wait(30) == 0
