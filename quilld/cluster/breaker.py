"""Per-peer failure detection for directory lookups, sans-IO: a circuit breaker and a hedge delay.

SWIM (swim.py) says whether a member is alive in the view; a peer can be alive there and still
not answer this node (SIGSTOPped, or a one-way partition). So each node also keeps, per peer,
what its own calls saw:
- a **breaker**: one call that failed or timed out opens it; while open the peer is asked only
  for items none of whose other owners is left (dir_lookup.py), until `open_ms` has passed;
  then the next lookups ask it again (half-open): an answer closes it, a failure reopens it;
- a **latency estimate** (smoothed mean and deviation, as TCP's RTO): `hedge_after` is
  mean + 4 deviations, at least `hedge_floor_ms` and at most `hedge_max_ms`. A lookup asks the
  next owner too once its owner has not answered by then (dir_link.py), so even the first
  stall is covered before any timeout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Peer:
    mean: float = -1.0  # seconds; < 0: no sample yet
    dev: float = 0.0
    open_until: float = 0.0  # > 0: the breaker is open (until then; a probe after)


class PeerHealth:
    def __init__(self, clock: Callable[[], float], stats: Counter, hedge_floor_ms: int = 30,
                 hedge_max_ms: int = 1000, open_ms: int = 1000) -> None:
        self.clock, self.stats = clock, stats
        self.floor, self.cap, self.open_for = hedge_floor_ms / 1000, hedge_max_ms / 1000, open_ms / 1000
        self.peers: dict[str, _Peer] = {}
        self.opened = 0  # peers whose breaker is open (or half-open)

    def _peer(self, peer: str) -> _Peer:
        p = self.peers.get(peer)
        if p is None:
            p = self.peers[peer] = _Peer()
        return p

    def avoid(self) -> set[str]:
        """Peers to skip now: breaker open and its probe not due. The first lookup after `open_ms`
        asks the peer again (the half-open probe): an answer closes it, a failure reopens it."""
        if not self.opened:
            return _NONE
        now = self.clock()
        out = {peer for peer, p in self.peers.items() if p.open_until > now}
        if out:
            self.stats["lookup_breaker_skips"] += 1
        return out

    def answered(self, peer: str, seconds: float) -> None:
        p = self._peer(peer)
        if p.mean < 0:
            p.mean, p.dev = seconds, seconds / 2
        else:
            p.dev += (abs(seconds - p.mean) - p.dev) / 4
            p.mean += (seconds - p.mean) / 8
        if p.open_until:
            self.stats["breaker_closes"] += 1
            self.opened -= 1
            p.open_until = 0.0

    def failed(self, peer: str) -> None:
        p = self._peer(peer)
        now = self.clock()
        if p.open_until <= now:  # closed, or a probe's call failed
            self.stats["breaker_opens"] += 1
        if not p.open_until:
            self.opened += 1
        p.open_until = now + self.open_for

    def hedge_after(self, peer: str) -> float:
        """Seconds to wait for `peer` before the next owner is asked too."""
        p = self.peers.get(peer)
        if p is None or p.mean < 0:
            return self.floor
        return min(self.cap, max(self.floor, p.mean + 4 * p.dev))

    def forget(self, peer: str) -> None:
        p = self.peers.pop(peer, None)
        if p is not None and p.open_until:
            self.opened -= 1

    def open_peers(self) -> int:
        return self.opened


_NONE: set[str] = set()
