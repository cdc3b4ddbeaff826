"""Cluster membership from etcd (`cluster.registry = "etcd"`), in place of SWIM gossip.

Each node keeps one lease (`cluster.etcd_lease_ttl_s`) and, under it, one key:

    <etcd_prefix>/nodes/<node id>  ->  {"state": "alive", "meta": {...its addresses, capacity, ...}}

written with `"state": "left"` before a graceful stop revokes the lease. Every node watches
`<etcd_prefix>/nodes/` from the revision of its last full read, so every node sees the same
joins, updates and deaths in the same order (a key deleted by a lease that expired: the node
died; `left`: it stopped). The events are those of gossip (swim.Event), so the cluster
(cluster.py) treats both registries alike: the directory's ownership follows these members,
and `revision` says which etcd revision the view was last brought to.

Each engine's home is elected under the same leases:

    <etcd_prefix>/homes/<engine id>  ->  <node id>

created only where absent (a transaction), under the claiming node's lease: exactly one node
holds an engine's home at a time, and a home whose node died is free once its lease runs out.
The node the engines' rule picks (engines_sync.py: the registering node while alive, else a
rendezvous choice) claims it; a holder the rule no longer picks gives it up; the others follow
whoever holds the key (`home_holder`).

The meta a node writes is the same as its gossip meta. Its addresses, directory epoch, engine
table summary and capacity are written as soon as they change; what changes every second (use,
loads, the directory's figures) at most every META_WRITE_S, so a busy cluster does not write
etcd once a second per node.

The data path never waits on etcd: a node that loses etcd keeps its last view of the members
(`state` "unreachable", logged once, in INFO and /healthz and /readyz), keeps trying the
endpoints in turn, and when etcd answers again reads the members afresh (those gone meanwhile
are dead, the new ones joined) and watches on; a node whose lease expired meanwhile registers
again. The client is aetcd (asyncio, gRPC; `pip install -e '.[etcd]'`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from quilld.cluster.swim import Event, EventKind, Member
from quilld.cluster.wire import State
from quilld.errors import ConfigError

log = logging.getLogger("quilld.cluster")

META_WRITE_S = 5.0  # the changing part of a node's meta is written at most this often
# meta fields written at once when they change: what peers need to reach this node, its
# directory epoch (a restart), its engine table's summary (peers pull the table when it moves)
STABLE_META = ("resp", "admin", "version", "dir_epoch", "eng", "rdma", "dram_capacity")
CALL_TIMEOUT_S = 3.0  # one etcd call
RETRY_S = (0.2, 0.5, 1.0, 2.0)  # between attempts while etcd does not answer (the last repeats)
FIRST_SYNC_WAIT_S = 5.0  # start() waits this long for the first view, then goes on in the background


def describe(error: BaseException | None) -> str:
    """An error as a log line says it (a timeout's str() is empty)."""
    if error is None:
        return "no answer"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def node_key(prefix: str, node_id: str) -> bytes:
    return f"{prefix}/nodes/{node_id}".encode()


def home_key(prefix: str, engine_id: str) -> bytes:
    return f"{prefix}/homes/{engine_id}".encode()


def parse_endpoint(url: str) -> tuple[str, int]:
    """`http://host:port`, `host:port` or `host` (port 2379) -> (host, port)."""
    rest = url.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep:
        return rest, 2379
    if not port.isdigit() or not host:
        raise ConfigError(f"cluster.etcd_endpoints: {url!r} is not host:port (or http://host:port)")
    return host.strip("[]"), int(port)


class EtcdRegistry:
    """One node's membership through etcd; the same face as gossip.Gossip for cluster.py."""

    def __init__(self, node_id: str, meta: dict, cfg, on_event: Callable[[Event], None],
                 client_factory: Callable[..., Any] | None = None) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.on_event = on_event
        self.prefix = cfg.etcd_prefix.rstrip("/")
        self.endpoints = [parse_endpoint(u.strip()) for u in cfg.etcd_endpoints.split(",") if u.strip()]
        self.port = 0  # no gossip port
        self.state = "connecting"  # connected, unreachable
        self.unreachable_since: float | None = None
        self.revision = 0  # the etcd revision the members were last brought to
        self.stats: Counter[str] = Counter(registry_errors=0, registry_registrations=0, registry_meta_writes=0,
                                           registry_resyncs=0)
        self._factory = client_factory
        self._meta = dict(meta)
        self._written: dict | None = None  # the meta as last written
        self._written_at = 0.0
        self._members: dict[str, Member] = {node_id: Member(node_id, ("", 0), 0, State.ALIVE, self._meta,
                                                            time.monotonic())}
        self._raw: dict[str, tuple[int, bytes]] = {}  # node -> (create revision, value) last applied
        self.homes: dict[str, str] = {}  # engine -> the node that holds its home key
        self.on_homes: Callable[[], None] | None = None  # told when an engine's home key changes
        self._claims: set[asyncio.Task] = set()
        self._client: Any = None
        self._endpoint = 0
        self._lease: Any = None
        self._task: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._synced = asyncio.Event()
        self._closing = False

    # -- the face cluster.py uses ----------------------------------------------------------------
    def members(self) -> list[Member]:
        return list(self._members.values())

    def update_meta(self, meta: dict) -> None:
        self._meta = dict(meta)
        me = self._members[self.node_id]
        me.meta = self._meta
        if self._closing or self._lease is None:
            return
        stable = {k: meta.get(k) for k in STABLE_META}
        due = self._written is None or stable != {k: self._written.get(k) for k in STABLE_META} \
            or (time.monotonic() - self._written_at >= META_WRITE_S and meta != self._written)
        if due and (self._writer is None or self._writer.done()):
            self._writer = asyncio.create_task(self._write_meta(), name="etcd-meta")

    def home_holder(self, engine_id: str) -> str | None:
        """The node that holds the engine's home key now (None: nobody, or etcd not read yet)."""
        return self.homes.get(engine_id)

    def claim_home(self, engine_id: str) -> None:
        """Take the engine's home if nobody holds it (in the background: the watch says who won)."""
        self._in_background(self._claim(engine_id))

    def release_home(self, engine_id: str) -> None:
        """Give the engine's home up, if this node holds it."""
        self._in_background(self._release(engine_id))

    def _in_background(self, coro) -> None:
        if self._closing or self._client is None or self._lease is None:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _claim(self, engine_id: str) -> None:
        client, key = self._client, home_key(self.prefix, engine_id)
        try:
            ok, _ = await asyncio.wait_for(client.transaction(
                compare=[client.transactions.create(key) == 0],
                success=[client.transactions.put(key, self.node_id.encode(), self._lease)], failure=[]),
                CALL_TIMEOUT_S)
            self.stats["registry_home_claims" if ok else "registry_home_claims_lost"] += 1
        except Exception as e:  # etcd gone: the loop reads the homes afresh on its return
            log.debug("cluster: claiming %s's home in etcd failed: %s", engine_id, describe(e))

    async def _release(self, engine_id: str) -> None:
        client, key = self._client, home_key(self.prefix, engine_id)
        try:
            await asyncio.wait_for(client.transaction(
                compare=[client.transactions.value(key) == self.node_id.encode()],
                success=[client.transactions.delete(key)], failure=[]), CALL_TIMEOUT_S)
        except Exception as e:
            log.debug("cluster: giving %s's home up in etcd failed: %s", engine_id, describe(e))

    async def start(self) -> None:
        """Register and read the members (waiting FIRST_SYNC_WAIT_S at most: etcd may be down; the
        node then serves alone and joins once it answers)."""
        if importlib.util.find_spec("aetcd") is None:
            raise ConfigError("cluster.registry = \"etcd\" needs the aetcd package: pip install -e '.[etcd]'")
        self._task = asyncio.create_task(self._run(), name="etcd-registry")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._synced.wait()), FIRST_SYNC_WAIT_S)
        if not self._synced.is_set():
            log.warning("cluster: etcd (%s) did not answer within %.0f s; serving alone until it does",
                        self._endpoints_text(), FIRST_SYNC_WAIT_S)

    async def stop(self, leave: bool = True) -> None:
        """Say `left`, revoke the lease (when `leave`), close the client."""
        self._closing = True
        for task in (self._task, self._writer, *self._claims):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if leave and self._lease is not None and self._client is not None:
            try:
                await asyncio.wait_for(self._client.put(node_key(self.prefix, self.node_id),
                                                        self._value("left"), lease=self._lease), CALL_TIMEOUT_S)
                await asyncio.wait_for(self._client.revoke_lease(self._lease.id), CALL_TIMEOUT_S)
            except Exception as e:  # a stop never fails on etcd: the lease expires by itself
                log.info("cluster: could not leave through etcd (%s); the lease expires in %d s", e,
                         self.cfg.etcd_lease_ttl_s)
        await self._close_client()

    # -- the loop: connect, register, read, watch; again on any failure -----------------------------
    async def _run(self) -> None:
        failures = 0
        while not self._closing:
            try:
                await self._connect()
                await self._register()
                await self._resync()
                failures = 0
                self._set_state("connected")
                await self._watch_and_keep_alive()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd gone, a timeout, a refused call: the last view stands
                self.stats["registry_errors"] += 1
                self._set_state("unreachable", e)
                await self._close_client()
                self._endpoint = (self._endpoint + 1) % len(self.endpoints)  # the next one, next time
                await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1

    async def _connect(self) -> None:
        if self._client is not None:
            return
        host, port = self.endpoints[self._endpoint]
        factory = self._factory
        if factory is None:
            import aetcd
            factory = aetcd.Client
        kwargs: dict[str, Any] = {"host": host, "port": port, "timeout": CALL_TIMEOUT_S}
        if self.cfg.etcd_user:
            kwargs |= {"username": self.cfg.etcd_user, "password": self.cfg.etcd_password}
        client = factory(**kwargs)
        await asyncio.wait_for(client.connect(), CALL_TIMEOUT_S)
        self._client = client

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 1.0)

    async def _register(self) -> None:
        """A lease, when this node has none (or it expired), and the node's key under it."""
        if self._lease is not None:  # back after etcd was gone: is the lease still there?
            reply = await asyncio.wait_for(self._client.refresh_lease(self._lease.id), CALL_TIMEOUT_S)
            if reply is None or reply.TTL <= 0:
                self._lease = None  # it ran out meanwhile (etcd was down longer, or restarted without it)
        if self._lease is None:
            self._lease = await asyncio.wait_for(self._client.lease(self.cfg.etcd_lease_ttl_s), CALL_TIMEOUT_S)
            self.stats["registry_registrations"] += 1
            if self.stats["registry_registrations"] > 1:
                log.warning("cluster: registered in etcd again (the lease had expired)")
        await self._write_meta()

    async def _write_meta(self) -> None:
        if self._client is None or self._lease is None:
            return
        meta = dict(self._meta)
        try:
            await asyncio.wait_for(self._client.put(node_key(self.prefix, self.node_id), self._value("alive", meta),
                                                    lease=self._lease), CALL_TIMEOUT_S)
        except Exception as e:
            if "lease not found" in str(e):
                self._lease = None  # gone from etcd: the loop takes a new one and writes again
            if self._writer is not None and asyncio.current_task() is self._writer:
                log.debug("cluster: writing this node's meta to etcd failed: %s", e)
                return  # the loop notices etcd is gone and writes it again on its return
            raise
        self._written, self._written_at = meta, time.monotonic()
        self.stats["registry_meta_writes"] += 1

    def _value(self, state: str, meta: dict | None = None) -> bytes:
        return json.dumps({"state": state, "meta": self._meta if meta is None else meta},
                          separators=(",", ":"), sort_keys=True).encode()

    async def _resync(self) -> None:
        """Read every node's key: the members not there any more are dead (or left), the new ones
        joined, the changed ones updated; the watch goes on from this revision."""
        got = await asyncio.wait_for(self._client.get_prefix(f"{self.prefix}/".encode()), CALL_TIMEOUT_S)
        self.revision = got.header.revision
        seen = set()
        homes: dict[str, str] = {}
        for kv in got:
            engine_id = self._engine_of(kv.key)
            if engine_id is not None:
                homes[engine_id] = kv.value.decode(errors="replace")
                continue
            node_id = self._apply_put(kv)
            if node_id is not None:
                seen.add(node_id)
        if homes != self.homes:
            self.homes = homes
            self._homes_changed()
        for node_id, m in list(self._members.items()):
            if node_id != self.node_id and node_id not in seen and m.state in (State.ALIVE, State.SUSPECT):
                self._change(node_id, State.DEAD, m.meta, m.incarnation)
        self.stats["registry_resyncs"] += 1
        self._synced.set()

    async def _watch_and_keep_alive(self) -> None:
        watch = await asyncio.wait_for(
            self._client.watch_prefix(f"{self.prefix}/".encode(), start_revision=self.revision + 1),
            CALL_TIMEOUT_S)
        keeper = asyncio.create_task(self._keep_alive(), name="etcd-lease")
        watcher = asyncio.create_task(self._follow(watch), name="etcd-watch")
        try:
            done, _ = await asyncio.wait((keeper, watcher), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # its failure is the loop's
            raise ConnectionError("the etcd watch ended")
        finally:
            for task in (keeper, watcher):
                task.cancel()
            await asyncio.gather(keeper, watcher, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)

    async def _follow(self, watch: Any) -> None:
        async for ev in watch:
            self.revision = max(self.revision, ev.kv.mod_revision)
            engine_id = self._engine_of(ev.kv.key)
            if engine_id is not None:
                if ev.kind == "PUT":
                    self.homes[engine_id] = ev.kv.value.decode(errors="replace")
                else:
                    self.homes.pop(engine_id, None)
                self._homes_changed()
            elif ev.kind == "PUT":
                self._apply_put(ev.kv)
            else:
                node_id = self._node_of(ev.kv.key)
                m = self._members.get(node_id) if node_id else None
                if m is not None and node_id != self.node_id and m.state in (State.ALIVE, State.SUSPECT):
                    self._change(node_id, State.DEAD, m.meta, m.incarnation)  # its lease expired
                elif node_id == self.node_id and not self._closing:
                    self._lease = None  # our key is gone (lease expired, or deleted): register again
                    raise ConnectionError("this node's key was deleted from etcd")

    async def _keep_alive(self) -> None:
        period = max(0.5, self.cfg.etcd_lease_ttl_s / 3)
        while True:
            await asyncio.sleep(period)
            reply = await asyncio.wait_for(self._client.refresh_lease(self._lease.id), CALL_TIMEOUT_S)
            if reply is None or reply.TTL <= 0:
                self._lease = None
                raise ConnectionError("this node's etcd lease expired")

    # -- members -------------------------------------------------------------------------------------
    def _engine_of(self, key: bytes) -> str | None:
        head = f"{self.prefix}/homes/".encode()
        return key[len(head):].decode(errors="replace") if key.startswith(head) else None

    def _homes_changed(self) -> None:
        if self.on_homes is not None:
            self.on_homes()

    def _node_of(self, key: bytes) -> str | None:
        head = f"{self.prefix}/nodes/".encode()
        if not key.startswith(head):
            return None
        return key[len(head):].decode(errors="replace") or None

    def _apply_put(self, kv: Any) -> str | None:
        node_id = self._node_of(kv.key)
        if node_id is None:
            return None
        raw = (kv.create_revision, kv.value)
        if self._raw.get(node_id) == raw:
            return node_id  # what this node last read of it (a resync): nothing to decode
        self._raw[node_id] = raw
        try:
            value = json.loads(kv.value)
            state = State.LEFT if value["state"] == "left" else State.ALIVE
            meta = value["meta"]
            if not isinstance(meta, dict):
                raise TypeError("meta is not an object")
        except (ValueError, KeyError, TypeError) as e:
            self.stats["registry_malformed"] += 1
            log.warning("cluster: ignored a malformed etcd entry for %s: %s", node_id, e)
            return None
        if node_id != self.node_id:
            self._change(node_id, state, meta, kv.create_revision)
        return node_id

    def _change(self, node_id: str, state: State, meta: dict, incarnation: int) -> None:
        old = self._members.get(node_id)
        addr = tuple(meta.get("resp") or ("", 0))
        m = Member(node_id, (str(addr[0]), int(addr[1])), incarnation, state, meta,
                   time.monotonic() if old is None or old.state != state else old.since)
        self._members[node_id] = m
        if state == State.LEFT:
            kind = EventKind.LEFT if old is not None and old.state != State.LEFT else None
        elif state == State.DEAD:
            kind = EventKind.DEAD
        elif old is None or old.state in (State.DEAD, State.LEFT):
            kind = EventKind.JOINED
        elif old.meta != meta or old.incarnation != incarnation:
            kind = EventKind.UPDATED
        else:
            kind = None
        if kind is not None:
            self.on_event(Event(kind, Member(m.node_id, m.addr, m.incarnation, m.state, m.meta, m.since),
                                None if old is None else old.state))

    def _set_state(self, state: str, error: Exception | None = None) -> None:
        if state == self.state:
            return
        if state == "unreachable":
            self.unreachable_since = time.monotonic()
            log.warning("cluster: etcd unreachable (%s: %s); serving with the last view of %d member(s)",
                        self._endpoints_text(), describe(error), len(self._members))
        elif self.state == "unreachable":
            log.info("cluster: etcd answers again after %.1f s; the members read afresh (revision %d)",
                     time.monotonic() - (self.unreachable_since or time.monotonic()), self.revision)
            self.unreachable_since = None
        self.state = state

    def _endpoints_text(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.endpoints)

    def info(self) -> list[tuple[str, Any]]:
        return [("cluster_registry_state", self.state), ("cluster_registry_revision", self.revision)] + \
            [(f"cluster_{k}", v) for k, v in sorted(self.stats.items())]
