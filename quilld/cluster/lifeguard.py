"""Lifeguard's two timers: dynamic suspicion timeouts and local health awareness.

Lifeguard (Dadgar, Phillips, Currey, "Lifeguard: Local Health Awareness for
More Accurate Failure Detection", 2018) makes SWIM slower to blame others
when the fault may be its own:

* A suspicion starts with a long timeout that shrinks, logarithmically, as
  independent confirmations arrive (suspect messages about the same member
  from distinct accusers). One slow or lossy accuser alone must wait the
  full `hi`; a member several nodes agree on dies after `lo`.
* A node that misses acks it should have received (or nacks from ping-req
  helpers, which prove its messages got out) raises its awareness score and
  stretches its own probe interval and timeout by `score + 1`.

Pure arithmetic; `swim.py` owns when these are consulted.
"""

from __future__ import annotations

import math

AWARENESS_MAX = 8  # memberlist's AwarenessMaxMultiplier: probes slow down at most 9x


def suspicion_bounds(mult: float, max_mult: float, n: int, interval: float) -> tuple[float, float]:
    """(lo, hi) suspicion timeouts in seconds for a cluster of `n` live members.

    lo = mult * max(1, log10(n + 1)) * interval, SWIM's "suspect for a few
    protocol periods, a little longer in larger clusters"; hi = max_mult * lo.
    """
    lo = mult * max(1.0, math.log10(n + 1)) * interval
    return lo, max_mult * lo


def expected_confirmations(mult: int, n: int) -> int:
    """How many independent confirmations shrink a suspicion to `lo`: mult - 2 (memberlist's k).

    Only n - 2 members besides the accuser and the suspect can confirm, so
    k is capped there (memberlist drops k to 0 instead, which in a 3-node
    cluster kills on a single lossy accuser's word after `lo`). With nobody
    left to confirm (n <= 2) the timeout is `lo` from the start.
    """
    return max(0, min(mult - 2, n - 2))


class Suspicion:
    """A timer on one suspected member, shortened by independent confirmations."""

    __slots__ = ("start", "lo", "hi", "k", "accusers", "deadline")

    def __init__(self, start: float, lo: float, hi: float, k: int, accuser: str) -> None:
        self.start, self.lo, self.hi, self.k = start, lo, hi, k
        self.accusers = {accuser}  # the first accuser is not a confirmation
        self.deadline = start + (hi if k >= 1 else lo)

    @property
    def confirmations(self) -> int:
        return len(self.accusers) - 1

    def confirm(self, accuser: str) -> bool:
        """Count a suspicion from `accuser`; True if it was new and moved the deadline."""
        if self.k < 1 or accuser in self.accusers or self.confirmations >= self.k:
            return False
        self.accusers.add(accuser)
        frac = math.log(self.confirmations + 1) / math.log(self.k + 1)
        self.deadline = self.start + max(self.lo, self.hi - frac * (self.hi - self.lo))
        return True


    def verdict(self) -> None:
        """The cluster's verdict came (a DEAD row in a push/pull table: some member's timer ran
        out): the suspect keeps only the shortest window to refute, `lo` from the start."""
        self.deadline = min(self.deadline, self.start + self.lo)


class Awareness:
    """Local health multiplier: 0 is healthy, AWARENESS_MAX is as unhealthy as it counts."""

    __slots__ = ("score", "max_score")

    def __init__(self, max_score: int = AWARENESS_MAX) -> None:
        self.score = 0
        self.max_score = max_score

    def apply(self, delta: int) -> None:
        self.score = min(self.max_score, max(0, self.score + delta))

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)
