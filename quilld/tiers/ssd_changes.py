"""Changes to copies on the SSD tier that a client waits for: deletions and new TTLs.

`DurableChanges` is mixed into `Tiering` (tiering.py) and keeps its state there. A copy
on SSD stops being wanted (`drop`: a DEL, UNLINK, FLUSHALL, overwrite, expiry or
eviction of its value) or its value's TTL changes (`retime`: EXPIRE, PEXPIRE, PERSIST,
GETEX, SET ... KEEPTTL of a value with a copy there). Either goes into the next group
commit: one WAL record (DEL and META operations) and one sync for everything that
arrived while the previous group was being written (`_flush_locked`). The keyspace
marks the change `unsynced`, and the handler answers only once `synced()` resolves, so
an acknowledged deletion or TTL never comes undone by a crash.

A value whose demotion write is in flight has no entry to drop or retime yet: the
batch's settling (demotion.py `_settle`) drops the copy it just made durable if the
value changed meanwhile, or retimes it if only its TTL did. `writing` and
`writing_inline` tell the keyspace that such a write exists, and `synced()` then waits
for that batch to settle first (batches settle in order), then for the group its
settling joined. The same holds for every metadata change that can be acknowledged
while the key's demotion is in flight (a TTL set, changed or removed, a rename, a
delete, an overwrite), for blocks and inline values alike.

After a group is durable its deleted copies are forgotten, their extents scrubbed
(head page zeroed) and only then reused (ssd.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

from quilld.tiers.block import Block
from quilld.tiers.ssd import SsdEntry
from quilld.tiers.ssd_format import SsdFailure
from quilld.tiers.wal import Unstorable, check_expire

log = logging.getLogger("quilld.ssd")


class DurableChanges:
    """Tiering methods for deletions and TTL changes of SSD copies (mixed into `Tiering`)."""

    def drop(self, entry: SsdEntry) -> None:
        """An SSD copy is no longer wanted: its DEL record joins the next group commit, then
        its space is scrubbed and freed. `synced()` says when that is durable."""
        self._doomed.append(entry)
        self._join_group()

    def retime(self, entry: SsdEntry, expire: int) -> None:
        """The value an SSD copy holds now expires at `expire` (unix ms, 0: never): a META
        record joins the next group commit. `synced()` says when that is durable. An expiry
        the tier cannot hold (wal.Unstorable) is refused alone, loudly: the copy keeps its
        old TTL on SSD, the group goes on without it."""
        try:
            check_expire(expire)
        except Unstorable as e:
            self.stats["ssd_unstorable"] += 1
            log.error("ssd tier: the new TTL of key %r is not logged, the SSD tier cannot hold it: %s (its copy "
                      "there keeps its old TTL)", entry.key[:64], e)
            return
        entry.expire = expire
        self._retimed[entry] = None
        self._join_group()

    def _join_group(self) -> None:
        if self._group is None:
            self._group = self._last_group = asyncio.get_running_loop().create_future()
        self._kick()

    def writing(self, block: Block) -> bool:
        """Whether `block` is being written to SSD right now (it is being released or its TTL
        changed: the batch's settling drops or retimes the copy, and `synced()` waits for that)."""
        return self._waits_for(self._writing.get(block))

    def writing_inline(self, fk: bytes) -> bool:
        """As `writing`, for the inline value of key `fk`."""
        return bool(self._writing) and self._waits_for(self._writing.get(fk))

    def _waits_for(self, batch: asyncio.Future | None) -> bool:
        if batch is None:
            return False
        # batches settle in order: waiting for the latest one a change touched waits for all
        if self._waits_batch is None or self._waits_batch.done() or self._later(batch, self._waits_batch):
            self._waits_batch = batch
        return True

    def _later(self, a: asyncio.Future, b: asyncio.Future) -> bool:
        """Whether batch `a` was started after batch `b` (both in flight)."""
        order = list(dict.fromkeys(self._writing.values()))
        return b not in order or (a in order and order.index(a) > order.index(b))

    def synced(self) -> Awaitable[None] | None:
        """What makes every deletion and TTL change requested so far durable; None when
        nothing is left to wait for. Raises (when awaited) if one could not be made durable."""
        batch, self._waits_batch = self._waits_batch, None
        group = self._last_group
        if batch is None and (group is None or (group.done() and not group.cancelled()
                                                and group.exception() is None)):
            return None
        return self._wait_synced(batch, group)

    async def _wait_synced(self, batch: asyncio.Future | None, group: asyncio.Future | None) -> None:
        if batch is not None:
            await asyncio.shield(batch)
            group = self._last_group  # the group the batch's settling joined (groups resolve in order)
        if group is not None:
            await asyncio.shield(group)

    def _kick(self) -> None:
        if self._deleting is None or self._deleting.done():
            self._deleting = asyncio.ensure_future(self._delete_soon())

    def _reap(self) -> None:
        """Scrub and reclaim what the SSD tier freed (replaced or unpinned versions), soon."""
        if self.ssd.has_freed:
            self._kick()

    async def _delete_soon(self) -> None:
        await asyncio.sleep(0)  # gather a burst of changes into one WAL sync
        await self._flush_deletes()

    async def _flush_deletes(self) -> None:
        async with self._flush_lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        """Log every queued deletion and TTL change (one group, one WAL sync), answer its
        waiters, then scrub and reclaim the freed extents; repeat while more arrived meanwhile."""
        while self._doomed or self._retimed or self.ssd.has_freed:
            batch, self._doomed = self._doomed[:], []
            retimed, self._retimed = [e for e in self._retimed if not e.retired], {}
            group, self._group = self._group, None
            error = None
            if batch or retimed:
                self._logging = len(batch)
                try:
                    error = await self._log(batch, retimed)
                finally:
                    self._logging = 0
                for entry in batch:
                    self.ssd.forget(entry)
                self.stats["ssd_deletes"] += len(batch)
                self.stats["ssd_retimes"] += len(retimed)
                self.stats["delete_syncs"] += 1
            if group is not None and not group.done():
                if error is None:
                    group.set_result(None)
                else:
                    group.set_exception(error)
                    group.exception()  # retrieved here: a group nobody awaits logs nothing
            freed = self.ssd.take_freed()
            if freed and self.active:
                try:
                    await self._run(self.ssd.scrub, freed)
                except SsdFailure as e:
                    self._failed(e)
                    continue  # a failed tier is never written again: its space stays taken
                self.ssd.reclaim(freed)
                self.stats["ssd_scrubbed"] += len(freed)

    async def _log(self, batch: list[SsdEntry], retimed: list[SsdEntry]) -> SsdFailure | None:
        """Make the deletion of `batch` and the new TTLs of `retimed` durable: DEL and META
        records, or on a failed tier its fence (a restart then trusts nothing on it: no copy
        comes back, with any TTL). Returns the error when neither is possible."""
        if self.active:
            try:
                await self._run(self.ssd.log_changes, batch, retimed)
                return None
            except SsdFailure as e:
                self._failed(e)
        if self.ssd.fenced:
            return None
        try:
            await self._run(self.ssd.fence)
        except OSError as e:
            log.error("ssd tier: cannot fence the failed tier, deletions of SSD copies are not durable: %s", e)
            return SsdFailure(f"ssd tier failed ({self.ssd.failed}); the deletion of its copy is not durable")
        log.warning("ssd tier: fenced (failed, and deletions can no longer be logged): a restart starts it empty")
        return None
