"""The control plane: engines, their KV-event residencies, hot prefixes and routing.

Identity: an engine's cached blocks are recorded under the scope (engine's
tenant, model, tokenizer, LoRA name from the event). A ROUTE request is scored
only against residencies of its own full scope, so a block cached for one
identity never earns credit for another; a request whose first block exists
only under another scope is counted as a guard refusal.

Block hashes given as token ids are chained here with xxhash (each block's hash
covers the previous hash and its tokens), so equal prefixes give equal leading
hashes. They match what quilld's own clients and gateway send, not vLLM's
internal hashes; engines' events carry vLLM's hashes.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import xxhash

from quilld.config import Config, EngineConfig
from quilld.index.engines import EngineRegistry
from quilld.index.events import Batch, Cleared, Removed, Stored, medium_tier
from quilld.index.residency import ResidencyIndex, hash_key
from quilld.index.router import CostWeights, Decision, choose
from quilld.index.sketch import HotPrefixes
from quilld.index.subscriber import KvEventSubscriber
from quilld.model import IdentityScope
from quilld.scopes import ScopeRegistry

log = logging.getLogger("quilld.index.control")


def chain_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Prefix-preserving block hashes of the full blocks of `tokens`."""
    out, prev = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxhash.xxh64(prev)
        h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens[start:start + block_size]))
        value = h.intdigest()
        out.append(value)
        prev = value.to_bytes(8, "big")
    return out


class ControlPlane:
    def __init__(self, cfg: Config, scopes: ScopeRegistry) -> None:
        self.scopes = scopes
        self.index = ResidencyIndex(scopes)
        self.engines = EngineRegistry(cfg.engines, cfg.router.lease_timeout_ms)
        self.hot = HotPrefixes()
        r = cfg.router
        self.weights = CostWeights(prefill_load_scale=r.prefill_load_scale,
                                   active_request_weight=r.active_request_weight, temperature=r.temperature,
                                   storage_credit=r.storage_credit)
        self.affinity: dict[str, str] = {}  # session id -> engine id
        self.stats: Counter[str] = Counter()
        self._tags: dict[str, set[bytes]] = {}  # engine id -> scope tags its blocks were stored under
        self._subscribers: dict[str, Any] = {}  # engine id -> its KV-event subscriber
        self.pool: list[str] = []  # pool node ids (this node, then peers) holding blocks ROUTE can fetch

    # -- engine events --------------------------------------------------------
    def engine_tag(self, engine_id: str, adapter: str | None) -> bytes:
        e = self.engines.get(engine_id)
        return self.scopes.tag(IdentityScope(e.tenant, e.model, e.tokenizer, adapter or ""))

    def apply(self, engine_id: str, batch: Batch) -> int:
        """Apply one decoded batch of `engine_id`'s events; returns the events applied."""
        index = self.index
        for ev in batch.events:
            if type(ev) is Stored:
                tag, tier = self.engine_tag(engine_id, ev.lora_name), medium_tier(ev.medium)
                self._tags.setdefault(engine_id, set()).add(tag)
                for h in ev.block_hashes:
                    index.put(tag, h, engine_id, tier)
            elif type(ev) is Removed:  # events name no adapter: try every scope the engine used
                tier = medium_tier(ev.medium)
                for tag in self._tags.get(engine_id, ()):
                    for h in ev.block_hashes:
                        index.remove(tag, h, engine_id, tier)
            elif type(ev) is Cleared:
                index.clear_holder(engine_id)
        self.stats["kv_batches"] += 1
        self.stats["kv_events"] += len(batch.events)
        return len(batch.events)

    def on_gap(self, engine_id: str, missing: int) -> None:
        """Events were lost: what we know of this engine may be wrong, so forget it."""
        dropped = self.index.clear_holder(engine_id)
        self.stats["kv_gaps"] += 1
        log.warning("engine %s: %d KV events lost, dropped its %d residencies", engine_id, missing, dropped)

    # -- routing ----------------------------------------------------------------
    def route(self, scope: IdentityScope, tag: bytes, blocks: list, decode_blocks: float = 0.0,
              session: str | None = None, acquire: bool = False) -> Decision:
        """The engine for a request of `scope` (its `tag`) over `blocks`, with its URL and, with
        `acquire`, an in-flight lease on it (give it back with `engines.release`)."""
        engines = [e.id for e in self.engines.for_model(scope.model)]
        if blocks:
            self.hot.add(hash_key(blocks[0]))
        if session and self.affinity.get(session) in engines:
            engines_considered = [self.affinity[session]]
        else:
            engines_considered = engines
        decision = choose(self.index, tag, blocks, engines_considered, self.pool, self.engines.in_flight,
                          decode_blocks, self.weights)
        if blocks and not any(c.overlap_blocks for c in decision.candidates):
            other = self.index.held_elsewhere(tag, blocks[0])
            if other is not None:
                self.scopes.refused(tag, other)
        self.stats["routes"] += 1
        if decision.engine is None:
            return decision
        engine = self.engines.get(decision.engine)
        if session:
            self.affinity[session] = engine.id
        return Decision(decision.engine, decision.cost, decision.candidates, decision.plan, engine.url,
                        self.engines.acquire(engine.id) if acquire else None)

    # -- engines and their subscriptions ------------------------------------------
    async def add_engine(self, engine: EngineConfig) -> bool:
        """Register an engine and follow its KV events; True when it is new.

        Replacing an engine forgets what was known of the old one.
        """
        if engine.id in self.engines.engines:
            await self.remove_engine(engine.id)
            new = False
        else:
            new = True
        self.engines.add(engine)
        if engine.kv_events:
            sub = KvEventSubscriber(engine.id, engine.kv_events, self.apply, self.on_gap, engine.replay or None)
            await sub.start()
            self._subscribers[engine.id] = sub
        return new

    async def remove_engine(self, engine_id: str) -> int:
        """Forget an engine: its subscription, residencies, load and sessions; returns residencies dropped."""
        self.engines.remove(engine_id)
        sub = self._subscribers.pop(engine_id, None)
        if sub is not None:
            await sub.stop()
        self._tags.pop(engine_id, None)
        for session in [s for s, e in self.affinity.items() if e == engine_id]:
            del self.affinity[session]
        return self.index.clear_holder(engine_id)

    @property
    def subscriptions(self) -> int:
        return len(self._subscribers)

    async def start(self) -> None:
        """Subscribe to every configured engine that names a KV-event endpoint."""
        for engine in list(self.engines.engines.values()):
            await self.add_engine(engine)

    async def stop(self) -> None:
        for sub in self._subscribers.values():
            await sub.stop()
        self._subscribers.clear()

    def subscriber_stats(self) -> Counter[str]:
        """The ZMQ subscribers' counters, summed over engines."""
        total: Counter[str] = Counter()
        for sub in self._subscribers.values():
            total.update(sub.stats)
        return total

    def housekeeping(self) -> None:
        self.engines.expire()
