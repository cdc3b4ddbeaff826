"""Session affinity: which engine a session's last request went to, per tenant, bounded.

A request that names a session (ROUTE's `session`, the gateway's `x-quillcache-session`)
goes to the engine its session's last request went to, while that engine serves the
request's model; otherwise the router picks, and the session follows its pick.

The table is keyed by (tenant, session id): two tenants that happen to use the same id
never steer each other's requests, and one tenant cannot learn where another's sessions
went. It is bounded three ways, so that no caller can grow it without end:

- an id longer than `MAX_SESSION_ID_BYTES` (UTF-8) is refused (`SessionIdTooLong`);
- at most `max_sessions` entries (`gateway.session_max`): a new session past it evicts the
  least recently used one (counted in `evicted_full`);
- an entry unused for `idle_s` seconds (`gateway.session_idle_s`) is forgotten (counted in
  `evicted_idle`): when a lookup finds it, and by `sweep` (the control plane's
  housekeeping) otherwise.

Entries are kept in an OrderedDict in order of last use, so the least recently used is
always first: a full table and an idle sweep each pop from the front, in O(1) per entry. An
id is kept as its 16-byte BLAKE2b digest, so an entry costs the same (about 330 bytes with
the OrderedDict's own) whatever the id's length: 100,000 sessions hold about 33 MiB.
Pure: the caller supplies the clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from hashlib import blake2b

from quilld.errors import CommandError

# A session id is a handle (a UUID is 36 bytes, a conversation id rarely more than 64); 256
# leaves room for a prefixed or composite id. Longer ones are refused rather than hashed down
# in silence: a caller sending 32 KiB ids is sending something else. (aiohttp stops a header
# value at 8190 bytes, ROUTE's JSON at proto_max_bulk_len: far above any id.)
MAX_SESSION_ID_BYTES = 256
# Entries one sweep forgets at most (housekeeping sweeps 20 times a second): a table that went
# idle all at once empties over a few ticks instead of stalling one.
SWEEP_MAX = 4096


class SessionIdTooLong(CommandError):
    """A session id over MAX_SESSION_ID_BYTES: refused before anything is routed."""

    def __init__(self, size: int) -> None:
        super().__init__(f"session id of {size} bytes is too long (at most {MAX_SESSION_ID_BYTES})")


def check_session_id(session: str) -> None:
    """Raise SessionIdTooLong for an id over MAX_SESSION_ID_BYTES in UTF-8."""
    if len(session) * 4 > MAX_SESSION_ID_BYTES:  # only then can the UTF-8 form be too long
        try:  # RESP arguments keep bytes that are not UTF-8 as surrogate escapes: those count 1 each
            size = len(session.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:  # a lone surrogate from JSON ("\ud800"): 3 bytes, as CESU would
            size = len(session.encode("utf-8", "surrogatepass"))
        if size > MAX_SESSION_ID_BYTES:
            raise SessionIdTooLong(size)


def _digest(session: str) -> bytes:
    """A session id as the table keeps it: 16 bytes, whatever its length (ids never collide in practice)."""
    return blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionAffinity:
    """(tenant, session id) -> engine id, least recently used first, bounded in count and idle time."""

    __slots__ = ("max_sessions", "idle_s", "clock", "_engines", "evicted_full", "evicted_idle")

    def __init__(self, max_sessions: int, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.clock = clock
        # (tenant, digest of the session id) -> (engine, last use), least recently used first
        self._engines: OrderedDict[tuple[str, bytes], tuple[str, float]] = OrderedDict()
        self.evicted_full = 0  # entries dropped because the table was full
        self.evicted_idle = 0  # entries dropped after idle_s without use

    def get(self, tenant: str, session: str) -> str | None:
        """The engine of `tenant`'s `session`, or None (unknown, or idle too long: then forgotten)."""
        key = (tenant, _digest(session))
        entry = self._engines.get(key)
        if entry is None:
            return None
        if self.clock() - entry[1] > self.idle_s:
            del self._engines[key]
            self.evicted_idle += 1
            return None
        return entry[0]

    def put(self, tenant: str, session: str, engine: str) -> None:
        """`tenant`'s `session` went to `engine` now; the least recently used entry goes when full."""
        check_session_id(session)
        now = self.clock()
        engines = self._engines
        key = (tenant, _digest(session))
        engines[key] = (engine, now)
        engines.move_to_end(key)
        self._sweep(now)
        while len(engines) > self.max_sessions:
            engines.popitem(last=False)
            self.evicted_full += 1

    def sweep(self, most: int = SWEEP_MAX) -> int:
        """Forget the entries unused for idle_s, at most `most` of them; returns how many went."""
        return self._sweep(self.clock(), most)

    def _sweep(self, now: float, most: int = SWEEP_MAX) -> int:
        engines, oldest, n = self._engines, now - self.idle_s, 0
        while engines and n < most:
            key, (_, used) = next(iter(engines.items()))
            if used >= oldest:
                break
            del engines[key]
            n += 1
        self.evicted_idle += n
        return n

    def forget_engine(self, engine: str) -> int:
        """Drop every session of `engine` (it was removed); returns how many."""
        gone = [key for key, (e, _) in self._engines.items() if e == engine]
        for key in gone:
            del self._engines[key]
        return len(gone)

    def __len__(self) -> int:
        return len(self._engines)
