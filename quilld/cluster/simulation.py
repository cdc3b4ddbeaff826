"""A deterministic cluster in one process: real membership and directory code, a virtual clock.

Each simulated node runs the real `Swim` (membership) and the real `Directory`
(ownership, placement, handoff, anti-entropy, lookups), the same objects a
quilld node runs; only the transport is replaced: SWIM datagrams, push/pulls and
directory requests are delivered in memory after a per-link delay (and, when
asked, lost with a given probability), on a virtual clock driven by an event
heap. Everything is seeded, so a run (and a failure) reproduces exactly.

Used by the suite (a few dozen nodes) and by `bench/directory_sim.py` (up to a
thousand). Nothing here is imported by a running quilld.

What it can say, per scenario: how many directory bytes each node keeps, how
many messages a placement costs, how many owner round trips a ROUTE or a key
lookup costs, how long the directory takes to converge after nodes crash, join
or restart, and whether every entry of every live holder can be found.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from quilld.cluster.dir_entries import KEY, HeldEntries, scope_digest
from quilld.cluster.dir_owned import OwnedEntries, run_items
from quilld.cluster.dir_lookup import LookupRun
from quilld.cluster.directory import BATCH, LOOKUP, Directory, DirectorySettings
from quilld.cluster.swim import EventKind, Swim

SWIM_DEFAULTS = dict(probe_interval=0.5, probe_timeout=0.2, indirect_probes=3, suspicion_mult=4,
                     push_pull_interval=10.0)
RPC_TIMEOUT = 1.0  # a directory request (or its reply) lost: the sender learns it after this
CTAG = scope_digest("default", "m", "t", "")


def chain(seed: int, n: int) -> list[bytes]:
    """`n` chained 8-byte block hashes (a prompt's blocks), deterministic in `seed`."""
    rng = random.Random(seed)
    return [rng.getrandbits(64).to_bytes(8, "big") for _ in range(n)]


@dataclass
class SimNode:
    node_id: str
    addr: tuple[str, int]
    swim: Swim
    directory: Directory
    members: dict[str, float] = field(default_factory=dict)  # live members as SWIM tells this node
    epoch: int = 0
    keys: set[bytes] = field(default_factory=set)  # eids of the keys this node holds
    engines: dict[str, list[list[bytes]]] = field(default_factory=dict)  # engine -> its chains


class Simulation:
    def __init__(self, seed: int = 1, settings: DirectorySettings = DirectorySettings(), *, loss: float = 0.0,
                 delay: tuple[float, float] = (0.0002, 0.001), **swim_kw) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.settings = settings
        self.loss = loss
        self.delay = delay
        self.swim_kw = {**SWIM_DEFAULTS, **swim_kw}
        self.nodes: dict[str, SimNode] = {}
        self.by_addr: dict[tuple, str] = {}
        self.down: set[str] = set()
        self.stats: Counter[str] = Counter()
        self._heap: list = []
        self._tie = itertools.count()
        self._wake_at: dict[str, float | None] = {}
        self._seq = itertools.count(1)

    # -- building ---------------------------------------------------------------------
    def add(self, node_id: str, seeds: Iterable[str] = (), restart_of: SimNode | None = None) -> SimNode:
        n = len(self.by_addr)
        addr = restart_of.addr if restart_of else (f"10.{n // 60000}.{n // 250 % 240}.{n % 250 + 1}", 7946)
        epoch = (restart_of.epoch + 1) if restart_of else 0
        directory = Directory(node_id, self.settings, rng=random.Random(self.rng.random()))
        directory.epoch = f"{self.rng.getrandbits(64):016x}"  # seeded, so a run reproduces
        swim = Swim(node_id, addr, {"epoch": directory.epoch}, clock=lambda: self.now,
                    rng=random.Random(self.rng.random()), **self.swim_kw)
        node = SimNode(node_id, addr, swim, directory, {node_id: 1.0}, epoch)
        if restart_of is not None:  # what it held comes back (its SSD tier), and is placed anew
            node.keys, node.engines = restart_of.keys, restart_of.engines
        self.nodes[node_id] = node
        self.by_addr[addr] = node_id
        self.down.discard(node_id)
        directory.note_members(node.members, self.now)
        for eid in node.keys:
            directory.place_key(node_id, eid, "dram", 4096)
        for engine, chains in node.engines.items():
            for c in chains:
                self._place_chain(node, engine, c)
        swim.join([self.nodes[s].addr for s in seeds])
        self._pump(node_id)
        return node

    def start(self, n: int, prefix: str = "n", seeds: int = 3, stagger: float = 0.002,
              bootstrap: bool = False) -> list[SimNode]:
        """`n` nodes joining through the first `seeds`, `stagger` apart; or, with `bootstrap`, a
        cluster that has already converged: every node's SWIM table filled by push/pulls through
        the first node (SWIM's own merge), so a large simulation starts from one shared view."""
        out = []
        for i in range(n):
            out.append(self.add(f"{prefix}{i:04d}", [] if bootstrap else [s.node_id for s in out[:seeds]]))
            if not bootstrap:
                self.run(stagger)
        if bootstrap and out:
            hub = out[0].swim
            for node in out[1:]:
                hub.merge_state(node.swim.full_state())
            state = hub.full_state()
            for node in out[1:]:
                node.swim.merge_state(state)
            for node in out:
                self._pump(node.node_id)
        return out

    def set_meta(self, node: SimNode, meta: dict) -> None:
        """`node` publishes new meta, as a busy node's changes every probe interval (its SWIM's
        update_meta: rate-limited there, spread like any ALIVE update)."""
        node.swim.update_meta({**meta, "epoch": node.directory.epoch})
        self._pump(node.node_id)

    def live(self) -> list[SimNode]:
        return [n for nid, n in self.nodes.items() if nid not in self.down]

    def crash(self, ids: Iterable[str]) -> None:
        for nid in ids:
            self.down.add(nid)
            self.stats["crashes"] += 1

    def restart(self, node_id: str) -> SimNode:
        """The node's process dies and a new one starts under its name, keeping what it held."""
        old = self.nodes[node_id]
        seeds = [n.node_id for n in self.live() if n.node_id != node_id][:3]
        self.down.add(node_id)
        return self.add(node_id, seeds, restart_of=old)

    # -- workload ---------------------------------------------------------------------
    def place_keys(self, node: SimNode, count: int, size: int = 4096) -> None:
        for _ in range(count):
            eid = CTAG + b"chunk:%d" % next(self._seq)
            node.keys.add(eid)
            node.directory.place_key(node.node_id, eid, "dram", size)
        self._pump(node.node_id)

    def place_engine(self, node: SimNode, engine: str, chains: list[list[bytes]]) -> None:
        node.engines.setdefault(engine, []).extend(chains)
        for c in chains:
            self._place_chain(node, engine, c)
        self._pump(node.node_id)

    @staticmethod
    def _place_chain(node: SimNode, engine: str, c: list[bytes]) -> None:
        parent = None
        for h in c:
            node.directory.place_block(engine, CTAG, h, parent, "hbm")
            parent = h

    # -- the network ----------------------------------------------------------------------
    def _link_delay(self) -> float:
        lo, hi = self.delay
        return self.rng.uniform(lo, hi)

    def _lost(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss

    def _push(self, when: float, kind: str, arg) -> None:
        heapq.heappush(self._heap, (when, next(self._tie), kind, arg))

    def _pump(self, nid: str) -> None:
        if nid in self.down:
            return
        node = self.nodes[nid]
        swim, d = node.swim, node.directory
        for dst, msg in swim.drain_outbox():
            self.stats["swim_packets"] += 1
            dest = self.by_addr.get(tuple(dst))
            if dest is None or dest in self.down or self._lost():
                continue
            self._push(self.now + self._link_delay(), "pkt", (node.addr, dest, msg))
        for dst in swim.drain_syncs():
            self._push_pull(nid, self.by_addr.get(tuple(dst)))
        events = swim.drain_events()
        if events:
            self._membership(node, events)
        for dest, msg in d.poll(self.now):
            self._request(nid, dest, msg)
        due = min(swim.next_deadline(), d.next_deadline())
        due = max(due, self.now)
        if due != math.inf and due != self._wake_at.get(nid):
            self._wake_at[nid] = due
            self._push(due, "wake", nid)

    def _membership(self, node: SimNode, events) -> None:
        for ev in events:
            m = ev.member
            if m.node_id == node.node_id:
                continue
            if ev.kind in (EventKind.DEAD, EventKind.LEFT):
                node.members.pop(m.node_id, None)
            elif ev.kind is not EventKind.SUSPECT:
                node.members[m.node_id] = 1.0
                self._maybe_restarted(node, m)
        node.directory.note_members(node.members, self.now)

    def _maybe_restarted(self, node: SimNode, member) -> None:
        seen = getattr(node, "_epochs", None)
        if seen is None:
            seen = node._epochs = {}
        epoch = (member.meta or {}).get("epoch", "")
        if seen.get(member.node_id, epoch) != epoch:
            node.directory.restarted(member.node_id, epoch, self.now)
        seen[member.node_id] = epoch

    def _push_pull(self, src: str, dst: str | None) -> None:
        if dst is None or dst in self.down or src in self.down:
            return
        a, b = self.nodes[src].swim, self.nodes[dst].swim
        b.merge_state(a.full_state())
        a.merge_state(b.full_state())
        self.stats["push_pulls"] += 1
        self._push(self.now, "pump", dst)

    def _request(self, src: str, dst: str, msg: tuple) -> None:
        self.stats[f"dir_requests_{msg[0]}"] += 1
        if msg[0] == BATCH:
            self.stats["dir_batch_items"] += len(msg[3])
        if dst in self.down or dst not in self.nodes or self._lost():
            self._push(self.now + RPC_TIMEOUT, "fail", (src, dst, msg))
            return
        self._push(self.now + self._link_delay(), "req", (src, dst, msg))

    def run(self, duration: float) -> None:
        end = self.now + duration
        heap = self._heap
        while heap and heap[0][0] <= end:
            t, _, kind, arg = heapq.heappop(heap)
            self.now = t
            if kind == "pkt":
                src_addr, dst, msg = arg
                if dst in self.down:
                    continue
                self.nodes[dst].swim.receive(msg, src_addr)
                self._pump(dst)
            elif kind == "wake":
                if arg in self.down or self._wake_at.get(arg) != t:
                    continue
                self._wake_at[arg] = None
                self.nodes[arg].swim.tick(t)
                self._pump(arg)
            elif kind == "pump":
                self._pump(arg)
            elif kind == "req":
                src, dst, msg = arg
                if dst in self.down:
                    self._push(self.now + RPC_TIMEOUT, "fail", arg)
                    continue
                reply = self.nodes[dst].directory.handle(src, msg, t)
                self._pump(dst)
                if self._lost():
                    self._push(self.now + RPC_TIMEOUT, "fail", arg)
                else:
                    self._push(self.now + self._link_delay(), "rep", (src, dst, msg, reply))
            elif kind == "rep":
                src, dst, msg, reply = arg
                if src in self.down or self.nodes[src].directory is None:
                    continue
                self.nodes[src].directory.on_reply(dst, msg, reply, t)
                self._pump(src)
            elif kind == "fail":
                src, dst, msg = arg
                if src not in self.down:
                    self.nodes[src].directory.on_failure(dst, msg, t)
                    self._pump(src)
        self.now = end

    # -- observing ----------------------------------------------------------------------
    def views_agree(self) -> bool:
        """Every live node's directory applies the true set of live members."""
        truth = {n.node_id for n in self.live()}
        return all(set(n.directory.members) == truth for n in self.live())

    def quiet(self) -> bool:
        """Nothing queued or unanswered anywhere (no anti-entropy digest in flight either)."""
        return not any(n.directory.busy() for n in self.live())

    def settled(self) -> bool:
        """Every view applied and agreed, every bucket gained filled, every channel synced."""
        if not self.views_agree():
            return False
        for n in self.live():
            d = n.directory
            if d.filling or d._pending is not None or d._copy_asks or d._ready or any(
                    ch.queue and ch.queue[0][0] != "D" for ch in d.channels.values()):
                return False
        return True

    def converged(self) -> bool:
        """Settled, and every entry of every live holder at every one of its owners, none stale."""
        return self.settled() and self.unfindable() == (0, 0) and self.stale() == 0

    def run_until(self, cond: Callable[[], bool], limit: float, step: float = 0.1) -> float | None:
        """Run until `cond()` holds; the simulated seconds it took, or None past `limit`."""
        start = self.now
        while not cond():
            if self.now - start >= limit:
                return None
            self.run(step)
        return self.now - start

    def live_entries(self) -> list[tuple[str, int, bytes, bytes]]:
        """(holder, kind, eid, shard) of every entry a live node is the authority for."""
        out = []
        for n in self.live():
            for holder, held in n.directory.authorities.items():
                for bucket, entries in held.buckets.items():
                    for eid, (kind, shard, *_code) in entries.items():
                        out.append((holder, kind, eid, shard))
        return out

    def unfindable(self) -> tuple[int, int]:
        """(entries at none of their owners, entries missing at some owner), by the true view."""
        live = {n.node_id: n for n in self.live()}
        judge = next(iter(live.values())).directory.ownership
        none = short = 0
        for holder, kind, eid, shard in self.live_entries():
            b = judge.bucket_of(shard)
            found = 0
            owners = judge.owners(b)
            for o in owners:
                owned: OwnedEntries = live[o].directory.owned
                if kind == KEY:
                    got = owned.key_holders(b, eid)
                else:
                    got = owned.segment(b, shard, [eid[8:]])[0]
                found += any(h[0] == holder for h in got)
            if not found:
                none += 1
            elif found < len(owners):
                short += 1
        return none, short

    def stale(self) -> int:
        """Entries an owner keeps, in a bucket it owns, that their holder does not have (or has
        otherwise): what a lost removal would leave behind. A holder that is not live (an engine
        whose home died and was not re-homed) is left out."""
        truth: dict[tuple[str, bytes], tuple[int, int]] = {}
        for n in self.live():
            for holder, held in n.directory.authorities.items():
                for entries in held.buckets.values():
                    for eid, (_kind, _shard, code, *version) in entries.items():
                        truth[(holder, eid)] = (code, *version) if version else (code, 0)
        holders = {h for h, _ in truth} | {n.node_id for n in self.live()}
        bad = 0
        for n in self.live():
            d = n.directory
            for b in d.owned_buckets(n.node_id):
                for holder, e in d.owned.bucket_entries(b):
                    if holder in holders and truth.get((holder, e.eid)) != (e.code, e.version):
                        bad += 1
        return bad

    def lookup(self, node: SimNode, items: list[tuple]) -> tuple[list, int, int]:
        """Resolve LOOKUP items from `node` with quilld's own lookup loop (`LookupRun`, as
        dir_link.py drives it), its owners asked one after another on the running clock (a
        down owner or a lost message costs RPC_TIMEOUT): (answers, owner round trips, rounds)."""
        d = node.directory
        run = LookupRun(d, items)
        while asks := run.asks(self.now):
            for owner, its in asks.items():
                t0 = self.now
                if owner in self.down or self._lost():
                    self.run(RPC_TIMEOUT)
                    run.took(owner, None)
                    continue
                self.run(self._link_delay())
                reply = self.nodes[owner].directory.handle(node.node_id, (LOOKUP, its), self.now)
                self.run(self._link_delay())
                self.stats["lookup_seconds"] += self.now - t0
                run.took(owner, reply)
        return run.answers(), run.trips, run.rounds

    def directory_bytes(self, node: SimNode) -> int:
        """Bytes of the entries this node keeps as an owner (the structures, their keys and values)."""
        return owned_bytes(node.directory.owned)


def held_bytes(held: HeldEntries) -> int:
    """The bytes of a holder's own list of its entries (what it resends to new owners): every
    object under it once, however many entries share it (a segment's shard, cached small ints)."""
    seen: set[int] = set()
    total = 0
    stack: list[Any] = [held.buckets, held.where, held.digests]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if obj.__class__ is dict:
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif obj.__class__ is tuple:
            stack.extend(obj)
    return total


def owned_bytes(owned: OwnedEntries) -> int:
    size = sys.getsizeof
    total = size(owned.keys) + size(owned.segs) + size(owned.digests)
    for d in owned.keys.values():
        total += size(d)
        for k, v in d.items():
            total += size(k) + size(v)
    for segs in owned.segs.values():
        total += size(segs)
        for shard, runs in segs.items():
            total += size(shard) + size(runs)
            for no, run in runs.items():
                total += size(no) + size(run)
                if run.__class__ is dict:  # hashes of other widths
                    total += sum(size(k) + size(v) for k, v in run_items(run))
    for per in owned.digests.values():
        total += size(per) + sum(size(no) + size(v) for no, v in per.items())
    return total
