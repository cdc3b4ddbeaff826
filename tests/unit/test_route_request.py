"""A ROUTE request's fields and checks (quilld/index/route_request.py), RESP's argument splitting,
and the three renderings of one routing decision: RESP reply, admin JSON, gateway headers."""

from __future__ import annotations

import ast
import asyncio
import json
import math
from pathlib import Path

import pytest

from quilld.config import Config, EngineConfig
from quilld.errors import CommandError
from quilld.http.admin import decision_json
from quilld.http.gateway_upstream import decision_headers
from quilld.index.control import ControlPlane, chain_hashes
from quilld.index.events import Batch, Stored
from quilld.index.route_request import MAX_BLOCKS, RouteRequest, engine_route, parse_block_hash, route
from quilld.index.router import Candidate, Decision, Step
from quilld.model import CacheTier, IdentityScope
from quilld.protocol.commands.route import decision_reply, route_fields
from quilld.scopes import ScopeRegistry

INTEGERS = "ROUTE: tokens, block_size and decode_tokens must be integers"
SCOPE = IdentityScope("default", "m")


def error_of(fields) -> str:
    with pytest.raises(CommandError) as e:
        RouteRequest.parse(fields)
    return e.value.message


# -- RouteRequest.parse ----------------------------------------------------------------------------

def test_defaults_and_block_hashes_in_every_accepted_form():
    req = RouteRequest.parse({"blocks": [7, -3, "12", " 0x0aff ", "beef"]})
    assert req.blocks == [7, -3, 12, b"\x0a\xff", b"\xbe\xef"]
    assert (req.block_size, req.decode_tokens, req.session, req.acquire) == (16, 0, None, False)
    assert RouteRequest.parse({}).blocks == []
    assert RouteRequest.parse({"blocks": ""}).blocks == []  # `ROUTE blocks ""` on RESP


def quilld_hashed(req: dict) -> RouteRequest:
    return RouteRequest.parse({**req, "hashing": "quilld"})


def test_tokens_are_chained_in_blocks_of_block_size():
    req = quilld_hashed({"tokens": list(range(40)), "block_size": 8})
    assert req.blocks == chain_hashes(list(range(40)), 8) and len(req.blocks) == 5
    assert quilld_hashed({"tokens": ["1", "2"], "block_size": "1"}).blocks == chain_hashes([1, 2], 1)
    assert quilld_hashed({"tokens": list(range(20))}).blocks == chain_hashes(list(range(20)), 16)


def test_tokens_of_a_model_whose_engines_name_no_hashing_are_chained_as_quilld_does():
    """hashing auto (the default) waits for the model's engines; none names its own: quilld's chain,
    in the caller's scope."""
    control = control_with_two_engines()
    req = RouteRequest.parse({"tokens": list(range(40)), "block_size": 8})
    assert req.blocks == [] and req.prompt == {"prompt": list(range(40))} and req.hashing == "auto"
    er = asyncio.run(engine_route(control, SCOPE, b"tag", req, lambda: b"key"))
    assert (er.tag, er.salt, er.req.prompt) == (b"tag", None, None)
    assert er.req.blocks == chain_hashes(list(range(40)), 8)
    for request in ({"tokens": [1] * 16, "hashing": "engine"}, {"messages": [{"role": "user", "content": "x"}]},
                    {"prompt": "x"}):
        with pytest.raises(CommandError, match="no engine of model 'm' names its own hashing"):
            asyncio.run(engine_route(control, SCOPE, b"tag", RouteRequest.parse(request), lambda: b"key"))


def test_decode_tokens_count_in_blocks():
    assert RouteRequest.parse({"decode_tokens": 64, "block_size": 16}).decode_blocks == 4.0
    assert RouteRequest.parse({"decode_tokens": "10"}).decode_blocks == 10 / 16
    # without tokens a block size of 0 is not refused: decode tokens then count one block each
    assert RouteRequest.parse({"decode_tokens": 5, "block_size": 0}).decode_blocks == 5.0


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), ("YES", True), (True, True), (1, True),
                                         ("0", False), ("no", False), (False, False), ("", False)])
def test_acquire(value, want):
    assert RouteRequest.parse({"acquire": value}).acquire is want


def test_session_is_a_string_and_empty_means_none():
    assert RouteRequest.parse({"session": "chat-1"}).session == "chat-1"
    assert RouteRequest.parse({"session": 42}).session == "42"
    assert RouteRequest.parse({"session": ""}).session is None
    assert RouteRequest.parse({"session": None}).session is None


def test_unknown_fields_are_named_sorted():
    assert error_of({"blox": [1], "abc": 1, "blocks": [1]}) == "ROUTE: unknown field(s) abc, blox"
    assert error_of({"model": "m"}) == "ROUTE: unknown field(s) model"


@pytest.mark.parametrize("fields", [
    {"block_size": "x"},
    {"block_size": None, "blocks": [1]},
    {"block_size": [16], "tokens": [1]},
    {"tokens": [1, "x"]},
    {"tokens": None},
    {"tokens": 5},
    {"tokens": [1], "block_size": 0},
    {"tokens": [1], "block_size": -16},
    {"decode_tokens": "many"},
    {"decode_tokens": None},
    {"blocks": 5},
])
def test_fields_that_are_not_integers(fields):
    assert error_of(fields) == INTEGERS


def test_bad_block_hashes():
    assert error_of({"blocks": [1, "zz"]}) == "bad block hash 'zz': an integer or a hex string"
    assert error_of({"blocks": [1.5]}) == "bad block hash 1.5: an integer or a hex string"
    assert error_of({"blocks": [None]}) == "bad block hash None: an integer or a hex string"
    assert error_of({"blocks": [True]}) == "block hashes are integers or hex strings"
    # a block size is still read (and checked) when blocks are given
    assert error_of({"blocks": ["zz"], "block_size": "x"}) == INTEGERS
    with pytest.raises(CommandError, match="bad block hash"):
        parse_block_hash({"h": 1})


def test_token_ids_outside_32_bits_are_refused():
    for bad in (-1, 1 << 32):
        assert error_of({"tokens": [0] * 15 + [bad]}) == "ROUTE: tokens must be integers from 0 to 4294967295"
    assert quilld_hashed({"tokens": [(1 << 32) - 1] * 16}).blocks == chain_hashes([(1 << 32) - 1] * 16, 16)


def test_at_most_max_blocks():
    assert len(RouteRequest.parse({"blocks": list(range(MAX_BLOCKS))}).blocks) == MAX_BLOCKS
    assert error_of({"blocks": list(range(MAX_BLOCKS + 1))}) == f"ROUTE: at most {MAX_BLOCKS} blocks"
    assert error_of({"tokens": [0] * (MAX_BLOCKS + 1), "block_size": 1}) == f"ROUTE: at most {MAX_BLOCKS} blocks"
    # only full blocks count: one token short of an extra block is within the limit
    assert len(quilld_hashed({"tokens": [0] * (2 * (MAX_BLOCKS + 1) - 1), "block_size": 2}).blocks) \
        == MAX_BLOCKS


# -- routing a request in a caller's scope -----------------------------------------------------------

def control_with_two_engines() -> ControlPlane:
    engines = (EngineConfig(id="e1", url="http://127.0.0.1:9001", model="m"),
               EngineConfig(id="e2", url="http://127.0.0.1:9002/v1", model="m"))
    control = ControlPlane(Config(engines=engines), ScopeRegistry())
    control.apply("e2", Batch(0.0, (Stored((1, 2, 3), None, (), 16, None, "GPU"),), None, None))
    return control


def test_route_speaks_for_the_given_scope_and_can_take_a_lease():
    control = control_with_two_engines()
    scope = IdentityScope("default", "m")
    d = route(control, scope, control.scopes.tag(scope), RouteRequest.parse({"blocks": [1, 2, 3, 4],
                                                                               "acquire": "yes"}))
    assert (d.engine, d.url, d.cost, d.overlap_blocks) == ("e2", "http://127.0.0.1:9002/v1", 1.0, 3)
    assert d.lease is not None and control.engines.in_flight["e2"] == 1
    assert control.engines.release(d.lease)
    other = IdentityScope("t2", "m")  # another tenant: no credit for e2's blocks
    d = route(control, other, control.scopes.tag(other), RouteRequest.parse({"blocks": [1, 2, 3, 4]}))
    assert d.overlap_blocks == 0 and d.lease is None and {c.credit for c in d.candidates} == {0.0}
    nobody = IdentityScope("default", "no-such-model")
    d = route(control, nobody, control.scopes.tag(nobody), RouteRequest.parse({"blocks": [1]}))
    assert (d.engine, d.url, d.cost, d.candidates, d.plan) == (None, None, math.inf, [], [])


def test_the_index_imports_nothing_from_the_protocol_or_http_parts():
    root = Path(__file__).resolve().parents[2] / "quilld" / "index"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("quilld.protocol", "quilld.http")), (path.name, name)


# -- RESP's argument splitting -------------------------------------------------------------------------

def test_resp_arguments_as_json_or_key_value_pairs():
    assert route_fields([b"ROUTE", b' {"blocks": [1, 2], "acquire": true}']) == {"blocks": [1, 2], "acquire": True}
    assert route_fields([b"ROUTE", b"BLOCKS", b"1,2,ff", b"session", b"s", b"Tokens", b""]) == \
        {"blocks": ["1", "2", "ff"], "session": "s", "tokens": ""}
    assert route_fields([b"ROUTE"]) == {}
    with pytest.raises(CommandError, match="^ROUTE: invalid JSON: "):
        route_fields([b"ROUTE", b"{nope"])
    with pytest.raises(CommandError, match="^ROUTE takes a JSON object or key value pairs$"):
        route_fields([b"ROUTE", b"blocks"])
    with pytest.raises(CommandError, match="^ROUTE takes a JSON object or key value pairs$"):
        route_fields([b"ROUTE", b"[1, 2]"])
    assert RouteRequest.parse(route_fields([b"ROUTE", b"blocks", b"1,2", b"decode_tokens", b"32"])) == \
        RouteRequest([1, 2], 16, 32, None, False)


# -- one decision, three renderings ----------------------------------------------------------------------

DECISION = Decision(
    engine="e2", cost=1.5, url="http://127.0.0.1:9002", lease="lease-1",
    candidates=[Candidate("e1", 0, 0.0, 4.0, 1), Candidate("e2", 3, 2.5, 1.5, 0)],
    plan=[Step("hit", "e2", CacheTier.HBM), Step("hit", "e2", CacheTier.CPU), Step("fetch", "node-a", CacheTier.SSD),
          Step("recompute")])


def test_the_decision_knows_its_overlap_and_plan_tally():
    assert DECISION.overlap_blocks == 3 and DECISION.tally() == (2, 1, 1)
    assert Decision(None, math.inf, [], []).overlap_blocks == 0


def test_resp_rendering():
    assert decision_reply(DECISION) == {
        b"engine": b"e2", b"url": b"http://127.0.0.1:9002", b"cost": 1.5, b"lease": b"lease-1",
        b"plan": [b"hit:e2:hbm", b"hit:e2:cpu", b"fetch:node-a:ssd", b"recompute"],
        b"candidates": [
            {b"engine": b"e1", b"overlap_blocks": 0, b"credit": 0.0, b"cost": 4.0, b"in_flight": 1},
            {b"engine": b"e2", b"overlap_blocks": 3, b"credit": 2.5, b"cost": 1.5, b"in_flight": 0}]}
    none = decision_reply(Decision(None, math.inf, [], []))
    assert none == {b"engine": None, b"url": None, b"cost": None, b"lease": None, b"plan": [], b"candidates": []}
    no_lease = Decision("e1", 2.0, [Candidate("e1", 0, 0.0, 2.0, 0)], [Step("recompute")] * 2, "http://x")
    assert decision_reply(no_lease)[b"lease"] is None


def test_json_rendering():
    body = decision_json(DECISION)
    assert body == {
        "engine": "e2", "url": "http://127.0.0.1:9002", "cost": 1.5, "lease": "lease-1",
        "candidates": [{"engine": "e1", "overlap_blocks": 0, "credit": 0.0, "cost": 4.0, "in_flight": 1},
                       {"engine": "e2", "overlap_blocks": 3, "credit": 2.5, "cost": 1.5, "in_flight": 0}],
        "plan": [{"action": "hit", "holder": "e2", "tier": "hbm"}, {"action": "hit", "holder": "e2", "tier": "cpu"},
                 {"action": "fetch", "holder": "node-a", "tier": "ssd"},
                 {"action": "recompute", "holder": None, "tier": None}]}
    assert json.loads(json.dumps(body)) == body


def test_header_rendering():
    assert decision_headers(DECISION, "00ff00ff00000001") == {
        "x-quillcache-engine": "e2", "x-quillcache-overlap-blocks": "3", "x-quillcache-cost": "1.5",
        "x-quillcache-plan": "hits=2 fetches=1 recomputes=1", "x-quillcache-request-id": "00ff00ff00000001"}
    long = Decision("e1", 1234567.891, [Candidate("e1", 0, 0.0, 1234567.891, 9)], [Step("recompute")] * 10)
    headers = decision_headers(long, "r")
    assert headers["x-quillcache-cost"] == "1.23457e+06"
    assert headers["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=10"
    assert headers["x-quillcache-overlap-blocks"] == "0"


def test_engines_of_one_model_that_hash_differently_are_refused_by_name():
    engines = (EngineConfig(id="e1", url="http://127.0.0.1:9001", model="m", tokenizer="/tok",
                            prefix_caching_hash_algo="sha256"),
               EngineConfig(id="e2", url="http://127.0.0.1:9002", model="m", tokenizer="/tok",
                            prefix_caching_hash_algo="sha256_cbor"))
    control = ControlPlane(Config(engines=engines), ScopeRegistry())
    with pytest.raises(CommandError, match=r"hash their blocks in 2 ways \(e1: /tok sha256 block_size 16 tenant "
                                           r"default hash_seed unset lora_modules 0; e2: /tok sha256_cbor "
                                           r".*register them alike"):
        asyncio.run(engine_route(control, SCOPE, b"tag", RouteRequest.parse({"tokens": [1] * 16}), lambda: b"k"))
