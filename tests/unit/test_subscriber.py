"""KvEventSubscriber against real ZMQ sockets on loopback: a publisher that does what vLLM
0.33's ZmqEventPublisher does (PUB `(topic, seq, payload)`, a bounded buffer, a replay
ROUTER), payloads from vLLM's own schema (tests/vllm_schema.py).

Scenarios: in order, duplicates, topics; malformed input; gaps inside and beyond the
replay buffer; a late start and a restart of quilld (catch-up from the replay socket);
a restart of the publisher with and without its first batches, seen through the sequence,
the timestamp or the reconnect probe; big batches applied in slices; the idle warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import pytest
import vllm_schema as vllm
import zmq
import zmq.asyncio
from conftest import free_port

from quilld.index import subscriber as subscriber_mod
from quilld.index.engines import FeedStats
from quilld.index.events import Removed, Stored
from quilld.index.subscriber import KvEventSubscriber

ENGINE = "engine-a"
TEST_TIMEOUT_S = 10.0


async def until(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    """Wait for `cond`; the timeout only bounds a loaded machine's wait."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Publisher:
    """vLLM's ZmqEventPublisher on the wire: PUB, a replay ROUTER, a bounded buffer of past batches.

    `topic_in_replay` sends replies as vLLM 0.33 does (`[id, b"", topic, seq, payload]`, end
    marker `[id, b"", b"", END, b""]`); otherwise as older releases (`[id, b"", seq, payload]`).
    `replay_gap`: seconds between the batches of a replay (a slow replay).
    """

    replay_gap = 0.0

    def __init__(self, ctx: zmq.asyncio.Context, replay: bool = True, buffer_steps: int = 10_000,
                 topic: bytes = b"kv", topic_in_replay: bool = True, answer: bool = True) -> None:
        self.ctx = ctx
        self.pub_port, self.replay_port = free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}" if replay else None
        self.buffer_steps, self.topic, self.topic_in_replay, self.answer = buffer_steps, topic, topic_in_replay, answer
        self.requests: list[int] = []
        self.generation = 0
        self._open()

    def _open(self) -> None:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self.seq = 0
        self.router = None
        self.task = None
        if self.replay_endpoint is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(self.replay_endpoint)
            self.task = asyncio.create_task(self._serve())

    async def publish(self, *events, drop: bool = False, raw: bytes | None = None) -> int:
        """One batch (`drop`: lost on the PUB socket, kept in the buffer); returns its seq."""
        payload = raw if raw is not None else vllm.encode(list(events), ts=time.time())
        seq, self.seq = self.seq, self.seq + 1
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))
        return seq

    async def _serve(self) -> None:
        while True:
            request = await self.router.recv_multipart()
            if len(request) != 3:
                continue
            client, _, start_bytes = request
            start = int.from_bytes(start_bytes, "big")
            self.requests.append(start)
            if not self.answer:
                continue
            head = [client, b"", self.topic] if self.topic_in_replay else [client, b""]
            for seq, payload in list(self.buffer):
                if seq >= start:
                    if self.replay_gap:
                        await asyncio.sleep(self.replay_gap)
                    await self.router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
            end = [client, b"", b""] if self.topic_in_replay else [client, b""]
            await self.router.send_multipart(end + [vllm.END_SEQ, b""])

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self.task
            self.router.close(linger=0)
        self.pub.close(linger=0)

    async def restart(self) -> None:
        """A new vLLM process on the same ports: sequence from 0, an empty buffer."""
        await self.close()
        await asyncio.sleep(0.05)
        self.generation += 1
        self._open()


class Harness:
    """A subscriber following `pub`, recording what it applies and every reset."""

    def __init__(self, ctx: zmq.asyncio.Context, pub: Publisher) -> None:
        self.pub = pub
        self.applied: list[Stored] = []
        self.resets: list[tuple[str, int]] = []
        self.calls = 0
        self.stats = FeedStats()
        self.sub = KvEventSubscriber(ENGINE, pub.endpoint, self._apply, self._reset, pub.replay_endpoint,
                                     ctx=ctx, stats=self.stats)

    def _apply(self, engine: str, events) -> int:
        assert engine == ENGINE
        self.calls += 1
        for ev in events:
            if type(ev) is Removed:  # as the index does
                gone = set(ev.block_hashes)
                self.applied = [e._replace(block_hashes=tuple(h for h in e.block_hashes if h not in gone))
                                for e in self.applied]
            else:
                self.applied.append(ev)
        return len(events)

    def _reset(self, engine: str, reason: str, missing: int) -> int:
        self.resets.append((reason, missing))
        self.applied.clear()  # as the control plane does: what was known is gone
        return 0

    @property
    def hashes(self) -> list[int]:
        return [h for e in self.applied if type(e) is Stored for h in e.block_hashes]

    async def start(self) -> None:
        await self.sub.start()
        await until(lambda: self.sub.connected)

    async def join(self, first: int = 1000) -> int:
        """Without a replay socket: publish until the subscription carries batches (slow joiner)."""
        deadline = time.monotonic() + 15.0
        while not self.applied:
            assert time.monotonic() < deadline, "subscriber never received a batch"
            await self.pub.publish(vllm.gpu([first]))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        return self.pub.seq

    async def close(self) -> None:
        await self.sub.stop()


def run(body: Callable[[zmq.asyncio.Context], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(body(ctx), TEST_TIMEOUT_S)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


# ---------------------------------------------------------------- in order, catch-up


def test_applies_batches_in_order_and_counts_them() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        for i in range(1, 6):
            await pub.publish(vllm.gpu([i, 100 + i]))
        await until(lambda: len(h.hashes) == 10)
        assert h.hashes == [x for i in range(1, 6) for x in (i, 100 + i)]
        s = h.stats
        assert (s["batches"], s["events"], s["gaps"], s["malformed"], s.last_seq) == (5, 5, 0, 0, 4)
        assert h.resets == [] and s.state == "live"
        await h.close()
        await pub.close()

    run(body)


def test_a_late_start_catches_up_from_the_replay_socket() -> None:
    """quilld started (or restarted) after the engine: what vLLM's buffer holds is applied at once."""
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        for i in range(10):
            await pub.publish(vllm.gpu([i]))
        h = Harness(ctx, pub)
        await h.start()
        await until(lambda: len(h.hashes) == 10)  # no live batch needed
        assert h.hashes == list(range(10)) and pub.requests[0] == 0
        assert h.stats["replays"] == 1 and h.stats["missed"] == 0 and h.resets == []
        await pub.publish(vllm.gpu([10]))
        await until(lambda: len(h.hashes) == 11)
        assert h.stats.last_seq == 10 and h.stats["gaps"] == 0
        await h.close()
        # quilld restarts: a fresh subscriber (its state lost with the process) catches up the same way
        again = Harness(ctx, pub)
        await again.start()
        await until(lambda: len(again.hashes) == 11)
        assert again.hashes == list(range(11)) and again.stats.last_seq == 10
        await again.close()
        await pub.close()

    run(body)


def test_a_late_start_beyond_the_buffer_applies_what_is_left_and_says_so(caplog) -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, buffer_steps=4)
        for i in range(10):
            await pub.publish(vllm.gpu([i]))  # 0..5 have left the buffer
        h = Harness(ctx, pub)
        await h.start()
        await until(lambda: len(h.hashes) == 4)
        assert h.hashes == [6, 7, 8, 9] and h.stats["missed"] == 6
        assert h.resets == []  # nothing was known, so nothing to drop
        await h.close()
        await pub.close()

    with caplog.at_level(logging.WARNING, logger="quilld.index.subscriber"):
        run(body)
    assert "beyond reach" in caplog.text


@pytest.mark.parametrize("recent", [256, 1], ids=["by-digest", "by-timestamp"])
def test_duplicates_are_counted_and_not_applied(recent: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriber_mod, "RECENT", recent)

    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await pub.publish(vllm.gpu([2]))
        await until(lambda: len(h.hashes) == 2 and h.stats.state == "live")
        # a slow start (a loaded machine) may see 1 and 2 both live and in the catch-up's replay:
        # those duplicates are real too; count only the one sent below
        before = h.stats["duplicates"]
        payload = pub.buffer[0][1]
        await pub.pub.send_multipart([pub.topic, (0).to_bytes(8, "big"), payload])  # seq 0 again, same bytes
        await pub.publish(vllm.gpu([3]))
        await until(lambda: len(h.hashes) == 3)
        assert h.hashes == [1, 2, 3] and h.stats["duplicates"] == before + 1 and h.stats["restarts"] == 0
        assert h.resets == []
        await h.close()
        await pub.close()

    run(body)


def test_topic_filter() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, replay=False, topic=b"kv@engine-a")
        h = Harness(ctx, pub)
        h.sub.topic = b"kv@engine-a"
        await h.start()
        seq = await h.join()
        await pub.pub.send_multipart([b"other", seq.to_bytes(8, "big"), vllm.encode([vllm.gpu([7])])])
        await pub.publish(vllm.gpu([8]))  # seq `seq`, on our topic
        await until(lambda: 8 in h.hashes)
        assert 7 not in h.hashes
        await h.close()
        await pub.close()

    run(body)


# ---------------------------------------------------------------- bad input


def test_a_bad_event_costs_only_itself_and_a_broken_batch_is_not_a_gap() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await until(lambda: h.hashes == [1])
        # GPU and offload events in one batch, one of them of an unknown type
        mixed = vllm.encode([vllm.gpu([2, 3]), vllm.offloaded([2], vllm.MEDIUM_STORAGE)], ts=time.time())
        import msgpack

        obj = msgpack.unpackb(mixed)
        obj[1].insert(1, {"type": "BlockEvicted", "block_hashes": [9]})
        obj[1].append(["BlockStored", [4], None, "not a list", 16, None, "GPU"])
        await pub.publish(raw=msgpack.packb(obj))
        await pub.publish(raw=b"\xc1 not msgpack")  # seq 2: its envelope is broken
        await pub.pub.send_multipart([b"kv", b"\x01", b""])  # no readable sequence number at all
        await pub.publish(vllm.gpu([5]))  # seq 3
        await until(lambda: 5 in h.hashes)
        assert h.hashes == [1, 2, 3, 2, 5]
        s = h.stats
        assert s["malformed"] == 4 and s["gaps"] == 0 and s["batches"] == 4 and s.last_seq == 3
        assert h.resets == [] and pub.requests == [0]  # never mistaken for a gap, never replayed
        await h.close()
        await pub.close()

    run(body)


def test_apply_error_does_not_end_the_stream() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        inner = h._apply

        def flaky(engine: str, events) -> int:
            if events[0].block_hashes == (2,):
                raise RuntimeError("index bug")
            return inner(engine, events)

        h.sub._apply = flaky
        await h.start()
        for i in (1, 2, 3):
            await pub.publish(vllm.gpu([i]))
        await until(lambda: 3 in h.hashes)
        assert h.hashes == [1, 3] and h.stats["errors"] == 1 and h.sub.running
        await h.close()
        await pub.close()

    run(body)


# ---------------------------------------------------------------- gaps


def test_gap_without_replay_drops_and_says_so() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, replay=False)
        h = Harness(ctx, pub)
        await h.start()
        await h.join()
        for i in range(3):
            await pub.publish(vllm.gpu([50 + i]), drop=True)
        await pub.publish(vllm.gpu([60]))
        await until(lambda: 60 in h.hashes)
        assert h.resets == [("gap", 3)] and h.hashes == [60]
        assert h.stats["gaps"] == 1 and h.stats["missed"] == 3 and h.stats["replays"] == 0
        await h.close()
        await pub.close()

    run(body)


@pytest.mark.parametrize("topic_in_replay", [True, False], ids=["vllm-0.33-replies", "older-replies"])
def test_gap_inside_the_buffer_is_replayed_in_order(topic_in_replay: bool) -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, topic_in_replay=topic_in_replay)
        h = Harness(ctx, pub)
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await until(lambda: h.hashes == [1])
        for i in (2, 3, 4):
            await pub.publish(vllm.gpu([i]), drop=True)  # lost on the PUB socket, still in the buffer
        await pub.publish(vllm.gpu([5]))
        await pub.publish(vllm.gpu([6]))
        await until(lambda: len(h.hashes) == 6)
        assert h.hashes == [1, 2, 3, 4, 5, 6] and h.resets == []
        assert pub.requests[-1] == 0  # asked from the last batch applied, to check it is the same one
        s = h.stats
        assert s["gaps"] == 1 and s["missed"] == 0 and s["replays"] >= 1 and s.last_seq == 5
        await h.close()
        await pub.close()

    run(body)


def test_gap_beyond_the_buffer_drops_then_applies_what_is_left() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, buffer_steps=3)
        h = Harness(ctx, pub)
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await until(lambda: h.hashes == [1])
        for i in range(2, 8):
            await pub.publish(vllm.gpu([i]), drop=True)  # seq 1..6; the buffer keeps 5, 6 (and 7)
        await pub.publish(vllm.gpu([8]))
        await until(lambda: 8 in h.hashes)
        assert h.resets == [("beyond_buffer", 4)]  # seq 1..4 are gone: blocks 1.. may be stale
        assert h.hashes == [6, 7, 8]
        assert h.stats["missed"] == 4 and h.stats["gaps"] == 1
        await h.close()
        await pub.close()

    run(body)


def test_a_lost_last_batch_is_fetched_once_the_feed_goes_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriber_mod, "TAIL_PROBE_S", 0.2)

    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await until(lambda: h.hashes == [1])
        await pub.publish(vllm.removed([1]), vllm.gpu([2]), drop=True)  # the last batch, lost: no later one shows it
        requests = len(pub.requests)
        deadline = time.monotonic() + 15
        while h.hashes != [2]:  # what the control plane's housekeeping does every 50 ms
            assert time.monotonic() < deadline, "the lost last batch was never fetched"
            h.sub.housekeeping(time.monotonic(), 0.0)
            await asyncio.sleep(0.05)
        assert len(pub.requests) == requests + 1 and h.resets == [] and h.stats.last_seq == 1
        for _ in range(10):  # once per quiet spell, not once per housekeeping
            h.sub.housekeeping(time.monotonic(), 0.0)
            await asyncio.sleep(0.05)
        assert len(pub.requests) == requests + 1
        await h.close()
        await pub.close()

    run(body)


def test_replay_timeout_falls_back_to_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriber_mod, "REPLAY_TIMEOUT_S", 0.3)

    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, answer=False)
        h = Harness(ctx, pub)
        await h.start()
        await until(lambda: len(pub.requests) == 1)  # the catch-up at connect, unanswered
        seq = await h.join()
        await pub.publish(vllm.gpu([70]), drop=True)
        await pub.publish(vllm.gpu([71]))
        await until(lambda: 71 in h.hashes)
        assert h.resets == [("gap", 1)] and pub.requests[-1] == seq - 1
        await h.close()
        await pub.close()

    run(body)


# ---------------------------------------------------------------- publisher restarts


def test_publisher_restart_with_its_first_batches() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, replay=False)
        h = Harness(ctx, pub)
        await h.start()
        await h.join()
        for i in range(5):
            await pub.publish(vllm.gpu([i]))
        await until(lambda: 4 in h.hashes)
        pub.seq = 0  # a new process, same sockets (the restart's reconnect is not even seen)
        await pub.publish(vllm.gpu([40]))
        await until(lambda: 40 in h.hashes)
        assert h.resets == [("restart", 0)] and h.hashes == [40]
        assert h.stats["restarts"] == 1 and h.stats["duplicates"] == 0 and h.stats.last_seq == 0
        await h.close()
        await pub.close()

    run(body)


@pytest.mark.parametrize("recent", [256, 4], ids=["by-digest", "by-timestamp"])
def test_publisher_restart_without_its_first_batches(recent: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Restart and first batches lost within 50 ms: seq 2 after seq 10 is not a duplicate: its bytes
    differ from our seq 2 (or, once our seq 2 is forgotten, it is stamped after our newest batch)."""
    monkeypatch.setattr(subscriber_mod, "RECENT", recent)

    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        for i in range(11):
            await pub.publish(vllm.gpu([i]))
        await until(lambda: h.stats.last_seq == 10)
        pub.seq, pub.buffer = 0, deque(maxlen=pub.buffer_steps)  # new process, sockets kept
        await pub.publish(vllm.gpu([100]), drop=True)
        await pub.publish(vllm.gpu([101]), drop=True)
        await pub.publish(vllm.gpu([102]))
        await until(lambda: 102 in h.hashes)
        assert h.resets == [("restart", 0)]
        assert h.hashes == [100, 101, 102]  # its first batches came from its replay socket
        assert h.stats["restarts"] == 1 and pub.requests[-1] == 0
        await h.close()
        await pub.close()

    run(body)


def test_publisher_restart_seen_by_the_reconnect_probe() -> None:
    """The new process's only batch is lost before the subscriber reconnects: the probe finds it."""
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        for i in range(6):
            await pub.publish(vllm.gpu([i]))
        await until(lambda: h.stats.last_seq == 5)
        await pub.restart()
        await pub.publish(vllm.gpu([200]))  # published before the subscriber is back: lost on PUB
        await until(lambda: 200 in h.hashes)
        assert h.resets == [("restart", 0)] and h.hashes == [200]
        assert h.stats["restarts"] == 1 and h.stats.last_seq == 0
        await pub.publish(vllm.gpu([201]))
        await until(lambda: 201 in h.hashes)
        await h.close()
        await pub.close()

    run(body)


def test_publisher_restart_that_got_past_our_sequence_is_seen_by_the_digest() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        for i in range(3):
            await pub.publish(vllm.gpu([i]))
        await until(lambda: h.stats.last_seq == 2)
        await pub.restart()
        for i in range(6):
            await pub.publish(vllm.gpu([300 + i]), drop=True)  # its seq 2 is not ours
        await until(lambda: 305 in h.hashes)
        assert h.resets == [("restart", 0)] and h.hashes == [300 + i for i in range(6)]
        await h.close()
        await pub.close()

    run(body)


def test_a_reconnect_of_the_same_publisher_keeps_what_is_known() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await until(lambda: h.hashes == [1])
        # the same process drops and rebinds its sockets, keeping its counter and buffer
        seq, buffer = pub.seq, pub.buffer
        await pub.restart()
        pub.seq, pub.buffer = seq, buffer
        await pub.publish(vllm.gpu([2]), drop=True)
        await until(lambda: 2 in h.hashes)
        assert h.resets == [] and h.hashes == [1, 2] and h.stats["restarts"] == 0
        await h.close()
        await pub.close()

    run(body)


# ---------------------------------------------------------------- slices, idle, stop


def test_a_big_batch_is_applied_in_slices_and_the_loop_keeps_running() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.start()
        n = subscriber_mod.SLICE_WORK * 8 + 5
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:  # stands in for ROUTE: how long does it wait for the loop?
            while not stop:
                t = time.perf_counter()
                await asyncio.sleep(0)
                gaps.append(time.perf_counter() - t)

        tick = asyncio.create_task(ticker())
        await pub.publish(vllm.gpu(list(range(n))), vllm.gpu([n]), vllm.removed([0]))
        await until(lambda: n in h.hashes)
        stop = True
        await tick
        assert len(h.hashes) == n and 0 not in h.hashes and h.stats["events"] >= 3
        assert h.calls >= 9  # one event of n hashes went in parts
        assert len(gaps) >= 9
        await h.close()
        await pub.close()

    run(body)


def test_idle_warning_once_per_silence(caplog) -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        port = free_port()  # nobody publishes here: vLLM would have connected elsewhere
        stats = FeedStats()
        sub = KvEventSubscriber(ENGINE, f"tcp://127.0.0.1:{port}", lambda e, ev: len(ev), lambda *a: 0, ctx=ctx,
                                stats=stats)
        await sub.start()
        now = time.monotonic()
        assert not sub.check_idle(now, 60.0)
        assert sub.check_idle(now + 61, 60.0)
        assert not sub.check_idle(now + 120, 60.0)  # once per silence
        assert stats.state == "connecting" and not sub.connected
        await sub.stop()

    with caplog.at_level(logging.WARNING, logger="quilld.index.subscriber"):
        run(body)
    warnings = [r for r in caplog.records if "has received nothing" in r.getMessage()]
    assert len(warnings) == 1 and "tcp://*:5557" in warnings[0].getMessage()
    assert "not connected" in warnings[0].getMessage()


def test_stop_closes_cleanly() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Harness(ctx, pub)
        await h.sub.stop()  # before start: a no-op
        await h.start()
        await pub.publish(vllm.gpu([1]))
        await until(lambda: h.hashes == [1])
        sock = h.sub._sub
        t0 = time.monotonic()
        await h.sub.stop()
        assert time.monotonic() - t0 < 1.0
        assert not h.sub.running and sock is not None and sock.closed
        await h.sub.stop()  # twice: a no-op
        await pub.publish(vllm.gpu([2]))
        await asyncio.sleep(0.05)
        assert h.hashes == [1]
        await pub.close()

    run(body)
