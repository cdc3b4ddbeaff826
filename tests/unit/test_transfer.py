"""The peer transfer seam (cluster/transfer.py) and the RDMA path (cluster/rdma.py).

These machines have no RDMA device (nor kernel RDMA support), so:
- `probe_rdma` runs against fake `pyverbs` modules put in sys.modules, shaped
  like the pyverbs calls it makes (get_device_list, Context, query_port ...);
- `RdmaTransfer` runs against `FakeDevice`, which stands in for
  `PyverbsDevice` (the only class that calls pyverbs) and carries out an
  "RDMA READ" by copying between two real arenas at the addresses and rkeys
  the protocol exchanged. The handshake, leases, command handlers, timeouts
  and fallbacks are real; whether pyverbs drives a real NIC is not tested here.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import crc32c
import hiredis
import pytest

from quilld.cluster import rdma as rdma_mod
from quilld.cluster.peer_client import PeerError, PeerPool
from quilld.cluster.rdma import (IBV_WC_SUCCESS, Leases, QpInfo, RdmaError, RdmaTransfer, address_of,
                                 memlock_shortfall)
from quilld.cluster.fabric import RdmaInfo
from quilld.cluster.transfer import (RdmaProbe, TcpTransfer, Transfers, advertise,
                                     choose_transfer, path_for, probe_rdma)
from quilld.cluster.wire import check_meta
from quilld.protocol.commands.cluster import cmd_peerget, cmd_peerrdma, cmd_peerrelease
from quilld.config import DramConfig
from quilld.errors import CommandError, ConfigError, PeerOnly, QuillError
from quilld.scopes import ScopeRegistry
from quilld.model import IdentityScope
from quilld.model import Pending, Pinned
from quilld.tiers.block import Block
from quilld.tiers.keyspace import Keyspace
from handler_context import make_context, session
from quilld.tiers.arena import PAGE, DramArena

ROOT = Path(__file__).resolve().parents[2]
SCOPE = IdentityScope("acme", "llama", "tok", "")
IB_GID = "fe80:0000:0000:0000:0002:c903:0031:7b41"
ETH_GID = "0000:0000:0000:0000:0000:ffff:0a00:0005"
IB = RdmaInfo("mlx5_0", 1, 7, IB_GID, 5, "ib")
ETH = RdmaInfo("mlx5_1", 1, 0, ETH_GID, 3, "eth", gid_index=3)
NONE = RdmaProbe(None, "no RDMA device")


# -- a fake pyverbs, just the surface probe_rdma uses ---------------------------------------
def port(state=4, link_layer=1, lid=7, mtu=5, gids=(IB_GID,), gid_types=None):
    return SimpleNamespace(state=state, link_layer=link_layer, lid=lid, active_mtu=mtu,
                           gid_tbl_len=len(gids), gids=list(gids), gid_types=list(gid_types or [0] * len(gids)))


def install_fake_pyverbs(monkeypatch, devices: dict, list_error: Exception | None = None,
                         open_errors: dict | None = None) -> list[str]:
    """sys.modules gets a `pyverbs` whose devices are `devices` (name -> ports); returns the closed contexts."""
    closed: list[str] = []

    def get_device_list():
        if list_error is not None:
            raise list_error
        return [SimpleNamespace(name=name.encode()) for name in devices]

    class Context:
        def __init__(self, name):
            if (open_errors or {}).get(name):
                raise open_errors[name]
            self.name, self.ports = name, devices[name]

        def query_device(self):
            return SimpleNamespace(phys_port_cnt=len(self.ports))

        def query_port(self, n):
            return self.ports[n - 1]

        def query_gid(self, n, i):
            return self.ports[n - 1].gids[i]

        def query_gid_type(self, n, i):
            return self.ports[n - 1].gid_types[i]

        def close(self):
            closed.append(self.name)

    pkg = types.ModuleType("pyverbs")
    dev = types.ModuleType("pyverbs.device")
    dev.get_device_list, dev.Context = get_device_list, Context
    pkg.device = dev
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", dev)
    return closed


def test_probe_without_pyverbs(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # any `import pyverbs` now fails
    probe = probe_rdma()
    assert probe.info is None and not probe.available
    assert probe.reason.startswith("pyverbs not installed")


def test_probe_with_a_broken_pyverbs(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", types.ModuleType("pyverbs"))
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)  # like a missing libibverbs symbol
    probe = probe_rdma()
    assert probe.info is None and probe.reason.startswith("pyverbs cannot be loaded")


def test_probe_without_devices(monkeypatch):
    install_fake_pyverbs(monkeypatch, {})
    assert probe_rdma() == RdmaProbe(None, "no RDMA device")


def test_probe_when_the_device_list_fails(monkeypatch):
    install_fake_pyverbs(monkeypatch, {}, list_error=RuntimeError("Failed to get devices list"))
    probe = probe_rdma()
    assert probe.info is None
    assert probe.reason == "no RDMA device (cannot list devices: Failed to get devices list)"


def test_probe_without_an_active_port(monkeypatch):
    closed = install_fake_pyverbs(monkeypatch, {"mlx5_0": [port(state=1), port(state=2)]})
    probe = probe_rdma()
    assert probe.info is None
    assert probe.reason == "no active port (mlx5_0 port 1: down; mlx5_0 port 2: init)"
    assert closed == ["mlx5_0"]


def test_probe_finds_an_active_infiniband_port(monkeypatch):
    closed = install_fake_pyverbs(monkeypatch, {"mlx5_0": [port(state=1), port(lid=12, mtu=4)]})
    probe = probe_rdma()
    assert probe.reason == ""
    assert probe.info == RdmaInfo("mlx5_0", 2, 12, IB_GID, 4, "ib", gid_index=0)
    assert closed == ["mlx5_0"]


def test_probe_skips_a_device_it_cannot_open(monkeypatch):
    install_fake_pyverbs(monkeypatch, {"bad0": [port()], "mlx5_1": [port()]},
                         open_errors={"bad0": RuntimeError("Failed to open device bad0")})
    probe = probe_rdma()
    assert probe.info is not None and probe.info.device == "mlx5_1"


def test_probe_reports_each_device_it_could_not_use(monkeypatch):
    install_fake_pyverbs(monkeypatch, {"bad0": [port()], "mlx5_1": [port(state=3)]},
                         open_errors={"bad0": RuntimeError("Failed to open device bad0")})
    assert probe_rdma().reason == "no active port (bad0: Failed to open device bad0; mlx5_1 port 1: armed)"


def test_probe_picks_the_roce_v2_gid(monkeypatch):
    zero = ":".join(["0000"] * 8)
    v1 = "fe80:0000:0000:0000:5054:00ff:fe12:3456"
    gids, types_ = [v1, zero, v1, ETH_GID], [0, 0, 0, 1]
    install_fake_pyverbs(monkeypatch, {"rxe0": [port(link_layer=2, lid=0, mtu=3, gids=gids, gid_types=types_)]})
    assert probe_rdma().info == RdmaInfo("rxe0", 1, 0, ETH_GID, 3, "eth", gid_index=3)


def test_probe_rejects_a_roce_port_without_a_gid(monkeypatch):
    zero = ":".join(["0000"] * 8)
    install_fake_pyverbs(monkeypatch, {"rxe0": [port(link_layer=2, lid=0, gids=[zero, zero])]})
    probe = probe_rdma()
    assert probe.info is None and "rxe0 port 1: active but without a usable GID" in probe.reason


# -- choosing a path ------------------------------------------------------------------------------
def test_choose_tcp_is_always_tcp():
    assert choose_transfer("tcp", NONE) == "tcp"
    assert choose_transfer("tcp", RdmaProbe(IB)) == "tcp"


def test_choose_auto_follows_the_device():
    assert choose_transfer("auto", NONE) == "tcp"
    assert choose_transfer("auto", RdmaProbe(IB)) == "rdma"


def test_choose_rdma_without_a_device_fails_loudly():
    with pytest.raises(ConfigError) as e:
        choose_transfer("rdma", RdmaProbe(None, "pyverbs not installed (pip install -e '.[rdma]')"))
    assert e.value.message == ('cluster.transfer = "rdma" but RDMA is unavailable: pyverbs not installed '
                               '(pip install -e \'.[rdma]\'); use "auto" or "tcp"')


def test_choose_rdma_with_a_device():
    assert choose_transfer("rdma", RdmaProbe(IB)) == "rdma"


def test_choose_rejects_an_unknown_mode():
    with pytest.raises(ConfigError):
        choose_transfer("infiniband", RdmaProbe(IB))


def test_advertise_only_when_rdma_is_on():
    assert advertise("tcp", IB) == {}
    assert advertise("rdma", None) == {}
    meta = advertise("rdma", IB)
    assert meta == {"rdma": {"dev": "mlx5_0", "port": 1, "lid": 7, "gid": IB_GID, "mtu": 5, "ll": "ib"}}
    assert RdmaInfo.from_meta(meta["rdma"]) == IB  # gid_index stays local (0 default)


def test_advertised_meta_fits_a_gossip_packet():
    long_host = "node-with-a-rather-long-name.rack-17.eu-west.example.internal"
    meta = {"resp": [long_host, 65535], "admin": [long_host, 65535], "dram_capacity": 1 << 40,
            "dram_used": 1 << 40, "ssd_capacity": 1 << 44, "ssd_used": 1 << 44, "clients": 100000,
            "version": "0.1.0", **advertise("rdma", RdmaInfo("mlx5_bond_0", 2, 0xFFFF, ETH_GID, 5, "eth"))}
    check_meta(meta)  # raises past MAX_META_BYTES


PEER_IB = {"resp": ["10.0.0.2", 6379], **advertise("rdma", IB)}
PEER_ETH = {"resp": ["10.0.0.2", 6379], **advertise("rdma", ETH)}
PEER_TCP = {"resp": ["10.0.0.2", 6379]}


@pytest.mark.parametrize("mode, local, peer_meta, expected", [
    ("auto", IB, PEER_IB, "rdma"),
    ("rdma", IB, PEER_IB, "rdma"),
    ("tcp", IB, PEER_IB, "tcp"),  # both advertise, the mode forbids it
    ("auto", None, PEER_IB, "tcp"),  # only the peer has RDMA
    ("auto", IB, PEER_TCP, "tcp"),  # only this node has it
    ("rdma", IB, PEER_TCP, "tcp"),
    ("auto", IB, PEER_ETH, "tcp"),  # InfiniBand cannot reach RoCE
    ("auto", IB, None, "tcp"),
    ("auto", IB, {"rdma": "yes"}, "tcp"),
    ("auto", IB, {"rdma": {**IB.to_meta(), "gid": "fe80::1"}}, "tcp"),
    ("auto", IB, {"rdma": {**IB.to_meta(), "mtu": 9}}, "tcp"),
    ("auto", IB, {"rdma": {**IB.to_meta(), "port": True}}, "tcp"),
    ("auto", IB, {"rdma": {**IB.to_meta(), "dev": ""}}, "tcp"),
    ("auto", IB, {"rdma": {k: v for k, v in IB.to_meta().items() if k != "lid"}}, "tcp"),
])
def test_path_for(mode, local, peer_meta, expected):
    assert path_for(mode, local, peer_meta) == expected


def test_importing_the_seam_or_the_rdma_module_never_imports_pyverbs():
    code = ("import sys\n"
            "sys.modules['pyverbs'] = None  # importing it would now raise\n"
            "import quilld.cluster.transfer\n"
            "assert 'quilld.cluster.rdma' not in sys.modules\n"
            "import quilld.cluster.rdma\n"
            "from quilld.cluster.transfer import probe_rdma\n"
            "print(probe_rdma().reason)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pyverbs not installed")


# -- Transfers: startup and routing ------------------------------------------------------------
def never_probe():
    raise AssertionError("probed although cluster.transfer is tcp")


def test_open_tcp_never_probes():
    t = Transfers("tcp", PeerPool())
    t.open(None, "n1", 256, probe=never_probe)
    assert t.chosen == "tcp" and t.advertise() == {}
    assert dict(t.info())["cluster_rdma_unavailable_reason"] == 'cluster.transfer is "tcp"'


def test_open_auto_without_a_device_is_tcp_and_says_why():
    t = Transfers("auto", PeerPool())
    t.open(bytearray(PAGE), "n1", 256, probe=lambda: RdmaProbe(None, "no active port (mlx5_0 port 1: down)"))
    info = dict(t.info())
    assert (t.chosen, t.rdma, t.advertise()) == ("tcp", None, {})
    assert info["cluster_transfer"] == "tcp" and info["cluster_transfer_mode"] == "auto"
    assert info["cluster_rdma_unavailable_reason"] == "no active port (mlx5_0 port 1: down)"


def test_open_rdma_without_a_device_refuses_to_start():
    t = Transfers("rdma", PeerPool())
    with pytest.raises(ConfigError, match="RDMA is unavailable: no RDMA device"):
        t.open(bytearray(PAGE), "n1", 256, probe=lambda: NONE)


def failing_opener(*args):
    raise RuntimeError("Failed to register a MR")


def test_open_auto_falls_back_when_setup_fails():
    t = Transfers("auto", PeerPool())
    t.open(bytearray(PAGE), "n1", 256, probe=lambda: RdmaProbe(IB), opener=failing_opener)
    assert t.chosen == "tcp" and t.advertise() == {}
    assert dict(t.info())["cluster_rdma_unavailable_reason"] == \
        "RDMA setup on mlx5_0 port 1 failed: Failed to register a MR"


def test_open_rdma_fails_when_setup_fails():
    t = Transfers("rdma", PeerPool())
    with pytest.raises(ConfigError, match="Failed to register a MR"):
        t.open(bytearray(PAGE), "n1", 256, probe=lambda: RdmaProbe(IB), opener=failing_opener)


class Recorder:
    """A Transfer that records its calls, optionally failing."""

    def __init__(self, name: str, fail: QuillError | None = None) -> None:
        self.name, self.fail, self.calls, self.closed = name, fail, [], False
        self.stats: Counter[str] = Counter()

    async def fetch_into(self, peer, addr, scope, key, target):
        self.calls.append(peer)
        view = target(4)
        if self.fail is not None:
            raise self.fail
        view[:] = self.name[:4].encode().ljust(4, b".")
        return crc32c.crc32c(view), view

    def forget(self, peer):
        self.calls.append(("forget", peer))

    def close(self):
        self.closed = True


def routed(mode: str, rdma_fail: QuillError | None = None):
    now = [1000.0]
    t = Transfers(mode, PeerPool(), clock=lambda: now[0])
    tcp, rdma = Recorder("tcp"), Recorder("rdma", rdma_fail)
    t.tcp = tcp
    t.open(bytearray(PAGE), "n1", 256, probe=lambda: RdmaProbe(IB), opener=lambda *a: rdma)
    return t, tcp, rdma, now


def fetch(t: Transfers, peer_meta, targets: list | None = None):
    def target(n):
        buf = bytearray(n)
        if targets is not None:
            targets.append(buf)
        return memoryview(buf)
    return asyncio.run(t.fetch_into("p2", ("127.0.0.1", 1), peer_meta, SCOPE, b"k", target))


def test_fetch_takes_rdma_when_both_ends_have_it():
    t, tcp, rdma, _ = routed("auto")
    assert t.advertise() == {"rdma": IB.to_meta()}
    crc, view = fetch(t, PEER_IB)
    assert bytes(view) == b"rdma" and crc == crc32c.crc32c(b"rdma")
    assert (rdma.calls, tcp.calls) == (["p2"], [])
    assert fetch(t, PEER_TCP)[1].tobytes() == b"tcp."
    assert (rdma.calls, tcp.calls) == (["p2"], ["p2"])
    info = dict(t.info())
    assert info["cluster_transfer_fetches_rdma"] == 1 and info["cluster_transfer_fetches_tcp"] == 1
    assert info["cluster_rdma_device"] == "mlx5_0:1" and info["cluster_rdma_unavailable_reason"] == ""


def test_auto_falls_back_to_tcp_into_the_same_memory_then_retries_rdma_later():
    t, tcp, rdma, now = routed("auto", rdma_fail=PeerError("RDMA READ failed with completion status 12"))
    targets: list = []
    crc, view = fetch(t, PEER_IB, targets)
    assert bytes(view) == b"tcp." and len(targets) == 1  # target called once across both tries
    assert (rdma.calls, tcp.calls) == (["p2"], ["p2"])
    fetch(t, PEER_IB)  # within the cool-down: straight to TCP
    assert (rdma.calls, tcp.calls) == (["p2"], ["p2", "p2"])
    now[0] += 31
    fetch(t, PEER_IB)
    assert rdma.calls == ["p2", "p2"]
    stats = dict(t.info())
    assert stats["cluster_transfer_rdma_fallbacks"] == 2 and stats["cluster_transfer_rdma_errors"] == 2


def test_rdma_mode_raises_instead_of_falling_back():
    t, tcp, rdma, _ = routed("rdma", rdma_fail=PeerError("RDMA READ did not complete in 5s"))
    with pytest.raises(PeerError, match="did not complete"):
        fetch(t, PEER_IB)
    assert tcp.calls == []


def test_close_closes_rdma_and_stops_advertising():
    t, tcp, rdma, _ = routed("auto")
    t.peer_gone("p2")
    assert rdma.calls == [("forget", "p2")]
    t.close()
    assert rdma.closed and t.advertise() == {} and t.path("p2", PEER_IB) == "tcp"


# -- TcpTransfer against a loopback RESP peer -------------------------------------------------
def test_tcp_transfer_over_a_real_connection():
    payload = os.urandom(300_000)

    async def main():
        accepted = []

        finished = []

        async def serve(reader, writer):
            accepted.append(1)
            parser = hiredis.Reader()
            try:
                while data := await reader.read(65536):
                    parser.feed(data)
                    while (cmd := parser.gets()) is not False:
                        assert cmd[:5] == [b"PEERGET", b"acme", b"llama", b"tok", b""] and cmd[6:] == [b"PXAT"]
                        if cmd[5] == b"hit":  # with the key's expiry, as PXAT asks
                            writer.write(b"*3\r\n:%d\r\n$%d\r\n%b\r\n:1234\r\n" % (
                                crc32c.crc32c(payload), len(payload), payload))
                        elif cmd[5] == b"miss":
                            writer.write(b"$-1\r\n")
                        else:
                            writer.write(b"-NOPERM node-to-node command\r\n")
                        await writer.drain()
            finally:
                writer.close()
                finished.append(1)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        addr = server.sockets[0].getsockname()[:2]
        pool = PeerPool()
        tcp = TcpTransfer(pool)
        buf = bytearray(len(payload))
        crc, view, expires = await tcp.fetch_into("p2", addr, SCOPE, b"hit", lambda n: memoryview(buf)[:n])
        assert crc == crc32c.crc32c(payload) and bytes(buf) == payload and expires == 1234
        assert await tcp.fetch_into("p2", addr, SCOPE, b"miss", lambda n: memoryview(bytearray(n))) == (None, None, -1)
        with pytest.raises(QuillError, match="NOPERM node-to-node command"):
            await tcp.fetch_into("p2", addr, SCOPE, b"err", lambda n: memoryview(bytearray(n)))
        assert len(accepted) == 1  # one connection, back in the pool after each reply
        assert await tcp.fetch_into("p2", addr, SCOPE, b"miss", lambda n: memoryview(bytearray(n))) == (None, None, -1)
        assert len(accepted) == 2  # peer_client closes a connection after an error reply; the next call reconnects
        pool.close()
        while len(finished) < len(accepted):  # the handlers see EOF and close their side
            await asyncio.sleep(0.01)
        server.close()
        await server.wait_closed()

    asyncio.run(main())


# -- the RDMA path against a fake device ------------------------------------------------------
class FakeQp:
    def __init__(self, device, qpn):
        self.device, self.qpn, self.remote, self.destroyed = device, qpn, None, False


class Fabric:
    """The wire between fake devices: memory regions by rkey, queue pairs by number."""

    def __init__(self):
        self.regions: dict[int, FakeDevice] = {}
        self.qps: dict[int, FakeQp] = {}
        self.qpns = itertools.count(0x100)
        self.rkeys = itertools.count(0x5000)


class FakeDevice:
    """PyverbsDevice's surface; a READ copies from the remote region at (raddr, rkey) into ours."""

    def __init__(self, fabric: Fabric, region: memoryview, info: RdmaInfo = IB):
        self.fabric, self.region, self.info = fabric, region, info
        self.base, self.length = address_of(region), len(region)
        self.rkey = next(fabric.rkeys)
        fabric.regions[self.rkey] = self
        self.mode = "ok"  # "ok", "error" (completion status 12) or "hang"
        self.hung: list[tuple] = []
        self.destroyed: list[FakeQp] = []
        self.closed = False

    def start(self, on_done):
        self.on_done = on_done

    def create_qp(self):
        qp = FakeQp(self, next(self.fabric.qpns))
        self.fabric.qps[qp.qpn] = qp
        return qp, QpInfo(qp.qpn, 42, self.info.lid, self.info.gid, self.info.mtu)

    def connect_qp(self, qp, local, remote):
        assert remote.qpn in self.fabric.qps and local.qpn == qp.qpn
        qp.remote = remote.qpn

    def post_read(self, qp, wr_id, laddr, length, raddr, rkey):
        assert not qp.destroyed and qp.remote is not None
        peer_qp = self.fabric.qps[qp.remote]
        assert peer_qp.remote == qp.qpn and not peer_qp.destroyed  # the handshake paired them both ways
        src = self.fabric.regions[rkey]
        assert src is peer_qp.device  # the rkey belongs to the node the queue pair reaches
        if self.mode == "hang":
            self.hung.append((qp, wr_id))
            return
        status = IBV_WC_SUCCESS if self.mode == "ok" else 12  # IBV_WC_RETRY_EXC_ERR
        if status == IBV_WC_SUCCESS:
            off_r, off_l = raddr - src.base, laddr - self.base
            assert 0 <= off_r <= src.length - length and 0 <= off_l <= self.length - length
            self.region[off_l:off_l + length] = src.region[off_r:off_r + length]
        asyncio.get_running_loop().call_soon(self.on_done, [(wr_id, status)])

    def destroy_qp(self, qp):
        qp.destroyed = True
        self.destroyed.append(qp)
        self.hung = [h for h in self.hung if h[0] is not qp]  # no DMA after destroy

    def close(self):
        self.closed = True


class LoopbackConn:
    """A PeerConnection stand-in that runs each command on the serving node in-process."""

    closed = False

    def __init__(self, server):
        self.server = server

    async def call(self, *args):
        args = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        self.server.calls.append(args[0])
        handler = {b"PEERGET": cmd_peerget, b"PEERRDMA": cmd_peerrdma,
                   b"PEERRELEASE": cmd_peerrelease}[args[0]]
        try:
            reply = handler(self.server.session, args)
        except QuillError as e:
            return hiredis.ReplyError(e.wire())
        return await as_received(reply)


async def as_received(reply):
    """A reply value as hiredis hands it to the caller."""
    if isinstance(reply, Pending):
        reply = await reply.awaitable
    if isinstance(reply, Pinned):
        data = bytes(reply.view)
        reply.release()
        return data
    if isinstance(reply, list):
        return [await as_received(r) for r in reply]
    return reply


class LoopbackPool:
    def __init__(self, server):
        self.server = server
        self.out = 0

    async def acquire(self, host, port):
        self.out += 1
        return LoopbackConn(self.server)

    def release(self, conn):
        self.out -= 1


def make_store(pages=64, inline_max=256) -> Keyspace:
    return Keyspace(DramConfig(size=pages * PAGE, inline_max=inline_max), ScopeRegistry())


class Pair:
    """Node n1 fetches from node n2 over the fake fabric; n2 runs the real command handlers."""

    def __init__(self, client_inline=256, read_timeout=1.0):
        self.fabric = Fabric()
        # the serving node's command handlers run on a real context; its cluster is a stand-in
        # holding just what they use (the RDMA transfer and the counters)
        cluster = SimpleNamespace(transfers=SimpleNamespace(rdma=None), stats=Counter())
        self.ctx = make_context(cluster=cluster)
        self.server_store, self.client_store = self.ctx.keyspace, make_store(inline_max=client_inline)
        self.server_dev = FakeDevice(self.fabric, self.server_store.arena._view)
        self.client_dev = FakeDevice(self.fabric, self.client_store.arena._view)
        self.calls: list[bytes] = []
        self.server_rdma = RdmaTransfer(self.server_dev, IB, self.server_store.arena._view, None, "n2", 256)
        cluster.transfers.rdma = self.server_rdma
        self.session = session(self.ctx, peer=True)
        self.pool = LoopbackPool(self)
        self.rdma = RdmaTransfer(self.client_dev, IB, self.client_store.arena._view, self.pool, "n1",
                                 client_inline, read_timeout=read_timeout)
        self.blocks: list[Block] = []

    def put(self, key: bytes, data: bytes) -> None:
        st = self.server_store
        st.publish(st.scopes.tag(SCOPE), key, st.materialize(data))

    def target(self, n: int) -> memoryview:
        st = self.client_store
        if n <= st.inline_max:
            return memoryview(bytearray(n))
        block = st.reserve(n)
        self.blocks.append(block)
        return st.view(block)

    def fetch(self, key: bytes):
        async def main():
            return await self.rdma.fetch_into("n2", ("127.0.0.1", 1), SCOPE, key, self.target)
        return asyncio.run(main())


def test_rdma_read_lands_in_the_arena_and_releases_the_lease():
    p = Pair()
    data = os.urandom(5 * PAGE + 123)
    p.put(b"big", data)
    crc, view, expires = p.fetch(b"big")
    assert bytes(view) == data and crc == crc32c.crc32c(data) and expires == -1
    assert p.client_store.arena.view(p.blocks[0].handle, len(data)).tobytes() == data  # straight into the block
    assert p.calls == [b"PEERRDMA", b"PEERGET", b"PEERRELEASE"]
    assert p.server_store.active_pins == 0 and len(p.server_rdma.leases) == 0
    assert p.pool.out == 0
    assert p.rdma.stats["rdma_reads"] == 1 and p.rdma.stats["rdma_read_bytes"] == len(data)
    p.fetch(b"big")
    assert p.calls.count(b"PEERRDMA") == 1  # one handshake per peer


def test_small_and_missing_values_come_inline():
    p = Pair(client_inline=8 * PAGE)
    p.put(b"tiny", b"x" * 100)  # inline bytes on the server
    p.put(b"mid", b"y" * (2 * PAGE))  # an arena block, but under this client's inline_max
    at = int(time.time() * 1000) + 60_000
    p.server_store.set_expire(p.server_store.scopes.tag(SCOPE), b"mid", at)
    _, view, expires = p.fetch(b"tiny")
    assert bytes(view) == b"x" * 100 and expires == -1
    _, view, expires = p.fetch(b"mid")
    assert bytes(view) == b"y" * (2 * PAGE) and expires == at  # the expiry comes with the bytes
    assert p.fetch(b"nope") == (None, None, -1)
    assert b"PEERRELEASE" not in p.calls and p.server_store.active_pins == 0
    assert p.rdma.stats["rdma_inline_replies"] == 2


def test_a_failed_read_tears_the_queue_pair_down_and_reconnects_next_time():
    p = Pair()
    p.put(b"big", os.urandom(3 * PAGE))
    p.client_dev.mode = "error"
    with pytest.raises(RdmaError, match="completion status 12"):
        p.fetch(b"big")
    first = p.client_dev.destroyed[0]
    assert first.destroyed and p.server_store.active_pins == 0
    p.client_dev.mode = "ok"
    assert p.fetch(b"big")[1] is not None
    assert p.calls.count(b"PEERRDMA") == 2
    assert p.server_dev.destroyed and p.server_dev.destroyed[0].remote == first.qpn  # the stale server QP went


def test_a_read_that_never_completes_times_out_without_late_dma():
    p = Pair(read_timeout=0.05)
    p.put(b"big", os.urandom(3 * PAGE))
    p.client_dev.mode = "hang"
    with pytest.raises(RdmaError, match="did not complete"):
        p.fetch(b"big")
    assert p.client_dev.hung == [] and p.client_dev.destroyed  # destroyed before fetch_into returned
    assert p.rdma.stats["rdma_read_timeouts"] == 1
    assert p.server_store.active_pins == 0 and len(p.server_rdma.leases) == 0


def test_reads_sharing_a_failed_queue_pair_fail_together():
    p = Pair(read_timeout=5.0)
    p.put(b"a", os.urandom(2 * PAGE))
    p.put(b"b", os.urandom(2 * PAGE))

    async def main():
        await p.rdma.fetch_into("n2", ("127.0.0.1", 1), SCOPE, b"a", p.target)  # connect first
        p.client_dev.mode = "hang"
        t1 = asyncio.ensure_future(p.rdma.fetch_into("n2", ("127.0.0.1", 1), SCOPE, b"a", p.target))
        t2 = asyncio.ensure_future(p.rdma.fetch_into("n2", ("127.0.0.1", 1), SCOPE, b"b", p.target))
        while len(p.client_dev.hung) < 2:
            await asyncio.sleep(0)
        t1.cancel()  # the reader goes away mid-READ: its queue pair goes too
        r = await asyncio.gather(t1, t2, return_exceptions=True)
        return r

    r1, r2 = asyncio.run(asyncio.wait_for(main(), 2.0))
    assert isinstance(r1, asyncio.CancelledError)
    assert isinstance(r2, RdmaError) and "queue pair failed" in r2.message


def test_rdma_target_must_be_inside_the_registered_arena():
    p = Pair()
    with pytest.raises(RdmaError, match="outside the registered arena"):
        p.rdma.local_address(memoryview(bytearray(PAGE)))
    with pytest.raises(RdmaError, match="not writable"):
        p.rdma.local_address(memoryview(b"read-only"))
    block = p.client_store.reserve(PAGE)
    assert p.rdma.local_address(p.client_store.view(block)) == \
        p.client_dev.base + p.client_store.arena.offset(block.handle)


def test_address_of_does_not_hold_the_arena():
    arena = DramArena(4 * PAGE)
    base = address_of(arena._view)
    h = arena.reserve(PAGE)
    assert address_of(arena.view(h, 10)) == base + arena.offset(h)
    assert ctypes.string_at(base + arena.offset(h), 3) == b"\0\0\0"
    arena.close()  # a held export would raise BufferError here


# -- the serving side's commands ---------------------------------------------------------------
def test_handlers_need_a_peer_and_rdma():
    p = Pair()
    stranger = session(p.ctx, peer=False)
    with pytest.raises(PeerOnly):
        cmd_peerrdma(stranger, [b"PEERRDMA", b"CONNECT", b"{}"])
    no_rdma = session(make_context(cluster=SimpleNamespace(transfers=SimpleNamespace(rdma=None))), peer=True)
    with pytest.raises(CommandError, match="RDMA is not enabled on this node"):
        cmd_peerget(no_rdma, [b"PEERGET", b"acme", b"llama", b"tok", b"", b"k", b"RDMA", b"257"])
    with pytest.raises(CommandError, match="syntax"):
        cmd_peerrdma(p.session, [b"PEERRDMA", b"DISCONNECT", b"{}"])
    with pytest.raises(CommandError, match="syntax"):
        cmd_peerget(p.session, [b"PEERGET", b"acme", b"llama", b"tok", b"", b"k", b"TCP", b"257"])


@pytest.mark.parametrize("raw", [
    b"not json", b"[1,2]", b'{"v":2}', b"{" + b" " * 2000 + b"}",
    b'{"v":1,"node":"n1","qpn":0,"psn":1,"lid":7,"gid":"%s","mtu":5}' % IB_GID.encode(),
    b'{"v":1,"node":"n1","qpn":5,"psn":16777216,"lid":7,"gid":"%s","mtu":5}' % IB_GID.encode(),
    b'{"v":1,"node":"n1","qpn":5,"psn":1,"lid":7,"gid":"nope","mtu":5}',
    b'{"v":1,"node":"n1","qpn":5,"psn":1,"lid":7,"gid":"%s","mtu":6}' % IB_GID.encode(),
    b'{"v":1,"node":7,"qpn":5,"psn":1,"lid":7,"gid":"%s","mtu":5}' % IB_GID.encode(),
])
def test_connect_rejects_malformed_queue_pairs(raw):
    p = Pair()
    with pytest.raises(CommandError, match="PEERRDMA"):
        cmd_peerrdma(p.session, [b"PEERRDMA", b"CONNECT", raw])
    assert p.server_dev.fabric.qps == {}  # nothing was created for it


def test_qp_info_round_trip():
    info = QpInfo(0x1234, 0xABCDE, 7, IB_GID, 4)
    assert QpInfo.from_json(info.to_json("n1"), "ib") == (info, "n1")


def test_a_lease_is_released_only_by_its_connection():
    p = Pair()
    p.put(b"big", os.urandom(2 * PAGE))
    reply = cmd_peerget(p.session, [b"PEERGET", b"acme", b"llama", b"tok", b"", b"big", b"RDMA", b"257"])
    crc, length, raddr, rkey, lease = reply  # without PXAT: no expiry in the reply
    assert (length, rkey) == (2 * PAGE, p.server_dev.rkey)
    assert p.server_store.active_pins == 1
    other = session(p.ctx, peer=True)
    assert cmd_peerrelease(other, [b"PEERRELEASE", str(lease).encode()]) == 0
    assert p.server_store.active_pins == 1
    assert cmd_peerrelease(p.session, [b"PEERRELEASE", str(lease).encode(), b"12345"]) == 1
    assert p.server_store.active_pins == 0
    cmd_peerget(p.session, [b"PEERGET", b"acme", b"llama", b"tok", b"", b"big", b"RDMA", b"257"])
    p.server_rdma.session_closed(p.session.id)  # the connection closed without releasing
    assert p.server_store.active_pins == 0


def test_leases_expire_and_close():
    now = [0.0]
    released: list[int] = []
    leases = Leases(ttl=10.0, clock=lambda: now[0])
    a = leases.grant(1, lambda: released.append(1))
    now[0] = 5.0
    leases.grant(2, lambda: released.append(2))
    now[0] = 10.0
    assert leases.reap() == 1 and released == [1] and not leases.release(a, 1)
    leases.grant(3, lambda: released.append(3))
    leases.close()
    assert sorted(released) == [1, 2, 3] and len(leases) == 0


def test_close_releases_leases_and_queue_pairs():
    p = Pair()
    p.put(b"big", os.urandom(2 * PAGE))
    p.fetch(b"big")
    cmd_peerget(p.session, [b"PEERGET", b"acme", b"llama", b"tok", b"", b"big", b"RDMA", b"257"])
    p.server_rdma.close()
    assert p.server_store.active_pins == 0 and p.server_dev.closed
    assert all(qp.destroyed for qp in p.fabric.qps.values() if qp.device is p.server_dev)
    p.rdma.forget("n2")
    assert all(qp.destroyed for qp in p.fabric.qps.values() if qp.device is p.client_dev)


def test_memlock_shortfall():
    assert memlock_shortfall(1 << 30, limit=64 << 10, euid=1000).startswith("RLIMIT_MEMLOCK is 65536 bytes")
    assert memlock_shortfall(1 << 30, limit=64 << 10, euid=0) == ""
    assert memlock_shortfall(1 << 30, limit=rdma_mod.resource.RLIM_INFINITY, euid=1000) == ""
    assert memlock_shortfall(1 << 20, limit=1 << 20, euid=1000) == ""
