"""tests/netns.py itself: runs apart from each other, teardown by PID and by name, a killed run's
leftovers cleaned by the next, and a clear failure where namespaces cannot be made."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
import procs
from netns import NetnsUnavailable, Topology, listens, wait_listening

TESTS = Path(__file__).resolve().parent.parent
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
SERVER = "import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen(); time.sleep(600)"


@pytest.fixture
def topo():
    try:
        t = Topology(2)
    except NetnsUnavailable as e:
        pytest.fail(f"this test needs network namespaces (root and iproute2; CI runs as root): {e}")
    try:
        yield t
    finally:
        t.destroy()


def namespaces() -> set[str]:
    return set(netns.ip("netns", "list").stdout.split())


def links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


def of_run(run_id: str) -> set[str]:
    return {n for n in namespaces() if n.startswith(f"{netns.PREFIX}{run_id}-")}


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while netns._alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def connect_errno(t: Topology, host, addr: str, port: int) -> int:
    """From inside `host`: 0 when a TCP connection to addr:port is accepted, else its errno."""
    code = ("import socket, sys\ns = socket.socket(); s.settimeout(5)\n"
            "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))")
    return t.run(host, [sys.executable, "-c", code, addr, str(port)]).returncode


def test_hosts_reach_each_other_and_the_caller_reaches_them(topo):
    a, b = topo.hosts
    assert (a.addr, b.addr) == (str(topo.subnet.network_address + 1), str(topo.subnet.network_address + 2))
    server = topo.popen(a, [sys.executable, "-c", SERVER, a.addr])
    wait_listening(server, 5000, timeout=30)
    # the listening socket lives in a's namespace: the caller's /proc/net/tcp does not list it
    assert listens(server.pid, 5000) and not procs._listening_inodes(5000)
    assert connect_errno(topo, b, a.addr, 5000) == 0
    with socket.create_connection((a.addr, 5000), timeout=5) as s:
        assert s.getsockname()[0] == topo.caller_addr
    c = topo.add_host()
    assert c.addr == str(topo.subnet.network_address + 3) and connect_errno(topo, c, a.addr, 5000) == 0
    topo.cut(c)  # unplugged: nothing answers, not even a reset
    assert connect_errno(topo, c, a.addr, 5000) not in (0, errno.ECONNREFUSED)
    topo.mend(c)
    assert connect_errno(topo, c, a.addr, 5000) == 0
    # nothing leaves the bridge: a host has no route but its subnet's
    assert connect_errno(topo, c, "192.0.2.1", 80) == errno.ENETUNREACH
    assert topo.pids(a) == [server.pid]


def test_two_runs_at_once_are_apart_and_each_tears_down_only_its_own(topo):
    other = Topology(1)
    try:
        assert other.subnet != topo.subnet and not other.subnet.overlaps(topo.subnet)
        assert of_run(other.run_id) and not of_run(other.run_id) & of_run(topo.run_id)
        server = other.popen(other.hosts[0], [sys.executable, "-c", SERVER, other.hosts[0].addr])
        wait_listening(server, 5000, timeout=30)
        # topo's hosts cannot reach the other run's (no route between the two subnets)
        assert connect_errno(topo, topo.hosts[0], other.hosts[0].addr, 5000) == errno.ENETUNREACH
        assert netns.cleanup_stale() == []  # a live run is never taken for a stale one
    finally:
        other.destroy()
    assert server.poll() is not None
    assert not of_run(other.run_id) and other.link not in links()
    assert not (netns.RUN_DIR / f"{other.run_id}.lock").exists()
    assert len(of_run(topo.run_id)) == 3 and topo.link in links()  # switch and two hosts, untouched


def test_destroy_stops_by_pid_then_kills_what_else_is_inside(topo):
    ours = topo.popen(topo.hosts[0], SLEEPER)
    # a process the run did not start (a grandchild, say) is found by namespace and killed too
    stray = subprocess.Popen([netns.IP, "netns", "exec", topo.hosts[1].netns, *SLEEPER])
    assert wait_until_in(topo, topo.hosts[1], stray.pid)
    run_id = topo.run_id
    topo.destroy()
    assert ours.poll() is not None and stray.wait(10) == -signal.SIGKILL
    assert not of_run(run_id) and f"{netns.LINK_PREFIX}{run_id}" not in links()


def wait_until_in(t: Topology, host, pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while pid not in t.pids(host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_killed_run_is_cleaned_up_by_the_next(topo):
    """kill -9 of a run leaves its namespaces (nothing of it ran); what it started with PDEATHSIG
    dies with it, what it started without is killed by the next run, which deletes the rest."""
    script = (f"import sys, time; sys.path.insert(0, {str(TESTS)!r}); import netns\n"
              f"t = netns.Topology(2)\n"
              f"a = t.popen(t.hosts[0], {SLEEPER!r})\n"
              f"b = t.popen(t.hosts[1], {SLEEPER!r}, die_with_parent=False)\n"
              f"print(t.run_id, a.pid, b.pid, flush=True)\n"
              f"time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        run_id, a, b = child.stdout.readline().split()  # its run is made: it needs the lock no more
        a, b = int(a), int(b)
    except BaseException:
        child.kill()
        raise
    with netns.allocating():  # no other run (the other xdist worker's) cleans the killed one up first
        child.kill()
        child.wait(10)
        left = of_run(run_id)
        assert len(left) == 3 and f"{netns.LINK_PREFIX}{run_id}" in links()
        assert gone(a), "a process started with die_with_parent outlived its parent"
        assert netns._alive(b)
        assert run_id in netns.cleanup_stale()
    assert gone(b, timeout=1) and not of_run(run_id) and f"{netns.LINK_PREFIX}{run_id}" not in links()
    assert not (netns.RUN_DIR / f"{run_id}.lock").exists()
    assert len(of_run(topo.run_id)) == 3  # the live run beside it is untouched


def test_a_plain_kill_of_a_run_tears_its_topology_down_before_it_dies():
    script = (f"import sys, time; sys.path.insert(0, {str(TESTS)!r}); import netns\n"
              f"t = netns.Topology(2)\n"
              f"a = t.popen(t.hosts[0], {SLEEPER!r}, die_with_parent=False)\n"
              f"print(t.run_id, a.pid, flush=True)\n"
              f"time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        run_id, a = child.stdout.readline().split()
        assert len(of_run(run_id)) == 3
        child.terminate()
        assert child.wait(30) == -signal.SIGTERM
    finally:
        child.kill()
    assert gone(int(a), timeout=1) and not of_run(run_id) and f"{netns.LINK_PREFIX}{run_id}" not in links()
    assert not (netns.RUN_DIR / f"{run_id}.lock").exists()


def test_without_the_right_to_make_namespaces_it_says_why():
    """Root without CAP_SYS_ADMIN (as in an unprivileged container): NetnsUnavailable, naming the cause."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import netns; netns.Topology(1)"
    res = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
                          sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "NetnsUnavailable: `ip netns add` fails here" in res.stderr and "not permitted" in res.stderr, res.stderr
