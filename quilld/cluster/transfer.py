"""The transfer seam: how a block held by a peer gets into this node's arena.

Two paths sit behind one small interface (`Transfer.fetch_into`):

- TCP, always there: `PEERGET` over a pooled RESP connection, the payload
  received straight into the arena (cluster/peer_client.py);
- RDMA, the optional extra `quilld[rdma]` (cluster/rdma.py, imported only
  when this node will use it): one-sided RDMA READ from the peer's
  registered arena into ours, set up over the same TCP connection.

fabric.py holds what the paths share (the device description, the Transfer seam).

Which path is decided twice. Once at startup: `probe_rdma` looks for an RDMA
device with an active port and `choose_transfer` applies `cluster.transfer`
("auto" uses RDMA if there is a device, "tcp" never does, "rdma" refuses to
start without one). Then per fetch: `path_for` takes RDMA only when this node
has it enabled and the peer advertises a compatible device in its gossip meta
(`advertise`). `Transfers` holds the paths, routes each fetch, and in "auto"
falls back to TCP when an RDMA fetch fails; in "rdma" the failure is raised.

Nothing here imports pyverbs, nor cluster/rdma.py, at module level.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from quilld.cluster.fabric import ZERO_GID, Fetched, RdmaInfo, Target, Transfer
from quilld.cluster.peer_client import PeerError, PeerPool
from quilld.errors import ConfigError, QuillError
from quilld.model import IdentityScope

log = logging.getLogger("quilld.cluster")

MODES = ("auto", "tcp", "rdma")

# Values of the verbs ABI (rdma-core include/infiniband/verbs.h); stable across releases.
IBV_PORT_ACTIVE = 4  # enum ibv_port_state
PORT_STATES = {0: "nop", 1: "down", 2: "init", 3: "armed", 4: "active", 5: "active-defer"}
LINK_LAYERS = {0: "ib", 1: "ib", 2: "eth"}  # IBV_LINK_LAYER_{UNSPECIFIED,INFINIBAND,ETHERNET}
GID_TYPE_ROCE_V2 = 1  # enum ibv_gid_type_sysfs: IB_ROCE_V1 = 0, ROCE_V2 = 1

MAX_GID_SCAN = 16  # GID table entries looked at for a RoCE v2 address
RDMA_RETRY_AFTER = 30.0  # seconds a peer is fetched over TCP after an RDMA failure ("auto")



@dataclass(frozen=True)
class RdmaProbe:
    """What `probe_rdma` found: a usable port, or the reason there is none."""

    info: RdmaInfo | None
    reason: str = ""  # empty when info is set

    @property
    def available(self) -> bool:
        return self.info is not None


def probe_rdma() -> RdmaProbe:
    """The first RDMA port with an ACTIVE state, through pyverbs; never raises for "not there".

    Reasons, for logs and INFO: "pyverbs not installed ...", "pyverbs cannot be
    loaded: ..." (e.g. a pip-built pyverbs newer than the system's libibverbs),
    "no RDMA device (cannot list devices: ...)" (no kernel RDMA support),
    "no RDMA device", "no active port (mlx5_0 port 1: down; ...)".
    """
    try:
        importlib.import_module("pyverbs")
    except ModuleNotFoundError as e:
        if e.name == "pyverbs":
            return RdmaProbe(None, "pyverbs not installed (pip install -e '.[rdma]')")
        return RdmaProbe(None, f"pyverbs cannot be loaded: {e}")
    except ImportError as e:
        return RdmaProbe(None, f"pyverbs cannot be loaded: {e}")
    try:
        dev_mod = importlib.import_module("pyverbs.device")
    except ImportError as e:  # e.g. libibverbs.so.1 or one of its symbol versions missing
        return RdmaProbe(None, f"pyverbs cannot be loaded: {e}")
    try:
        devices = list(dev_mod.get_device_list())
    except Exception as e:  # PyverbsRDMAError when the kernel has no RDMA support at all
        return RdmaProbe(None, f"no RDMA device (cannot list devices: {e})")
    if not devices:
        return RdmaProbe(None, "no RDMA device")
    notes: list[str] = []
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            info = _probe_device(dev_mod, name, notes)
        except Exception as e:  # a device that cannot be opened or queried is skipped, with a note
            notes.append(f"{name}: {e}")
            continue
        if info is not None:
            return RdmaProbe(info)
    return RdmaProbe(None, "no active port (" + "; ".join(notes) + ")")


def _probe_device(dev_mod: Any, name: str, notes: list[str]) -> RdmaInfo | None:
    ctx = dev_mod.Context(name=name)
    try:
        for port in range(1, ctx.query_device().phys_port_cnt + 1):
            attr = ctx.query_port(port)
            if attr.state != IBV_PORT_ACTIVE:
                notes.append(f"{name} port {port}: {PORT_STATES.get(attr.state, attr.state)}")
                continue
            ll = LINK_LAYERS.get(attr.link_layer, "ib")
            gid_index, gid = _pick_gid(ctx, port, attr.gid_tbl_len, ll)
            if gid is None:
                notes.append(f"{name} port {port}: active but without a usable GID")
                continue
            return RdmaInfo(name, port, int(attr.lid), gid, int(attr.active_mtu), ll, gid_index)
        return None
    finally:
        ctx.close()


def _pick_gid(ctx: Any, port: int, table_len: int, ll: str) -> tuple[int, str | None]:
    """InfiniBand: GID 0. RoCE: the first RoCE v2 GID, else the first non-zero one."""
    if ll == "ib":
        return 0, str(ctx.query_gid(port, 0))
    first: tuple[int, str | None] = (0, None)
    for i in range(min(table_len, MAX_GID_SCAN)):
        try:
            gid = str(ctx.query_gid(port, i))
        except Exception:
            continue
        if gid == ZERO_GID:
            continue
        try:
            if ctx.query_gid_type(port, i) == GID_TYPE_ROCE_V2:
                return i, gid
        except Exception:
            pass
        if first[1] is None:
            first = (i, gid)
    return first


def choose_transfer(mode: str, probe: RdmaProbe) -> str:
    """At startup: "rdma" (used per peer when it has RDMA too) or "tcp"; ConfigError for "rdma" without a device."""
    if mode == "tcp":
        return "tcp"
    if mode == "auto":
        return "rdma" if probe.available else "tcp"
    if mode == "rdma":
        if not probe.available:
            raise ConfigError(f'cluster.transfer = "rdma" but RDMA is unavailable: {probe.reason}; '
                              'use "auto" or "tcp"')
        return "rdma"
    raise ConfigError(f"cluster.transfer must be one of {', '.join(MODES)}, got {mode!r}")


def advertise(chosen: str, local: RdmaInfo | None) -> dict:
    """This node's part of the gossip meta: its RDMA port when it takes RDMA reads, else nothing."""
    if chosen != "rdma" or local is None:
        return {}
    return {"rdma": local.to_meta()}


def path_for(mode: str, local: RdmaInfo | None, peer_meta: Any) -> str:
    """Per fetch: "rdma" only when the mode allows it, this node has RDMA and the peer advertises a match."""
    if mode == "tcp" or local is None or type(peer_meta) is not dict:
        return "tcp"
    peer = RdmaInfo.from_meta(peer_meta.get("rdma"))
    if peer is None or peer.link_layer != local.link_layer:
        return "tcp"
    return "rdma"


class TcpTransfer:
    """PEERGET over a pooled peer connection (peer_client.py does the work)."""

    name = "tcp"

    def __init__(self, pool: PeerPool) -> None:
        self.pool = pool

    async def fetch_into(self, peer: str, addr: tuple[str, int], scope: IdentityScope, key: bytes,
                         target: Target) -> Fetched:
        conn = await self.pool.acquire(*addr)
        try:
            return await conn.fetch_into(
                ("PEERGET", scope.tenant, scope.model, scope.tokenizer, scope.adapter, key, "PXAT"), target)
        finally:  # a connection that broke (or was cancelled mid-reply) is closed, and dropped here
            self.pool.release(conn)

    async def fetch_many(self, peer: str, addr: tuple[str, int], scope: IdentityScope, keys: list[bytes],
                         timeout: float) -> list:
        """Small values of `keys` in one PEERMGET: per key `[crc32c, bytes, pxat]` or None."""
        reply = await self.pool.call(*addr, "PEERMGET", scope.tenant, scope.model, scope.tokenizer, scope.adapter,
                                     *keys, timeout=timeout)
        if not isinstance(reply, list) or len(reply) != len(keys):
            raise PeerError(f"{peer}: unexpected PEERMGET reply {reply!r:.60}")
        return reply

    def close(self) -> None:
        pass  # the pool belongs to the cluster


class _Once:
    """`target` called at most once per length, so a fallback reuses the memory the first try took."""

    __slots__ = ("target", "length", "view")

    def __init__(self, target: Target) -> None:
        self.target = target
        self.length = -1
        self.view: memoryview | None = None

    def __call__(self, length: int) -> memoryview:
        if self.view is None or length != self.length:
            self.view, self.length = self.target(length), length
        return self.view


def _open_rdma(info: RdmaInfo, region: memoryview, pool: PeerPool, node_id: str, inline_max: int) -> Transfer:
    # The optional RDMA path is loaded only on a node that turns it on (no cycle: rdma.py
    # imports fabric.py, not this module); everywhere else the module is never imported.
    from quilld.cluster.rdma import RdmaTransfer

    return RdmaTransfer.open(info, region, pool, node_id, inline_max)


class Transfers:
    """The paths this node fetches peer blocks by, the choice between them, and their counters."""

    def __init__(self, mode: str, pool: PeerPool, clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self.pool = pool
        self.tcp: Transfer = TcpTransfer(pool)
        self.rdma: Any = None  # cluster/rdma.py RdmaTransfer once open() enabled it
        self.probe = RdmaProbe(None, "not probed")
        self.chosen = "tcp"
        self.stats: Counter[str] = Counter()
        self._clock = clock
        self._tcp_until: dict[str, float] = {}  # peer -> end of its TCP-only spell after an RDMA failure

    def open(self, region: memoryview | None, node_id: str, inline_max: int,
             probe: Callable[[], RdmaProbe] = probe_rdma, opener: Callable[..., Transfer] = _open_rdma) -> None:
        """At startup: probe, choose, and set RDMA up when chosen. ConfigError when "rdma" cannot be had."""
        if self.mode == "tcp":
            self.probe = RdmaProbe(None, 'cluster.transfer is "tcp"')
            self.chosen = "tcp"
            return
        self.probe = probe()
        self.chosen = choose_transfer(self.mode, self.probe)
        if self.chosen == "tcp":
            log.info("cluster: peer transfer over TCP (RDMA unavailable: %s)", self.probe.reason)
            return
        info = self.probe.info
        try:
            if region is None:
                raise QuillError("no DRAM arena to register")
            self.rdma = opener(info, region, self.pool, node_id, inline_max)
        except Exception as e:  # pyverbs raises its own errors; any of them means no RDMA here
            reason = f"RDMA setup on {info.device} port {info.port} failed: {e}"
            if self.mode == "rdma":
                raise ConfigError(f'cluster.transfer = "rdma" but {reason}; use "auto" or "tcp"') from None
            self.probe, self.chosen = RdmaProbe(None, reason), "tcp"
            log.warning("cluster: %s; peer transfer over TCP", reason)
            return
        log.info("cluster: RDMA reads enabled on %s port %d (%s)", info.device, info.port, info.link_layer)

    @property
    def local(self) -> RdmaInfo | None:
        return self.probe.info if self.rdma is not None else None

    def advertise(self) -> dict:
        return advertise(self.chosen, self.local)

    def path(self, peer: str, peer_meta: Any) -> str:
        path = path_for(self.mode, self.local, peer_meta)
        if path == "rdma" and self._tcp_until.get(peer, 0.0) > self._clock():
            return "tcp"
        return path

    async def fetch_into(self, peer: str, addr: tuple[str, int], peer_meta: Any, scope: IdentityScope,
                         key: bytes, target: Target) -> Fetched:
        """Read `key` from `peer` by the path `path()` picks; "auto" falls back to TCP when RDMA fails."""
        if self.path(peer, peer_meta) == "tcp":
            self.stats["transfer_fetches_tcp"] += 1
            return await self.tcp.fetch_into(peer, addr, scope, key, target)
        once = _Once(target)
        try:
            result = await self.rdma.fetch_into(peer, addr, scope, key, once)
        except QuillError as e:
            self.stats["transfer_rdma_errors"] += 1
            if self.mode == "rdma":
                log.error("cluster: RDMA fetch from %s failed: %s", peer, e.message)
                raise
            self._tcp_until[peer] = self._clock() + RDMA_RETRY_AFTER
            self.stats["transfer_rdma_fallbacks"] += 1
            log.warning("cluster: RDMA fetch from %s failed (%s); TCP for %ds", peer, e.message,
                        int(RDMA_RETRY_AFTER))
            self.stats["transfer_fetches_tcp"] += 1
            return await self.tcp.fetch_into(peer, addr, scope, key, once)
        self.stats["transfer_fetches_rdma"] += 1
        return result

    def peer_gone(self, peer: str) -> None:
        """A peer died or left: drop what was set up for it."""
        self._tcp_until.pop(peer, None)
        if self.rdma is not None:
            self.rdma.forget(peer)

    def session_closed(self, session_id: int) -> None:
        """A RESP connection closed: RDMA leases it held are released."""
        if self.rdma is not None:
            self.rdma.session_closed(session_id)

    def info(self) -> list[tuple[str, Any]]:
        local = self.local
        out: list[tuple[str, Any]] = [
            ("cluster_transfer_mode", self.mode), ("cluster_transfer", self.chosen),
            ("cluster_rdma_device", f"{local.device}:{local.port}" if local else ""),
            ("cluster_rdma_unavailable_reason", _info_text(self.probe.reason)),
        ]
        stats = Counter(self.stats)
        if self.rdma is not None:
            stats.update(self.rdma.stats)
        return out + [(f"cluster_{k}", v) for k, v in sorted(stats.items())]

    async def fetch_many(self, peer: str, addr: tuple[str, int], scope: IdentityScope, keys: list[bytes],
                         timeout: float) -> list:
        """Small values, many at once: always over TCP (an RDMA read pays off for large blocks)."""
        return await self.tcp.fetch_many(peer, addr, scope, keys, timeout)

    def close(self) -> None:
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        self.tcp.close()


def _info_text(s: str) -> str:
    """An INFO value on one line that redis-py will not read as a dict (no ',' or '=')."""
    return s.replace("\r", " ").replace("\n", " ").replace(",", ";").replace("=", ":")
