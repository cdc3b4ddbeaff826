"""The node's open RESP connections and the counters they feed (INFO stats, CLIENT LIST).

Also what concerns them all at once: CLIENT PAUSE (commands wait, every connection's or
only their writes, until the pause ends), MONITOR (each command run is sent to the
monitoring connections of the same user), the idle timeout (redis's `timeout`), the
watched keys (`watches`, protocol/transactions.py), client-side caching's table
(`tracking`, protocol/tracking.py), and the hold of an EXEC whose queued
command waits for the disk or a peer: until it ends, no other connection runs a command
(commands/multi.py; a cluster peer's connection is never held). A hold lasts at most
`server.exec_hold_ms`, and at most what its tenant has saved of its budget: each tenant
(user) earns `server.exec_hold_budget_ms` of hold a second, saved up to exec_hold_ms, and
spends what its holds last; so no tenant holds the others more than that share of the time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from quilld.config import PROTECTED_MODE_REFUSAL, protected_mode_refuses
from quilld.protocol.resp import shown_arg
from quilld.protocol.key_changes import KeyChanges
from quilld.protocol.tracking import Tracking
from quilld.protocol.transactions import Watches

if TYPE_CHECKING:  # for annotations only: server.py imports this module
    from quilld.protocol.server import RespConnection


DENIED = f"-DENIED {PROTECTED_MODE_REFUSAL}\r\n".encode()  # redis 7's protected-mode refusal, in quilld's words
FULL_RELOG = 60.0  # seconds between two log lines about clients refused at maxclients
log = logging.getLogger("quilld.protocol")


class Clients:
    def __init__(self, max_clients: int, on_close: Any = None, tracking_max_keys: int = 1_000_000) -> None:
        self.max_clients = max_clients
        self.connections: dict[int, RespConnection] = {}
        self.sessions: dict[int, Any] = {}
        self.stats: Counter[str] = Counter()  # total_connections_received, rejected_connections
        self.commands_processed = 0
        self.net_in = 0
        self.net_out = 0
        self.on_close = on_close  # called with a closed connection's session id (the cluster's RDMA leases)
        self._draining: set[RespConnection] = set()
        self._progress: dict[int, tuple[int, float]] = {}  # session id -> (payload bytes seen, since when)
        self._stall_check = 0.0
        self._samples: deque[tuple[float, int, int, int]] = deque(maxlen=3)  # INFO's instantaneous figures
        self.paused: tuple[str, float] | None = None  # CLIENT PAUSE: ("all" | "write", until monotonic)
        self._held: set[RespConnection] = set()  # connections whose next command waits for the pause's end
        self._pause_timer: asyncio.TimerHandle | None = None
        self.monitors: dict[int, RespConnection] = {}  # MONITOR: session id -> connection
        self.changes = KeyChanges()  # the keyspace's one `touched` hook, for WATCH and tracking
        self.watches = Watches(self.changes)  # WATCH: the node's watched keys
        self.tracking = Tracking(self)  # CLIENT TRACKING: who may cache which keys
        self.tracking.max_keys = tracking_max_keys
        self.running: Any = None  # the session whose commands run now (tracking's NOLOOP and message order)
        self.exclusive: Any = None  # the session of an EXEC holding the node (see hold_for), or None
        self._exec_held: set[RespConnection] = set()  # connections waiting for that hold's end
        self._held_since = 0.0  # when that hold began
        self._hold_saved: dict[str, tuple[float, float]] = {}  # tenant -> (seconds of hold saved, as of when)
        self._full_logged = float("-inf")  # when a refusal at maxclients was last logged
        self._full_since = 0  # refusals at maxclients since then

    def opened(self, conn: RespConnection) -> bool:
        """Admit a new connection, or refuse it (max clients reached; protected mode and a peer
        other than loopback, as redis refuses it: `-DENIED ...` before reading a byte): False."""
        refusal = None
        if len(self.connections) >= self.max_clients:
            refusal = b"-ERR max number of clients reached\r\n"
            self._refused_full()
        elif not conn.session.unix:  # a unix socket's peer is on this host: loopback, as redis counts it
            peer = conn.transport.get_extra_info("peername")
            if protected_mode_refuses(conn.ctx.cfg.server, conn.ctx.users.required, peer[0] if peer else None):
                refusal = DENIED
        if refusal is not None:
            self.stats["rejected_connections"] += 1
            conn.transport.write(refusal)
            conn.transport.close()
            return False
        self.connections[conn.session.id] = conn
        self.sessions[conn.session.id] = conn.session
        self.stats["total_connections_received"] += 1
        return True

    def _refused_full(self) -> None:
        """One log line a minute at most while clients are refused at maxclients (INFO stats counts
        each one in rejected_connections)."""
        self._full_since += 1
        now = time.monotonic()
        if now - self._full_logged >= FULL_RELOG:
            log.warning("max number of clients reached (maxclients %d): refusing new connections with "
                        "'-ERR max number of clients reached' (%d refused since the last such line)",
                        self.max_clients, self._full_since)
            self._full_logged, self._full_since = now, 0

    def closed(self, conn: RespConnection) -> None:
        self.monitor_off(conn.session)
        self._held.discard(conn)
        self._exec_held.discard(conn)
        conn.session.close()
        self.connections.pop(conn.session.id, None)
        self.sessions.pop(conn.session.id, None)
        self._draining.discard(conn)
        if self.on_close is not None:
            self.on_close(conn.session.id)

    def auth_changed(self, session: Any) -> None:
        """The session logged in (or out), or became a cluster peer: its parser's pre-AUTH limits follow."""
        conn = self.connections.get(session.id)
        if conn is not None:
            conn.parser.authenticated = session.authenticated or session.peer

    def watch_drain(self, conn: RespConnection) -> None:
        """Check `conn` again at the next housekeeping tick: its pinned replies are still being sent."""
        self._draining.add(conn)

    def check_draining(self) -> None:
        if self._draining:
            waiting, self._draining = self._draining, set()
            for conn in waiting:
                conn.check_drained()

    def close_stalled(self, timeout: float, now: float) -> int:
        """Close connections whose large payload (a value received into the arena, or one being
        refused) has not advanced for `timeout` seconds: a sender that stops mid-payload must not
        keep its reservation. Looks about once a second; returns how many were closed."""
        if now - self._stall_check < min(1.0, timeout / 2):
            return 0
        self._stall_check = now
        self._samples.append((now, self.commands_processed, self.net_in, self.net_out))
        self._close_idle(now)
        progress, closed = self._progress, 0
        for sid, conn in list(self.connections.items()):
            filled = conn.parser.sink_progress()
            if filled < 0:
                progress.pop(sid, None)
                continue
            seen = progress.get(sid)
            if seen is None or seen[0] != filled:
                progress[sid] = (filled, now)
            elif now - seen[1] >= timeout:
                progress.pop(sid, None)
                self.stats["payload_timeouts"] += 1
                conn.transport.close()  # connection_lost gives the reservation back
                closed += 1
        for sid in [s for s in progress if s not in self.connections]:
            del progress[sid]
        return closed

    def _close_idle(self, now: float) -> None:
        """Close clients idle longer than the runtime `timeout` (seconds; 0: never), as redis does:
        not a monitor, a cluster peer, nor one waiting for a reply or for a pause to end."""
        for conn in list(self.connections.values()):
            timeout = conn.ctx.runtime.timeout
            if not timeout:
                return
            s = conn.session
            if now - s.last_active > timeout and not (s.monitor or s.peer or conn.busy) and not (
                    conn in self._held or conn in self._exec_held):
                conn.transport.close()

    # -- CLIENT PAUSE ---------------------------------------------------------
    def pause(self, mode: str, seconds: float) -> None:
        """Hold every client's commands ("all") or their writes ("write") for `seconds`; a pause
        already on keeps the longer end and the stricter mode, as redis's pauseClients."""
        until = time.monotonic() + seconds
        if self.paused is not None:
            old_mode, old_until = self.paused
            mode = "all" if "all" in (mode, old_mode) else "write"
            until = max(until, old_until)
        self.paused = (mode, until)
        if self._pause_timer is not None:
            self._pause_timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (handler tests): the end is noticed by holds()
            return
        self._pause_timer = loop.call_later(max(until - time.monotonic(), 0), self._pause_due)

    def _pause_due(self) -> None:
        """The pause's timer: uvloop's clock counts whole milliseconds, so a timer may fire up to
        one early; a pause lasts at least its length, so what is left is waited again."""
        self._pause_timer = None
        if self.paused is None:
            return
        left = self.paused[1] - time.monotonic()
        if left > 0:
            self._pause_timer = asyncio.get_running_loop().call_later(left, self._pause_due)
        else:
            self.unpause()

    def unpause(self) -> None:
        """End the pause: the held connections run what they kept."""
        self.paused = None
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None
        held, self._held = self._held, set()
        for conn in held:
            conn.resume_after_pause()

    def holds(self, conn: RespConnection, cmd: Any) -> bool:
        """Whether the pause holds `cmd` (a table Command, or None for an unknown one) of `conn`."""
        mode, until = self.paused
        if time.monotonic() >= until:
            self.unpause()
            return False
        if mode == "all" or (cmd is not None and ("write" in cmd.info_flags or (
                cmd.name == "exec" and _writes_queued(conn.session)))):
            self._held.add(conn)
            return True
        return False

    # -- an EXEC holding the node -----------------------------------------------
    def hold_for(self, session: Any) -> float:
        """`session`'s EXEC waits mid-transaction (a queued command waits for the disk or a
        peer): no other connection runs a command until `release_hold`. Returns the seconds
        the hold may last: server.exec_hold_ms, or what its tenant has saved if less."""
        cfg = session.ctx.cfg.server
        now = time.monotonic()
        self.exclusive = session
        self._held_since = now
        self.stats["exec_holds"] += 1
        return min(cfg.exec_hold_ms / 1000, self._saved(session.user, cfg, now))

    def _saved(self, tenant: str, cfg: Any, now: float) -> float:
        cap = cfg.exec_hold_ms / 1000
        saved, since = self._hold_saved.get(tenant, (cap, now))
        return min(cap, saved + (now - since) * cfg.exec_hold_budget_ms / 1000)

    def held_out(self, conn: RespConnection) -> bool:
        """Whether `conn` must wait for the EXEC holding the node (never the EXEC's own connection,
        nor a cluster peer's); it runs what it has once the hold ends."""
        if self.exclusive is None or conn.session is self.exclusive or conn.session.peer:
            return False
        self._exec_held.add(conn)
        return True

    def release_hold(self) -> None:
        session, now = self.exclusive, time.monotonic()
        if session is not None:  # the hold's length is spent from its tenant's savings
            cfg = session.ctx.cfg.server
            saved = self._saved(session.user, cfg, now) - (now - self._held_since)
            if saved < cfg.exec_hold_ms / 1000:
                self._hold_saved[session.user] = (saved, now)
            else:
                self._hold_saved.pop(session.user, None)
        self.exclusive = None
        held, self._exec_held = self._exec_held, set()
        for conn in held:
            conn.resume_after_pause()

    # -- MONITOR --------------------------------------------------------------
    def monitor_on(self, session: Any) -> None:
        conn = self.connections.get(session.id)
        if conn is None:
            return
        session.monitor = True
        self.monitors[session.id] = conn
        conn.ctx.table.set_monitor(self._feed)

    def monitor_off(self, session: Any) -> None:
        session.monitor = False
        conn = self.monitors.pop(session.id, None)
        if conn is not None and not self.monitors:
            conn.ctx.table.set_monitor(None)

    def _feed(self, client: Any, cmd: Any, args: list) -> None:
        """Send one command run by `client` to the monitors of its user (redis's
        replicationFeedMonitors): a tenant never sees another tenant's commands."""
        line = None
        for conn in self.monitors.values():
            if conn.session.user != client.user:
                continue
            if line is None:
                line = monitor_line(client, cmd, args, time.time())
            conn.push(line)

    def instantaneous(self) -> tuple[int, float, float]:
        """Commands per second and KiB per second in and out, over the last seconds' samples
        (taken by close_stalled's once-a-second pass), as INFO's instantaneous_* figures."""
        if len(self._samples) < 2:
            return 0, 0.0, 0.0
        (t0, c0, i0, o0), (t1, c1, i1, o1) = self._samples[0], self._samples[-1]
        dt = (t1 - t0) or 1.0
        return round((c1 - c0) / dt), (i1 - i0) / dt / 1024, (o1 - o0) / dt / 1024

    def any_pinned(self) -> bool:
        return any(c.has_pins for c in self.connections.values())

    def close_all(self) -> None:
        for conn in list(self.connections.values()):
            conn.transport.close()

    def reset_stats(self) -> None:
        self.stats.clear()
        self.commands_processed = self.net_in = self.net_out = 0


def _writes_queued(session: Any) -> bool:
    """Whether the transaction `session` would EXEC writes (held by CLIENT PAUSE WRITE, as redis's
    EXEC is when its queue may replicate)."""
    return any("write" in cmd.info_flags for cmd, _ in session.multi or ())


_REPR = {0x5C: b"\\\\", 0x22: b'\\"', 0x0A: b"\\n", 0x0D: b"\\r", 0x09: b"\\t", 0x07: b"\\a", 0x08: b"\\b"}


def quoted(raw: bytes) -> bytes:
    """An argument as redis's sdscatrepr quotes it: "...", escapes, \\xHH for unprintable bytes."""
    out = bytearray(b'"')
    for b in raw:
        esc = _REPR.get(b)
        if esc is not None:
            out += esc
        elif 32 <= b < 127:
            out.append(b)
        else:
            out += b"\\x%02x" % b
    out += b'"'
    return bytes(out)


def monitor_line(client: Any, cmd: Any, args: list, now: float) -> bytes:
    """`+<seconds>.<micros> [0 <addr>] "arg" ...` with the arguments the command hides redacted."""
    hidden = set(cmd.doc.redact(args)) if cmd is not None and cmd.doc is not None and cmd.doc.redact else ()
    parts = [b'"(redacted)"' if i in hidden else quoted(shown_arg(a)) for i, a in enumerate(args)]
    secs = int(now)
    return b"+%d.%06d [0 %s] %s\r\n" % (secs, int((now - secs) * 1e6), client.addr.encode(), b" ".join(parts))
