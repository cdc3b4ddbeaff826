"""An asyncio subscriber to one vLLM engine's ZMQ KV-event publisher.

vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) publishes on a PUB socket
`(topic, seq, payload)`, its sequence numbers counting from 0 in each process, and, when
`replay_endpoint` is configured, serves a ROUTER socket: a request `[b"", start_seq
(8 bytes big-endian)]` from a DEALER is answered with one message per buffered batch with
`seq >= start_seq` (`[b"", seq, payload]`, 0.33 puts the topic before `seq`), then the end
marker (`seq` -1, empty payload). vLLM keeps `buffer_steps` (10 000) past batches.

This module is the IO shell around `quilld.index.events`. What it guarantees:

- **Catch-up after any start or (re)connect.** Each time the SUB socket connects (the
  first time, and after the publisher went away and came back), it asks the replay socket
  for everything from the last batch it applied (from 0 the first time), checks that the
  publisher still has that batch with the same bytes, and applies the rest. Batches that
  already left vLLM's buffer are counted as missed; if residencies were known, they are
  dropped (`on_reset`), because a removal among the lost batches cannot be undone.
- **Gaps**: a batch beyond the next expected sequence number is a gap: filled from the
  replay socket the same way, or else the engine's residencies are dropped and it says so.
- **Publisher restarts are never missed**: a restarted publisher counts from 0 again.
  A batch whose sequence number goes backwards with a newer timestamp (or different bytes
  than the batch we applied under that number), a replay that shows the publisher's
  newest batch older than ours, or a replay whose batch under our last number differs,
  all mean a new process: the engine's residencies are dropped and it is caught up from 0.
- **Bad input never costs good input**: a bad event is skipped by the decoder and the rest
  of its batch applies; a batch whose payload is broken still counts as that sequence
  number (so it is never mistaken for a gap).
- **A restarted quilld resumes where it stood**: with a persistent residency index, the
  subscriber starts from the cursor committed beside the residencies (`resume`: the last batch
  applied in full, its digest and timestamp), so the catch-up above asks the replay from that
  batch, checks its digest, and applies only what came after; `on_applied` reports each batch
  once it is applied in full, for the next commit. A catch-up that fails is tried again (by
  `housekeeping`) instead of waiting for the next batch.
- **Ingest never stalls the node**: the SUB socket is read with non-blocking receives, in
  slices of at most `SLICE_S` seconds, and a batch bigger than `SLICE_WORK` block hashes is
  applied in parts, yielding to the event loop in between, so ROUTE and the rest of the
  node wait at most one slice. (pyzmq's asyncio sockets cost a future and a loop turn per
  message; a message already queued is taken here without either.)

Counters, the last sequence number and the feed's state go to a `FeedStats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import NamedTuple

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from quilld.index.engines import FeedStats
from quilld.index.events import (
    Batch,
    Cleared,
    Event,
    MalformedEvent,
    decode_frames,
    is_replay_end,
)

log = logging.getLogger(__name__)

# A replay is abandoned (and treated as failed) when the replay socket sends nothing for this
# long, or when it has not ended after REPLAY_MAX_S (a restarted quilld may catch up on thousands
# of batches: on a busy machine that takes longer than one silence).
REPLAY_TIMEOUT_S = 2.0
REPLAY_MAX_S = 30.0
# vLLM's publisher keeps `buffer_steps` = 10 000 batches; a longer gap cannot be replayed.
MAX_REPLAY_BATCHES = 10_000
# stop() waits this long for the receive task to finish after cancelling it.
STOP_TIMEOUT_S = 1.0
# Ingest yields to the event loop after this long, so a ROUTE waits at most about this much
# (1 ms gave ROUTE p50 1.3-1.4 ms during ingest in bench/events_bench.py, 0.5 ms 0.75-0.95 ms).
SLICE_S = 0.0005
# A batch with more block hashes than this is applied in parts, one per slice.
SLICE_WORK = 1024
# vLLM's PUB high-water mark is 100 000 messages; the SUB side queues as many while a replay runs.
RCVHWM = 100_000
# Digests of this many recently applied batches tell a duplicate from a restarted publisher.
RECENT = 256
# After this long without a message, the replay socket is asked once whether anything was
# published since: a PUB drop of the last batches is only seen when a later batch arrives.
TAIL_PROBE_S = 1.0
# A repeated warning (malformed input) is logged at most once per this many seconds.
LOG_EVERY_S = 10.0

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
_NOBLOCK = int(zmq.NOBLOCK)
_FIRST = itemgetter(0)  # an event's block hashes
_monitor_ids = itertools.count()

# (engine id, events) -> events applied
ApplyFn = Callable[[str, Sequence[Event]], int]
# (engine id, reason, batches missing) -> residencies dropped
ResetFn = Callable[[str, str, int], int]


class Cursor(NamedTuple):
    """Where an engine's feed stands: the last batch applied in full, its payload's digest and
    timestamp. Persisted beside the residencies it produced (persistent.py), it is where a
    restarted quilld resumes: the replay is asked from `seq`, and the batch it gives under `seq`
    must have `digest`, or the publisher is a new process."""

    seq: int
    digest: int
    ts: float


# (engine id, cursor): a batch was applied in full
AppliedFn = Callable[[str, Cursor], None]


def _ignore_applied(engine_id: str, cursor: Cursor) -> None:
    """No one keeps the cursor (the default)."""


class ReplayFailed(Exception):
    """The replay socket did not answer, or not with a contiguous run of batches."""


class Replayed(NamedTuple):
    seq: int
    digest: int
    batch: Batch


def digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One multipart message without blocking (raises zmq.Again when none is queued).

    Frames are taken with `copy=False` and their `more` flag, not `recv_multipart`, whose
    RCVMORE option read per frame cost about half of a small message's receive time.
    """
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


class KvEventSubscriber:
    """Follows one engine's KV-event stream and applies its events in sequence order.

    `apply(engine_id, events)` is called in order, possibly several times per batch (a big
    batch is applied in parts). `on_reset(engine_id, reason, missing)` is called when
    what was applied can no longer be vouched for: events were lost (`missing` batches,
    0 when unknown) or the publisher restarted; the caller forgets that engine's residencies.
    """

    def __init__(
        self,
        engine_id: str,
        endpoint: str,
        apply: ApplyFn,
        on_reset: ResetFn,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        ctx: zmq.Context | None = None,
        stats: FeedStats | None = None,
        resume: Cursor | None = None,
        on_applied: AppliedFn = _ignore_applied,
    ) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._apply = apply
        self._on_reset = on_reset
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context.instance()
        self.stats = stats if stats is not None else FeedStats()
        self._next = 0  # the sequence number expected next
        self._known = False  # whether anything was applied since the last reset
        self._last_ts = float("-inf")  # the timestamp of the newest batch applied
        self._recent: dict[int, int] = {}  # seq -> payload digest of recently applied batches
        self.connected = False
        self._reconnects = 0  # CONNECTED events (and tail probes) not yet answered by a catch-up
        self._probed = False  # the replay socket was asked since the last message arrived
        self._catch_up_failed: float | None = None  # when the last catch-up failed (retried by housekeeping)
        self._sub: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._logged: dict[str, float] = {}
        self._on_applied = on_applied
        if resume is not None:  # a restarted quilld: what was applied before is still in the index
            self._next, self._known, self._last_ts = resume.seq + 1, True, resume.ts
            self._recent[resume.seq] = resume.digest
            self.stats.last_seq = resume.seq

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"subscriber for engine {self.engine_id!r} already started")
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        address = f"inproc://quilld-kv-monitor-{next(_monitor_ids)}"
        sub.monitor(address, _MONITOR_EVENTS)
        monitor = self._socket(zmq.PAIR)
        monitor.connect(address)
        sub.connect(self.endpoint)
        self._sub, self._monitor = sub, monitor
        loop = asyncio.get_running_loop()
        for sock in (sub, monitor):
            loop.add_reader(sock.getsockopt(zmq.FD), self._wake.set)
        self.stats.state = "connecting"
        self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.engine_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, STOP_TIMEOUT_S)
        sub, monitor, self._sub, self._monitor = self._sub, self._monitor, None, None
        loop = asyncio.get_running_loop()
        for sock in (sub, monitor):
            if sock is not None and not sock.closed:
                loop.remove_reader(sock.getsockopt(zmq.FD))
        if sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            sub.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _socket(self, kind: int) -> zmq.Socket:
        # Plain (synchronous) sockets, read without blocking; the event loop watches their FDs.
        sock = self._ctx.socket(kind, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def housekeeping(self, now: float, idle_warning_s: float) -> None:
        """Called periodically: probe the replay socket once per quiet spell, try a failed catch-up
        again, warn about silence."""
        stats = self.stats
        failed = self._catch_up_failed
        if failed is not None and self.connected and now - failed >= TAIL_PROBE_S:
            self._catch_up_failed = None
            self._reconnects += 1  # a catch-up, as after a reconnect
            self._wake.set()
        if (not self._probed and self.replay_endpoint is not None and self.connected
                and stats.last_heard is not None and now - stats.last_heard >= TAIL_PROBE_S):
            self._probed = True
            self._reconnects += 1  # a catch-up, as after a reconnect
            self._wake.set()
        if idle_warning_s > 0:
            self.check_idle(now, idle_warning_s)

    def check_idle(self, now: float, threshold: float) -> bool:
        """Warn once per silence when nothing arrived for `threshold` seconds; True if it warned."""
        stats = self.stats
        if stats.idle_warned or stats.idle_s(now) < threshold:
            return False
        stats.idle_warned = True
        heard = "nothing yet" if stats.last_heard is None else f"nothing for {stats.idle_s(now):.0f} s"
        link = "connected" if self.connected else "not connected"
        log.warning("engine %s: KV-event subscription to %s (%s) has received %s. vLLM binds its PUB socket only "
                    "when its endpoint contains '*' (tcp://*:5557) and connects otherwise: with a host in vLLM's "
                    "endpoint nothing reaches quilld", self.engine_id, self.endpoint, link, heard)
        return True

    # ------------------------------------------------------------ receive loop

    async def _run(self) -> None:
        sub, monitor = self._sub, self._monitor
        assert sub is not None and monitor is not None
        while True:
            self._wake.clear()
            self._read_monitor(monitor)
            if self._reconnects:
                self._reconnects = 0
                await self._guarded(self._catch_up())
                continue
            if not sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                # Idle waits here are bounded by stop(), which cancels this task.
                await self._wake.wait()
                continue
            await self._drain(sub)

    async def _drain(self, sub: zmq.Socket) -> None:
        """Take what the SUB socket holds for at most one slice, then let the loop run."""
        clock = time.perf_counter
        deadline = clock() + SLICE_S
        took = 0
        while True:
            try:
                frames = recv_frames(sub)
            except zmq.Again:
                break
            took += 1
            try:
                work = self._take(frames)
            except Exception:  # a bug downstream must not silently end the stream
                self.stats.add("errors")
                log.exception("KV-event subscriber %s: error handling a message", self.engine_id)
                continue
            if work is not None:
                await self._guarded(work)
                deadline = clock() + SLICE_S
            if clock() > deadline:
                break
        if took:
            self.stats.last_heard = time.monotonic()
            self.stats.idle_warned = self._probed = False
        await asyncio.sleep(0)

    async def _guarded(self, work) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug downstream must not silently end the stream
            self.stats.add("errors")
            log.exception("KV-event subscriber %s: error handling a message", self.engine_id)

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self._reconnects += 1
                self.stats.state = "live"
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.stats.state = "disconnected"

    # ------------------------------------------------------------ one message

    def _take(self, frames: list[bytes]):
        """Handle one PUB message; returns a coroutine when it needs more than the fast path."""
        try:
            batch = decode_frames(frames)
        except MalformedEvent as e:  # no readable sequence number: counted, nothing else
            self.stats.add("malformed")
            self._warn("malformed", "engine %s: %s", self.engine_id, e.message)
            return None
        seq = batch.seq
        if seq == self._next:
            return self._deliver(batch, digest(frames[-1]))
        if seq > self._next:
            return self._fill_gap(batch, digest(frames[-1]))
        return self._behind(batch, digest(frames[-1]))

    def _deliver(self, batch: Batch, payload_digest: int):
        """Apply a batch that is next in sequence (a coroutine when it is big)."""
        assert batch.seq is not None
        stats = self.stats
        if batch.malformed:
            stats.add("malformed", batch.malformed)
            self._warn("malformed", "engine %s: seq %d: skipped %d bad event(s): %s", self.engine_id, batch.seq,
                       batch.malformed, "; ".join(batch.problems))
        self._next = batch.seq + 1
        self._known = True
        if batch.ts > self._last_ts:
            self._last_ts = batch.ts
        recent = self._recent
        recent[batch.seq] = payload_digest
        if len(recent) > RECENT:
            del recent[next(iter(recent))]
        stats.add("batches")
        stats.last_seq = batch.seq
        events = batch.events
        try:  # Stored and Removed are tuples with their hashes first: counted in C
            work = sum(map(len, map(_FIRST, events)))
        except TypeError:  # an AllBlocksCleared among them
            work = sum(1 if type(e) is Cleared else len(e.block_hashes) for e in events)
        cursor = Cursor(batch.seq, payload_digest, batch.ts)
        if work > SLICE_WORK:
            return self._apply_in_parts(events, cursor)
        stats.add("events", self._apply(self.engine_id, events))
        self._on_applied(self.engine_id, cursor)
        return None

    async def _apply_in_parts(self, events: Sequence[Event], cursor: Cursor) -> None:
        part: list[Event] = []
        size = 0
        for ev in events:
            hashes = () if type(ev) is Cleared else ev.block_hashes
            while len(hashes) > SLICE_WORK:  # one event bigger than a slice: its hashes in pieces
                if part:
                    await self._apply_part(part)
                    part, size = [], 0
                await self._apply_part([ev._replace(block_hashes=hashes[:SLICE_WORK])])
                hashes = hashes[SLICE_WORK:]
                ev = ev._replace(block_hashes=hashes)
            part.append(ev)
            size += len(hashes) + 1
            if size >= SLICE_WORK:
                await self._apply_part(part)
                part, size = [], 0
        if part:
            await self._apply_part(part)
        if self._next == cursor.seq + 1:  # no reset meanwhile: the batch is applied in full
            self._on_applied(self.engine_id, cursor)

    async def _apply_part(self, events: list[Event]) -> None:
        self.stats.add("events", self._apply(self.engine_id, events))
        await asyncio.sleep(0)

    async def _apply_all(self, batches: list[Replayed]) -> None:
        """Apply replayed batches in order, one slice at a time."""
        clock = time.perf_counter
        deadline = clock() + SLICE_S
        for r in batches:
            if r.seq != self._next:
                continue  # already applied, or older than a reset
            work = self._deliver(r.batch, r.digest)
            if work is not None:
                await work
            if clock() > deadline:
                await asyncio.sleep(0)
                deadline = clock() + SLICE_S

    # ------------------------------------------------------------ out of order

    async def _fill_gap(self, batch: Batch, payload_digest: int) -> None:
        """`batch` is beyond the next expected one: replay what is missing, or drop and say so."""
        assert batch.seq is not None
        stats = self.stats
        stats.add("gaps")
        first = self._next
        missing = batch.seq - first
        if self.replay_endpoint is not None and missing <= MAX_REPLAY_BATCHES:
            try:
                got = await self._replay(first - 1 if self._known else first)
            except ReplayFailed as e:
                log.warning("engine %s: replay of seq %d..%d failed: %s", self.engine_id, first, batch.seq - 1, e)
            else:
                if await self._follow(got, "gap"):
                    if batch.seq < self._next:
                        return  # the replay brought it too
                    if batch.seq == self._next:  # the replay ended just before it
                        await self._run_work(self._deliver(batch, payload_digest))
                        return
        missing = batch.seq - self._next
        stats.add("missed", missing)
        self._reset("gap", missing)
        self._next = batch.seq
        await self._run_work(self._deliver(batch, payload_digest))

    async def _behind(self, batch: Batch, payload_digest: int) -> None:
        """`batch` is older than the next expected one: a duplicate, or a restarted publisher."""
        assert batch.seq is not None
        seen = self._recent.get(batch.seq)
        if seen is None:
            # Older than the digests kept: a batch from before the newest one applied is a late
            # duplicate; one stamped after it comes from a new process counting from 0 again.
            restarted = batch.ts > self._last_ts and not (batch.malformed and not batch.events)
        else:
            restarted = seen != payload_digest
        if not restarted:
            self.stats.add("duplicates")
            return
        await self._restart(f"sequence went back from {self._next - 1} to {batch.seq}", batch, payload_digest)

    async def _restart(self, why: str, batch: Batch | None = None, payload_digest: int = 0) -> None:
        """The publisher is a new process: forget everything, then catch up from its first batch."""
        self.stats.add("restarts")
        log.warning("engine %s: KV-event publisher restarted (%s)", self.engine_id, why)
        self._reset("restart", 0)
        self._next, self._recent, self._last_ts = 0, {}, float("-inf")
        if self.replay_endpoint is not None:
            try:
                got = await self._replay(0)
            except ReplayFailed as e:
                log.warning("engine %s: replay after the restart failed: %s", self.engine_id, e)
            else:
                await self._follow(got, "restart")
        if batch is not None and batch.seq is not None and batch.seq >= self._next:
            if batch.seq > self._next:
                self.stats.add("missed", batch.seq - self._next)
                self._next = batch.seq
            await self._run_work(self._deliver(batch, payload_digest))

    async def _catch_up(self) -> None:
        """After a (re)connect: ask the replay socket for what happened since the last batch applied."""
        if self.replay_endpoint is None:
            return
        self.stats.state = "catching_up"
        try:
            start = self._next - 1 if self._known else self._next
            try:
                got = await self._replay(start)
            except ReplayFailed as e:
                log.warning("engine %s: catch-up from seq %d after connecting failed: %s; trying again in %.0f s",
                            self.engine_id, start, e, TAIL_PROBE_S)
                self._catch_up_failed = time.monotonic()
                return
            self._catch_up_failed = None
            if self._known and not got:
                await self._restart(f"its newest batch is older than seq {start}")
            else:
                await self._follow(got, "catch-up")
        finally:
            self.stats.state = "live" if self.connected else "disconnected"

    async def _follow(self, got: list[Replayed], why: str) -> bool:
        """Apply a replay that began at our last batch (when one is known) or at the next one.

        Returns False when it cannot be used (nothing at or after the next batch).
        """
        first = self._next
        if self._known and got and got[0].seq == first - 1:
            if got[0].digest != self._recent.get(got[0].seq, got[0].digest):
                await self._restart(f"its batch {got[0].seq} differs from the one applied")
                return True
            got = got[1:]
        if not got:
            return why != "gap"
        if got[0].seq > first:  # the first batches we need already left the publisher's buffer
            lost = got[0].seq - first
            self.stats.add("missed", lost)
            self._reset("beyond_buffer", lost)
            self._next = got[0].seq
        elif got[0].seq < first:
            got = [r for r in got if r.seq >= first]
        self.stats.add("replays")
        await self._apply_all(got)
        return True

    def _reset(self, reason: str, missing: int) -> None:
        """Forget what was applied (`reason`: gap, beyond_buffer or restart)."""
        if self._known:
            self._on_reset(self.engine_id, reason, missing)
        elif missing:
            log.warning("engine %s: %d KV-event batch(es) published before quilld followed it are beyond reach; "
                        "blocks they stored are unknown until stored again", self.engine_id, missing)
        self._known = False

    @staticmethod
    async def _run_work(work) -> None:
        if work is not None:
            await work

    # ------------------------------------------------------------ replay

    async def _replay(self, start: int) -> list[Replayed]:
        """Every batch the replay socket holds from `start` on, in order (raises ReplayFailed)."""
        if self.replay_endpoint is None:
            raise ReplayFailed("no replay endpoint")
        try:
            return await asyncio.wait_for(self._request(start), REPLAY_MAX_S)
        except TimeoutError:
            raise ReplayFailed(f"no end marker within {REPLAY_MAX_S} s") from None
        except (MalformedEvent, zmq.ZMQError) as e:
            raise ReplayFailed(str(e) or type(e).__name__) from None

    async def _request(self, start: int) -> list[Replayed]:
        # A fresh DEALER per replay: late replies to an abandoned request die with it.
        dealer = self._socket(zmq.DEALER)
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        fd = dealer.getsockopt(zmq.FD)
        loop.add_reader(fd, ready.set)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: list[Replayed] = []
            deadline = time.perf_counter() + SLICE_S
            while True:
                try:
                    frames = recv_frames(dealer)
                except zmq.Again:
                    ready.clear()
                    if not dealer.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        try:
                            await asyncio.wait_for(ready.wait(), REPLAY_TIMEOUT_S)
                        except TimeoutError:
                            raise ReplayFailed(f"nothing from the replay socket for {REPLAY_TIMEOUT_S} s "
                                               f"({len(got)} batches received)") from None
                    continue
                if frames and len(frames[0]) == 0:
                    frames = frames[1:]  # the ROUTER's empty delimiter
                if is_replay_end(frames[-2:]):
                    return got
                batch = decode_frames(frames)
                assert batch.seq is not None
                want = got[-1].seq + 1 if got else None
                if want is not None and batch.seq != want:
                    raise ReplayFailed(f"expected seq {want}, got {batch.seq}")
                if not got and batch.seq < start:
                    raise ReplayFailed(f"asked from seq {start}, got {batch.seq}")
                got.append(Replayed(batch.seq, digest(frames[-1]), batch))
                if len(got) > MAX_REPLAY_BATCHES + 1:
                    raise ReplayFailed(f"more than {MAX_REPLAY_BATCHES} batches")
                if time.perf_counter() > deadline:
                    await asyncio.sleep(0)
                    deadline = time.perf_counter() + SLICE_S
        finally:
            loop.remove_reader(fd)
            dealer.close(linger=0)

    # ------------------------------------------------------------ logging

    def _warn(self, key: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[key] = now
            log.warning(msg, *args)
