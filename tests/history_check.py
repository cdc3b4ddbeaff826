"""A checker of histories of SET, DEL and GET against the pool's model for keys that change
(README, "One value per key": last writer wins by hybrid logical clock, tombstones for deletes).

A history is the operations clients ran, each with the times (one host's monotonic clock) it was
sent and answered, and the faults injected (kill, restart, partition, heal). Every value a test
writes is unique, so a read names the write it saw. Write w1 is *definitely before* w2 when w1
was answered more than SLACK_S before w2 was sent: then w2's node took a later wall-clock
millisecond than w1's, so w2's version is the higher one (the nodes share one host's clock; a
tie within a millisecond may go either way, which SLACK_S leaves out). A write that failed (no
answer: its node was killed, the link cut) may or may not have happened: any read may show it,
and it never makes another value old.

What `check` reports (a list of sentences, empty when the history is allowed):
- **invented**: a read returned a value no write of that key wrote;
- **from the future**: a read returned a value whose write was sent after the read was answered;
- **went back**: on one node, a read returned a value definitely before the value an earlier read
  on that node returned, with no kill in between (a kill can lose the newer value's only copy;
  then an older copy elsewhere is what the pool has, which the model allows);
- **stale too long**: a read returned a value definitely before a write answered more than
  STALE_S before the read was sent, with no fault since FAULT_QUIET_S before that write (without
  faults every node sees an answered write within STALE_S: directly from the owners, or once an
  owner tells a node with an older copy to drop it);
- at the end (`final`: what each node read of each key once the faults were over and the
  cluster converged): **disagree**, the nodes read different values; **lost**, they agree on
  something other than the last write (a write answered, its node never killed afterwards, and
  every other write of the key definitely before it): an older value, a deleted one back, or nil.

A miss (nil) during the run is always allowed: the pool is a cache, and a partition or a kill
makes misses.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

SLACK_S = 0.005
STALE_S = 2.0
FAULT_QUIET_S = 10.0


@dataclass(frozen=True)
class Op:
    kind: str  # "set", "del" or "get"
    node: str
    key: str
    value: str | None  # a set: the value written; a get: the value read (None: nil); a del: None
    start: float
    end: float
    ok: bool = True  # answered; False: a write whose fate is unknown (a failed get is left out)


@dataclass(frozen=True)
class Fault:
    kind: str  # "kill", "restart", "partition" or "heal"
    at: float
    node: str = ""


def _before(w1: Op, w2: Op) -> bool:
    """w1 is definitely before w2 (w2 answered, w1 answered SLACK_S before w2 was sent)."""
    return w1.ok and w2.ok and w1.end + SLACK_S < w2.start


def check(ops: list[Op], faults: list[Fault], final: dict[str, dict[str, str | None]] | None = None) -> list[str]:
    """Every way `ops` (and `final`: node -> key -> value, read after the faults) breaks the model."""
    bad: list[str] = []
    writes: dict[str, list[Op]] = defaultdict(list)
    by_value: dict[tuple[str, str], Op] = {}
    for op in ops:
        if op.kind in ("set", "del"):
            writes[op.key].append(op)
            if op.kind == "set":
                by_value[op.key, op.value] = op
    kills = sorted(f.at for f in faults if f.kind == "kill")
    fault_times = sorted(f.at for f in faults)

    def killed_between(t0: float, t1: float) -> bool:
        return any(t0 <= t <= t1 for t in kills)

    def quiet(t0: float, t1: float) -> bool:
        return not any(t0 - FAULT_QUIET_S <= t <= t1 for t in fault_times)

    last_seen: dict[tuple[str, str], tuple[Op, Op]] = {}  # (node, key) -> (the read, the write it saw)
    for r in sorted((op for op in ops if op.kind == "get"), key=lambda op: op.start):
        if r.value is None:
            continue
        w = by_value.get((r.key, r.value))
        if w is None:
            bad.append(f"invented: GET {r.key} on {r.node} at {r.start:.3f} read {r.value!r}, which nobody wrote")
            continue
        if w.start > r.end:
            bad.append(f"from the future: GET {r.key} on {r.node} read {r.value!r}, written after the read")
        seen = last_seen.get((r.node, r.key))
        if seen is not None:
            r0, w0 = seen
            if r0.end < r.start and _before(w, w0) and not killed_between(r0.end, r.start):
                bad.append(f"went back: GET {r.key} on {r.node} read {w.value!r} at {r.start:.3f} after reading "
                           f"the newer {w0.value!r} at {r0.start:.3f}")
        if seen is None or _before(seen[1], w):
            last_seen[r.node, r.key] = (r, w)
        for w2 in writes[r.key]:
            if _before(w, w2) and w2.end + STALE_S < r.start and quiet(w2.start, r.end):
                what = "a DEL" if w2.kind == "del" else f"SET {w2.value!r}"
                bad.append(f"stale too long: GET {r.key} on {r.node} at {r.start:.3f} read {w.value!r}, "
                           f"{r.start - w2.end:.1f} s after {what} on {w2.node} was answered")
                break
    if final is not None:
        bad += _check_final(writes, faults, final)
    return bad


def _check_final(writes, faults, final) -> list[str]:
    """The end state: every node reads the same value of each key, and where one write of the key
    is *unbeaten* (answered, its node never killed after it, every other write of the key
    definitely before it), that write's value (nil for a DEL)."""
    bad = []
    killed_at: dict[str, list[float]] = defaultdict(list)
    for f in faults:
        if f.kind == "kill":
            killed_at[f.node].append(f.at)
    for key in sorted({k for per in final.values() for k in per}):
        values = {node: per.get(key) for node, per in final.items()}
        if len(set(values.values())) > 1:
            bad.append(f"disagree: {key} reads {values} at the end")
            continue
        value = next(iter(values.values()))
        if value is not None and not any(w.kind == "set" and w.value == value for w in writes[key]):
            bad.append(f"invented: {key} reads {value!r} at the end, which nobody wrote")
            continue
        for w in writes[key]:
            unbeaten = (w.ok and not any(t >= w.start for t in killed_at[w.node])
                        and all(_before(w2, w) for w2 in writes[key] if w2 is not w))
            if unbeaten and (w.value if w.kind == "set" else None) != value:
                what = "a DEL" if w.kind == "del" else f"SET {w.value!r}"
                bad.append(f"lost: {key} reads {value!r} everywhere at the end, not the last write, "
                           f"{what} on {w.node}, whose node was never killed after it")
    return bad
