"""Engines across the cluster: one table on every node, one home per engine, load summed.

* **The table** (engine_table.py) holds every engine any node knows, merged last-writer-wins.
  A registration (`POST /v1/engines`) or a removal (`DELETE /v1/engines/{id}`) on any node
  writes it here (`register`, `remove`), and the node's gossip meta then names the table's
  new summary (`announce`, at once: digest, entries, newest write). A node that sees a
  peer's digest differ from its own, when the peer may hold a write it lacks
  (`worth_pulling`), pulls that peer's table (`PEERENGINES` over the cluster's authenticated
  peer connections: at most `MAX_PULLS` at once, one at a time per peer and one per
  `PULL_GAP_S`, none again while the peer's digest is the one it last pulled) and merges it;
  its own summary changes and spreads the same way. Every engine in the merged table is
  registered in the local `ControlPlane`, so every node's ROUTE, LOCATE and gateway know it.
* **A home per engine** (`home_of`): the node it was registered on while that node is alive,
  else (and for the config file's engines) the live member with the highest rendezvous hash.
  Only the home subscribes to the engine's ZMQ publisher and applies its pushed KV events
  (another node forwards a KVEVENTS or `POST /v1/kv-events` batch there: `forward`); its
  residencies go to the sharded directory with the engine as their holder (dir_link.py).
  When the membership changes an engine's home, the new home gathers the engine's entries
  from their owners (the directory's DUMP, asked of every live member), becomes their
  authority (`Directory.adopt`), then subscribes (the subscriber catches up from the
  publisher's replay buffer); the old home, if alive, unsubscribes and drops its authority.
  A registration is not adopted (nothing was known of it), nor a replaced engine (replacing
  forgets what was known). The home is an engine's one authority in the directory: what
  another node places for it (the gateway's record of a prompt it sent an engine without KV
  events) is handed to the home (`HomePlacements`, the control plane's placements in a
  cluster), not placed there, so two nodes never repair each other's entries away.
* **Load**: `own_loads` (this node's leases, per engine with any) go in the gossip meta; the
  sum of the peers' last advertised loads is the registry's remote part (`remote_loads`).

Every change to the control plane's engines runs under one lock, in `_settle`, which
brings the local registry and subscriptions to what the table and the membership say.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from typing import Any, Callable

import msgpack

from quilld.cluster.dir_entries import DROP, Entry
from quilld.cluster.dir_link import ENGINE_ITEMS, REMOVED, STORED, DirectoryLink
from quilld.cluster.directory import DUMP, Directory
from quilld.cluster.engine_table import EngineTable, Version, home_of, worth_pulling
from quilld.cluster.peer_client import PeerError, PeerPool
from quilld.config import EngineConfig
from quilld.errors import CommandError, QuillError
from quilld.index.control import ControlPlane
from quilld.index.engines import Load
from quilld.index.residency import hash_key
from quilld.model import CacheTier

log = logging.getLogger("quilld.cluster")

# what INFO cluster counts of the engines (each from the start, at 0)
COUNTERS = ("engine_table_pulls", "engine_table_pull_failures", "engine_table_merges", "engine_table_rows_refused",
            "engine_rehomes", "engine_homes_left", "engine_entries_adopted", "engine_events_forwarded",
            "engine_placements_handed_over", "engine_placements_lost", "engine_placements_taken",
            "engine_loads_unadvertised", "engine_blocks_unadvertised")
PULL_GAP_S = 0.5  # seconds between two pulls of one peer's table
MAX_PULLS = 2  # pulls in flight at once (a node that joins sees every peer differ)
SETTLE_DELAY_S = 0.3  # a membership change is acted on once it has not changed for this long
CALL_TIMEOUT = 5.0


def now_ms() -> int:
    return int(time.time() * 1000)


class EngineSync:
    def __init__(self, node_id: str, control: ControlPlane, directory: Directory, link: DirectoryLink,
                 pool: PeerPool, addresses: dict[str, tuple[str, int]], members: dict[str, float],
                 announce: Callable[[], None]) -> None:
        """`members`, `addresses`: the cluster's (kept current by it); `announce()`: gossip this
        node's meta now (the table's digest changed)."""
        self.node_id = node_id
        self.control = control
        self.directory = directory
        self.link = link
        self.pool = pool
        self.addresses = addresses
        self.members = members
        self.announce = announce
        self.table = EngineTable(control.engines.engines.values())
        # engine -> the version registered in the control plane (the config file's, from the start)
        self.applied: dict[str, Version] = {e: entry.version for e, entry in self.table.entries.items()}
        self.homes: dict[str, str] = {}  # engine -> its home, as last settled here
        self.election: Any = None  # with etcd: the registry that elects each engine's home (_elected)
        self.stats: Counter[str] = Counter()
        self._fresh: set[str] = set()  # engines registered here whose first settle must not adopt
        self._pulled: dict[str, str] = {}  # peer -> the digest its table had when we last pulled it
        self._pulling: set[str] = set()
        self._next_pull: dict[str, float] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._delay = 0.0
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.placements = HomePlacements(self)
        self._outbox: dict[str, list] = {}  # home -> placements to hand it

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engines")
        self.kick()

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    def kick(self, delay: float = 0.0) -> None:
        """Settle the registry and homes once the current callbacks are done (after `delay`)."""
        self._delay = max(self._delay, delay)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            while self._delay:  # a burst of membership changes: once it is over
                delay, self._delay = self._delay, 0.0
                await asyncio.sleep(delay)
            self._wake.clear()
            try:
                await self._settle()
            except Exception:
                log.exception("engines: settling the engine table failed")  # a bug: logged, goes on

    # -- this node's writes ---------------------------------------------------------------
    async def register(self, engine: EngineConfig) -> bool:
        """`POST /v1/engines` here: the engine is the cluster's, homed here while this node lives
        (an engine with no locality stores its KV through this node). True when it is new."""
        if not engine.locality:
            engine = dataclasses.replace(engine, locality=self.node_id)
        old = self.table.get(engine.id)
        async with self._lock:
            self.table.put(engine, self.node_id, now_ms())
            self._fresh.add(engine.id)
            await self._settle_locked()
        self.announce()
        return old is None or old.removed

    async def remove(self, engine_id: str) -> int:
        """`DELETE /v1/engines/{id}` here: removed on every node; the residencies dropped here.
        CommandError when no such engine is known."""
        async with self._lock:
            if self.table.remove(engine_id, self.node_id, now_ms()) is None:
                raise CommandError(f"no engine {engine_id!r}")
            dropped = await self._unregister(engine_id)
        self.announce()
        return dropped

    # -- the table over gossip ------------------------------------------------------------
    def meta(self) -> dict:
        return {"eng": self.table.summary()}

    def own_loads(self) -> list[tuple[str, list[int]]]:
        """This node's leases per engine, busiest first (the cluster puts what fits in its meta)."""
        loads = self.control.engines.own_loads()
        return sorted(((e, list(load)) for e, load in loads.items()), key=lambda x: -x[1][0])

    def remote_loads(self, peer_meta: dict[str, dict]) -> None:
        """The peers' advertised loads, summed, as the registry's remote part."""
        total: dict[str, list[int]] = {}
        for peer, meta in peer_meta.items():
            if peer not in self.members:
                continue
            loads = meta.get("load")
            if not isinstance(loads, dict):
                continue
            for engine, load in loads.items():
                if isinstance(load, list) and len(load) == 4 and all(isinstance(n, int) and n >= 0 for n in load):
                    acc = total.setdefault(engine, [0, 0, 0, 0])
                    for i, n in enumerate(load):
                        acc[i] += n
        self.control.engines.set_remote({e: Load(*v) for e, v in total.items()})

    def peer_meta(self, peer: str, meta: dict) -> None:
        """A peer's meta: pull its table when its digest differs from ours (and from the one we
        last pulled of it) and it may hold a write ours lacks; one pull at a time per peer,
        MAX_PULLS in all, not more often than PULL_GAP_S."""
        theirs = meta.get("eng")
        if not worth_pulling(self.table.summary(), theirs) or theirs[0] == self._pulled.get(peer):
            return
        if (peer in self._pulling or len(self._pulling) >= MAX_PULLS
                or time.monotonic() < self._next_pull.get(peer, 0.0)):
            return  # the periodic `tick` looks again
        self._pulling.add(peer)
        task = asyncio.ensure_future(self._pull(peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def tick(self, peer_meta: dict[str, dict]) -> None:
        """Every meta refresh: forget old removals, look at every peer's digest again, and at
        their loads (an engine merged since their last meta change has its load now)."""
        if self.table.expire(now_ms()):
            self.announce()
        self.remote_loads(peer_meta)
        peers = [p for p in peer_meta if p in self.members]
        random.shuffle(peers)  # MAX_PULLS at once: not always the same peers first
        for peer in peers:
            self.peer_meta(peer, peer_meta[peer])

    async def _pull(self, peer: str) -> None:
        self._next_pull[peer] = time.monotonic() + PULL_GAP_S
        try:
            reply = await self._call(peer, "PEERENGINES", self.node_id)
            digest, rows = reply["digest"], reply["rows"]
            if not isinstance(rows, list) or not isinstance(digest, str):
                raise ValueError("PEERENGINES: a map of digest and rows")
        except (QuillError, ValueError, TypeError, KeyError) as e:
            self.stats["engine_table_pull_failures"] += 1
            log.debug("engines: pulling %s's engine table failed: %s", peer, e)
            return
        finally:
            self._pulling.discard(peer)
        self.stats["engine_table_pulls"] += 1
        changed, bad = self.table.merge(rows, now_ms())
        self._pulled[peer] = digest
        if bad:
            self.stats["engine_table_rows_refused"] += bad
            log.warning("engines: %d malformed row(s) in %s's engine table were ignored", bad, peer)
        if changed:
            self.stats["engine_table_merges"] += len(changed)
            for old, new in changed:
                if new.removed:
                    log.info("engines: %s was removed (by %s)", new.engine_id, new.version[1])
                elif old is None or old.removed:
                    log.info("engines: %s registered on %s is known here", new.engine_id, new.origin or "config")
            self.kick()
            self.announce()

    def rows_reply(self) -> bytes:
        """PEERENGINES' reply: this node's table and its digest, msgpacked."""
        return msgpack.packb({"digest": self.table.digest(), "rows": self.table.rows()}, use_bin_type=True)

    async def _call(self, peer: str, *args: Any) -> Any:
        addr = self.addresses.get(peer)
        if addr is None:
            raise PeerError(f"no address for {peer}")
        reply = await self.pool.call(*addr, *args, timeout=CALL_TIMEOUT)
        if isinstance(reply, Exception):
            raise PeerError(f"{peer} refused {args[0]}: {reply}")
        if isinstance(reply, bytes) and args[0] == "PEERENGINES":
            return msgpack.unpackb(reply, raw=False)
        return reply

    # -- homes -----------------------------------------------------------------------------
    def home(self, engine_id: str) -> str | None:
        """The engine's home as this node last settled it (what its subscriptions and authority
        follow; a membership change moves it once settled), or by the rule when not settled yet
        or when that node is no longer a member; None: no such engine. On every KV event: two
        dict lookups."""
        home = self.homes.get(engine_id)
        if home is not None and home in self.members:
            return home
        entry = self.table.get(engine_id)
        if entry is None or entry.removed:
            return None
        return home_of(engine_id, entry.origin, self.members)

    def origin(self, engine_id: str) -> str:
        entry = self.table.get(engine_id)
        return "" if entry is None else entry.origin

    def members_changed(self) -> None:
        self.kick(SETTLE_DELAY_S)

    async def forward(self, home: str, engine_id: str, raw: bytes) -> int:
        """A pushed batch of KV events for an engine homed on another node: applied there."""
        reply = await self._call(home, "PEERKVEVENTS", engine_id, raw)
        if not isinstance(reply, int):
            raise PeerError(f"{home} answered PEERKVEVENTS with {reply!r:.60}")
        self.stats["engine_events_forwarded"] += 1
        return reply

    async def _settle(self) -> None:
        async with self._lock:
            await self._settle_locked()

    async def _settle_locked(self) -> None:
        live = self.table.live()
        for engine_id in [e for e in self.applied if e not in live]:
            await self._unregister(engine_id)
        for engine_id, entry in live.items():
            replaced = False
            if self.applied.get(engine_id) != entry.version:
                # replaced: what was known of the old one is forgotten (unsubscribed, and cleared
                # at the owners by its authority), everywhere
                replaced = engine_id in self.applied
                if replaced:
                    self._fresh.add(engine_id)
                ms, writer, _ = entry.version  # the same place among the candidates on every node
                rank = (ms, writer, 0, engine_id) if ms else (0, "", 1 << 30, engine_id)
                await self.control.add_engine(entry.config, follow=False, rank=rank)
                self.applied[engine_id] = entry.version
            home = home_of(engine_id, entry.origin, self.members)
            if self.election is not None:
                home = self._elected(engine_id, home)
            prev = None if replaced else self.homes.get(engine_id)
            fresh = engine_id in self._fresh
            self._fresh.discard(engine_id)
            if home is not None:
                self.homes[engine_id] = home  # what arrives while it adopts is placed here, and kept
            if home == self.node_id:
                if prev != self.node_id and not fresh:
                    await self._adopt(engine_id, prev)
                if await self.control.follow(engine_id):  # subscribed already: nothing
                    log.info("engines: subscribed to %s's KV events (its home is this node)", engine_id)
            elif home != self.node_id and (prev == self.node_id or engine_id in self.directory.authorities
                                           or self.control.follows(engine_id)):
                await self.control.unfollow(engine_id)
                self.directory.drop_authority(engine_id)  # its entries stay with their owners
                self.stats["engine_homes_left"] += 1
                log.info("engines: %s's home is now %s; this node stopped consuming its KV events", engine_id, home)

    def _elected(self, engine_id: str, wanted: str | None) -> str | None:
        """With etcd (`election`, etcd_registry.py): the home is the node that holds the engine's
        home key, exactly one at a time. The node the rule wants claims it when nobody holds it; a
        holder the rule no longer wants gives it up (and stays home until the key is gone). None:
        nobody holds it yet (a claim is on its way)."""
        held = self.election.home_holder(engine_id)
        if held is not None and held not in self.members:
            held = None  # a dead node's key goes with its lease
        if wanted == self.node_id and held is None:
            self.election.claim_home(engine_id)
        elif held == self.node_id and wanted != self.node_id:
            self.election.release_home(engine_id)
        return held

    async def _unregister(self, engine_id: str) -> int:
        self.applied.pop(engine_id, None)
        self.homes.pop(engine_id, None)
        self._fresh.discard(engine_id)
        try:
            dropped = await self.control.remove_engine(engine_id)
        except CommandError:
            return 0
        self.directory.drop_authority(engine_id)
        return dropped

    async def _adopt(self, engine_id: str, prev: str | None) -> None:
        """Become the authority for the engine's directory entries: gather them from their
        owners (every live member is asked: DUMP), keep them as ours."""
        entries: dict[bytes, tuple[int, Entry]] = {}
        for bucket, e in self.directory.owned.entries_of(engine_id):
            entries[e.eid] = (bucket, e)
        peers = [m for m in self.members if m != self.node_id and m in self.addresses]
        replies = await asyncio.gather(*(self.link.call(p, (DUMP, engine_id)) for p in peers), return_exceptions=True)
        failed = 0
        for peer, reply in zip(peers, replies):
            if isinstance(reply, BaseException):
                if not isinstance(reply, (QuillError, ValueError, TypeError)):
                    raise reply
                failed += 1
                continue
            for bucket, e in reply[1]:
                entry = Entry(*e)
                entries.setdefault(entry.eid, (bucket, entry))
        taken = self.directory.adopt(engine_id, entries.values())  # not those placed here meanwhile
        self.control.note_scope(engine_id)  # its removals reach what it stored without a LoRA adapter
        self.stats["engine_entries_adopted"] += taken
        if prev is not None:
            self.stats["engine_rehomes"] += 1
        log.info("engines: this node is now %s's home%s; adopted its %d directory entries from %d owner(s)%s",
                 engine_id, f" (was {prev})" if prev else "", taken, len(peers) + 1 - failed,
                 f", {failed} did not answer" if failed else "")

    def send_home(self, home: str, item: tuple) -> None:
        """Queue a placement for an engine's home; one request in flight per home carries what
        queued meanwhile."""
        queue = self._outbox.get(home)
        if queue is not None:
            queue.append(item)
            return
        self._outbox[home] = [item]
        task = asyncio.ensure_future(self._hand_over(home))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hand_over(self, home: str) -> None:
        try:
            while self._outbox.get(home):
                items, self._outbox[home] = self._outbox[home], []
                try:
                    await self.link.call(home, (ENGINE_ITEMS, items))
                    self.stats["engine_placements_handed_over"] += len(items)
                except (QuillError, ValueError, TypeError) as e:
                    self.stats["engine_placements_lost"] += len(items)
                    log.debug("engines: handing %d placements to %s failed: %s", len(items), home, e)
        finally:
            self._outbox.pop(home, None)

    # -- reporting -------------------------------------------------------------------------
    def info(self) -> list[tuple[str, Any]]:
        live = self.table.live()
        self.stats["engine_placements_taken"] = self.link.stats["engine_items_taken"]
        return [("cluster_engines_known", len(live)),
                ("cluster_engines_homed", sum(1 for e in live if self.homes.get(e) == self.node_id)),
                ("cluster_engine_table_digest", self.table.digest()),
                *((f"cluster_{k}", self.stats[k]) for k in COUNTERS)]


class HomePlacements:
    """The control plane's `placements` in a cluster: an engine's residencies go to the directory
    from its home; another node hands them to the home. A clear reaches the owners from the
    engine's authority only (its home, or the home it was until a replacement moved it): on
    any other node it is that node's own forgetting, not the engine's."""

    def __init__(self, sync: EngineSync) -> None:
        self.sync = sync
        self.link = sync.link

    def _home(self, engine: str) -> str | None:
        home = self.sync.home(engine)
        return None if home is None or home == self.sync.node_id else home

    def engine_blocks(self, engine: str, ops: list[tuple]) -> None:
        """A batch of the engine's stores and removals (DirectoryLink.engine_blocks): placed here
        when this node is its home, else handed to the home an event at a time."""
        home = self._home(engine)
        if home is None:
            self.link.engine_blocks(engine, ops)
            return
        for tag, tier, hashes, parent in ops:
            if parent is DROP:
                self.engine_removed(engine, tag, hashes, tier)
            else:
                self.engine_stored(engine, tag, hashes, parent, tier)

    def engine_stored(self, engine: str, tag: bytes, hashes: Any, parent: Any, tier: CacheTier) -> None:
        home = self._home(engine)
        if home is None:
            self.link.engine_stored(engine, tag, hashes, parent, tier)
        else:
            self.sync.send_home(home, (engine, STORED, self.link.ctag(tag), [hash_key(h) for h in hashes],
                                       None if parent is None else hash_key(parent), tier.value))

    def engine_removed(self, engine: str, tag: bytes, hashes: Any, tier: CacheTier | None) -> None:
        home = self._home(engine)
        if home is None:
            self.link.engine_removed(engine, tag, hashes, tier)
        else:
            self.sync.send_home(home, (engine, REMOVED, self.link.ctag(tag), [hash_key(h) for h in hashes], None,
                                       None if tier is None else tier.value))

    def engine_cleared(self, engine: str) -> None:
        if engine in self.sync.directory.authorities:
            self.link.engine_cleared(engine)
