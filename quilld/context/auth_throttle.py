"""Failed logins counted per user name and per client address, and how long the next attempt waits.

One `AuthThrottle` per node (`NodeContext.auth_throttle`) serves RESP's AUTH and HELLO ...
AUTH (protocol/commands/connection.py says how the delays are applied; it never refuses)
and may serve any other door that checks users' passwords; cluster peers' PEERAUTH keeps one
of its own. Pure bookkeeping on a clock the caller passes: no I/O, no event loop.

Only failures are answered late. Since a right password is answered at once, an attempt that
is not answered at once is known to have failed: a guesser need not wait for the answer, and
could close the connection and try again on a new one. So the failures still waiting for their
answer count, per address and per user name, and once one of them has AUTH_UNANSWERED such,
a further attempt from there (or for that user) is not checked until the first of them has been
answered, nor later than auth_delay_max_ms after it came: a guesser learns at most
AUTH_UNANSWERED answers per delay from an address, however many connections it opens.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Any

from quilld.config import SecurityConfig

AUTH_THROTTLE_KEYS = 65536  # user names, and addresses, whose failures are remembered (oldest forgotten first)
AUTH_DELAY_FIRST = 0.05  # seconds: the first throttled attempt's delay; each failure doubles it
AUTH_UNANSWERED = 8  # failures from one address (for one user) waiting for their answer before further attempts wait


class _Failures:
    __slots__ = ("count", "last")

    def __init__(self) -> None:
        self.count = 0  # failures within the window
        self.last = 0.0  # when the last one happened


class _FailureLog:
    """Failures per key (a user name, or an address), the oldest key forgotten first past
    AUTH_THROTTLE_KEYS, and each key once it has been quiet for a whole window."""

    def __init__(self) -> None:
        self._by_key: OrderedDict[Any, _Failures] = OrderedDict()

    def count(self, cfg: SecurityConfig, key: Any, now: float) -> int:
        f = self._by_key.get(key)
        if f is None:
            return 0
        if now - f.last > cfg.auth_throttle_window_ms / 1000:
            del self._by_key[key]  # quiet for a whole window: starts afresh
            return 0
        return f.count

    def failed(self, cfg: SecurityConfig, key: Any, now: float) -> None:
        if not self.count(cfg, key, now):
            self._by_key.pop(key, None)
            if len(self._by_key) >= AUTH_THROTTLE_KEYS:
                self._by_key.popitem(last=False)
            f = self._by_key[key] = _Failures()
        else:
            f = self._by_key[key]
            self._by_key.move_to_end(key)
        f.count += 1
        f.last = now

    def slowed(self, after: int) -> int:
        return sum(1 for f in self._by_key.values() if f.count >= after)


class AuthThrottle:
    """Failed attempts per user name and per client address: how late a failure is answered,
    and how long a new attempt waits before it is checked."""

    def __init__(self) -> None:
        self._users = _FailureLog()
        self._addrs = _FailureLog()
        # key -> answer times (monotonic, ascending) of its failures not answered yet
        self._unanswered: dict[Any, list[float]] = {}

    def delay(self, cfg: SecurityConfig, user: bytes, addr: str, now: float) -> float:
        """Seconds a failure for `user` from `addr` now would be answered late (0: at once): the
        longer of the two keys' delays, at most auth_delay_max_ms."""
        after = cfg.auth_throttle_after
        if not after:
            return 0.0
        n = max(self._users.count(cfg, user, now), self._addrs.count(cfg, addr, now))
        if n < after:
            return 0.0
        return min(cfg.auth_delay_max_ms / 1000, AUTH_DELAY_FIRST * 2.0 ** min(n - after, 32))

    def failed(self, cfg: SecurityConfig, user: bytes, addr: str, now: float) -> float:
        """Count a failure; the seconds its answer waits (`delay`, as it was before this one)."""
        late = self.delay(cfg, user, addr, now)
        self._users.failed(cfg, user, now)
        self._addrs.failed(cfg, addr, now)
        if late:
            if len(self._unanswered) >= AUTH_THROTTLE_KEYS:
                self._forget_answered(now)
            for key in ((0, user), (1, addr)):
                bisect.insort(self._unanswered.setdefault(key, []), now + late)
        return late

    def admit_in(self, cfg: SecurityConfig, user: bytes, addr: str, now: float) -> float:
        """Seconds before an attempt for `user` from `addr` may be checked (0: now): until the
        first unanswered failure of a key holding AUTH_UNANSWERED of them is answered."""
        wait = 0.0
        for key in ((0, user), (1, addr)):
            times = self._unanswered.get(key)
            if times is None:
                continue
            while times and times[0] <= now:
                del times[0]
            if not times:
                del self._unanswered[key]
            elif len(times) >= AUTH_UNANSWERED:
                wait = max(wait, times[len(times) - AUTH_UNANSWERED] - now)
        return wait

    def _forget_answered(self, now: float) -> None:
        for key in [k for k, times in self._unanswered.items() if times[-1] <= now]:
            del self._unanswered[key]

    def throttled(self, cfg: SecurityConfig) -> int:
        """User names and addresses whose failures are answered late now (for tests)."""
        return self._users.slowed(cfg.auth_throttle_after) + self._addrs.slowed(cfg.auth_throttle_after)
