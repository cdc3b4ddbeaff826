"""The asyncio shell around `Swim`: UDP for probes and gossip, TCP for push/pull.

It only moves bytes: datagrams in -> `Codec.decode_datagram` ->
`Swim.receive`; `Swim`'s outbox -> `Codec.encode` -> `sendto`. Both
protocols share one port number: UDP for pings, acks, ping-reqs, nacks and
rumors, a TCP listener for push/pull full-state exchanges (one
length-prefixed frame each way: a 4-byte big-endian length, then the
packet). The real clock (`time.monotonic`) and a real `random.Random` drive
the state machine.

Bad input never escapes: a packet that fails authentication is counted in
`stats["gossip_auth_failures"]`, an authentic one replayed in
`stats["gossip_replays_rejected"]` (or `gossip_stale_rejected` when stamped
outside the replay window: an old packet, or a clock out of step, which is
logged), any other malformed one in `stats["gossip_malformed"]`; all are
dropped unanswered. Without `cluster.secret` packets are neither
authenticated nor stamped, so `start` refuses to gossip on an address other
than loopback.

Tasks: one ticker (sleeps until `Swim.next_deadline()`, at most a tenth of
a probe interval, woken early when a packet moves a deadline closer), and
short-lived push/pull tasks, each under `SYNC_TIMEOUT`, at most
`MAX_OUTBOUND_SYNCS`/`MAX_INBOUND_SYNCS` at once. `stop()` leaves
gracefully (LEFT, then a short grace period in which pings are still
answered), then cancels and awaits every task and closes both sockets.

Member addresses must be IP literals (UDP replies go to `sendto`): the
advertised host is resolved once at start; seeds may be names (resolved at
start when possible; TCP connects resolve them anyway).

Seeds that do not answer are said so: while a node with seeds is alone (no
other live member), a WARNING after `cluster.seed_warning_ms` (10 s) names each seed
and what went wrong with it (refused, timed out, failed authentication...),
repeated at most every `SEED_WARN_EVERY` seconds while it lasts; an INFO line
once contact is made after such a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import struct
import time
from collections import Counter
from typing import Callable, Iterable

from quilld.cluster.swim import Event, Member, Swim
from quilld.cluster.wire import MAX_FRAME, REPLAY_WINDOW, Addr, AuthFailure, Codec, MalformedPacket, Replayed
from quilld.config import is_loopback
from quilld.errors import ConfigError

log = logging.getLogger("quilld.gossip")

SYNC_TIMEOUT = 5.0  # seconds for one whole push/pull exchange, connect included
MAX_OUTBOUND_SYNCS = 4  # push/pulls we start at once; more requests are skipped
MAX_INBOUND_SYNCS = 16  # push/pulls we serve at once; more connections are closed
MIN_SLEEP = 0.001  # seconds: the ticker never spins
BIND_ATTEMPTS = 8  # port 0: tries at finding a number free for both UDP and TCP
SKEW_LOG_INTERVAL = 60.0  # seconds between two warnings about packets stamped outside the replay window
SEED_WARN_EVERY = 60.0  # seconds between two such warnings while the node stays alone
_LEN = struct.Struct(">I")


def parse_seeds(text: str) -> list[Addr]:
    """`"host:port,host:port"` -> [(host, port)]; IPv6 hosts may be bracketed."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"seed {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    return out


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise MalformedPacket(f"push/pull frame of {n} bytes, over the {MAX_FRAME}-byte limit")
    return await reader.readexactly(n)


class GossipBindError(OSError):
    """The gossip port could not be bound; `protocol` says which of its two sockets failed ("udp", "tcp")."""

    def __init__(self, protocol: str, err: OSError) -> None:
        super().__init__(err.errno, err.strerror)
        self.protocol = protocol


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, owner: "Gossip") -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr) -> None:
        self.owner._on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable from a dead peer
        self.owner.stats["gossip_udp_errors"] += 1


class Gossip:
    """Cluster membership for one node over UDP and TCP on `port` (0: pick a free one)."""

    def __init__(self, node_id: str, bind_host: str, port: int, meta: dict | None, cfg,
                 on_event: Callable[[Event], None] | None = None, *,
                 advertise_host: str | None = None, seeds: Iterable[Addr] | None = None,
                 rng: random.Random | None = None) -> None:
        """`cfg` is a `ClusterConfig` (or anything with its field names); `seeds`
        overrides `cfg.seeds`. `on_event` is called, in order, for every `Event`."""
        self.node_id = node_id
        self.bind_host = bind_host
        self.port = port
        self.cfg = cfg
        self.on_event = on_event
        # the refusals are shown (in INFO cluster) before the first one
        self.stats: Counter[str] = Counter(gossip_auth_failures=0, gossip_replays_rejected=0,
                                           gossip_stale_rejected=0)
        self._skew_logged = -SKEW_LOG_INTERVAL
        self._meta = dict(meta or {})
        self._advertise_host = advertise_host
        self._seeds = list(seeds) if seeds is not None else parse_seeds(cfg.seeds)
        self._rng = rng or random.Random()
        self._codec = Codec(cfg.secret)
        self._max_sleep = cfg.probe_interval_ms / 1000 / 10
        self.swim: Swim | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task | None = None
        self._syncs: set[asyncio.Task] = set()
        self._inbound: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._sleep_until = 0.0
        self._closing = False
        self._seed_addrs: list[Addr] = []  # the seeds, resolved (this node's own address left out)
        self._seed_problems: dict[Addr, str] = {}  # seed -> what went wrong the last time it was tried
        self._alone_since: float | None = None
        self._seeds_warned_at: float | None = None

    # -- public ----------------------------------------------------------------

    @property
    def addr(self) -> Addr:
        """The advertised (host, port) peers reach this node at."""
        return self.swim.addr

    def members(self) -> list[Member]:
        return self.swim.members() if self.swim else []

    def update_meta(self, meta: dict) -> None:
        self._meta = dict(meta)
        if self.swim and not self._closing:
            self.swim.update_meta(self._meta)
            self._pump()

    async def start(self) -> None:
        """Bind, then join. ConfigError, with nothing left open, when there is no secret and the
        bound address is not loopback."""
        loop = asyncio.get_running_loop()
        await self._bind(loop)
        bound = self._transport.get_extra_info("sockname")[0]
        if not self._codec.authenticated and not is_loopback(bound):
            await self.stop(leave=False)
            raise ConfigError(f"cluster.secret (QUILLD_CLUSTER_SECRET) is required to gossip on {bound}, "
                              "a non-loopback address: without it one forged UDP packet can mark a node dead")
        host = await self._advertised_ip(loop)
        self.swim = Swim.from_config(self.node_id, (host, self.port), self._meta, self.cfg,
                                     clock=time.monotonic, rng=self._rng)
        seeds = await self._resolve_seeds(loop)
        self._seed_addrs = [a for a in seeds if a != self.swim.addr]
        self._alone_since = time.monotonic()
        self.swim.join(seeds)
        self._pump()
        self._ticker = asyncio.create_task(self._tick_loop(), name=f"gossip-tick-{self.node_id}")

    async def stop(self, leave: bool = True) -> None:
        """Leave (when `leave` and started), then close sockets and end every task."""
        if self._closing:
            return
        if leave and self.swim is not None and self._transport is not None:
            self.swim.leave()
            self._pump()
            # Keep answering pings for a moment: their acks carry the LEFT to whoever missed it.
            await asyncio.sleep(self.cfg.probe_interval_ms / 1000)
        self._closing = True
        tasks = {t for t in (self._ticker, *self._syncs, *self._inbound) if t is not None}
        # repeated and bounded: 3.11's wait_for can lose a cancel that races with a finishing read
        deadline = time.monotonic() + 5.0
        while tasks and time.monotonic() < deadline:
            for t in tasks:
                t.cancel()
            _, tasks = await asyncio.wait(tasks, timeout=0.1)
        if tasks:
            log.warning("gossip: %d task(s) did not end within 5 s of the stop", len(tasks))
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._transport is not None:
            self._transport.close()
        self._ticker, self._server, self._transport = None, None, None

    # -- setup -----------------------------------------------------------------

    async def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """UDP and TCP on one port number; with port 0, retry until a number is free for both."""
        attempts = BIND_ATTEMPTS if self.port == 0 else 1
        for attempt in range(attempts):
            # the socket bound here, not by the loop: uvloop's local_addr loses the error number
            # ("could not bind ... [Errno None]"), and "in use" is what an operator needs to read
            family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                sock.bind((self.bind_host, self.port))
            except OSError as e:
                sock.close()
                raise GossipBindError("udp", e) from e
            transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), sock=sock)
            port = transport.get_extra_info("sockname")[1]
            try:
                self._server = await asyncio.start_server(self._serve, self.bind_host, port)
            except OSError as e:
                transport.close()
                if attempt == attempts - 1:
                    raise GossipBindError("tcp", e) from e
                continue
            self._transport, self.port = transport, port
            return

    async def _advertised_ip(self, loop: asyncio.AbstractEventLoop) -> str:
        host = self._advertise_host or self.bind_host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            family = self._transport.get_extra_info("socket").family
            infos = await loop.getaddrinfo(host, self.port, family=family, type=socket.SOCK_DGRAM)
            return infos[0][4][0]

    async def _resolve_seeds(self, loop: asyncio.AbstractEventLoop) -> list[Addr]:
        out = []
        family = self._transport.get_extra_info("socket").family  # "localhost" may be ::1 first
        for host, port in self._seeds:
            try:
                infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
                out.append((infos[0][4][0], port))
            except OSError:
                self.stats["gossip_seed_unresolved"] += 1
                out.append((host, port))  # a TCP connect retries the name later
        return out

    # -- moving bytes ----------------------------------------------------------

    def _pump(self) -> None:
        """Send what Swim queued, start requested push/pulls, deliver events."""
        swim = self.swim
        for addr, msg in swim.drain_outbox():
            if self._transport is None or self._closing:
                break
            try:
                data = self._codec.encode(msg)
                self._transport.sendto(data, addr)
            except (OSError, ValueError, TypeError):
                self.stats["gossip_send_errors"] += 1
                continue
            self.stats["gossip_packets_out"] += 1
            self.stats["gossip_bytes_out"] += len(data)
        for addr in swim.drain_syncs():
            if self._closing or len(self._syncs) >= MAX_OUTBOUND_SYNCS:
                self.stats["gossip_push_pull_skipped"] += 1
                continue
            task = asyncio.create_task(self._push_pull(addr))
            self._syncs.add(task)
            task.add_done_callback(self._syncs.discard)
        for event in swim.drain_events():
            if self.on_event is None:
                continue
            try:
                self.on_event(event)
            except Exception:
                log.exception("gossip event handler failed on %s", event.kind.value)
                self.stats["gossip_event_errors"] += 1
        if swim.next_deadline() < self._sleep_until:
            self._wake.set()

    def _on_datagram(self, data: bytes, addr) -> None:
        if self._closing or self.swim is None:
            return
        self.stats["gossip_packets_in"] += 1
        self.stats["gossip_bytes_in"] += len(data)
        try:
            msg = self._codec.decode_datagram(data)
        except MalformedPacket as e:
            self._count_bad(e, addr)
            return
        try:
            self.swim.receive(msg, (addr[0], addr[1]))
            self._pump()
        except Exception:  # a bug must not take the endpoint down
            log.exception("gossip: handling a datagram from %s failed", addr)
            self.stats["gossip_internal_errors"] += 1

    async def _tick_loop(self) -> None:
        while not self._closing:
            try:
                self.swim.tick(time.monotonic())
                self._pump()
                self._check_seeds(time.monotonic())
            except Exception:
                log.exception("gossip: tick failed")
                self.stats["gossip_internal_errors"] += 1
            now = time.monotonic()
            delay = min(max(self.swim.next_deadline() - now, MIN_SLEEP), self._max_sleep)
            self._sleep_until = now + delay
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    # -- push/pull over TCP ----------------------------------------------------

    def _frame(self, payload: bytes) -> bytes:
        return _LEN.pack(len(payload)) + payload

    def _count_bad(self, e: MalformedPacket, addr) -> None:
        if isinstance(e, AuthFailure):
            self.stats["gossip_auth_failures"] += 1
        elif isinstance(e, Replayed):
            self.stats["gossip_stale_rejected" if e.stale else "gossip_replays_rejected"] += 1
            now = time.monotonic()
            if e.stale and now - self._skew_logged >= SKEW_LOG_INTERVAL:
                self._skew_logged = now
                log.warning("gossip: dropped a packet from %s stamped %+.1f s off this node's clock (the replay "
                            "window is %.0f s): a replay, or clocks out of step (NTP)", addr[0], e.skew,
                            REPLAY_WINDOW)
        else:
            self.stats["gossip_malformed"] += 1

    async def _push_pull(self, addr: Addr) -> None:
        """Send our table to `addr`, merge the table it sends back."""
        writer = None
        try:
            async with asyncio.timeout(SYNC_TIMEOUT):
                reader, writer = await asyncio.open_connection(addr[0], addr[1])
                writer.write(self._frame(self._codec.encode(self.swim.full_state())))
                await writer.drain()
                reply = self._codec.decode_frame(await _read_frame(reader))
        except MalformedPacket as e:
            self._count_bad(e, addr)
            self._seed_problem(addr, "answered with a packet that failed authentication (is cluster.secret the "
                                     "same on every node?)" if isinstance(e, AuthFailure) else
                                     f"answered with a packet that was refused ({e})")
            return
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            self.stats["gossip_push_pull_failed"] += 1
            self._seed_problem(addr, f"no answer within {SYNC_TIMEOUT:.0f} s" if isinstance(e, asyncio.TimeoutError)
                               else "closed the connection mid-exchange" if isinstance(e, asyncio.IncompleteReadError)
                               else (e.strerror or str(e) or type(e).__name__).lower())
            return
        finally:
            if writer is not None:
                writer.close()
        self._seed_problems.pop(addr, None)
        if self._closing:
            return
        self.swim.merge_state(reply)
        self.stats["gossip_push_pull_ok"] += 1
        self._pump()

    # -- seeds that do not answer --------------------------------------------

    def _seed_problem(self, addr: Addr, what: str) -> None:
        if addr in self._seed_addrs:
            self._seed_problems[addr] = what

    def _check_seeds(self, now: float) -> None:
        """Warn while this node, which has seeds, is alone; say when that ends."""
        if not self._seed_addrs or self.swim is None:
            return
        if self.swim.live_count() > 1:
            if self._seeds_warned_at is not None:
                log.info("gossip: in contact with the cluster after %.0f s alone", now - self._alone_since)
            self._alone_since = self._seeds_warned_at = None
            return
        if self._alone_since is None:
            self._alone_since = now
        if now - self._alone_since < self.cfg.seed_warning_ms / 1000 or (
                self._seeds_warned_at is not None and now - self._seeds_warned_at < SEED_WARN_EVERY):
            return
        self._seeds_warned_at = now
        seeds = "; ".join(f"{host}:{port} {self._seed_problems.get((host, port), 'has not answered')}"
                          for host, port in self._seed_addrs)
        retry = min(self.cfg.push_pull_interval_ms, 4 * self.cfg.probe_interval_ms) / 1000
        log.warning("gossip: no seed has answered for %.0f s, this node is alone (%s); still trying every %g s",
                    now - self._alone_since, seeds, retry)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one push/pull: merge the peer's table, reply with ours."""
        task = asyncio.current_task()
        if self._closing or len(self._inbound) >= MAX_INBOUND_SYNCS:
            self.stats["gossip_push_pull_refused"] += 1
            writer.close()
            return
        self._inbound.add(task)
        try:
            async with asyncio.timeout(SYNC_TIMEOUT):
                request = self._codec.decode_frame(await _read_frame(reader))
                self.swim.merge_state(request)
                reply = self._codec.encode(self.swim.full_state())
                self._pump()
                writer.write(self._frame(reply))
                await writer.drain()
            self.stats["gossip_push_pull_served"] += 1
        except MalformedPacket as e:
            self._count_bad(e, writer.get_extra_info("peername") or ("?", 0))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            self.stats["gossip_push_pull_failed"] += 1
        finally:
            self._inbound.discard(task)
            writer.close()
