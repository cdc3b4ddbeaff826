"""KvEventSubscriber against real ZMQ sockets on loopback (PUB, and a ROUTER for replay)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from quilld.index import subscriber as subscriber_mod
from quilld.index.events import Batch, Stored
from quilld.index.subscriber import KvEventSubscriber

ENGINE = "engine-a"
END_SEQ = b"\xff" * 8  # vLLM: (-1).to_bytes(8, "big", signed=True)
TEST_TIMEOUT_S = 8.0


def payload(seq: int) -> bytes:
    # The block hash carries the seq so a test can tell batches apart by content too.
    return msgpack.packb([float(seq), [["BlockStored", [1000 + seq, 2], None, [1, 2, 3], 16, None, "GPU"]], 0])


def frames(seq: int, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload(seq)]


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Harness:
    """A PUB socket standing in for vLLM, and a subscriber recording what it is given."""

    def __init__(self, ctx: zmq.asyncio.Context, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.applied: list[Batch] = []
        self.gaps: list[tuple[str, int]] = []
        self.sub = KvEventSubscriber(
            ENGINE,
            f"tcp://127.0.0.1:{port}",
            lambda engine, batch: self.applied.append(batch) if engine == ENGINE else None,
            lambda engine, missing: self.gaps.append((engine, missing)),
            replay_endpoint=replay_endpoint,
            topic=topic,
            ctx=ctx,
        )

    @property
    def seqs(self) -> list[int | None]:
        return [b.seq for b in self.applied]

    async def send(self, seq: int, topic: bytes = b"") -> None:
        await self.pub.send_multipart(frames(seq, topic))

    async def join(self, seq: int = 0, topic: bytes = b"") -> None:
        """Beat the slow joiner: publish `seq` until the subscriber has applied it."""
        deadline = time.monotonic() + 3.0
        while not self.applied:
            if time.monotonic() > deadline:
                raise AssertionError("subscriber never received the first batch")
            await self.send(seq, topic)
            await asyncio.sleep(0.02)
        # Let the repeated copies of `seq` drain (they are dropped as duplicates).
        await asyncio.sleep(0.05)
        self.sub.stats["duplicates"] = 0

    async def close(self) -> None:
        await self.sub.stop()
        self.pub.close(linger=0)


def run(body: Callable[[zmq.asyncio.Context], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(body(ctx), TEST_TIMEOUT_S)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


# ---------------------------------------------------------------- in order


def test_applies_batches_in_order() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        await h.sub.start()
        await h.join(0)
        for seq in range(1, 6):
            await h.send(seq)
        await until(lambda: len(h.applied) == 6)
        assert h.seqs == [0, 1, 2, 3, 4, 5]
        first = h.applied[1].events[0]
        assert isinstance(first, Stored) and first.block_hashes == (1001, 2) and first.medium == "GPU"
        assert h.gaps == []
        assert h.sub.stats["batches"] == 6 and h.sub.stats["events"] == 6
        assert h.sub.stats["gaps"] == 0 and h.sub.stats["malformed"] == 0
        await h.close()

    run(body)


def test_duplicates_are_counted_and_not_applied() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        await h.sub.start()
        await h.join(0)
        for seq in (1, 1, 2, 1, 3):  # a repeat, then an older one (seq 0 would mean a restart)
            await h.send(seq)
        await until(lambda: len(h.applied) == 4)
        assert h.seqs == [0, 1, 2, 3]
        assert h.sub.stats["duplicates"] == 2 and h.gaps == []
        await h.close()

    run(body)


def test_topic_filter() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx, topic=b"kv@engine-a")
        await h.sub.start()
        await h.join(0, topic=b"kv@engine-a")
        await h.send(1, topic=b"other")
        await h.send(2, topic=b"kv@engine-a")
        await until(lambda: len(h.applied) == 2)
        assert h.seqs == [0, 2]  # seq 1 was on a topic we did not subscribe to
        await h.close()

    run(body)


# ---------------------------------------------------------------- malformed


def test_malformed_messages_are_counted_and_skipped() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        await h.sub.start()
        await h.join(0)
        bad = [
            [b"", (1).to_bytes(8, "big"), b"\xc1"],  # not msgpack
            [b"", (1).to_bytes(8, "big"), msgpack.packb([0.0, [["NoSuchEvent"]], 0])],
            [b"", b"\x01", payload(1)],  # short sequence frame
            [b"only-one-frame"],
        ]
        for msg in bad:
            await h.pub.send_multipart(msg)
        await h.send(1)
        await until(lambda: len(h.applied) == 2)
        assert h.seqs == [0, 1]
        assert h.sub.stats["malformed"] == 4
        assert h.sub.running
        await h.close()

    run(body)


def test_apply_error_does_not_end_the_stream() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        inner = h.sub._apply

        def flaky(engine: str, batch: Batch) -> None:
            if batch.seq == 1:
                raise RuntimeError("index bug")
            inner(engine, batch)

        h.sub._apply = flaky
        await h.sub.start()
        await h.join(0)
        await h.send(1)
        await h.send(2)
        await until(lambda: len(h.applied) == 2)
        assert h.seqs == [0, 2]
        assert h.sub.stats["errors"] == 1 and h.sub.running
        await h.close()

    run(body)


# ---------------------------------------------------------------- gaps


def test_gap_without_replay_calls_on_gap() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        await h.sub.start()
        await h.join(0)
        await h.send(1)
        await h.send(5)  # 2, 3, 4 lost
        await h.send(6)
        await until(lambda: len(h.applied) == 4)
        assert h.seqs == [0, 1, 5, 6]
        assert h.gaps == [(ENGINE, 3)]
        assert h.sub.stats["gaps"] == 1 and h.sub.stats["missed"] == 3 and h.sub.stats["replays"] == 0
        await h.close()

    run(body)


def test_engine_restart_resets_sequence() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        await h.sub.start()
        await h.join(0)
        await h.send(1)
        await h.send(2)
        await h.send(0)  # a new vLLM process counts from 0 again
        await h.send(1)
        await until(lambda: len(h.applied) == 5)
        assert h.seqs == [0, 1, 2, 0, 1]
        assert h.gaps == [(ENGINE, 0)]
        assert h.sub.stats["restarts"] == 1 and h.sub.stats["duplicates"] == 0
        await h.close()

    run(body)


class ReplayServer:
    """vLLM's replay ROUTER: `[id, b"", start]` in, `[id, b"", seq, payload]`... then END out."""

    def __init__(self, ctx: zmq.asyncio.Context, buffered: list[int], answer: bool = True) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffered = buffered
        self.answer = answer
        self.requests: list[list[bytes]] = []
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            request = await self.router.recv_multipart()
            self.requests.append(request)
            if not self.answer or len(request) != 3:
                continue
            client_id, _, start_bytes = request
            start = int.from_bytes(start_bytes, "big")
            for seq in self.buffered:
                if seq >= start:
                    await self.router.send_multipart([client_id, b"", seq.to_bytes(8, "big"), payload(seq)])
            await self.router.send_multipart([client_id, b"", END_SEQ, b""])

    async def close(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        self.router.close(linger=0)


def test_gap_with_replay_applies_missing_batches_in_order() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        # The publisher's buffer holds everything, including batches newer than the gap.
        server = ReplayServer(ctx, buffered=list(range(0, 8)))
        h = Harness(ctx, replay_endpoint=server.endpoint)
        await h.sub.start()
        await h.join(0)
        await h.send(1)
        await h.send(5)  # 2, 3, 4 lost on the PUB path
        await h.send(6)
        await until(lambda: len(h.applied) == 7)
        assert h.seqs == [0, 1, 2, 3, 4, 5, 6]
        assert [b.events[0].block_hashes[0] for b in h.applied] == [1000 + s for s in range(7)]
        assert h.gaps == []
        assert len(server.requests) == 1
        _, delim, start = server.requests[0]
        assert delim == b"" and start == (2).to_bytes(8, "big")
        s = h.sub.stats
        assert s["gaps"] == 1 and s["missed"] == 3 and s["replays"] == 1 and s["batches"] == 7
        await h.close()
        await server.close()

    run(body)


def test_replay_timeout_falls_back_to_on_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriber_mod, "REPLAY_TIMEOUT_S", 0.3)

    async def body(ctx: zmq.asyncio.Context) -> None:
        server = ReplayServer(ctx, buffered=[], answer=False)
        h = Harness(ctx, replay_endpoint=server.endpoint)
        await h.sub.start()
        await h.join(0)
        await h.send(3)
        await h.send(4)
        await until(lambda: len(h.applied) == 3)
        assert h.seqs == [0, 3, 4]
        assert h.gaps == [(ENGINE, 2)]
        assert len(server.requests) == 1 and h.sub.stats["replays"] == 0
        await h.close()
        await server.close()

    run(body)


def test_incomplete_replay_falls_back_to_on_gap() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        # Seq 1 has already left the publisher's bounded buffer.
        server = ReplayServer(ctx, buffered=[2, 3])
        h = Harness(ctx, replay_endpoint=server.endpoint)
        await h.sub.start()
        await h.join(0)
        await h.send(3)
        await until(lambda: len(h.applied) == 2)
        assert h.seqs == [0, 3]
        assert h.gaps == [(ENGINE, 2)]
        await h.close()
        await server.close()

    run(body)


# ---------------------------------------------------------------- lifecycle


def test_stop_closes_cleanly() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        h = Harness(ctx)
        await h.sub.stop()  # before start: a no-op
        await h.sub.start()
        await h.join(0)
        sock = h.sub._sub
        t0 = time.monotonic()
        await h.sub.stop()
        assert time.monotonic() - t0 < 1.0
        assert not h.sub.running and sock is not None and sock.closed
        await h.sub.stop()  # twice: a no-op
        await h.send(1)
        await asyncio.sleep(0.05)
        assert h.seqs == [0]
        h.pub.close(linger=0)

    run(body)
