"""The node's side of the cluster: membership, the sharded directory, peer fetch.

Gossip (SWIM) tells who is alive and where its RESP port is. The live members are the
directory's view (directory.py: each entry has `cluster.directory_replicas` owner nodes by
rendezvous hashing), applied once the view settles; `DirectoryLink` (dir_link.py) moves the
directory's messages and answers this node's lookups. A member declared dead (or that left)
loses its entries at every owner at once; a member that restarted (a new directory epoch in
its gossip meta) is told everything anew. Reads of values this node lacks go to the holders
the directory names (pool_reads.py), never to every peer.

Engines are the cluster's (engines_sync.py): every node holds the same engine table (its digest
in the gossip meta, a differing peer's table pulled), each engine's KV events are consumed by
one home node, re-homed when that node dies or leaves, and the leases on each engine are summed
over the nodes (each node's own in its meta).

Membership changes are logged, one line each: a peer joins, is suspected, comes back,
restarts, leaves or is declared dead (gossip.py warns when no seed answers).
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
import time
from collections import Counter
from typing import Any, Callable

from quilld import __version__
from quilld.cluster.breaker import PeerHealth
from quilld.cluster.dir_link import DirectoryLink
from quilld.cluster.directory import Directory, DirectorySettings
from quilld.cluster.engines_sync import EngineSync
from quilld.cluster.etcd_registry import EtcdRegistry
from quilld.cluster.gossip import Gossip
from quilld.cluster.local_secret import local_secret
from quilld.cluster.peer_client import PeerPool
from quilld.cluster.pool_reads import PoolReads
from quilld.cluster.transfer import Transfers
from quilld.cluster.wire import MAX_META_BYTES
from quilld.config import Config
from quilld.index.control import ControlPlane
from quilld.index.residency import ResidencyIndex
from quilld.index.route_request import RouteRequest
from quilld.index.router import Decision
from quilld.index.residency_feed import ResidencyFeed
from quilld.model import CacheTier, IdentityScope
from quilld.scopes import ScopeRegistry
from quilld.tiers.keyspace import Keyspace

log = logging.getLogger("quilld.cluster")

ENGINE_TIERS = (CacheTier.HBM, CacheTier.CPU, CacheTier.STORAGE)  # an engine's own, advertised by its home
META_INTERVAL = 1.0  # seconds between refreshes of this node's advertised usage


def advertised_host(bind: str) -> str:
    """The address peers and clients are told to reach this node at (a wildcard bind: loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "", "::") else bind


def standalone_meta(bind: str, port: int, admin_port: int, dram_used: int, dram_capacity: int) -> dict:
    """What a node outside any cluster would advertise of itself: the fields NODES and /v1/nodes show."""
    host = advertised_host(bind)
    return {"resp": [host, port], "admin": [host, admin_port], "dram_capacity": dram_capacity,
            "dram_used": dram_used, "version": __version__}


def node_line(node_id: str, state: str, incarnation: int, meta: dict, myself: bool) -> str:
    """One NODES line: `id state[ myself] incarnation resp admin dram_used/dram_capacity`."""
    resp = ":".join(map(str, meta.get("resp", ["?", "?"])))
    admin = ":".join(map(str, meta.get("admin", ["?", "?"])))
    me = " myself" if myself else ""
    return (f"{node_id} {state}{me} {incarnation} {resp} {admin} "
            f"{meta.get('dram_used', 0)}/{meta.get('dram_capacity', 0)}")


def directory_settings(cfg: Config) -> DirectorySettings:
    c = cfg.cluster
    return DirectorySettings(replicas=c.directory_replicas, buckets=c.directory_buckets,
                             group_blocks=c.directory_group_blocks, weighted=c.directory_weighted,
                             anti_entropy_s=c.directory_anti_entropy_ms / 1000)


class Cluster:
    def __init__(self, cfg: Config, node_id: str, keyspace: Keyspace, scopes: ScopeRegistry,
                 control: ControlPlane, feed: ResidencyFeed, usage: Callable[[], dict]) -> None:
        """`usage()` gives what this node advertises besides its addresses: ports, capacity, use."""
        self.node_cfg = cfg
        self.cfg = cfg.cluster
        self.node_id = node_id
        self.keyspace = keyspace
        self.scopes = scopes
        self.control = control
        self.feed = feed
        self.usage = usage
        self.addresses: dict[str, tuple[str, int]] = {}  # peer -> RESP address
        # what peers authenticate with (PEERAUTH): cluster.secret, else this host's (local_secret.py)
        self.peer_secret = self.cfg.secret or local_secret()
        hello = (("PEERAUTH", self.peer_secret),)
        self.pool = PeerPool(hello=hello)
        self.transfers = Transfers(self.cfg.transfer, self.pool)
        self.directory = Directory(node_id, directory_settings(cfg))
        self.link = DirectoryLink(self.directory, scopes, hello, self.addresses)
        self.link.health = PeerHealth(time.monotonic, self.link.stats, self.cfg.hedge_floor_ms,
                                      self.cfg.hedge_max_ms, self.cfg.breaker_open_ms)
        self.link.lookup_timeout = self.cfg.lookup_timeout_ms / 1000
        self.link.tombstone_s = float(self.cfg.tombstone_s)
        self.peer_meta: dict[str, dict] = {}  # peer -> the meta it gossips (its RDMA port, if any)
        self.members: dict[str, float] = {node_id: 1.0}  # live (alive or suspect) members -> weight
        self.suspects: set[str] = set()  # peers gossip suspects now
        self.epochs: dict[str, str] = {}  # peer -> the directory epoch its meta last named
        self.pool_reads = self.cfg.pool_reads
        # pool reads are shown (in INFO cluster) before the first one
        self.stats: Counter[str] = Counter(pool_reads=0, pool_read_hits=0, pool_read_errors=0)
        self.reads = PoolReads(self.cfg, node_id, keyspace, self.link, self.transfers, self.addresses,
                               self.peer_meta, self.stats)
        # the cluster's engine table, each engine's home, the engines' load summed (engines_sync.py)
        self.engines = EngineSync(node_id, control, self.directory, self.link, self.pool, self.addresses,
                                  self.members, self._announce)
        self.membership: Any = None  # gossip.Gossip, or etcd_registry.EtcdRegistry (cluster.registry)
        self.started = time.time()
        self._meta_task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        ks = self.keyspace
        # ConfigError here (cluster.transfer = "rdma" without RDMA) stops the start
        self.transfers.open(ks.arena.region, self.node_id, ks.inline_max)
        self.keyspace.track_everything()  # every value, small ones too: a pool read never broadcasts
        # recovered (or written before the cluster started): version 0, older than any versioned
        # write or delete of the key elsewhere (hlc.py)
        for fk, tier, nbytes, bhash in list(self.keyspace.tracked_values()):
            self.link.moved(fk, tier, nbytes, bhash)
        self.feed.log = self.link  # this node's values become directory entries ...
        ks.deleted = self.link.deleted  # ... and what clients delete here, tombstones
        self.link.drop_copy = ks.delete  # a copy an owner found older than its key's newest goes
        # ... and so do the blocks of the engines it is home to (handed to their home otherwise)
        self.control.placements = self.engines.placements
        self.directory.note_members(self.members, time.monotonic())
        self.link.start()
        if self.cfg.registry == "etcd":
            self.membership = EtcdRegistry(self.node_id, self.meta(), self.cfg, self._on_event)
            self.engines.election = self.membership  # each engine's home, one at a time, under a lease
            self.membership.on_homes = self.engines.kick
        else:
            self.membership = Gossip(self.node_id, self.node_cfg.server.bind, self.cfg.gossip_port, self.meta(),
                                     self.cfg, self._on_event)
        await self.membership.start()
        self.engines.start()
        self._meta_task = asyncio.create_task(self._refresh_meta(), name="cluster-meta")

    async def stop(self) -> None:
        """Leave gracefully (peers mark us LEFT, not dead, and drop our entries), close connections."""
        if self._meta_task is not None:
            self._meta_task.cancel()
            await asyncio.gather(self._meta_task, return_exceptions=True)
        await self.engines.stop()
        if self.membership is not None:
            await self.membership.stop(leave=True)
        await self.link.stop()
        self.transfers.close()
        self.pool.close()

    @property
    def gossip_port(self) -> int:
        return self.membership.port if self.membership is not None else self.cfg.gossip_port

    @property
    def observe_fetch(self) -> Callable[[float], None]:
        return self.reads.observe_fetch

    @observe_fetch.setter
    def observe_fetch(self, fn: Callable[[float], None]) -> None:
        self.reads.observe_fetch = fn

    # -- membership -----------------------------------------------------------
    def meta(self) -> dict:
        usage = self.usage()
        host = self._advertised_host()
        meta = {
            "resp": [host, usage.pop("port")],
            "admin": [host, usage.pop("admin_port")],
            "dram_capacity": self.keyspace.capacity, "dram_used": self.keyspace.used,
            **usage, "version": __version__, "dir_epoch": self.directory.epoch,
            # the directory at a glance, for /v1/nodes and the status page of every node
            "dir": [self.directory.owned.entries, len(self.directory.filling) + len(self.directory._unacked),
                    self.link.stats["lookups"], self.link.stats["route_owner_trips"], self.link.stats["routes"],
                    self.directory.stats["ae_repairs"]],
            **self.transfers.advertise(), **self.engines.meta(),
        }
        loads = self.engines.own_loads()  # this node's leases per engine, busiest first, as many as fit
        self._advertise(meta, "load", loads, "engine_loads_unadvertised")
        # the cached blocks of the engines homed here (their KV events are applied here only), per tier
        index = self.control.index
        homed = [(e, [index.count(e, t) for t in ENGINE_TIERS]) for e in sorted(self.control.engines.engines)
                 if self.engines.home(e) == self.node_id]
        self._advertise(meta, "blk", homed, "engine_blocks_unadvertised")
        return meta

    def _advertise(self, meta: dict, field: str, rows: list[tuple[str, Any]], unadvertised: str) -> None:
        """Put `rows` (engine, figure) under meta[field], as many as fit in a member's meta."""
        if not rows:
            return
        meta[field] = advertised = {}
        for engine, figure in rows:
            advertised[engine] = figure
            if len(msgpack.packb(meta, use_bin_type=True)) > MAX_META_BYTES - 16:
                del advertised[engine]
                self.engines.stats[unadvertised] += 1
                break

    def _announce(self) -> None:
        """Gossip this node's meta now (its engine table changed), not at the next refresh."""
        if self.membership is not None:
            try:
                self.membership.update_meta(self.meta())
            except ValueError:
                log.exception("cluster meta update failed")

    def _advertised_host(self) -> str:
        return advertised_host(self.node_cfg.server.bind)

    async def _refresh_meta(self) -> None:
        while True:
            await asyncio.sleep(META_INTERVAL)
            try:
                self.membership.update_meta(self.meta())
                self.engines.tick(self.peer_meta)
            except Exception:
                log.exception("cluster meta refresh failed")

    def _on_event(self, event: Any) -> None:
        m = event.member
        if m.node_id == self.node_id:
            return
        kind = event.kind.value
        now = time.monotonic()
        if kind == "suspect":
            self.suspects.add(m.node_id)
            log.info("cluster: %s is suspect (missed its probes at %s:%d)", m.node_id, *m.addr)
            return
        self.suspects.discard(m.node_id)
        if kind in ("joined", "updated", "alive"):
            moved = self._address(m.node_id, m.meta or {})
            epoch = (m.meta or {}).get("dir_epoch")
            restarted = epoch is not None and self.epochs.get(m.node_id, epoch) != epoch
            if epoch is not None:
                self.epochs[m.node_id] = epoch
            if restarted:
                self.directory.restarted(m.node_id, epoch, now)
            joined = m.node_id not in self.members
            self.members[m.node_id] = 1.0
            self.directory.note_members(self.members, now)
            self.link.kick()
            if joined or restarted:
                self.engines.members_changed()  # an engine's home may move to it
            if m.node_id in self.peer_meta:
                self.engines.peer_meta(m.node_id, self.peer_meta[m.node_id])
                self.engines.remote_loads(self.peer_meta)
            resp = "%s:%s" % self.addresses[m.node_id] if m.node_id in self.addresses else "no RESP address"
            if kind == "joined":
                back = f" (back after {event.previous.name.lower()})" if event.previous is not None else ""
                log.info("cluster: %s joined%s: gossip %s:%d, RESP %s", m.node_id, back, *m.addr, resp)
            elif kind == "alive":
                log.info("cluster: %s is alive again (refuted the suspicion)", m.node_id)
            elif restarted:
                log.warning("cluster: %s restarted (a new process); its entries are placed anew", m.node_id)
            elif moved:
                log.info("cluster: %s now serves RESP at %s", m.node_id, resp)
        elif kind in ("dead", "left"):
            self._forget(m.node_id, kind)

    def _address(self, peer: str, meta: dict) -> bool:
        """Note the RESP address `peer`'s meta names; whether it changed."""
        try:
            host, port = meta["resp"][0], int(meta["resp"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            self.stats["members_without_address"] += 1
            return False
        self.peer_meta[peer] = meta
        if self.addresses.get(peer) == (host, port):
            return False
        old = self.addresses.get(peer)
        if old is not None:
            self.pool.drop(*old)
            self.link.pool.drop(*old)
        self.addresses[peer] = (host, port)
        if peer not in self.control.pool:
            self.control.pool.append(peer)
        return True

    def _forget(self, peer: str, why: str) -> None:
        addr = self.addresses.pop(peer, None)
        if addr is not None:
            self.pool.drop(*addr)
            self.link.pool.drop(*addr)
        self.peer_meta.pop(peer, None)
        self.transfers.peer_gone(peer)
        self.link.health.forget(peer)
        self.members.pop(peer, None)
        now = time.monotonic()
        dropped = self.directory.holder_gone(peer, now)
        self.directory.note_members(self.members, now)
        self.link.kick()
        if peer in self.control.pool:
            self.control.pool.remove(peer)
        self.engines.members_changed()  # the engines homed on it move
        self.engines.remote_loads(self.peer_meta)
        self.stats["peers_left" if why == "left" else "peers_declared_dead"] += 1  # events; members_* are states
        if why == "left":
            log.info("cluster: %s left; dropped the %d directory entries of its values kept here", peer, dropped)
        else:
            log.warning("cluster: %s is dead; dropped the %d directory entries of its values kept here", peer, dropped)

    def members_list(self) -> list:
        return self.membership.members() if self.membership is not None else []

    def state_age(self, member: Any) -> float:
        """Seconds since `member` (one of `members_list()`) last changed state, on gossip's clock."""
        return max(0.0, time.monotonic() - member.since)

    def node_lines(self) -> list[str]:
        """NODES: `id state incarnation resp admin dram_used/dram_capacity`, this node first."""
        return [node_line(m.node_id, m.state.name.lower(), m.incarnation, m.meta or {}, m.node_id == self.node_id)
                for m in sorted(self.members_list(), key=lambda m: (m.node_id != self.node_id, m.node_id))]

    # -- reads of what peers hold (pool_reads.py) ----------------------------------------
    async def fetch(self, scope: IdentityScope, tag: bytes, key: bytes) -> Any:
        return await self.reads.fetch(scope, tag, key)

    async def pool_read(self, scope: IdentityScope, tag: bytes, key: bytes) -> Any:
        return await self.reads.pool_read(scope, tag, key)

    async def pool_read_many(self, scope: IdentityScope, tag: bytes, keys: list[bytes]) -> list:
        return await self.reads.pool_read_many(scope, tag, keys)

    async def pool_has_many(self, tag: bytes, keys: list[bytes]) -> list[bool]:
        return await self.reads.pool_has_many(tag, keys)

    async def pool_delete(self, tag: bytes, keys: list[bytes]) -> int:
        """DEL of keys this node lacks: a tombstone for each one a peer holds (its copies then go,
        and stay gone), once the owners have it; how many there were."""
        held = await self.reads.pool_has_many(tag, keys)
        for key, there in zip(keys, held):
            if there:
                self.link.bury(tag, key)
        acked = self.link.acknowledged()
        if acked is not None:
            await acked
        return sum(held)

    async def locate(self, tag: bytes, keys: list[bytes]) -> list:
        return await self.reads.locate(tag, keys)

    # -- ROUTE over the directory --------------------------------------------------------
    async def route_view(self, tag: bytes, blocks: list) -> ResidencyIndex:
        """The residencies of a prompt's blocks, as the directory's owners know them (every
        engine's and every node's, one owner round trip per segment of blocks, none when this
        node owns them), in an index ROUTE scores against."""
        holders, _trips = await self.link.block_holders(tag, blocks)
        view = ResidencyIndex()
        for h, per in zip(blocks, holders):
            for holder, tiers in per:
                for t in tiers:
                    view.put(tag, h, holder, t)
        return view

    async def hot_holders(self, routed: list[list[tuple[bytes, Any]]]) -> list[set[tuple[str, CacheTier]]]:
        """Who holds each hot prefix (its first block, under every scope it was routed with: one
        list per prefix), by the directory's owners as ROUTE asks them: one lookup for them all."""
        flat = [r for per in routed for r in per]
        answers = iter(await self.link.first_block_holders(flat))
        return [{(h, t) for _ in per for h, ts in next(answers) for t in ts} for per in routed]

    def member_state(self, node_id: str) -> str:
        """A node's state as this node's gossip sees it: alive, suspect, dead, left, or unknown."""
        m = next((m for m in self.members_list() if m.node_id == node_id), None)
        return m.state.name.lower() if m is not None else "unknown"

    def engine_blocks(self, engine_id: str, home: str) -> dict[str, int] | None:
        """An engine's cached blocks per tier as its home last advertised them (its meta's `blk`);
        None when the home did not (its meta was full)."""
        per = (self.peer_meta.get(home) or {}).get("blk")
        counts = per.get(engine_id) if isinstance(per, dict) else None
        if not isinstance(counts, list) or len(counts) != len(ENGINE_TIERS):
            return None
        return {t.value: n for t, n in zip(ENGINE_TIERS, counts) if isinstance(n, int) and n > 0}

    async def pool_resident(self, tag: bytes, blocks: list) -> int:
        """How many of a prompt's blocks have a copy on some pool node (DRAM or SSD), by the
        directory's owners: the gateway's handoff check in a cluster."""
        holders, _trips = await self.link.block_holders(tag, blocks)
        pool = {CacheTier.DRAM, CacheTier.SSD}
        return sum(1 for per in holders if any(h in self.members and pool.intersection(t) for h, t in per))

    async def route(self, scope: IdentityScope, tag: bytes, req: RouteRequest) -> Decision:
        """ROUTE in a cluster: the same decision on every node, from the directory's view."""
        view = await self.route_view(tag, req.blocks)
        return self.control.route(scope, tag, req.blocks, req.decode_blocks, req.session, req.acquire, view=view)

    # -- reporting ------------------------------------------------------------------
    def info(self) -> list[tuple[str, Any]]:
        members = self.members_list()
        states = Counter(m.state.name.lower() for m in members)
        d = self.directory
        out: list[tuple[str, Any]] = [
            ("cluster_enabled", 1), ("cluster_node_id", self.node_id),
            ("cluster_gossip_port", self.gossip_port), ("cluster_members", len(members)),
            ("cluster_members_alive", states.get("alive", 0)), ("cluster_members_suspect", states.get("suspect", 0)),
            ("cluster_members_dead", states.get("dead", 0)), ("cluster_members_left", states.get("left", 0)),
            ("cluster_directory_replicas", min(d.s.replicas, max(1, len(d.members)))),
            ("cluster_directory_epoch", d.epoch),
        ]
        out += [(f"cluster_{k}", v) for k, v in d.info().items()]
        link = self.link.stats
        out += [("cluster_lookups", link["lookups"]),
                ("cluster_lookups_local", link["lookups_0_trips"]),
                ("cluster_lookups_one_hop", link["lookups_1_trips"]),
                ("cluster_lookups_two_hops", link["lookups_2_trips"] + link["lookups_3_trips"]),
                ("cluster_lookup_failures", link["lookup_failures"]),
                ("cluster_lookup_misses", link["lookup_misses"]),
                ("cluster_lookup_misses_unreachable", link["lookup_misses_unreachable"]),
                ("cluster_lookup_hedged", link["lookup_hedged"]),
                ("cluster_lookup_hedges_won", link["lookup_hedges_won"]),
                ("cluster_lookup_breaker_skips", link["lookup_breaker_skips"]),
                ("cluster_peer_breaker_opens", link["breaker_opens"]),
                ("cluster_peer_breakers_open", self.link.health.open_peers()),
                ("cluster_route_lookups", link["routes"]),
                ("cluster_route_owner_round_trips", link["route_owner_trips"]),
                ("cluster_route_second_waves", link["route_second_waves"]),
                ("cluster_directory_requests", link["requests"]),
                ("cluster_directory_message_failures", link["message_failures"]),
                ("cluster_peer_connection_waits", self.pool.waits + self.link.pool.waits),
                # calls that found every connection to their peer busy for their whole timeout
                ("cluster_peer_connection_busy_timeouts", self.pool.busy_timeouts + self.link.pool.busy_timeouts)]
        out += [(f"cluster_{k}", v) for k, v in sorted(self.stats.items())]
        out += self.engines.info()
        out += self.transfers.info()
        out.append(("cluster_registry", self.cfg.registry))
        if isinstance(self.membership, EtcdRegistry):
            out += self.membership.info()
        elif self.membership is not None:
            out += [(f"cluster_{k}", v) for k, v in sorted(self.membership.stats.items())]
        return out
