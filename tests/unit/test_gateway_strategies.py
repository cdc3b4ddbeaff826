"""The gateway's stages alone, without a socket or a process: the decision for engines with roles,
which relay strategy serves it, and each strategy (co-located, through the pool, engine to engine,
both legs at once) driven with fake legs that record what each engine was sent."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from quilld.config import KV_TRANSFERS, Config, EngineConfig, GatewayConfig, RouterConfig
from quilld.http.gateway_decide import Decider
from quilld.http.gateway_engines import EngineBook
from quilld.http.gateway_prompt import PromptHashing
from quilld.http.gateway_relay import Relay
from quilld.http.gateway_request import Parsed
from quilld.http.gateway_stats import GatewayStats
from quilld.http.gateway_strategy import (BothLegs, CoLocated, EngineToEngine, Serving, Strategies, ThroughPool,
                                          bootstrap_addr)
from quilld.http.gateway_upstream import (DECODE_HEADER, DISAGGREGATED_HEADER, HANDOFF_HEADER, PAIR_HEADER,
                                          PREFILL_HEADER, Choice, UpstreamFailed, decision_headers)
from quilld.index.control import ControlPlane
from quilld.scopes import ScopeRegistry

PROMPT = list(range(16 * 8))  # token ids: 8 blocks of 16 (a prompt routed as ids)
BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 20, "stream": True}


class FakeLegs:
    """Engines as a script: `fail` names the engines whose legs fail (before any body byte)."""

    def __init__(self, fail: set[str] = frozenset(), kv: dict | None = None) -> None:
        self.fail = set(fail)
        self.kv = {"remote_engine_id": "p-engine", "remote_block_ids": [1, 2]} if kv is None else kv
        self.sent: list[tuple[str, str, dict, Choice | None]] = []  # (leg, engine, body, choice)
        self.in_flight_then: dict[str, int] = {}  # engine -> its in-flight count while its leg ran
        self.control: ControlPlane | None = None

    async def answer(self, req: Parsed, choice: Choice, relay: Relay) -> None:
        body = json.loads(req.body if choice.body is None else choice.body)
        self.sent.append(("answer", choice.engine.id, body, choice))
        self.in_flight_then[choice.engine.id] = self.control.engines.in_flight[choice.engine.id]
        if choice.engine.id in self.fail:
            raise UpstreamFailed("HTTP 503")
        relay.resp = SimpleNamespace(headers=decision_headers(choice.decision, req.request_id, choice.fallback)
                                     | (choice.headers or {}))

    async def prefill(self, req: Parsed, engine: EngineConfig, data: bytes, headers: dict[str, str]) -> dict:
        self.sent.append(("prefill", engine.id, json.loads(data), None))
        self.in_flight_then[engine.id] = self.control.engines.in_flight[engine.id]
        await asyncio.sleep(0)
        if engine.id in self.fail:
            raise UpstreamFailed("HTTP 500")
        return dict(self.kv)


def stages(*engines: EngineConfig, legs: FakeLegs | None = None, disaggregation: str = "always",
           **gateway) -> tuple[Strategies, Serving]:
    cfg = Config(engines=engines, router=RouterConfig(disaggregation=disaggregation),
                 gateway=GatewayConfig(**{"handoff_wait_ms": 30, **gateway}))
    control = ControlPlane(cfg, ScopeRegistry())
    node = SimpleNamespace(cfg=cfg, control=control, scopes=control.scopes, cluster=None, salt_key=lambda: b"k" * 32)
    stats = GatewayStats()
    book = EngineBook(control, cfg.gateway.recorded_blocks, stats.counts)
    legs = legs or FakeLegs()
    legs.control = control
    s = Serving(cfg.gateway, control, node, stats, book, Decider(control, node, book), legs)
    return Strategies(s), s


def request(body: dict = BODY) -> Parsed:
    return Parsed("/v1/completions", json.dumps(body).encode(), "m", "", "default", PROMPT, 20, 800.0,
                  time.perf_counter(), "rid", None, body)


def run(strategies: Strategies, s: Serving, req: Parsed | None = None) -> tuple[Choice | None, Relay]:
    """The pipeline from the decision on: (the first decision's choice, the client's relay)."""
    req = req or request()
    relay = Relay(SimpleNamespace(headers={"Accept": "text/event-stream"}))
    prompt = PromptHashing(16 * 4, s.control.engine_prompts, s.control.scopes, lambda: b"k" * 32,
                           s.stats.counts).prompt(req)

    async def go() -> Choice | None:
        choice = await s.decider.choose(req, prompt, set())
        await strategies.carry_out(req, prompt, choice, relay)
        legs = asyncio.all_tasks() - {asyncio.current_task()}  # a Mooncake prefill leg may run on
        await asyncio.gather(*legs, return_exceptions=True)
        await asyncio.sleep(0)  # its done callback
        return choice

    return asyncio.run(go()), relay


def engine(name: str, role: str = "both", **kw) -> EngineConfig:
    return EngineConfig(id=name, url=f"http://127.0.0.1:{9000 + len(name)}", model="m", role=role, block_size=16,
                        **kw)


def pair(kv_transfer: str = "pool", prefills: int = 1, decodes: int = 1, **kw) -> tuple[EngineConfig, ...]:
    extra = {"kv_engine_id": "mc-engine"} if kv_transfer == "mooncake" else {}
    return (*(engine(f"p{i}", "prefill", kv_transfer=kv_transfer, **extra, **kw) for i in range(prefills)),
            *(engine(f"d{i}", "decode", **kw) for i in range(decodes)))


def idle(s: Serving) -> bool:
    """Every lease the legs took was given back."""
    return not s.book.leases and not any(s.control.engines.in_flight.values())


# -- the decision, and which strategy serves it ---------------------------------------------------

def test_every_kv_transfer_has_its_strategy():
    strategies, _ = stages(*pair())
    assert set(strategies.ways) == set(KV_TRANSFERS)
    assert {type(w) for w in strategies.ways.values()} == {ThroughPool, EngineToEngine, BothLegs}


@pytest.mark.parametrize("kv_transfer,way", [("pool", ThroughPool), ("nixl", EngineToEngine),
                                             ("mooncake", BothLegs)])
def test_a_split_decision_is_served_by_its_prefill_engines_way_of_moving_kv(kv_transfer, way):
    strategies, s = stages(*pair(kv_transfer))
    req = request()
    prompt = PromptHashing(64, s.control.engine_prompts, s.control.scopes, lambda: b"k", s.stats.counts).prompt(req)
    choice = asyncio.run(s.decider.choose(req, prompt, set()))
    assert choice.engine.id == "d0" and choice.decision.pair.prefill == "p0"
    assert type(strategies.pick(choice)) is way


def test_a_decision_for_one_engine_is_co_located():
    strategies, s = stages(engine("a"), engine("b"))
    req = request()
    prompt = PromptHashing(64, s.control.engine_prompts, s.control.scopes, lambda: b"k", s.stats.counts).prompt(req)
    choice = asyncio.run(s.decider.choose(req, prompt, set()))
    assert choice.decision.pair is None and type(strategies.pick(choice)) is CoLocated
    assert type(strategies.pick(None)) is CoLocated  # no engine left: co-located gives up


def test_a_cooling_first_prefill_engine_gives_the_pick_to_the_next_ones_way():
    engines = (engine("p0", "prefill", kv_transfer="mooncake", kv_engine_id="x"),
               engine("p1", "prefill", kv_transfer="nixl"), engine("d0", "decode"))
    strategies, s = stages(*engines)
    req = request()
    prompt = PromptHashing(64, s.control.engine_prompts, s.control.scopes, lambda: b"k", s.stats.counts).prompt(req)
    choice = asyncio.run(s.decider.choose(req, prompt, set()))
    first = choice.decision.pair.prefill_order[0]
    s.book.cool(first)
    other = next(e for e in ("p0", "p1") if e != first)
    assert strategies.pick(choice).kind == s.control.engines.get(other).kv_transfer


# -- co-located -----------------------------------------------------------------------------------------

def test_co_located_moves_to_the_next_engine_and_cools_the_failed_one():
    legs = FakeLegs(fail={"a"})
    strategies, s = stages(engine("a"), engine("b"), legs=legs)
    s.control.sessions.put("default", "sess", "a")  # the first decision goes to a
    choice, relay = run(strategies, s, request()._replace(session="sess"))
    assert [(leg, e) for leg, e, _, _ in legs.sent] == [("answer", "a"), ("answer", "b")]
    assert legs.in_flight_then == {"a": 1, "b": 1}  # each leg held its lease
    assert s.book.is_cooling("a", time.monotonic()) and not s.book.is_cooling("b", time.monotonic())
    c = s.stats.counts
    assert (c["retries"], c["upstream_errors"]) == (1, 1)
    assert relay.failures == ["a: HTTP 503"] and relay.resp.headers["x-quillcache-engine"] == "b"
    assert idle(s) and relay.lease is None


def test_co_located_with_every_engine_failing_gives_up_counted_missed():
    legs = FakeLegs(fail={"a", "b"})
    strategies, s = stages(engine("a"), engine("b"), legs=legs)
    _, relay = run(strategies, s)
    assert relay.resp is None and relay.settled and sorted(relay.failures) == ["a: HTTP 503", "b: HTTP 503"]
    assert s.stats.counts["slo_counted"] == 1 and s.stats.counts["within_slo"] == 0
    assert idle(s)


# -- through the pool -------------------------------------------------------------------------------------

def test_through_the_pool_prefills_then_waits_for_the_blocks_then_decodes_with_the_kv_params():
    legs = FakeLegs()
    strategies, s = stages(*pair("pool"), legs=legs)
    _, relay = run(strategies, s)
    (leg1, e1, prefill_body, _), (leg2, e2, decode_body, attempt) = legs.sent
    assert (leg1, e1, leg2, e2) == ("prefill", "p0", "answer", "d0")
    # vLLM's proxy protocol: one token, not streamed, do_remote_decode; the decode leg gets what it answered
    assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    assert decode_body["kv_transfer_params"] == dict(legs.kv, do_remote_prefill=True)
    assert decode_body["stream"] is True and decode_body["max_tokens"] == 20
    headers = relay.resp.headers
    assert (headers[PREFILL_HEADER], headers[DECODE_HEADER], headers[DISAGGREGATED_HEADER]) == ("p0", "d0", "true")
    handoff = headers[HANDOFF_HEADER]
    # nothing wrote the pool here: the whole wait, every block counted missing
    assert handoff.startswith("blocks=8 resident=0 late=0 waited_ms=") and handoff.endswith("prefetched=-")
    assert float(handoff.split("waited_ms=")[1].split()[0]) >= 30
    c = s.stats.counts
    assert (c["prefills"], c["disaggregated"], c["handoff_missing"], c["handoff_blocks_missing"],
            c["handoff_direct"]) == (1, 1, 1, 8, 0)
    assert legs.in_flight_then == {"p0": 1, "d0": 1} and idle(s)


def test_a_failed_decode_engine_hands_the_same_request_to_the_next_without_a_second_prefill():
    legs = FakeLegs(fail={"d0"})
    strategies, s = stages(*pair("pool", decodes=2), legs=legs)
    _, relay = run(strategies, s)
    legs_sent = [(leg, e) for leg, e, _, _ in legs.sent]
    assert legs_sent[0] == ("prefill", "p0") and [leg for leg, _ in legs_sent].count("prefill") == 1
    assert sorted(e for leg, e in legs_sent if leg == "answer") == ["d0", "d1"]
    first, second = (body for leg, _, body, _ in legs.sent if leg == "answer")
    assert first == second  # the same kv_transfer_params: the KV is in the pool
    c = s.stats.counts
    assert (c["decode_retries"], c["upstream_errors"], c["disaggregated"], c["handoff_missing"]) == (1, 1, 1, 1)
    assert relay.resp.headers[DECODE_HEADER] == "d1" and idle(s)


def test_every_prefill_failing_leaves_the_decode_engine_alone_saying_why():
    legs = FakeLegs(fail={"p0", "p1"})
    strategies, s = stages(*pair("pool", prefills=2), legs=legs)
    _, relay = run(strategies, s)
    assert [(leg, e) for leg, e, _, _ in legs.sent][-1] == ("answer", "d0")
    _, _, body, attempt = legs.sent[-1]
    assert "kv_transfer_params" not in body and body["max_tokens"] == 20  # the client's request, as it came
    headers = relay.resp.headers
    assert headers[DISAGGREGATED_HEADER] == "false" and headers[PREFILL_HEADER] == "d0"
    assert headers[PAIR_HEADER].startswith("prefill_failed: p")
    c = s.stats.counts
    assert (c["prefill_failures"], c["prefill_fallbacks"], c["disaggregated"]) == (2, 1, 0)
    assert s.book.is_cooling("p0", time.monotonic()) and s.book.is_cooling("p1", time.monotonic())
    assert idle(s)


# -- engine to engine (NIXL) and both legs at once (Mooncake) ----------------------------------------------------

def test_engine_to_engine_sends_the_decode_leg_at_once_with_no_pool_wait():
    legs = FakeLegs()
    strategies, s = stages(*pair("nixl"), legs=legs, handoff_wait_ms=5_000)
    t0 = time.perf_counter()
    _, relay = run(strategies, s)
    assert time.perf_counter() - t0 < 2.5  # not the 5 s handoff wait
    assert [(leg, e) for leg, e, _, _ in legs.sent] == [("prefill", "p0"), ("answer", "d0")]
    assert legs.sent[1][2]["kv_transfer_params"] == dict(legs.kv, do_remote_prefill=True)
    assert relay.resp.headers[HANDOFF_HEADER] == ("kv_transfer=nixl engine-to-engine blocks=8 waited_ms=0 from=p0 "
                                                  "prefetched=-")
    c = s.stats.counts
    assert (c["handoff_direct"], c["disaggregated"], c["handoff_missing"], c["handoff_on_time"]) == (1, 1, 0, 0)
    assert idle(s)


def test_both_legs_go_at_once_tied_by_one_transfer_id():
    class Held(FakeLegs):
        """The prefill answers only once the decode leg was sent: both legs are in flight at once."""

        def __init__(self) -> None:
            super().__init__()
            self.decode_sent = asyncio.Event()

        async def prefill(self, req, engine, data, headers):
            self.sent.append(("prefill", engine.id, json.loads(data), None))
            await asyncio.wait_for(self.decode_sent.wait(), 2.0)  # one leg after the other: TimeoutError
            return {}

        async def answer(self, req, choice, relay):
            self.decode_sent.set()
            await super().answer(req, choice, relay)
            await asyncio.sleep(0.01)  # the prefill leg ends while the decode streams

    legs = Held()
    strategies, s = stages(*pair("mooncake", kv_bootstrap="10.0.0.7:8998"), legs=legs)
    _, relay = run(strategies, s)
    sent = {leg: (e, body) for leg, e, body, _ in legs.sent}
    (p, prefill_body), (d, decode_body) = sent["prefill"], sent["answer"]
    transfer_id = prefill_body["kv_transfer_params"]["transfer_id"]
    assert transfer_id.startswith("rid-") and (p, d) == ("p0", "d0")
    assert decode_body["kv_transfer_params"] == {"remote_engine_id": "mc-engine",
                                                 "remote_bootstrap_addr": "10.0.0.7:8998",
                                                 "transfer_id": transfer_id, "do_remote_prefill": True}
    assert "both-legs-at-once" in relay.resp.headers[HANDOFF_HEADER]
    c = s.stats.counts
    assert (c["prefills"], c["handoff_direct"], c["disaggregated"], c["prefill_failures"]) == (1, 1, 1, 0)
    assert idle(s)  # the prefill's lease given back when its leg ended


def test_a_mooncake_prefill_that_fails_beside_its_decode_is_counted_and_cools():
    legs = FakeLegs(fail={"p0"})
    strategies, s = stages(*pair("mooncake"), legs=legs)

    _, relay = run(strategies, s)
    assert relay.resp.headers[DECODE_HEADER] == "d0"  # the decode engine answered (it recomputes)
    assert s.stats.counts["prefill_failures"] == 1 and s.book.is_cooling("p0", time.monotonic())
    assert idle(s)


def test_bootstrap_addr_defaults_to_the_engines_host_on_vllms_port():
    assert bootstrap_addr(EngineConfig(id="p", url="http://10.1.2.3:8000", model="m")) == "10.1.2.3:8998"
    assert bootstrap_addr(EngineConfig(id="p", url="http://[::1]:8000", model="m")) == "[::1]:8998"
    assert bootstrap_addr(EngineConfig(id="p", url="http://h:1", model="m", kv_bootstrap="b:7")) == "b:7"
