"""The asyncio driver of a directory lookup (`LookupRun`), with per-peer failure detection.

Each round asks its owners at once. An owner whose breaker is open (breaker.py) is asked an
item only once no other owner of it is left (`LookupRun.asks`' `avoid`). An owner that has not answered within its
hedge delay (`PeerHealth.hedge_after`) is given up on for this round, so the next owner is
asked too (a hedge); its call goes on, and if it answers before the lookup ends its reply is
merged in (`LookupRun.late`). Only when an item still has no holder once no owner is left is
the lookup held for the calls still out (to their timeout), so a hedge never turns a slow
owner's answer into "absent". Every call's outcome feeds the peer's breaker and latency.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from quilld.cluster.breaker import PeerHealth
from quilld.cluster.dir_lookup import LookupRun
from quilld.errors import QuillError

Call = Callable[[str, tuple, float], Awaitable[Any]]
FAILED = object()  # a call's outcome when it failed (the breaker has been told)


async def drive(run: LookupRun, call: Call, health: PeerHealth, timeout: float, msg: Callable[[list], tuple],
                stats: Counter, keep: set[asyncio.Task]) -> None:
    """Run `run` to its end: `call(owner, msg(items), timeout)` per owner per round. Calls still
    out when the lookup ends are kept in `keep` until they finish (their outcome still counts)."""
    slow: list[tuple[asyncio.Task, list[tuple[int, int]]]] = []  # (call given up on, its route)
    while asks := run.asks(time.monotonic(), health.avoid()):
        tasks = {owner: asyncio.ensure_future(_timed(call, owner, msg(items), timeout, health))
                 for owner, items in asks.items()}
        wait = max(health.hedge_after(o) for o in tasks)
        done, _ = await asyncio.wait(tasks.values(), timeout=wait)
        for owner, task in tasks.items():
            if task in done:
                reply = task.result()
                if reply is FAILED:
                    stats["lookup_failures"] += 1
                run.took(owner, None if reply is FAILED else reply)
                continue
            stats["lookup_hedged"] += 1
            slow.append((task, run.route_of(owner)))
            run.took(owner, None)
    # owners given up on: merge what they answered, and wait for them (for whichever answers
    # first, never one behind another) only while the answer still needs them
    pending = dict(slow)
    while pending:
        for task in [t for t in pending if t.done()]:
            route, reply = pending.pop(task), task.result()
            if reply is not FAILED:
                run.late(route, reply)
        if not pending or not run.unresolved():
            break
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        stats["lookup_hedges_won"] += 1
        keep.add(task)
        task.add_done_callback(keep.discard)


async def _timed(call: Call, owner: str, message: tuple, timeout: float, health: PeerHealth) -> Any:
    t0 = time.monotonic()
    try:
        reply = await call(owner, message, timeout)
    except (QuillError, ValueError, TypeError, asyncio.TimeoutError):
        health.failed(owner)
        return FAILED
    health.answered(owner, time.monotonic() - t0)
    return reply
