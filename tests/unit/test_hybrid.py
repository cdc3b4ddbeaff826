"""Hybrid models (issue 18.8): an engine whose KV-cache group kinds are declared is credited the
prefix vLLM 0.33's hybrid KV-cache manager would hit.

The events are vLLM 0.33's, encoded with msgspec structs shaped like vLLM's (tests/vllm_schema.py)
and decoded by quilld as the subscriber does. The reference below transcribes vLLM 0.33's
`HybridKVCacheCoordinator.find_longest_cache_hit` and the three managers' `find_longest_cache_hit`
(`vllm/v1/core/kv_cache_coordinator.py`, `single_type_kv_cache_manager.py`) for the case quilld
models: one block size, no EAGLE, hits aligned to whole blocks."""

from __future__ import annotations

import random

import pytest
import vllm_schema as vllm

from quilld.config import Config, EngineConfig, GroupConfig, RouterConfig, load
from quilld.errors import ConfigError
from quilld.index.control import ControlPlane
from quilld.index.events import decode_payload
from quilld.index.groups import HitRule, longest_hit
from quilld.model import CacheTier, IdentityScope
from quilld.scopes import ScopeRegistry

B = 16  # tokens per block
SCOPE = IdentityScope("default", "m", "", "")
FULL, MAMBA = GroupConfig("full"), GroupConfig("mamba")


def window(tokens: int) -> GroupConfig:
    return GroupConfig("sliding_window", tokens)


_VLLM_KIND = {"full": "full_attention", "sliding_window": "sliding_window", "mamba": "mamba"}


# -- the reference: vLLM 0.33's search, transcribed ----------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _all_cached(cached: set, h, group_ids: list[int]) -> bool:
    return all((h, g) in cached for g in group_ids)  # BlockPool.get_cached_block over the group ids


def full_attention_hit(hashes, max_length, group_ids, cached) -> int:
    n = 0
    for h in hashes[:max_length // B]:  # Phase 1: longest run of cached blocks from the start
        if not _all_cached(cached, h, group_ids):
            break
        n += 1
    return n * B


def sliding_window_hit(hashes, max_length, group_ids, cached, sliding_window) -> int:
    contiguous_needed = cdiv(sliding_window - 1, B)
    max_num_blocks = max_length // B
    num_contiguous_blocks = 0
    for i in range(max_num_blocks - 1, -1, -1):  # right to left, early stop on a match
        if _all_cached(cached, hashes[i], group_ids):
            num_contiguous_blocks += 1
            if num_contiguous_blocks >= contiguous_needed:
                return (i + num_contiguous_blocks) * B  # the trailing blocks are trimmed
        else:
            num_contiguous_blocks = 0
    return num_contiguous_blocks * B  # the first blocks are a hit even if fewer than the window


def mamba_hit(hashes, max_length, group_ids, cached) -> int:
    for i in range(max_length // B - 1, -1, -1):  # the last match only
        if _all_cached(cached, hashes[i], group_ids):
            return (i + 1) * B
    return 0


def vllm_hit_blocks(groups: tuple[GroupConfig, ...], cached: set, hashes: list, max_length: int) -> int:
    """HybridKVCacheCoordinator.find_longest_cache_hit: the blocks of the hit."""
    specs: list[tuple[GroupConfig, list[int]]] = []  # groups of one spec are looked up together
    for g, group in enumerate(groups):
        for spec, ids in specs:
            if spec == group:
                ids.append(g)
                break
        else:
            specs.append((group, [g]))
    specs.sort(key=lambda s: s[0].kind != "full")  # full attention first
    simple = len(specs) == 2 and specs[0][0].kind == "full"
    hit_length, full_length = max_length, None
    while True:
        curr = hit_length
        for spec, ids in specs:
            if spec.kind == "full" and full_length is not None:
                curr = min(curr, full_length)  # downward-closed: looked up once
                continue
            if spec.kind == "full":
                curr = full_length = full_attention_hit(hashes, curr, ids, cached)
            elif spec.kind == "sliding_window":
                curr = sliding_window_hit(hashes, curr, ids, cached, spec.window_tokens)
            else:
                curr = mamba_hit(hashes, curr, ids, cached)
        if curr >= hit_length:
            break
        hit_length = curr
        if simple:
            break
    return hit_length // B


# -- a vLLM block pool's event stream ---------------------------------------------------------------------------


class HybridEngine:
    """What vLLM's block pool publishes for a hybrid model, group by group: a prefill caches every
    block of the prompt in each attention group and, for a Mamba group (mamba_cache_mode "align"),
    the state at the prefill's last block; evicting a cached block of a group sends BlockRemoved
    with that group. `cached` is the prefix cache the reference searches."""

    def __init__(self, groups: tuple[GroupConfig, ...]) -> None:
        self.groups = groups
        self.cached: set[tuple[int, int]] = set()

    def prefill(self, hashes: list[int], upto: int | None = None) -> list:
        events = []
        for g, group in enumerate(self.groups):
            stored = hashes[upto - 1:upto] if group.kind == "mamba" and upto else \
                hashes[-1:] if group.kind == "mamba" else hashes[:upto]
            new = [h for h in stored if (h, g) not in self.cached]
            if not new:
                continue
            self.cached.update((h, g) for h in new)
            events.append(vllm.gpu(new, block_size=B, group=g, kind=_VLLM_KIND[group.kind],
                                   window=group.window_tokens or None))
        return events

    def evict(self, rng: random.Random, n: int) -> list:
        events = []
        for h, g in rng.sample(sorted(self.cached), min(n, len(self.cached))):
            self.cached.discard((h, g))
            events.append(vllm.removed([h], group=g))
        return events


def plane(*groups: GroupConfig, **router) -> ControlPlane:
    engine = EngineConfig(id="vllm-0", url="http://127.0.0.1:1", model="m", block_size=B, groups=groups)
    return ControlPlane(Config(engines=(engine,), router=RouterConfig(**router)), ScopeRegistry())


def feed(control: ControlPlane, events: list) -> None:
    batch = decode_payload(vllm.encode(events))
    assert batch.malformed == 0
    control.apply_events("vllm-0", batch.events)


def decide(control: ControlPlane, blocks: list):
    return control.route(SCOPE, control.scopes.tag(SCOPE), blocks)


def plan(control: ControlPlane, blocks: list) -> list[str]:
    return [s.action if s.action == "recompute" else f"{s.action}:{s.tier.value}" for s in decide(control, blocks).plan]


def chain(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(n)]


# -- the cases --------------------------------------------------------------------------------------------


def test_a_mamba_group_keeping_state_at_the_last_block_credits_the_whole_prefix():
    """The issue: with a Mamba group, ROUTE credited 0 of the 8 blocks vLLM reuses."""
    prompt = chain(1, 8)
    engine = HybridEngine((FULL, MAMBA))
    events = engine.prefill(prompt)
    assert [(e.group_idx, len(e.block_hashes), e.kv_cache_spec_kind) for e in events] == \
        [(0, 8, "full_attention"), (1, 1, "mamba")]
    control = plane(FULL, MAMBA)
    feed(control, events)
    longer = prompt + chain(2, 2)  # the next turn: the same 8 blocks, then new ones
    assert vllm_hit_blocks(engine.groups, engine.cached, longer, len(longer) * B) == 8
    d = decide(control, longer)
    assert (d.overlap_blocks, d.candidates[0].credit) == (8, 8.0)
    assert plan(control, longer) == ["hit:hbm"] * 8 + ["recompute"] * 2
    # a prompt that stops inside the prefix has no state to resume from: vLLM recomputes it all
    assert vllm_hit_blocks(engine.groups, engine.cached, prompt[:6], 6 * B) == 0
    assert plan(control, prompt[:6]) == ["recompute"] * 6

    # today's rule, kept for an engine that declares nothing: a block counts only while every group holds it
    undeclared = plane()
    feed(undeclared, events)
    assert decide(undeclared, longer).overlap_blocks == 0


def test_a_sliding_window_group_needs_only_its_last_window():
    """4 blocks of window (64 tokens, cdiv(63, 16) = 4): the freed early blocks do not matter."""
    groups = (FULL, window(64))
    prompt = chain(3, 12)
    engine = HybridEngine(groups)
    events = engine.prefill(prompt)
    events.append(vllm.removed(prompt[:8], group=1))  # the window group's blocks 0..7 were evicted
    engine.cached -= {(h, 1) for h in prompt[:8]}
    control = plane(*groups)
    feed(control, events)
    assert plan(control, prompt) == ["hit:hbm"] * 12
    # 10 blocks: the window before block 10 (6..9) is half gone, and so is every shorter one
    assert vllm_hit_blocks(groups, engine.cached, prompt[:10], 10 * B) == 0
    assert plan(control, prompt[:10]) == ["recompute"] * 10
    undeclared = plane()
    feed(undeclared, events)
    assert decide(undeclared, prompt).overlap_blocks == 0  # under-credited: block 0 left the window group


def test_the_hit_matches_vllms_search_on_random_streams():
    """Random prefills and evictions over shared prefixes, for mixes of kinds: ROUTE's overlap is
    the reference's hit for every prefix length, each block a hit in HBM."""
    mixes = [(FULL, MAMBA), (FULL, window(64)), (FULL, window(17), MAMBA), (window(48), MAMBA), (MAMBA,),
             (window(33),), (FULL, FULL, window(100)), (MAMBA, FULL, window(64), window(16)), (FULL,)]
    rng = random.Random(18_8)
    compared = nonzero = 0
    for mix in mixes:
        engine, control = HybridEngine(mix), plane(*mix)
        roots = [chain(rng.getrandbits(32), 24) for _ in range(3)]
        prompts = []
        for step in range(40):
            root = rng.choice(roots)
            cut = rng.randint(1, 24)
            prompt = root[:cut] + chain(rng.getrandbits(32), rng.randint(0, 3))
            prompts.append(prompt)
            events = engine.prefill(prompt, upto=rng.choice([None, rng.randint(1, len(prompt))]))
            if rng.random() < 0.5:
                events += engine.evict(rng, rng.randint(1, 12))
            feed(control, events)
            for query in prompts[-3:] + [rng.choice(roots)]:
                for n in (len(query), rng.randint(1, len(query))):
                    blocks = query[:n]
                    want = vllm_hit_blocks(mix, engine.cached, blocks, n * B)
                    d = decide(control, blocks)
                    assert d.overlap_blocks == want, (mix, step, n)
                    assert d.candidates[0].credit == float(want)
                    assert [s.action for s in d.plan] == ["hit"] * want + ["recompute"] * (n - want)
                    compared += 1
                    nonzero += want > 0
    assert compared > 2000 and nonzero > compared // 4


def test_longest_hit_is_the_longest_prefix_every_group_accepts():
    rule = HitRule.of((FULL, window(64), MAMBA), B)
    assert (rule.full, rule.windows, rule.states) == (0b001, ((0b010, 4),), 0b100)
    assert HitRule.of((window(1),), B).windows == ((1, 1),)  # vLLM finds at least the block before the end
    assert HitRule.of((window(4096),), B).windows == ((1, 256),)
    every, full_sw = 0b111, 0b011
    holds = [full_sw, full_sw, every, full_sw, full_sw, full_sw, full_sw, every]
    assert longest_hit(rule, holds) == 8
    assert longest_hit(rule, holds[:7]) == 3  # the state at block 2, its window 0..2 whole
    assert longest_hit(rule, [0b011, 0b111, 0b001, 0b011, 0b111]) == 2  # block 2 breaks every later window
    assert longest_hit(rule, [0b001, 0b101, 0b011, 0b011, 0b111]) == 0  # and here block 1 (and 0)
    assert longest_hit(rule, []) == 0


# -- tiers, the pool, and vLLM 0.33's offload placeholders --------------------------------------------------------


def test_each_block_is_credited_where_the_groups_that_read_it_have_it():
    groups = (FULL, window(32), MAMBA)  # a window of cdiv(31, 16) = 2 blocks
    prompt = chain(4, 6)
    control = plane(*groups)
    feed(control, HybridEngine(groups).prefill(prompt))
    # the offloading connector copied the last blocks out, one placeholder per group (vLLM 0.33 names it),
    # and the GPU then evicted the Mamba state and the window group's block 4
    feed(control, [vllm.offloaded(prompt[4:], vllm.MEDIUM_CPU, group=g) for g in range(3)] +
         [vllm.removed(prompt[5:], group=2), vllm.removed(prompt[4:5], group=1)])
    # block 5 ends the prefix: the Mamba state is on the CPU only; block 4: the window's copy is on the CPU
    assert plan(control, prompt) == ["hit:hbm"] * 4 + ["hit:cpu", "hit:cpu"]
    assert decide(control, prompt).candidates[0].credit == 4.0 + 2 * 0.75
    # a placeholder with no group speaks for the block as a whole
    feed(control, [vllm.removed(prompt[4:], vllm.MEDIUM_CPU, group=g) for g in range(3)] +
         [vllm.offloaded(prompt[4:], vllm.MEDIUM_STORAGE)])
    assert plan(control, prompt) == ["hit:hbm"] * 4 + ["hit:storage"] * 2
    assert decide(control, prompt).candidates[0].credit == 4.0 + 2 * 0.25


def test_a_block_read_for_nothing_is_credited_as_the_block_that_ends_the_prefix():
    control = plane(MAMBA)  # a pure state-space model: only the state at the end is read
    prompt = chain(5, 5)
    feed(control, [vllm.offloaded(prompt[4:], vllm.MEDIUM_CPU, group=0)])
    assert plan(control, prompt) == ["hit:cpu"] * 5
    assert plan(control, prompt[:4]) == ["recompute"] * 4


def test_a_pool_copy_is_the_block_as_a_whole():
    control = plane(FULL, MAMBA)
    prompt = chain(6, 8)
    feed(control, [vllm.gpu(prompt, group=0, kind="full_attention"), vllm.gpu(prompt[5:6], group=1, kind="mamba")])
    assert plan(control, prompt) == ["hit:hbm"] * 6 + ["recompute"] * 2  # the state at block 5
    tag = control.scopes.tag(SCOPE)
    control.index.put(tag, prompt[7], "node-b", CacheTier.DRAM)
    control.pool = ["node-b"]
    assert plan(control, prompt) == ["hit:hbm"] * 7 + ["fetch:dram"]  # block 7 from the pool, state and all
    d = decide(control, prompt)
    assert d.plan[-1].holder == "node-b" and d.candidates[0].credit == 7.0 + 0.75
    feed(control, [vllm.removed(prompt[1:2], group=0)])  # the engine lost block 1; the pool's SSD has it
    control.index.put(tag, prompt[1], "node-b", CacheTier.SSD)
    assert plan(control, prompt) == ["hit:hbm", "fetch:ssd"] + ["hit:hbm"] * 5 + ["fetch:dram"]
    assert decide(control, prompt).candidates[0].credit == 6.0 + 0.25 + 0.75


def test_removal_clear_and_reset_forget_what_the_groups_held():
    control = plane(FULL, MAMBA)
    prompt = chain(7, 4)
    feed(control, HybridEngine((FULL, MAMBA)).prefill(prompt))
    tag = control.scopes.tag(SCOPE)
    assert [sorted(t.value for _, t in held) for held in control.index.locate(tag, prompt)] == [["hbm"]] * 4
    feed(control, [vllm.removed(prompt[3:], group=1)])  # the state goes: nothing is reusable
    assert plan(control, prompt) == ["recompute"] * 4
    assert control.index.locate(tag, prompt[3:]) == [[("vllm-0", CacheTier.HBM)]]  # the full group still has it
    feed(control, [vllm.AllBlocksCleared()])
    assert len(control.index) == 0 and plan(control, prompt) == ["recompute"] * 4
    feed(control, HybridEngine((FULL, MAMBA)).prefill(prompt))
    assert control.reset_engine("vllm-0", "gap") == 4 and plan(control, prompt) == ["recompute"] * 4


def test_events_of_an_undeclared_group_are_ignored_and_a_kind_mismatch_is_logged(caplog):
    control = plane(FULL, MAMBA)
    prompt = chain(8, 4)
    feed(control, [vllm.gpu(prompt, group=0, kind="full_attention"), vllm.gpu(prompt[3:], group=1, kind="mamba"),
                   vllm.gpu(prompt[:2], group=2, kind="sliding_window", window=64)])
    assert plan(control, prompt) == ["hit:hbm"] * 4
    assert "name KV-cache group 2, but its config declares 2 group(s)" in caplog.text
    control = plane(FULL, window(64))
    feed(control, [vllm.gpu(prompt, group=1, kind="mamba")])
    assert "group 1 is declared sliding_window(64) but its events say mamba" in caplog.text
    feed(control, [vllm.gpu(prompt, group=0, kind="full_attention")])
    assert plan(control, prompt) == ["hit:hbm"] * 4  # credited as declared


def test_the_gateways_record_fills_every_group():
    """An engine without KV events: the gateway records a prefilled prompt in every group."""
    control = plane(FULL, window(64), MAMBA)
    prompt = chain(9, 5)
    tag = control.scopes.tag(SCOPE)
    assert control.record("vllm-0", tag, prompt) == 5
    assert plan(control, prompt) == ["hit:hbm"] * 5
    control.unrecord("vllm-0", tag, prompt[4])  # every group's copy of block 4 goes
    assert plan(control, prompt) == ["hit:hbm"] * 4 + ["recompute"]  # the state at block 3 is still there
    control.unrecord("vllm-0", tag, prompt[0])
    assert plan(control, prompt) == ["recompute"] * 5 and len(control.index) == 3


# -- the config --------------------------------------------------------------------------------------------------


def test_groups_are_declared_in_the_engine_table(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text('[[engines]]\nid = "e"\nurl = "http://h:1"\nmodel = "m"\nblock_size = 32\n'
                    'groups = [{kind = "full"}, {kind = "sliding_window", window_tokens = 4096}, {kind = "mamba"}]\n')
    e = load(str(path), environ={}).engines[0]
    assert e.groups == (FULL, window(4096), MAMBA) and e.block_size == 32
    assert load(environ={}).engines == () and EngineConfig().groups == ()


@pytest.mark.parametrize("groups, message", [
    ('"full"', "groups must be a list of tables"),
    ('["full"]', "groups[0]: a group is a table"),
    ('[{kind = "full_attention"}]', "groups[0].kind must be one of full, sliding_window, mamba"),
    ('[{kind = "sliding_window"}]', "a sliding_window group needs window_tokens"),
    ('[{kind = "sliding_window", window_tokens = -1}]', "a sliding_window group needs window_tokens"),
    ('[{kind = "mamba", window_tokens = 8}]', "window_tokens is for sliding_window groups only"),
    ('[{kind = "full", size = 16}]', "unknown key(s) size"),
    ('[{kind = "sliding_window", window_tokens = "wide"}]', "groups[0].window_tokens: invalid value"),
    ("[" + ", ".join(['{kind = "full"}'] * 65) + "]", "at most 64 groups"),
])
def test_bad_groups_are_refused_with_what_is_wrong(tmp_path, groups, message):
    path = tmp_path / "q.toml"
    path.write_text(f'[[engines]]\nid = "e"\nurl = "http://h:1"\nmodel = "m"\ngroups = {groups}\n')
    with pytest.raises(ConfigError) as e:
        load(str(path), environ={})
    assert message in e.value.message
