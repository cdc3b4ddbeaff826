"""The sharded residency directory: each entry lives on its R owners, not on every node.

`Directory` is one node's part of it, sans-IO like `swim.py`: the caller feeds it
the membership (`set_members`), this node's own changes (`place_key`,
`place_block`, ...), requests from peers (`handle`) and the replies to its own
requests (`on_reply`, `on_failure`), with the time; it hands back what to send
(`poll`). The asyncio shell (cluster.py) moves the messages over RESP peer
connections; the simulation (simulation.py) moves them in memory on a virtual
clock. Both drive this same code.

**Roles.** Every node is a *holder* (the authority for its own values, and for
the engines it is home to: their blocks come from KV events it consumes) and an
*owner* (it keeps the entries of the buckets `Ownership` gives it, for every
holder). A node never keeps entries of buckets it does not own.

**Placement.** A change of a holder's entry is applied to its own list
(`HeldEntries`) and queued to each owner of the entry's bucket. Each owner has
one ordered channel from each holder-node: one message in flight at a time,
numbered (`epoch`, `seq`); everything queued while one is in flight goes in the
next, so a burst becomes a few large messages. A failed message is sent again
(same number) until it is answered or the owner leaves the membership. An owner
that sees a number it cannot follow (it restarted, or the holder did) answers
`resync`, and the holder sends it a *full sync*: for every bucket it owns, a
replacement of the holder's entries, then the list of buckets that have any
(entries of the holder in other buckets of that owner are dropped).

**Handoff.** A membership change moves some buckets (`Ownership.update`). For
each moved bucket, each holder sends its entries in it to the new owners (the
holders are the authority, so nothing a live holder has is lost, even when every
old owner died); a new owner also copies the bucket from an old owner that is
still alive, so lookups are answered before every holder's handoff has arrived,
and marks it *filling* until then (a lookup answered from a filling bucket says
so, and the asker also asks the next owner). An owner keeps a bucket it lost for
`handoff_grace_s` (askers with an older view), then drops it. The entries of a
holder-node that died or left are dropped at once; an engine's entries stay
until its new home takes over (`adopt`).

**Anti-entropy.** Every `anti_entropy_s`, each holder-node sends each owner a
digest (count and XOR of entry hashes) of each of its holders' buckets that
owner owns; the owner answers which (holder, bucket) pairs differ, and the holder
replaces those. With both views of the membership equal, buckets the digest does
not list are empty on the holder, and the owner drops what it has there.

**Lookups.** A key's owners are asked for its holders (`key_lookup`), a prompt's
blocks segment by segment (`block_lookup`): all blocks of a segment have the
same owners, so ROUTE over G blocks is one owner round trip. A node that owns
the bucket answers from its own store (no round trip).
"""

from __future__ import annotations

import heapq
import os
import random
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import xxhash

from quilld.cluster.dir_entries import (BLOCK, DROP, KEY, TIER_BIT, TOMBSTONE, Changes, Entry, HeldEntries,
                                        block_shard, code_of, key_shard)
from quilld.cluster.dir_owned import OwnedEntries
from quilld.cluster.hlc import Hlc
from quilld.cluster.ownership import Ownership

# message kinds (first element of a request tuple)
BATCH, LOOKUP, COPY, DUMP, STALE = "b", "l", "c", "h", "x"
# items of a batch (ITEMS: a run of one holder's changes as columns, `dir_entries.Changes`)
PUT, DEL, CLEAR, SYNCED, DIGEST, BEGIN, ITEMS = "P", "R", "C", "E", "D", "S", "M"
_HELD_OPS = frozenset((PUT, DEL, CLEAR, SYNCED, DIGEST, ITEMS))  # batch items that name their holder second
COPY_BUCKETS = 256  # buckets per COPY request
SETTLE_FROM = 32  # views of more members than this wait `membership_settle_s` (bursts of joins at scale)
SWEEP_ROUNDS = 8  # every this many anti-entropy rounds, a digest goes to every owner
STALE_TRIES = 10  # times a stale-copy notice is sent to a holder that does not answer


@dataclass(frozen=True)
class DirectorySettings:
    replicas: int = 3  # owners per bucket (cluster.directory_replicas); every node when fewer
    buckets: int = 16384  # virtual buckets (a power of two)
    group_blocks: int = 32  # blocks per prefix segment: a segment's blocks share owners
    weighted: bool = False  # ownership weighted by each member's capacity
    anti_entropy_s: float = 30.0
    handoff_grace_s: float = 10.0
    retry_s: float = 0.5  # a failed message is sent again after this
    membership_settle_s: float = 0.2  # a new view is applied once it has not changed for this long
    batch_items: int = 8192  # items per message


@dataclass
class _Channel:
    """Messages from this node (as holder) to one owner, in order, one in flight."""

    queue: deque = field(default_factory=deque)
    seq: int = 0
    inflight: tuple | None = None
    retry_at: float = 0.0  # when the message in flight is sent again (0: not failed)
    acked: int = 0  # the highest sequence number the owner has answered
    synced: bool = False  # the owner has had a full sync since we (or it) started
    touched: dict = field(default_factory=dict)  # holder -> buckets sent (or queued) since the last digest
    sweep_at: float = 0.0  # when the next digest goes even with nothing in common


@dataclass
class LookupPlan:
    """Which owners to ask for what, and what this node answered itself.

    `asks`: owner -> the LOOKUP items for it; `local`: item number -> answer;
    `route`: item number -> (owner, index in that owner's items)."""

    items: list
    asks: dict[str, list] = field(default_factory=dict)
    route: dict[int, tuple[str, int]] = field(default_factory=dict)
    local: dict[int, Any] = field(default_factory=dict)


class Directory:
    def __init__(self, node_id: str, settings: DirectorySettings = DirectorySettings(),
                 rng: random.Random | None = None, wall: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.hlc = Hlc(node_id, wall)  # versions of this node's writes and deletes of keys
        self.s = settings
        self.rng = rng or random.Random()
        self.epoch = os.urandom(8).hex()
        self.ownership = Ownership(settings.buckets, settings.replicas, settings.weighted)
        self.bucket_of = self.ownership.bucket_of
        self.owned = OwnedEntries()
        self.authorities: dict[str, HeldEntries] = {node_id: HeldEntries(node_id)}
        self.members: dict[str, float] = {}
        self.channels: dict[str, _Channel] = {}
        self.inbound: dict[str, tuple[str, int]] = {}  # holder-node -> (epoch, last seq applied)
        self.filling: dict[int, set[str]] = {}  # bucket -> holders heard since (a copy not yet in)
        self.gained: dict[int, float] = {}  # bucket -> until when its answers may lack a late writer's entry
        self.departed: dict[str, float] = {}  # members that died or left -> when (their entries are dropped)
        self.stats: Counter[str] = Counter()
        self.key_changed: Callable[[bytes], None] | None = None  # told of each key an owner hears changed
        # told of each key this node holds an older version of than the key's newest (an owner
        # said so): the caller drops its copy, and its removal comes back as `remove_key`
        self.key_stale: Callable[[bytes], None] | None = None
        self._stale_out: dict[str, list[tuple[bytes, int]]] = {}  # holder-node -> notices to send
        self._pending: dict[str, float] | None = None  # a view waiting for the membership to settle
        self._pending_at = 0.0
        self._pending_since = 0.0
        self._now = 0.0  # the latest time the caller gave (a lookup's answers need it)
        self._handoff_until = 0.0  # until when lookups may also ask a bucket's old owners
        self._ready: set[str] = set()  # channels with something to send and nothing in flight
        self._unacked: set[str] = set()  # channels with something queued or in flight
        self._timers: list[tuple[float, int, str, Any]] = []  # (when, tie, what, arg): retries, digests, drops
        self._tie = 0
        self._view = b""  # the membership, so that two nodes can tell they agree
        self._copy_asks: dict[str, list[int]] = {}  # old owner -> buckets to copy from it
        self._strays: set[int] = set()  # buckets not ours that a holder sent entries for (release pending)

    # -- membership --------------------------------------------------------------------
    def note_members(self, members: dict[str, float], now: float) -> None:
        """A new view of the live members: at once while this node was alone or the cluster is
        small (SETTLE_FROM members); else once it has not changed for `membership_settle_s` (a
        burst of joins or deaths moves the buckets once), and at most four times that after the
        first change."""
        members = dict(members)
        members.setdefault(self.node_id, 1.0)
        if members == (self._pending if self._pending is not None else self.members):
            return
        if len(self.members) <= 1 or len(members) <= SETTLE_FROM:  # alone, or a small cluster: at once
            self.set_members(members, now)
            return
        if self._pending is None:
            self._pending_since = now
        self._pending = members
        self._pending_at = min(now + self.s.membership_settle_s, self._pending_since + 4 * self.s.membership_settle_s)

    def set_members(self, members: dict[str, float], now: float) -> None:
        """Apply a view of the live members (this node among them) now: move what it moves."""
        self._pending = None
        self._now = now
        members = dict(members)
        members.setdefault(self.node_id, 1.0)
        gone = set(self.members) - set(members)
        alone = set(self.members) <= {self.node_id}  # a lone view (a new process) owned nothing real
        mine_before = self.owned_buckets(self.node_id) if self.ownership.members else set()
        changed = self.ownership.update(members)
        added = set(members) - set(self.members)
        self.members = members
        self._view = xxhash.xxh64_digest(repr(sorted(self.ownership.members)).encode())
        for node in gone:
            self.channels.pop(node, None)
            self.inbound.pop(node, None)
            self._ready.discard(node)
            self._unacked.discard(node)
        dead_holders = {n for n in gone if n != self.node_id}
        for n in dead_holders:
            self.departed[n] = now
        for n in added:
            self.departed.pop(n, None)
        if dead_holders:
            self.stats["holders_dropped"] += self.owned.drop_holders(dead_holders)
        if len(changed):
            self._handoff_until = now + self.s.handoff_grace_s
            self._moved(changed, now, alone, mine_before)
        for node in added:
            if node != self.node_id:
                self._channel(node)
                if self._shares(node):  # its first message is a full sync; none while we hold nothing of its
                    self._ready.add(node)
                self._timer(now + self.s.anti_entropy_s * (0.5 + self.rng.random()), "digest", node)

    def holder_gone(self, node: str, now: float) -> int:
        """`node` died or left: its entries go at once (a lookup never sends anyone to it), ahead of
        the view change that moves its buckets; returns how many went."""
        self.departed[node] = now
        dropped = self.owned.drop_holders({node})
        self.stats["holders_dropped"] += dropped
        return dropped

    def restarted(self, node: str, epoch: str, now: float) -> None:
        """`node` is a new process (directory `epoch`) under an old name: what we sent it is gone,
        and what its old process held as a holder is gone with it (unless the new one has already
        sent its full sync, which replaced it)."""
        ch = self.channels.get(node)
        if ch is not None:
            ch.synced, ch.inflight, ch.retry_at = False, None, 0.0
            ch.queue.clear()
            if self._shares(node):
                self._ready.add(node)
        known = self.inbound.get(node)
        if known is None or known[0] != epoch:
            self.inbound.pop(node, None)
            self.stats["holders_dropped"] += self.owned.drop_holders({node})
        self.stats["peer_restarts"] += 1

    def _moved(self, changed: np.ndarray, now: float, alone: bool, mine_before: set[int]) -> None:
        """Hand over what a new view moves: as an owner, fill the buckets gained (copied from an
        old owner) and release those lost (after a grace); as a holder, send the new owners of each
        moved bucket our entries in it."""
        me, own = self.node_id, self.ownership
        mine = self.owned_buckets(me)
        gained = mine if alone else mine - mine_before
        young = now + self.s.handoff_grace_s
        for b in gained:
            self.gained[b] = young  # a holder that has not seen this view yet places elsewhere meanwhile
            old, new = own.previous_owners(b), own.owners(b)
            if b not in mine_before and self.owned.digests.get(b):  # kept from an earlier spell: stale
                self.owned.drop_bucket(b)
            # an old owner still alive has the bucket (or another current owner, when this node was
            # alone: a new process, whose lone view held nothing of the others')
            source = next((o for o in (*old, *new) if o != me and o in self.members), None)
            if source is not None:
                self.filling[b] = set()
                self._copy_asks.setdefault(source, []).append(b)
            self.stats["buckets_gained"] += 1
        for b in mine_before - mine:
            self.filling.pop(b, None)
            self._timer(now + self.s.handoff_grace_s, "release", b)
            self.stats["buckets_lost"] += 1
        moved = set(changed.tolist())
        for holder, held in self.authorities.items():  # as a holder: the new owners get ours
            for b in moved.intersection(held.buckets):
                old = own.previous_owners(b)
                for o in own.owners(b):
                    if o in old:
                        continue
                    if o == me:
                        self.owned.replace(holder, b, held.in_bucket(b))
                    else:
                        self._send_replace(o, holder, b, held)
                        self.stats["handoff_buckets"] += 1

    def owned_buckets(self, member: str) -> frozenset[int]:
        return self.ownership.owned_set(member)

    # -- this node's own changes (as a holder) ----------------------------------------------
    def add_authority(self, holder: str) -> HeldEntries:
        held = self.authorities.get(holder)
        if held is None:
            held = self.authorities[holder] = HeldEntries(holder)
        return held

    def place_key(self, holder: str, eid: bytes, tier: str, nbytes: int, version: int = 0) -> None:
        """`holder` has the key `eid` (ctag + key) at `version`, now only in `tier`."""
        self._put(holder, KEY, eid, key_shard(eid), code_of(TIER_BIT[tier], nbytes), version)

    def bury_key(self, holder: str, eid: bytes, version: int, until: float) -> None:
        """`holder` deleted the key `eid` at `version`: a tombstone, kept until `until` (this
        directory's clock) so that an older copy anywhere, even on a node away meanwhile that
        comes back with it, is dropped rather than found."""
        self._put(holder, KEY, eid, key_shard(eid), TOMBSTONE, version)
        self._timer(until, "tomb", (holder, eid, version))
        self.stats["tombstones_placed"] += 1

    def version_of(self, holder: str, eid: bytes) -> int | None:
        """`holder`'s version of the key `eid` (0: recovered, unknown), None when it has none."""
        held = self.authorities.get(holder)
        return None if held is None else held.version_of(eid)

    def remove_key(self, holder: str, eid: bytes) -> None:
        self._remove(holder, eid)

    def place_block(self, holder: str, ctag: bytes, bhash: bytes, parent: bytes | None, tier: str,
                    exact: bool = False) -> None:
        """`holder` has the block `bhash` of scope `ctag` in `tier` (added to its other tiers, or
        its only tier with `exact`). `parent`, the hash before it in its chain, places it in its
        prefix segment; a block whose parent is None or unknown starts a chain."""
        self.change_blocks(holder, [(ctag, tier, (bhash,), parent)], {ctag: ctag}, exact)

    def unplace_block(self, holder: str, ctag: bytes, bhash: bytes, tier: str | None) -> None:
        """`holder` no longer has the block in `tier` (in any tier when None)."""
        self.change_blocks(holder, [(ctag, tier, (bhash,), DROP)], {ctag: ctag})

    def change_blocks(self, holder: str, ops: list[tuple], ctags: dict, exact: bool = False) -> None:
        """`holder`'s block stores and removals, in order (`HeldEntries.change_blocks`: ops
        `(tag, tier, hashes, parent or DROP)`, `ctags` each tag's scope digest): a batch of KV
        events is one call, one loop over the holder's list, and one ITEMS item per owner for all
        of it (its messages carry the changes as columns, not an item per block)."""
        held = self.authorities.get(holder)
        if held is None:
            if all(op[3] is DROP for op in ops):
                return
            held = self.add_authority(holder)
        changes, unanchored = held.change_blocks(ops, ctags, exact, self.s.group_blocks, self.bucket_of)
        if unanchored:
            self.stats["blocks_unanchored"] += unanchored
        if changes.eids:
            self._distribute(holder, changes)

    def clear_holder(self, holder: str) -> None:
        """Everything `holder` had is gone (an engine cleared its cache)."""
        held = self.authorities.get(holder)
        if held is None:
            return
        for b in held.clear():
            for o in self.ownership.owners(b):
                if o == self.node_id:
                    self.owned.drop_holder_in(holder, b)
                else:
                    self._enqueue(o, (CLEAR, holder, b))

    def drop_authority(self, holder: str) -> None:
        """Stop being `holder`'s authority (an engine moved home); its entries stay with the owners."""
        if holder != self.node_id:
            self.authorities.pop(holder, None)

    def adopt(self, holder: str, entries: Iterable[tuple[int, Entry]]) -> int:
        """Become `holder`'s authority with these entries (an engine's, gathered from its owners);
        an entry placed here meanwhile is newer and stays. Returns how many were taken."""
        held = self.add_authority(holder)
        taken = 0
        for bucket, e in entries:
            if held.get(e.eid) is None:
                taken += held.put(e.kind, e.eid, e.shard, bucket, e.code)
        return taken

    def _put(self, holder: str, kind: int, eid: bytes, shard: bytes, code: int, version: int = 0) -> None:
        held = self.add_authority(holder)
        bucket = self.bucket_of(shard)
        if not held.put(kind, eid, shard, bucket, code, version):
            return
        self.stats["placements"] += 1
        for o in self.ownership.owners(bucket):
            if o == self.node_id:
                self.owned.put(holder, kind, eid, shard, bucket, code, version)
            else:
                self._enqueue(o, (PUT, holder, kind, eid, shard, code, version), bucket)

    def _distribute(self, holder: str, changes: Changes) -> None:
        """Hand a run of `holder`'s changes (applied to its list already) to the owners of their
        buckets: applied here when this node is one, one ITEMS item queued for each other owner,
        with its entries in order. With no more members than replicas every bucket has the same
        owners and the run goes whole to each; otherwise each owner gets the entries of its
        buckets (entries of different buckets commute: an owner keeps them apart)."""
        n = len(changes.eids)
        self.stats["placements"] += n
        own = self.ownership
        if len(own.members) <= self.s.replicas:
            groups = [(tuple(own.members), changes)]
        else:
            owners, by_owner = own.owners, {}
            for i, b in enumerate(changes.buckets):
                for o in owners(b):
                    got = by_owner.get(o)
                    if got is None:
                        by_owner[o] = [i]
                    else:
                        got.append(i)
            e, sh, bu, co = changes.eids, changes.shards, changes.buckets, changes.codes
            groups = [((o,), changes if len(idx) == n else
                       Changes(changes.kind, [e[i] for i in idx], [sh[i] for i in idx], [bu[i] for i in idx],
                               [co[i] for i in idx])) for o, idx in by_owner.items()]
        me, limit = self.node_id, self.s.batch_items
        for row, part in groups:
            for o in row:
                if o == me:
                    self.owned.apply(holder, part.kind, part.eids, part.shards, part.buckets, part.codes)
                    continue
                ch = self._channel(o)
                size = len(part.eids)
                self.stats["placement_items"] += size
                if ch.synced:  # before the first full sync, the sync itself carries everything
                    for i in range(0, size, limit):
                        ch.queue.append((ITEMS, holder, part.kind, part.eids[i:i + limit], part.shards[i:i + limit],
                                         part.codes[i:i + limit]) if size > limit else
                                        (ITEMS, holder, part.kind, part.eids, part.shards, part.codes))
                    got = ch.touched.get(holder)
                    if got is None:
                        ch.touched[holder] = set(part.buckets)
                    else:
                        got.update(part.buckets)
                if ch.inflight is None:
                    self._ready.add(o)
                self._unacked.add(o)

    def _remove(self, holder: str, eid: bytes) -> None:
        held = self.authorities.get(holder)
        old = held.remove(eid) if held is not None else None
        if old is None:
            return
        kind, shard, _code, bucket = old
        self.stats["placements"] += 1
        for o in self.ownership.owners(bucket):
            if o == self.node_id:
                self.owned.remove(holder, kind, eid, shard, bucket)
            else:
                self._enqueue(o, (DEL, holder, kind, eid, shard), bucket)

    # -- channels ------------------------------------------------------------------------
    def _timer(self, when: float, what: str, arg: Any) -> None:
        self._tie += 1
        heapq.heappush(self._timers, (when, self._tie, what, arg))

    def _channel(self, dest: str) -> _Channel:
        ch = self.channels.get(dest)
        if ch is None:
            ch = self.channels[dest] = _Channel()
        return ch

    def _shares(self, dest: str) -> bool:
        """Whether we are the authority for any entry in a bucket `dest` owns."""
        theirs = self.owned_buckets(dest)
        return any(not theirs.isdisjoint(held.buckets) for held in self.authorities.values())

    def _enqueue(self, dest: str, item: tuple, bucket: int | None = None) -> None:
        """Queue one item for `dest`; `bucket`: the bucket of the entry it puts or removes."""
        ch = self._channel(dest)
        self.stats["placement_items"] += 1
        if ch.synced:  # before the first full sync, the sync itself carries everything
            ch.queue.append(item)
            if bucket is not None:
                ch.touched.setdefault(item[1], set()).add(bucket)
        if ch.inflight is None:
            self._ready.add(dest)
        self._unacked.add(dest)

    def barrier(self) -> dict[str, int] | None:
        """What the owners must have answered for every change made so far to have reached them:
        owner -> the sequence number that carries (or will carry) its last item; None when
        nothing is on its way. See `passed`."""
        out = {}
        for dest in self._unacked:
            ch = self.channels.get(dest)
            if ch is not None:
                out[dest] = ch.seq + (1 if ch.queue or not ch.synced or dest in self._ready else 0)
        return out or None

    def passed(self, barrier: dict[str, int]) -> bool:
        """Whether every owner named has answered up to its number (or left the membership)."""
        for dest, n in barrier.items():
            ch = self.channels.get(dest)
            if ch is not None and dest in self.members and ch.acked < n:
                return False
        return True

    def _send_replace(self, dest: str, holder: str, bucket: int, held: HeldEntries) -> None:
        ch = self._channel(dest)
        if not ch.synced:
            if ch.inflight is None:
                self._ready.add(dest)  # the full sync carries it
            return
        ch.queue.append((CLEAR, holder, bucket))
        entries = held.in_bucket(bucket)
        for e in entries:
            ch.queue.append((PUT, holder, e.kind, e.eid, e.shard, e.code, e.version))
        if entries:
            ch.touched.setdefault(holder, set()).add(bucket)
        if ch.inflight is None:
            self._ready.add(dest)
        self._unacked.add(dest)

    def _full_sync(self, dest: str, ch: _Channel) -> None:
        """Queue, for `dest`, every entry of every holder we are authority for in the buckets it
        owns (each bucket replaced), then each holder's list of those buckets."""
        ch.queue.clear()
        ch.queue.append((BEGIN,))
        ch.synced = True
        theirs = self.owned_buckets(dest)
        for holder, held in self.authorities.items():
            listed = sorted(theirs.intersection(held.buckets))
            for b in listed:
                self._send_replace(dest, holder, b, held)
            ch.queue.append((SYNCED, holder, listed, self._view))
        self.stats["full_syncs"] += 1

    def next_deadline(self) -> float:
        """When `poll` next has work that waits for time (0: now)."""
        if self._ready or self._copy_asks:
            return 0.0
        t = self._timers[0][0] if self._timers else float("inf")
        if self._pending is not None:
            t = min(t, self._pending_at)
        return t

    def poll(self, now: float) -> list[tuple[str, tuple]]:
        """The requests to send now: batches on idle channels, copies, retries and digests due,
        and notices of stale copies."""
        self._now = now
        if self._pending is not None and now >= self._pending_at:
            self.set_members(self._pending, now)
        out: list[tuple[str, tuple]] = []
        if self.owned.stale:
            self._note_stale()
        for dest, notices in self._stale_out.items():
            if dest in self.members:
                out.append((dest, (STALE, notices, 1)))
                self.stats["stale_notices_sent"] += len(notices)
        self._stale_out = {}
        for source, buckets in self._copy_asks.items():
            for i in range(0, len(buckets), COPY_BUCKETS):
                out.append((source, (COPY, buckets[i:i + COPY_BUCKETS])))
        self._copy_asks = {}
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, what, arg = heapq.heappop(timers)
            if what == "retry":
                ch = self.channels.get(arg)
                if ch is not None and ch.inflight is not None and ch.retry_at and ch.retry_at <= now:
                    ch.retry_at = 0.0
                    out.append((arg, ch.inflight))
                    self.stats["retries"] += 1
            elif what == "digest":
                if arg in self.members:
                    ch = self._channel(arg)
                    if ch.queue or ch.inflight is not None:  # digests describe what was sent: wait
                        self._timer(now + self.s.retry_s, "digest", arg)
                        continue
                    # to an owner we share buckets with, or sent something since; now and then to
                    # every owner (what it copied from another may hold stale entries of ours)
                    if ch.synced and (ch.touched or self._shares(arg) or now >= ch.sweep_at):
                        self._queue_digest(arg, ch)
                        if now >= ch.sweep_at:
                            ch.sweep_at = now + SWEEP_ROUNDS * self.s.anti_entropy_s * (0.5 + self.rng.random())
                    elif not ch.synced and now >= ch.sweep_at:
                        ch.sweep_at = now + SWEEP_ROUNDS * self.s.anti_entropy_s * (0.5 + self.rng.random())
                        self._ready.add(arg)  # never synced: a full sync tells it we hold nothing there
                    self._timer(now + self.s.anti_entropy_s * (0.5 + self.rng.random()), "digest", arg)
            elif what == "tomb":
                holder, eid, version = arg
                held = self.authorities.get(holder)
                got = held.get(eid) if held is not None else None
                if got is not None and got[2] == TOMBSTONE and got[3] == version:  # not written since
                    self._remove(holder, eid)
                    self.stats["tombstones_expired"] += 1
            elif what == "stale":
                dest, notices, tries = arg
                if dest in self.members:
                    out.append((dest, (STALE, notices, tries)))
            elif what == "release":
                self._strays.discard(arg)
                if not self.ownership.is_owner(self.node_id, arg):
                    self.stats["entries_released"] += self.owned.drop_bucket(arg)
        for dest in list(self._ready):
            self._ready.discard(dest)
            ch = self.channels.get(dest)
            if ch is None or dest not in self.members or ch.inflight is not None:
                continue
            if not ch.synced:
                self._full_sync(dest, ch)
            if ch.queue:
                q, items, size, limit = ch.queue, [], 0, self.s.batch_items
                while q and size < limit:  # an ITEMS item counts its entries
                    item = q.popleft()
                    items.append(item)
                    size += len(item[3]) if item[0] == ITEMS else 1
                ch.seq += 1
                ch.inflight = (BATCH, self.epoch, ch.seq, items)
                out.append((dest, ch.inflight))
                self.stats["batches_sent"] += 1
        return out

    def _note_stale(self) -> None:
        """Owners' findings of older copies (`OwnedEntries.stale`): this node's own are dropped now,
        other holder-nodes' are sent them (engines hold blocks, never keys)."""
        found, self.owned.stale = self.owned.stale, []
        for holder, eid, version in found:
            if holder == self.node_id:
                self._stale_here(eid, version)
            elif holder in self.members:
                self._stale_out.setdefault(holder, []).append((eid, version))

    def _stale_here(self, eid: bytes, version: int) -> None:
        """An owner says `eid`'s newest version is `version`: an older copy here is dropped."""
        self.hlc.observe(version)
        mine = self.authorities[self.node_id].get(eid)
        if mine is None or mine[2] == TOMBSTONE or mine[3] >= version:
            return
        self.stats["stale_copies_dropped"] += 1
        if self.key_stale is not None:
            self.key_stale(eid)

    def _queue_digest(self, dest: str, ch: _Channel) -> None:
        theirs = self.owned_buckets(dest)
        touched, ch.touched = ch.touched, {}
        for holder, held in self.authorities.items():
            buckets = set(theirs.intersection(held.buckets))
            buckets.update(touched.get(holder, ()))
            listed = [(b, *held.digest(b)) for b in sorted(buckets)]
            ch.queue.append((DIGEST, holder, listed, self._view))
        self._ready.add(dest)
        self.stats["digests_sent"] += 1

    def busy(self) -> bool:
        """Whether anything is queued, unanswered or still filling (the simulation's quiet check)."""
        if self._copy_asks or self.filling or self._pending is not None or self._ready:
            return True
        return any(ch.queue or ch.inflight is not None for d, ch in self.channels.items() if d in self.members)

    # -- replies to our requests -----------------------------------------------------------
    def on_reply(self, dest: str, request: tuple, reply: tuple, now: float) -> None:
        kind = request[0]
        if kind == BATCH:
            ch = self.channels.get(dest)
            if ch is None or ch.inflight is not request:
                return  # the channel was reset meanwhile
            if reply[0] == "later":  # it does not know us yet (or has buried us): again, later
                ch.retry_at = now + self.s.retry_s
                self._timer(ch.retry_at, "retry", dest)
                return
            ch.inflight, ch.retry_at = None, 0.0
            if reply[0] == "resync":
                self.stats["resyncs_asked"] += 1
                ch.synced = False
            else:
                ch.acked = max(ch.acked, request[2])
                for holder, bucket in reply[1]:  # digests that differ: replace those buckets
                    held = self.authorities.get(holder)
                    if held is not None:
                        if bucket in held.buckets:
                            self._send_replace(dest, holder, bucket, held)
                        else:
                            ch.queue.append((CLEAR, holder, bucket))
                        self.stats["ae_repairs"] += 1
            if ch.queue or not ch.synced:
                self._ready.add(dest)
            else:
                self._unacked.discard(dest)
        elif kind == COPY:
            for bucket, entries in reply[1]:
                if bucket in self.filling:
                    self._fill(bucket, entries)
        elif kind == STALE:
            self.stats["stale_notices_answered"] += len(request[1])

    def on_failure(self, dest: str, request: tuple, now: float) -> None:
        if request[0] == BATCH:
            ch = self.channels.get(dest)
            if ch is not None and ch.inflight is request:
                ch.retry_at = now + self.s.retry_s
                self._timer(ch.retry_at, "retry", dest)
            self.stats["batch_failures"] += 1  # the link counts every failed message (message_failures)
        elif request[0] == COPY:
            # ask another current owner; when none is left, the holders' handoffs fill it
            for b in request[1]:
                if b not in self.filling:
                    continue
                source = next((o for o in self.ownership.owners(b) if o not in (self.node_id, dest)
                               and o in self.members), None)
                if source is None:
                    del self.filling[b]
                else:
                    self._copy_asks.setdefault(source, []).append(b)
            self.stats["copy_failures"] += 1
        elif request[0] == STALE:
            _, notices, tries = request
            if tries < STALE_TRIES and dest in self.members:
                self._timer(now + self.s.retry_s, "stale", (dest, notices, tries + 1))
            self.stats["stale_notice_failures"] += 1

    def _fill(self, bucket: int, entries: list) -> None:
        """An old owner's copy of a bucket we gained, taken for the holders not heard from since."""
        heard = self.filling.pop(bucket)
        for holder, kind, eid, shard, code, *version in entries:
            # not from holders that have spoken since, nor ourselves, nor nodes gone (the old owner
            # may not have applied their departure yet)
            if holder not in heard and holder != self.node_id and holder not in self.departed:
                self.owned.put(holder, kind, eid, shard, bucket, code, *version)
        self.stats["buckets_copied"] += 1

    # -- requests from peers ------------------------------------------------------------
    def handle(self, src: str, msg: tuple, now: float) -> tuple:
        self._now = now
        kind = msg[0]
        if kind == BATCH:
            return self._apply_batch(src, msg, now)
        if kind == LOOKUP:
            return ("r", [self._answer(item) for item in msg[1]])
        if kind == COPY:
            return ("r", [(b, [(h, *e) for h, e in self.owned.bucket_entries(b)]) for b in msg[1]])
        if kind == DUMP:
            return ("r", [(b, tuple(e)) for b, e in self.owned.entries_of(msg[1])])
        if kind == STALE:
            for eid, version in msg[1]:
                self._stale_here(eid, version)
            return ("ok", [])
        raise ValueError(f"unknown directory message {kind!r}")

    def _apply_batch(self, src: str, msg: tuple, now: float) -> tuple:
        _, epoch, seq, items = msg
        if src not in self.members:  # not (or no longer) a member in our view: nothing of it is kept
            return ("later",)
        known = self.inbound.get(src)
        if items and items[0][0] == BEGIN:
            pass  # a full sync starts: whatever came before from this holder-node is replaced
        elif known is None or known[0] != epoch:
            return ("resync",)  # we (or it) restarted: only a full sync can follow
        elif seq <= known[1]:
            return ("ok", [])  # a message sent again whose first answer was lost
        elif seq != known[1] + 1:
            return ("resync",)
        self.inbound[src] = (epoch, seq)
        owned, bucket_of, filling, needs = self.owned, self.bucket_of, self.filling, []
        mine = self.owned_buckets(self.node_id)
        members = self.members
        for item in items:
            op = item[0]
            if op in _HELD_OPS and item[1] != src and item[1] in members:
                # a node places its own values (and its engines'), never another node's: a peer
                # holding the secret cannot make a node appear to hold, or lose, anything
                self.stats["placements_refused"] += 1
                continue
            if op == PUT:
                _, holder, k, eid, shard, code, *version = item  # a key's version last
                b = bucket_of(shard)
                owned.put(holder, k, eid, shard, b, code, *version)
                if version:
                    self.hlc.observe(version[0])
                if k == KEY and self.key_changed is not None:
                    self.key_changed(eid)
                if b in filling:
                    filling[b].add(holder)
                elif b not in mine and b not in self._strays:  # the holder's view is ahead of ours,
                    self._strays.add(b)  # or behind: kept for a grace, then dropped unless ours by then
                    self._timer(now + self.s.handoff_grace_s, "release", b)
            elif op == ITEMS:
                _, holder, k, eids, shards, codes = item
                buckets = [bucket_of(shard) for shard in shards]
                owned.apply(holder, k, eids, shards, buckets, codes)
                if k == KEY and self.key_changed is not None:
                    for eid in eids:
                        self.key_changed(eid)
                for b in {b for b, code in zip(buckets, codes) if code is not None}:  # as PUT below
                    if b in filling:
                        filling[b].add(holder)
                    elif b not in mine and b not in self._strays:
                        self._strays.add(b)
                        self._timer(now + self.s.handoff_grace_s, "release", b)
            elif op == DEL:
                _, holder, k, eid, shard = item
                owned.remove(holder, k, eid, shard, bucket_of(shard))
                if k == KEY and self.key_changed is not None:
                    self.key_changed(eid)
            elif op == CLEAR:
                owned.drop_holder_in(item[1], item[2])
                if item[2] in filling:
                    filling[item[2]].add(item[1])
            elif op == SYNCED:
                _, holder, listed, view = item
                if view == self._view:  # we agree on who owns what: unlisted buckets are empty there
                    for b in owned.holder_buckets(holder).difference(listed):
                        if b in self.owned_buckets(self.node_id):
                            owned.drop_holder_in(holder, b)
                    for heard in filling.values():
                        heard.add(holder)
            elif op == BEGIN:
                pass
            elif op == DIGEST:
                _, holder, listed, view = item
                seen = set()
                for b, count, xor in listed:
                    seen.add(b)
                    if b in mine and owned.digest(holder, b) != (count, xor):  # not ours: released soon
                        needs.append((holder, b))
                if view == self._view:
                    needs += [(holder, b) for b in owned.holder_buckets(holder) - seen if b in mine]
        self.stats["batches_applied"] += 1
        if needs:
            self.stats["ae_mismatches"] += len(needs)
        return ("ok", needs)

    def _answer(self, item: tuple) -> tuple:
        """One LOOKUP item: (KEY, eid) -> ([(holder, code)], partial);
        (BLOCK, shard, parts) -> ([[(holder, code)] per part], partial)."""
        if item[0] == KEY:
            eid = item[1]
            b = self.bucket_of(key_shard(eid))
            return self.owned.key_holders(b, eid), self._partial(b)
        shard, parts = item[1], item[2]
        b = self.bucket_of(shard)
        return self.owned.segment(b, shard, parts), self._partial(b)

    def _partial(self, bucket: int) -> bool:
        """Whether an answer from this bucket may miss entries: still filling, not ours, or gained
        so recently (`handoff_grace_s`) that a holder may not know yet we own it, and placed a
        write with the old owners."""
        if bucket in self.filling or not self.ownership.is_owner(self.node_id, bucket):
            return True
        until = self.gained.get(bucket)
        if until is None:
            return False
        if self._now < until:
            return True
        del self.gained[bucket]
        return False

    # -- lookups ---------------------------------------------------------------------------
    def owners_to_ask(self, shard: bytes) -> list[str]:
        """The shard's owners in the order to ask them: this node first when it is one; during a
        handoff (`handoff_grace_s` after the view moved buckets) then its old owners still alive,
        which keep what they lost that long."""
        own = self.ownership
        b = own.bucket_of(shard)
        owners = list(own.owners(b))
        if self.node_id in owners:
            owners.remove(self.node_id)
            owners.insert(0, self.node_id)
        if self._now < self._handoff_until:
            owners += [o for o in own.previous_owners(b) if o not in owners and o in self.members]
        return owners

    def plan(self, items: list[tuple], asked: dict[int, set[str]] | None = None,
             now: float | None = None) -> LookupPlan:
        """Group LOOKUP items by the owner to ask; answer those this node owns (and is not
        filling) itself. `asked`: item -> owners already asked (a second round skips them)."""
        if now is not None:
            self._now = now
        plan = LookupPlan(items)
        for i, item in enumerate(items):
            shard = key_shard(item[1]) if item[0] == KEY else item[1]
            owners = [o for o in self.owners_to_ask(shard) if not asked or o not in asked.get(i, ())]
            if not owners:
                continue
            o = owners[0]
            if o == self.node_id:
                answer = self._answer(item)
                plan.local[i] = answer
                if not answer[1] or len(owners) == 1:
                    continue
                o = owners[1]  # our copy is still filling: the next owner too
            asks = plan.asks.setdefault(o, [])
            plan.route[i] = (o, len(asks))
            asks.append(item)
        return plan

    @staticmethod
    def key_item(eid: bytes) -> tuple:
        return (KEY, eid)

    def block_items(self, ctag: bytes, hashes: list[bytes]) -> list[tuple[tuple, int]]:
        """A prompt's blocks (from its first) as LOOKUP items, one per segment, each with the
        index of its first block."""
        g = self.s.group_blocks
        return [((BLOCK, block_shard(ctag, hashes[i]), list(hashes[i:i + g])), i)
                for i in range(0, len(hashes), g)]

    # -- figures ------------------------------------------------------------------------
    def info(self) -> dict[str, int]:
        return {
            "directory_view_members": len(self.members),  # the membership the directory applies
            "directory_view_pending": int(self._pending is not None),  # a newer one waits to settle
            "directory_entries_owned": self.owned.entries,
            "directory_buckets_owned": len(self.owned_buckets(self.node_id)) if self.ownership.members else 0,
            "directory_entries_held": sum(len(h) for h in self.authorities.values()),
            "directory_handoffs_in_flight": len(self.filling) + sum(
                1 for ch in self.channels.values() if ch.inflight is not None or ch.queue),
            "directory_buckets_filling": len(self.filling),
            **{f"directory_{k}": v for k, v in sorted(self.stats.items())},
        }
