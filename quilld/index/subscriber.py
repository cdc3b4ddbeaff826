"""An asyncio subscriber to one vLLM engine's ZMQ KV-event publisher.

vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) publishes on a PUB socket
`(topic, seq, payload)` and, when `replay_endpoint` is configured, serves a ROUTER
socket: a request `[b"", start_seq (8 bytes big-endian)]` from a DEALER (the ROUTER
sees `[client_id, b"", start_seq]`) is answered with one `[b"", seq, payload]` per
buffered batch with `seq >= start_seq`, then `[b"", END_SEQ, b""]`. vLLM only keeps a
bounded buffer of past batches (`buffer_steps`, 10 000 by default).

This module is the IO shell around `quilld.index.events`: it decodes with
`decode_frames`, orders with `SequenceTracker`, and hands whole batches to `apply`.
On a gap it replays when it can; otherwise it calls `on_gap` so the caller clears the
engine's residency (the index must never keep a state it can no longer vouch for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from quilld.index.events import Batch, MalformedEvent, SequenceTracker, decode_frames, is_replay_end

log = logging.getLogger(__name__)

# A replay is abandoned (and the gap reported) after this long, end marker or not.
REPLAY_TIMEOUT_S = 2.0
# vLLM's publisher keeps `buffer_steps` = 10 000 batches; a longer gap cannot be replayed.
MAX_REPLAY_BATCHES = 10_000
# stop() waits this long for the receive task to finish after cancelling it.
STOP_TIMEOUT_S = 1.0

STAT_NAMES = ("batches", "events", "malformed", "gaps", "missed", "replays", "duplicates", "restarts", "errors")


class ReplayFailed(Exception):
    """The replay socket did not deliver exactly the missing batches."""


class KvEventSubscriber:
    """Follows one engine's KV-event stream and applies its batches in order.

    `apply(engine_id, batch)` is called once per batch, in sequence order.
    `on_gap(engine_id, missing)` is called when batches were lost and could not be
    replayed (`missing` > 0), or when the engine restarted its counter (`missing` 0);
    either way the caller should forget what it knew about that engine.
    """

    def __init__(
        self,
        engine_id: str,
        endpoint: str,
        apply: Callable[[str, Batch], None],
        on_gap: Callable[[str, int], None],
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._apply = apply
        self._on_gap = on_gap
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context.instance()
        self._tracker = SequenceTracker()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"subscriber for engine {self.engine_id!r} already started")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.engine_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, STOP_TIMEOUT_S)
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.close(linger=0)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ------------------------------------------------------------ receive loop

    async def _run(self) -> None:
        assert self._sub is not None
        sub = self._sub
        while True:
            # Idle waits here are bounded by stop(), which cancels this task.
            frames = await sub.recv_multipart()
            try:
                await self._handle(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug downstream must not silently end the stream
                self.stats["errors"] += 1
                log.exception("KV-event subscriber %s: error handling a message", self.engine_id)

    async def _handle(self, frames: list[bytes]) -> None:
        try:
            batch = decode_frames(frames)
        except MalformedEvent as e:
            self.stats["malformed"] += 1
            log.warning("engine %s: %s", self.engine_id, e)
            return
        assert batch.seq is not None
        if batch.malformed:
            self.stats["malformed"] += batch.malformed
            log.warning("engine %s: seq %d: %s", self.engine_id, batch.seq, "; ".join(batch.problems))
        last = self._tracker.last
        skipped = self._tracker.observe(batch.seq)
        if skipped < 0:
            if batch.seq == 0 and last is not None and last > 0:
                # vLLM restarts its counter at 0 with a new process: what we knew is stale.
                self.stats["restarts"] += 1
                self._tracker.reset()
                self._tracker.observe(0)
                self._call_on_gap(0)
                self._deliver(batch)
            else:
                self.stats["duplicates"] += 1
            return
        if skipped > 0:
            assert last is not None
            self.stats["gaps"] += 1
            self.stats["missed"] += skipped
            replayed = await self._try_replay(last + 1, batch.seq)
            if replayed is None:
                self._call_on_gap(skipped)
            else:
                for old in replayed:
                    self._deliver(old)
        self._deliver(batch)

    def _deliver(self, batch: Batch) -> None:
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        self._apply(self.engine_id, batch)

    def _call_on_gap(self, missing: int) -> None:
        self._on_gap(self.engine_id, missing)

    # ------------------------------------------------------------ replay

    async def _try_replay(self, first: int, stop: int) -> list[Batch] | None:
        """The batches `first .. stop-1` from the replay socket, or None if it cannot."""
        if self.replay_endpoint is None or stop - first > MAX_REPLAY_BATCHES:
            return None
        try:
            batches = await asyncio.wait_for(self._replay(first, stop), REPLAY_TIMEOUT_S)
        except (ReplayFailed, MalformedEvent, asyncio.TimeoutError, zmq.ZMQError) as e:
            why = str(e) or type(e).__name__
            log.warning("engine %s: replay of seq %d..%d failed: %s", self.engine_id, first, stop - 1, why)
            return None
        self.stats["replays"] += 1
        return batches

    async def _replay(self, first: int, stop: int) -> list[Batch]:
        # A fresh DEALER per replay: late replies to an abandoned request die with it.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", first.to_bytes(8, "big")])
            got: list[Batch] = []
            while True:
                frames = await dealer.recv_multipart()
                if frames and len(frames[0]) == 0:
                    frames = frames[1:]  # the ROUTER's empty delimiter
                if is_replay_end(frames[-2:]):
                    break
                batch = decode_frames(frames)
                assert batch.seq is not None
                if batch.seq >= stop:
                    continue  # already held (or still queued on the SUB socket)
                if batch.seq != first + len(got):
                    raise ReplayFailed(f"expected seq {first + len(got)}, got {batch.seq}")
                got.append(batch)
            if len(got) != stop - first:
                raise ReplayFailed(f"got {len(got)} of {stop - first} missing batches")
            return got
        finally:
            dealer.close(linger=0)
