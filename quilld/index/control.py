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
import time
from collections import Counter
from dataclasses import replace
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import xxhash

from quilld.config import Config, EngineConfig
from quilld.index.affinity import SessionAffinity, check_session_id
from quilld.index.backend import open_index
from quilld.index.engine_prompts import EnginePrompts
from quilld.index.engines import EngineRegistry, FeedStats
from quilld.index.events import Batch, Cleared, Event, Removed, Stored, medium_tier
from quilld.index.hash_check import HashCheck
from quilld.index.groups import EVERY_GROUP, GroupedHoldings, HitRule, HybridHoldings
from quilld.index.pairing import NoDecodeEngine, Pair, PairCandidate, PairCosts, decide
from quilld.index.residency import TIER_SLOTS, TIERS, ResidencyIndex
from quilld.index.router import Candidate, CostWeights, Decision, Step, choose, score
from quilld.index.hot_routes import HotRoutes
from quilld.index.sketch import HotPrefixes
from quilld.index.subscriber import Cursor, KvEventSubscriber
from quilld.model import CacheTier, IdentityScope
from quilld.scopes import TAG_LEN, ScopeRegistry

log = logging.getLogger("quilld.index.control")
_OVERLAP = itemgetter(1)  # a Candidate's overlap_blocks
_POOL_TIERS = 1 << TIERS.index(CacheTier.DRAM) | 1 << TIERS.index(CacheTier.SSD)  # a pool node's tiers


_TIER_OF = {m: medium_tier(m) for m in (None, "GPU", "CPU", "STORAGE")}  # the common media, looked up inline
_RESETS = {
    "gap": "KV events lost (a gap in the sequence that could not be replayed)",
    "beyond_buffer": "KV events lost beyond the publisher's replay buffer",
    "restart": "its KV-event publisher restarted",
}


def _ignore(seconds: float) -> None:
    """No observer of ROUTE's time (the default; node.py gives the node's metrics)."""


def _uncached(candidates: list[Candidate], engine: str, blocks: int, block_tokens: float) -> int:
    """The tokens of a request `engine` cannot reuse (its candidate's credit)."""
    for c in candidates:
        if c.engine == engine:
            return int(round(max(0.0, blocks - c.credit) * block_tokens))
    return int(blocks * block_tokens)


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


# vLLM's kv_cache_spec_kind values (KVCacheSpecKind, 0.33) as the kinds an engine's config declares
_DECLARED_AS = {"full_attention": "full", "mla_attention": "full", "sliding_window": "sliding_window",
                "sliding_window_mla": "sliding_window", "mamba": "mamba"}


def _check_declared(engine_id: str, declared: tuple, ev: Stored) -> None:
    """Warn (once per group: the caller notes each group once) when the engine's events describe a
    group otherwise than its config declares it."""
    g = ev.group_idx
    if g >= len(declared):
        log.warning("engine %s: its KV events name KV-cache group %d, but its config declares %d group(s): "
                    "that group's events are ignored; declare every group, in vLLM's order", engine_id, g,
                    len(declared))
        return
    want, said = declared[g], _DECLARED_AS.get(ev.kv_cache_spec_kind or "")
    window = ev.sliding_window if said == "sliding_window" else None
    if (said is not None and said != want.kind) or (window and want.kind == "sliding_window"
                                                       and window != want.window_tokens):
        log.warning("engine %s: KV-cache group %d is declared %s%s but its events say %s%s; ROUTE credits it as "
                    "declared", engine_id, g, want.kind,
                    f"({want.window_tokens})" if want.kind == "sliding_window" else "", ev.kv_cache_spec_kind,
                    f"({window})" if window else "")


def _rule_state(rule: HitRule) -> list:
    """A declared group rule as persisted beside the groups' holdings (JSON)."""
    return [rule.count, rule.full, [list(w) for w in rule.windows], rule.states]


class ControlPlane:
    def __init__(self, cfg: Config, scopes: ScopeRegistry) -> None:
        self.scopes = scopes
        self.index: ResidencyIndex = open_index(cfg.index, scopes)
        self.engines = EngineRegistry(cfg.engines, cfg.router.lease_timeout_ms)
        self.hot = HotPrefixes()
        self.hot_routes = HotRoutes(self.hot)  # under which scopes each hot prefix was routed (/v1/hot)
        r = cfg.router
        self.weights = CostWeights(prefill_load_scale=r.prefill_load_scale,
                                   active_request_weight=r.active_request_weight, temperature=r.temperature,
                                   storage_credit=r.storage_credit)
        self.idle_warning_s = r.kv_idle_warning_s
        self.pair_costs = PairCosts(r.disaggregation, r.disagg_min_uncached_tokens, r.prefill_us_per_token,
                                    r.running_decode_penalty_us, r.decode_stall_weight, r.transfer_us_per_mib,
                                    r.cross_node_us, r.handoff_us)
        self.node_id = cfg.server.node_id  # this node's id (node.py sets the derived one): an engine's default locality
        g = cfg.gateway
        self.sessions = SessionAffinity(g.session_max, g.session_idle_s)  # (tenant, session) -> engine
        self.stats: Counter[str] = Counter()
        self.feeds: dict[str, FeedStats] = {e: FeedStats(self.stats) for e in self.engines.engines}
        self._tags: dict[str, set[bytes]] = {}  # engine id -> scope tags its blocks were stored under
        self._scope_of: dict[str, dict[str | None, IdentityScope]] = {}  # engine id -> adapter -> scope
        self._grouped: dict[str, GroupedHoldings] = {}  # engines whose events name more than one group
        self._hybrid: dict[str, HybridHoldings] = {}  # engines with declared KV-cache group kinds
        self._checks: dict[str, HashCheck] = {}  # engines with a prefix_caching_hash_algo: their hash check
        self.engine_prompts = EnginePrompts()  # each engine family's hashing, for the gateway and ROUTE
        for e in cfg.engines:
            self._declare(e)
        self._whole: dict[str, set[CacheTier]] = {}  # engine id -> tiers its events stored with no group
        self._subscribers: dict[str, KvEventSubscriber] = {}  # engine id -> its KV-event subscriber
        self.pool: list[str] = []  # pool node ids (this node, then peers) holding blocks ROUTE can fetch
        self.observe_route: Callable[[float], None] = _ignore  # each decision's seconds (the node's metrics)
        # in a cluster, the sharded directory (cluster/dir_link.py): told of the residencies of the
        # engines this node consumes the KV events of, so every node's ROUTE sees them
        self.placements: Any = None
        self._cursors: dict[str, Cursor] = {}  # engine id -> its last KV-event batch applied in full
        self.index.states = self._states
        self._resume()

    # -- engine events --------------------------------------------------------
    def engine_tag(self, engine_id: str, adapter: str | None) -> bytes:
        per = self._scope_of.get(engine_id)
        if per is None:
            per = self._scope_of[engine_id] = {}
        scope = per.get(adapter)
        if scope is None:
            e = self.engines.get(engine_id)
            scope = per[adapter] = IdentityScope(e.tenant, e.model, e.tokenizer, adapter or "")
        return self.scopes.tag(scope)

    def note_scope(self, engine_id: str, adapter: str | None = None) -> None:
        """The engine's blocks may be stored under this adapter's scope (a removal tries it): in a
        cluster, its new home knows the engine's entries without having seen its stores."""
        self._tags.setdefault(engine_id, set()).add(self.engine_tag(engine_id, adapter))

    def feed(self, engine_id: str) -> FeedStats:
        """The figures of `engine_id`'s KV-event feed (created with the engine)."""
        feed = self.feeds.get(engine_id)
        if feed is None:
            self.engines.get(engine_id)  # raises for an unknown engine
            feed = self.feeds[engine_id] = FeedStats(self.stats)
        return feed

    def apply(self, engine_id: str, batch: Batch) -> int:
        """Apply one decoded batch of `engine_id`'s events (POST /v1/kv-events, KVEVENTS); returns
        the events applied. The ZMQ subscriber applies its batches through `apply_events`, in slices."""
        n = self.apply_events(engine_id, batch.events)
        feed = self.feed(engine_id)
        feed.add("batches")
        feed.add("events", n)
        return n

    def apply_events(self, engine_id: str, events: Sequence[Event]) -> int:
        """Apply events of `engine_id` to the index, in order; returns how many.

        An engine whose group kinds are declared keeps its residencies per group in
        `HybridHoldings`. Otherwise a KV-cache group other than 0 hands the engine over to
        `GroupedHoldings`, which applies groups.py's every-group rule; until then (and for
        every engine with one group) events go straight to the index, a run of consecutive
        stores (or removals) of one scope and tier in one call: vLLM sends one event per
        request and step, often of a single block, and the index's cost is mostly per call.
        """
        check = self._checks.get(engine_id)
        if check is not None:
            check.events(events)
        tags = self._tags.get(engine_id)
        if tags is None:
            tags = self._tags[engine_id] = set()
        named_groups = self.feed(engine_id).groups
        hybrid = self._hybrid.get(engine_id)
        if hybrid is not None:
            return self._apply_hybrid(engine_id, hybrid, events, tags, named_groups)
        index, grouped, placements = self.index, self._grouped.get(engine_id), self.placements
        tag_of: dict[str | None, bytes] = {}  # adapter -> tag, for this call (no sweep runs inside it)
        run: list = []  # the hashes of the run not yet given to the index: stores (run_tag) or removals
        # in a cluster, every store and removal of this call in order, for the directory (one call):
        # (tag, tier, hashes, parent), parent False for a removal (one op per scope the engine used)
        placed: list | None = [] if placements is not None else None
        run_stores, run_tag, run_tier = False, b"", CacheTier.HBM
        for ev in events:
            kind = type(ev)
            if kind is Stored:
                if run and not run_stores:
                    self._removed_run(engine_id, tags, run, run_tier)
                    run = []
                adapter, group = ev.lora_name, ev.group_idx
                tag = tag_of.get(adapter)
                if tag is None:
                    tag = tag_of[adapter] = self.engine_tag(engine_id, adapter)
                    tags.add(tag)
                tier = _TIER_OF.get(ev.medium) or medium_tier(ev.medium)
                if group is not None and group not in named_groups:
                    self._note_group(engine_id, ev)
                if grouped is None:
                    if not group:  # None or 0: one group as far as anyone knows
                        if group is None:
                            self._whole.setdefault(engine_id, set()).add(tier)
                        if run and (run_tag is not tag or run_tier is not tier):
                            index.put_many(run_tag, run, engine_id, run_tier)
                            run = []
                        run += ev.block_hashes
                        if placed is not None:
                            placed.append((tag, tier, ev.block_hashes, ev.parent))
                        run_stores, run_tag, run_tier = True, tag, tier
                        continue
                    if run:
                        index.put_many(run_tag, run, engine_id, run_tier)
                        run = []
                    grouped = self._group_up(engine_id)
                if group is not None:
                    grouped.learn(group)
                grouped.stored(tag, ev.block_hashes, tier, EVERY_GROUP if group is None else 1 << group)
            elif kind is Removed:  # events name no adapter: try every scope the engine used
                if run and run_stores:
                    index.put_many(run_tag, run, engine_id, run_tier)
                    run = []
                tier, group = _TIER_OF.get(ev.medium) or medium_tier(ev.medium), ev.group_idx
                if grouped is None and group:
                    if run:
                        self._removed_run(engine_id, tags, run, run_tier)
                        run = []
                    grouped = self._group_up(engine_id)
                if grouped is None:
                    if run and run_tier is not tier:
                        self._removed_run(engine_id, tags, run, run_tier)
                        run = []
                    run += ev.block_hashes
                    run_stores, run_tier = False, tier
                    if placed is not None:
                        for tag in tags:
                            placed.append((tag, tier, ev.block_hashes, False))
                    continue
                if group is not None:
                    grouped.learn(group)
                mask = EVERY_GROUP if group is None else 1 << group
                for tag in tags:
                    grouped.removed(tag, ev.block_hashes, tier, mask)
            elif kind is Cleared:
                if run:
                    if run_stores:
                        index.put_many(run_tag, run, engine_id, run_tier)
                    else:
                        self._removed_run(engine_id, tags, run, run_tier)
                    run = []
                index.clear_holder(engine_id)
                if placements is not None:
                    if placed:
                        placements.engine_blocks(engine_id, placed)
                        placed = []
                    placements.engine_cleared(engine_id)
                if grouped is not None:
                    grouped.clear()
        if run:
            if run_stores:
                index.put_many(run_tag, run, engine_id, run_tier)
            else:
                self._removed_run(engine_id, tags, run, run_tier)
        if placed:
            placements.engine_blocks(engine_id, placed)
        return len(events)

    def _removed_run(self, engine_id: str, tags: set[bytes], hashes: list, tier: CacheTier) -> None:
        """Removals of `engine_id`'s blocks in `tier`: tried in every scope the engine used."""
        remove = self.index.remove_many
        for tag in tags:
            remove(tag, hashes, engine_id, tier)

    def _apply_hybrid(self, engine_id: str, hybrid: HybridHoldings, events: Sequence[Event], tags: set[bytes],
                      named_groups: dict[int, str]) -> int:
        """`apply_events` for an engine with declared group kinds: each event for its group, or for
        every group without `group_idx`; a group beyond those declared is ignored (and logged)."""
        every, count = hybrid.rule.every, hybrid.rule.count
        tag_of: dict[str | None, bytes] = {}
        for ev in events:
            kind = type(ev)
            if kind is Stored:
                adapter, group = ev.lora_name, ev.group_idx
                tag = tag_of.get(adapter)
                if tag is None:
                    tag = tag_of[adapter] = self.engine_tag(engine_id, adapter)
                    tags.add(tag)
                if group is not None and group not in named_groups:
                    self._note_group(engine_id, ev)
                if group is None or group < count:
                    hybrid.stored(tag, ev.block_hashes, _TIER_OF.get(ev.medium) or medium_tier(ev.medium),
                                  every if group is None else 1 << group)
            elif kind is Removed:
                group = ev.group_idx
                if group is None or group < count:
                    tier = _TIER_OF.get(ev.medium) or medium_tier(ev.medium)
                    mask = every if group is None else 1 << group
                    for tag in tags:
                        hybrid.removed(tag, ev.block_hashes, tier, mask)
            elif kind is Cleared:
                self.index.clear_holder(engine_id)
                hybrid.clear()
        return len(events)

    def _declare(self, engine: EngineConfig) -> None:
        """Keep `engine`'s residencies per declared group, when its config declares their kinds; check
        its events' block hashes when it names its prefix-cache hashing (index/hash_check.py)."""
        if engine.prefix_caching_hash_algo:
            self._checks[engine.id] = HashCheck(engine.id, engine.prefix_caching_hash_algo, engine.hash_seed,
                                                engine.block_size, engine.lora_modules,
                                                engine.kv_event_hashes == "int")
        else:
            self._checks.pop(engine.id, None)
        if engine.groups:
            rule = HitRule.of(engine.groups, engine.block_size)
            self._hybrid[engine.id] = HybridHoldings(engine.id, self.index, rule)
        else:
            self._hybrid.pop(engine.id, None)

    def _group_up(self, engine_id: str) -> GroupedHoldings:
        """The engine named a second KV-cache group: from now on its residencies are kept per group."""
        grouped = self._grouped[engine_id] = GroupedHoldings(engine_id, self.index)
        n = grouped.adopt(self.index.holder_entries(engine_id), self._whole.get(engine_id, set()))
        log.info("engine %s: its KV events name more than one KV-cache group; %d residencies now kept per group",
                 engine_id, n)
        return grouped

    def _note_group(self, engine_id: str, ev: Stored) -> None:
        kind = ev.kv_cache_spec_kind or "unknown"
        if ev.sliding_window:
            kind = f"{kind}({ev.sliding_window})"
        self.feed(engine_id).groups[ev.group_idx] = kind
        declared = self.engines.get(engine_id).groups
        if declared:
            _check_declared(engine_id, declared, ev)

    def reset_engine(self, engine_id: str, reason: str, missing: int = 0) -> int:
        """What we know of this engine may be wrong (events lost, or its publisher restarted):
        forget it; returns the residencies dropped. `reason` (gap, beyond_buffer, restart) is
        logged; a loss also counts in kv_gaps."""
        dropped = self.index.clear_holder(engine_id)
        if self.placements is not None:
            self.placements.engine_cleared(engine_id)
        grouped = self._grouped.pop(engine_id, None)
        if grouped is not None:
            grouped.clear()
        self._cursors.pop(engine_id, None)
        hybrid = self._hybrid.get(engine_id)
        if hybrid is not None:
            hybrid.clear()
        self._whole.pop(engine_id, None)
        feed = self.feeds.get(engine_id)
        if feed is not None:
            feed.add("drops")
            feed.groups.clear()
        if reason != "restart":
            self.stats["kv_gaps"] += 1
        log.warning("engine %s: %s%s; dropped its %d residencies rather than route on a stale view", engine_id,
                    _RESETS.get(reason, reason), f" ({missing} batches)" if missing else "", dropped)
        return dropped

    # -- routing ----------------------------------------------------------------
    def route(self, scope: IdentityScope, tag: bytes, blocks: list, decode_blocks: float = 0.0,
              session: str | None = None, acquire: bool = False, block_tokens: float = 16.0,
              view: ResidencyIndex | None = None) -> Decision:
        """The engine for a request of `scope` (its `tag`) over `blocks`, with its URL and, with
        `acquire`, an in-flight lease on it (give it back with `engines.release`).

        A `session` (of `scope`'s tenant) goes where its last request went while that engine
        serves the model; an id over MAX_SESSION_ID_BYTES raises SessionIdTooLong first.
        When the model's engines have roles the decision carries its prefill-decode `pair`
        (pairing.py; `block_tokens`: tokens a block stands for), and with `acquire` a prefill
        lease on the prefill engine too; a model with only prefill engines raises NoDecodeEngine.
        `view`: the residencies to score against instead of this node's index (in a cluster, what
        the directory's owners answered for these blocks)."""
        t0 = time.perf_counter()
        if session:
            check_session_id(session)
        engines = self.engines.ids_for_model(scope.model)
        if blocks:
            self.hot_routes.note(tag, blocks[0])
        engines_considered = engines
        kept = None
        if session:
            kept = self.sessions.get(scope.tenant, session)
            if kept is not None and kept in engines:
                engines_considered = [kept]
        paired = bool(engines) and self.engines.has_roles(scope.model)
        if paired:
            engines_considered = engines  # every engine may prefill; the session keeps its decode engine
        index = self.index if view is None else view
        engine_id, cost, candidates, plan = score(index, tag, blocks, engines_considered, self.pool,
                                                  self.engines.in_flight, decode_blocks, self.weights, None,
                                                  self._hybrid if view is None else {})
        if blocks and not any(map(_OVERLAP, candidates)):
            others = self.index.held_elsewhere(tag, blocks[0])
            if others:
                self.scopes.refused(tag, others)
        self.stats["routes"] += 1
        pair = None
        if paired:
            pair = self._pair(scope.model, candidates, len(blocks), block_tokens,
                              kept if kept in engines else None)
            serving = pair.prefill or pair.decode
            if serving != engine_id:
                plan = self.plan_for(serving, tag, blocks, view)
            engine_id = pair.decode
            cost = next(c.cost for c in candidates if c.engine == engine_id)
        self.observe_route(time.perf_counter() - t0)
        if engine_id is None:
            return Decision(None, cost, candidates, plan)
        engine = self.engines.get(engine_id)
        if session:
            self.sessions.put(scope.tenant, session, engine.id)
        lease = None
        if acquire:
            if pair is None:
                lease = self.engines.acquire(engine.id, "request", _uncached(candidates, engine.id, len(blocks),
                                                                             block_tokens))
            elif pair.prefill is None:
                lease = self.engines.acquire(engine.id, "request", pair.uncached_tokens)
            else:
                lease = self.engines.acquire(engine.id, "decode")
        if pair is not None and pair.prefill is not None:
            prefill = self.engines.get(pair.prefill)
            pair = replace(pair, prefill_url=prefill.url, prefill_lease=self.engines.acquire(
                prefill.id, "prefill", _uncached(candidates, prefill.id, len(blocks), block_tokens))
                if acquire else None)
        return Decision(engine_id, cost, candidates, plan, engine.url, lease, pair)

    def _pair(self, model: str, candidates: list[Candidate], blocks: int, block_tokens: float,
              session_engine: str | None) -> Pair:
        """The prefill-decode pair among `candidates` (pairing.py); a session's engine decodes."""
        engines, node = self.engines, self.node_id
        cands = []
        for c in candidates:
            e = engines.get(c.engine)
            if session_engine is not None and e.id != session_engine and e.role != "prefill":
                role = "prefill" if e.role == "both" else None  # another engine decodes the session
                if role is None:
                    continue
            else:
                role = e.role
            cands.append(PairCandidate(e.id, role, e.locality or node, c.overlap_blocks, c.credit, c.cost,
                                       engines.load(e.id), e.kv_bytes_per_token))
        pair = decide(cands, blocks, block_tokens, self.pair_costs)
        if pair is None:
            raise NoDecodeEngine(model)
        self.stats[f"pair_{pair.reason}"] += 1
        return pair

    def resident(self, tag: bytes, blocks: list) -> int:
        """How many of `blocks` (engine block hashes of scope `tag`) have a copy in the pool (DRAM or SSD
        of any pool node this node knows of): the gateway's handoff check, one index lookup a block."""
        mask = 0
        for holder in self.pool:
            no = self.index.holder_no(holder)
            if no is not None:
                mask |= _POOL_TIERS << (no * TIER_SLOTS)
        if not mask:
            return 0
        return sum(1 for m in self.index.masks(tag, blocks) if m & mask)

    def record(self, engine_id: str, tag: bytes, blocks: list) -> int:
        """`engine_id` prefilled `blocks` under `tag` (the gateway's word, for an engine without KV
        events): every group of it holds them in HBM now. Returns how many were new."""
        hybrid = self._hybrid.get(engine_id)
        if hybrid is not None:
            return hybrid.stored(tag, blocks, CacheTier.HBM, hybrid.rule.every)
        put = self.index.put
        if self.placements is not None:
            self.placements.engine_stored(engine_id, tag, blocks, None, CacheTier.HBM)
        return sum(put(tag, h, engine_id, CacheTier.HBM) for h in blocks)

    def unrecord(self, engine_id: str, tag: bytes, block) -> None:
        """Forget a block `record` placed in `engine_id`'s HBM (it has likely evicted it by now)."""
        hybrid = self._hybrid.get(engine_id)
        if hybrid is not None:
            hybrid.removed(tag, (block,), CacheTier.HBM, hybrid.rule.every)
        else:
            self.index.remove(tag, block, engine_id, CacheTier.HBM)
            if self.placements is not None:
                self.placements.engine_removed(engine_id, tag, (block,), CacheTier.HBM)

    def plan_for(self, engine_id: str, tag: bytes, blocks: list, view: ResidencyIndex | None = None) -> list[Step]:
        """The per-block plan of `blocks` on `engine_id`, as `route` would give it had it chosen that
        engine (the gateway's, when it falls back to another engine than the router's pick)."""
        return choose(self.index if view is None else view, tag, blocks, [engine_id], self.pool,
                      self.engines.in_flight, 0.0, self.weights, None, self._hybrid if view is None else {}).plan

    # -- engines and their subscriptions ------------------------------------------
    async def add_engine(self, engine: EngineConfig, follow: bool = True, rank: tuple | None = None) -> bool:
        """Register an engine and, with `follow`, subscribe to its KV events; True when it is new.

        Replacing an engine forgets what was known of the old one. In a cluster only the
        engine's home follows it (cluster/engines_sync.py decides, and calls `follow`), and
        `rank` puts it among its model's candidates in the same place on every node.
        """
        if engine.id in self.engines.engines:
            await self.remove_engine(engine.id)
            new = False
        else:
            new = True
        self.engines.add(engine, rank)
        self.index.keep(engine.id)
        self._declare(engine)
        self.feeds[engine.id] = FeedStats(self.stats)
        if follow:
            await self.follow(engine.id)
        return new

    async def follow(self, engine_id: str) -> bool:
        """Subscribe to the engine's KV-event publisher, unless it names none or is followed
        already; True when it subscribed now. It resumes from where the engine's feed stood when
        a persistent index last committed, else from the replay buffer's start (a catch-up,
        subscriber.py)."""
        engine = self.engines.get(engine_id)
        if not engine.kv_events or engine_id in self._subscribers:
            return False
        sub = KvEventSubscriber(engine.id, engine.kv_events, self.apply_events, self.reset_engine,
                                engine.replay or None, stats=self.feed(engine_id),
                                resume=self._cursors.get(engine.id), on_applied=self._applied)
        await sub.start()
        self._subscribers[engine.id] = sub
        return True

    async def unfollow(self, engine_id: str) -> bool:
        """Stop consuming the engine's KV events (another node is its home now); what was applied
        stays. True when it was followed."""
        sub = self._subscribers.pop(engine_id, None)
        if sub is None:
            return False
        await sub.stop()
        return True

    def follows(self, engine_id: str) -> bool:
        return engine_id in self._subscribers

    async def remove_engine(self, engine_id: str) -> int:
        """Forget an engine: its subscription, residencies, load and sessions; returns residencies dropped."""
        self.engines.remove(engine_id)
        sub = self._subscribers.pop(engine_id, None)
        if sub is not None:
            await sub.stop()
        self._tags.pop(engine_id, None)
        self._scope_of.pop(engine_id, None)
        for holdings in (self._grouped.pop(engine_id, None), self._hybrid.pop(engine_id, None)):
            if holdings is not None:
                holdings.clear()
        self._whole.pop(engine_id, None)
        self._checks.pop(engine_id, None)
        self._cursors.pop(engine_id, None)
        self.feeds.pop(engine_id, None)
        self.sessions.forget_engine(engine_id)
        if self.placements is not None:
            self.placements.engine_cleared(engine_id)
        dropped = self.index.clear_holder(engine_id)
        self.index.release(engine_id)
        return dropped

    @property
    def subscriptions(self) -> int:
        return len(self._subscribers)

    async def start(self, follow: bool = True) -> None:
        """Subscribe to every configured engine that names a KV-event endpoint (in a cluster,
        `follow` is False: each engine's home subscribes)."""
        for engine in list(self.engines.engines.values()):
            if follow:
                await self.follow(engine.id)

    async def stop(self) -> None:
        """Stop every subscriber, then close the index (a persistent one commits what is left), even
        when a subscriber's stop fails: the first such error is raised once all of it is done."""
        failed: BaseException | None = None
        for sub in self._subscribers.values():
            try:
                await sub.stop()
            except Exception as e:  # noqa: BLE001 - the other subscribers and the index still stop
                failed = failed or e
                log.error("stopping the KV-event subscriber of %s failed: %s", sub.engine_id, e, exc_info=e)
        self._subscribers.clear()
        self.index.close()
        if failed is not None:
            raise failed

    # -- a persistent index: what outlives a restart ------------------------------------------------
    def _resume(self) -> None:
        """Take up what a persistent index kept of the configured engines: their residencies, their
        KV-cache group holdings and where each feed stood (the subscriber resumes from there and
        reconciles with the engine's replay); forget what it kept of anyone else."""
        index = self.index
        if not index.persistent:
            return
        index.retain(self.engines.engines)
        tags_of = index.holder_tags()
        for engine_id in self.engines.engines:
            index.keep(engine_id)
            state = index.engine_state(engine_id) or {}
            hybrid = self._hybrid.get(engine_id)
            grouped = index.groups_of(engine_id, "grouped")
            if state.get("rule") != (_rule_state(hybrid.rule) if hybrid is not None else None):
                # its groups are declared otherwise now: what was kept per group means something else
                if index.clear_holder(engine_id) or grouped or (hybrid is not None and len(hybrid)):
                    log.warning("engine %s: its KV-cache groups are declared otherwise than when its residencies "
                                "were persisted; dropped them", engine_id)
                grouped.clear()
                if hybrid is not None:
                    hybrid.clear()
                continue
            tags = set(tags_of.get(engine_id, ()))
            if hybrid is not None:
                tags |= set(hybrid.held)
            elif state.get("known") is not None:
                g = self._grouped[engine_id] = GroupedHoldings(engine_id, index, grouped)
                g.known = state["known"]
                tags |= {key[:TAG_LEN] for key in grouped}
            if tags:
                self._tags[engine_id] = tags
            if state.get("whole"):
                self._whole[engine_id] = {CacheTier(t) for t in state["whole"]}
            if state.get("cursor"):
                self._cursors[engine_id] = Cursor(*state["cursor"])
        log.info("index: %s backend, %d entries loaded in %.3f s", index.backend, len(index),
                 index.describe().get("load_seconds", 0.0))

    def _applied(self, engine_id: str, cursor: Cursor) -> None:
        self._cursors[engine_id] = cursor

    def _states(self) -> dict[str, dict]:
        """What a persistent index commits of each engine beside its residencies."""
        out: dict[str, dict] = {}
        for engine_id in self.engines.engines:
            state: dict[str, Any] = {}
            cursor = self._cursors.get(engine_id)
            if cursor is not None:
                state["cursor"] = list(cursor)
            grouped = self._grouped.get(engine_id)
            if grouped is not None:
                state["known"] = grouped.known
            whole = self._whole.get(engine_id)
            if whole:
                state["whole"] = sorted(t.value for t in whole)
            hybrid = self._hybrid.get(engine_id)
            if hybrid is not None:
                state["rule"] = _rule_state(hybrid.rule)
            out[engine_id] = state
        return out

    def subscriber_stats(self) -> Counter[str]:
        """The ZMQ subscribers' counters, summed over engines."""
        total: Counter[str] = Counter()
        for sub in self._subscribers.values():
            total.update(sub.stats.counts)
        return total

    def feed_view(self, engine_id: str, now: float | None = None) -> dict[str, Any]:
        """One engine's feed figures as plain values (admin API, INFO, metrics)."""
        now = time.monotonic() if now is None else now
        view = self.feed(engine_id).as_dict(now)
        sub = self._subscribers.get(engine_id)
        view["subscribed"] = sub is not None
        if sub is None:
            view["state"] = "push"  # fed by POST /v1/kv-events or KVEVENTS, if at all
        check = self._checks.get(engine_id)  # None: the engine names no prefix-cache hashing, nothing checked
        view["hash_check"] = None if check is None else check.view()
        committed = self.index.committed_state(engine_id)
        if committed is not None:  # a persistent index: the last batch a restart would resume after
            view["persisted_seq"] = (committed.get("cursor") or [None])[0]
        return view

    def housekeeping(self) -> None:
        self.index.flush()
        self.engines.expire()
        self.sessions.sweep()
        now = time.monotonic()
        for sub in self._subscribers.values():
            sub.housekeeping(now, self.idle_warning_s)
