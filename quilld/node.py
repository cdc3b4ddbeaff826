"""Builds a quilld node's parts and owns their start and stop order; nothing else.

Start: admin API (its probes answer while the node starts; its other routes
answer 503 until it serves), SSD recovery (before anything is served), RESP
listener, control plane (engine subscriptions), cluster, gateway, housekeeping.
Stop: stop accepting, leave the cluster, drain replies still being sent,
close connections, stop housekeeping, gateway and admin API, stop the control
plane, drop open puts, flush the SSD tier, release the arena. Each step is
guarded: a part whose stop fails is logged and the next steps still run (a
RocksDB index that cannot close on a full disk never costs the SSD flush);
`stop_failed` names the parts (cli.py then exits 1).

`stop` may be called at any moment of `start` (a signal cancels `start`, or a
step of it failed): it undoes the steps that were taken, in the same order. SSD
recovery runs in a worker thread that cannot be interrupted, so a stop during
recovery waits for it to end, then stops the tier as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import inspect
import logging
import os
import socket
import stat
import time

from quilld import __version__, native
from quilld.cluster.cluster import Cluster
from quilld.cluster.gossip import GossipBindError
from quilld.config import SHM_SLOTS, Config, map_user_names, shm_leases_per_user
from quilld.http.admin import AdminServer
from quilld.http.gateway import Gateway
from quilld.http.metrics import NodeMetrics
from quilld.index.control import ControlPlane
from quilld.index.residency_feed import ResidencyFeed
from quilld.protocol.clients import Clients
from quilld.protocol.commands import build_table
from quilld.protocol.commands.blocks import large_target, release_args
from quilld.context.node_context import NodeContext
from quilld.context.figures import human
from quilld.context.open_files import fit_open_files
from quilld.errors import ConfigError
from quilld.protocol.server import RespConnection
from quilld.scopes import ScopeRegistry
from quilld.security import Users
from quilld.tiers.arena import check_arena_size
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.leases import LeaseTable
from quilld.tiers.lookup_table import LookupTable, table_slots
from quilld.tiers.puts import TwoPhasePuts
from quilld.tiers.tiering import Tiering

log = logging.getLogger("quilld")


class ListenError(OSError):
    """A listener could not open its port; the message names the listener, its flag and key."""


# each listener: what it is, its flag, its config key, the protocols its port is bound with
RESP, ADMIN, GOSSIP, GATEWAY = (("RESP", "--port", "server.port", ("tcp",)),
                                ("admin API", "--admin-port", "admin.port", ("tcp",)),
                                ("gossip", "--gossip-port", "cluster.gossip_port", ("udp", "tcp")),
                                ("gateway", "--gateway-port", "gateway.port", ("tcp",)))


def port_holder(port: int, protocols: tuple[str, ...] = ("tcp", "udp")) -> str:
    """Who else holds `port` over one of `protocols` (any address; TCP: listening): "pid N
    (command)", or "" when it cannot be told (another user's process, or no /proc).

    This process is never named: a listener bound with two protocols (gossip: UDP, then TCP) holds
    the port itself when its second bind fails, and /proc lists pids in no order that says who came
    first once they wrap."""
    inodes = set()
    for proto in protocols:
        for table in (proto, f"{proto}6"):
            try:
                with open(f"/proc/net/{table}") as f:
                    next(f)
                    for line in f:
                        parts = line.split()
                        if int(parts[1].rsplit(":", 1)[1], 16) == port and (proto == "udp" or parts[3] == "0A"):
                            inodes.add(parts[9])
            except (OSError, ValueError, IndexError, StopIteration):
                continue
    if not inodes:
        return ""
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == me:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {pid} ({cmd[:80]})"
        except OSError:
            continue
    return ""


@contextlib.asynccontextmanager
async def _listening(listener: tuple[str, str, str], bind: str, port: int):
    """Turn an OSError from opening `listener` into a ListenError that says which one it was (and,
    when its port is taken, by whom)."""
    try:
        yield
    except OSError as e:
        what, flag, key, protocols = listener
        if e.errno == errno.EADDRINUSE:
            if isinstance(e, GossipBindError):  # which of its two sockets failed
                protocols = (e.protocol,)
            holder = port_holder(port, protocols) if port else ""
            reason = "the port is in use" + (f" by {holder}" if holder else "")
        else:
            reason = e.strerror or str(e)
        raise ListenError(e.errno, f"the {what} listener cannot open {bind}:{port}: {reason} "
                                   f"(set another with {flag} or {key}; [Errno {e.errno}])") from e


async def _unix_listener(path: str, mode: int, factory) -> asyncio.AbstractServer:
    """The RESP listener on a unix socket (server.unixsocket), its file set to `mode`.

    A socket file nobody listens on (left by a quilld that was killed) is replaced; a live one,
    or a path that is not a socket, is a ListenError naming the key."""
    def refuse(reason: str, err: int) -> ListenError:
        return ListenError(err, f"the unix socket listener cannot open {path}: {reason} "
                                f"(set another with --unixsocket or server.unixsocket; [Errno {err}])")

    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise refuse(e.strerror or str(e), e.errno) from e
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise refuse("the path exists and is not a socket", errno.EEXIST)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: its quilld is gone
        except OSError:
            pass  # not ours to judge: create_unix_server says why
        else:
            raise refuse("another process is listening on it", errno.EADDRINUSE)
        finally:
            probe.close()
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_unix_server(factory, path, backlog=1024)
    except OSError as e:
        raise refuse("the path is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e)), e.errno) from e
    os.chmod(path, mode)
    return server


async def _stop_step(failed: list[str], what: str, stop) -> None:
    """Run one part's stop (a plain or async callable); a failure is logged and noted in `failed`,
    and the stop goes on: no part failing skips another's stop (the SSD tier's flush above all)."""
    try:
        result = stop()
        if inspect.isawaitable(result):
            await result
    except Exception as e:  # noqa: BLE001 - whatever it was, the next part still stops
        failed.append(what)
        log.error("stopping %s failed (the stop goes on): %s", what, e, exc_info=e)


HOUSEKEEPING_INTERVAL = 0.05  # seconds between expiry sweeps, lease checks and pin checks
DRAIN_TIMEOUT = 5.0  # seconds shutdown waits for replies still being written


class Node:
    def __init__(self, cfg: Config, config_file: str = "") -> None:
        self.cfg = cfg
        node_id = cfg.server.node_id or f"{socket.gethostname()}:{cfg.server.port}"
        too_big = check_arena_size(cfg.dram.size)  # refuses an arena larger than the machine (ConfigError)
        if too_big:
            log.warning("%s", too_big)
        scopes = ScopeRegistry(cfg.security.max_scopes_per_tenant)
        keyspace = Keyspace(cfg.dram, scopes, cfg.security.max_unfilled_bytes_per_tenant)
        self._space = asyncio.Event()  # set (and replaced) when arena space is freed while writers wait
        self._space_waiters = 0
        keyspace.on_free = self._space_freed
        tiering = Tiering(keyspace, cfg.ssd, self.space_freed) if cfg.ssd.dir else None
        control = ControlPlane(cfg, scopes)
        self.feed = ResidencyFeed(control.index, node_id, scopes)
        keyspace.listener = self.feed
        # in a cluster every value is placed in the directory, small ones too (from the first write)
        keyspace.track_all = cfg.cluster.enabled
        control.pool = [node_id]  # pool nodes whose copies ROUTE can fetch from
        control.node_id = node_id  # where an engine with no locality stores its KV
        self.ctx = NodeContext(
            cfg=cfg, node_id=node_id, keyspace=keyspace,
            puts=TwoPhasePuts(keyspace, cfg.blocks.default_lease_ms, cfg.blocks.max_lease_ms,
                              cfg.security.max_open_puts_per_tenant),
            scopes=scopes, users=Users.from_config(cfg.security), control=control, table=build_table(),
            clients=Clients(cfg.server.max_clients, on_close=self._session_closed,
                            tracking_max_keys=cfg.server.tracking_table_max_keys),
            tiering=tiering, config_file=config_file, port=cfg.server.port, admin_port=cfg.admin.port,
            gateway_port=cfg.gateway.port, space_freed=self.space_freed)
        if cfg.server.unixsocket:  # the shared-memory path's read leases live beside the unix socket
            self.ctx.leases = LeaseTable(keyspace, SHM_SLOTS, cfg.server.shm_lease_ms, cfg.server.shm_max_leases,
                                         shm_leases_per_user(cfg))
            mappers = map_user_names(cfg.security.map_users)
            slots = table_slots(cfg.server.shm_lookup_slots, keyspace.capacity)
            if mappers and slots:  # and the lookup table that mapped clients read blocks by, no round trip
                keyspace.lookup_table = LookupTable(keyspace, slots, mappers)
        self._unix: asyncio.AbstractServer | None = None
        self.metrics = NodeMetrics(self.ctx)  # its registry; observers handed to the control plane and SSD tier
        self._server: asyncio.AbstractServer | None = None
        self._admin: AdminServer | None = None
        self._gateway: Gateway | None = None
        self._tasks: list[asyncio.Task] = []
        self._recovery: asyncio.Future | None = None  # the SSD tier's start, once begun
        self._control_started = False
        self._stopped = False
        self.stop_failed: list[str] = []  # the parts whose stop failed (the others still stopped)

    # what tests and benches read off a running in-process node
    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    @property
    def port(self) -> int:
        return self.ctx.port

    @property
    def admin_port(self) -> int:
        return self.ctx.admin_port

    @property
    def gateway_port(self) -> int:
        return self.ctx.gateway_port

    @property
    def phase(self) -> str:
        """The start step under way (for the log of a stop during start), "serving", "stopping"."""
        return self.ctx.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.ctx.phase = value

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        ctx, s = self.ctx, self.cfg.server
        loop = asyncio.get_running_loop()
        self._fit_open_files()
        if self.cfg.admin.port:  # first, so that probes are answered while the SSD tier recovers (503: not ready)
            self.phase = "opening the admin API"
            self._admin = AdminServer(ctx, self.metrics)
            async with _listening(ADMIN, s.bind, self.cfg.admin.port):
                ctx.admin_port = await self._admin.start(s.bind, self.cfg.admin.port)
        if ctx.tiering is not None:
            self.phase = "recovering the SSD tier"
            # recovery completes before anything is served; shielded, so a stop meanwhile can wait for it
            self._recovery = asyncio.ensure_future(ctx.tiering.start(ctx.scopes))
            await asyncio.shield(self._recovery)
        self.phase = "opening listeners"
        async with _listening(RESP, s.bind, s.port):
            self._server = await loop.create_server(
                lambda: RespConnection(ctx, large_target, release_args), s.bind, s.port,
                reuse_address=True, backlog=1024)
        ctx.port = self._server.sockets[0].getsockname()[1]
        if s.unixsocket:
            self._unix = await _unix_listener(
                s.unixsocket, s.unixsocketperm, lambda: RespConnection(ctx, large_target, release_args))
        self.phase = "subscribing to engines"
        self._control_started = True
        await ctx.control.start(follow=not self.cfg.cluster.enabled)  # in a cluster, each engine's home
        if self.cfg.cluster.enabled:
            self.phase = "joining the cluster"
            cluster = Cluster(self.cfg, ctx.node_id, ctx.keyspace, ctx.scopes, ctx.control, self.feed, self._usage)
            cluster.observe_fetch = self.metrics.peer_fetch.observe
            ctx.cluster = cluster
            if self.cfg.cluster.gossip_port:
                async with _listening(GOSSIP, s.bind, self.cfg.cluster.gossip_port):
                    await cluster.start()
            else:
                await cluster.start()
        if self.cfg.gateway.port:
            self.phase = "opening the gateway"
            self._gateway = Gateway(ctx, self.metrics.gateway_ttft, self.metrics.gateway_handoff)
            ctx.gateway = self._gateway
            async with _listening(GATEWAY, s.bind, self.cfg.gateway.port):
                ctx.gateway_port = await self._gateway.start(s.bind, self.cfg.gateway.port)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        self.phase = "serving"
        log.info("quilld %s node %s listening on %s:%d%s (RESP), admin %s, DRAM %s%s",
                 __version__, ctx.node_id, s.bind, ctx.port, f" and {s.unixsocket}" if self._unix else "",
                 f"{s.bind}:{ctx.admin_port}" if self._admin else "off", human(ctx.keyspace.capacity),
                 ", protected mode: loopback clients only" if s.protected_mode and not ctx.users.required else "")
        if ctx.tiering is None:
            log.info("no SSD tier: values are kept in DRAM only, and a restart or a crash starts empty "
                     "(--ssd-dir or ssd.dir keeps them)")
        if self.cfg.engines:
            log.info("%d engine(s) from the config: %s", len(self.cfg.engines),
                     ", ".join(f"{e.id} ({e.kind}, model {e.model}, {e.url})" for e in self.cfg.engines))
        build, why = native.running()
        if build == "compiled":
            log.info("hot path compiled (%s)", why)
        else:  # INFO server's quilld_build says the same
            log.warning("hot path not compiled: running the pure-Python build, slower (%s)", why)

    def _fit_open_files(self) -> None:
        """Raise the descriptor limit to fit maxclients, or lower maxclients to fit it (one line
        says which), before anything opens a file (context/open_files.py)."""
        clients = self.ctx.clients
        fit = fit_open_files(self.cfg, clients.max_clients)
        if fit.maxclients < 1:
            raise ConfigError(f"the open files limit ('ulimit -n') of {fit.soft} is not enough for quilld to start: "
                              f"it needs at least {fit.needed - fit.asked + 1}, and {fit.needed} for maxclients "
                              f"{fit.asked} ({fit.error})")
        clients.max_clients = fit.maxclients
        if fit.message:
            (log.warning if fit.maxclients < fit.asked else log.info)(fit.message)

    async def stop(self) -> None:
        """Stop accepting, drain replies in flight, close clients, stop admin, free memory.

        Safe at any point of `start` (and a second call does nothing): only what was started is stopped.
        """
        if self._stopped:
            return
        self._stopped = True
        self.phase = "stopping"
        ctx = self.ctx
        failed: list[str] = []
        step = functools.partial(_stop_step, failed)
        if self._server is not None:
            await step("the RESP listener", self._server.close)
        if self._unix is not None:
            await step("the unix socket listener", self._close_unix)
        if ctx.cluster is not None:
            await step("the cluster", ctx.cluster.stop)
        await step("the connections", self._close_clients)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._gateway is not None:
            await step("the gateway", self._gateway.stop)
        if self._admin is not None:
            await step("the admin API", self._admin.stop)
        if self._control_started:
            await step("the control plane (its index commits what is left)", ctx.control.stop)
        await step("the open puts", ctx.puts.close)
        if self._recovery is not None:
            if not self._recovery.done():
                log.info("ssd tier: waiting for recovery to finish before stopping (it cannot be interrupted)")
            await asyncio.gather(self._recovery, return_exceptions=True)
            await step("the SSD tier", ctx.tiering.stop)  # it says what it could not keep
        elif ctx.tiering is None and ctx.keyspace.data:
            ks = ctx.keyspace
            log.warning("%d keys (%s) were held in DRAM only and are not kept: this node has no SSD tier "
                        "(ssd.dir, --ssd-dir)", len(ks.data), human(ks.used))
        if ctx.leases is not None:
            await step("the shared-memory leases", ctx.leases.close)
        if ctx.keyspace.lookup_table is not None:
            await step("the lookup table", ctx.keyspace.lookup_table.close)
        await step("the keyspace", ctx.keyspace.close)
        self._server = None
        self.stop_failed = failed
        if failed:
            log.error("quilld stopped, but %s failed to stop (each said why above)", "; ".join(failed))
        else:
            log.info("quilld stopped")

    def _close_unix(self) -> None:
        self._unix.close()
        with contextlib.suppress(OSError):
            os.unlink(self.cfg.server.unixsocket)

    async def _close_clients(self) -> None:
        """Let replies still being sent drain (DRAIN_TIMEOUT at most), then close every connection."""
        clients = self.ctx.clients
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while clients.any_pinned() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        clients.close_all()
        await asyncio.sleep(0)

    def unflushed(self) -> str:
        """What exiting now, without a clean stop, loses: for the log of a second Ctrl-C."""
        tiering = self.ctx.tiering
        if tiering is None:
            return "no SSD tier: DRAM is never flushed, nothing more is lost"
        if not tiering.active:
            return "the SSD tier has failed: nothing was to be flushed"
        if self._recovery is not None and not self._recovery.done():
            return "the SSD tier was still recovering: its blocks stay on SSD, nothing is lost"
        keys, nbytes, writing, writing_bytes = tiering.unflushed()
        if not keys:
            return "every DRAM value was already on SSD, nothing is lost"
        mib = 1 << 20
        inflight = (f"; {writing} of them ({writing_bytes / mib:.1f} MiB) were being written and may "
                    "survive") if writing else ""
        return (f"{keys} value{'s' if keys != 1 else ''} ({nbytes / mib:.1f} MiB) were not flushed to the "
                f"SSD tier: they were only in DRAM and the next start will not have them{inflight}")

    async def _housekeeping(self) -> None:
        ctx = self.ctx
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            try:
                ctx.keyspace.sweep_expired()
                ctx.scopes.sweep()
                ctx.puts.reclaim_expired()
                if ctx.leases is not None:
                    ctx.leases.expire()
                if ctx.keyspace.lookup_table is not None:
                    ctx.keyspace.lookup_table.note_reads()
                ctx.control.housekeeping()
                ctx.clients.check_draining()
                ctx.clients.tracking.trim()  # a table over tracking-table-max-keys shrinks with no read too
                ctx.clients.close_stalled(self.cfg.server.payload_timeout_ms / 1000, time.monotonic())
            except Exception:  # a housekeeping bug must not stop housekeeping
                log.exception("housekeeping failed")

    def _session_closed(self, session_id: int) -> None:
        if self.ctx.leases is not None:
            self.ctx.leases.drop_owner(session_id)
        if self.ctx.cluster is not None:
            self.ctx.cluster.transfers.session_closed(session_id)

    def _usage(self) -> dict:
        """What the cluster advertises of this node besides its DRAM."""
        ctx = self.ctx
        ssd = ctx.tiering
        return {"port": ctx.port, "admin_port": ctx.admin_port,
                "ssd_capacity": ssd.capacity if ssd else 0, "ssd_used": ssd.used if ssd else 0,
                "clients": len(ctx.clients.connections), "started": int(ctx.started)}

    # -- arena space ----------------------------------------------------------
    def _space_freed(self) -> None:
        if self._space_waiters:
            ev, self._space = self._space, asyncio.Event()
            ev.set()

    async def space_freed(self, timeout: float) -> None:
        """Return when arena space is next freed, or after `timeout` seconds, whichever is first."""
        self._space_waiters += 1
        try:
            await asyncio.wait_for(self._space.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._space_waiters -= 1
