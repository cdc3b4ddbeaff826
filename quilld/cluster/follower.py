"""Follows one peer's replication log into the directory.

A loop per live peer: long-poll `REPLOG SINCE epoch seq COUNT n WAIT ms`
and apply what comes back. A new follower, one that fell behind the peer's
retained log, or one that sees a new epoch (the peer restarted) loads a
snapshot first: it forgets everything known of the peer, applies the
snapshot, and follows from the snapshot's sequence number. A peer that
cannot be reached is retried with a bounded backoff until it is declared
dead, when the cluster stops the follower and forgets the peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import hiredis

from quilld.cluster.directory import Directory
from quilld.cluster.peer_client import PeerConnection, PeerError
from quilld.cluster.replog import from_wire

log = logging.getLogger("quilld.cluster")

BATCH = 5000  # entries per REPLOG call
WAIT_MS = 1000  # how long the peer holds a REPLOG call open when nothing is new
RETRY_MIN, RETRY_MAX = 0.05, 1.0  # backoff between failed attempts, seconds
STOP_WAIT = 5.0  # seconds stop() waits for the follow loop to end


class Follower:
    def __init__(self, peer: str, host: str, port: int, directory: Directory, hello: tuple[tuple, ...]) -> None:
        self.peer = peer
        self.host, self.port = host, port
        self.directory = directory
        self.hello = hello
        self.epoch: str | None = None
        self.seq = 0
        self.stats: Counter[str] = Counter()
        self.last_applied = 0.0  # monotonic time of the last successful call
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"follow-{self.peer}")

    async def stop(self) -> None:
        """End the follow loop. Python 3.11's wait_for can lose a cancellation that races with
        its inner call finishing (a REPLOG reply arriving as the node stops), so the loop is
        also told by a flag, the cancel is repeated, and the wait is bounded."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        deadline = time.monotonic() + STOP_WAIT
        while not task.done() and time.monotonic() < deadline:
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if not task.done():
            log.warning("following %s: the follow loop did not end within %.0f s", self.peer, STOP_WAIT)

    async def _run(self) -> None:
        conn = PeerConnection(self.host, self.port, self.hello)
        delay = RETRY_MIN
        try:
            while not self._stopping:
                try:
                    if self.epoch is None:
                        await self._resync(conn)
                    await self._follow(conn)
                    delay = RETRY_MIN
                except PeerError as e:
                    self.stats["errors"] += 1
                    log.debug("following %s: %s", self.peer, e.message)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX, delay * 2)
                except (ValueError, TypeError, UnicodeDecodeError) as e:
                    self.stats["malformed"] += 1
                    log.warning("following %s: malformed log reply (%s); resyncing", self.peer, e)
                    self.epoch = None
                    conn.close()
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX, delay * 2)
        finally:
            conn.close()

    async def _resync(self, conn: PeerConnection) -> None:
        reply = await conn.call("REPLOG", "SNAPSHOT", timeout=60.0)
        if isinstance(reply, hiredis.ReplyError):
            raise PeerError(f"REPLOG SNAPSHOT refused: {reply}")
        epoch, seq, items = reply
        entries = [from_wire(i) for i in items]
        self.directory.forget(self.peer)
        self.directory.apply(self.peer, entries)
        self.epoch, self.seq = epoch.decode(), seq
        self.stats["resyncs"] += 1
        self.last_applied = time.monotonic()

    async def _follow(self, conn: PeerConnection) -> None:
        while True:
            reply = await conn.call("REPLOG", "SINCE", self.epoch, self.seq, "COUNT", BATCH,
                                    "WAIT", WAIT_MS, timeout=WAIT_MS / 1000 + 10)
            if isinstance(reply, hiredis.ReplyError):
                if str(reply).startswith("BEHIND"):
                    self.epoch = None
                    return
                raise PeerError(f"REPLOG refused: {reply}")
            _, seq, items = reply
            entries = [from_wire(i) for i in items]
            if entries:
                self.directory.apply(self.peer, entries)
                self.seq = entries[-1].seq
            self.last_applied = time.monotonic()
