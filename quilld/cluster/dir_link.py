"""The sharded directory's asyncio shell: its messages over RESP, its timers, this node's lookups.

`Directory` (directory.py) is sans-IO; this module drives it on the event loop:

* **Messages.** Whatever `Directory.poll` hands back is sent as `DIR <from> <msgpack>` on
  pooled peer connections of its own (at most `PER_PEER` to each peer, apart from block
  fetches), and the reply or the failure goes back to the directory. The pump runs once per
  loop iteration after a change (`kick`), and at the directory's next deadline.
* **Requests from peers.** `handle` answers a peer's `DIR` (the RESP command in
  protocol/commands/cluster.py).
* **This node's lookups.** `key_holders` (pool reads, GETBLK, LOCATE) and `block_holders`
  (ROUTE, the gateway's handoff check) ask each owner once for everything it owns, all owners
  at once, and a second owner only for what the first could not answer fully (a bucket still
  filling, an owner that failed): one round trip in the common case, none when this node owns
  it.
* **What this node places.** `placed`/`removed` (the keyspace's values, through the
  residency feed) and `engine_stored`/`engine_removed`/`engine_cleared` (the KV events of the
  engines this node is home to) become the directory's entries; so do the placements another
  node hands over for an engine this node is home to (`ENGINE_ITEMS`: the gateway's record of
  what it sent an engine, made on whichever node served the request; engines_sync.py), so an
  engine has one authority.

Identity scopes have a per-node tag; the directory names them by `scope_digest` (`ctag`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Callable

import msgpack

from quilld.cluster.dir_entries import BLOCK, DROP, TIERS, block_shard, nbytes_of, scope_digest, tiers_of
from quilld.cluster.breaker import PeerHealth
from quilld.cluster.dir_lookup import LookupRun, union
from quilld.cluster.hedged_lookup import drive
from quilld.cluster.directory import LOOKUP, Directory
from quilld.cluster.peer_client import PeerError, PeerPool
from quilld.errors import QuillError
from quilld.index.residency import hash_key
from quilld.model import CacheTier
from quilld.scopes import TAG_LEN, ScopeRegistry

log = logging.getLogger("quilld.cluster")

PER_PEER = 4  # directory connections to one peer at once
ACK_WAIT = 2.0  # seconds a write's reply waits for its owners' acknowledgement at most
CALL_TIMEOUT = 5.0  # seconds a directory request may take
MAX_WAIT = 1.0  # the pump looks at the directory at least this often
# a DIR message of this kind: [(engine, op, ctag, hashes, parent, tier)], op STORED or REMOVED,
# placements of an engine this node is home to, handed over by the node that made them
ENGINE_ITEMS, STORED, REMOVED = "e", "s", "r"


class _Ctags(dict):
    """This node's scope tags -> their cluster-wide digests (`ctag`), each computed once."""

    def __init__(self, scopes: ScopeRegistry) -> None:
        super().__init__()
        self.scopes = scopes
        self.tags: dict[bytes, bytes] = {}  # ctag -> tag

    def __missing__(self, tag: bytes) -> bytes:
        ctag = self[tag] = scope_digest(*self.scopes.scope_of(tag))
        self.tags[ctag] = tag
        return ctag


class _Same(dict):
    """A ctag names itself (placements that arrive with their scopes' digests)."""

    def __missing__(self, ctag: bytes) -> bytes:
        return ctag


_SAME = _Same()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def tiers(code: int) -> list[CacheTier]:
    bits = tiers_of(code)
    return [t for i, t in enumerate(TIERS) if bits >> i & 1]


class DirectoryLink:
    def __init__(self, directory: Directory, scopes: ScopeRegistry, hello: tuple[tuple, ...],
                 addresses: dict[str, tuple[str, int]]) -> None:
        self.d = directory
        self.node_id = directory.node_id
        self.scopes = scopes
        self.addresses = addresses  # peer -> RESP address (the cluster's, kept current by it)
        self.pool = PeerPool(hello=hello, per_peer=PER_PEER)
        self.stats: Counter[str] = Counter()
        self.touched: Callable[[bytes], None] | None = None  # WATCH: a key changed on another node
        self.parents: dict[bytes, bytes] = {}  # ctag + hash -> parent hash, for a block about to be placed
        self._ctags = _Ctags(scopes)  # tag -> ctag
        self._tags = self._ctags.tags  # ctag -> tag
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._kicked = False
        self._inflight: set[asyncio.Task] = set()
        self._barriers: list[tuple[dict[str, int], asyncio.Future]] = []
        self.health = PeerHealth(time.monotonic, self.stats)  # per-peer breakers and hedge delays (lookups)
        self.lookup_timeout = CALL_TIMEOUT  # seconds a lookup's call to one owner may take
        self.placements = 0  # changes placed so far (the server shell compares it around a batch)
        directory.key_changed = self._key_changed
        directory.key_stale = self._key_stale
        self.drop_copy: Callable[[bytes, bytes], Any] | None = None  # (tag, key): delete this node's copy
        self.tombstone_s = 86_400.0  # cluster.tombstone_s
        self._keeping: dict[bytes, int] = {}  # full key -> the version of the peer's copy about to be kept
        self._dropping = False  # a stale copy is being deleted: no tombstone for it
        scopes.on_release.append(self._released)

    # -- scopes ------------------------------------------------------------------------
    def ctag(self, tag: bytes) -> bytes:
        return self._ctags[tag]

    def _released(self, tag: bytes, scope: Any) -> None:
        ctag = self._ctags.pop(tag, None)
        if ctag is not None:
            self._tags.pop(ctag, None)

    def _key_changed(self, eid: bytes) -> None:
        touched = self.touched
        if touched is not None:
            tag = self._tags.get(eid[:8])
            if tag is not None:
                touched(tag + eid[8:])

    # -- the pump ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="directory")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._inflight) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self.pool.close()

    def kick(self) -> None:
        """Something changed: the pump looks at the directory once the current callbacks are done."""
        if not self._kicked:
            self._kicked = True
            self._wake.set()

    async def _run(self) -> None:
        while True:
            self._kicked = False
            self._wake.clear()
            try:
                for dest, msg in self.d.poll(time.monotonic()):
                    self._send(dest, msg)
                if self._barriers:  # an owner that left answers nothing more: its part is met
                    self._check_barriers()
            except Exception:
                log.exception("directory: the pump failed")  # a bug: logged, the pump goes on
            wait = min(MAX_WAIT, max(0.0, self.d.next_deadline() - time.monotonic()))
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def _send(self, dest: str, msg: tuple) -> None:
        task = asyncio.ensure_future(self._request(dest, msg))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _request(self, dest: str, msg: tuple) -> None:
        try:
            reply = await self.call(dest, msg)
        except (QuillError, ValueError, TypeError) as e:
            self.stats["message_failures"] += 1
            log.debug("directory: %s to %s failed: %s", msg[0], dest, e)
            self.d.on_failure(dest, msg, time.monotonic())
        else:
            self.d.on_reply(dest, msg, reply, time.monotonic())
        if self._barriers:
            self._check_barriers()
        self.kick()

    # -- writes answered once their owners have them ---------------------------------------
    def acknowledged(self) -> Any:
        """An awaitable that resolves once every owner has answered the placements made so far
        (ACK_WAIT at most: a slow owner delays a write, it never fails it; counted), or None
        when none is on its way. The server shell holds a batch's replies on it, so a value
        written on this node is found from every node once its write is answered."""
        barrier = self.d.barrier()
        if barrier is None or self.d.passed(barrier):
            return None
        fut = asyncio.get_running_loop().create_future()
        self._barriers.append((barrier, fut))
        return self._wait_acked(fut)

    async def _wait_acked(self, fut: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(fut), ACK_WAIT)
        except asyncio.TimeoutError:
            self.stats["placement_ack_timeouts"] += 1
            self._barriers = [(b, f) for b, f in self._barriers if f is not fut]

    def _check_barriers(self) -> None:
        keep = []
        for barrier, fut in self._barriers:
            if fut.done():
                continue
            if self.d.passed(barrier):
                fut.set_result(None)
            else:
                keep.append((barrier, fut))
        self._barriers = keep

    async def call(self, dest: str, msg: tuple, timeout: float = CALL_TIMEOUT) -> Any:
        """One request to `dest`'s directory; its reply (raises QuillError when it failed)."""
        addr = self.addresses.get(dest)
        if addr is None:
            raise PeerError(f"no address for {dest}")
        reply = await self.pool.call(*addr, "DIR", self.node_id, pack(msg), timeout=timeout)
        if not isinstance(reply, bytes):
            raise PeerError(f"{dest} refused DIR: {reply}")
        self.stats["requests"] += 1
        return unpack(reply)

    def handle(self, src: str, payload: bytes) -> bytes:
        """A peer's DIR request: its reply, packed."""
        msg = unpack(payload)
        if msg[0] == ENGINE_ITEMS:
            self.engine_items(msg[1])
            return pack(("ok", []))
        reply = self.d.handle(src, msg, time.monotonic())
        if reply[0] == "ok" or reply[0] == "r":
            self.kick()  # applying it may have moved nothing, but a copy or a gained bucket may
        return pack(reply)

    # -- this node's own values and engines ------------------------------------------------
    def placed(self, fk: bytes, tier: CacheTier, nbytes: int, bhash: int | bytes | None) -> None:
        """The value of `fk` was just written here: a new version, unless it is a peer's copy this
        node keeps (`keep_as`), which keeps the version it was read at."""
        version = self._keeping.pop(fk, None)
        self._place(fk, tier, nbytes, bhash, self.d.hlc.now() if version is None else version)

    def moved(self, fk: bytes, tier: CacheTier, nbytes: int, bhash: int | bytes | None) -> None:
        """The same value of `fk` is now in `tier` (or was recovered at start: version 0, unknown)."""
        self._place(fk, tier, nbytes, bhash, self.d.version_of(self.node_id, self.ctag(fk[:TAG_LEN]) + fk[TAG_LEN:])
                    or 0)

    def keep_as(self, fk: bytes, version: int | None) -> None:
        """The next write of `fk` here is a copy of a peer's value at `version` (a pool read kept);
        None: it was not written after all."""
        if version is None:
            self._keeping.pop(fk, None)
        else:
            self._keeping[fk] = version

    def _place(self, fk: bytes, tier: CacheTier, nbytes: int, bhash: int | bytes | None, version: int) -> None:
        self.placements += 1
        ctag = self.ctag(fk[:TAG_LEN])
        self.d.place_key(self.node_id, ctag + fk[TAG_LEN:], tier.value, nbytes, version)
        if bhash is not None:
            h = hash_key(bhash)
            self.d.place_block(self.node_id, ctag, h, self.parents.pop(ctag + h, None), tier.value, exact=True)
        self.kick()

    def removed(self, fk: bytes, bhash: int | bytes | None) -> None:
        self.placements += 1
        ctag = self.ctag(fk[:TAG_LEN])
        self.d.remove_key(self.node_id, ctag + fk[TAG_LEN:])
        if bhash is not None:
            self.d.unplace_block(self.node_id, ctag, hash_key(bhash), None)
        self.kick()

    def deleted(self, fk: bytes) -> None:
        """A client deleted `fk` here (the keyspace's `deleted` hook): a tombstone, so that every
        older copy anywhere goes too, and no node brings one back (`cluster.tombstone_s`)."""
        if not self._dropping:
            self.bury(fk[:TAG_LEN], fk[TAG_LEN:])

    def bury(self, tag: bytes, key: bytes) -> None:
        """A tombstone for `key` of scope `tag`, at a new version (DEL of a key only peers hold)."""
        self.placements += 1
        self.d.bury_key(self.node_id, self.ctag(tag) + key, self.d.hlc.now(), time.monotonic() + self.tombstone_s)
        self.kick()

    def _key_stale(self, eid: bytes) -> None:
        """An owner found this node's copy of a key older than the key's newest version: dropped
        (no tombstone: the newer version is someone else's write or delete)."""
        tag = self._tags.get(eid[:8])
        if tag is None or self.drop_copy is None:
            return
        self._dropping = True
        try:
            self.drop_copy(tag, eid[8:])
        finally:
            self._dropping = False
        self.stats["stale_copies_dropped"] += 1

    def note_parent(self, tag: bytes, bhash: int | bytes, parent: int | bytes) -> None:
        """The block `bhash` about to be stored here follows `parent` in its chain."""
        ctag = self.ctag(tag)
        if len(self.parents) >= 65536:  # puts begun and never committed: forget the oldest
            self.parents.pop(next(iter(self.parents)))
        self.parents[ctag + hash_key(bhash)] = hash_key(parent)

    def engine_blocks(self, engine: str, ops: list[tuple]) -> None:
        """`engine`'s stores and removals, in order: ops `(tag, tier, hashes, parent)`, `parent`
        False for a removal (ControlPlane.apply_events: a batch of KV events is one call, one
        item per owner)."""
        self.d.change_blocks(engine, ops, self._ctags)
        self.kick()

    def engine_stored(self, engine: str, tag: bytes, hashes: Iterable, parent: Any, tier: CacheTier) -> None:
        self.engine_blocks(engine, [(tag, tier, hashes, parent)])

    def engine_removed(self, engine: str, tag: bytes, hashes: Iterable, tier: CacheTier | None) -> None:
        self.engine_blocks(engine, [(tag, tier, hashes, DROP)])

    def engine_cleared(self, engine: str) -> None:
        self.d.clear_holder(engine)
        self.kick()

    def engine_items(self, items: list) -> None:
        """Placements of engines this node is home to, made on another node (ENGINE_ITEMS)."""
        for engine, op, ctag, hashes, parent, tier in items:
            if op == STORED:
                self.d.change_blocks(engine, [(ctag, tier, hashes, parent)], _SAME)
            elif op == REMOVED:
                self.d.change_blocks(engine, [(ctag, tier, hashes, DROP)], _SAME)
            else:
                raise ValueError(f"unknown engine placement {op!r}")
        self.stats["engine_items_taken"] += len(items)
        self.kick()

    # -- lookups --------------------------------------------------------------------------
    async def lookup(self, items: list[tuple], counted: bool = True) -> tuple[list, int]:
        """LOOKUP `items` through their owners (`LookupRun`: every owner before an item is
        absent): (answers, owner round trips). An answer is what the owners hold: for a key
        [(holder, code)], for a segment [[(holder, code)] per block]. `counted` false: a view's
        look (the status page's), left out of the lookup and miss counts, which are reads'."""
        run = LookupRun(self.d, items)
        await drive(run, self.call, self.health, self.lookup_timeout, lambda asked: (LOOKUP, asked), self.stats,
                    self._inflight)
        out = run.answers()
        if not counted:
            return out, run.trips
        self.stats["lookup_misses"] += run.misses
        self.stats["lookup_misses_unreachable"] += run.unreachable
        self.stats["lookups"] += 1
        self.stats[f"lookups_{min(run.trips, 3)}_trips"] += 1
        return out, run.trips

    async def first_block_holders(self, routed: list[tuple[bytes, Any]]) -> list[list[tuple[str, list[CacheTier]]]]:
        """For each (tag, block) a prompt was routed with as its first block: (holder, tiers) of every
        engine and node holding it, as ROUTE's first wave finds it (a first block heads its segment),
        all in one lookup. Not counted as a ROUTE: the status page asks this every 2 s."""
        if not routed:
            return []
        items = [self.d.block_items(self.ctag(tag), [hash_key(block)])[0][0] for tag, block in routed]
        answers, _trips = await self.lookup(items, counted=False)
        return [[(h, tiers(code)) for h, code in a[0]] for a in answers]

    async def key_holders(self, tag: bytes, keys: list[bytes]) -> list[list[tuple[str, list[CacheTier], int, int]]]:
        """For each key of scope `tag`: (holder, tiers, bytes, version) of every node the directory
        names with the key's newest version (none when that is a delete)."""
        ctag = self.ctag(tag)
        answers, _ = await self.lookup([Directory.key_item(ctag + k) for k in keys])
        observe = self.d.hlc.observe
        out = []
        for a in answers:
            if a:
                observe(a[0][2])  # a write after this read gets a later version
            out.append([(h, tiers(code), nbytes_of(code), version) for h, code, version in a])
        return out

    async def block_holders(self, tag: bytes, hashes: list) -> tuple[list[list[tuple[str, list[CacheTier]]]], int]:
        """For each block of a prompt (from its first): (holder, tiers) of every engine and node
        holding it; and the owner round trips it took.

        First wave: each prompt segment's owners (a block placed from its chain is there). A
        block placed with no known parent (a pool block stored with HASH alone, or the first of
        a chain whose parent its holder lacks) heads a segment of its own, under its own hash,
        whatever its place in the prompt. So where a holder of a block is not found at the
        next one in the same segment, a second wave asks the blocks from there to the
        segment's end at their own shards, all segments' at once (the first of each also with
        the blocks after it, for a chain that starts there)."""
        ctag = self.ctag(tag)
        parts = [hash_key(h) for h in hashes]
        items = self.d.block_items(ctag, parts)
        answers, trips = await self.lookup([item for item, _ in items])
        found: list[list] = [per for seg in answers for per in seg]
        g = self.d.s.group_blocks
        more, starts = [], []
        for s in range(0, len(parts), g):
            end = min(len(parts), s + g)
            j = next((j for j in range(s + 1, end) if _left(found[j - 1], found[j])), None)
            if j is None:
                continue
            more.append((BLOCK, block_shard(ctag, parts[j]), parts[j:j + g]))
            starts.append(j)
            for k in range(j + 1, end):
                more.append((BLOCK, block_shard(ctag, parts[k]), [parts[k]]))
                starts.append(k)
        if more:
            got, trips2 = await self.lookup(more)
            trips += trips2
            for j, seg in zip(starts, got):
                for k, per in enumerate(seg, j):
                    found[k] = union(found[k], per)
            self.stats["route_second_waves"] += 1
        self.stats["routes"] += 1
        self.stats["route_owner_trips"] += trips
        return [[(h, tiers(code)) for h, code in per] for per in found], trips


def _left(before: list, here: list) -> bool:
    """Whether a holder of the block before is not among this block's (found so far)."""
    names = {h for h, _ in here}
    return any(h not in names for h, _ in before)
