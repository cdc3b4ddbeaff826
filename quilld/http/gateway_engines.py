"""What the gateway keeps of its engines between requests: which cool down after a failure, the
leases of the legs they serve, and the blocks it recorded as prefilled where no KV event says so.

- Cooling: an engine that refused, reset, answered 5xx/429 or stayed silent cools down for
  ENGINE_COOLDOWN seconds: it is tried only when no other engine is left, and is healthy again
  as soon as it answers.
- Leases: each leg (a whole request, a prefill, a decode) holds a lease on its engine
  (index/engines.py) while it runs; `renew` pushes every held lease's deadline back, so a long
  stream keeps counting.
- Residencies: when an engine without KV events answers a prompt, its blocks are recorded as
  in its HBM (`record`), in a bounded LRU per engine (`gateway.recorded_blocks`): the engine
  evicts too, and nothing says what, so the oldest are forgotten first.

No sockets, no request: the stages of a request (quilld/http/gateway.py) share one book.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from quilld.config import EngineConfig
from quilld.index.control import ControlPlane
from quilld.scopes import NO_SCOPE

ENGINE_COOLDOWN = 3.0  # seconds a failed engine is passed over while others are left


class EngineBook:
    def __init__(self, control: ControlPlane, recorded_blocks: int, counts: Counter) -> None:
        self.control = control
        self.recorded_blocks = recorded_blocks
        self.counts = counts  # the gateway's counters (gateway_stats.py)
        self.cooling: dict[str, float] = {}  # engine id -> monotonic time its cooldown ends
        self.leases: set[str] = set()  # in-flight leases, renewed so a long stream keeps counting
        self._recorded: dict[str, OrderedDict] = {}  # engine -> (tag, block hash) it recorded, oldest first

    # -- cooling ----------------------------------------------------------------------------
    def cool(self, engine_id: str) -> None:
        self.cooling[engine_id] = time.monotonic() + ENGINE_COOLDOWN

    def is_cooling(self, engine_id: str, now: float) -> bool:
        return self.cooling.get(engine_id, 0.0) > now

    def healthy_first(self, engine_ids: Iterable[str]) -> list[str]:
        """`engine_ids` in their order, those cooling down last."""
        now = time.monotonic()
        return sorted(engine_ids, key=lambda e: self.is_cooling(e, now))

    def answered(self, engine_id: str) -> None:
        """The engine answered: healthy again, even if it was tried as a last resort."""
        self.cooling.pop(engine_id, None)

    def cooling_now(self) -> int:
        now = time.monotonic()
        return sum(1 for t in self.cooling.values() if t > now)

    # -- leases -----------------------------------------------------------------------------
    def take(self, engine_id: str, kind: str, tokens: int = 0) -> str:
        """A lease of `kind` on the engine (`tokens`: the uncached tokens it prefills), renewed until `give_back`."""
        lease = self.control.engines.acquire(engine_id, kind, tokens)
        self.leases.add(lease)
        return lease

    def give_back(self, lease: str) -> None:
        self.leases.discard(lease)
        self.control.engines.release(lease)

    @contextmanager
    def lease(self, engine_id: str, kind: str, tokens: int = 0) -> Iterator[str]:
        lease = self.take(engine_id, kind, tokens)
        try:
            yield lease
        finally:
            self.give_back(lease)

    def renew(self) -> None:
        renew = self.control.engines.renew
        for lease in self.leases:
            renew(lease)

    # -- residencies ------------------------------------------------------------------------
    def record(self, engine: EngineConfig, tag: bytes, blocks: list[int]) -> None:
        """`engine` holds the prompt's `blocks` (of scope `tag`) in its HBM now."""
        control = self.control
        if engine.kv_events or control.engines.engines.get(engine.id) is not engine:
            return  # its events are the authority, or it was removed or replaced meanwhile
        if tag == NO_SCOPE:
            return
        engine_id = engine.id
        self.counts["residencies_recorded"] += control.record(engine_id, tag, blocks)
        recorded = self._recorded.setdefault(engine_id, OrderedDict())
        for h in reversed(blocks):  # leading blocks last: a prefix is forgotten from its tail
            recorded[(tag, h)] = None
            recorded.move_to_end((tag, h))
        while len(recorded) > self.recorded_blocks:
            (old_tag, old_h), _ = recorded.popitem(last=False)
            control.unrecord(engine_id, old_tag, old_h)
            self.counts["residencies_forgotten"] += 1
