"""The Dynamo-style cost function: which engine recomputes the least.

For each eligible engine (same model as the request) the overlap is the
longest run of leading blocks it can reuse, each credited by where it is:
1.0 in the engine's own HBM, 0.75 in host memory (the engine's CPU tier or
this pool's DRAM), 0.25 on this pool's SSD or in the engine's own offload
storage (vLLM's medium STORAGE; `router.storage_credit`), the best source
winning where a block is in several. For an engine whose KV-cache group kinds
are declared (a hybrid model: full attention, sliding window, Mamba), the
reusable prefix is the one vLLM's hybrid cache manager would hit, and each of
its blocks is credited by where the groups that read it have it (groups.py).
Then

    cost = prefill_load_scale * max(0, prefill_blocks - credit)
           + decode_blocks + active_request_weight * in_flight

and the lowest cost wins, or a softmax draw over -cost / temperature when a
temperature is set. The per-block plan says, for the winner, which blocks are
hits on the engine, which are fetched from which pool node and tier, and which
are recomputed. Pure: the caller supplies the index, engines and load.

The result is a `Decision`, one typed value from here to the wire: the control
plane adds the chosen engine's URL and lease, and RESP (ROUTE), the admin JSON
(POST /v1/route) and the gateway's `x-quillcache-*` headers each render it.
Candidates and plan steps are NamedTuples: a request builds one per engine and
one per block, and a tuple is built without a Python-level __init__.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Literal, NamedTuple

from quilld.index.groups import HybridHoldings, longest_hit
from quilld.index.pairing import Pair
from quilld.index.residency import TIER_MASK, TIER_SLOTS, TIERS, ResidencyIndex, entry_key
from quilld.model import CacheTier

_HBM, _CPU, _DRAM, _SSD, _STORAGE = (TIERS.index(t) for t in (CacheTier.HBM, CacheTier.CPU, CacheTier.DRAM,
                                                                 CacheTier.SSD, CacheTier.STORAGE))
_HBM_BIT, _CPU_BIT, _STORAGE_BIT = 1 << _HBM, 1 << _CPU, 1 << _STORAGE
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class CostWeights:
    prefill_load_scale: float = 1.0
    active_request_weight: float = 1.0
    temperature: float = 0.0  # 0: always the cheapest; > 0: softmax draw
    hbm_credit: float = 1.0
    host_credit: float = 0.75
    disk_credit: float = 0.25
    storage_credit: float = 0.25  # a block in the engine's own offload storage (vLLM's medium STORAGE)


class Candidate(NamedTuple):
    """One eligible engine's score."""

    engine: str
    overlap_blocks: int
    credit: float
    cost: float
    in_flight: int


class Step(NamedTuple):
    """What happens to one block on the chosen engine."""

    action: Literal["hit", "fetch", "recompute"]  # already on the engine, from a pool node, or prefilled
    holder: str | None = None  # the engine (hit) or pool node (fetch) holding the block
    tier: CacheTier | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why: the chosen engine, every candidate's score and the block plan.

    `engine` is None (and `cost` infinite) when no engine serves the model.
    `url` and `lease` are the control plane's: the chosen engine's base URL,
    and the in-flight lease when the caller asked for one. The lists are
    never mutated once the decision is made.

    When the model's engines have roles, `pair` says which engine prefills and
    which decodes (pairing.py): `engine` is then the engine that answers (the
    decode engine), `cost` its router cost, and `plan` the plan of the engine
    that prefills (the prefill engine when disaggregated).
    """

    engine: str | None
    cost: float
    candidates: list[Candidate]  # one per eligible engine, in the order they were scored
    plan: list[Step]  # one per block of the request, for the engine that prefills
    url: str | None = None
    lease: str | None = None
    pair: Pair | None = None

    @property
    def overlap_blocks(self) -> int:
        """The leading blocks the chosen engine reuses (hits and fetches); 0 without an engine."""
        for c in self.candidates:
            if c.engine == self.engine:
                return c.overlap_blocks
        return 0

    def tally(self) -> tuple[int, int, int]:
        """(hits, fetches, recomputes) of the plan."""
        hits = fetches = 0
        for step in self.plan:
            if step.action == "hit":
                hits += 1
            elif step.action == "fetch":
                fetches += 1
        return hits, fetches, len(self.plan) - hits - fetches


RECOMPUTE = Step("recompute")
_NO_STEPS: list[Step] = []  # shared, never mutated: plans are built as new lists
_HITS: dict[str, tuple[Step, Step, Step]] = {}  # engine -> its hit steps (hbm, cpu, storage), shared


def _hits(engine: str) -> tuple[Step, Step, Step]:
    hits = _HITS.get(engine)
    if hits is None:
        if len(_HITS) >= 4096:  # engines come and go: never grow without bound
            _HITS.clear()
        hits = _HITS[engine] = (Step("hit", engine, CacheTier.HBM), Step("hit", engine, CacheTier.CPU),
                                Step("hit", engine, CacheTier.STORAGE))
    return hits


def _own_walk(masks: list[int], engine: str, shift: int, w: CostWeights) -> tuple[float, list[Step]]:
    """`_engine_walk` with no pool to fetch from: the engine's own tiers alone, to the first gap."""
    hit_hbm, hit_cpu, hit_storage = _hits(engine)
    hbm, host, stored = w.hbm_credit, w.host_credit, w.storage_credit
    credit, steps = 0.0, []
    add = steps.append
    for mask in masks:
        own = mask >> shift
        if own & _HBM_BIT:
            credit += hbm
            add(hit_hbm)
        elif own & _CPU_BIT:
            credit += host
            add(hit_cpu)
        elif own & _STORAGE_BIT:
            credit += stored
            add(hit_storage)
        else:
            break
    return credit, steps


def _engine_walk(index: ResidencyIndex, masks: list[int], engine: str, pool: list[str],
                 w: CostWeights) -> tuple[float, list[Step]]:
    """Credit and plan of the leading blocks `engine` can reuse, stopping at the first gap."""
    base = index.holder_bits(engine)
    shift = (base & -base).bit_length() - 1 if base else -1
    pool_bits = [(h, b) for h in pool if (b := index.holder_bits(h))]
    credit, steps = 0.0, []
    hit_hbm, hit_cpu, hit_storage = _hits(engine)
    for mask in masks:
        own = (mask >> shift) & TIER_MASK if shift >= 0 else 0
        if own & _HBM_BIT:
            credit += w.hbm_credit
            steps.append(hit_hbm)
            continue
        if own & _CPU_BIT:
            credit += w.host_credit
            steps.append(hit_cpu)
            continue
        # below host memory: the engine's own storage or a pool copy, whichever credits more
        stored = own & _STORAGE_BIT
        if not pool_bits:
            if not stored:
                break
            credit += w.storage_credit
            steps.append(hit_storage)
            continue
        best = None
        for holder, bits in pool_bits:
            if not bits:
                continue
            nib = (mask & bits) >> ((bits & -bits).bit_length() - 1)
            if nib >> _DRAM & 1:
                best = (holder, CacheTier.DRAM)
                break
            if nib >> _SSD & 1 and best is None:
                best = (holder, CacheTier.SSD)
        fetched = 0.0 if best is None else w.host_credit if best[1] is CacheTier.DRAM else w.disk_credit
        if stored and (best is None or w.storage_credit >= fetched):
            credit += w.storage_credit
            steps.append(hit_storage)
            continue
        if best is None:
            break
        credit += fetched
        steps.append(Step("fetch", best[0], best[1]))
    return credit, steps


def _best_copy(mask: int, pool_bits: list[tuple[str, int]]) -> tuple[str, CacheTier] | None:
    """The pool node and tier to fetch a block from (DRAM before SSD), given its entry mask."""
    best = None
    for holder, bits in pool_bits:
        nib = (mask & bits) >> ((bits & -bits).bit_length() - 1)
        if nib >> _DRAM & 1:
            return holder, CacheTier.DRAM
        if nib >> _SSD & 1 and best is None:
            best = (holder, CacheTier.SSD)
    return best


def _hybrid_walk(index: ResidencyIndex, holdings: HybridHoldings, tag: bytes, blocks: list, engine: str,
                 pool_bits: list[tuple[str, int]], w: CostWeights) -> tuple[float, list[Step]]:
    """Credit and plan of the prefix an engine with declared KV-cache group kinds reuses, as vLLM's
    hybrid cache manager finds it (groups.py): the longest prefix every group accepts, each block
    credited by where the groups that read it have it, or by a pool copy when that credits more."""
    rule = holdings.rule
    count, every, full = rule.count, rule.every, rule.full
    s_cpu, s_storage = _CPU * count, _STORAGE * count  # HBM's group bits are the lowest (_HBM is 0)
    own_get = holdings.entries(tag).get
    pool_get = index.entries(tag).get if pool_bits else None
    pool_tiers = 0  # the pool nodes' DRAM and SSD bits
    for _, bits in pool_bits:
        pool_tiers |= (1 << _DRAM | 1 << _SSD) * (bits & -bits)
    packed: list[int] = []  # per block: bit tier * count + g while group g holds it in that tier
    holds: list[int] = []  # per block: the groups holding it anywhere (every group when a pool node has it)
    copies: list[int] = []  # per block: its entry mask's pool bits (with a pool only)
    add_packed, add_held, add_copy = packed.append, holds.append, copies.append
    for block in blocks:  # up to the first block a full-attention group lacks
        key = block & _U64 if block.__class__ is int else entry_key(block)
        p = own_get(key, 0)
        held = (p | p >> s_cpu | p >> s_storage) & every
        if pool_get is not None:
            copy = pool_get(key, 0) & pool_tiers
            if copy:
                held = every
            if held & full != full:
                break
            add_copy(copy)
        elif held & full != full:
            break
        add_packed(p)
        add_held(held)
    length = longest_hit(rule, holds)
    hit_hbm, hit_cpu, hit_storage = _hits(engine)
    hbm_credit, host_credit, storage_credit = w.hbm_credit, w.host_credit, w.storage_credit

    def step(i: int, need: int) -> tuple[Step, float]:
        """Where block i comes from when groups `need` read it: the slowest of their best tiers on the
        engine, or a pool copy when that credits more."""
        p = packed[i]
        own, value = None, 0.0
        if p & need == need:
            own, value = hit_hbm, hbm_credit
        elif (p | p >> s_cpu) & need == need:
            own, value = hit_cpu, host_credit
        elif (p | p >> s_cpu | p >> s_storage) & need == need:
            own, value = hit_storage, storage_credit
        if pool_get is not None and copies[i]:
            holder, tier = _best_copy(copies[i], pool_bits)
            fetched = host_credit if tier is CacheTier.DRAM else w.disk_credit
            if own is None or fetched > value:
                return Step("fetch", holder, tier), fetched
        return own, value

    # The last `reach` blocks are read by more groups than the full-attention ones (a window, the
    # state at the end); the ones before them by the full-attention groups alone, or by none.
    tail = max(0, length - rule.reach)
    steps: list[Step] = [RECOMPUTE] * length
    credit, anchor, anchor_credit = 0.0, RECOMPUTE, 0.0
    for i in range(length - 1, tail - 1, -1):
        need = rule.needs(i, length)
        if need:  # otherwise read for nothing: skipped because of the block that ends the prefix
            anchor, anchor_credit = step(i, need)
        steps[i] = anchor
        credit += anchor_credit
    if not tail:
        return credit, steps
    if not full:  # no group reads the blocks before the tail: credited as its first block
        steps[:tail] = [anchor] * tail
        return credit + anchor_credit * tail, steps
    on_cpu = (hit_cpu, host_credit)
    for i in range(tail):
        p = packed[i]
        if p & full == full and (pool_get is None or not copies[i] or hbm_credit >= host_credit):
            steps[i] = hit_hbm
            credit += hbm_credit
        elif pool_get is None and (p | p >> s_cpu) & full == full:
            steps[i], value = on_cpu
            credit += value
        else:
            steps[i], value = step(i, full)
            credit += value
    return credit, steps


def choose(index: ResidencyIndex, tag: bytes, blocks: list, engines: list[str], pool: list[str],
           in_flight: dict[str, int], decode_blocks: float = 0.0, weights: CostWeights = CostWeights(),
           rng: random.Random | None = None, hybrid: Mapping[str, HybridHoldings] | None = None) -> Decision:
    """Score every engine in `engines` (already filtered to the request's model); `hybrid`: the
    engines with declared KV-cache group kinds, credited by groups.py's rule."""
    engine, cost, candidates, plan = score(index, tag, blocks, engines, pool, in_flight, decode_blocks, weights,
                                           rng, hybrid)
    return Decision(engine, cost, candidates, plan)


def score(index: ResidencyIndex, tag: bytes, blocks: list, engines: list[str], pool: list[str],
          in_flight: dict[str, int], decode_blocks: float = 0.0, weights: CostWeights = CostWeights(),
          rng: random.Random | None = None, hybrid: Mapping[str, HybridHoldings] | None = None,
          ) -> tuple[str | None, float, list[Candidate], list[Step]]:
    """`choose`'s decision as its parts (engine, cost, candidates, plan), for a caller that adds
    to them before building the one `Decision` (the control plane: URL and lease)."""
    if not engines:
        return None, math.inf, [], []
    masks = index.leading_masks(tag, blocks)  # every walk but the hybrid one ends where these end, or before
    n = len(blocks)
    first = masks[0] if masks else 0
    scale, per_request = weights.prefill_load_scale, weights.active_request_weight
    holder_no, load_of = index.holder_no, in_flight.get
    cold = scale * n + decode_blocks  # the cost before load of an engine that reuses nothing
    if pool:
        pool = [h for h in pool if holder_no(h) is not None]  # pool nodes that hold nothing cannot help
    if hybrid and not any(e in hybrid for e in engines):
        hybrid = None
    if not pool and not hybrid:
        loads = list(map(load_of, engines, repeat(0)))
        if not any(loads):
            candidates, walks, best = _idle(index, tag, masks, first, engines, cold, per_request, scale,
                                            decode_blocks, n, weights)
            return _pick(candidates, walks, best, n, weights, rng)
    candidates: list[Candidate] = []
    walks: list[list[Step]] = []
    best, best_cost, best_engine = -1, 0.0, ""
    make = tuple.__new__
    pool_bits = [(h, b) for h in pool if (b := index.holder_bits(h))] if hybrid else []
    for engine in engines:
        load = load_of(engine, 0)
        no = holder_no(engine)
        if hybrid and engine in hybrid:
            credit, steps = _hybrid_walk(index, hybrid[engine], tag, blocks, engine, pool_bits, weights)
        elif pool:
            credit, steps = _engine_walk(index, masks, engine, pool, weights)
        elif no is not None and first >> (no * TIER_SLOTS) & TIER_MASK:
            credit, steps = _own_walk(masks, engine, no * TIER_SLOTS, weights)
        else:  # it lacks the first block and there is no pool to fetch from: nothing to reuse
            cost = cold + per_request * load
            candidates.append(make(Candidate, (engine, 0, 0.0, cost, load)))
            walks.append(_NO_STEPS)
            if best < 0 or cost < best_cost or (cost == best_cost and engine < best_engine):
                best, best_cost, best_engine = len(walks) - 1, cost, engine
            continue
        uncovered = n - credit
        cost = scale * (uncovered if uncovered > 0 else 0.0) + decode_blocks + per_request * load
        candidates.append(make(Candidate, (engine, len(steps), credit, cost, load)))
        walks.append(steps)
        if best < 0 or cost < best_cost or (cost == best_cost and engine < best_engine):
            best, best_cost, best_engine = len(walks) - 1, cost, engine
    return _pick(candidates, walks, best, n, weights, rng)


def _pick(candidates: list[Candidate], walks: list[list[Step]], best: int, n: int, weights: CostWeights,
          rng: random.Random | None) -> tuple[str | None, float, list[Candidate], list[Step]]:
    pick = best
    if weights.temperature > 0:
        rng = rng or random.Random()
        low = candidates[best].cost
        odds = [math.exp(-(c.cost - low) / weights.temperature) for c in candidates]
        pick = rng.choices(range(len(candidates)), weights=odds)[0]
    winner, steps = candidates[pick], walks[pick]
    plan = steps + [RECOMPUTE] * (n - len(steps))
    return winner.engine, winner.cost, candidates, plan


# The common request: no pool to fetch from and no engine with a request in flight. Then every
# engine lacking the first block scores the same as in the last such request of the same size,
# so those candidates (shared tuples, never mutated) and the cheapest of them are kept, with
# which engine each holder number is, per engine list and number of holders known, in the
# index's `router_memo` (holder numbers are the index's own).
_COLD_MAX = 1024


def _idle(index: ResidencyIndex, tag: bytes, masks: list[int], first: int, engines: list[str], cold: float,
          per_request: float, scale: float, decode_blocks: float, n: int,
          w: CostWeights) -> tuple[list[Candidate], list[list[Step]], int]:
    key = (tuple(engines), index.holder_count(), cold, per_request)
    memo = index.router_memo
    kept = memo.get(key)
    if kept is None:
        if len(memo) >= _COLD_MAX:
            memo.clear()
        cost = cold + per_request * 0
        idle = [Candidate(e, 0, 0.0, cost, 0) for e in engines]
        best = 0
        for i, c in enumerate(idle):  # equal costs: the smallest engine id
            if c.engine < idle[best].engine:
                best = i
        position = {}
        for i, e in enumerate(engines):
            no = index.holder_no(e)
            if no is not None:
                position.setdefault(no, i)
        kept = memo[key] = (idle, best, position)
    idle, best, position = kept
    candidates = list(idle)
    walks = [_NO_STEPS] * len(engines)
    scored = []
    bits = first
    while bits:  # the holders of the first block: the only engines with something to reuse
        low = bits & -bits
        no = (low.bit_length() - 1) // TIER_SLOTS
        bits &= ~(TIER_MASK << (no * TIER_SLOTS))
        i = position.get(no)
        if i is None:
            continue
        engine = engines[i]
        credit, steps = _own_walk(masks, engine, no * TIER_SLOTS, w)
        uncovered = n - credit
        cost = scale * (uncovered if uncovered > 0 else 0.0) + decode_blocks + per_request * 0
        candidates[i] = Candidate(engine, len(steps), credit, cost, 0)
        walks[i] = steps
        scored.append(i)
    if best in scored:  # the idle favourite was scored: look at everyone, in order, as `score` does
        best = 0
        for i, c in enumerate(candidates):
            if c[3] < candidates[best][3] or (c[3] == candidates[best][3] and c[0] < candidates[best][0]):
                best = i
        return candidates, walks, best
    best_cost, best_engine = candidates[best][3], candidates[best][0]
    for i in sorted(scored):
        c = candidates[i]
        if c[3] < best_cost or (c[3] == best_cost and c[0] < best_engine):
            best, best_cost, best_engine = i, c[3], c[0]
    return candidates, walks, best
