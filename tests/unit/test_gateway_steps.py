"""The gateway's steps that need no engine or socket: the request sent upstream, how an answer's
status is judged, failure descriptions, and which engine (and decision) each attempt gets."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from quilld.config import Config, EngineConfig, GroupConfig
from quilld.http.gateway import Gateway
from quilld.http.gateway_request import CHAT, Parsed
from quilld.http.gateway_upstream import (UpstreamFailed, answer_ok, decision_headers, describe, upstream_headers,
                                          upstream_url)
from quilld.index.control import ControlPlane, chain_hashes
from quilld.index.events import Batch, Stored
from quilld.model import IdentityScope
from quilld.scopes import ScopeRegistry


def test_upstream_url_with_or_without_v1():
    assert upstream_url("http://h:1", CHAT) == "http://h:1/v1/chat/completions"
    assert upstream_url("http://h:1/", CHAT) == "http://h:1/v1/chat/completions"
    assert upstream_url("http://h:1/v1", CHAT) == "http://h:1/v1/chat/completions"
    assert upstream_url("http://h:1/api/v1/", "/v1/completions") == "http://h:1/api/v1/completions"


def test_upstream_headers_pass_accept_and_encoding_and_name_the_request():
    assert upstream_headers({}, "rid") == {"Content-Type": "application/json", "Accept": "*/*",
                                           "Accept-Encoding": "identity", "X-Request-Id": "rid"}
    asked = {"Accept": "text/event-stream", "Accept-Encoding": "gzip", "Authorization": "Bearer secret"}
    sent = upstream_headers(asked, "rid")
    assert sent["Accept"] == "text/event-stream" and sent["Accept-Encoding"] == "gzip"
    assert "Authorization" not in sent  # the client's API key is the gateway's, never the engine's


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429])
def test_5xx_and_429_move_on_and_cool_the_engine(status):
    for headers_sent in (False, True):
        with pytest.raises(UpstreamFailed) as e:
            answer_ok(status, headers_sent)
        assert e.value.reason == f"HTTP {status}" and e.value.cool


def test_2xx_is_ok_and_a_refusal_is_relayed_unless_headers_already_went_out():
    assert answer_ok(200, False) and answer_ok(204, True)
    assert answer_ok(400, False) is False and answer_ok(404, False) is False and answer_ok(302, False) is False
    with pytest.raises(UpstreamFailed) as e:
        answer_ok(400, True)
    assert e.value.reason == "HTTP 400 after the headers went out" and not e.value.cool


def test_describe_failures():
    assert describe(TimeoutError()) == "timed out"
    assert describe(ConnectionResetError("reset by peer")) == "ConnectionResetError: reset by peer"
    assert describe(ConnectionRefusedError()) == "ConnectionRefusedError"
    assert describe(UpstreamFailed("HTTP 503")) == "HTTP 503"


# -- choosing the engine of each attempt ---------------------------------------------------------------

PROMPT = list(range(16 * 4))  # token ids: 4 blocks of 16
BLOCKS = chain_hashes(PROMPT, 16)


def gateway_with(*engines: EngineConfig) -> Gateway:
    cfg = Config(engines=engines)
    control = ControlPlane(cfg, ScopeRegistry())
    node = SimpleNamespace(cfg=cfg, control=control, scopes=control.scopes, cluster=None)
    return Gateway(node)


def request(session: str | None = None) -> Parsed:
    return Parsed(CHAT, b"{}", "m", "", "default", PROMPT, 0, 800.0, time.perf_counter(), "rid", session)


def hot_and_cold() -> Gateway:
    gw = gateway_with(EngineConfig(id="cold", url="http://127.0.0.1:9001", model="m"),
                      EngineConfig(id="hot", url="http://127.0.0.1:9002", model="m"),
                      EngineConfig(id="other", url="http://127.0.0.1:9003", model="not-m"))
    gw.control.apply("hot", Batch(0.0, (Stored(tuple(BLOCKS[:3]), None, (), 16, None, "GPU"),), None, None))
    return gw


def choose(gw: Gateway, tried: set[str], req: Parsed | None = None):
    req = req or request()
    return asyncio.run(gw.decider.choose(req, gw.hashing.prompt(req), tried))


def test_the_first_attempt_goes_to_the_routers_pick_with_its_decision():
    gw = hot_and_cold()
    choice = choose(gw, set())
    d = choice.decision
    assert choice.engine.id == d.engine == "hot" and d.url == "http://127.0.0.1:9002"
    assert choice.blocks == BLOCKS and choice.tag == gw.control.scopes.tag(IdentityScope("default", "m"))
    assert decision_headers(d, "rid") == {
        "x-quillcache-engine": "hot", "x-quillcache-overlap-blocks": "3", "x-quillcache-cost": "1",
        "x-quillcache-plan": "hits=3 fetches=0 recomputes=1", "x-quillcache-request-id": "rid"}


def test_a_retry_gets_the_next_engine_with_its_own_plan_and_cost():
    gw = hot_and_cold()
    choice = choose(gw, {"hot"})
    d = choice.decision
    assert choice.engine.id == d.engine == "cold" and d.url == "http://127.0.0.1:9001"
    assert {c.engine for c in d.candidates} == {"cold", "hot"}  # the router's breakdown is kept
    assert decision_headers(d, "rid")["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=4"
    assert (d.cost, d.overlap_blocks) == (4.0, 0)
    assert choose(gw, {"hot", "cold"}) is None  # no engine of the model is left


def test_a_cooling_engine_is_tried_only_when_no_other_is_left():
    gw = hot_and_cold()
    gw.book.cool("hot")
    first = choose(gw, set())
    assert first.engine.id == "cold" and first.decision.engine == "cold"
    assert decision_headers(first.decision, "rid")["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=4"
    last = choose(gw, {"cold"})
    assert last.engine.id == "hot" and decision_headers(last.decision, "rid")["x-quillcache-overlap-blocks"] == "3"


def test_a_fallback_to_a_hybrid_engine_gets_the_plan_route_gives_it():
    """The plan of an engine the gateway takes instead of the router's pick is the control plane's,
    credited by the engine's declared group kinds as ROUTE credits it (issue 18.8)."""
    gw = gateway_with(EngineConfig(id="hot", url="http://127.0.0.1:9001", model="m"),
                      EngineConfig(id="hybrid", url="http://127.0.0.1:9002", model="m",
                                   groups=(GroupConfig("full"), GroupConfig("mamba"))))
    gw.control.apply("hot", Batch(0.0, (Stored(tuple(BLOCKS), None, (), 16, None, "GPU"),), None, None))
    gw.control.apply("hybrid", Batch(0.0, (Stored(tuple(BLOCKS), None, (), 16, None, "GPU", None, 0),
                                           Stored(tuple(BLOCKS[2:3]), None, (), 16, None, "GPU", None, 1)), None, None))
    choice = choose(gw, {"hot"})
    d = choice.decision
    assert choice.engine.id == d.engine == "hybrid"
    headers = decision_headers(d, "rid")
    assert headers["x-quillcache-overlap-blocks"] == "3"  # the Mamba state at block 2
    assert headers["x-quillcache-plan"] == "hits=3 fetches=0 recomputes=1"
    assert d.plan == gw.control.plan_for("hybrid", choice.tag, BLOCKS)
    scope = IdentityScope("default", "m")
    routed = {c.engine: c for c in gw.control.route(scope, gw.control.scopes.tag(scope), BLOCKS).candidates}
    assert (routed["hybrid"].overlap_blocks, routed["hybrid"].credit) == (3, 3.0)


def test_the_session_holds_on_the_first_attempt_only():
    gw = hot_and_cold()
    gw.control.sessions.put("default", "s", "cold")
    assert choose(gw, set(), request("s")).engine.id == "cold"
    assert choose(gw, {"cold"}, request("s")).engine.id == "hot"
