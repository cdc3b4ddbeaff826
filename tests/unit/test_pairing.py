"""The prefill-decode pair (index/pairing.py) as a pure function, its leases, and ROUTE's control plane with roles."""

from __future__ import annotations

import dataclasses

import pytest

from quilld.config import Config, EngineConfig, RouterConfig
from quilld.errors import ConfigError
from quilld.index.control import ControlPlane
from quilld.index.engines import EngineRegistry, Load
from quilld.index.pairing import MiB, NoDecodeEngine, PairCandidate, PairCosts, decide, prefill_us, transfer
from quilld.model import CacheTier, IdentityScope
from quilld.scopes import ScopeRegistry

COSTS = PairCosts()
IDLE = Load()


def cand(engine, role, node="n1", overlap=0, credit=0.0, cost=10.0, load=IDLE, kv=131_072):
    return PairCandidate(engine, role, node, overlap, credit, cost, load, kv)


# -- the decision -------------------------------------------------------------------------
def test_a_short_uncached_prompt_is_prefilled_on_the_decode_engine():
    # 4 blocks of 16 tokens = 64 uncached tokens, under the 512-token threshold
    pair = decide([cand("p", "prefill"), cand("d", "decode", load=Load(5, 0, 0, 5))], 4, 16, COSTS)
    assert (pair.decode, pair.prefill, pair.reason, pair.disaggregated) == ("d", None, "short", False)
    assert pair.uncached_tokens == 64
    # the same prompt, mostly cached on the decode engine, is short too; uncached on it, it is not
    long = decide([cand("p", "prefill"), cand("d", "decode", load=Load(5, 0, 0, 5))], 64, 16, COSTS)
    assert long.disaggregated and long.reason == "remote_cheaper" and long.prefill == "p"
    cached = decide([cand("p", "prefill"), cand("d", "decode", overlap=60, credit=60.0, load=Load(5, 0, 0, 5))],
                    64, 16, COSTS)
    assert cached.reason == "short" and cached.uncached_tokens == 64


def test_busy_decode_engines_disaggregate_a_long_prompt_an_idle_one_prefills_it_itself():
    busy = Load(requests=8, decodes=8)
    pair = decide([cand("p", "prefill"), cand("d", "decode", load=busy)], 64, 16, COSTS)
    assert pair.reason == "remote_cheaper" and (pair.prefill, pair.decode) == ("p", "d")
    own = COSTS.prefill_us_per_token * 64 * 16
    assert pair.local_us == pytest.approx(own + 8 * (COSTS.running_decode_penalty_us + own))
    assert pair.remote_us == pytest.approx(own + COSTS.handoff_us)  # same node: nothing moves
    assert pair.transfer_us == 0 and pair.transfer_bytes == 0
    idle = decide([cand("p", "prefill"), cand("d", "decode")], 64, 16, COSTS)
    assert idle.reason == "local_cheaper" and not idle.disaggregated  # the handoff is all it would add
    assert idle.remote_us - idle.local_us == pytest.approx(COSTS.handoff_us)


def test_a_long_prefill_queue_keeps_the_request_on_the_decode_engine():
    busy = Load(requests=2, decodes=2)
    fast = decide([cand("p", "prefill"), cand("d", "decode", load=busy)], 64, 16, COSTS)
    assert fast.disaggregated
    queued = Load(requests=9, prefills=9, prefill_tokens=9 * 4096)
    slow = decide([cand("p", "prefill", load=queued), cand("d", "decode", load=busy)], 64, 16, COSTS)
    assert slow.reason == "local_cheaper" and slow.decode == "d" and slow.prefill is None
    assert slow.remote_us > slow.local_us


def test_the_prefill_engine_is_the_one_with_the_most_reusable_prefix_then_the_shortest_queue():
    busy = Load(decodes=6, requests=6)
    cands = [cand("p1", "prefill"), cand("p2", "prefill", overlap=40, credit=40.0), cand("d", "decode", load=busy)]
    assert decide(cands, 64, 16, COSTS).prefill == "p2"
    queued = Load(requests=3, prefills=3, prefill_tokens=3 * 1024)
    cands[1] = cand("p2", "prefill", overlap=40, credit=40.0, load=queued)
    assert decide(cands, 64, 16, COSTS).prefill == "p1"  # 40 blocks of credit do not pay for 3072 queued tokens
    assert decide(cands, 64, 16, COSTS).prefill_order == ("p1", "p2")


def test_the_decode_engine_weighs_its_decodes_and_moving_the_kv_to_its_node():
    busy = Load(requests=8, decodes=8)
    # same load: the one on the prefill's node wins (nothing moves)
    cands = [cand("p", "prefill", node="A"), cand("dA", "decode", node="A", load=busy),
             cand("dB", "decode", node="B", load=busy)]
    pair = decide(cands, 64, 16, COSTS)
    assert (pair.decode, pair.prefill_node, pair.decode_node, pair.transfer_us) == ("dA", "A", "A", 0.0)
    assert pair.decode_order == ("dA", "dB")
    # a much busier decode engine on the prefill's node loses to an idler one elsewhere, which pays the move
    cands[1] = cand("dA", "decode", node="A", load=Load(requests=30, decodes=30))
    pair = decide(cands, 64, 16, COSTS)
    assert pair.decode == "dB" and pair.decode_node == "B" and pair.prefill_node == "A"
    nbytes = 64 * 16 * 131_072
    assert pair.transfer_bytes == nbytes
    assert pair.transfer_us == pytest.approx(COSTS.transfer_us_per_mib * nbytes / MiB + COSTS.cross_node_us)
    # what the decode engine already holds does not move
    us, moved = transfer(cands[0], cand("dB", "decode", node="B", overlap=48), 64, 16, COSTS)
    assert moved == 16 * 16 * 131_072 and us < pair.transfer_us


def test_modes_roles_and_the_engines_that_can_decode():
    busy = Load(requests=8, decodes=8)
    cands = [cand("p", "prefill"), cand("d", "decode", load=busy)]
    assert decide(cands, 64, 16, dataclasses.replace(COSTS, mode="never")).reason == "never"
    always = decide([cand("p", "prefill"), cand("d", "decode")], 2, 16, dataclasses.replace(COSTS, mode="always"))
    assert always.reason == "always" and always.disaggregated  # short and idle: still split
    assert decide([cand("p1", "prefill"), cand("p2", "prefill")], 64, 16, COSTS) is None
    alone = decide([cand("d", "decode", load=busy)], 64, 16, COSTS)
    assert alone.reason == "no_prefill_engine" and alone.decode == "d" and alone.remote_us is None
    # a `both` engine may prefill for a decode engine, never be paired with itself
    solo = decide([cand("b", "both", load=busy)], 64, 16, COSTS)
    assert solo.reason == "no_prefill_engine" and solo.decode == "b"
    pair = decide([cand("b", "both"), cand("d", "decode", cost=5.0, load=busy)], 64, 16, COSTS)
    assert pair.prefill == "b" and pair.decode == "d"


def test_prefill_cost_is_queue_plus_uncached_plus_the_stall_of_running_decodes():
    c = cand("e", "both", credit=10.0, load=Load(requests=3, prefills=1, prefill_tokens=100, decodes=2))
    own = 45.0 * (20 - 10) * 16
    assert prefill_us(c, 20, 16, COSTS) == pytest.approx(45.0 * 100 + own + 2 * (1500.0 + own))


# -- leases ---------------------------------------------------------------------------------
def test_leases_keep_prefill_and_decode_load_apart():
    reg = EngineRegistry((EngineConfig(id="e", url="http://x", model="m"),))
    whole = reg.acquire("e", "request", 300)
    pre = reg.acquire("e", "prefill", 200)
    dec = reg.acquire("e", "decode")
    assert reg.load("e") == Load(requests=3, prefills=2, prefill_tokens=500, decodes=2)
    assert reg.prefilled(whole) and not reg.prefilled(whole) and not reg.prefilled(dec)
    assert reg.load("e") == Load(3, 1, 200, 2)
    assert reg.release(whole) and reg.release(pre) and reg.release(dec) and not reg.release(dec)
    assert reg.load("e") == Load(0, 0, 0, 0)
    assert reg.in_flight["e"] == 0


# -- the control plane ----------------------------------------------------------------------
def plane(engines, **router) -> tuple[ControlPlane, IdentityScope, bytes]:
    cfg = Config(router=RouterConfig(**router), engines=tuple(engines)).validate()
    scopes = ScopeRegistry()
    control = ControlPlane(cfg, scopes)
    control.node_id = "node-a"
    control.pool = ["node-a"]
    scope = IdentityScope("default", "m", "t", "")
    return control, scope, scopes.tag(scope)


def eng(id, role, locality=""):
    return EngineConfig(id=id, url=f"http://{id}", model="m", tokenizer="t", role=role, locality=locality)


def test_without_roles_route_is_what_it_was():
    control, scope, tag = plane([eng("a", "both"), eng("b", "both")])
    d = control.route(scope, tag, list(range(1, 40)), acquire=True)
    assert d.pair is None and d.engine == "a" and d.lease is not None
    assert control.engines.load("a") == Load(1, 1, 39 * 16, 1)


def test_route_with_roles_answers_the_pair_with_urls_leases_and_the_prefill_engines_plan():
    control, scope, tag = plane([eng("p", "prefill"), eng("d", "decode", locality="node-b")],
                                disaggregation="always")
    blocks = list(range(1, 41))
    for h in blocks[:10]:
        control.index.put(tag, h, "p", CacheTier.HBM)
    d = control.route(scope, tag, blocks, acquire=True, block_tokens=16)
    pair = d.pair
    assert (d.engine, d.url, pair.prefill, pair.prefill_url, pair.reason) == ("d", "http://d", "p", "http://p", "always")
    assert (pair.prefill_node, pair.decode_node) == ("node-a", "node-b")  # no locality: this node
    assert pair.transfer_bytes == 40 * 16 * 131_072 and pair.transfer_us > 0
    assert [s.action for s in d.plan] == ["hit"] * 10 + ["recompute"] * 30  # the prefill engine's plan
    assert control.engines.load("p") == Load(1, 1, 30 * 16, 0)
    assert control.engines.load("d") == Load(1, 0, 0, 1)
    assert control.engines.release(d.lease) and control.engines.release(pair.prefill_lease)
    assert control.stats["pair_always"] == 1


def test_route_with_only_prefill_engines_is_an_error_and_roles_are_checked():
    control, scope, tag = plane([eng("p", "prefill")])
    with pytest.raises(NoDecodeEngine, match="no decode-capable engine serves model 'm'"):
        control.route(scope, tag, [1, 2, 3])
    with pytest.raises(ConfigError, match="role must be one of both, prefill, decode"):
        Config(engines=(eng("x", "prefiller"),)).validate()
    with pytest.raises(ConfigError, match="router.disaggregation"):
        Config(router=RouterConfig(disaggregation="sometimes")).validate()


def test_a_session_keeps_its_decode_engine_and_may_still_be_prefilled_elsewhere():
    control, scope, tag = plane([eng("p", "prefill"), eng("d1", "decode"), eng("d2", "decode")],
                                disaggregation="always")
    first = control.route(scope, tag, list(range(1, 41)), session="s1")
    control.engines.acquire(first.engine, "decode")
    control.engines.acquire(first.engine, "decode")  # now the other decode engine is idler
    again = control.route(scope, tag, list(range(1, 41)), session="s1")
    assert again.engine == first.engine and again.pair.prefill == "p"
    other = control.route(scope, tag, list(range(1, 41)), session="s2")
    assert other.engine != first.engine


def test_resident_counts_the_blocks_a_pool_node_holds_not_engines():
    control, scope, tag = plane([eng("p", "prefill"), eng("d", "decode")])
    control.pool = ["node-a", "node-b"]
    control.index.put(tag, 1, "node-a", CacheTier.DRAM)
    control.index.put(tag, 2, "node-b", CacheTier.SSD)
    control.index.put(tag, 3, "p", CacheTier.HBM)  # an engine's copy is not in the pool
    assert control.resident(tag, [1, 2, 3, 4]) == 2
    other = control.scopes.tag(IdentityScope("someone-else", "m", "t", ""))
    assert other != tag and control.resident(other, [1, 2]) == 0  # another identity's copies never count


# -- ROUTE's renderings of a pair ------------------------------------------------------------
def test_the_reply_encoders_write_the_pair_as_the_generic_encoder_does():
    import hiredis

    from quilld.protocol.commands.route import decision_reply, encode_compact, encode_decision, pair_reply
    from quilld.protocol.resp import encode

    control, scope, tag = plane([eng("p", "prefill"), eng("d", "decode", locality="node-b")],
                                disaggregation="always")
    for acquire in (False, True):
        d = control.route(scope, tag, list(range(1, 41)), acquire=acquire)
        for resp3 in (False, True):
            out: list = []
            encode(decision_reply(d), resp3, out)
            assert encode_decision(d, resp3) == b"".join(out)
            reader = hiredis.Reader()
            reader.feed(encode_compact(d, resp3))
            compact = reader.gets()
            assert len(compact) == 6 and compact[0] == b"d"
            pair = compact[5] if resp3 else dict(zip(compact[5][::2], compact[5][1::2]))
            want = pair_reply(d.pair)
            assert pair[b"prefill"] == b"p" and pair[b"reason"] == b"always"
            assert set(pair) == set(want)
    plain, _, _ = plane([eng("a", "both")])
    d = plain.route(scope, tag, [1, 2])
    assert b"pair" not in decision_reply(d) and encode_compact(d, False).startswith(b"*5\r\n")
