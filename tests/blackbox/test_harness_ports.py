"""The harness waits for *its* process on a port, not for anybody listening there.

A port from free_port() is free only when chosen; a quilld spends a second or more
(imports, SSD recovery) before it binds it, and another test's server can take it
meanwhile. A bare connect then reached that other server, and a test read its INFO
(seen in CI: INFO without the SSD tier's recovery fields).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import conftest
import procs
from conftest import PortTaken, listens, start_quilld, start_redis, stop_process, wait_port

LISTENER = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); " \
           "print('up', flush=True); time.sleep(60)"


@pytest.fixture
def squatter():
    """Another process listening on a port; (port, process)."""
    port = conftest.free_port()
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        yield port, proc
    finally:
        stop_process(proc)


def test_listens_tells_whose_socket_it_is(squatter):
    port, owner = squatter
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert listens(owner, port)
        assert not listens(other, port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # what the old wait_port took for "started"
    finally:
        stop_process(other)


def test_a_process_that_cannot_bind_is_not_taken_for_started(squatter):
    port, _ = squatter
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(PortTaken):
            wait_port(port, proc, timeout=30)
    finally:
        stop_process(proc)


@pytest.mark.parametrize("start", [start_quilld, start_redis], ids=["quilld", "redis-server"])
def test_a_taken_port_is_retried_with_a_fresh_one(squatter, tmp_path, monkeypatch, start):
    port, _ = squatter
    real, chosen = procs.free_port, []

    def first_the_taken_one() -> int:
        chosen.append(port if not chosen else real())
        return chosen[-1]
    monkeypatch.setattr(procs, "free_port", first_the_taken_one)  # where start_quilld/start_redis take it
    server = start(tmp_path, admin=False) if start is start_quilld else start(tmp_path)
    proc = server.proc if start is start_quilld else server[1]
    served = server.port if start is start_quilld else server[0]
    try:
        assert chosen[0] == port and served != port and listens(proc, served)
    finally:
        stop_process(proc)
