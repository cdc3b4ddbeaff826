"""The cost function of quilld/index/router.py on hand-built residencies."""

from __future__ import annotations

import random
from collections import Counter

from quilld.index.residency import ResidencyIndex
from quilld.index.router import CostWeights, Step, choose
from quilld.model import CacheTier

TAG = b"\x00\x00\x00\x00"
BLOCKS = list(range(100, 116))  # a 16-block request
ENGINES = ["e1", "e2", "e3"]


def index_with(**holdings: tuple[str, int]) -> ResidencyIndex:
    """holdings: holder=(tier, number of leading blocks held)."""
    idx = ResidencyIndex()
    for holder, (tier, n) in holdings.items():
        for b in BLOCKS[:n]:
            idx.put(TAG, b, holder, tier)
    return idx


def test_the_cache_hot_engine_wins_when_load_is_equal():
    idx = index_with(e2=("hbm", 12))
    d = choose(idx, TAG, BLOCKS, ENGINES, [], {})
    assert d.engine == "e2"
    by = {c.engine: c for c in d.candidates}
    assert by["e2"].overlap_blocks == 12 and by["e2"].credit == 12.0
    assert by["e2"].cost == 4.0 and by["e1"].cost == 16.0
    assert d.plan == [Step("hit", "e2", CacheTier.HBM)] * 12 + [Step("recompute")] * 4


def test_a_loaded_hot_engine_loses_to_an_idle_cold_one_when_the_cost_says_so():
    idx = index_with(e1=("hbm", 4))
    assert choose(idx, TAG, BLOCKS, ["e1", "e2"], [], {"e1": 2}).engine == "e1"  # 12+2 < 16
    assert choose(idx, TAG, BLOCKS, ["e1", "e2"], [], {"e1": 5}).engine == "e2"  # 12+5 > 16


def test_in_flight_counts_spread_a_burst_of_identical_requests():
    idx = index_with(e1=("hbm", 2))
    in_flight: Counter[str] = Counter()
    for _ in range(30):
        d = choose(idx, TAG, BLOCKS, ENGINES, [], in_flight)
        in_flight[d.engine] += 1
    assert set(in_flight) == set(ENGINES)
    assert max(in_flight.values()) - min(in_flight.values()) <= 3


def test_tier_credits_order_hbm_then_host_then_disk():
    idx = ResidencyIndex()
    for b in BLOCKS[:8]:
        idx.put(TAG, b, "e1", "hbm")
        idx.put(TAG, b, "e2", "cpu")
        idx.put(TAG, b, "node-b", "ssd")
    for b in BLOCKS[:8]:
        idx.put(TAG, b, "node-a", "dram")
    d = choose(idx, TAG, BLOCKS, ["e1", "e2"], ["node-a", "node-b"], {})
    credit = {c.engine: c.credit for c in d.candidates}
    assert credit == {"e1": 8.0, "e2": 6.0}
    alone = ResidencyIndex()
    for b in BLOCKS[:8]:
        alone.put(TAG, b, "node-b", "ssd")
    ssd = choose(alone, TAG, BLOCKS, ["e3"], ["node-b"], {})
    assert ssd.candidates[0].credit == 2.0
    assert ssd.plan[:8] == [Step("fetch", "node-b", CacheTier.SSD)] * 8
    assert d.engine == "e1"


def test_pool_dram_is_preferred_over_pool_ssd_for_a_fetch():
    idx = ResidencyIndex()
    for b in BLOCKS[:4]:
        idx.put(TAG, b, "node-b", "ssd")
        idx.put(TAG, b, "node-c", "dram")
    d = choose(idx, TAG, BLOCKS, ["e1"], ["node-b", "node-c"], {})
    assert d.plan[:4] == [Step("fetch", "node-c", CacheTier.DRAM)] * 4
    assert d.candidates[0].credit == 3.0


def test_a_gap_ends_the_reusable_prefix():
    idx = ResidencyIndex()
    for b in BLOCKS[:3] + BLOCKS[4:]:
        idx.put(TAG, b, "e1", "hbm")
    d = choose(idx, TAG, BLOCKS, ["e1"], [], {})
    assert d.candidates[0].overlap_blocks == 3
    assert d.plan[3:] == [Step("recompute")] * 13


def test_only_the_given_engines_are_candidates_and_none_means_no_decision():
    idx = index_with(e9=("hbm", 16))  # an engine of another model, filtered out by the caller
    d = choose(idx, TAG, BLOCKS, ["e1"], [], {})
    assert d.engine == "e1"
    assert choose(idx, TAG, BLOCKS, [], [], {}).engine is None


def test_a_temperature_draws_mostly_but_not_only_the_cheapest():
    idx = index_with(e1=("hbm", 10))
    rng = random.Random(1)
    picks = Counter(choose(idx, TAG, BLOCKS, ["e1", "e2"], [], {}, weights=CostWeights(temperature=4.0),
                           rng=rng).engine for _ in range(400))
    assert picks["e1"] > picks["e2"] > 0
    cold = Counter(choose(idx, TAG, BLOCKS, ["e1", "e2"], [], {}, weights=CostWeights(temperature=0.0)).engine
                   for _ in range(20))
    assert cold == {"e1": 20}


def test_the_engines_own_storage_tier_credits_storage_credit_and_says_hit_storage():
    idx = ResidencyIndex()
    for b in BLOCKS[:4]:
        idx.put(TAG, b, "e1", "hbm")
    for b in BLOCKS[4:10]:
        idx.put(TAG, b, "e1", "storage")  # offloaded by vLLM's connector (medium STORAGE)
    d = choose(idx, TAG, BLOCKS, ["e1"], [], {})
    assert d.candidates[0].overlap_blocks == 10
    assert d.candidates[0].credit == 4 * 1.0 + 6 * 0.25
    assert d.plan[:10] == [Step("hit", "e1", CacheTier.HBM)] * 4 + [Step("hit", "e1", CacheTier.STORAGE)] * 6
    assert d.plan[10:] == [Step("recompute")] * 6
    tuned = choose(idx, TAG, BLOCKS, ["e1"], [], {}, weights=CostWeights(storage_credit=0.5))
    assert tuned.candidates[0].credit == 4 * 1.0 + 6 * 0.5
    assert tuned.candidates[0].cost == 16 - 7.0


def test_a_pool_dram_copy_beats_the_engines_own_storage_and_storage_beats_nothing():
    idx = ResidencyIndex()
    for b in BLOCKS[:4]:
        idx.put(TAG, b, "e1", "storage")
        idx.put(TAG, b, "node-a", "dram" if b < BLOCKS[2] else "ssd")
    d = choose(idx, TAG, BLOCKS, ["e1"], ["node-a"], {})
    # blocks 0-1: pool DRAM (0.75) beats own storage (0.25); blocks 2-3: pool SSD ties own storage, own wins
    assert d.plan[:4] == [Step("fetch", "node-a", CacheTier.DRAM)] * 2 + [Step("hit", "e1", CacheTier.STORAGE)] * 2
    assert d.candidates[0].credit == 2 * 0.75 + 2 * 0.25
    assert choose(idx, TAG, BLOCKS, ["e2"], ["node-a"], {}).candidates[0].credit == 2 * 0.75 + 2 * 0.25
