"""One directory lookup's rounds through the owners, sans-IO: the loop `dir_link.py` drives on the
event loop and the simulation (simulation.py) on its virtual clock, so both run the same code."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quilld.cluster.dir_entries import BLOCK, KEY, TOMBSTONE, key_shard

if TYPE_CHECKING:
    from quilld.cluster.directory import Directory


class LookupRun:
    """One lookup of `items` through their owners, sans-IO: the asyncio shell (dir_link.py) and
    the simulation drive this same loop, round by round.

    Each round (`asks`) sends every pending item to its next owner not asked yet (this node
    answers what it owns itself); `took` hands each owner's reply back (None: it failed). What
    an owner could not answer fully (it failed, or its bucket is filling) stays pending for the
    next, until one has or every owner in the view, and during a handoff every old owner still
    a member, has been asked: only then is an item absent. Each round asks owners not asked
    before, so it ends. `answers()`: for a key [(holder, code, version)] of its newest
    version (`newest`), for a segment [[(holder, code)] per block]; `misses` counts the items left with no holder that an owner
    answered fully, `unreachable` those no owner could answer (one at least failed)."""

    def __init__(self, d: Directory, items: list[tuple]) -> None:
        self.d, self.items = d, items
        self._answers: dict[int, Any] = {}
        self._asked: dict[int, set[str]] = {}
        self._full: set[int] = set()
        self._failed: set[int] = set()
        self._pending = list(range(len(items)))
        self._route: dict[int, tuple[str, int]] = {}
        self._again: list[int] = []
        self.trips = self.rounds = 0
        self.misses = self.unreachable = 0

    def asks(self, now: float, avoid: frozenset[str] | set[str] = frozenset()) -> dict[str, list]:
        """The owners to ask this round, each with its items; empty once the lookup is done.
        `avoid`: owners to ask an item of only once none of its other owners is left (their
        breakers are open, breaker.py); empty on the common path, which then costs nothing more."""
        self._pending = [i for i in self._again if i not in self._full] if self.rounds else self._pending
        self._again = []
        if not self._pending:
            return {}
        pending, me = self._pending, self.d.node_id
        asked = {j: self._asked.get(i, set()) for j, i in enumerate(pending)}
        if avoid:
            for j, i in enumerate(pending):
                item = self.items[i]
                left = [o for o in self.d.owners_to_ask(key_shard(item[1]) if item[0] == KEY else item[1])
                        if o not in asked[j]]
                if any(o not in avoid for o in left):
                    asked[j] = asked[j] | (avoid & set(left))
        plan = self.d.plan([self.items[i] for i in pending], asked, now)
        for j, (answer, partial) in plan.local.items():
            i = pending[j]
            self._asked.setdefault(i, set()).add(me)
            self._answers[i] = merge(self.items[i][0], self._answers.get(i), answer)
            if not partial:
                self._full.add(i)
        self._route = {pending[j]: where for j, where in plan.route.items()}
        if plan.asks:
            self.rounds += 1
            self.trips += len(plan.asks)
        else:
            self._pending = []
        return plan.asks

    def route_of(self, owner: str) -> list[tuple[int, int]]:
        """This round's items asked of `owner`: (item, index in its ask), for a late reply."""
        return [(i, k) for i, (o, k) in self._route.items() if o == owner]

    def late(self, route: list[tuple[int, int]], reply: tuple) -> None:
        """The reply of an owner an earlier round gave up waiting for (the lookup hedged to the
        next owner): what it holds is merged in, nothing is asked again."""
        for i, k in route:
            answer, partial = reply[1][k]
            self._answers[i] = merge(self.items[i][0], self._answers.get(i), answer)
            if not partial:
                self._full.add(i)

    def unresolved(self) -> bool:
        """Whether some item has no holder yet that no owner answered fully."""
        for i, item in enumerate(self.items):
            answer = self._answers.get(i)
            if i not in self._full and not (answer and (item[0] != BLOCK or any(answer))):
                return True
        return False

    def took(self, owner: str, reply: tuple | None) -> None:
        """`owner`'s reply to this round's LOOKUP (None: it failed, could not be reached, or
        was given up on for now: the lookup hedged to the next owner)."""
        for i, (o, k) in self._route.items():
            if o != owner:
                continue
            self._asked.setdefault(i, set()).add(owner)
            if reply is None:
                self._failed.add(i)
                self._again.append(i)
                continue
            answer, partial = reply[1][k]
            self._answers[i] = merge(self.items[i][0], self._answers.get(i), answer)
            if partial:
                self._again.append(i)
            else:
                self._full.add(i)

    def answers(self) -> list:
        """Every item's answer (none found: empty), the misses counted."""
        items, out = self.items, []
        for i, item in enumerate(items):
            answer = self._answers.get(i, [] if item[0] == KEY else [[] for _ in item[2]])
            if item[0] == KEY and answer:
                answer = newest(answer)
            out.append(answer)
            if not (any(answer) if item[0] == BLOCK else answer):
                if i in self._full or i not in self._failed:
                    self.misses += 1
                else:
                    self.unreachable += 1
        return out


def merge(kind: int, a: Any, b: Any) -> Any:
    """Two owners' answers to one item, together (a key's holders, or a segment's, block by block)."""
    if a is None:
        return b
    if kind == BLOCK:
        return [union(x, y) for x, y in zip(a, b)]
    return union(a, b)


def union(a: list, b: list) -> list:
    """Two lists of holders (tuples, or lists off the wire), each holder once."""
    seen = {tuple(x) for x in a}
    return [tuple(x) for x in a] + [t for t in map(tuple, b) if t not in seen]


def newest(holders: list) -> list:
    """A key's holders as its owners answered, (holder, code, version) each: those of its newest
    version, none when that is a delete (a tombstone wins a tie, and every owner and asker
    decides the same)."""
    top = max(h[2] for h in holders)
    best = [tuple(h) for h in holders if h[2] == top]
    if any(h[1] == TOMBSTONE for h in best):
        return []
    return best
