"""CLIENT PAUSE lasts at least its length on uvloop, whose timers count whole milliseconds and
fire up to one early (a held command answered a fraction of a millisecond before the pause's
end failed test_introspection in CI)."""

from __future__ import annotations

import asyncio
import random
import time

import uvloop

from quilld.protocol.clients import Clients


class HeldConnection:
    """What the pause resumes: records when."""

    def __init__(self) -> None:
        self.resumed: list[float] = []

    def resume_after_pause(self) -> None:
        self.resumed.append(time.monotonic())


def test_a_pause_never_ends_before_its_length():
    async def main() -> list[float]:
        clients, conn, early = Clients(10), HeldConnection(), []
        for _ in range(40):
            await asyncio.sleep(random.random() * 0.002)  # anywhere within uvloop's millisecond
            clients.pause("all", 0.0105)
            until = clients.paused[1]
            assert clients.holds(conn, None)  # held: ALL holds every command
            deadline = time.monotonic() + 5
            n = len(conn.resumed)
            while len(conn.resumed) == n and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            assert len(conn.resumed) == n + 1, "the pause never ended"
            if conn.resumed[-1] < until:
                early.append(until - conn.resumed[-1])
        return early

    early = uvloop.run(main())
    assert not early, f"{len(early)} of 40 pauses ended early, by up to {max(early) * 1000:.2f} ms"
