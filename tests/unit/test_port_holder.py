"""Who holds a port (issue 29, item 7): `port_holder` names another process holding the port over
the protocol whose bind failed, never quilld itself.

The gossip listener binds UDP, then TCP, on one port: when the TCP bind fails, quilld holds the UDP
socket itself, and /proc lists pids in no order that says who came first once they wrap. Here the
test process plays quilld (it holds the UDP socket), and real processes started after it (so with
higher pids, listed after it) hold the rest.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from procs import stop_process

from quilld.node import port_holder

HOLD = """
import socket, sys, time
kind = socket.SOCK_STREAM if sys.argv[1] == "tcp" else socket.SOCK_DGRAM
s = socket.socket(socket.AF_INET, kind)
s.bind(("127.0.0.1", int(sys.argv[2])))
if kind == socket.SOCK_STREAM:
    s.listen()
print("bound", flush=True)
time.sleep(60)
"""


def hold(proto: str, port: int) -> subprocess.Popen:
    """A process holding `port` over `proto` until stopped (it says so before the call returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, proto, str(port)], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"bound\n"
    return proc


@pytest.fixture
def holders():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        stop_process(proc)


def test_this_process_is_never_named_as_the_holder(holders):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as own:  # quilld's own gossip UDP socket
        own.bind(("127.0.0.1", 0))
        port = own.getsockname()[1]
        holders.append(tcp := hold("tcp", port))  # who made quilld's TCP bind fail
        assert port_holder(port).startswith(f"pid {tcp.pid} ("), port_holder(port)
        assert port_holder(port, ("tcp",)).startswith(f"pid {tcp.pid} (")
        assert port_holder(port, ("udp",)) == ""  # only this process holds it over UDP


def test_only_the_protocol_whose_bind_failed_is_looked_at(holders):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    holders.append(udp := hold("udp", port))  # started first: the lower pid, listed first
    holders.append(tcp := hold("tcp", port))
    assert port_holder(port, ("tcp",)).startswith(f"pid {tcp.pid} ("), port_holder(port, ("tcp",))
    assert port_holder(port, ("udp",)).startswith(f"pid {udp.pid} ("), port_holder(port, ("udp",))
