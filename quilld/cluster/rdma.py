"""One-sided RDMA READ of peer blocks: the optional extra `quilld[rdma]`, over pyverbs.

NOT EXERCISED ON RDMA HARDWARE. The machines this was written on have no
RDMA device. The unit tests run everything here except `PyverbsDevice`
(the only class that calls pyverbs) against a fake device that copies
between two real arenas: the handshake, leases, addresses, completions,
timeouts and error paths. Whether the verbs calls in `PyverbsDevice` bring
an RC queue pair up and complete a READ on a real NIC is untested.

The protocol, over the peers' existing authenticated RESP connection:

1. `PEERRDMA CONNECT <json>`: once per peer, the fetching node sends its
   queue pair (qpn, psn, lid, gid, mtu) and node id; the serving node creates
   an RC queue pair for it, brings it up against the caller's, and answers
   with its own. The caller then brings its queue pair up.
2. `PEERGET tenant model tokenizer adapter key RDMA min_bytes`: nil, or
   `[crc32c, payload]` (values under min_bytes, inline or only on SSD: they
   come over TCP as with plain PEERGET), or
   `[crc32c, length, remote_addr, rkey, lease]`: the block stays pinned on the
   serving node until `PEERRELEASE lease`, or the connection closes, or
   LEASE_TTL passes (a bound for a vanished reader, not the reader's guard).
3. The fetching node posts one IBV_WR_RDMA_READ from (remote_addr, rkey) into
   its own arena view, waits for the completion (the completion channel's fd
   on the event loop) for at most READ_TIMEOUT, then releases the lease.
   `Cluster.fetch` verifies the CRC32C as for TCP: a lease that ran out
   under a slow READ shows as a checksum failure, never as wrong data.

Both nodes register their whole DRAM arena once (LOCAL_WRITE | REMOTE_READ).
Registration pins the arena's pages: with RDMA the arena costs its full size
in memory from the start, and RLIMIT_MEMLOCK must allow it.

pyverbs is imported only by `PyverbsDevice`: this module imports without it.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import logging
import os
import resource
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import hiredis

from quilld.cluster.fabric import Fetched, RdmaInfo, Target
from quilld.cluster.peer_client import PeerError, PeerPool
from quilld.errors import CommandError, QuillError
from quilld.model import IdentityScope

log = logging.getLogger("quilld.cluster")

# Values of the verbs ABI (rdma-core include/infiniband/verbs.h).
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_READ = 1 << 2
IBV_QPT_RC = 2
IBV_WR_RDMA_READ = 4
IBV_SEND_SIGNALED = 1 << 1
IBV_WC_SUCCESS = 0
QP_GONE = -1  # completion status given to reads whose queue pair was destroyed under them

SEND_DEPTH = 64  # RDMA READs in flight on one queue pair
CQ_DEPTH = 4096
MAX_RD_ATOMIC = 16  # outstanding READs a queue pair asks for / answers (capped by the device)
READ_TIMEOUT = 5.0  # seconds one READ may take before its queue pair is torn down
LEASE_TTL = 15.0  # seconds a block stays pinned for a reader that never released it
MAX_LEASES = 65_536
MAX_SERVER_QPS = 1024
MAX_CONNECT_JSON = 1024  # bytes of a PEERRDMA CONNECT argument
MAX_READ_BYTES = (1 << 31) - 1  # an ibv_sge length is 32 bits


class RdmaError(PeerError):
    """An RDMA set-up or transfer failure (the caller may fall back to TCP)."""


@dataclass(frozen=True)
class QpInfo:
    """What one end of an RC queue pair tells the other."""

    qpn: int
    psn: int
    lid: int
    gid: str
    mtu: int

    def to_json(self, node_id: str = "") -> bytes:
        return json.dumps({"v": 1, "node": node_id, "qpn": self.qpn, "psn": self.psn, "lid": self.lid,
                           "gid": self.gid, "mtu": self.mtu}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, ll: str) -> tuple[QpInfo, str]:
        """(the queue pair, the sender's node id); CommandError for anything malformed."""
        if len(raw) > MAX_CONNECT_JSON:
            raise CommandError(f"PEERRDMA: queue pair description over {MAX_CONNECT_JSON} bytes")
        try:
            d = json.loads(bytes(raw))
        except ValueError:
            raise CommandError("PEERRDMA: queue pair description is not JSON") from None
        if type(d) is not dict or d.get("v") != 1:
            raise CommandError("PEERRDMA: unsupported queue pair description")
        node, qpn, psn = d.get("node", ""), d.get("qpn"), d.get("psn")
        port = RdmaInfo.from_meta({"dev": "peer", "port": 1, "lid": d.get("lid"), "gid": d.get("gid"),
                                   "mtu": d.get("mtu"), "ll": ll})
        if port is None or type(node) is not str or len(node) > 256 or not (
                type(qpn) is int and 0 < qpn < 1 << 24 and type(psn) is int and 0 <= psn < 1 << 24):
            raise CommandError("PEERRDMA: invalid queue pair description")
        return cls(qpn, psn, port.lid, port.gid, port.mtu), node


def address_of(view: memoryview | bytearray) -> int:
    """The address of a writable buffer's first byte (the buffer is not held afterwards)."""
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def memlock_shortfall(nbytes: int, limit: int | None = None, euid: int | None = None) -> str:
    """Why registering `nbytes` would fail on RLIMIT_MEMLOCK, or "" when it should not."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if euid is None:
        euid = os.geteuid()
    if euid == 0 or limit == resource.RLIM_INFINITY or limit >= nbytes:
        return ""  # root usually has CAP_IPC_LOCK; if not, ibv_reg_mr says so
    return (f"RLIMIT_MEMLOCK is {limit} bytes but the arena to register is {nbytes}: "
            "raise it (ulimit -l unlimited, or LimitMEMLOCK=infinity in the unit)")


class PyverbsDevice:
    """The only code that calls pyverbs: one device context, PD, arena MR, CQ and completion channel.

    UNTESTED ON HARDWARE (see the module docstring). Everything else in this
    module talks to it through these methods, which a test fake provides:
    `base`, `length`, `rkey`; `start(on_done)`, `create_qp() -> (qp, QpInfo)`,
    `connect_qp(qp, local, remote)`, `post_read(qp, wr_id, laddr, length,
    raddr, rkey)`, `destroy_qp(qp)`, `close()`.
    """

    def __init__(self, info: RdmaInfo, region: memoryview) -> None:
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD

        self.info = info
        self.base, self.length = address_of(region), len(region)
        short = memlock_shortfall(self.length)
        if short:
            raise RdmaError(short)
        self.ctx = Context(name=info.device)
        try:
            attr = self.ctx.query_device()
            self.rd_init = max(1, min(attr.max_qp_init_rd_atom, MAX_RD_ATOMIC))
            self.rd_dest = max(1, min(attr.max_qp_rd_atom, MAX_RD_ATOMIC))
            self.pd = PD(self.ctx)
            # the arena outlives this MR: Transfers.close() runs in Cluster.stop(), before the store closes
            self.mr = MR(self.pd, self.length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ, address=self.base)
            self.channel = CompChannel(self.ctx)
            self.cq = CQ(self.ctx, CQ_DEPTH, None, self.channel, 0)
        except BaseException:
            self.ctx.close()
            raise
        self.lkey, self.rkey = self.mr.lkey, self.mr.rkey
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, on_done: Callable[[list[tuple[int, int]]], None]) -> None:
        fd = self.channel.fd
        os.set_blocking(fd, False)
        self.cq.req_notify()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._on_event, on_done)

    def _on_event(self, on_done: Callable[[list[tuple[int, int]]], None]) -> None:
        try:
            self.channel.get_cq_event(self.cq)
        except Exception:
            return  # spurious wake-up (EAGAIN)
        self.cq.ack_events(1)
        self.cq.req_notify()  # re-arm before polling, so a completion landing now is not missed
        done: list[tuple[int, int]] = []
        while True:
            n, wcs = self.cq.poll(64)
            done += [(wc.wr_id, wc.status) for wc in wcs]
            if n < 64:
                break
        if done:
            on_done(done)

    def create_qp(self) -> tuple[Any, QpInfo]:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=SEND_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        qp = QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1))
        i = self.info
        return qp, QpInfo(qp.qp_num, secrets.randbits(24), i.lid, i.gid, i.mtu)

    def connect_qp(self, qp: Any, local: QpInfo, remote: QpInfo) -> None:
        """RESET -> INIT -> RTR -> RTS against the remote queue pair."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        i = self.info
        attr = QPAttr(port_num=i.port, path_mtu=min(local.mtu, remote.mtu))
        attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote.qpn, remote.psn, local.psn
        attr.max_dest_rd_atomic, attr.max_rd_atomic = self.rd_dest, self.rd_init
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        if i.link_layer == "eth" or remote.lid == 0:  # RoCE, or IB across subnets: route by GID
            gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=i.gid_index, hop_limit=64)
            attr.ah_attr = AHAttr(dlid=remote.lid, port_num=i.port, is_global=1, gr=gr)
        else:
            attr.ah_attr = AHAttr(dlid=remote.lid, port_num=i.port)
        qp.to_rts(attr)

    def post_read(self, qp: Any, wr_id: int, laddr: int, length: int, raddr: int, rkey: int) -> None:
        from pyverbs.wr import SGE, SendWR

        wr = SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(laddr, length, self.lkey)],
                    send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, raddr)
        qp.post_send(wr)

    def destroy_qp(self, qp: Any) -> None:
        """After this returns the device does no more DMA for the queue pair's requests."""
        qp.close()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.channel.fd)
            self._loop = None
        self.ctx.close()  # closes the CQ, channel, MR and PD it made


class Leases:
    """Blocks pinned for remote readers (serving side), each owned by the connection that asked."""

    def __init__(self, ttl: float = LEASE_TTL, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._ids = itertools.count(1)
        self._leases: OrderedDict[int, tuple[int, float, Callable[[], None]]] = OrderedDict()  # in expiry order
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, session_id: int, release: Callable[[], None]) -> int:
        self.reap()
        if len(self._leases) >= MAX_LEASES:
            raise CommandError("PEERGET RDMA: too many blocks leased to peers; use plain PEERGET")
        lease = next(self._ids)
        self._leases[lease] = (session_id, self.clock() + self.ttl, release)
        return lease

    def release(self, lease: int, session_id: int) -> bool:
        entry = self._leases.get(lease)
        if entry is None or entry[0] != session_id:
            return False
        del self._leases[lease]
        entry[2]()
        return True

    def session_closed(self, session_id: int) -> int:
        mine = [k for k, (sid, _, _) in self._leases.items() if sid == session_id]
        for k in mine:
            self._leases.pop(k)[2]()
        return len(mine)

    def reap(self) -> int:
        now, n = self.clock(), 0
        while self._leases:
            lease, (_, deadline, release) = next(iter(self._leases.items()))
            if deadline > now:
                break
            del self._leases[lease]
            release()
            n += 1
        self.expired += n
        return n

    def close(self) -> None:
        while self._leases:
            self._leases.popitem(last=False)[1][2]()


class _ClientQp:
    __slots__ = ("qp", "pending", "slots", "dead")

    def __init__(self, qp: Any) -> None:
        self.qp = qp
        self.pending: set[int] = set()
        self.slots = asyncio.Semaphore(SEND_DEPTH)
        self.dead = False


class RdmaTransfer:
    """The RDMA path of the transfer seam: both the fetching side and the serving side's state."""

    name = "rdma"

    def __init__(self, device: Any, info: RdmaInfo, region: memoryview, pool: PeerPool, node_id: str,
                 inline_max: int, read_timeout: float = READ_TIMEOUT, leases: Leases | None = None) -> None:
        self.device = device
        self.info = info
        self.region_len = len(region)
        self.pool = pool
        self.node_id = node_id
        self.min_bytes = inline_max + 1  # smaller values land in bytes, not the arena: TCP brings them
        self.read_timeout = read_timeout
        self.leases = leases or Leases()
        self.stats: Counter[str] = Counter()
        self._client: dict[str, _ClientQp] = {}  # peer node id -> our queue pair to it
        self._connecting: dict[str, asyncio.Lock] = {}
        self._server: dict[str, Any] = {}  # peer node id -> the queue pair we serve it on
        self._pending: dict[int, tuple[asyncio.Future, _ClientQp]] = {}
        self._wr_ids = itertools.count(1)
        device.start(self._on_done)

    @classmethod
    def open(cls, info: RdmaInfo, region: memoryview, pool: PeerPool, node_id: str,
             inline_max: int) -> RdmaTransfer:
        return cls(PyverbsDevice(info, region), info, region, pool, node_id, inline_max)

    # -- fetching side ----------------------------------------------------------------
    async def fetch_into(self, peer: str, addr: tuple[str, int], scope: IdentityScope, key: bytes,
                         target: Target) -> Fetched:
        cqp = await self._queue_pair(peer, addr)
        conn = await self.pool.acquire(*addr)
        try:
            reply = _checked(await conn.call("PEERGET", scope.tenant, scope.model, scope.tokenizer,
                                             scope.adapter, key, "RDMA", self.min_bytes, "PXAT"))
            if reply is None:
                result: Fetched = (None, None, -1)
            elif _is_inline(reply):
                view = target(len(reply[1]))
                view[:] = reply[1]
                result = (reply[0], view, reply[2])
                self.stats["rdma_inline_replies"] += 1
            elif _is_lease(reply):
                crc, length, raddr, rkey, lease, pxat = reply
                try:
                    view = target(length)
                    await self._read(cqp, view, raddr, rkey)
                except QuillError:
                    try:  # best effort: the lease also ends with the connection or its TTL
                        await conn.call("PEERRELEASE", lease)
                    except QuillError:
                        pass
                    raise
                _checked(await conn.call("PEERRELEASE", lease))
                result = (crc, view, pxat)
                self.stats["rdma_reads"] += 1
                self.stats["rdma_read_bytes"] += length
            else:
                raise RdmaError(f"peer {peer}: unexpected PEERGET RDMA reply")
        finally:
            self.pool.release(conn)  # closed (and so dropped) when the connection itself broke
        return result

    async def _queue_pair(self, peer: str, addr: tuple[str, int]) -> _ClientQp:
        cqp = self._client.get(peer)
        if cqp is not None and not cqp.dead:
            return cqp
        lock = self._connecting.setdefault(peer, asyncio.Lock())
        async with lock:
            cqp = self._client.get(peer)
            if cqp is not None and not cqp.dead:
                return cqp
            try:
                qp, local = self.device.create_qp()
            except Exception as e:  # pyverbs errors
                raise RdmaError(f"cannot create a queue pair: {e}") from None
            try:
                conn = await self.pool.acquire(*addr)
                try:
                    reply = _checked(await conn.call("PEERRDMA", "CONNECT", local.to_json(self.node_id)))
                finally:
                    self.pool.release(conn)
                if not isinstance(reply, bytes):
                    raise RdmaError(f"peer {peer}: unexpected PEERRDMA reply")
                try:
                    remote, _ = QpInfo.from_json(reply, self.info.link_layer)
                except CommandError as e:
                    raise RdmaError(f"peer {peer}: {e.message}") from None
                self.device.connect_qp(qp, local, remote)
            except QuillError:
                self.device.destroy_qp(qp)
                raise
            except Exception as e:  # pyverbs errors from connect_qp
                self.device.destroy_qp(qp)
                raise RdmaError(f"peer {peer}: cannot connect the queue pair: {e}") from None
            cqp = self._client[peer] = _ClientQp(qp)
            self.stats["rdma_connects"] += 1
            return cqp

    def local_address(self, view: memoryview) -> int:
        """The address of `view`, which must lie inside the registered arena."""
        if not view.nbytes:
            raise RdmaError("RDMA READ of nothing")
        try:
            laddr = address_of(view)
        except (TypeError, ValueError) as e:
            raise RdmaError(f"RDMA READ target is not writable memory: {e}") from None
        if not self.device.base <= laddr <= self.device.base + self.region_len - view.nbytes:
            raise RdmaError("RDMA READ target lies outside the registered arena")
        return laddr

    async def _read(self, cqp: _ClientQp, view: memoryview, raddr: int, rkey: int) -> None:
        """One RDMA READ of len(view) bytes from (raddr, rkey) into `view`.

        On any failure the queue pair is destroyed before this returns, so no
        late DMA can land in memory the caller is about to give back.
        """
        laddr = self.local_address(view)
        if view.nbytes > MAX_READ_BYTES:
            raise RdmaError(f"block of {view.nbytes} bytes is too large for one RDMA READ")
        async with cqp.slots:
            if cqp.dead:
                raise RdmaError("queue pair failed")
            wr_id = next(self._wr_ids)
            fut = asyncio.get_running_loop().create_future()
            self._pending[wr_id] = (fut, cqp)
            cqp.pending.add(wr_id)
            try:
                self.device.post_read(cqp.qp, wr_id, laddr, view.nbytes, raddr, rkey)
                status = await asyncio.wait_for(asyncio.shield(fut), self.read_timeout)
            except asyncio.TimeoutError:
                self.stats["rdma_read_timeouts"] += 1
                self._kill(cqp)
                raise RdmaError(f"RDMA READ did not complete in {self.read_timeout:g}s") from None
            except QuillError:
                self._kill(cqp)
                raise
            except BaseException as e:  # a pyverbs error from post_send, or cancellation
                self._kill(cqp)
                if isinstance(e, Exception):
                    raise RdmaError(f"cannot post the RDMA READ: {e}") from None
                raise
            finally:
                self._pending.pop(wr_id, None)
                cqp.pending.discard(wr_id)
            if status != IBV_WC_SUCCESS:
                self.stats["rdma_read_errors"] += 1
                self._kill(cqp)  # an RC queue pair is in the error state after a failed request
                if status == QP_GONE:
                    raise RdmaError("RDMA READ abandoned: its queue pair failed")
                raise RdmaError(f"RDMA READ failed with completion status {status}")

    def _on_done(self, done: list[tuple[int, int]]) -> None:
        for wr_id, status in done:
            entry = self._pending.get(wr_id)
            if entry is not None and not entry[0].done():
                entry[0].set_result(status)

    def _kill(self, cqp: _ClientQp) -> None:
        """Destroy a failed queue pair; reads still waiting on it fail now, not at their timeout."""
        if cqp.dead:
            return
        cqp.dead = True
        for peer, q in list(self._client.items()):
            if q is cqp:
                del self._client[peer]
        self.device.destroy_qp(cqp.qp)
        for wr_id in list(cqp.pending):
            fut = self._pending[wr_id][0]
            if not fut.done():
                fut.set_result(QP_GONE)

    # -- serving side ------------------------------------------------------------------
    def accept(self, payload: bytes) -> bytes:
        """PEERRDMA CONNECT: a queue pair for the caller, brought up against its own; ours as JSON."""
        remote, node = QpInfo.from_json(payload, self.info.link_layer)
        old = self._server.pop(node, None) if node else None
        if old is not None:
            self.device.destroy_qp(old)  # the peer restarted or reconnected
        if len(self._server) >= MAX_SERVER_QPS:
            raise CommandError("PEERRDMA: too many peer queue pairs")
        qp, local = self.device.create_qp()
        try:
            self.device.connect_qp(qp, local, remote)
        except Exception as e:
            self.device.destroy_qp(qp)
            raise CommandError(f"PEERRDMA: cannot connect the queue pair: {e}") from None
        self._server[node or f"?{local.qpn}"] = qp
        self.stats["rdma_accepts"] += 1
        return local.to_json(self.node_id)

    def forget(self, peer: str) -> None:
        """A peer died or left: its queue pairs, both ways, go."""
        cqp = self._client.get(peer)
        if cqp is not None:
            self._kill(cqp)
        self._connecting.pop(peer, None)
        qp = self._server.pop(peer, None)
        if qp is not None:
            self.device.destroy_qp(qp)

    def session_closed(self, session_id: int) -> None:
        self.stats["rdma_leases_dropped"] += self.leases.session_closed(session_id)

    def close(self) -> None:
        self.leases.close()
        for cqp in list(self._client.values()):
            self._kill(cqp)
        for qp in self._server.values():
            self.device.destroy_qp(qp)
        self._server.clear()
        self.device.close()


def _checked(reply: Any) -> Any:
    if isinstance(reply, hiredis.ReplyError):
        raise QuillError(str(reply))
    return reply


def _is_inline(r: Any) -> bool:  # [crc, bytes, pxat]
    return type(r) is list and len(r) == 3 and type(r[0]) is int and type(r[1]) is bytes and type(r[2]) is int


def _is_lease(r: Any) -> bool:  # [crc, length, remote address, rkey, lease, pxat]
    return (type(r) is list and len(r) == 6 and all(type(x) is int for x in r)
            and 0 < r[1] <= MAX_READ_BYTES and r[2] > 0)
