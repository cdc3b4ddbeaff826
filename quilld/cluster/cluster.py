"""The node's side of the cluster: membership, residency replication, peer fetch.

Gossip (SWIM) tells who is alive and where its RESP port is. For every live
peer a follower keeps the directory current from that peer's replication
log; a peer declared dead (or that left) is forgotten everywhere at once.
`fetch` reads a block held only by peers straight into this node's arena,
verifies its CRC32C, and keeps a local copy when configured to. It returns
the same plain values as a local read (bytes, a `Pinned` view, or None).
`pool_read` is GET's, MGET's and EXISTS's read of a key this node lacks
(`cluster.pool_reads`): from the holders the directory names, else from
whichever live peer has it, all asked at once (values of at most
`dram.inline_max` bytes are not in the replication log, and a write may not
have reached it yet); a miss, never an error, when nobody can serve it.
The cluster reaches storage only through the keyspace's front door.

Membership changes are logged, one line each: a peer joins, is suspected,
comes back, leaves or is declared dead (gossip.py warns when no seed answers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Callable

import crc32c

from quilld import __version__
from quilld.cluster.directory import Directory
from quilld.cluster.follower import Follower
from quilld.cluster.gossip import Gossip
from quilld.cluster.local_secret import local_secret
from quilld.cluster.peer_client import PeerError, PeerPool
from quilld.cluster.replog import ReplicationLog
from quilld.cluster.transfer import Transfers
from quilld.config import Config
from quilld.errors import QuillError
from quilld.index.control import ControlPlane
from quilld.index.residency_feed import ResidencyFeed
from quilld.model import IdentityScope, Pinned
from quilld.scopes import TAG_LEN, ScopeRegistry
from quilld.tiers.keyspace import Keyspace

log = logging.getLogger("quilld.cluster")

META_INTERVAL = 1.0  # seconds between refreshes of this node's advertised usage
ASK_TIMEOUT = 2.0  # seconds a peer asked for a key the directory does not place has to answer it


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


def _ignore(seconds: float) -> None:
    """No observer of peer fetches (the default; node.py gives the node's metrics)."""


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
        self.log = ReplicationLog(self._snapshot_source)
        self.log.on_append = self._wake
        self.directory = Directory(scopes, control.index)
        self.followers: dict[str, Follower] = {}
        self.addresses: dict[str, tuple[str, int]] = {}  # peer -> RESP address
        # what peers authenticate with (PEERAUTH): cluster.secret, else this host's (local_secret.py)
        self.peer_secret = self.cfg.secret or local_secret()
        self.pool = PeerPool(hello=(("PEERAUTH", self.peer_secret),))
        self.transfers = Transfers(self.cfg.transfer, self.pool)
        self.peer_meta: dict[str, dict] = {}  # peer -> the meta it gossips (its RDMA port, if any)
        self.suspects: set[str] = set()  # peers gossip suspects now: not asked by pool reads
        self.pool_reads = self.cfg.pool_reads
        # pool reads are shown (in INFO cluster) before the first one
        self.stats: Counter[str] = Counter(pool_reads=0, pool_read_hits=0, pool_read_asks=0, pool_read_errors=0)
        self.observe_fetch: Callable[[float], None] = _ignore  # seconds of each verified peer fetch
        self.gossip: Any = None
        self.started = time.time()
        self._changed = asyncio.Event()
        self._waiters = 0
        self._meta_task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        ks = self.keyspace
        # ConfigError here (cluster.transfer = "rdma" without RDMA) stops the start
        self.transfers.open(ks.arena.region, self.node_id, ks.inline_max)
        self.feed.log = self.log
        self.gossip = Gossip(self.node_id, self.node_cfg.server.bind, self.cfg.gossip_port, self.meta(),
                             self.cfg, self._on_event)
        await self.gossip.start()
        self._meta_task = asyncio.create_task(self._refresh_meta(), name="cluster-meta")

    async def stop(self) -> None:
        """Leave gracefully (peers mark us LEFT, not dead), stop following, close connections."""
        if self._meta_task is not None:
            self._meta_task.cancel()
            await asyncio.gather(self._meta_task, return_exceptions=True)
        if self.gossip is not None:
            await self.gossip.stop(leave=True)
        for f in list(self.followers.values()):
            await f.stop()
        self.followers.clear()
        self.transfers.close()
        self.pool.close()

    @property
    def gossip_port(self) -> int:
        return self.gossip.port if self.gossip is not None else self.cfg.gossip_port

    # -- membership -----------------------------------------------------------
    def meta(self) -> dict:
        usage = self.usage()
        host = self._advertised_host()
        return {
            "resp": [host, usage.pop("port")],
            "admin": [host, usage.pop("admin_port")],
            "dram_capacity": self.keyspace.capacity, "dram_used": self.keyspace.used,
            **usage, "version": __version__,
            **self.transfers.advertise(),
        }

    def _advertised_host(self) -> str:
        return advertised_host(self.node_cfg.server.bind)

    async def _refresh_meta(self) -> None:
        while True:
            await asyncio.sleep(META_INTERVAL)
            try:
                self.gossip.update_meta(self.meta())
            except Exception:
                log.exception("cluster meta refresh failed")

    def _on_event(self, event: Any) -> None:
        m = event.member
        if m.node_id == self.node_id:
            return
        kind = event.kind.value
        if kind == "suspect":
            self.suspects.add(m.node_id)
            log.info("cluster: %s is suspect (missed its probes at %s:%d)", m.node_id, *m.addr)
            return
        self.suspects.discard(m.node_id)
        if kind in ("joined", "updated", "alive"):
            moved = self._follow(m.node_id, m.meta)
            resp = "%s:%s" % self.addresses[m.node_id] if m.node_id in self.addresses else "no RESP address"
            if kind == "joined":
                back = f" (back after {event.previous.name.lower()})" if event.previous is not None else ""
                log.info("cluster: %s joined%s: gossip %s:%d, RESP %s", m.node_id, back, *m.addr, resp)
            elif kind == "alive":
                log.info("cluster: %s is alive again (refuted the suspicion)", m.node_id)
            elif moved:
                log.info("cluster: %s now serves RESP at %s", m.node_id, resp)
        elif kind in ("dead", "left"):
            self._forget(m.node_id, kind)

    def _follow(self, peer: str, meta: dict) -> bool:
        """Follow `peer`'s log at the RESP address its meta names; whether a follower was (re)started."""
        try:
            host, port = meta["resp"][0], int(meta["resp"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            self.stats["members_without_address"] += 1
            return False
        self.peer_meta[peer] = meta
        if self.addresses.get(peer) == (host, port) and peer in self.followers:
            return False
        old = self.followers.pop(peer, None)
        if old is not None:
            asyncio.ensure_future(old.stop())
        self.addresses[peer] = (host, port)
        follower = Follower(peer, host, port, self.directory, (("PEERAUTH", self.peer_secret),))
        self.followers[peer] = follower
        follower.start()
        if peer not in self.control.pool:
            self.control.pool.append(peer)
        return True

    def _forget(self, peer: str, why: str) -> None:
        follower = self.followers.pop(peer, None)
        if follower is not None:
            asyncio.ensure_future(follower.stop())
        addr = self.addresses.pop(peer, None)
        if addr is not None:
            self.pool.drop(*addr)
        self.peer_meta.pop(peer, None)
        self.transfers.peer_gone(peer)
        dropped = self.directory.forget(peer)
        if peer in self.control.pool:
            self.control.pool.remove(peer)
        self.stats[f"members_{why}"] += 1
        if why == "left":
            log.info("cluster: %s left; dropped its %d residencies", peer, dropped)
        else:
            log.warning("cluster: %s is dead; dropped its %d residencies", peer, dropped)

    def members(self) -> list:
        return self.gossip.members() if self.gossip is not None else []

    def state_age(self, member: Any) -> float:
        """Seconds since `member` (one of `members()`) last changed state, on gossip's clock."""
        return max(0.0, time.monotonic() - member.since)

    def node_lines(self) -> list[str]:
        """NODES: `id state incarnation resp admin dram_used/dram_capacity`, this node first."""
        return [node_line(m.node_id, m.state.name.lower(), m.incarnation, m.meta or {}, m.node_id == self.node_id)
                for m in sorted(self.members(), key=lambda m: (m.node_id != self.node_id, m.node_id))]

    # -- the replication log ----------------------------------------------------
    def _snapshot_source(self):
        scope_of = self.scopes.scope_of
        for fk, tier, nbytes, bhash in self.keyspace.tracked_values():
            yield scope_of(fk[:TAG_LEN]), fk[TAG_LEN:], tier, nbytes, bhash

    def _wake(self) -> None:
        if self._waiters:
            ev, self._changed = self._changed, asyncio.Event()
            ev.set()

    async def wait_log(self, after: int, timeout: float) -> None:
        """Return once the log has entries past `after`, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.log.seq <= after:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._waiters += 1
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return
            finally:
                self._waiters -= 1

    # -- peer fetch ---------------------------------------------------------------
    async def fetch(self, scope: IdentityScope, tag: bytes, key: bytes) -> Any:
        """A key held only by peers: read it into this node, verified; None if nobody has it."""
        last_error: QuillError | None = None
        for peer, _tier in self.directory.holders(tag, key):
            addr = self.addresses.get(peer)
            if addr is None:
                continue
            try:
                got = await self._fetch_from(peer, addr, scope, key)
            except QuillError as e:
                last_error = e
                continue
            if got is not None:
                return self._deliver(tag, key, *got)
        if last_error is not None:
            raise PeerError(f"no peer could serve the block: {last_error.message}")
        return None

    async def _fetch_from(self, peer: str, addr: tuple[str, int], scope: IdentityScope,
                          key: bytes) -> tuple[Any, bytearray | None, int] | None:
        """`key` from `peer`, verified: (arena block, None, expiry) or (None, buffer of an inline-sized
        value, expiry), the expiry being when the key expires there (unix ms) or -1; None when the
        peer does not have it. Raises QuillError when it failed (counted); whatever
        it reserved is given back on every way out but success, cancellation included."""
        store = self.keyspace
        block = None
        buf: bytearray | None = None

        def target(length: int) -> memoryview:
            nonlocal block, buf
            if block is not None:  # called again (a fallback to TCP): the first reservation goes
                store.discard(block)
                block = None
            if length <= store.inline_max:
                buf = bytearray(length)
                return memoryview(buf)
            block = store.reserve(length)
            return store.write_view(block)

        t0 = time.perf_counter()
        try:
            crc, view, expires = await self.transfers.fetch_into(peer, addr, self.peer_meta.get(peer), scope, key,
                                                                  target)
        except QuillError as e:
            if block is not None:
                store.discard(block)
            self.stats["peer_fetch_errors"] += 1
            log.warning("cluster: fetching from %s failed: %s", peer, e.message)
            raise
        except BaseException:  # cancelled (shutdown, a pool read answered by another peer) mid-transfer
            if block is not None:
                store.discard(block)
            raise
        if view is None:  # the peer does not have it (for a directory holder: the directory was behind)
            if block is not None:  # memory named by an attempt before the nil (RDMA, then TCP)
                store.discard(block)
            self.stats["peer_fetch_stale"] += 1
            return None
        if crc32c.crc32c(view) != crc:
            if block is not None:
                store.discard(block)
            self.stats["peer_fetch_checksum_failures"] += 1
            raise PeerError(f"block from {peer} failed its checksum")
        if block is not None:
            block.crc = crc  # verified: a later peer reading it from here needs no recompute
        self.stats["peer_fetches"] += 1
        self.stats["peer_fetch_bytes"] += len(view)
        elapsed = time.perf_counter() - t0  # request to verified
        self.stats["peer_fetch_usec"] += int(elapsed * 1e6)
        self.observe_fetch(elapsed)
        return block, buf, expires

    # -- pool reads (GET, MGET, EXISTS) -----------------------------------------------
    async def pool_read(self, scope: IdentityScope, tag: bytes, key: bytes) -> Any:
        """A key this node lacks, from the pool: bytes, a Pinned view, or None (nobody has it, or
        nobody could serve it: a miss, counted in pool_read_errors, never an error reply)."""
        self.stats["pool_reads"] += 1
        asked: set[str] = set()
        try:
            holders = self.directory.holders(tag, key)
            if holders:
                asked = {peer for peer, _tier in holders}
                value = await self.fetch(scope, tag, key)
                if value is not None:
                    self.stats["pool_read_hits"] += 1
                    return value
            value = await self._ask(scope, tag, key, asked)
        except QuillError:
            self.stats["pool_read_errors"] += 1
            return None
        if value is not None:
            self.stats["pool_read_hits"] += 1
        return value

    async def pool_has(self, scope: IdentityScope, tag: bytes, key: bytes) -> bool:
        """EXISTS of a key this node lacks: the directory's word, else whether a peer has it (read
        into this node as pool_read does, so the GET that usually follows is local)."""
        if self.directory.holders(tag, key):
            return True
        value = await self.pool_read(scope, tag, key)
        if value.__class__ is Pinned:
            value.release()
        return value is not None

    async def pool_read_many(self, scope: IdentityScope, tag: bytes, keys: list[bytes]) -> list:
        """pool_read of each key, all at once."""
        return list(await asyncio.gather(*(self.pool_read(scope, tag, k) for k in keys)))

    async def _ask(self, scope: IdentityScope, tag: bytes, key: bytes, skip: set[str]) -> Any:
        """`key` from whichever live peer (not suspect, not in `skip`) has it, all asked at once, each
        for at most ASK_TIMEOUT: the first verified copy wins, the others are cancelled or given back.
        None if nobody has it."""
        peers = [(p, a) for p, a in self.addresses.items() if p not in skip and p not in self.suspects]
        if not peers:
            return None
        self.stats["pool_read_asks"] += 1
        tasks = [asyncio.ensure_future(asyncio.wait_for(self._fetch_from(p, a, scope, key), ASK_TIMEOUT))
                 for p, a in peers]
        winner = None
        try:
            pending = set(tasks)
            while pending and winner is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if winner is None and not t.cancelled() and t.exception() is None:
                        winner = t.result()
        finally:
            for t in tasks:
                t.cancel()  # a transfer still running gives its reservation back
            # awaited, so that a copy completing as it was cancelled is seen below and given back
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        unexpected = None
        for got in outcomes:
            if isinstance(got, asyncio.TimeoutError):
                self.stats["pool_read_ask_timeouts"] += 1
            elif isinstance(got, BaseException):
                if not isinstance(got, (QuillError, asyncio.CancelledError)):
                    unexpected = got  # a bug: raised once every reservation is given back
            elif got is not None and got is not winner and got[0] is not None:
                self.keyspace.discard(got[0])
        if unexpected is not None:
            if winner is not None and winner[0] is not None:
                self.keyspace.discard(winner[0])
            raise unexpected
        return None if winner is None else self._deliver(tag, key, *winner)

    def _deliver(self, tag: bytes, key: bytes, block: Any, buf: bytearray | None, expires: int) -> bytes | Pinned:
        """Answer with what was fetched; with keep_fetched, keep it too, expiring when the holder's does."""
        store = self.keyspace
        value = bytes(buf or b"") if block is None else block
        if not self.cfg.keep_fetched:
            return value if block is None else Pinned(store.view(block), lambda: store.discard(block))
        store.publish(tag, key, value)
        if expires >= 0:
            store.set_expire(tag, key, expires)
        return value if block is None else store.pinned(block)

    # -- reporting ------------------------------------------------------------------
    def info(self) -> list[tuple[str, Any]]:
        members = self.members()
        states = Counter(m.state.name.lower() for m in members)
        now = time.monotonic()
        lags = [now - f.last_applied for f in self.followers.values() if f.last_applied]
        out: list[tuple[str, Any]] = [
            ("cluster_enabled", 1), ("cluster_node_id", self.node_id),
            ("cluster_gossip_port", self.gossip_port), ("cluster_members", len(members)),
            ("cluster_members_alive", states.get("alive", 0)), ("cluster_members_suspect", states.get("suspect", 0)),
            ("cluster_members_dead", states.get("dead", 0)), ("cluster_members_left", states.get("left", 0)),
            ("cluster_followers", len(self.followers)), ("cluster_log_seq", self.log.seq),
            ("cluster_log_epoch", self.log.epoch), ("cluster_log_snapshots", self.log.snapshots),
            ("cluster_follow_max_idle_ms", int(max(lags) * 1000) if lags else 0),
            ("cluster_peer_keys", len(self.directory.keys)),
        ]
        follow = Counter()
        for f in self.followers.values():
            follow.update(f.stats)
        out += [(f"cluster_follow_{k}", v) for k, v in sorted(follow.items())]
        out += [(f"cluster_{k}", v) for k, v in sorted(self.stats.items())]
        out += self.transfers.info()
        if self.gossip is not None:
            out += [(f"cluster_{k}", v) for k, v in sorted(self.gossip.stats.items())]
        return out
