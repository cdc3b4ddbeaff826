"""SWIM + Lifeguard on a simulated network: injected clock, per-link delay, loss, partitions.

`Net` is a discrete-event simulator. Every packet goes through the real
`Codec` (so HMAC and validation are exercised), is dropped with probability
`loss` or when a partition or crash separates its ends, and is delivered
after its link's fixed delay plus jitter. Each node is ticked exactly at its
`next_deadline()`. Push/pull is done in-line (TCP is reliable; it fails
only across a partition or to a crashed node). Everything is seeded, so a
failure reproduces exactly.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import Counter
from typing import Callable

import msgpack
import pytest

from quilld.cluster import wire
from quilld.cluster.lifeguard import Suspicion, expected_confirmations, suspicion_bounds
from quilld.cluster.swim import EventKind, Swim
from quilld.cluster.wire import (AuthFailure, Codec, Entry, MalformedPacket, Nack, Ping, PingReq, PushPull,
                                 Replayed, ReplayGuard, Rumor, State, Update, Ack)

T = 0.5  # probe interval (the config default, 500 ms)
WALL0 = 1_700_000_000.0  # the simulated nodes' wall clock at simulated time 0 (packets' stamps)
DEFAULTS = dict(probe_interval=T, probe_timeout=0.2, indirect_probes=3, suspicion_mult=4,
                push_pull_interval=10.0)


class Net:
    def __init__(self, seed: int, *, loss: float = 0.0, secret: str = "", jitter: float = 0.002,
                 **swim_kw) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.loss = loss
        self.secret = secret
        self.jitter = jitter
        self.swim_kw = {**DEFAULTS, **swim_kw}
        self.nodes: dict[tuple, Swim] = {}
        self.codecs: dict[tuple, Codec] = {}
        self.down: set[tuple] = set()
        self.blocked: Callable[[tuple, tuple], bool] | None = None
        self.events: list[tuple[float, str, object]] = []
        self.stats: Counter[str] = Counter()
        self._base_delay: dict[tuple, float] = {}
        self._heap: list = []
        self._tie = itertools.count()
        self._wake_at: dict[tuple, float] = {}
        self.tap: list[tuple[tuple, tuple, bytes]] | None = None  # (src, dst, bytes) delivered, when set

    # -- building --

    def add(self, node_id: str, seeds=(), meta=None, secret: str | None = None, addr=None, **kw) -> Swim:
        addr = addr or (f"10.0.{len(self.nodes) // 200}.{len(self.nodes) % 200 + 1}", 7946)
        swim = Swim(node_id, addr, meta if meta is not None else {"resp": f"{addr[0]}:7379"},
                    clock=lambda: self.now, rng=random.Random(self.rng.random()), **{**self.swim_kw, **kw})
        self.nodes[addr] = swim
        self.codecs[addr] = Codec(self.secret if secret is None else secret, clock=lambda: WALL0 + self.now)
        self.down.discard(addr)
        swim.join(seeds)
        self._pump(addr)
        return swim

    def cluster(self, n: int, prefix: str = "n", stagger: float = 0.05, seeds: int = 1) -> list[Swim]:
        out = []
        for i in range(n):
            out.append(self.add(f"{prefix}{i}", seeds=[s.addr for s in out[:seeds]]))
            self.run(stagger)
        return out

    def crash(self, swim: Swim) -> None:
        self.down.add(swim.addr)

    def live(self) -> list[Swim]:
        return [s for a, s in self.nodes.items() if a not in self.down]

    # -- the network --

    def link_ok(self, a: tuple, b: tuple) -> bool:
        return a not in self.down and b not in self.down and not (self.blocked and self.blocked(a, b))

    def _delay(self, a: tuple, b: tuple) -> float:
        base = self._base_delay.get((a, b))
        if base is None:
            base = self._base_delay[(a, b)] = self.rng.uniform(0.0005, 0.005)
        return base + self.rng.random() * self.jitter

    def inject(self, dst: tuple, data: bytes, src=("10.9.9.9", 7946)) -> None:
        heapq.heappush(self._heap, (self.now, next(self._tie), "pkt", (src, dst, data)))

    def _pump(self, addr: tuple) -> None:
        swim = self.nodes[addr]
        for dst, msg in swim.drain_outbox():
            data = self.codecs[addr].encode(msg)
            assert len(data) <= wire.PACKET_BUDGET
            self.stats["sent"] += 1
            if not self.link_ok(addr, dst) or self.rng.random() < self.loss:
                self.stats["lost"] += 1
                continue
            heapq.heappush(self._heap, (self.now + self._delay(addr, dst), next(self._tie), "pkt",
                                        (addr, dst, data)))
        for dst in swim.drain_syncs():
            self._push_pull(addr, dst)
        for ev in swim.drain_events():
            self.events.append((self.now, swim.node_id, ev))
        d = max(swim.next_deadline(), self.now)
        if d != self._wake_at.get(addr) and d != math.inf:
            self._wake_at[addr] = d
            heapq.heappush(self._heap, (d, next(self._tie), "wake", addr))

    def _push_pull(self, src: tuple, dst: tuple) -> None:
        if dst not in self.nodes or not self.link_ok(src, dst) or not self.link_ok(dst, src):
            self.stats["push_pull_failed"] += 1
            return
        a, b = self.nodes[src], self.nodes[dst]
        try:
            b.merge_state(self.codecs[dst].decode_frame(self.codecs[src].encode(a.full_state())))
            reply = self.codecs[src].decode_frame(self.codecs[dst].encode(b.full_state()))
        except MalformedPacket as e:
            self.stats["auth_failures" if isinstance(e, AuthFailure) else "malformed"] += 1
            return
        a.merge_state(reply)
        self.stats["push_pull"] += 1
        heapq.heappush(self._heap, (self.now, next(self._tie), "pump", dst))

    def run(self, duration: float) -> None:
        end = self.now + duration
        while self._heap and self._heap[0][0] <= end:
            t, _, kind, arg = heapq.heappop(self._heap)
            self.now = t
            if kind == "pkt":
                src, dst, data = arg
                if dst not in self.nodes or not self.link_ok(src, dst):
                    continue
                try:
                    msg = self.codecs[dst].decode_datagram(data)
                except AuthFailure:
                    self.stats["auth_failures"] += 1
                    continue
                except Replayed as e:
                    self.stats["stale" if e.stale else "replayed"] += 1
                    continue
                except MalformedPacket:
                    self.stats["malformed"] += 1
                    continue
                if self.tap is not None:
                    self.tap.append((src, dst, data))
                self.nodes[dst].receive(msg, src)
                self._pump(dst)
            elif kind == "wake":
                if arg in self.down or self._wake_at.get(arg) != t:
                    continue
                self._wake_at[arg] = None
                self.nodes[arg].tick(t)
                self._pump(arg)
            elif arg not in self.down:  # "pump"
                self._pump(arg)
        self.now = end

    def run_until(self, cond: Callable[[], bool], limit: float, step: float = 0.05) -> float:
        """Run until `cond()` holds; return the simulated seconds it took (fails past `limit`)."""
        start = self.now
        while not cond():
            assert self.now - start < limit, f"condition not met within {limit}s of simulated time"
            self.run(step)
        return self.now - start

    # -- observing --

    def state_of(self, observer: Swim, node_id: str) -> State | None:
        m = observer.member(node_id)
        return m.state if m else None

    def all_see(self, node_id: str, state: State, observers=None) -> bool:
        return all(self.state_of(o, node_id) is state for o in (observers or self.live()) if o.node_id != node_id)

    def converged(self, swims=None) -> bool:
        swims = swims or self.live()
        ids = {s.node_id for s in swims}
        return all({m.node_id for m in s.members() if m.state is State.ALIVE} == ids for s in swims)

    def events_about(self, node_id: str, kind: EventKind | None = None, since: float = 0.0) -> list:
        return [(t, who, e) for t, who, e in self.events
                if e.member.node_id == node_id and (kind is None or e.kind is kind) and t >= since]


def detection_bound(n: int, swim: Swim) -> float:
    """Worst case from a crash to DEAD at every live member, from the config.

    Some member probes the crashed one within its next round-robin round:
    at most 2(n-1) probe intervals (probed first in the last round, last in
    the next) counting the probe interval itself. Its suspicion, unconfirmed,
    lasts at most `hi`. The DEAD then needs to spread: 2*log2(n) intervals.
    """
    _, hi = suspicion_bounds(swim.suspicion_mult, swim.suspicion_max_mult, n, swim.probe_interval)
    return 2 * (n - 1) * swim.probe_interval + hi + 2 * math.ceil(math.log2(n)) * swim.probe_interval


def detect(net: Net, victims: list[Swim], n: int) -> tuple[float, float]:
    """Crash `victims`; return (earliest, latest) seconds to DEAD at every live member."""
    crash_at = net.now
    for v in victims:
        net.crash(v)
    bound = detection_bound(n, net.live()[0])
    net.run_until(lambda: all(net.all_see(v.node_id, State.DEAD) for v in victims), limit=bound)
    times = [t - crash_at for v in victims for t, _, _ in net.events_about(v.node_id, EventKind.DEAD, crash_at)]
    return min(times), max(times)


# -- failure detection --------------------------------------------------------

def test_crashed_node_is_dead_everywhere_within_the_bound():
    net = Net(seed=1)
    swims = net.cluster(8)
    net.run_until(net.converged, limit=10)
    victim = swims[3]
    lo, hi = victim.suspicion_bounds(8)
    bound = detection_bound(8, swims[0])
    first, last = detect(net, [victim], 8)
    print(f"\n8 nodes: crash -> DEAD everywhere in {first:.2f}..{last:.2f}s (lo {lo:.1f}s, hi {hi:.1f}s, "
          f"bound {bound:.1f}s)")
    assert first >= lo  # nobody can be faster than the shortest suspicion
    assert last <= bound
    # Every live member saw it DEAD exactly once, nobody else was suspected.
    assert len(net.events_about(victim.node_id, EventKind.DEAD)) == 7
    assert all(e.member.node_id == victim.node_id for _, _, e in net.events if e.kind is not EventKind.JOINED)


def test_no_live_node_is_declared_dead_at_ten_percent_loss():
    net = Net(seed=2, loss=0.10)
    swims = net.cluster(8)
    net.run_until(net.converged, limit=20)
    start = net.now
    net.run(400 * T)
    kinds = Counter(e.kind for t, _, e in net.events if t >= start)
    refutations = sum(s.counters["refutations"] for s in swims)
    print(f"\n10% loss, 8 nodes, 400 periods: {net.stats['lost']} of {net.stats['sent']} packets lost, "
          f"{kinds[EventKind.SUSPECT]} suspicions, {refutations} refutations, "
          f"max local health {max(s.local_health for s in swims)}")
    assert kinds[EventKind.DEAD] == 0 and kinds[EventKind.LEFT] == 0
    assert kinds[EventKind.SUSPECT] > 0  # the loss did bite; the suspicions were all refuted
    assert net.converged()


def test_suspected_live_node_refutes_and_is_alive_everywhere():
    net = Net(seed=3)
    swims = net.cluster(8)
    net.run_until(net.converged, limit=10)
    x = swims[5]
    before = x.incarnation
    net.blocked = lambda a, b: x.addr in (a, b)  # cut x off until somebody suspects it
    t0 = net.now
    net.run_until(lambda: net.events_about(x.node_id, EventKind.SUSPECT, t0), limit=30)
    net.blocked = None
    took = net.run_until(lambda: all(o.member(x.node_id).state is State.ALIVE
                                     and o.member(x.node_id).incarnation == x.incarnation
                                     for o in swims if o is not x), limit=10)
    print(f"\nrefuted in {took:.2f}s, incarnation {before} -> {x.incarnation}")
    assert x.incarnation > before
    assert not net.events_about(x.node_id, EventKind.DEAD)
    assert net.events_about(x.node_id, EventKind.ALIVE)  # the "alive again" event
    assert net.converged()


def test_indirect_probes_keep_a_member_with_one_broken_link_alive():
    net = Net(seed=12)
    swims = net.cluster(5)
    net.run_until(net.converged, limit=10)
    a, b = swims[0], swims[1]
    net.blocked = lambda x, y: {x, y} == {a.addr, b.addr}  # a and b cannot talk directly
    start = net.now
    net.run(200 * T)
    assert not [e for t, _, e in net.events if t >= start and e.kind is not EventKind.JOINED]
    assert a.counters["probes"] > 150 and a.local_health == 0


def test_a_node_whose_packets_do_not_get_out_slows_its_probing():
    net = Net(seed=13)
    swims = net.cluster(5)
    net.run_until(net.converged, limit=10)
    x, y = swims[2], swims[3]
    net.blocked = lambda src, dst: src == x.addr  # x hears everyone, nobody hears x
    probes_x, probes_y = x.counters["probes"], y.counters["probes"]
    net.run(20 * T)
    assert x.local_health >= 3  # no acks and not even nacks from its ping-req helpers
    assert x.counters["probes"] - probes_x < (y.counters["probes"] - probes_y) / 2


def test_partition_heals_into_one_view_through_push_pull():
    net = Net(seed=4)
    swims = net.cluster(8)
    net.run_until(net.converged, limit=10)
    left, right = swims[:4], swims[4:]
    left_addrs = {s.addr for s in left}
    net.blocked = lambda a, b: (a in left_addrs) != (b in left_addrs)
    net.run_until(lambda: all(net.all_see(s.node_id, State.DEAD, left) for s in right)
                  and all(net.all_see(s.node_id, State.DEAD, right) for s in left), limit=60)
    assert net.converged(left) and net.converged(right)
    net.blocked = None
    pp = swims[0].push_pull_interval
    took = net.run_until(net.converged, limit=2 * pp + 10 * T)
    print(f"\npartition healed in {took:.2f}s (push/pull interval {pp:.0f}s)")


def test_meta_update_reaches_everyone_in_about_log_n_periods():
    n = 32
    net = Net(seed=5, push_pull_interval=1e6)  # no push/pull: piggy-backing alone must carry it
    swims = net.cluster(n, stagger=0.02, seeds=3)
    net.run_until(net.converged, limit=30)
    net.run(20 * T)  # let the join news age out of the queues
    owner = swims[7]
    inc = owner.incarnation
    owner.update_meta({"resp": "10.0.0.8:7379", "load": 0.75})
    net._pump(owner.addr)
    took = net.run_until(lambda: all(s.member(owner.node_id).meta.get("load") == 0.75 for s in swims), limit=30)
    periods = took / T
    bound = 2 * math.ceil(math.log2(n))
    print(f"\nmeta update reached all {n} nodes in {periods:.1f} probe periods (bound {bound})")
    assert owner.incarnation == inc + 1
    assert periods <= bound
    updated = {who for _, who, e in net.events_about(owner.node_id, EventKind.UPDATED)}
    assert updated == {s.node_id for s in swims} - {owner.node_id}


def test_meta_updates_are_coalesced_to_one_per_probe_interval():
    net = Net(seed=6)
    a, b = net.cluster(2)
    net.run_until(net.converged, limit=10)
    inc = a.incarnation
    for load in range(10):
        a.update_meta({"load": load})
    assert a.incarnation == inc + 1  # the first applied at once, the rest wait
    net.run(T + 0.01)
    assert a.incarnation == inc + 2 and a.member(a.node_id).meta == {"load": 9}
    net.run(5 * T)
    assert b.member(a.node_id).meta == {"load": 9}


def test_fifty_nodes_join_and_crash_quickly():
    started = time.process_time()  # this process's CPU: other processes' load does not count
    net = Net(seed=7)
    swims = net.cluster(50, stagger=0.1, seeds=2)
    join_took = net.run_until(net.converged, limit=60)
    victims = [swims[11], swims[29], swims[43]]
    first, last = detect(net, victims, 50)
    elapsed = time.process_time() - started
    print(f"\n50 nodes: converged {join_took:.1f}s after the last join, 3 crashes DEAD everywhere in "
          f"{first:.2f}..{last:.2f}s (bound {detection_bound(50, swims[0]):.1f}s); "
          f"{net.stats['sent']} packets, cpu {elapsed:.2f}s")
    assert elapsed < 20
    assert not [e for _, _, e in net.events if e.kind is EventKind.DEAD and e.member.node_id not in
                {v.node_id for v in victims}]


# -- leave and restart --------------------------------------------------------

def test_graceful_leave_is_left_everywhere_and_a_restart_rejoins():
    net = Net(seed=8)
    swims = net.cluster(6)
    net.run_until(net.converged, limit=10)
    x = swims[4]
    old_inc = x.incarnation
    x.leave()
    net._pump(x.addr)
    net.run(T)
    net.crash(x)  # the process exits
    others = [s for s in swims if s is not x]
    net.run_until(lambda: net.all_see(x.node_id, State.LEFT, others), limit=5)
    net.run(30 * T)  # long enough that a missed leave would have turned into a DEAD
    assert net.all_see(x.node_id, State.LEFT, others)
    assert not net.events_about(x.node_id, EventKind.DEAD)
    assert not net.events_about(x.node_id, EventKind.SUSPECT)

    # Same id, same address, a fresh process at incarnation 0: it must out-bid its old LEFT.
    x2 = net.add(x.node_id, seeds=[swims[0].addr], addr=x.addr)
    net.run_until(lambda: net.converged(), limit=10)
    assert x2.incarnation > old_inc
    rejoined = net.events_about(x.node_id, EventKind.JOINED, since=net.now - 10)
    assert {e.previous for _, _, e in rejoined} == {State.LEFT}


def test_crashed_node_restarted_with_the_same_id_comes_back_alive():
    net = Net(seed=9)
    swims = net.cluster(6)
    net.run_until(net.converged, limit=10)
    y = swims[2]
    detect(net, [y], 6)
    dead_inc = swims[0].member(y.node_id).incarnation
    y2 = net.add(y.node_id, seeds=[swims[5].addr], addr=y.addr)
    took = net.run_until(net.converged, limit=10)
    print(f"\nrestarted node ALIVE everywhere {took:.2f}s after starting")
    assert y2.incarnation > dead_inc
    assert all(s.member(y.node_id).incarnation == y2.incarnation for s in net.live())


def test_restart_before_detection_outbids_the_old_incarnation():
    net = Net(seed=10)
    swims = net.cluster(4)
    net.run_until(net.converged, limit=10)
    z = swims[1]
    z.update_meta({"v": 1})
    net._pump(z.addr)
    net.run(10 * T)
    old_inc = z.incarnation
    net.crash(z)
    z2 = net.add(z.node_id, seeds=[swims[0].addr], addr=z.addr, meta={"v": 2})
    net.run_until(lambda: all(s.member(z.node_id).meta == {"v": 2} for s in net.live()), limit=10)
    assert z2.incarnation > old_inc
    assert not net.events_about(z.node_id, EventKind.DEAD)


def test_a_dead_members_age_holds_and_its_restart_is_back_after_dead():
    """Issue 29, item 5: a dead member was forgotten one tombstone_time (60 s) after it died, then
    learnt again from a peer's table with a fresh `since` (the page showed "dead · 13 s" 80 s after
    the kill), and a restart later was a first join, never "back after dead". Every live member keeps
    it DEAD with the age it died at, as long as the page may show it (minutes here), and then sees
    its restart as a join back after DEAD."""
    net = Net(seed=21)
    swims = net.cluster(4)
    net.run_until(net.converged, limit=10)
    x = swims[3]
    killed = net.now
    detect(net, [x], 4)
    bound = killed + detection_bound(4, swims[0])
    for _ in range(60):  # five simulated minutes, pushes/pulls every 10 s
        net.run(5.0)
        for s in net.live():
            m = s.member(x.node_id)
            assert m is not None and m.state is State.DEAD, (net.now, s.node_id, m)
            assert killed <= m.since <= bound, (net.now - killed, s.node_id, net.now - m.since)
    net.add(x.node_id, seeds=[swims[0].addr], addr=x.addr)
    net.run_until(net.converged, limit=10)
    back = net.events_about(x.node_id, EventKind.JOINED, since=net.now - 10)
    assert {who for _, who, _ in back} == {s.node_id for s in swims[:3]}
    assert {e.previous for _, _, e in back} == {State.DEAD}


def test_a_reaped_dead_member_is_not_learnt_again_from_a_peer():
    """Once a dead member's keep time is over it is forgotten everywhere, for good: a peer that reaps
    it a little later cannot hand it back (its table's DEAD row), or two peers would pass it to
    each other for ever, its age starting again at each pass."""
    net = Net(seed=22, dead_time=40.0)
    swims = net.cluster(4, stagger=3.0)  # started apart: each looks for what to forget at its own times
    net.run_until(net.converged, limit=10)
    x = swims[3]
    detect(net, [x], 4)
    net.run(45.0)  # past the keep time on the first to have declared it dead
    net.run(120.0)
    assert [s.node_id for s in net.live() if s.member(x.node_id) is not None] == []
    assert all(s.counters["reaped"] >= 1 for s in net.live())


# -- authentication and malformed input ---------------------------------------

def test_wrong_secret_and_malformed_packets_are_dropped_and_counted():
    net = Net(seed=11, secret="s3cret")
    swims = net.cluster(3)
    net.run_until(net.converged, limit=10)
    intruder = net.add("intruder", seeds=[swims[0].addr], secret="guess")
    net.run(20 * T)
    assert net.stats["auth_failures"] > 0
    assert all(s.member("intruder") is None for s in swims)
    assert {m.node_id for m in intruder.members()} == {"intruder"}
    net.crash(intruder)

    before, before_auth = net.stats["malformed"], net.stats["auth_failures"]
    target = swims[0].addr
    good = Codec("s3cret", clock=lambda: WALL0 + net.now)
    for data in (b"", b"\xc1", b"garbage" * 10, good.encode(Ping(1, "n0", "n1"))[:-1],
                 Codec("s3cret").encode(Ping(1, "n0", "n1")) + b"x"):
        net.inject(target, data)
    # Authenticated but malformed: a forged ALIVE with a bool where the incarnation goes.
    body = msgpack.packb([1, 5, "n1", [[0, "ghost", True, "10.0.0.9", 7946, {}]]])
    net.inject(target, good._seal(body))
    net.run(T)
    assert net.stats["auth_failures"] == before_auth + 5
    assert net.stats["malformed"] == before + 1
    assert swims[0].member("ghost") is None
    assert net.converged(swims)


def test_replayed_packets_are_refused_and_counted():
    """Issue 11: with a secret, an authentic packet captured on the wire is accepted once;
    replayed within the window it is a replay, later it is stale; neither reaches SWIM."""
    net = Net(seed=12, secret="s3cret")
    swims = net.cluster(4)
    net.run_until(net.converged, limit=10)
    net.tap = []
    net.run(4 * T)
    captured, net.tap = net.tap, None
    assert len(captured) > 20 and net.stats["replayed"] == net.stats["stale"] == 0
    events = len(net.events)
    for src, dst, data in captured:
        net.inject(dst, data, src)
    net.run(T)
    assert net.stats["replayed"] == len(captured) and net.stats["stale"] == 0
    # a copy of each packet, replayed after the window, is stale
    net.run(wire.REPLAY_WINDOW + T)
    for src, dst, data in captured:
        net.inject(dst, data, src)
    net.run(T)
    assert net.stats["stale"] == len(captured) and net.stats["replayed"] == len(captured)
    assert net.converged(swims) and len(net.events) == events  # no member changed on their account


def test_replay_guard_accepts_each_stamp_once_within_the_window():
    g = ReplayGuard(window=30.0, per_sender=4)
    now = 1000.0
    us = int(now * 1e6)
    g.check("a", us, now)
    with pytest.raises(Replayed) as info:
        g.check("a", us, now)
    assert not info.value.stale
    g.check("b", us, now)  # the same stamp from another sender is another packet
    g.check("a", us - 5_000_000, now)  # reordered, still inside the window: accepted once
    with pytest.raises(Replayed):
        g.check("a", us - 5_000_000, now + 1)
    for skew in (-31.0, 31.0):  # outside the window either way: stale, with the skew measured
        with pytest.raises(Replayed) as info:
            g.check("a", us + int(skew * 1e6), now)
        assert info.value.stale and info.value.skew == pytest.approx(skew)
    # per_sender bounds memory: past it the oldest stamp is forgotten and everything up to it refused
    for i in range(1, 5):
        g.check("a", us + i, now)
    with pytest.raises(Replayed):
        g.check("a", us - 5_000_000, now)
    with pytest.raises(Replayed):
        g.check("a", us - 1, now)  # never seen, but below the forgotten oldest
    g.check("a", us + 10, now)
    # senders gone quiet for a window are forgotten at the next sweep
    assert len(g) == 2
    later = now + 31
    for i in range(ReplayGuard.SWEEP_EVERY):
        g.check("c", int(later * 1e6) + i, later)
    assert len(g) == 1


def test_stamps_strictly_increase_whatever_the_clock_does():
    clock = [100.0]
    tx, rx = Codec("k", clock=lambda: clock[0]), Codec("k", clock=lambda: 100.0)
    packets = [tx.encode(Nack(i, "a")) for i in range(3)]
    clock[0] = 99.0  # the wall clock stepped back (NTP)
    packets.append(tx.encode(Nack(3, "a")))
    assert [rx.decode_datagram(p) for p in packets] == [Nack(i, "a") for i in range(4)]
    assert len({p[-wire.MAC_LEN - wire.STAMP_LEN:-wire.MAC_LEN] for p in packets}) == 4


# -- wire format --------------------------------------------------------------

ALIVE = Update(State.ALIVE, "a", 3, ("10.0.0.1", 7946), {"resp": "10.0.0.1:7379", "tiers": {"dram": [1, 2]}})
MESSAGES = [
    Ping(7, "b", "a", (ALIVE, Update(State.SUSPECT, "c", 2, source="a"), Update(State.LEFT, "d", 9))),
    Ack(wire.MAX_SEQ, "b", (Update(State.DEAD, "c", 0, source="b"),)),
    Nack(0, "b"),
    PingReq(9, "c", ("::1", 1), "a", (ALIVE,)),
    Rumor("a", ()),
]


@pytest.mark.parametrize("secret", ["", "k"])
def test_every_message_round_trips(secret):
    codec = Codec(secret)
    for msg in MESSAGES:
        assert codec.decode_datagram(codec.encode(msg)) == msg
    pp = PushPull("a", (Entry("a", ("10.0.0.1", 7946), 3, State.SUSPECT, {"x": None}),))
    assert codec.decode_frame(codec.encode(pp)) == pp
    with pytest.raises(MalformedPacket):
        codec.decode_datagram(codec.encode(pp))  # push/pull never travels over UDP
    with pytest.raises(MalformedPacket):
        codec.decode_frame(codec.encode(MESSAGES[0]))


def test_missing_or_foreign_mac_is_an_auth_failure():
    plain, keyed = Codec(""), Codec("k")
    data = plain.encode(MESSAGES[0])
    with pytest.raises(AuthFailure):
        keyed.decode_datagram(data)
    with pytest.raises(AuthFailure):
        keyed.decode_datagram(Codec("other").encode(MESSAGES[0]))
    with pytest.raises(AuthFailure):
        keyed.decode_datagram(b"short")
    with pytest.raises(MalformedPacket):  # a MAC'd packet is not msgpack to a node without a secret
        plain.decode_datagram(keyed.encode(MESSAGES[0]))


@pytest.mark.parametrize("body", [
    [2, 1, 7, "b", "a", []],  # unknown version
    [1, 9, 7, "b", "a", []],  # unknown type
    [1, 1, 7, "b", "a"],  # missing field
    [1, 1, -1, "b", "a", []],  # negative seq
    [1, 1, 2**32, "b", "a", []],  # seq too large
    [1, 1, 7, "", "a", []],  # empty id
    [1, 1, 7, "b" * 65, "a", []],  # id too long
    [1, 1, 7, b"b", "a", []],  # bytes where a string goes
    [1, True, 7, "b", "a", []],  # bool where an int goes
    [1, 1, 7, "b", "a", [[0, "x", 1, "h", 0, {}]]],  # port 0
    [1, 1, 7, "b", "a", [[0, "x", 1, "h", 1, []]]],  # meta not a map
    [1, 1, 7, "b", "a", [[0, "x", 1, "h", 1, {"k": {"k": {"k": {"k": {"k": 1}}}}}]]],  # too deep
    [1, 1, 7, "b", "a", [[1, "x", 1]]],  # suspect without accuser
    [1, 1, 7, "b", "a", [[4, "x", 1]]],  # unknown state
    [1, 1, 7, "b", "a", [[3, "x", 1]] * 65],  # too many updates
    {"v": 1},  # not an array
])
def test_malformed_shapes_are_refused(body):
    with pytest.raises(MalformedPacket) as info:
        Codec().decode_datagram(msgpack.packb(body, use_bin_type=True))
    assert not isinstance(info.value, AuthFailure)


def test_size_limits():
    with pytest.raises(MalformedPacket):
        Codec().decode_datagram(b"\x90" + b"\x00" * wire.MAX_DATAGRAM)
    big_meta = {"blob": "x" * (wire.MAX_META_BYTES + 1)}
    with pytest.raises(ValueError):
        wire.check_meta(big_meta)
    with pytest.raises(ValueError):
        Swim("a", ("10.0.0.1", 1), big_meta, clock=lambda: 0.0, rng=random.Random(0))
    frame = Codec().encode(PushPull("a", (Entry("b", ("h", 1), 0, State.ALIVE, big_meta),)))
    with pytest.raises(MalformedPacket):
        Codec().decode_frame(frame)


def test_packets_stay_within_the_budget_with_a_full_queue():
    now = [0.0]
    s = Swim("me", ("10.0.0.1", 7946), {}, clock=lambda: now[0], rng=random.Random(1), **DEFAULTS)
    fat = {"pad": "m" * 400}
    s.merge_state(PushPull("peer", tuple(Entry(f"node-{i:03d}", (f"10.1.0.{i}", 7946), 0, State.ALIVE, fat)
                                         for i in range(1, 100))))
    assert len(s.drain_events()) == 99
    sizes, carried = [], 0
    for step in range(200):
        now[0] += T
        s.tick(now[0])
        for addr, msg in s.drain_outbox():
            sizes.append(len(Codec("k").encode(msg)))
            carried += len(getattr(msg, "updates", ()))
    assert max(sizes) <= wire.PACKET_BUDGET
    assert carried > 100  # updates did ride along, two per packet at this size


def test_a_dead_row_in_a_table_leaves_the_shortest_window_and_a_suspect_row_the_longest():
    """A member the DEAD rumour missed (1 in 1,000 pairs at a thousand nodes) learns it from a
    push/pull: it waits `lo` for a refutation, not Lifeguard's unconfirmed `hi` (which made a
    5% crash take 48 s to reach every view at 1,000 nodes instead of about 23 s)."""
    now = [0.0]
    s = Swim("me", ("10.0.0.1", 7946), {}, clock=lambda: now[0], rng=random.Random(1), **DEFAULTS)
    rows = [Entry(f"node-{i}", (f"10.1.0.{i}", 7946), 0, State.ALIVE, {}) for i in range(1, 5)]
    s.merge_state(PushPull("peer", tuple(rows)))
    lo, hi = s.suspicion_bounds(s.live_count())
    assert hi > lo
    now[0] = 1.0
    s.merge_state(PushPull("peer", (Entry("node-1", rows[0].addr, 0, State.DEAD, {}),
                                    Entry("node-2", rows[1].addr, 0, State.SUSPECT, {}))))
    assert s._suspicions["node-1"].deadline == pytest.approx(1.0 + lo)
    assert s._suspicions["node-2"].deadline == pytest.approx(1.0 + hi)
    now[0] = 3.0  # the suspect row's member is later reported DEAD by another table: lo from its start
    s.merge_state(PushPull("other", (Entry("node-2", rows[1].addr, 0, State.DEAD, {}),)))
    assert s._suspicions["node-2"].deadline == pytest.approx(1.0 + lo)
    now[0] = 1.0 + lo + 0.01
    s.tick(now[0])
    dead = {e.member.node_id for e in s.drain_events() if e.kind is EventKind.DEAD}
    assert dead == {"node-1", "node-2"}
    assert {m.node_id for m in s.members() if m.state is State.ALIVE} >= {"node-3", "node-4"}


# -- precedence (SWIM's rules, one member, one node) ---------------------------

def _one(now=None):
    now = now or [0.0]
    s = Swim("me", ("10.0.0.1", 7946), {}, clock=lambda: now[0], rng=random.Random(1), **DEFAULTS)
    s.receive(Rumor("x", (Update(State.ALIVE, "x", 5, ("10.0.0.2", 7946), {}),)), ("10.0.0.2", 7946))
    return s


@pytest.mark.parametrize("news, expect", [
    (Update(State.SUSPECT, "x", 4, source="y"), (State.ALIVE, 5)),  # older suspect: ignored
    (Update(State.SUSPECT, "x", 5, source="y"), (State.SUSPECT, 5)),  # suspect(i) beats alive(j), i >= j
    (Update(State.ALIVE, "x", 5, ("10.0.0.2", 7946), {"m": 1}), (State.ALIVE, 5)),  # same inc: no change
    (Update(State.DEAD, "x", 4, source="y"), (State.ALIVE, 5)),
    (Update(State.DEAD, "x", 5, source="y"), (State.DEAD, 5)),
    (Update(State.LEFT, "x", 6), (State.LEFT, 6)),
])
def test_precedence_against_alive(news, expect):
    s = _one()
    s.receive(Rumor("y", (news,)), ("10.0.0.3", 7946))
    m = s.member("x")
    assert (m.state, m.incarnation) == expect


def test_precedence_of_alive_over_suspect_and_dead():
    s = _one()
    s.receive(Rumor("y", (Update(State.SUSPECT, "x", 5, source="y"),)), ("10.0.0.3", 7946))
    s.receive(Rumor("y", (Update(State.ALIVE, "x", 5, ("10.0.0.2", 7946), {}),)), ("10.0.0.3", 7946))
    assert s.member("x").state is State.SUSPECT  # alive(i) needs i > j
    s.receive(Rumor("y", (Update(State.ALIVE, "x", 6, ("10.0.0.2", 7946), {}),)), ("10.0.0.3", 7946))
    assert s.member("x").state is State.ALIVE
    s.receive(Rumor("y", (Update(State.DEAD, "x", 6, source="y"),)), ("10.0.0.3", 7946))
    s.receive(Rumor("y", (Update(State.ALIVE, "x", 6, ("10.0.0.2", 7946), {}),)), ("10.0.0.3", 7946))
    assert s.member("x").state is State.DEAD  # the tombstone holds against a stale alive
    s.receive(Rumor("y", (Update(State.LEFT, "x", 6),)), ("10.0.0.3", 7946))
    assert s.member("x").state is State.LEFT  # the member's own word wins over our verdict
    s.receive(Rumor("y", (Update(State.DEAD, "x", 7, source="y"),)), ("10.0.0.3", 7946))
    assert s.member("x").state is State.LEFT
    kinds = [e.kind for e in s.drain_events()]
    assert kinds == [EventKind.JOINED, EventKind.SUSPECT, EventKind.ALIVE, EventKind.DEAD, EventKind.LEFT]


def test_only_the_member_raises_its_incarnation():
    s = _one()
    s.receive(Rumor("y", (Update(State.SUSPECT, "me", 0, source="y"),)), ("10.0.0.3", 7946))
    assert s.incarnation == 1 and s.local_health == 1
    s.receive(Rumor("y", (Update(State.SUSPECT, "me", 0, source="y"),)), ("10.0.0.3", 7946))
    assert s.incarnation == 1  # stale news about us changes nothing
    s.receive(Rumor("y", (Update(State.DEAD, "me", 4, source="y"),)), ("10.0.0.3", 7946))
    assert s.incarnation == 5
    assert s.member("me").state is State.ALIVE


def test_tombstones_are_reaped():
    now = [0.0]
    s = _one(now)
    s.receive(Rumor("y", (Update(State.DEAD, "x", 5, source="y"),)), ("10.0.0.3", 7946))
    s.receive(Rumor("z", (Update(State.ALIVE, "z", 1, ("10.0.0.4", 7946), {}),)), ("10.0.0.4", 7946))
    s.receive(Rumor("z", (Update(State.LEFT, "z", 1),)), ("10.0.0.4", 7946))
    now[0] = s.tombstone_time + 1
    s.tick(now[0])
    assert s.member("z") is None and s.member("x").state is State.DEAD  # a dead one is kept longer
    now[0] = s.dead_time + 1
    s.tick(now[0])
    assert s.member("x") is None and s.counters["reaped"] == 2


# -- Lifeguard arithmetic -----------------------------------------------------

def test_suspicion_timeout_shrinks_with_independent_confirmations():
    lo, hi = suspicion_bounds(4, 6, 8, 0.5)
    assert (lo, hi) == (2.0, 12.0)
    k = expected_confirmations(4, 8)
    assert k == 2 and expected_confirmations(4, 3) == 1 and expected_confirmations(4, 2) == 0
    s = Suspicion(100.0, lo, hi, k, "a")
    assert s.deadline == 100.0 + hi
    assert not s.confirm("a")  # the first accuser is not a confirmation
    assert s.confirm("b") and 100.0 + lo < s.deadline < 100.0 + hi
    assert not s.confirm("b")
    assert s.confirm("c") and s.deadline == pytest.approx(100.0 + lo)
    assert not s.confirm("d")  # k reached
    assert Suspicion(0.0, lo, hi, 0, "a").deadline == lo
