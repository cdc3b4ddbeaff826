"""Network namespaces joined by a bridge: many hosts with their own addresses, on one machine.

A `Topology` is a bridge in a namespace of its own (the switch), N host namespaces each joined
to it by a veth pair, with its own address in one /24 and its loopback up, and one more veth
pair from the caller's namespace into the bridge, so this process reaches every host directly
(urllib, redis-py, sockets: nothing to enter). Hosts have no default route: nothing they send
can leave the bridge.

    with Topology(12) as topo:                  # or topo = Topology(12) ... topo.destroy()
        proc = topo.popen(topo.hosts[3], ["python3", "-m", "quilld", "--bind", topo.hosts[3].addr])
        wait_listening(proc, 7379)
        host = topo.add_host()                  # one more, joined to the same bridge

Names carry a per-run prefix (`quilltest-<run>-`, host link `qt<run>`) and each run holds a lock
(`RUN_DIR/<run>.lock`) while it lives, so two runs at once (two xdist workers, a bench) never
meet, and a run that was killed (kill -9: nothing of it ran) is found by its free lock and torn
down by the next `Topology`: the processes still in its namespaces killed, the namespaces
deleted. Within a run, `destroy()` (also at interpreter exit, and on SIGTERM where that has its
default action) stops every process by PID, kills whatever else is inside the namespaces, and
deletes them by name. Processes are started with
PR_SET_PDEATHSIG (SIGKILL), so they die with the thread that started them: start them from a
thread that outlives them (the main thread), or pass die_with_parent=False.

A process enters its namespace through util-linux's `nsenter` (and `setpriv --pdeathsig`), which
exec the program in the same process, never through a `preexec_fn`: a preexec_fn makes Python
fork() the caller instead of vfork()ing it, and forking a long-lived test worker took 18 s a
process (every popen of a run, in a full suite run).

The subnet is the first /24 of SUBNETS that overlaps no route or address of the caller's
namespace (another run's included), chosen under a machine-wide lock.

Needs root, iproute2's `ip` and util-linux's `nsenter` and `setpriv`; otherwise `NetnsUnavailable` says so (a test should fail on it,
not skip). No pytest here: a bench uses this module too.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from procs import holds_listener

PREFIX = "quilltest-"  # every namespace this module makes: quilltest-<run>-sw, quilltest-<run>-h<i>
LINK_PREFIX = "qt"  # the caller's end of the veth into the bridge: qt<run> (interface names: 15 chars at most)
RUN_DIR = Path("/run/quilltest-netns")  # <run>.lock held by each live run; alloc.lock: choosing a subnet
# 10.77.0.0/16 first, then the benchmarking range (RFC 2544): private, and never routed to the internet
SUBNETS = [f"10.77.{i}.0/24" for i in range(256)] + [f"198.18.{i}.0/24" for i in range(256)]
NOBODY_MAC = "02:00:00:00:00:00"  # locally administered, on no interface: partition() sends frames to it
CALLER_HOST = 254  # the caller's address in the subnet: .254; hosts get .1, .2, ...
IP_TIMEOUT = 30.0  # one `ip` invocation
STOP_TIMEOUT = 10.0  # SIGTERM to SIGKILL

# iproute2's `ip`, also where PATH lacks the sbin directories (a non-login root shell may)
IP = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), "")
_RUN_RE = re.compile(rf"^{re.escape(PREFIX)}([0-9a-f]{{8}})-")
_LINK_RE = re.compile(rf"^{re.escape(LINK_PREFIX)}([0-9a-f]{{8}})$")
NSENTER, SETPRIV = shutil.which("nsenter"), shutil.which("setpriv")  # util-linux: essential on Debian


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces here (not root, no `ip`, or the kernel refuses)."""


class NetnsError(RuntimeError):
    """An `ip` command failed."""


def ip(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip args...` (a batch on `stdin` with "-batch -"); NetnsError with its stderr on failure."""
    if not IP:
        raise NetnsUnavailable("iproute2's `ip` is not installed (Debian: apt-get install iproute2)")
    try:
        res = subprocess.run([IP, *args], input=stdin, capture_output=True, text=True, timeout=IP_TIMEOUT)
    except FileNotFoundError:
        raise NetnsUnavailable("iproute2's `ip` is not installed (Debian: apt-get install iproute2)") from None
    if check and res.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}"
                         + (f"\nbatch:\n{stdin}" if stdin else ""))
    return res


def require_netns(probe: bool = True) -> None:
    """Raise NetnsUnavailable, saying why, unless this process can make network namespaces (with
    `probe`, by making one: a first `ip netns add` on a machine also sets up /run/netns)."""
    if not IP:
        raise NetnsUnavailable("iproute2's `ip` is not installed (Debian: apt-get install iproute2)")
    if not (NSENTER and SETPRIV):
        raise NetnsUnavailable("util-linux's nsenter and setpriv are not installed (Debian: apt-get install util-linux)")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"network namespaces need root; this process runs as uid {os.geteuid()}")
    if not probe:
        return
    name = f"{PREFIX}probe{os.getpid()}"
    res = ip("netns", "add", name, check=False)
    if res.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` fails here: {res.stderr.strip()}")
    ip("netns", "del", name, check=False)


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge: `addr` is its address (on its eth0), `netns` its name."""

    index: int
    netns: str
    addr: str


def _entered(netns: str, argv: Sequence[str], die_with_parent: bool) -> list[str]:
    """`argv` run inside `netns` (and with PR_SET_PDEATHSIG = SIGKILL if asked): nsenter and setpriv
    each exec the next, so the process's PID is the program's."""
    if not os.path.exists(f"/run/netns/{netns}"):
        raise NetnsError(f"no network namespace {netns}")
    return [NSENTER, f"--net=/run/netns/{netns}", *([SETPRIV, "--pdeathsig", "KILL"] if die_with_parent else []),
            *argv]


def _wait_exec(proc: subprocess.Popen, argv: Sequence[str], timeout: float = 10.0) -> None:
    """Wait until `proc` runs `argv` itself, past nsenter and setpriv: from then on its death signal
    is set (a parent killed before then would leave it running)."""
    want = os.fsencode(argv[0])
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                if f.read().split(b"\0", 1)[0] == want:
                    return
        except OSError:
            return
        time.sleep(0.001)


def _pids_in(netns: str) -> list[int]:
    res = ip("netns", "pids", netns, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(pids: Iterable[int], timeout: float = STOP_TIMEOUT) -> None:
    """SIGKILL each pid and wait (bounded) until none is alive; zombies of ours count as gone."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _delete(names: Sequence[str], link: str | None = None) -> None:
    """Kill what is left in the namespaces `names` and delete them (and `link`, if it exists)."""
    for _ in range(2):  # a process may fork while we kill: a second sweep catches its children
        _kill_all([pid for name in names for pid in _pids_in(name)])
    if names:
        ip("-force", "-batch", "-", stdin="".join(f"netns del {n}\n" for n in names), check=False)
    if link and Path(f"/sys/class/net/{link}").exists():
        ip("link", "del", link, check=False)


def _lock_is_free(path: Path) -> bool:
    """Whether nobody holds `path`'s flock (its run is gone); a missing file counts as free."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def cleanup_stale() -> list[str]:
    """Tear down what runs that are gone (killed before their teardown) left: their processes, their
    namespaces and links. Returns the run ids cleaned. Runs that still hold their lock are left alone."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    names = ip("netns", "list", check=False).stdout.split()
    runs: dict[str, list[str]] = {}
    for name in names:
        if m := _RUN_RE.match(name):
            runs.setdefault(m.group(1), []).append(name)
    for link in os.listdir("/sys/class/net"):
        if m := _LINK_RE.match(link):
            runs.setdefault(m.group(1), [])
    for lock in RUN_DIR.glob("*.lock"):
        if re.fullmatch(r"[0-9a-f]{8}", lock.stem):
            runs.setdefault(lock.stem, [])
    cleaned = []
    for run, spaces in sorted(runs.items()):
        lock = RUN_DIR / f"{run}.lock"
        if not _lock_is_free(lock):
            continue
        _delete(spaces, f"{LINK_PREFIX}{run}")
        lock.unlink(missing_ok=True)
        cleaned.append(run)
    for name in names:  # a probe namespace of require_netns() left by a killed process
        if name.startswith(f"{PREFIX}probe") and not _alive(int(name[len(PREFIX) + 5:] or 0)):
            _delete([name])
    return cleaned


@contextlib.contextmanager
def allocating() -> Iterator[None]:
    """Hold the machine-wide lock under which a new run cleans up stale runs and picks its subnet
    (so, while it is held, no other run's cleanup_stale() runs)."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(RUN_DIR / "alloc.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route (all tables) and address of this namespace, but the default route."""
    out = []
    routes = json.loads(ip("-4", "-j", "route", "show", "table", "all").stdout or "[]")
    for r in routes:
        dst = r.get("dst", "default")
        if dst != "default":
            out.append(ipaddress.ip_network(dst, strict=False))
    for link in json.loads(ip("-4", "-j", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            out.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return out


def _free_subnet() -> ipaddress.IPv4Network:
    taken = _taken_networks()
    for text in SUBNETS:
        net = ipaddress.ip_network(text)
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetnsError(f"every subnet of {SUBNETS[0]}..{SUBNETS[-1]} overlaps a route here")


@dataclass(eq=False)
class Topology:
    """A bridge, `n` hosts on it and this process's way in; see the module's docstring."""

    n: int = 0
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)  # every process started, for teardown
    subnet: ipaddress.IPv4Network | None = None
    _lock_fd: int = -1
    _spaces: list[str] = field(default_factory=list)  # every namespace made, the switch first
    _pinned: dict[str, set[str]] = field(default_factory=dict)  # partition(): netns -> addresses pinned

    def __post_init__(self) -> None:
        require_netns(probe=False)  # root and `ip`: said before anything is touched
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(RUN_DIR / f"{self.run_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held for the run's life: it is not stale
        _live.append(self)
        _on_sigterm_destroy()
        try:
            with allocating():
                require_netns()
                cleanup_stale()
                self.subnet = _free_subnet()
                self._make_switch()  # its route claims the subnet before the lock is let go
            self._add_hosts(self.n)
        except BaseException:
            self.destroy()
            raise

    # -- names and addresses ----------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run_id}-sw"

    @property
    def link(self) -> str:
        return f"{LINK_PREFIX}{self.run_id}"

    @property
    def caller_addr(self) -> str:
        """This process's address on the bridge (the source of its connections to the hosts)."""
        return str(self.subnet.network_address + CALLER_HOST)

    def _addr(self, index: int) -> str:
        if not 0 <= index < CALLER_HOST - 1:
            raise NetnsError(f"at most {CALLER_HOST - 1} hosts in a /24")
        return str(self.subnet.network_address + index + 1)

    # -- building ---------------------------------------------------------------------------------

    def _make_switch(self) -> None:
        sw, plen = self.switch, self.subnet.prefixlen
        self._spaces.append(sw)
        ip("netns", "add", sw)
        ip("-n", sw, "-batch", "-", stdin="link set lo up\nlink add br0 type bridge\nlink set br0 up\n")
        ip("link", "add", "name", self.link, "type", "veth", "peer", "name", "caller", "netns", sw)
        ip("-n", sw, "-batch", "-", stdin="link set dev caller master br0\nlink set dev caller up\n")
        ip("-batch", "-", stdin=f"addr add {self.caller_addr}/{plen} dev {self.link}\nlink set {self.link} up\n")

    def _add_hosts(self, count: int) -> list[Host]:
        new = [Host(i, f"{PREFIX}{self.run_id}-h{i}", self._addr(i))
               for i in range(len(self.hosts), len(self.hosts) + count)]
        if not new:
            return []
        self._spaces += [h.netns for h in new]
        batch = [f"netns add {h.netns}" for h in new]
        batch += [f"link add name p{h.index} netns {self.switch} type veth peer name eth0 netns {h.netns}"
                  for h in new]
        ip("-batch", "-", stdin="\n".join(batch) + "\n")
        ip("-n", self.switch, "-batch", "-",
           stdin="".join(f"link set p{h.index} master br0\nlink set p{h.index} up\n" for h in new))
        for h in new:
            ip("-n", h.netns, "-batch", "-", stdin=f"link set lo up\naddr add {h.addr}/{self.subnet.prefixlen} "
                                                   f"dev eth0\nlink set eth0 up\n")
        self.hosts += new
        return new

    def add_host(self) -> Host:
        """One more host on the bridge, with the next address."""
        return self._add_hosts(1)[0]

    def add_hosts(self, count: int) -> list[Host]:
        return self._add_hosts(count)

    def cut(self, host: Host) -> None:
        """Unplug `host` from the bridge (its port down): what it sends and what is sent to it is
        lost, with no reset, as when a machine or its link dies. Its processes keep running."""
        ip("-n", self.switch, "link", "set", f"p{host.index}", "down")

    def mend(self, host: Host) -> None:
        """Plug `host` back in."""
        ip("-n", self.switch, "link", "set", f"p{host.index}", "up")

    def partition(self, *sides: Sequence[Host]) -> None:
        """Split the hosts into `sides` that cannot reach one another (each still reaches its own
        side, and this process reaches every host): silently, as a switch failure does, with no
        reset and no "unreachable". Each host's neighbour entry for every host of another side is
        pinned to a MAC nobody has, so its frames are flooded and dropped by every receiver.
        Undone by `heal`."""
        for side in sides:
            others = [h for other in sides if other is not side for h in other]
            for host in side:
                ip("-n", host.netns, "-batch", "-", stdin="".join(
                    f"neigh replace {h.addr} lladdr {NOBODY_MAC} dev eth0 nud permanent\n" for h in others))
                self._pinned.setdefault(host.netns, set()).update(h.addr for h in others)

    def heal(self) -> None:
        """Undo every `partition`: the pinned neighbour entries go, and ARP finds the hosts again."""
        for netns, addrs in self._pinned.items():
            ip("-n", netns, "-batch", "-", stdin="".join(f"neigh del {a} dev eth0\n" for a in sorted(addrs)))
        self._pinned.clear()

    # -- running ----------------------------------------------------------------------------------

    def popen(self, host: Host, argv: Sequence[str], die_with_parent: bool = True, **kw) -> subprocess.Popen:
        """Start `argv` inside `host`'s namespace (subprocess.Popen's keywords pass through); it is
        stopped by destroy() unless stopped before. With die_with_parent, it gets SIGKILL when the
        thread that started it ends (PR_SET_PDEATHSIG)."""
        proc = subprocess.Popen(_entered(host.netns, argv, die_with_parent), **kw)
        self.procs.append(proc)
        if die_with_parent:
            _wait_exec(proc, argv)
        return proc

    def run(self, host: Host, argv: Sequence[str], timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        """Run `argv` inside `host`'s namespace to its end (text output captured unless told)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(_entered(host.netns, argv, False), timeout=timeout, **kw)

    def pids(self, host: Host) -> list[int]:
        """Every process inside `host`'s namespace, started here or not."""
        return _pids_in(host.netns)

    # -- tearing down -----------------------------------------------------------------------------

    def destroy(self) -> None:
        """Stop every process started here (SIGTERM, then SIGKILL past STOP_TIMEOUT), kill whatever
        else is inside the namespaces, delete them and the caller's link. Idempotent."""
        if self in _live:
            _live.remove(self)
        stop_all(self.procs)
        _delete(self._spaces[::-1], self.link if self.subnet else None)
        self._spaces.clear()
        if self._lock_fd >= 0:
            (RUN_DIR / f"{self.run_id}.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


_live: list[Topology] = []


def _destroy_live() -> None:
    for t in list(_live):
        t.destroy()


atexit.register(_destroy_live)


def _on_sigterm_destroy() -> None:
    """A plain kill (SIGTERM) of this process, where it would die without cleaning up, tears the
    live topologies down first and then dies of the signal as before. Only where SIGTERM has its
    default action and from the main thread (where Python sets handlers); kill -9 is left to the
    next run's cleanup_stale()."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _destroy_live()
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM every live process of `procs` at once, wait up to `timeout` for all, SIGKILL the rest."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout)


# -- is it listening? (the process's own socket, in its own namespace) ---------------------------

def listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself holds a socket listening on TCP `port` in its namespace."""
    return holds_listener([pid], port, namespace_of=pid)


def wait_listening(proc: subprocess.Popen, ports: Iterable[int], timeout: float = 60.0) -> None:
    """Wait until `proc` listens on every TCP port of `ports` (in its namespace); RuntimeError if it
    exits first, TimeoutError past `timeout`."""
    ports = [ports] if isinstance(ports, int) else list(ports)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening on {ports}")
        waiting = [p for p in ports if not listens(proc.pid, p)]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"process {proc.pid} did not listen on {waiting} after {timeout} s")
        time.sleep(0.05)
