"""Per-peer failure detection for directory lookups, sans-IO: a circuit breaker and a hedge delay.

SWIM (swim.py) says whether a member is alive in the view; a peer can be alive there and still
not answer this node (SIGSTOPped, or a one-way partition). So each node also keeps, per peer,
what its own calls saw:
- a **breaker**: one call that failed or timed out opens it; while open the peer is skipped
  (its lookups go to the next owner at once) until `open_ms` has passed, then one call is let
  through as a probe (half-open): an answer closes it, a failure opens it again;
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
    probing: bool = False


class PeerHealth:
    def __init__(self, clock: Callable[[], float], stats: Counter, hedge_floor_ms: int = 30,
                 hedge_max_ms: int = 1000, open_ms: int = 1000) -> None:
        self.clock, self.stats = clock, stats
        self.floor, self.cap, self.open_for = hedge_floor_ms / 1000, hedge_max_ms / 1000, open_ms / 1000
        self.peers: dict[str, _Peer] = {}

    def _peer(self, peer: str) -> _Peer:
        p = self.peers.get(peer)
        if p is None:
            p = self.peers[peer] = _Peer()
        return p

    def allow(self, peer: str) -> bool:
        """Whether to call `peer` now: its breaker is closed, or it is the one half-open probe."""
        p = self.peers.get(peer)
        if p is None or not p.open_until:
            return True
        if p.probing or self.clock() < p.open_until:
            self.stats["breaker_skips"] += 1
            return False
        p.probing = True
        self.stats["breaker_probes"] += 1
        return True

    def answered(self, peer: str, seconds: float) -> None:
        p = self._peer(peer)
        if p.mean < 0:
            p.mean, p.dev = seconds, seconds / 2
        else:
            p.dev += (abs(seconds - p.mean) - p.dev) / 4
            p.mean += (seconds - p.mean) / 8
        if p.open_until:
            self.stats["breaker_closes"] += 1
        p.open_until, p.probing = 0.0, False

    def failed(self, peer: str) -> None:
        p = self._peer(peer)
        if not p.open_until or p.probing:
            self.stats["breaker_opens"] += 1
        p.open_until, p.probing = self.clock() + self.open_for, False

    def hedge_after(self, peer: str) -> float:
        """Seconds to wait for `peer` before the next owner is asked too."""
        p = self.peers.get(peer)
        if p is None or p.mean < 0:
            return self.floor
        return min(self.cap, max(self.floor, p.mean + 4 * p.dev))

    def forget(self, peer: str) -> None:
        self.peers.pop(peer, None)

    def open_peers(self) -> int:
        return sum(1 for p in self.peers.values() if p.open_until)
