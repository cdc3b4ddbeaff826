"""Sans-IO SWIM membership with Lifeguard: who is in the cluster, and who is alive.

`Swim` is a state machine. It opens no socket and reads no clock of its own:
the caller feeds it time (`tick(now)`, and the injected `clock` for
timestamps inside `receive`) and packets (`receive(msg, from_addr)`), and
collects what it wants done:

* `drain_outbox()` -> [(addr, message)] to send as UDP datagrams;
* `drain_syncs()` -> [addr] to run a TCP push/pull with: send
  `full_state()`, then `merge_state()` the reply (the receiving side calls
  `merge_state()` on the request and replies with its `full_state()`);
* `drain_events()` -> [Event] membership changes for the node;
* `next_deadline()` -> when `tick` next has work to do.

The protocol (Das, Gupta, Motivala, "SWIM", 2002, with memberlist's and
Lifeguard's refinements):

* Probing. Every probe interval the next member of a shuffled round-robin
  list is pinged. No ack within the probe timeout -> PING_REQ to
  `indirect_probes` random members, which ping it and relay the ack (or send
  a NACK when they got none). No ack by the end of the interval -> SUSPECT.
* Suspicion (Lifeguard). A suspect is declared DEAD when its timer runs
  out; the timer starts at `hi` and shrinks towards `lo` as distinct
  accusers confirm (see lifeguard.py). Missed acks and missing nacks raise
  the local awareness score, which stretches our own probe interval.
* Incarnations. Only a member raises its own incarnation: when it hears a
  SUSPECT, DEAD or LEFT about itself at or above its current one (or an
  ALIVE about itself that is newer, or conflicts with what it is: a previous
  process with the same id), it increments past it and spreads ALIVE.
  Precedence about a member at incarnation j, for news at incarnation i:
  ALIVE(i) wins over SUSPECT/DEAD/LEFT(j) iff i > j; SUSPECT(i) wins over
  ALIVE(j) iff i >= j; DEAD(i) wins over ALIVE/SUSPECT(j) iff i >= j; LEFT(i)
  (said only by the member itself) wins over everything but LEFT iff i >= j.
* Dissemination. Accepted news is piggy-backed on pings, acks and
  ping-reqs through `BroadcastQueue`, least-sent first, within
  `wire.PACKET_BUDGET`, about `retransmit_mult * ln(n + 1)` times each.
  A packet to a member we think SUSPECT/DEAD/LEFT always carries that news
  first, so the member learns it and can refute (Lifeguard's "buddy system").
* Push/pull. Every `push_pull_interval` the full table is exchanged with one
  random live member, and with one address we lost contact with (a DEAD
  tombstone, or a seed that is not a live member) so that partitions heal
  and a node that started before its seeds still joins. A DEAD row in a
  received table is taken as a SUSPECT from the sender, as memberlist does,
  so the member gets a chance to refute instead of being killed wholesale,
  though only the shortest window (`lo`): a timer ran out somewhere already;
  a suspicion learnt from a table is neither counted as a confirmation nor
  re-gossiped (its sender may only be relaying it).
* Tombstones. LEFT members are kept `tombstone_time` seconds so a stale
  ALIVE at the old incarnation cannot resurrect them, then forgotten; DEAD
  ones `dead_time` (an hour), so that operators see a dead node, and how long
  it has been dead, and its restart is a join back after DEAD. A member
  forgotten here is not learnt again from a peer's table (at the incarnation
  it was forgotten at, for as long again): a peer that forgets it a little
  later would hand it back with its age starting anew, and two would pass it
  to each other for ever.
  A restarted node with the same id learns its old incarnation from a push/pull
  or a refutation and takes a higher one, so it comes back ALIVE.

Meta. A member's meta (addresses, tier capacities, load, version: opaque
here) travels in its ALIVE updates. The owner changes it with `update_meta`,
which raises its incarnation and spreads a new ALIVE, exactly like a
refutation, so one ordering (the incarnation) decides both liveness and
which meta is newest, and meta news piggy-backs and push/pulls like any
other. To keep a fast-changing field (load) from flooding the cluster,
changes are applied at most once per probe interval; the latest wins.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable, Iterable

from quilld.cluster import wire
from quilld.cluster.broadcast import BroadcastQueue
from quilld.cluster.lifeguard import Awareness, Suspicion, expected_confirmations, suspicion_bounds
from quilld.cluster.wire import Ack, Addr, Entry, Nack, Ping, PingReq, PushPull, Rumor, State, Update

LIVE = (State.ALIVE, State.SUSPECT)  # members that are probed and count towards n
GONE = (State.DEAD, State.LEFT)
DEAD_TIME_S = 3600.0  # how long a DEAD member is kept (and shown) before it is forgotten
MAX_RELAYS = 256  # ping-reqs we serve at once; more are dropped (bounds amplification)
LEAVE_FANOUT = 64  # members told directly about a graceful leave; gossip reaches the rest


class EventKind(str, Enum):
    JOINED = "joined"  # first seen, or back after DEAD/LEFT (a restart)
    UPDATED = "updated"  # an ALIVE member's meta or address changed
    SUSPECT = "suspect"
    ALIVE = "alive"  # a SUSPECT member refuted the suspicion
    DEAD = "dead"
    LEFT = "left"


@dataclass(slots=True)
class Member:
    """One member as this node sees it. Copies are handed out; meta must not be mutated."""

    node_id: str
    addr: Addr
    incarnation: int
    state: State
    meta: dict
    since: float  # clock time of the last state change


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    member: Member  # a snapshot taken when the event happened
    previous: State | None  # None when first seen


@dataclass(slots=True)
class _Probe:
    seq: int
    target: str
    timeout_at: float
    acked: bool = False
    direct: bool = False
    indirect_sent: bool = False
    helpers: int = 0
    nacks: int = 0


@dataclass(slots=True)
class _Relay:
    requester: Addr
    seq: int
    nack_at: float


class Swim:
    """Membership of one node. Not thread-safe; drive it from one task."""

    def __init__(self, self_id: str, self_addr: Addr, meta: dict | None = None, *,
                 clock: Callable[[], float], rng: random.Random,
                 probe_interval: float = 0.5, probe_timeout: float = 0.2, indirect_probes: int = 3,
                 suspicion_mult: int = 4, suspicion_max_mult: int = 6, push_pull_interval: float = 10.0,
                 retransmit_mult: float = 3.0, tombstone_time: float | None = None,
                 dead_time: float = DEAD_TIME_S, incarnation: int = 0) -> None:
        if not 0 < len(self_id) <= wire.MAX_ID_LEN:
            raise ValueError(f"node id must be 1..{wire.MAX_ID_LEN} characters")
        if not 0 < probe_timeout < probe_interval or push_pull_interval <= 0:
            raise ValueError("need 0 < probe_timeout < probe_interval and push_pull_interval > 0")
        if indirect_probes < 0 or suspicion_mult < 1 or suspicion_max_mult < 1:
            raise ValueError("need indirect_probes >= 0, suspicion_mult >= 1, suspicion_max_mult >= 1")
        meta = dict(meta or {})
        wire.check_meta(meta)
        self.node_id = self_id
        self._clock, self._rng = clock, rng
        self.probe_interval, self.probe_timeout = probe_interval, probe_timeout
        self.indirect_probes = indirect_probes
        self.suspicion_mult, self.suspicion_max_mult = suspicion_mult, suspicion_max_mult
        self.push_pull_interval = push_pull_interval
        self.retransmit_mult = retransmit_mult
        self.tombstone_time = tombstone_time if tombstone_time is not None \
            else max(60.0, 6 * push_pull_interval)
        self.dead_time = max(dead_time, self.tombstone_time)
        self._reaped: dict[str, tuple[int, float]] = {}  # forgotten tombstones: incarnation, when
        now = clock()
        self._me = Member(self_id, tuple(self_addr), incarnation, State.ALIVE, meta, now)
        self._members: dict[str, Member] = {self_id: self._me}
        self._outbox: list[tuple[Addr, wire.Datagram]] = []
        self._events: list[Event] = []
        self._syncs: list[Addr] = []
        self._queue = BroadcastQueue()
        self._suspicions: dict[str, Suspicion] = {}
        self._awareness = Awareness()
        self._order: list[str] = []  # probe round-robin
        self._order_at = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._seq = rng.randrange(wire.MAX_SEQ + 1)
        self._seeds: list[Addr] = []
        self._leaving = False
        self._pending_meta: dict | None = None
        self._meta_at = -math.inf
        # Timers start at random offsets so that nodes started together do not probe in lockstep.
        self._next_probe_at = now + rng.random() * probe_interval
        self._next_sync_at = now + rng.random() * push_pull_interval
        self._next_reap_at = now + self.tombstone_time / 4
        self.counters: Counter[str] = Counter()
        self._queue_update(self._alive_update(self._me))

    @classmethod
    def from_config(cls, self_id: str, self_addr: Addr, meta: dict | None, cfg, *,
                    clock: Callable[[], float], rng: random.Random) -> "Swim":
        """Build from a `quilld.config.ClusterConfig` (milliseconds become seconds)."""
        return cls(self_id, self_addr, meta, clock=clock, rng=rng,
                   probe_interval=cfg.probe_interval_ms / 1000, probe_timeout=cfg.probe_timeout_ms / 1000,
                   indirect_probes=cfg.indirect_probes, suspicion_mult=cfg.suspicion_mult,
                   push_pull_interval=cfg.push_pull_interval_ms / 1000)

    # -- reading the view ------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._me.incarnation

    @property
    def addr(self) -> Addr:
        return self._me.addr

    @property
    def local_health(self) -> int:
        """Lifeguard awareness score: 0 healthy; probing is slowed by a factor of score + 1."""
        return self._awareness.score

    def members(self) -> list[Member]:
        """Every known member, this node and tombstones included, as snapshots."""
        return [replace(m) for m in self._members.values()]

    def member(self, node_id: str) -> Member | None:
        m = self._members.get(node_id)
        return replace(m) if m else None

    def live_count(self) -> int:
        """Members ALIVE or SUSPECT, this node included: the n of SWIM's formulas."""
        return sum(1 for m in self._members.values() if m.state in LIVE)

    def suspicion_bounds(self, n: int | None = None) -> tuple[float, float]:
        """(lo, hi) suspicion timeout in seconds for `n` live members (default: now)."""
        return suspicion_bounds(self.suspicion_mult, self.suspicion_max_mult,
                                self.live_count() if n is None else n, self.probe_interval)

    def retransmit_limit(self) -> int:
        return max(1, math.ceil(self.retransmit_mult * math.log(self.live_count() + 1)))

    # -- outputs ---------------------------------------------------------------

    def drain_outbox(self) -> list[tuple[Addr, wire.Datagram]]:
        out, self._outbox = self._outbox, []
        return out

    def drain_events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def drain_syncs(self) -> list[Addr]:
        out, self._syncs = self._syncs, []
        return out

    def next_deadline(self) -> float:
        """The earliest time `tick` has something to do (it is also safe to call earlier)."""
        d = min((r.nack_at for r in self._relays.values()), default=math.inf)
        if self._leaving:
            return d
        d = min(d, self._next_probe_at, self._next_sync_at, self._next_reap_at)
        p = self._probe
        if p and not p.acked and not p.indirect_sent:
            d = min(d, p.timeout_at)
        if self._suspicions:
            d = min(d, min(s.deadline for s in self._suspicions.values()))
        if self._pending_meta is not None:
            d = min(d, self._meta_at + self.probe_interval)
        return d

    # -- inputs ----------------------------------------------------------------

    def join(self, seeds: Iterable[Addr]) -> None:
        """Contact `seeds` (gossip addresses) with a push/pull each; they are retried while alone."""
        self._seeds = [tuple(a) for a in seeds if tuple(a) != self._me.addr]
        self._syncs.extend(self._seeds)

    def leave(self) -> None:
        """Announce a graceful leave: LEFT to up to LEAVE_FANOUT members now, then via gossip.

        Afterwards the node stops probing and pushing but still answers pings
        (their acks carry the LEFT) until the shell closes it.
        """
        if self._leaving:
            return
        self._leaving = True
        self._me.state, self._me.since = State.LEFT, self._clock()
        self._pending_meta = None
        left = Update(State.LEFT, self.node_id, self._me.incarnation)
        self._queue_update(left)
        live = [m for m in self._members.values() if m.state in LIVE and m is not self._me]
        for m in self._rng.sample(live, min(LEAVE_FANOUT, len(live))):
            self._outbox.append((m.addr, Rumor(self.node_id, (left,))))

    def update_meta(self, meta: dict) -> None:
        """Replace this node's meta; spread with a higher incarnation, at most once per probe interval."""
        meta = dict(meta)
        wire.check_meta(meta)
        if self._leaving:
            return
        if meta == self._me.meta:
            self._pending_meta = None
            return
        self._pending_meta = meta
        self._apply_pending_meta(self._clock())

    def tick(self, now: float | None = None) -> None:
        """Run every timer that is due at `now` (default: the injected clock)."""
        now = self._clock() if now is None else now
        for seq, r in list(self._relays.items()):
            if now >= r.nack_at:
                del self._relays[seq]
                self._outbox.append((r.requester, Nack(r.seq, self.node_id)))
        if self._leaving:
            return
        self._apply_pending_meta(now)
        for node_id, s in list(self._suspicions.items()):
            if now >= s.deadline:
                m = self._members[node_id]
                self.counters["declared_dead"] += 1
                self._on_dead(Update(State.DEAD, node_id, m.incarnation, source=self.node_id), now)
        p = self._probe
        if p and not p.acked and not p.indirect_sent and now >= p.timeout_at:
            self._send_ping_reqs(p)
        if now >= self._next_probe_at:
            if self._probe:
                self._finish_probe(now)
            self._start_probe(now)
        if now >= self._next_sync_at:
            self._schedule_syncs(now)
        if now >= self._next_reap_at:
            self._reap(now)

    def receive(self, msg: wire.Datagram, from_addr: Addr) -> None:
        """Handle one decoded datagram from `from_addr`."""
        now = self._clock()
        from_addr = (from_addr[0], from_addr[1])
        if isinstance(msg, Ping):
            if msg.target != self.node_id:
                self.counters["misdirected_pings"] += 1  # another node had this address before us
                return
            self._apply_all(msg.updates, now)
            self._send(from_addr, Ack(msg.seq, self.node_id), about=msg.source)
        elif isinstance(msg, Ack):
            self._apply_all(msg.updates, now)
            self._on_ack(msg.seq)
        elif isinstance(msg, Nack):
            if self._probe and msg.seq == self._probe.seq:
                self._probe.nacks += 1
        elif isinstance(msg, PingReq):
            self._apply_all(msg.updates, now)
            if self._leaving or len(self._relays) >= MAX_RELAYS:
                self.counters["ping_reqs_dropped"] += 1
                return
            seq = self._next_seq()
            self._relays[seq] = _Relay(from_addr, msg.seq, now + self.probe_timeout)
            self._send(msg.addr, Ping(seq, msg.target, self.node_id), about=msg.target)
        elif isinstance(msg, Rumor):
            self._apply_all(msg.updates, now)
        else:
            raise TypeError(f"not a datagram message: {type(msg).__name__}")

    def full_state(self) -> PushPull:
        """This node's whole table, tombstones included, for a push/pull exchange."""
        rows = [Entry(m.node_id, m.addr, m.incarnation, m.state, m.meta) for m in self._members.values()]
        return PushPull(self.node_id, tuple(rows[:wire.MAX_ENTRIES]))

    def merge_state(self, state: PushPull) -> None:
        """Fold a peer's table into ours with the usual precedence."""
        now = self._clock()
        for e in state.entries:
            known = e.node_id in self._members
            if e.state is State.ALIVE:
                self._on_alive(Update(State.ALIVE, e.node_id, e.incarnation, e.addr, e.meta), now)
            elif not known and e.state in GONE and e.node_id != self.node_id:
                # A tombstone we never knew the member of: keep it, silently, so a stale
                # ALIVE at that incarnation cannot bring the member back; one we forgot: not again.
                if e.incarnation > self._reaped.get(e.node_id, (-1, 0.0))[0]:
                    self._members[e.node_id] = Member(e.node_id, e.addr, e.incarnation, e.state, e.meta, now)
            elif e.state is State.LEFT:
                self._on_dead(Update(State.LEFT, e.node_id, e.incarnation), now)
            else:  # SUSPECT, or DEAD taken as SUSPECT: let the member refute
                self._on_suspect(Update(State.SUSPECT, e.node_id, e.incarnation, source=state.source), now,
                                 hearsay=True, verdict=e.state is State.DEAD)

    # -- probing ---------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & wire.MAX_SEQ
        return self._seq

    def _next_target(self) -> Member | None:
        for _ in range(2):
            while self._order_at < len(self._order):
                m = self._members.get(self._order[self._order_at])
                self._order_at += 1
                if m is not None and m.state in LIVE and m is not self._me:
                    return m
            self._order = [i for i, m in self._members.items() if m.state in LIVE and m is not self._me]
            self._rng.shuffle(self._order)
            self._order_at = 0
        return None

    def _add_to_order(self, node_id: str) -> None:
        """A new or returning member is probed in this round, at a random place still ahead."""
        self._order.insert(self._rng.randint(self._order_at, len(self._order)), node_id)

    def _start_probe(self, now: float) -> None:
        self._next_probe_at = now + self._awareness.scale(self.probe_interval)
        target = self._next_target()
        if target is None:
            self._probe = None
            return
        p = _Probe(self._next_seq(), target.node_id, now + self._awareness.scale(self.probe_timeout))
        self._probe = p
        self.counters["probes"] += 1
        self._send(target.addr, Ping(p.seq, target.node_id, self.node_id), about=target.node_id)

    def _send_ping_reqs(self, p: _Probe) -> None:
        p.indirect_sent = True
        target = self._members.get(p.target)
        if target is None or target.state not in LIVE:
            return
        helpers = [m for m in self._members.values()
                   if m.state is State.ALIVE and m is not self._me and m.node_id != p.target]
        for h in self._rng.sample(helpers, min(self.indirect_probes, len(helpers))):
            p.helpers += 1
            self._send(h.addr, PingReq(p.seq, target.node_id, target.addr, self.node_id), about=h.node_id)

    def _on_ack(self, seq: int) -> None:
        p = self._probe
        if p is not None and seq == p.seq:
            if not p.acked:
                p.acked, p.direct = True, not p.indirect_sent
            return
        r = self._relays.pop(seq, None)
        if r is not None:
            self._send(r.requester, Ack(r.seq, self.node_id))

    def _finish_probe(self, now: float) -> None:
        p, self._probe = self._probe, None
        if p.acked:
            self._awareness.apply(-1 if p.direct else 0)
            return
        self.counters["probe_failures"] += 1
        # Helpers that did not even nack suggest our own packets are not getting out.
        self._awareness.apply(p.helpers - p.nacks if p.helpers else 1)
        m = self._members.get(p.target)
        if m is not None and m.state in LIVE:
            self._on_suspect(Update(State.SUSPECT, m.node_id, m.incarnation, source=self.node_id), now)

    def _schedule_syncs(self, now: float) -> None:
        live = [m for m in self._members.values() if m.state in LIVE and m is not self._me]
        live_addrs = {m.addr for m in live}
        lost = [m.addr for m in self._members.values() if m.state is State.DEAD and m.addr not in live_addrs]
        lost += [a for a in self._seeds if a not in live_addrs and a not in lost]
        if live:
            self._syncs.append(self._rng.choice(live).addr)
        if lost:
            self._syncs.append(self._rng.choice(lost))
        # Alone (nobody reachable yet): knock on the seeds and tombstones more often.
        interval = self.push_pull_interval if live else min(self.push_pull_interval, 4 * self.probe_interval)
        self._next_sync_at = now + interval

    def _reap(self, now: float) -> None:
        self._next_reap_at = now + self.tombstone_time / 4
        for node_id, m in list(self._members.items()):
            keep = self.dead_time if m.state is State.DEAD else self.tombstone_time
            if m.state in GONE and m is not self._me and now - m.since >= keep:
                del self._members[node_id]
                self._reaped[node_id] = (m.incarnation, now + keep)
                self.counters["reaped"] += 1
        for node_id, (_, until) in list(self._reaped.items()):
            if now >= until:
                del self._reaped[node_id]

    # -- sending ---------------------------------------------------------------

    def _send(self, addr: Addr, msg: wire.Datagram, about: str | None = None) -> None:
        """Queue `msg` to `addr` with as much news as fits, news about `about` first if bad."""
        if isinstance(msg, Nack):
            self._outbox.append((addr, msg))
            return
        room = wire.room(msg)
        updates: list[Update] = []
        m = self._members.get(about) if about else None
        if m is not None and m.state is not State.ALIVE and m is not self._me:
            u = self._bad_news(m)
            updates.append(u)
            room -= wire.update_size(u)
        updates += self._queue.select(room, self.retransmit_limit(), wire.MAX_UPDATES - len(updates))
        self._outbox.append((addr, replace(msg, updates=tuple(updates))))

    def _bad_news(self, m: Member) -> Update:
        if m.state is State.LEFT:
            return Update(State.LEFT, m.node_id, m.incarnation)
        return Update(m.state, m.node_id, m.incarnation, source=self.node_id)

    def _alive_update(self, m: Member) -> Update:
        return Update(State.ALIVE, m.node_id, m.incarnation, m.addr, m.meta)

    def _queue_update(self, u: Update, urgent: bool = True) -> None:
        """Queue `u` for piggy-backing; not `urgent` when it only refreshes an alive member's meta or
        address (broadcast.py sends membership news first)."""
        self._queue.push(u.node_id, u, wire.update_size(u), urgent)

    def _emit(self, kind: EventKind, m: Member, previous: State | None) -> None:
        self._events.append(Event(kind, replace(m), previous))

    # -- applying news ---------------------------------------------------------

    def _apply_all(self, updates: Iterable[Update], now: float) -> None:
        for u in updates:
            if u.kind is State.ALIVE:
                self._on_alive(u, now)
            elif u.kind is State.SUSPECT:
                self._on_suspect(u, now)
            else:
                self._on_dead(u, now)

    def _refute(self, incarnation: int, now: float, health: bool, urgent: bool = True) -> None:
        self._me.incarnation = max(self._me.incarnation, incarnation) + 1
        self._queue_update(self._alive_update(self._me), urgent)
        self.counters["refutations"] += 1
        if health:  # being suspected hints that our own acks are late or lost
            self._awareness.apply(1)

    def _apply_pending_meta(self, now: float) -> None:
        if self._pending_meta is None or now < self._meta_at + self.probe_interval:
            return
        self._me.meta, self._pending_meta, self._meta_at = self._pending_meta, None, now
        self._refute(self._me.incarnation, now, health=False, urgent=False)  # new meta, nothing else

    def _on_alive(self, u: Update, now: float) -> None:
        if u.node_id == self.node_id:
            if self._leaving:
                return
            me = self._me
            if u.incarnation > me.incarnation or (
                    u.incarnation == me.incarnation and (u.addr != me.addr or u.meta != me.meta)):
                self._refute(u.incarnation, now, health=False)  # an older process with our id
            return
        m = self._members.get(u.node_id)
        if m is None:
            m = Member(u.node_id, u.addr, u.incarnation, State.ALIVE, u.meta, now)
            self._members[u.node_id] = m
            self._add_to_order(u.node_id)
            self._queue_update(u)
            self._emit(EventKind.JOINED, m, None)
            return
        if u.incarnation <= m.incarnation:
            return
        previous, changed = m.state, (m.addr != u.addr or m.meta != u.meta)
        m.incarnation, m.addr, m.meta = u.incarnation, u.addr, u.meta
        # a refreshed meta of a member alive all along waits behind membership news; a refutation
        # (alive again, or a new incarnation with nothing else new) does not
        self._queue_update(u, urgent=previous is not State.ALIVE or not changed)
        if previous is State.ALIVE:
            if changed:
                self._emit(EventKind.UPDATED, m, previous)
            return
        m.state, m.since = State.ALIVE, now
        self._suspicions.pop(u.node_id, None)
        if previous is State.SUSPECT:
            self._emit(EventKind.ALIVE, m, previous)
        else:
            self._add_to_order(u.node_id)
            self._emit(EventKind.JOINED, m, previous)

    def _on_suspect(self, u: Update, now: float, hearsay: bool = False, verdict: bool = False) -> None:
        """SUSPECT news. `hearsay` marks a row of a push/pull table: its sender may only be
        passing on someone else's suspicion, so it neither confirms one (that would shorten
        timers on rumour) nor is repeated under the sender's name (others would count it).
        `verdict` marks a DEAD row: a timer ran out somewhere, so ours runs only the shortest
        window (`lo`) the member has to refute, not Lifeguard's longest (the few members the
        DEAD rumour missed in a large cluster learn it here, seconds rather than a minute late)."""
        if u.node_id == self.node_id:
            if self._leaving:
                return
            if u.incarnation >= self._me.incarnation:
                self._refute(u.incarnation, now, health=True)
            else:  # the sender missed our refutation: send it again, fresh
                self._queue_update(self._alive_update(self._me))
            return
        m = self._members.get(u.node_id)
        if m is None or u.incarnation < m.incarnation or m.state in GONE:
            return
        if m.state is State.SUSPECT:
            newer = u.incarnation > m.incarnation
            m.incarnation = u.incarnation
            if verdict:
                self._suspicions[u.node_id].verdict()
            if not hearsay and (self._suspicions[u.node_id].confirm(u.source) or newer):
                self._queue_update(u)  # pass the confirmation on so others shorten their timers too
            return
        m.state, m.incarnation, m.since = State.SUSPECT, u.incarnation, now
        n = self.live_count()
        lo, hi = self.suspicion_bounds(n)
        suspicion = self._suspicions[u.node_id] = Suspicion(now, lo, hi, expected_confirmations(self.suspicion_mult, n),
                                                            u.source)
        if verdict:
            suspicion.verdict()
        if not hearsay:
            self._queue_update(u)
        self._emit(EventKind.SUSPECT, m, State.ALIVE)

    def _on_dead(self, u: Update, now: float) -> None:
        left = u.kind is State.LEFT
        if u.node_id == self.node_id:
            if not self._leaving and u.incarnation >= self._me.incarnation:
                self._refute(u.incarnation, now, health=not left)
            return
        m = self._members.get(u.node_id)
        if m is None or u.incarnation < m.incarnation or m.state is State.LEFT:
            return
        if m.state is State.DEAD and not left:
            return
        previous = m.state
        m.state, m.incarnation, m.since = u.kind, u.incarnation, now
        self._suspicions.pop(u.node_id, None)
        self._queue_update(u)
        self._emit(EventKind.LEFT if left else EventKind.DEAD, m, previous)
