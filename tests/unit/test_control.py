"""The control plane: the identity guard on a collision workload, and engines' KV events as vLLM
0.33 sends them (offload placeholders, the STORAGE tier, KV-cache groups, resets)."""

from __future__ import annotations

import asyncio
import random

import pytest
import vllm_schema as vllm
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import free_port

from quilld.config import Config, EngineConfig, IndexConfig, RouterConfig
from quilld.index.control import ControlPlane, chain_hashes
from quilld.index.events import Batch, Stored, decode_payload
from quilld.index.residency import ResidencyIndex
from quilld.model import IdentityScope
from quilld.scopes import ScopeRegistry


def test_collision_workload_reuses_nothing_across_identities_and_counts_refusals():
    # One engine per (tenant, model); the same content hashes stored under every identity's
    # engine, some of them with a LoRA adapter.
    engines = tuple(EngineConfig(id=f"{t}-{m}", url="http://127.0.0.1:1", model=m, tenant=t)
                    for t in ("t1", "t2") for m in ("m1", "m2"))
    control = ControlPlane(Config(engines=engines), ScopeRegistry())
    rng = random.Random(9)
    chains = [[rng.getrandbits(64) for _ in range(8)] for _ in range(20)]
    owners = {}
    for i, chain in enumerate(chains):
        engine = engines[i % len(engines)]
        adapter = "lora-a" if i % 3 == 0 else None
        control.apply(engine.id, Batch(0.0, (Stored(tuple(chain), None, (), 16, None, "GPU", adapter),), None, None))
        owners[i] = (engine.tenant, engine.model, adapter or "")
    naive_cross = safe_hits = 0
    for i, chain in enumerate(chains):
        for tenant in ("t1", "t2"):
            for model in ("m1", "m2"):
                for adapter in ("", "lora-a"):
                    scope = IdentityScope(tenant, model, "", adapter)
                    d = control.route(scope, control.scopes.tag(scope), chain)
                    same = owners[i] == (tenant, model, adapter)
                    naive_cross += not same  # a content-hash cache would have served these
                    credit = max((c.credit for c in d.candidates), default=0.0)
                    if same:
                        assert credit == 8.0
                        safe_hits += 1
                    else:
                        assert credit == 0.0, (i, scope)
    refusals = control.scopes.refusals_of()  # by reason, every tenant's lookups
    # every cross-identity request whose model has engines was refused and counted
    assert safe_hits == len(chains)
    assert sum(refusals.values()) > 0
    assert set(refusals) == {"cross_tenant", "cross_model", "cross_tokenizer", "cross_adapter"}
    assert {t for t, _ in control.scopes.refusals} <= {"t1", "t2"}  # counted by the refused tenant
    assert refusals["cross_tenant"] > 0 and refusals["cross_adapter"] > 0
    assert naive_cross == len(chains) * 7


def test_token_chains_share_leading_blocks():
    a = chain_hashes(list(range(64)), 16)
    b = chain_hashes(list(range(48)) + [999] * 16, 16)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert chain_hashes(list(range(15)), 16) == []


# ---------------------------------------------------------------- KV events (issue 12)

ENGINE = EngineConfig(id="vllm-0", url="http://127.0.0.1:1", model="m")
SCOPE = IdentityScope("default", "m", "", "")


def plane(*engines: EngineConfig) -> ControlPlane:
    return ControlPlane(Config(engines=engines or (ENGINE,)), ScopeRegistry())


def feed(control: ControlPlane, *events, engine: str = "vllm-0") -> Batch:
    """Events through vLLM 0.33's encoding and quilld's decoder, then applied as the subscriber does."""
    batch = decode_payload(vllm.encode(list(events)))
    control.apply_events(engine, batch.events)
    return batch


def plan(control: ControlPlane, blocks: list) -> list[str]:
    d = control.route(SCOPE, control.scopes.tag(SCOPE), blocks)
    return [s.action if s.action == "recompute" else f"{s.action}:{s.tier.value}" for s in d.plan]


def test_offload_events_share_a_batch_with_gpu_events_and_all_of_it_applies():
    """The issue's case: the offloading connector's placeholders (block_size=0, STORAGE) beside GPU
    events used to lose the whole batch and, after a failed replay, every residency (4 -> 1)."""
    control = plane()
    batch = feed(control, vllm.gpu([1, 2, 3, 4]), vllm.offloaded([5, 6], vllm.MEDIUM_STORAGE),
                 vllm.offloaded([1, 2], vllm.MEDIUM_CPU), vllm.removed([9]))
    assert batch.malformed == 0
    assert plan(control, [1, 2, 3, 4, 5, 6, 7]) == ["hit:hbm"] * 4 + ["hit:storage"] * 2 + ["recompute"]
    d = control.route(SCOPE, control.scopes.tag(SCOPE), [1, 2, 3, 4, 5, 6, 7])
    assert d.candidates[0].credit == 4 * 1.0 + 2 * 0.25
    assert {t.value for _, t in control.index.locate(control.scopes.tag(SCOPE), [1])[0]} == {"hbm", "cpu"}
    feed(control, vllm.removed([1, 2, 3, 4]))  # GPU evicts; the CPU copies of 1 and 2 still count
    assert plan(control, [1, 2, 3]) == ["hit:cpu", "hit:cpu", "recompute"]


def test_storage_credit_comes_from_the_config():
    control = ControlPlane(Config(engines=(ENGINE,), router=RouterConfig(storage_credit=0.5)), ScopeRegistry())
    feed(control, vllm.offloaded([1, 2], vllm.MEDIUM_STORAGE))
    assert control.route(SCOPE, control.scopes.tag(SCOPE), [1, 2]).candidates[0].credit == 1.0


def test_a_block_counts_only_while_every_kv_cache_group_holds_it():
    control = plane()
    full = {"group": 0, "kind": "full_attention"}
    swa = {"group": 1, "kind": "sliding_window", "window": 4096}
    feed(control, vllm.gpu([1, 2, 3, 4], **full), vllm.gpu([1, 2, 3, 4], **swa))
    assert plan(control, [1, 2, 3, 4]) == ["hit:hbm"] * 4
    feed(control, vllm.removed([1], group=1))  # the window group freed block 1; the full group holds it
    assert plan(control, [1, 2, 3, 4]) == ["recompute"] * 4
    assert plan(control, [2, 3, 4]) == ["hit:hbm"] * 3
    assert control.index.locate(control.scopes.tag(SCOPE), [1]) == [[]]
    feed(control, vllm.gpu([1], **swa))  # stored again in that group: reusable again
    assert plan(control, [1, 2, 3, 4]) == ["hit:hbm"] * 4
    feed(control, vllm.removed([3], group=0))
    assert plan(control, [1, 2, 3, 4]) == ["hit:hbm"] * 2 + ["recompute"] * 2
    assert control.feed("vllm-0").groups == {0: "full_attention", 1: "sliding_window(4096)"}


def test_a_second_group_carries_the_first_groups_blocks_over():
    control = plane()
    feed(control, vllm.gpu([1, 2, 3], group=0), vllm.offloaded([7]))  # one group so far: straight to the index
    assert plan(control, [1, 2, 3]) == ["hit:hbm"] * 3
    feed(control, vllm.gpu([1, 2], group=1))  # group 1 appears: block 3 is group 0's only
    assert plan(control, [1, 2, 3]) == ["hit:hbm"] * 2 + ["recompute"]
    assert plan(control, [7]) == ["hit:cpu"]  # stored with no group: the whole block, every group
    feed(control, vllm.removed([7], vllm.MEDIUM_CPU, group=None))
    assert plan(control, [7]) == ["recompute"]


def test_groups_are_per_tier_and_a_clear_empties_every_group():
    control = plane()
    feed(control, vllm.gpu([1, 2], group=0), vllm.gpu([1, 2], group=1))
    feed(control, vllm.removed([2], group=1), vllm.BlockStored([2], None, [], 0, None, "CPU", None, group_idx=1))
    assert plan(control, [1, 2]) == ["hit:hbm", "recompute"]  # held in two tiers by two groups: neither counts
    feed(control, vllm.AllBlocksCleared())
    assert plan(control, [1]) == ["recompute"] and len(control.index) == 0
    feed(control, vllm.gpu([5], group=0), vllm.gpu([5], group=1))
    assert plan(control, [5]) == ["hit:hbm"]


def test_reset_drops_the_engine_and_counts_why():
    control = plane()
    control.apply("vllm-0", decode_payload(vllm.encode([vllm.gpu([1, 2], group=0), vllm.gpu([1], group=1)])))
    f = control.feed("vllm-0")
    assert (f["batches"], f["events"]) == (1, 2) and control.stats["kv_batches"] == 1
    assert control.reset_engine("vllm-0", "gap", 3) == 1
    assert plan(control, [1]) == ["recompute"] and f["drops"] == 1 and control.stats["kv_gaps"] == 1
    assert f.groups == {}
    feed(control, vllm.gpu([4], group=0))
    control.reset_engine("vllm-0", "restart")
    assert control.stats["kv_gaps"] == 1 and f["drops"] == 2  # a restart is not a loss
    view = control.feed_view("vllm-0")
    assert view["state"] == "push" and not view["subscribed"] and view["batches"] == 1


# ---------------------------------------------------------------- runs of events, one index call each (issue 22.3)

_event_ops = st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "clear"]),
                                st.lists(st.integers(0, 12), min_size=1, max_size=3),
                                st.sampled_from([vllm.MEDIUM_GPU, vllm.MEDIUM_CPU, vllm.MEDIUM_STORAGE]),
                                st.sampled_from([None, "lora-a"]), st.sampled_from([None, 0, 0, 1])),
                      max_size=24)


def _vllm_event(op, hashes, medium, lora, group):
    if op == "store":
        return vllm.gpu(hashes, lora=lora, group=group) if medium == vllm.MEDIUM_GPU else \
            vllm.BlockStored(hashes, None, [], 0, None, medium, lora, group_idx=group)
    if op == "remove":
        return vllm.removed(hashes, medium, group)
    return vllm.AllBlocksCleared()


@settings(max_examples=150, deadline=None)
@given(_event_ops, st.integers(1, 6))
def test_a_batch_applies_as_its_events_one_by_one(ops, cut):
    """Stores and removals of several scopes, tiers and groups, and clears, in one batch: the index
    ends as when each event is applied alone, however the batch is cut."""
    events = [_vllm_event(*op) for op in ops]
    whole, single, parts = plane(), plane(), plane()
    if events:
        feed(whole, *events)
        for e in events:
            feed(single, e)
        for i in range(0, len(events), cut):
            feed(parts, *events[i:i + cut])
    for other in (single, parts):
        assert sorted(whole.index.holder_entries("vllm-0")) == sorted(other.index.holder_entries("vllm-0"))
        assert len(whole.index) == len(other.index)
        for tier in ("hbm", "cpu", "storage"):
            assert whole.index.count("vllm-0", tier) == other.index.count("vllm-0", tier)


class CountingIndex(ResidencyIndex):
    """The real index, counting the calls the control plane makes to it."""

    calls = 0

    def put_many(self, *a):
        CountingIndex.calls += 1
        return super().put_many(*a)

    def remove_many(self, *a):
        CountingIndex.calls += 1
        return super().remove_many(*a)


def test_single_block_events_cost_one_index_call_per_run():
    """vLLM sends one event per request and step, often of one block: a run of stores (or of
    removals) of one scope and tier is one index call, not one per event."""
    control = plane()
    control.index = CountingIndex(control.scopes)
    CountingIndex.calls = 0
    feed(control, *[vllm.gpu([i]) for i in range(48)], *[vllm.removed([i]) for i in range(16)])
    assert CountingIndex.calls == 2
    assert control.index.count("vllm-0", "hbm") == 32



def test_a_subscriber_failing_to_stop_still_lets_the_index_commit_and_close(tmp_path):
    """Issue 29.21: stop order survives any part failing: a subscriber whose stop raises no longer
    skips the other subscribers' stops nor the persistent index's last commit."""
    engines = tuple(EngineConfig(id=f"e{i}", url="http://127.0.0.1:9", model="m",
                                 kv_events=f"tcp://127.0.0.1:{free_port()}") for i in range(2))
    cfg = Config(engines=engines, index=IndexConfig(backend="lmdb", path=str(tmp_path / "index")))

    async def body():
        control = ControlPlane(cfg, ScopeRegistry())
        await control.start()
        assert control.subscriptions == 2
        subs = list(control._subscribers.values())
        stopped = []

        async def broken():
            raise RuntimeError("a subscriber that cannot stop")

        subs[0].stop = broken
        real = subs[1].stop

        async def second():
            stopped.append(subs[1].engine_id)
            await real()

        subs[1].stop = second
        control.apply("e1", Batch(0.0, (Stored((11, 12, 13), None, (), 16, None, "GPU", None),), None, None))
        with pytest.raises(RuntimeError, match="cannot stop"):
            await control.stop()
        assert stopped == ["e1"]

    asyncio.run(asyncio.wait_for(body(), 20))
    again = ControlPlane(cfg, ScopeRegistry())  # the last changes were committed at the stop
    assert len(again.index) == 3 and again.index.count("e1", "hbm") == 3
    again.index.close()
