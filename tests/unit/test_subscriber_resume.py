"""A restarted quilld resumes an engine's feed from the cursor its persistent index kept (issue 23.3):
the replay is asked from the last batch applied, checked by its digest, and only what came after is
applied; a publisher that restarted meanwhile has the engine's residencies dropped; the cursor is
reported once per batch applied in full, a big batch's after its last slice."""

from __future__ import annotations

import asyncio
import time

import vllm_schema as vllm
import zmq.asyncio
from test_subscriber import Publisher, run, until

from quilld.index import subscriber as subscriber_mod
from quilld.index.engines import FeedStats
from quilld.index.events import Removed, Stored
from quilld.index.subscriber import Cursor, KvEventSubscriber, digest

ENGINE = "engine-a"


class Resumed:
    """A subscriber that starts from `resume` with `applied` already in its 'index'."""

    def __init__(self, ctx: zmq.asyncio.Context, pub: Publisher, resume: Cursor | None, applied: set[int]) -> None:
        self.hashes = set(applied)
        self.resets: list[str] = []
        self.cursors: list[Cursor] = []
        self.stats = FeedStats()
        self.sub = KvEventSubscriber(ENGINE, pub.endpoint, self._apply, self._reset, pub.replay_endpoint, ctx=ctx,
                                     stats=self.stats, resume=resume, on_applied=self._applied)

    def _apply(self, engine: str, events) -> int:
        for ev in events:
            if type(ev) is Stored:
                self.hashes |= set(ev.block_hashes)
            elif type(ev) is Removed:
                self.hashes -= set(ev.block_hashes)
        return len(events)

    def _reset(self, engine: str, reason: str, missing: int) -> int:
        self.resets.append(reason)
        self.hashes.clear()
        return 0

    def _applied(self, engine: str, cursor: Cursor) -> None:
        self.cursors.append(cursor)


def cursor_of(pub: Publisher, seq: int) -> Cursor:
    payload = dict(pub.buffer)[seq]
    return Cursor(seq, digest(payload), vllm_ts(payload))


def vllm_ts(payload: bytes) -> float:
    from quilld.index.events import decode_payload
    return decode_payload(payload).ts


def test_a_resumed_feed_applies_only_what_came_after_its_cursor() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        for i in range(5):
            await pub.publish(vllm.gpu([i]))
        cursor = cursor_of(pub, 2)  # quilld had committed up to batch 2 when it was killed
        await pub.publish(vllm.removed([0]))  # 5: while quilld was down
        h = Resumed(ctx, pub, cursor, {0, 1, 2})
        await h.sub.start()
        await until(lambda: h.hashes == {1, 2, 3, 4})
        assert pub.requests[0] == 2  # asked from the cursor's batch, to check it
        assert h.resets == [] and h.stats["replays"] == 1 and h.stats.last_seq == 5
        assert [c.seq for c in h.cursors] == [3, 4, 5]
        await pub.publish(vllm.gpu([9]))
        await until(lambda: 9 in h.hashes)
        assert h.cursors[-1].seq == 6 and h.resets == []
        await h.sub.stop()
        await pub.close()

    run(body)


def test_a_publisher_that_restarted_meanwhile_drops_what_was_kept() -> None:
    """Its batch under the cursor's number has other bytes: a new process, whose replay is applied
    from 0 once the old process's residencies are dropped."""
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        for i in range(4):
            await pub.publish(vllm.gpu([i]))
        cursor = cursor_of(pub, 3)
        await pub.restart()
        for i in range(6):  # the new process got past the old sequence number
            await pub.publish(vllm.gpu([100 + i]))
        h = Resumed(ctx, pub, cursor, {0, 1, 2, 3})
        await h.sub.start()
        await until(lambda: h.hashes == {100 + i for i in range(6)})
        assert h.resets == ["restart"] and h.stats["restarts"] == 1
        assert h.cursors[-1].seq == 5
        await h.sub.stop()
        await pub.close()

    run(body)


def test_a_resumed_feed_without_replay_continues_or_resets_on_what_it_sees() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, replay=False)
        for i in range(3):
            await pub.publish(vllm.gpu([i]), drop=True)  # published before quilld came back
        cursor = cursor_of(pub, 2)
        h = Resumed(ctx, pub, cursor, {0, 1, 2})
        await h.sub.start()
        await until(lambda: h.sub.connected)
        deadline = time.monotonic() + 15.0
        while h.stats["batches"] == 0:  # batch 3 continues what was kept (a slow joiner may miss a send: again)
            assert time.monotonic() < deadline, "the subscriber never received batch 3"
            pub.seq = 3
            await pub.publish(vllm.gpu([3]))
            await asyncio.sleep(0.05)
        assert h.hashes == {0, 1, 2, 3} and h.resets == [] and h.cursors[-1].seq == 3
        pub.seq = 10  # batches 4..9 never arrive: a gap without replay drops the engine
        await pub.publish(vllm.gpu([10]))
        await until(lambda: h.resets == ["gap"])
        await until(lambda: h.hashes == {10})
        await h.sub.stop()
        await pub.close()

    run(body)


def test_the_cursor_is_reported_after_the_last_slice_of_a_big_batch() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        h = Resumed(ctx, pub, None, set())
        await h.sub.start()
        await until(lambda: h.sub.connected)
        n = subscriber_mod.SLICE_WORK * 3 + 1
        await pub.publish(vllm.gpu(list(range(n))))
        await pub.publish(vllm.gpu([n]))
        await until(lambda: n in h.hashes)
        assert [c.seq for c in h.cursors] == [0, 1] and len(h.hashes) == n + 1
        assert h.cursors[0].digest == digest(dict(pub.buffer)[0])
        await h.sub.stop()
        await pub.close()

    run(body)


class SlowReplay(Publisher):
    """A replay socket that answers one batch at a time, `replay_gap` seconds apart."""

    replay_gap = 0.03


def test_a_long_replay_that_keeps_coming_is_not_cut_off(monkeypatch) -> None:
    """A restarted quilld may catch up on thousands of batches: the replay is abandoned after a silence
    of REPLAY_TIMEOUT_S, not when it has lasted that long."""
    monkeypatch.setattr(subscriber_mod, "REPLAY_TIMEOUT_S", 0.2)

    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = SlowReplay(ctx)
        for i in range(12):  # 12 x 0.03 s: longer than 0.2 s in all, never silent for 0.2 s
            await pub.publish(vllm.gpu([i]))
        h = Resumed(ctx, pub, cursor_of(pub, 0), {0})
        await h.sub.start()
        await until(lambda: h.hashes == set(range(12)))
        assert h.resets == [] and h.cursors[-1].seq == 11
        await h.sub.stop()
        await pub.close()

    run(body)


def test_a_failed_catch_up_is_tried_again(monkeypatch) -> None:
    monkeypatch.setattr(subscriber_mod, "REPLAY_TIMEOUT_S", 0.2)

    async def body(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, answer=False)
        for i in range(4):
            await pub.publish(vllm.gpu([i]))
        h = Resumed(ctx, pub, cursor_of(pub, 1), {0, 1})
        await h.sub.start()
        await until(lambda: h.sub._catch_up_failed is not None)  # asked, never answered
        pub.answer = True
        h.sub.housekeeping(time.monotonic(), 0)  # too soon: not yet
        assert len(pub.requests) == 1
        h.sub.housekeeping(time.monotonic() + subscriber_mod.TAIL_PROBE_S, 0)
        await until(lambda: h.hashes == {0, 1, 2, 3})
        assert pub.requests == [1, 1] and h.resets == []
        await h.sub.stop()
        await pub.close()

    run(body)
