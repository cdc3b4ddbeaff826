"""The retransmit queue: membership updates waiting to be piggy-backed.

SWIM spreads news by infection: every update a node accepts is attached to
its next outgoing pings, acks and ping-reqs, each time to a different peer,
until it has gone out `limit` times (about lambda * log(n + 1); after that,
with high probability, everyone has it and push/pull mops up the rest).

At most one update per member is queued: a newer update about the same
member replaces the older one and starts again at zero transmissions (the
caller only queues updates that won by SWIM's precedence rules, so the
newest is always the one worth sending). Selection takes membership news
(joins, suspicions, deaths, leaves, refutations: `urgent`) before meta-only
refreshes, then the least-sent updates first, newest first among equals, so
fresh news is never starved by old news and a busy cluster's meta, changing
every probe interval on every node, never crowds failure news out of the
packets; it fills a packet greedily up to a byte budget.
"""

from __future__ import annotations

from typing import Any


class _Item:
    __slots__ = ("update", "size", "sent", "order", "rank")

    def __init__(self, update: Any, size: int, order: int, urgent: bool) -> None:
        self.update, self.size, self.sent, self.order = update, size, 0, order
        self.rank = 0 if urgent else 1


class BroadcastQueue:
    prioritize = True  # membership news before meta refreshes (bench/gossip_news_sim.py compares without)

    def __init__(self) -> None:
        self._items: dict[str, _Item] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, key: str, update: Any, size: int, urgent: bool = True) -> None:
        """Queue `update` (encoded `size` bytes) as the news about member `key`; `urgent` unless it
        only refreshes an alive member's meta or address."""
        self._order += 1
        self._items[key] = _Item(update, size, self._order, urgent or not self.prioritize)

    def select(self, room: int, limit: int, max_count: int) -> list[Any]:
        """Up to `max_count` updates totalling at most `room` bytes, counted as sent once.

        An update sent `limit` times leaves the queue.
        """
        if not self._items or room <= 0:
            return []
        ranked = sorted(self._items.items(), key=lambda kv: (kv[1].rank, kv[1].sent, -kv[1].order))
        out = []
        for key, item in ranked:
            if item.size > room:
                continue
            room -= item.size
            out.append(item.update)
            item.sent += 1
            if item.sent >= limit:
                del self._items[key]
            if len(out) >= max_count or room <= 0:
                break
        return out

    def pending(self) -> list[Any]:
        """The queued updates, for tests and introspection."""
        return [item.update for item in self._items.values()]
