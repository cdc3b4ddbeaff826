"""Registered inference engines and their live in-flight load.

Load is counted by leases: `acquire` (ROUTE ... ACQUIRE) adds one request to an
engine and returns a lease id; `release` takes it back. A lease not released
within the timeout expires, so a lost release cannot pin load forever.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter

from quilld.config import EngineConfig
from quilld.errors import CommandError


class EngineRegistry:
    def __init__(self, engines: tuple[EngineConfig, ...] = (), lease_timeout_ms: int = 60_000) -> None:
        self.engines: dict[str, EngineConfig] = {e.id: e for e in engines}
        self.lease_timeout = lease_timeout_ms / 1000
        self.in_flight: Counter[str] = Counter()
        self._leases: dict[str, tuple[str, float]] = {}  # lease id -> (engine, deadline)
        self.expired_leases = 0

    def add(self, engine: EngineConfig) -> bool:
        """Register or replace an engine; True when it is new."""
        new = engine.id not in self.engines
        self.engines[engine.id] = engine
        return new

    def remove(self, engine_id: str) -> EngineConfig:
        engine = self.engines.pop(engine_id, None)
        if engine is None:
            raise CommandError(f"no engine {engine_id!r}")
        for lease, (owner, _) in list(self._leases.items()):
            if owner == engine_id:
                del self._leases[lease]
        self.in_flight.pop(engine_id, None)
        return engine

    def get(self, engine_id: str) -> EngineConfig:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise CommandError(f"no engine {engine_id!r}")
        return engine

    def for_model(self, model: str) -> list[EngineConfig]:
        return [e for e in self.engines.values() if e.model == model]

    def acquire(self, engine_id: str) -> str:
        lease = secrets.token_hex(8)
        self._leases[lease] = (engine_id, time.monotonic() + self.lease_timeout)
        self.in_flight[engine_id] += 1
        return lease

    def renew(self, lease: str) -> bool:
        """Push a live lease's deadline back (a long stream is still in flight)."""
        entry = self._leases.get(lease)
        if entry is None:
            return False
        self._leases[lease] = (entry[0], time.monotonic() + self.lease_timeout)
        return True

    def release(self, lease: str) -> bool:
        entry = self._leases.pop(lease, None)
        if entry is None:
            return False
        self.in_flight[entry[0]] -= 1
        return True

    def expire(self) -> int:
        """Drop leases past their deadline (called periodically)."""
        now = time.monotonic()
        late = [lease for lease, (_, deadline) in self._leases.items() if deadline < now]
        for lease in late:
            self.release(lease)
        self.expired_leases += len(late)
        return len(late)
