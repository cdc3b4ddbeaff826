"""Registered inference engines, their live in-flight load and their KV-event feeds' figures.

Load is counted by leases: `acquire` (ROUTE ... ACQUIRE) adds one request to an
engine and returns a lease id; `release` takes it back. A lease not released
within the timeout expires, so a lost release cannot pin load forever.

A lease has a kind, so that prefill and decode load are kept apart (the pair
decision reads each where it belongs, index/pairing.py): a `request` lease is a
whole request on one engine (it prefills `tokens` uncached tokens, then decodes;
`prefilled` says when its prefill is done), a `prefill` lease a disaggregated
request's prefill (its `tokens`), a `decode` lease its decode. `in_flight`
counts every lease, as the router's cost always has.

In a cluster the leases of an engine are held on whichever nodes routed to it: each node
advertises its own (`own_loads`) and hands the sum of its peers' to `set_remote`; the
counters `load()`, `in_flight` and the others answer with both, so every node's router
weighs the same load.

Each engine has a `FeedStats`: what its KV events did (batches, events, malformed,
gaps, replays, restarts, missed batches, the last sequence number), kept by whoever
feeds it (the ZMQ subscriber, or POST /v1/kv-events and KVEVENTS) and shown per engine
by INFO router, /v1/engines, /v1/stats and /metrics.

Who may feed an engine's KV events (`event_sender`, the one check used by KVEVENTS and
POST /v1/kv-events): the operator (RESP user `default`, and the admin API, whose callers
hold the admin token) and the engine's own tenant (its `tenant` in the engines config:
the engine logs in with that user's credential). Another tenant's events would rewrite
where ROUTE sends requests that are not its own: NOPERM, and the same NOPERM whether the
engine exists or not, so a tenant cannot probe other tenants' engine ids.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from typing import NamedTuple

from quilld.config import EngineConfig
from quilld.errors import CommandError, NoPerm

FEED_COUNTERS = ("batches", "events", "malformed", "gaps", "missed", "replays", "restarts", "drops", "duplicates",
                 "errors")
OPERATOR = "default"  # the user whose commands change the node for every tenant
# The node-wide counters (INFO stats) that sum one of them over every engine.
_TOTALS = {"batches": "kv_batches", "events": "kv_events", "malformed": "kv_malformed"}


class FeedStats:
    """One engine's KV-event feed: counters, the last sequence number, and when it last heard anything.

    `gaps` counts holes seen in the sequence, `replays` the replays that filled one (or
    caught up after a start or reconnect), `missed` the batches lost for good, `restarts`
    the publisher restarts detected, `drops` the times the engine's residencies were
    dropped because of either. Adding to batches, events or malformed also adds to the
    node-wide `totals` (kv_batches, kv_events, kv_malformed).
    """

    __slots__ = ("counts", "totals", "last_seq", "last_heard", "started", "state", "idle_warned", "groups")

    def __init__(self, totals: Counter[str] | None = None, clock=time.monotonic) -> None:
        self.counts: dict[str, int] = dict.fromkeys(FEED_COUNTERS, 0)
        self.totals = totals
        self.last_seq: int | None = None
        self.last_heard: float | None = None  # monotonic time of the last message, of any kind
        self.started = clock()
        self.state = "new"  # new, waiting, catching_up, live (the ZMQ feed's phase)
        self.idle_warned = False
        self.groups: dict[int, str] = {}  # KV-cache group -> its kind, as the engine's events name them

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n
        total = _TOTALS.get(name)
        if total is not None and self.totals is not None:
            self.totals[total] += n

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def idle_s(self, now: float) -> float:
        """Seconds since the feed last heard anything (since it started, if never)."""
        return now - (self.last_heard if self.last_heard is not None else self.started)

    def as_dict(self, now: float) -> dict:
        return dict(self.counts, last_seq=self.last_seq, state=self.state, idle_s=round(self.idle_s(now), 3),
                    groups={str(g): kind for g, kind in sorted(self.groups.items())})


LEASE_KINDS = ("request", "prefill", "decode")


class Load(NamedTuple):
    """One engine's in-flight work, from its leases."""

    requests: int = 0  # every lease (the router's in-flight count)
    prefills: int = 0  # leases still prefilling: prefill leases, and request leases before `prefilled`
    prefill_tokens: int = 0  # the uncached tokens those still have to prefill
    decodes: int = 0  # leases decoding or about to: decode leases and request leases


class _Lease:
    __slots__ = ("engine", "deadline", "kind", "tokens", "prefilling")

    def __init__(self, engine: str, deadline: float, kind: str, tokens: int) -> None:
        self.engine, self.deadline, self.kind, self.tokens = engine, deadline, kind, tokens
        self.prefilling = kind != "decode"


class EngineRegistry:
    def __init__(self, engines: tuple[EngineConfig, ...] = (), lease_timeout_ms: int = 60_000) -> None:
        self.engines: dict[str, EngineConfig] = {e.id: e for e in engines}
        self.lease_timeout = lease_timeout_ms / 1000
        self.in_flight: Counter[str] = Counter()
        self.prefills: Counter[str] = Counter()
        self.prefill_tokens: Counter[str] = Counter()
        self.decodes: Counter[str] = Counter()
        self._leases: dict[str, _Lease] = {}
        self._remote: dict[str, Load] = {}  # engine -> the load its leases on other nodes add (a cluster's)
        self.expired_leases = 0
        self._ids_of: dict[str, list[str]] = {}  # model -> its engines' ids (ROUTE's), until add or remove
        # engine -> where it stands among its model's candidates: registration order, or in a
        # cluster the order of the engine table's versions, the same on every node
        self._rank: dict[str, tuple] = {e.id: (0, "", i) for i, e in enumerate(engines)}
        self._added = len(engines)
        self._roles_of: dict[str, bool] = {}  # model -> whether any of its engines has a role but `both`

    def add(self, engine: EngineConfig, rank: tuple | None = None) -> bool:
        """Register or replace an engine; True when it is new. `rank` (int, str, int): where it
        stands among its model's candidates (default: after every engine registered so far)."""
        new = engine.id not in self.engines
        self.engines[engine.id] = engine
        if rank is None:
            self._added += 1
            rank = (0, "", self._added)
        self._rank[engine.id] = rank
        self._ids_of.clear()
        self._roles_of.clear()
        return new

    def remove(self, engine_id: str) -> EngineConfig:
        engine = self.engines.pop(engine_id, None)
        self._rank.pop(engine_id, None)
        self._ids_of.clear()
        self._roles_of.clear()
        if engine is None:
            raise CommandError(f"no engine {engine_id!r}")
        for lease, held in list(self._leases.items()):
            if held.engine == engine_id:
                del self._leases[lease]
        for counts in (self.in_flight, self.prefills, self.prefill_tokens, self.decodes):
            counts.pop(engine_id, None)
        self._remote.pop(engine_id, None)
        return engine

    def _counters(self) -> tuple[Counter[str], ...]:
        return self.in_flight, self.prefills, self.prefill_tokens, self.decodes

    def set_remote(self, loads: dict[str, Load]) -> None:
        """The load other nodes' leases put on each engine (their sum; engines not named: none);
        replaces what was set before. Engines not registered here are left out."""
        counters = self._counters()
        for engine_id, old in self._remote.items():
            for counts, n in zip(counters, old):
                counts[engine_id] -= n
        self._remote = {e: Load(*load) for e, load in loads.items() if e in self.engines and any(load)}
        for engine_id, new in self._remote.items():
            for counts, n in zip(counters, new):
                counts[engine_id] += n

    def remote_load(self, engine_id: str) -> Load:
        return self._remote.get(engine_id, Load())

    def own_loads(self) -> dict[str, Load]:
        """The load of this node's own leases, per engine that has any."""
        out = {}
        for engine_id, total in self.in_flight.items():
            remote = self._remote.get(engine_id)
            own = self.load(engine_id) if remote is None else Load(*(a - b for a, b in zip(self.load(engine_id),
                                                                                             remote)))
            if own.requests > 0:
                out[engine_id] = own
        return out

    def has_roles(self, model: str) -> bool:
        """Whether any engine of `model` is a prefill or a decode engine (then ROUTE decides a pair)."""
        roles = self._roles_of.get(model)
        if roles is None:
            if len(self._roles_of) >= 1024:
                self._roles_of.clear()
            roles = self._roles_of[model] = any(e.role != "both" for e in self.engines.values() if e.model == model)
        return roles

    def load(self, engine_id: str) -> Load:
        return Load(self.in_flight[engine_id], self.prefills[engine_id], self.prefill_tokens[engine_id],
                    self.decodes[engine_id])

    def get(self, engine_id: str) -> EngineConfig:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise CommandError(f"no engine {engine_id!r}")
        return engine

    def event_sender(self, engine_id: str, user: str) -> EngineConfig:
        """The engine whose KV events `user` sends (the operator's user for the admin API), or
        NoPerm when `user` is neither the operator nor the engine's tenant."""
        engine = self.engines.get(engine_id)
        if user != OPERATOR and (engine is None or engine.tenant != user):
            raise NoPerm(f"user '{user}' may not send KV events for engine '{engine_id}': only the operator "
                         f"(user default, or the admin API) and the engine's own tenant may")
        return self.get(engine_id)

    def for_model(self, model: str) -> list[EngineConfig]:
        return [e for e in self.engines.values() if e.model == model]

    def ids_for_model(self, model: str) -> list[str]:
        """The ids of `model`'s engines, in rank order (registration order; kept until an engine is added or
        removed; the caller must not change the list)."""
        ids = self._ids_of.get(model)
        if ids is None:
            if len(self._ids_of) >= 1024:  # models named by requests, most with no engine
                self._ids_of.clear()
            rank = self._rank
            ids = self._ids_of[model] = sorted((e.id for e in self.engines.values() if e.model == model),
                                               key=lambda e: rank.get(e, ()))
        return ids

    def acquire(self, engine_id: str, kind: str = "request", tokens: int = 0) -> str:
        """A lease of `kind` (LEASE_KINDS) on the engine; `tokens`: the uncached tokens it prefills."""
        lease = secrets.token_hex(8)
        held = self._leases[lease] = _Lease(engine_id, time.monotonic() + self.lease_timeout, kind, tokens)
        self.in_flight[engine_id] += 1
        if held.prefilling:
            self.prefills[engine_id] += 1
            self.prefill_tokens[engine_id] += tokens
        if kind != "prefill":
            self.decodes[engine_id] += 1
        return lease

    def prefilled(self, lease: str) -> bool:
        """The lease's prefill is done (a request's first byte): its tokens no longer count as queued."""
        held = self._leases.get(lease)
        if held is None or not held.prefilling:
            return False
        self._done_prefilling(held)
        return True

    def _done_prefilling(self, held: _Lease) -> None:
        held.prefilling = False
        self.prefills[held.engine] -= 1
        self.prefill_tokens[held.engine] -= held.tokens

    def renew(self, lease: str) -> bool:
        """Push a live lease's deadline back (a long stream is still in flight)."""
        held = self._leases.get(lease)
        if held is None:
            return False
        held.deadline = time.monotonic() + self.lease_timeout
        return True

    def release(self, lease: str) -> bool:
        held = self._leases.pop(lease, None)
        if held is None:
            return False
        self.in_flight[held.engine] -= 1
        if held.prefilling:
            self._done_prefilling(held)
        if held.kind != "prefill":
            self.decodes[held.engine] -= 1
        return True

    def expire(self) -> int:
        """Drop leases past their deadline (called periodically)."""
        now = time.monotonic()
        late = [lease for lease, held in self._leases.items() if held.deadline < now]
        for lease in late:
            self.release(lease)
        self.expired_leases += len(late)
        return len(late)
