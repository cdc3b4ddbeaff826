"""The router's cost function against a plain reference written from its docstring, on random
residencies: the optimised walk (leading lookups only, per-engine shortcuts) decides the same."""

from __future__ import annotations

import math
import random

import pytest

from quilld.index.residency import ResidencyIndex
from quilld.index.router import Candidate, CostWeights, Step, choose
from quilld.model import CacheTier

TAG = b"\x00\x00\x00\x07"
ENGINE_TIERS = ("hbm", "cpu", "storage")
POOL_TIERS = ("dram", "ssd")


def reference(index: ResidencyIndex, blocks: list, engines: list[str], pool: list[str], in_flight: dict,
              decode_blocks: float, w: CostWeights) -> tuple:
    """Per engine, the leading run of blocks it can reuse: its own HBM, then CPU, else the best of
    its own storage and a pool copy (DRAM before SSD, pool nodes in order); lowest cost wins, ties
    to the smaller engine id."""
    holders = [index.locate(TAG, [b])[0] for b in blocks]
    candidates, plans = [], []
    for engine in engines:
        credit, plan = 0.0, []
        for held in holders:
            own = {t for h, t in held if h == engine}
            if CacheTier.HBM in own:
                credit += w.hbm_credit
                plan.append(Step("hit", engine, CacheTier.HBM))
                continue
            if CacheTier.CPU in own:
                credit += w.host_credit
                plan.append(Step("hit", engine, CacheTier.CPU))
                continue
            fetch = None
            for node in pool:
                tiers = {t for h, t in held if h == node}
                if CacheTier.DRAM in tiers:
                    fetch = (node, CacheTier.DRAM)
                    break
                if CacheTier.SSD in tiers and fetch is None:
                    fetch = (node, CacheTier.SSD)
            fetched = 0.0 if fetch is None else w.host_credit if fetch[1] is CacheTier.DRAM else w.disk_credit
            if CacheTier.STORAGE in own and (fetch is None or w.storage_credit >= fetched):
                credit += w.storage_credit
                plan.append(Step("hit", engine, CacheTier.STORAGE))
                continue
            if fetch is None:
                break
            credit += fetched
            plan.append(Step("fetch", *fetch))
        load = in_flight.get(engine, 0)
        uncovered = len(blocks) - credit
        cost = w.prefill_load_scale * (uncovered if uncovered > 0 else 0.0) + decode_blocks + \
            w.active_request_weight * load
        candidates.append(Candidate(engine, len(plan), credit, cost, load))
        plans.append(plan)
    if not candidates:
        return None, math.inf, [], []
    best = min(range(len(candidates)), key=lambda i: (candidates[i].cost, candidates[i].engine))
    plan = plans[best] + [Step("recompute")] * (len(blocks) - len(plans[best]))
    return candidates[best].engine, candidates[best].cost, candidates, plan


@pytest.mark.parametrize("seed", range(80))
def test_choose_matches_the_reference(seed):
    rng = random.Random(seed)
    engines = [f"e{i}" for i in range(rng.randint(0, 6))]
    pool = [f"node-{i}" for i in range(rng.randint(0, 2))]
    index = ResidencyIndex()
    chain = [rng.getrandbits(64) - (1 << 63) * rng.randint(0, 1) for _ in range(rng.randint(0, 24))]
    for holder in engines + pool + ["stranger"]:
        tiers = POOL_TIERS if holder.startswith("node") else ENGINE_TIERS
        for i, block in enumerate(chain):
            if rng.random() < 0.7 - 0.02 * i:
                index.put(TAG, block, holder, rng.choice(tiers))
    w = CostWeights(prefill_load_scale=rng.choice([1.0, 0.5]), active_request_weight=rng.choice([1.0, 3.0]),
                    storage_credit=rng.choice([0.25, 0.8, 0.1, -0.5]))
    in_flight = {e: rng.randint(0, 3) for e in engines if rng.random() < 0.5}
    decode = rng.choice([0.0, 2.0, 0.3])
    blocks = chain + ([rng.getrandbits(64)] if rng.random() < 0.3 else [])
    d = choose(index, TAG, blocks, engines, pool, in_flight, decode, w)
    assert (d.engine, d.cost, d.candidates, d.plan) == reference(index, blocks, engines, pool, in_flight, decode, w)


def test_two_indexes_numbering_their_holders_differently_decide_apart():
    """What the router keeps between requests belongs to one index: holder numbers differ between
    indexes (here e1 is holder 0 in one and holder 1 in the other)."""
    blocks = [1, 2, 3]
    one, other = ResidencyIndex(), ResidencyIndex()
    for b in blocks:
        one.put(TAG, b, "e1", "hbm")
    other.put(TAG, 99, "e1", "hbm")  # e1 is numbered first here too, then e2 holds the request
    for b in blocks:
        other.put(TAG, b, "e2", "hbm")
    flipped = ResidencyIndex()
    flipped.put(TAG, 99, "e2", "hbm")
    for b in blocks:
        flipped.put(TAG, b, "e1", "hbm")
    w = CostWeights()
    for index, want in ((one, "e1"), (other, "e2"), (flipped, "e1"), (one, "e1")):
        d = choose(index, TAG, blocks, ["e1", "e2"], [], {}, 0.0, w)
        assert d.engine == want and d.plan == [Step("hit", want, CacheTier.HBM)] * 3
        assert (d.engine, d.cost, d.candidates, d.plan) == reference(index, blocks, ["e1", "e2"], [], {}, 0.0, w)
